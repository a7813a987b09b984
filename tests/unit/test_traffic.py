"""The data behind ``bytes_per_round.png`` and ``cumulative_bytes.png`` (fcl_edge.traffic):
sums per round and kind, the fallback for logs without a kind split, and task boundaries."""

from __future__ import annotations

import numpy as np

from fcl_edge.figures import title_of
from fcl_edge.traffic import round_bytes


def _record(r: int, task: int, client: str, up: int, down: int, dense: int = 100, **kinds) -> dict:
    return {"event": "round_client", "round": r, "task": task, "client": client, "bytes_up": up,
            "bytes_down": down, "dense_fp32_up": dense, **kinds}  # fmt: skip


def test_totals_without_a_kind_split_count_as_model_bytes() -> None:
    events = [_record(0, 0, "a", 10, 20), _record(0, 0, "b", 30, 40), {"event": "round", "round": 0}]
    data = round_bytes(events)
    assert data.rounds == [0]
    assert data.up == {"model": [40], "knowledge": [0], "control": [0]}
    assert data.down == {"model": [60], "knowledge": [0], "control": [0]}
    assert data.dense == [200]


def test_kind_splits_are_summed_per_kind_and_match_the_totals() -> None:
    split = {"model": 50, "knowledge": 30, "control": 4}
    events = [
        _record(3, 1, "a", 84, 84, up_kinds=split, down_kinds={"model": 80, "knowledge": 0, "control": 4}),
        _record(3, 1, "b", 7, 9),  # an older record in the same round: totals as model bytes
    ]
    data = round_bytes(events)
    assert data.up == {"model": [57], "knowledge": [30], "control": [4]}
    assert data.down == {"model": [89], "knowledge": [0], "control": [4]}
    assert list(data.total("up")) == [91] and list(data.total("down")) == [93]


def test_task_boundaries_are_the_first_round_of_each_later_task() -> None:
    tasks = [0, 0, 0, 1, 1, 2, 2, 2]
    events = [_record(r, t, c, 1, 1) for r, t in enumerate(tasks) for c in ("a", "b")]
    data = round_bytes(list(reversed(events)))  # log order does not matter
    assert data.rounds == list(range(8))
    assert data.task_starts == [3, 5]
    assert np.array_equal(data.total("up"), np.full(8, 2))


def test_an_empty_log_has_no_rounds() -> None:
    data = round_bytes([{"event": "run"}])
    assert data.rounds == [] and data.task_starts == [] and data.total("down").size == 0


def test_titles_name_the_scenario_and_each_method_once() -> None:
    runs = [{"federation": "qs", "method": "confedmade"}, {"federation": "qs", "method": "fedavg"}]
    assert title_of(runs + runs[:1]) == "qs: confedmade, fedavg"
