"""The client daemon: wait for a round, merge the global model, evaluate, train, upload.

paho's thread only queues raw messages; this loop validates and acts on them.  Each
upload carries the client's evaluation of the model it received (the global model after
the previous round), so no extra message is needed per round; the FINISH message is
answered by one EVAL frame.

After every update the daemon checkpoints itself (``edge_client.state``) before publishing,
and keeps the update until a later round is announced: it sends it again when the
aggregator asks (a REQUEST naming this device) or re-announces the round, and after a
restart.  With ``key_file`` set, every frame it sends is signed (``fclcore.signing``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import threading
import time
import zlib
from collections import Counter
from pathlib import Path

import numpy as np
import torch

import methods
from edge_client.control import ControlServer
from edge_client.replica import CATCHUP, FULL, ModelReplica
from edge_client.serving import ServedModelWriter
from edge_client.state import ClientState, ClientStateStore, learner_store_dir
from edge_client.taskdir import TaskDirectory
from fclcore import topics
from fclcore.checkpoint import CheckpointError, FileBytes
from fclcore.codec import CodecError, CodecLimits, Frame, Header, Kind, decode, encode, max_value
from fclcore.config import ConfigError, from_dict, to_dict
from fclcore.data import (
    ClientTasks,
    Dataset,
    client_task_split,
    domain_task_split,
    float_pixels,
    load_dataset,
    pool_task_split,
)
from fclcore.errors import TrainingDiverged
from fclcore.exitcodes import ExitCode
from fclcore.learner import Learner
from fclcore.membership import ACTIVE, NOT_ENROLLED, RETIRED, Membership
from fclcore.model_sync import SYNC_KNOWLEDGE, SYNC_KNOWLEDGE_BYTES
from fclcore.procmem import peak_rss_mb, release_free_memory, rss_mb
from fclcore.runid import check_run_id, is_newer
from fclcore.schedule import RoundPlace
from fclcore.schema import ClientConfig, FederationSpec
from fclcore.sdnotify import Notifier, WatchdogThread
from fclcore.signing import read_key, sign, verify
from fclcore.transport import MqttLink, TransportError, parse_status

log = logging.getLogger(__name__)
POLL_S = 0.2
SEQUENCE_AHEAD_US = 10_000_000  # a sequence further ahead of the aggregator's clock is reset to it
FINAL_SEND_S = 60.0  # how long the final evaluation is retried across broker outages
# Learners seed torch's global generator while they build their model: daemons sharing one
# process (fcl simulate --in-process) build one at a time, so each gets the same values as alone.
_BUILD_LOCK = threading.Lock()


def _no_tensors(header: Header) -> bool:
    return False


class RejectedFrame(ValueError):
    """A downlink message that must be dropped; the message says why."""


class ClientDaemon:
    def __init__(self, cfg: ClientConfig, stop: threading.Event | None = None, link_factory=MqttLink) -> None:
        """``link_factory``: how to reach the broker (``MqttLink``, or an in-process link)."""
        self.cfg = cfg
        self.stop = stop or threading.Event()
        self.out_dir = Path(cfg.out_dir)
        self.task_dir = TaskDirectory(cfg.data_dir) if cfg.data_dir else None
        # compact: binarised MNIST stays uint8 until a learner that needs float32 is built (_fit_pixels)
        self.data = load_client_data(cfg, compact=True) if cfg.data else self.task_dir.scan(None)
        self.input_dim: int | None = int(self.data.train[0].x.shape[1]) if self.data.train else None
        self.waiting: tuple[Frame, int] | None = None  # a round whose task's data has not arrived yet
        self.served_round = -1  # the round after which the served model was last exported
        self.queue: queue.Queue[tuple[str, bytes, int, float]] = queue.Queue()  # + arrival time
        self.learner: Learner | None = None
        self.fed: FederationSpec | None = None
        self.task = -1
        self.done_round = -1
        self.sequence = time.time_ns() // 1000  # above anything sent before, even without saved state
        self.rejected: dict[str, int] = {}
        self.round_bytes_down: dict[int, int] = {}  # PUBLISH bytes of each round's announcement
        self.round_cpu_s: dict[int, float] = {}  # CPU seconds this process spent on each round
        # this thread's CPU seconds per round by phase: "eval" (the held-out report), "train"
        # (task start, training, upload); the rest of round_cpu_s is I/O and background threads
        self.round_cpu_phases: dict[int, dict[str, float]] = {}
        self.round_rss_mb: dict[int, list[float | None]] = {}  # [RSS, peak RSS] in MiB after each round
        # task -> the aggregator's knowledge frame for it, as received: validated on arrival, kept in
        # a file of the state directory (not in memory: 36 MB by ConFedMADE's fifth MNIST task),
        # decoded again only when the task starts (a decoded frame is 5x its bytes), kept for restarts
        self.knowledge_raw: dict[int, FileBytes] = {}
        self.knowledge_bytes: dict[int, int] = {}
        self.mid_frames: dict[int, tuple[Frame, int]] = {}  # round -> (own frame, size) inside a started task
        self.pending: tuple[Frame, int] | None = None  # a round waiting for its own frame
        self.unacked: bytes | None = None  # the update for done_round, until a later round is announced
        self.sent_at = 0.0  # when it was published (monotonic)
        self.arrival = 0.0  # when the message being handled arrived
        self.limits = CodecLimits()
        self.final_state = "stopped"  # the retained status run() leaves: "retired" once the membership retires it
        self.told_not_enrolled = False
        self.run_id: str | None = None  # the run this device belongs to (fclcore.runid); None until its first round
        self.newer: dict[str, dict[int, tuple[bytes, int]]] = {}  # knowledge of a newer run, until it is joined
        self.clock_offset_us = 0  # the aggregator's clock minus ours (from its announcements): sequences follow it
        self.exit_code: ExitCode | None = None  # set when the run ends other than by finishing (failed, other run)
        self.aggregator_lost_since: float | None = None  # since when the aggregator is gone (status or link)
        self.aggregator_state = "unknown"
        self.told_lost = False
        try:
            self.key = read_key(cfg.key_file) if cfg.key_file else None
        except OSError as exc:
            raise ConfigError(f"key_file: {exc}") from None
        except ValueError as exc:
            raise ConfigError(f"key_file: {exc}") from None
        state_dir = Path(cfg.state_dir) if cfg.state_dir else self.out_dir / "state"
        self.store = ClientStateStore(state_dir)
        self.serving = ServedModelWriter(
            self.out_dir, cfg.data.dataset if cfg.data else "", cfg.serve.int8, cfg.serve.export_timeout_s
        )
        self.control = ControlServer(
            self.store.path.parent / "control.sock", self.status_snapshot, self.serving.model_path
        )
        self.subscribed = (  # exact topics: a message on any other was misrouted by the broker
            topics.round_topic(cfg.federation),
            topics.knowledge_topic(cfg.federation, cfg.client_id),
            topics.status_topic(cfg.federation, topics.AGGREGATOR_ID),
        )
        # subscribed only while the device resyncs (``ModelReplica``): "full" or "catchup"
        self.sync_topics = {topics.model_topic(cfg.federation, w): w for w in (FULL, CATCHUP)}
        # subscribed only while a task's knowledge frame names entries this device no longer holds
        self.kb_full_topic = topics.knowledge_full_topic(cfg.federation, cfg.client_id)
        self.kb_fetching: int | None = None  # the task whose full knowledge frame is being fetched
        self.kb_syncs: Counter[str] = Counter()  # full knowledge frames fetched, and their bytes
        self.replica: ModelReplica | None = None  # the global model as announced, kept in step by deltas
        self.syncing: str | None = None  # the sync frame being fetched
        self.parked: tuple[str, bytes, int] | None = None  # the announcement that waits for it
        self.link = link_factory(
            cfg.broker,
            f"fcl-{cfg.federation}-{cfg.client_id}",
            status_topic=topics.status_topic(cfg.federation, cfg.client_id),
            subscriptions=list(self.subscribed),
            on_message=lambda t, p, n: self.queue.put((t, p, n, time.monotonic())),
        )
        torch.set_num_threads(cfg.threads)
        self.notifier = Notifier()
        self.watchdog = WatchdogThread(self.notifier)
        self._restore()

    # -- checkpoints ---------------------------------------------------------------------
    def _restore(self) -> None:
        """Continue from the last checkpoint, if there is one for this device."""
        try:
            state = self.store.load()
        except CheckpointError as exc:
            raise ConfigError(f"state_dir: {exc}; move it away to rejoin from scratch") from None
        if state is None:
            return
        if state.client_id != self.cfg.client_id or state.federation.get("name") != self.cfg.federation:
            raise ConfigError(
                f"state_dir {self.store.path.parent}: it belongs to {state.client_id!r} in "
                f"{state.federation.get('name')!r}; move it away to rejoin from scratch"
            )
        self.input_dim = self.input_dim or state.input_dim
        try:
            fed = from_dict(FederationSpec, state.federation, "checkpoint", "federation")
            for t, raw in state.knowledge.items():  # every frame is checked, one at a time
                if t > state.task:
                    decode(raw, self.limits, _no_tensors)
            with _BUILD_LOCK:
                self.learner = methods.learner_for(fed, self.input_dim, self.client_index)
            self.learner.allow_embedding_upload = self.cfg.allow_embedding_upload
            self.learner.fleet_data = self.data.fleet
            self._fit_pixels()
            self.learner.store_dir = str(learner_store_dir(self.store.path.parent, state.run))
            for t in range(state.task + 1):  # decoded one at a time: a started task's frame is kept raw only
                raw = state.knowledge.get(t)
                self.learner.start_task(t, None if raw is None else decode(raw, self.limits))
            self.learner.load_state(state.learner_meta, state.learner_arrays)
        except (CodecError, ValueError) as exc:  # ConfigError is a ValueError
            raise ConfigError(
                f"state_dir {self.store.path.parent}: cannot resume ({exc}); move it away to rejoin from scratch"
            ) from None
        self.fed, self.task, self.done_round = fed, state.task, state.done_round
        self.knowledge_raw = {t: self.store.spill(t, raw) for t, raw in state.knowledge.items()}
        self.unacked = state.unacked
        self.sequence = max(self.sequence, state.sequence)
        self.run_id = state.run or None
        log.info(
            "resuming after round %d (task %d)%s",
            self.done_round,
            self.task,
            "; the last update is not yet acknowledged" if self.unacked else "",
        )

    def _checkpoint(self, unacked: bytes) -> None:
        meta, arrays = self.learner.state()
        self.store.save(
            ClientState(
                self.cfg.client_id,
                to_dict(self.fed),
                self.task,
                self.done_round,
                self.sequence,
                self.knowledge_raw,
                unacked,
                meta,
                arrays,
                self.input_dim,
                self.run_id or "",
            )
        )

    def run(self) -> ExitCode:
        """Serve until the run finishes or ``stop`` is set (SIGTERM): a stop waits for the
        round in hand to be checkpointed and sent, then says "stopped" and disconnects."""
        self.link.status_fields.update(role="client", task=self.task, round=self.done_round)
        try:
            self.link.start()
        except TransportError as exc:
            log.error("%s", exc)
            return ExitCode.BROKER_UNREACHABLE
        self.watchdog.start()
        try:
            self.control.start()
        except OSError as exc:  # e.g. a path longer than a Unix socket allows: the daemon runs on
            log.warning("no control socket at %s: %s", self.control.path, exc)
        self.notifier.ready(f"connected to {self.cfg.broker.url}")
        finished = False
        try:
            while not finished and not self.stop.is_set():
                self.watchdog.beat()
                try:
                    topic, payload, size, self.arrival = self.queue.get(timeout=POLL_S)
                except queue.Empty:
                    self._watch_aggregator()
                    finished = self._retry_waiting()
                    continue
                finished = self._handle(topic, payload, size)
        finally:
            self.notifier.stopping("shutting down")
            self.serving.close()
            self.control.stop()
            self.link.close(self.final_state)
            self._write_wire_log()
            self.watchdog.stop()
        if self.exit_code is not None:
            return self.exit_code
        return ExitCode.OK if finished else ExitCode.INTERRUPTED

    def status_snapshot(self) -> dict:
        """What ``fcl ctl status`` shows (read from the control socket's thread)."""
        waiting = self.waiting
        return {
            "client_id": self.cfg.client_id,
            "federation": self.cfg.federation,
            "connected": self.link.connected.is_set(),
            "task": self.task,
            "last_round": self.done_round,
            "unacknowledged_update": self.unacked is not None,
            "tasks_on_device": len(self.data.train),
            "waiting_for_task": waiting[0].header.task if waiting else None,
            "served_model": str(self.serving.model_path) if self.serving.model_path.exists() else None,
            "bytes": {d: self.link.meter.snapshot()[d]["bytes"] for d in ("up", "down")},
        }

    def _handle(self, topic: str, payload: bytes, size: int) -> bool:
        """Act on one downlink message; True when the run is finished."""
        if not payload:
            return False  # a deleted retained message
        if topic == topics.status_topic(self.cfg.federation, topics.AGGREGATOR_ID):
            self._on_aggregator_status(payload)
            return False
        try:
            if topic not in self.subscribed and topic not in self.sync_topics and topic != self.kb_full_topic:
                raise RejectedFrame(f"topic: {topic} is not a topic this device subscribed to")
            return self._act(topic, payload, size)
        except RejectedFrame as exc:
            self._drop(exc, topic)
            return False

    def _drop(self, exc: RejectedFrame, topic: str | None = None) -> None:
        """Every downlink message this device drops is counted here, by reason (its updates
        report the counts: metrics.jsonl ``rejected_by_client``, summary.json likewise)."""
        reason = str(exc).split(":", 1)[0]
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        log.warning("dropped downlink message%s: %s", f" on {topic}" if topic else "", exc)

    def _act(self, topic: str, payload: bytes, size: int) -> bool:
        frame, fed = self._check(payload)
        kind = frame.header.kind
        run = _run_of(frame)
        if kind is Kind.KNOWLEDGE:
            if topic == self.kb_full_topic and run != self.run_id:
                return False  # fetched only for a task of this device's run
            if self.run_id is not None and run != self.run_id:
                if not is_newer(run, self.run_id):
                    raise RejectedFrame(f"run: knowledge of run {run}, an earlier run than this device's {self.run_id}")
                self.newer.setdefault(run, {})[frame.header.task] = (payload, size)  # kept until it is joined
                return False
            return self._on_knowledge(topic, frame, payload, size)
        if kind is Kind.MODEL:
            if run != self.run_id:
                raise RejectedFrame(f"run: a model of run {run}, this device is in run {self.run_id}")
            return self._on_sync(topic, frame, size)
        if kind is Kind.REQUEST:
            if run != self.run_id:
                raise RejectedFrame(f"run: a request of run {run}, this device is in run {self.run_id}")
            if self.cfg.client_id in frame.meta.get("missing", ()):
                self._resend(frame.header.round, "the aggregator asked for it")
            return False
        if self.run_id is None or run != self.run_id:
            ended = self._meet_run(frame, run)
            if ended:
                return True
        self._note_clock(frame)
        if kind is Kind.FINISH and (frame.meta.get("failed") is not None or frame.header.round != fed.total_rounds):
            return self._finish_early(frame, fed)
        state = self._membership_state(fed, frame.header.task)
        if state == RETIRED:
            self._retire(frame, fed)
            return True
        if state == NOT_ENROLLED:
            if not self.told_not_enrolled:
                log.info("not enrolled yet in task %d (federation.membership): waiting", frame.header.task)
                self.told_not_enrolled = True
            return False
        if kind is Kind.FINISH and self.done_round < 0:
            log.info("ignoring the end of a run this device did not take part in")
            return False
        if kind is Kind.ROUND and frame.header.round <= self.done_round:
            # seen again after a reconnect or a restart, or re-announced: the round is still open
            self._resend(frame.header.round, "its round is still open")
            return False
        model = self._model(frame, fed, (topic, payload, size))
        if model is None:
            return False  # the announcement waits for a sync frame
        frame = dataclasses.replace(frame, tensors=model)
        self.unacked = None  # a later round or the end: the last update was taken or is moot
        self._load(frame, fed)
        if kind is Kind.FINISH:
            self._finish(frame)
            return True
        if self._needs_knowledge(frame):
            self.pending = (frame, size)  # the knowledge frame is on its way on another topic
            return False
        return self._handle_round(frame, size)

    def _meet_run(self, frame: Frame, run: str) -> bool:
        """A round or FINISH of a run this device is not in: adopt it (a fresh device, at a
        round), join it (a newer run, ``on_new_run: join``: start over), refuse it (exit
        ``OTHER_RUN``), or drop it (an earlier run's retained message, or the end of a run this
        device took no part in).  True when the daemon must stop."""
        kind = frame.header.kind
        if self.run_id is None:
            if kind is Kind.FINISH and frame.meta.get("failed") is None:
                raise RejectedFrame(f"run: the end of run {run}, which this device took no part in")
            self._adopt_run(run)
            return False
        if not is_newer(run, self.run_id):
            raise RejectedFrame(f"run: a {kind.name} of run {run}, an earlier run than this device's {self.run_id}")
        if kind is Kind.FINISH:
            raise RejectedFrame(f"run: the end of run {run}, a newer run this device has not joined")
        if self.cfg.on_new_run == "refuse":
            log.error(
                "a newer run %s of %s started; this device belongs to run %s and on_new_run is refuse: exiting",
                run,
                self.cfg.federation,
                self.run_id,
            )
            self.exit_code = ExitCode.OTHER_RUN
            return True
        log.warning(
            "a newer run %s of %s started: joining it from scratch (was in run %s)",
            run,
            self.cfg.federation,
            self.run_id,
        )
        self.learner, self.fed, self.task, self.done_round = None, None, -1, -1
        self.knowledge_raw, self.knowledge_bytes, self.mid_frames = {}, {}, {}
        self.pending = self.waiting = self.unacked = None
        self.served_round, self.told_not_enrolled = -1, False
        self._fetch_knowledge(None)
        self._adopt_run(run)
        return False

    def _adopt_run(self, run: str) -> None:
        """Belong to ``run``: knowledge frames of other runs go; those of this run kept aside come in."""
        self.run_id = run
        for task, raw in list(self.knowledge_raw.items()):
            # (a frame from before runs had ids stays)
            if decode(raw.read(), self.limits, _no_tensors).meta.get("run", run) != run:
                self.knowledge_raw.pop(task, None)
                self.knowledge_bytes.pop(task, None)
        for task, (raw, size) in sorted(self.newer.pop(run, {}).items()):
            self.knowledge_raw[task], self.knowledge_bytes[task] = self.store.spill(task, raw), size
        self.newer = {r: f for r, f in self.newer.items() if is_newer(r, run)}
        self.link.status_fields.update(run=run)

    def _finish_early(self, frame: Frame, fed: FederationSpec) -> bool:
        """A FINISH that is not the end of this run's last round: the aggregator gave up (the
        device exits ``FEDERATION_FAILED`` with its checkpoint as it is, also one that has not
        trained yet: no round of this run will come), or a stale one (dropped)."""
        failed = frame.meta.get("failed")
        if failed is None:
            raise RejectedFrame(
                f"finish: for round {frame.header.round}, but the federation has {fed.total_rounds} rounds"
            )
        log.error("the aggregator ended run %s as failed: %s", self.run_id, str(failed)[:200])
        self.unacked = None
        self.serving.wait()
        self.exit_code = ExitCode.FEDERATION_FAILED
        return True

    def _note_clock(self, frame: Frame) -> None:
        """The aggregator's clock, from its announcement: this device's sequence numbers follow it."""
        clock = frame.meta.get("clock_us")
        if isinstance(clock, int) and not isinstance(clock, bool) and clock > 0:
            self.clock_offset_us = clock - time.time_ns() // 1000

    def _on_aggregator_status(self, payload: bytes) -> None:
        status = parse_status(payload)
        self.aggregator_state = status["state"] if status else "unknown"
        if self.aggregator_state == "online":
            if self.told_lost:
                log.info("the aggregator is back")
                self.link.publish_status("online", aggregator="online")
            self.aggregator_lost_since, self.told_lost = None, False
        elif self.aggregator_lost_since is None:
            self.aggregator_lost_since = time.monotonic()

    def _watch_aggregator(self) -> None:
        """Say so (log and status) when the aggregator has been gone longer than
        ``aggregator_timeout_s``: its status is "dead" or "stopped", or the broker is out of
        reach.  The device keeps waiting and reconnecting; it never ends as if finished."""
        if not self.link.connected.is_set() and self.aggregator_lost_since is None:
            self.aggregator_lost_since = time.monotonic()
        if self.aggregator_lost_since is None or self.told_lost:
            return
        gone = time.monotonic() - self.aggregator_lost_since
        if gone > self.cfg.aggregator_timeout_s:
            why = (
                "the broker is out of reach"
                if not self.link.connected.is_set()
                else f"its status is {self.aggregator_state}"
            )
            log.warning("no aggregator for %.0f s (%s); still waiting for it", gone, why)
            self.link.publish_status("online", aggregator="lost")
            self.told_lost = True

    def _needs_knowledge(self, frame: Frame) -> bool:
        """The round says the strategy sent this device its own frame for it, and it is not here
        yet: a task's first frame (kept for restarts), or a frame for a later round of the task
        this device is in.  ``client_frames`` is True (every device of the round gets one) or
        the list of the devices that do."""
        frames = frame.meta.get("client_frames")
        if frames is not True and not (isinstance(frames, list) and self.cfg.client_id in frames):
            return False
        if frame.header.task != self.task:
            return frame.header.task not in self.knowledge_raw
        return frame.header.round > self.done_round and frame.header.round not in self.mid_frames

    def _membership_state(self, fed: FederationSpec, task: int) -> str:
        """This device's state in ``task`` by the federation's membership table (checked in ``_check``)."""
        try:
            table = Membership.of(fed)
            return ACTIVE if table is None else table.state(self.cfg.client_id, task)
        except ValueError as exc:
            raise RejectedFrame(f"federation: {exc}") from None

    def _retire(self, frame: Frame, fed: FederationSpec) -> None:
        """A round (or the end) of a task in which this device is retired: it serves the model of
        its last round, if it has one, and leaves the run with the status "retired"."""
        log.info("retired from task %d (federation.membership): leaving the federation", frame.header.task)
        if self.learner is not None and frame.header.round - 1 == self.done_round:
            try:  # the announcement carries the aggregate of this device's last round: serve it
                self._load(frame, fed)
                self.serving.submit(self._served(frame.header.round - 1, _places(frame)[1], task_ended=True))
            except RejectedFrame as exc:
                log.warning("not serving the last model: %s", exc)
        self.unacked = None
        self.serving.wait()
        self.final_state = "retired"

    def _resend(self, rnd: int, why: str) -> None:
        """Publish the unacknowledged update again, unless the message asking for it arrived
        before the update was first sent (it queued up while this device was training)."""
        if rnd == self.done_round and self.unacked is not None and self.arrival >= self.sent_at:
            log.info("re-sending the update for round %d: %s", rnd, why)
            self.link.publish(
                topics.update_topic(self.cfg.federation, self.cfg.client_id), self.unacked, tag=f"resend:{rnd}"
            )
            self.sent_at = time.monotonic()

    def _on_knowledge(self, topic: str, frame: Frame, payload: bytes, size: int) -> bool:
        if topic == self.kb_full_topic:
            return self._on_full_knowledge(frame, payload, size)
        if topic != topics.knowledge_topic(self.cfg.federation, self.cfg.client_id):
            raise RejectedFrame(f"topic: knowledge frame on {topic}")
        if frame.meta.get("for_task", frame.header.task) != frame.header.task:
            raise RejectedFrame("knowledge: meta.for_task differs from the header's task")
        if frame.header.task == self.task:  # for a later round of the task in hand
            if frame.header.round <= self.done_round:
                return False  # a retained frame of a round already done
            self.mid_frames = {r: f for r, f in self.mid_frames.items() if r > self.done_round}
            self.mid_frames[frame.header.round] = (frame, size)
        else:
            self.knowledge_raw[frame.header.task] = self.store.spill(frame.header.task, payload)
            self.knowledge_bytes[frame.header.task] = size
        if self.pending is not None and not self._needs_knowledge(self.pending[0]):
            pending, self.pending = self.pending, None
            return self._handle_round(*pending)
        return False

    def _have_data(self, task: int) -> bool:
        """With a task directory: rescan until task ``task``'s folder is there.  A device on its
        own task clock never waits: it trains what has arrived (rescanned every round)."""
        if self.task_dir is not None and (self.own_clock or len(self.data.train) <= task):
            self.data = self.task_dir.scan(self.input_dim)
        return self.own_clock or len(self.data.train) > task

    @property
    def own_clock(self) -> bool:
        return self.fed is not None and methods.lookup(self.fed.method).own_clock

    def _arrived(self, rnd: int, task: int) -> list:
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

    def _retry_waiting(self) -> bool:
        """While idle: join the waiting round as soon as its task's data has arrived."""
        if self.waiting is None or not self._have_data(self.waiting[0].header.task):
            return False
        frame, size = self.waiting
        self.waiting = None
        log.info("data for task %d arrived in %s", frame.header.task, self.task_dir.root)
        try:
            return self._handle_round(frame, size)
        except RejectedFrame as exc:
            self._drop(exc)
            return False

    def _handle_round(self, frame: Frame, size: int) -> bool:
        if not self._have_data(frame.header.task):
            if self.waiting is None or self.waiting[0].header.task != frame.header.task:
                log.info(
                    "round %d is on task %d: waiting for its folder in %s",
                    frame.header.round,
                    frame.header.task,
                    self.task_dir.root,
                )
                if self.task >= 0:  # meanwhile, serve what the federation learned up to here
                    self.serving.submit(
                        self._served(
                            frame.header.round - 1, _places(frame)[1], task_ended=frame.header.task != self.task
                        )
                    )
                    self.serving.wait()  # nothing to train until the data comes: serve it before saying so
                self.link.publish_status("online", waiting_for_task=frame.header.task)
            self.waiting = (frame, size)
            return False
        new_task = frame.header.task != self.task  # the task's knowledge frame counts for its first round
        if new_task and self._lacks_knowledge(frame, size):
            return False  # the round waits for the full knowledge frame
        own = self.mid_frames.get(frame.header.round, (None, 0))[1] if not new_task else 0
        self.round_bytes_down[frame.header.round] = (
            size + own + (self.knowledge_bytes.get(frame.header.task, 0) if new_task else 0)
        )
        self._round(frame)
        return False

    def _keeps_tensors(self, header: Header) -> bool:
        return header.kind is not Kind.KNOWLEDGE or header.task == self.task

    # -- knowledge the device no longer holds -------------------------------------------------
    def _lacks_knowledge(self, frame: Frame, size: int) -> bool:
        """Whether the knowledge frame of the task ``frame`` starts names entries this device
        neither holds nor finds in it (its store was lost, or the aggregator's idea of what it
        holds is wrong): then the round waits while the full frame is fetched (counted)."""
        task = frame.header.task
        raw = self.knowledge_raw.get(task)
        try:  # decoded whole here (it is kept without its tensors) and dropped before the task starts
            lacking = self.learner.lacks(decode(raw.read(), self.limits)) if raw is not None else []
        except ValueError as exc:
            raise RejectedFrame(f"knowledge: {exc}") from None
        if not lacking:
            return False
        if self.kb_fetching != task:
            log.warning(
                "task %d's knowledge frame names %d entries this device does not hold: fetching the full frame",
                task,
                len(lacking),
            )
            self.kb_syncs[SYNC_KNOWLEDGE] += 1
            self._fetch_knowledge(task)
        self.pending = (frame, size)
        return True

    def _fetch_knowledge(self, task: int | None) -> None:
        """Subscribe to this device's full knowledge frame while task ``task``'s is wanted (None: stop)."""
        if task is not None and self.kb_fetching is None:
            self.link.subscribe(self.kb_full_topic)
        elif task is None and self.kb_fetching is not None:
            self.link.unsubscribe(self.kb_full_topic)
        self.kb_fetching = task

    def _on_full_knowledge(self, frame: Frame, payload: bytes, size: int) -> bool:
        """The full knowledge frame: it replaces the task's own frame (also in the checkpoint)."""
        task = frame.header.task
        if self.kb_fetching is None or task != self.kb_fetching:
            return False  # a retained copy delivered after the fetch ended, or another task's
        if frame.meta.get("for_task", task) != task:
            raise RejectedFrame("knowledge: meta.for_task differs from the header's task")
        try:  # ``frame`` came without its tensors (a task not yet started): decoded whole here
            lacking = self.learner.lacks(decode(payload, self.limits))
        except ValueError as exc:
            raise RejectedFrame(f"knowledge: {exc}") from None
        if lacking:
            raise RejectedFrame(f"knowledge: the full frame lacks {len(lacking)} of its entries")
        self.kb_syncs[SYNC_KNOWLEDGE_BYTES] += size
        self.knowledge_raw[task] = self.store.spill(task, payload)
        self.knowledge_bytes[task] = self.knowledge_bytes.get(task, 0) + size  # it received both
        self._fetch_knowledge(None)
        pending, self.pending = self.pending, None
        return self._handle_round(*pending) if pending is not None else False

    def _sync_report(self) -> dict[str, int]:
        """The cumulative resync counts every update reports: the model's and the knowledge's."""
        return {**(self.replica.report() if self.replica else {}), **self.kb_syncs}

    def _check(self, payload: bytes) -> tuple[Frame, FederationSpec]:
        """Validate a downlink frame without touching any state."""
        try:
            # a knowledge frame for a task not yet started is only stored (raw): checked, not kept decoded
            frame = decode(payload, self.limits, self._keeps_tensors)
        except CodecError as exc:
            raise RejectedFrame(f"codec: {exc}") from None
        h = frame.header
        if h.federation != self.cfg.federation or h.client != topics.AGGREGATOR_ID:
            raise RejectedFrame(f"sender: {h.client!r} of {h.federation!r} is not this federation's aggregator")
        if h.kind not in (Kind.ROUND, Kind.FINISH, Kind.KNOWLEDGE, Kind.REQUEST, Kind.MODEL):
            raise RejectedFrame(f"kind: {h.kind.name} is not a downlink message")
        if h.kind in (Kind.KNOWLEDGE, Kind.REQUEST, Kind.MODEL):
            return frame, self.fed
        try:
            fed = from_dict(FederationSpec, frame.meta.get("federation"), "round message", "federation")
            methods.resolve(fed, "round message")
            Membership.of(fed)
        except ValueError as exc:  # ConfigError, or a bad membership table
            raise RejectedFrame(f"federation: {exc}") from None
        dim = frame.meta.get("input_dim")
        if (
            not isinstance(dim, int)
            or isinstance(dim, bool)
            or dim < 1
            or (self.input_dim is not None and dim != self.input_dim)
        ):
            raise RejectedFrame(f"input_dim: model expects {dim!r}, this device's data has {self.input_dim}")
        if self.task_dir is None and len(self.data.train) < fed.num_tasks:
            raise RejectedFrame(f"tasks: federation has {fed.num_tasks} tasks, this device has {len(self.data.train)}")
        _places(frame)  # the schedule is checked before anything acts on the frame
        return frame, fed

    # -- the global model: deltas and resyncs ------------------------------------------------
    def _model(self, frame: Frame, fed: FederationSpec, message: tuple[str, bytes, int]) -> dict | None:
        """The whole global model an announcement brings, or None while the sync frame it needs
        is fetched (``message`` is handled again once the replica has caught up)."""
        if self.replica is None:
            self.replica = ModelReplica(methods.positions_for(fed, frame.meta["input_dim"], "round message"))
        try:
            got = self.replica.take(frame)
        except ValueError as exc:
            raise RejectedFrame(f"model: {exc}") from None
        if isinstance(got, str):
            self.parked = message
            self._fetch(got)
            return None
        self._fetch(None)
        return got

    def _fetch(self, which: str | None) -> None:
        """Subscribe to sync frame ``which`` (None: to none), leaving the one fetched before."""
        if which == self.syncing:
            return
        if self.syncing is not None:
            self.link.unsubscribe(topics.model_topic(self.cfg.federation, self.syncing))
        if which is not None:
            log.info("fetching the %s model (holding version %s)", which, self.replica.version)
            self.link.subscribe(topics.model_topic(self.cfg.federation, which))
        else:
            self.parked = None
        self.syncing = which

    def _on_sync(self, topic: str, frame: Frame, size: int) -> bool:
        which = self.sync_topics[topic]
        if which != self.syncing or self.replica is None:
            return False  # a retained copy delivered after the fetch ended
        try:
            wanted = self.replica.sync(frame, which, size)
        except ValueError as exc:
            raise RejectedFrame(f"model: {exc}") from None
        if wanted is not None:
            self._fetch(wanted)
            return False
        parked = self.parked
        self._fetch(None)
        return self._act(*parked) if parked is not None else False

    def _load(self, frame: Frame, fed: FederationSpec) -> None:
        """Create the learner on the first round, then merge the global tensors."""
        if self.fed is not None and to_dict(fed) != to_dict(self.fed):
            raise RejectedFrame("federation: settings changed during the run")
        if self.learner is None:
            self.input_dim = frame.meta["input_dim"]  # checked by _check
            try:
                with _BUILD_LOCK:
                    self.learner = methods.learner_for(fed, self.input_dim, self.client_index)
            except ValueError as exc:
                raise RejectedFrame(f"federation: {exc}") from None
            self.learner.allow_embedding_upload = self.cfg.allow_embedding_upload
            self.learner.fleet_data = self.data.fleet
            self._fit_pixels()
            self.learner.store_dir = str(learner_store_dir(self.store.path.parent, self.run_id or "", fresh=True))
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

    @property
    def client_index(self) -> int:
        """Seeds per-device shuffling: the shard index in a simulation, else from the id."""
        return self.cfg.data.client_index if self.cfg.data else zlib.crc32(self.cfg.client_id.encode()) & 0xFFFF

    def _round(self, frame: Frame) -> None:
        cpu_start, thread_start = time.process_time(), time.thread_time()
        rnd, task = frame.header.round, frame.header.task
        place, previous = _places(frame)
        task_ended = task != self.task and self.task >= 0
        if self.task < 0:  # a fresh device (one enrolling at task t too) evaluates with its tasks started
            self._start_tasks(task)
        report = self._evaluate(rnd - 1, previous)
        eval_cpu = time.thread_time() - thread_start
        served = self._served(after_round=rnd - 1, previous=previous, task_ended=task_ended)
        if task != self.task:
            self._start_tasks(task)
        elif rnd in self.mid_frames:
            try:
                self.learner.receive_frame(self.mid_frames.pop(rnd)[0], rnd)
            except ValueError as exc:
                raise RejectedFrame(f"knowledge: {exc}") from None
        n_samples, train_nll = self.learner.train_round(self._arrived(rnd, task), rnd, place)
        tensors = self.learner.upload(rnd, place)
        train_cpu = time.thread_time() - thread_start - eval_cpu
        check_finite(rnd, train_nll, tensors, self.fed.wire.value_dtype)  # nothing non-finite leaves the device
        meta = {
            "n_samples": n_samples,
            "train_nll": None if train_nll is None else round(train_nll, 4),
            **({"eval": report} if report is not None else {}),
            "rejected": dict(self.rejected),
            **({"sync": sync} if (sync := self._sync_report()) else {}),
            **self.learner.report(place),
            **({"allow_embedding_upload": True} if self.cfg.allow_embedding_upload else {}),
        }
        payload = self._frame(Kind.UPDATE, rnd, task, meta, tensors)
        if self.learner.reads_upload:  # error feedback: what coding lost stays in the learner (checkpointed next)
            frame_bytes = verify(payload, self.key) if self.key is not None else payload
            self.learner.uploaded(decode(frame_bytes, self.limits).tensors)
        self.done_round, self.unacked = rnd, payload
        self._checkpoint(payload)  # before publishing: a crash after this re-sends, never retrains
        self._send(payload, f"update:{rnd}")
        self.sent_at = time.monotonic()
        self.serving.submit(served)  # exported in the background, never before the update is out
        release_free_memory()  # the round's freed buffers go back to the OS, not into next round's peak
        self.round_cpu_s[rnd] = round(time.process_time() - cpu_start, 4)
        self.round_cpu_phases[rnd] = {"eval": round(eval_cpu, 4), "train": round(train_cpu, 4)}
        self.round_rss_mb[rnd] = [rss_mb(), peak_rss_mb()]
        meter = self.link.meter.snapshot()
        self.link.publish_status(
            "online",
            task=task,
            round=rnd,
            bytes_up=meter["up"]["bytes"],
            bytes_down=meter["down"]["bytes"],
            waiting_for_task=None,
        )
        self.notifier.status(f"round {rnd}, task {task}")
        log.info("round %d task %d: %d samples, train NLL %s", rnd, task, n_samples, meta["train_nll"])

    def _start_tasks(self, task: int) -> None:
        """Start the tasks up to ``task`` (a device that joined late, or was away for a whole task,
        starts those it missed; only ``task`` gets its own knowledge frame)."""
        try:
            for t in range(self.task + 1, task + 1):
                raw = self.knowledge_raw.get(t) if t == task else None
                # decoded only now, after the last task's state is gone; the raw frame stays for restarts
                self.learner.start_task(t, None if raw is None else decode(raw.read(), self.limits))
        except ValueError as exc:  # CodecError too
            raise RejectedFrame(f"knowledge: {exc}") from None
        release_free_memory()
        self.task = task

    def _finish(self, frame: Frame) -> None:
        _, previous = _places(frame)
        report = self._evaluate(frame.header.round - 1, previous, everything=True)
        served = self._served(after_round=frame.header.round - 1, previous=previous, task_ended=True)
        meta = {**({"eval": report} if report is not None else {}), "rejected": dict(self.rejected)}
        payload = self._frame(Kind.EVAL, frame.header.round, frame.header.task, meta, {})
        self._deliver(payload, f"eval:{frame.header.round}")
        self.serving.submit(served)
        self.serving.wait()  # the final model is in service before the daemon exits
        log.info("run finished; final %s per task %s", self.learner.metric, (report or {}).get(self.learner.metric))

    def _deliver(self, payload: bytes, tag: str, timeout: float = FINAL_SEND_S) -> bool:
        """Publish and wait until the broker has it; a link that drops meanwhile (a broker
        restart) is waited for and the frame sent again (the aggregator drops a duplicate)."""
        deadline = time.monotonic() + timeout
        info = self._send(payload, tag)
        while not self.stop.is_set() and (left := deadline - time.monotonic()) > 0:
            try:
                info.wait_for_publish(min(2.0, left))
                if info.is_published():
                    return True
            except (RuntimeError, ValueError):  # paho: published while the link was down
                if self.link.connected.wait(min(2.0, left)):
                    info = self._send(payload, tag)
        log.warning("%s was not delivered within %.0f s; the aggregator will go on without it", tag, timeout)
        return False

    def _served(self, after_round: int, previous: RoundPlace | None, task_ended: bool):
        """The model to serve after ``after_round`` (a snapshot the background export may
        read while training goes on), or None: after a task, or every round if so configured."""
        every = self.cfg.serve.every
        if (
            after_round < 0
            or previous is None
            or every == "never"
            or (every == "task" and not task_ended)
            or after_round == self.served_round
        ):
            return None
        task = previous.task
        # The export's parity rows: the task's held-out rows.  A device on its own task clock may
        # have fewer task folders than the federation has tasks (or none yet): its newest ones.
        tests = self.data.test
        ordered = ([tests[task]] if task < len(tests) else []) + list(reversed(tests))
        parity = next((float_pixels(d).x for d in ordered if len(d)), None)  # float32 for the export
        if parity is None:
            log.info("not serving the model after round %d: no data on this device yet", after_round)
            return None
        self.served_round = after_round
        return self.serving.snapshot(self.learner, task, parity)

    def _evaluate(self, rnd: int, place: RoundPlace | None, everything: bool = False) -> dict | None:
        """Held-out NLL (or accuracy) of the loaded model after round ``rnd`` (at ``place`` in
        the schedule): on every task seen so far after a task's last round (the continual
        metrics) or when asked, else on the current task."""
        task = place.task if place is not None else 0
        full = everything or place is None or place.task_end
        tests = [d if full or i == task else None for i, d in enumerate(self.data.test[: task + 1])]
        if len(tests) <= task or tests[task] is None or len(tests[task]) == 0:
            return None  # an own-clock device without this task's test data has nothing to report
        return {"round": rnd, "task": task, self.learner.metric: self.learner.evaluate(tests)}

    def _frame(self, kind: Kind, rnd: int, task: int, meta: dict, tensors: dict) -> bytes:
        """An uplink message: encoded, and signed when the device has a key.  Its sequence runs on
        the aggregator's clock (which bounds what it accepts); one far ahead of it (a clock that
        was wrong when the checkpoint was written) is brought back to it."""
        now = time.time_ns() // 1000 + self.clock_offset_us
        if self.sequence + 1 > now + SEQUENCE_AHEAD_US:
            log.warning(
                "this device's sequence was %.0f s ahead of the aggregator's clock: reset", (self.sequence - now) / 1e6
            )
            self.sequence = now
        self.sequence = max(self.sequence + 1, now)
        header = Header(kind, self.cfg.federation, rnd, task, self.cfg.client_id, self.sequence)
        payload = encode(Frame(header, meta, tensors), self.fed.value_coding, self.limits)
        return sign(payload, self.key) if self.key is not None else payload

    def _send(self, payload: bytes, tag: str):
        return self.link.publish(topics.update_topic(self.cfg.federation, self.cfg.client_id), payload, tag=tag)

    def _write_wire_log(self) -> None:
        """The device's own meter, for comparison with the aggregator's and a packet capture."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.out_dir / "wire.json.tmp"
        tmp.write_text(
            json.dumps(
                {
                    "client": self.cfg.client_id,
                    "rejected": self.rejected,
                    "round_bytes_down": self.round_bytes_down,
                    "model_syncs": dict(self.replica.totals) if self.replica else {},
                    "knowledge_syncs": dict(self.kb_syncs),
                    "round_cpu_s": self.round_cpu_s,
                    "round_cpu_phases": self.round_cpu_phases,
                    "round_rss_mb": self.round_rss_mb,
                    "max_rss_mb": peak_rss_mb(),
                    "export_child_peak_rss_mb": self.serving.child_peak_rss_mb,
                    **self.link.meter.snapshot(),
                },
                indent=2,
            )
        )
        os.replace(tmp, self.out_dir / "wire.json")


def check_finite(rnd: int, loss: float | None, tensors: dict, value_dtype: str) -> None:
    """Raise ``TrainingDiverged`` if the round's loss or any value of its update is not a finite
    number in the wire's value type (a float32 value beyond float16's range would become inf)."""
    if loss is not None and not np.isfinite(loss):
        raise TrainingDiverged(f"training diverged at round {rnd} (loss={loss}): lower `federation.train.lr`")
    bound = max_value(value_dtype)
    for name, tensor in tensors.items():
        values = np.asarray(getattr(tensor, "values", tensor), dtype=np.float64)
        if values.size and not np.all(np.abs(values) <= bound):  # False for nan too
            shown = "" if loss is None else f"loss={loss:.4g}, "
            raise TrainingDiverged(
                f"training diverged at round {rnd} ({shown}update {name!r} is not finite in {value_dtype}): "
                "lower `federation.train.lr`"
            )


def _run_of(frame: Frame) -> str:
    """The run a downlink frame belongs to (every aggregator frame names it)."""
    try:
        return check_run_id(frame.meta.get("run"))
    except ValueError as exc:
        raise RejectedFrame(str(exc)) from None


def _places(frame: Frame) -> tuple[RoundPlace, RoundPlace | None]:
    """(this round's place in the task schedule, the previous round's), from the round message."""
    schedule = frame.meta.get("schedule")
    try:
        place = RoundPlace.from_meta(schedule, frame.header.task)
        previous = schedule.get("previous")
        before = (
            None
            if previous is None
            else RoundPlace.from_meta(previous, previous.get("task") if isinstance(previous, dict) else -1)
        )
    except ValueError as exc:
        raise RejectedFrame(str(exc)) from None
    return place, before


def load_client_data(cfg: ClientConfig, compact: bool = False) -> ClientTasks:
    """This device's shard, derived from the shared plan alone (the same split ``fcl simulate`` checked).

    ``compact``: binarised MNIST shards stay uint8 0/1 (pass them through :func:`float_tasks`
    for a learner without ``compact_pixels``); else every shard is float32."""
    spec = cfg.data
    seed = spec.data_seed
    gray = spec.domains is not None
    train, test = load_dataset(spec.dataset, spec.path, seed, spec.max_length, gray=gray, compact=not gray)
    if spec.domains is not None:  # domain-incremental: rotated / permuted grayscale images, every class per task
        return domain_task_split(
            train,
            test,
            spec.domains,
            spec.client_index,
            len(spec.client_tasks),
            seed,
            spec.per_class,
            spec.test_per_class,
        )
    if spec.pool_ids is not None:
        pooled = pool_task_split(train, test, spec.pool_tasks, spec.pool_ids, seed, spec.per_class, spec.test_per_class)
        return pooled if compact else float_tasks(pooled)
    own = client_task_split(
        train, test, spec.client_tasks, spec.client_index, seed, spec.test_tasks, spec.per_class, spec.test_per_class
    )
    fleet = None
    if spec.fleet:  # every device's shard of each task, as each device computes its own
        shards = [
            client_task_split(train, test, spec.client_tasks, i, seed, spec.test_tasks, spec.per_class, 1).train
            for i in range(len(spec.client_tasks))
        ]
        fleet = tuple(
            float_pixels(Dataset(np.concatenate([s[t].x for s in shards]), np.concatenate([s[t].y for s in shards])))
            for t in range(len(own.train))
        )
    arrivals = tuple(spec.arrivals) if spec.arrivals is not None else None
    tasks = ClientTasks(own.train, own.test, arrivals, fleet)
    return tasks if compact else float_tasks(tasks)


def float_tasks(tasks: ClientTasks) -> ClientTasks:
    """The shards as float32, cut from a compact set (the whole set is not kept); float shards unchanged."""
    return dataclasses.replace(
        tasks, train=tuple(map(float_pixels, tasks.train)), test=tuple(map(float_pixels, tasks.test))
    )
