"""What the service reports of a closed round and of the run: the round's rows in the run log
(one per client of its roster: bytes up and down by kind, what the device reported), its own
event, the metrics, the retained status, the INFO line; at the end, ``summary.json``.

The accounting of an update is taken when it is accepted (``measure``, ``arrived``): a streaming
strategy folds the update's tensors away before the round closes.  Bytes are counted by kind
(``model``, ``knowledge``: the tensors of per-client frames, ``control``: headers, metadata,
signatures, MQTT) under the names ``metrics.jsonl`` has always used (docs/metrics.md).
"""

from __future__ import annotations

import logging
import time
from typing import Mapping, Protocol

from aggregator.announcer import Announced
from aggregator.client_frames import FrameSizes
from aggregator.inbox import is_finite_number
from aggregator.metrics import AggregatorMetrics
from aggregator.progress import byte_totals, round_line
from aggregator.runlog import RunLog
from aggregator.variants import Sent
from fclcore.codec import CodecLimits, Frame, encode
from fclcore.model_sync import SYNC_KNOWLEDGE_BYTES
from fclcore.schema import FederationSpec
from fclcore.signing import MAGIC as SIGNED_MAGIC
from fclcore.signing import TAG_BYTES, is_signed
from fclcore.strategy import Strategy, Update
from fclcore.transport import WireMeter

log = logging.getLogger(__name__)
# the tensors of an update that feed other clients' frames (the methods' wire convention)
FRAME_TENSOR_PREFIX = "kb:"


class StatusLink(Protocol):
    """What the report needs of a transport (``fclcore.transport.MqttLink``)."""

    meter: WireMeter

    def publish_status(self, state: str, **extra: object) -> object: ...


class RunReport:
    def __init__(
        self,
        strategy: Strategy,
        runlog: RunLog,
        metrics: AggregatorMetrics,
        link: StatusLink,
        fed: FederationSpec,
        limits: CodecLimits,
    ) -> None:
        self.strategy = strategy
        self.schedule = strategy.schedule
        self.runlog = runlog
        self.metrics = metrics
        self.link = link
        self.fed = fed
        self.limits = limits
        self.tensor_bytes: dict[str, dict[str, int]] = {}  # client -> bytes by kind of its accepted update
        self.up_kinds: dict[str, dict[str, int]] = {}  # client -> its accepted update's packet bytes by kind
        self.sync_seen: dict[str, dict[str, int]] = {}  # client -> its latest cumulative sync report
        self.update_span: tuple[float, float] | None = None  # wall-clock times of the round's first and last update

    def open(self) -> None:
        """A round opens: its updates have not begun to arrive."""
        self.update_span = None

    def measure(self, update: Update, payload: bytes) -> None:
        """Count an update's bytes by kind while its tensors are still there (before a fold)."""
        self.tensor_bytes[update.client] = self.strategy.bytes_by_kind(update.frame.tensors, update.frame.meta)
        self.up_kinds[update.client] = _up_kinds(update, payload, self.fed.value_coding, self.limits)

    def arrived(self) -> None:
        """An update of the open round was taken (now)."""
        now = time.time()
        self.update_span = (self.update_span[0] if self.update_span else now, now)

    def record(
        self,
        rnd: int,
        task: int,
        roster: list[str],
        received: Mapping[str, Update],
        sent: Announced,
        attempt: int,
        duration: float,
        frames: FrameSizes,
    ) -> None:
        """Report the closed round (``sent``: its last announcement; ``frames``: the per-client
        frames published for it), and the mean evaluation of the round before."""
        bytes_before = byte_totals(self.runlog.bytes)
        dense_fp32 = self.strategy.dense_fp32_bytes  # a property that sums the model's shapes: once, not per row
        full = self.strategy.full_finetune_fp32_bytes
        for client in roster:
            frame = frames.get(client, (0, 0))
            self._client_row(rnd, task, client, received.get(client), sent, frame, dense_fp32, full)
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
            down=sum(sent.to(c).packet_bytes + frames.get(c, (0, 0))[0] for c in roster),
            dense_up=dense_fp32 * len(received),
            dense_down=dense_fp32 * len(roster),
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
            self._learning(rnd - 1)
        up, down = (after - then for after, then in zip(byte_totals(self.runlog.bytes), bytes_before))
        log.info("%s", round_line(rnd, self.fed.total_rounds, task, len(received), len(roster), up, down, duration))

    def _learning(self, rnd: int, fleet: dict | None = None) -> None:
        """The learning gauges from the evaluations of the model after round ``rnd``: each task's
        fleet mean, and at a task's end (or with ``fleet``, the run's) the continual metrics."""
        found = self.runlog.round_means(rnd)
        if found is None:
            return
        metric, means = found
        ends = [e for e in self.task_ends if e <= rnd]
        if fleet is None and rnd in ends:
            fleet = self.runlog.fleet_scores(list(self.runlog.evals), ends)
        self.metrics.learning(metric, means, fleet, len(ends))

    @property
    def task_ends(self) -> list[int]:
        return [self.schedule.last_round(t) for t in range(self.schedule.num_tasks)]

    def summary(self, duration: float, run_id: str, clients: list[str], status: str, final_roster: list[str]) -> None:
        """The run's ``summary.json`` (``duration``: seconds this start ran; ``status``: complete,
        interrupted or failed; ``final_roster``: the devices whose final evaluation it needs)."""
        last = self.fed.total_rounds - 1  # a final evaluation reports on the model after the last round
        out = self.runlog.summary(
            method=self.fed.method,
            federation=self.fed.name,
            status=status,
            missing_final_evaluations=[c for c in sorted(final_roster) if last not in self.runlog.evals.get(c, {})],
            run=run_id,
            clients=clients,
            tasks=self.fed.num_tasks,
            rounds=self.fed.total_rounds,
            rounds_per_task=self.fed.rounds_per_task,
            task_ends=self.task_ends,
            duration_s=round(duration, 2),
            meter=self.link.meter.snapshot(),
        )
        self._learning(self.fed.total_rounds - 1, out["fleet"])

    def _client_row(
        self,
        rnd: int,
        task: int,
        client: str,
        update: Update | None,
        sent: Announced | Sent,
        frame: tuple[int, int],
        dense_fp32: int,
        full_finetune: int | None,
    ) -> None:
        meta = update.frame.meta if update else {}
        references = (
            {}
            if full_finetune is None
            else {"full_finetune_fp32_up": full_finetune if update else 0, "full_finetune_fp32_down": full_finetune}
        )
        frame_bytes, frame_payload = frame
        sent = sent.to(client)  # a device that reads its own topic got a variant (aggregator.variants)
        sync = self._new_syncs(client, meta.get("sync")) if update else {}  # fetched since its last report
        sync_bytes = sync.pop("bytes", 0)
        frame_sync = sync.pop(SYNC_KNOWLEDGE_BYTES, 0)  # the full client frames it fetched
        frame_bytes, frame_payload = frame_bytes + frame_sync, frame_payload + frame_sync
        up_kinds = self.up_kinds.get(client, {}) if update else _kinds(0, 0, 0)
        down_kinds = _kinds(sent.model_bytes + sync_bytes, frame_bytes, sent.packet_bytes - sent.model_bytes)
        self.metrics.devices.round_closed(
            client,
            update is not None,
            update.packet_bytes if update else 0,
            sum(down_kinds.values()),
            up_kinds,
            down_kinds,
        )
        self.runlog.round_client(
            rnd,
            task,
            client,
            up=update.packet_bytes if update else 0,
            payload_up=update.payload_bytes if update else 0,
            down=sent.packet_bytes + frame_bytes + sync_bytes,
            payload_down=sent.payload_bytes + frame_payload + sync_bytes,
            dense_fp32_up=dense_fp32 if update else 0,
            dense_fp32_down=dense_fp32,
            **references,
            up_kinds=up_kinds,
            down_kinds=down_kinds,
            **({"sync": sync} if sync else {}),
            status="accepted" if update else "missing",
            **({"trained_on": update.frame.header.round} if update and update.frame.header.round != rnd else {}),
            n_samples=meta.get("n_samples"),
            train_nll=_number(meta.get("train_nll")),
            rejected_by_client=_counts(meta.get("rejected")),
            base_values=_count(meta.get("base_values")),
            **({"tensor_bytes_by_kind": self.tensor_bytes[client]} if update else {}),
        )
        if "attention" in meta:
            self.runlog.write("attention", round=rnd, task=task, client=client, **_attention(meta["attention"]))

    def _new_syncs(self, client: str, report: object) -> dict[str, int]:
        """What a device's cumulative sync report adds to the last one this service took from it
        (all of it when a count went down: the device restarted and counts afresh)."""
        now = _counts(report) or {}
        before = self.sync_seen.get(client, {})
        self.sync_seen[client] = now
        if any(n < before.get(k, 0) for k, n in now.items()):
            return dict(now)
        return {k: n - before.get(k, 0) for k, n in now.items() if n > before.get(k, 0)}


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


def _kinds(model: int, frames: int, control: int) -> dict[str, int]:
    """Bytes by kind: the model, per-client frame tensors, and control (headers, metadata, MQTT),
    under the run log's names."""
    return {"model": int(model), "knowledge": int(frames), "control": int(control)}


def _up_kinds(update: Update, payload: bytes, coding: object, limits: CodecLimits) -> dict[str, int]:
    """An update's packet bytes by kind: its tensors' records (those that feed client frames
    apart), and the rest (header, metadata, signature, MQTT header) as control."""
    frame = update.frame
    frame_len = len(payload) - (len(SIGNED_MAGIC) + TAG_BYTES if is_signed(payload) else 0)
    tensors = frame_len - len(encode(Frame(frame.header, frame.meta, {}), limits=limits))
    shared = {k: v for k, v in frame.tensors.items() if k.startswith(FRAME_TENSOR_PREFIX)}
    empty = len(encode(Frame(frame.header, {}, {}), limits=limits))
    frame_tensors = len(encode(Frame(frame.header, {}, shared), coding, limits)) - empty if shared else 0
    return _kinds(tensors - frame_tensors, frame_tensors, update.packet_bytes - tensors)
