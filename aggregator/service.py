"""The aggregator service: announce a round, collect updates, aggregate, record, advance.

One thread owns all state: paho's network thread only puts raw messages on a queue, and
this loop decodes, validates and applies them, so no lock guards the model.  No torch is
imported on this path.

A strategy whose server step is a weighted sum (``Strategy.streams``) has each accepted
update folded into the round's ``RunningSum`` as it arrives; the round then keeps only the
update's metadata (and what the strategy asks to keep), so it holds O(model) memory.  The sum
lives in memory only: after a restart it is rebuilt from the round's journal, which replays
each accepted update through the same accept path once.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import methods
from aggregator.clients import ClientSet
from aggregator.downlink import ModelDownlink
from aggregator.inbox import Inbox, Rejection, is_finite_number
from aggregator.metrics import AggregatorMetrics
from aggregator.partial import Sites
from aggregator.progress import WaitNotice, byte_totals, quorum_count, round_line
from aggregator.runlog import RunLog
from aggregator.state import Committed, StateStore, fingerprint
from fclcore import fastfold, topics
from fclcore.aggregation import RunningSum
from fclcore.checkpoint import CheckpointError
from fclcore.codec import CodecLimits, Frame, Header, Kind, decode, encode
from fclcore.config import to_dict
from fclcore.errors import ConfigError, NotEnoughClients
from fclcore.exitcodes import ExitCode
from fclcore.membership import Membership
from fclcore.model_sync import SYNC_KNOWLEDGE_BYTES
from fclcore.runid import new_run_id, started_us
from fclcore.schema import AggregatorConfig
from fclcore.sdnotify import Notifier, WatchdogThread
from fclcore.signing import MAGIC as SIGNED_MAGIC
from fclcore.signing import TAG_BYTES, is_signed, load_keys
from fclcore.strategy import Update
from fclcore.transport import MqttLink, TransportError, parse_status, publish_packet_bytes

log = logging.getLogger(__name__)
POLL_S = 0.2
KNOWLEDGE_PREFIX = "kb:"  # tensors of an update that are knowledge-base entries (the methods' wire convention)


@dataclass(frozen=True)
class Incoming:
    topic: str
    payload: bytes
    packet_bytes: int


class AggregatorService:
    def __init__(self, cfg: AggregatorConfig, stop: threading.Event | None = None, link_factory=MqttLink) -> None:
        """``link_factory``: how to reach the broker (``MqttLink``, or an in-process link)."""
        self.cfg = cfg
        self.stop = stop or threading.Event()
        self.method, _, self.fed = methods.resolve(cfg.federation, "aggregator config")
        self.strategy = methods.strategy_for(self.fed, cfg.input_dim, aux_dir=cfg.aux_dir)
        self.schedule = self.strategy.schedule
        self.global_params = self.strategy.initial_model()
        self.limits = CodecLimits(max_frame_bytes=int(self.fed.wire.max_frame_mb * 2**20))
        self.downlink = ModelDownlink(
            self.fed.wire.value_dtype,
            methods.positions_for(self.fed, cfg.input_dim, "aggregator config"),
            self.fed.wire.catchup_versions,
        )
        self.announced_model_bytes = 0  # payload bytes of the model in the latest announcement
        keys = None
        if cfg.keys_dir:
            try:
                keys = load_keys(cfg.keys_dir, cfg.expected_clients)
            except (OSError, ValueError) as exc:
                raise ConfigError(f"keys_dir: {exc}") from None
        try:
            self.membership = Membership.of(self.fed, cfg.expected_clients)
        except ValueError as exc:
            raise ConfigError(f"aggregator config: federation.{exc}") from None
        self.clients = ClientSet(
            cfg.expected_clients,
            open_enrollment=cfg.enrollment == "open",
            max_clients=cfg.max_clients,
            drop_after_missed=cfg.drop_after_missed,
            admit=self._admit,
            membership=self.membership,
        )
        self.sites = Sites(cfg.sites, self.strategy, self.fed.method)  # senders whose frames are partial sums
        self.inbox = Inbox(
            self.fed.name,
            self.clients,
            self.sites.normalizer(self.strategy.normalize),
            self.fed.num_tasks,
            self.limits,
            keys=keys,
            max_update_norm=self.fed.rounds.max_update_norm,
            min_samples=self.strategy.min_samples,
            max_skew_us=int(cfg.max_clock_skew_s * 1e6),
        )
        self.runlog = RunLog(cfg.out_dir)
        self.queue: queue.Queue[Incoming] = queue.Queue()
        self.sequence = 0
        self.retained: dict[str, bytes] = {}  # what this service last published retained, per topic
        self.seen_connects = 0
        self.run_id = ""  # set by _resume: this run's identity (fclcore.runid), kept across restarts
        self.fresh = False  # no committed state: a new run, whose start clears an earlier run's retained messages
        self.open_round = 0  # the round being run (a failure announcement names it)
        # a streaming strategy's open round: (round, its sums, the clients whose update was folded)
        self.round_sum: tuple[int, RunningSum, set[str]] | None = None
        self.update_span: tuple[float, float] | None = (
            None  # wall-clock times of the open round's first and last update
        )
        self.tensor_bytes: dict[str, dict[str, int]] = {}  # client -> bytes by kind of its accepted update
        self.up_kinds: dict[str, dict[str, int]] = {}  # client -> its accepted update's packet bytes by kind
        self.sync_seen: dict[str, dict[str, int]] = {}  # client -> its latest cumulative sync report
        self.store = StateStore(cfg.state_dir or Path(cfg.out_dir) / "state")
        self.fingerprint = fingerprint(to_dict(self.fed), cfg.input_dim)
        self.next_round = self._resume()
        # devices number their frames on this clock: nothing older than the run's start is of this run
        self.inbox.min_seq = started_us(self.run_id) - self.inbox.max_skew_us
        self.notifier = Notifier()
        self.watchdog = WatchdogThread(self.notifier)
        self.metrics = AggregatorMetrics(self.fed.name, cfg.metrics_port, cfg.metrics_addr)
        self.link = link_factory(
            cfg.broker,
            f"fcl-{self.fed.name}-aggregator",
            status_topic=topics.status_topic(self.fed.name, topics.AGGREGATOR_ID),
            subscriptions=[topics.update_filter(self.fed.name), topics.status_filter(self.fed.name)],
            on_message=lambda t, p, n: self.queue.put(Incoming(t, p, n)),
        )

    # -- lifecycle -------------------------------------------------------------------
    def _resume(self) -> int:
        """Load the last committed round, if any; the round to run next."""
        try:
            committed = self.store.load()
        except CheckpointError as exc:
            raise ConfigError(f"state_dir: {exc}; move it away to start the federation afresh") from None
        if committed is None:
            self.run_id, self.fresh = new_run_id(), True
            return 0
        if committed.fingerprint != self.fingerprint:
            raise ConfigError(
                f"state_dir {self.store.dir}: it belongs to a different federation or input_dim; "
                f"move it away to start afresh, or restore the old config"
            )
        if not self.strategy.fits(committed.global_params):
            raise ConfigError(f"state_dir {self.store.dir}: the committed model does not fit this federation")
        try:
            self.strategy.restore(committed.strategy, committed.strategy_arrays)
            self.clients.restore(committed.clients)
            self.runlog.resume(committed.metrics_offset, committed.rejections)
        except (KeyError, ValueError, OSError) as exc:  # OSError: metrics.jsonl gone
            raise ConfigError(f"state_dir {self.store.dir}: cannot resume ({exc})") from None
        self.global_params = committed.global_params
        self.sequence = committed.sequence
        self.run_id = committed.run_id or new_run_id()  # a checkpoint from before run ids: this run gets one now
        self.inbox.last_seq.update(committed.last_seq)
        log.info("resuming %s after committed round %d", self.fed.name, committed.round)
        return committed.round + 1

    def _commit(self, rnd: int) -> None:
        meta, arrays = self.strategy.state()
        self.store.commit(
            Committed(
                self.fingerprint,
                rnd,
                self.sequence,
                dict(self.inbox.last_seq),
                dict(self.runlog.rejections),
                self.runlog.offset(),
                meta,
                self.global_params,
                arrays,
                self.clients.state(),
                self.run_id,
            )
        )

    def _admit(self, client: str) -> bool:
        """A device may enroll when updates need signatures only if its key is provisioned."""
        if not self.cfg.keys_dir:
            return True
        try:
            self.inbox.keys.update(load_keys(self.cfg.keys_dir, [client]))
        except (OSError, ValueError) as exc:
            log.warning("client %s not enrolled: %s", client, exc)
            return False
        return True

    def run(self) -> ExitCode:
        log.info("aggregator for %s, broker %s", self.fed.name, self.cfg.broker.redacted())
        if self.strategy.streams:  # compiled before the first round, not in its first fold
            log.info("streaming fold: %s", "compiled kernels (numba)" if fastfold.warm() else "numpy")
        try:
            self.link.start()
        except TransportError as exc:
            log.error("%s", exc)
            self.metrics.close()
            return ExitCode.BROKER_UNREACHABLE
        self.watchdog.start()
        self.notifier.ready(f"connected to {self.cfg.broker.url}")
        started = time.monotonic()
        finished_before = self.next_round > self.fed.total_rounds
        log.info("run %s of %s (%s)", self.run_id, self.fed.name, "new" if self.fresh else "resumed")
        if self.fresh:
            self._clear_earlier_run()
        try:
            if finished_before:  # the end was committed: announce it again, for devices that missed it
                log.info("%s finished before this start; announcing its end again", self.fed.name)
                self._announce(Kind.FINISH, self.fed.total_rounds, self.schedule.task_of(self.fed.total_rounds))
                return ExitCode.OK
            carried = self._replay_journal(self.next_round)
            if self.next_round < self.fed.total_rounds:  # else every round is committed: only the end is left
                self._wait_for_clients(carried)
            for rnd in range(self.next_round, self.fed.total_rounds):
                if self.stop.is_set():
                    return ExitCode.INTERRUPTED
                self._run_round(rnd, carried if rnd == self.next_round else {})
            if self.stop.is_set():
                return ExitCode.INTERRUPTED
            self._finish()
            self._commit(self.fed.total_rounds)  # the federation's end: a restart does not run it again
        except NotEnoughClients as exc:
            log.error("%s", exc)
            self._announce_failure(str(exc))
            return exc.exit_code
        except OSError as exc:  # the state or run directory cannot be written
            log.error("cannot write state: %s", exc)
            return ExitCode.STATE_ERROR
        finally:
            self.notifier.stopping("shutting down")
            self.link.close("stopped")
            if not finished_before:  # the summary of a finished run stays as it was written
                self._write_summary(time.monotonic() - started)
            self.runlog.close()
            self.store.close()  # a round left open (SIGTERM): its journal synced for the restart
            self.store.wait_swept(timeout=10)  # the last round's journal files (a restart deletes what is left)
            self.watchdog.stop()
            self.metrics.close()
        return ExitCode.INTERRUPTED if self.stop.is_set() else ExitCode.OK

    def _clear_earlier_run(self) -> None:
        """A new run: delete the retained round and knowledge messages an earlier run of this
        federation left on the broker (a broker with persistence keeps them across restarts),
        so no device acts on them.  Devices also ignore frames of another run (``meta.run``)."""
        topics_ = [topics.round_topic(self.fed.name)]
        topics_ += [topics.model_topic(self.fed.name, which) for which in ("full", "catchup")]
        topics_ += [topics.knowledge_topic(self.fed.name, c) for c in self.cfg.expected_clients]
        topics_ += [topics.knowledge_full_topic(self.fed.name, c) for c in self.cfg.expected_clients]
        for topic in topics_:
            self.link.publish(topic, b"", retain=True, tag="clear")
        self.runlog.write("run", run=self.run_id, cleared=len(topics_))

    def _announce_failure(self, reason: str) -> None:
        """Tell the devices, in a retained message of this run, that it failed: they end
        (``ExitCode.FEDERATION_FAILED``) instead of waiting for a round that will not come."""
        try:
            self._announce(Kind.FINISH, self.open_round, self.schedule.task_of(self.open_round), failed=reason)
            self.runlog.write("failed", round=self.open_round, reason=reason)
        except Exception as exc:  # noqa: BLE001  (the exit code says it failed; this is a courtesy)
            log.warning("could not announce the failure: %s", exc)

    def _wait_for_clients(self, carried: dict[str, Update]) -> None:
        """Wait for the clients' online status.  After a restart the round in progress is open
        already (its announcement is retained), so updates queued for it are taken here."""
        expected = set(self.clients.roster(self.schedule.task_of(self.next_round)))  # active in the first task
        deadline = time.monotonic() + self.fed.rounds.start_timeout_s
        open_round = self.next_round if self.next_round > 0 else -1
        need, notice = self._quorum(len(expected)), WaitNotice("start")
        self._tell_roster(sorted(expected))
        while not expected <= self.clients.online and time.monotonic() < deadline and not self.stop.is_set():
            self._drain(open_round, carried, timeout=POLL_S)
            notice.check(expected - self.clients.online, len(expected & self.clients.online), need, len(expected))
        online = len(self.clients.online & expected)
        if online < need:
            raise NotEnoughClients(
                f"{online} of {len(expected)} clients online after "
                f"{self.fed.rounds.start_timeout_s:.0f} s; quorum needs {need}"
            )
        log.info("%d/%d clients online", online, len(expected))

    # -- one round -------------------------------------------------------------------
    def _run_round(self, rnd: int, received: dict[str, Update]) -> None:
        self.open_round, self.update_span = rnd, None
        task = self.schedule.task_of(rnd)
        roster = self.clients.open_round(rnd, task)  # who this round is run with (the quorum is a share of it)
        self._tell_roster(roster)
        for client, state in self.clients.changes:
            self.runlog.write("membership", round=rnd, task=task, client=client, state=state)
        knowledge = self._send_downlinks(rnd, task, roster)
        frames = sorted(knowledge) if self.membership is not None else None
        self.metrics.round_started(rnd, task)
        for attempt in range(1, self.fed.rounds.max_attempts + 1):
            started = time.monotonic()
            self.notifier.status(f"round {rnd + 1}/{self.fed.total_rounds}, task {task}, attempt {attempt}")
            down, payload_down = self._announce(Kind.ROUND, rnd, task, attempt, frames)
            self._collect(rnd, roster, received)
            if self.stop.is_set():
                return  # SIGTERM: the round stays open; its journal carries over to the restart
            if len(received) >= self._quorum(len(roster)):
                self.global_params = self._close_model(rnd, received)
                bytes_before, seconds = byte_totals(self.runlog.bytes), time.monotonic() - started
                self._record_round(rnd, task, roster, received, down, payload_down, attempt, seconds, knowledge)
                self._say_round(rnd, task, len(received), len(roster), bytes_before, seconds)
                self.clients.close_round(roster, received)
                self._commit(rnd)
                return
            log.warning(
                "round %d attempt %d: %d updates, quorum %d; re-announcing",
                rnd,
                attempt,
                len(received),
                self._quorum(len(roster)),
            )
        raise NotEnoughClients(f"round {rnd} missed its quorum in {self.fed.rounds.max_attempts} attempts")

    def _close_model(self, rnd: int, received: dict[str, Update]) -> dict[str, np.ndarray]:
        """The round's next global model: from the running sums (streaming) or every update (batch)."""
        updates = [received[c] for c in sorted(received)]  # arrival order must not change the result
        if not self.strategy.streams:
            return self.strategy.aggregate(updates, self.global_params)
        running, folded = self._round_sum(rnd)
        if folded != set(received):  # each accepted update went through ``fold`` exactly once
            raise AssertionError(f"round {rnd}: folded {sorted(folded)}, accepted {sorted(received)}")
        self.round_sum = None
        return self.strategy.close(running, updates, self.global_params)

    def _round_sum(self, rnd: int) -> tuple[RunningSum, set[str]]:
        """Round ``rnd``'s running sum and who is in it; a new (empty) one when the round has none yet."""
        if self.round_sum is None or self.round_sum[0] != rnd:
            self.round_sum = (rnd, self.strategy.running_sum(self.global_params), set())
        return self.round_sum[1], self.round_sum[2]

    def _send_downlinks(self, rnd: int, task: int, roster: list[str]) -> dict[str, tuple[int, int]]:
        """Publish the strategy's per-client frames for round ``rnd`` (retained, before the round);
        today's use: each client's knowledge-base entries at a task start."""
        sizes = {}
        for client, (meta, tensors) in self.strategy.client_downlinks(rnd, roster).items():
            self.sequence += 1
            header = Header(Kind.KNOWLEDGE, self.fed.name, rnd, task, topics.AGGREGATOR_ID, self.sequence)
            payload = encode(Frame(header, {**meta, "run": self.run_id}, tensors), self.fed.value_coding, self.limits)
            topic = topics.knowledge_topic(self.fed.name, client)
            self.link.publish(topic, payload, retain=True, tag=f"knowledge:{task}")
            self.retained[topic] = payload
            sizes[client] = (publish_packet_bytes(topic, len(payload)), len(payload))
            self.runlog.write(
                "knowledge", task=task, client=client, bytes=sizes[client][0], **self.strategy.downlink_log(meta)
            )
        # what a device that lacks something its frame refers to fetches instead (it reports the bytes)
        for client, (meta, tensors) in self.strategy.full_downlinks(rnd, roster).items():
            self.sequence += 1
            header = Header(Kind.KNOWLEDGE, self.fed.name, rnd, task, topics.AGGREGATOR_ID, self.sequence)
            payload = encode(Frame(header, {**meta, "run": self.run_id}, tensors), self.fed.value_coding, self.limits)
            topic = topics.knowledge_full_topic(self.fed.name, client)
            self.link.publish(topic, payload, retain=True, tag=f"knowledge-full:{task}")
            self.retained[topic] = payload
        return sizes

    def _announce(
        self,
        kind: Kind,
        rnd: int,
        task: int,
        attempt: int = 1,
        frames: list[str] | None = None,
        failed: str | None = None,
    ) -> tuple[int, int]:
        """``frames``: the clients sent a frame of their own for this round; with a membership
        table the announcement names them (``client_frames``), so only they wait for one.
        ``failed``: a FINISH saying the run failed (no model, the reason)."""
        meta = {
            "run": self.run_id,
            "clock_us": time.time_ns() // 1000,  # devices keep their sequence numbers on this clock
            "federation": to_dict(self.fed),
            "input_dim": self.cfg.input_dim,
            "total_rounds": self.fed.total_rounds,
            "attempt": attempt,
            "schedule": self._schedule_meta(rnd),
            **self.strategy.announce_meta(rnd),
        }
        if frames is not None and meta.get("client_frames") is True:
            meta["client_frames"] = frames
        if failed is not None:
            meta["failed"] = failed[:200]
        self.sequence += 1
        header = Header(kind, self.fed.name, rnd, task, topics.AGGREGATOR_ID, self.sequence)
        tensors: dict = {}
        coding = self.fed.value_coding
        if failed is None:
            tensors, ref = self.downlink.prepare(rnd, self.global_params, lambda t: self._roundtrip(header, t))
            self.global_params = self.downlink.served  # the model as every device decodes it
            meta["model"] = ref.to_meta()
            self._publish_sync(rnd, task)
        payload = encode(Frame(header, meta, tensors), coding, self.limits)
        topic = topics.round_topic(self.fed.name)
        self.link.publish(topic, payload, retain=True, tag=f"{kind.name.lower()}:{rnd}")
        self.retained[topic] = payload
        self.announced_model_bytes = len(payload) - len(encode(Frame(header, meta, {}), coding, self.limits))
        return publish_packet_bytes(topic, len(payload)), len(payload)

    def _roundtrip(self, header: Header, tensors: dict) -> dict:
        """``tensors`` as a device decodes them from an announcement with ``header``."""
        payload = encode(Frame(header, {}, tensors), self.fed.value_coding, self.limits)
        return decode(payload, self.limits).tensors

    def _publish_sync(self, rnd: int, task: int) -> None:
        """The retained sync frames of the model about to be announced (published first, so a
        device that sees the announcement finds them): the full model and the catch-up."""
        for which, (tensors, ref, dtype) in self.downlink.sync_frames().items():
            self.sequence += 1
            header = Header(Kind.MODEL, self.fed.name, rnd, task, topics.AGGREGATOR_ID, self.sequence)
            payload = encode(Frame(header, {"run": self.run_id, "model": ref.to_meta()}, tensors), dtype, self.limits)
            topic = topics.model_topic(self.fed.name, which)
            self.link.publish(topic, payload, retain=True, tag=f"sync:{which}")
            self.retained[topic] = payload

    def _schedule_meta(self, rnd: int) -> dict:
        """This round's place in the task schedule and the previous round's (what the device's
        evaluation in this round's reply is of)."""
        previous = self.schedule.place(rnd - 1).to_meta() if rnd > 0 else None
        return {**self.schedule.place(rnd).to_meta(), "previous": previous}

    def _after_outage(self) -> None:
        """After a reconnect, publish the round's retained messages again: a broker that
        restarted without persistence has lost them, and clients that reconnect need them."""
        if self.link.connects == self.seen_connects:
            return
        if self.seen_connects:
            log.warning("reconnected to the broker; re-publishing %d retained message(s)", len(self.retained))
            for topic, payload in self.retained.items():
                self.link.publish(topic, payload, retain=True, tag="republish")
        self.seen_connects = self.link.connects

    def _replay_journal(self, rnd: int) -> dict[str, Update]:
        """Updates accepted in round ``rnd`` before a restart, checked again like new arrivals."""
        received: dict[str, Update] = {}
        for client, payload, packet_bytes in self.store.journaled(rnd):
            result = self.inbox.check(
                client, payload, packet_bytes, rnd, set(received), Kind.UPDATE, self.global_params
            )
            if isinstance(result, Update):
                self._accept(result, rnd, payload, received, journal=False)
        if received:
            log.info("round %d: %d update(s) recovered from the journal", rnd, len(received))
        return received

    def _collect(
        self, rnd: int, roster: list[str], received: dict[str, Update] | None = None, kind: Kind = Kind.UPDATE
    ) -> dict[str, Update]:
        """Fill ``received`` until every client of the round's roster replied or the deadline
        passes; clients still missing are asked to re-send every ``resend_after_s`` (their update
        may have been lost with a broker, or sent while this service was down)."""
        received = {} if received is None else received
        now = time.monotonic()
        deadline, resend_at = now + self.fed.rounds.deadline_s, now + self.fed.rounds.resend_after_s
        expected = set(roster)
        need = self._quorum(len(expected))
        notice = WaitNotice(f"round {rnd + 1}" if kind is Kind.UPDATE else "final evaluation")
        while not self._round_complete(received, expected) and time.monotonic() < deadline and not self.stop.is_set():
            self._drain(rnd, received, timeout=min(POLL_S, max(0.0, deadline - time.monotonic())), kind=kind)
            notice.check(expected - set(received), len(received), need, len(expected))
            self._after_outage()
            if time.monotonic() >= resend_at and set(received) < expected:
                self._request(kind, rnd, sorted(expected - set(received)))
                resend_at = time.monotonic() + self.fed.rounds.resend_after_s
        return received

    def _round_complete(self, received: dict[str, Update], expected: set[str]) -> bool:
        """Every expected client replied; or the quorum did and the rest are known to be gone
        (their status is "stopped" or the last-will "dead"), so waiting for the deadline is moot."""
        if set(received) >= expected:
            return True
        return len(received) >= self._quorum(len(expected)) and set(received) >= (expected & self.clients.online)

    def _request(self, kind: Kind, rnd: int, missing: list[str]) -> None:
        """Ask ``missing`` clients to send their update (or evaluation) for ``rnd`` again."""
        self.sequence += 1
        task = self.schedule.task_of(rnd)
        header = Header(Kind.REQUEST, self.fed.name, rnd, task, topics.AGGREGATOR_ID, self.sequence)
        meta = {"missing": missing, "kind": kind.name, "run": self.run_id}
        payload = encode(Frame(header, meta, {}), limits=self.limits)
        self.link.publish(topics.round_topic(self.fed.name), payload, tag=f"request:{rnd}")
        self.runlog.write("request", round=rnd, kind=kind.name, missing=missing)
        log.info("round %d: asked %s to re-send", rnd, ", ".join(missing))

    def _drain(self, open_round: int, received: dict[str, Update], timeout: float, kind: Kind = Kind.UPDATE) -> None:
        self.watchdog.beat()
        try:
            item = self.queue.get_nowait()
        except queue.Empty:
            self.store.sync()  # the queue ran dry: one fdatasync for what was journaled since the last
            try:
                item = self.queue.get(timeout=timeout)
            except queue.Empty:
                return
        who = topics.parse_status_topic(self.fed.name, item.topic)
        if who is not None:
            self._on_status(who, item.payload, open_round)
            return
        client = topics.parse_update_topic(self.fed.name, item.topic)
        task = self.schedule.task_of(max(0, open_round))
        if client is not None and client in self.clients and not self.clients.active(client, task):
            why = Rejection("inactive", f"{client} is not active in task {task}", client)
            self._reject(item.topic, why, open_round)
            return
        result = self.inbox.check(
            client, item.payload, item.packet_bytes, open_round, set(received), kind, self.global_params
        )
        if isinstance(result, Rejection):
            self._reject(item.topic, result, open_round)
            return
        self._accept(result, open_round, item.payload, received, journal=kind is Kind.UPDATE, kind=kind)

    def _accept(
        self,
        update: Update,
        rnd: int,
        payload: bytes,
        received: dict[str, Update],
        journal: bool,
        kind: Kind = Kind.UPDATE,
    ) -> None:
        """Take a checked message into round ``rnd``: an update is folded (streaming strategies)
        before it is journaled, so a crash in between loses nothing that a restart would not
        replay; a replayed update (``journal=False``) is folded into the rebuilt sum once."""
        if kind is Kind.UPDATE:
            self.tensor_bytes[update.client] = self.strategy.bytes_by_kind(update.frame.tensors, update.frame.meta)
            self.up_kinds[update.client] = _up_kinds(update, payload, self.fed.value_coding, self.limits)
            if self.strategy.streams:
                running, folded = self._round_sum(rnd)
                if update.client in folded:  # the inbox refuses a second update per round; never fold one
                    raise AssertionError(f"round {rnd}: a second fold for {update.client}")
                try:
                    update = self.sites.fold(self.strategy, running, update)
                    folded.add(update.client)
                except ValueError as exc:  # the sums are unchanged (RunningSum checks before it adds)
                    why = Rejection("fold", str(exc), update.client)
                    self._reject(topics.update_topic(self.fed.name, update.client), why, rnd)
                    return
            if journal:
                self.store.journal(rnd, update.client, payload, update.packet_bytes)
            now = time.time()
            self.update_span = (self.update_span[0] if self.update_span else now, now)
        if "eval" in update.frame.meta:
            self.runlog.evaluation(update.client, update.frame.meta["eval"])
        received[update.client] = update

    def _reject(self, topic: str, rejection: Rejection, open_round: int) -> None:
        log.warning("dropped message on %s: %s: %s", topic, rejection.reason, rejection.detail)
        self.metrics.rejected(rejection.reason)
        self.runlog.rejected(
            rejection.reason, rejection.detail, topic=topic, client=rejection.client, open_round=open_round
        )

    def _on_status(self, who: str, payload: bytes, open_round: int) -> None:
        if who == topics.AGGREGATOR_ID or not payload:
            return
        status = parse_status(payload)
        if status is None:
            self._reject(
                topics.status_topic(self.fed.name, who),
                Rejection("status", "not a JSON status object", who),
                open_round,
            )
            return
        self.clients.on_status(who, status["state"])  # any state but "online" ("retired" too): offline
        if status["state"] != "online":
            log.info("client %s is %s", who, status["state"])
        self.metrics.clients_online(len(self.clients.online & set(self.clients.enrolled)))

    def _record_round(
        self,
        rnd: int,
        task: int,
        roster: list[str],
        received: dict[str, Update],
        down: int,
        payload_down: int,
        attempt: int,
        duration: float,
        knowledge: dict[str, tuple[int, int]],
    ) -> None:
        model_down = self.announced_model_bytes
        dense_fp32 = self.strategy.dense_fp32_bytes  # a property that sums the model's shapes: once, not per row
        for client in roster:
            update = received.get(client)
            meta = update.frame.meta if update else {}
            kb_bytes, kb_payload = knowledge.get(client, (0, 0))
            sync = self._new_syncs(client, meta.get("sync")) if update else {}  # fetched since its last report
            sync_bytes = sync.pop("bytes", 0)
            kb_sync = sync.pop(SYNC_KNOWLEDGE_BYTES, 0)  # full knowledge frames it fetched
            kb_bytes, kb_payload = kb_bytes + kb_sync, kb_payload + kb_sync
            self.runlog.round_client(
                rnd,
                task,
                client,
                up=update.packet_bytes if update else 0,
                payload_up=update.payload_bytes if update else 0,
                down=down + kb_bytes + sync_bytes,
                payload_down=payload_down + kb_payload + sync_bytes,
                dense_fp32_up=dense_fp32 if update else 0,
                dense_fp32_down=dense_fp32,
                up_kinds=self.up_kinds.get(client, {}) if update else _kinds(0, 0, 0),
                down_kinds=_kinds(model_down + sync_bytes, kb_bytes, down - model_down),
                **({"sync": sync} if sync else {}),
                status="accepted" if update else "missing",
                n_samples=meta.get("n_samples"),
                train_nll=_number(meta.get("train_nll")),
                rejected_by_client=_counts(meta.get("rejected")),
                base_values=_count(meta.get("base_values")),
                **({"tensor_bytes_by_kind": self.tensor_bytes[client]} if update else {}),
            )
            if "attention" in meta:
                self.runlog.write("attention", round=rnd, task=task, client=client, **_attention(meta["attention"]))
        self.runlog.write(
            "round",
            round=rnd,
            task=task,
            attempt=attempt,
            accepted=len(received),
            expected=len(roster),
            duration_s=round(duration, 3),
            first_update_t=self.update_span and self.update_span[0],
            last_update_t=self.update_span and self.update_span[1],
        )
        self.metrics.round_done(rnd, task, len(received), duration)
        self.metrics.add_bytes(
            up=sum(u.packet_bytes for u in received.values()),
            down=sum(down + knowledge.get(c, (0, 0))[0] for c in roster),
        )
        self.up_kinds.clear()
        meter = self.link.meter.snapshot()
        self.link.publish_status(
            "online",
            role="aggregator",
            task=task,
            round=rnd,
            bytes_up=meter["up"]["bytes"],
            bytes_down=meter["down"]["bytes"],
        )
        if rnd > 0:
            self.runlog.round_summary(rnd - 1, self.schedule.task_of(rnd - 1))

    # -- end of run ------------------------------------------------------------------
    def _finish(self) -> None:
        """Send the final model; clients answer with an evaluation of it."""
        last = self.fed.total_rounds
        self._announce(Kind.FINISH, last, self.schedule.task_of(last))
        roster = self.clients.roster(self.schedule.task_of(last))  # the last task's active clients
        received = self._collect(last, roster, kind=Kind.EVAL)
        self.runlog.round_summary(last - 1, self.schedule.task_of(last - 1))
        log.info("final evaluation from %d/%d clients", len(received), len(roster))

    def _new_syncs(self, client: str, report: object) -> dict[str, int]:
        """What a device's cumulative sync report adds to the last one this service took from it
        (all of it when a count went down: the device restarted and counts afresh)."""
        now = _counts(report) or {}
        before = self.sync_seen.get(client, {})
        self.sync_seen[client] = now
        if any(n < before.get(k, 0) for k, n in now.items()):
            return dict(now)
        return {k: n - before.get(k, 0) for k, n in now.items() if n > before.get(k, 0)}

    def _write_summary(self, duration: float) -> None:
        self.runlog.summary(
            method=self.fed.method,
            federation=self.fed.name,
            run=self.run_id,
            clients=list(self.clients.known),
            tasks=self.fed.num_tasks,
            rounds=self.fed.total_rounds,
            rounds_per_task=self.fed.rounds_per_task,
            task_ends=[self.schedule.last_round(t) for t in range(self.schedule.num_tasks)],
            duration_s=round(duration, 2),
            meter=self.link.meter.snapshot(),
        )

    def _quorum(self, enrolled: int) -> int:
        """Updates a round needs: the configured share of the clients enrolled for it, as a count."""
        return quorum_count(self.fed.rounds.quorum, enrolled)

    def _say_round(self, rnd: int, task: int, accepted: int, expected: int, before: tuple, seconds: float) -> None:
        """The round's INFO line; its bytes are what the run log counted for it."""
        up, down = (after - then for after, then in zip(byte_totals(self.runlog.bytes), before))
        log.info("%s", round_line(rnd, self.fed.total_rounds, task, accepted, expected, up, down, seconds))

    def _tell_roster(self, roster: list[str]) -> None:
        """Put the devices this service expects into its retained status (``fcl status`` lists
        the ones that never showed up)."""
        if self.link.status_fields.get("expected") != roster:
            self.link.publish_status("online", role="aggregator", expected=list(roster))


def _attention(report: object) -> dict:
    """A client's attention report ({"entries": [ids], "alpha": [numbers]}), or nothing if malformed."""
    if not isinstance(report, dict):
        return {}
    entries, alpha = report.get("entries"), report.get("alpha")
    ok = (
        isinstance(entries, list)
        and isinstance(alpha, list)
        and len(entries) == len(alpha) <= 1024
        and all(isinstance(e, str) for e in entries)
        and all(is_finite_number(a) for a in alpha)
    )
    return {"entries": entries, "alpha": alpha} if ok else {}


def _number(value: object) -> float | None:
    return float(value) if is_finite_number(value) else None


def _count(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**53 else None


def _counts(value: object) -> dict[str, int] | None:
    """A client's {reason: count} report, or None if it is anything else (it goes into metrics)."""
    if not isinstance(value, dict) or len(value) > 32:
        return None
    clean = {k: _count(v) for k, v in value.items() if isinstance(k, str) and len(k) <= 64}
    return clean if len(clean) == len(value) and None not in clean.values() else None


def _kinds(model: int, knowledge: int, control: int) -> dict[str, int]:
    """Bytes by kind: the model, knowledge-base entries, and control (headers, metadata, MQTT)."""
    return {"model": int(model), "knowledge": int(knowledge), "control": int(control)}


def _up_kinds(update: Update, payload: bytes, coding: object, limits: CodecLimits) -> dict[str, int]:
    """An update's packet bytes by kind: its tensors' records (``kb:`` tensors are knowledge
    entries), and the rest (header, metadata, signature, MQTT header) as control."""
    frame = update.frame
    frame_len = len(payload) - (len(SIGNED_MAGIC) + TAG_BYTES if is_signed(payload) else 0)
    tensors = frame_len - len(encode(Frame(frame.header, frame.meta, {}), limits=limits))
    kb = {k: v for k, v in frame.tensors.items() if k.startswith(KNOWLEDGE_PREFIX)}
    empty = len(encode(Frame(frame.header, {}, {}), limits=limits))
    knowledge = len(encode(Frame(frame.header, {}, kb), coding, limits)) - empty if kb else 0
    return _kinds(tensors - knowledge, knowledge, update.packet_bytes - tensors)
