"""Compression of dense updates as a wire stage: top-k sparsification with error feedback,
both ways (``federation.wire``: ``sparsify`` / ``density`` up, ``down_sparsify`` /
``down_density`` down, ``error_feedback``; docs/wire.md "Compression").

Why: a dense tensor that every round changes everywhere (an extractor, FedAvg's model) costs
its whole size each way however little it moved.  Sending only the largest changes and keeping
the rest for later (Lin et al. 2018, Deep Gradient Compression; Sattler et al. 2019, sparse
ternary compression both ways) loses nothing for good: what was not sent is added to the next
round's change, so over rounds the sum of what was sent plus what is held back equals the sum
of the changes.

* **Up** (``Residuals``, on the device): the device holds the global model the aggregator
  announced; its change is ``c = (w_local - w_global) + r``; it sends the top-k of ``c`` as a
  sparse tensor named ``<name>@delta`` (values in the federation's value dtype), and keeps
  ``r = c - sent``, with ``sent`` exactly what the aggregator decodes (float16 or 8-bit
  rounding included: ``Residuals.sent``).  The residuals are learner state: in the checkpoint.
* **Down** (``TrueModel``, on the aggregator): the aggregator adds the mean of the round's
  deltas to the model they sum to (``W``), but announces only a top-k move of the model devices
  hold (``A``) towards it; ``W - A`` is its residual, sent when it has grown among the largest.
  Devices still hold exactly what was announced (``fclcore.model_sync``: the announcement is a
  sparse delta and its hash verifies); ``W`` is strategy state, in the aggregator's checkpoint.

A method chooses which tensors go through the stage (``Compression.of`` with its own defaults),
and may give a kind of tensor a density of its own (``compress`` / ``step``'s ``density``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional

import numpy as np

from fclcore.codec import SparseTensor, Tensor
from fclcore.schema import WireSpec
from fclcore.strategy import Rejected

DELTA = "@delta"  # suffix of an uploaded tensor that is a change from the model the device holds
REJECT = "compression"  # the counted reason of an update whose compressed tensors break the stage's rules


@dataclass(frozen=True)
class Compression:
    """The stage's settings as resolved for one federation: a density None is off."""

    up_density: Optional[float] = None  # share of a tensor's entries a device sends (top-k)
    down_density: Optional[float] = None  # share of a tensor's entries an announcement changes
    error_feedback: bool = True

    @classmethod
    def of(cls, wire: WireSpec, default: Compression) -> Compression:
        """The scenario's settings where it gave them, the method's ``default`` elsewhere."""
        up = _side(wire.sparsify, wire.density, default.up_density, "density")
        down = _side(wire.down_sparsify, wire.down_density, default.down_density, "down_density")
        return cls(up, down, wire.error_feedback)


OFF = Compression()


def _side(mode: str | None, density: float | None, default: float | None, key: str) -> float | None:
    if mode == "none" or (mode is None and default is None):
        return None
    if density is None and default is None:
        raise ValueError(f"federation.wire.{key}: top-k needs a density (the method sets none)")
    return density if density is not None else default


def kept_count(numel: int, density: float) -> int:
    """Entries of a tensor of ``numel`` that top-k keeps: ceil(density x numel), at least 1."""
    return min(numel, max(1, math.ceil(density * numel)))


def top_k(values: np.ndarray, k: int) -> np.ndarray:
    """Flat indices, increasing, of the ``k`` entries of largest magnitude (non-zero ones only;
    among equal magnitudes the lower index first, so the choice is a function of the values)."""
    flat = np.abs(np.asarray(values).reshape(-1))
    k = min(k, int(np.count_nonzero(flat)))
    if k <= 0:
        return np.zeros(0, np.int64)
    if k == flat.size:
        return np.arange(flat.size, dtype=np.int64)
    threshold = np.partition(flat, flat.size - k)[flat.size - k]
    above = np.flatnonzero(flat > threshold)
    ties = np.flatnonzero(flat == threshold)[: k - above.size]
    return np.union1d(above, ties).astype(np.int64)


class Residuals:
    """The device's half: per tensor, what its uploads have not sent yet.

    ``compress`` picks what to send and keeps the rest, as if the values arrived exactly;
    ``sent`` then adds what coding lost (the daemon hands it the update as the aggregator
    decodes it), so ``r = c - sent`` holds to the bit of float32."""

    def __init__(self, density: float, error_feedback: bool = True) -> None:
        self.density, self.error_feedback = density, error_feedback
        self.residuals: dict[str, np.ndarray] = {}
        self._pending: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # name -> (indices, values before coding)

    def compress(self, name: str, change: np.ndarray, density: float | None = None) -> SparseTensor:
        """The top-k of ``change`` plus this tensor's residual, as a sparse tensor of its shape
        (``density``: this tensor's share where the method sets one, else the stage's)."""
        c = np.array(change, dtype=np.float32)  # a copy: it becomes the residual
        held = self.residuals.get(name)
        if held is not None and held.shape == c.shape and self.error_feedback:
            c += held
        index = top_k(c, kept_count(c.size, self.density if density is None else density))
        flat = c.reshape(-1)
        values = flat[index].copy()
        flat[index] = 0.0
        self.residuals[name] = c if self.error_feedback else np.zeros_like(c)
        self._pending[name] = (index, values)
        return SparseTensor(c.shape, index, values)

    def sent(self, tensors: Mapping[str, Tensor]) -> None:
        """Account for what the aggregator decodes of the last ``compress`` of each tensor
        (``tensors`` keyed as uploaded, ``<name>@delta``): the coding error joins the residual."""
        for name, (index, values) in self._pending.items():
            got = tensors.get(name + DELTA)
            if got is None:
                raise ValueError(f"{name + DELTA}: compressed but not in the update")
            decoded = got.to_dense().reshape(-1) if isinstance(got, SparseTensor) else np.asarray(got).reshape(-1)
            if self.error_feedback:
                self.residuals[name].reshape(-1)[index] += values - decoded[index]
        self._pending.clear()

    def state(self, prefix: str) -> dict[str, np.ndarray]:
        return {prefix + name: r for name, r in self.residuals.items()}

    def load_state(self, arrays: Mapping[str, np.ndarray], prefix: str, shapes: Mapping[str, tuple]) -> None:
        """Residuals from a checkpoint (those ``state`` wrote); ValueError if one does not fit."""
        self.residuals, self._pending = {}, {}
        for key, value in arrays.items():
            if not key.startswith(prefix):
                continue
            name = key[len(prefix) :]
            if name not in shapes or tuple(value.shape) != tuple(shapes[name]):
                raise ValueError(f"checkpoint: residual {name!r} does not fit the model")
            self.residuals[name] = np.array(value, dtype=np.float32)


def checked_delta(name: str, tensor: Tensor, shape: tuple[int, ...], density: float) -> Tensor:
    """An uploaded ``<name>@delta`` as the stage allows it: the tensor's shape and at most
    ``kept_count`` entries (the codec has already refused bad indices, counts and values);
    ``Rejected`` with reason ``compression`` otherwise."""
    got = tensor.shape if isinstance(tensor, SparseTensor) else np.shape(tensor)
    if tuple(got) != tuple(shape):
        raise Rejected(REJECT, f"{name}{DELTA}: shape {tuple(got)}, expected {tuple(shape)}")
    sent = tensor.nnz if isinstance(tensor, SparseTensor) else int(np.count_nonzero(tensor))
    bound = kept_count(math.prod(shape), density)
    if sent > bound:
        raise Rejected(REJECT, f"{name}{DELTA}: {sent} entries, at most {bound} (density {density})")
    return tensor


def move_towards(target: np.ndarray, held: np.ndarray, density: float | None) -> np.ndarray:
    """``held`` with its top-k entries of ``|target - held|`` set to ``target``'s (all of them
    when ``density`` is None): the model to announce, a sparse change from what devices hold."""
    target = np.asarray(target, np.float32)
    if density is None:
        return target.copy()
    out = np.array(held, dtype=np.float32)
    index = top_k(target - out, kept_count(out.size, density))
    out.reshape(-1)[index] = target.reshape(-1)[index]
    return out


class TrueModel:
    """The aggregator's half: per tensor, the model the accepted deltas add up to (``W``), of
    which devices hold the announced version (``A``, the service's global model); ``W - A`` is
    the aggregator's residual.  Without error feedback ``W`` follows ``A``."""

    def __init__(self, down_density: float | None, error_feedback: bool = True) -> None:
        self.down_density, self.error_feedback = down_density, error_feedback
        self.values: dict[str, np.ndarray] = {}

    def step(self, name: str, held: np.ndarray, change: np.ndarray | None, density: float | None = None) -> np.ndarray:
        """``W += change`` (None: no change this round); returns the model to announce
        (``density``: this tensor's share where the method sets one, else the stage's)."""
        true = self.values.get(name)
        if true is None or true.shape != held.shape:
            true = np.array(held, dtype=np.float32)  # first round: devices hold W
        if change is not None:
            true = (true.astype(np.float64) + change).astype(np.float32)
        announced = move_towards(true, held, self.down_density if density is None else density)
        self.values[name] = true if self.error_feedback else announced
        return announced

    def state(self, prefix: str) -> dict[str, np.ndarray]:
        return {prefix + name: w for name, w in self.values.items()}

    def restore(self, arrays: Mapping[str, np.ndarray], prefix: str, shapes: Mapping[str, tuple]) -> None:
        self.values = {}
        for key, value in arrays.items():
            if key.startswith(prefix):
                name = key[len(prefix) :]
                if name not in shapes or tuple(value.shape) != tuple(shapes[name]):
                    raise ValueError(f"checkpoint: true model tensor {name!r} does not fit the model")
                self.values[name] = np.array(value, dtype=np.float32)


def mean_change(sums: np.ndarray, count: float, shape: tuple[int, ...]) -> np.ndarray:
    """The mean of ``count`` deltas from their summed values (an entry a device did not send
    counts as its zero): what ``TrueModel.step`` adds."""
    return (sums / max(count, 1.0)).reshape(shape)
