"""A clean run is clean (issue 21): no WARNING, ERROR or traceback in any log of a successful
run, over a real Mosquitto and over the embedded broker of the zero-config demo, and every
message a participant dropped is counted the same in metrics.jsonl and summary.json."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import run_fcl

from aggregator.runlog import RunLog
from edge_client.uplink import check_finite
from fclcore.codec import SparseTensor
from fclcore.errors import TrainingDiverged
from fclcore.exitcodes import ExitCode

SHORT = ["--set", "compare=[]", "--set", "federation.rounds_per_task=2"]  # the quickstart in 4 rounds
TINY = [*SHORT, "--set", "federation.model.hidden_sizes=[32]"]
NOISE = re.compile(r"\b(WARNING|ERROR|CRITICAL)\b|Traceback")


def _noise(run: Path) -> list[str]:
    logs = sorted((run / "logs").glob("*.log"))
    assert logs, f"no logs in {run}"
    return [f"{p.name}: {line}" for p in logs for line in p.read_text().splitlines() if NOISE.search(line)]


def _rejections(run: Path) -> tuple[dict, dict, dict]:
    """(summary rejected, summary rejected_by_client, each client's last report in metrics.jsonl)."""
    summary = json.loads((run / "summary.json").read_text())
    last: dict[str, dict] = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event["event"] == "round_client" and event.get("rejected_by_client") is not None:
            last[event["client"]] = event["rejected_by_client"]
    return summary["rejected"], summary["rejected_by_client"], last


@pytest.mark.parametrize("broker", ["mosquitto", "embedded"])
def test_a_successful_run_logs_no_warning_and_drops_nothing(broker, request, tmp_path: Path, repo_root: Path) -> None:
    """Three device processes and the aggregator: every log is free of warnings.  With the
    embedded broker this failed on every device (another device's retained JSON status, sent
    to it on a topic it never subscribed to, dropped as a corrupt frame) and in the broker's
    log (a bare TCP readiness probe logged as a failed MQTT session).  Without ``--broker`` it
    is the README's main command, which starts the embedded broker (the quickstart's model)."""
    out = tmp_path / "run"
    embedded = broker == "embedded"
    where = [*SHORT] if embedded else ["--broker", request.getfixturevalue("mosquitto").url, *TINY]
    result = run_fcl("simulate", str(repo_root / "configs/scenarios/quickstart.yaml"), "--out", str(out), *where)
    assert result.returncode == ExitCode.OK, result.stderr
    assert _noise(out) == []
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 4 and summary["final"]["avg_nll"] > 0
    if embedded:
        assert "embedded broker listening" in (out / "logs" / "broker.log").read_text()
    assert "Traceback" not in result.stderr and "%|" not in result.stderr  # no progress bar off a terminal
    rejected, by_client, reported = _rejections(out)
    assert rejected == {} and by_client == {}
    assert len(reported) == 3 and all(counts == {} for counts in reported.values()), reported


def test_summary_reports_the_devices_drops_as_metrics_jsonl_does(tmp_path: Path) -> None:
    log = RunLog(tmp_path)
    common = dict(up=1, payload_up=1, down=1, payload_down=1, dense_fp32_up=1)
    log.round_client(0, 0, "client-0", **common, rejected_by_client={"topic": 1})
    log.round_client(0, 0, "client-1", **common, rejected_by_client={})
    log.round_client(1, 0, "client-0", **common, rejected_by_client={"topic": 1, "run": 2})  # cumulative
    log.rejected("late", "round 0 is closed")
    summary = log.summary(
        method="fedavg", federation="f", clients=["client-0", "client-1"], tasks=1, rounds=2, rounds_per_task=2,
        task_ends=[1],
    )  # fmt: skip
    log.close()
    assert summary["rejected"] == {"late": 1}
    assert summary["rejected_by_client"] == {"client-0": {"topic": 1, "run": 2}}
    assert _rejections(tmp_path)[2] == {"client-0": {"topic": 1, "run": 2}, "client-1": {}}


@pytest.mark.parametrize(
    "loss, tensors, dtype, says",
    [
        (float("inf"), {"w": np.zeros(3, np.float32)}, "float32", "(loss=inf)"),
        (float("nan"), {"w": np.zeros(3, np.float32)}, "float32", "(loss=nan)"),
        (1.5, {"w": np.array([0.0, np.nan], np.float32)}, "float32", "update 'w' is not finite"),
        (None, {"s": SparseTensor((4,), np.array([1]), np.array([np.inf]))}, "float32", "update 's'"),
        (1.5, {"w": np.array([1e5], np.float32)}, "float16", "not finite in float16"),  # inf once on the wire
        (1.5, {"w": np.array([1e39])}, "int8", "not finite in int8"),  # int8 blocks read back as float32
    ],
)
def test_a_diverged_round_is_stopped_before_anything_is_sent(loss, tensors, dtype, says) -> None:
    with pytest.raises(TrainingDiverged, match=re.escape(says)) as raised:
        check_finite(7, loss, tensors, dtype)
    assert str(raised.value).startswith("training diverged at round 7 (")
    assert str(raised.value).endswith("lower `federation.train.lr`") and raised.value.exit_code == ExitCode.BAD_INPUT


def test_a_finite_round_passes() -> None:
    check_finite(0, 3.2, {"w": np.ones(4, np.float32), "n": np.array([3])}, "float16")
    check_finite(0, None, {}, "float32")
    check_finite(0, 1.0, {"w": np.array([1e5], np.float32)}, "int8")  # beyond float16, fine in int8
