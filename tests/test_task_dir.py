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


def _ctl(sock: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fcl_edge.cli", "ctl", str(sock), *args], capture_output=True, text=True, timeout=60
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
