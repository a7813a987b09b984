"""Tasks that arrive as folders on the device, and the client's local control socket.

Unit checks of the folder scanner, then a run with separate processes on Mosquitto: the
device has only task 0's folder, waits when the federation reaches task 1 (visible through
``fcl ctl status``), answers ``fcl ctl loglik`` with the model it serves, and joins the next
round once task 1's folder is renamed into place."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from support.timescale import scaled

from edge_client.taskdir import TaskDirectory
from fclcore.data import load_dataset

D = 64


def _write(folder: Path, x: np.ndarray, test: np.ndarray | None = None) -> None:
    folder.mkdir(parents=True)
    np.save(folder / "train.npy", x)
    if test is not None:
        np.save(folder / "test.npy", test)


def test_scan_order_holdout_and_hidden_folders(tmp_path) -> None:
    rng = np.random.default_rng(0)
    _write(tmp_path / "001-b", (rng.random((20, D)) > 0.5).astype(np.uint8))
    _write(tmp_path / "000-a", rng.random((10, D)).astype(np.float32), test=np.ones((3, D), np.float32))
    _write(tmp_path / ".002-c", np.ones((5, D)))  # still being copied: ignored
    tasks = TaskDirectory(tmp_path).scan(D)
    assert [len(d.x) for d in tasks.train] == [10, 18] and [len(d.x) for d in tasks.test] == [3, 2]
    assert set(np.unique(tasks.train[0].x)) <= {0.0, 1.0}  # binarised at 0.5


@pytest.mark.parametrize(
    "bad,reason",
    [
        (np.ones((4, D + 1)), "columns"),
        (np.full((4, D), 2.0), r"\[0, 1\]"),
        (np.full((4, D), np.nan), "finite"),
        (np.ones(D), "2-D"),
        (np.array([[{"evil": 1}]], dtype=object), "readable"),
    ],
)
def test_a_bad_folder_stops_the_scan_and_is_reported(tmp_path, caplog, bad, reason) -> None:
    _write(tmp_path / "000-ok", np.ones((4, D)))
    (tmp_path / "001-bad").mkdir()
    np.save(tmp_path / "001-bad" / "train.npy", bad, allow_pickle=True)
    _write(tmp_path / "002-later", np.ones((4, D)))
    directory = TaskDirectory(tmp_path)
    assert len(directory.scan(D).train) == 1  # task 2 waits behind the broken task 1
    assert any(r.levelname == "WARNING" and "001-bad" in r.message for r in caplog.records)
    assert __import__("re").search(reason, caplog.text)
    caplog.clear()
    directory.scan(D)
    assert not caplog.records  # reported once, not on every rescan


def _labelled(folder: Path, files: dict) -> Path:
    """A task folder from ``{file name: array, or text for classes.json}``."""
    folder.mkdir(parents=True)
    for name, value in files.items():
        if isinstance(value, str):
            (folder / name).write_text(value)
        else:
            np.save(folder / name, value, allow_pickle=True)
    return folder


def test_labels_and_class_names_are_loaded(tmp_path) -> None:
    x = np.ones((6, D), np.float32)
    _labelled(
        tmp_path / "000-pets",
        {
            "train.npy": x,
            "train_labels.npy": np.array([0, 1, 1, 0, 1, 0], np.int32),
            "test.npy": x[:3],
            "test_labels.npy": np.array([1, 0, 1], np.uint8),
            "classes.json": json.dumps(["cat", "dog"]),
        },
    )
    _labelled(tmp_path / "001-digits", {"train.npy": x[:4], "train_labels.npy": np.array([3, 7, 3, 7])})
    tasks = TaskDirectory(tmp_path).scan(D)
    pets, digits = tasks.train
    assert pets.classes == ("cat", "dog") and pets.y.dtype == np.int64
    assert pets.label_names().tolist() == ["cat", "dog", "dog", "cat", "dog", "cat"]
    assert tasks.test[0].label_names().tolist() == ["dog", "cat", "dog"] and tasks.test[0].classes == ("cat", "dog")
    assert digits.classes is None  # without classes.json a label's name is its number
    assert [*digits.label_names(), *tasks.test[1].label_names()] == ["3", "7", "3", "7"]  # 3 train, 1 held out


def test_the_holdout_keeps_labels_with_their_rows(tmp_path) -> None:
    n = 20
    x = np.zeros((n, D), np.float32)
    x[np.arange(n), np.arange(n)] = 1.0  # row i is one-hot at column i: rows can be told apart
    y = np.arange(n) % 3
    _labelled(tmp_path / "000-t", {"train.npy": x, "train_labels.npy": y, "classes.json": '["a", "b", "c"]'})
    tasks = TaskDirectory(tmp_path).scan(D)
    for d in (tasks.train[0], tasks.test[0]):
        rows = d.x.argmax(axis=1)
        assert (d.y == y[rows]).all() and d.label_names().tolist() == [["a", "b", "c"][v] for v in y[rows]]
    assert len(tasks.train[0]) == 18 and tasks.test[0].x.argmax(axis=1).tolist() == [18, 19]  # the last 10%


@pytest.mark.parametrize(
    "files,reason",
    [
        ({"train_labels.npy": np.zeros(3, np.int64)}, "3 labels for 4 rows"),
        ({"train_labels.npy": np.zeros(4, np.float32)}, "integer"),
        ({"train_labels.npy": np.zeros(4, bool)}, "integer"),
        ({"train_labels.npy": np.zeros((4, 1), np.int64)}, "1-D"),
        ({"train_labels.npy": np.array([0, -1, 0, 0])}, "negative"),
        ({"train_labels.npy": np.array([{"evil": 1}] * 4, dtype=object)}, "readable"),
        ({"train_labels.npy": np.array([0, 2, 0, 1]), "classes.json": '["a", "b"]'}, "label 2"),
        ({"train_labels.npy": np.zeros(4, np.int64), "classes.json": '["a", '}, "JSON"),
        ({"train_labels.npy": np.zeros(4, np.int64), "classes.json": '{"0": "a"}'}, "list"),
        ({"train_labels.npy": np.zeros(4, np.int64), "classes.json": "[]"}, "list"),
        ({"train_labels.npy": np.zeros(4, np.int64), "classes.json": json.dumps(["a"] * 1025)}, "list"),
        ({"train_labels.npy": np.zeros(4, np.int64), "classes.json": '["a", "a"]'}, "duplicate"),
        ({"train_labels.npy": np.zeros(4, np.int64), "classes.json": '["a", 1]'}, "printable"),
        ({"train_labels.npy": np.zeros(4, np.int64), "classes.json": '[""]'}, "printable"),
        ({"train_labels.npy": np.zeros(4, np.int64), "classes.json": json.dumps(["x" * 65])}, "printable"),
        ({"train_labels.npy": np.zeros(4, np.int64), "classes.json": '["a\\nb"]'}, "printable"),
        ({"classes.json": '["a"]'}, "without train_labels"),
        ({"test.npy": np.ones((2, D)), "test_labels.npy": np.zeros(2, np.int64)}, "without train_labels"),
        ({"train_labels.npy": np.zeros(4, np.int64), "test_labels.npy": np.zeros(2, np.int64)}, "without test.npy"),
        ({"train_labels.npy": np.zeros(4, np.int64), "test.npy": np.ones((2, D))}, "without test_labels"),
        (
            {"train_labels.npy": np.zeros(4, np.int64), "test.npy": np.ones((2, D)), "test_labels.npy": np.zeros(3)},
            "test_labels.npy",
        ),
    ],
)
def test_a_folder_with_bad_labels_is_not_usable_yet(tmp_path, caplog, files, reason) -> None:
    _write(tmp_path / "000-ok", np.ones((4, D)))
    _labelled(tmp_path / "001-bad", {"train.npy": np.ones((4, D)), **files})
    _write(tmp_path / "002-later", np.ones((4, D)))
    directory = TaskDirectory(tmp_path)
    assert len(directory.scan(D).train) == 1  # task 2 waits behind the broken task 1
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "001-bad" in warnings[0] and reason in warnings[0], warnings
    caplog.clear()
    directory.scan(D)
    assert not caplog.records  # reported once, not on every rescan


def test_labels_fixed_in_place_are_picked_up(tmp_path) -> None:
    folder = _labelled(
        tmp_path / "000-t",
        {"train.npy": np.ones((4, D)), "train_labels.npy": np.array([0, 1, 2, 1]), "classes.json": '["a", "b"]'},
    )
    directory = TaskDirectory(tmp_path)
    assert directory.scan(D).train == ()
    (folder / "classes.json").write_text('["a", "b", "c"]')
    tasks = directory.scan(D)
    assert [*tasks.train[0].label_names(), *tasks.test[0].label_names()] == ["a", "b", "c", "b"]


def _ctl(sock: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fcl_edge.cli", "ctl", str(sock), *args],
        capture_output=True,
        text=True,
        timeout=scaled(60),
    )


def test_device_waits_for_a_task_folder_and_answers_local_commands(mosquitto, tmp_path) -> None:
    train, _ = load_dataset("digits", None, 0)
    data = tmp_path / "data"
    _write(data / "000-low", train.x[train.y < 5][:300])
    fed = {
        "name": "home",
        "method": "fedavg",
        "num_tasks": 2,
        "rounds_per_task": 2,
        "model": {"hidden_sizes": [32]},
        "rounds": {"deadline_s": 120, "resend_after_s": 60},
    }
    agg = {
        "federation": fed,
        "expected_clients": ["dev-0"],
        "out_dir": str(tmp_path / "agg"),
        "broker": {"url": mosquitto.url},
        "input_dim": D,
    }
    client = {
        "client_id": "dev-0",
        "federation": "home",
        "data_dir": str(data),
        "out_dir": str(tmp_path / "dev"),
        "broker": {"url": mosquitto.url},
    }
    for name, cfg in (("agg", agg), ("dev", client)):
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    logs = {n: open(tmp_path / f"{n}.log", "w") for n in ("agg", "dev")}
    procs = {
        n: subprocess.Popen(
            [sys.executable, "-m", "fcl_edge.cli", kind, "--config", str(tmp_path / f"{n}.yaml")],
            stdout=logs[n],
            stderr=subprocess.STDOUT,
        )
        for n, kind in (("agg", "aggregator"), ("dev", "client"))
    }
    sock = tmp_path / "dev" / "state" / "control.sock"
    try:
        deadline = time.monotonic() + 120
        status = {}
        while time.monotonic() < deadline:
            result = _ctl(sock, "status") if sock.exists() else None
            if result is not None and result.returncode == 0:
                status = json.loads(result.stdout)
                if status["waiting_for_task"] == 1:
                    break
            time.sleep(0.3)
        assert status.get("waiting_for_task") == 1 and status["last_round"] == 1, status
        assert status["tasks_on_device"] == 1 and status["served_model"]

        rows = train.x[train.y < 5][:5]
        np.save(tmp_path / "rows.npy", rows)
        scored = _ctl(sock, "loglik", "--input", str(tmp_path / "rows.npy"))
        assert scored.returncode == 0, scored.stderr
        values = [float(v) for v in scored.stdout.split()]
        assert len(values) == 5 and all(-D * 1.0 < v < 0 for v in values)
        bad = _ctl(sock, "loglik", "--input", str(tmp_path / "agg.yaml"))
        assert bad.returncode == 2

        staging = data / ".001-high"  # copy under a hidden name, then rename: a task appears whole
        _write(staging, train.x[train.y >= 5][:300])
        staging.rename(data / "001-high")
        assert procs["agg"].wait(180) == 0
        assert procs["dev"].wait(60) == 0
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
    summary = json.loads((tmp_path / "agg" / "summary.json").read_text())
    matrix = summary["final"]["per_client"]["dev-0"]["nll_matrix"]
    assert len(matrix) == 2 and matrix[1][1] is not None  # task 1 was trained and scored
    assert "data for task 1 arrived" in (tmp_path / "dev.log").read_text()
