"""The method's learner on this device and the data it learns from: built from the federation
settings of the first round (or rebuilt from a checkpoint), where it is in the schedule (the
task it has started, the last round it trained), what it trains on in a round and what it is
evaluated on.  No broker and no wire here: the daemon hands it frames already checked."""

from __future__ import annotations

import threading
import zlib
from pathlib import Path

import methods
from edge_client.data import float_tasks
from edge_client.frames import ClientFrames
from edge_client.protocol import RejectedFrame, no_tensors
from edge_client.state import ClientState, learner_store_dir
from edge_client.taskdir import TaskDirectory
from fclcore.codec import CodecLimits, Frame, decode
from fclcore.config import to_dict
from fclcore.data import ClientTasks
from fclcore.device import place
from fclcore.device import resolve as resolve_device
from fclcore.learner import Learner
from fclcore.procmem import release_free_memory
from fclcore.schedule import RoundPlace
from fclcore.schema import ClientConfig, FederationSpec

# Learners seed torch's global generator while they build their model: daemons sharing one
# process (fcl simulate --in-process) build one at a time, so each gets the same values as alone.
BUILD_LOCK = threading.Lock()


class DeviceLearner:
    def __init__(self, cfg: ClientConfig, data: ClientTasks, task_dir: TaskDirectory | None, state_dir: Path) -> None:
        """``state_dir``: where the learner's own files go (``learner_store_dir``)."""
        self.cfg = cfg
        self.data = data
        self.task_dir = task_dir
        self.state_dir = state_dir
        self.input_dim: int | None = int(data.train[0].x.shape[1]) if data.train else None
        self.learner: Learner | None = None
        self.fed: FederationSpec | None = None
        self.task = -1  # the last task started
        self.done_round = -1  # the last round trained
        self.run_id: str | None = None  # the run this device belongs to (fclcore.runid); None until its first round
        self.train_device = resolve_device(cfg.train.device)  # ConfigError (exit 2): a CUDA device this machine lacks

    @property
    def client_index(self) -> int:
        """Seeds per-device shuffling: the shard index in a simulation, else from the id."""
        return self.cfg.data.client_index if self.cfg.data else zlib.crc32(self.cfg.client_id.encode()) & 0xFFFF

    @property
    def own_clock(self) -> bool:
        return self.fed is not None and methods.lookup(self.fed.method).own_clock

    def build(self, fed: FederationSpec) -> None:
        """A new learner for ``fed`` (ValueError when the method cannot build one)."""
        with BUILD_LOCK:
            self.learner = methods.learner_for(fed, self.input_dim, self.client_index)
        self.learner.allow_embedding_upload = self.cfg.allow_embedding_upload
        place(self.learner, self.cfg.train.device, self.train_device, self.cfg.train.amp)
        self.learner.fleet_data = self.data.fleet
        self._fit_pixels()

    def forget(self) -> None:
        """Start over (a newer run is joined): no learner, no task started, no round done."""
        self.learner, self.fed, self.task, self.done_round = None, None, -1, -1

    def resume(self, state: ClientState, fed: FederationSpec, limits: CodecLimits) -> None:
        """The learner of a checkpoint: its frames checked, its tasks started again, its state
        loaded.  ValueError (CodecError too) when the checkpoint cannot be resumed."""
        for t, raw in state.frames.items():  # every frame is checked, one at a time
            if t > state.task:
                decode(raw, limits, no_tensors)
        self.build(fed)
        self.learner.store_dir = str(learner_store_dir(self.state_dir, state.run))
        for t in range(state.task + 1):  # decoded one at a time: a started task's frame is kept raw only
            raw = state.frames.get(t)
            self.learner.start_task(t, None if raw is None else decode(raw, limits))
        self.learner.load_state(state.learner_meta, state.learner_arrays)
        self.fed, self.task, self.done_round = fed, state.task, state.done_round
        self.run_id = state.run or None

    def load(self, frame: Frame, fed: FederationSpec) -> None:
        """Create the learner on the first round, then merge the global tensors."""
        if self.fed is not None and to_dict(fed) != to_dict(self.fed):
            raise RejectedFrame("federation: settings changed during the run")
        if self.learner is None:
            self.input_dim = frame.meta["input_dim"]  # checked by check_downlink
            try:
                self.build(fed)
            except ValueError as exc:
                raise RejectedFrame(f"federation: {exc}") from None
            self.learner.store_dir = str(learner_store_dir(self.state_dir, self.run_id or "", fresh=True))
            self.fed = fed
        try:
            self.learner.load_global(frame.tensors, frame.header.round, frame.meta)
        except ValueError as exc:
            raise RejectedFrame(f"tensors: {exc}") from None

    def _fit_pixels(self) -> None:
        """The shards as the new learner reads them: uint8 0/1 pixels stay so for a learner
        that converts per batch (``Learner.compact_pixels``), else become float32 once."""
        if not self.learner.compact_pixels:
            self.data = float_tasks(self.data)

    def start_tasks(self, task: int, frames: ClientFrames) -> None:
        """Start the tasks up to ``task`` (a device that joined late, or was away for a whole task,
        starts those it missed; only ``task`` gets its own first frame)."""
        try:
            for t in range(self.task + 1, task + 1):
                # decoded only now, after the last task's state is gone; the raw frame stays for restarts
                self.learner.start_task(t, frames.first(t) if t == task else None)
        except ValueError as exc:  # CodecError too
            raise RejectedFrame(f"knowledge: {exc}") from None
        release_free_memory()
        self.task = task

    def have_data(self, task: int) -> bool:
        """With a task directory: rescan until task ``task``'s folder is there.  A device on its
        own task clock never waits: it trains what has arrived (rescanned every round)."""
        if self.task_dir is not None and (self.own_clock or len(self.data.train) <= task):
            self.data = self.task_dir.scan(self.input_dim)
        return self.own_clock or len(self.data.train) > task

    def arrived(self, rnd: int, task: int) -> list:
        """What the learner trains from in round ``rnd`` (of the federation's task ``task``): the
        tasks up to ``task``; on an own clock, every task that has arrived (None for the rest)."""
        train = self.data.train
        if self.learner.sees_all_tasks:
            return list(train)
        if not self.own_clock:
            return list(train[: task + 1])
        if self.task_dir is not None:
            return list(train)
        arrivals = self.data.arrivals or (None,) * len(train)
        return [d if (t <= task if a is None else a <= rnd) else None for t, (d, a) in enumerate(zip(train, arrivals))]

    def evaluate(self, rnd: int, place: RoundPlace | None, everything: bool = False) -> dict | None:
        """Held-out NLL (or accuracy) of the loaded model after round ``rnd`` (at ``place`` in
        the schedule): on every task seen so far after a task's last round (the continual
        metrics) or when asked, else on the current task."""
        task = place.task if place is not None else 0
        full = everything or place is None or place.task_end
        tests = [d if full or i == task else None for i, d in enumerate(self.data.test[: task + 1])]
        if len(tests) <= task or tests[task] is None or len(tests[task]) == 0:
            return None  # an own-clock device without this task's test data has nothing to report
        return {"round": rnd, "task": task, self.learner.metric: self.learner.evaluate(tests)}
