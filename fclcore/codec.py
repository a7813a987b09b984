"""Wire codec v1/v2: the binary frame format exchanged over MQTT.

Why a custom format: pickle executes code on load and must never touch bytes
from the network; JSON floats are large and slow; edge links need sparse
updates.  Frames arrive from untrusted peers, so the decoder validates every
field and turns every problem into a single :class:`CodecError` whose message
names the field, the value received and what was expected.

All integers are little-endian.  Frame layout::

    size     field
    -------  -----------------------------------------------------------
    4        magic  b"FCLW"
    1        version      u8   (1, or 2 when a tensor has int8 values)
    1        kind         u8   (see Kind)
    2        flags        u16  (must be 0)
    4        round        u32
    4        task         u32
    8        sequence     u64
    1 + n    federation   u8 length n + UTF-8
    1 + n    client       u8 length n + UTF-8
    4 + n    meta         u32 length n + UTF-8 JSON object (finite numbers only)
    2        tensor count u16
    ...      tensor records, `count` times (below)
    4        CRC32        zlib.crc32 of every preceding byte (fclcore.crc)

Tensor record::

    size     field
    -------  -----------------------------------------------------------
    1 + n    name         u8 length n + UTF-8 (non-empty, unique)
    1        layout       u8: 0 dense | 1 sparse index list | 2 sparse bitmap
    1        dtype        u8: 1 float32 | 2 float16 | 3 int8 blocks (v2 only)
    1        ndim         u8
    4*ndim   dims         u32 each, every dim >= 1 (ndim 0 is a scalar)
    4        nnz          u32, sparse layouts only
    ...      data         dense:  numel values
                          index:  nnz indices (u16 if numel <= 65536 else
                                  u32; implied by numel), then nnz values
                          bitmap: ceil(numel/8) bytes (packbits, little bit
                                  order, padding bits 0), then nnz values
                                  in index order

"values" above is ``count`` values (numel dense, nnz sparse): float32 or float16 as they
are, or for dtype 3 (int8 blocks)::

    2        block        u16, >= 1: values per scale
    4*b      scales       b = ceil(count / block) float32, finite, >= 0 (sign bit clear),
                          <= MAX_SCALE (127 * scale fits in float32); 0 only for all-zero codes
    count    codes        i8 each in [-127, 127] (-128 is rejected); value = code * scale

Values are always decoded to float32; NaN/Inf are rejected in both directions.

Versions: v2 is v1 plus dtype 3.  The encoder writes version 2 only when the frame carries
an int8 tensor, so a frame without one is byte for byte what v1 wrote and a v1 peer reads
it; the decoder reads both and refuses dtype 3 inside a v1 frame.

int8 error bound (``fclcore.blockquant``).  Values are cut into consecutive blocks of
``block`` entries in flat order of what is sent (all numel entries dense, the nnz values
sparse).  A block's scale is s = max|block| / 127, rounded up to float32, and exactly
s = 1 for a block of integers within [-127, 127] (those are then sent without error).
Nearest rounding (default): |x - q(x)| <= s / 2.  Stochastic rounding (``rounding=
"stochastic"``): |x - q(x)| < s and E[q(x)] = x; its random stream is seeded from
``ValueCoding.seed``, the header (kind, federation, round, task, client) and the tensor
name, never from global RNG state, so a re-run (or a re-send of the same update) writes the
same bytes.  The sequence number is left out on purpose: a device may renumber a frame
(``with_sequence``) and the values must stay the same.
Both bounds are on the exact product code * s; the decoder then rounds it to float32
once (at most half a float32 ulp of the value more).
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
import operator
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, NoReturn

import numpy as np

from fclcore import blockquant
from fclcore.crc import crc32
from fclcore.errors import BadInput

MAGIC = b"FCLW"
VERSION = 1  # what a frame without int8 values is written as
INT8_VERSION = 2  # the version that added dtype 3 (int8 blocks)
SPOKEN = (VERSION, INT8_VERSION)  # the frame versions ``decode`` reads (a NACK names them)

_HEAD = struct.Struct("<4sBBHIIQ")
_TENSOR_HEAD = struct.Struct("<BBB")
_U8, _U16, _U32 = struct.Struct("<B"), struct.Struct("<H"), struct.Struct("<I")
_U8_MAX, _U16_MAX, _U32_MAX, _U64_MAX = 2**8 - 1, 2**16 - 1, 2**32 - 1, 2**64 - 1
_SMALL_NUMEL = 65536  # up to this many elements every flat index fits in a u16
DENSE, INDEX, BITMAP = 0, 1, 2
_LAYOUTS = "0 (dense), 1 (index list) or 2 (bitmap)"
_DTYPES = {"float32": (1, np.dtype("<f4")), "float16": (2, np.dtype("<f2"))}
_DTYPE_BY_CODE = {code: dt for code, dt in _DTYPES.values()}
INT8 = 3  # dtype code of int8 block values
VALUE_DTYPES = ("float32", "float16", "int8")
ROUNDINGS = ("nearest", "stochastic")


def dtype_code(value_dtype: str) -> int:
    """The wire code of a value dtype name (1 float32, 2 float16, 3 int8)."""
    return INT8 if value_dtype == "int8" else _DTYPES[value_dtype][0]


def max_value(value_dtype: str) -> float:
    """The largest |value| a tensor value can have and still be sent as ``value_dtype``."""
    if value_dtype not in VALUE_DTYPES:
        _fail("value_dtype", repr(value_dtype), " or ".join(map(repr, VALUE_DTYPES)))
    return float(np.finfo(np.float16 if value_dtype == "float16" else np.float32).max)  # int8 reads back as float32


class CodecError(BadInput):
    """The one error raised for malformed frames or unencodable input."""


def _fail(field_name: str, got: Any, expected: str) -> NoReturn:
    raise CodecError(f"{field_name}: got {got}, expected {expected}")


class Kind(enum.IntEnum):
    ROUND = 1  # aggregator -> clients: round announcement (+ global tensors)
    UPDATE = 2  # client -> aggregator: local update
    EVAL = 3  # client -> aggregator: evaluation report
    FINISH = 4  # aggregator -> clients: run finished (+ final tensors)
    STATUS = 5  # status messages
    ACK = 6  # aggregator -> client acknowledgement
    KNOWLEDGE = 7  # aggregator -> one client: knowledge-base entries for its next task
    REQUEST = 8  # aggregator -> clients: re-send your update for this round (meta.missing names who)
    MODEL = 9  # aggregator -> a device that must resync, retained: the global model (full or catch-up)


@dataclass(frozen=True)
class SparseTensor:
    """A tensor given by its non-zero (or masked-in) entries.

    The constructor normalises and validates, but numpy arrays stay mutable,
    so :func:`encode` validates again before anything reaches the wire.
    """

    shape: tuple[int, ...]
    indices: np.ndarray  # int64 flat C-order indices, strictly increasing
    values: np.ndarray  # float32 (or float16), same length as indices

    def __post_init__(self) -> None:
        shape = _check_shape(self.shape, "SparseTensor.shape")
        indices, values = np.asarray(self.indices), np.asarray(self.values)
        if indices.dtype.kind not in "iu" and indices.size == 0:
            indices = indices.astype(np.int64)  # np.asarray([]) is float64
        if indices.dtype.kind not in "iu":
            _fail("SparseTensor.indices", f"dtype {indices.dtype}", "an integer array")
        if values.dtype.kind not in "fiu":
            _fail("SparseTensor.values", f"dtype {values.dtype}", "real numbers")
        if values.dtype != np.float16:
            with np.errstate(over="ignore"):  # overflow becomes inf, which encode() rejects
                values = values.astype(np.float32, copy=False)
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "indices", indices.astype(np.int64, copy=False))
        object.__setattr__(self, "values", values)
        self._validate("SparseTensor")

    def _validate(self, where: str) -> None:
        if self.indices.ndim != 1 or self.values.ndim != 1:
            _fail(f"{where}.indices/values ndim", (self.indices.ndim, self.values.ndim), "(1, 1)")
        if self.indices.shape != self.values.shape:
            _fail(f"{where}.values length", len(self.values), f"{len(self.indices)} (one per index)")
        _check_indices(self.indices, math.prod(self.shape), f"{where}.indices")

    @classmethod
    def from_dense(cls, dense: np.ndarray, mask: np.ndarray | None = None) -> SparseTensor:
        """Keep the entries where `mask` is true (default: the non-zero entries)."""
        dense = np.asarray(dense)
        mask = dense != 0 if mask is None else np.asarray(mask, dtype=bool)
        if mask.shape != dense.shape:
            _fail("SparseTensor.from_dense mask shape", mask.shape, f"{dense.shape} (the dense shape)")
        flat = np.flatnonzero(mask)
        return cls(dense.shape, flat, dense.reshape(-1)[flat])

    def to_dense(self, fill: float = 0.0) -> np.ndarray:
        out = np.full(math.prod(self.shape), fill, dtype=np.float32)
        out[self.indices] = self.values
        return out.reshape(self.shape)

    @property
    def nnz(self) -> int:
        return int(self.indices.size)

    def __eq__(self, other: object) -> bool:  # arrays make the generated __eq__ unusable
        if not isinstance(other, SparseTensor):
            return NotImplemented
        return (
            self.shape == other.shape
            and np.array_equal(self.indices, other.indices)
            and np.array_equal(self.values, other.values)
        )


class PackedSparse(SparseTensor):
    """A sparse tensor as the decoder read it: its positions stay in their wire layout (the
    bitmap, or the u16/u32 index list) until something asks for ``indices``, which are then
    expanded once.  ``RunningSum`` folds the wire layout directly (``fclcore.fastfold``), so
    an aggregator never expands the positions of an update it only adds up.  Everything else
    sees an ordinary ``SparseTensor``; the decoder has checked all that its constructor does."""

    @classmethod
    def _packed(cls, shape: tuple[int, ...], nnz: int, values: np.ndarray, *, bitmap=None, index=None) -> PackedSparse:
        assert values.dtype == np.float32 and values.shape == (nnz,) and (bitmap is None) != (index is None)
        tensor = object.__new__(cls)
        for name, value in (("shape", shape), ("values", values), ("_nnz", nnz), ("_indices", None)):
            object.__setattr__(tensor, name, value)
        object.__setattr__(tensor, "bitmap", bitmap)  # uint8, ceil(numel / 8) bytes, little bit order
        object.__setattr__(tensor, "index", index)  # u16 or u32 flat positions, strictly increasing
        return tensor

    @property
    def indices(self) -> np.ndarray:  # int64 flat positions, expanded on first use
        if self._indices is None:
            if self.bitmap is not None:
                bits = np.unpackbits(self.bitmap, count=math.prod(self.shape), bitorder="little")
                expanded = np.flatnonzero(bits.view(bool))  # int64; on bool, numpy's fastest path
            else:
                expanded = self.index.astype(np.int64)
            object.__setattr__(self, "_indices", expanded)
        return self._indices

    @indices.setter
    def indices(self, value: np.ndarray) -> None:  # only the dataclass __init__ sets it (object.__setattr__)
        object.__setattr__(self, "_indices", value)
        object.__setattr__(self, "bitmap", None)
        object.__setattr__(self, "index", None)

    @property
    def nnz(self) -> int:
        return int(self._nnz) if self._indices is None else int(self._indices.size)


Tensor = np.ndarray | SparseTensor


@dataclass(frozen=True)
class Header:
    kind: Kind
    federation: str
    round: int
    task: int
    client: str
    sequence: int


@dataclass(frozen=True)
class Frame:
    header: Header
    meta: dict = field(default_factory=dict)
    tensors: dict[str, Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class CodecLimits:
    max_frame_bytes: int = 64 * 2**20
    max_tensors: int = 256
    max_ndim: int = 8
    max_elements: int = 64 * 2**20  # per tensor
    max_meta_bytes: int = 64 * 2**10
    max_name_bytes: int = 255
    # what the decoder reads: a device that declared less (docs/protocol.md P-CAP-4) holds itself to it
    frame_versions: tuple[int, ...] = SPOKEN
    value_dtypes: tuple[int, ...] = (1, 2, 3)  # dtype codes
    layouts: tuple[int, ...] = (DENSE, INDEX, BITMAP)


@dataclass(frozen=True)
class ValueCoding:
    """How tensor values are written: ``dtype`` float32 | float16 | int8; for int8, ``block``
    values share a scale and ``rounding`` is nearest or stochastic (seeded, see above)."""

    dtype: str = "float32"
    block: int = 64
    rounding: str = "nearest"
    seed: int = 0
    sparse_layouts: tuple[int, ...] = (INDEX, BITMAP)  # a sparse tensor may be written in these, or dense

    def __post_init__(self) -> None:
        if self.dtype not in VALUE_DTYPES:
            _fail("value_dtype", repr(self.dtype), " or ".join(map(repr, VALUE_DTYPES)))
        _uint(self.block, "int8 block", _U16_MAX)
        if self.block < 1:
            _fail("int8 block", self.block, f"1 <= block <= {_U16_MAX}")
        if self.rounding not in ROUNDINGS:
            _fail("int8 rounding", repr(self.rounding), " or ".join(map(repr, ROUNDINGS)))
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            _fail("int8 seed", repr(self.seed), "an integer")

    def norm_error(self) -> float:
        """A bound on ||decoded - sent||_2 / ||sent||_2 for any tensor written this way, for a
        receiver's plausibility checks on norms.  int8: each value of a block errs by at most
        s / 2 (nearest; < s stochastic) with s = max|block| / 127 <= ||block||_2 / 127, so a
        block's error norm is at most sqrt(block) / 254 (/ 127) of its norm, and so the whole
        tensor's; float16: 2^-11 of each value (normal range); float32: none."""
        if self.dtype == "int8":
            per_code = 254 if self.rounding == "nearest" else 127
            return math.sqrt(self.block) / per_code * (1 + 1e-6)  # 1e-6: the scale's rounding up to float32
        return 2.0**-11 if self.dtype == "float16" else 0.0


# ---------------------------------------------------------------- shared checks


def _check_shape(shape: Any, where: str) -> tuple[int, ...]:
    try:
        dims = tuple(operator.index(d) for d in shape)
    except TypeError:
        _fail(where, repr(shape), "a tuple of ints")
    if any(d < 1 for d in dims):
        _fail(where, dims, "every dim >= 1")
    return dims


def _check_indices(indices: np.ndarray, numel: int, where: str) -> None:
    """Strictly increasing and inside [0, numel): what makes index order canonical.

    One vectorised comparison of neighbours; once they increase, the ends bound the range.
    A range error is reported before an order error, whichever the input has."""
    if indices.size == 0:
        return
    unordered = indices[1:] <= indices[:-1]  # a comparison, unlike np.diff, cannot overflow
    ordered = not unordered.any()
    low, high = (int(indices[0]), int(indices[-1])) if ordered else (int(indices.min()), int(indices.max()))
    if low < 0 or high >= numel:
        _fail(where, low if low < 0 else high, f"0 <= index < {numel} (numel)")
    if not ordered:
        i = int(np.argmax(unordered)) + 1
        _fail(f"{where}[{i}]", int(indices[i]), f"> {int(indices[i - 1])} (strictly increasing)")


def _check_numel(shape: tuple[int, ...], where: str, limits: CodecLimits) -> int:
    if len(shape) > min(limits.max_ndim, _U8_MAX):
        _fail(f"{where}.ndim", len(shape), f"<= {limits.max_ndim} (max_ndim)")
    numel = math.prod(shape)
    if numel > min(limits.max_elements, _U32_MAX):
        _fail(f"{where}.numel", numel, f"<= {limits.max_elements} (max_elements)")
    return numel


def _require_finite(arr: np.ndarray, where: str) -> None:
    bad = ~np.isfinite(arr)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        _fail(where, f"{arr.reshape(-1)[i]} at flat index {i}", "finite values (no NaN/Inf)")


def _short(name: Any) -> str:
    """repr() capped in length: names go into error messages and may be huge."""
    text = repr(name)
    return text if len(text) <= 40 else text[:37] + "..."


# ---------------------------------------------------------------------- encode


def encode(frame: Frame, value_dtype: str | ValueCoding = "float32", limits: CodecLimits = CodecLimits()) -> bytes:
    """Serialise `frame`; tensor values are written as `value_dtype` (a dtype name or a ValueCoding)."""
    coding = value_dtype if isinstance(value_dtype, ValueCoding) else ValueCoding(value_dtype)
    if not isinstance(frame, Frame):
        _fail("frame", type(frame).__name__, "Frame")
    head = _encode_header(frame.header, VERSION)  # validates the header before the tensors use it
    meta = _encode_meta(frame.meta, limits)
    tensors = _encode_tensors(frame.tensors, _ValueWriter(coding, frame.header), limits)
    if coding.dtype == "int8" and frame.tensors:
        head = _encode_header(frame.header, INT8_VERSION)
    parts = [head, meta, *tensors]
    crc, size = 0, 4
    for part in parts:
        crc, size = crc32(part, crc), size + len(part)
    if size > limits.max_frame_bytes:
        _fail("frame size", f"{size} bytes", f"<= {limits.max_frame_bytes} (max_frame_bytes)")
    parts.append(_U32.pack(crc))
    return b"".join(parts)


def with_sequence(data: bytes, sequence: int) -> bytes:
    """The same frame renumbered: ``sequence`` written into the header and the CRC made again.
    Every other byte stays (int8 rounding never reads the sequence), so a device can send an
    update again under a number its aggregator takes (docs/protocol.md, P-SEQ-6)."""
    head = _HEAD.size
    if len(data) < head + 4 or data[:4] != MAGIC:
        _fail("frame", f"{len(data)} bytes", f"a frame starting with {MAGIC!r}")
    body = bytearray(data[:-4])
    struct.pack_into("<Q", body, head - 8, _uint(sequence, "header.sequence", _U64_MAX))
    return bytes(body) + _U32.pack(crc32(body))


def _uint(value: Any, where: str, maximum: int) -> int:
    if isinstance(value, bool):
        _fail(where, repr(value), "an integer, not bool")
    try:
        number = operator.index(value)
    except TypeError:
        _fail(where, repr(value), "an integer")
    if not 0 <= number <= maximum:
        _fail(where, number, f"0 <= value <= {maximum}")
    return number


def _encode_text(value: Any, where: str, max_bytes: int) -> bytes:
    if not isinstance(value, str):
        _fail(where, type(value).__name__, "str")
    try:
        raw = value.encode("utf-8")
    except UnicodeEncodeError:
        _fail(where, repr(value), "text encodable as UTF-8")
    if len(raw) > min(max_bytes, _U8_MAX):
        _fail(where, f"{len(raw)} UTF-8 bytes", f"<= {min(max_bytes, _U8_MAX)} bytes")
    return _U8.pack(len(raw)) + raw


def _encode_header(header: Header, version: int) -> bytes:
    if not isinstance(header, Header):
        _fail("header", type(header).__name__, "Header")
    try:
        kind = Kind(header.kind)
    except (ValueError, TypeError):
        _fail("header.kind", repr(header.kind), f"one of {[int(k) for k in Kind]}")
    fixed = _HEAD.pack(
        MAGIC,
        version,
        kind,
        0,
        _uint(header.round, "header.round", _U32_MAX),
        _uint(header.task, "header.task", _U32_MAX),
        _uint(header.sequence, "header.sequence", _U64_MAX),
    )
    return (
        fixed
        + _encode_text(header.federation, "header.federation", _U8_MAX)
        + _encode_text(header.client, "header.client", _U8_MAX)
    )


def _encode_meta(meta: Any, limits: CodecLimits) -> bytes:
    if not isinstance(meta, dict):
        _fail("meta", type(meta).__name__, "dict")
    for key in meta:
        if not isinstance(key, str):
            _fail("meta key", repr(key), "str")
    try:
        raw = json.dumps(meta, allow_nan=False, ensure_ascii=False, separators=(",", ":")).encode()
    except (TypeError, ValueError, RecursionError) as exc:
        raise CodecError(f"meta: got unserialisable content ({exc}), expected finite JSON data") from exc
    if len(raw) > min(limits.max_meta_bytes, _U32_MAX):
        _fail("meta", f"{len(raw)} bytes of JSON", f"<= {limits.max_meta_bytes} (max_meta_bytes)")
    return _U32.pack(len(raw)) + raw


def _encode_tensors(tensors: Any, writer: _ValueWriter, limits: CodecLimits) -> list[bytes]:
    if not isinstance(tensors, dict):
        _fail("tensors", type(tensors).__name__, "dict")
    if len(tensors) > min(limits.max_tensors, _U16_MAX):
        _fail("tensor count", len(tensors), f"<= {limits.max_tensors} (max_tensors)")
    parts = [_U16.pack(len(tensors))]
    for name, tensor in tensors.items():
        where = f"tensors[{_short(name)}]"
        if name == "":
            _fail(f"{where} name", "''", "a non-empty name")
        parts.append(_encode_text(name, f"{where} name", limits.max_name_bytes))
        parts += _encode_tensor(tensor, name, where, writer, limits)
    return parts


def _check_real(values: np.ndarray, where: str) -> None:
    if values.dtype.kind not in "fiu":
        _fail(f"{where}.dtype", values.dtype, "real numbers (float/int)")
    if values.dtype.kind == "f":
        _require_finite(values, f"{where}.values")


def _wire_values(values: np.ndarray, wire: np.dtype, where: str) -> bytes:
    """Cast to the wire dtype, refusing NaN/Inf and float16 overflow."""
    _check_real(values, where)
    with np.errstate(over="ignore", invalid="ignore"):
        out = values.astype(wire)
    limit = np.finfo(wire).max
    # Finite floats within +-limit cannot overflow; the cheap max() skips a slow float16 isfinite.
    if values.size and (values.dtype.kind != "f" or np.abs(values).max() > limit):
        overflow = ~np.isfinite(out)
        if overflow.any():
            i = int(np.flatnonzero(overflow)[0])
            _fail(
                f"{where}.values",
                f"{values.reshape(-1)[i]} at flat index {i}",
                f"|value| <= {limit} (overflows {wire.name})",
            )
    return out.tobytes()


def _int8_values(values: np.ndarray, block: int, rng: np.random.Generator | None, where: str) -> bytes:
    """Block-quantize, refusing NaN/Inf and values beyond float32 (what the decoder reads back)."""
    _check_real(values, where)
    wide = values.astype(np.float64).reshape(-1)
    limit = float(np.finfo(np.float32).max)
    too_big = np.abs(wide) > limit
    if too_big.any():
        i = int(np.flatnonzero(too_big)[0])
        _fail(f"{where}.values", f"{wide[i]} at flat index {i}", f"|value| <= {limit} (int8 blocks decode to float32)")
    scales, codes = blockquant.quantize(wide, block, rng)
    return _U16.pack(block) + scales.astype("<f4").tobytes() + codes.tobytes()


class _ValueWriter:
    """Writes a tensor's values in the frame's ValueCoding and knows what that costs."""

    def __init__(self, coding: ValueCoding, header: Header) -> None:
        self.coding, self.header = coding, header
        self.code = INT8 if coding.dtype == "int8" else _DTYPES[coding.dtype][0]

    def size(self, count: int) -> int:
        if self.code == INT8:
            return 2 + 4 * blockquant.block_count(count, self.coding.block) + count
        return count * _DTYPE_BY_CODE[self.code].itemsize

    def write(self, values: np.ndarray, name: str, where: str) -> bytes:
        if self.code != INT8:
            return _wire_values(values, _DTYPE_BY_CODE[self.code], where)
        return _int8_values(values, self.coding.block, self._rng(name), where)

    def _rng(self, name: str) -> np.random.Generator | None:
        """Stochastic rounding's stream: a function of the seed, the header and the tensor."""
        if self.coding.rounding == "nearest":
            return None
        h = self.header
        key = json.dumps([self.coding.seed, int(h.kind), h.federation, h.round, h.task, h.client, name])
        digest = hashlib.blake2b(key.encode(), digest_size=16).digest()
        return np.random.default_rng(int.from_bytes(digest, "little"))


def _encode_tensor(tensor: Any, name: str, where: str, writer: _ValueWriter, limits: CodecLimits) -> list[bytes]:
    if isinstance(tensor, np.ndarray):
        shape = _check_shape(tensor.shape, f"{where}.shape")
        _check_numel(shape, where, limits)
        layout, data = DENSE, [writer.write(tensor, name, where)]
    elif isinstance(tensor, SparseTensor):
        tensor._validate(where)  # the arrays may have been mutated since construction
        shape = tensor.shape
        layout, data = _encode_sparse(tensor, _check_numel(shape, where, limits), writer, name, where)
    else:
        _fail(where, type(tensor).__name__, "np.ndarray or SparseTensor")
    head = _TENSOR_HEAD.pack(layout, writer.code, len(shape)) + struct.pack(f"<{len(shape)}I", *shape)
    return [head, *data]


def _encode_sparse(
    tensor: SparseTensor, numel: int, writer: _ValueWriter, name: str, where: str
) -> tuple[int, list[bytes]]:
    """Pick whichever of dense / index list / bitmap is smallest (ties: first listed)."""
    _check_real(tensor.values, where)  # NaN/Inf is refused whichever layout is picked
    nnz, width = tensor.nnz, (2 if numel <= _SMALL_NUMEL else 4)
    sizes = {
        DENSE: writer.size(numel),
        INDEX: 4 + nnz * width + writer.size(nnz),
        BITMAP: 4 + (numel + 7) // 8 + writer.size(nnz),
    }
    sizes = {k: v for k, v in sizes.items() if k == DENSE or k in writer.coding.sparse_layouts}
    layout = min(sizes, key=sizes.__getitem__)
    if layout == DENSE:
        return DENSE, [writer.write(tensor.to_dense(), name, where)]
    if layout == INDEX:
        body = tensor.indices.astype("<u2" if width == 2 else "<u4").tobytes()
    else:
        mask = np.zeros(numel, dtype=bool)
        mask[tensor.indices] = True
        body = np.packbits(mask, bitorder="little").tobytes()
    return layout, [_U32.pack(nnz), body, writer.write(tensor.values, name, where)]


# ---------------------------------------------------------------------- decode


class _Reader:
    """Cursor over a memoryview; a short read becomes a CodecError naming the field."""

    def __init__(self, view: memoryview) -> None:
        self._view, self._pos = view, 0

    @property
    def remaining(self) -> int:
        return len(self._view) - self._pos

    def take(self, n: int, where: str) -> memoryview:
        if n > self.remaining:
            _fail(where, f"{self.remaining} bytes left at offset {self._pos}", f"{n} bytes")
        chunk = self._view[self._pos : self._pos + n]
        self._pos += n
        return chunk

    def unpack(self, st: struct.Struct, where: str) -> tuple:
        return st.unpack(self.take(st.size, where))

    def uint(self, st: struct.Struct, where: str) -> int:
        return self.unpack(st, where)[0]

    def text(self, where: str, max_bytes: int = _U8_MAX) -> str:
        n = self.uint(_U8, f"{where} length")
        if n > max_bytes:
            _fail(f"{where} length", n, f"<= {max_bytes} bytes")
        return _utf8(self.take(n, where), where)

    def array(self, dtype: str | np.dtype, count: int, where: str) -> np.ndarray:
        dt = np.dtype(dtype)
        return np.frombuffer(self.take(count * dt.itemsize, where), dtype=dt)


def _utf8(raw: memoryview, where: str) -> str:
    try:
        return str(raw, "utf-8")
    except UnicodeDecodeError as exc:
        _fail(where, f"invalid UTF-8 ({exc.reason} at byte {exc.start})", "valid UTF-8")


def decode(
    data: bytes, limits: CodecLimits = CodecLimits(), keep_tensors: Callable[[Header], bool] | None = None
) -> Frame:
    """Parse and fully validate one frame (size first, then CRC, then the body).

    ``keep_tensors(header)`` False: every tensor is still decoded and validated, but one at a
    time and dropped, and the frame comes back without tensors (a receiver that only stores
    the bytes for later needs no decoded copy, up to 12 bytes per sparse entry, at once)."""
    try:
        view = memoryview(data).cast("B")
    except TypeError:
        _fail("data", type(data).__name__, "a contiguous bytes-like object")
    if len(view) > limits.max_frame_bytes:
        _fail("frame size", f"{len(view)} bytes", f"<= {limits.max_frame_bytes} (max_frame_bytes)")
    if len(view) < 4:
        _fail("frame size", f"{len(view)} bytes", ">= 4 bytes (CRC32 trailer)")
    stored, actual = _U32.unpack_from(view, len(view) - 4)[0], crc32(view[:-4])
    if stored != actual:
        _fail("checksum", f"0x{stored:08x}", f"0x{actual:08x} (CRC32 of the preceding bytes)")
    reader = _Reader(view[:-4])
    header, version = _decode_header(reader)
    if version not in limits.frame_versions:
        _fail("header.version", version, f"one of {list(limits.frame_versions)} (the versions this decoder reads)")
    meta = _decode_meta(reader, limits)
    tensors = _decode_tensors(reader, version, limits, keep_tensors is None or keep_tensors(header))
    if reader.remaining:
        _fail("trailing bytes", f"{reader.remaining} bytes after the tensor table", "0")
    return Frame(header, meta, tensors)


def _decode_header(reader: _Reader) -> tuple[Header, int]:
    magic, version, kind, flags, rnd, task, seq = reader.unpack(_HEAD, "header")
    if magic != MAGIC:
        _fail("header.magic", repr(magic), repr(MAGIC))
    if version not in SPOKEN:
        _fail("header.version", version, f"{VERSION} or {INT8_VERSION} (supported versions)")
    if kind not in {int(k) for k in Kind}:
        _fail("header.kind", kind, f"one of {[int(k) for k in Kind]}")
    if flags:
        _fail("header.flags", f"0x{flags:04x}", "0 (no flags are defined)")
    federation, client = reader.text("header.federation"), reader.text("header.client")
    return Header(Kind(kind), federation, rnd, task, client, seq), version


def _reject_constant(name: str) -> NoReturn:
    _fail("meta", f"JSON constant {name}", "finite numbers")


def _finite_float(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        _fail("meta", f"number {text} (not finite as a float)", "finite numbers")
    return number


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            _fail("meta key", repr(key), "unique keys in each JSON object")
        out[key] = value
    return out


def _decode_meta(reader: _Reader, limits: CodecLimits) -> dict:
    n = reader.uint(_U32, "meta length")
    if n > limits.max_meta_bytes:
        _fail("meta length", n, f"<= {limits.max_meta_bytes} (max_meta_bytes)")
    text = _utf8(reader.take(n, "meta"), "meta")
    try:
        meta = json.loads(
            text, parse_constant=_reject_constant, parse_float=_finite_float, object_pairs_hook=_unique_keys
        )
    except CodecError:
        raise
    except (ValueError, RecursionError) as exc:
        _fail("meta", f"invalid JSON ({exc})", "a JSON object")
    if not isinstance(meta, dict):
        _fail("meta", f"JSON {type(meta).__name__}", "a JSON object")
    return meta


def _decode_tensors(reader: _Reader, version: int, limits: CodecLimits, keep: bool = True) -> dict[str, Tensor]:
    count = reader.uint(_U16, "tensor count")
    if count > limits.max_tensors:
        _fail("tensor count", count, f"<= {limits.max_tensors} (max_tensors)")
    tensors: dict[str, Tensor] = {}
    names: set[str] = set()
    for i in range(count):
        name = reader.text(f"tensor[{i}].name", min(limits.max_name_bytes, _U8_MAX))
        if not name or name in names:
            _fail(f"tensor[{i}].name", repr(name), "a non-empty name not used by an earlier tensor")
        names.add(name)
        tensor = _decode_tensor(reader, f"tensor[{i}] {_short(name)}", version, limits)
        if keep:
            tensors[name] = tensor
        del tensor  # (not kept: dropped before the next one is decoded)
    return tensors


def _read_values(reader: _Reader, code: int, count: int, where: str) -> np.ndarray:
    if code == INT8:
        return _read_int8(reader, count, where)
    # astype copies, so the result never aliases the input buffer; checking finiteness
    # after widening to float32 is exact (float16 inf/nan stay inf/nan) and much faster.
    values = reader.array(_DTYPE_BY_CODE[code], count, f"{where}.values").astype(np.float32)
    _require_finite(values, f"{where}.values")
    return values


def _read_int8(reader: _Reader, count: int, where: str) -> np.ndarray:
    block = reader.uint(_U16, f"{where}.block")
    if block < 1:
        _fail(f"{where}.block", block, f"1 <= block <= {_U16_MAX}")
    scales = reader.array("<f4", blockquant.block_count(count, block), f"{where}.scales")
    codes = reader.array(np.int8, count, f"{where}.codes")
    bad = ~(np.isfinite(scales) & ~np.signbit(scales) & (scales <= blockquant.MAX_SCALE))
    if bad.any():
        i = int(np.argmax(bad))
        _fail(f"{where}.scales[{i}]", scales[i], f"a finite float32 in [0, {blockquant.MAX_SCALE}]")
    if count and codes.min() == -128:  # a reduction: no mask unless there is something to report
        i = int(np.argmax(codes == -128))
        _fail(f"{where}.codes[{i}]", -128, "a code in [-127, 127]")
    if not scales.all():  # only blocks with scale 0 need their codes looked at
        zero_scale = np.repeat(scales == 0, block)[:count]
        if (zero_scale & (codes != 0)).any():
            i = int(np.argmax(zero_scale & (codes != 0)))
            _fail(f"{where}.codes[{i}]", int(codes[i]), f"0 (block {i // block} has scale 0)")
    return blockquant.dequantize(scales, codes, block)


def _decode_tensor(reader: _Reader, where: str, version: int, limits: CodecLimits) -> Tensor:
    layout, code, ndim = reader.unpack(_TENSOR_HEAD, where)
    if layout not in (DENSE, INDEX, BITMAP):
        _fail(f"{where}.layout", layout, _LAYOUTS)
    if code not in _DTYPE_BY_CODE and not (code == INT8 and version >= INT8_VERSION):
        allowed = "1 (float32), 2 (float16)" + (" or 3 (int8)" if version >= INT8_VERSION else " (3, int8, needs v2)")
        _fail(f"{where}.dtype", code, allowed)
    if layout not in limits.layouts or code not in limits.value_dtypes:
        what = "layout" if layout not in limits.layouts else "dtype"
        _fail(f"{where}.{what}", layout if what == "layout" else code, "one this decoder reads (it declared less)")
    if ndim > limits.max_ndim:
        _fail(f"{where}.ndim", ndim, f"<= {limits.max_ndim} (max_ndim)")
    shape = tuple(int(d) for d in reader.array("<u4", ndim, f"{where}.dims"))
    if any(d < 1 for d in shape):
        _fail(f"{where}.dims", shape, "every dim >= 1")
    numel = _check_numel(shape, where, limits)
    if layout == DENSE:
        return _read_values(reader, code, numel, where).reshape(shape)
    nnz = reader.uint(_U32, f"{where}.nnz")
    if nnz > numel:
        _fail(f"{where}.nnz", nnz, f"<= {numel} (numel)")
    # The positions are kept as they came (copied: the frame's buffer may be reused) and
    # expanded only if asked for (PackedSparse); both layouts are checked in full here.
    if layout == INDEX:
        width = "<u2" if numel <= _SMALL_NUMEL else "<u4"
        raw = reader.array(width, nnz, f"{where}.indices")
        _check_indices(raw, numel, f"{where}.indices")  # on the wire's unsigned ints: no int64 pass first
        positions = {"index": raw.astype(raw.dtype.newbyteorder("="))}  # a native-order copy
    else:
        positions = {
            "bitmap": _checked_bitmap(reader.array(np.uint8, (numel + 7) // 8, f"{where}.bitmap"), numel, nnz, where)
        }
    return PackedSparse._packed(shape, nnz, _read_values(reader, code, nnz, where), **positions)


def _checked_bitmap(packed: np.ndarray, numel: int, nnz: int, where: str) -> np.ndarray:
    """A copy of the bitmap once its padding bits are clear and it has nnz set bits (whose
    positions are then strictly increasing and below numel by construction)."""
    spare = 8 * packed.size - numel
    if spare and packed[-1] >> (8 - spare):
        _fail(f"{where}.bitmap", f"bits set beyond element {numel - 1}", "zero padding bits")
    bitmap = packed.copy()  # aligned, so whole words of it can be counted
    if hasattr(np, "bitwise_count"):  # numpy >= 2.0: a popcount, 64 bits at a time, no expansion
        whole = bitmap.size // 8 * 8
        count = int(np.bitwise_count(bitmap[:whole].view(np.uint64)).sum(dtype=np.int64))
        count += int(np.bitwise_count(bitmap[whole:]).sum(dtype=np.int64))
    else:
        count = int(np.count_nonzero(np.unpackbits(bitmap)))
    if count != nnz:
        _fail(f"{where}.bitmap popcount", count, f"{nnz} (nnz)")
    return bitmap
