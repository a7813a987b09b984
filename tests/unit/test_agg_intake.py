"""The aggregator's intake alone, without a broker or a service: messages put on its queue are
checked, folded into the round's running sum and journaled once; what it rejects leaves no
trace; a restart's replay of the journal gives the same model; statuses move the client set."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
from support.agg_parts import FED, RecordingLink, federation

from aggregator.clients import ClientSet
from aggregator.inbox import Inbox
from aggregator.intake import Intake
from aggregator.metrics import AggregatorMetrics
from aggregator.partial import Sites
from aggregator.report import RunReport
from aggregator.runlog import RunLog
from aggregator.state import StateStore
from fclcore import topics
from fclcore.codec import CodecLimits, Frame, Header, Kind, encode
from fclcore.strategy import Update

CLIENTS = ["c0", "c1"]
SEQUENCE = itertools.count(1)  # a device's counter (docs/protocol.md, P-SEQ-1)


def _intake(tmp_path: Path) -> Intake:
    fed, strategy = federation()
    clients = ClientSet(CLIENTS)
    inbox = Inbox(FED, clients, strategy.normalize, fed.num_tasks)
    runlog = RunLog(tmp_path / "out")
    metrics = AggregatorMetrics(FED)
    report = RunReport(strategy, runlog, metrics, RecordingLink(), fed, CodecLimits())
    sites = Sites([], strategy, fed.method)
    return Intake(FED, strategy, clients, inbox, sites, StateStore(tmp_path / "state"), runlog, metrics, report)


@pytest.fixture
def intake(tmp_path: Path):
    part = _intake(tmp_path)
    yield part
    part.runlog.close()


def _update(model: dict, client: str, n_samples: int, shift: float) -> bytes:
    tensors = {k: (v + shift).astype(np.float32) for k, v in model.items()}
    header = Header(Kind.UPDATE, FED, 0, 0, client, next(SEQUENCE))
    return encode(Frame(header, {"n_samples": n_samples}, tensors))


def _take_all(intake: Intake, model: dict) -> dict[str, Update]:
    received: dict[str, Update] = {}
    while not intake.queue.empty():
        intake.drain(0, received, 0, model)
    return received


def test_updates_are_folded_once_journaled_and_closed_to_their_weighted_mean(intake) -> None:
    model = intake.strategy.initial_model()
    for client, n, shift in (("c0", 1, 0.5), ("c1", 3, -0.25)):
        payload = _update(model, client, n, shift)
        intake.put(topics.update_topic(FED, client), payload, len(payload) + 20)
    received = _take_all(intake, model)
    assert set(received) == set(CLIENTS)
    assert intake.round_sum is not None and intake.round_sum[2] == set(CLIENTS)
    assert [client for client, _, _ in intake.store.journaled(0)] == CLIENTS
    assert intake.report.update_span is not None
    closed = intake.close(0, received, model)
    for name, value in model.items():
        np.testing.assert_allclose(closed[name], value + (1 * 0.5 + 3 * -0.25) / 4, rtol=1e-6, atol=1e-6)
    assert intake.round_sum is None


def test_a_replayed_journal_rebuilds_the_same_model(tmp_path: Path, intake) -> None:
    model = intake.strategy.initial_model()
    for client, n, shift in (("c0", 2, 0.1), ("c1", 5, 0.3)):
        payload = _update(model, client, n, shift)
        intake.put(topics.update_topic(FED, client), payload, len(payload))
    expected = intake.close(0, _take_all(intake, model), model)
    intake.store.close()
    restarted = _intake(tmp_path)  # the same state directory, a new process's parts
    replayed = restarted.replay(0, model)
    assert set(replayed) == set(CLIENTS)
    assert len(restarted.store.journaled(0)) == 2  # replaying journals nothing again
    closed = restarted.close(0, replayed, model)
    for name in model:
        np.testing.assert_array_equal(closed[name], expected[name])
    restarted.runlog.close()


def test_a_rejected_update_leaves_no_trace(intake) -> None:
    model = intake.strategy.initial_model()
    payload = _update(model, "intruder", 1, 0.0)
    intake.put(topics.update_topic(FED, "intruder"), payload, len(payload))
    wrong_round = _update(model, "c0", 1, 0.0)
    intake.put(topics.update_topic(FED, "c0"), wrong_round, len(wrong_round))
    received: dict[str, Update] = {}
    intake.drain(0, received, 0, model)
    intake.drain(1, received, 0, model)  # round 1 is open: c0's update of round 0 is late
    assert received == {} and intake.round_sum is None and intake.store.journaled(0) == []
    assert intake.inbox.last_seq == {}
    assert set(intake.runlog.rejections) == {"unknown-client", "late"}


def test_statuses_move_clients_online_and_offline(intake) -> None:
    model = intake.strategy.initial_model()
    status = topics.status_topic(FED, "c0")
    intake.put(status, json.dumps({"state": "online", "time": 1.0}).encode(), 0)
    intake.drain(0, {}, 0, model)
    assert intake.clients.online == {"c0"}
    intake.put(status, json.dumps({"state": "dead", "time": 2.0}).encode(), 0)
    intake.put(status, b"not json", 0)
    intake.drain(0, {}, 0, model)
    intake.drain(0, {}, 0, model)
    assert intake.clients.online == set() and dict(intake.runlog.rejections) == {"status": 1}
