"""Server-side halves of learning methods, registered under the scenario's ``method`` name.

A strategy owns the global model's initial value, how an update's tensors are validated
and expanded (``normalize``), how accepted updates become the next global model, and any
per-client downlink at a task start (the knowledge base).  Everything here is NumPy:
methods that need server-side training import torch lazily in their own module.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from aggregator.fedavg import weighted_average
from aggregator.inbox import Update, template_check
from fclcore.codec import Frame, Tensor
from fclcore.made_spec import MadeConfig, init_params, param_shapes
from fclcore.schema import FederationSpec

STRATEGIES: dict[str, type["Strategy"]] = {}


def register(*names: str) -> Callable[[type["Strategy"]], type["Strategy"]]:
    def wrap(cls: type[Strategy]) -> type[Strategy]:
        for name in names:
            STRATEGIES[name] = cls
        return cls
    return wrap


def make_strategy(fed: FederationSpec, made: MadeConfig, clients: Sequence[str],
                  aux_dir: str | None = None) -> "Strategy":
    """``aux_dir``: fedet's auxiliary texts (from the aggregator's own config)."""
    import aggregator.decomposed  # noqa: F401  (registers the decomposed methods)
    if fed.method == "fedet":
        import aggregator.fedet_strategy  # noqa: F401  (torch: only for this method)
        return STRATEGIES["fedet"](fed, made, list(clients), aux_dir=aux_dir)
    if fed.method not in STRATEGIES:
        raise ValueError(f"method: expected one of {sorted(STRATEGIES) + ['fedet']}, got {fed.method!r}")
    return STRATEGIES[fed.method](fed, made, list(clients))


class Strategy:
    uses_knowledge = False  # True: clients wait for a knowledge frame at each task start
    min_samples = 1  # an update must report at least this many training samples

    def __init__(self, fed: FederationSpec, made: MadeConfig, clients: list[str]) -> None:
        self.fed = fed
        self.made = made
        self.clients = clients
        self.shapes = param_shapes(made)

    @property
    def dense_fp32_bytes(self) -> int:
        """Bytes of one dense float32 upload of every trainable MADE tensor (the reference)."""
        return 4 * sum(int(np.prod(s)) for s in self.shapes.values())

    def initial_model(self) -> dict[str, np.ndarray]:
        return init_params(self.made, self.fed.seed)

    def fits(self, params: dict[str, np.ndarray]) -> bool:
        """Whether a committed global model has this federation's names and shapes."""
        return {k: v.shape for k, v in params.items()} == {k: v.shape for k, v in self.initial_model().items()}

    def announce_meta(self, rnd: int) -> dict:
        """Extra metadata for the announcement of round ``rnd``."""
        return {}

    def normalize(self, frame: Frame) -> dict[str, Tensor]:
        raise NotImplementedError

    def aggregate(self, updates: Sequence[Update], current: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def knowledge_for(self, task: int) -> dict[str, tuple[dict, dict[str, Tensor]]]:
        """Per client: (meta, tensors) of its knowledge frame for ``task``."""
        return {}

    def state(self) -> tuple[dict, dict[str, np.ndarray]]:
        """Server-side state beyond the global model, for the checkpoint: (JSON meta, arrays)."""
        return {}, {}

    def restore(self, meta: dict, arrays: dict[str, np.ndarray]) -> None:
        """Inverse of ``state``; ValueError if the checkpoint does not fit this strategy."""


@register("fedavg", "fedcl-finetune", "fedprox", "fedcurv", "fedcl-cumulative-replay", "offline")
class FedAvg(Strategy):
    """Sample-weighted averaging of every trainable MADE tensor; the baselines differ only on
    the device (proximal term, EWC penalty, replay)."""

    def normalize(self, frame: Frame) -> dict[str, Tensor]:
        return template_check(self.shapes)(frame)

    def aggregate(self, updates: Sequence[Update], current: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return weighted_average([(u.tensors, float(u.n_samples)) for u in updates], current)
