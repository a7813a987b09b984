"""FedSeIT: Selective Inter-client Transfer for federated continual text classification
(Chaudhary et al., 2022), with FedWeIT on the same text CNN as its baseline.

Modules: ``config`` (options), ``wire`` (the contract both halves use), ``strategy`` (the
aggregator: masked FedAvg of the conv bases, the knowledge base, SIT's scoring; NumPy only),
``sit`` (k-means centres and their similarity), ``model`` and ``learner`` (the device).

Presets: ``fedseit`` (segregated foreign branches; ``sit: true`` turns on SIT with ``sit_k``
slots, ``dls: true`` federates W_f and W_c) and ``fedweit-cnn`` (FedWeIT: the foreign A's
summed into the filters).  Task-incremental: one head per task, the task id picks it.
"""

from fclcore.method import MethodSpec, register
from methods.fedseit.config import FedSeITOptions

_SMOKE = (
    "tasks.pool.tasks=[[0, 1], [1, 2], [0, 2], [2, 3], [1, 3], [0, 3]]",
    "tasks.pool.per_client=2",
    "data.per_class=6",
    "data.test_per_class=4",
    "federation.options.max_length=16",
    "federation.options.filters=8",
)


def _spec(name: str, learner: str, summary: str, value_dtype: str = "float32") -> MethodSpec:
    return MethodSpec(
        name=name,
        package="fedseit",
        options=FedSeITOptions,
        strategy="methods.fedseit.strategy:FedSeITStrategy",
        learner=f"methods.fedseit.learner:{learner}",
        metric="accuracy",
        headline="avg_accuracy",  # its results table: accuracy over every task after the last
        served_format="text-tasks",
        summary=summary,
        example_scenario="configs/scenarios/bbc_fedseit.yaml",
        smoke_overrides=_SMOKE,
        value_dtype=value_dtype,
    )


register(
    _spec(
        "fedseit",
        "FedSeITLearner",
        "FedSeIT: segregated foreign task-adaptive branches on a text CNN (+SIT, +DLS)",
        "int8",  # bbc_fedseit: 29.7% of dense fp32 both ways against 109%, no measurable accuracy cost (docs/wire.md)
    ),
    _spec("fedweit-cnn", "FedWeITCNNLearner", "FedWeIT on the text CNN: foreign A's summed into the filters"),
)
