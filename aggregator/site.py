"""A site aggregator: one level of a hierarchy between a share of the devices and the root.

The site sits on its own broker, bridged to the root's (deploy/mosquitto/site-bridge.conf):
the bridge carries the root's downlink topics (``round``, ``kb/#``, the root's status) in and
the site's own ``update`` and ``status`` topics out, never a device's raw update.  So the site
neither re-encodes nor interprets the global model: its devices get the root's frames as the
root sent them, and the site reads only their header and metadata (round, task, run, kind).

Per round the root announces, the site collects its devices' updates (checked by the same
``Inbox`` as the root's, with the method's ``normalize``), folds each into a ``RunningSum`` and
journals it (``StateStore``), then forwards ONE partial-sum frame (``aggregator.partial``) on
``fcl/<fed>/update/<site_id>``, which the root merges as one weighted update.  A round is
forwarded when every device replied; or when the federation's quorum share of them replied and
the rest are offline; or after ``collect_s`` with at least one update.  Devices still missing
are asked to re-send every ``resend_after_s`` (a REQUEST on the site's broker only).

Exactly once: a restarted site replays its journal into a rebuilt sum before it takes new
updates, and commits (last forwarded round, each device's sequence mark) only after it
published the partial.  A crash between the two re-forwards the same frame, which the root
refuses as a duplicate (one update per sender and round), so no device is counted twice.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import methods
from aggregator.inbox import Inbox, Rejection
from aggregator.partial import check_hierarchy, encode_partial
from aggregator.runlog import RunLog
from aggregator.state import Committed, StateStore, fingerprint
from fclcore import checkpoint, fastfold, topics
from fclcore.aggregation import RunningSum
from fclcore.checkpoint import CheckpointError
from fclcore.chunks import CHUNK_MAGIC
from fclcore.codec import CodecError, CodecLimits, Frame, Header, Kind, decode, encode
from fclcore.config import to_dict
from fclcore.errors import ConfigError
from fclcore.exitcodes import ExitCode
from fclcore.runid import check_run_id, is_newer, started_us
from fclcore.schema import SiteConfig
from fclcore.signing import load_keys, read_key, sign
from fclcore.strategy import Update
from fclcore.transport import MqttLink, TransportError, parse_status

log = logging.getLogger(__name__)
POLL_S = 0.1


@dataclass
class OpenRound:
    """A round the root announced that this site has not forwarded yet (or the final evaluation)."""

    rnd: int
    task: int
    kind: Kind  # UPDATE for a training round, EVAL after FINISH
    running: RunningSum
    opened: float = field(default_factory=time.monotonic)
    received: dict[str, Update] = field(default_factory=dict)
    resend_at: float = 0.0
    update_span: tuple[float, float] | None = None  # wall-clock times of the first and last update taken


class SiteAggregator:
    def __init__(self, cfg: SiteConfig, stop: threading.Event | None = None, link_factory=MqttLink) -> None:
        self.cfg = cfg
        self.stop = stop or threading.Event()
        spec, _, self.fed = methods.resolve(cfg.federation, "site config")
        check_hierarchy(spec.strategy_class(), self.fed.method)  # before building it: no method's own errors
        self.strategy = methods.strategy_for(self.fed, cfg.input_dim)
        self.shape_model = self.strategy.initial_model()  # names and shapes only: the sums' template
        self.limits = CodecLimits(max_frame_bytes=int(self.fed.wire.max_frame_mb * 2**20))
        try:
            keys = load_keys(cfg.keys_dir, cfg.expected_clients) if cfg.keys_dir else None
            self.key = read_key(cfg.site_key) if cfg.site_key else None
        except (OSError, ValueError) as exc:
            raise ConfigError(f"site config: {exc}") from None
        self.devices = set(cfg.expected_clients)
        self.inbox = Inbox(
            self.fed.name,
            self.devices,
            self.strategy.normalize,
            self.fed.num_tasks,
            self.limits,
            keys=keys,
            min_samples=self.strategy.min_samples,
            max_skew_us=int(cfg.max_clock_skew_s * 1e6),
        )
        self.collect_s = cfg.collect_s or self.fed.rounds.deadline_s / 2
        self.store = StateStore(cfg.state_dir or Path(cfg.out_dir) / "state")
        self.forwarded_dir = self.store.dir / "forwarded"
        self.fingerprint = fingerprint(to_dict(self.fed), cfg.input_dim)
        self.runlog = RunLog(cfg.out_dir)
        self.online: set[str] = set()
        self.open: OpenRound | None = None
        self.forwarded_round, self.sequence, self.run_id = -1, 0, ""
        self._resume()
        self.queue: queue.Queue[tuple[str, bytes]] = queue.Queue()
        self.link = link_factory(
            cfg.broker,
            f"fcl-{self.fed.name}-site-{cfg.site_id}",
            status_topic=topics.status_topic(self.fed.name, cfg.site_id),
            subscriptions=[
                topics.round_topic(self.fed.name),
                topics.update_filter(self.fed.name),
                topics.status_filter(self.fed.name),
            ],
            on_message=lambda t, p, n: self.queue.put((t, p)),
        )

    def _resume(self) -> None:
        try:
            committed = self.store.load()
        except CheckpointError as exc:
            raise ConfigError(f"state_dir: {exc}; move it away to start the site afresh") from None
        if committed is None:
            return
        if committed.fingerprint != self.fingerprint:
            raise ConfigError(f"state_dir {self.store.dir}: it belongs to a different federation or input_dim")
        self.forwarded_round, self.sequence, self.run_id = committed.round, committed.sequence, committed.run_id
        self.inbox.last_seq.update(committed.last_seq)
        self._join_run(self.run_id)
        log.info("site %s resuming after forwarded round %d", self.cfg.site_id, self.forwarded_round)

    def run(self) -> ExitCode:
        try:
            self.link.start()
        except TransportError as exc:
            log.error("%s", exc)
            return ExitCode.BROKER_UNREACHABLE
        log.info("site %s of %s, %d device(s)", self.cfg.site_id, self.fed.name, len(self.devices))
        log.info("streaming fold: %s", "compiled kernels (numba)" if fastfold.warm() else "numpy")
        code = ExitCode.INTERRUPTED
        try:
            while not self.stop.is_set():
                try:
                    topic, payload = self.queue.get_nowait()
                except queue.Empty:
                    self.store.sync()  # the queue ran dry: one fdatasync for what was journaled since the last
                    try:
                        topic, payload = self.queue.get(timeout=POLL_S)
                    except queue.Empty:
                        topic = None
                done = self._dispatch(topic, payload) if topic is not None else None
                done = done if done is not None else self._tick()
                if done is not None:
                    code = done
                    break
        finally:
            self.link.close("stopped")
            self.store.close()  # a round left open: its journal synced for the restart
            self.runlog.close()
        return code

    # -- messages ------------------------------------------------------------------------
    def _dispatch(self, topic: str, payload: bytes) -> ExitCode | None:
        if topic == topics.round_topic(self.fed.name):
            return self._on_downlink(payload) if payload else None
        who = topics.parse_status_topic(self.fed.name, topic)
        if who is not None:
            status = parse_status(payload) if payload else None
            if who in self.devices and status is not None:
                (self.online.add if status["state"] == "online" else self.online.discard)(who)
            return None
        client = topics.parse_update_topic(self.fed.name, topic)
        if client != self.cfg.site_id:  # the site's own partial sums come back on its subscription
            self._on_update(client, topic, payload)
        return None

    def _on_downlink(self, payload: bytes) -> ExitCode | None:
        """The root's ROUND, FINISH or REQUEST (the bridge carries them in verbatim)."""
        if payload[: len(CHUNK_MAGIC)] == CHUNK_MAGIC:
            log.warning(
                "the root sent a frame in chunks (wire.chunk_bytes, docs/protocol.md P-CHK-6), which a site "
                "does not put together: set federation.wire.chunk_bytes: null for a hierarchy"
            )
            return None
        try:
            frame = decode(payload, self.limits)
            run = check_run_id(frame.meta.get("run"))
        except (CodecError, ValueError) as exc:
            log.warning("dropped a downlink frame: %s", exc)
            return None
        h = frame.header
        if h.federation != self.fed.name or h.client != topics.AGGREGATOR_ID:
            return None
        if run != self.run_id:
            if self.run_id and not is_newer(run, self.run_id):
                return None  # an earlier run's retained frame
            self._new_run(run)
        if h.kind is Kind.REQUEST:
            if self.cfg.site_id in frame.meta.get("missing", ()):
                self._resend(h.round)
            return None
        if frame.meta.get("federation") not in (None, to_dict(self.fed)):
            log.error("the root's federation settings differ from this site's config: stopping")
            return ExitCode.BAD_INPUT
        if h.kind is Kind.FINISH and frame.meta.get("failed") is not None:
            log.error("the root announced that the run failed: %s", frame.meta["failed"])
            return ExitCode.FEDERATION_FAILED
        if h.kind in (Kind.ROUND, Kind.FINISH):
            self._on_round(h.round, h.task, Kind.UPDATE if h.kind is Kind.ROUND else Kind.EVAL)
        return None

    def _on_round(self, rnd: int, task: int, kind: Kind) -> None:
        if self.open is not None and (self.open.rnd, self.open.kind) == (rnd, kind):
            return  # announced again (a re-announcement, or a reconnect's retained copy)
        if rnd <= self.forwarded_round:
            if rnd == self.forwarded_round:
                self._resend(rnd)  # the root announced our round again: it may have lost our partial
            return
        if self.open is not None:
            log.warning("round %d closed at the root before this site forwarded it", self.open.rnd)
        self.open = OpenRound(rnd, task, kind, self.strategy.running_sum(self.shape_model))
        self.open.resend_at = time.monotonic() + self.fed.rounds.resend_after_s
        if kind is Kind.UPDATE:
            self._replay_journal(self.open)

    def _replay_journal(self, open_: OpenRound) -> None:
        for client, payload, packet_bytes in self.store.journaled(open_.rnd):
            result = self.inbox.check(client, payload, packet_bytes, open_.rnd, set(open_.received), Kind.UPDATE)
            if isinstance(result, Update):
                self._accept(result, payload, journal=False)
        if open_.received:
            log.info("round %d: %d update(s) recovered from the journal", open_.rnd, len(open_.received))

    def _on_update(self, client: str | None, topic: str, payload: bytes) -> None:
        open_ = self.open
        if open_ is None:  # checked before the inbox, so the device's sequence mark stays: it re-sends when asked
            self._reject(topic, Rejection("round", "no round is open at this site", client))
            return
        result = self.inbox.check(client, payload, len(payload), open_.rnd, set(open_.received), open_.kind)
        if isinstance(result, Rejection):
            self._reject(topic, result)
        else:
            self._accept(result, payload, journal=open_.kind is Kind.UPDATE)

    def _accept(self, update: Update, payload: bytes, journal: bool) -> None:
        open_ = self.open
        if open_.kind is Kind.UPDATE:
            try:
                update = self.strategy.fold(open_.running, update)
            except ValueError as exc:  # the sums are unchanged
                self._reject(topics.update_topic(self.fed.name, update.client), Rejection("fold", str(exc)))
                return
            if journal:
                self.store.journal(open_.rnd, update.client, payload, update.packet_bytes)
            now = time.time()
            open_.update_span = (open_.update_span[0] if open_.update_span else now, now)
        if "eval" in update.frame.meta:
            self.runlog.evaluation(update.client, update.frame.meta["eval"])
        open_.received[update.client] = update

    def _reject(self, topic: str, rejection: Rejection) -> None:
        log.warning("dropped message on %s: %s: %s", topic, rejection.reason, rejection.detail)
        self.runlog.rejected(rejection.reason, rejection.detail, topic=topic, client=rejection.client)

    # -- forwarding ----------------------------------------------------------------------
    def _tick(self) -> ExitCode | None:
        """Forward the open round once it is complete; ask missing devices to re-send."""
        open_ = self.open
        if open_ is None:
            return None
        now = time.monotonic()
        missing = self.devices - set(open_.received)
        if not self._complete(open_, now):
            if missing and now >= open_.resend_at:
                self._request(open_, sorted(missing))
                open_.resend_at = now + self.fed.rounds.resend_after_s
            return None
        if open_.kind is Kind.EVAL:
            self._send(open_, {"evaluated": len(open_.received)}, {}, Kind.EVAL)
            self.runlog.write("finish", round=open_.rnd, evaluated=sorted(open_.received))
            return ExitCode.OK
        self._forward(open_)
        return None

    def _complete(self, open_: OpenRound, now: float) -> bool:
        got = set(open_.received)
        if got >= self.devices:
            return True
        quorum = max(1, int(-(-self.fed.rounds.quorum * len(self.devices) // 1)))
        if len(got) >= quorum and got >= self.devices & self.online:
            return True
        return bool(got) and now - open_.opened >= self.collect_s

    def _forward(self, open_: OpenRound) -> None:
        """Publish the round's partial sum, then commit; an earlier copy of it is re-used."""
        path = self.forwarded_dir / f"{open_.rnd}.frame"
        payload = path.read_bytes() if path.exists() else None
        if payload is None:
            meta, tensors = encode_partial(open_.running)
            payload = self._frame(open_, meta, tensors, Kind.UPDATE)
            checkpoint.write_atomic(path, payload)
        self.link.publish(topics.update_topic(self.fed.name, self.cfg.site_id), payload, tag=f"partial:{open_.rnd}")
        self.store.commit(  # clears the journal
            Committed(self.fingerprint, open_.rnd, self.sequence, dict(self.inbox.last_seq), run_id=self.run_id)
        )
        for old in self.forwarded_dir.glob("*.frame"):
            if old != path:
                old.unlink(missing_ok=True)
        first, last = open_.update_span or (None, None)
        self.runlog.write(
            "partial",
            round=open_.rnd,
            task=open_.task,
            devices=sorted(open_.received),
            bytes=len(payload),
            first_update_t=first,
            last_update_t=last,
        )
        log.info("round %d: forwarded the partial sum of %d device(s)", open_.rnd, len(open_.received))
        self.forwarded_round, self.open = open_.rnd, None

    def _resend(self, rnd: int) -> None:
        path = self.forwarded_dir / f"{rnd}.frame"
        if rnd == self.forwarded_round and path.exists():
            self.link.publish(topics.update_topic(self.fed.name, self.cfg.site_id), path.read_bytes(), tag="resend")

    def _send(self, open_: OpenRound, meta: dict, tensors: dict, kind: Kind) -> None:
        payload = self._frame(open_, meta, tensors, kind)
        self.link.publish(topics.update_topic(self.fed.name, self.cfg.site_id), payload, tag=kind.name.lower())

    def _frame(self, open_: OpenRound, meta: dict, tensors: dict, kind: Kind) -> bytes:
        """A frame from this site to the root, numbered as a device numbers its own (P-SEQ-1):
        the site's counter, above the start of the root's run."""
        self.sequence = max(self.sequence, started_us(self.run_id) if self.run_id else 0) + 1
        header = Header(kind, self.fed.name, open_.rnd, open_.task, self.cfg.site_id, self.sequence)
        payload = encode(Frame(header, meta, tensors), "float32", self.limits)
        return sign(payload, self.key) if self.key is not None else payload

    def _request(self, open_: OpenRound, missing: list[str]) -> None:
        """Ask this site's missing devices to re-send (published on the site's broker only)."""
        self.sequence += 1
        header = Header(Kind.REQUEST, self.fed.name, open_.rnd, open_.task, topics.AGGREGATOR_ID, self.sequence)
        meta = {"missing": missing, "kind": open_.kind.name, "run": self.run_id}
        self.link.publish(topics.round_topic(self.fed.name), encode(Frame(header, meta, {}), limits=self.limits))
        log.info("round %d: asked %s to re-send", open_.rnd, ", ".join(missing))

    # -- runs ----------------------------------------------------------------------------
    def _new_run(self, run: str) -> None:
        """The root started a run this site has no state of: forget an earlier run's."""
        if self.run_id:
            log.info("the root started run %s; forgetting run %s", run, self.run_id)
            self.store.clear_journal()
            self.inbox.last_seq.clear()
        self.forwarded_round, self.open = -1, None
        self._join_run(run)

    def _join_run(self, run: str) -> None:
        self.run_id = run
        if run:
            self.inbox.min_seq = started_us(run) - self.inbox.max_skew_us
