"""Every byte a device meters is attributed: to a round row or to a run-level kind.

The device's meter names each message it receives (``downlink_tag``); its ledger says what each
round's row counts (``RoundLedger``) and leaves the rest as run-level bytes by kind, which
``fcl simulate`` writes to the run directory (``fcl_edge.attribution``) with what is left over.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edge_client.ledger import RoundLedger, downlink_tag
from fcl_edge.attribution import attribute
from fclcore.codec import Frame, Header, Kind, encode
from fclcore.transport import WireMeter, publish_packet_bytes

STATUS = "fcl/fed/status/aggregator"


def _frame(kind: Kind) -> bytes:
    return encode(Frame(Header(kind, "fed", 3, 1, "aggregator", 7), {"x": 1}, {}))


@pytest.mark.parametrize("kind", [Kind.ROUND, Kind.FINISH, Kind.REQUEST, Kind.KNOWLEDGE, Kind.MODEL])
def test_a_downlink_frame_is_tagged_by_its_kind(kind: Kind) -> None:
    assert downlink_tag(STATUS)("fcl/fed/round", _frame(kind)) == kind.name.lower()


def test_status_empty_and_garbage_have_their_own_tags_and_never_raise() -> None:
    tag = downlink_tag(STATUS)
    assert tag(STATUS, b'{"state": "online"}') == "status"
    assert tag("fcl/fed/round", b"") == "clear"
    for junk in (b"x", b"FCLW", b"FCLW\x01", b"FCLW\x01\xff" + bytes(30), b"\x00" * 64):
        assert tag("fcl/fed/round", junk) == "unreadable", junk


def test_the_meter_tags_what_it_receives_with_its_classifier() -> None:
    meter = WireMeter(classify=downlink_tag(STATUS))
    payload = _frame(Kind.FINISH)
    size = meter.received("fcl/fed/round", payload, "fcl/fed/status")
    assert size == publish_packet_bytes("fcl/fed/round", len(payload))
    assert meter.snapshot()["by_tag"] == {"down:finish": {"packets": 1, "bytes": size, "payload": len(payload)}}
    plain = WireMeter()  # without one: only status messages are tagged
    plain.received("fcl/fed/status/client-1", b"{}", "fcl/fed/status")
    plain.received("fcl/fed/round", b"abc", "fcl/fed/status")
    assert list(plain.snapshot()["by_tag"]) == ["down:status"]


def _meter(tags: dict[str, int], untagged: dict[str, int] | None = None) -> dict:
    """A meter snapshot with these tagged bytes (and some without a tag)."""
    untagged = untagged or {"up": 0, "down": 0}
    totals = {d: sum(n for k, n in tags.items() if k.startswith(d + ":")) + untagged[d] for d in ("up", "down")}
    return {
        **{d: {"packets": 0, "bytes": totals[d], "payload": 0} for d in totals},
        "by_tag": {k: {"packets": 1, "bytes": n, "payload": 0} for k, n in tags.items()},
    }


def test_run_level_is_what_no_round_row_counts_by_kind() -> None:
    ledger = RoundLedger()
    ledger.counted(0, announcement=100, own=40)
    ledger.reported(0, {"full": 1, "bytes": 70})  # a sync frame fetched before round 0's update
    ledger.counted(1, announcement=90, own=0)
    ledger.reported(1, {"full": 1, "bytes": 70})  # nothing new since
    meter = _meter(
        {
            "up:update:0": 500,
            "up:update:1": 510,
            "up:resend:1": 510,
            "up:eval:2": 30,
            "up:status": 20,
            "down:round": 100 + 90 + 95,  # round 1 announced twice
            "down:knowledge": 40,
            "down:model": 70 + 60,  # a second sync frame after the last update
            "down:finish": 300,
            "down:status": 11,
        }
    )
    assert ledger.bytes_down() == {0: 210, 1: 90}
    assert ledger.run_level(meter) == {
        "up": {"eval": 30, "resend": 510, "status": 20},
        "down": {"finish": 300, "model": 60, "round": 95, "status": 11},
        "untagged": {"up": 0, "down": 0},
    }


def test_bytes_a_row_claims_but_the_meter_never_saw_show_as_negative() -> None:
    ledger = RoundLedger()
    ledger.counted(0, announcement=100, own=50)
    run = ledger.run_level(_meter({"down:round": 100}, untagged={"up": 3, "down": 0}))
    assert run["down"] == {"knowledge": -50} and run["untagged"] == {"up": 3, "down": 0}


def _run_dir(tmp_path: Path, wire_down: int) -> Path:
    out = tmp_path / "run"
    (out / "clients" / "c0").mkdir(parents=True)
    rows = [{"event": "round_client", "client": "c0", "round": r, "bytes_up": 100, "bytes_down": 200} for r in (0, 1)]
    (out / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in rows))
    (out / "summary.json").write_text(json.dumps({"method": "m", "bytes": {"up_total": 200, "down_total": 400}}))
    wire = {
        "up": {"bytes": 200 + 15 + 5},
        "down": {"bytes": wire_down},
        "run_level": {"up": {"status": 15, "eval": 5}, "down": {"finish": 90}, "untagged": {"up": 0, "down": 0}},
    }
    (out / "clients" / "c0" / "wire.json").write_text(json.dumps(wire))
    return out


def test_simulate_writes_the_run_level_bytes_and_what_is_left_over(tmp_path: Path) -> None:
    out = _run_dir(tmp_path, wire_down=400 + 90)
    block = attribute(out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["bytes"]["run_level"] == block
    assert block["up_by_kind"] == {"eval": 5, "status": 15} and block["down_by_kind"] == {"finish": 90}
    assert (block["up_total"], block["down_total"], block["unattributed"]) == (20, 90, {"up": 0, "down": 0})
    assert block["share"] == round(110 / (110 + 600), 4)
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert last == {
        "event": "run_level",
        "client": "c0",
        "bytes_up": 20,
        "bytes_down": 90,
        "up": {"status": 15, "eval": 5},
        "down": {"finish": 90},
        "meter": {"up": 220, "down": 490},
        "unattributed": {"up": 0, "down": 0},
    }


def test_bytes_neither_the_rows_nor_the_device_account_for_are_reported(tmp_path: Path) -> None:
    out = _run_dir(tmp_path, wire_down=400 + 90 + 7)
    assert attribute(out)["per_client"]["c0"]["unattributed"] == {"up": 0, "down": 7}


def test_nothing_is_written_without_a_device_ledger(tmp_path: Path) -> None:
    out = _run_dir(tmp_path, wire_down=490)
    wire = json.loads((out / "clients" / "c0" / "wire.json").read_text())
    del wire["run_level"]  # a daemon from before the ledger
    (out / "clients" / "c0" / "wire.json").write_text(json.dumps(wire))
    before = (out / "metrics.jsonl").read_text()
    assert attribute(out) is None
    assert (out / "metrics.jsonl").read_text() == before
