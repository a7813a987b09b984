"""End to end: the quickstart scenario through a real Mosquitto, with an independent byte count.

The broker URL handed to `fcl simulate` points at a counting relay in front of Mosquitto,
so every PUBLISH byte of every participant is counted by code that shares nothing with
the toolkit's meter.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_fcl
from support.listener import Listener
from support.mosquitto import Mosquitto
from support.mqtt_counter import MqttCounter

from fclcore import topics
from fclcore.codec import INT8_VERSION

ROUNDS_PER_TASK = 5
FED = "quickstart"
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def quickstart_run(tmp_path_factory):
    """One run, read by the four tests below (none of them writes into it)."""
    work = tmp_path_factory.mktemp("quickstart")
    mosquitto = Mosquitto(work / "mosquitto").start()
    counter = MqttCounter(mosquitto.port)
    out = work / "run"
    result = run_fcl(
        "simulate",
        str(REPO_ROOT / "configs/scenarios/quickstart.yaml"),
        "--out",
        str(out),
        "--broker",
        f"mqtt://127.0.0.1:{counter.port}",
        "--set",
        f"federation.rounds_per_task={ROUNDS_PER_TASK}",
        "--set",
        "compare=[]",
    )
    try:
        logs = "".join(p.read_text() for p in sorted((out / "logs").glob("*.log"))) if (out / "logs").exists() else ""
        assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n{logs}"
        events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        summary = json.loads((out / "summary.json").read_text())
        yield out, events, summary, counter, result
    finally:
        counter.close()
        mosquitto.stop()


def test_every_round_completes_and_files_follow_the_contract(quickstart_run):
    out, events, summary, _, result = quickstart_run
    tasks, rounds = summary["tasks"], summary["rounds"]
    assert (summary["method"], summary["clients"], tasks, rounds) == ("fedavg", 3, 2, 2 * ROUNDS_PER_TASK)
    for key in ("avg_nll", "forgetting", "base_nll", "new_nll"):
        assert key in summary["final"]
    assert set(summary["final"]["per_client"]) == set(summary["client_ids"])

    closed = [e for e in events if e["event"] == "round"]
    assert [e["round"] for e in closed] == list(range(rounds))
    assert all(e["accepted"] == 3 for e in closed)
    per_round = [e for e in events if e["event"] == "round_client"]
    assert {(e["round"], e["client"]) for e in per_round} == {
        (r, c) for r in range(rounds) for c in summary["client_ids"]
    }
    for e in per_round:
        assert e["task"] == e["round"] // ROUNDS_PER_TASK
        assert e["status"] == "accepted"
        assert 0 < e["payload_up"] < e["bytes_up"] and 0 < e["payload_down"] < e["bytes_down"]
    for total, key in (("up_total", "bytes_up"), ("dense_fp32_up_total", "dense_fp32_up")):
        assert summary["bytes"][total] == sum(e[key] for e in per_round) > 0, total  # metrics.jsonl's sums
    assert summary["bytes"]["down_total"] >= sum(e["bytes_down"] for e in per_round) > 0
    assert "round" in result.stdout and "task NLL" in result.stdout
    # a single-method run prints its share of the dense reference, the ratio of metrics.jsonl's sums
    b = summary["bytes"]
    up_share = sum(e["bytes_up"] for e in per_round) / sum(e["dense_fp32_up"] for e in per_round)
    assert b["up_vs_dense"] == round(up_share, 4) and b["down_vs_dense"] == round(
        b["down_total"] / b["dense_fp32_down_total"], 4
    )
    assert f"up / down vs dense: {b['up_vs_dense']:.1%} / {b['down_vs_dense']:.1%} ({b['reference']})" in result.stdout


def test_held_out_nll_falls_within_each_task(quickstart_run):
    _, events, summary, _, _ = quickstart_run
    mean_nll = {e["round"]: e["mean_nll"] for e in events if e["event"] == "round_summary"}
    for task in range(summary["tasks"]):
        first, last = task * ROUNDS_PER_TASK, (task + 1) * ROUNDS_PER_TASK - 1
        assert mean_nll[last] < mean_nll[first] - 1.0, (task, mean_nll)


def test_metered_bytes_match_an_independent_count(quickstart_run):
    out, events, summary, counter, _ = quickstart_run
    for cid in summary["client_ids"]:
        wire = json.loads((out / "clients" / cid / "wire.json").read_text())
        mqtt_id = f"fcl-{FED}-{cid}"
        # the device's meter equals the relay's parse of its TCP stream, both directions
        assert wire["up"]["bytes"] == counter.publish_bytes(mqtt_id, "up") > 0
        assert wire["down"]["bytes"] == counter.publish_bytes(mqtt_id, "down") > 0
        # the aggregator's per-round records equal what the device metered for those rounds
        rows = [e for e in events if e["event"] == "round_client" and e["client"] == cid]
        updates = {k: v for k, v in wire["by_tag"].items() if k.startswith("up:update:")}
        assert {int(k.rsplit(":", 1)[1]): v["bytes"] for k, v in updates.items()} == {
            e["round"]: e["bytes_up"] for e in rows
        }
        assert {int(r): b for r, b in wire["round_bytes_down"].items()} == {e["round"]: e["bytes_down"] for e in rows}
    agg = summary["meter"]
    assert agg["up"]["bytes"] == counter.publish_bytes(f"fcl-{FED}-aggregator", "up")
    assert agg["down"]["bytes"] == counter.publish_bytes(f"fcl-{FED}-aggregator", "down")


def test_served_models_answer_without_torch_and_match_the_final_evaluation(quickstart_run, tmp_path):
    import subprocess
    import sys

    import numpy as np

    from fclcore.data import load_digits

    out, _, summary, _, _ = quickstart_run
    _, test = load_digits(seed=0)
    task1 = test.x[np.isin(test.y, [5, 6, 7, 8, 9])]  # the quickstart's second task
    np.save(tmp_path / "task1.npy", task1)
    blocked = "import sys; sys.modules['torch'] = None; from fcl_edge.cli import main; sys.exit(main())"
    for cid in summary["client_ids"]:
        model = out / "clients" / cid / "model.onnx"
        result = subprocess.run(
            [
                sys.executable,
                "-c",
                blocked,
                "infer",
                str(model),
                "--op",
                "loglik",
                "--input",
                str(tmp_path / "task1.npy"),
            ],
            capture_output=True,
            text=True,
        )
        assert result.returncode == 0, result.stderr
        answer = json.loads(result.stdout)
        assert answer["model"]["task"] == 1 and answer["n"] == len(task1)
        final_nll = summary["final"]["per_client"][cid]["nll_matrix"][1][1]
        assert -answer["mean_log_likelihood"] == pytest.approx(final_nll, abs=2e-3)


def test_confedmade_alone_sends_its_default_int8_values_and_prints_its_shares(mosquitto, tmp_path, repo_root):
    """The quickstart leaves ``wire.value_dtype`` to each method: ConFedMADE's updates, round
    downlinks and knowledge frames cross the broker as int8 (codec v2) frames, every update is
    accepted (test_int8_e2e.py, a slow test, adds stochastic rounding), and the shares it prints are
    metrics.jsonl's bytes over its dense reference.  Over its two tasks every device applies
    every announced model delta (the sparse model downlink, docs/protocol.md section 15): no
    hash ever differs, no device resyncs (the restarted device's resync: test_model_sync_e2e.py)."""
    listener = Listener(mosquitto.port, extra_topics=(topics.round_topic(FED),))
    out = tmp_path / "confedmade"
    result = run_fcl(
        "simulate",
        str(repo_root / "configs/scenarios/quickstart.yaml"),
        *("--out", str(out), "--broker", f"mqtt://127.0.0.1:{mosquitto.port}"),
        *("--set", "federation.rounds_per_task=2", "--set", "compare=[]", "--set", "federation.method=confedmade"),
    )
    listener.stop()
    assert result.returncode == 0, result.stderr[-3000:]
    with_values = {}  # topic kind -> versions of the frames that carried tensors
    for (topic, frame), (_, data) in zip(listener.frames, listener.payloads):
        if frame.tensors:
            with_values.setdefault(topic.split("/")[2], set()).add(data[4])
    assert with_values == {"update": {INT8_VERSION}, "round": {INT8_VERSION}, "kb": {INT8_VERSION}}
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [e for e in rows if e["event"] == "round_client"]
    assert sum(e["status"] == "accepted" for e in rows) == summary["rounds"] * summary["clients"]
    b = summary["bytes"]
    assert b["up_total"] == sum(e["bytes_up"] for e in rows) and b["dense_fp32_up_total"] == sum(
        e["dense_fp32_up"] for e in rows
    )
    assert b["dense_fp32_down_total"] == sum(e["dense_fp32_down"] for e in rows)
    assert b["up_vs_dense"] == round(b["up_total"] / b["dense_fp32_up_total"], 4) < 0.25
    assert b["down_vs_dense"] == round(b["down_total"] / b["dense_fp32_down_total"], 4) < 0.4
    assert f"up / down vs dense: {b['up_vs_dense']:.1%} / {b['down_vs_dense']:.1%} ({b['reference']})" in result.stdout
    for cid in summary["client_ids"]:  # no hash mismatch, no bad delta, no resync
        assert json.loads((out / "clients" / cid / "wire.json").read_text())["model_syncs"] == {}, cid
    assert b["syncs"] == {} and sum(b["down_by_kind"].values()) == b["down_total"]
    # the model part of the downlink is the aggregated entries, well under a dense float32 model per round
    assert b["down_by_kind"]["model"] < 0.75 * b["dense_fp32_down_total"], b["down_by_kind"]
    assert b["down_by_kind"]["knowledge"] > 0  # ConFedMADE's knowledge frames at the task start
