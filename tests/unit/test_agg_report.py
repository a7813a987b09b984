"""The run report alone: a closed round's rows charge each client the announcement, its own
frame and the sync frames it fetched since its last report (all of a report whose counts went
down: the device restarted), and the retained status says where the run is."""

from __future__ import annotations

import json
import time

import numpy as np
from support.agg_parts import FED, RecordingLink, federation

from aggregator.announcer import Announced
from aggregator.metrics import AggregatorMetrics
from aggregator.report import RunReport
from aggregator.runlog import RunLog
from fclcore.codec import CodecLimits, Frame, Header, Kind, decode, encode
from fclcore.strategy import Update

SENT = Announced(packet_bytes=1000, payload_bytes=950, model_bytes=800, model={})


def _update(client: str, meta: dict) -> tuple[Update, bytes]:
    tensors = {"w": np.ones(4, np.float32), "kb:w": np.ones(2, np.float32)}
    payload = encode(Frame(Header(Kind.UPDATE, FED, 0, 0, client, 1), {"n_samples": 3, **meta}, tensors))
    return Update(client, decode(payload), 3, len(payload) + 30, len(payload), tensors), payload


def _rows(path) -> list[dict]:
    return [e for e in map(json.loads, path.read_text().splitlines()) if e["event"] == "round_client"]


def test_rows_charge_each_client_its_frames_and_new_syncs(tmp_path) -> None:
    fed, strategy = federation()
    link, runlog = RecordingLink(), RunLog(tmp_path)
    report = RunReport(strategy, runlog, AggregatorMetrics(FED), link, fed, CodecLimits())
    for rnd, sync in enumerate(({"full": 1, "bytes": 500}, {"full": 2, "bytes": 700}, {"full": 1, "bytes": 300})):
        report.open()
        update, payload = _update("a", {"sync": sync})
        report.measure(update, payload)
        report.arrived()
        report.record(rnd, 0, ["a", "b"], {"a": update}, SENT, 1, 0.5, {"a": (120, 100)})
        status = link.statuses[-1]
        assert (status["state"], status["role"], status["round"], status["task"]) == ("online", "aggregator", rnd, 0)
    runlog.close()
    rows = _rows(tmp_path / "metrics.jsonl")
    a = [r for r in rows if r["client"] == "a"]
    # round 1 adds 1 full model and 200 bytes to round 0's report; round 2's counts went down: all of it
    assert [r.get("sync") for r in a] == [{"full": 1}, {"full": 1}, {"full": 1}]
    assert [r["bytes_down"] for r in a] == [1000 + 120 + 500, 1000 + 120 + 200, 1000 + 120 + 300]
    assert a[0]["down_kinds"] == {"model": 800 + 500, "knowledge": 120, "control": 200}
    assert a[0]["up_kinds"]["knowledge"] > 0 and sum(a[0]["up_kinds"].values()) == a[0]["bytes_up"]
    b = [r for r in rows if r["client"] == "b"]
    assert [(r["status"], r["bytes_up"], r["bytes_down"]) for r in b] == [("missing", 0, 1000)] * 3
    assert time.time() - 60 < report.update_span[0] <= report.update_span[1]


def test_a_full_finetune_reference_is_summed_reported_and_rebuilt_on_resume(tmp_path) -> None:
    """A method that trains adapters on a frozen backbone states the whole model as its second
    reference: each row carries it (0 up for a missing device), summary.json its totals and the
    run's shares of them, and a resumed run log rebuilds the same totals from metrics.jsonl."""
    fed, strategy = federation()
    strategy.full_finetune_fp32_bytes = 10_000
    runlog = RunLog(tmp_path)
    report = RunReport(strategy, runlog, AggregatorMetrics(FED), RecordingLink(), fed, CodecLimits())
    for rnd in range(2):
        report.open()
        update, payload = _update("a", {})
        report.measure(update, payload)
        report.arrived()
        report.record(rnd, 0, ["a", "b"], {"a": update}, SENT, 1, 0.5, {})
    offset = runlog.offset()
    rows = _rows(tmp_path / "metrics.jsonl")
    assert [(r["full_finetune_fp32_up"], r["full_finetune_fp32_down"]) for r in rows] == [
        (10_000, 10_000),
        (0, 10_000),
    ] * 2
    b = runlog.summary(
        method="m", federation=FED, clients=["a", "b"], tasks=1, rounds=2, rounds_per_task=2, task_ends=[1]
    )["bytes"]
    assert (b["full_finetune_fp32_up_total"], b["full_finetune_fp32_down_total"]) == (20_000, 40_000)
    assert b["up_vs_full_finetune"] == round(b["up_total"] / 20_000, 4) > 0
    assert b["down_vs_full_finetune"] == round(4 * 1000 / 40_000, 4)
    assert "full fine-tuning" in b["reference_full_finetune"] and b["reference"] != b["reference_full_finetune"]
    runlog.close()
    again = RunLog(tmp_path)
    again.resume(offset, {})
    assert again.full_finetune == runlog.full_finetune == {"up": 20_000, "down": 40_000}
    again.close()


def test_a_method_without_a_second_reference_reports_only_dense(tmp_path) -> None:
    fed, strategy = federation()
    runlog = RunLog(tmp_path)
    report = RunReport(strategy, runlog, AggregatorMetrics(FED), RecordingLink(), fed, CodecLimits())
    report.open()
    update, payload = _update("a", {})
    report.measure(update, payload)
    report.arrived()
    report.record(0, 0, ["a"], {"a": update}, SENT, 1, 0.5, {})
    b = runlog.summary(method="m", federation=FED, clients=["a"], tasks=1, rounds=1, rounds_per_task=1, task_ends=[0])[
        "bytes"
    ]
    runlog.close()
    assert not any("full_finetune" in key for key in b) and b["up_vs_dense"] is not None
    assert not any("full_finetune" in key for key in _rows(tmp_path / "metrics.jsonl")[0])
