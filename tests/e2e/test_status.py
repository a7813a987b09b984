"""``fcl status`` against a real Mosquitto holding retained statuses and a real round frame."""

from __future__ import annotations

import io
import json
import time

import paho.mqtt.client as mqtt
import pytest
from conftest import run_fcl
from support.timescale import scaled

from fcl_edge.cli import main
from fcl_edge.status import build_views, read_round, read_status
from fclcore import topics
from fclcore.codec import Frame, Header, Kind, encode
from fclcore.config import to_dict
from fclcore.exitcodes import ExitCode
from fclcore.schema import FederationSpec, ModelSpec
from methods import strategy_for

FED = "fleet"
NOW = time.time()
CLIENTS = {  # what three daemons left behind: a busy one, a cleanly stopped one, a dead one
    "cam-0": {
        "state": "online",
        "time": NOW - 5,
        "role": "client",
        "task": 1,
        "round": 6,
        "bytes_up": 123456,
        "bytes_down": 654321,
        "future_field": [1, 2],
    },
    "cam-1": {
        "state": "stopped",
        "time": NOW - 600,
        "role": "client",
        "task": 0,
        "round": 4,
        "bytes_up": 1000,
        "bytes_down": 2000,
    },
    "cam-2": {"state": "dead", "time": NOW - 7200},  # the last-will: no task, round or bytes
}


def announcement(rnd: int = 7, task: int = 1, kind: Kind = Kind.ROUND, sequence: int = 9, fed_name: str = FED) -> bytes:
    """Built the way AggregatorService._announce builds it: header, meta, the global model."""
    fed = FederationSpec(
        name=fed_name, method="fedavg", num_tasks=2, rounds_per_task=5, model=ModelSpec(hidden_sizes=[8])
    )
    strategy = strategy_for(fed, 16)
    meta = {
        "federation": to_dict(fed),
        "input_dim": 16,
        "total_rounds": fed.total_rounds,
        "attempt": 2,
        "knowledge": False,
    }
    header = Header(kind, fed_name, rnd, task, topics.AGGREGATOR_ID, sequence)
    return encode(Frame(header, meta, strategy.initial_model()))


def publish_retained(url: str, messages: dict[str, bytes]) -> None:
    host, port = url.removeprefix("mqtt://").split(":")
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="test-fleet", protocol=mqtt.MQTTv311)
    client.connect(host, int(port))
    client.loop_start()
    try:
        infos = [client.publish(topic, payload, qos=1, retain=True) for topic, payload in messages.items()]
        for info in infos:
            info.wait_for_publish(10)
    finally:
        client.disconnect()
        client.loop_stop()


def fleet_messages() -> dict[str, bytes]:
    msgs = {topics.status_topic(FED, cid): json.dumps(s).encode() for cid, s in CLIENTS.items()}
    msgs[topics.status_topic(FED, "cam-3")] = b"\xff\x00 not json {"  # garbage must not crash it
    msgs[topics.status_topic(FED, topics.AGGREGATOR_ID)] = json.dumps(
        {"state": "online", "time": NOW, "role": "aggregator", "round": 7, "task": 1}
    ).encode()
    msgs[topics.round_topic(FED)] = announcement()
    return msgs


# docs/protocol.md P-10.3
def test_fcl_status_json_against_a_live_broker(mosquitto):
    publish_retained(mosquitto.url, fleet_messages())
    started = time.monotonic()
    result = run_fcl("status", "--broker", mosquitto.url, "--json", "--wait", "0.5", timeout=scaled(60))
    assert result.returncode == 0, result.stderr
    assert time.monotonic() - started < 30
    report = json.loads(result.stdout)
    view = report["federations"][FED]
    clients = view["clients"]
    assert set(clients) == {"cam-0", "cam-1", "cam-2", "cam-3"}
    assert {k: clients["cam-0"][k] for k in ("state", "task", "round", "bytes_up", "bytes_down")} == {
        "state": "online",
        "task": 1,
        "round": 6,
        "bytes_up": 123456,
        "bytes_down": 654321,
    }
    assert clients["cam-0"]["last_seen"] == pytest.approx(NOW - 5, abs=0.01)
    assert clients["cam-1"]["state"] == "stopped" and clients["cam-1"]["round"] == 4
    assert clients["cam-2"] == {
        **clients["cam-2"],
        "state": "dead",
        "task": None,
        "round": None,
        "bytes_up": None,
        "last_seen": None,
    }
    assert clients["cam-3"]["state"] == "?" and clients["cam-3"]["problem"]
    assert any(p.startswith("cam-3:") for p in view["problems"])
    assert view["online"] == 1
    assert view["aggregator"]["state"] == "online"
    assert view["round"] == {
        "kind": "round",
        "round": 7,
        "task": 1,
        "total_rounds": 10,
        "attempt": 2,
        "method": "fedavg",
        "sequence": 9,
    }


def test_fcl_status_table_and_federation_filter(mosquitto, capsys):
    msgs = fleet_messages()
    msgs[topics.status_topic("other", "x-0")] = json.dumps({"state": "online", "time": NOW}).encode()
    publish_retained(mosquitto.url, msgs)
    assert main(["status", "--broker", mosquitto.url, "--wait", "0.3"]) == 0
    table = capsys.readouterr().out
    assert "federation fleet: aggregator online; round 7/10 in progress, task 1 (attempt 2, fedavg)" in table
    assert "1/4 clients online" in table and "federation other" in table
    row = next(line for line in table.splitlines() if line.strip().startswith("cam-0"))
    assert row.split()[:6] == ["cam-0", "online", "1", "6", "123,456", "654,321"]
    dead = next(line for line in table.splitlines() if line.strip().startswith("cam-2"))
    assert dead.split() == ["cam-2", "dead", "?", "?", "?", "?", "?"]
    assert "note: cam-3:" in table
    assert main(["status", "--broker", mosquitto.url, "--wait", "0.3", "--federation", "other", "--json"]) == 0
    assert list(json.loads(capsys.readouterr().out)["federations"]) == ["other"]


def test_empty_broker(mosquitto, capsys):
    assert main(["status", "--broker", mosquitto.url, "--wait", "0.2"]) == 0
    assert "no fcl federations" in capsys.readouterr().out


def test_unreachable_broker_and_bad_input(capsys):
    from support.mosquitto import free_port

    url = f"mqtt://127.0.0.1:{free_port()}"
    assert main(["status", "--broker", url, "--connect-timeout", "1"]) == ExitCode.BROKER_UNREACHABLE
    assert "could not connect" in capsys.readouterr().err
    assert main(["status", "--broker", "http://x"]) == ExitCode.BAD_INPUT
    assert main(["status", "--broker", url, "--federation", "a/#"]) == ExitCode.BAD_INPUT


@pytest.mark.parametrize(
    "payload, state, problem",
    [
        (
            b'{"state": "online", "time": 1.5, "task": "3", "round": -1, "bytes_up": true, "bytes_down": 1e400}',
            "online",
            False,
        ),
        (b'{"state": 7}', "?", True),
        (b'{"state": "' + b"x" * 100 + b'"}', "?", True),
        (b'{"state": "on\\nline"}', "?", True),
        (b"[1, 2]", "?", True),
        (b"", "?", True),
        (b'{"a":' * 10_000, "?", True),  # deeply nested: json raises RecursionError, which must not escape
        (b'{"state": "online"}' + b" " * 70_000, "?", True),
    ],
)
# docs/protocol.md P-10.1
def test_read_status_never_raises(payload, state, problem):
    status = read_status("dev", payload)
    assert status.state == state and (status.problem is not None) == problem
    if state == "online":
        assert (status.task, status.round, status.bytes_up, status.bytes_down) == (None, None, None, None)
        assert status.status_time == 1.5


def test_read_round_rejects_what_is_not_this_federations_announcement():
    assert read_round(FED, announcement(kind=Kind.FINISH, rnd=10)).kind == "finish"
    assert "not a frame" in read_round(FED, b"garbage")
    assert "frame from" in read_round(FED, announcement(fed_name="elsewhere"))
    assert "UPDATE" in read_round(FED, encode(Frame(Header(Kind.UPDATE, FED, 1, 0, topics.AGGREGATOR_ID, 1))))
    request = encode(Frame(Header(Kind.REQUEST, FED, 7, 1, topics.AGGREGATOR_ID, 10), {"missing": ["cam-1"]}))
    assert read_round(FED, request) is None  # the aggregator asking for a re-send: not a problem
    views = build_views([(topics.round_topic(FED), announcement()), (topics.round_topic(FED), request)])
    assert views[FED].round.round == 7 and views[FED].problems == []


def test_build_views_keeps_the_newest_round_and_skips_foreign_topics():
    views = build_views(
        [
            (topics.round_topic(FED), announcement(rnd=3, sequence=5)),
            (topics.round_topic(FED), announcement(rnd=2, sequence=4)),  # an older retained copy
            ("fcl/a+b/status/x", b'{"state": "online"}'),
            ("other/fleet/status/x", b'{"state": "online"}'),
            (topics.status_topic(FED, "cam-0"), b""),  # a cleared retained message
        ]
    )
    assert list(views) == [FED]
    assert views[FED].round.round == 3 and views[FED].clients == {}


def test_table_shows_question_marks_for_unknowns():
    from fcl_edge.status import print_table

    views = build_views([(topics.status_topic(FED, "dev"), b'{"state": "online"}')])
    out = io.StringIO()
    print_table(views, NOW, out)
    assert out.getvalue().splitlines()[-1].split() == ["dev", "online", "?", "?", "?", "?", "?"]
    assert "aggregator no status; no round announced; 1/1 clients online" in out.getvalue()


@pytest.mark.parametrize(
    "expected, shown",
    [
        (["dev-0", "dev-1", "dev-2"], "2/3 clients online"),
        (["dev-0", "dev-1"], "2/2 clients online"),
        (["dev-0", "a/b"], "2/2 clients online"),  # not a list of ids: ignored, not trusted
    ],
)
def test_devices_the_aggregator_expects_without_a_status_show_as_absent(expected, shown):
    from fcl_edge.status import print_table

    aggregator = json.dumps({"state": "online", "role": "aggregator", "expected": expected}).encode()
    views = build_views(
        [(topics.status_topic(FED, topics.AGGREGATOR_ID), aggregator)]
        + [(topics.status_topic(FED, f"dev-{i}"), b'{"state": "online"}') for i in range(2)]
    )
    out = io.StringIO()
    print_table(views, NOW, out)
    assert shown in out.getvalue()
    absent = {who for who, s in views[FED].clients.items() if s.state == "absent"}
    assert absent == ({"dev-2"} if "dev-2" in expected else set())


def test_fcl_status_during_and_after_a_live_run(mosquitto, tmp_path, repo_root):
    """A real aggregator and three clients (fcl simulate) on the broker while fcl status looks."""
    import subprocess
    import sys

    with open(tmp_path / "simulate.log", "w") as log:
        run = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "fcl_edge.cli",
                "simulate",
                str(repo_root / "configs/scenarios/quickstart.yaml"),
                "--out",
                str(tmp_path / "run"),
                "--broker",
                mosquitto.url,
                "--set",
                "federation.rounds_per_task=8",  # a window long enough to poll on a busy machine
                "--set",
                "compare=[]",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=tmp_path,
        )
    try:
        during = None
        deadline = time.monotonic() + 120
        while during is None and time.monotonic() < deadline and run.poll() is None:
            seen = run_fcl("status", "--broker", mosquitto.url, "--json", "--wait", "0.3", timeout=scaled(60))
            view = json.loads(seen.stdout)["federations"].get("quickstart")
            if view and view["round"] and view["round"]["kind"] == "round" and view["online"] == 3:
                during = view
        assert during is not None, "never saw a round in progress with 3 clients online"
        assert during["aggregator"]["state"] == "online" and during["round"]["total_rounds"] == 16
        assert sorted(during["clients"]) == ["client-0", "client-1", "client-2"]
        assert run.wait(180) == 0, (tmp_path / "simulate.log").read_text()[-3000:]
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    after = json.loads(run_fcl("status", "--broker", mosquitto.url, "--json", "--wait", "0.3").stdout)
    view = after["federations"]["quickstart"]
    assert view["round"]["kind"] == "finish" and view["aggregator"]["state"] == "stopped"
    assert {c["state"] for c in view["clients"].values()} == {"stopped"} and view["online"] == 0
