#!/usr/bin/env python
"""Run ``fcl client`` as a device whose training of a round takes SECONDS longer, for the
availability benchmark (benchmarks/bench_async.py).

    python benchmarks/train_time_shim.py SECONDS client --config client.yaml

A Raspberry Pi trains for minutes what this machine's core trains in milliseconds; twenty-odd
devices burning that CPU here would measure the two shared cores, not the rounds.  So the
device sleeps SECONDS before each round's training (its process is busy and silent, as a slow
device is; its link stays up or goes down with its availability meanwhile), then trains for
real.  The shim wraps ``DeviceLearner.arrived`` (what the round trains from, asked once per
round just before training) before anything of fcl-edge runs; no product code knows about it.
"""

from __future__ import annotations

import runpy
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def install(seconds: float) -> None:
    from edge_client.learning import DeviceLearner

    arrived = DeviceLearner.arrived

    def slow_arrived(self, rnd: int, task: int) -> list:
        time.sleep(seconds)
        return arrived(self, rnd, task)

    DeviceLearner.arrived = slow_arrived


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit("usage: train_time_shim.py SECONDS FCL_ARGS...")
    seconds = float(sys.argv[1])
    sys.argv = ["fcl", *sys.argv[2:]]
    sys.path[0] = str(ROOT)  # the repository, not benchmarks/, as ``python -m fcl_edge.cli`` would have it
    install(seconds)
    runpy.run_module("fcl_edge.cli", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
