"""Label-aligned fusion of heterogeneous class heads (NGFL Sec. 4.3; reading notes 3.4 G7, G9).

Each device uploads some rows of its linear head (weight rows and biases) with an
``UploadTable`` naming their labels.  The aggregator first extends the global table with the
round's new labels (sorted by string, each added by the first client in sorted order that
brought it; new rows start at zero, so copies on different devices average cleanly), then
sets each global row from the senders whose mask holds its label:

* ``partial`` (PF): the mask is the classes the sender trained this round (``current``);
* ``total`` (TF): every class the sender has viewed (among the rows it uploaded);
* the row is the mean over those senders; a row nobody sent keeps its previous value.

``literal=True`` is the paper's Eq. 10 as printed: the masked sum divided by every sender of
the round.  It shrinks a row held by k of S senders to k/S of its mean and, under PF, zeroes
every class nobody trained this round (old classes wiped; the notes measured SA-PF falling to
0.198 final accuracy with it), so it is an option, never the default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np

from methods.ngfl.table import GlobalTable, TableError, UploadTable


@dataclass(frozen=True)
class HeadUpload:
    client: str
    table: UploadTable
    weight: np.ndarray  # (rows, d): the uploaded head rows, in ``table.labels`` order
    bias: np.ndarray  # (rows,)

    def __post_init__(self) -> None:
        rows = len(self.table.labels)
        if self.weight.ndim != 2 or self.weight.shape[0] != rows or self.bias.shape != (rows,):
            raise TableError(f"head: {rows} labels for weight {self.weight.shape} and bias {self.bias.shape}")


def extend_for_round(table: GlobalTable, uploads: Sequence[HeadUpload], rnd: int, pending: bool = False) -> list[str]:
    """Add the round's labels the table lacks: sorted by string, each credited to the first
    client (sorted) that brought it.  Returns the labels added."""
    firsts: dict[str, str] = {}
    for u in sorted(uploads, key=lambda u: u.client):
        for label in u.table.labels:
            if table.row(label) is None:
                firsts.setdefault(label, u.client)
    added = []
    for label in sorted(firsts):
        added += table.extend([label], rnd, firsts[label], pending=pending)
    return added


def fuse_heads(
    table: GlobalTable,
    weight: np.ndarray,
    bias: np.ndarray,
    uploads: Sequence[HeadUpload],
    rnd: int,
    mode: Literal["partial", "total"] = "partial",
    literal: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """The global head after this round (``table`` is extended in place and its fused rows
    stop being pending).  ``weight`` (R, d) and ``bias`` (R,) are the head before the round, in
    the table's row order."""
    if weight.shape[0] != len(table.labels) or bias.shape != (len(table.labels),):
        raise ValueError(f"head: {weight.shape[0]} rows for a table of {len(table.labels)} labels")
    extend_for_round(table, uploads, rnd)
    grow = len(table.labels) - weight.shape[0]
    weight = np.concatenate([weight, np.zeros((grow, weight.shape[1]), weight.dtype)]).astype(np.float64)
    bias = np.concatenate([bias, np.zeros(grow, bias.dtype)]).astype(np.float64)
    total_w, total_b = np.zeros_like(weight), np.zeros_like(bias)
    senders = np.zeros(len(table.labels))
    for u in uploads:
        mask = set(u.table.current if mode == "partial" else u.table.viewed)
        for i, label in enumerate(u.table.labels):
            if label in mask:
                row = table.row(label)
                total_w[row] += u.weight[i]
                total_b[row] += u.bias[i]
                senders[row] += 1
    if literal:  # Eq. 10: every row divided by all of the round's senders
        weight, bias = total_w / max(1, len(uploads)), total_b / max(1, len(uploads))
    else:
        sent = senders > 0
        weight[sent] = total_w[sent] / senders[sent, None]
        bias[sent] = total_b[sent] / senders[sent]
    table.fused(label for label, n in zip(table.labels, senders) if n > 0)
    return weight.astype(np.float32), bias.astype(np.float32)
