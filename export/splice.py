"""A sealed ONNX file whose large frozen weights are written from arrays, never held in a proto.

A text-tasks graph leaves its frozen tables out (``export.snapshot_text_tasks.FrozenRef``: for
FedSeIT, MiniLM's 47 MB wordpiece table).  Putting a table back into the proto and serialising
it held the table three times on the device (the proto, protobuf's buffer, the bytes), with every
other weight twice (issue 40).  :func:`sealed_chunks` instead serialises the graph without them
and splices each table's bytes in as its initializer's ``raw_data`` while the file is written:
the bytes protobuf itself would write (fields in number order, so ``raw_data``, field 9, goes
right after the fields numbered below it), sealed as :func:`export.publish.seal` seals (the same
weights and integrity hashes), so the file is the one the proto path wrote.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from export._proto import (
    _GRAPH_INITIALIZER,
    _MODEL_GRAPH,
    _TENSOR_RAW,
    INTEGRITY_KEY,
    _fields,
    _tensor,
    parse_model,
    sha256,
)
from export._proto import (
    _varint as _read_varint,
)
from export.publish import ExportError, seal_props

if TYPE_CHECKING:
    import onnx

__all__ = ["sealed_chunks", "write_chunks"]


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _header(field: int, length: int) -> bytes:
    return _varint(field << 3 | 2) + _varint(length)


def sealed_chunks(proto: "onnx.ModelProto", metadata: dict[str, Any], tables: Mapping[str, np.ndarray]) -> list:
    """The sealed file of ``proto`` with ``tables`` (initializer name -> float32 array) as the
    ``raw_data`` of those initializers, which must be in ``proto`` with their dims and no data:
    a list of byte chunks (the tables' own memory among them).  ``proto`` is sealed in place."""
    inits = {t.name: t for t in proto.graph.initializer}
    raws: dict[str, memoryview] = {}
    for name, array in tables.items():
        init = inits.get(name)
        a = np.ascontiguousarray(array, "<f4")
        if init is None or init.raw_data or tuple(init.dims) != a.shape:
            raise ExportError(f"the graph has no empty {a.shape} initializer {name!r} to fill")
        raws[name] = memoryview(a).cast("B")
    seal_props(proto, metadata, raws)
    data = memoryview(proto.SerializeToString())
    chunks = _splice(data, raws)
    span = parse_model(data).metadata_spans[INTEGRITY_KEY]
    h = sha256()
    for c in chunks:
        h.update(c)
    return _patch(chunks, data, span, h.hexdigest().encode())


def _splice(data: memoryview, raws: Mapping[str, memoryview]) -> list:
    """``data`` as chunks with each named initializer's ``raw_data`` field inserted."""
    pos = 0
    for field, wire, a, b in _fields(data, 0, len(data)):
        if field == _MODEL_GRAPH and wire == 2:
            graph = _graph(data, a, b, raws)
            return [data[:pos], _header(_MODEL_GRAPH, sum(len(c) for c in graph)), *graph, data[b:]]
        pos = _field_end(data, pos, b, wire)
    raise ExportError("the serialised model has no graph")


def _field_end(data: memoryview, pos: int, b: int, wire: int) -> int:
    """The end of the field that starts at ``pos`` (``_fields`` yields a varint's value, not its end)."""
    if wire != 0:
        return b
    key_end = _read_varint(data, pos, len(data))[1]
    return _read_varint(data, key_end, len(data))[1]


def _graph(data: memoryview, start: int, end: int, raws: Mapping[str, memoryview]) -> list:
    out: list = []
    pos, done = start, set()
    for field, wire, a, b in _fields(data, start, end):
        field_end = _field_end(data, pos, b, wire)
        if field == _GRAPH_INITIALIZER and wire == 2:
            name = _tensor(data, a, b).name
            if name in raws:
                tensor = _tensor_with_raw(data, a, b, raws[name])
                out += [_header(_GRAPH_INITIALIZER, sum(len(c) for c in tensor)), *tensor]
                done.add(name)
                pos = field_end
                continue
        out.append(data[pos:field_end])
        pos = field_end
    missing = sorted(set(raws) - done)
    if missing:
        raise ExportError(f"the serialised graph has no initializer {missing[0]!r}")
    return out


def _tensor_with_raw(data: memoryview, start: int, end: int, raw: memoryview) -> list:
    """The TensorProto's fields with ``raw_data`` before the first field numbered above it."""
    pos = start
    for field, wire, a, b in _fields(data, start, end):
        if field > _TENSOR_RAW:
            break
        pos = _field_end(data, pos, b, wire)
    return [data[start:pos], _header(_TENSOR_RAW, len(raw)), raw, data[pos:end]]


def _patch(chunks: list, data: memoryview, span: tuple[int, int], digest: bytes) -> list:
    """``chunks`` with the integrity value (at ``span`` of the unspliced ``data``, which lies in
    the last chunk: metadata follows the graph) replaced by ``digest``."""
    tail = chunks[-1]
    offset = len(data) - len(tail)
    a, b = span[0] - offset, span[1] - offset
    if a < 0 or b - a != len(digest):
        raise ExportError("the integrity entry is not after the graph")
    return [*chunks[:-1], bytes(tail[:a]) + digest + bytes(tail[b:])]


def write_chunks(path: str | os.PathLike, chunks: list) -> None:
    """Write ``chunks`` to ``path`` (truncating it) and fsync the file."""
    with open(path, "wb") as fh:
        for c in chunks:
            fh.write(c)
        fh.flush()
        os.fsync(fh.fileno())
