"""End to end over Mosquitto: ``fcl simulate`` with a membership preset (FIL-VER's scattered
enrollment).  Devices that enroll late are started by ``fcl simulate`` when their task comes
and train from it on; devices that retire stop training, leave with the retained status
"retired" and exit 0; the fleet's continual metrics cover every task end."""

from __future__ import annotations

import json
import queue
from pathlib import Path

import paho.mqtt.client as mqtt
import yaml
from conftest import run_fcl

from fclcore import topics
from fclcore.membership import Membership

FED = "quickstart"
ROUNDS_PER_TASK = 2
OVERRIDES = [
    "compare=[]",
    "clients=4",
    "tasks.shared=[[0, 1, 2], [3, 4, 5], [6, 7, 8, 9]]",
    f"federation.rounds_per_task={ROUNDS_PER_TASK}",
    "federation.train.local_epochs=1",
    "federation.rounds.deadline_s=40",
    "federation.rounds.resend_after_s=5",
    "membership=scattered",
]
SCATTERED = {"client-0": "* o o", "client-1": "* o o", "client-2": "x * o", "client-3": "x x *"}  # the preset's table


def retained(url_port: int, topic: str, timeout: float = 10.0) -> bytes | None:
    """The retained message on ``topic`` (None if there is none)."""
    got: queue.Queue[bytes] = queue.Queue()
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="membership-test", protocol=mqtt.MQTTv311)
    client.on_connect = lambda c, *_: c.subscribe(topic, qos=1)
    client.on_message = lambda c, u, msg: got.put(msg.payload) if msg.retain else None
    client.connect("127.0.0.1", url_port)
    client.loop_start()
    try:
        return got.get(timeout=timeout)
    except queue.Empty:
        return None
    finally:
        client.loop_stop()
        client.disconnect()


def test_late_devices_join_at_their_task_and_retired_ones_leave(mosquitto, tmp_path: Path, repo_root: Path) -> None:
    out = tmp_path / "run"
    args = [a for o in OVERRIDES for a in ("--set", o)]
    result = run_fcl(
        "simulate",
        str(repo_root / "configs/scenarios/quickstart.yaml"),
        "--out",
        str(out),
        "--broker",
        mosquitto.url,
        *args,
    )
    logs = {p.stem: p.read_text() for p in sorted((out / "logs").glob("*.log"))} if (out / "logs").exists() else {}
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n{logs}"

    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    written = yaml.safe_load((out / "scenario.yaml").read_text())["federation"]["membership"]
    assert written == SCATTERED  # the preset, expanded for client-0..3
    membership = Membership(written, 3)
    accepted: dict[str, list[tuple[int, int]]] = {}
    for e in events:
        if e["event"] == "round_client" and e["status"] == "accepted":
            accepted.setdefault(e["client"], []).append((e["round"], e["task"]))
    assert set(accepted) == {"client-0", "client-1", "client-2", "client-3"}, accepted
    for client, updates in accepted.items():
        first, retired = membership.first_task(client), membership.retired_from(client)
        assert updates[0][1] == first and min(t for _, t in updates) == first, (client, updates)
        assert retired is None or max(t for _, t in updates) < retired, (client, updates)
        assert {t for _, t in updates} == {t for t in range(3) if membership.is_active(client, t)}
    rounds = {e["round"]: e for e in events if e["event"] == "round"}
    assert [rounds[r]["expected"] for r in sorted(rounds)] == [2, 2, 1, 1, 1, 1]  # the roster per task
    assert all(e["accepted"] == e["expected"] for e in rounds.values())

    changes = {(e["client"], e["state"], e["task"]) for e in events if e["event"] == "membership"}
    assert changes == {
        ("client-0", "retired", 1),
        ("client-1", "retired", 1),
        ("client-2", "enrolled", 1),
        ("client-2", "retired", 2),
        ("client-3", "enrolled", 2),
    }
    for client in ("client-0", "client-1", "client-2"):  # they said so, then left with exit 0
        assert "retired from task" in logs[client], logs[client]
        status = retained(mosquitto.port, topics.status_topic(FED, client))
        assert status is not None and json.loads(status)["state"] == "retired", status

    fleet = summary["fleet"]
    matrix = fleet["nll_matrix"]
    assert len(matrix) == 3 and all(
        len(row) == 3 and all((v is not None) == (i <= t) for i, v in enumerate(row)) for t, row in enumerate(matrix)
    ), matrix
    assert fleet["clients_per_task"] == [1, 1, 1]  # task 0's end: client-2's first report; task 1's: client-3's
    assert fleet["avg_nll"] is not None and "fleet avg NLL" in result.stdout
