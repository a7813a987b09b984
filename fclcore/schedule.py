"""The task schedule: which task each round trains, owned by the server strategy.

The aggregator computes it once and carries each round's place in it inside the round
message (``meta["schedule"]``), so no device recomputes the task clock: a device only
reads ``RoundPlace.from_meta``.  Tasks may start at any round (``starts``); the default
is ``rounds_per_task`` rounds per task.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RoundPlace:
    """Where one round sits in its task."""

    task: int
    task_start: bool  # the task's first round
    task_end: bool  # the task's last round: its evaluation is a row of the continual metrics

    def to_meta(self) -> dict:
        return {"task": self.task, "task_start": self.task_start, "task_end": self.task_end}

    @classmethod
    def from_meta(cls, meta: Any, task: int) -> "RoundPlace":
        """The place a round message states; ValueError if it is malformed or names another task."""
        if (
            not isinstance(meta, dict)
            or meta.get("task") != task
            or not all(isinstance(meta.get(k), bool) for k in ("task_start", "task_end"))
        ):
            raise ValueError(
                f"schedule: expected {{task: {task}, task_start: bool, task_end: bool}}, got {meta!r}"[:200]
            )
        return cls(task, meta["task_start"], meta["task_end"])


@dataclass(frozen=True)
class TaskSchedule:
    starts: tuple[int, ...]  # the first round of each task, strictly increasing from 0
    total_rounds: int

    def __post_init__(self) -> None:
        if (
            not self.starts
            or self.starts[0] != 0
            or list(self.starts) != sorted(set(self.starts))
            or self.starts[-1] >= self.total_rounds
        ):
            raise ValueError(
                f"task schedule: expected task starts 0 = s0 < s1 < ... < {self.total_rounds}, got {list(self.starts)}"
            )

    @classmethod
    def uniform(cls, num_tasks: int, rounds_per_task: int) -> "TaskSchedule":
        return cls(tuple(t * rounds_per_task for t in range(num_tasks)), num_tasks * rounds_per_task)

    @classmethod
    def from_rounds(cls, task_rounds: list[int]) -> "TaskSchedule":
        """Task t runs ``task_rounds[t]`` rounds."""
        starts = [sum(task_rounds[:t]) for t in range(len(task_rounds))]
        return cls(tuple(starts), sum(task_rounds))

    @classmethod
    def from_federation(cls, fed: Any) -> "TaskSchedule":
        fed.check_schedule()
        if fed.task_rounds is not None:
            return cls.from_rounds(list(fed.task_rounds))
        return cls.uniform(fed.num_tasks, fed.rounds_per_task)

    @property
    def num_tasks(self) -> int:
        return len(self.starts)

    def task_of(self, rnd: int) -> int:
        """The task round ``rnd`` trains (rounds past the end belong to the last task)."""
        return max(0, bisect.bisect_right(self.starts, rnd) - 1)

    def last_round(self, task: int) -> int:
        return (self.starts[task + 1] if task + 1 < self.num_tasks else self.total_rounds) - 1

    def place(self, rnd: int) -> RoundPlace:
        task = self.task_of(rnd)
        return RoundPlace(task, rnd == self.starts[task], rnd == self.last_round(task))
