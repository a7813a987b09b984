"""Per-device Prometheus series: what the aggregator knows of each device, and what each device
says of itself in its retained status (``fclcore.health``).

Labels are bounded: ``federation`` and ``device`` on every series (a device is tracked only
once it is enrolled or waiting to enroll, so at most ``max_devices``), plus ``direction`` and
``kind`` (a fixed 2 x 3) on the byte counters and ``reason`` (``REJECTION_REASONS``, anything
else counted as ``other``) on the rejections; nothing is labelled by round.  The series per
device are counted in docs/monitoring.md.

``prometheus_client`` formats about 200,000 samples a second, so 10,000 devices would take it
about a second per scrape; ``render`` writes the exposition text itself from label strings
made once per device (benchmarks/bench_fleet.py ``--scrape`` times it).  The service's thread
updates the records while the HTTP thread renders them: a record's fields are plain numbers,
and the table of records is copied under a lock.
"""

from __future__ import annotations

import operator
import threading
import time
from dataclasses import dataclass, field

from fclcore.health import read_health, read_protocol

# every reason the inbox, the intake and the methods' ``Rejected`` use (a test keeps this in step)
REJECTION_REASONS = frozenset(
    "budget centres codec consent content duplicate embeddings entries federation fold inactive kind knowledge "
    "labels late meta nonfinite norm replay round sender sequence signature status table unknown-client version "
    "stale compression decodes".split()
)
DIRECTIONS = ("up", "down")
KINDS = ("model", "knowledge", "control")  # the run log's byte kinds (aggregator/report.py)
MB = 2**20


@dataclass(slots=True)
class DeviceRecord:
    labels: str  # 'federation="f",device="d"', escaped once
    online: bool = False
    last_seen: int = 0  # unix time (whole seconds) of its last status or accepted update
    participated: int = 0
    missed: int = 0
    last_up: int = 0  # packet bytes of its last closed round
    last_down: int = 0
    bytes: list[int] = field(default_factory=lambda: [0] * (len(DIRECTIONS) * len(KINDS)))
    last_round: int = -1  # the last round it uploaded for (its model version)
    task: int = -1
    peak_rss_mb: float | None = None
    gpu_peak_mb: float | None = None
    budget_mb: float | None = None
    cpu_s: float | None = None
    resyncs: int = 0
    version: str = "unknown"
    protocol: str = "unknown"
    rejected: dict[str, int] = field(default_factory=dict)


# name, type, the record's field ("lag": computed at the scrape; "_mb" fields are exported in bytes), help
PER_DEVICE = (
    ("fcl_device_online", "gauge", "online", "1 if the device's retained status is online"),
    ("fcl_device_last_seen_timestamp_seconds", "gauge", "last_seen", "Unix time of its last status or update"),
    ("fcl_device_rounds_participated_total", "counter", "participated", "Closed rounds with its update"),
    ("fcl_device_rounds_missed_total", "counter", "missed", "Closed rounds of its roster without its update"),
    ("fcl_device_last_round_up_bytes", "gauge", "last_up", "MQTT PUBLISH bytes it sent in its last closed round"),
    ("fcl_device_last_round_down_bytes", "gauge", "last_down", "MQTT PUBLISH bytes sent to it in that round"),
    ("fcl_device_model_lag_rounds", "gauge", "lag", "Closed rounds since the last one it uploaded for"),
    ("fcl_device_task", "gauge", "task", "The task it trains (its status; -1 before the first)"),
    ("fcl_device_peak_rss_bytes", "gauge", "peak_rss_mb", "Peak resident memory of its daemon (its status)"),
    ("fcl_device_gpu_peak_bytes", "gauge", "gpu_peak_mb", "Peak GPU memory its training allocated (GPU devices)"),
    ("fcl_device_memory_budget_bytes", "gauge", "budget_mb", "The memory budget its config sets (memory_budget_mb)"),
    ("fcl_device_round_cpu_seconds", "gauge", "cpu_s", "CPU seconds its daemon spent on its last round"),
    ("fcl_device_resyncs_total", "counter", "resyncs", "Sync frames it fetched after missing a model or its frame"),
)


def _values(records: list[DeviceRecord], attr: str, lags: list[int]) -> list:
    """One family's values in ``records``' order (None: no sample); every number is finite, as
    ``read_health`` checked it."""
    if attr == "lag":
        return lags
    values = list(map(operator.attrgetter(attr), records))
    if attr.endswith("_mb"):  # whole bytes: an int prints five times faster than a float
        return [None if v is None else int(v * MB) for v in values]
    return [int(v) for v in values] if attr == "online" else values


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class DeviceBook:
    """One federation's devices, as the aggregator tracks them between scrapes."""

    def __init__(self, federation: str, max_devices: int = 10_000) -> None:
        self.federation = federation
        self.max_devices = max_devices
        self.closed_round = -1  # the last round closed: the model version every device is behind of
        self._records: dict[str, DeviceRecord] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._records)

    def get(self, device: str) -> DeviceRecord | None:
        return self._records.get(device)

    def track(self, device: str) -> DeviceRecord | None:
        """The device's record, made on first sight; None when ``max_devices`` are tracked."""
        record = self._records.get(device)
        if record is None and len(self._records) < self.max_devices:
            record = DeviceRecord(f'federation="{_escape(self.federation)}",device="{_escape(device)}"')
            with self._lock:
                self._records[device] = record
        return record

    # -- what the service tells -----------------------------------------------------------------
    def status(self, device: str, status: dict) -> None:
        """Its retained status arrived (a JSON object with a ``state`` string, from the network)."""
        record = self.track(device)
        if record is None:
            return
        record.online, record.last_seen = status["state"] == "online", int(time.time())
        for name, value in read_health(status.get("health")).items():
            setattr(record, name, value)
        task, protocol = status.get("task"), read_protocol(status.get("protocol"))
        if isinstance(task, int) and not isinstance(task, bool) and -1 <= task < 2**31:
            record.task = task
        if protocol is not None:
            record.protocol = protocol

    def update(self, device: str, rnd: int) -> None:
        """An update of round ``rnd`` was accepted."""
        record = self.track(device)
        if record is not None:
            record.last_seen, record.last_round = int(time.time()), max(record.last_round, rnd)

    def round_closed(self, device: str, replied: bool, up: int, down: int, up_kinds: dict, down_kinds: dict) -> None:
        record = self.track(device)
        if record is None:
            return
        if replied:
            record.participated += 1
        else:
            record.missed += 1
        record.last_up, record.last_down = up, down
        for d, kinds in enumerate((up_kinds, down_kinds)):
            for k, kind in enumerate(KINDS):
                record.bytes[d * len(KINDS) + k] += int(kinds.get(kind, 0))

    def rejected(self, device: str, reason: str) -> None:
        """Only an enrolled or enrolling device has a record to count on (the service checks)."""
        record = self.track(device)
        if record is not None:
            key = reason if reason in REJECTION_REASONS else "other"
            record.rejected[key] = record.rejected.get(key, 0) + 1

    # -- the exposition text ----------------------------------------------------------------------
    def render(self) -> str:
        with self._lock:
            records = list(self._records.values())
        closed = self.closed_round
        lags = [max(0, closed - r.last_round) for r in records]
        out: list[str] = []
        for name, kind, attr, text in PER_DEVICE:
            out.append(f"# HELP {name} {text}\n# TYPE {name} {kind}\n")
            values = _values(records, attr, lags)
            out.append("".join([f"{name}{{{r.labels}}} {v}\n" for r, v in zip(records, values) if v is not None]))
        out.append(self._bytes(records))
        out.append(self._rejections(records))
        out.append(self._info(records))
        return "".join(out)

    def _bytes(self, records: list[DeviceRecord]) -> str:
        name = "fcl_device_bytes_total"
        out = [f"# HELP {name} MQTT PUBLISH bytes of its closed rounds, by direction and kind\n# TYPE {name} counter\n"]
        keys = [f'direction="{d}",kind="{k}"' for d in DIRECTIONS for k in KINDS]
        for r in records:
            out.append("".join(f"{name}{{{r.labels},{key}}} {n}\n" for key, n in zip(keys, r.bytes)))
        return "".join(out)

    def _rejections(self, records: list[DeviceRecord]) -> str:
        name = "fcl_device_rejected_total"
        out = [f"# HELP {name} Its messages the aggregator dropped, by reason\n# TYPE {name} counter\n"]
        for r in records:
            out.extend(f'{name}{{{r.labels},reason="{k}"}} {n}\n' for k, n in list(r.rejected.items()))
        return "".join(out)

    def _info(self, records: list[DeviceRecord]) -> str:
        name = "fcl_device_info"
        out = [f"# HELP {name} The daemon and protocol version its status names (value 1)\n# TYPE {name} gauge\n"]
        out.extend(
            f'{name}{{{r.labels},version="{_escape(r.version)}",protocol="{_escape(r.protocol)}"}} 1\n' for r in records
        )
        return "".join(out)
