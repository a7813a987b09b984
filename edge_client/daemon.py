"""The client daemon: wait for a round, merge the global model, evaluate, train, upload.

paho's thread only queues raw messages; this loop validates and acts on them.  Each
upload carries the client's evaluation of the model it received (the global model after
the previous round), so no extra message is needed per round; the FINISH message is
answered by one EVAL frame.

The daemon runs the round protocol (which message is acted on, for which run, in which
membership state) and wires its parts together: the learner and its data
(``edge_client.learning``), the frames sent to this device alone (``edge_client.frames``),
the global model's replica and its resyncs (``edge_client.modelsync``), what it sends
(``edge_client.uplink``), a round's work with its checkpoint (``edge_client.rounds``), which
run it may act on and when it stops waiting (``edge_client.rungate``), how it joins, refuses
and leaves a run (``edge_client.lifecycle``), and what it reports
about itself (``edge_client.status``).  With ``key_file`` set, every frame
it sends is signed (``fclcore.signing``).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from pathlib import Path

import torch

from edge_client.chunkfetch import ChunkFetch
from edge_client.control import ControlServer
from edge_client.data import load_client_data, served_class_names
from edge_client.frames import ClientFrames
from edge_client.learning import DeviceLearner
from edge_client.ledger import downlink_tag
from edge_client.lifecycle import RunLifecycle
from edge_client.modelsync import ModelSync
from edge_client.nacks import NackLog
from edge_client.protocol import RejectedFrame, check_downlink, run_of
from edge_client.rounds import RoundWork
from edge_client.rungate import RunGate
from edge_client.serving import ServedModelWriter
from edge_client.state import ClientStateStore
from edge_client.status import AggregatorWatch, RoundStats
from edge_client.taskdir import TaskDirectory
from edge_client.uplink import Uplink
from fclcore import topics
from fclcore.capabilities import Decodes, device_capabilities
from fclcore.chunks import CHUNK_MAGIC, ChunkError
from fclcore.codec import CodecLimits, Frame, Kind
from fclcore.config import ConfigError
from fclcore.exitcodes import ExitCode
from fclcore.procmem import release_free_memory
from fclcore.runid import is_newer
from fclcore.schema import ClientConfig, FederationSpec
from fclcore.sdnotify import Notifier, WatchdogThread
from fclcore.signing import read_key
from fclcore.transport import MqttLink, TransportError, WireMeter

log = logging.getLogger(__name__)
POLL_S = 0.2


def device_key(cfg: ClientConfig) -> bytes | None:
    """The key every frame is signed with (``key_file``), if one is set."""
    try:
        return read_key(cfg.key_file) if cfg.key_file else None
    except OSError as exc:
        raise ConfigError(f"key_file: {exc}") from None
    except ValueError as exc:
        raise ConfigError(f"key_file: {exc}") from None


class ClientDaemon:
    def __init__(self, cfg: ClientConfig, stop: threading.Event | None = None, link_factory=MqttLink) -> None:
        """``link_factory``: how to reach the broker (``MqttLink``, or an in-process link)."""
        self.cfg = cfg
        self.stop = stop or threading.Event()
        self.out_dir = Path(cfg.out_dir)
        task_dir = TaskDirectory(cfg.data_dir) if cfg.data_dir else None
        # compact: binarised MNIST stays uint8 until a learner that needs float32 is built
        data = load_client_data(cfg, compact=True) if cfg.data else task_dir.scan(None)
        release_free_memory()  # the corpus and tokenizer scratch (BBC: 146 MB freed but resident)
        self.queue: queue.Queue[tuple[str, bytes, int, float]] = queue.Queue()  # + arrival time
        self.arrival = 0.0  # when the message being handled arrived
        self.decodes = Decodes.of(cfg.decodes)  # what it says it decodes, and holds itself to (P-CAP-4)
        self.limits = self.decodes.limits(CodecLimits())
        key = device_key(cfg)
        state_dir = Path(cfg.state_dir) if cfg.state_dir else self.out_dir / "state"
        self.store = ClientStateStore(state_dir)
        self.device = DeviceLearner(cfg, data, task_dir, self.store.path.parent)
        self.serving = ServedModelWriter(
            self.out_dir,
            cfg.data.dataset if cfg.data else "",
            cfg.serve.int8,
            cfg.serve.export_timeout_s,
            class_names=served_class_names(cfg),
        )
        self.control = ControlServer(
            self.store.path.parent / "control.sock", self.status_snapshot, self.serving.model_path, cfg.serve.providers
        )
        self.nack_topic = topics.nack_topic(cfg.federation, cfg.client_id)  # why a frame of ours was dropped
        self.subscribed = (  # exact topics: a message on any other was misrouted by the broker
            self.decodes.announcements(cfg.federation, cfg.client_id),
            topics.knowledge_topic(cfg.federation, cfg.client_id),
            topics.status_topic(cfg.federation, topics.AGGREGATOR_ID),
            self.nack_topic,
        )
        self.link = link_factory(
            cfg.broker,
            f"fcl-{cfg.federation}-{cfg.client_id}",
            status_topic=topics.status_topic(cfg.federation, cfg.client_id),
            subscriptions=list(self.subscribed),
            on_message=lambda t, p, n: self.queue.put((t, p, n, time.monotonic())),
            meter=WireMeter(classify=downlink_tag(self.subscribed[2])),  # every byte received is named
        )
        # subscribed to only while a task's own frame names entries this device no longer holds
        full_topic = topics.knowledge_full_topic(cfg.federation, cfg.client_id)
        self.frames = ClientFrames(cfg.client_id, self.subscribed[1], full_topic, self.store, self.link, self.limits)
        self.sync = ModelSync(cfg.federation, self.link, self.decodes.derived_positions)
        # large retained frames come in chunks (docs/protocol.md, section 16)
        self.chunks = ChunkFetch(self.link, self.limits.max_frame_bytes, (self.subscribed[0],), self.decodes.chunks)
        self.uplink = Uplink(cfg.federation, cfg.client_id, self.link, key, self.limits, self.stop)
        self.stats = RoundStats()
        self.watch = AggregatorWatch(self.link, cfg.aggregator_timeout_s)
        self.nacks = NackLog(self.link)
        self.gate = RunGate(self.watch, cfg.max_clock_skew_s, cfg.run_over_s)
        torch.set_num_threads(cfg.threads)
        self.notifier = Notifier()
        self.watchdog = WatchdogThread(self.notifier)
        self.work = RoundWork(
            cfg,
            self.device,
            self.frames,
            self.sync,
            self.uplink,
            self.stats,
            self.store,
            self.serving,
            self.link,
            self.notifier,
        )
        self.work.restore()
        self.runs = RunLifecycle(
            cfg, self.device, self.gate, self.frames, self.work, self.uplink, self.serving, self.link
        )

    def run(self) -> ExitCode:
        """Serve until the run finishes or ``stop`` is set (SIGTERM): a stop waits for the
        round in hand to be checkpointed and sent, then says "stopped" and disconnects."""
        self.link.status_fields.update(
            role="client", task=self.device.task, round=self.device.done_round, **device_capabilities(self.decodes)
        )
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
                    self.watch.check()
                    finished = self.work.retry_waiting() or self._done_waiting()
                    continue
                finished = self._handle(topic, payload, size) or self._done_waiting()
        finally:
            self.notifier.stopping("shutting down")
            self.serving.close()
            self.control.stop()
            self.link.close(self.runs.final_state)
            self.stats.write(
                self.out_dir,
                self.cfg.client_id,
                self.sync.totals(),
                dict(self.frames.syncs),
                self.serving.child_peak_rss_mb,
                self.link.meter.snapshot(),
            )
            self.watchdog.stop()
        if self.exit_code is not None:
            return self.exit_code
        return ExitCode.OK if finished else ExitCode.INTERRUPTED

    def _done_waiting(self) -> bool:
        """Whether the device stops waiting now (``RunGate.verdict``): its final evaluation's end
        is committed, or it has nothing to do in any run (exit code set)."""
        verdict = self.gate.verdict(self.device.run_id)
        if verdict is not None and verdict is not ExitCode.OK:
            self.runs.exit_code = verdict
        return verdict is not None

    @property
    def exit_code(self) -> ExitCode | None:
        """Set when the run ends other than by finishing (failed, other run, nothing to do)."""
        return self.runs.exit_code

    def status_snapshot(self) -> dict:
        """What ``fcl ctl status`` shows (read from the control socket's thread)."""
        waiting = self.work.waiting
        return {
            "client_id": self.cfg.client_id,
            "federation": self.cfg.federation,
            "connected": self.link.connected.is_set(),
            "task": self.device.task,
            "last_round": self.device.done_round,
            "unacknowledged_update": self.uplink.unacked is not None,
            "tasks_on_device": len(self.device.data.train),
            "waiting_for_task": waiting[0].header.task if waiting else None,
            "served_model": str(self.serving.model_path) if self.serving.model_path.exists() else None,
            "serve_provider": self.control.provider,
            "train_device": str(self.device.train_device),
            "train_amp": self.cfg.train.amp,
            "bytes": {d: self.link.meter.snapshot()[d]["bytes"] for d in ("up", "down")},
            "health": self.stats.health(self.work.sync_report(), self.link.meter.snapshot(), self.cfg.memory_budget_mb),
            "retained_status": dict(self.link.status_fields),  # health; protocol fields where the daemon sets them
            "last_nack": self.nacks.last,
        }

    def _handle(self, topic: str, payload: bytes, size: int) -> bool:
        """Act on one downlink message; True when the run is finished."""
        if not payload:
            return False  # a deleted retained message
        self.stats.downlink(topic, size)
        if topic == topics.status_topic(self.cfg.federation, topics.AGGREGATOR_ID):
            self.watch.on_status(payload)
            held = self.gate.release()  # a frame of the run the status names now
            return self._handle(*held) if held is not None else False
        if topic == self.nack_topic:
            self._on_nack(payload)
            return False
        try:
            if payload[: len(CHUNK_MAGIC)] == CHUNK_MAGIC:
                whole = self._chunk(topic, payload, size)
                if whole is None:
                    return False
                topic, payload, size = whole
            elif topic not in self.subscribed and topic not in self.sync.topics and topic != self.frames.full_topic:
                raise RejectedFrame(f"topic: {topic} is not a topic this device subscribed to")
            return self._act(topic, payload, size)
        except (RejectedFrame, ChunkError) as exc:
            self.stats.drop(exc, topic)
            return False

    def _chunk(self, topic: str, payload: bytes, size: int) -> tuple[str, bytes, int] | None:
        """A chunk message: the whole frame it completes, or None while chunks are missing."""
        own = topic in self.subscribed or topic in self.sync.topics or topic == self.frames.full_topic
        if not (own or self.chunks.owns(topic)):
            raise RejectedFrame(f"topic: {topic} is not a topic this device subscribed to")
        return self.chunks.take(topic, payload, size)

    def _on_nack(self, payload: bytes) -> None:
        """Why the aggregator dropped a frame of this device; an update whose number it does not
        take is renumbered, checkpointed and sent again at once (P-SEQ-6)."""
        nack = self.nacks.take(payload, self.device.run_id)
        if nack is not None and self.uplink.renumber(nack):
            self.work.checkpoint(self.uplink.unacked)
            self.uplink.send(self.uplink.unacked, f"renumbered:{nack['round']}")
            self.uplink.sent_at = time.monotonic()

    def _check(self, payload: bytes) -> tuple[Frame, FederationSpec | None]:
        device = self.device
        return check_downlink(
            payload,
            self.cfg.federation,
            self.limits,
            lambda header: self.frames.keeps_tensors(header, device.task),
            device.fed,
            device.input_dim,
            None if device.task_dir is not None else len(device.data.train),
        )

    def _act(self, topic: str, payload: bytes, size: int) -> bool:
        frame, fed = self._check(payload)
        kind = frame.header.kind
        run = run_of(frame)
        device = self.device
        if run == device.run_id:
            self.gate.own_frame()
        if kind is Kind.KNOWLEDGE:
            if topic == self.frames.full_topic and run != device.run_id:
                return False  # fetched only for a task of this device's run
            if device.run_id is not None and run != device.run_id:
                if not is_newer(run, device.run_id):
                    raise RejectedFrame(
                        f"run: knowledge of run {run}, an earlier run than this device's {device.run_id}"
                    )
                self.frames.hold_newer(run, frame, payload, size)  # kept until it is joined
                return False
            return self.work.take_own_frame(topic, frame, payload, size)
        if kind is Kind.MODEL:
            if run != device.run_id:
                raise RejectedFrame(f"run: a model of run {run}, this device is in run {device.run_id}")
            parked = self.sync.take(topic, frame, size)
            return self._act(*parked) if parked is not None else False
        if kind is Kind.REQUEST:
            if run != device.run_id:
                raise RejectedFrame(f"run: a request of run {run}, this device is in run {device.run_id}")
            self.work.answer_request(frame, self.arrival)
            return False
        if device.run_id is None or run != device.run_id:
            met = self.runs.meet(frame, run, (topic, payload, size))
            if met is None:
                return False  # held until the aggregator's status names the run
            if met:
                return True
        if kind is Kind.FINISH and (frame.meta.get("failed") is not None or frame.header.round != fed.total_rounds):
            return self.runs.finish_early(frame, fed)
        outside = self.runs.outside(frame, fed)
        if outside is not None:
            return outside
        if kind is Kind.FINISH and device.done_round < 0:
            self.gate.saw_end_of_other_run()
            log.info("ignoring the end of a run this device did not take part in")
            return False
        if kind is Kind.FINISH and self.work.final_eval is not None:  # announced again (a restarted aggregator)
            self.uplink.send(self.work.final_eval, f"resend:eval:{frame.header.round}")
            return False
        if kind is Kind.ROUND and frame.header.round <= device.done_round:
            # seen again after a reconnect or a restart, or re-announced: the round is still open
            self.uplink.resend(frame.header.round, device.done_round, self.arrival, "its round is still open")
            return False
        model = self.sync.model(frame, fed, (topic, payload, size))
        if model is None:
            return False  # the announcement waits for a sync frame
        frame = dataclasses.replace(frame, tensors=model)
        self.uplink.unacked = None  # a later round or the end: the last update was taken or is moot
        device.load(frame, fed)
        if kind is Kind.FINISH:
            self.work.finish(frame)
            self.gate.final_sent = time.monotonic()  # held until the aggregator says the end is committed
            return False
        if fed.rounds.mode == "buffered" and self._announced_since():
            return False  # buffered rounds: the model is applied, the newest version is trained on
        if self.frames.wanted(frame, device.task, device.done_round):
            self.work.pending = (frame, size)  # the device's own frame is on its way on another topic
            return False
        return self.work.handle_round(frame, size)

    def _announced_since(self) -> bool:
        """A later announcement is queued already (docs/buffered.md)."""
        with self.queue.mutex:
            return any(topic == self.subscribed[0] for topic, *_ in self.queue.queue)
