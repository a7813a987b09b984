"""FIL-VER: federated incremental learning with variational embedding rehearsal and
server-side training (arXiv 2110.09695), for fleets whose devices enroll late and retire.

Modules: ``config`` (options and the presets' defaults), ``wire`` (names, shapes, the
embedding part of an update), ``model`` (encoder, classifier, VER loss; torch), ``learner``
(the device), ``strategy`` (the aggregator: phase 0, the frozen encoder's downlink, the
rehearsal buffer; NumPy) and ``server_train`` (SST, the aggregator's only torch, lazy).

Presets (one package, defaults differ): ``filver`` (VER-Sampled+SST), ``filver-stats``
(VER-Stats+SST), ``filver-ebr`` (EBR+SST: a deterministic encoder), ``filver-nosst`` (device
rehearsal only), ``filver-vanilla`` (no rehearsal) and ``filver-offline`` (every task's data
from the start).  Domain-incremental: one shared head, the task id is never needed to serve.
"""

from fclcore.method import MethodSpec, register
from methods.filver import config

_SMOKE = (
    "federation.task_rounds=[2, 2]",
    "federation.options.phase0_rounds=1",
    "federation.options.hidden=32",
    "federation.options.latent=8",
    "federation.options.sst_steps=3",
    "tasks.domains.tasks=2",
    "data.per_class=4",
    "data.test_per_class=4",
)


def _spec(
    name: str, options: type, summary: str, learner: str = "FILVERLearner", value_dtype: str = "float32"
) -> MethodSpec:
    return MethodSpec(
        name=name,
        package="filver",
        options=options,
        strategy="methods.filver.strategy:FILVERStrategy",
        learner=f"methods.filver.learner:{learner}",
        metric="accuracy",
        headline="avg_accuracy",  # its results table: accuracy over every task after the last
        served_format="image-classifier",
        server_torch=True,
        summary=summary,
        example_scenario="configs/scenarios/mnist_filver.yaml",
        smoke_overrides=_SMOKE,
        value_dtype=value_dtype,
    )


register(
    _spec(
        "filver",
        config.FILVEROptions,
        "FIL-VER: sampled-z rehearsal on a frozen variational encoder + SST",
        value_dtype="int8",  # classifier top-k 20%, encoder whole: 13.9% of dense fp32, +0.4 points (docs/filver.md)
    ),
    _spec("filver-stats", config.StatsOptions, "FIL-VER with (mu, sigma) uploaded (the paper's Stats; not private)"),
    _spec("filver-ebr", config.EBROptions, "EBR: deterministic embedding rehearsal + SST"),
    _spec("filver-nosst", config.NoSSTOptions, "FIL-VER without SST: device rehearsal only"),
    _spec("filver-vanilla", config.VanillaOptions, "Vanilla FL on the frozen encoder: no rehearsal"),
    _spec(
        "filver-offline",
        config.OfflineOptions,
        "Offline reference: every task's data from the start",
        learner="FILVEROfflineLearner",
    ),
)
