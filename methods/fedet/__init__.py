"""FedET: Enhancer groups on a frozen transformer, entropy-aware server distillation
(Liu et al., IJCAI 2023), class-incremental text classification.

Modules: ``config`` (options), ``wire`` (the contract both halves use), ``strategy`` and
``server`` (the aggregator's half: trains on the server, torch), ``learner`` and ``client``
(the device: Algorithm 1), ``losses``, ``memory`` (the sample memory), ``baselines``
(finetune / replay / multi-task FedAvg on one Enhancer group, for the BBC benchmark).
"""

from fclcore.method import MethodSpec, register
from methods.fedet.config import FedETOptions

register(MethodSpec(
    name="fedet", package="fedet", options=FedETOptions, strategy="methods.fedet.strategy:FedETStrategy",
    learner="methods.fedet.learner:FedETLearner", metric="accuracy", served_format="text-groups",
    server_torch=True, needs_aux_data=True,
    summary="FedET: Enhancer groups on a frozen MiniLM, entropy-aware server distillation",
    example_scenario="configs/scenarios/bbc_fedet.yaml",
    smoke_overrides=("tasks.sizes=[2, 2]", "data.per_class=4", "data.test_per_class=3",
                     "federation.options.max_length=24", "federation.options.server_epochs=1",
                     "federation.options.aux_per_round=6", "federation.options.bottleneck=16")))
