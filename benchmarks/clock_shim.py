#!/usr/bin/env python
"""Run an ``fcl`` command whose wall clock can be stepped from outside, for clock-step chaos.

    python benchmarks/clock_shim.py OFFSET_FILE client --config client.yaml

``time.time`` and ``time.time_ns`` of the process return the real clock plus the number of
seconds in OFFSET_FILE (re-read every 20 ms; a missing or unreadable file leaves the offset as
it was), as a Raspberry Pi's clock steps when NTP first syncs after boot.  The monotonic
clocks are left alone, as a real step leaves them.  The shim patches the ``time`` module
before anything of fcl-edge is imported, so ``from time import time`` would see it too; no
product code knows about it.
"""

from __future__ import annotations

import runpy
import sys
import threading
import time
from pathlib import Path

POLL_S = 0.02
ROOT = Path(__file__).resolve().parent.parent


class SteppedClock:
    def __init__(self, path: Path) -> None:
        self.path, self.offset = path, 0.0
        self._time, self._time_ns = time.time, time.time_ns
        self.read()

    def read(self) -> None:
        try:
            self.offset = float(self.path.read_text().strip() or 0)
        except (OSError, ValueError):
            pass

    def watch(self) -> None:
        while True:
            time.sleep(POLL_S)
            self.read()

    def install(self) -> None:
        time.time = lambda: self._time() + self.offset
        time.time_ns = lambda: self._time_ns() + int(self.offset * 1e9)
        threading.Thread(target=self.watch, name="clock-shim", daemon=True).start()


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit("usage: clock_shim.py OFFSET_FILE FCL_ARGS...")
    SteppedClock(Path(sys.argv[1])).install()
    sys.argv = ["fcl", *sys.argv[2:]]
    sys.path[0] = str(ROOT)  # the repository, not benchmarks/, as ``python -m fcl_edge.cli`` would have it
    runpy.run_module("fcl_edge.cli", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
