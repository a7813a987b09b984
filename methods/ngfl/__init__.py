"""NGFL: federated class-incremental learning with heterogeneous heads aligned by a
double-ended task alignment table (seed 004; reading notes section 3).

Modules: ``config`` (options and the presets' defaults), ``wire`` (names, shapes, the initial
extractor, the ``ngfl`` metadata), ``table`` (the device's and the aggregator's tables,
coverage, validation), ``fusion`` (label-aligned partial / total fusion, the literal Eq. 10),
``model`` (extractor, growing head, TA / SA losses; torch), ``learner`` (the device, on its
own task clock) and ``strategy`` (the aggregator; NumPy).

Presets (one package, defaults differ): ``ngfl`` (SA-PF), ``ngfl-ta-tf``, ``ngfl-ta-pf``,
``ngfl-sa-tf``, and the upper references ``ngfl-self`` (each device replays all its own past
data) and ``ngfl-global`` (a Self-sized sample of every device's earlier data; simulation only).
"""

from fclcore.method import MethodSpec, register
from methods.ngfl import config

_SMOKE = (
    "federation.task_rounds=[2, 2]",
    "federation.options.base_rounds=2",
    "federation.options.hidden=[32, 16]",
    "tasks.incremental.pools=[[2, 3]]",
    "data.per_class=20",
    "data.test_per_class=10",
)


def _spec(name: str, options: type, summary: str, fleet: bool = False) -> MethodSpec:
    return MethodSpec(
        name=name,
        package="ngfl",
        options=options,
        strategy="methods.ngfl.strategy:NGFLStrategy",
        learner="methods.ngfl.learner:NGFLLearner",
        metric="accuracy",
        headline="avg_accuracy",  # its results table: accuracy over every task after the last
        served_format="image-classifier",
        own_clock=True,
        fleet_data=fleet,
        summary=summary,
        example_scenario="configs/scenarios/mnist_ngfl.yaml",
        smoke_overrides=_SMOKE,
    )


register(
    _spec(
        "ngfl", config.NGFLOptions, "NGFL: task alignment tables, heads fused by class (SA-PF), per-device task clocks"
    ),
    _spec("ngfl-ta-tf", config.TATFOptions, "NGFL lower setting TA-TF: total attention, total fusion (plain FL)"),
    _spec("ngfl-ta-pf", config.TAPFOptions, "NGFL lower setting TA-PF: total attention, partial fusion"),
    _spec("ngfl-sa-tf", config.SATFOptions, "NGFL lower setting SA-TF: self-attention, total fusion"),
    _spec("ngfl-self", config.SelfOptions, "NGFL upper reference Self: each device replays its own past data"),
    _spec(
        "ngfl-global",
        config.GlobalOptions,
        "NGFL upper reference Global: replays a sample of every device's earlier data (simulation only)",
        fleet=True,
    ),
)
