"""The golden vectors of docs/protocol.md (docs/protocol-vectors/) against the Python codec:
every frame decodes to its committed content, the encoder still writes those bytes, every
invalid frame is rejected naming its field, and the digest and SplitMix64 follow the text of
the rules (written out again here, independently of the modules that implement them)."""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from fclcore.codec import CodecError, decode
from fclcore.crc import crc32
from fclcore.model_sync import model_digest, model_hash
from fclcore.signing import SignatureError, verify
from fclcore.splitmix import SplitMix64, mix
from scripts import protocol_vectors

VECTORS = Path(__file__).resolve().parents[2] / "docs" / "protocol-vectors"
FRAMES = json.loads((VECTORS / "frames.json").read_text())
INVALID = json.loads((VECTORS / "invalid.json").read_text())


def test_committed_vectors_are_what_the_encoder_writes() -> None:
    """P-1.2, P-5.5: a frame without int8 values is version 1, and the same content is the same bytes."""
    for name, doc in protocol_vectors.documents().items():
        assert json.loads((VECTORS / name).read_text()) == json.loads(json.dumps(doc)), name


@pytest.mark.parametrize("vector", FRAMES, ids=[v["name"] for v in FRAMES])
def test_every_frame_decodes_to_its_content(vector: dict) -> None:
    """P-4.1 to P-5.7: header fields, meta, layouts, positions and float32 values."""
    payload = bytes.fromhex(vector["hex"])
    if "key" in vector:  # P-6.1: the envelope is magic, HMAC-SHA256 of the frame, the frame
        payload = verify(payload, bytes.fromhex(vector["key"]))
    assert struct.unpack_from("<I", payload, len(payload) - 4)[0] == zlib.crc32(payload[:-4])  # P-4.6
    assert protocol_vectors.decoded(payload) == json.loads(json.dumps(vector["decoded"]))
    frame, want = decode(payload), vector["decoded"]
    assert frame.header.kind.name == want["header"]["kind"] and payload[4] == want["header"]["version"]
    for name, tensor in want["tensors"].items():
        got = frame.tensors[name]
        values = getattr(got, "values", np.asarray(got).reshape(-1))
        assert np.array_equal(values, np.asarray(tensor["values"], np.float32)), name


def test_the_signed_vector_fails_with_another_key_or_a_flipped_bit() -> None:
    (signed,) = [v for v in FRAMES if "key" in v]
    payload = bytes.fromhex(signed["hex"])
    with pytest.raises(SignatureError):
        verify(payload, bytes(32))
    with pytest.raises(SignatureError):
        verify(payload[:-1] + bytes([payload[-1] ^ 1]), bytes.fromhex(signed["key"]))


@pytest.mark.parametrize("vector", INVALID, ids=[v["name"] for v in INVALID])
def test_every_invalid_frame_is_rejected_naming_its_field(vector: dict) -> None:
    """P-4.1, P-4.5 (NaN, a repeated key), P-4.6, P-5.2, P-5.6, P-5.7."""
    with pytest.raises(CodecError) as err:
        decode(bytes.fromhex(vector["hex"]))
    assert vector["error_field"] in str(err.value).split(": got")[0]


def test_crc32_is_zlibs() -> None:
    """P-4.6: CRC-32/ISO-HDLC, check value 0xCBF43926."""
    assert crc32(b"123456789") == zlib.crc32(b"123456789") == 0xCBF43926


def _digest_by_the_rule(tensors: dict[str, np.ndarray]) -> str:
    """P-7.6 as written in docs/protocol.md, independently of ``model_digest``."""
    out = b"FCLM" + bytes([2]) + struct.pack("<I", len(tensors))
    for raw in sorted(n.encode("utf-8") for n in tensors):
        value = tensors[raw.decode()]
        out += struct.pack("<H", len(raw)) + raw + bytes([1, value.ndim])
        out += b"".join(struct.pack("<I", d) for d in value.shape)
        out += b"".join(struct.pack("<f", float(v)) for v in value.reshape(-1))
    return hashlib.sha256(out).hexdigest()


def test_model_digest_vector() -> None:
    """P-7.5, P-7.6: the committed model's hash and digest; the digest sees -0.0 and the shape."""
    doc = json.loads((VECTORS / "model-digest.json").read_text())
    model = {k: np.asarray(v["values"], np.float32).reshape(v["shape"]) for k, v in doc["tensors"].items()}
    assert model_hash(model) == doc["hash"]
    assert model_digest(model) == doc["digest"] == _digest_by_the_rule(model)
    assert len(doc["digest"]) == 64
    flipped = {**model, "net.0.bias": np.abs(model["net.0.bias"])}  # -0.0 -> 0.0
    reshaped = {**model, "net.0.weight": model["net.0.weight"].reshape(4, 3)}
    assert len({model_digest(m) for m in (model, flipped, reshaped)}) == 3


def test_splitmix64_vectors() -> None:
    """P-7.8: the finaliser is the published SplitMix64 (its first output from state 0 is
    0xe220a8397b1dcdaf), and the committed streams are what the generator draws."""
    assert mix(0x9E3779B97F4A7C15) == 0xE220A8397B1DCDAF
    for case in json.loads((VECTORS / "splitmix64.json").read_text()):
        rng = SplitMix64(case["seed"], *case["keys"])
        assert [f"{rng.next():016x}" for _ in range(4)] == case["next"]
        assert [rng.below(10) for _ in range(8)] == case["then_below_10"]
        perm = SplitMix64(case["seed"], *case["keys"]).permutation(16)
        assert perm == case["permutation_16"] and sorted(perm) == list(range(16))
    with pytest.raises(ValueError):
        SplitMix64(-1)
