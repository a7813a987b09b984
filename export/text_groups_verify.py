"""The torch-free half of a text-groups export (``export.onnx_text_groups``): the parity checks
of the written file against the torch reference, the int8 copy and its agreement check, and
the atomic publication of both.

``export_text_classifier`` runs it right after building the file, in the same process; with a
``stage_dir`` it stops after the torch half instead (:func:`write_stage`) and
:func:`finish_stage` runs this half from that directory in another process, which imports
onnx and onnxruntime but never torch.  ``export.child`` does so for the daemon, so that no
process of the device holds torch, the backbone, onnx, onnxruntime and the int8 copy at once
(``firmware_notes/memory.md``).

A stage directory holds ``model.onnx`` (the unsealed fp32 graph, its initializers in
``model.onnx.data`` as ONNX external data: the first process writes them one tensor at a time
and never serialises the whole model; the second reads them back, seals and writes the
one-file model), ``parity.npz`` (the parity
rows ``ids``, ``mask`` and the torch reference ``label``, ``group``, ``logits``,
``route_margin``, ``label_margin``) and ``stage.json`` (the target ``path``, the file's
``metadata``, the parity rows' ``desc``, ``classes``, ``groups`` and the int8 settings).
"""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from export import scaffold
from export.publish import ExportError, publish_export, quantize_int8, seal, write_synced
from fclcore.procmem import release_free_memory

__all__ = [
    "FORMAT",
    "PARITY_TOL",
    "ROUTE_TOL",
    "INT8_MIN_AGREEMENT",
    "verify_and_publish",
    "write_stage",
    "finish_stage",
    "load_staged_model",
    "STAGE_WEIGHTS",
]

FORMAT = "fcl-fedet/1"  # = export.text_runtime.FORMAT (not imported here: that module loads onnxruntime)
PARITY_TOL = 1e-4  # |onnx - torch| <= PARITY_TOL * max(1, |torch|) for every finite logit
ROUTE_TOL = 1e-4  # a cosine (selector) or logit (head) top-2 gap below this is a float32 tie
INT8_MIN_AGREEMENT = 0.9  # default: int8 labels must equal the fp32 torch labels on >= 90% of parity rows
_INT8_OPS = {"MatMulInteger", "QAttention", "DynamicQuantizeLinear", "DequantizeLinear"}
STAGE_WEIGHTS = "model.onnx.data"  # the staged graph's initializers (external data of model.onnx)
_PARITY = ("ids", "mask", "label", "group", "logits", "route_margin", "label_margin")


def verify_and_publish(tmp: Path, temps: list[Path], checks: dict[str, Any]) -> dict[str, Any]:
    """Check the fp32 file ``tmp`` (next to ``checks["path"]``), make and check the int8 copy
    if asked, and publish both; the report.  ``temps``: the caller's temporaries to remove."""
    path, metadata, parity = Path(checks["path"]), checks["metadata"], checks["parity"]
    ids, mask, desc = parity["ids"], parity["mask"], parity["desc"]
    ref = {k: parity[k] for k in _PARITY[2:]}
    rt = scaffold.open_written(_runtime, tmp, metadata)
    labels, routes, logits = rt.predict_ids(ids, mask)
    fields = {"classes": checks["classes"], "groups": checks["groups"]}
    parity = _compare(ref, labels, routes, logits, "fp32", desc)
    report = scaffold.fp32_report(path, tmp, fields, len(ids), desc, parity, rt)
    del rt
    int8_fn = _Int8(tmp, metadata, ref, (ids, mask, desc), checks) if checks["int8"] else None
    return publish_export(tmp, path, temps, report, int8_fn)


def write_stage(stage_dir: Path, proto: onnx.ModelProto, checks: dict[str, Any]) -> None:
    """Leave the unsealed fp32 graph and what :func:`verify_and_publish` needs in ``stage_dir``.

    The graph goes out with its initializers as external data (``model.onnx`` +
    :data:`STAGE_WEIGHTS`), written one tensor at a time, so this process never holds a whole
    serialised copy of the weights; ``proto`` is emptied of them (the caller drops it).
    :func:`finish_stage` seals it with ``checks["metadata"]`` into the one-file model."""
    stage_dir.mkdir(parents=True, exist_ok=True)
    weights = stage_dir / STAGE_WEIGHTS
    weights.unlink(missing_ok=True)  # onnx appends to an existing file
    onnx.save_model(
        proto, stage_dir / "model.onnx", save_as_external_data=True, all_tensors_to_one_file=True, location=weights.name
    )
    for f in (weights, stage_dir / "model.onnx"):
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    parity = checks["parity"]
    np.savez(stage_dir / "parity.npz", **{k: np.asarray(parity[k]) for k in _PARITY})
    doc = {k: v for k, v in checks.items() if k != "parity"}
    (stage_dir / "stage.json").write_text(json.dumps({**doc, "desc": parity["desc"]}))


def finish_stage(stage_dir: Path) -> dict[str, Any]:
    """:func:`verify_and_publish` of what :func:`write_stage` left in ``stage_dir``, after sealing
    the staged graph into the one-file model.  Raises :class:`ExportError`, or ValueError /
    OSError for a stage that is not complete."""
    stage_dir = Path(stage_dir)
    try:
        doc = json.loads((stage_dir / "stage.json").read_text())
        with np.load(stage_dir / "parity.npz", allow_pickle=False) as z:
            parity = {k: z[k] for k in _PARITY}
        checks = {**doc, "parity": {**parity, "desc": str(doc["desc"])}}
        path, metadata = Path(checks["path"]), checks["metadata"]
        if not isinstance(metadata, dict):
            raise TypeError("metadata is not a dict")
    except (KeyError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{stage_dir}: not a complete export stage ({exc!r})") from None
    with scaffold.staged(path) as (tmp, temps):  # next to the target, so that publishing it is a rename
        proto = load_staged_model(stage_dir / "model.onnx")
        write_synced(tmp, seal(proto, metadata).SerializeToString())
        del proto
        gc.collect()
        release_free_memory()
        try:  # the graph's checker pass, left out of the first process (``build_text_classifier_onnx``)
            onnx.checker.check_model(str(tmp))
        except onnx.checker.ValidationError as exc:
            raise ExportError(f"the staged model fails the ONNX checker: {exc}") from None
        return verify_and_publish(tmp, temps, checks)


def load_staged_model(path: Path) -> onnx.ModelProto:
    """The graph :func:`write_stage` left at ``path``, its initializers read back from
    :data:`STAGE_WEIGHTS` into ``raw_data`` exactly as the exporter had them (no
    ``data_location`` field, which ``onnx.load`` would add): sealing it gives the bytes sealing
    the exporter's proto gave.  ValueError for a malformed stage."""
    path = Path(path)
    proto = onnx.load(path, load_external_data=False)
    with open(path.with_name(STAGE_WEIGHTS), "rb") as fh:
        for t in proto.graph.initializer:
            if t.data_location != onnx.TensorProto.EXTERNAL:
                continue
            info = {e.key: e.value for e in t.external_data}
            if info.get("location") != STAGE_WEIGHTS or "offset" not in info or "length" not in info:
                raise ValueError(f"{path}: initializer {t.name!r} is not in {STAGE_WEIGHTS} ({info})")
            fh.seek(int(info["offset"]))
            raw = fh.read(int(info["length"]))
            if len(raw) != int(info["length"]):
                raise ValueError(f"{path}: {STAGE_WEIGHTS} is truncated at {t.name!r}")
            t.raw_data = raw
            del raw
            del t.external_data[:]
            t.ClearField("data_location")
    return proto


# ------------------------------------------------------------------ parity


def _compare(
    ref: dict[str, np.ndarray], labels: np.ndarray, groups: np.ndarray, logits: np.ndarray, what: str, desc: str
) -> dict[str, Any]:
    """fp32 parity: labels and groups exactly (except float32 ties), logits within PARITY_TOL."""
    route_tie = ref["route_margin"] <= ROUTE_TOL
    same_route = groups == ref["group"]
    scale = np.abs(ref["logits"]).max(axis=1, initial=0.0, where=np.isfinite(ref["logits"]))
    label_tie = ref["label_margin"] <= ROUTE_TOL * np.maximum(1.0, scale)
    bad_route = ~same_route & ~route_tie
    bad_label = same_route & (labels != ref["label"]) & ~label_tie
    if bad_route.any() or bad_label.any():
        rows = np.flatnonzero(bad_route | bad_label)[:5].tolist()
        raise ExportError(
            f"{what} parity check failed on {int(bad_route.sum())} routes and {int(bad_label.sum())} "
            f"labels of {len(labels)} rows ({desc}; first rows {rows}: onnx label/group "
            f"{labels[rows].tolist()}/{groups[rows].tolist()}, torch {ref['label'][rows].tolist()}/"
            f"{ref['group'][rows].tolist()})"
        )
    r, g = ref["logits"][same_route].astype(np.float64), logits[same_route].astype(np.float64)
    finite = np.isfinite(r)
    if not np.array_equal(finite, np.isfinite(g)) or np.isnan(g).any():
        raise ExportError(f"{what} parity check failed: the -inf layout of the logits differs from torch ({desc})")
    err, scaled = scaffold.check_logit_parity(g[finite], r[finite], PARITY_TOL, rows=len(labels), desc=desc, what=what)
    return {
        "max_abs_err": err,
        "max_scaled_err": scaled,
        "label_agreement": float((labels == ref["label"]).mean()),
        "float32_ties": int((~same_route | (labels != ref["label"])).sum()),
    }


# ------------------------------------------------------------------ int8


def _selector_nodes(proto: onnx.ModelProto) -> list[str]:
    """Names of the nodes reading the prototypes (the selector's MatMul): kept in fp32 by int8."""
    names = {t.name for t in proto.graph.initializer if "prototypes_t" in t.name}
    return [n.name for n in proto.graph.node if names & set(n.input)]


def _stack_gathers(proto: onnx.ModelProto) -> list[str]:
    """Names of the Gathers picking each row's group from the stacked ``stack_*`` tensors.

    Left alone the int8 quantiser would quantise every float one (Gather is in its op list)
    with one scale per tensor across all groups; excluded, the Enhancers and heads stay fp32
    (the per-row MatMuls they feed are not quantised either: their weights are not constant
    initializers, and dynamic quantisation only takes MatMuls with a constant B)."""
    names = {t.name for t in proto.graph.initializer if t.name.startswith("stack_")}
    return [n.name for n in proto.graph.node if n.op_type == "Gather" and n.input[0] in names]


def _runtime(path: Path) -> Any:
    """The torch-free runtime on ``path`` (``export.text_runtime.TextClassifierRuntime``)."""
    from export.text_runtime import TextClassifierRuntime

    return TextClassifierRuntime(path, tokenizer=False)


class _Int8(scaffold.Int8Copy):
    """The int8 copy: torch's label on ``int8_min_agreement`` of the parity rows (its group
    agreement recorded too); the selector and the stacked groups stay fp32."""

    agreements = ("int8_label_agreement", "int8_group_agreement")

    def __init__(
        self,
        fp32_tmp: Path,
        metadata: dict[str, Any],
        ref: dict[str, np.ndarray],
        rows: tuple[np.ndarray, np.ndarray, str],
        checks: dict[str, Any],
    ) -> None:
        super().__init__(fp32_tmp, metadata, rows[2], checks["int8_min_agreement"])
        self.ref, self.rows = ref, rows
        self.per_channel, self.exclude_selector = checks["int8_per_channel"], checks["int8_exclude_selector"]
        self.exclude: list[str] = []

    def quantize(self, q_tmp: Path) -> None:
        proto = onnx.load(self.fp32_tmp, load_external_data=False)
        self.exclude = (_selector_nodes(proto) if self.exclude_selector else []) + _stack_gathers(proto)
        del proto  # the quantiser loads its own copy: not two fp32 models at its peak
        gc.collect()
        release_free_memory()
        quantize_int8(self.fp32_tmp, q_tmp, self.exclude, self.per_channel)

    def load(self, path: Path) -> Any:
        return _runtime(path)

    def measure(self, rt: Any) -> tuple[tuple[np.ndarray, ...], dict[str, float]]:
        labels, groups, _ = rt.predict_ids(*self.rows[:2])
        return (labels, groups), {
            "int8_label_agreement": float((labels == self.ref["label"]).mean()),
            "int8_group_agreement": float((groups == self.ref["group"]).mean()),
        }

    def refusal(self, agree: float) -> str:
        return (
            f"int8 label agreement with torch fp32 is {agree:.4f} < {self.min_agreement:g} on {len(self.rows[0])} rows "
            f"({self.desc}); nothing written"
        )

    def extras(self, proto: onnx.ModelProto, answers: tuple[np.ndarray, ...]) -> dict[str, Any]:
        return {
            "int8_excluded_nodes": self.exclude,
            "int8_quantized_ops": sorted({n.op_type for n in proto.graph.node if n.op_type in _INT8_OPS}),
            "int8_per_channel": self.per_channel,
        }
