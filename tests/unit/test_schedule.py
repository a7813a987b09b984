"""The task schedule the strategy owns and the round message carries."""

from __future__ import annotations

import pytest

from fclcore.schedule import RoundPlace, TaskSchedule
from fclcore.schema import FederationSpec


@pytest.mark.parametrize(
    "schedule,rnd,expected",
    [
        (TaskSchedule.uniform(3, 2), 0, RoundPlace(0, True, False)),
        (TaskSchedule.uniform(3, 2), 1, RoundPlace(0, False, True)),
        (TaskSchedule.uniform(3, 2), 4, RoundPlace(2, True, False)),
        (TaskSchedule.from_rounds([1, 3, 2]), 0, RoundPlace(0, True, True)),  # a one-round task starts and ends
        (TaskSchedule.from_rounds([1, 3, 2]), 2, RoundPlace(1, False, False)),
        (TaskSchedule.from_rounds([1, 3, 2]), 3, RoundPlace(1, False, True)),
        (TaskSchedule.from_rounds([1, 3, 2]), 5, RoundPlace(2, False, True)),
        (TaskSchedule.from_rounds([1, 3, 2]), 6, RoundPlace(2, False, False)),  # the FINISH round: the last task
    ],
)
def test_place_of_a_round(schedule, rnd, expected) -> None:
    assert schedule.place(rnd) == expected
    assert RoundPlace.from_meta(expected.to_meta(), expected.task) == expected


def test_the_federation_sets_the_schedule() -> None:
    fed = FederationSpec(name="f", num_tasks=3, task_rounds=[1, 3, 2])
    assert fed.total_rounds == 6 and TaskSchedule.from_federation(fed).starts == (0, 1, 4)
    assert TaskSchedule.from_federation(FederationSpec(name="f", num_tasks=2, rounds_per_task=4)).starts == (0, 4)
    with pytest.raises(ValueError, match="task_rounds"):
        TaskSchedule.from_federation(FederationSpec(name="f", num_tasks=2, task_rounds=[3]))
    with pytest.raises(ValueError, match="task_rounds"):
        FederationSpec(name="f", num_tasks=1, task_rounds=[0])
    with pytest.raises(ValueError, match="task starts"):
        TaskSchedule((0, 3, 2), 6)


@pytest.mark.parametrize(
    "meta", [None, {}, {"task": 1, "task_start": True}, {"task": 0, "task_start": True, "task_end": "no"}]
)
def test_a_malformed_place_is_refused(meta) -> None:
    with pytest.raises(ValueError, match="schedule"):
        RoundPlace.from_meta(meta, 1)


@pytest.mark.e2e  # a whole federation, in process
def test_uneven_tasks_through_the_services(tmp_path, repo_root) -> None:
    """Tasks of 3 then 1 rounds, in process: the continual metrics read each task's last round."""
    import json

    from fcl_edge.simulate import simulate

    code = simulate(
        str(repo_root / "configs/scenarios/quickstart.yaml"),
        str(tmp_path / "run"),
        in_process=True,
        overrides=["compare=[]", "federation.task_rounds=[3, 1]", "clients=2", "federation.model.hidden_sizes=[16]"],
    )
    assert code == 0
    summary = json.loads((tmp_path / "run/summary.json").read_text())
    assert summary["rounds"] == 4 and len(summary["final"]["per_client"]["client-0"]["nll_matrix"]) == 2
    evals = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    full = sorted(
        {
            e["round"]
            for e in evals
            if e.get("event") == "eval" and len(e.get("nll", [])) > 0 and all(v is not None for v in e["nll"])
        }
    )
    assert 2 in full and 3 in full  # after the last round of each task: every task seen so far is scored
