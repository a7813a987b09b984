"""Tests for the continual-learning metrics (fclcore.continual), against docs/metrics.md:

n[t][i] = test NLL of task i after training task t (nan for i > t), T = last task.
avg_nll = mean_i n[T][i]; base_nll = [n[t][0]]; new_nll = [n[t][t]];
forgetting = mean over i < T of (n[T][i] - min_{i <= t < T} n[t][i]).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fclcore.continual import continual_metrics, loss_matrix, mean_metrics

NAN = float("nan")
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Example A: ordinary forgetting.
#   task 0: 2.0 -> 2.5 -> 2.2 ; task 1: 3.0 -> 3.4 ; task 2: 1.8
A = [[2.0, NAN, NAN], [2.5, 3.0, NAN], [2.2, 3.4, 1.8]]
# avg_nll    = (2.2 + 3.4 + 1.8) / 3 = 7.4 / 3 = 2.46666... -> 2.4667
# forgetting = mean(2.2 - min(2.0, 2.5), 3.4 - min(3.0)) = mean(0.2, 0.4) = 0.3
# avg after each task: 2.0 ; (2.5 + 3.0) / 2 = 2.75 ; 2.4667
A_METRICS = {
    "avg_nll": 2.4667,
    "forgetting": 0.3,
    "base_nll": [2.0, 2.5, 2.2],
    "new_nll": [2.0, 3.0, 1.8],
    "avg_nll_per_task": [2.0, 2.75, 2.4667],
}

# Example B: the best earlier value of task 0 is after task 1 (not right after task 0), and
# task 1 improves after training task 2 (negative forgetting = backward transfer).
B = [[5.0, NAN, NAN], [4.0, 6.0, NAN], [4.5, 5.0, 3.0]]
# avg_nll    = (4.5 + 5.0 + 3.0) / 3 = 12.5 / 3 = 4.16666... -> 4.1667
# forgetting = mean(4.5 - min(5.0, 4.0), 5.0 - min(6.0)) = mean(0.5, -1.0) = -0.25
# avg after each task: 5.0 ; (4.0 + 6.0) / 2 = 5.0 ; 4.1667
B_METRICS = {
    "avg_nll": 4.1667,
    "forgetting": -0.25,
    "base_nll": [5.0, 4.0, 4.5],
    "new_nll": [5.0, 6.0, 3.0],
    "avg_nll_per_task": [5.0, 5.0, 4.1667],
}


def assert_metrics(got: dict, expected: dict) -> None:
    assert set(got) == {"avg_nll", "forgetting", "base_nll", "new_nll", "avg_nll_per_task"}
    assert got["avg_nll_per_task"][-1] == got["avg_nll"]
    for key in ("avg_nll", "forgetting"):
        assert got[key] == pytest.approx(expected[key], abs=1e-9), key
    for key in ("base_nll", "new_nll", "avg_nll_per_task"):
        if key in expected:
            assert got[key] == pytest.approx(expected[key], abs=1e-9), key


@pytest.mark.parametrize("rows, expected", [(A, A_METRICS), (B, B_METRICS)], ids=["A", "B"])
def test_hand_computed_3x3(rows, expected):
    assert_metrics(continual_metrics(np.array(rows)), expected)


def test_hand_computed_2x2():
    # forgetting = 3.0 - 1.0 = 2.0 ; avg = (3.0 + 2.0) / 2 = 2.5
    got = continual_metrics(np.array([[1.0, NAN], [3.0, 2.0]]))
    assert_metrics(got, {"avg_nll": 2.5, "forgetting": 2.0, "base_nll": [1.0, 3.0], "new_nll": [1.0, 2.0]})


def test_hand_computed_4x4_min_over_window():
    # task 0 column: 9, 7, 8 | final 10 -> 10 - 7 = 3
    # task 1 column:    6, 4 | final 5  -> 5 - 4 = 1
    # task 2 column:       2 | final 2  -> 0
    # forgetting = (3 + 1 + 0) / 3 = 1.3333 ; avg = (10 + 5 + 2 + 1) / 4 = 4.5
    rows = [[9.0], [7.0, 6.0], [8.0, 4.0, 2.0], [10.0, 5.0, 2.0, 1.0]]
    got = continual_metrics(loss_matrix(rows))
    assert_metrics(
        got, {"avg_nll": 4.5, "forgetting": 1.3333, "base_nll": [9.0, 7.0, 8.0, 10.0], "new_nll": [9.0, 6.0, 2.0, 1.0]}
    )


def test_single_task_has_zero_forgetting():
    got = continual_metrics(np.array([[1.2345]]))
    assert_metrics(got, {"avg_nll": 1.2345, "forgetting": 0.0, "base_nll": [1.2345], "new_nll": [1.2345]})
    assert got["forgetting"] == 0.0


def test_upper_triangle_is_ignored():
    filled = np.array(A)
    filled[np.triu_indices(3, 1)] = 999.0
    assert continual_metrics(filled) == continual_metrics(np.array(A))


def test_results_are_plain_rounded_floats():
    got = continual_metrics(np.array([[1.0 / 3.0, NAN], [2.0 / 3.0, 0.123456789]]))
    json.dumps(got)  # JSON-serialisable: no numpy scalars
    assert type(got["avg_nll"]) is float and all(type(v) is float for v in got["base_nll"])
    assert got["new_nll"] == [0.3333, 0.1235]
    assert got["forgetting"] == 0.3333  # 2/3 - 1/3


def test_lists_accepted():
    assert continual_metrics(A) == continual_metrics(np.array(A))


# --------------------------------------------------------------- loss_matrix


def test_loss_matrix_pads_with_nan():
    m = loss_matrix([[1.0], [2.0, 3.0], [4.0, 5.0, 6.0]])
    assert m.shape == (3, 3) and m.dtype == np.float64
    assert np.isnan(m[0, 1]) and np.isnan(m[0, 2]) and np.isnan(m[1, 2])
    np.testing.assert_array_equal(m[np.tril_indices(3)], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0])


def test_loss_matrix_empty():
    assert loss_matrix([]).shape == (0, 0)


# -------------------------------------------------------- reference property


def reference(n: np.ndarray) -> dict:
    """Straight transcription of the docs/metrics.md definitions with loops."""
    T = n.shape[0] - 1
    forgetting = []
    for i in range(T):
        best = min(n[t][i] for t in range(i, T))
        forgetting.append(n[T][i] - best)
    return {
        "avg_nll": sum(n[T][i] for i in range(T + 1)) / (T + 1),
        "forgetting": sum(forgetting) / len(forgetting) if forgetting else 0.0,
        "base_nll": [n[t][0] for t in range(T + 1)],
        "new_nll": [n[t][t] for t in range(T + 1)],
    }


@FAST
@given(
    st.integers(1, 6).flatmap(
        lambda k: st.lists(st.floats(0.0, 500.0, allow_nan=False), min_size=k * (k + 1) // 2, max_size=k * (k + 1) // 2)
    )
)
def test_matches_reference_definitions(values):
    k = int((math.isqrt(8 * len(values) + 1) - 1) // 2)
    rows, it = [], iter(values)
    for t in range(k):
        rows.append([next(it) for _ in range(t + 1)])
    n = loss_matrix(rows)
    got, want = continual_metrics(n), reference(n)
    for key in ("avg_nll", "forgetting"):
        assert got[key] == pytest.approx(want[key], abs=6e-5)
    for key in ("base_nll", "new_nll"):
        assert got[key] == pytest.approx(want[key], abs=6e-5)


# -------------------------------------------------------------- mean_metrics


def test_mean_metrics_two_clients():
    per_client = {"a": continual_metrics(np.array(A)), "b": continual_metrics(np.array(B))}
    got = mean_metrics(per_client)
    # avg_nll    = (2.4667 + 4.1667) / 2 = 3.3167
    # forgetting = (0.3 + -0.25) / 2 = 0.025
    # base_nll   = [(2.0 + 5.0)/2, (2.5 + 4.0)/2, (2.2 + 4.5)/2] = [3.5, 3.25, 3.35]
    # new_nll    = [(2.0 + 5.0)/2, (3.0 + 6.0)/2, (1.8 + 3.0)/2] = [3.5, 4.5, 2.4]
    assert got["avg_nll"] == pytest.approx(3.3167, abs=1e-9)
    assert got["forgetting"] == pytest.approx(0.025, abs=1e-9)
    assert got["base_nll"] == pytest.approx([3.5, 3.25, 3.35], abs=1e-9)
    assert got["new_nll"] == pytest.approx([3.5, 4.5, 2.4], abs=1e-9)
    json.dumps(got)


def test_mean_metrics_ignores_extra_keys_and_single_client():
    one = {**continual_metrics(np.array(A)), "nll_matrix": [[2.0]]}
    got = mean_metrics({"only": one})
    assert_metrics(got, A_METRICS)
    assert "nll_matrix" not in got


def test_mean_metrics_empty():
    assert mean_metrics({}) == {}
