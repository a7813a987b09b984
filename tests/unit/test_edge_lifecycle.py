"""Which run the device is in and how it leaves it (``edge_client.lifecycle.RunLifecycle``) alone,
without a broker or a learner: a real ``RunGate`` decides which run is confirmed; the device, its
frames, its round work, its uplink and serving are recorders."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest
from support.builders import federation_spec

from edge_client.lifecycle import RunLifecycle
from edge_client.protocol import RejectedFrame
from edge_client.rungate import RunGate
from edge_client.status import AggregatorWatch
from fclcore import topics
from fclcore.codec import Frame, Header, Kind
from fclcore.exitcodes import ExitCode
from fclcore.runid import new_run_id

CLIENT = "dev-1"


class Recorder:
    """Stands in for a part: remembers every call as (name, args)."""

    def __init__(self, **fields) -> None:
        self.calls: list[tuple] = []
        self.__dict__.update(fields)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args, **kwargs: self.calls.append((name, *args))

    def called(self) -> list[str]:
        return [c[0] for c in self.calls]


def runs_in_order(n: int) -> list[str]:
    out = []
    for _ in range(n):
        out.append(new_run_id())
        time.sleep(0.002)  # run ids order by start time
    return out


def lifecycle(run_id: str | None = None, on_new_run: str = "join", aggregator_run: str | None = None):
    link = Recorder(status_fields={})
    watch = AggregatorWatch(link, 60.0)
    watch.run = aggregator_run  # what the aggregator's retained status names
    device = Recorder(run_id=run_id, learner=None, done_round=-1)
    device.forget = lambda: device.__dict__.update(learner=None, done_round=-1, forgotten=True)
    work = Recorder(pending=("round", 1), waiting=("round", 2), handoff=SimpleNamespace(served_round=4))
    work.served = lambda after_round, previous, task_ended: ("job", after_round, task_ended)
    uplink = Recorder(unacked=b"update")
    cfg = SimpleNamespace(client_id=CLIENT, federation="fed", on_new_run=on_new_run)
    parts = SimpleNamespace(
        device=device, frames=Recorder(), work=work, uplink=uplink, serving=Recorder(), link=link, gate=None
    )
    parts.gate = RunGate(watch, max_skew_s=60.0, run_over_s=60.0)
    runs = RunLifecycle(cfg, device, parts.gate, parts.frames, work, uplink, parts.serving, link)
    return runs, parts


def frame(kind: Kind, run: str, rnd: int = 0, task: int = 0, previous: dict | None = None, **meta) -> Frame:
    schedule = {"task": task, "task_start": True, "task_end": False, "previous": previous}
    header = Header(kind, "fed", rnd, task, topics.AGGREGATOR_ID, 1)
    return Frame(header, {"run": run, "schedule": schedule, **meta}, {})


def test_a_fresh_device_adopts_a_confirmed_run_at_its_round() -> None:
    (run,) = runs_in_order(1)
    runs, p = lifecycle(aggregator_run=run)
    assert runs.meet(frame(Kind.ROUND, run), run, ("t", b"x", 1)) is False
    assert p.device.run_id == run and p.link.status_fields == {"run": run}
    assert p.frames.calls == [("adopt", run)]
    assert runs.exit_code is None and runs.final_state == "stopped"


def test_a_run_the_aggregator_does_not_name_is_held_until_it_does() -> None:
    (run,) = runs_in_order(1)
    runs, p = lifecycle(aggregator_run=None)
    message = ("t", b"round", 5)
    assert runs.meet(frame(Kind.ROUND, run), run, message) is None
    assert p.device.run_id is None and p.gate.release() is None
    p.gate.watch.run = run
    assert p.gate.release() == message


def test_a_run_id_from_the_future_is_dropped_before_it_is_held() -> None:
    future = f"{(time.time_ns() // 1000) + 3_600_000_000:016x}-00000000"  # an hour ahead, 60 s skew allowed
    runs, p = lifecycle(aggregator_run=future)
    with pytest.raises(RejectedFrame, match="^run: .* past this device's clock"):
        runs.meet(frame(Kind.ROUND, future), future, ("t", b"x", 1))
    assert p.device.run_id is None and p.gate.held is None


OTHER_RUNS = {  # what comes, and whose run: the device's (None: fresh), and the message it is dropped with
    "the end of a run a fresh device missed": (Kind.FINISH, 1, None, "^run: the end of run .* took no part in$"),
    "a round of an earlier run": (Kind.ROUND, 0, 1, "^run: a ROUND of run .* an earlier run than this device's"),
    "the end of a newer run not joined": (Kind.FINISH, 2, 1, "^run: the end of run .* has not joined$"),
}


@pytest.mark.parametrize("case", OTHER_RUNS)
def test_frames_of_other_runs_that_are_never_acted_on(case: str) -> None:
    kind, which, device_which, message = OTHER_RUNS[case]
    ids = runs_in_order(3)
    run, device_run = ids[which], None if device_which is None else ids[device_which]
    runs, p = lifecycle(run_id=device_run, aggregator_run=run)
    with pytest.raises(RejectedFrame, match=message):
        runs.meet(frame(kind, run), run, ("t", b"x", 1))
    assert p.device.run_id == device_run and p.frames.calls == [] and p.gate.held is None
    assert (p.gate.ended_since is not None) == (device_run is None)  # only a fresh device counts toward RUN_ENDED


def test_a_newer_run_is_joined_from_scratch() -> None:
    current, newer = runs_in_order(2)
    runs, p = lifecycle(run_id=current, on_new_run="join", aggregator_run=newer)
    runs.told_not_enrolled = True
    assert runs.meet(frame(Kind.ROUND, newer), newer, ("t", b"x", 1)) is False
    assert p.device.run_id == newer and p.device.forgotten
    assert (p.work.pending, p.work.waiting, p.uplink.unacked, p.work.handoff.served_round) == (None, None, None, -1)
    assert p.frames.called() == ["reset", "adopt"] and not runs.told_not_enrolled
    assert runs.exit_code is None


def test_a_newer_run_is_refused_with_other_run(caplog) -> None:
    current, newer = runs_in_order(2)
    runs, p = lifecycle(run_id=current, on_new_run="refuse", aggregator_run=newer)
    with caplog.at_level(logging.ERROR, logger="edge_client.daemon"):
        assert runs.meet(frame(Kind.ROUND, newer), newer, ("t", b"x", 1)) is True
    assert runs.exit_code is ExitCode.OTHER_RUN and p.device.run_id == current
    assert p.frames.calls == [] and p.uplink.unacked == b"update"
    assert "on_new_run is refuse" in caplog.text


def test_a_failed_run_ends_the_device_and_a_stale_finish_is_dropped() -> None:
    (run,) = runs_in_order(1)
    fed = federation_spec()
    runs, p = lifecycle(run_id=run)
    with pytest.raises(RejectedFrame, match=f"^finish: for round 3, but the federation has {fed.total_rounds} rounds"):
        runs.finish_early(frame(Kind.FINISH, run, rnd=3), fed)
    assert runs.exit_code is None and p.uplink.unacked == b"update"
    assert runs.finish_early(frame(Kind.FINISH, run, rnd=3, failed="round 3 missed its quorum"), fed) is True
    assert runs.exit_code is ExitCode.FEDERATION_FAILED and p.uplink.unacked is None
    assert p.serving.called() == ["wait"]


def test_membership_waits_before_enrolment_acts_while_active_and_retires_after(caplog) -> None:
    (run,) = runs_in_order(1)
    fed = federation_spec(membership={CLIENT: "x * o", "dev-2": "* * *"})
    runs, p = lifecycle(run_id=run)
    with caplog.at_level(logging.INFO, logger="edge_client.daemon"):
        assert runs.outside(frame(Kind.ROUND, run, rnd=0, task=0), fed) is False
        assert runs.outside(frame(Kind.ROUND, run, rnd=1, task=0), fed) is False
    assert caplog.text.count("not enrolled yet in task 0") == 1 and runs.told_not_enrolled
    assert runs.outside(frame(Kind.ROUND, run, rnd=2, task=1), fed) is None
    assert runs.final_state == "stopped" and p.serving.calls == []
    assert runs.outside(frame(Kind.ROUND, run, rnd=4, task=2), fed) is True
    assert runs.final_state == "retired" and p.uplink.unacked is None
    assert p.serving.called() == ["wait"]  # no learner: nothing to serve


def test_a_retired_device_serves_the_model_of_its_last_round() -> None:
    (run,) = runs_in_order(1)
    fed = federation_spec(membership={CLIENT: "* * o", "dev-2": "* * *"})
    runs, p = lifecycle(run_id=run)
    p.device.__dict__.update(learner=object(), done_round=3)
    last = frame(Kind.ROUND, run, rnd=4, task=2, previous={"task": 1, "task_start": False, "task_end": True})
    assert runs.outside(last, fed) is True
    assert p.device.calls == [("load", last, fed)]
    assert p.serving.calls == [("submit", ("job", 3, True)), ("wait",)]
    assert runs.final_state == "retired"
