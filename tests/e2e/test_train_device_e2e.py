"""``train.device`` on a machine without CUDA: a small quickstart ConFedMADE run gives the same
numbers with no device setting, with ``device=cpu`` and with ``device=auto`` (issue 35: the CPU
path stays bit-identical); ``amp=bf16`` is a different run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.timescale import scaled

ROOT = Path(__file__).resolve().parents[2]
RUN = ["--set", "compare=[]", "--set", "federation.method=confedmade", "--set", "federation.rounds_per_task=2"]
RUN += ["--set", "clients=2", "--set", "federation.model.hidden_sizes=[32]"]  # four runs: each kept small


def _final(out: Path, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "fcl_edge.cli", "simulate", "configs/scenarios/quickstart.yaml", "--in-process"]
    proc = subprocess.run(
        [*cmd, *RUN, *extra, "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=scaled(900)
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    return {"final": summary["final"], "fleet": summary["fleet"]}


# the default suite's 10 min; CPU bit-identity per learner: tests/methods/test_train_device.py
@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="auto would train on CUDA here")
def test_cpu_and_auto_give_todays_numbers_and_bf16_does_not(tmp_path):
    today = _final(tmp_path / "default")
    assert _final(tmp_path / "cpu", "--set", "device=cpu") == today
    assert _final(tmp_path / "auto", "--set", "device=auto") == today
    assert _final(tmp_path / "bf16", "--set", "amp=bf16") != today
