"""Codec v2's int8 block values: the stated error bound, seeded rounding, versions, validation."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.frames import mutated, raw_frame, rec, reseal, u16

from fclcore import blockquant
from fclcore.codec import (
    INT8_VERSION,
    CodecError,
    Frame,
    Header,
    Kind,
    SparseTensor,
    ValueCoding,
    decode,
    encode,
)

HEADER = Header(Kind.UPDATE, "fed", 3, 1, "client-1", 7)
NEAREST, STOCHASTIC = ValueCoding("int8"), ValueCoding("int8", rounding="stochastic", seed=5)


def i8(block: int, scales, codes) -> bytes:
    """The values section of an int8 tensor, from the documented layout."""
    return struct.pack("<H", block) + np.asarray(scales, "<f4").tobytes() + np.asarray(codes, np.int8).tobytes()


def sent_order(sent, got) -> tuple[np.ndarray, np.ndarray]:
    """(sent, received) values in the order the int8 blocks cover them: all numel entries when
    the tensor went dense, the nnz values in index order when it went sparse."""
    if isinstance(got, SparseTensor):
        return np.asarray(sent.values, np.float64), got.values.astype(np.float64)
    dense = sent.to_dense() if isinstance(sent, SparseTensor) else sent
    return np.asarray(dense, np.float64).reshape(-1), got.astype(np.float64).reshape(-1)


def assert_within_bound(x: np.ndarray, q: np.ndarray, block: int, rounding: str) -> None:
    """|x - q| <= s/2 (nearest) or < s (stochastic), s = max|block| / 127, plus the documented
    slack: s rounded up to float32 (one ulp) and the final float32 rounding of q."""
    n = x.size
    if n == 0:
        return
    blocks = np.zeros(-(-n // block) * block)
    blocks[:n] = np.abs(x)
    s = np.repeat(blocks.reshape(-1, block).max(axis=1) / 127, block)[:n]
    s_sent = s * (1 + 2.0**-23) + 2.0**-149  # rounded up to a float32
    with np.errstate(over="ignore"):  # the spacing of float32's largest values is inf: no bound there
        final = np.spacing(np.maximum(np.abs(x), np.abs(q)).astype(np.float32)).astype(np.float64) / 2
    err = np.abs(x - q)
    limit = (s_sent / 2 if rounding == "nearest" else s_sent) + final
    worst = int(np.argmax(err - limit))
    assert err[worst] <= limit[worst], f"value {x[worst]} read back as {q[worst]} (s={s[worst]})"


# ---------------------------------------------------------------- property-based round trip

SHAPES = st.lists(st.integers(1, 40), min_size=1, max_size=3).map(tuple)
KINDS = ["normal", "tiny", "huge", "mixed", "zeros", "outlier", "integers"]


@st.composite
def int8_tensors(draw):
    shape = draw(SHAPES)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(KINDS))
    x = rng.standard_normal(shape)
    if kind == "tiny":
        x *= 1e-30
    elif kind == "huge":
        x *= 1e36
    elif kind == "mixed":  # mixed signs over many orders of magnitude
        x *= 10.0 ** rng.integers(-20, 20, shape)
    elif kind == "zeros":
        x[...] = 0
    elif kind == "outlier":  # one entry dwarfs the rest of its block
        x.reshape(-1)[rng.integers(x.size)] = 1e6
    elif kind == "integers":
        x = rng.integers(-127, 128, shape).astype(np.float64)
    x = x.astype(np.float32)
    density = draw(st.sampled_from([0.0, 0.05, 0.5, 1.0]))
    mask = rng.random(shape) < density
    if draw(st.booleans()):
        return kind, np.where(mask, x, 0).astype(np.float32)
    return kind, SparseTensor.from_dense(x, mask)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.dictionaries(st.text(min_size=1, max_size=6), int8_tensors(), min_size=1, max_size=3),
    st.sampled_from([1, 7, 64, 128]),
    st.sampled_from(["nearest", "stochastic"]),
)
def test_round_trip_within_bound(tensors, block, rounding):
    frame = Frame(HEADER, {"n": 1}, {name: t for name, (_, t) in tensors.items()})
    data = encode(frame, ValueCoding("int8", block, rounding, seed=11))
    assert data[4] == INT8_VERSION
    out = decode(data)
    assert out.header == HEADER and list(out.tensors) == list(frame.tensors)
    for name, (kind, sent) in tensors.items():
        got = out.tensors[name]
        assert got.shape == sent.shape
        if isinstance(got, SparseTensor):
            assert isinstance(sent, SparseTensor) and np.array_equal(got.indices, sent.indices)
        x, q = sent_order(sent, got)
        assert_within_bound(x, q, block, rounding)
        if kind in ("zeros", "integers"):  # small integers (and all-zero blocks) are exact
            np.testing.assert_array_equal(q, x)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 300), st.integers(1, 70), st.integers(0, 2**32 - 1))
def test_dequantize_is_code_times_its_block_scale(count, block, seed):
    """Whole blocks and the short last one: each value is float32(code) * its float32 scale."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(-127, 128, count).astype(np.int8)
    scales = rng.uniform(0, 2, blockquant.block_count(count, block)).astype(np.float32)
    expected = codes.astype(np.float32) * np.repeat(scales, block)[:count]
    got = blockquant.dequantize(scales, codes, block)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, expected)


def test_bound_is_tight_enough_to_fail():
    """The helper really checks: a value moved by more than s/2 fails it."""
    x = np.array([127.0, 0.3])  # s = 1
    assert_within_bound(x, np.array([127.0, 0.0]), 64, "nearest")
    with pytest.raises(AssertionError):
        assert_within_bound(x, np.array([127.0, 1.0]), 64, "nearest")


def test_nearest_error_is_half_a_step_at_worst():
    """Values halfway between two codes: the error reaches s/2 and no further."""
    s = 0.01
    x = np.concatenate([[127 * s], (np.arange(63) + 0.5) * s * np.where(np.arange(63) % 2, 1, -1)]).astype(np.float32)
    q = decode(encode(Frame(HEADER, {}, {"t": x}), NEAREST)).tensors["t"]
    err = np.abs(x.astype(np.float64) - q)
    assert err.max() == pytest.approx(s / 2, rel=1e-4)


def test_stochastic_rounding_is_unbiased_and_nearest_is_not():
    x = np.full(100_000, 0.3, np.float32)
    x[::64] = 127.0  # one value per block fixes its scale at 1: 0.3 lies between codes 0 and 1
    body = np.ones(x.size, bool)
    body[::64] = False
    near = decode(encode(Frame(HEADER, {}, {"t": x}), NEAREST)).tensors["t"][body]
    stoch = decode(encode(Frame(HEADER, {}, {"t": x}), STOCHASTIC)).tensors["t"][body]
    assert set(np.unique(stoch)) == {0.0, 1.0}
    sigma = np.sqrt(0.3 * 0.7 / body.sum())
    assert abs(stoch.mean() - 0.3) < 5 * sigma
    assert near.mean() == 0.0


# ---------------------------------------------------------------- seeded stochastic rounding


def codes(data: bytes) -> bytes:
    return data[-4 - 1000 : -4]  # the codes end the one 1,000-value tensor, before the CRC


def stochastic_bytes(header=HEADER, name="t", seed=5) -> bytes:
    x = np.linspace(-1, 1, 1000, dtype=np.float32)
    return encode(Frame(header, {}, {name: x}), ValueCoding("int8", rounding="stochastic", seed=seed))


def test_stochastic_rounding_is_reproducible_and_ignores_global_rng():
    np.random.seed(1)
    first = stochastic_bytes()
    np.random.seed(2)
    np.random.default_rng().random(10)
    assert stochastic_bytes() == first
    later_sequence = Header(HEADER.kind, HEADER.federation, HEADER.round, HEADER.task, HEADER.client, 10**12)
    assert codes(stochastic_bytes(later_sequence)) == codes(first)  # a re-send (new sequence): same values


@pytest.mark.parametrize(
    "change",
    [
        {"header": Header(Kind.UPDATE, "fed", 4, 1, "client-1", 7)},
        {"header": Header(Kind.UPDATE, "fed", 3, 1, "client-2", 7)},
        {"header": Header(Kind.ROUND, "fed", 3, 1, "client-1", 7)},
        {"name": "u"},
        {"seed": 6},
    ],
)
def test_stochastic_stream_depends_on_round_client_kind_tensor_and_seed(change):
    assert codes(stochastic_bytes(**change)) != codes(stochastic_bytes())


# ---------------------------------------------------------------- versions


def test_int8_coding_without_tensors_writes_v1():
    # docs/protocol.md P-VER-1: the lowest version that carries the frame
    frame = Frame(HEADER, {"a": 1})
    assert encode(frame, NEAREST) == encode(frame, "float32")
    assert encode(frame, NEAREST)[4] == 1


def test_values_cost_one_byte_each_plus_a_float32_scale_per_block():
    x = np.arange(130, dtype=np.float32) / 7
    float32_size = len(encode(Frame(HEADER, {}, {"t": x}), "float32"))
    for block, blocks in [(64, 3), (128, 2), (130, 1), (1, 130)]:
        size = len(encode(Frame(HEADER, {}, {"t": x}), ValueCoding("int8", block)))
        assert size == float32_size - 130 * 4 + 2 + 4 * blocks + 130


def test_sparse_layout_choice_counts_int8_bytes():
    """1% of 10,000 values goes as an index list, 60% as a bitmap, 100% dense: int8 sizes decide."""
    rng = np.random.default_rng(0)

    def layout(density: float) -> int:
        idx = np.sort(rng.choice(10_000, int(10_000 * density), replace=False))
        data = encode(Frame(HEADER, {}, {"t": SparseTensor((10_000,), idx, rng.uniform(1, 2, idx.size))}), NEAREST)
        return data[len(encode(Frame(HEADER))) - 2]

    assert (layout(0.01), layout(0.6), layout(1.0)) == (1, 2, 0)


# ---------------------------------------------------------------- decode validation


def int8_rec(data: bytes, layout=0, dims=(4,), nnz=None) -> bytes:
    return rec(layout=layout, dtype=3, dims=dims, nnz=nnz, data=data)


def v2(*records) -> bytes:
    return raw_frame(version=INT8_VERSION, tensors=list(records))


def test_raw_int8_frame_decodes_to_code_times_scale():
    dense = int8_rec(i8(2, [0.5, 0.25], [1, -2, 127, -127]))
    sparse = rec(b"s", layout=1, dtype=3, dims=(5,), nnz=2, data=u16(1, 3) + i8(64, [2.0], [3, -1]))
    got = decode(v2(dense, sparse))
    np.testing.assert_array_equal(got.tensors["t"], [0.5, -1.0, 31.75, -31.75])
    assert got.tensors["s"] == SparseTensor((5,), [1, 3], [6.0, -2.0])


MAX_SCALE = float(blockquant.MAX_SCALE)
BAD_INT8 = {
    "block 0": (v2(int8_rec(i8(0, [], [1, 1, 1, 1]))), "block"),
    "scale NaN": (v2(int8_rec(i8(4, [np.nan], [1, 1, 1, 1]))), r"scales\[0\]"),
    "scale Inf": (v2(int8_rec(i8(2, [1, np.inf], [1, 1, 1, 1]))), r"scales\[1\]"),
    "scale negative": (v2(int8_rec(i8(4, [-1], [1, 1, 1, 1]))), "scales"),
    "scale -0.0": (v2(int8_rec(i8(4, [-0.0], [0, 0, 0, 0]))), "scales"),
    "scale overflows float32": (v2(int8_rec(i8(4, [np.nextafter(np.float32(MAX_SCALE), np.inf)], [1] * 4))), "scales"),
    "code -128": (v2(int8_rec(i8(4, [1], [1, -128, 1, 1]))), r"codes\[1\]"),
    "scale 0, code non-zero": (v2(int8_rec(i8(2, [1, 0], [1, 1, 0, 5]))), r"codes\[3\].*scale 0"),
    "int8 in a v1 frame": (raw_frame(tensors=[int8_rec(i8(4, [1], [1, 1, 1, 1]))]), "needs v2"),
    "scales cut short": (v2(int8_rec(i8(2, [1], []))), "scales"),
    "codes cut short": (v2(int8_rec(i8(4, [1], [1, 1, 1]))), "codes"),
    "one code too many": (v2(int8_rec(i8(4, [1], [1, 1, 1, 1, 1]))), "trailing"),
    "one scale too many": (v2(int8_rec(i8(4, [1, 0], [1, 1, 1, 1]))), "trailing"),  # read as 4 zero codes
    "block missing": (v2(int8_rec(b"\x04")), "block"),
    "sparse codes cut short": (v2(int8_rec(u16(1, 3) + i8(64, [1], [1]), layout=1, dims=(5,), nnz=2)), "codes"),
}


@pytest.mark.parametrize("name", list(BAD_INT8))
def test_decode_rejects_bad_int8(name):
    data, field = BAD_INT8[name]
    with pytest.raises(CodecError, match=field):
        decode(data)


def test_largest_scale_decodes_finite():
    got = decode(v2(int8_rec(i8(4, [MAX_SCALE], [127, -127, 1, 0])))).tensors["t"]
    assert np.isfinite(got).all() and got[0] == np.float32(127 * MAX_SCALE)


# ---------------------------------------------------------------- encode validation


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"dtype": "int4"}, "value_dtype"),
        ({"dtype": "int8", "block": 0}, "block"),
        ({"dtype": "int8", "block": 65536}, "block"),
        ({"dtype": "int8", "block": 64.0}, "block"),
        ({"dtype": "int8", "rounding": "up"}, "rounding"),
        ({"dtype": "int8", "seed": 1.5}, "seed"),
    ],
)
def test_value_coding_rejects(kwargs, field):
    with pytest.raises(CodecError, match=field):
        ValueCoding(**kwargs)


@pytest.mark.parametrize(
    "tensor, field",
    [
        (np.array([1.0, np.nan], np.float32), "finite"),
        (SparseTensor((4,), [1], [np.inf]), "finite"),
        (np.array([1.0, 1e39]), "decode to float32"),
        (np.ones(3, bool), "dtype"),
    ],
)
def test_encode_rejects_for_int8(tensor, field):
    with pytest.raises(CodecError, match=field):
        encode(Frame(HEADER, {}, {"t": tensor}), NEAREST)


def test_negative_zeros_give_a_positive_zero_scale():
    x = np.array([-0.0, 0.0, -0.0, 1.0], np.float32)
    data = encode(Frame(HEADER, {}, {"t": x}), ValueCoding("int8", block=1))
    np.testing.assert_array_equal(decode(data).tensors["t"], [0, 0, 0, 1])


def test_float32_extremes_encode_and_decode():
    x = np.array([np.finfo(np.float32).max, -np.finfo(np.float32).max, 1e-45, 0], np.float32)
    got = decode(encode(Frame(HEADER, {}, {"t": x}), ValueCoding("int8", block=2))).tensors["t"]
    assert np.isfinite(got).all()
    assert_within_bound(x.astype(np.float64), got.astype(np.float64), 2, "nearest")


# ---------------------------------------------------------------- fuzz


def int8_frame() -> Frame:
    few = np.zeros(300, np.float32)
    few[[3, 40, 299]] = [1.5, -2.0, 1e-3]
    return Frame(
        HEADER,
        {"n": 5},
        {
            "w": np.linspace(-3, 3, 150, dtype=np.float32).reshape(10, 15),
            "few": SparseTensor.from_dense(few),
            "many": SparseTensor.from_dense(np.where(np.arange(300) % 3, few + 0.5, 0)),
        },
    )


def test_every_truncation_of_an_int8_frame_rejected():
    body = encode(int8_frame(), NEAREST)[:-4]
    for n in range(len(body)):
        with pytest.raises(CodecError):
            decode(reseal(body[:n]))


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["set", "insert", "delete"]), st.integers(0, 10**6), st.integers(0, 255)),
        min_size=1,
        max_size=4,
    ),
    st.sampled_from(["nearest", "stochastic"]),
)
def test_fuzz_mutated_int8_frames(edits, rounding):
    try:
        frame = decode(mutated(encode(int8_frame(), ValueCoding("int8", 16, rounding)), edits))
    except CodecError:
        return
    for t in frame.tensors.values():  # whatever is accepted reads back as finite float32
        values = t.values if isinstance(t, SparseTensor) else t
        assert values.dtype == np.float32 and np.isfinite(values).all()
    encode(frame, NEAREST)  # and can be sent on again


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_fuzz_random_int8_records(data):
    """Arbitrary bytes as a v2 tensor record's values: rejected or finite, never anything else."""
    try:
        frame = decode(v2(int8_rec(data, dims=(7,))))
    except CodecError:
        return
    assert np.isfinite(frame.tensors["t"]).all()


@pytest.mark.parametrize(
    "coding, scale",
    [
        *((c, s) for c in (NEAREST, STOCHASTIC, ValueCoding("int8", block=7)) for s in (1e-6, 1.0, 1e4)),
        *((ValueCoding("float16"), s) for s in (1.0, 1e4)),  # float16's bound holds in its normal range
    ],
)
def test_norm_error_bounds_what_a_tensor_loses_on_the_wire(coding, scale):
    """``ValueCoding.norm_error``: what a receiver may allow a norm to grow by (FedET's class sums)."""
    rng = np.random.default_rng(int(scale * 1e6) % 97)
    for shape in [(1, 384), (3, 50), (1000,)]:
        sent = (rng.standard_normal(shape) * rng.choice([1.0, 0.01], shape) * scale).astype(np.float32)
        got = decode(encode(Frame(HEADER, {}, {"t": sent}), coding)).tensors["t"]
        error = np.linalg.norm(got.astype(np.float64) - sent) / np.linalg.norm(sent.astype(np.float64))
        assert 0 < error <= coding.norm_error()


def test_norm_error_by_hand():
    assert NEAREST.norm_error() == pytest.approx(8 / 254, rel=1e-5)  # sqrt(64) / 254
    assert STOCHASTIC.norm_error() == pytest.approx(8 / 127, rel=1e-5)
    assert ValueCoding("float32").norm_error() == 0.0
