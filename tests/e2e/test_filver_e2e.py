"""FIL-VER end to end over a real Mosquitto (issue 16): scenario 3 (devices enroll one per
task) through ``fcl simulate`` with a listener that decodes what crossed the broker; and the
aggregator SIGKILLed mid-run in scenario 1, whose rehearsal buffer must come back with every
item once; and ``fcl infer`` on a device's served model."""

from __future__ import annotations

import collections
import json
import time

import numpy as np
import pytest
from conftest import run_fcl
from support.fleet import Fleet
from support.listener import Listener
from support.timescale import scaled

from aggregator.state import StateStore
from fclcore.codec import Kind

TINY = [
    "federation.task_rounds=[3, 2, 2, 2]",
    "federation.options.phase0_rounds=1",
    "federation.options.hidden=64",
    "federation.options.latent=16",
    "federation.options.sst_steps=5",
    "federation.rounds.deadline_s=90",
    "federation.rounds.resend_after_s=3",
    "data.per_class=10",
    "data.test_per_class=10",
]
ITEMS = 10  # share 0.1 of 100 images per (device, task), one per class


def buffer(state_dir) -> dict:
    committed = StateStore(state_dir).load()
    return {**committed.strategy_arrays, "clients": committed.strategy["buffer_clients"]}


# the default suite's 10 min; FIL-VER through Mosquitto stays: test_aggregator_killed_mid_run_keeps_its_buffer_once
@pytest.mark.slow
def test_increasing_enrollment_through_mosquitto(mosquitto, tmp_path, repo_root) -> None:
    listener = Listener(mosquitto.port)
    out = tmp_path / "run"
    args = ["simulate", str(repo_root / "configs/scenarios/mnist_filver_s3_increasing.yaml"), "--out", str(out)]
    args += ["--broker", mosquitto.url]
    for item in TINY:
        args += ["--set", item]
    result = run_fcl(*args)
    frames = listener.stop()
    assert result.returncode == 0, result.stderr + "".join(p.read_text()[-2000:] for p in (out / "logs").glob("*.log"))

    first_round = {"client-0": 0, "client-1": 3, "client-2": 5, "client-3": 7}  # each device's first task
    updates = collections.defaultdict(list)
    for _, f in frames:
        if f.header.kind is Kind.UPDATE:
            updates[f.header.client].append(f)
    for client, start in first_round.items():
        rounds = sorted({f.header.round for f in updates[client]})
        assert rounds == list(range(start, 9)), (client, rounds)  # from its enrollment on, every round
        for f in updates[client]:
            emb = {n for n in f.tensors if n.startswith("emb:")}
            if f.header.round == 0:  # phase 0: encoder + classifier, no embeddings
                assert any(n.startswith("enc.") for n in f.tensors) and not emb
            else:  # the classifier and this round's share of the task's items, opt-in declared
                assert not any(n.startswith("enc.") for n in f.tensors)
                assert emb == {"emb:y", "emb:z"} and f.meta["allow_embedding_upload"] is True
                assert f.tensors["emb:z"].shape == (len(f.tensors["emb:y"]), 16)

    encoders = collections.Counter(
        topic.rsplit("/", 1)[1] for topic, f in frames if f.header.kind is Kind.KNOWLEDGE and f.meta.get("encoder")
    )
    assert encoders == {c: 1 for c in first_round}, encoders  # the frozen encoder, once per device
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    enrolled = {e["client"]: e["round"] for e in events if e["event"] == "membership" and e["state"] == "enrolled"}
    assert enrolled == {c: r for c, r in first_round.items() if r}, enrolled

    summary = json.loads((out / "summary.json").read_text())
    assert summary["rejected"] == {}
    matrix = summary["fleet"]["accuracy_matrix"]
    assert len(matrix) == 4 and all(v is not None for t, row in enumerate(matrix) for v in row[: t + 1])

    buf = buffer(out / "state")  # every item of every (device, active task), kept after devices left
    per = collections.Counter(zip(buf["buffer/client"].tolist(), buf["buffer/task"].tolist()))
    active = {("client-0", t) for t in range(4)} | {("client-1", t) for t in (1, 2, 3)}
    active |= {("client-2", 2), ("client-2", 3), ("client-3", 3)}
    assert {(buf["clients"][c], t): n for (c, t), n in per.items()} == {k: ITEMS for k in active}

    model = out / "clients" / "client-3" / "model.onnx"
    images = tmp_path / "images.npy"
    np.save(images, np.random.default_rng(0).random((3, 28, 28), dtype=np.float32))
    infer = run_fcl("infer", str(model), "--input", str(images))
    assert infer.returncode == 0, infer.stderr
    lines = [json.loads(line) for line in infer.stdout.splitlines() if line.strip()]
    assert [row["index"] for row in lines] == [0, 1, 2] and all(0 <= row["label"] < 10 for row in lines)


def test_aggregator_killed_mid_run_keeps_its_buffer_once(mosquitto, tmp_path, repo_root) -> None:
    """Two devices, three tasks: the kill after round 4 leaves task 0's and task 1's items in
    the committed buffer and task 2 to come."""
    overrides = [*TINY, "federation.name=filver-kill", "clients=2", "tasks.domains.tasks=3"]
    overrides += ["federation.task_rounds=[3, 2, 2]"]  # TINY's, less its fourth task
    fleet = Fleet(repo_root / "configs/scenarios/mnist_filver.yaml", tmp_path / "run", mosquitto.url, overrides)
    try:
        fleet.start_all()
        fleet.wait_for_round(4, timeout=scaled(180))  # in task 1, with items of task 0 in the buffer
        fleet.kill("aggregator")
        time.sleep(1.0)
        fleet.start("aggregator")
        codes = fleet.wait(timeout=scaled(300))
        assert set(codes.values()) == {0}, (codes, fleet.logs())
        assert "resuming" in (tmp_path / "run/logs/aggregator.2.log").read_text()
    finally:
        fleet.stop()
    buf = buffer(tmp_path / "run" / "state")
    per = collections.Counter(zip(buf["buffer/client"].tolist(), buf["buffer/task"].tolist()))
    assert sorted(per.values()) == [ITEMS] * 6, per  # 2 devices x 3 tasks: none lost, none twice
    assert len(set(buf["buffer/seq"].tolist())) == len(buf["buffer/seq"]) == 6 * ITEMS
