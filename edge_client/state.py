"""The client daemon's crash-recovery state, saved after every update it produces.

One checkpoint (``state_dir/client.npz``, replaced atomically) holds: the federation the
device joined, the task and last round it trained, its frame sequence counter, the
frames sent to it alone (``edge_client.frames``: raw bytes, re-validated by the codec on load), the
learner's state, and the update it sent but has not seen acknowledged (a round
announcement for a later round is the acknowledgement).  A daemon killed at any point
restarts from the last update: it re-sends that update if its round is still open, and
otherwise trains the next round from exactly the state it would have had.  What a learner
keeps on disk across tasks (ConFedMADE: the entries its frames carried) is in
``state_dir/learner/<run>``.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fclcore import checkpoint
from fclcore.checkpoint import CheckpointError, FileBytes

STATE_VERSION = 1
# the client frames are stored under their wire kind's name ("knowledge"), as since the first version
_LEARNER, _FRAMES, _FRAME_TASKS, _UNACKED = "learner/", "knowledge/", "knowledge_tasks", "unacked"


@dataclass
class ClientState:
    client_id: str
    federation: dict  # FederationSpec as sent by the aggregator
    task: int
    done_round: int
    sequence: int
    # task -> the task's first client frame, raw: bytes, or (the daemon's) a file of the state directory, ``spill``
    frames: dict[int, bytes | FileBytes] = field(default_factory=dict)
    unacked: bytes | None = None  # the last update's payload, until a later round is announced
    learner_meta: dict = field(default_factory=dict)
    learner_arrays: dict[str, np.ndarray] = field(default_factory=dict)
    input_dim: int = 0
    run: str = ""  # the run of the federation this device belongs to (fclcore.runid); "" before runs had ids


class ClientStateStore:
    def __init__(self, state_dir: str | os.PathLike) -> None:
        self.path = Path(state_dir) / "client.npz"

    def spill(self, task: int, raw: bytes) -> FileBytes:
        """Keep task ``task``'s client frame in a file beside the checkpoint instead of in
        memory (written atomically; ``save`` copies it into every checkpoint, which stays the
        one file a restart reads).  A frame is tens of MB by a late task and needed only when its
        task starts or the device restarts."""
        path = self.path.parent / _FRAMES / f"{int(task)}.frame"
        checkpoint.write_atomic(path, raw)
        return FileBytes(path)

    def save(self, state: ClientState) -> None:
        meta = {
            "version": STATE_VERSION,
            "client_id": state.client_id,
            "federation": state.federation,
            "task": state.task,
            "done_round": state.done_round,
            "sequence": state.sequence,
            _FRAME_TASKS: sorted(state.frames),
            "learner": state.learner_meta,
            "input_dim": state.input_dim,
            "run": state.run,
        }
        arrays = {_LEARNER + k: v for k, v in state.learner_arrays.items()}
        arrays.update(
            {
                f"{_FRAMES}{t}": raw if isinstance(raw, FileBytes) else np.frombuffer(raw, np.uint8)
                for t, raw in state.frames.items()
            }
        )
        if state.unacked is not None:
            arrays[_UNACKED] = np.frombuffer(state.unacked, np.uint8)
        checkpoint.save(self.path, meta, arrays)

    def load(self) -> ClientState | None:
        loaded = checkpoint.load_versioned(self.path, STATE_VERSION)
        if loaded is None:
            return None
        meta, arrays = loaded
        try:
            unacked = arrays.get(_UNACKED)
            return ClientState(
                client_id=str(meta["client_id"]),
                federation=dict(meta["federation"]),
                task=int(meta["task"]),
                done_round=int(meta["done_round"]),
                sequence=int(meta["sequence"]),
                frames={int(t): arrays[f"{_FRAMES}{t}"].tobytes() for t in meta[_FRAME_TASKS]},
                unacked=None if unacked is None else unacked.tobytes(),
                learner_meta=dict(meta["learner"]),
                input_dim=int(meta["input_dim"]),
                run=str(meta.get("run", "")),
                learner_arrays={k[len(_LEARNER) :]: v for k, v in arrays.items() if k.startswith(_LEARNER)},
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{self.path}: malformed state ({exc})") from None


def learner_store_dir(state_dir: str | os.PathLike, run: str, fresh: bool = False) -> Path:
    """The directory a learner of run ``run`` keeps its files in (``Learner.store_dir``), under
    ``state_dir/learner``; ``fresh``: a new learner, so the directories of other runs go."""
    root = Path(state_dir) / "learner"
    name = run or "no-run"
    if fresh and root.is_dir():
        for other in root.iterdir():
            if other.name != name:
                shutil.rmtree(other, ignore_errors=True)
    return root / name


def learner_from_state(state_dir: str | os.PathLike) -> tuple[object, ClientState]:
    """The learner of the device whose checkpoint is in ``state_dir``, rebuilt through the
    method registry as a restarted daemon rebuilds it; ValueError if there is none."""
    import methods
    from fclcore.codec import CodecError, decode
    from fclcore.config import from_dict
    from fclcore.schema import FederationSpec

    try:
        state = ClientStateStore(state_dir).load()
        if state is None:
            raise ValueError(f"{state_dir}: no client.npz checkpoint in this directory")
        fed = from_dict(FederationSpec, state.federation, "checkpoint", "federation")
        learner = methods.learner_for(fed, state.input_dim, 0, "checkpoint")
        learner.store_dir = str(learner_store_dir(state_dir, state.run))
        for task in range(state.task + 1):
            raw = state.frames.get(task)
            learner.start_task(task, decode(raw) if raw is not None else None)
        learner.load_state(state.learner_meta, state.learner_arrays)
    except (CheckpointError, CodecError) as exc:
        raise ValueError(f"{state_dir}: {exc}") from None
    return learner, state


def served_from_state(state_dir: str | os.PathLike) -> object:
    """What the device whose checkpoint is in ``state_dir`` serves (a ``fclcore.served``
    description of the checkpointed model); ValueError if there is none."""
    learner, state = learner_from_state(state_dir)
    served = learner.served_model(max(state.task, 0))
    if served is None:
        raise ValueError(f"{state_dir}: the device serves nothing yet")
    return served
