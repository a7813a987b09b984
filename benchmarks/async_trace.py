"""The plumbing of benchmarks/bench_async.py: seeded availability traces, and what became of each
device's training, from the aggregator's records against the devices' own.

A trace is each device's online sessions, ``[(start_s, end_s), ...]``: alternating online and
offline spells of exponential length (an alternating renewal process), the mean offline spell
chosen so that a device is online ``online_share`` of the time, the first spell drawn as the
process would be found at a random moment (online with probability ``online_share``).

The accounting (``outcomes``) pairs each update with the version (round) it was trained on:

* trained: the rounds a device trained on, by its own record (``wire.json`` ``round_cpu_s``);
* sent: the rounds whose update it published (its meter's ``update:R`` and ``resend:R`` tags);
* folded: the aggregator's accepted ``round_client`` rows (``trained_on``, else ``round``);
* refused: the aggregator's ``rejected`` events of UPDATE frames (their ``frame`` header).

``training_used_share`` = trained updates folded / trained.  ``double_counted`` = folds of an
update beyond its first, plus folds of an update its device never trained.  A sent update the
aggregator has no record of (neither folded nor refused) is ``after_end`` when it first reached
the broker after the aggregator's final evaluation had closed (``UpdateWatch``, a subscriber on
the broker itself, says when each update got there): no run can take those.  Every other one
is ``lost``: it reached the broker while the run went on, or never did.
"""

from __future__ import annotations

import bisect
import collections
import json
import math
import random
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from fclcore.codec import Kind, decode

Sessions = list[tuple[float, float]]


def trace(horizon_s: float, online_share: float, mean_online_s: float, seed: int) -> Sessions:
    """One device's online sessions within ``[0, horizon_s)``."""
    if not (0 < online_share < 1 and mean_online_s > 0 and horizon_s > 0):
        raise ValueError(
            f"trace: expected 0 < online_share < 1, mean_online_s > 0, horizon_s > 0; "
            f"got {online_share}, {mean_online_s}, {horizon_s}"
        )
    rng = random.Random(seed)
    mean_offline_s = mean_online_s * (1 - online_share) / online_share
    online = rng.random() < online_share
    t, sessions = 0.0, []
    while t < horizon_s:
        spell = rng.expovariate(1 / (mean_online_s if online else mean_offline_s))
        if online:
            sessions.append((round(t, 3), round(min(t + spell, horizon_s), 3)))
        t, online = t + spell, not online
    return sessions


def traces(devices: list[str], horizon_s: float, online_share: float, mean_online_s: float, seed: int) -> dict:
    """Every device's sessions, each device its own seed derived from ``seed``."""
    return {d: trace(horizon_s, online_share, mean_online_s, seed * 1_000_003 + i) for i, d in enumerate(devices)}


def online_at(sessions: Sessions, t: float) -> bool:
    i = bisect.bisect_right([start for start, _ in sessions], t) - 1
    return i >= 0 and t < sessions[i][1]


def online_fraction(sessions: Sessions, horizon_s: float) -> float:
    return sum(min(end, horizon_s) - start for start, end in sessions if start < horizon_s) / horizon_s


@dataclass(frozen=True)
class Outcomes:
    trained: int  # (device, round) pairs a device trained on
    folded: int  # of those, folded into a version
    lost: int
    double_counted: int
    refused: dict[str, int]  # refused updates by reason
    after_end: int = 0

    @property
    def training_used_share(self) -> float | None:
        return None if not self.trained else self.folded / self.trained


def outcomes(
    trained: dict[str, set[int]],
    sent: dict[str, set[int]],
    folded: list[tuple[str, int]],
    refused: list[tuple[str, int, str]],
    after_end: set[tuple[str, int]] = frozenset(),
) -> Outcomes:
    """What became of each device's training (module docstring): ``folded`` and ``refused``
    (with reasons) as lists, so that a second fold or refusal of one update shows;
    ``after_end``: the (device, round) updates that first reached the broker after the run's end."""
    trained_pairs = {(d, r) for d, rounds in trained.items() for r in rounds}
    sent_pairs = {(d, r) for d, rounds in sent.items() for r in rounds}
    folds = collections.Counter(folded)
    refused_pairs = {(d, r) for d, r, _ in refused}
    double = sum(n - 1 for n in folds.values()) + sum(n for pair, n in folds.items() if pair not in trained_pairs)
    unknown = sent_pairs - set(folds) - refused_pairs
    reasons = collections.Counter(reason for _, _, reason in refused)
    return Outcomes(
        trained=len(trained_pairs),
        folded=len(trained_pairs & set(folds)),
        lost=len(unknown - set(after_end)),
        double_counted=double,
        refused=dict(sorted(reasons.items())),
        after_end=len(unknown & set(after_end)),
    )


class UpdateWatch:
    """A subscriber on the broker itself (not behind any relay): when each device's update for
    each round first got there (``time.time()``), decoded from its header."""

    def __init__(self, port: int) -> None:
        import paho.mqtt.client as mqtt

        self.first: dict[tuple[str, int], float] = {}
        self.lock = threading.Lock()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="bench-async-watch")
        self.client.on_message = self._on_message
        self.client.on_connect = lambda c, *a: c.subscribe("fcl/+/update/+", qos=1)
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()

    def _on_message(self, client, userdata, msg) -> None:
        try:
            header = decode(bytes(msg.payload)).header
        except ValueError:
            return
        if header.kind is Kind.UPDATE:
            with self.lock:
                self.first.setdefault((header.client, header.round), time.time())

    def after(self, end: float) -> set[tuple[str, int]]:
        with self.lock:
            return {pair for pair, t in self.first.items() if t > end}

    def stop(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


def read_events(path: Path) -> list[dict]:
    text = path.read_text() if path.exists() else ""
    whole = text[: text.rfind("\n") + 1]  # the service may be mid-write: its last line can be partial
    return [json.loads(line) for line in whole.splitlines() if line.strip()]


def aggregator_records(events: list[dict]) -> tuple[list[tuple[str, int]], list[tuple[str, int, str]]]:
    """(folded, refused) from a run's ``metrics.jsonl`` events."""
    folded = [
        (e["client"], e.get("trained_on", e["round"]))
        for e in events
        if e.get("event") == "round_client" and e.get("status") == "accepted"
    ]
    refused = [
        (e["client"], e["frame"]["round"], e["reason"])
        for e in events
        if e.get("event") == "rejected" and (e.get("frame") or {}).get("kind") == "UPDATE"
    ]
    return folded, refused


def device_records(wire: dict) -> tuple[set[int], set[int]]:
    """(trained, sent) rounds from one device's ``wire.json``."""
    trained = {int(r) for r in wire.get("round_cpu_s", {})}
    sent = set()
    for tag in wire.get("by_tag", {}):
        direction, _, rest = tag.partition(":")
        kind, _, rnd = rest.partition(":")
        if direction == "up" and kind in ("update", "resend") and rnd.lstrip("-").isdigit():
            sent.add(int(rnd))
    return trained, sent


def version_metrics(events: list[dict], task: int) -> dict[int, float]:
    """Each version's metric: the NLL on task ``task``'s test data of the model after that round,
    from the devices' evaluations of it (all devices share one test set, so any of them tells).
    A device evaluates the task it is in at every round (earlier tasks only at a task's end), so
    the versions of task ``task`` each have one."""
    found: dict[int, float] = {}
    for e in events:
        if e.get("event") != "eval" or e.get("round", -1) < 0 or e.get("task") != task:
            continue
        nll = e.get("nll") or []
        value = nll[task] if len(nll) > task else None
        if isinstance(value, (int, float)) and math.isfinite(value):
            found.setdefault(e["round"], value)
    return dict(sorted(found.items()))


def all_tasks_metric(events: list[dict], version: int, tasks: int) -> float | None:
    """The mean NLL over every task of the model after ``version`` (the final one: devices
    evaluate every task at the end), or None if no device evaluated it on all of them."""
    for e in events:
        if e.get("event") != "eval" or e.get("round") != version:
            continue
        nll = e.get("nll") or []
        if len(nll) == tasks and all(isinstance(x, (int, float)) and math.isfinite(x) for x in nll):
            return sum(nll) / tasks
    return None


def time_to_target(published_at: dict[int, float], metrics: dict[int, float], target: float) -> float | None:
    """Seconds until the first version whose metric is at or below ``target`` was published."""
    hits = [published_at[v] for v, m in metrics.items() if m <= target and v in published_at]
    return min(hits) if hits else None
