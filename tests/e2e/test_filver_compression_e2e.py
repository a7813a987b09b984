"""End to end over a real Mosquitto: FIL-VER's smoke scenario with the compression stage off
and with its default (top-k with error feedback both ways).  In the compressed run the phase-0
encoder crosses the broker as its whole change and the classifier as sparse ``@delta``
uploads (``wire.density``), every announcement
after the first moves the classifier by at most the top-k of each tensor (a sparse downlink),
every update is accepted, every device's model verifies by hash (no resync), and the run
moves fewer bytes each way."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import run_fcl
from support.listener import Listener

import methods
from fclcore import topics
from fclcore.codec import Kind, SparseTensor
from fclcore.sparsify import DELTA, kept_count
from methods.filver.wire import COMPRESSION

FED = "filver-compress-e2e"


def _run(mosquitto, out: Path, repo_root: Path, *extra: str) -> tuple[dict, list]:
    spec = methods.lookup("filver")
    listener = Listener(mosquitto.port, extra_topics=(topics.round_topic(FED),))
    sets = [item for o in (*spec.smoke_overrides, f"federation.name={FED}", *extra) for item in ("--set", o)]
    result = run_fcl(
        "simulate", str(repo_root / spec.example_scenario), "--out", str(out), "--broker", mosquitto.url, *sets
    )
    listener.stop()
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads((out / "summary.json").read_text()), listener.frames


@pytest.mark.slow
@pytest.mark.timeout(900)  # two runs of the smoke scenario; generous for a machine shared with other work
def test_filver_compressed_both_ways_verifies_and_moves_fewer_bytes_through_mosquitto(mosquitto, tmp_path, repo_root):
    """Slow (two runs, 15 s): the default suite's compressed run through Mosquitto is NGFL's
    (tests/e2e/test_compression_e2e.py), FIL-VER's through Mosquitto is
    tests/e2e/test_filver_e2e.py, and FIL-VER's compression stage is checked in process by
    tests/methods/test_compression_filver.py."""
    dense, _ = _run(
        mosquitto, tmp_path / "off", repo_root, "federation.wire.sparsify=none", "federation.wire.down_sparsify=none"
    )
    small, frames = _run(mosquitto, tmp_path / "on", repo_root)

    updates = [f for topic, f in frames if topic.startswith(topics.update_topic(FED, "")) and f.tensors]
    assert {f.header.round for f in updates} == set(range(small["rounds"]))
    for f in updates:
        model = {n: t for n, t in f.tensors.items() if not n.startswith("emb:")}
        assert model and all(n.endswith(DELTA) for n in model), f.header
        assert all(isinstance(t, SparseTensor) for n, t in model.items() if n.startswith("cls.")), f.header
        assert any(n.startswith("enc.") for n in model) == (f.header.round == 0)  # phase 0 is one round here

    rounds = [f for topic, f in frames if topic == topics.round_topic(FED) and f.header.kind is Kind.ROUND]
    deltas = [f for f in rounds if f.meta["model"]["base"] is not None]
    assert len(deltas) == small["rounds"] - 1  # every announcement after the first is a delta
    for f in deltas:
        assert f.tensors and all(n.startswith("cls.") for n in f.tensors)
        for name, t in f.tensors.items():
            bound = kept_count(math.prod(t.shape), COMPRESSION.down_density)
            assert isinstance(t, SparseTensor) and t.nnz <= bound, (f.header.round, name)

    events = [json.loads(line) for line in (tmp_path / "on" / "metrics.jsonl").read_text().splitlines()]
    accepted = [e for e in events if e["event"] == "round_client" and e["status"] == "accepted"]
    assert len(accepted) == small["rounds"] * small["clients"] and small["rejected"] == {}
    assert not small["bytes"]["syncs"]  # every announcement's hash verified on every device
    for way in ("up_total", "down_total"):
        assert small["bytes"][way] < dense["bytes"][way], way
    after = [_up_after_phase0(tmp_path / run) for run in ("on", "off")]  # the encoder goes whole in phase 0
    assert after[0] < 0.5 * after[1], after


def _up_after_phase0(out: Path) -> int:
    """Bytes the devices uploaded in the rounds after phase 0 (the smoke scenario's is round 0)."""
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return sum(e["bytes_up"] for e in events if e["event"] == "round_client" and e["round"] >= 1)
