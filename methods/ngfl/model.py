"""NGFL's network and losses (torch): a feature extractor and a class head that grows.

* ``Extractor``: an MLP (784-256-128, ReLU, notes G11) giving the d-dimensional features.
* ``GrowingHead``: a linear head whose rows follow the device's table.  ``reindex`` rebuilds it
  in a new row order (the mapping ``DeviceTable.adopt`` returns; a new row starts at zero, so
  copies on different devices average cleanly) and ``grow`` appends zero rows.
* ``total_attention``: cross-entropy over every output row the device may use (rows pending
  under pre-alignment and held by others are masked out, notes G9).
* ``self_attention``: cross-entropy over the current task's rows only, chosen by the table,
  not assumed to be the last rows (notes G8); a one-class task has nothing to separate, so it
  falls back to total attention (the caller counts it).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torch.nn import functional as F


class Extractor(nn.Module):
    def __init__(self, input_dim: int, hidden: Sequence[int] = (256, 128)) -> None:
        super().__init__()
        sizes = [input_dim, *hidden]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))
        self.dim = sizes[-1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.relu(layer(x))
        return x


class GrowingHead(nn.Module):
    def __init__(self, dim: int, rows: int = 0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(rows, dim))
        self.bias = nn.Parameter(torch.zeros(rows))

    @property
    def rows(self) -> int:
        return self.weight.shape[0]

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return F.linear(features, self.weight, self.bias)

    def reindex(self, mapping: Sequence[int | None]) -> None:
        """Row i becomes old row ``mapping[i]`` (None: a zero row)."""
        with torch.no_grad():
            w = torch.zeros(len(mapping), self.weight.shape[1], device=self.weight.device)
            b = torch.zeros(len(mapping), device=self.weight.device)
            for new, old in enumerate(mapping):
                if old is not None:
                    if not 0 <= old < self.rows:
                        raise ValueError(f"head: no row {old} to move (the head has {self.rows})")
                    w[new], b[new] = self.weight[old], self.bias[old]
        self.weight, self.bias = nn.Parameter(w), nn.Parameter(b)

    def grow(self, extra: int) -> None:
        self.reindex([*range(self.rows), *([None] * extra)])


def total_attention(logits: torch.Tensor, y: torch.Tensor, usable: torch.Tensor | None = None) -> torch.Tensor:
    """Cross-entropy over every usable row (``usable``: a bool mask over rows; None: all)."""
    if usable is not None:
        logits = logits.masked_fill(~usable, float("-inf"))
    return F.cross_entropy(logits, y)


def self_attention(logits: torch.Tensor, y: torch.Tensor, current_rows: Sequence[int]) -> torch.Tensor:
    """Cross-entropy over the current task's rows only; ``y`` holds head rows, all current."""
    device = logits.device
    rows = torch.as_tensor(list(current_rows), dtype=torch.long, device=device)
    position = torch.full((logits.shape[1],), -1, dtype=torch.long, device=device)
    position[rows] = torch.arange(len(rows), device=device)
    target = position[y]
    if (target < 0).any():
        raise ValueError("self_attention: a label outside the current task's rows")
    return F.cross_entropy(logits[:, rows], target)
