"""benchmarks/gpu_check.py on a machine without CUDA: the CPU half runs and the result file has
the issue's shape with the CUDA fields null and the reason; a learner that cannot leave the CPU
is reported as such.  Its GPU half runs on a GPU machine, not in the suite."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.timescale import scaled

from fclcore.learner import Learner

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
check = importlib.import_module("gpu_check")
ROW = {
    "cpu_s_per_round",
    "cpu_torch_threads",
    "cuda_s_per_round",
    "speedup",
    "max_abs_metric_diff",
    "peak_gpu_mb",
    "placeable",
    "cuda",
}


@pytest.mark.e2e  # a whole smoke federation in-process (about 15 s)
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check would run its GPU half")
def test_without_cuda_the_cpu_half_runs_and_the_cuda_fields_are_null(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--methods", "fedavg", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=scaled(600),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[0].startswith("CUDA unavailable: torch ")
    result = json.loads(out.read_text())
    assert set(result) == {"device", "cuda", "torch", "methods", "serving", "machine", "command"}
    assert result["cuda"].startswith("unavailable: ") and result["torch"] == torch.__version__
    row = result["methods"]["fedavg"]
    assert ROW <= set(row) and row["rounds"] == 4 and row["cpu_s_per_round"] > 0
    assert row["placeable"] is True and row["cuda"] == "not run: no CUDA device"
    assert [row[k] for k in ("cuda_s_per_round", "speedup", "max_abs_metric_diff", "peak_gpu_mb")] == [None] * 4
    serving = result["serving"]
    assert "CPUExecutionProvider" in serving["providers_available"] and serving["cpu_latency_us"] > 0
    assert serving["provider_used"] == "CPUExecutionProvider" and serving["gpu_latency_us"] is None
    assert result["command"] == f"python benchmarks/gpu_check.py --methods fedavg --out {out}"


def test_an_unknown_method_is_refused_by_name(tmp_path):
    with pytest.raises(SystemExit) as info:
        check.main(["--methods", "fedavgg", "--out", str(tmp_path / "x.json")])
    assert info.value.code == 2 and not (tmp_path / "x.json").exists()


def test_a_learner_that_cannot_leave_the_cpu_gives_its_reason(monkeypatch, tmp_path):
    class CpuOnly(Learner):
        fed = type("Fed", (), {"method": "cpu-only"})()

        def __init__(self) -> None:  # no federation needed: only ``place`` is asked
            pass

    monkeypatch.setattr("edge_client.state.learner_from_state", lambda state_dir: (CpuOnly(), None))
    assert check.cannot_place(tmp_path) == "method cpu-only trains on the CPU without amp only (asked: meta, amp off)"


def test_the_metric_difference_is_over_every_number_of_the_final_metrics():
    a = {"avg_nll": 20.0, "per_task": [1.0, None], "per_client": {"c0": {"m": [[2.0]]}}}
    b = {"avg_nll": 20.25, "per_task": [1.5, None], "per_client": {"c0": {"m": [[1.0]]}}}
    assert check.max_abs_diff(a, b) == 1.0
    with pytest.raises(ValueError, match="differ in shape"):
        check.max_abs_diff(a, {"avg_nll": 20.0})
