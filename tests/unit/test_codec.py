"""Tests for the wire codec (fclcore.codec): frame layout, float values; int8 in test_codec_int8."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.frames import f32, mutated, raw_frame, rec, reseal, u16

from fclcore.codec import (
    CodecError,
    CodecLimits,
    Frame,
    Header,
    Kind,
    SparseTensor,
    decode,
    encode,
)

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
HEADER = Header(Kind.UPDATE, "fed", 3, 1, "client-1", 7)


# ---------------------------------------------------------------- helpers


def as_dense(t) -> np.ndarray:
    return t.to_dense() if isinstance(t, SparseTensor) else t


def small_frame() -> Frame:
    """A frame that contains all three layouts (dense, index list, bitmap)."""
    few = np.zeros(64, np.float32)
    few[[3, 40]] = [1.5, -2.0]
    many = np.zeros(64, np.float32)
    many[:40] = np.arange(1, 41)
    return Frame(
        HEADER,
        {"lr": 0.1, "n": 5},
        {
            "w": np.arange(6, dtype=np.float32).reshape(2, 3),
            "few": SparseTensor.from_dense(few),
            "many": SparseTensor.from_dense(many),
        },
    )


# ---------------------------------------------------------------- round trip

shapes = st.lists(st.integers(1, 6), min_size=1, max_size=4).map(tuple)


@st.composite
def tensors(draw):
    shape = draw(shapes)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    scale = draw(st.sampled_from([1e-6, 1.0, 1e3, 6e4]))
    dense = (rng.uniform(-1, 1, shape) * scale).astype(np.float32)
    density = draw(st.sampled_from([0.0, 0.01, 0.5, 1.0]))
    mask = rng.random(shape) < density
    if draw(st.booleans()):
        return np.where(mask, dense, 0).astype(np.float32)
    return SparseTensor.from_dense(dense, mask)  # may keep explicit zeros: that's fine


json_leaf = (
    st.none()
    | st.booleans()
    | st.integers(-(2**53), 2**53)
    | st.text(max_size=8)
    | st.floats(allow_nan=False, allow_infinity=False)
)
json_values = st.recursive(
    json_leaf, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3), max_leaves=8
)
headers = st.builds(
    Header,
    st.sampled_from(list(Kind)),
    st.text(max_size=20),
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**32 - 1),
    st.text(max_size=20),
    st.integers(0, 2**64 - 1),
)
frames = st.builds(
    Frame,
    headers,
    st.dictionaries(st.text(max_size=10), json_values, max_size=4),
    st.dictionaries(st.text(min_size=1, max_size=12), tensors(), max_size=4),
)


@FAST
@given(frames, st.sampled_from(["float32", "float16"]))
def test_round_trip(frame, value_dtype):
    out = decode(encode(frame, value_dtype))
    assert out.header == frame.header and isinstance(out.header.kind, Kind)
    assert out.meta == frame.meta
    assert list(out.tensors) == list(frame.tensors)
    for name, sent in frame.tensors.items():
        got = out.tensors[name]
        expected = as_dense(sent).astype(np.float32)
        if value_dtype == "float16":
            expected = expected.astype(np.float16).astype(np.float32)
        np.testing.assert_array_equal(as_dense(got), expected)
        if isinstance(sent, np.ndarray):
            assert isinstance(got, np.ndarray)
        if isinstance(got, SparseTensor):
            assert got.indices.dtype == np.int64 and got.values.dtype == np.float32
            np.testing.assert_array_equal(got.indices, sent.indices)
        else:
            assert got.dtype == np.float32 and got.shape == expected.shape


@pytest.mark.parametrize("numel", [65536, 65537, 70000])
# docs/protocol.md P-5.2
def test_index_width_boundary(numel):
    """u16 indices up to 65536 elements, u32 beyond; the last index must survive."""
    sparse = SparseTensor((numel,), [0, numel - 1], [1.0, 2.0])
    out = decode(encode(Frame(HEADER, {}, {"t": sparse}))).tensors["t"]
    assert out == sparse


def test_scalar_and_decoded_arrays_are_independent_copies():
    buf = bytearray(encode(Frame(HEADER, {}, {"s": np.array(2.5, np.float32)})))
    out = decode(buf).tensors["s"]
    buf[:] = bytes(len(buf))
    assert out.shape == () and out == 2.5 and out.flags.writeable


# ---------------------------------------------------------------- layout choice


def layout_of(data: bytes) -> int:
    """Layout byte of the single tensor named 't' (right after count u16 + name)."""
    base = len(encode(Frame(HEADER)))  # count u16 sits at base-6, CRC after it
    return data[base - 2]


def sparse_of(numel: int, density: float) -> SparseTensor:
    rng = np.random.default_rng(0)
    idx = np.sort(rng.choice(numel, size=int(numel * density), replace=False))
    return SparseTensor((numel,), idx, rng.uniform(1, 2, idx.size))


@pytest.mark.parametrize("value_dtype", ["float32", "float16"])
# docs/protocol.md P-5.5
def test_encoder_picks_smallest_layout(value_dtype):
    numel = 10000
    dense_size = len(encode(Frame(HEADER, {}, {"t": np.ones(numel, np.float32)}), value_dtype))
    sizes, layouts = {}, {}
    for density in (0.0, 0.01, 0.05, 0.3, 0.6, 1.0):
        data = encode(Frame(HEADER, {}, {"t": sparse_of(numel, density)}), value_dtype)
        sizes[density], layouts[density] = len(data), layout_of(data)
    assert layouts[0.01] == 1 and layouts[0.6] == 2 and layouts[1.0] == 0
    assert sizes[0.0] < sizes[0.01] < sizes[0.05] < sizes[0.3] < sizes[0.6] <= dense_size
    assert sizes[1.0] == dense_size
    # index list beats bitmap at 1%, bitmap beats index list at 60%: compare with the other layout
    vb, bitmap_bytes = (4 if value_dtype == "float32" else 2), numel // 8
    assert sizes[0.01] - sizes[0.0] == 100 * (2 + vb) < bitmap_bytes + 100 * vb
    assert isinstance(decode(encode(Frame(HEADER, {}, {"t": sparse_of(numel, 1.0)}))).tensors["t"], np.ndarray)


def test_dense_ndarray_is_always_dense():
    data = encode(Frame(HEADER, {}, {"t": np.zeros(10000, np.float32)}))
    assert layout_of(data) == 0 and isinstance(decode(data).tensors["t"], np.ndarray)


# ---------------------------------------------------------------- sparse API


def test_sparse_tensor_api():
    dense = np.array([[0, 1.5], [0, -2]], np.float32)
    s = SparseTensor.from_dense(dense)
    assert s.nnz == 2 and s.indices.tolist() == [1, 3] and s.indices.dtype == np.int64
    np.testing.assert_array_equal(s.to_dense(), dense)
    np.testing.assert_array_equal(s.to_dense(fill=9), [[9, 1.5], [9, -2]])
    m = SparseTensor.from_dense(dense, mask=np.array([[True, False], [False, False]]))
    assert m.nnz == 1 and m.values.tolist() == [0.0]
    with pytest.raises(CodecError, match="mask shape"):
        SparseTensor.from_dense(dense, mask=np.ones(3, bool))
    for shape, idx, vals in [
        ((4,), [2, 1], [1, 1]),
        ((4,), [1, 1], [1, 1]),
        ((4,), [4], [1]),
        ((4,), [-1], [1]),
        ((4,), [1, 2], [1]),
        ((0, 4), [], []),
        ((4,), [0.5], [1]),
        ((4,), [2**62, -(2**63)], [1, 1]),
    ]:  # np.diff would wrap around here
        with pytest.raises(CodecError):
            SparseTensor(shape, idx, vals)


# ---------------------------------------------------------------- decode rejections


# docs/protocol.md P-5.1
def test_raw_builder_matches_spec():
    sparse_idx = rec(b"i", layout=1, dims=(10,), nnz=2, data=u16(1, 7) + f32(1, 2))
    sparse_bits = rec(
        b"b", layout=2, dtype=2, dims=(2, 5), nnz=2, data=bytes([0b0000_0110, 0]) + np.array([3, 4], "<f2").tobytes()
    )
    frame = decode(raw_frame(meta=b'{"a":[1,2.5]}', tensors=[rec(), sparse_idx, sparse_bits]))
    assert frame.header == Header(Kind.UPDATE, "f", 1, 0, "c", 9) and frame.meta == {"a": [1, 2.5]}
    np.testing.assert_array_equal(frame.tensors["t"], np.ones(4))
    assert frame.tensors["i"].indices.tolist() == [1, 7]
    assert frame.tensors["b"].indices.tolist() == [1, 2] and frame.tensors["b"].shape == (2, 5)


def test_a_frame_checked_without_keeping_its_tensors_is_still_checked_whole():
    """``keep_tensors`` False (a knowledge frame the daemon only stores): the same header and
    meta, no tensors, and every tensor still validated (a bad one later in the frame, or a
    repeated name, is refused as by a full decode)."""
    sparse = rec(b"i", layout=1, dims=(10,), nnz=2, data=u16(1, 7) + f32(1, 2))
    good = raw_frame(meta=b'{"a":1}', tensors=[rec(), sparse])
    full = decode(good)
    light = decode(good, keep_tensors=lambda header: header.kind is not Kind.UPDATE)
    assert light.header == full.header and light.meta == full.meta and light.tensors == {}
    assert decode(good, keep_tensors=lambda header: True).tensors.keys() == full.tensors.keys()
    nan = rec(b"n", data=f32(1, 2, float("nan"), 4))
    unsorted = rec(b"u", layout=1, dims=(10,), nnz=2, data=u16(7, 1) + f32(1, 2))
    for bad in ([rec(), nan], [rec(), unsorted], [rec(), rec()]):
        with pytest.raises(CodecError) as expected:
            decode(raw_frame(tensors=bad))
        with pytest.raises(CodecError) as got:
            decode(raw_frame(tensors=bad), keep_tensors=lambda header: False)
        assert str(got.value) == str(expected.value)


BAD_FRAMES = {
    "magic": (raw_frame(magic=b"FCLX"), "magic"),
    "version 0": (raw_frame(version=0), "version"),  # docs/protocol.md P-VER-2: versions not decoded
    "version 3": (raw_frame(version=3), "version"),
    "kind 0": (raw_frame(kind=0), "kind"),
    "kind 10": (raw_frame(kind=10), "kind"),
    "flags": (raw_frame(flags=1), "flags"),
    "federation utf8": (raw_frame(fed=b"\xff"), "federation"),
    "client utf8": (raw_frame(client=b"a\xc3"), "client"),
    "meta utf8": (raw_frame(meta=b'{"\xff":1}'), "meta"),
    "meta not object": (raw_frame(meta=b"[1]"), "meta"),
    "meta empty": (raw_frame(meta=b""), "meta"),
    "meta NaN": (raw_frame(meta=b'{"a":NaN}'), "meta"),
    "meta -Infinity": (raw_frame(meta=b'{"a":-Infinity}'), "meta"),
    "meta 1e999": (raw_frame(meta=b'{"a":1e999}'), "meta"),
    "meta duplicate key": (raw_frame(meta=b'{"a":1,"a":2}'), "meta key"),
    "meta deep nesting": (raw_frame(meta=b"[" * 30000 + b"]" * 30000), "meta"),
    "meta bad json": (raw_frame(meta=b"{'a':1}"), "meta"),
    "duplicate name": (raw_frame(tensors=[rec(), rec()]), "name"),
    "empty name": (raw_frame(tensors=[rec(name=b"")]), "name"),
    "name utf8": (raw_frame(tensors=[rec(name=b"\xfe")]), "name"),
    "layout": (raw_frame(tensors=[rec(layout=3)]), "layout"),
    "dtype 0": (raw_frame(tensors=[rec(dtype=0)]), "dtype"),
    "dtype 3 (int8) in a v1 frame": (raw_frame(tensors=[rec(dtype=3)]), "needs v2"),  # P-VER-2
    "dtype 4": (raw_frame(version=2, tensors=[rec(dtype=4)]), "dtype"),
    "ndim": (raw_frame(tensors=[rec(dims=(1,) * 9)]), "ndim"),
    "zero dim": (raw_frame(tensors=[rec(dims=(2, 0), data=b"")]), "dims"),
    "numel": (raw_frame(tensors=[rec(dims=(2**16, 2**16), data=b"")]), "numel"),
    "nnz > numel": (raw_frame(tensors=[rec(layout=1, dims=(2,), nnz=3, data=u16(0, 1, 2) + f32(1, 1, 1))]), "nnz"),
    "index repeated": (raw_frame(tensors=[rec(layout=1, dims=(4,), nnz=2, data=u16(1, 1) + f32(1, 1))]), "increasing"),
    "index decreasing": (
        raw_frame(tensors=[rec(layout=1, dims=(4,), nnz=2, data=u16(2, 1) + f32(1, 1))]),
        "increasing",
    ),
    "index >= numel": (raw_frame(tensors=[rec(layout=1, dims=(4,), nnz=2, data=u16(1, 4) + f32(1, 1))]), "numel"),
    "popcount": (raw_frame(tensors=[rec(layout=2, dims=(8,), nnz=1, data=bytes([3]) + f32(1))]), "popcount"),
    "bitmap padding": (raw_frame(tensors=[rec(layout=2, dims=(5,), nnz=1, data=bytes([0x80]) + f32(1))]), "bitmap"),
    "dense NaN": (raw_frame(tensors=[rec(dims=(2,), data=f32(1, np.nan))]), "finite"),
    "dense Inf": (raw_frame(tensors=[rec(dims=(2,), data=f32(-np.inf, 1))]), "finite"),
    "float16 Inf": (raw_frame(tensors=[rec(dtype=2, dims=(1,), data=np.array([np.inf], "<f2").tobytes())]), "finite"),
    "sparse NaN": (raw_frame(tensors=[rec(layout=1, dims=(4,), nnz=1, data=u16(1) + f32(np.nan))]), "finite"),
    "trailing": (raw_frame(tensors=[rec()], extra=b"\x00"), "trailing"),
    "count too big": (raw_frame(count=2, tensors=[rec()]), "bytes left"),
    "too many tensors": (raw_frame(count=257), "tensor count"),
    "short dense data": (raw_frame(tensors=[rec(dims=(4,), data=f32(1, 2))]), "values"),
    "empty": (b"", "frame size"),
    "crc only": (reseal(b""), "header"),
}


@pytest.mark.parametrize("name", list(BAD_FRAMES))
# docs/protocol.md P-4.1, P-4.2, P-5.2, P-5.3, P-5.7
def test_decode_rejects(name):
    data, field = BAD_FRAMES[name]
    with pytest.raises(CodecError, match=field):
        decode(data)


def _reference_index_error(indices: list[int], numel: int) -> str | None:
    """The rule, spelled out slowly: any index out of range is reported (the lowest below 0,
    else the highest), and only then the first that does not increase."""
    if not indices:
        return None
    low, high = min(indices), max(indices)
    if low < 0 or high >= numel:
        return f"got {low if low < 0 else high}, expected 0 <= index < {numel} (numel)"
    for i in range(1, len(indices)):
        if indices[i] <= indices[i - 1]:
            return f"[{i}]: got {indices[i]}, expected > {indices[i - 1]} (strictly increasing)"
    return None


@FAST
@given(st.lists(st.integers(-3, 12), max_size=8), st.integers(1, 10), st.booleans())
def test_index_check_reports_what_the_rule_says(indices, numel, ordered):
    """The one-pass check (neighbours first, the ends as the range) reports exactly what the
    rule does, for sorted and unsorted input alike."""
    indices = sorted(set(indices)) if ordered else indices
    expected = _reference_index_error(indices, numel)
    if expected is None:
        assert SparseTensor((numel,), indices, [1.0] * len(indices)).nnz == len(indices)
        return
    with pytest.raises(CodecError) as raised:
        SparseTensor((numel,), indices, [1.0] * len(indices))
    assert str(raised.value).endswith(expected), (str(raised.value), expected)


@FAST
@given(st.integers(1, 70), st.integers(0, 2**32 - 1))
# docs/protocol.md P-5.3
def test_bitmap_decodes_to_its_set_bits_and_refuses_every_padding_bit(numel, seed):
    mask = np.random.default_rng(seed).random(numel) < 0.3
    nnz = int(mask.sum())
    packed = np.packbits(mask, bitorder="little")
    record = rec(layout=2, dims=(numel,), nnz=nnz, data=packed.tobytes() + f32(*range(nnz)))
    tensor = decode(raw_frame(tensors=[record])).tensors["t"]
    np.testing.assert_array_equal(tensor.indices, np.flatnonzero(mask))
    np.testing.assert_array_equal(tensor.values, np.arange(nnz, dtype=np.float32))
    for bit in range(numel, 8 * packed.size):  # each padding bit alone is refused
        bad = packed.copy()
        bad[-1] |= 1 << (bit % 8)
        with pytest.raises(CodecError, match="padding"):
            decode(raw_frame(tensors=[rec(layout=2, dims=(numel,), nnz=nnz, data=bad.tobytes() + f32(*range(nnz)))]))


def test_error_message_names_value_and_expectation():
    with pytest.raises(CodecError, match=r"header\.version: got 3, expected 1 or 2"):
        decode(raw_frame(version=3))


# docs/protocol.md P-4.6, P-4.7
def test_checksum_mismatch():
    data = bytearray(encode(small_frame()))
    data[-1] ^= 0x01
    with pytest.raises(CodecError, match="checksum"):
        decode(bytes(data))


# docs/protocol.md P-4.4, P-4.7
def test_size_limit_checked_first():
    data = encode(small_frame())
    limits = CodecLimits(max_frame_bytes=len(data) - 1)
    with pytest.raises(CodecError, match="max_frame_bytes"):
        decode(data, limits)
    with pytest.raises(CodecError, match="max_frame_bytes"):  # garbage: size beats CRC
        decode(b"\x00" * 100, CodecLimits(max_frame_bytes=50))
    assert decode(data, CodecLimits(max_frame_bytes=len(data))).header == HEADER


# docs/protocol.md P-4.4
def test_decode_limits():
    data = encode(small_frame())
    with pytest.raises(CodecError, match="max_tensors"):
        decode(data, CodecLimits(max_tensors=2))
    with pytest.raises(CodecError, match="max_meta_bytes"):
        decode(data, CodecLimits(max_meta_bytes=5))
    with pytest.raises(CodecError, match="max_elements"):
        decode(data, CodecLimits(max_elements=10))
    with pytest.raises(CodecError, match="name"):
        decode(data, CodecLimits(max_name_bytes=3))
    with pytest.raises(CodecError, match="max_ndim"):
        decode(data, CodecLimits(max_ndim=1))


def test_not_bytes():
    for bad in ("FCLW", 123, None, np.zeros((4, 4))[:, 0]):
        with pytest.raises(CodecError):
            decode(bad)


def test_every_truncation_rejected():
    data = encode(small_frame())
    for n in range(len(data)):
        with pytest.raises(CodecError):
            decode(data[:n])
    body = data[:-4]
    for n in range(len(body)):  # with a valid CRC: exercises every short read in the parser
        with pytest.raises(CodecError):
            decode(reseal(body[:n]))


def test_every_byte_corruption_rejected():
    data = encode(small_frame())
    for i in range(len(data)):
        for mask in (0x01, 0xFF):
            bad = bytearray(data)
            bad[i] ^= mask
            with pytest.raises(CodecError):
                decode(bytes(bad))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.booleans())
def test_fuzz_random_bytes(data, sealed):
    try:
        decode(reseal(data) if sealed else data)
    except CodecError:
        pass


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["set", "insert", "delete"]), st.integers(0, 10**6), st.integers(0, 255)),
        min_size=1,
        max_size=4,
    ),
    st.sampled_from(["float32", "float16"]),
)
def test_fuzz_mutated_frames(edits, value_dtype):
    try:
        frame = decode(mutated(encode(small_frame(), value_dtype), edits))
    except CodecError:
        return
    assert isinstance(frame, Frame)
    encode(frame)  # anything the decoder accepts must be encodable again


# ---------------------------------------------------------------- encode rejections


def frame_with(**tensors) -> Frame:
    return Frame(HEADER, {}, tensors)


def header_with(**changes) -> Frame:
    fields = dict(kind=Kind.ROUND, federation="f", round=0, task=0, client="c", sequence=0)
    fields.update(changes)
    return Frame(Header(**fields))


BAD_INPUTS = {
    "dense NaN": (frame_with(t=np.array([1, np.nan], np.float32)), "finite"),
    "dense Inf": (frame_with(t=np.array([np.inf], np.float64)), "finite"),
    "sparse NaN": (frame_with(t=SparseTensor((4,), [1], [np.nan])), "finite"),
    "float64 overflow to float32": (frame_with(t=np.array([1e300])), "overflows float32"),
    "zero-size dense": (frame_with(t=np.zeros((0, 3), np.float32)), "dim"),
    "bool dense": (frame_with(t=np.ones(3, bool)), "dtype"),
    "not a tensor": (frame_with(t=[1.0, 2.0]), "ndarray or SparseTensor"),
    "empty name": (Frame(HEADER, {}, {"": np.ones(1, np.float32)}), "non-empty"),
    "long name": (Frame(HEADER, {}, {"a" * 256: np.ones(1, np.float32)}), "name"),
    "non-str name": (Frame(HEADER, {}, {1: np.ones(1, np.float32)}), "name"),
    "negative round": (header_with(round=-1), "round"),
    "negative task": (header_with(task=-1), "task"),
    "negative sequence": (header_with(sequence=-1), "sequence"),
    "round too big": (header_with(round=2**32), "round"),
    "sequence too big": (header_with(sequence=2**64), "sequence"),
    "bool round": (header_with(round=True), "round"),
    "float task": (header_with(task=1.0), "task"),
    "unknown kind": (header_with(kind=99), "kind"),
    "federation too long": (header_with(federation="é" * 128), "federation"),
    "client too long": (header_with(client="x" * 256), "client"),
    "client surrogate": (header_with(client="\ud800"), "client"),
    "meta NaN": (Frame(HEADER, {"a": float("nan")}), "meta"),
    "meta non-str key": (Frame(HEADER, {1: 2}), "meta key"),
    "meta object": (Frame(HEADER, {"a": object()}), "meta"),
    "meta not dict": (Frame(HEADER, [1]), "meta"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_encode_rejects(name):
    frame, field = BAD_INPUTS[name]
    with pytest.raises(CodecError, match=field):
        encode(frame)


def test_federation_limit_is_in_bytes_not_chars():
    encode(header_with(federation="é" * 127))  # 254 bytes: fine


# docs/protocol.md P-5.6
def test_encode_float16_overflow():
    frame = frame_with(t=np.array([1.0, 70000.0], np.float32))
    encode(frame, "float32")
    with pytest.raises(CodecError, match="overflows float16"):
        encode(frame, "float16")
    with pytest.raises(CodecError, match="overflows float16"):
        encode(frame_with(t=SparseTensor((4,), [2], [-1e5])), "float16")
    with pytest.raises(CodecError, match="overflows float16"):  # integers are checked too
        encode(frame_with(t=np.array([1, 70000], np.int32)), "float16")


def test_encode_mutated_sparse_tensor():
    """Arrays stay mutable inside the frozen dataclass, so encode re-validates."""
    s = SparseTensor((10,), [1, 5], [1.0, 2.0])
    s.indices[:] = [5, 1]
    with pytest.raises(CodecError, match="increasing"):
        encode(frame_with(t=s))
    s.indices[:] = [1, 10]
    with pytest.raises(CodecError, match="numel"):
        encode(frame_with(t=s))


def test_encode_limits():
    frame = small_frame()
    size = len(encode(frame))
    with pytest.raises(CodecError, match="max_frame_bytes"):
        encode(frame, limits=CodecLimits(max_frame_bytes=size - 1))
    assert len(encode(frame, limits=CodecLimits(max_frame_bytes=size))) == size
    with pytest.raises(CodecError, match="max_tensors"):
        encode(frame, limits=CodecLimits(max_tensors=2))
    with pytest.raises(CodecError, match="max_elements"):
        encode(frame, limits=CodecLimits(max_elements=10))
    with pytest.raises(CodecError, match="max_ndim"):
        encode(frame, limits=CodecLimits(max_ndim=1))
    with pytest.raises(CodecError, match="max_meta_bytes"):
        encode(frame, limits=CodecLimits(max_meta_bytes=5))
    with pytest.raises(CodecError, match="name"):
        encode(frame, limits=CodecLimits(max_name_bytes=2))
    with pytest.raises(CodecError, match="value_dtype"):
        encode(frame, "float64")


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=4096), start=st.integers(0, 2**32 - 1), cut=st.integers(0, 4096))
def test_the_codec_crc_is_zlibs(data, start, cut):
    """ISA-L's CRC32 (the ``fast`` extra) and zlib's agree, continued from any value and in pieces,
    so a frame sealed by either side checks on the other."""
    import zlib

    from fclcore import crc

    cut = min(cut, len(data))
    assert crc.crc32(data, start) == zlib.crc32(data, start)
    assert crc.crc32(memoryview(data)[cut:], crc.crc32(data[:cut])) == zlib.crc32(data)


def test_the_fast_crc_is_in_use_when_installed():
    """With ``isal`` importable the codec checks frames with it (CI installs it)."""
    pytest.importorskip("isal")
    from fclcore import crc

    assert crc.implementation() == "isal"
