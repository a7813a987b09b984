"""A rolling upgrade over a real Mosquitto (docs/protocol.md P-VER-6, P-SEQ-7): one device still
numbers its frames as protocol 1 did (on the aggregator's clock, which is this process's clock
here), two number them with per-run counters; the run finishes with the same global model as a
run where every device speaks protocol 2."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import numpy as np
from test_wedge_e2e import Run, Running

from edge_client.daemon import ClientDaemon
from edge_client.uplink import Uplink
from fclcore import checkpoint
from fclcore.codec import Frame, Header, encode
from fclcore.exitcodes import ExitCode
from fclcore.runid import started_us

OVERRIDES = ["federation.method=fedavg", "federation.rounds.quorum=1.0"]
OLD = "client-1"


class ClockNumbered(Uplink):
    """Protocol 1's numbering: the next frame is numbered max(last + 1, the clock in microseconds)."""

    def frame(self, kind, rnd, task, meta, tensors, value_coding, run=None) -> bytes:
        self.sequence = max(self.sequence + 1, time.time_ns() // 1000)
        header = Header(kind, self.federation, rnd, task, self.client_id, self.sequence)
        return self._signed(encode(Frame(header, meta, tensors), value_coding, self.limits))


def _finish(repo_root: Path, out: Path, url: str, old: set[str]) -> tuple[str, dict]:
    """Run the federation with the devices in ``old`` on protocol 1; (model hash, committed meta)."""
    run = Run(repo_root, out, url, OVERRIDES)
    try:
        run.start_aggregator()
        for name, cfg in run.client_cfgs.items():
            daemon = ClientDaemon(cfg)
            if name in old:
                daemon.uplink.__class__ = ClockNumbered  # RoundWork holds the same object
            run.clients[name] = Running(daemon)
        assert set(run.finish().values()) == {ExitCode.OK}
        run.assert_every_round_once()
    finally:
        run.stop_all()
    meta, arrays = checkpoint.load(out / "state" / "committed.npz")
    digest = hashlib.sha256()
    for name in sorted(k for k in arrays if k.startswith("global/")):
        digest.update(name.encode() + np.ascontiguousarray(arrays[name]).tobytes())
    return digest.hexdigest(), meta


def test_a_fleet_half_upgraded_ends_with_the_model_of_a_fleet_all_upgraded(tmp_path, repo_root, mosquitto) -> None:
    new_hash, new_meta = _finish(repo_root, tmp_path / "all-new", mosquitto.url, set())
    mixed_hash, mixed_meta = _finish(repo_root, tmp_path / "mixed", mosquitto.url, {OLD})
    assert mixed_hash == new_hash
    start = started_us(mixed_meta["run_id"])
    marks = mixed_meta["last_seq"]
    assert marks[OLD] > start + 10**4  # clock-numbered: microseconds since the run started (counters: < 100)
    assert all(start < marks[c] < start + 100 for c in marks if c != OLD)  # counters: a frame a round
