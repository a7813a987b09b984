"""``fcl status --device``: one device's facts from its retained status payload, checked value by
value (the payload comes from the network), and printed."""

from __future__ import annotations

import io
import json

import pytest

from fcl_edge.device_view import device_facts, print_device

HEALTH = {
    "rss_mb": 200.5,
    "peak_mb": 256.0,
    "budget_mb": 1024.0,
    "cpu_s": 1.5,
    "resyncs": 2,
    "up": {"update": 90_000, "status": 1_200},
    "down": {"round": 70_000},
    "daemon": "0.1.0",
}


def _payload(**fields: object) -> bytes:
    return json.dumps({"state": "online", "time": 1_700_000_000.0, **fields}).encode()


def test_a_devices_status_is_shown_with_its_health_and_unknown_fields() -> None:
    payload = _payload(role="client", task=1, round=7, bytes_up=91_200, bytes_down=70_000, health=HEALTH,
                       future_field=3, last_rejection={"reason": "late", "round": 6})  # fmt: skip
    facts = device_facts(payload)
    assert facts["health"]["peak_mb"] == 256.0 and facts["health"]["up"] == HEALTH["up"]
    assert facts["other"] == {"future_field": 3, "last_rejection": '{"reason":"late","round":6}'}
    out = io.StringIO()
    print_device("d0", "home", facts, 1_700_000_010.0, out)
    text = out.getvalue()
    assert text.splitlines()[0] == "d0 of home: online, task 1, round 7, last seen 10 s ago"
    assert "memory: peak 256.0 MiB of a 1024.0 MiB budget (25%), now 200.5 MiB" in text
    assert "CPU of its last round: 1.5 s; resyncs: 2" in text
    assert "bytes up: 91,200 (status 1,200, update 90,000)" in text and "bytes down: 70,000 (round 70,000)" in text
    assert (
        "daemon 0.1.0" in text and "future_field: 3" in text and 'last_rejection: {"reason":"late","round":6}' in text
    )


@pytest.mark.parametrize(
    "payload",
    [
        b"not json",
        _payload(health="x"),
        _payload(health={"peak_mb": "1", "budget_mb": float("inf"), "up": {"a": -1, "b": True}, "daemon": "\x1b[2J"}),
        _payload(health={"up": {str(i): i for i in range(100)}}, **{"\x00": 1, "k" * 100: 2}),
    ],
)
def test_a_malformed_status_prints_question_marks_never_raises(payload: bytes) -> None:
    facts = device_facts(payload)
    out = io.StringIO()
    print_device("d0", "home", facts, 1_700_000_010.0, out)
    assert "memory: peak ? MiB" in out.getvalue() and "\x1b" not in out.getvalue()
    assert facts["health"]["up"] == {} and set(facts["other"]) <= {"time"}
