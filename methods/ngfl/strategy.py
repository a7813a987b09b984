"""The NGFL aggregator: keeps the global task alignment table, aligns uploaded head rows by
label and fuses them (NumPy only).

Each round: the extractor becomes the unweighted mean of the senders' extractors (notes G7;
a round of skip notices only keeps it); the round's new labels are appended to the global
table (sorted by string) and every row is fused from the senders whose mask holds it
(``methods.ngfl.fusion``).  Under pre-alignment the labels devices announce are appended
afterwards as *pending* rows (zero), which reach every device with the next round's table
and stay out of the softmax of devices that do not hold them until fused once (G9).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from fclcore.aggregation import RunningSum
from fclcore.codec import Frame, SparseTensor, Tensor
from fclcore.schema import FederationSpec
from fclcore.sparsify import DELTA, Compression, TrueModel, checked_delta, mean_change
from fclcore.strategy import Checked, Rejected, Strategy, Update, tensor_nbytes, without_tensors
from methods.ngfl.config import NGFLOptions
from methods.ngfl.fusion import HeadUpload, fuse_heads
from methods.ngfl.table import MAX_LABELS, GlobalTable, TableError, UploadTable, check_labels
from methods.ngfl.wire import (
    COMPRESSION,
    EXTRACTOR,
    HEAD_B,
    HEAD_W,
    META,
    ROWS_B,
    ROWS_W,
    extractor_shapes,
    initial_extractor,
)

TRUE = "true/"  # checkpoint prefix of the extractor the deltas add up to (the downlink's residual)


@dataclass(frozen=True)
class Parsed:
    """An accepted update's NGFL view: its head rows (None for a skip notice) and announced labels."""

    head: HeadUpload | None
    announce: tuple[str, ...]


class NGFLStrategy(Strategy):
    min_samples = 0  # a skip notice trains nothing
    streams = True  # the extractor is a plain mean, folded as updates arrive; head rows are kept for fusion

    def __init__(self, fed: FederationSpec, options: NGFLOptions, input_dim: int, aux_dir: str | None = None) -> None:
        super().__init__(fed, options, input_dim)
        self.o = options
        self.shapes = extractor_shapes(input_dim, options.hidden)
        self.dim = options.hidden[-1]
        self.table = GlobalTable()
        self.rejected_tables = 0
        self.compression = Compression.of(fed.wire, COMPRESSION)
        on = self.compression.up_density is not None or self.compression.down_density is not None
        self.true = TrueModel(self.compression.down_density, fed.wire.error_feedback) if on else None

    @property
    def dense_fp32_bytes(self) -> int:
        """The extractor and a full head of the global table's rows, in float32."""
        extractor = sum(int(np.prod(s)) for s in self.shapes.values())
        return 4 * (extractor + len(self.table.labels) * (self.dim + 1))

    def initial_model(self) -> dict[str, np.ndarray]:
        return initial_extractor(self.input_dim, self.o.hidden, self.fed.seed)

    def fits(self, params: dict[str, np.ndarray]) -> bool:
        head = {k: v.shape for k, v in params.items() if k in (HEAD_W, HEAD_B)}
        extractor = {k: v.shape for k, v in params.items() if k not in head}
        if extractor != self.shapes:
            return False
        if not head:
            return True
        w, b = head.get(HEAD_W), head.get(HEAD_B)
        return w is not None and b is not None and len(w) == 2 and w[1] == self.dim and b == (w[0],)

    def announce_meta(self, rnd: int) -> dict:
        return {META: {"table": self.table.to_meta()}}

    def bytes_by_kind(self, tensors: Mapping[str, Tensor], meta: Mapping | None = None) -> dict[str, int]:
        out = {"extractor": 0, "head": 0}
        for name, t in tensors.items():
            out["extractor" if name.startswith(EXTRACTOR) else "head"] += tensor_nbytes(t)
        ngfl = (meta or {}).get(META)
        table = ngfl.get("table") if isinstance(ngfl, dict) else None
        out["table"] = len(json.dumps(table, separators=(",", ":"))) if table is not None else 0
        return out

    # -- one update ------------------------------------------------------------------------
    def normalize(self, frame: Frame) -> Checked:
        meta = frame.meta.get(META)
        if not isinstance(meta, dict):
            raise Rejected("table", f"meta.{META}: expected an object, got {type(meta).__name__}")
        try:
            announce = check_labels(meta.get("announce", []), "announce")
        except TableError as exc:
            raise Rejected(exc.reason, str(exc)) from None
        if meta.get("skip") is True:
            if frame.tensors or frame.meta.get("n_samples") != 0:
                raise Rejected("table", "a skip notice carries no tensors and n_samples 0")
            return Checked({}, Parsed(None, announce))
        density = self.compression.up_density
        extractor = {name + DELTA: shape for name, shape in self.shapes.items()} if density else self.shapes
        if set(frame.tensors) != {*extractor, ROWS_W, ROWS_B}:
            names = {*extractor, ROWS_W, ROWS_B}
            missing, extra = sorted(names - set(frame.tensors)), sorted(set(frame.tensors) - names)
            raise ValueError(f"tensors: missing {missing[:3]}, unexpected {extra[:3]}")
        tensors: dict[str, Tensor] = {}
        for name, tensor in frame.tensors.items():
            if density and name in extractor:
                tensors[name] = checked_delta(name[: -len(DELTA)], tensor, extractor[name], density)
                continue
            if isinstance(tensor, SparseTensor):
                raise ValueError(f"{name}: expected a dense tensor")
            tensors[name] = np.asarray(tensor, np.float32)
            if name in extractor and tensors[name].shape != extractor[name]:
                raise ValueError(f"{name}: shape {tensors[name].shape}, expected {extractor[name]}")
        w, b = tensors[ROWS_W], tensors[ROWS_B]
        if w.ndim != 2 or w.shape[1] != self.dim or b.shape != (w.shape[0],):
            raise ValueError(f"{ROWS_W}, {ROWS_B}: expected (rows, {self.dim}) and (rows,), got {w.shape}, {b.shape}")
        try:
            table = UploadTable.parse(meta.get("table"), w.shape[0])
            head = HeadUpload(frame.header.client, table, w, b)
        except TableError as exc:
            raise Rejected(exc.reason, str(exc)) from None
        grown = len(self.table.labels) + len((set(table.labels) | set(announce)) - set(self.table.labels))
        if grown > MAX_LABELS:
            raise Rejected("table", f"labels: the global head would have {grown} rows, at most {MAX_LABELS}")
        return Checked(tensors, Parsed(head, announce))

    # -- the round -------------------------------------------------------------------------
    def running_sum(self, current: Mapping[str, np.ndarray]) -> RunningSum:
        return RunningSum(self.shapes)  # the extractor only: the head is fused from its rows at close

    def fold(self, running: RunningSum, update: Update) -> Update:
        """A sender's extractor joins the unweighted mean; its head rows stay in ``parsed``."""
        if update.parsed.head is not None:
            suffix = DELTA if self.compression.up_density else ""
            running.add({name: update.tensors[name + suffix] for name in self.shapes}, 1.0)
        return without_tensors(update)

    def close(self, running: RunningSum, kept: Sequence[Update], current: dict[str, np.ndarray]) -> dict:
        rnd = kept[0].frame.header.round if kept else 0
        senders = [u for u in sorted(kept, key=lambda u: u.client) if u.parsed.head is not None]
        params = {k: v for k, v in current.items() if k not in (HEAD_W, HEAD_B)}
        if self.true is not None:
            params.update(self._announced(running, bool(senders), {n: current[n] for n in self.shapes}))
        elif senders:
            params.update(running.result({name: current[name] for name in self.shapes}))
        weight = current.get(HEAD_W, np.zeros((0, self.dim), np.float32))
        bias = current.get(HEAD_B, np.zeros(0, np.float32))
        weight, bias = fuse_heads(
            self.table,
            weight,
            bias,
            [u.parsed.head for u in senders],
            rnd,
            self.o.fusion,
            literal=self.o.literal_eq10,
        )
        if self.o.alignment == "pre":  # the round's announced labels sorted, each credited to its first announcer
            firsts: dict[str, str] = {}
            for u in sorted(kept, key=lambda u: u.client):
                for label in u.parsed.announce:
                    firsts.setdefault(label, u.client)
            added: list[str] = []
            for label in sorted(firsts):
                added += self.table.extend([label], rnd, firsts[label], pending=True)
            weight = np.concatenate([weight, np.zeros((len(added), self.dim), np.float32)])
            bias = np.concatenate([bias, np.zeros(len(added), np.float32)])
        if len(self.table.labels):
            params[HEAD_W], params[HEAD_B] = weight, bias
        return params

    def _announced(self, running: RunningSum, sent: bool, current: Mapping[str, np.ndarray]) -> dict:
        """The extractor to announce under compression: the deltas' mean (or the plain mean's
        change, uplink off) added to the true extractor, and the announced one moved towards it."""
        plain = None if not sent or self.compression.up_density else running.result(current)
        out = {}
        for name, shape in self.shapes.items():
            change = None
            if plain is not None:
                change = plain[name].astype(np.float64) - current[name]
            elif sent:
                change = mean_change(running.sums[name], running.total_weight, shape)
            out[name] = self.true.step(name, current[name], change)
        return out

    # -- restarts --------------------------------------------------------------------------
    def state(self) -> tuple[dict, dict[str, np.ndarray]]:
        return {"table": self.table.to_meta()}, ({} if self.true is None else self.true.state(TRUE))

    def restore(self, meta: dict, arrays: dict[str, np.ndarray]) -> None:
        try:
            self.table = GlobalTable.from_meta(meta.get("table"))
        except TableError as exc:
            raise ValueError(f"ngfl checkpoint: {exc}") from None
        if self.true is not None:
            self.true.restore(arrays, TRUE, self.shapes)
