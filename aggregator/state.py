"""The aggregator's crash-recovery state: one committed checkpoint plus a journal of the open round.

Layout of ``state_dir``::

    committed.npz          last committed round: global model, strategy state (what the
                           method keeps across rounds), per-device sequence high-water marks,
                           metrics offset
    open/<round>.journal   updates accepted in the round in progress (in the journal of
                           round ``total_rounds``: the final evaluations), as received (raw,
                           possibly signed payloads), appended one record each

A round commits by writing ``committed.npz`` (atomic rename) and then clearing ``open/``.
A crash before the rename replays the round from the journal; a crash after it, before
the journal is cleared, leaves the journal of a committed round, which is recognised by
its round number and discarded.  So an accepted update is never counted twice.  Nothing
here is unpickled: payloads are re-checked by the inbox like any message.

Group commit.  A record is written to the file at once (unbuffered: a killed process loses
nothing that was appended), but made durable with one ``fdatasync`` for a group of records
(``sync``: the service calls it when its queue runs dry and every ``SYNC_EVERY`` records),
not one per record: two fsyncs per update had capped one aggregator at about 120 updates a
second over MQTT (``benchmarks/bench_round_close.py``).  A power cut can lose the records
since the last sync, or leave a torn last record; a torn or corrupt tail is cut off when
the journal is read (each record carries its CRC32), and the devices whose updates went are
asked to re-send like any device that is missing from a round.

Record: ``b"FJ"``, client id (u8 length + UTF-8), packet bytes (u32), payload (u32 length +
bytes), CRC32 of all of the above (u32); little-endian.

Clearing is one rename of ``open/`` to ``cleared.<n>/``; a background thread deletes the
renamed directories, and a directory a crash leaves behind is deleted by the next start;
its files are never read.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fclcore import checkpoint
from fclcore.checkpoint import CheckpointError, fsync_dir
from fclcore.crc import crc32

STATE_VERSION = 1
_GLOBAL = "global/"
_CLEARED = "cleared."  # prefix of journal directories waiting to be deleted
_clear_count = itertools.count()
SYNC_EVERY = 256  # records appended before a sync even while updates keep coming
_MAGIC = b"FJ"
_U32 = struct.Struct("<I")


@dataclass
class Committed:
    """What a restarted aggregator needs to continue after ``round`` (-1: no round yet, only
    the run's identity, committed when a new run starts)."""

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
        self._journal: tuple[int, object] | None = None  # (round, unbuffered append handle)
        self._unsynced = 0  # records appended since the last sync

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
        """Append one accepted update to round ``rnd``'s journal (durable at the next ``sync``)."""
        name = client.encode("utf-8")
        if len(name) > 255:
            raise ValueError(f"journal: client id longer than 255 bytes: {client[:40]!r}...")
        head = b"".join((_MAGIC, bytes([len(name)]), name, _U32.pack(packet_bytes), _U32.pack(len(payload))))
        handle = self._journal_file(rnd)
        for part in (head, payload, _U32.pack(crc32(payload, crc32(head)))):  # the payload is not copied
            handle.write(part)  # a kill between two writes leaves a torn record: cut off on reading
        self._unsynced += 1
        if self._unsynced >= SYNC_EVERY:
            self.sync()

    def sync(self) -> None:
        """Make every record appended so far durable (one fdatasync); a no-op when there are none."""
        if self._unsynced and self._journal is not None:
            getattr(os, "fdatasync", os.fsync)(self._journal[1].fileno())
        self._unsynced = 0

    def journaled(self, rnd: int) -> list[tuple[str, bytes, int]]:
        """(client, payload, packet bytes) accepted in round ``rnd`` before a restart; journals
        of any other round (left by a crash between a commit and the journal's clearing) go,
        and a torn or corrupt tail of this one is cut off so new records follow whole ones."""
        out = []
        if any(self.dir.glob(f"{_CLEARED}*")):  # left by a crash: delete them, they are never read
            self.sweep()
        if not self.open_dir.exists():
            return out
        mine = self._journal_path(rnd)
        for path in self.open_dir.iterdir():
            if path != mine:
                self._close_journal(sync=False)
                path.unlink(missing_ok=True)
        if mine.exists():
            data = mine.read_bytes()
            records, end = _parse_journal(data)
            if end < len(data):
                self._close_journal(sync=False)
                with open(mine, "r+b") as handle:
                    handle.truncate(end)
                    os.fsync(handle.fileno())
            out = records
        return sorted(out)

    def journaled_clients(self, rnd: int) -> list[str]:
        """The clients whose records of round ``rnd`` are whole, read without changing anything
        (another process's journal, say: a running service's)."""
        path = self._journal_path(rnd)
        return sorted(client for client, _, _ in _parse_journal(path.read_bytes())[0]) if path.exists() else []

    def clear_journal(self) -> None:
        """Empty the journal: ``open/`` is renamed away now, its files deleted in the background."""
        self._close_journal(sync=False)  # the commit before this is what is durable now
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

    def close(self) -> None:
        """Sync and close the journal (a service stopping with its round still open)."""
        self._close_journal(sync=True)

    def _journal_path(self, rnd: int) -> Path:
        return self.open_dir / f"{int(rnd)}.journal"

    def _journal_file(self, rnd: int):
        if self._journal is not None and self._journal[0] == rnd:
            return self._journal[1]
        self._close_journal(sync=True)
        path = self._journal_path(rnd)
        fresh = not path.exists()
        path.parent.mkdir(parents=True, exist_ok=True)
        handle = open(path, "ab", buffering=0)  # held open for the round, appended to per update
        if fresh:
            fsync_dir(path.parent)  # the file's name is durable once; its records at each sync
        self._journal = (rnd, handle)
        return handle

    def _close_journal(self, sync: bool) -> None:
        if self._journal is not None:
            if sync:
                self.sync()
            self._journal[1].close()
            self._journal, self._unsynced = None, 0

    def _sweep(self) -> None:
        while True:
            for path in self.dir.glob(f"{_CLEARED}*"):
                shutil.rmtree(path, ignore_errors=True)
            with self._lock:
                if not self._more:
                    self._sweeper = None
                    return
                self._more = False


def _parse_journal(data: bytes) -> tuple[list[tuple[str, bytes, int]], int]:
    """The whole records at the start of ``data`` and where they end (a torn or corrupt record
    and everything after it are not read)."""
    out, pos = [], 0
    view = memoryview(data)
    while pos + 3 <= len(data) and data[pos : pos + 2] == _MAGIC:
        name_end = pos + 3 + data[pos + 2]
        if name_end + 8 > len(data):
            break
        packet_bytes = _U32.unpack_from(data, name_end)[0]
        end = name_end + 8 + _U32.unpack_from(data, name_end + 4)[0]
        if end + 4 > len(data) or _U32.unpack_from(data, end)[0] != crc32(view[pos:end]):
            break
        try:
            client = str(view[pos + 3 : name_end], "utf-8")
        except UnicodeDecodeError:
            break
        out.append((client, bytes(view[name_end + 8 : end]), packet_bytes))
        pos = end + 4
    return out, pos
