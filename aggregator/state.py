"""The aggregator's crash-recovery state: one committed checkpoint plus a journal of the open round.

Layout of ``state_dir``::

    committed.npz          last committed round: global model, strategy state (knowledge
                           base), per-device sequence high-water marks, metrics offset
    open/<round>__<bytes>__<client>.frame
                           updates accepted in the round in progress, as received (raw,
                           possibly signed payloads), one file each, written atomically

A round commits by writing ``committed.npz`` (atomic rename) and then clearing ``open/``.
A crash before the rename replays the round from the journal; a crash after it, before
the journal is cleared, leaves journal files of a committed round, which are recognised by
their round number and discarded.  So an accepted update is never lost and never counted
twice.  Nothing here is unpickled: payloads are re-checked by the inbox like any message.

Clearing is one rename of ``open/`` to ``cleared.<n>/``; a background thread deletes the
renamed directories (one per round), since unlinking a thousand journal files took 2.5 s on
the benchmark machine's disk and nothing waits for it.  A directory a crash leaves behind is
deleted by the next start; its files are never read.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fclcore import checkpoint
from fclcore.checkpoint import CheckpointError

STATE_VERSION = 1
_GLOBAL = "global/"
_CLEARED = "cleared."  # prefix of journal directories waiting to be deleted
_clear_count = itertools.count()


@dataclass
class Committed:
    """What a restarted aggregator needs to continue after ``round`` (-1: nothing committed)."""

    fingerprint: str
    round: int = -1
    sequence: int = 0
    last_seq: dict[str, int] = field(default_factory=dict)
    rejections: dict[str, int] = field(default_factory=dict)
    metrics_offset: int = 0
    strategy: dict = field(default_factory=dict)
    global_params: dict[str, np.ndarray] = field(default_factory=dict)
    strategy_arrays: dict[str, np.ndarray] = field(default_factory=dict)
    clients: dict = field(default_factory=dict)  # the live client set (aggregator.clients.ClientSet.state)
    run_id: str = ""  # this run's identity (fclcore.runid); "" in a checkpoint written before runs had one


def fingerprint(federation: dict, input_dim: int) -> str:
    """What must not change between a checkpoint and the config that resumes it (not the
    client list: devices enroll and leave, and the committed state carries the live set)."""
    text = json.dumps({"federation": federation, "input_dim": input_dim}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class StateStore:
    def __init__(self, state_dir: str | os.PathLike) -> None:
        self.dir = Path(state_dir)
        self.open_dir = self.dir / "open"
        self.path = self.dir / "committed.npz"
        self._lock = threading.Lock()
        self._sweeper: threading.Thread | None = None  # deleting cleared journals
        self._more = False  # a journal was cleared while the sweeper ran: look again

    def load(self) -> Committed | None:
        """The last committed state, None if there is none; CheckpointError if unusable."""
        loaded = checkpoint.load_versioned(self.path, STATE_VERSION)
        if loaded is None:
            return None
        meta, arrays = loaded
        try:
            state = Committed(
                fingerprint=str(meta["fingerprint"]),
                round=int(meta["round"]),
                sequence=int(meta["sequence"]),
                last_seq={str(k): int(v) for k, v in meta["last_seq"].items()},
                rejections={str(k): int(v) for k, v in meta["rejections"].items()},
                metrics_offset=int(meta["metrics_offset"]),
                strategy=dict(meta["strategy"]),
                clients=dict(meta.get("clients", {})),
                run_id=str(meta.get("run_id", "")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"{self.path}: malformed metadata ({exc})") from None
        state.global_params = {k[len(_GLOBAL) :]: v for k, v in arrays.items() if k.startswith(_GLOBAL)}
        state.strategy_arrays = {k: v for k, v in arrays.items() if not k.startswith(_GLOBAL)}
        return state

    def commit(self, state: Committed) -> None:
        meta = {
            "version": STATE_VERSION,
            "fingerprint": state.fingerprint,
            "round": state.round,
            "sequence": state.sequence,
            "last_seq": state.last_seq,
            "rejections": state.rejections,
            "metrics_offset": state.metrics_offset,
            "strategy": state.strategy,
            "clients": state.clients,
            "run_id": state.run_id,
        }
        arrays = {_GLOBAL + k: v for k, v in state.global_params.items()}
        if set(arrays) & set(state.strategy_arrays):
            raise ValueError("strategy array names collide with the global model's")
        checkpoint.save(self.path, meta, {**arrays, **state.strategy_arrays})
        self.clear_journal()

    # -- the open round's journal -------------------------------------------------------
    def journal(self, rnd: int, client: str, payload: bytes, packet_bytes: int) -> None:
        checkpoint.write_atomic(self.open_dir / f"{rnd}__{packet_bytes}__{client}.frame", payload)

    def journaled(self, rnd: int) -> list[tuple[str, bytes, int]]:
        """(client, payload, packet bytes) accepted in round ``rnd`` before a restart; files of
        any other round (left by a crash between a commit and the journal's clearing) go."""
        out = []
        if any(self.dir.glob(f"{_CLEARED}*")):  # left by a crash: delete them, they are never read
            self.sweep()
        if not self.open_dir.exists():
            return out
        for path in sorted(self.open_dir.iterdir()):
            parts = path.name.removesuffix(".frame").split("__", 2)
            if len(parts) == 3 and parts[0].isdigit() and parts[1].isdigit() and int(parts[0]) == rnd:
                out.append((parts[2], path.read_bytes(), int(parts[1])))
            else:
                path.unlink(missing_ok=True)
        return sorted(out)

    def clear_journal(self) -> None:
        """Empty the journal: ``open/`` is renamed away now, its files deleted in the background."""
        if self.open_dir.exists():
            os.replace(self.open_dir, self.dir / f"{_CLEARED}{os.getpid()}.{next(_clear_count)}")
            self.sweep()

    def sweep(self) -> None:
        """Delete cleared journals (this store's and any a crash left) on a background thread."""
        with self._lock:
            if self._sweeper is not None:
                self._more = True
                return
            self._sweeper = threading.Thread(target=self._sweep, name="journal-sweep", daemon=True)
            self._sweeper.start()

    def wait_swept(self, timeout: float | None = None) -> bool:
        """Wait for the background deletion; True when nothing is left to delete."""
        with self._lock:
            sweeper = self._sweeper
        if sweeper is not None:
            sweeper.join(timeout)
        return not sweeper or not sweeper.is_alive()

    def _sweep(self) -> None:
        while True:
            for path in self.dir.glob(f"{_CLEARED}*"):
                shutil.rmtree(path, ignore_errors=True)
            with self._lock:
                if not self._more:
                    self._sweeper = None
                    return
                self._more = False
