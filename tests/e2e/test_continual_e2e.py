"""A short continual run on digits through Mosquitto: ConFedMADE forgets less than a
federated finetune baseline, and the same scenario gives the same numbers twice (the second
time in one process over the in-process broker: the numbers do not depend on the transport)."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import run_fcl

SCENARIO = "configs/scenarios/digits_continual.yaml"


def _run(mosquitto, repo_root: Path, out: Path, method: str) -> dict:
    """One run through ``mosquitto``, or in one process over the in-process broker (None)."""
    where = ["--broker", mosquitto.url] if mosquitto is not None else ["--in-process"]
    result = run_fcl(
        "simulate",
        str(repo_root / SCENARIO),
        "--out",
        str(out),
        *where,
        "--set",
        f"federation.method={method}",
        "--set",
        f"federation.name=dc-{method}",
        "--set",
        "federation.rounds_per_task=3",  # three runs: half the scenario's rounds (forgetting 3.2 vs -0.03 nats)
    )
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
    again = _run(None, repo_root, tmp_path / "again", "confedmade")  # one process: no broker, no process start-ups
    assert again["final"]["per_client"] == confed["final"]["per_client"]


def test_connectivity_agnostic_masks_stay_synchronised(mosquitto, tmp_path, repo_root):
    """Every order also redraws the hidden degrees; devices and aggregator derive the same
    masks, so every masked upload is accepted (a mismatch is rejected as content)."""
    out = tmp_path / "agnostic"
    result = run_fcl(
        "simulate",
        str(repo_root / SCENARIO),
        "--out",
        str(out),
        "--broker",
        mosquitto.url,
        "--set",
        "federation.name=dc-agnostic",
        "--set",
        "federation.model.connectivity_agnostic=true",
        "--set",
        "federation.model.num_orders=3",
    )
    assert result.returncode == 0, result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rejected"] == {}
    assert summary["final"]["forgetting"] < 1.0


def test_offline_reference_beats_single_device_finetune(tmp_path, repo_root):
    """The offline reference trains one device on all tasks from the start: it forgets
    nothing and ends with a lower average NLL than the same device finetuned task by task
    (a learning result, run in one process: the numbers do not depend on the transport, as above)."""
    runs = {}
    for method in ("offline", "fedcl-finetune"):
        out = tmp_path / method
        result = run_fcl(
            "simulate",
            str(repo_root / SCENARIO),
            "--out",
            str(out),
            "--in-process",
            "--set",
            f"federation.method={method}",
            "--set",
            f"federation.name=one-{method}",
            "--set",
            "clients=1",
        )
        assert result.returncode == 0, result.stderr
        runs[method] = json.loads((out / "summary.json").read_text())["final"]
    assert runs["offline"]["avg_nll"] < runs["fedcl-finetune"]["avg_nll"] - 1.0
    assert runs["offline"]["forgetting"] < runs["fedcl-finetune"]["forgetting"]
