"""Buffered asynchronous rounds (aggregator.buffered): the open version folds updates of recent
versions weighted n_samples / sqrt(1 + staleness), refuses older ones as "stale", closes at
``buffer_k`` updates and holds a device's second update for the next version; a journal replay
folds the same updates to the same model; a method that does not declare buffered rounds is
refused."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest
from support.agg_parts import FED, RecordingLink, federation

import methods
from aggregator.buffered import Buffer, staleness_weight
from aggregator.clients import ClientSet
from aggregator.collector import Collector
from aggregator.inbox import Inbox
from aggregator.intake import Intake
from aggregator.metrics import AggregatorMetrics
from aggregator.partial import Sites
from aggregator.report import RunReport
from aggregator.runlog import RunLog
from aggregator.state import StateStore
from fclcore import topics
from fclcore.codec import CodecLimits, Frame, Header, Kind, encode
from fclcore.config import from_dict
from fclcore.errors import ConfigError
from fclcore.schema import FederationSpec

CLIENTS = ["c0", "c1", "c2", "c3"]
OPEN = 3  # the open version in the hand-made case


def _intake(tmp_path: Path, buffer: Buffer) -> Intake:
    fed, strategy = federation(mode="buffered", buffer_k=buffer.buffer_k, max_staleness=buffer.max_staleness)
    clients = ClientSet(CLIENTS)
    inbox = Inbox(FED, clients, strategy.normalize, fed.num_tasks, buffer=buffer)
    runlog = RunLog(tmp_path / "out")
    metrics = AggregatorMetrics(FED)
    report = RunReport(strategy, runlog, metrics, RecordingLink(), fed, CodecLimits())
    sites = Sites([], strategy, fed.method)
    store = StateStore(tmp_path / "state")
    return Intake(FED, strategy, clients, inbox, sites, store, runlog, metrics, report, buffer=buffer)


_SEQUENCE = itertools.count(1)


def _update(model: dict, client: str, trained_on: int, n_samples: int, shift: float) -> bytes:
    tensors = {k: (v + shift).astype(np.float32) for k, v in model.items()}
    header = Header(Kind.UPDATE, FED, trained_on, 1, client, next(_SEQUENCE))  # counted, as devices do (P-SEQ-1)
    return encode(Frame(header, {"n_samples": n_samples}, tensors))


def _take_all(intake: Intake, model: dict) -> dict:
    received: dict = {}
    while not intake.queue.empty():
        intake.drain(OPEN, received, 0, model)
    return received


def test_the_staleness_weight_is_one_over_the_root_of_one_plus_staleness() -> None:
    assert staleness_weight(0) == 1.0
    assert staleness_weight(3) == pytest.approx(0.5)
    assert staleness_weight(1) == pytest.approx(0.7071067811865476)
    with pytest.raises(ValueError):
        staleness_weight(-1)


def test_updates_of_recent_versions_fold_by_staleness_and_older_ones_are_refused_as_stale(tmp_path: Path) -> None:
    """P-11.5, the aggregator's half."""
    intake = _intake(tmp_path, Buffer(buffer_k=3, max_staleness=2))
    model = intake.strategy.initial_model()
    # (client, version trained on, n_samples, shift): staleness 0, 1, 2, and 3 (beyond the limit)
    sent = [("c0", 3, 2, 0.5), ("c1", 2, 4, -0.25), ("c2", 1, 1, 1.0), ("c3", 0, 8, 10.0)]
    for client, version, n, shift in sent:
        payload = _update(model, client, version, n, shift)
        intake.put(topics.update_topic(FED, client), payload, len(payload) + 20)
    received = _take_all(intake, model)
    assert sorted(received) == ["c0", "c1", "c2"]
    assert dict(intake.runlog.rejections) == {"stale": 1}
    assert [client for client, _, _ in intake.store.journaled(OPEN)] == ["c0", "c1", "c2"]
    assert [received[c].n_samples for c in ("c0", "c1", "c2")] == [2, 4, 1]  # the devices' own counts are kept
    # by hand: weights n / sqrt(1 + staleness) = 2, 4 / sqrt(2), 1 / sqrt(3)
    weights = [2.0, 4.0 / math.sqrt(2.0), 1.0 / math.sqrt(3.0)]
    shift = (weights[0] * 0.5 + weights[1] * -0.25 + weights[2] * 1.0) / sum(weights)
    closed = intake.close(OPEN, received, model)
    for name, value in model.items():
        np.testing.assert_allclose(closed[name], value + shift, rtol=1e-6, atol=1e-6)
    # a sync round would have weighed them by samples alone: the formula is what moved it
    assert abs(shift - (2 * 0.5 + 4 * -0.25 + 1 * 1.0) / 7) > 1e-3
    intake.runlog.close()
    events = [json.loads(line) for line in (tmp_path / "out/metrics.jsonl").read_text().splitlines()]
    refused = [(e["client"], e["reason"], e["frame"]["kind"], e["frame"]["round"]) for e in events if "frame" in e]
    assert refused == [("c3", "stale", "UPDATE", 0)]  # the refusal names the update it refused

    restarted = _intake(tmp_path, Buffer(buffer_k=3, max_staleness=2))  # the journal replays once, same weights
    replayed = restarted.replay(OPEN, model)
    assert sorted(replayed) == ["c0", "c1", "c2"]
    again = restarted.close(OPEN, replayed, model)
    for name in model:
        np.testing.assert_array_equal(again[name], closed[name])
    restarted.runlog.close()


def test_a_devices_second_update_in_one_version_is_held_for_the_next(tmp_path: Path) -> None:
    intake = _intake(tmp_path, Buffer(buffer_k=3, max_staleness=2))
    model = intake.strategy.initial_model()
    for version in (1, 2, 2):  # trained on version 1, then on 2 (sent twice), all while version 2 is open
        payload = _update(model, "c0", version, 5, 0.1)
        intake.put(topics.update_topic(FED, "c0"), payload, len(payload) + 20)
    first: dict = {}
    while not intake.queue.empty():
        intake.drain(2, first, 0, model)
    assert [u.frame.header.round for u in first.values()] == [1] and len(intake.held) == 1
    assert dict(intake.runlog.rejections) == {"duplicate": 1}  # one held per device: a third is refused
    second: dict = {}
    intake.drain(2, second, 0, model)  # still version 2: nothing is taken back
    assert not second and len(intake.held) == 1
    intake.drain(3, second, 0, model)  # version 3 takes it first, one version stale
    assert [u.frame.header.round for u in second.values()] == [2] and not intake.held
    assert dict(intake.runlog.rejections) == {"duplicate": 1}
    intake.runlog.close()


def test_a_buffered_version_closes_at_buffer_k_updates_and_the_final_evaluation_waits_as_before() -> None:
    fed, _ = federation(mode="buffered", buffer_k=2, quorum=1.0)
    clients = ClientSet(CLIENTS)
    clients.online.update(CLIENTS)
    collector = Collector(fed.rounds, clients, None, None, None, None)  # type: ignore[arg-type]
    assert collector.quorum(4) == 2
    assert not collector.complete({"c0": None}, set(CLIENTS))
    assert collector.complete({"c0": None, "c3": None}, set(CLIENTS))  # c1 and c2 still online, training
    assert not collector.complete({"c0": None, "c3": None}, set(CLIENTS), Kind.EVAL)


def _fed(method: str, **rounds: object) -> FederationSpec:
    spec = {"name": "f", "method": method, "num_tasks": 1, "rounds_per_task": 1, "rounds": rounds}
    return from_dict(FederationSpec, spec, "test")


def test_only_methods_that_declare_buffered_rounds_run_them() -> None:
    assert methods.resolve(_fed("fedavg", mode="buffered"), "test")[0].buffered
    with pytest.raises(ConfigError, match="confedmade does not support buffered rounds") as exc:
        methods.resolve(_fed("confedmade", mode="buffered"), "test")
    assert "\n" not in str(exc.value)
    methods.resolve(_fed("confedmade"), "test")  # synchronous rounds: as before


@pytest.mark.parametrize(
    "rounds", [{"mode": "async"}, {"mode": "buffered", "buffer_k": 0}, {"mode": "buffered", "max_staleness": -1}]
)
def test_bad_buffered_settings_are_refused(rounds: dict) -> None:
    with pytest.raises(ConfigError):
        _fed("fedavg", **rounds)
