"""The aggregator's half of the model downlink (``fclcore.model_sync``): the global model as
devices hold it, the delta each announcement carries, and the two retained sync frames.

``prepare`` turns the next global model into the tensors and ``ModelRef`` of its announcement:
a delta from the version before (positions derived where the method says so), or the full
model for the first announcement and after a restart.  The delta goes through the codec once
before it is announced (``roundtrip``) and the served model is built from what came out, so
the aggregator holds exactly what every device decodes, rounding of float16 or 8-bit values
included, and the announced hash is that model's.  The service takes ``served`` as its global
model from then on.

``sync_frames`` are what a device that cannot apply a delta fetches: the catch-up frame (the
entries changed over the last ``catchup_versions`` versions) and the full model, both coded
without loss (``lossless_dtype``).
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Mapping

import numpy as np

from fclcore.codec import SparseTensor, Tensor
from fclcore.model_sync import (
    VALUE_BYTES,
    ModelRef,
    apply,
    catchup,
    changes,
    delta,
    lossless_dtype,
    model_digest,
    model_hash,
)

Roundtrip = Callable[[dict[str, Tensor]], Mapping[str, Tensor]]  # tensors -> what a device decodes


class ModelDownlink:
    def __init__(
        self,
        value_dtype: str,
        positions: Callable[[int], Mapping[str, np.ndarray] | None],
        catchup_versions: int,
    ) -> None:
        """``positions(rnd)``: the positions round ``rnd``'s aggregation can change (or None)."""
        self.value_bytes = VALUE_BYTES.get(value_dtype, 4)
        self.positions = positions
        self.catchup_versions = catchup_versions
        self.version: int | None = None
        self.served: dict[str, np.ndarray] | None = None
        self.hash = ""
        self.digest: str | None = None  # the protocol 2 digest of ``served`` (``model_digest``)
        self.last: tuple[dict[str, Tensor], ModelRef] | None = None  # the latest announcement's content
        self.steps: deque[dict[str, np.ndarray]] = deque(maxlen=max(1, catchup_versions))  # changes per version

    def prepare(
        self, version: int, params: Mapping[str, np.ndarray], roundtrip: Roundtrip
    ) -> tuple[dict[str, Tensor], ModelRef]:
        """The tensors and ref that bring devices to ``version`` (the global model ``params``)."""
        if self.last is not None and version == self.version:
            return self.last  # the same round announced again
        follows = self.served is not None and self.version is not None and version == self.version + 1
        positions = self.positions(version - 1) if follows else None
        tensors, derived, removed = delta(self.served if follows else None, params, positions, self.value_bytes)
        sent = dict(roundtrip(tensors))
        # the codec codes a SparseTensor dense, zeros filled, when that is smaller: such a change is
        # sent as the whole tensor (a delta's dense tensor replaces; its zeros would be taken as values)
        densified = [
            k for k, t in tensors.items() if isinstance(t, SparseTensor) and not isinstance(sent[k], SparseTensor)
        ]
        if densified:
            tensors.update({k: np.asarray(params[k], dtype=np.float32) for k in densified})
            sent = dict(roundtrip(tensors))
        ref = ModelRef(version, self.version if follows else None, "", derived, removed)
        served = apply(self.served, ref, sent, positions)
        step = changes(self.served, served) if follows else None
        if step is None:
            self.steps.clear()
        else:
            self.steps.append(step)
        self.version, self.served, self.hash = version, served, model_hash(served)
        self.digest = model_digest(served)
        ref = ModelRef(version, ref.base, self.hash, derived, removed, self.digest)
        self.last = (tensors, ref)  # encoded again exactly as in the round trip: devices decode ``sent``
        return self.last

    def sync_frames(self) -> dict[str, tuple[dict[str, Tensor], ModelRef, str]]:
        """name -> (tensors, ref, value dtype) of the retained sync frames for the current version:
        ``full`` always, ``catchup`` when the last versions are known (from two steps back)."""
        if self.served is None or self.version is None:
            return {}
        out = {
            "full": (
                self.served,
                ModelRef(self.version, None, self.hash, digest=self.digest),
                lossless_dtype(self.served),
            )
        }
        steps = list(self.steps)[-self.catchup_versions :] if self.catchup_versions else []
        if len(steps) >= 2:
            tensors = catchup(steps, self.served, 4)
            ref = ModelRef(self.version, self.version - len(steps), self.hash, digest=self.digest)
            out["catchup"] = (tensors, ref, lossless_dtype(tensors))
        return out
