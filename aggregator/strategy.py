"""Server-side halves of learning methods, registered under the scenario's ``method`` name.

A strategy owns the global model's initial value and how accepted updates become the next
global model.  Everything here is NumPy: methods that need server-side training import
torch lazily in their own module.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from aggregator.fedavg import weighted_average
from aggregator.inbox import Update
from fclcore.made_spec import MadeConfig, init_params, param_shapes

STRATEGIES: dict[str, type["Strategy"]] = {}


def register(name: str) -> Callable[[type["Strategy"]], type["Strategy"]]:
    def wrap(cls: type[Strategy]) -> type[Strategy]:
        STRATEGIES[name] = cls
        return cls
    return wrap


def make_strategy(method: str, made: MadeConfig, seed: int) -> "Strategy":
    if method not in STRATEGIES:
        raise ValueError(f"method: expected one of {sorted(STRATEGIES)}, got {method!r}")
    return STRATEGIES[method](made, seed)


class Strategy:
    def __init__(self, made: MadeConfig, seed: int) -> None:
        self.made = made
        self.seed = seed

    def template(self) -> dict[str, tuple[int, ...]]:
        """Names and shapes of the tensors a client uploads."""
        return param_shapes(self.made)

    def initial_model(self) -> dict[str, np.ndarray]:
        return init_params(self.made, self.seed)

    def aggregate(self, updates: Sequence[Update], current: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise NotImplementedError


@register("fedavg")
class FedAvg(Strategy):
    """FedMADE: sample-weighted averaging of every trainable MADE tensor."""

    def aggregate(self, updates: Sequence[Update], current: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return weighted_average([(u.frame.tensors, float(u.n_samples)) for u in updates], current)
