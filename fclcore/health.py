"""A device's health in its retained status: the ``health`` field, a few hundred bytes.

The device writes it with every round's status (``device_health``); the aggregator reads it
into its per-device Prometheus series (``read_health``), and ``fcl ctl status`` shows it.  Only
what the device alone knows travels: its memory, CPU, resyncs, its own byte meter and its
version; what the aggregator sees for itself (rounds, bytes it counted, rejections) does not.

    {"rss_mb": 212.4, "peak_mb": 240.9, "gpu_mb": 80.0, "budget_mb": 512.0, "cpu_s": 1.93,
     "resyncs": 1, "up": {"update": 51234, "status": 3120}, "down": {"round": 90211, ...},
     "daemon": "0.1.0"}

``gpu_mb`` only where training allocated GPU memory, ``budget_mb`` only where the device's
config sets ``memory_budget_mb``.  Everything read from the network is checked: a field of the
wrong type or out of range is left out, never an error.
"""

from __future__ import annotations

import functools
import math

from fclcore.model_sync import SYNC_KNOWLEDGE
from fclcore.procmem import gpu_peak_mb, peak_rss_mb, rss_mb

RESYNC_KINDS = ("full", "catchup", SYNC_KNOWLEDGE)  # sync frames fetched (the replica's and the frames' counts)
MAX_KINDS = 8  # byte-meter kinds per direction in a status; more is garbage
MAX_MB = 2**30  # a petabyte of memory is not a reading
MAX_WORD = 32


@functools.lru_cache(maxsize=1)
def daemon_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("fcl-edge")
    except PackageNotFoundError:  # a checkout that was never installed
        return "unknown"


def meter_kinds(by_tag: dict[str, dict], direction: str) -> dict[str, int]:
    """A ``WireMeter.snapshot()["by_tag"]``'s bytes of one direction by kind: a tag's first word
    (``update:7`` and ``update:8`` are both ``update``)."""
    out: dict[str, int] = {}
    for key, count in by_tag.items():
        side, _, tag = key.partition(":")
        if side == direction:
            kind = tag.split(":", 1)[0]
            out[kind] = out.get(kind, 0) + int(count["bytes"])
    return out


def device_health(
    cpu_s: float | None, syncs: dict[str, int], up: dict[str, int], down: dict[str, int], budget_mb: float | None
) -> dict:
    """The ``health`` status field (``syncs``: the cumulative sync counts each update reports)."""
    gpu = gpu_peak_mb()
    return {
        "rss_mb": rss_mb(),
        "peak_mb": peak_rss_mb(),
        **({"gpu_mb": gpu} if gpu else {}),
        **({"budget_mb": budget_mb} if budget_mb else {}),
        "cpu_s": None if cpu_s is None else round(cpu_s, 3),
        "resyncs": sum(syncs.get(k, 0) for k in RESYNC_KINDS),
        "up": dict(up),
        "down": dict(down),
        "daemon": daemon_version(),
    }


def read_health(raw: object) -> dict:
    """The checked fields of a status's ``health`` (and top-level ``protocol``), under
    ``DeviceRecord``'s names; what is missing or malformed is left out."""
    if not isinstance(raw, dict):
        return {}
    out: dict = {}
    for key, name in (("peak_mb", "peak_rss_mb"), ("gpu_mb", "gpu_peak_mb"), ("budget_mb", "budget_mb")):
        if _amount(raw.get(key), MAX_MB):
            out[name] = float(raw[key])
    if _amount(raw.get("cpu_s"), 1e9):
        out["cpu_s"] = float(raw["cpu_s"])
    if _amount(raw.get("resyncs"), 2**53) and isinstance(raw["resyncs"], int):
        out["resyncs"] = raw["resyncs"]
    if _word(raw.get("daemon")):
        out["version"] = raw["daemon"]
    return out


def read_protocol(value: object) -> str | None:
    """A status's protocol version (an int or a short word), as a label value."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**31:
        return str(value)
    return value if _word(value) else None


def _amount(value: object, limit: float) -> bool:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return ok and math.isfinite(value) and 0 <= value <= limit


def _word(value: object) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_WORD and value.isprintable() and '"' not in value
