"""A validating safetensors reader (u64 header size, JSON header, raw little-endian data): how
the MiniLM backbone's (and FedSeIT's pre-trained) weights are read without pickle, straight
into the parameters they fill, and the map from our parameter names to Hugging Face's."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import numpy as np

_ST_DTYPES = {"F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4"}


def read_safetensors(path: str | Path, names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
    """Tensors of a safetensors file (u64 header size, JSON header, raw little-endian data):
    all of them, or only ``names`` (a missing name is an error)."""
    return dict(iter_safetensors(path, names))


def iter_safetensors(
    path: str | Path, names: Sequence[str] | None = None, into: Mapping[str, np.ndarray] | None = None
) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) of each tensor of ``read_safetensors``, one at a time; a tensor named in
    ``into`` is read into that (C-contiguous, same shape and dtype) array instead of a new one.

    Every offset and size is checked against the file before it is used; no code is executed.
    The file is never held whole: ``load_minilm`` reads each tensor into its parameter, so it
    peaks at the parameters alone, not at three copies of the file."""
    path = Path(path)
    with path.open("rb") as f:
        size = path.stat().st_size
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: {size} bytes, expected a safetensors file (>= 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ValueError(f"{path}: header size {n} exceeds the file ({size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: header is not JSON: {exc}") from None
        if not isinstance(header, dict):
            raise ValueError(f"{path}: header is not a JSON object")
        wanted = [k for k in header if k != "__metadata__"] if names is None else list(names)
        for name in wanted:
            info = header.get(name)
            if not isinstance(info, dict):
                raise ValueError(f"{path}: no tensor {name!r}")
            dtype = np.dtype(_ST_DTYPES.get(info.get("dtype"), "V"))
            if dtype.kind == "V":
                raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info.get('dtype')!r}")
            shape, (start, end) = tuple(int(d) for d in info["shape"]), info["data_offsets"]
            if not 0 <= start <= end <= size - 8 - n or end - start != math.prod(shape) * dtype.itemsize:
                raise ValueError(f"{path}: tensor {name!r} offsets {start}..{end} do not fit shape {shape}")
            array = np.empty(shape, dtype=dtype) if into is None or name not in into else into[name]
            if array.shape != shape or array.dtype != dtype or not array.flags.c_contiguous:
                raise ValueError(
                    f"{path}: tensor {name!r} is {dtype}{list(shape)}, the target {array.dtype}{list(array.shape)}"
                )
            f.seek(8 + n + start)
            if f.readinto(memoryview(array).cast("B")) != end - start:
                raise ValueError(f"{path}: tensor {name!r} is cut short")
            yield name, array


def hf_name(ours: str) -> str:
    """Our parameter name -> the Hugging Face BertModel name in model.safetensors."""
    fixed = {
        "word.weight": "embeddings.word_embeddings.weight",
        "position.weight": "embeddings.position_embeddings.weight",
        "token_type.weight": "embeddings.token_type_embeddings.weight",
        "embed_norm.weight": "embeddings.LayerNorm.weight",
        "embed_norm.bias": "embeddings.LayerNorm.bias",
    }
    if ours in fixed:
        return fixed[ours]
    _, i, module, kind = ours.split(".")
    path = {
        "query": "attention.self.query",
        "key": "attention.self.key",
        "value": "attention.self.value",
        "attn_out": "attention.output.dense",
        "attn_norm": "attention.output.LayerNorm",
        "ffn_in": "intermediate.dense",
        "ffn_out": "output.dense",
        "ffn_norm": "output.LayerNorm",
    }[module]
    return f"encoder.layer.{i}.{path}.{kind}"
