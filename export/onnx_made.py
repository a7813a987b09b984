"""Export a served MADE to a self-describing ONNX file (opset 17), verified before it is published.

The graph is built directly with ``onnx.helper`` (no tracing, no dynamo exporter):

    x (batch, D) -> [MatMul(W_l^T * M_l^T) -> Add(b_l) -> Relu] per hidden layer
                 -> MatMul(W_out^T * M_out^T) -> Add(b_out) [-> Add(MatMul(x, W_dir^T * M_dir^T))] -> logits

The masks of the given order are multiplied into the weights, which are stored transposed
(``(in, out)``, as MatMul wants them) under the names ``<layer>.masked_weight_t``.  Masked
entries are exact zeros, which int8 dynamic quantisation (symmetric weights) keeps exact.

torch is imported lazily, only for the parity check against ``fclcore.models.made.MADE``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from export import _meta, scaffold
from export.publish import OPSET, ExportError, int8_path_for, publish_export, quantize_int8, seal, write_synced
from fclcore.made_spec import input_order, made_masks, mask_for_param
from fclcore.served import ServedModel

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "ServedModel",
    "ExportError",
    "base_metadata",
    "build_onnx",
    "export_served_model",
    "int8_path_for",
    "PARITY_TOL",
    "OPSET",
]

PARITY_TOL = 1e-5
_PARITY_RANDOM_ROWS = 64


def base_metadata(model: ServedModel, toolkit_version: str) -> dict[str, Any]:
    """The ``fcl.*`` metadata of ``model``'s fp32 export (without the hashes :func:`seal` adds)."""
    cfg = model.made
    return {
        "format": _meta.FORMAT,
        "method": model.method,
        "task": model.task,
        "input_dim": cfg.input_dim,
        "hidden_sizes": list(cfg.hidden_sizes),
        "direct": cfg.direct,
        "mask_seed": cfg.mask_seed,
        "natural_order": cfg.natural_order,
        "num_orders": cfg.num_orders,
        "order_index": model.order_k,
        "input_order": [int(v) for v in input_order(cfg, model.order_k)],
        "binarize": model.binarize,
        "toolkit_version": str(toolkit_version),
        "quantization": "none",
    }


def build_onnx(model: ServedModel, toolkit_version: str) -> onnx.ModelProto:
    """The opset-17 graph ``x (batch, D) float32 -> logits (batch, D)`` with masks baked in, sealed."""
    cfg = model.made
    d = cfg.input_dim
    masks = made_masks(cfg, model.order_k)
    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []

    def masked_t(name: str) -> np.ndarray:
        w = model.params[name] * mask_for_param(masks, name)  # (out, in), exactly as MaskedLinear
        return np.ascontiguousarray(w.T, dtype=np.float32)  # (in, out) for MatMul

    h = "x"
    for i in range(len(cfg.hidden_sizes)):
        layer = f"hidden.{i}"
        inits.append(numpy_helper.from_array(masked_t(f"{layer}.weight"), f"{layer}.masked_weight_t"))
        inits.append(numpy_helper.from_array(model.params[f"{layer}.bias"].copy(), f"{layer}.bias"))
        nodes.append(
            helper.make_node("MatMul", [h, f"{layer}.masked_weight_t"], [f"{layer}.matmul"], name=f"{layer}.matmul")
        )
        nodes.append(
            helper.make_node("Add", [f"{layer}.matmul", f"{layer}.bias"], [f"{layer}.pre"], name=f"{layer}.add")
        )
        nodes.append(helper.make_node("Relu", [f"{layer}.pre"], [f"{layer}.out"], name=f"{layer}.relu"))
        h = f"{layer}.out"
    inits.append(numpy_helper.from_array(masked_t("output.weight"), "output.masked_weight_t"))
    inits.append(numpy_helper.from_array(model.params["output.bias"].copy(), "output.bias"))
    nodes.append(helper.make_node("MatMul", [h, "output.masked_weight_t"], ["output.matmul"], name="output.matmul"))
    out_name = "output.pre" if cfg.direct else "logits"
    nodes.append(helper.make_node("Add", ["output.matmul", "output.bias"], [out_name], name="output.add"))
    if cfg.direct:
        inits.append(numpy_helper.from_array(masked_t("direct.weight"), "direct.masked_weight_t"))
        nodes.append(
            helper.make_node("MatMul", ["x", "direct.masked_weight_t"], ["direct.matmul"], name="direct.matmul")
        )
        nodes.append(helper.make_node("Add", ["output.pre", "direct.matmul"], ["logits"], name="direct.add"))

    graph = helper.make_graph(
        nodes,
        "fcl_made",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", d])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", d])],
        initializer=inits,
        doc_string=f"MADE D={d} hidden={list(cfg.hidden_sizes)} direct={cfg.direct} order_index={model.order_k}: "
        "x in {0,1}^D -> Bernoulli logits of p(x_d=1 | x_<d), <d in fcl.input_order",
    )
    proto = scaffold.model_proto(graph, toolkit_version)
    onnx.checker.check_model(proto)
    return seal(proto, base_metadata(model, toolkit_version))


def _torch_logits(model: ServedModel, x: np.ndarray) -> np.ndarray:
    """Reference logits from the torch MADE with the same params and order (torch imported here only)."""
    from fclcore.models.made import served_logits

    return served_logits(model, x)


def _parity_inputs(model: ServedModel, parity_inputs: np.ndarray | None) -> tuple[np.ndarray, str]:
    d = model.made.input_dim
    if parity_inputs is None:
        rng = np.random.default_rng(0)
        return (rng.random((_PARITY_RANDOM_ROWS, d)) < 0.5).astype(np.float32), f"random_binary:{_PARITY_RANDOM_ROWS}"
    a = np.asarray(parity_inputs)
    if a.ndim != 2 or a.shape[1] != d or a.shape[0] == 0:
        raise ExportError(f"parity_inputs must have shape (N >= 1, {d}), got {a.shape}")
    a = np.ascontiguousarray(a, dtype=np.float32)
    if not np.isin(a, (0.0, 1.0)).all():
        raise ExportError("parity_inputs must contain only 0 and 1")
    return a, f"parity_inputs:{a.shape[0]}"


def _reference(model: ServedModel, x: np.ndarray, given: np.ndarray | None, random_rows: bool) -> np.ndarray:
    if given is None:
        return _torch_logits(model, x).astype(np.float64)
    ref = np.asarray(given)
    if random_rows or ref.shape != x.shape or ref.dtype != np.float32:
        raise ExportError(f"reference_logits must be float32 {x.shape} logits on the given parity_inputs")
    return ref.astype(np.float64)


def _load(path: Path) -> Any:
    from export.runtime import MadeRuntime

    return MadeRuntime.load(path)


def export_served_model(
    model: ServedModel,
    path: str | os.PathLike,
    *,
    reference_logits: np.ndarray | None = None,
    **options: Unpack[scaffold.ExportOptions],
) -> dict[str, Any]:
    """Write ``model`` as ONNX to ``path`` atomically, after verifying the written bytes.

    The file is written to a temporary file in the same directory, loaded back with the
    torch-free runtime (metadata + hashes), and its logits on ``parity_inputs`` (default: 64
    seeded random binary rows) compared with the torch MADE; only if every logit satisfies
    ``|onnx - torch| <= 1e-5 * max(1, |torch|)`` is it moved over ``path`` with ``os.replace``.
    (Absolute 1e-5 for logits within [-1, 1]; relative beyond, because two float32 GEMMs
    with different summation orders legitimately differ by a few ulp: a trained MNIST MADE
    has logits near -30, where one float32 ulp is 1.9e-6.)  The report carries both
    ``max_abs_err`` and ``max_scaled_err``.  With ``int8`` a weight-int8 copy
    ``<stem>.int8.onnx`` is made with onnxruntime's ``quantize_dynamic``; its mean NLL change
    vs fp32 on the same inputs is stored in its metadata (``fcl.int8_nll_delta``).  Both
    files are published only if both pass.  Raises :class:`ExportError`.

    ``reference_logits``: the torch MADE's logits on ``parity_inputs``, computed by a process
    that has torch (the training daemon); given, the export itself runs without torch.
    """
    parity_inputs, int8, toolkit_version = scaffold.export_options(options)
    path = scaffold.check_destination(path)
    x, x_desc = _parity_inputs(model, parity_inputs)
    proto = build_onnx(model, toolkit_version)
    with scaffold.staged(path) as (tmp, temps):
        write_synced(tmp, proto.SerializeToString())
        expected = base_metadata(model, toolkit_version)
        rt = scaffold.open_written(_load, tmp, expected)
        ref = _reference(model, x, reference_logits, parity_inputs is None)
        err, scaled = scaffold.logit_errors(rt.logits(x), ref)
        if not scaled <= PARITY_TOL:  # also catches NaN
            raise ExportError(
                f"parity check failed: max |onnx - torch| / max(1, |torch|) = {scaled:.3g} > "
                f"{PARITY_TOL:g} (max |onnx - torch| logit error {err:.3g}) on {x.shape[0]} rows "
                f"({x_desc}); {path} left unchanged"
            )
        report: dict[str, Any] = {
            "path": str(path),
            "bytes": tmp.stat().st_size,
            "max_abs_err": err,
            "max_scaled_err": scaled,
            "sha256": rt.metadata["weights_sha256"],
            "parity_rows": int(x.shape[0]),
            "parity_data": x_desc,
        }
        int8_fn = (lambda q_tmp, q_path: _export_int8(rt, tmp, q_tmp, q_path, x, x_desc, expected)) if int8 else None
        return publish_export(tmp, path, temps, report, int8_fn)


def _export_int8(
    fp32_rt: Any, fp32_tmp: Path, q_tmp: Path, q_path: Path, x: np.ndarray, x_desc: str, metadata: dict[str, Any]
) -> dict[str, Any]:
    import onnxruntime as ort

    from export.runtime import session_options

    quantize_int8(fp32_tmp, q_tmp, per_channel=False)
    proto = onnx.load(q_tmp)
    # Measure the NLL change before sealing (row by row: activation scales are per tensor).
    sess = ort.InferenceSession(
        proto.SerializeToString(), sess_options=session_options(), providers=["CPUExecutionProvider"]
    )
    z_q = np.concatenate([sess.run(None, {"x": x[i : i + 1]})[0] for i in range(x.shape[0])]).astype(np.float64)
    nll_q = -(x * z_q - np.logaddexp(0.0, z_q)).sum(axis=1)
    nll_f = -fp32_rt.log_likelihood(x)
    delta = float(np.mean(nll_q - nll_f))
    if not np.isfinite(delta):
        raise ExportError("int8 model produces non-finite log-likelihoods")
    meta = dict(metadata, quantization="int8-dynamic", int8_nll_delta=delta, int8_eval=x_desc)
    write_synced(q_tmp, seal(proto, meta).SerializeToString())
    rt = scaffold.load_verified(_load, q_tmp, "int8")
    check = float(np.max(np.abs(-rt.log_likelihood(x) - nll_q)))
    if check > 1e-3:
        raise ExportError(f"sealed int8 model disagrees with the measured one by {check:.3g} nats")
    return {
        **scaffold.int8_sizes(fp32_tmp, q_tmp, q_path),
        "int8_nll_delta": delta,
        "int8_sha256": rt.metadata["weights_sha256"],
    }
