"""The dense FedAvg strategy a method may build on: the sample-weighted average of every MADE
tensor, folded update by update into the round's sums (``Strategy.streams``) and closed as
their mean.  A variant overrides one step, as FedAvgM overrides ``close`` with server momentum."""

from __future__ import annotations

from typing import Any

import numpy as np

from fclcore.aggregation import RunningSum, template_check
from fclcore.codec import Frame, Tensor
from fclcore.made_spec import init_params, param_shapes
from fclcore.schema import FederationSpec
from fclcore.strategy import Strategy, Update, without_tensors


class FedAvgStrategy(Strategy):
    """Sample-weighted averaging of every trainable MADE tensor; the FedAvg-family baselines
    differ only on the device (proximal term, EWC penalty, replay).  A weighted sum, so each
    update is folded into the round's sums as it arrives (``Strategy.streams``)."""

    streams = True
    partial_sums = True  # fold keeps nothing, close is the sums' mean: a site can pre-sum

    def __init__(self, fed: FederationSpec, options: Any, input_dim: int, aux_dir: str | None = None) -> None:
        super().__init__(fed, options, input_dim, aux_dir)
        self.made = fed.model.made_config(input_dim)
        self.shapes = param_shapes(self.made)

    @property
    def dense_fp32_bytes(self) -> int:
        return 4 * sum(int(np.prod(s)) for s in self.shapes.values())

    def initial_model(self) -> dict[str, np.ndarray]:
        return init_params(self.made, self.fed.seed)

    def normalize(self, frame: Frame) -> dict[str, Tensor]:
        return template_check(self.shapes)(frame)

    def fold(self, running: RunningSum, update: Update) -> Update:
        running.add(update.tensors, float(update.n_samples))
        return without_tensors(update)
