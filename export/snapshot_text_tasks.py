"""The snapshot of a ``text-tasks`` model (format ``fcl-served-text-tasks/1``, described in
``export.snapshot_formats``): a traced graph, the torch logits it must reproduce, and the
frozen tables it names instead of copying (:class:`FrozenRef`).  numpy only."""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from export.snapshot import SnapshotError, meta_int, meta_names, meta_str, no_other_arrays
from fclcore.errors import BadInput
from fclcore.served import check_task_labels

__all__ = ["TEXT_TASKS_FORMAT", "FrozenRef", "TextTasksStage", "encode_text_tasks", "decode_text_tasks"]

TEXT_TASKS_FORMAT = "fcl-served-text-tasks/1"


@dataclass(frozen=True, eq=False)
class FrozenRef:
    """A weight left out of a traced graph (its initializer kept, its bytes cleared) because a
    shipped file holds it (:class:`fclcore.served.FrozenTable`): put back by :meth:`values`."""

    initializer: str
    model_dir: str
    tensor: str
    scale: float
    zero_rows: tuple[int, ...]
    shape: tuple[int, ...]
    sha256: str  # of the float32 little-endian bytes
    array: np.ndarray | None = None  # the device's own copy; None: rebuilt from the source

    def values(self) -> np.ndarray:
        """The weight (float32), rebuilt from ``model_dir`` or the installed MiniLM package's
        directory, whichever gives the recorded hash; SnapshotError if neither does."""
        if self.array is not None:
            return self.array
        dirs = [Path(self.model_dir)]
        try:
            from fclcore.text import default_tokenizer_json

            dirs.append(default_tokenizer_json().parent)
        except BadInput:
            pass
        for d in dirs:
            table = _rebuild(d, self)
            if table is not None and _sha(table) == self.sha256:
                return table
        raise SnapshotError(
            f"no {self.tensor} of sha256 {self.sha256[:16]}... (x {self.scale:g}) in the model.safetensors "
            f"of {' or '.join(map(str, dirs))} (the snapshot names this frozen table instead of copying it)"
        )

    def meta(self) -> dict[str, Any]:
        return {
            "initializer": self.initializer,
            "model_dir": self.model_dir,
            "tensor": self.tensor,
            "scale": self.scale,
            "zero_rows": list(self.zero_rows),
            "shape": list(self.shape),
            "sha256": self.sha256,
        }


def _sha(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a, "<f4").tobytes()).hexdigest()


def _rebuild(model_dir: Path, ref: FrozenRef) -> np.ndarray | None:
    """``ref``'s table from ``model_dir`` (None if that file or tensor is missing or unreadable)."""
    from fclbases.minilm.safetensors import read_safetensors  # numpy only

    try:
        table = read_safetensors(model_dir / "model.safetensors", [ref.tensor])[ref.tensor].astype(np.float32)
    except (OSError, ValueError, KeyError):
        return None
    if table.shape != ref.shape or any(not 0 <= r < len(table) for r in ref.zero_rows):
        return None
    table[list(ref.zero_rows)] = 0.0
    return table * np.float32(ref.scale)


_VERIFIED: dict[tuple, bool] = {}  # FrozenRef source + hash -> whether its source rebuilds it, per process


def _rebuilds(ref: FrozenRef) -> bool:
    key = (ref.model_dir, ref.tensor, ref.scale, ref.zero_rows, ref.sha256)
    if key not in _VERIFIED:
        table = _rebuild(Path(ref.model_dir), ref)
        _VERIFIED[key] = table is not None and _sha(table) == ref.sha256
    return _VERIFIED[key]


@dataclass(frozen=True, eq=False)
class TextTasksStage:
    """A traced text-tasks export before its publication: what ``export.onnx_text_tasks`` checks
    and seals, and what its snapshot holds."""

    graph: bytes  # the unsealed ONNX protobuf
    ids: np.ndarray  # (N, L) int64 parity rows
    mask: np.ndarray  # (N, L) int64 0/1
    reference: np.ndarray  # (N, T, W) float32 torch logits on the rows
    labels: tuple[tuple[int, ...], ...]
    class_names: tuple[str, ...]
    task: int
    max_length: int
    method: str
    vocab_size: int
    tokenizer_sha256: str
    desc: str  # what the parity rows are, e.g. random_tokens:32
    frozen: tuple[FrozenRef, ...] = ()  # initializers whose bytes ``graph`` leaves out
    format = "text-tasks"


def encode_text_tasks(s: TextTasksStage) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    meta = {
        "format": TEXT_TASKS_FORMAT,
        "labels": [list(row) for row in s.labels],
        "class_names": list(s.class_names),
        "task": s.task,
        "max_length": s.max_length,
        "method": s.method,
        "vocab_size": s.vocab_size,
        "tokenizer_sha256": s.tokenizer_sha256,
        "parity": s.desc,
        "frozen": [ref.meta() for ref in s.frozen],
    }
    arrays = {
        "graph": np.frombuffer(s.graph, np.uint8),
        "parity_ids": s.ids,
        "parity_mask": s.mask,
        "reference": s.reference,
    }
    for ref in s.frozen:  # named by its source where that rebuilds it, else copied
        if ref.array is not None and not _rebuilds(ref):
            arrays[f"frozen/{ref.initializer}"] = ref.array
    return meta, arrays


def decode_text_tasks(meta: dict[str, Any], arrays: dict[str, np.ndarray], where: str) -> TextTasksStage:
    graph, ids, mask, ref = arrays["graph"], arrays["parity_ids"], arrays["parity_mask"], arrays["reference"]
    frozen = tuple(_frozen_ref(entry, arrays) for entry in meta.get("frozen", []))
    no_other_arrays(
        arrays, {"graph", "parity_ids", "parity_mask", "reference", *(f"frozen/{r.initializer}" for r in frozen)}
    )
    names = meta_names(meta["class_names"])
    labels = check_task_labels(meta["labels"], len(names))
    vocab, max_length = meta_int(meta["vocab_size"], "vocab_size", 1), meta_int(meta["max_length"], "max_length", 2)
    if graph.dtype != np.uint8 or graph.ndim != 1 or graph.size == 0:
        raise ValueError(f"graph must be non-empty uint8 bytes, got {graph.dtype} {graph.shape}")
    if ids.dtype != np.int64 or ids.ndim != 2 or mask.shape != ids.shape or ids.shape[0] == 0:
        raise ValueError(f"parity_ids and parity_mask must be int64 (N >= 1, L), got {ids.shape} and {mask.shape}")
    if ids.shape[1] > max_length or ids.min() < 0 or ids.max() >= vocab or not np.isin(mask, (0, 1)).all():
        raise ValueError(f"parity rows need L <= {max_length}, ids in [0, {vocab}) and a 0/1 mask")
    want = (len(ids), len(labels), max(len(row) for row in labels))
    if ref.dtype != np.float32 or ref.shape != want:
        raise ValueError(f"reference must be float32 {want} (rows, tasks, most labels), got {ref.dtype} {ref.shape}")
    for t, row in enumerate(labels):
        if not np.isfinite(ref[:, t, : len(row)]).all() or not (ref[:, t, len(row) :] == -np.inf).all():
            raise ValueError(f"reference logits of task {t} must be finite in its {len(row)} columns, -inf after them")
    task = meta_int(meta["task"], "task")
    if task != len(labels) - 1:
        raise ValueError(f"task must be the last of the {len(labels)} tasks, got {task}")
    return TextTasksStage(
        graph=graph.tobytes(),
        ids=ids,
        mask=mask,
        reference=ref,
        labels=labels,
        class_names=names,
        task=task,
        max_length=max_length,
        method=meta_str(meta["method"], "method"),
        vocab_size=vocab,
        tokenizer_sha256=meta_str(meta["tokenizer_sha256"], "tokenizer_sha256"),
        desc=str(meta.get("parity", f"snapshot:{len(ids)}")),
        frozen=frozen,
    )


def _frozen_ref(entry: Any, arrays: dict[str, np.ndarray]) -> FrozenRef:
    if not isinstance(entry, dict):
        raise ValueError(f"frozen entries must be objects, got {entry!r}")
    shape = tuple(meta_int(d, "frozen shape", 1) for d in entry["shape"])
    scale = entry["scale"]
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not np.isfinite(scale):
        raise ValueError(f"frozen scale must be a finite number, got {scale!r}")
    ref = FrozenRef(
        meta_str(entry["initializer"], "frozen initializer"),
        meta_str(entry["model_dir"], "frozen model_dir"),
        meta_str(entry["tensor"], "frozen tensor"),
        float(scale),
        tuple(meta_int(r, "frozen zero_rows") for r in entry["zero_rows"]),
        shape,
        meta_str(entry["sha256"], "frozen sha256"),
    )
    stored = arrays.get(f"frozen/{ref.initializer}")
    if stored is None:
        return ref
    if stored.dtype != np.float32 or stored.shape != shape or _sha(stored) != ref.sha256:
        raise ValueError(
            f"array frozen/{ref.initializer} is not the float32 {shape} table of sha256 {ref.sha256[:16]}..."
        )
    return dataclasses.replace(ref, array=stored)
