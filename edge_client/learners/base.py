"""What a learning method does on the device, independent of MQTT."""

from __future__ import annotations

from typing import Callable, Sequence

from fclcore.codec import Tensor
from fclcore.data import Dataset
from fclcore.made_spec import MadeConfig
from fclcore.schema import FederationSpec

LEARNERS: dict[str, type["Learner"]] = {}


def register(name: str) -> Callable[[type["Learner"]], type["Learner"]]:
    def wrap(cls: type[Learner]) -> type[Learner]:
        LEARNERS[name] = cls
        return cls
    return wrap


def make_learner(fed: FederationSpec, made: MadeConfig, client_index: int) -> "Learner":
    if fed.method not in LEARNERS:
        raise ValueError(f"method: expected one of {sorted(LEARNERS)}, got {fed.method!r}")
    return LEARNERS[fed.method](fed, made, client_index)


class Learner:
    """One client's model and optimiser state across rounds and tasks."""

    def __init__(self, fed: FederationSpec, made: MadeConfig, client_index: int) -> None:
        self.fed = fed
        self.made = made
        self.client_index = client_index

    def load_global(self, tensors: dict[str, Tensor]) -> None:
        """Merge the aggregator's model; ValueError if names or shapes do not fit."""
        raise NotImplementedError

    def start_task(self, task: int) -> None:
        """Called once before the first round of each task."""

    def train_round(self, data: Dataset, rnd: int) -> tuple[int, float]:
        """Local training for round ``rnd``; returns (samples used, mean train NLL)."""
        raise NotImplementedError

    def upload(self) -> dict[str, Tensor]:
        """The tensors to send for this round."""
        raise NotImplementedError

    def evaluate(self, tests: Sequence[Dataset]) -> list[float]:
        """Mean test NLL (nats per sample) of the served model on each dataset."""
        raise NotImplementedError
