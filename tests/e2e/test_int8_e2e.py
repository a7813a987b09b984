"""End to end over a real Mosquitto: ``wire.value_dtype: int8`` on every frame that carries values.

ConFedMADE on 8x8 digits, three short tasks, stochastic int8 rounding: updates, round
downlinks and knowledge-base frames all cross the broker as codec v2 frames with int8
values, every update is accepted, and the run learns (finite NLL).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import run_fcl
from support.listener import Listener

from fclcore import topics
from fclcore.codec import INT8_VERSION

FED = "int8-e2e"


@pytest.mark.slow  # the default suite's int8 frames, each way and on the knowledge topic: test_e2e_quickstart.py
def test_int8_values_travel_in_every_direction(mosquitto, tmp_path: Path, repo_root: Path):
    listener = Listener(mosquitto.port, extra_topics=(topics.round_topic(FED),))
    out = tmp_path / "run"
    result = run_fcl(
        "simulate",
        str(repo_root / "configs/scenarios/digits_continual.yaml"),
        "--out",
        str(out),
        "--broker",
        f"mqtt://127.0.0.1:{mosquitto.port}",
        *("--set", f"federation.name={FED}", "--set", "federation.rounds_per_task=2"),
        *("--set", "federation.wire.value_dtype=int8", "--set", "federation.wire.int8_rounding=stochastic"),
    )
    listener.stop()
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert math.isfinite(summary["final"]["avg_nll"])
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    accepted = [e for e in events if e["event"] == "round_client" and e["status"] == "accepted"]
    assert len(accepted) == summary["rounds"] * summary["clients"]

    with_values = {}  # topic kind -> versions of the frames that carried tensors
    for (topic, frame), (_, data) in zip(listener.frames, listener.payloads):
        if frame.tensors:  # decoded, so every value was checked finite on the way
            with_values.setdefault(topic.split("/")[2], set()).add(data[4])
    assert with_values == {"update": {INT8_VERSION}, "round": {INT8_VERSION}, "kb": {INT8_VERSION}}
