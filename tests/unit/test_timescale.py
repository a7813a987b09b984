"""FCL_TEST_TIME_SCALE stretches every test's time limit (README "Tests on a slow machine")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from support.timescale import scaled

TESTS = Path(__file__).resolve().parent.parent

SLEEPER = """
import time
import pytest

@pytest.mark.timeout(1)
def test_sleeps_past_one_second():
    time.sleep(1.6)
"""


def _run(tmp_path: Path, scale: str) -> subprocess.CompletedProcess:
    (tmp_path / "test_sleeper.py").write_text(SLEEPER)
    env = {**os.environ, "FCL_TEST_TIME_SCALE": scale, "PYTHONPATH": os.pathsep.join([str(TESTS), str(TESTS.parent)])}
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider", "test_sleeper.py"]
    return subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=scaled(120))


def test_a_limit_that_fails_at_scale_1_passes_at_scale_3(tmp_path) -> None:
    strict, stretched = _run(tmp_path, "1"), _run(tmp_path, "3")
    assert strict.returncode == 1 and "Timeout" in strict.stdout, strict.stdout[-2000:]
    assert stretched.returncode == 0, stretched.stdout[-2000:]


def test_a_scale_below_one_is_refused(tmp_path) -> None:
    done = _run(tmp_path, "0.5")
    assert done.returncode != 0 and "FCL_TEST_TIME_SCALE: expected a number >= 1" in done.stdout + done.stderr
