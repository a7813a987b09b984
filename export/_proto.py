"""Minimal, pure-Python reader of the parts of an ONNX file the fcl runtime checks.

The torch-free runtime must verify a model file *before* handing it to onnxruntime and
without importing the ``onnx`` package (which is not installed on devices).  ONNX files
are protocol-buffer ``ModelProto`` messages; this module walks the protobuf wire format
just far enough to extract

* ``metadata_props`` (``ModelProto`` field 14: ``StringStringEntryProto`` key=1, value=2),
  with the byte range of each value (the integrity hash blanks its own value),
* the graph initializers (``GraphProto`` field 5, ``TensorProto``: dims=1, data_type=2,
  name=8, raw_data=9, data_location=14),

and validates every length and varint on the way, so truncated or byte-corrupted files
fail here with :class:`ProtoError` rather than somewhere inside onnxruntime.

The same module defines the two hashes written by the exporter, so both sides share a
single implementation:

* ``weights_digest``: SHA-256 over the initializers sorted by name, each contributing
  ``name \\0 data_type \\0 dims-as-JSON \\0 len(raw_data) as 8-byte LE \\ raw_data``.
  Every initializer must carry its values in ``raw_data`` (the exporter normalises this).
* ``integrity_digest``: SHA-256 of the whole file with the 64-character value of the
  ``fcl.integrity_sha256`` entry replaced by ``"0" * 64``; it detects a change of any
  other byte (metadata, graph structure, header) as well.

Reference: https://protobuf.dev/programming-guides/encoding/ and onnx/onnx.proto.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterable, Iterator

from fclcore.errors import BadInput

try:  # CPython's built-in SHA-256: hashlib would load OpenSSL, ~4 MB of RSS on a device
    from _sha256 import sha256  # Python <= 3.11
except ImportError:  # pragma: no cover - depends on the interpreter
    try:
        from _sha2 import sha256  # Python >= 3.12
    except ImportError:
        from hashlib import sha256

INTEGRITY_KEY = "fcl.integrity_sha256"
PLACEHOLDER = b"0" * 64

# ModelProto / GraphProto / TensorProto field numbers (onnx.proto).
_MODEL_GRAPH, _MODEL_METADATA = 7, 14
_GRAPH_INITIALIZER, _GRAPH_SPARSE_INITIALIZER = 5, 15
_TENSOR_DIMS, _TENSOR_DATA_TYPE, _TENSOR_NAME, _TENSOR_RAW, _TENSOR_LOCATION = 1, 2, 8, 9, 14
_TENSOR_TYPED_FIELDS = {
    4: "float_data",
    5: "int32_data",
    6: "string_data",
    7: "int64_data",
    10: "double_data",
    11: "uint64_data",
    13: "external_data",
}


class ProtoError(BadInput):
    """The bytes are not a well-formed ONNX ModelProto (or use a feature we refuse)."""


@dataclass(frozen=True)
class Initializer:
    name: str
    data_type: int
    dims: tuple[int, ...]
    raw: memoryview


@dataclass(frozen=True)
class ParsedModel:
    metadata: dict[str, str]
    metadata_spans: dict[str, tuple[int, int]]  # byte range of each metadata value in the file
    initializers: tuple[Initializer, ...]
    has_graph: bool


def _varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= end:
            raise ProtoError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ProtoError("varint longer than 10 bytes")


def _fields(buf: memoryview, start: int, end: int) -> Iterator[tuple[int, int, int, int]]:
    """Yield ``(field, wire_type, a, b)``: varint -> (value, 0); fixed/len -> byte range [a, b)."""
    pos = start
    while pos < end:
        key, pos = _varint(buf, pos, end)
        field, wire = key >> 3, key & 7
        if field == 0:
            raise ProtoError("field number 0")
        if wire == 0:
            value, pos = _varint(buf, pos, end)
            yield field, wire, value, 0
            continue
        if wire == 2:
            length, pos = _varint(buf, pos, end)
            size = length
        elif wire == 1:
            size = 8
        elif wire == 5:
            size = 4
        else:
            raise ProtoError(f"unsupported wire type {wire} (field {field})")
        if pos + size > end:
            raise ProtoError(f"field {field} runs past the end of its message (truncated?)")
        yield field, wire, pos, pos + size
        pos += size
    if pos != end:
        raise ProtoError("message overruns its declared length")


def _utf8(buf: memoryview, a: int, b: int, what: str) -> str:
    try:
        return bytes(buf[a:b]).decode("utf-8")
    except UnicodeDecodeError:
        raise ProtoError(f"{what} is not valid UTF-8") from None


def _tensor(buf: memoryview, a: int, b: int) -> Initializer:
    dims: list[int] = []
    name, data_type, raw = None, 0, memoryview(b"")
    for field, wire, x, y in _fields(buf, a, b):
        if field == _TENSOR_DIMS:
            if wire == 0:
                dims.append(x)
            elif wire == 2:  # packed
                p = x
                while p < y:
                    v, p = _varint(buf, p, y)
                    dims.append(v)
            else:
                raise ProtoError("bad wire type for TensorProto.dims")
        elif field == _TENSOR_DATA_TYPE and wire == 0:
            data_type = x
        elif field == _TENSOR_NAME and wire == 2:
            name = _utf8(buf, x, y, "initializer name")
        elif field == _TENSOR_RAW and wire == 2:
            raw = buf[x:y]
        elif field == _TENSOR_LOCATION and wire == 0:
            if x != 0:
                raise ProtoError("initializer stored as external data (not supported)")
        elif field in _TENSOR_TYPED_FIELDS:
            raise ProtoError(f"initializer uses {_TENSOR_TYPED_FIELDS[field]} instead of raw_data")
    if not name:
        raise ProtoError("initializer without a name")
    dims_t = tuple(int(d) for d in dims)
    return Initializer(name, data_type, dims_t, raw)


def parse_model(data: bytes | memoryview) -> ParsedModel:
    """Parse the ModelProto bytes; raise ProtoError on any malformation."""
    buf = memoryview(data)
    metadata: dict[str, str] = {}
    spans: dict[str, tuple[int, int]] = {}
    inits: list[Initializer] = []
    has_graph = False
    for field, wire, a, b in _fields(buf, 0, len(buf)):
        if field == _MODEL_GRAPH:
            if wire != 2 or has_graph:
                raise ProtoError("bad or repeated ModelProto.graph")
            has_graph = True
            for gf, gw, ga, gb in _fields(buf, a, b):
                if gf == _GRAPH_INITIALIZER and gw == 2:
                    inits.append(_tensor(buf, ga, gb))
                elif gf == _GRAPH_SPARSE_INITIALIZER:
                    raise ProtoError("sparse initializers are not supported")
        elif field == _MODEL_METADATA:
            if wire != 2:
                raise ProtoError("bad wire type for ModelProto.metadata_props")
            key = value = None
            span = (0, 0)
            for ef, ew, ea, eb in _fields(buf, a, b):
                if ef == 1 and ew == 2:
                    key = _utf8(buf, ea, eb, "metadata key")
                elif ef == 2 and ew == 2:
                    value, span = _utf8(buf, ea, eb, "metadata value"), (ea, eb)
            if key is None:
                raise ProtoError("metadata entry without a key")
            if key in metadata:
                raise ProtoError(f"duplicate metadata key {key!r}")
            metadata[key] = value if value is not None else ""
            spans[key] = span
    names = [t.name for t in inits]
    if len(set(names)) != len(names):
        raise ProtoError("duplicate initializer names")
    return ParsedModel(metadata, spans, tuple(inits), has_graph)


def weights_digest(initializers: Iterable[tuple[str, int, Iterable[int], bytes | memoryview]]) -> str:
    """SHA-256 hex of ``(name, data_type, dims, raw_data)`` records, in name order (see module doc)."""
    return weights_digest_in_order(sorted(initializers, key=lambda r: r[0]))


def weights_digest_in_order(initializers: Iterable[tuple[str, int, Iterable[int], bytes | memoryview]]) -> str:
    """:func:`weights_digest` of records already in name order, read one at a time: an onnx
    proto's ``raw_data`` is a fresh copy on each read, and sorting those records held a copy of
    every weight at once (issue 40: 105 MB at FedSeIT's fifth task)."""
    h = sha256()
    for name, data_type, dims, raw in initializers:
        h.update(name.encode("utf-8") + b"\0")
        h.update(str(int(data_type)).encode() + b"\0")
        h.update(json.dumps([int(d) for d in dims]).encode() + b"\0")
        h.update(len(raw).to_bytes(8, "little"))
        h.update(raw)
    return h.hexdigest()


def integrity_digest(data: bytes | memoryview, span: tuple[int, int]) -> str:
    """SHA-256 hex of ``data`` with the bytes in ``span`` (the integrity value) set to the placeholder."""
    a, b = span
    if b - a != len(PLACEHOLDER):
        raise ProtoError(f"{INTEGRITY_KEY} must be {len(PLACEHOLDER)} characters")
    buf = memoryview(data)
    h = sha256()
    h.update(buf[:a])
    h.update(PLACEHOLDER)
    h.update(buf[b:])
    return h.hexdigest()
