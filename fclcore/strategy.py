"""The server half of a learning method, as the aggregator service sees it.

The service runs the rounds; a ``Strategy`` says what a round carries and what it does:

* ``announce_meta`` and ``client_downlinks``: configure a round (the announcement's metadata,
  and frames for single clients, published before the announcement; ``full_downlinks``, what
  a client fetches instead when its frame refers to something it no longer holds);
* ``normalize``: validate one update once (names, shapes, the method's metadata) and return
  its full-shape tensors, or a ``Checked`` that also keeps the method's parsed view;
* ``aggregate``: accepted updates -> the next global model;
* ``streams`` / ``running_sum`` / ``fold`` / ``close``: a method whose server step is a
  weighted sum says so (``streams = True``); the service then folds each accepted update into a
  ``fclcore.aggregation.RunningSum`` as it arrives, keeps only what ``fold`` leaves of it
  (metadata, knowledge-base entries), and closes the round from the sums (O(model) memory
  and work however many devices reply).  Its ``aggregate`` is the same fold-then-close over
  a list, so both paths give one result;
* ``state`` / ``restore``: what a restarted service needs beyond the global model.

Everything here is NumPy; a strategy that trains on the server imports torch in its own
module and its spec says ``server_torch``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

import numpy as np

from fclcore.aggregation import RunningSum
from fclcore.codec import Frame, SparseTensor, Tensor
from fclcore.schedule import TaskSchedule
from fclcore.schema import FederationSpec


@dataclass(frozen=True)
class Update:
    """An accepted update: the frame as received and the strategy's checked view of it."""

    client: str
    frame: Frame
    n_samples: int
    packet_bytes: int
    payload_bytes: int
    tensors: Mapping[str, Tensor]  # as the strategy normalised them (full shapes)
    parsed: Any = None  # the strategy's own parse of the update's metadata, kept from ``normalize``


@dataclass(frozen=True)
class Checked:
    """What ``normalize`` may return instead of bare tensors: tensors plus a parsed view."""

    tensors: Mapping[str, Tensor]
    parsed: Any = None


class Rejected(ValueError):
    """What ``normalize`` raises to reject an update under a reason of its own (counted by
    that reason, e.g. ``"centres"``); a plain ValueError counts as ``"content"``."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


Downlinks = dict[str, tuple[dict, dict[str, Tensor]]]  # client -> (meta, tensors) of its own frame


class Strategy:
    min_samples = 1  # an update must report at least this many training samples
    # bytes of one dense float32 exchange of the whole model, frozen parts included, for a method
    # that trains only part of it (adapters on a frozen backbone): the full fine-tuning reference
    # of summary.json; None where the trained tensors are the whole model
    full_finetune_fp32_bytes: int | None = None

    def __init__(self, fed: FederationSpec, options: Any, input_dim: int, aux_dir: str | None = None) -> None:
        self.fed = fed
        self.options = options
        self.input_dim = input_dim
        self.schedule = TaskSchedule.from_federation(fed)

    @property
    def dense_fp32_bytes(self) -> int:
        """Bytes of one dense float32 upload of every trainable tensor (the FedAvg reference)."""
        return 4 * sum(int(np.prod(v.shape)) for v in self.initial_model().values())

    def initial_model(self) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def fits(self, params: dict[str, np.ndarray]) -> bool:
        """Whether a committed global model has this federation's names and shapes."""
        return {k: v.shape for k, v in params.items()} == {k: v.shape for k, v in self.initial_model().items()}

    def announce_meta(self, rnd: int) -> dict:
        """Extra metadata for the announcement of round ``rnd``."""
        return {}

    def client_downlinks(self, rnd: int, clients: Sequence[str]) -> Downlinks:
        """Per-client frames to publish (retained, on each client's own topic) before round
        ``rnd`` is announced; a device waits for its frame when the round says so."""
        return {}

    def full_downlinks(self, rnd: int, clients: Sequence[str]) -> Downlinks:
        """For the clients whose frame of ``client_downlinks`` leaves out what it expects them to
        hold: the frame that carries everything, published retained on the client's ``full``
        topic; a device that lacks something its frame refers to fetches it (``Learner.lacks``)."""
        return {}

    def downlink_log(self, meta: dict) -> dict:
        """What the run log records about a per-client frame with metadata ``meta``."""
        return {}

    def bytes_by_kind(self, tensors: Mapping[str, Tensor], meta: Mapping | None = None) -> dict[str, int]:
        """Decoded bytes of an accepted update's tensors as received by the method's kinds (e.g. base,
        adaptive, centres), for ``metrics.jsonl``; one kind, "model", unless a method says more
        (``meta``: the update's metadata, for a method whose metadata carries part of the model)."""
        return {"model": sum(tensor_nbytes(t) for t in tensors.values())}

    def normalize(self, frame: Frame) -> dict[str, Tensor] | Checked:
        raise NotImplementedError

    def aggregate(self, updates: Sequence[Update], current: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The next global model from a round's accepted updates (sorted by client).  A streaming
        strategy gets this for free: every update folded into a fresh sum, then ``close``."""
        if not self.streams:
            raise NotImplementedError
        running = self.running_sum(current)
        kept = [self.fold(running, u) for u in updates]
        return self.close(running, kept, current)

    # -- streaming (only for ``streams = True``) ---------------------------------------------
    streams = False  # True: the server step is a weighted sum that ``fold`` / ``close`` compute
    # True: a round's result depends on its updates only through the running sum (``fold`` keeps
    # no tensors, ``close`` reads nothing per update), so a site aggregator may pre-sum a share of
    # the devices and its parent merge that partial sum (aggregator.partial): a hierarchy.
    partial_sums = False

    def running_sum(self, current: Mapping[str, np.ndarray]) -> RunningSum:
        """An empty sum for a round over the global model ``current`` (what ``fold`` adds to)."""
        return RunningSum.over(current)

    def fold(self, running: RunningSum, update: Update) -> Update:
        """Add ``update``'s summed part to ``running`` (ValueError, with nothing added, if it does
        not fit) and return what the round keeps of it for ``close``.  Must not change the
        strategy's own state: that happens in ``close``, when the round commits."""
        raise NotImplementedError

    def close(self, running: RunningSum, kept: Sequence[Update], current: dict[str, np.ndarray]) -> dict:
        """The next global model from the round's sums and what ``fold`` kept (sorted by client)."""
        return running.result(current)

    def state(self) -> tuple[dict, dict[str, np.ndarray]]:
        """Server-side state beyond the global model, for the checkpoint: (JSON meta, arrays)."""
        return {}, {}

    def restore(self, meta: dict, arrays: dict[str, np.ndarray]) -> None:
        """Inverse of ``state``; ValueError if the checkpoint does not fit this strategy."""


def without_tensors(update: Update, keep: Mapping[str, Tensor] | None = None) -> Update:
    """``update`` with its decoded tensors dropped (all, or all but ``keep``): what a streaming
    round holds once the sums have them; header and metadata stay."""
    frame = Frame(update.frame.header, update.frame.meta, {})
    return replace(update, frame=frame, tensors=dict(keep or {}))


def tensor_nbytes(t: Tensor) -> int:
    """Bytes of a tensor's values (and indices, if sparse) as decoded."""
    if isinstance(t, SparseTensor):  # int64 indices (SparseTensor's dtype), not expanded to count them
        return int(t.values.nbytes + 8 * t.nnz)
    return int(np.asarray(t).nbytes)
