"""Torch-free runtime for the ``image-classifier`` served format (numpy + onnxruntime only).

A model file (format ``fcl-image-classifier/1``, written by ``export.onnx_image``) is
validated completely before onnxruntime sees it, as every fcl export is
(``export.runtime.validate_model_bytes``: protobuf structure, the ``fcl.*`` metadata below,
weights and whole-file hashes), so a truncated, corrupted, foreign or tampered file is an
:class:`export.runtime.ModelFileError`.

The graph: ``x`` (float32 [batch, side*side], square one-channel images flattened row-major,
pixel values as the training data had them) -> reshaped to [batch, 1, side, side] ->
conv / ReLU / max-pool / flatten / linear layers ->

* ``logits`` (float32 [batch, classes]),
* ``label`` (int64 [batch]): the argmax of ``logits`` (the first maximum on a tie).

fp32 models run chunks of ``CHUNK_ROWS`` images; int8 models quantise activations with one
scale per *tensor*, so an image's answer would depend on the others of a batch: they run one
image at a time.

Metadata (``fcl.*``; JSON unless noted):

| key                     | meaning |
|-------------------------|---------|
| fcl.format              | str ``fcl-image-classifier/1`` |
| fcl.method              | str, the learning method that trained it |
| fcl.task                | int, the task the model was served after |
| fcl.image_side          | int, images are side x side pixels, one channel |
| fcl.class_names         | list of str, class id (logit column) -> name |
| fcl.layers              | list of str, one line per layer (``conv2d 1->4 k5 p0``, ``relu``, ...), informational |
| fcl.toolkit_version     | str |
| fcl.quantization        | str ``none`` or ``int8-dynamic`` |
| fcl.weights_sha256 / fcl.integrity_sha256 | hex, see ``export._proto`` |
| fcl.int8_label_agreement | int8 only: share of the parity images whose int8 label equals the fp32 reference one |
| fcl.int8_min_agreement  | int8 only: the threshold the exporter enforced |
| fcl.int8_eval           | int8 only, str: which inputs the agreement was measured on |
"""

from __future__ import annotations

import io
import os
import sys
from typing import Any, Callable

import numpy as np
import onnxruntime as ort

from export import _meta
from export.runtime import InputError, ModelFileError, identity, open_validated, session_options, validate_model_bytes
from fclcore.npfile import refusal

__all__ = ["FORMAT", "CHUNK_ROWS", "ImageClassifierRuntime", "parse_metadata", "load_images"]

FORMAT = "fcl-image-classifier/1"
CHUNK_ROWS = 32  # fp32: images per onnxruntime call (bounded activation memory)

REQUIRED: dict[str, Callable[[str, str], Any]] = {
    "format": _meta._text(True),
    "method": _meta._text(True),
    "task": _meta._int(0),
    "image_side": _meta._int(1),
    "class_names": _meta._str_list,
    "layers": _meta._str_list,
    "toolkit_version": _meta._text(True),
    "quantization": _meta._text(True),
    "weights_sha256": _meta._hex,
    "integrity_sha256": _meta._hex,
}
OPTIONAL: dict[str, Callable[[str, str], Any]] = {
    "int8_label_agreement": _meta._fraction,
    "int8_min_agreement": _meta._fraction,
    "int8_eval": _meta._text(False),
}
_OTHER_FORMATS = {
    _meta.FORMAT: "a MADE model: use fcl infer --op loglik|conditionals|sample",
    "fcl-fedet/1": "a text-groups classifier: use fcl infer --text",
    "fcl-text-tasks/1": "a text-tasks classifier: use fcl infer --text [--task N]",
}


def parse_metadata(raw: dict[str, str]) -> dict[str, Any]:
    """Validate the ``fcl.*`` entries of an image-classifier model; return them parsed, keys without the prefix."""
    out = _meta.read_format(raw, FORMAT, "this image-classifier runtime", REQUIRED, OPTIONAL, _OTHER_FORMATS)
    if not out["class_names"]:
        raise _meta.MetadataError("fcl.class_names must name at least one class")
    _meta.check_quantization(out, "int8_label_agreement")
    return out


def _check_io(session: ort.InferenceSession, meta: dict[str, Any], path: str) -> None:
    d, c = meta["image_side"] ** 2, len(meta["class_names"])
    ins = session.get_inputs()
    if len(ins) != 1 or ins[0].name != "x" or ins[0].type != "tensor(float)" or len(ins[0].shape) != 2:
        raise ModelFileError(
            f"{path}: expected one float input x [batch, {d}], got "
            + ", ".join(f"{i.name}:{i.type}{i.shape}" for i in ins)
        )
    if ins[0].shape[1] != d:
        raise ModelFileError(f"{path}: input x has shape {ins[0].shape}, metadata says {d} pixels per image")
    outs = {o.name: o for o in session.get_outputs()}
    want = {"logits": ("tensor(float)", 2), "label": ("tensor(int64)", 1)}
    if set(outs) != set(want) or any((outs[n].type, len(outs[n].shape)) != t for n, t in want.items()):
        raise ModelFileError(
            f"{path}: expected outputs logits:float [batch, {c}] and label:int64 [batch], got "
            + ", ".join(f"{o.name}:{o.type}{o.shape}" for o in session.get_outputs())
        )
    if outs["logits"].shape[1] != c:
        raise ModelFileError(f"{path}: output logits has shape {outs['logits'].shape}, metadata lists {c} class names")


def load_images(source: str | os.PathLike) -> np.ndarray:
    """The array in a ``.npy`` file (``-``: the ``.npy`` bytes on stdin), never unpickled.

    Raises :class:`InputError` for a missing or unreadable file, a pickled (object) array or
    anything that is not a single ``.npy`` array; the shape is checked by :meth:`ImageClassifierRuntime.classify`."""
    where = "stdin" if source == "-" else os.fspath(source)
    try:
        if source == "-":
            a = np.load(io.BytesIO(sys.stdin.buffer.read()), allow_pickle=False)
        else:
            a = np.load(where, allow_pickle=False)
    except FileNotFoundError:
        raise InputError(f"{where}: no such input file") from None
    except IsADirectoryError:
        raise InputError(f"{where}: is a directory, not a .npy file") from None
    except (ValueError, EOFError) as exc:  # object arrays (pickles), not a .npy file, truncated
        raise InputError(f"{where}: not a plain numeric .npy file: {refusal(exc)}") from None
    except OSError as exc:
        raise InputError(f"{where}: cannot read input: {exc.strerror or exc}") from None
    if not isinstance(a, np.ndarray):  # an .npz archive
        if hasattr(a, "close"):
            a.close()
        raise InputError(f"{where}: expected one array in a .npy file, got an .npz archive")
    return a


class ImageClassifierRuntime:
    """A validated image classifier: ``classify(images) -> (logits, labels)``."""

    def __init__(self, model_path: str | os.PathLike, *, intra_op_threads: int | None = 1) -> None:
        """Load and validate ``model_path``; :class:`ModelFileError` (one line naming the path)
        for anything but a sound image-classifier export."""
        self.path = os.fspath(model_path)
        self._session, self.metadata, self.stat_key = open_validated(
            self.path,
            session_options(intra_op_threads),
            lambda data, path: validate_model_bytes(data, path, parse_metadata),
        )
        _check_io(self._session, self.metadata, self.path)
        self.image_side: int = self.metadata["image_side"]
        self.input_dim = self.image_side * self.image_side
        self.class_names: list[str] = self.metadata["class_names"]
        self.num_classes = len(self.class_names)
        self.quantized = self.metadata["quantization"] != "none"

    @classmethod
    def load(cls, model_path: str | os.PathLike, *, intra_op_threads: int | None = 1) -> "ImageClassifierRuntime":
        """The same as the constructor (for symmetry with ``MadeRuntime.load``)."""
        return cls(model_path, intra_op_threads=intra_op_threads)

    def prepare(self, images: Any) -> np.ndarray:
        """``images`` as the model's float32 input rows ``(N, side*side)``.

        Accepted shapes: ``(N, side*side)``, ``(N, side, side)`` or ``(N, 1, side, side)``.
        ``uint8`` images (0-255) are scaled to [0, 1] (``/ 255``); float arrays are passed as
        they are, so they must already be on the scale the model was trained on (e.g. [0, 1]);
        bool and other integer arrays are converted to float32 without scaling.  Raises
        :class:`InputError` (a ``ValueError``) for a wrong shape or dtype, NaN or infinities."""
        a = np.asarray(images)
        if a.dtype == object or not (np.issubdtype(a.dtype, np.number) or a.dtype == np.bool_):
            raise InputError(f"images must be a numeric array, got dtype {a.dtype}")
        if np.issubdtype(a.dtype, np.complexfloating):
            raise InputError(f"images must be real numbers, got dtype {a.dtype}")
        s, d = self.image_side, self.input_dim
        if a.ndim not in (2, 3, 4) or a.shape[1:] not in ((d,), (s, s), (1, s, s)):
            raise InputError(
                f"images must have shape (N, {d}), (N, {s}, {s}) or (N, 1, {s}, {s}) "
                f"({s}x{s} one-channel images), got {a.shape}"
            )
        if a.dtype == np.uint8:
            x = a.reshape(len(a), d).astype(np.float32) / np.float32(255.0)
        else:
            x = np.ascontiguousarray(a.reshape(len(a), d), dtype=np.float32)
            if not np.isfinite(x).all():
                raise InputError("images contain NaN or infinite values (or values beyond float32)")
        return np.ascontiguousarray(x)

    def classify(self, images: Any) -> tuple[np.ndarray, np.ndarray]:
        """(logits float32 (N, classes), labels int64 (N,)) for ``images`` (see :meth:`prepare`
        for the shapes and the uint8 scaling)."""
        x = self.prepare(images)
        n = len(x)
        logits = np.empty((n, self.num_classes), np.float32)
        labels = np.empty(n, np.int64)
        step = 1 if self.quantized else CHUNK_ROWS
        for s in range(0, n, step):
            z, lab = self._session.run(["logits", "label"], {"x": x[s : s + step]})
            if z.shape != (len(x[s : s + step]), self.num_classes):
                raise ModelFileError(f"{self.path}: the model returned logits of shape {z.shape}")
            logits[s : s + step], labels[s : s + step] = z, lab
        return logits, labels

    def predictions(self, images: Any) -> list[dict[str, Any]]:
        """Per image ``{"index", "label", "class", "score"}`` (``score``: softmax probability of the label)."""
        logits, labels = self.classify(images)
        if len(labels) == 0:
            return []
        z = logits.astype(np.float64)
        e = np.exp(z - z.max(axis=1, keepdims=True))
        probs = e[np.arange(len(labels)), labels] / e.sum(axis=1)
        return [
            {"index": i, "label": int(c), "class": self.class_names[int(c)], "score": round(float(p), 6)}
            for i, (c, p) in enumerate(zip(labels, probs))
        ]

    def describe(self) -> dict[str, Any]:
        """Identity of the loaded model, for logs and JSON answers."""
        classes = ("classes", len(self.metadata["class_names"]))
        return identity(
            self.path,
            self.metadata,
            "format",
            "method",
            "task",
            "image_side",
            classes,
            "quantization",
            "weights_sha256",
        )
