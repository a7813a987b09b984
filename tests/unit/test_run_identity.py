"""Run identity and bounded sequences, message by message (issue 22; docs/security.md).

Real aggregator services build the frames (each on a fresh state directory, so each is a run
of its own) and a real client daemon acts on them over the in-process broker: every message
kind of another run is dropped and counted; a newer run is joined or refused; a FINISH that
is not the end of the device's run is dropped; a failed run ends the device with its code.
The inbox never accepts a sequence far past a device's mark, and no clock numbers a frame.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import pytest

from aggregator.inbox import SEQUENCE_WINDOW, Inbox, Rejection
from aggregator.service import AggregatorService
from edge_client.daemon import ClientDaemon
from fcl_edge.simulate import plan, write_configs
from fclcore import topics
from fclcore.codec import Frame, Header, Kind, decode, encode
from fclcore.config import load_config
from fclcore.exitcodes import ExitCode
from fclcore.inproc import InProcessBroker, link_factory
from fclcore.runid import check_run_id, is_newer, new_run_id, started_us
from fclcore.schema import AggregatorConfig, ClientConfig
from fclcore.strategy import Update

OVERRIDES = ["federation.rounds_per_task=2"]


@pytest.fixture
def fleet(tmp_path: Path, repo_root: Path):
    broker = InProcessBroker()
    (tmp_path / "run").mkdir()
    configs = write_configs(
        plan(str(repo_root / "configs/scenarios/quickstart.yaml"), OVERRIDES), tmp_path / "run", "mqtt://in-process:1"
    )
    agg = load_config(AggregatorConfig, configs["aggregator"][1])
    client = load_config(ClientConfig, configs["client-0"][1])
    yield broker, agg, client, tmp_path
    broker.stop()


def aggregator(broker, cfg: AggregatorConfig, state_dir: Path) -> tuple[AggregatorService, list]:
    """A service on a fresh state directory (a run of its own) whose publishes are recorded."""
    service = AggregatorService(dataclasses.replace(cfg, state_dir=str(state_dir)), link_factory=link_factory(broker))
    sent: list[tuple[str, bytes]] = []
    service.link.publish = lambda topic, payload, retain=False, tag=None: sent.append((topic, payload))
    time.sleep(0.002)  # run ids order by start time: the next service is a newer run
    return service, sent


def frames(service: AggregatorService, sent: list) -> dict[str, tuple[str, bytes]]:
    """One frame of every downlink kind from ``service``'s run."""
    fed, total = service.fed, service.fed.total_rounds
    service._announce(Kind.ROUND, 0, 0)
    service._announce(Kind.ROUND, 1, 0)
    service.announcer.request(Kind.UPDATE, 1, ["client-0"])
    service._announce(Kind.FINISH, total, service.schedule.task_of(total))
    service._announce(Kind.FINISH, 1, service.schedule.task_of(1), failed="round 1 missed its quorum in 1 attempts")
    service._announce(
        Kind.FINISH, total - 1, service.schedule.task_of(total - 1)
    )  # a FINISH that is not the end of the last round
    header = Header(Kind.KNOWLEDGE, fed.name, 0, 0, topics.AGGREGATOR_ID, 99)
    knowledge = encode(Frame(header, {"run": service.run_id, "for_task": 0}, {"x": np.zeros(2, np.float32)}))
    names = ["round0", "round1", "request", "finish", "failed", "early_finish"]
    announced = [m for m in sent if "/model/" not in m[0]]  # the retained sync frames are not needed here
    out = {name: announced[i] for i, name in enumerate(names)}
    out["knowledge"] = (topics.knowledge_topic(fed.name, "client-0"), knowledge)
    out["status"] = status_of(service)
    return out


def status_of(service: AggregatorService, **fields) -> tuple[str, bytes]:
    """The aggregator's retained status naming its run (what confirms a run to a device)."""
    payload = json.dumps({"state": "online", "run": service.run_id, **fields}).encode()
    return topics.status_topic(service.fed.name, topics.AGGREGATOR_ID), payload


def daemon(broker, cfg: ClientConfig, out: Path, **changes) -> ClientDaemon:
    cfg = dataclasses.replace(cfg, out_dir=str(out), state_dir=str(out / "state"), **changes)
    return ClientDaemon(cfg, link_factory=link_factory(broker))


def handle(d: ClientDaemon, message: tuple[str, bytes]) -> bool:
    return d._handle(message[0], message[1], len(message[1]))


# docs/protocol.md P-9.1
def test_run_ids_order_by_start_and_are_validated() -> None:
    a = new_run_id()
    time.sleep(0.002)
    b = new_run_id()
    assert check_run_id(a) == a and is_newer(b, a) and not is_newer(a, b)
    for bad in (None, 7, "", "zz", a.upper(), a + "0"):
        with pytest.raises(ValueError, match="run"):
            check_run_id(bad)


# docs/protocol.md P-8.1, P-9.2
def test_every_message_kind_of_an_earlier_run_is_dropped_and_counted(fleet) -> None:
    broker, agg_cfg, client_cfg, tmp = fleet
    old = frames(*aggregator(broker, agg_cfg, tmp / "agg-old"))
    current = frames(*aggregator(broker, agg_cfg, tmp / "agg-current"))
    d = daemon(broker, client_cfg, tmp / "device")
    handle(d, current["status"])
    assert handle(d, current["round0"]) is False  # a fresh device adopts the run of its first round
    run, done = d.device.run_id, d.device.done_round
    assert run == decode(current["round0"][1]).meta["run"] and done == 0
    for name in ("round1", "request", "finish", "failed", "knowledge"):
        assert handle(d, old[name]) is False, name
    assert d.stats.rejected.get("run") == 5 and d.exit_code is None
    assert d.device.run_id == run and d.device.done_round == done
    assert handle(d, current["early_finish"]) is False  # its own run, but not the end of the last round
    assert d.stats.rejected.get("finish") == 1 and d.exit_code is None
    state = d.store.load()
    assert state.run == run  # the checkpoint names the run


def test_a_fresh_device_ignores_an_earlier_runs_finish_but_ends_on_a_failure(fleet) -> None:
    broker, agg_cfg, client_cfg, tmp = fleet
    old = frames(*aggregator(broker, agg_cfg, tmp / "agg-old"))
    d = daemon(broker, client_cfg, tmp / "device")
    assert handle(d, old["finish"]) is False and d.stats.rejected == {"run": 1} and d.device.run_id is None
    assert handle(d, old["failed"]) is False and d.device.run_id is None  # held: no status names its run yet
    assert handle(d, old["status"]) is True and d.exit_code is ExitCode.FEDERATION_FAILED


@pytest.mark.parametrize("policy", ["join", "refuse"])
# docs/protocol.md P-9.2
def test_a_newer_run_is_joined_from_scratch_or_refused(fleet, policy: str) -> None:
    broker, agg_cfg, client_cfg, tmp = fleet
    first = frames(*aggregator(broker, agg_cfg, tmp / "agg-first"))
    newer = frames(*aggregator(broker, agg_cfg, tmp / "agg-newer"))
    d = daemon(broker, client_cfg, tmp / "device", on_new_run=policy)
    handle(d, first["status"])
    handle(d, first["round0"])
    handle(d, first["round1"])
    assert d.device.done_round == 1
    assert handle(d, newer["round0"]) is False  # held until the aggregator's status names the newer run
    first_run = decode(first["round0"][1]).meta["run"]
    assert d.device.run_id == first_run and d.store.load().run == first_run  # nothing of it persisted
    ended = handle(d, newer["status"])  # the held round is acted on now
    new_run = decode(newer["round0"][1]).meta["run"]
    if policy == "refuse":
        assert ended is True and d.exit_code is ExitCode.OTHER_RUN and d.device.run_id != new_run
    else:
        assert ended is False and d.device.run_id == new_run and d.device.done_round == 0 and d.exit_code is None
        assert d.store.load().run == new_run


def test_a_failed_run_ends_a_device_that_took_part(fleet) -> None:
    broker, agg_cfg, client_cfg, tmp = fleet
    run = frames(*aggregator(broker, agg_cfg, tmp / "agg"))
    d = daemon(broker, client_cfg, tmp / "device")
    handle(d, run["status"])
    handle(d, run["round0"])
    assert handle(d, run["failed"]) is True and d.exit_code is ExitCode.FEDERATION_FAILED
    assert d.store.load().done_round == 0  # its checkpoint is kept as it was


def test_device_sequences_count_from_the_runs_start_not_any_clock(fleet) -> None:
    """P-SEQ-2: a fresh device numbers its first frame of a run start(run) + 1, whatever the
    announcement's ``clock_us`` (which protocol-1 devices numbered on) says."""
    broker, agg_cfg, client_cfg, tmp = fleet
    service, sent = aggregator(broker, agg_cfg, tmp / "agg")
    service._announce(Kind.ROUND, 0, 0)
    frame = decode(sent[-1][1])  # the announcement, published after the retained sync frames
    ahead = frame.meta["clock_us"] + 3_600_000_000  # the aggregator's clock is an hour ahead of ours
    frame = Frame(frame.header, {**frame.meta, "clock_us": ahead}, frame.tensors)
    d = daemon(broker, client_cfg, tmp / "device")
    handle(d, status_of(service))  # the run is taken up once its aggregator names it
    handle(d, (sent[-1][0], encode(frame)))
    assert decode(d.uplink.unacked).header.sequence == started_us(service.run_id) + 1
    assert d.store.load().sequence == started_us(service.run_id) + 1  # checkpointed before it was sent


def test_a_device_does_not_check_the_aggregators_numbers(fleet) -> None:
    """P-SEQ-8: a downlink frame of the device's run is acted on whatever its number (here
    round 1 numbered below round 0, as by an aggregator whose counter was not committed)."""
    broker, agg_cfg, client_cfg, tmp = fleet
    run = frames(*aggregator(broker, agg_cfg, tmp / "agg"))
    d = daemon(broker, client_cfg, tmp / "device")
    handle(d, run["status"])
    handle(d, run["round0"])
    topic, payload = run["round1"]
    frame = decode(payload)
    lower = Frame(dataclasses.replace(frame.header, sequence=1), frame.meta, frame.tensors)
    handle(d, (topic, encode(lower)))
    assert d.device.done_round == 1 and d.stats.rejected == {}


@pytest.mark.parametrize("reason", ["replay", "duplicate"])
def test_a_nack_at_the_mark_renumbers_checkpoints_and_resends_the_update(fleet, reason) -> None:
    """P-SEQ-6 through the daemon: a fresh device whose first number is its mark (``duplicate``)
    or below it (``replay``) sends the update again as mark + 1, checkpointed first."""
    broker, agg_cfg, client_cfg, tmp = fleet
    service, sent = aggregator(broker, agg_cfg, tmp / "agg")
    run = frames(service, sent)
    d = daemon(broker, client_cfg, tmp / "device")
    handle(d, run["status"])
    handle(d, run["round0"])
    header = decode(d.uplink.unacked).header
    mark = header.sequence + (5 if reason == "replay" else 0)
    published: list[tuple[str, bytes]] = []
    d.link.publish = lambda topic, payload, retain=False, tag=None: published.append((topic, payload))
    nack = {"run": service.run_id, "round": 0, "kind": "UPDATE", "sequence": header.sequence, "reason": reason}
    handle(d, (d.nack_topic, json.dumps({**nack, "detail": "d", "mark": mark}).encode()))
    updates = [p for t, p in published if t == topics.update_topic(client_cfg.federation, client_cfg.client_id)]
    assert len(updates) == 1 and decode(updates[0]).header.sequence == mark + 1
    assert d.store.load().sequence == mark + 1 and d.store.load().unacked == updates[0]
    assert d.status_snapshot()["last_nack"]["reason"] == reason


def _update(seq: int) -> bytes:
    header = Header(Kind.UPDATE, "f", 0, 0, "c", seq)
    return encode(Frame(header, {"n_samples": 1}, {"w": np.ones(2, np.float32)}))


def test_the_inbox_never_accepts_a_sequence_past_its_window() -> None:
    """P-SEQ-3, P-SEQ-4: above the run's floor, at most SEQUENCE_WINDOW past the mark (or the
    floor), checked before anything else, so a forged frame moves nothing; the window slides."""
    start = 1_700_000_000_000_000
    inbox = Inbox("f", {"c"}, lambda frame: dict(frame.tensors), 1, min_seq=start - 30_000_000)
    forged = inbox.check("c", _update(start + 31 * 365 * 86400 * 10**6), 100, 0, set())
    assert isinstance(forged, Rejection) and forged.reason == "sequence" and "c" not in inbox.last_seq
    assert forged.mark == inbox.min_seq  # what the device's next number must be above (P-SEQ-6)
    edge = inbox.check("c", _update(inbox.min_seq + SEQUENCE_WINDOW + 1), 100, 0, set())
    assert isinstance(edge, Rejection) and edge.reason == "sequence"
    assert isinstance(inbox.check("c", _update(start + 1), 100, 0, set()), Update)  # the forged frame moved nothing
    later = start + 1 + SEQUENCE_WINDOW  # exactly the window past the mark: a clock-numbered device (P-SEQ-7)
    assert isinstance(inbox.check("c", _update(later), 100, 0, set()), Update)
    assert inbox.last_seq["c"] == later


# docs/protocol.md P-11.4
def test_a_device_says_when_the_aggregator_is_gone_and_keeps_waiting(fleet) -> None:
    broker, _, client_cfg, tmp = fleet
    d = daemon(broker, client_cfg, tmp / "device", aggregator_timeout_s=0.05)
    d.link.start()
    status_topic = topics.status_topic(client_cfg.federation, client_cfg.client_id)
    d.watch.on_status(b'{"state": "dead"}')  # the aggregator's last will
    d.watch.check()
    assert not d.watch.told_lost  # not yet longer than aggregator_timeout_s
    time.sleep(0.1)
    d.watch.check()
    assert d.watch.told_lost and d.exit_code is None
    assert json.loads(broker.retained(status_topic))["aggregator"] == "lost"
    d.watch.on_status(b'{"state": "online"}')
    assert not d.watch.told_lost and json.loads(broker.retained(status_topic))["aggregator"] == "online"
    d.link.close()


# docs/protocol.md P-2.5
def test_a_deleted_retained_message_is_ignored_not_counted(fleet) -> None:
    broker, agg_cfg, client_cfg, tmp = fleet
    current = frames(*aggregator(broker, agg_cfg, tmp / "agg"))
    d = daemon(broker, client_cfg, tmp / "device")
    handle(d, current["status"])
    assert handle(d, current["round0"]) is False and d.device.done_round == 0
    for topic in (current["round1"][0], current["knowledge"][0]):
        assert handle(d, (topic, b"")) is False
    assert d.stats.rejected == {} and d.device.done_round == 0 and d.exit_code is None


# -- issue 42: a run id a device never saw from its aggregator cannot replace its run ----------------
def _with_run(message: tuple[str, bytes], run: str) -> tuple[str, bytes]:
    """The same frame under another run id (a forgery: no ACL, unsigned downlink)."""
    frame = decode(message[1])
    return message[0], encode(Frame(frame.header, {**frame.meta, "run": run}, frame.tensors))


@pytest.mark.parametrize("forged_run", ["far-future", "newer-unconfirmed"])  # docs/protocol.md P-9.2
def test_a_forged_run_id_never_replaces_the_run_a_device_is_in(fleet, forged_run: str) -> None:
    broker, agg_cfg, client_cfg, tmp = fleet
    service, sent = aggregator(broker, agg_cfg, tmp / "agg")
    run = frames(service, sent)
    d = daemon(broker, client_cfg, tmp / "device")
    handle(d, run["status"])
    handle(d, run["round0"])
    genuine = d.device.run_id
    fake = "7fffffffffffffff-00000000" if forged_run == "far-future" else new_run_id()
    assert handle(d, _with_run(run["round1"], fake)) is False
    if forged_run == "far-future":  # dropped even when a forged status names it
        handle(d, (run["status"][0], json.dumps({"state": "online", "run": fake}).encode()))
        assert d.stats.rejected.get("run") == 1 and d.gate.held is None
    else:
        assert d.gate.held is not None and d.gate.held[0] == fake
    assert d.device.run_id == genuine and d.store.load().run == genuine and d.device.done_round == 0
    handle(d, run["status"])  # the genuine aggregator's status (it re-publishes it on every change)
    assert handle(d, run["round1"]) is False and d.device.done_round == 1  # the genuine run goes on
    assert d.device.run_id == genuine and d.store.load().run == genuine and d.exit_code is None


def test_a_device_that_comes_after_its_run_ended_exits_run_ended(fleet) -> None:
    """docs/protocol.md P-9.4, exit 9."""
    broker, agg_cfg, client_cfg, tmp = fleet
    run = frames(*aggregator(broker, agg_cfg, tmp / "agg"))
    d = daemon(broker, client_cfg, tmp / "device", run_over_s=0.05)
    handle(d, run["status"])
    assert handle(d, run["finish"]) is False and d.stats.rejected == {"run": 1}
    assert d._done_waiting() is False  # a new run may still come (stale retained state, say)
    time.sleep(0.1)
    assert d._done_waiting() is True and d.exit_code is ExitCode.RUN_ENDED


def test_a_device_whose_aggregator_runs_another_run_gives_up(fleet) -> None:
    """docs/protocol.md P-9.4, exit 10."""
    broker, agg_cfg, client_cfg, tmp = fleet
    old_service, old_sent = aggregator(broker, agg_cfg, tmp / "agg-old")
    old = frames(old_service, old_sent)
    current = frames(*aggregator(broker, agg_cfg, tmp / "agg-current"))
    d = daemon(broker, client_cfg, tmp / "device", run_over_s=0.05)
    handle(d, current["status"])
    handle(d, current["round0"])
    handle(d, old["status"])  # its aggregator names an earlier run, which the device cannot join
    assert d._done_waiting() is False
    time.sleep(0.1)
    assert d._done_waiting() is True and d.exit_code is ExitCode.RUN_STALLED


def test_a_device_waits_for_a_newer_runs_first_round_however_late(fleet) -> None:
    broker, agg_cfg, client_cfg, tmp = fleet
    first = frames(*aggregator(broker, agg_cfg, tmp / "agg-first"))
    newer = frames(*aggregator(broker, agg_cfg, tmp / "agg-newer"))
    d = daemon(broker, client_cfg, tmp / "device", run_over_s=0.05)
    handle(d, first["status"])
    handle(d, first["round0"])
    handle(d, newer["status"])  # a new run, still waiting for its devices: its round 0 comes later
    time.sleep(0.1)
    assert d._done_waiting() is False and d.exit_code is None


def test_the_final_evaluation_is_held_until_the_end_is_committed(fleet) -> None:
    broker, agg_cfg, client_cfg, tmp = fleet
    service, sent = aggregator(broker, agg_cfg, tmp / "agg")
    run = frames(service, sent)
    d = daemon(broker, client_cfg, tmp / "device")
    d.link.start()  # the final evaluation is delivered (the broker has it) before the device goes on
    handle(d, run["status"])
    handle(d, run["round0"])
    handle(d, run["round1"])
    assert handle(d, run["finish"]) is False and d.work.final_eval is not None
    assert d._done_waiting() is False  # the aggregator has not said the end is committed
    evals = len([t for t in d.link.meter.snapshot()["by_tag"] if t.startswith("up:eval:")])
    assert handle(d, run["finish"]) is False  # announced again by a restarted aggregator: the same frame again
    assert any(t.startswith("up:resend:eval:") for t in d.link.meter.snapshot()["by_tag"]) and evals == 1
    handle(d, status_of(service, ended=service.run_id))
    assert d._done_waiting() is True and d.exit_code is None
    d.link.close()
