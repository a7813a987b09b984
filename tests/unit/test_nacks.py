"""NACKs without a broker: what the aggregator's ``Nacks`` publishes for a rejection and how
its token buckets hold a flood back; what the intake answers with one; how the device reads
one (garbage never crashes it, each is logged once, the last is in its status); how
``fcl status`` shows it.  Rules cited are docs/protocol.md's, "Rejections (NACK)"."""

from __future__ import annotations

import io
import json
import logging

import numpy as np
import pytest

from aggregator.inbox import Inbox, Rejection
from aggregator.nacks import GLOBAL_BURST, MAX_DETAIL, PER_DEVICE_BURST, PER_DEVICE_EVERY_S, Nacks
from edge_client.nacks import NackLog, parse_nack
from fcl_edge.status import build_views, print_table, read_status
from fclcore import topics
from fclcore.codec import SPOKEN, Frame, Header, Kind, encode

RUN = "0006f1c2a3b4c5d6-1a2b3c4d"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def nacks(clock: Clock | None = None) -> tuple[Nacks, list]:
    sent: list = []

    def publish(topic, payload, retain=True, tag=None):
        sent.append((topic, json.loads(payload), retain))

    return Nacks(publish, "fed", RUN, SPOKEN, clock or Clock()), sent


def _update(seq: int, n_samples: object = 3) -> bytes:
    return encode(Frame(Header(Kind.UPDATE, "fed", 0, 0, "c0", seq), {"n_samples": n_samples}, {"w": np.ones(2)}))


def test_a_nack_names_the_frame_the_reason_the_mark_and_the_versions_spoken() -> None:
    """P-NACK-1, P-NACK-2: non-retained, on the sender's own topic; round, kind, sequence of the
    dropped frame, the reason code and its text, the mark (P-SEQ-6) and the versions (P-VER-3)."""
    inbox = Inbox("fed", {"c0"}, lambda frame: dict(frame.tensors), 1)
    rejection = inbox.check("c0", _update(7, n_samples="many"), 100, 0, set())
    assert isinstance(rejection, Rejection) and rejection.reason == "content"
    out, sent = nacks()
    assert out.send(rejection, 0)
    topic, body, retain = sent[0]
    assert topic == topics.nack_topic("fed", "c0") == "fcl/fed/nack/c0" and retain is False
    assert body == {
        "nack": 1,
        "run": RUN,
        "round": 0,
        "kind": "UPDATE",
        "sequence": 7,
        "reason": "content",
        "detail": rejection.detail,
        "mark": 0,
        "open_round": 0,
        "versions": list(SPOKEN),
    }
    assert "meta.n_samples" in body["detail"]


def test_a_frame_that_did_not_decode_is_nacked_with_nulls_and_a_long_text_is_cut() -> None:
    out, sent = nacks()
    out.send(Rejection("codec", "x" * 5000, "c0"), 4)
    body = sent[0][1]
    assert (body["round"], body["kind"], body["sequence"], body["mark"]) == (None, None, None, None)
    assert len(body["detail"]) == MAX_DETAIL and body["open_round"] == 4


def test_a_flood_from_one_device_gets_a_burst_then_one_nack_per_interval() -> None:
    """P-NACK-3: per device, PER_DEVICE_BURST at once, then one per PER_DEVICE_EVERY_S."""
    clock = Clock()
    out, sent = nacks(clock)
    garbage = Rejection("codec", "checksum", "c0")
    assert [out.send(garbage, 0) for _ in range(50)].count(True) == PER_DEVICE_BURST
    assert out.send(Rejection("codec", "checksum", "c1"), 0)  # another device has its own bucket
    clock.now += PER_DEVICE_EVERY_S / 2
    assert not out.send(garbage, 0)
    clock.now += PER_DEVICE_EVERY_S / 2
    assert out.send(garbage, 0) and not out.send(garbage, 0)
    assert out.sent == len(sent) == PER_DEVICE_BURST + 2 and out.suppressed == 50 - PER_DEVICE_BURST + 2


def test_a_flood_under_many_names_is_held_by_the_shared_bucket() -> None:
    """P-NACK-3: all NACKs together, GLOBAL_BURST at once (spoofed ids cannot multiply them)."""
    out, sent = nacks()
    for i in range(GLOBAL_BURST * 3):
        out.send(Rejection("unknown-client", "not expected", f"spoof-{i}"), 0)
    assert len(sent) == GLOBAL_BURST and out.suppressed == GLOBAL_BURST * 2


def test_the_intake_nacks_dropped_frames_but_not_statuses(tmp_path) -> None:
    from support.agg_parts import FED
    from test_agg_intake import _intake

    intake = _intake(tmp_path)
    out, sent = nacks()
    intake.nacks = out
    try:
        intake.put(topics.update_topic(FED, "c0"), b"garbage", 27)
        intake.put(topics.status_topic(FED, "c0"), b"not json", 28)
        for _ in range(2):
            intake.drain(0, {}, 0, {})
    finally:
        intake.runlog.close()
    assert set(intake.runlog.rejections) == {"codec", "status"}
    assert [(t, b["reason"]) for t, b, _ in sent] == [(topics.nack_topic("fed", "c0"), "codec")]  # Nacks' own fed


class Link:
    def __init__(self) -> None:
        self.statuses: list[dict] = []

    def publish_status(self, state: str, **extra) -> None:
        self.statuses.append({"state": state, **extra})


GOOD = {"run": RUN, "round": 3, "kind": "UPDATE", "sequence": 9, "reason": "replay", "detail": "d", "mark": 12}


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xff\xfe",
        b"[]",
        b"{" * 5000,
        b'{"reason": "replay"}',  # no detail
        json.dumps({**GOOD, "reason": "two words"}).encode(),
        json.dumps({**GOOD, "round": -1}).encode(),
        json.dumps({**GOOD, "sequence": True}).encode(),
        json.dumps({**GOOD, "mark": "12"}).encode(),
        json.dumps({**GOOD, "detail": "x" * 5000}).encode(),  # over MAX_NACK_BYTES
    ],
)
def test_a_device_drops_what_is_not_a_nack(payload) -> None:
    """P-NACK-4: a NACK is input from the network: anything else is ignored, never raised."""
    assert parse_nack(payload) is None
    log = NackLog(Link())
    assert log.take(payload, RUN) is None and log.last is None


def test_a_device_logs_each_nack_once_and_shows_the_last_in_its_status(caplog) -> None:
    """P-NACK-4: logged once, however often it comes again; the last in the retained status."""
    link = Link()
    log = NackLog(link)
    payload = json.dumps({**GOOD, "detail": "sequence 9, last accepted 12\n"}).encode()
    with caplog.at_level(logging.WARNING, logger="edge_client.daemon"):
        for _ in range(3):
            assert log.take(payload, RUN)["mark"] == 12
    assert len([r for r in caplog.records if "dropped UPDATE for round 3: replay" in r.getMessage()]) == 1
    assert link.statuses[-1]["nack"] == {
        "round": 3,
        "kind": "UPDATE",
        "sequence": 9,
        "reason": "replay",
        "detail": "sequence 9, last accepted 12?",
    }
    assert log.take(json.dumps({**GOOD, "run": "0006f1c2a3b4c5d6-00000000"}).encode(), RUN) is None  # another run
    assert parse_nack(json.dumps({**GOOD, "nack": 2, "hint": {"a": 1}}).encode())["reason"] == "replay"  # P-VER-4


def test_fcl_status_shows_a_devices_last_nack() -> None:
    nack = {"round": 3, "kind": "UPDATE", "sequence": 9, "reason": "content", "detail": "meta.n_samples: expected"}
    status = json.dumps({"state": "online", "time": 1.0, "role": "client", "nack": nack}).encode()
    assert read_status("c0", status).nack == "UPDATE round 3 dropped: content: meta.n_samples: expected"
    garbage = json.dumps({"state": "online", "nack": {"reason": ["x"]}}).encode()
    assert read_status("c1", garbage).nack is None
    out = io.StringIO()
    print_table(build_views([("fcl/fed/status/c0", status), ("fcl/fed/status/c1", garbage)]), 2.0, out)
    assert "last nack: c0: UPDATE round 3 dropped: content" in out.getvalue() and "c1: " not in out.getvalue()
