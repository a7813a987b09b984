"""``fcl status --federation F --device ID``: one device's facts from its retained status.

The same facts the aggregator exports per device (docs/monitoring.md), as the device itself
reported them: its state, task and round, its health (memory against its budget, the last
round's CPU, resyncs, its own byte meter by kind, its daemon's version) and whatever else its
status carries (the protocol's version, its last rejection).  Every value comes from the
network: what is malformed is shown as ``?`` and never raises.
"""

from __future__ import annotations

import json
import math
from typing import Any, TextIO

from fcl_edge.status import STATUS_FIELDS, UNKNOWN, BrokerOptions, _age, collect, read_status
from fclcore import topics
from fclcore.health import MAX_KINDS
from fclcore.transport import parse_status

NUMBERS = ("rss_mb", "peak_mb", "gpu_mb", "budget_mb", "cpu_s", "resyncs")
MAX_OTHER = 64  # status fields looked at for ones this view does not know


def device_facts(payload: bytes) -> dict:
    """The status payload's facts, checked: numbers, short words, byte counts by kind."""
    status = read_status("device", payload)
    raw = parse_status(payload) or {}
    health = raw.get("health") if isinstance(raw.get("health"), dict) else {}
    return {
        "state": status.state,
        "task": status.task,
        "round": status.round,
        "last_seen": status.last_seen,
        "bytes_up": status.bytes_up,
        "bytes_down": status.bytes_down,
        "health": {
            **{k: _number(health.get(k)) for k in NUMBERS},
            "up": _kinds(health.get("up")),
            "down": _kinds(health.get("down")),
            "daemon": _short(health.get("daemon")),
        },
        "other": _others(raw),
        "problem": status.problem,
    }


def print_device(device: str, federation: str, facts: dict, now: float, out: TextIO) -> None:
    h = facts["health"]
    print(
        f"{device} of {federation}: {facts['state']}, task {_cell(facts['task'])}, round {_cell(facts['round'])}, "
        f"last seen {_age(facts['last_seen'], now)}",
        file=out,
    )
    share = f" ({h['peak_mb'] / h['budget_mb']:.0%})" if h["peak_mb"] and h["budget_mb"] else ""
    print(
        f"  memory: peak {_cell(h['peak_mb'])} MiB of a {_cell(h['budget_mb'])} MiB budget{share}, "
        f"now {_cell(h['rss_mb'])} MiB" + (f"; GPU peak {h['gpu_mb']} MiB" if h["gpu_mb"] else ""),
        file=out,
    )
    print(f"  CPU of its last round: {_cell(h['cpu_s'])} s; resyncs: {_cell(h['resyncs'])}", file=out)
    for direction in ("up", "down"):
        kinds = ", ".join(f"{k} {v:,}" for k, v in sorted(h[direction].items())) or UNKNOWN
        print(f"  bytes {direction}: {_cell(facts[f'bytes_{direction}'])} ({kinds})", file=out)
    print(f"  daemon {_cell(h['daemon'])}", file=out)
    for key, value in sorted(facts["other"].items()):
        print(f"  {key}: {_cell(value)}", file=out)
    if facts["problem"]:
        print(f"  note: {facts['problem']}", file=out)


def device_status(
    options: BrokerOptions, federation: str, device: str, wait_s: float, as_json: bool, out: TextIO, now: float
) -> bool:
    """Print the device's facts; False if the broker holds no status of it."""
    topic = topics.status_topic(federation, device)
    payloads = [p for t, p in collect(options, federation, wait_s) if t == topic and p]
    if not payloads:
        print(f"no retained status of {device} in {federation} on {options.url}", file=out)
        return False
    facts = device_facts(payloads[-1])
    if as_json:
        json.dump({"federation": federation, "device": device, **facts}, out, indent=2)
        out.write("\n")
    else:
        print_device(device, federation, facts, now, out)
    return True


def _others(raw: dict) -> dict:
    """The status fields this view does not know (a newer protocol's), with a value it can show."""
    out = {}
    for key, value in list(raw.items())[:MAX_OTHER]:
        shown = _short(value)
        if key not in STATUS_FIELDS and _short(key) and shown is not None:
            out[key] = shown
    return out


def _number(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return value if ok and 0 <= value < 2**53 else None


def _short(value: Any) -> str | int | float | bool | None:
    if isinstance(value, (dict, list)):  # a structured field of a newer status, shown as compact JSON
        text = json.dumps(value, separators=(",", ":"))
        return text if len(text) <= 200 else None
    if isinstance(value, str):
        return value if 0 < len(value) <= 64 and value.isprintable() else None
    if isinstance(value, bool) or value is None:
        return value
    return _number(value)


def _kinds(value: Any) -> dict[str, int]:
    if not isinstance(value, dict) or len(value) > MAX_KINDS:
        return {}
    return {k: v for k, v in value.items() if _short(k) and isinstance(v, int) and not isinstance(v, bool) and v >= 0}


def _cell(value: Any) -> str:
    if value is None:
        return UNKNOWN
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)
