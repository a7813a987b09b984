"""What the device tells about itself besides its updates: whether it still sees its aggregator
(``AggregatorWatch``: log and retained status), and its own per-round measurements, written at
exit as ``wire.json`` for comparison with the aggregator's meter and a packet capture
(``RoundStats``)."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from edge_client.ledger import RoundLedger
from fclcore.health import device_health, meter_kinds
from fclcore.procmem import peak_rss_mb, rss_mb
from fclcore.runid import check_run_id
from fclcore.transport import parse_status

log = logging.getLogger("edge_client.daemon")  # its parts log as the daemon did before the split


class AggregatorWatch:
    def __init__(self, link, timeout_s: float) -> None:
        self.link, self.timeout_s = link, timeout_s
        self.lost_since: float | None = None  # since when the aggregator is gone (status or link)
        self.state = "unknown"
        self.told_lost = False
        self.run: str | None = None  # the run the aggregator's status last named (its last-will names none)
        self.ended: str | None = None  # the run whose end it last said is committed

    def on_status(self, payload: bytes) -> None:
        """The aggregator's retained status changed."""
        status = parse_status(payload)
        self.state = status["state"] if status else "unknown"
        if status and _is_run(status.get("run")):
            self.run = status["run"]
            self.ended = status.get("ended") if _is_run(status.get("ended")) else None
        if self.state == "online":
            if self.told_lost:
                log.info("the aggregator is back")
                self.link.publish_status("online", aggregator="online")
            self.lost_since, self.told_lost = None, False
        elif self.lost_since is None:
            self.lost_since = time.monotonic()

    def check(self) -> None:
        """Say so (log and status) when the aggregator has been gone longer than
        ``aggregator_timeout_s``: its status is "dead" or "stopped", or the broker is out of
        reach.  The device keeps waiting and reconnecting; it never ends as if finished."""
        if not self.link.connected.is_set() and self.lost_since is None:
            self.lost_since = time.monotonic()
        if self.lost_since is None or self.told_lost:
            return
        gone = time.monotonic() - self.lost_since
        if gone > self.timeout_s:
            why = "the broker is out of reach" if not self.link.connected.is_set() else f"its status is {self.state}"
            log.warning("no aggregator for %.0f s (%s); still waiting for it", gone, why)
            self.link.publish_status("online", aggregator="lost")
            self.told_lost = True


def _is_run(value: object) -> bool:
    try:
        check_run_id(value)
    except ValueError:
        return False
    return True


class RoundStats:
    def __init__(self) -> None:
        self.rejected: dict[str, int] = {}  # downlink messages dropped, by reason
        self.ledger = RoundLedger()  # what each round's row counts of the bytes received; the rest is run-level
        self.cpu_s: dict[int, float] = {}  # CPU seconds this process spent on each round
        # this thread's CPU seconds per round by phase: "eval" (the held-out report), "train"
        # (task start, training, upload); the rest of cpu_s is I/O and background threads
        self.cpu_phases: dict[int, dict[str, float]] = {}
        self.rss_mb: dict[int, list[float | None]] = {}  # [RSS, peak RSS] in MiB after each round
        self.down_kinds: dict[str, int] = {}  # PUBLISH bytes received, by topic kind (round, model, knowledge, ...)

    def drop(self, exc: Exception, topic: str | None = None) -> None:
        """Every downlink message this device drops is counted here, by reason (its updates
        report the counts: metrics.jsonl ``rejected_by_client``, summary.json likewise)."""
        reason = str(exc).split(":", 1)[0]
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        log.warning("dropped downlink message%s: %s", f" on {topic}" if topic else "", exc)

    def downlink(self, topic: str, size: int) -> None:
        """Count a received message by its topic's kind (``fcl/<fed>/<kind>/...``)."""
        parts = topic.split("/", 3)
        kind = parts[2] if len(parts) > 2 else "other"
        self.down_kinds[kind] = self.down_kinds.get(kind, 0) + size

    def health(self, syncs: dict[str, int], meter: dict, budget_mb: float | None) -> dict:
        """The status's ``health`` field (``fclcore.health``): memory, the last round's CPU,
        resyncs, this device's own byte meter by kind, its version."""
        cpu = list(self.cpu_s.values())  # a copy: the control socket's thread asks too
        up = meter_kinds(meter.get("by_tag", {}), "up")
        return device_health(cpu[-1] if cpu else None, syncs, up, dict(self.down_kinds), budget_mb)

    def round_done(self, rnd: int, cpu_s: float, eval_cpu: float, train_cpu: float) -> None:
        self.cpu_s[rnd] = round(cpu_s, 4)
        self.cpu_phases[rnd] = {"eval": round(eval_cpu, 4), "train": round(train_cpu, 4)}
        self.rss_mb[rnd] = [rss_mb(), peak_rss_mb()]

    def write(self, out_dir: Path, client_id: str, model_syncs: dict, frame_syncs: dict, child_mb: float, meter: dict):
        """``out_dir/wire.json`` (atomically), with the resyncs (the model's, the device's own
        frames': key ``knowledge_syncs``), the export child's peak RSS, the link's meter and the
        bytes no round row counts (``run_level``, ``edge_client.ledger``)."""
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out_dir / "wire.json.tmp"
        tmp.write_text(
            json.dumps(
                {
                    "client": client_id,
                    "rejected": self.rejected,
                    "round_bytes_down": self.ledger.bytes_down(),
                    "run_level": self.ledger.run_level(meter),
                    "model_syncs": model_syncs,
                    "knowledge_syncs": frame_syncs,
                    "round_cpu_s": self.cpu_s,
                    "round_cpu_phases": self.cpu_phases,
                    "round_rss_mb": self.rss_mb,
                    "max_rss_mb": peak_rss_mb(),
                    "export_child_peak_rss_mb": child_mb,
                    **meter,
                },
                indent=2,
            )
        )
        os.replace(tmp, out_dir / "wire.json")
