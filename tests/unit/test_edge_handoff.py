"""When the device hands a model to serving (``edge_client.handoff.ServeHandoff``), alone: after a
task or every round as configured, once per round, with the task's held-out rows (or the newest
a device has) as the export's parity rows."""

from __future__ import annotations

import numpy as np
import pytest

from edge_client.handoff import ServeHandoff
from fclcore.data import Dataset
from fclcore.schedule import RoundPlace


class Writer:
    def snapshot(self, learner, task: int, parity: np.ndarray):
        return (learner, task, parity)


def data(rows: int, value: int) -> Dataset:
    return Dataset(np.full((rows, 3), value, np.uint8), np.zeros(rows, np.int64))


TESTS = (data(2, 0), data(2, 1))
AFTER_TASK_0 = RoundPlace(0, False, True)


@pytest.mark.parametrize(
    ("every", "task_ended", "served"),
    [("task", True, True), ("task", False, False), ("round", False, True), ("never", True, False)],
)
def test_what_is_served_follows_serve_every(every, task_ended, served) -> None:
    handoff = ServeHandoff(Writer(), every)
    got = handoff.served("learner", TESTS, after_round=3, previous=AFTER_TASK_0, task_ended=task_ended)
    assert (got is not None) == served
    assert handoff.served_round == (3 if served else -1)


def test_a_round_is_served_once_and_not_before_the_first_round() -> None:
    handoff = ServeHandoff(Writer(), "round")
    assert handoff.served("learner", TESTS, after_round=-1, previous=None, task_ended=False) is None
    learner, task, parity = handoff.served("learner", TESTS, after_round=3, previous=AFTER_TASK_0, task_ended=True)
    assert (learner, task) == ("learner", 0)
    assert parity.dtype == np.float32 and (parity == 0).all()  # task 0's held-out rows, as float32
    assert handoff.served("learner", TESTS, after_round=3, previous=AFTER_TASK_0, task_ended=True) is None


def test_a_device_without_the_tasks_rows_checks_with_its_newest_and_without_any_serves_nothing() -> None:
    handoff = ServeHandoff(Writer(), "task")
    later = RoundPlace(5, False, True)  # an own-clock device has fewer task folders than the federation tasks
    _, task, parity = handoff.served("learner", TESTS, after_round=7, previous=later, task_ended=True)
    assert task == 5 and (parity == 1).all()
    assert handoff.served("learner", (data(0, 0),), after_round=8, previous=later, task_ended=True) is None
    assert handoff.served_round == 7


class _Stop(Exception):
    pass


def test_a_round_waits_for_the_last_export_before_it_touches_the_learner() -> None:
    """Issue 40: the export of the last task's model ran beside the next round's evaluation and
    training, and the two peaks added up (FedSeIT: 100 MB more per task)."""
    from types import SimpleNamespace

    from edge_client.rounds import RoundWork

    calls: list = []

    class Waiting:
        def wait(self, timeout: float = 600.0) -> bool:
            calls.append(("wait", timeout))
            raise _Stop

    class Device:
        def __getattr__(self, name: str):
            calls.append(name)
            raise _Stop

    work = object.__new__(RoundWork)
    work.writer, work.device = Waiting(), Device()
    work.cfg = SimpleNamespace(serve=SimpleNamespace(export_timeout_s=42.0))
    with pytest.raises(_Stop):
        work.round(None)
    assert calls == [("wait", 42.0)]
