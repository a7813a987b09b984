"""The double-ended task alignment table (NGFL Sec. 4.2.1; reading notes 3.4 G6, G9, G13, G14).

* ``GlobalTable`` (the aggregator's end): class labels in head-row order, append-only, with the
  round each row was added in and by whom, a version that grows with every change, and (with
  pre-alignment) the rows announced but not yet fused (``pending``).
* ``DeviceTable`` (the device's end): the same slots for the rows of its own head, the classes
  it trains this round (``current``), every class it has viewed, and its task history, which
  never leaves the device.  On download it adopts the global order and re-appends its own
  classes the aggregator lacks; on a new task it classifies coverage and grows.
* ``UploadTable``: what a device sends with its head (labels of the uploaded rows in order,
  current and viewed classes, the global version it started from), parsed from JSON metadata
  and validated; labels are opaque strings, never pickled.

Coverage of a task against the classes the device knows from the aggregator (Eqs. 6-8, with
notes G6): ``full`` (a subset, or equal), ``semi`` (they overlap, not a subset), ``none``.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, Sequence

MAX_LABELS = 1024  # rows of one head at most
MAX_LABEL_CHARS = 64

Coverage = Literal["full", "semi", "none"]


class TableError(ValueError):
    """A table that must be rejected; ``reason`` is the counted reason (``table``)."""

    reason = "table"


def check_label(value: Any) -> str:
    """A class label: a string of 1-64 printable characters, NFC-normalised."""
    if not isinstance(value, str):
        raise TableError(f"labels: expected strings, got {type(value).__name__}")
    label = unicodedata.normalize("NFC", value)
    if not 1 <= len(label) <= MAX_LABEL_CHARS or not label.isprintable():
        raise TableError(f"labels: expected 1-{MAX_LABEL_CHARS} printable characters, got {value!r}"[:120])
    return label


def check_labels(values: Any, what: str = "labels") -> tuple[str, ...]:
    """A list of distinct labels, at most ``MAX_LABELS``."""
    if not isinstance(values, (list, tuple)):
        raise TableError(f"{what}: expected a list of strings, got {type(values).__name__}")
    if len(values) > MAX_LABELS:
        raise TableError(f"{what}: {len(values)} labels, at most {MAX_LABELS}")
    labels = tuple(check_label(v) for v in values)
    if len(set(labels)) != len(labels):
        dup = sorted({v for v in labels if labels.count(v) > 1})
        raise TableError(f"{what}: duplicate labels {dup[:3]}")
    return labels


def coverage(task: Iterable[str], known: Iterable[str]) -> Coverage:
    """How the aggregator's classes ``known`` cover a new task (Eqs. 6-8, notes G6)."""
    task, known = set(task), set(known)
    if task <= known:
        return "full"
    return "semi" if task & known else "none"


@dataclass
class GlobalTable:
    labels: list[str] = field(default_factory=list)  # head rows, in order
    added: list[tuple[int, str]] = field(default_factory=list)  # per row: (round added, by whom)
    version: int = 0
    pending: set[str] = field(default_factory=set)  # announced (pre-alignment), not yet fused

    def __post_init__(self) -> None:
        self.index = {label: row for row, label in enumerate(self.labels)}

    def row(self, label: str) -> int | None:
        return self.index.get(label)

    def extend(self, labels: Iterable[str], rnd: int, by: str, pending: bool = False) -> list[str]:
        """Append the labels not yet in the table, sorted by string (the order is then the same
        whoever brought them); returns the labels added."""
        new = sorted({check_label(v) for v in labels} - set(self.index))
        if len(self.labels) + len(new) > MAX_LABELS:
            raise TableError(
                f"labels: the global head would have {len(self.labels) + len(new)} rows, at most {MAX_LABELS}"
            )
        for label in new:
            self.index[label] = len(self.labels)
            self.labels.append(label)
            self.added.append((rnd, by))
        if pending:
            self.pending |= set(new)
        if new:
            self.version += 1
        return new

    def fused(self, labels: Iterable[str]) -> None:
        """Rows that have been fused once stop being pending."""
        done = self.pending & set(labels)
        if done:
            self.pending -= done
            self.version += 1

    def to_meta(self) -> dict:
        return {
            "labels": list(self.labels),
            "added": [[r, by] for r, by in self.added],
            "version": self.version,
            "pending": sorted(self.pending),
        }

    @classmethod
    def from_meta(cls, meta: Any) -> "GlobalTable":
        """Parse (and validate) a table sent down; TableError if it is malformed."""
        if not isinstance(meta, dict):
            raise TableError("table: expected {labels, added, version, pending}")
        labels = check_labels(meta.get("labels"))
        added, version, pending = meta.get("added"), meta.get("version"), meta.get("pending", [])
        if not isinstance(added, list) or len(added) != len(labels):
            raise TableError("table.added: expected one [round, by] per label")
        slots = []
        for item in added:
            if not (isinstance(item, list) and len(item) == 2 and _is_int(item[0]) and isinstance(item[1], str)):
                raise TableError(f"table.added: expected [round, client], got {item!r}"[:120])
            slots.append((int(item[0]), item[1]))
        if not _is_int(version) or version < 0:
            raise TableError(f"table.version: expected an int >= 0, got {version!r}"[:120])
        pending_labels = set(check_labels(pending, "table.pending"))
        if not pending_labels <= set(labels):
            raise TableError("table.pending: labels outside the table")
        return cls(list(labels), slots, int(version), pending_labels)


@dataclass(frozen=True)
class UploadTable:
    """A device's table as uploaded with its head rows."""

    labels: tuple[str, ...]  # of the uploaded head rows, in order
    current: tuple[str, ...]  # the classes trained this round (partial fusion's mask)
    viewed: tuple[str, ...]  # every class the device has trained (total fusion's mask)
    base_version: int  # the global table version the device started the round from

    def to_meta(self) -> dict:
        return {
            "labels": list(self.labels),
            "current": list(self.current),
            "viewed": list(self.viewed),
            "base_version": self.base_version,
        }

    @classmethod
    def parse(cls, meta: Any, head_rows: int) -> "UploadTable":
        """Validate an uploaded table against the number of head rows that came with it."""
        if not isinstance(meta, dict):
            raise TableError("table: expected {labels, current, viewed, base_version}")
        labels = check_labels(meta.get("labels"))
        if len(labels) != head_rows:
            raise TableError(f"table.labels: {len(labels)} labels for {head_rows} head rows")
        current = check_labels(meta.get("current"), "table.current")
        viewed = check_labels(meta.get("viewed"), "table.viewed")
        outside = sorted(set(current) - set(labels))
        if outside:
            raise TableError(f"table.current: classes outside the uploaded labels {outside[:3]}")
        if not set(current) <= set(viewed):
            raise TableError("table.current: classes the device has not viewed")
        version = meta.get("base_version")
        if not _is_int(version) or version < 0:
            raise TableError(f"table.base_version: expected an int >= 0, got {version!r}"[:120])
        return cls(labels, current, viewed, int(version))


@dataclass
class DeviceTable:
    """The device's end: its head rows' labels and slots, what it trains now, what it has viewed."""

    client: str
    labels: list[str] = field(default_factory=list)
    added: list[tuple[int, str]] = field(default_factory=list)
    current: list[str] = field(default_factory=list)
    viewed: list[str] = field(default_factory=list)
    history: list[list[str]] = field(default_factory=list)  # its own tasks, in order: never uploaded
    base_version: int = 0
    known: set[str] = field(default_factory=set)  # classes the aggregator's table held at the last download

    def row(self, label: str) -> int:
        return self.labels.index(label)

    def to_meta(self) -> dict:
        """Everything, task history included, for the device's own checkpoint (never uploaded)."""
        return {
            "client": self.client,
            "labels": list(self.labels),
            "added": [[r, by] for r, by in self.added],
            "current": list(self.current),
            "viewed": list(self.viewed),
            "history": [list(t) for t in self.history],
            "base_version": self.base_version,
            "known": sorted(self.known),
        }

    @classmethod
    def from_meta(cls, meta: Any) -> "DeviceTable":
        """Inverse of ``to_meta``; TableError if the checkpoint's table is malformed."""
        if not isinstance(meta, dict) or not isinstance(meta.get("client"), str):
            raise TableError("device table: expected the object to_meta wrote")
        labels = list(check_labels(meta.get("labels")))
        added = meta.get("added")
        if not isinstance(added, list) or len(added) != len(labels):
            raise TableError("device table.added: expected one [round, by] per label")
        history = meta.get("history")
        if not isinstance(history, list):
            raise TableError("device table.history: expected a list of tasks")
        version = meta.get("base_version")
        if not _is_int(version):
            raise TableError("device table.base_version: expected an int")
        return cls(
            meta["client"],
            labels,
            [(int(r), str(by)) for r, by in added],
            list(check_labels(meta.get("current"), "current")),
            list(check_labels(meta.get("viewed"), "viewed")),
            [list(check_labels(t, "history")) for t in history],
            int(version),
            set(check_labels(meta.get("known"), "known")),
        )

    def adopt(self, table: GlobalTable) -> list[int | None]:
        """Rebuild from the global table, keeping this device's classes the aggregator lacks
        (appended after the global rows, in their old order).  Returns, for each new row, the
        old row it comes from (None: a class new to this device), so the head can be re-indexed."""
        local_only = [(lab, slot) for lab, slot in zip(self.labels, self.added) if table.row(lab) is None]
        old = {lab: row for row, lab in enumerate(self.labels)}
        self.labels = list(table.labels) + [lab for lab, _ in local_only]
        self.added = list(table.added) + [slot for _, slot in local_only]
        self.base_version = table.version
        self.known = set(table.labels)
        return [old.get(lab) for lab in self.labels]

    def start_task(self, task: Sequence[str], rnd: int) -> tuple[Coverage, list[str]]:
        """A new task's classes: coverage against the aggregator's classes, then the missing
        classes are appended (sorted); returns (coverage, labels added)."""
        task_labels = list(check_labels(list(task), "task"))
        if not task_labels:
            raise TableError("task: expected at least one class")
        cover = coverage(task_labels, self.known)
        new = sorted(set(task_labels) - set(self.labels))
        if len(self.labels) + len(new) > MAX_LABELS:
            raise TableError(f"task: the head would have {len(self.labels) + len(new)} rows, at most {MAX_LABELS}")
        self.labels += new
        self.added += [(rnd, self.client)] * len(new)
        self.history.append(task_labels)
        self.current = task_labels
        self.viewed += [lab for lab in task_labels if lab not in self.viewed]
        return cover, new

    def upload(self, partial: bool) -> tuple[UploadTable, list[int]]:
        """The table to send and the head rows it describes: the current classes' rows under
        partial fusion, the rows of every class it has viewed under total fusion (the rows its
        mask holds: other rows would be sent only to be ignored)."""
        viewed = set(self.viewed)
        rows = (
            [self.row(lab) for lab in self.current]
            if partial
            else [r for r, lab in enumerate(self.labels) if lab in viewed]
        )
        labels = tuple(self.labels[r] for r in rows)
        return UploadTable(labels, tuple(self.current), tuple(self.viewed), self.base_version), rows


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
