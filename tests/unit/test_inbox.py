"""Tests for the aggregator's validation of incoming frames (aggregator.inbox)."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aggregator.inbox import Inbox, Rejection, eval_problem
from fclcore.aggregation import template_check
from fclcore.codec import CodecLimits, Frame, Header, Kind, SparseTensor, encode
from fclcore.strategy import Update

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

TEMPLATE = {"w": (2, 3), "b": (3,)}
OPEN = 4  # the open round in every test
GOOD_EVAL = {"round": OPEN - 1, "task": 1, "nll": [1.5, 2.5]}


def make_inbox(**kw) -> Inbox:
    return Inbox("fed", frozenset({"a", "b"}), template_check(TEMPLATE), 2, **kw)


def dense_tensors() -> dict:
    return {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.array([0.5, -1.0, 2.0], np.float32)}


def sparse_tensors() -> dict:
    w = np.zeros((2, 3), np.float32)
    w[0, 1], w[1, 2] = 3.0, -4.0
    return {"w": SparseTensor.from_dense(w), "b": SparseTensor((3,), np.array([], np.int64), np.array([]))}


def payload(
    *, fed="fed", client="a", rnd=OPEN, task=1, kind=Kind.UPDATE, meta=None, tensors=None, seq=1, value_dtype="float32"
) -> bytes:
    meta = {"n_samples": 10} if meta is None else meta
    tensors = dense_tensors() if tensors is None else tensors
    return encode(Frame(Header(kind, fed, rnd, task, client, seq), meta, tensors), value_dtype)


def check(data: bytes, client="a", received=(), kind=Kind.UPDATE, inbox=None):
    return (inbox or make_inbox()).check(client, data, len(data) + 30, OPEN, set(received), kind)


def reseal(data: bytes) -> bytes:
    body = bytes(data[:-4])
    return body + struct.pack("<I", zlib.crc32(body))


def rejected(result, reason: str) -> Rejection:
    assert isinstance(result, Rejection), result
    assert result.reason == reason, result
    assert isinstance(result.detail, str) and result.detail
    return result


# ------------------------------------------------------------------ accepted


def test_dense_update_accepted():
    data = payload(meta={"n_samples": 12})
    result = check(data)
    assert isinstance(result, Update)
    assert result.client == "a"
    assert result.n_samples == 12
    assert result.packet_bytes == len(data) + 30
    assert result.payload_bytes == len(data)
    assert result.frame.header.round == OPEN and result.frame.header.kind == Kind.UPDATE
    for name, tensor in dense_tensors().items():
        np.testing.assert_array_equal(result.frame.tensors[name], tensor)


def test_sparse_update_accepted():
    result = check(payload(tensors=sparse_tensors(), meta={"n_samples": 3}))
    assert isinstance(result, Update) and result.n_samples == 3
    w = result.frame.tensors["w"]
    assert isinstance(w, SparseTensor) and w.shape == (2, 3)
    np.testing.assert_array_equal(w.to_dense(), sparse_tensors()["w"].to_dense())


def test_mixed_float16_update_accepted():
    tensors = {"w": dense_tensors()["w"], "b": SparseTensor((3,), np.array([1]), np.array([2.0], np.float32))}
    assert isinstance(check(payload(tensors=tensors, value_dtype="float16")), Update)


def test_update_with_eval_and_extra_meta_accepted():
    meta = {"n_samples": 7, "eval": GOOD_EVAL, "train_nll": 3.25, "note": "x"}
    result = check(payload(meta=meta))
    assert isinstance(result, Update)
    assert result.frame.meta["eval"] == GOOD_EVAL


def test_second_client_accepted_after_first():
    result = check(payload(client="b"), client="b", received={"a"})
    assert isinstance(result, Update) and result.client == "b"


# docs/protocol.md P-8.4
def test_eval_frame_accepted_without_tensors_or_n_samples():
    data = payload(kind=Kind.EVAL, meta={"eval": {"round": OPEN - 1, "task": 0, "nll": [4.0]}}, tensors={})
    result = check(data, kind=Kind.EVAL)
    assert isinstance(result, Update) and result.n_samples == 0


# ---------------------------------------------------------------- rejections


@pytest.mark.parametrize("client", [None, "zzz", "", "A", "fed"])
def test_unknown_client(client):
    r = rejected(check(payload(), client=client), "unknown-client")
    assert r.client == client


def test_unknown_client_checked_before_decoding():
    rejected(check(b"garbage", client=None), "unknown-client")


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"abc",
        b"garbage garbage garbage",
        b"\x00" * 64,
        payload()[:-1],  # truncated
        payload()[:20],
        payload() + b"\x00",  # trailing byte breaks the CRC
    ],
    ids=["empty", "short", "text", "zeros", "truncated", "head-only", "trailing"],
)
def test_codec_garbage(data):
    r = rejected(check(data), "codec")
    assert r.client == "a" and not r.late


def test_codec_bad_checksum():
    data = bytearray(payload())
    data[30] ^= 0xFF
    rejected(check(bytes(data)), "codec")


def test_an_unknown_frame_version_is_refused_naming_the_versions_spoken():
    """P-VER-3: reason ``version``, and the text names what this aggregator decodes."""
    data = bytearray(payload())
    data[4] = 9  # version, with a valid CRC
    r = rejected(check(reseal(bytes(data))), "version")
    assert "version 9" in r.detail and "speaks 1, 2" in r.detail


def test_codec_limits_are_applied():
    inbox = make_inbox(limits=CodecLimits(max_frame_bytes=64))
    r = rejected(check(payload(), inbox=inbox), "codec")
    assert "frame size" in r.detail


def test_nan_in_eval_is_rejected_by_codec():
    # The JSON meta cannot carry NaN/Infinity: hand-patch an encoded frame and reseal it.
    for token in (b"NaN", b"1e999"):
        placeholder = b"7" * len(token)
        data = payload(meta={"n_samples": 1, "eval": {"round": OPEN - 1, "task": 0, "nll": [int(placeholder)]}})
        assert data.count(placeholder) == 1
        rejected(check(reseal(data.replace(placeholder, token))), "codec")


# docs/protocol.md P-4.3
def test_wrong_federation():
    r = rejected(check(payload(fed="other")), "federation")
    assert "other" in r.detail


# docs/protocol.md P-3.3
def test_header_client_differs_from_topic_client():
    r = rejected(check(payload(client="b"), client="a"), "sender")
    assert r.client == "a"


@pytest.mark.parametrize("kind", [Kind.ROUND, Kind.EVAL, Kind.FINISH, Kind.STATUS, Kind.ACK])
# docs/protocol.md P-4.3
def test_wrong_kind(kind):
    rejected(check(payload(kind=kind)), "kind")


def test_update_frame_where_eval_expected():
    rejected(check(payload(), kind=Kind.EVAL), "kind")


@pytest.mark.parametrize("rnd", [0, OPEN - 1])
def test_closed_round_is_late(rnd):
    r = rejected(check(payload(rnd=rnd)), "late")
    assert r.late is True


@pytest.mark.parametrize("rnd", [OPEN + 1, 2**32 - 1])
def test_future_round(rnd):
    r = rejected(check(payload(rnd=rnd)), "round")
    assert r.late is False


def test_duplicate():  # docs/protocol.md P-SEQ-3
    r = rejected(check(payload(), received={"a"}), "duplicate")
    assert r.client == "a"


def test_late_duplicate_is_reported_late():
    rejected(check(payload(rnd=OPEN - 1), received={"a"}), "late")


@pytest.mark.parametrize(
    "tensors, words",
    [
        ({"w": dense_tensors()["w"]}, ["missing ['b']"]),
        ({**dense_tensors(), "c": np.zeros(1, np.float32)}, ["unexpected ['c']"]),
        ({}, ["missing ['b', 'w']"]),
        ({"w": dense_tensors()["w"], "B": dense_tensors()["b"]}, ["missing ['b']", "unexpected ['B']"]),
        ({"w": np.zeros((3, 2), np.float32), "b": dense_tensors()["b"]}, ["w", "(2, 3)", "(3, 2)"]),
        ({"w": np.zeros(6, np.float32), "b": dense_tensors()["b"]}, ["w", "(2, 3)", "(6,)"]),
        ({"w": dense_tensors()["w"], "b": np.zeros((1, 3), np.float32)}, ["b", "(3,)", "(1, 3)"]),
        (
            {"w": SparseTensor((3, 2), np.array([0]), np.array([1.0])), "b": dense_tensors()["b"]},
            ["w", "(2, 3)", "(3, 2)"],
        ),
        ({"w": dense_tensors()["w"], "b": np.array(1.0, np.float32)}, ["b", "(3,)", "()"]),
    ],
    ids=["missing", "extra", "none", "renamed", "transposed", "flat", "extra-dim", "sparse-shape", "scalar"],
)
def test_tensor_problems(tensors, words):
    r = rejected(check(payload(tensors=tensors)), "content")
    for word in words:
        assert word in r.detail, r.detail


@pytest.mark.parametrize(
    "meta",
    [
        {},
        {"n_samples": 0},
        {"n_samples": -3},
        {"n_samples": True},
        {"n_samples": False},
        {"n_samples": "5"},
        {"n_samples": 5.0},
        {"n_samples": 2.5},
        {"n_samples": None},
        {"n_samples": [5]},
    ],
    ids=["missing", "zero", "negative", "true", "false", "str", "float", "fraction", "null", "list"],
)
# docs/protocol.md P-8.3
def test_bad_n_samples(meta):
    r = rejected(check(payload(meta=meta)), "content")
    assert "n_samples" in r.detail


def test_n_samples_checked_before_tensors():
    r = rejected(check(payload(meta={}, tensors={})), "content")
    assert "n_samples" in r.detail


@pytest.mark.parametrize(
    "report, word",
    [
        ({"round": OPEN, "task": 1, "nll": [1.0]}, "list of 2"),
        ({"round": OPEN, "task": 1, "nll": [1.0, 2.0, 3.0]}, "list of 2"),
        ({"round": OPEN, "task": 2, "nll": [1.0, 2.0, 3.0]}, "[0, 2)"),
        ({"round": OPEN, "task": -1, "nll": []}, "[0, 2)"),
        ({"round": OPEN, "task": 0, "nll": ["1.0"]}, "finite"),
        ({"round": "4", "task": 0, "nll": [1.0]}, "integer round"),
        ("report", "mapping"),
    ],
    ids=["short", "long", "task-high", "task-negative", "str-value", "str-round", "not-mapping"],
)
def test_bad_eval_report(report, word):
    for kind, tensors, meta in (
        (Kind.UPDATE, None, {"n_samples": 5, "eval": report}),
        (Kind.EVAL, {}, {"eval": report}),
    ):
        r = rejected(check(payload(kind=kind, tensors=tensors, meta=meta), kind=kind), "content")
        assert word in r.detail, r.detail


def test_huge_integer_in_eval_is_rejected_not_raised():
    data = payload(meta={"n_samples": 5, "eval": {"round": OPEN - 1, "task": 0, "nll": [10**400]}})
    rejected(check(data), "content")


def test_accepted_n_samples_is_a_usable_weight():
    result = check(payload(meta={"n_samples": 10**400}))
    if isinstance(result, Update):
        assert np.isfinite(float(result.n_samples))
    else:
        rejected(result, "content")


@pytest.mark.parametrize("n_samples", [None, "many", [1], {"n": 1}], ids=["null", "str", "list", "dict"])
def test_eval_frame_with_non_numeric_n_samples(n_samples):
    meta = {"n_samples": n_samples, "eval": {"round": OPEN - 1, "task": 0, "nll": [1.0]}}
    assert_outcome(check(payload(kind=Kind.EVAL, tensors={}, meta=meta), kind=Kind.EVAL))


# --------------------------------------------------------------- eval_problem


@pytest.mark.parametrize(
    "report, num_tasks, word",
    [
        ({"round": 0, "task": 0, "nll": [1.0]}, 1, None),
        ({"round": 9, "task": 2, "nll": [1, 2.5, 0]}, 3, None),
        ({"round": 0, "task": 0, "nll": [1.0], "extra": "ok"}, 1, None),
        ({"round": 0, "task": 0, "nll": [-1e300]}, 1, None),
        (None, 1, "expected a mapping, got NoneType"),
        ([1.0], 1, "expected a mapping, got list"),
        ("x", 1, "expected a mapping, got str"),
        ({}, 1, "integer round and task in [0, 1)"),
        ({"task": 0, "nll": [1.0]}, 1, "integer round"),
        ({"round": 0, "nll": [1.0]}, 1, "integer round"),
        ({"round": 0.0, "task": 0, "nll": [1.0]}, 1, "integer round"),
        ({"round": 0, "task": 1.0, "nll": [1.0, 1.0]}, 2, "integer round"),
        ({"round": 0, "task": 3, "nll": [1.0] * 4}, 3, "[0, 3)"),
        ({"round": 0, "task": -1, "nll": []}, 3, "[0, 3)"),
        ({"round": 0, "task": 0}, 1, "list of 1 numbers"),
        ({"round": 0, "task": 0, "nll": 1.0}, 1, "list of 1 numbers"),
        ({"round": 0, "task": 0, "nll": (1.0,)}, 1, "list of 1 numbers"),
        ({"round": 0, "task": 1, "nll": [1.0]}, 2, "list of 2 numbers"),
        ({"round": 0, "task": 0, "nll": []}, 1, "list of 1 numbers"),
        ({"round": 0, "task": 0, "nll": [float("nan")]}, 1, "finite"),
        ({"round": 0, "task": 1, "nll": [1.0, float("inf")]}, 2, "finite"),
        ({"round": 0, "task": 0, "nll": [float("-inf")]}, 1, "finite"),
        ({"round": 0, "task": 0, "nll": [True]}, 1, "finite"),
        ({"round": 0, "task": 0, "nll": [None]}, 1, "finite"),
        ({"round": 0, "task": 0, "nll": ["1"]}, 1, "finite"),
        ({"round": 0, "task": 0, "nll": [[1.0]]}, 1, "finite"),
        ({"round": 0, "task": 0, "accuracy": [0.5]}, 1, None),
        ({"round": 0, "task": 1, "accuracy": [None, 1.0]}, 2, None),
        ({"round": 0, "task": 0, "accuracy": [1.5]}, 1, "[0, 1]"),
        ({"round": 0, "task": 0, "accuracy": [-0.1]}, 1, "[0, 1]"),
        ({"round": 0, "task": 0, "accuracy": [float("nan")]}, 1, "finite"),
        ({"round": 0, "task": 0, "accuracy": []}, 1, "list of 1 numbers"),
        ({"round": 0, "task": 0, "accuracy": [0.5], "nll": [1.0]}, 1, "both"),
    ],
)
# docs/protocol.md P-8.5
def test_eval_problem_table(report, num_tasks, word):
    problem = eval_problem(report, num_tasks)
    if word is None:
        assert problem is None
    else:
        assert isinstance(problem, str) and word in problem, problem


@pytest.mark.parametrize(
    "report",
    [
        {"round": 0, "task": True, "nll": [1.0, 2.0]},
        {"round": True, "task": 0, "nll": [1.0]},
    ],
    ids=["task-true", "round-true"],
)
def test_eval_problem_refuses_bools(report):
    assert eval_problem(report, 2) is not None


def test_eval_problem_huge_int():
    assert eval_problem({"round": 0, "task": 0, "nll": [10**400]}, 1) is not None


# ------------------------------------------------------------- never raises

VALID_PAYLOADS = [
    payload(),
    payload(tensors=sparse_tensors(), meta={"n_samples": 3, "eval": GOOD_EVAL}),
    payload(kind=Kind.EVAL, tensors={}, meta={"eval": {"round": OPEN, "task": 0, "nll": [2.0]}}),
    payload(
        value_dtype="float16", tensors={"w": SparseTensor((2, 3), np.arange(5), np.ones(5)), "b": dense_tensors()["b"]}
    ),
]


def assert_outcome(result) -> None:
    assert isinstance(result, (Update, Rejection)), result
    if isinstance(result, Rejection):
        assert isinstance(result.reason, str) and isinstance(result.detail, str)


@FAST
@given(st.binary(max_size=400), st.sampled_from([None, "a", "b", "zzz"]), st.sampled_from(list(Kind)))
def test_random_bytes_never_raise(data, client, kind):
    assert_outcome(make_inbox().check(client, data, len(data), OPEN, set(), kind))


mutation = st.one_of(
    st.tuples(st.just("set"), st.integers(0, 10_000), st.integers(0, 255)),
    st.tuples(st.just("xor"), st.integers(0, 10_000), st.integers(1, 255)),
    st.tuples(st.just("insert"), st.integers(0, 10_000), st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("delete"), st.integers(0, 10_000), st.integers(1, 8)),
    st.tuples(st.just("truncate"), st.integers(0, 10_000), st.just(0)),
)


def mutate(data: bytes, ops) -> bytes:
    buf = bytearray(data)
    for op, pos, arg in ops:
        if not buf:
            break
        pos %= len(buf)
        if op == "set":
            buf[pos] = arg
        elif op == "xor":
            buf[pos] ^= arg
        elif op == "insert":
            buf[pos:pos] = arg
        elif op == "delete":
            del buf[pos : pos + arg]
        else:
            del buf[pos:]
    return bytes(buf)


@FAST
@given(
    st.sampled_from(range(len(VALID_PAYLOADS))),
    st.lists(mutation, min_size=1, max_size=4),
    st.booleans(),
    st.sampled_from([Kind.UPDATE, Kind.EVAL]),
    st.sets(st.sampled_from(["a", "b"])),
)
def test_mutated_frames_never_raise(index, ops, seal, kind, received):
    data = mutate(VALID_PAYLOADS[index], ops)
    if seal and len(data) >= 4:
        data = reseal(data)  # get past the CRC so the body checks are exercised
    assert_outcome(make_inbox().check("a", data, len(data), OPEN, received, kind))


# JSON-like meta values; integers stay within float range (see the xfail tests above).
json_scalar = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**53), 2**53),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=5),
)
json_value = st.recursive(
    json_scalar,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=5), inner, max_size=4)),
    max_leaves=12,
)
eval_like = st.fixed_dictionaries(
    {},
    optional={
        "round": json_value | st.integers(0, 10),
        "task": json_value | st.integers(-1, 3),
        "nll": json_value | st.lists(st.floats(0, 10), max_size=4),
    },
)


@FAST
@given(
    st.fixed_dictionaries(
        {},
        optional={"n_samples": json_value | st.integers(-2, 100), "eval": json_value | eval_like, "other": json_value},
    ),
    st.sampled_from([Kind.UPDATE, Kind.EVAL]),
)
def test_random_meta_never_raises(meta, kind):
    if kind is Kind.EVAL and not isinstance(meta.get("n_samples", 0), (int, float)):
        del meta["n_samples"]  # known bug, see test_eval_frame_with_non_numeric_n_samples
    tensors = dense_tensors() if kind is Kind.UPDATE else {}
    result = check(payload(kind=kind, meta=meta, tensors=tensors), kind=kind)
    assert_outcome(result)
    if isinstance(result, Update) and kind is Kind.UPDATE:
        n = meta["n_samples"]
        assert type(n) is int and n >= 1 and result.n_samples == n
    if isinstance(result, Update) and "eval" in meta:
        assert eval_problem(meta["eval"], 2) is None


@pytest.mark.parametrize("eval_round", [OPEN, OPEN - 2, 0])
# docs/protocol.md P-8.5
def test_eval_must_describe_the_previous_rounds_model(eval_round):
    """A client reports on the global model it received: the one from the round before."""
    data = payload(meta={"n_samples": 3, "eval": {"round": eval_round, "task": 0, "nll": [1.0]}})
    result = check(data)
    assert isinstance(result, Rejection) and result.reason == "content" and "eval.round" in result.detail


@pytest.mark.parametrize("nll,ok", [([None, 2.0], True), ([1.0, None], False), ([None, None], False)])
def test_eval_may_skip_earlier_tasks_but_not_the_current_one(nll, ok):
    problem = eval_problem({"round": 3, "task": 1, "nll": nll}, num_tasks=2)
    assert (problem is None) == ok
