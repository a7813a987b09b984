"""FedAvgM: FedAvg with server momentum (Hsu et al. 2019, "Measuring the effects of non-identical
data distribution for federated visual classification").  The devices are dense FedAvg's
(``fclbases.fedavg.learner``); the server keeps a momentum of the round's pseudo-gradient
(``strategy``); ``config`` holds its two options.  A variant of a shared base, so the package
is a subclass and its options."""

from fclcore.method import MethodSpec, register
from methods.fedavgm.config import FedAvgMOptions

register(
    MethodSpec(
        name="fedavgm",
        package="fedavgm",
        options=FedAvgMOptions,
        strategy="methods.fedavgm.strategy:FedAvgMStrategy",
        learner="fclbases.fedavg.learner:FedAvgLearner",
        summary="FedAvg of a plain MADE with server momentum (FedAvgM)",
        example_scenario="methods/fedavgm/scenario.yaml",
        smoke_overrides=("federation.model.hidden_sizes=[32]", "tasks.shared=[[0, 1], [2, 3]]"),
    )
)
