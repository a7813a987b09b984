"""The torch-free half of the ``text-tasks`` export (``export.onnx_text_tasks`` traces): seal a
traced graph (:class:`export.snapshot_formats.TextTasksStage`) with its metadata, check it
against the torch logits the stage holds and publish it.  ``fcl export`` of a text-tasks
snapshot runs only this, so it needs onnx and onnxruntime but not torch.

The checks: every finite logit within ``PARITY_TOL`` of torch's (scaled by ``max(1, |torch|)``),
the ``-inf`` entries the same, and each task's label torch's unless torch's own top-2 gap is a
float32 tie; with ``int8``, the int8 copy's labels agree with torch's on ``INT8_MIN_AGREEMENT``
of the (parity row, task) pairs.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import onnx

from export import scaffold
from export.publish import ExportError, publish_export
from export.snapshot_text_tasks import FrozenRef, TextTasksStage
from export.splice import sealed_chunks, write_chunks
from export.text_export import tokenizer_metadata
from export.text_tasks_runtime import FORMAT, TextTasksRuntime
from fclcore.procmem import release_free_memory

__all__ = [
    "publish_text_tasks",
    "check_layout",
    "task_labels",
    "default_tokenizer",
    "PARITY_TOL",
    "TIE_TOL",
    "INT8_MIN_AGREEMENT",
]

PARITY_TOL = 1e-4  # |onnx - torch| <= PARITY_TOL * max(1, |torch|) for every finite logit (as text-groups)
TIE_TOL = 1e-4  # a top-2 logit gap of a task below this (scaled like PARITY_TOL) is a float32 tie
INT8_MIN_AGREEMENT = 0.9  # int8 labels must equal the fp32 torch ones on >= 90% of (parity row, task) pairs


def check_layout(logits: np.ndarray, labels: Sequence[Sequence[int]], what: str) -> None:
    """(N, T, W) with W the most labels of a task; finite in a task's label columns, -inf after them."""
    want = (len(logits), len(labels), max(len(row) for row in labels))
    if logits.shape != want:
        raise ExportError(f"{what} logits have shape {logits.shape}, expected {want} (rows, tasks, most labels)")
    for t, row in enumerate(labels):
        bad = np.flatnonzero(~np.isfinite(logits[:, t, : len(row)]).all(axis=1))
        if len(bad):
            raise ExportError(
                f"{what} logits of task {t} are not finite in its {len(row)} label columns (rows {bad[:5].tolist()})"
            )
        if not (logits[:, t, len(row) :] == -np.inf).all():
            raise ExportError(f"{what} logits of task {t} must be -inf in the columns past its {len(row)} labels")


def task_labels(logits: np.ndarray, labels: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(global class ids (N, T), top-2 logit gap (N, T), inf for one-label tasks) per row and task."""
    n = len(logits)
    ids, gaps = np.empty((n, len(labels)), np.int64), np.full((n, len(labels)), np.inf)
    for t, row in enumerate(labels):
        z = logits[:, t, : len(row)].astype(np.float64)
        ids[:, t] = np.asarray(row, np.int64)[z.argmax(axis=1)]
        if len(row) > 1:
            top = np.sort(z, axis=1)
            gaps[:, t] = top[:, -1] - top[:, -2]
    return ids, gaps


def _compare(ref: np.ndarray, got: np.ndarray, labels: Sequence[Sequence[int]], what: str, desc: str) -> dict[str, Any]:
    """Finite logits within PARITY_TOL, -inf at the same places, the same label per task except
    where torch's own top-2 gap is a float32 tie."""
    finite = np.isfinite(ref)
    same_inf = np.array_equal(finite, np.isfinite(got)) and np.array_equal(ref[~finite], got[~finite])
    if np.isnan(got).any() or not same_inf:
        raise ExportError(f"{what} parity check failed: the -inf layout of the logits differs from torch ({desc})")
    err, scaled = scaffold.check_logit_parity(got[finite], ref[finite], PARITY_TOL, rows=len(ref), desc=desc, what=what)
    want, gaps = task_labels(ref, labels)
    have, _ = task_labels(got, labels)
    scale = np.abs(np.where(np.isfinite(ref), ref, 0.0)).max(axis=2)  # (N, T)
    tie = gaps <= TIE_TOL * np.maximum(1.0, scale)
    bad = (have != want) & ~tie
    if bad.any():
        raise ExportError(f"{what} parity check failed: {int(bad.sum())} (row, task) labels differ from torch ({desc})")
    return scaffold.label_report(err, scaled, have, want, tie)


class _Int8(scaffold.Int8Copy):
    """The int8 copy must give torch's label on ``min_agreement`` of the (parity row, task) pairs."""

    def __init__(
        self,
        fp32_tmp: Path,
        metadata: dict[str, Any],
        min_agreement: float,
        ref: np.ndarray,
        labels: Sequence[Sequence[int]],
        rows: tuple[np.ndarray, np.ndarray, str],
    ) -> None:
        super().__init__(fp32_tmp, metadata, rows[2], min_agreement)
        self.ref, self.labels, self.rows = ref, labels, rows

    def load(self, path: Path) -> TextTasksRuntime:
        return TextTasksRuntime(path, tokenizer=False)

    def measure(self, rt: TextTasksRuntime) -> tuple[tuple[np.ndarray, ...], dict[str, float]]:
        logits = rt.predict_ids(*self.rows[:2])
        check_layout(logits, self.labels, "int8")
        have, _ = task_labels(logits, self.labels)
        return (have,), {"int8_label_agreement": float((have == task_labels(self.ref, self.labels)[0]).mean())}

    def refusal(self, agree: float) -> str:
        return (
            f"int8 label agreement with torch fp32 is {agree:.4f} < {self.min_agreement:g} on {len(self.rows[0])} "
            f"rows x {len(self.labels)} tasks ({self.desc}); nothing written"
        )


def default_tokenizer() -> Path:
    from fclcore.dataset import DataError
    from fclcore.text import default_tokenizer_json

    try:
        return default_tokenizer_json()
    except DataError as exc:
        raise ExportError(f"no tokenizer to embed: {exc}") from None


def _check_graph(proto: onnx.ModelProto, frozen: Sequence[FrozenRef]) -> None:
    """The ONNX checker on the graph, each frozen table a row of zeros (the checker wants every
    initializer's bytes; a table's are only written into the file, ``export.splice``)."""
    inits = {init.name: init for init in proto.graph.initializer}
    for ref in frozen:
        init = inits.get(ref.initializer)
        if init is None or init.raw_data or tuple(init.dims) != ref.shape:
            raise ExportError(f"the traced graph has no empty {ref.shape} initializer {ref.initializer!r} to fill")
    try:
        for ref in frozen:
            inits[ref.initializer].dims[:] = (1, *ref.shape[1:])
            inits[ref.initializer].raw_data = bytes(4 * int(np.prod(ref.shape[1:], dtype=np.int64)))
        onnx.checker.check_model(proto)
    except Exception as exc:  # noqa: BLE001 - protobuf and the checker raise many types
        raise ExportError(f"the traced graph is not a valid ONNX model: {str(exc).splitlines()[0][:200]}") from None
    finally:
        for ref in frozen:
            inits[ref.initializer].ClearField("raw_data")
            inits[ref.initializer].dims[:] = ref.shape


def publish_text_tasks(
    stage: TextTasksStage,
    path: str | os.PathLike,
    *,
    tokenizer_json: str | os.PathLike | None = None,
    int8: bool = False,
    toolkit_version: str = "0.1.0",
    int8_min_agreement: float = INT8_MIN_AGREEMENT,
) -> dict[str, Any]:
    """Seal ``stage``'s graph with its metadata (the tokenizer embedded: it must be the one the
    stage was made with), check it against the stage's torch logits and publish it at ``path``
    (with ``int8``, the int8 copy too); the report.  Raises :class:`ExportError`.

    Once parsed, the graph's bytes are no longer referenced from here: a caller that passes
    its only reference to ``stage`` (``export.formats.export_with_snapshot``) has them freed
    before the file is sealed and loaded, 58 MB less at FedSeIT's fifth task."""
    path = scaffold.check_destination(path)
    scaffold.check_min_agreement(int8_min_agreement)
    tok_meta, vocab = tokenizer_metadata(tokenizer_json if tokenizer_json is not None else default_tokenizer())
    if tok_meta["tokenizer_sha256"] != stage.tokenizer_sha256:
        raise ExportError(
            f"the model was traced with the tokenizer of sha256 {stage.tokenizer_sha256[:16]}..., "
            f"this one is {tok_meta['tokenizer_sha256'][:16]}..."
        )
    labels = [list(row) for row in stage.labels]
    metadata: dict[str, Any] = {
        "format": FORMAT,
        "method": stage.method,
        "task": stage.task,
        "labels": labels,
        "class_names": list(stage.class_names),
        "max_length": stage.max_length,
        "vocab_size": vocab,
        "toolkit_version": str(toolkit_version),
        "quantization": "none",
        **tok_meta,
    }
    try:
        proto = onnx.load_from_string(stage.graph)
    except Exception as exc:  # noqa: BLE001 - protobuf raises its own DecodeError
        raise ExportError(f"the traced graph is not an ONNX model: {str(exc).splitlines()[0][:200]}") from None
    stage = dataclasses.replace(stage, graph=b"")  # the caller's stage may be the bytes' last holder: issue 40
    _check_graph(proto, stage.frozen)
    release_free_memory()  # the checker's copies of the graph, before the file is written
    ids, mask, ref = stage.ids, stage.mask, stage.reference
    with scaffold.staged(path) as (tmp, temps):
        write_chunks(tmp, sealed_chunks(proto, metadata, {r.initializer: r.values() for r in stage.frozen}))
        del proto
        release_free_memory()  # the sealed graph and its bytes, before onnxruntime loads the file
        rt = scaffold.open_written(lambda p: TextTasksRuntime(p, tokenizer=False), tmp, metadata)
        parity = _compare(ref, rt.predict_ids(ids, mask), labels, "fp32", stage.desc)
        report = scaffold.fp32_report(
            path, tmp, {"tasks": len(labels), "labels": labels}, len(ids), stage.desc, parity, rt
        )
        del rt
        rows = (ids, mask, stage.desc)
        int8_fn = _Int8(tmp, metadata, int8_min_agreement, ref, labels, rows) if int8 else None
        return publish_export(tmp, path, temps, report, int8_fn)
