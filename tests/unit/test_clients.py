"""The live client set: enrollment, rosters, leaving after missed rounds, and its checkpoint."""

from __future__ import annotations

import json

from aggregator.clients import ClientSet


def test_closed_federation_takes_only_configured_clients() -> None:
    cs = ClientSet(["a", "b"])
    for client in ("a", "b", "intruder"):
        cs.on_status(client, "online")
    assert cs.open_round(0) == ["a", "b"] and "intruder" not in cs


def test_open_enrollment_joins_the_next_roster_in_arrival_order() -> None:
    cs = ClientSet(["a"], open_enrollment=True)
    cs.on_status("a", "online")
    assert cs.open_round(0) == ["a"]
    cs.on_status("z", "online")
    cs.on_status("m", "online")
    assert "z" not in cs  # not during the open round: from the next one
    assert cs.open_round(1) == ["a", "z", "m"] and cs.enrolled["z"] == 1
    cs.on_status("q", "online")
    cs.on_status("q", "dead")  # gone again before the round opened: not enrolled
    assert cs.open_round(2) == ["a", "z", "m"]


def test_max_clients_and_admission_check() -> None:
    cs = ClientSet(["a"], open_enrollment=True, max_clients=2, admit=lambda c: c != "nokey")
    for client in ("a", "nokey", "b", "c"):
        cs.on_status(client, "online")
    assert cs.open_round(0) == ["a", "b"]  # nokey refused, c over the limit


def test_missed_rounds_leave_and_a_returning_device_rejoins() -> None:
    cs = ClientSet(["a", "b"], drop_after_missed=2)
    cs.on_status("a", "online")
    cs.on_status("b", "online")
    roster = cs.open_round(0)
    assert cs.close_round(roster, ["a"]) == []  # b missed one
    assert cs.close_round(cs.open_round(1), ["a", "b"]) == []  # and replied: the count restarts
    cs.close_round(cs.open_round(2), ["a"])
    assert cs.close_round(cs.open_round(3), ["a"]) == ["b"] and cs.roster() == ["a"]
    cs.on_status("b", "online")  # back: a configured client enrolls again, even when closed
    assert cs.open_round(4) == ["a", "b"] and cs.enrolled["b"] == 4


def test_state_round_trips_through_json() -> None:
    cs = ClientSet(["a"], open_enrollment=True, drop_after_missed=3)
    cs.on_status("x", "online")
    cs.close_round(cs.open_round(0), ["a"])
    again = ClientSet(["a"], open_enrollment=True, drop_after_missed=3)
    again.restore(json.loads(json.dumps(cs.state())))
    assert again.roster() == cs.roster() == ["a", "x"] and again.missed == {"a": 0, "x": 1}
    fresh = ClientSet(["a", "b"])
    fresh.restore({})  # nothing committed yet: the configured clients
    assert fresh.roster() == ["a", "b"]
