"""A short continual run on digits through Mosquitto: ConFedMADE forgets less than a
federated finetune baseline, and the same scenario gives the same numbers twice."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import run_fcl

SCENARIO = "configs/scenarios/digits_continual.yaml"


def _run(mosquitto, repo_root: Path, out: Path, method: str) -> dict:
    result = run_fcl("simulate", str(repo_root / SCENARIO), "--out", str(out), "--broker", mosquitto.url,
                     "--set", f"federation.method={method}", "--set", f"federation.name=dc-{method}")
    assert result.returncode == 0, result.stderr + "".join(p.read_text() for p in (out / "logs").glob("*.log"))
    return json.loads((out / "summary.json").read_text())


def test_confedmade_forgets_less_than_finetune_and_is_reproducible(mosquitto, tmp_path, repo_root):
    confed = _run(mosquitto, repo_root, tmp_path / "confed", "confedmade")
    finetune = _run(mosquitto, repo_root, tmp_path / "finetune", "fedcl-finetune")
    assert confed["final"]["forgetting"] < finetune["final"]["forgetting"] - 1.0
    assert confed["final"]["avg_nll"] < finetune["final"]["avg_nll"]
    # compact masked uploads: well under a dense float32 FedAvg of the same model
    assert confed["bytes"]["up_total"] < 0.6 * confed["bytes"]["dense_fp32_up_total"]
    events = [json.loads(line) for line in (tmp_path / "confed" / "metrics.jsonl").read_text().splitlines()]
    knowledge = [e for e in events if e["event"] == "knowledge"]
    assert {(e["task"], e["client"]) for e in knowledge} == {(t, c) for t in range(3) for c in confed["client_ids"]}
    assert all(len(e["entries"]) == (1 if e["task"] else 0) * e["task"] for e in knowledge)  # the other client's
    again = _run(mosquitto, repo_root, tmp_path / "again", "confedmade")
    assert again["final"]["per_client"] == confed["final"]["per_client"]
