"""The contract both halves of NGFL use: tensor names, shapes, the initial extractor and the
``ngfl`` metadata of rounds and updates (reading notes 3.4 G13).

* Down (the round message): the extractor (``extractor.<i>.weight|bias``), the head in the
  global table's row order (``head.weight`` (rows, d), ``head.bias``; absent while the table
  is empty) and ``meta.ngfl.table`` (``GlobalTable.to_meta``: labels, per row [round, by],
  version, pending).
* Up: the extractor, the uploaded head rows (``rows.weight``, ``rows.bias``: partial fusion
  sends the current classes' rows, total fusion every row) and ``meta.ngfl`` = ``{"table":
  UploadTable.to_meta, "announce": [...], "sa_fallback": n}``; a device with nothing to train
  sends ``{"skip": true, "announce": [...]}`` with no tensors (its skip notice).  The task
  history never leaves the device.  Labels are strings in JSON, never pickled.
* Compressed (the default, ``COMPRESSION``; ``fclcore.sparsify``): the extractor goes up as
  ``extractor.<i>.<part>@delta``, the top-k of its change from the announced extractor plus
  the device's residual, and the announcement moves the extractor by the top-k of the
  aggregator's residual; the head rows travel as above (partial fusion already sends only the
  trained rows).  ``federation.wire.sparsify`` / ``down_sparsify: none`` turn either side off.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from fclcore.sparsify import Compression

EXTRACTOR = "extractor."
HEAD_W, HEAD_B = "head.weight", "head.bias"  # the global head (down)
ROWS_W, ROWS_B = "rows.weight", "rows.bias"  # a device's uploaded rows (up)
META = "ngfl"
# the extractor's share of entries sent each way per round (measured: docs/ngfl.md, "Bytes")
COMPRESSION = Compression(up_density=0.05, down_density=0.05)


def extractor_shapes(input_dim: int, hidden: Sequence[int]) -> dict[str, tuple[int, ...]]:
    sizes = [input_dim, *hidden]
    shapes: dict[str, tuple[int, ...]] = {}
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        shapes[f"{EXTRACTOR}{i}.weight"] = (b, a)
        shapes[f"{EXTRACTOR}{i}.bias"] = (b,)
    return shapes


def initial_extractor(input_dim: int, hidden: Sequence[int], seed: int) -> dict[str, np.ndarray]:
    """``nn.Linear``'s default initialisation, U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weights
    and biases, drawn by NumPy from the federation seed (every device starts from this model)."""
    rng = np.random.default_rng((seed, 17))
    out = {}
    for name, shape in extractor_shapes(input_dim, hidden).items():
        fan_in = shape[1] if len(shape) == 2 else out[name.replace("bias", "weight")].shape[1]
        bound = 1.0 / math.sqrt(fan_in)
        out[name] = rng.uniform(-bound, bound, size=shape).astype(np.float32)
    return out
