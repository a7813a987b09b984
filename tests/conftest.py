"""Shared fixtures: a real Mosquitto broker per test on a free loopback port."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# the checkout's packages first: tests/methods/ would otherwise shadow the methods package
# (as a namespace package) when a single test file runs on its own
sys.path.insert(0, str(Path(__file__).parent.parent))

from support.mosquitto import Mosquitto
from support.timescale import SCALE, scaled

E2E_DIR = Path(__file__).resolve().parent / "e2e"
# Fixtures that start a broker or a whole fleet: a test asking for one is end-to-end wherever it lives.
E2E_FIXTURES = {"mosquitto", "quickstart_reference"}


def pytest_collection_modifyitems(config, items) -> None:
    """Mark end-to-end tests ``e2e``, so ``-m "not e2e and not slow"`` is the fast inner loop;
    scale each test's time limit (its ``timeout`` mark, else the ini's) by FCL_TEST_TIME_SCALE."""
    default = float(config.getini("timeout") or 0)
    for item in items:
        if E2E_DIR in Path(item.path).resolve().parents or E2E_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.e2e)
        if SCALE != 1:
            mark = item.get_closest_marker("timeout")
            limit = float(mark.args[0]) if mark and mark.args else default
            if limit > 0:
                item.add_marker(pytest.mark.timeout(scaled(limit)), append=False)  # the closest mark wins


@pytest.fixture
def mosquitto(tmp_path: Path):
    """A Mosquitto process started for this test and stopped after it."""
    if shutil.which("mosquitto") is None and not Path("/usr/sbin/mosquitto").exists():
        pytest.fail("mosquitto is not installed (apt-get install mosquitto); .ci/run installs it")
    broker = Mosquitto(tmp_path / "mosquitto")
    broker.start()
    yield broker
    broker.stop()


@pytest.fixture
def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def quickstart_reference(tmp_path_factory) -> dict:
    """Per-client NLL matrices of an undisturbed short quickstart run: what every crash, outage
    and restart test (separate processes on Mosquitto) must reproduce exactly.  It runs in one
    process over the in-process broker: the numbers do not depend on the transport, and each of
    those tests then shows it again."""
    import json

    from support.fleet import QUICK_OVERRIDES, QUICK_SCENARIO, matrices

    out = tmp_path_factory.mktemp("reference") / "run"
    sets = [item for o in (*QUICK_OVERRIDES, "compare=[]") for item in ("--set", o)]
    scenario = Path(__file__).resolve().parent.parent / QUICK_SCENARIO
    result = run_fcl("simulate", str(scenario), "--out", str(out), "--in-process", *sets)
    assert result.returncode == 0, result.stderr[-3000:]
    return matrices(json.loads((out / "summary.json").read_text()))


def run_fcl(*args: str, timeout: float = 300, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``fcl ARGS``; ``timeout`` is the quiet machine's limit (scaled here)."""
    return subprocess.run(
        [sys.executable, "-m", "fcl_edge.cli", *args], capture_output=True, text=True, timeout=scaled(timeout), cwd=cwd
    )


def autograd_penalty(learner):
    """ConFedMADE's eq. 6 weight terms written plainly with autograd (a DecomposedLearner's):
    the reference its hand-written ``WeightPenalty`` gradients are checked against."""
    import torch

    total, t = torch.zeros(()), learner.task
    for prefix, layer in learner.model.layers.items():
        mask = layer.mask if learner.masked else 1.0
        total = total + learner.opts.lambda1 * sum((a * mask).abs().sum() for a in layer.adaptive)
        base0, adaptive0, bias0, offsets0 = learner.anchor[prefix]
        d_base = layer.weight - base0  # (out, in)
        for i in range(t):
            drift = d_base * torch.sigmoid(layer.unit_logits[i])[:, None] + (layer.adaptive[i] - adaptive0[i])
            total = total + learner.opts.lambda2 * (drift**2).sum()
            if layer.bias is not None:
                bias_drift = (layer.bias - bias0) + (layer.bias_offsets[i] - offsets0[i])
                total = total + learner.opts.lambda2 * (bias_drift**2).sum()
    return total
