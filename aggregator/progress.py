"""What the aggregator says while it runs: one INFO line per closed round, a line naming the
devices it waits for, and the quorum as a count.

An operator reading ``journalctl -u fcl-aggregator`` should see the run move (round, task,
devices in / expected, bytes, seconds) and, when it stalls, whom it is waiting for, without
reading metrics.jsonl.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, Mapping

log = logging.getLogger(__name__)

SHARE_TOLERANCE = 0.005  # a share is written with two decimals: 0.67 stands for 2/3, 0.33 for 1/3


def quorum_count(share: float, enrolled: int) -> int:
    """Updates a round needs, as a count: the fewest k of ``enrolled`` whose share k/n reaches
    ``share`` read at the two decimals it is written with, never more than half a device
    short of ``share * enrolled`` (2 of 3 meets 0.67; 1 of 3 does not meet 0.34; 900 of 1000
    are needed for 0.9); at least 1."""
    slack = min(SHARE_TOLERANCE * enrolled, 0.5)
    return max(1, math.ceil(share * enrolled - slack - 1e-9))


def byte_totals(per_client: Mapping[str, Mapping[str, int]]) -> tuple[int, int]:
    """(up, down) summed over the run log's per-client byte counters."""
    return sum(c.get("up", 0) for c in per_client.values()), sum(c.get("down", 0) for c in per_client.values())


def round_line(
    rnd: int, total: int, task: int, accepted: int, expected: int, up: int, down: int, seconds: float
) -> str:
    """The one INFO line of a closed round (rounds counted from 1 for people)."""
    return (
        f"round {rnd + 1}/{total} task {task}: {accepted}/{expected} updates, "
        f"{up / 1e3:,.1f} kB up, {down / 1e3:,.1f} kB down, {seconds:.1f} s"
    )


class WaitNotice:
    """Says whom the service is waiting for: first after ``first_s`` of waiting, then when the
    set of missing devices changes, and again every ``every_s`` while it does not."""

    def __init__(
        self, what: str, first_s: float = 3.0, every_s: float = 30.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.what, self.first_s, self.every_s, self.clock = what, first_s, every_s, clock
        self.started = clock()
        self.told: tuple[str, ...] | None = None
        self.told_at = 0.0

    def check(self, missing: Iterable[str], have: int, need: int, of: int) -> str | None:
        """Log (and return) the line if one is due now, else None."""
        missing = tuple(sorted(missing))
        now = self.clock()
        if not missing or now - self.started < self.first_s:
            return None
        if missing == self.told and now - self.told_at < self.every_s:
            return None
        self.told, self.told_at = missing, now
        line = f"{self.what}: waiting for {', '.join(missing)} ({have}/{of} in, {need} needed)"
        log.info("%s", line)
        return line


@contextmanager
def still_working(what: str, every_s: float = 30.0) -> Iterator[None]:
    """Log ``what ... N s so far`` every ``every_s`` while the block runs: server-side work
    (FedET's distillation, FIL-VER's training on the buffer) can take minutes, and a silent
    service looks hung.  Nothing is logged for work that ends within ``every_s``."""
    done, started = threading.Event(), time.monotonic()

    def tell() -> None:
        while not done.wait(every_s):
            log.info("%s: still running, %.0f s so far", what, time.monotonic() - started)

    teller = threading.Thread(target=tell, name="still-working", daemon=True)
    teller.start()
    try:
        yield
    finally:
        done.set()
        teller.join()
