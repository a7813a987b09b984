"""Partial sums between aggregators: what a site forwards to its parent, and how the parent takes it.

A site aggregator folds its devices' updates into a ``RunningSum`` and sends its parent ONE
UPDATE frame on its own update topic (``fcl/<fed>/update/<site>``), signed with the site's key
like any device update.  Per tensor ``t`` of the round's sum the frame carries::

    mean:t  mean.lo:t      the per-element weighted mean where the site had weight, as a
                           float32 pair (high part, then the float32 rounding of the rest):
                           together about 48 significant bits, so the root's merge matches a
                           flat fold to float32 rounding
    weight:t weight.lo:t   the per-element weight sum, as the same kind of pair

each a ``SparseTensor`` over the elements some device sent (dense when every element had
weight; the codec may also send a dense-enough one dense, with weight 0 where nobody sent), so
the frame costs about four times the union of the devices' sparsity.  The mean, not the
sum, travels because it stays in the model's range where a sum of sample-weighted values may
not fit float32.  ``meta``: ``n_samples`` (the site's devices' total, for the logs) and
``partial`` ({"updates": how many device updates the sum holds}).

Only a strategy with ``partial_sums`` (its round result depends on the updates only through the
sum) can run under a hierarchy; every other one is refused at start (``check_hierarchy``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Collection, Mapping

import numpy as np

from fclcore.aggregation import MAX_WEIGHT, RunningSum
from fclcore.codec import Frame, SparseTensor, Tensor
from fclcore.errors import ConfigError
from fclcore.strategy import Checked, Strategy, Update, without_tensors

PARTS = ("mean:", "mean.lo:", "weight:", "weight.lo:")
MAX_UPDATES = 2**31 - 1


def check_hierarchy(strategy: Strategy | type[Strategy], method: str) -> None:
    """ConfigError unless ``method``'s server step is a sum a site can pre-compute (a strategy
    or its class: both say so in class attributes)."""
    if not (strategy.streams and strategy.partial_sums):
        raise ConfigError(
            f"method {method!r} cannot run under a hierarchy of aggregators: its server step is not "
            f"a weighted sum of the updates alone; run it with one aggregator (no sites)"
        )


def encode_partial(running: RunningSum) -> tuple[dict, dict[str, Tensor]]:
    """(meta, tensors) of the partial-sum frame for ``running`` (at least one update folded)."""
    if running.count == 0:
        raise ValueError("encode_partial: expected a sum with at least one folded update")
    tensors: dict[str, Tensor] = {}
    for name, shape in running.shapes.items():
        weight = running.weights(name)
        sent = np.flatnonzero(weight > 0)
        mean = running.sums[name][sent] / weight[sent]
        for prefix, values in (("mean", mean), ("weight", weight[sent])):
            high = values.astype(np.float32)
            low = (values - high.astype(np.float64)).astype(np.float32)
            for part, vals in ((f"{prefix}:", high), (f"{prefix}.lo:", low)):
                dense = sent.size == weight.size
                tensors[part + name] = vals.reshape(shape) if dense else SparseTensor(shape, sent, vals)
    samples = max(1, min(int(round(running.total_weight)), 2**31 - 1))  # the devices' total, for the logs
    return {"n_samples": samples, "partial": {"updates": running.count}}, tensors


def decode_partial(frame: Frame, shapes: Mapping[str, tuple[int, ...]]) -> RunningSum:
    """The ``RunningSum`` a partial-sum frame carries; ValueError saying what is wrong."""
    expected = {part + name for name in shapes for part in PARTS}
    if set(frame.tensors) != expected:
        missing, extra = sorted(expected - set(frame.tensors)), sorted(set(frame.tensors) - expected)
        raise ValueError(f"partial sum tensors: missing {missing[:4]}, unexpected {extra[:4]}")
    info = frame.meta.get("partial")
    updates = info.get("updates") if isinstance(info, dict) else None
    if not isinstance(updates, int) or isinstance(updates, bool) or not 1 <= updates <= MAX_UPDATES:
        raise ValueError(f"meta.partial.updates: expected an integer in [1, {MAX_UPDATES}], got {updates!r}")
    running = RunningSum(shapes)
    for name in shapes:
        size = running.sums[name].size
        mean = _flat(frame.tensors[f"mean:{name}"], size) + _flat(frame.tensors[f"mean.lo:{name}"], size)
        weight = _flat(frame.tensors[f"weight:{name}"], size) + _flat(frame.tensors[f"weight.lo:{name}"], size)
        if not (weight >= 0).all() or weight.max(initial=0.0) > MAX_WEIGHT * updates:
            raise ValueError(f"partial sum {name}: expected weights in [0, {updates} x 2**53]")
        sent = weight > 0  # the codec may send a dense-enough sparse tensor dense, with zeros elsewhere
        running.sums[name][sent] = mean[sent] * weight[sent]
        running.sparse_weight[name] = np.where(sent, weight, 0.0)
    running.count = updates
    running.total_weight = float(frame.meta["n_samples"])
    return running


def _flat(tensor: Tensor, size: int) -> np.ndarray:
    """A tensor's values as a flat float64 array over all ``size`` elements (0 where a sparse one is not)."""
    if isinstance(tensor, SparseTensor):
        out = np.zeros(size, np.float64)
        out[tensor.indices] = tensor.values
        return out
    return np.ravel(tensor).astype(np.float64)


class Sites:
    """The root's view of the site aggregators among its senders: their frames are partial sums."""

    def __init__(self, ids: Collection[str], strategy: Strategy, method: str) -> None:
        self.ids = frozenset(ids)
        if self.ids:
            check_hierarchy(strategy, method)
            self.shapes = strategy.running_sum(strategy.initial_model()).shapes

    def __contains__(self, client: object) -> bool:
        return client in self.ids

    def normalizer(self, normalize: Callable[[Frame], object]) -> Callable[[Frame], object]:
        """The strategy's ``normalize`` for devices; a site's frame is parsed as a partial sum
        (its checked tensors are the site's means, so ``max_update_norm`` applies to them)."""
        if not self.ids:
            return normalize

        def check(frame: Frame) -> object:
            if frame.header.client not in self.ids:
                return normalize(frame)
            running = decode_partial(frame, self.shapes)
            means = {name[len("mean:") :]: t for name, t in frame.tensors.items() if name.startswith("mean:")}
            return Checked(means, running)

        return check

    def fold(self, strategy: Strategy, running: RunningSum, update: Update) -> Update:
        """A site's partial sum is merged into the round's sum; a device's update is folded."""
        if update.client not in self.ids:
            return strategy.fold(running, update)
        running.merge(update.parsed)
        return replace(without_tensors(update), parsed=None)  # the round keeps O(model) however many sites
