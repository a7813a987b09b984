"""The aggregator service: announce a round, collect updates, aggregate, record, advance.

This module is the round loop and the service's lifecycle; the parts it drives each hold one
thing: ``intake`` takes messages into the open round (checked, folded, journaled),
``announcer`` and ``client_frames`` publish what devices receive through one ``outbox``,
``report`` writes each closed round to the run log, ``checkpoints`` commits rounds and resumes
them.  One thread runs it all (paho's network thread only queues raw messages), so no lock
guards the model.  No torch is imported on this path.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import methods
from aggregator.announcer import Announced, Announcer
from aggregator.buffered import Buffer
from aggregator.checkpoints import Checkpoints
from aggregator.client_frames import ClientFrames
from aggregator.clients import ClientSet
from aggregator.collector import Collector
from aggregator.downlink import ModelDownlink
from aggregator.inbox import Inbox
from aggregator.intake import Intake
from aggregator.metrics import AggregatorMetrics
from aggregator.nacks import Nacks
from aggregator.outbox import Outbox
from aggregator.partial import Sites
from aggregator.report import RunReport
from aggregator.runlog import RunLog
from aggregator.state import StateStore, fingerprint
from aggregator.variants import Variants
from fclcore import fastfold, topics
from fclcore.capabilities import aggregator_capabilities
from fclcore.codec import SPOKEN, CodecLimits, Kind
from fclcore.config import to_dict
from fclcore.errors import ConfigError, NotEnoughClients
from fclcore.exitcodes import ExitCode
from fclcore.membership import Membership
from fclcore.runid import new_run_id, started_us
from fclcore.schema import AggregatorConfig
from fclcore.sdnotify import Notifier, WatchdogThread
from fclcore.signing import load_keys
from fclcore.strategy import Update
from fclcore.transport import MqttLink, TransportError

log = logging.getLogger(__name__)


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
        downlink = ModelDownlink(
            self.fed.wire.value_dtype,
            methods.positions_for(self.fed, cfg.input_dim, "aggregator config"),
            self.fed.wire.catchup_versions,
        )
        keys = _provisioned_keys(cfg)
        self.membership = _membership(self.fed, cfg.expected_clients)
        self.clients = ClientSet(
            cfg.expected_clients,
            open_enrollment=cfg.enrollment == "open",
            max_clients=cfg.max_clients,
            drop_after_missed=cfg.drop_after_missed,
            admit=self._admit,
            membership=self.membership,
        )
        self.sites = Sites(cfg.sites, self.strategy, self.fed.method)  # senders whose frames are partial sums
        rounds = self.fed.rounds
        buffer = Buffer(rounds.buffer_k, rounds.max_staleness) if rounds.mode == "buffered" else None
        if buffer is not None and cfg.sites:
            raise ConfigError("aggregator config: sites: buffered rounds take updates from devices only")
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
            buffer=buffer,
        )
        self.runlog = RunLog(cfg.out_dir)
        self.open_round = 0  # the round being run (a failure announcement names it)
        self.store = StateStore(cfg.state_dir or Path(cfg.out_dir) / "state")
        self.checkpoints = Checkpoints(
            self.store,
            fingerprint(to_dict(self.fed), cfg.input_dim),
            self.fed.name,
            self.strategy,
            self.clients,
            self.inbox,
            self.runlog,
        )
        sequence = self._resume()
        # devices number their frames on this clock: nothing older than the run's start is of this run
        self.inbox.min_seq = started_us(self.run_id) - self.inbox.max_skew_us
        self.notifier = Notifier()
        self.watchdog = WatchdogThread(self.notifier)
        self.metrics = AggregatorMetrics(
            self.fed.name, cfg.metrics_port, cfg.metrics_addr, None, cfg.max_clients, cfg.metrics_linger_s, self.stop
        )
        self.metrics.configure(self.fed.total_rounds, self.fed.rounds.deadline_s)
        self.link = _link(link_factory, cfg, self.fed.name, on_message=lambda t, p, n: self.intake.put(t, p, n))
        self.link.status_fields.update(aggregator_capabilities())  # P-VER-6
        self.link.status_fields.update(run=self.run_id)  # devices join a run only once its aggregator names it
        self.report = RunReport(self.strategy, self.runlog, self.metrics, self.link, self.fed, self.limits)
        self.intake = Intake(
            self.fed.name,
            self.strategy,
            self.clients,
            self.inbox,
            self.sites,
            self.store,
            self.runlog,
            self.metrics,
            self.report,
            Nacks(self.link.publish, self.fed.name, self.run_id, SPOKEN),
            buffer,
        )
        self.outbox = Outbox(self.link, self.fed.name, self.run_id, sequence, self.fed.wire.chunk_bytes)
        self.intake.own_topics[topics.round_topic(self.fed.name)] = self.outbox.observe
        self.variants = Variants(self.outbox, self.fed.name, self.limits)  # for devices that decode less
        self.intake.declares = self.variants.on_status
        self.announcer = Announcer(
            self.outbox, self.fed, cfg.input_dim, self.strategy, downlink, self.limits, self.runlog, self.variants
        )
        self.client_frames = ClientFrames(self.outbox, self.fed, self.strategy, self.limits, self.runlog, self.variants)
        self.collector = Collector(
            self.fed.rounds, self.clients, self.intake, self.announcer, self.outbox, self.stop, self.watchdog.beat
        )

    # -- lifecycle -------------------------------------------------------------------
    def _resume(self) -> int:
        """Take back the last committed round, if any: sets the run id and the round to run
        next; returns the sequence to go on from."""
        committed = self.checkpoints.resume()
        self.fresh = committed is None  # a new run, whose start clears an earlier run's retained messages
        if committed is None:
            self.run_id, self.next_round = new_run_id(), 0
            return 0
        if committed.round < 0:
            log.info("resuming run %s of %s before its first round", committed.run_id, self.fed.name)
        self.global_params = committed.global_params
        self.run_id = committed.run_id or new_run_id()  # a checkpoint from before run ids: this run gets one now
        self.next_round = committed.round + 1
        return committed.sequence

    def _commit(self, rnd: int) -> None:
        self.checkpoints.commit(rnd, self.global_params, self.outbox.sequence, self.run_id)

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
        complete = False
        try:
            if self.fresh:
                self._clear_earlier_run()
                self._commit(-1)  # the run's identity: a restart before round 0 closes continues this run
            if finished_before:  # the end was committed: announce it again, for devices that missed it
                log.info("%s finished before this start; announcing its end again", self.fed.name)
                self._announce(Kind.FINISH, self.fed.total_rounds, self.schedule.task_of(self.fed.total_rounds))
                self._tell_ended()
                return ExitCode.OK
            last = self.next_round >= self.fed.total_rounds  # every round is committed: only the end is left
            carried = self.intake.replay(self.next_round, self.global_params, Kind.EVAL if last else Kind.UPDATE)
            if not last:
                self._wait_for_clients(carried)
            for rnd in range(self.next_round, self.fed.total_rounds):
                if self.stop.is_set():
                    return ExitCode.INTERRUPTED
                self._run_round(rnd, carried if rnd == self.next_round else {})
            if self.stop.is_set():
                return ExitCode.INTERRUPTED
            self._finish(carried if last else {})
            if self.stop.is_set():  # the end is not committed: a restart takes the journaled evaluations back
                return ExitCode.INTERRUPTED
            self._commit(self.fed.total_rounds)  # the federation's end: a restart does not run it again
            self._tell_ended()
            complete = True
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
                status = "complete" if complete else "interrupted" if self.stop.is_set() else "failed"
                final_roster = self.clients.roster(self.schedule.task_of(self.fed.total_rounds))
                self.report.summary(
                    time.monotonic() - started, self.run_id, list(self.clients.known), status, final_roster
                )
            self.runlog.close()
            self.store.close()  # a round left open (SIGTERM): its journal synced for the restart
            self.store.wait_swept(timeout=10)  # the last round's journal files (a restart deletes what is left)
            self.watchdog.stop()
            self.metrics.close()
        return ExitCode.INTERRUPTED if self.stop.is_set() else ExitCode.OK

    def _clear_earlier_run(self) -> None:
        """A new run: delete the retained round, model and client-frame messages an earlier run of
        this federation left on the broker (a broker with persistence keeps them across restarts),
        so no device acts on them.  Devices also ignore frames of another run (``meta.run``)."""
        expected = self.cfg.expected_clients
        topics_ = self.announcer.retained_topics() + self.client_frames.retained_topics(expected)
        topics_ += self.variants.retained_topics(expected)
        self.outbox.clear(topics_)
        self.runlog.write("run", run=self.run_id, cleared=len(topics_))

    def _announce_failure(self, reason: str) -> None:
        """Tell the devices, in a retained message of this run, that it failed: they end
        (``ExitCode.FEDERATION_FAILED``) instead of waiting for a round that will not come."""
        try:
            self.metrics.run_failed()
            self._announce(Kind.FINISH, self.open_round, self.schedule.task_of(self.open_round), failed=reason)
            self.runlog.write("failed", round=self.open_round, reason=reason)
        except Exception as exc:  # noqa: BLE001  (the exit code says it failed; this is a courtesy)
            log.warning("could not announce the failure: %s", exc)

    def _tell_ended(self) -> None:
        """Say in the retained status that the run's end is committed: devices hold their final
        evaluation (and re-send it when asked) until they see this, then exit."""
        self.link.status_fields.update(ended=self.run_id)
        self.link.publish_status("online")

    def _tell_roster(self, roster: list[str]) -> None:
        """Put the devices this service expects into its retained status (``fcl status`` lists
        the ones that never showed up)."""
        if self.link.status_fields.get("expected") != roster:
            self.link.publish_status("online", role="aggregator", expected=list(roster))

    def _wait_for_clients(self, carried: dict[str, Update]) -> None:
        """Until the first round's roster is online (updates for an open round taken meanwhile)."""
        expected = set(self.clients.roster(self.schedule.task_of(self.next_round)))  # active in the first task
        self._tell_roster(sorted(expected))
        open_round = self.next_round if self.next_round > 0 else -1
        self.collector.wait_online(expected, open_round, carried, self.global_params)

    # -- one round -------------------------------------------------------------------
    def _run_round(self, rnd: int, received: dict[str, Update]) -> None:
        self.open_round = rnd
        self.report.open()
        task = self.schedule.task_of(rnd)
        roster = self.clients.open_round(rnd, task)  # who this round is run with (the quorum is a share of it)
        self._tell_roster(roster)
        for client, state in self.clients.changes:
            self.runlog.write("membership", round=rnd, task=task, client=client, state=state)
        frame_sizes = self.client_frames.publish(rnd, task, roster)
        frames = sorted(frame_sizes) if self.membership is not None else None
        self.metrics.round_started(rnd, task, len(roster))
        for attempt in range(1, self.fed.rounds.max_attempts + 1):
            started = time.monotonic()
            self.notifier.status(f"round {rnd + 1}/{self.fed.total_rounds}, task {task}, attempt {attempt}")
            sent = self._announce(Kind.ROUND, rnd, task, attempt, frames)
            self.collector.collect(rnd, roster, self.global_params, received)
            if self.stop.is_set():
                return  # SIGTERM: the round stays open; its journal carries over to the restart
            if len(received) >= self.collector.quorum(len(roster)):
                self.global_params = self.intake.close(rnd, received, self.global_params)
                seconds = time.monotonic() - started
                self.report.record(rnd, task, roster, received, sent, attempt, seconds, frame_sizes)
                self.clients.close_round(roster, received)
                self._commit(rnd)
                return
            log.warning(
                "round %d attempt %d: %d updates, quorum %d%s",
                rnd,
                attempt,
                len(received),
                self.collector.quorum(len(roster)),
                "; re-announcing" if attempt < self.fed.rounds.max_attempts else "",
            )
        raise NotEnoughClients(f"round {rnd} missed its quorum in {self.fed.rounds.max_attempts} attempts")

    def _announce(
        self,
        kind: Kind,
        rnd: int,
        task: int,
        attempt: int = 1,
        frames: list[str] | None = None,
        failed: str | None = None,
    ) -> Announced:
        """Announce round ``rnd`` (``Announcer.announce``); the global model becomes the one
        every device decodes from it."""
        sent = self.announcer.announce(kind, rnd, task, self.global_params, attempt, frames, failed)
        self.global_params = sent.model
        return sent

    # -- the end of the run -----------------------------------------------------------
    def _finish(self, received: dict[str, Update]) -> None:
        """Send the final model; clients answer with an evaluation of it (journaled like updates:
        ``received`` holds those taken back after a restart), with as many attempts as a round
        (a device that restarts slowly still counts).  Stopped meanwhile, nothing is summed up:
        the restart goes on collecting."""
        last = self.fed.total_rounds
        self.open_round = last
        roster = self.clients.roster(self.schedule.task_of(last))  # the last task's active clients
        for attempt in range(1, self.fed.rounds.max_attempts + 1):
            self._announce(Kind.FINISH, last, self.schedule.task_of(last), attempt)
            self.collector.collect(last, roster, self.global_params, received, kind=Kind.EVAL)
            if self.stop.is_set() or self.collector.complete(received, set(roster)):
                break
        if self.stop.is_set():
            log.info("stopped during the final evaluation (%d/%d in); a restart goes on", len(received), len(roster))
            return
        self.runlog.round_summary(last - 1, self.schedule.task_of(last - 1))
        missing = sorted(set(roster) - set(received))
        log.info("final evaluation from %d/%d clients%s", len(received), len(roster), _missing(missing))


def _provisioned_keys(cfg: AggregatorConfig) -> dict | None:
    """The expected devices' public keys when updates must be signed (``keys_dir``), else None."""
    if not cfg.keys_dir:
        return None
    try:
        return load_keys(cfg.keys_dir, cfg.expected_clients)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"keys_dir: {exc}") from None


def _membership(fed, expected: list[str]) -> Membership:
    try:
        return Membership.of(fed, expected)
    except ValueError as exc:
        raise ConfigError(f"aggregator config: federation.{exc}") from None


def _link(link_factory, cfg: AggregatorConfig, name: str, on_message):
    """The aggregator's broker connection: device updates and statuses, and its own round topic
    too (what the broker holds there is checked: ``Outbox.observe``)."""
    return link_factory(
        cfg.broker,
        f"fcl-{name}-aggregator",
        status_topic=topics.status_topic(name, topics.AGGREGATOR_ID),
        subscriptions=[topics.update_filter(name), topics.status_filter(name), topics.round_topic(name)],
        on_message=on_message,
    )


def _missing(clients: list[str]) -> str:
    return f"; missing: {', '.join(clients)}" if clients else ""
