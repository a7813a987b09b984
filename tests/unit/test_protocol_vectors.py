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

import methods
from fclcore.codec import CodecError, decode
from fclcore.crc import crc32
from fclcore.model_sync import model_digest, model_hash
from fclcore.schema import ModelSpec
from fclcore.signing import SignatureError, verify
from fclcore.splitmix import SplitMix64, mix
from scripts import protocol_vectors
from tests.support.builders import federation_spec

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


def _masks_by_the_rule(model: dict, k: int) -> dict[str, np.ndarray]:
    """P-7.9 as written in docs/protocol.md: orders, degrees and masks from SplitMix64 alone."""
    d, s = model["input_dim"], model["mask_seed"]
    k %= model["num_orders"]
    order = list(range(d)) if k == 0 and model["natural_order"] else SplitMix64(s, 1, k).permutation(d)
    deg_in = np.empty(d, np.int64)
    deg_in[order] = np.arange(1, d + 1)
    stream, low, prev, masks = SplitMix64(s, 0), 1, deg_in, {}
    for layer, h in enumerate(model["hidden_sizes"]):
        high = max(low, d - 1)
        m = np.array([low + stream.below(high - low + 1) for _ in range(h)])
        masks[f"hidden.{layer}.weight"] = (m[:, None] >= prev[None, :]).astype(int)
        prev, low = m, int(m.min())
    masks["output.weight"] = (deg_in[:, None] > prev[None, :]).astype(int)
    masks["direct.weight"] = (deg_in[:, None] > deg_in[None, :]).astype(int)
    return masks


def test_derived_positions_vector() -> None:
    """P-7.9: the committed positions follow from the rule's text, and they are what
    ConFedMADE derives for its announcements in a federation with ``mask_rng: splitmix64``."""
    doc = json.loads((VECTORS / "derived-positions.json").read_text())
    model = doc["model"]
    fed = federation_spec(model=ModelSpec(**{k: v for k, v in model.items() if k != "input_dim"}))
    derive = methods.positions_for(fed, model["input_dim"], "test")
    for rnd, positions in doc["positions_by_announcement"].items():
        u = 0 if model["num_orders"] == 1 else (int(rnd) - 1) * 7919 % model["num_orders"]
        by_rule = _masks_by_the_rule(model, u)
        derived = derive(int(rnd) - 1)  # a device derives the announcement of version r from round r - 1
        assert set(positions) == set(by_rule) == set(derived)
        for name, mask in positions.items():
            assert np.array_equal(np.asarray(mask), by_rule[name]), (rnd, name)
            assert np.array_equal(derived[name], np.asarray(mask, bool)), (rnd, name)
    assert len({json.dumps(p) for p in doc["positions_by_announcement"].values()}) == 3  # three orders
