"""FedET: Enhancer groups on a frozen transformer, entropy-aware server distillation
(Liu et al., IJCAI 2023), class-incremental text classification.

Modules: ``config`` (options), ``wire`` (the contract both halves use), ``strategy`` and
``server`` (the aggregator's half: trains on the server, torch), ``learner`` and ``client``
(the device: Algorithm 1), ``model`` (the pool of groups, the frozen-prefix cache, prototype
head rows), ``losses``, ``memory`` (the sample memory), ``baselines`` (the in-process building
blocks of the same baselines, used by the unit tests).  The backbone, the Enhancer groups and
the prototype selector are shared bases (``fclbases.minilm``): the text-groups export serves them.

Baselines, presets of this package: ``fedet-finetune`` and ``fedet-replay`` (one Enhancer
group averaged by FedAvg; ``GroupFedAvgStrategy`` + ``GroupFedAvgLearner`` /
``ReplayGroupLearner``); the multi-task upper bound is ``fedet-finetune`` on one task holding
every class (``tasks.sizes=[5]``); FedET with one group is ``fedet`` with ``num_groups: 1``.
"""

from fclcore.method import MethodSpec, register
from methods.fedet.config import FedETOptions

_SMOKE = (
    "tasks.sizes=[2, 2]",
    "data.per_class=4",
    "data.test_per_class=3",
    "federation.options.max_length=24",
    "federation.options.server_epochs=1",
    "federation.options.aux_per_round=6",
    "federation.options.bottleneck=16",
)


def _baseline(name: str, learner: str, summary: str) -> MethodSpec:
    """A FedAvg baseline of the FedET benchmark: one Enhancer group, no server distillation."""
    return MethodSpec(
        name=name,
        package="fedet",
        options=FedETOptions,
        strategy="methods.fedet.strategy:GroupFedAvgStrategy",
        learner=f"methods.fedet.learner:{learner}",
        metric="accuracy",
        served_format="text-groups",
        server_torch=True,
        summary=summary,
        example_scenario="configs/scenarios/bbc_fedet.yaml",
        smoke_overrides=_SMOKE,
    )


register(
    MethodSpec(
        name="fedet",
        package="fedet",
        options=FedETOptions,
        strategy="methods.fedet.strategy:FedETStrategy",
        learner="methods.fedet.learner:FedETLearner",
        metric="accuracy",
        served_format="text-groups",
        server_torch=True,
        needs_aux_data=True,
        value_dtype="int8",  # the Enhancers and head rows it exchanges (docs/wire.md "Value dtype per method")
        summary="FedET: Enhancer groups on a frozen MiniLM, entropy-aware server distillation",
        example_scenario="configs/scenarios/bbc_fedet.yaml",
        smoke_overrides=_SMOKE,
    ),
    _baseline("fedet-finetune", "GroupFedAvgLearner", "finetune-FL: FedAvg of one Enhancer group, classes so far"),
    _baseline("fedet-replay", "ReplayGroupLearner", "replay-FL: finetune-FL plus the sample memory"),
)
