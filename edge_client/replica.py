"""The device's copy of the global model, kept in step by the downlink's deltas (``fclcore.model_sync``).

``take`` turns a frame that carries the model (a round announcement, the end of the run, or
a sync frame) into the whole model at its version, or says which sync frame the device must
fetch: ``catchup`` when it holds an earlier version, ``full`` when it holds none (it just
joined or restarted), when the catch-up cannot bridge the gap, or when a delta did not
produce the announced hash (a forged or corrupted frame: counted, and never kept).
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Mapping

import numpy as np

from fclcore.codec import Frame, Tensor
from fclcore.model_sync import ModelRef, apply

FULL, CATCHUP = "full", "catchup"


class ModelReplica:
    def __init__(self, positions: Callable[[int], Mapping[str, np.ndarray] | None]) -> None:
        """``positions(rnd)``: the positions round ``rnd``'s aggregation can change (derived deltas)."""
        self.positions = positions
        self.version: int | None = None
        self.params: dict[str, np.ndarray] | None = None
        self.hash = ""
        # over the device's life: "full" / "catchup" syncs, "hash_mismatch", "bad_delta", and the
        # "bytes" of the sync frames received (its updates report them, its wire.json keeps them)
        self.totals: Counter[str] = Counter()

    def take(self, frame: Frame) -> dict[str, Tensor] | str:
        """The model after ``frame`` (its tensors as they are when it carries no ``meta.model``),
        or the name of the sync frame to fetch.  ValueError when ``meta.model`` is malformed."""
        ref = ModelRef.of(frame.meta)
        if ref is None:
            return frame.tensors
        if ref.version == self.version and ref.hash == self.hash:
            return self.params
        if not ref.applies_to(self.version):
            return CATCHUP if self.version is not None and ref.version > self.version else FULL
        try:
            positions = self.positions(ref.version - 1) if ref.derived else None
            params = apply(self.params, ref, frame.tensors, positions)
        except ValueError:
            self._note("bad_delta")
            return FULL
        if not ref.matches(params):
            self._note("hash_mismatch")
            return FULL
        self.version, self.params, self.hash = ref.version, params, ref.hash
        return params

    def sync(self, frame: Frame, wanted: str, size: int) -> str | None:
        """Apply a sync frame fetched as ``wanted``: None once the replica moved to its version,
        else the sync frame to fetch now (``full`` when a catch-up does not fit)."""
        self._note("bytes", size)
        ref = ModelRef.of(frame.meta)
        if ref is None:
            raise ValueError("model: a sync frame without meta.model")
        if self.version is not None and ref.version <= self.version:
            return FULL  # stale: the full model is published with every version
        got = self.take(frame)
        if isinstance(got, str):
            return FULL
        self._note(wanted)
        return None

    def report(self) -> dict[str, int]:
        """What the device tells the aggregator with each update: its totals so far (cumulative,
        so a report in an update that arrives too late is not lost: the next one carries it)."""
        return dict(self.totals)

    def _note(self, what: str, n: int = 1) -> None:
        self.totals[what] += n
