"""Membership schedules (``fclcore.membership``): presets, validation, the aggregator's roster
per task, the fleet matrix of the run log, and ``fcl simulate``'s expansion of a preset."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from aggregator.clients import ClientSet
from aggregator.runlog import RunLog
from edge_client.frames import ClientFrames
from fclcore.codec import CodecLimits, Frame, Header, Kind
from fclcore.errors import ConfigError
from fclcore.membership import Membership, preset

C4 = ["c1", "c2", "c3", "c4"]
QUICKSTART = Path(__file__).resolve().parents[2] / "configs/scenarios/quickstart.yaml"


@pytest.mark.parametrize(
    "name, expected",
    [
        ("fully", ["* * * *"] * 4),
        ("decreasing", ["* o o o", "* * o o", "* * * o", "* * * *"]),
        ("increasing", ["* * * *", "x * * *", "x x * *", "x x x *"]),
        ("scattered", ["* o o o", "x * o o", "x x * o", "x x x *"]),
    ],
)
def test_presets_for_four_clients_and_four_tasks(name: str, expected: list[str]) -> None:
    table = preset(name, C4, 4)
    assert table == dict(zip(C4, expected))
    Membership(table, 4, C4)  # every preset of this size validates


def test_presets_of_other_sizes_use_the_slot_rule() -> None:
    clients = [f"c{i}" for i in range(4)]
    assert preset("scattered", clients, 3) == {"c0": "* o o", "c1": "* o o", "c2": "x * o", "c3": "x x *"}
    assert preset("increasing", clients[:2], 2) == {"c0": "* *", "c1": "x *"}
    with pytest.raises(ValueError, match="task 1 has no active client"):  # fewer clients than tasks
        Membership(preset("scattered", clients[:2], 4), 4, clients[:2])
    with pytest.raises(ValueError, match="unknown preset 'sometimes'"):
        preset("sometimes", clients, 2)


def test_the_table_answers_per_client_and_task() -> None:
    m = Membership({"a": "* * o", "b": "x * *", "c": "* * *"}, 3)
    assert [m.state("a", t) for t in range(3)] == ["*", "*", "o"]
    assert m.active(0) == ["a", "c"] and m.active(1) == ["a", "b", "c"] and m.active(2) == ["b", "c"]
    assert (m.first_task("a"), m.first_task("b"), m.first_task("unlisted")) == (0, 1, 0)
    assert (m.retired_from("a"), m.retired_from("b"), m.retired_from("unlisted")) == (2, None, None)
    assert m.listed("b") and not m.listed("unlisted")
    assert m.state("unlisted", 2) == "*"  # a client not listed is always active
    assert m.table() == {"a": "* * o", "b": "x * *", "c": "* * *"}
    assert Membership.of(SimpleNamespace(membership=None, num_tasks=3)) is None


@pytest.mark.parametrize(
    "table, clients, message",
    [
        ({"a": "* *", "b": "* * *"}, None, r"client 'b': expected 2 symbols \(one per task\), got 3 in '\* \* \*'"),
        ({"a": "* ?"}, None, r"client 'a', task 1: unknown symbol '\?'"),
        ({"a": "* x"}, None, r"client 'a', task 1: '\*' -> 'x' goes back"),
        ({"a": "o *"}, None, r"client 'a', task 1: 'o' -> '\*' goes back"),
        ({"a": "* *", "b": "x o"}, None, r"client 'b': never active"),
        ({"a": "x *"}, None, r"task 0 has no active client"),
        ({"a": "* o", "b": "* o"}, None, r"task 1 has no active client"),
        ({"a": "* *", "z": "* *"}, ["a"], r"client 'z' is not a client of the federation"),
        ({"a": "* *"}, ["a", "b"], r"client 'b' has no schedule"),
        ({}, None, r"expected a mapping client id -> schedule"),
        ({"a/b": "* *"}, None, r"client id: expected 1-64 characters"),
        ({"a": 3}, None, r"client 'a': expected a string of 2 symbols"),
    ],
)
def test_every_validation_error_is_one_line_naming_what_is_wrong(table, clients, message) -> None:
    with pytest.raises(ValueError, match=message) as info:
        Membership(table, 2, clients)
    assert str(info.value).startswith("membership: ") and "\n" not in str(info.value)


# -- the aggregator's client set -------------------------------------------------------------
def scattered_set(**kwargs) -> ClientSet:
    return ClientSet(C4, membership=Membership(preset("scattered", C4, 4), 4, C4), **kwargs)


def test_each_round_runs_with_the_clients_active_in_its_task() -> None:
    clients = scattered_set()
    assert clients.open_round(0, 0) == ["c1"] and clients.changes == []
    assert clients.roster(0) == ["c1"] and clients.roster() == C4  # enrolled: all, until one retires
    assert clients.open_round(1, 1) == ["c2"]
    assert clients.changes == [("c1", "retired"), ("c2", "enrolled")]
    assert clients.open_round(2, 1) == ["c2"] and clients.changes == []  # each change is reported once
    assert clients.open_round(3, 2) == ["c3"] and clients.changes == [("c2", "retired"), ("c3", "enrolled")]
    assert "c1" not in clients and "c2" not in clients and clients.retired == ["c1", "c2"]
    assert clients.open_round(4, 3) == ["c4"] and clients.roster(3) == ["c4"]


def test_a_retired_client_never_enrolls_again() -> None:
    clients = scattered_set(open_enrollment=True)
    for c in C4:
        clients.on_status(c, "online")
    clients.open_round(0, 0)
    clients.open_round(1, 1)
    clients.on_status("c1", "retired")  # its final status: offline
    assert "c1" not in clients.online
    clients.on_status("c1", "online")  # a later "online" (a restart) does not bring it back
    assert clients.open_round(2, 1) == ["c2"] and "c1" not in clients and "c1" not in clients.waiting
    clients.on_status("new", "online")  # open enrollment still works for devices not in the table
    assert clients.open_round(3, 2) == ["c3", "new"]


def test_a_late_client_is_not_counted_missing_before_its_task() -> None:
    clients = scattered_set(drop_after_missed=1)
    roster = clients.open_round(0, 0)
    assert clients.close_round(roster, replied=["c1"]) == [] and "c4" in clients


def test_the_set_round_trips_through_its_state() -> None:
    clients = scattered_set()
    clients.open_round(0, 0)
    clients.open_round(1, 1)
    state = json.loads(json.dumps(clients.state()))
    assert state["retired"] == ["c1"] and state["activated"] == ["c2"]
    again = scattered_set()
    again.restore(state)
    assert again.state() == clients.state()
    assert again.open_round(2, 1) == ["c2"] and again.changes == []  # not retired or enrolled twice
    old = {k: v for k, v in state.items() if k not in ("retired", "activated")}  # before membership
    older = scattered_set()
    older.restore(old)
    assert older.retired == [] and older.activated == []


# -- the run log's fleet matrix ------------------------------------------------------------
def evaluation(rnd: int, task: int, values: list[float]) -> dict:
    return {"round": rnd, "task": task, "nll": values}


def test_the_fleet_matrix_averages_whoever_reported_at_each_task_end(tmp_path: Path) -> None:
    log = RunLog(tmp_path)
    log.evaluation("c1", evaluation(1, 0, [10.0]))
    log.evaluation("c2", evaluation(1, 0, [20.0]))  # enrolled late: its first report is of task 0's end
    log.evaluation("c2", evaluation(5, 2, [12.0, 14.0, 16.0]))
    log.evaluation("c1", evaluation(2, 1, [99.0, 99.0]))  # not a task end: not in the matrix
    out = log.summary(
        method="fedavg",
        federation="f",
        clients=["c1", "c2"],
        tasks=3,
        rounds=6,
        rounds_per_task=2,
        task_ends=[1, 3, 5],
    )
    log.close()
    fleet = out["fleet"]
    assert fleet["nll_matrix"] == [[15.0, None, None], [None, None, None], [12.0, 14.0, 16.0]]
    assert fleet["clients_per_task"] == [2, 0, 1]
    assert fleet["avg_nll"] == 14.0 and fleet["new_nll"] == [15.0, None, 16.0]
    assert out["final"] == {"per_client": {}}  # nobody reported at every task end
    assert json.loads((tmp_path / "summary.json").read_text())["fleet"] == fleet


def test_no_report_at_all_gives_no_fleet(tmp_path: Path) -> None:
    log = RunLog(tmp_path)
    out = log.summary(
        method="fedavg", federation="f", clients=["c1"], tasks=1, rounds=1, rounds_per_task=1, task_ends=[0]
    )
    log.close()
    assert out["fleet"] is None


# -- the device: which announced frames it waits for -----------------------------------------
def round_frame(client_frames: object, task: int = 1, rnd: int = 4) -> Frame:
    header = Header(Kind.ROUND, "fed", rnd, task, "aggregator", 1)
    return Frame(header, {"client_frames": client_frames}, {})


def test_a_device_waits_for_its_own_frame_only_when_the_round_names_it() -> None:
    frames = ClientFrames("dev-1", "own", "own/full", store=None, link=None, limits=CodecLimits())
    task, done_round = 0, 3  # the device is in task 0, round 3 done
    assert frames.wanted(round_frame(True), task, done_round)
    assert frames.wanted(round_frame(["dev-0", "dev-1"]), task, done_round)
    assert not frames.wanted(round_frame(["dev-0"]), task, done_round)
    assert not frames.wanted(round_frame(False), task, done_round)
    frames.raw[1] = b"frame"  # here already (kept raw)
    assert not frames.wanted(round_frame(["dev-1"]), task, done_round)


# -- fcl simulate: a preset becomes the federation's table ---------------------------------------
SMALL = ["clients=4", "tasks.shared=[[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]"]


def sets(*overrides: str) -> list[str]:
    return [*SMALL, *overrides]


def test_simulate_expands_a_preset_for_its_client_ids(tmp_path: Path) -> None:
    from fcl_edge.simulate import _late_starts, plan, write_configs

    p = plan(str(QUICKSTART), sets("membership=scattered", "allow_embedding_upload=true"))
    assert p.scenario.membership is None  # the scenario keeps only the table
    assert p.scenario.federation.membership == {
        "client-0": "* o o",
        "client-1": "* o o",
        "client-2": "x * o",
        "client-3": "x x *",
    }
    rpt = p.scenario.federation.rounds_per_task
    assert _late_starts(p) == {"client-2": rpt - 1, "client-3": 2 * rpt - 1}
    written = write_configs(p, tmp_path, "mqtt://127.0.0.1:1883")
    client = yaml.safe_load(written["client-0"][1].read_text())
    aggregator = yaml.safe_load(written["aggregator"][1].read_text())
    assert client["allow_embedding_upload"] is True
    assert aggregator["federation"]["membership"]["client-3"] == "x x *"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["membership=fully", "federation.membership={client-0: '* * *'}"],
            "membership: expected a preset or federation.membership, not both",
        ),
        (["membership=often"], "membership: unknown preset 'often'"),
        (
            ["clients=2", "membership=scattered"],
            "membership: preset 'scattered' for 2 clients and 3 tasks: task 2 has no active client",
        ),
        (
            ["federation.membership={client-0: '* * *', client-1: '* *', client-2: '* * *', client-3: '* * *'}"],
            "federation.membership: client 'client-1': expected 3 symbols",
        ),
        (
            ["federation.membership={client-0: '* * *'}"],
            "federation.membership: client 'client-1' has no schedule",
        ),
    ],
)
def test_simulate_rejects_a_bad_membership_naming_the_scenario(overrides: list[str], message: str) -> None:
    from fcl_edge.simulate import plan

    with pytest.raises(ConfigError) as info:
        plan(str(QUICKSTART), sets(*overrides))
    assert str(info.value).startswith(f"{QUICKSTART}: ") and message in str(info.value), str(info.value)


@pytest.mark.e2e  # a whole federation, in process
def test_simulate_in_process_starts_late_devices_when_their_task_comes(tmp_path: Path, monkeypatch) -> None:
    from aggregator.intake import Intake
    from fcl_edge.simulate import simulate

    metas: list[dict] = []
    accept = Intake.accept
    monkeypatch.setattr(
        Intake, "accept", lambda self, u, *a, **k: metas.append(u.frame.meta) or accept(self, u, *a, **k)
    )
    overrides = sets(
        "membership=increasing", "allow_embedding_upload=true", "federation.rounds_per_task=2", "compare=[]"
    )
    assert simulate(str(QUICKSTART), str(tmp_path), overrides=overrides, in_process=True) == 0
    events = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    first = {}
    for e in events:
        if e["event"] == "round_client" and e["status"] == "accepted":
            first.setdefault(e["client"], e["task"])
    assert first == {"client-0": 0, "client-1": 0, "client-2": 1, "client-3": 2}  # slots 0, 0, 1, 2
    enrolled = [(e["client"], e["task"]) for e in events if e["event"] == "membership"]
    assert enrolled == [("client-2", 1), ("client-3", 2)]
    updates = [m for m in metas if "n_samples" in m]
    assert updates and all(m.get("allow_embedding_upload") is True for m in updates)
    summary = json.loads((tmp_path / "summary.json").read_text())
    # client-2's first report is of task 0's end (the model it received); client-3's of task 1's
    assert set(summary["final"]["per_client"]) == {"client-0", "client-1", "client-2"}
    assert summary["fleet"]["clients_per_task"] == [3, 4, 4]
