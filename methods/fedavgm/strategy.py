"""FedAvgM's server step: dense FedAvg's average, taken as a pseudo-gradient with momentum.

    v <- beta * v + (w - w_avg)        w <- w - server_lr * v

with ``w`` the global model, ``w_avg`` the round's sample-weighted average (``FedAvgStrategy``)
and ``v`` zero before the first round.  ``v`` is server state: it survives a restart
(``state`` / ``restore``).  The sums are still all a round needs, so updates stream and a
site may pre-sum them."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from fclbases.fedavg.strategy import FedAvgStrategy
from fclcore.aggregation import RunningSum
from fclcore.strategy import Update

_V = "velocity/"  # the checkpoint's array names: velocity/<tensor>


class FedAvgMStrategy(FedAvgStrategy):
    velocity: dict[str, np.ndarray] = {}  # v per tensor, float32; empty until the first round closes

    def close(self, running: RunningSum, kept: Sequence[Update], current: dict[str, np.ndarray]) -> dict:
        average = super().close(running, kept, current)
        beta, lr = np.float32(self.options.server_momentum), np.float32(self.options.server_lr)
        self.velocity = {k: beta * self.velocity.get(k, np.float32(0)) + (current[k] - average[k]) for k in average}
        return {k: current[k] - lr * self.velocity[k] for k in average}

    def state(self) -> tuple[dict, dict[str, np.ndarray]]:
        return {}, {_V + k: v for k, v in self.velocity.items()}

    def restore(self, meta: dict, arrays: dict[str, np.ndarray]) -> None:
        velocity = {k[len(_V) :]: np.asarray(v, np.float32) for k, v in arrays.items() if k.startswith(_V)}
        for name, v in velocity.items():
            if tuple(v.shape) != tuple(self.shapes.get(name, ())):
                raise ValueError(f"velocity/{name}: shape {v.shape} does not fit the model {self.shapes.get(name)}")
        self.velocity = velocity
