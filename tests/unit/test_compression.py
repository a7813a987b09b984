"""The compression stage (fclcore.sparsify): top-k with error feedback on the device, the
aggregator's true model and its sparse downlink, checked by hand and through the codec."""

from __future__ import annotations

import numpy as np
import pytest

from aggregator.downlink import ModelDownlink
from fclcore import checkpoint
from fclcore.codec import Frame, Header, Kind, SparseTensor, ValueCoding, decode, encode
from fclcore.model_sync import apply, model_hash
from fclcore.schema import WireSpec
from fclcore.sparsify import (
    DELTA,
    OFF,
    Compression,
    Residuals,
    TrueModel,
    checked_delta,
    kept_count,
    mean_change,
    top_k,
)
from fclcore.strategy import Rejected

HEADER = Header(Kind.UPDATE, "fed", 3, 0, "dev", 1)


def _roundtrip(tensors: dict, coding: ValueCoding) -> dict:
    return decode(encode(Frame(HEADER, {}, tensors), coding)).tensors


def test_top_k_picks_the_largest_magnitudes_lower_index_on_ties_never_zeros():
    values = np.array([0.1, -3.0, 2.0, 0.0, -2.0, 0.5], np.float32)
    assert top_k(values, 1).tolist() == [1]
    assert top_k(values, 2).tolist() == [1, 2]  # |2.0| ties with |-2.0|: the lower index
    assert top_k(values, 3).tolist() == [1, 2, 4]
    assert top_k(values, 6).tolist() == [0, 1, 2, 4, 5]  # the zero is never sent
    assert top_k(np.zeros((2, 3)), 4).tolist() == []
    rng = np.random.default_rng(0)
    big = rng.normal(size=(40, 50))
    picked = top_k(big, 100)
    assert np.abs(big).reshape(-1)[picked].min() >= np.sort(np.abs(big).reshape(-1))[-100]
    assert kept_count(2000, 0.05) == 100 and kept_count(16, 0.05) == 1 and kept_count(3, 1.0) == 3


def test_error_feedback_hand_case_sent_plus_residual_is_what_dense_would_have_sent():
    """Four rounds of changes to a 2x3 tensor at density 1/3 (two entries a round): after every
    round, everything sent so far plus the residual equals the sum of the changes."""
    changes = [
        np.array([[1.0, -0.5, 0.25], [0.0, 2.0, -1.0]], np.float32),
        np.array([[0.5, 0.5, 0.5], [0.5, -3.0, 0.0]], np.float32),
        np.array([[-1.5, 0.0, 1.0], [0.25, 0.0, 0.75]], np.float32),
        np.array([[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], np.float32),
    ]
    stage = Residuals(density=1 / 3)
    sent_total = np.zeros((2, 3))
    # round 1: the two largest are 2.0 (index 4) and 1.0 / -1.0 (indices 0 and 5: 0 first); round 2:
    # c = [[.5, 0, .75], [.5, -3, -1]]; round 3: [[-1, 0, 1.75], [.75, 0, .75]]; round 4 sends the tie
    expected_sent = [[0, 4], [4, 5], [0, 2], [3, 5]]
    for rnd, change in enumerate(changes):
        sparse = stage.compress("w", change)
        stage.sent({"w" + DELTA: sparse})
        assert sparse.indices.tolist() == expected_sent[rnd]
        sent_total += sparse.to_dense()
        np.testing.assert_array_equal(sent_total + stage.residuals["w"], np.sum(changes[: rnd + 1], axis=0))
    assert not stage.residuals["w"].any()  # the last round's zero change drained the residual
    # without error feedback, what was not sent is lost
    lossy = Residuals(density=1 / 3, error_feedback=False)
    first = lossy.compress("w", changes[0])
    assert not lossy.residuals["w"].any() and first.nnz == 2


@pytest.mark.parametrize("dtype", ["float16", "int8"])
def test_lossy_values_the_residual_keeps_what_coding_lost(dtype):
    """int8 blocks (and float16): the residual is c minus what the aggregator decodes, so sent
    plus residual still adds up to the changes, round after round."""
    rng = np.random.default_rng(1)
    coding = ValueCoding(dtype, block=16)
    stage = Residuals(density=0.1)
    total_change, total_sent = np.zeros((30, 40)), np.zeros((30, 40))
    for _ in range(5):
        change = rng.normal(scale=0.01, size=(30, 40)).astype(np.float32)
        total_change += change
        sparse = stage.compress("w", change)
        decoded = _roundtrip({"w" + DELTA: sparse}, coding)
        assert not np.array_equal(decoded["w" + DELTA].values, sparse.values)  # the coding did lose something
        stage.sent(decoded)
        total_sent += decoded["w" + DELTA].to_dense()
        np.testing.assert_allclose(total_sent + stage.residuals["w"], total_change, rtol=0, atol=1e-7)


def test_residuals_round_trip_through_a_checkpoint_bit_identically(tmp_path):
    rng = np.random.default_rng(2)
    stage = Residuals(density=0.05)
    for _ in range(3):
        stage.sent({"a" + DELTA: stage.compress("a", rng.normal(size=(20, 30)).astype(np.float32))})
        stage.sent({"b" + DELTA: stage.compress("b", rng.normal(size=7).astype(np.float32))})
    checkpoint.save(tmp_path / "c.npz", {}, stage.state("residual/"))
    _, arrays = checkpoint.load(tmp_path / "c.npz")
    again = Residuals(density=0.05)
    again.load_state(arrays, "residual/", {"a": (20, 30), "b": (7,)})
    for name in ("a", "b"):
        assert again.residuals[name].tobytes() == stage.residuals[name].tobytes()
    change = rng.normal(size=(20, 30)).astype(np.float32)  # the next round is the same from either
    assert stage.compress("a", change) == again.compress("a", change)
    with pytest.raises(ValueError, match="does not fit"):
        Residuals(0.05).load_state(arrays, "residual/", {"a": (30, 20), "b": (7,)})


def test_downlink_with_server_error_feedback_verifies_by_hash_and_stays_sparse():
    """The aggregator's true model moves by the mean delta; the announcement moves what devices
    hold by its top-k only; a device applying each delta holds exactly the announced model."""
    rng = np.random.default_rng(3)
    shape, density = (50, 40), 0.05
    initial = {"w": rng.normal(size=shape).astype(np.float32)}
    downlink = ModelDownlink("float16", lambda rnd: None, catchup_versions=4)
    coding = ValueCoding("float16")

    def roundtrip(tensors):
        return _roundtrip(tensors, coding)

    tensors, ref = downlink.prepare(0, initial, roundtrip)
    device = apply(None, ref, roundtrip(tensors))
    true = TrueModel(density)
    held = downlink.served
    for version in range(1, 6):
        change = rng.normal(scale=0.01, size=shape)
        announced = {"w": true.step("w", held["w"], change)}
        tensors, ref = downlink.prepare(version, announced, roundtrip)
        assert isinstance(tensors["w"], SparseTensor) and tensors["w"].nnz <= kept_count(2000, density)
        device = apply(device, ref, roundtrip(tensors))
        assert model_hash(device) == ref.hash
        held = downlink.served
        # the aggregator's residual is what devices do not hold yet
        assert np.abs(true.values["w"] - held["w"]).max() > 0
    # the true model is the sum of the changes: the residual plus what was announced
    assert np.abs(true.values["w"] - device["w"]).max() < 0.1


def test_true_model_without_error_feedback_follows_the_announced_model():
    true = TrueModel(0.5, error_feedback=False)
    held = np.zeros(4, np.float32)
    out = true.step("w", held, np.array([1.0, -2.0, 0.5, 0.0]))
    assert out.tolist() == [1.0, -2.0, 0.0, 0.0]
    assert true.values["w"].tolist() == out.tolist()
    assert mean_change(np.array([2.0, 4.0]), 2.0, (2,)).tolist() == [1.0, 2.0]


def test_a_delta_above_the_declared_density_or_of_another_shape_is_rejected_with_its_reason():
    ok = SparseTensor((10, 10), np.arange(5), np.ones(5))
    assert checked_delta("w", ok, (10, 10), 0.05) is ok
    for bad, shape, match in (
        (SparseTensor((10, 10), np.arange(6), np.ones(6)), (10, 10), "6 entries, at most 5"),
        (SparseTensor((100,), np.arange(5), np.ones(5)), (10, 10), "shape"),
        (np.ones((10, 10), np.float32), (10, 10), "100 entries, at most 5"),
    ):
        with pytest.raises(Rejected, match=match) as caught:
            checked_delta("w", bad, shape, 0.05)
        assert caught.value.reason == "compression"


def test_settings_resolve_the_scenario_over_the_method_default():
    method = Compression(up_density=0.05, down_density=0.02)
    assert Compression.of(WireSpec(), method) == method
    assert Compression.of(WireSpec(), OFF) == OFF  # every other method: off unless asked
    assert Compression.of(WireSpec(sparsify="none"), method) == Compression(None, 0.02)
    assert Compression.of(WireSpec(density=0.1, down_sparsify="none"), method) == Compression(0.1, None)
    assert Compression.of(WireSpec(sparsify="topk", density=0.2), OFF) == Compression(0.2, None)
    with pytest.raises(ValueError, match="needs a density"):
        Compression.of(WireSpec(sparsify="topk"), OFF)
    with pytest.raises(ValueError, match="density"):
        WireSpec(density=1.5)


def test_untouched_settings_leave_the_announced_json_and_the_fingerprint_as_before():
    """The stage's keys are left out of ``to_dict`` at their defaults (announcements carry the
    federation as JSON, and the aggregator's state fingerprint is of it); set, they travel."""
    from fclcore.config import from_dict, to_dict

    assert list(to_dict(WireSpec())) == [
        "value_dtype",
        "max_frame_mb",
        "int8_block",
        "int8_rounding",
        "catchup_versions",
    ]
    spec = WireSpec(sparsify="topk", density=0.1, error_feedback=False, down_sparsify="none")
    assert from_dict(WireSpec, to_dict(spec), "test") == spec
