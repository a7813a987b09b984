"""The contract both halves of FIL-VER use: tensor names and shapes, the initial model,
and the embedding part of an update.

Phase 0 (rounds ``< phase0_rounds``): the global model and every update hold the encoder
(``enc.*``) and the classifier (``cls.*``).  Then the encoder is frozen: it goes down once
per device in a frame of its own, and rounds carry the classifier only.  An update after
phase 0 may add a device's rehearsal items: ``emb:y`` (labels, integer values) with
``emb:z`` (sampled z, or EBR's deterministic embedding) or ``emb:mu`` + ``emb:log_sigma``
(Stats), one row per item; its metadata says ``{"filver": {"task": t, "form": ...}}``.

Compressed (the default, ``COMPRESSION``; ``fclcore.sparsify``): the trained tensors (encoder
and classifier in phase 0, the classifier after) go up as ``<name>@delta``, the top-k of their
change from the announced model plus the device's residual, and each announcement moves them
by the top-k of the aggregator's residual (its true model, SST included).  The classifier's
top-k is the stage's density; the encoder's, in phase 0, is ``encoder_density`` (``density``
below: by default its whole change, in the value dtype, with the coding error fed back).  The
frozen encoder goes down once, whole, as the aggregator's true encoder.  Embeddings travel in
the federation's value dtype.  ``federation.wire.sparsify`` / ``down_sparsify: none`` turn
either side off.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from fclcore.sparsify import Compression
from methods.filver.config import FILVEROptions

ENC, CLS = "enc.", "cls."
EMB_Y, EMB_Z, EMB_MU, EMB_LOG_SIGMA = "emb:y", "emb:z", "emb:mu", "emb:log_sigma"
FORM_TENSORS = {"z": (EMB_Z,), "stats": (EMB_MU, EMB_LOG_SIGMA)}  # the upload form -> its value tensors
# the classifier's share of entries sent each way per round; phase 0's encoder goes at
# ``encoder_density`` (``density``), whole by default (measured: docs/filver.md, "Bytes")
COMPRESSION = Compression(up_density=0.2, down_density=0.2)


def density(name: str, stage: float | None, o: FILVEROptions) -> float | None:
    """The top-k share of tensor ``name`` on a side whose stage runs at ``stage`` (None: off).

    The encoder (phase 0 only) goes at ``encoder_density``, whole by default: its top-k at 20%
    let the cross-entropy's large changes through and held back the KL term's small ones, and
    the frozen encoder's embeddings were re-identified five times as often (docs/filver.md)."""
    if stage is None:
        return None
    return o.encoder_density if name.startswith(ENC) else stage


def image_side(input_dim: int) -> int:
    """Images arrive flattened: the side of a square one-channel image of ``input_dim`` pixels."""
    side = math.isqrt(input_dim)
    if side * side != input_dim:
        raise ValueError(f"filver: expected square one-channel images, got input_dim {input_dim}")
    return side


def conv_out(side: int, padding: int) -> int:
    """Side after [conv 5x5 (padding), maxpool 2] x 2; ValueError if the image is too small."""
    for _ in range(2):
        side = (side + 2 * padding - 4) // 2
        if side < 1:
            raise ValueError("filver: the image is too small for two 5x5 conv + pool stages (try padding: 2)")
    return side


def encoder_shapes(o: FILVEROptions, input_dim: int) -> dict[str, tuple[int, ...]]:
    c1, c2 = o.channels
    flat = c2 * conv_out(image_side(input_dim), o.padding) ** 2
    shapes = {
        "enc.conv1.weight": (c1, 1, 5, 5),
        "enc.conv1.bias": (c1,),
        "enc.conv2.weight": (c2, c1, 5, 5),
        "enc.conv2.bias": (c2,),
        "enc.fc1.weight": (o.hidden, flat),
        "enc.fc1.bias": (o.hidden,),
        "enc.fc2.weight": (o.hidden, o.hidden),
        "enc.fc2.bias": (o.hidden,),
        "enc.mu.weight": (o.latent, o.hidden),
        "enc.mu.bias": (o.latent,),
    }
    if o.variational:
        shapes.update({"enc.log_sigma.weight": (o.latent, o.hidden), "enc.log_sigma.bias": (o.latent,)})
    return shapes


def classifier_shapes(o: FILVEROptions) -> dict[str, tuple[int, ...]]:
    return {
        "cls.fc1.weight": (o.hidden, o.latent),
        "cls.fc1.bias": (o.hidden,),
        "cls.fc2.weight": (o.hidden, o.hidden),
        "cls.fc2.bias": (o.hidden,),
        "cls.out.weight": (o.classes, o.hidden),
        "cls.out.bias": (o.classes,),
    }


def initial_params(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, np.ndarray]:
    """Drawn like torch's default conv/linear init: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for
    weights and biases alike, fan_in from the layer's weight."""
    rng = np.random.default_rng((seed, 23))
    out = {}
    for name, shape in shapes.items():
        weight = shapes[name.rsplit(".", 1)[0] + ".weight"]
        bound = 1.0 / math.sqrt(math.prod(weight[1:]))
        out[name] = rng.uniform(-bound, bound, shape).astype(np.float32)
    return out


def parse_report(meta: Any) -> dict:
    """The update's ``meta.filver``: ``{"task": int >= 0, "form": "z" | "stats" | "none"}``."""
    report = meta.get("filver") if isinstance(meta, dict) else None
    if not isinstance(report, dict):
        raise ValueError("meta.filver: expected {task, form}")
    task, form = report.get("task"), report.get("form")
    if not isinstance(task, int) or isinstance(task, bool) or task < 0:
        raise ValueError(f"meta.filver.task: expected an int >= 0, got {task!r}"[:120])
    if form not in ("z", "stats", "none"):
        raise ValueError(f"meta.filver.form: expected z, stats or none, got {form!r}"[:120])
    return {"task": task, "form": form}
