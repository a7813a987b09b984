"""The validating safetensors reader (``fclbases.minilm.safetensors``): tensors come back as written,
read one at a time (into given arrays when asked), and a malformed file is a clear ValueError."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from fclbases.minilm.safetensors import iter_safetensors, read_safetensors


def write(path, tensors: dict[str, np.ndarray], header_patch: dict | None = None, cut: int = 0) -> None:
    codes = {np.dtype("<f4"): "F32", np.dtype("<f2"): "F16", np.dtype("<i8"): "I64"}
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, a in tensors.items():
        raw = np.ascontiguousarray(a).tobytes()
        header[name] = {"dtype": codes[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    for name, patch in (header_patch or {}).items():
        header[name] = {**header[name], **patch}
    text = json.dumps(header).encode()
    data = struct.pack("<Q", len(text)) + text + b"".join(blobs)
    path.write_bytes(data[: len(data) - cut])


@pytest.fixture
def tensors():
    rng = np.random.default_rng(0)
    return {
        "a": rng.normal(size=(3, 5)).astype(np.float32),
        "b": rng.normal(size=(7,)).astype(np.float16),
        "c": np.arange(4, dtype=np.int64),
    }


def test_round_trip_all_and_selected(tmp_path, tensors):
    write(tmp_path / "m.safetensors", tensors)
    got = read_safetensors(tmp_path / "m.safetensors")
    assert set(got) == set(tensors)
    for name, a in tensors.items():
        np.testing.assert_array_equal(got[name], a)
        assert got[name].dtype == a.dtype
    only = read_safetensors(tmp_path / "m.safetensors", ["c"])
    assert list(only) == ["c"]
    np.testing.assert_array_equal(only["c"], tensors["c"])


def test_reads_into_given_arrays(tmp_path, tensors):
    write(tmp_path / "m.safetensors", tensors)
    target = np.zeros((3, 5), np.float32)
    (name, array), *_ = list(iter_safetensors(tmp_path / "m.safetensors", ["a", "c"], into={"a": target}))
    assert name == "a" and array is target
    np.testing.assert_array_equal(target, tensors["a"])
    with pytest.raises(ValueError, match="the target"):
        list(iter_safetensors(tmp_path / "m.safetensors", ["a"], into={"a": np.zeros((5, 3), np.float32)}))


@pytest.mark.parametrize(
    "patch, cut, match",
    [
        (None, 10, "offsets|cut short"),  # the file ends inside a tensor
        ({"a": {"data_offsets": [0, 10_000]}}, 0, "offsets"),  # a tensor past the end
        ({"a": {"shape": [4, 5]}}, 0, "do not fit"),  # shape and size disagree
        ({"a": {"dtype": "BOGUS"}}, 0, "unsupported dtype"),
    ],
)
def test_malformed_files_are_value_errors(tmp_path, tensors, patch, cut, match):
    write(tmp_path / "m.safetensors", tensors, patch, cut)
    with pytest.raises(ValueError, match=match):
        read_safetensors(tmp_path / "m.safetensors")


def test_bad_headers_and_missing_names(tmp_path, tensors):
    p = tmp_path / "m.safetensors"
    p.write_bytes(b"\x01\x02")
    with pytest.raises(ValueError, match=">= 8 bytes"):
        read_safetensors(p)
    p.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ValueError, match="header size"):
        read_safetensors(p)
    p.write_bytes(struct.pack("<Q", 3) + b"{x}")
    with pytest.raises(ValueError, match="not JSON"):
        read_safetensors(p)
    write(p, tensors)
    with pytest.raises(ValueError, match="no tensor 'zz'"):
        read_safetensors(p, ["zz"])
