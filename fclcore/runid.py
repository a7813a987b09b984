"""Run identity: which run of a federation a retained message belongs to.

A federation name is reused run after run, and a broker with persistence keeps retained
messages across restarts, so a device can meet the FINISH or ROUND of an earlier run.  The
aggregator picks a run id when it starts on a fresh state directory and keeps it across its
own restarts (it is in the committed state); every frame it sends carries it as
``meta["run"]``, and a device keeps the run it belongs to in its checkpoint.

A run id is ``<start time in microseconds, 16 hex digits>-<8 random hex digits>``, so two runs
compare by when they started: a device can tell a newer run (join it, or refuse: its
``on_new_run``) from a stale one (ignored and counted).
"""

from __future__ import annotations

import re
import secrets
import time

_RUN = re.compile(r"^[0-9a-f]{16}-[0-9a-f]{8}$")


def new_run_id() -> str:
    return f"{time.time_ns() // 1000:016x}-{secrets.token_hex(4)}"


def check_run_id(value: object) -> str:
    """A run id as sent in a frame's metadata; ValueError otherwise."""
    if not isinstance(value, str) or not _RUN.match(value):
        raise ValueError(f"run: expected a run id like 0006f1c2a3b4c5d6-1a2b3c4d, got {value!r}"[:120])
    return value


def started_us(run_id: str) -> int:
    """When the run started (microseconds since the epoch, by the aggregator's clock)."""
    return int(run_id.split("-", 1)[0], 16)


def is_newer(run_id: str, than: str) -> bool:
    return (started_us(run_id), run_id) > (started_us(than), than)
