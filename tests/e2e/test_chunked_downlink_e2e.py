"""A device dropped mid-download resumes (issue 37; docs/protocol.md section 16): a real
Mosquitto holds a retained multi-megabyte MODEL frame in chunks, a device process in its own
network namespace fetches it behind a 1 Mbit/s link (``fcl_edge.links``), the relay cuts the
connection halfway, and the device finishes from the chunks it lacks instead of starting over.
The harness is the drop benchmark's (``benchmarks/bench_drop.py``)."""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from pathlib import Path

import pytest

from fcl_edge.links import PROFILES

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
bench = importlib.import_module("bench_drop")

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="shaping needs root (CI runs as root)")
CHUNK = 128 * 1024


# the default suite's 10 min; the chunk rules: tests/unit/test_chunks.py, chunked bytes: test_every_byte_attributed.py
@pytest.mark.slow
def test_a_device_dropped_mid_download_fetches_only_the_chunks_it_lacks(mosquitto) -> None:
    """P-CHK-4: the cut costs the chunks in flight, not the frame: the device receives fewer
    bytes than two whole transfers, and fewer than starting over would have cost."""
    profile = dataclasses.replace(PROFILES["lte-m"], stall_rate=0.0)  # 1 Mbit/s down
    payload = bench.model_frame(1.2)  # about 10 s on the link
    run = bench.drop_run(mosquitto.port, payload, CHUNK, profile, cut_at=0.6)
    assert run["connects"] == 2  # cut once, connected again
    assert run["cut_after_bytes"] < len(payload)  # the cut came mid-download
    assert run["link_down"] < 2 * len(payload)
    starting_over = run["cut_after_bytes"] + len(payload)  # what the whole frame costs after such a cut
    assert run["link_down"] < starting_over - CHUNK, (run, starting_over)
    # what the device kept: one copy of every chunk, the manifest twice (it came again on reconnect)
    assert run["metered_down"] < len(payload) + CHUNK + 4096  # (a chunk queued at the cut may come twice)
