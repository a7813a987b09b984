"""The ``image-classifier`` served format (:class:`fclcore.served.ImageClassifierServed`) as ONNX.

The graph (opset ``export.publish.OPSET``, dynamic ``batch``) is built directly with
``onnx.helper`` from the description's NumPy weights -- no torch, no tracing:

    x (float32 [batch, side*side]) -> Reshape [batch, 1, side, side]
      -> per layer: Conv (stride 1, pads) | Relu | MaxPool 2x2 stride 2 | Flatten | Gemm (transB=1)
      -> logits (float32 [batch, classes]), label = ArgMax(logits) (int64 [batch])

Layer ``i``'s initializers are ``layer<i>.weight`` / ``layer<i>.bias``.  The usual publish
path follows (``export.publish``): a temporary file, sealed with the ``fcl.*`` metadata
(schema in ``export.image_runtime``), loaded back and validated by the torch-free
:class:`export.image_runtime.ImageClassifierRuntime`, its logits compared with the NumPy
reference (:meth:`ImageClassifierServed.logits`, float64), and only then moved over the
destination with ``os.replace``.  With ``int8`` an ``<stem>.int8.onnx`` copy (onnxruntime's
dynamic quantisation: ConvInteger / MatMulInteger with per-channel int8 weights) is published
with it, once its labels agree with the reference on enough parity rows.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from export import scaffold
from export.image_runtime import FORMAT, ImageClassifierRuntime
from export.publish import ExportError, publish_export, seal, write_synced
from fclcore.served import ImageClassifierServed

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "export_image_classifier",
    "build_image_onnx",
    "image_metadata",
    "ExportError",
    "PARITY_TOL",
    "TIE_TOL",
    "INT8_MIN_AGREEMENT",
]

PARITY_TOL = 1e-4  # |onnx - reference| <= PARITY_TOL * max(1, |reference|) for every logit
TIE_TOL = 1e-4  # a reference top-2 logit gap below this (scaled like PARITY_TOL) is a float32 tie
INT8_MIN_AGREEMENT = 0.9  # int8 labels must equal the fp32 reference ones on >= 90% of the parity rows
_PARITY_RANDOM_ROWS = 64


def _as_served(served: Any) -> ImageClassifierServed:
    """``served`` validated as an :class:`ImageClassifierServed` (anything with its fields is re-checked)."""
    if not isinstance(served, ImageClassifierServed):
        try:
            served = ImageClassifierServed(
                served.image_side, served.layers, served.class_names, served.method, served.task
            )
        except (AttributeError, TypeError, ValueError) as exc:
            raise ExportError(f"not an image-classifier served model: {exc}") from None
    return served


def image_metadata(served: ImageClassifierServed, toolkit_version: str) -> dict[str, Any]:
    """The ``fcl.*`` metadata of ``served``'s fp32 export (without the hashes :func:`seal` adds)."""
    return {
        "format": FORMAT,
        "method": served.method,
        "task": served.task,
        "image_side": served.image_side,
        "class_names": list(served.class_names),
        "layers": served.layer_summary(),
        "toolkit_version": str(toolkit_version),
        "quantization": "none",
    }


def build_image_onnx(served: ImageClassifierServed, toolkit_version: str = "0.1.0") -> onnx.ModelProto:
    """The checked, unsealed opset-17 graph ``x [batch, side*side] -> logits [batch, classes], label [batch]``."""
    side = served.image_side
    inits = [numpy_helper.from_array(np.array([-1, 1, side, side], np.int64), "image_shape")]
    nodes = [helper.make_node("Reshape", ["x", "image_shape"], ["image"], name="to_image")]
    h = "image"
    last = len(served.layers) - 1
    for i, (kind, p) in enumerate(served.layers):
        out = "logits" if i == last else f"layer{i}.out"
        name = f"layer{i}.{kind}"
        if kind in ("conv2d", "linear"):
            inits.append(numpy_helper.from_array(np.ascontiguousarray(p["weight"]), f"layer{i}.weight"))
            inits.append(numpy_helper.from_array(np.ascontiguousarray(p["bias"]), f"layer{i}.bias"))
            args = [h, f"layer{i}.weight", f"layer{i}.bias"]
        if kind == "conv2d":
            k, pad = int(p["weight"].shape[2]), p["padding"]
            nodes.append(
                helper.make_node("Conv", args, [out], name=name, kernel_shape=[k, k], pads=[pad] * 4, strides=[1, 1])
            )
        elif kind == "relu":
            nodes.append(helper.make_node("Relu", [h], [out], name=name))
        elif kind == "maxpool2":
            nodes.append(helper.make_node("MaxPool", [h], [out], name=name, kernel_shape=[2, 2], strides=[2, 2]))
        elif kind == "flatten":
            nodes.append(helper.make_node("Flatten", [h], [out], name=name, axis=1))
        else:  # linear
            nodes.append(helper.make_node("Gemm", args, [out], name=name, transB=1))
        h = out
    nodes.append(helper.make_node("ArgMax", ["logits"], ["label"], name="label", axis=1, keepdims=0))
    graph = helper.make_graph(
        nodes,
        "fcl_image_classifier",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", side * side])],
        [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", served.num_classes]),
            helper.make_tensor_value_info("label", TensorProto.INT64, ["batch"]),
        ],
        initializer=inits,
        doc_string=f"image classifier, {side}x{side} one-channel images flattened row-major -> "
        f"logits over {served.num_classes} classes and their argmax: " + ", ".join(served.layer_summary()),
    )
    proto = scaffold.model_proto(graph, toolkit_version)
    try:
        onnx.checker.check_model(proto, full_check=True)
    except Exception as exc:  # the checker raises several types
        raise ExportError(f"the image-classifier graph is invalid: {exc}") from exc
    return proto


def _parity_inputs(served: ImageClassifierServed, parity_inputs: Any) -> tuple[np.ndarray, str]:
    d = served.input_dim
    if parity_inputs is None:
        rng = np.random.default_rng(0)
        return rng.random((_PARITY_RANDOM_ROWS, d), dtype=np.float32), f"random_uniform:{_PARITY_RANDOM_ROWS}"
    a = np.asarray(parity_inputs)
    if a.dtype == object or not (np.issubdtype(a.dtype, np.floating) or np.issubdtype(a.dtype, np.integer)):
        raise ExportError(f"parity_inputs must be a float array (N, {d}), got dtype {a.dtype}")
    if a.ndim != 2 or a.shape[1] != d or a.shape[0] == 0:
        raise ExportError(f"parity_inputs must have shape (N >= 1, {d}) (flattened images), got {a.shape}")
    a = np.ascontiguousarray(a, dtype=np.float32)
    if not np.isfinite(a).all():
        raise ExportError("parity_inputs contain NaN or infinite values")
    return a, f"parity_inputs:{a.shape[0]}"


def _top2_gap(z: np.ndarray) -> np.ndarray:
    if z.shape[1] < 2:
        return np.full(len(z), np.inf)
    top = np.sort(z, axis=1)
    return top[:, -1] - top[:, -2]


def _compare(ref: np.ndarray, logits: np.ndarray, labels: np.ndarray, desc: str) -> dict[str, Any]:
    """Every logit within PARITY_TOL (scaled), and the graph's label the reference argmax except
    where the reference's own top-2 gap is a float32 tie."""
    err, scaled = scaffold.check_logit_parity(logits, ref, PARITY_TOL, rows=len(ref), desc=desc, against="numpy")
    want = ref.argmax(axis=1)
    tie = _top2_gap(ref) <= TIE_TOL * np.maximum(1.0, np.abs(ref).max(axis=1))
    if not np.array_equal(labels, logits.argmax(axis=1)):
        raise ExportError(f"parity check failed: the graph's label output is not the argmax of its logits ({desc})")
    bad = (labels != want) & ~tie
    if bad.any():
        raise ExportError(
            f"parity check failed: {int(bad.sum())} labels differ from the numpy reference (rows "
            f"{np.flatnonzero(bad)[:5].tolist()}; {desc})"
        )
    return scaffold.label_report(err, scaled, labels, want, tie)


class _Int8(scaffold.Int8Copy):
    """The int8 copy must give the reference label on ``min_agreement`` of the parity images."""

    def __init__(
        self, fp32_tmp: Path, metadata: dict[str, Any], desc: str, min_agreement: float, ref: np.ndarray, x: np.ndarray
    ) -> None:
        super().__init__(fp32_tmp, metadata, desc, min_agreement)
        self.ref, self.x, self.max_abs_err = ref, x, 0.0

    def load(self, path: Path) -> ImageClassifierRuntime:
        return ImageClassifierRuntime(path)

    def measure(self, rt: ImageClassifierRuntime) -> tuple[tuple[np.ndarray, ...], dict[str, float]]:
        logits, labels = rt.classify(self.x)
        if not np.isfinite(logits).all():
            raise ExportError("the int8 model produces non-finite logits")
        self.max_abs_err = float(np.max(np.abs(logits.astype(np.float64) - self.ref)))
        return (labels,), {"int8_label_agreement": float((labels == self.ref.argmax(axis=1)).mean())}

    def refusal(self, agree: float) -> str:
        return (
            f"int8 label agreement with the fp32 reference is {agree:.4f} < {self.min_agreement:g} on {len(self.x)} "
            f"rows ({self.desc}); nothing written"
        )

    def extras(self, proto: Any, answers: tuple[np.ndarray, ...]) -> dict[str, Any]:
        return {"int8_max_abs_err": self.max_abs_err}


def export_image_classifier(
    served: Any,
    path: str | os.PathLike,
    *,
    int8_min_agreement: float = INT8_MIN_AGREEMENT,
    **options: Unpack[scaffold.ExportOptions],
) -> dict[str, Any]:
    """Export an :class:`~fclcore.served.ImageClassifierServed` to ``path`` (verified, atomic) and
    return a report.

    ``parity_inputs``: float rows ``(N, side*side)`` as the device's data has them (the
    daemon passes the task's test rows), or None for 64 seeded uniform [0, 1) rows.  Every
    logit of the written file (run by onnxruntime through the torch-free runtime) must satisfy
    ``|onnx - numpy| <= 1e-4 * max(1, |numpy|)`` against the float64 NumPy reference, and its
    ``label`` must be the reference argmax unless the reference's own top-2 gap is a float32
    tie; otherwise nothing is written.  With ``int8``, ``<stem>.int8.onnx`` (onnxruntime
    ``quantize_dynamic``, per-channel int8 weights) must give the reference label on at least
    ``int8_min_agreement`` of the parity rows; both files are published only if both pass.
    Raises :class:`ExportError`."""
    parity_inputs, int8, toolkit_version = scaffold.export_options(options)
    served = _as_served(served)
    path = scaffold.check_destination(path)
    scaffold.check_min_agreement(int8_min_agreement)
    x, desc = _parity_inputs(served, parity_inputs)
    ref = served.logits(x)
    if not np.isfinite(ref).all():
        raise ExportError(f"the reference logits are not finite on the parity rows ({desc})")
    metadata = image_metadata(served, toolkit_version)
    proto = build_image_onnx(served, toolkit_version)
    with scaffold.staged(path) as (tmp, temps):
        write_synced(tmp, seal(proto, metadata).SerializeToString())
        del proto
        rt = scaffold.open_written(ImageClassifierRuntime, tmp, metadata)
        logits, labels = rt.classify(x)
        fields = {"classes": served.num_classes}
        report = scaffold.fp32_report(path, tmp, fields, len(x), desc, _compare(ref, logits, labels, desc), rt)
        del rt
        int8_fn = _Int8(tmp, metadata, desc, int8_min_agreement, ref, x) if int8 else None
        return publish_export(tmp, path, temps, report, int8_fn)
