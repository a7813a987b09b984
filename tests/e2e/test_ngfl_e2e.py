"""NGFL end to end over a real Mosquitto: an aggregator and three devices with task folders,
as separate ``fcl`` processes.  Each device is on its own task clock: folders (labelled, some
naming their classes in classes.json) appear while the run goes, at rounds of the device's own;
a device without an active task sends a skip notice and every round still closes.  Device A
brings "cat" / "dog", device B later "dog" / "emu" (one class in common, named in another
order), device C starts late and enrolls in the federation's task 1 (federation.membership).
The global table must hold each label once, and the devices' served ONNX models must name the
table's labels."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml
from conftest import run_fcl
from support.listener import Listener

from aggregator.state import StateStore
from export.image_runtime import ImageClassifierRuntime
from fclcore.codec import Kind
from fclcore.data import load_dataset

FED = "ngfl-e2e"
DEVICES = ("dev-a", "dev-b", "dev-c")
TASK_ROUNDS = [6, 6]  # the federation's two stages; dev-c enrolls at the second (round 6)
ROUNDS = sum(TASK_ROUNDS)
LABELS = {"0", "1", "2", "3", "cat", "dog", "emu", "fox"}
PER_CLASS = 60


def _task(folder: Path, data, digits: dict[int, int], classes: list[str] | None, test: bool) -> None:
    """A labelled task folder, written under a hidden name and renamed into place (as a device's
    data would be copied): ``digits`` maps a digit to its label value in the folder."""
    rng = np.random.default_rng(0)
    rows = np.concatenate([np.flatnonzero(data.y == d)[:PER_CLASS] for d in digits])
    rows = rng.permutation(rows)  # shuffled: the holdout of a folder without test.npy holds every class
    x, y = data.x[rows], np.array([digits[int(d)] for d in data.y[rows]], np.int64)
    staging = folder.parent / f".{folder.name}"
    staging.mkdir(parents=True)
    cut = len(x) - 20 if test else len(x)
    np.save(staging / "train.npy", x[:cut])
    np.save(staging / "train_labels.npy", y[:cut])
    if test:
        np.save(staging / "test.npy", x[cut:])
        np.save(staging / "test_labels.npy", y[cut:].astype(np.int32))
    if classes is not None:
        (staging / "classes.json").write_text(json.dumps(classes))
    staging.rename(folder)


class Run:
    """The aggregator and the devices as processes, and what they wrote."""

    def __init__(self, tmp: Path, broker_url: str) -> None:
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen] = {}
        fed = {
            "name": FED,
            "method": "ngfl",
            "seed": 0,
            "num_tasks": len(TASK_ROUNDS),
            "task_rounds": TASK_ROUNDS,
            "train": {"optimizer": "sgd", "lr": 0.05, "batch_size": 32, "local_epochs": 1},
            "options": {"hidden": [32, 16], "base_rounds": 2, "rounds_per_task": 1},  # idle: skip (default)
            "rounds": {"deadline_s": 60, "resend_after_s": 5, "start_timeout_s": 60},
            "membership": {"dev-a": "* *", "dev-b": "* *", "dev-c": "x *"},
        }
        configs = {
            "aggregator": {
                "federation": fed,
                "expected_clients": list(DEVICES),
                "out_dir": str(tmp / "agg"),
                "broker": {"url": broker_url},
                "input_dim": 64,
            }
        }
        for dev in DEVICES:
            configs[dev] = {
                "client_id": dev,
                "federation": FED,
                "data_dir": str(tmp / "data" / dev),
                "out_dir": str(tmp / dev),
                "broker": {"url": broker_url},
            }
            (tmp / "data" / dev).mkdir(parents=True)
        for name, cfg in configs.items():
            (tmp / f"{name}.yaml").write_text(yaml.safe_dump(cfg))

    def start(self, name: str) -> None:
        kind = "aggregator" if name == "aggregator" else "client"
        log = open(self.tmp / f"{name}.log", "w")
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "fcl_edge.cli", kind, "--config", str(self.tmp / f"{name}.yaml")],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

    @contextlib.contextmanager
    def paused(self, name: str):
        """SIGSTOP a device while its folder is written: the federation cannot run more than a
        round or two ahead of it, so the folder arrives while rounds are left."""
        os.kill(self.procs[name].pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(self.procs[name].pid, signal.SIGCONT)

    def events(self, kind: str) -> list[dict]:
        path = self.tmp / "agg" / "metrics.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [e for e in map(json.loads, filter(None, lines)) if e.get("event") == kind]

    def wait_for(self, what: str, check, timeout: float = 40):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = check()
            if found is not None:
                return found
            for name, proc in self.procs.items():
                assert proc.poll() is None, f"{name} exited with {proc.returncode} waiting for {what}\n{self.logs()}"
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what}\n{self.logs()}")

    def wait_for_round(self, rnd: int) -> None:
        self.wait_for(f"round {rnd}", lambda: True if any(e["round"] >= rnd for e in self.events("round")) else None)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2500:]}" for p in sorted(self.tmp.glob("*.log")))


def _first_round_with(listener: Listener, client: str, label: str) -> int | None:
    """The first round in which ``client`` uploaded a head row for ``label``."""
    with listener.lock:
        frames = list(listener.frames)
    rounds = [
        f.header.round
        for _, f in frames
        if f.header.kind is Kind.UPDATE
        and f.header.client == client
        and label in f.meta["ngfl"].get("table", {}).get("labels", [])
    ]
    return min(rounds) if rounds else None


def test_ngfl_devices_on_their_own_clocks_through_mosquitto(mosquitto, tmp_path) -> None:
    train, _ = load_dataset("digits", None, 0)
    data = tmp_path / "data"
    run = Run(tmp_path, mosquitto.url)
    _task(data / "dev-a" / "000-base", train, {0: 0, 1: 1}, None, test=False)  # names "0", "1"
    _task(data / "dev-b" / "000-base", train, {2: 2, 3: 3}, None, test=True)  # names "2", "3"
    listener = Listener(mosquitto.port)
    try:
        for name in ("aggregator", "dev-a", "dev-b"):
            run.start(name)
        run.wait_for_round(2)  # dev-a and dev-b trained their base task in rounds 0-1, then skipped
        with run.paused("dev-a"):
            _task(data / "dev-a" / "001-pets", train, {4: 0, 5: 1}, ["cat", "dog"], test=True)
        run.start("dev-c")  # late: not enrolled before task 1, it waits
        _task(data / "dev-c" / "000-wild", train, {7: 0, 6: 1}, ["fox", "emu"], test=False)
        ra = run.wait_for("dev-a's pets", lambda: _first_round_with(listener, "dev-a", "cat"))
        run.wait_for_round(ra)
        with run.paused("dev-b"):  # dog and emu, named in another order than anyone else's
            _task(data / "dev-b" / "001-zoo", train, {6: 0, 5: 1}, ["emu", "dog"], test=True)
        rb = run.wait_for("dev-b's zoo", lambda: _first_round_with(listener, "dev-b", "emu"))

        codes = {"aggregator": run.procs["aggregator"].wait(60)}
        codes.update({dev: run.procs[dev].wait(30) for dev in DEVICES})
        assert set(codes.values()) == {0}, (codes, run.logs())
    finally:
        frames = listener.stop()
        run.stop()

    # every round closed with an update (a skip notice or a trained head) from its whole roster
    rounds = run.events("round")
    assert [e["round"] for e in rounds] == list(range(ROUNDS))
    assert all(e["accepted"] == e["expected"] == (2 if e["round"] < 6 else 3) for e in rounds), rounds
    per_client = run.events("round_client")
    assert all(e["status"] == "accepted" for e in per_client)
    trained = collections.defaultdict(set)
    pairs = collections.Counter((e["round"], e["client"]) for e in per_client)
    assert set(pairs.values()) == {1} and len(pairs) == 2 * ROUNDS + TASK_ROUNDS[1]
    for e in per_client:
        if e["n_samples"]:
            trained[e["client"]].add(e["round"])
        else:  # a skip notice: no tensors, nothing trained, accepted all the same
            assert e["train_nll"] is None and e["tensor_bytes_by_kind"]["head"] == 0
    assert 2 < ra < rb < ROUNDS - 1
    assert trained == {"dev-a": {0, 1, ra}, "dev-b": {0, 1, rb}, "dev-c": {6, 7}}, (trained, ra, rb)
    skips = collections.Counter(e["client"] for e in per_client if e["n_samples"] == 0)
    assert skips == {"dev-a": ROUNDS - 3, "dev-b": ROUNDS - 3, "dev-c": TASK_ROUNDS[1] - 2}
    enrolled = [e for e in run.events("membership") if e["state"] == "enrolled"]
    assert [(e["client"], e["round"]) for e in enrolled] == [("dev-c", 6)]
    assert json.loads((tmp_path / "agg" / "summary.json").read_text())["rejected"] == {}

    # the late device's updates: from round 6 on, its own classes first, then the federation's
    updates = {(f.header.client, f.header.round): f for _, f in frames if f.header.kind is Kind.UPDATE}
    assert sorted(r for c, r in updates if c == "dev-c") == list(range(6, ROUNDS))
    assert set(updates["dev-c", 6].meta["ngfl"]["table"]["current"]) == {"emu", "fox"}
    assert updates["dev-b", rb].meta["ngfl"]["coverage"] in (["semi"], ["full"])  # dog was the federation's

    # the aggregator's committed table: each label once, "dog" once (brought by dev-a), a head row each
    committed = StateStore(tmp_path / "agg" / "state").load()
    table = committed.strategy["table"]
    labels = table["labels"]
    assert sorted(labels) == sorted(LABELS) and len(labels) == len(LABELS) and labels.count("dog") == 1
    assert table["added"][labels.index("dog")] == [ra, "dev-a"]
    assert table["added"][labels.index("fox")] == [6, "dev-c"]
    assert committed.global_params["head.weight"].shape == (len(LABELS), 16)

    # each device serves the final model, its classes named by the table
    for dev in DEVICES:
        runtime = ImageClassifierRuntime(tmp_path / dev / "model.onnx")
        assert runtime.class_names == labels, (dev, runtime.class_names)
    images = train.x[np.isin(train.y, [0, 5, 7])][:6].reshape(-1, 8, 8)
    np.save(tmp_path / "images.npy", images)
    infer = run_fcl("infer", str(tmp_path / "dev-a" / "model.onnx"), "--input", str(tmp_path / "images.npy"))
    assert infer.returncode == 0, infer.stderr
    lines = [json.loads(line) for line in infer.stdout.splitlines() if line.strip()]
    assert [row["index"] for row in lines] == list(range(6)) and all(row["class"] in LABELS for row in lines)
