"""The knowledge-base entries a device holds, kept on disk between task starts.

A knowledge frame names every entry the device is to use for its next task but carries the
tensors only of those the device does not hold yet (``methods.confedmade.wire``).  The
device keeps every entry it receives, one ``fclcore.checkpoint`` file per entry (written
atomically, read with ``allow_pickle=False``) in a directory of its state directory, and
reads back the ones a later frame names without carrying.  Values are kept exactly as they
were decoded, so a stack built from stored entries is bit-identical to one built from a
frame that carries them all.  The first copy of an entry is the one kept: a frame that
carries an entry again is used as it is, and the store does not change (so a restarted
device, which replays its frames in order, builds each task's stack exactly as before).

Without a directory (a learner built outside a daemon: tests, tools) they go to a temporary
directory, removed with the store.  A frame that names an entry neither carried nor held is never completed: ``missing``
names such entries (the daemon then fetches the frame that carries every entry), and
``complete`` raises ``MissingKnowledge``.
"""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

import numpy as np

from fclcore import checkpoint
from fclcore.checkpoint import CheckpointError
from fclcore.codec import Frame, SparseTensor, Tensor
from methods.confedmade.wire import knowledge_key, parse_knowledge_meta

_FORMAT = 1


class MissingKnowledge(ValueError):
    """A knowledge frame names entries the device neither holds nor finds in it."""

    def __init__(self, missing: list[str]) -> None:
        super().__init__(f"entries neither held nor sent: {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
        self.missing = missing


class KnowledgeStore:
    def __init__(self, directory: str | None) -> None:
        self.requested = directory
        self.tmp = tempfile.TemporaryDirectory(prefix="fcl-kb-") if directory is None else None
        self.directory = Path(self.tmp.name if self.tmp is not None else directory)
        self.held: set[str] = set()
        if self.directory.is_dir():
            for path in sorted(self.directory.glob("*.npz")):
                entry = _read_id(path)
                if entry is not None and path.name == _file_name(entry):
                    self.held.add(entry)

    def ids(self) -> list[str]:
        """Every entry held, sorted (what the device declares to the aggregator)."""
        return sorted(self.held)

    def missing(self, frame: Frame | None) -> list[str]:
        """The entries ``frame`` names that it does not carry and the device does not hold."""
        if frame is None:
            return []
        return [e for e in parse_knowledge_meta(frame.meta) if not _carried(frame, e) and e not in self.held]

    def complete(self, frame: Frame | None) -> tuple[Frame | None, list[str]]:
        """(``frame`` with the tensors of every entry it names, the ids it carried itself);
        ``MissingKnowledge`` when one is neither carried nor held (nothing is changed)."""
        if frame is None:
            return None, []
        ids = parse_knowledge_meta(frame.meta)
        carried = [e for e in ids if _carried(frame, e)]
        lacking = self.missing(frame)
        if lacking:
            raise MissingKnowledge(lacking)
        tensors = dict(frame.tensors)
        for entry in ids:
            if entry not in carried:
                try:
                    tensors.update({knowledge_key(entry, w): t for w, t in self._read(entry).items()})
                except (CheckpointError, KeyError, TypeError, ValueError) as exc:
                    self.held.discard(entry)  # unreadable: no longer held (the next frame's check says so)
                    raise MissingKnowledge([entry]) from exc
        return Frame(frame.header, frame.meta, tensors), carried

    def keep(self, frame: Frame, carried: list[str]) -> None:
        """Store the ``carried`` entries of a (validated) frame that are not held yet."""
        for entry in carried:
            if entry in self.held:
                continue
            prefix = entry + "|"
            tensors = {k[len(prefix) :]: t for k, t in frame.tensors.items() if k.startswith(prefix)}
            _write(self.directory / _file_name(entry), entry, tensors)
            self.held.add(entry)

    def _read(self, entry: str) -> dict[str, Tensor]:
        meta, arrays = checkpoint.load(self.directory / _file_name(entry))
        if meta.get("format") != _FORMAT or meta.get("id") != entry:
            raise ValueError(f"knowledge entry {entry}: the file holds {meta.get('id')!r}")
        out: dict[str, Tensor] = {}
        for i, (weight, spec) in enumerate(sorted(meta["tensors"].items())):
            shape = tuple(int(n) for n in spec["shape"])
            if spec["sparse"]:
                out[weight] = SparseTensor(shape, arrays[f"{i}/indices"], arrays[f"{i}/values"])
            else:
                out[weight] = arrays[f"{i}/dense"].reshape(shape)
        return out


def _carried(frame: Frame, entry: str) -> bool:
    prefix = entry + "|"
    return any(k.startswith(prefix) for k in frame.tensors)


def _file_name(entry: str) -> str:
    """A file name for any entry id (ids come from the wire: never a path)."""
    return hashlib.sha256(entry.encode("utf-8")).hexdigest()[:32] + ".npz"


def _write(path: Path, entry: str, tensors: dict[str, Tensor]) -> None:
    specs, arrays = {}, {}
    for i, (weight, t) in enumerate(sorted(tensors.items())):
        sparse = isinstance(t, SparseTensor)
        specs[weight] = {"shape": list(t.shape), "sparse": sparse}
        if sparse:
            arrays[f"{i}/indices"], arrays[f"{i}/values"] = t.indices, t.values
        else:
            arrays[f"{i}/dense"] = np.asarray(t)
    checkpoint.save(path, {"format": _FORMAT, "id": entry, "tensors": specs}, arrays)


def _read_id(path: Path) -> str | None:
    try:
        meta, _ = checkpoint.load(path)
    except CheckpointError:
        return None
    entry = meta.get("id")
    return entry if isinstance(entry, str) and meta.get("format") == _FORMAT else None
