"""The model downlink's deltas, hashes and resyncs (fclcore.model_sync, aggregator/downlink.py,
edge_client/replica.py), through the real codec: a device that applies every announcement holds
the aggregator's model exactly; one that cannot (behind, fresh, forged frame) asks for a sync
frame and never keeps a half-applied or corrupted model."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from aggregator.downlink import ModelDownlink
from edge_client.replica import CATCHUP, FULL, ModelReplica
from fclcore.codec import Frame, Header, Kind, SparseTensor, decode, encode
from fclcore.model_sync import OUTSIDE, ModelRef, changes, model_digest, model_hash

SHAPES = {"w": (12, 9), "b": (12,), "head": (5, 12)}


def _model(rng: np.random.Generator) -> dict[str, np.ndarray]:
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def _perturb(rng: np.random.Generator, params: dict[str, np.ndarray], share: float) -> dict[str, np.ndarray]:
    out = {k: v.copy() for k, v in params.items()}
    for v in out.values():
        hit = rng.random(v.shape) < share
        v[hit] = rng.standard_normal(int(hit.sum())).astype(np.float32)
    return out


class Wire:
    """Announcements as the service encodes them and a device decodes them."""

    def __init__(self, dtype: str = "float32", positions=lambda rnd: None, catchup: int = 4) -> None:
        self.dtype = dtype
        self.downlink = ModelDownlink(dtype, positions, catchup)

    def announce(self, version: int, params: dict[str, np.ndarray]) -> tuple[Frame, int]:
        header = Header(Kind.ROUND, "fed", version, 0, "aggregator", version + 1)

        def roundtrip(tensors):
            return decode(encode(Frame(header, {}, tensors), self.dtype)).tensors

        tensors, ref = self.downlink.prepare(version, params, roundtrip)
        payload = encode(Frame(header, {"model": ref.to_meta()}, tensors), self.dtype)
        return decode(payload), len(payload)

    def sync(self, which: str) -> tuple[Frame, int]:
        tensors, ref, dtype = self.downlink.sync_frames()[which]
        header = Header(Kind.MODEL, "fed", ref.version, 0, "aggregator", 99)
        payload = encode(Frame(header, {"model": ref.to_meta()}, tensors), dtype)
        return decode(payload), len(payload)


@pytest.mark.parametrize("dtype", ["float32", "float16", "int8"])
@pytest.mark.parametrize("share", [0.0, 0.02, 0.3, 1.0])
# docs/protocol.md P-5.4, P-7.2
def test_a_device_that_applies_every_delta_holds_the_aggregators_model(dtype: str, share: float) -> None:
    rng = np.random.default_rng(int(share * 100))
    wire, replica = Wire(dtype), ModelReplica(lambda rnd: None)
    params = _model(rng)
    for version in range(8):
        frame, _ = wire.announce(version, params)
        held = replica.take(frame)
        assert isinstance(held, dict) and model_hash(held) == wire.downlink.hash
        assert held.keys() == params.keys()
        for name, value in held.items():  # float32 is exact; float16 and int8 round each sent value once
            atol = {"float32": 0, "float16": 0, "int8": np.abs(params[name]).max() / 127}[dtype]
            np.testing.assert_allclose(value, params[name], rtol=1e-3 if dtype == "float16" else 0, atol=atol)
        params = _perturb(rng, wire.downlink.served, share)
    assert not replica.totals


def test_only_changed_entries_travel_and_nothing_changed_costs_no_tensor() -> None:
    rng = np.random.default_rng(1)
    wire, replica = Wire(), ModelReplica(lambda rnd: None)
    params = _model(rng)
    full, full_bytes = wire.announce(0, params)
    replica.take(full)
    same, same_bytes = wire.announce(1, wire.downlink.served)
    assert same.tensors == {} and same_bytes < full_bytes / 4  # the header and metadata only
    assert isinstance(replica.take(same), dict) and replica.version == 1
    changed = {k: v.copy() for k, v in wire.downlink.served.items()}
    changed["w"][3, 4] = 7.0
    frame, _ = wire.announce(2, changed)
    assert set(frame.tensors) == {"w"} and isinstance(frame.tensors["w"], SparseTensor)
    assert frame.tensors["w"].nnz == 1
    assert model_hash(replica.take(frame)) == model_hash(changed)


# docs/protocol.md P-7.2, P-7.7
def test_derived_positions_send_values_without_indices() -> None:
    rng = np.random.default_rng(2)
    mask = rng.random(SHAPES["w"]) < 0.4
    positions = lambda rnd: {"w": mask}  # noqa: E731
    derived, plain = Wire(positions=positions), Wire()
    params = _model(rng)
    replica = ModelReplica(positions)
    replica.take(derived.announce(0, params)[0])
    plain.announce(0, params)
    nxt = {k: v.copy() for k, v in params.items()}
    nxt["w"][mask] += 1.0  # every entry inside the positions changes
    frame, size = derived.announce(1, nxt)
    _, plain_size = plain.announce(1, nxt)
    assert ModelRef.of(frame.meta).derived == ("w",) and frame.tensors["w"].shape == (int(mask.sum()),)
    assert size < plain_size
    assert model_hash(replica.take(frame)) == model_hash(nxt)
    few = {k: v.copy() for k, v in nxt.items()}
    few["w"][mask] += 1.0
    stray = np.flatnonzero(~mask)[:2]
    few["w"].reshape(-1)[stray] = 5.0  # two changes outside: derived values plus a sparse companion
    frame, _ = derived.announce(2, few)
    assert ModelRef.of(frame.meta).derived == ("w",)
    assert list(frame.tensors["w" + OUTSIDE].indices) == list(stray)
    assert model_hash(replica.take(frame)) == model_hash(few)
    outside = {k: v.copy() for k, v in few.items()}
    outside["w"][~mask] += 1.0  # every entry outside changes: the whole tensor is cheaper
    frame, _ = derived.announce(3, outside)
    assert ModelRef.of(frame.meta).derived == ()
    assert model_hash(replica.take(frame)) == model_hash(outside)


def test_new_removed_and_reshaped_tensors_travel_whole() -> None:
    rng = np.random.default_rng(3)
    wire, replica = Wire(), ModelReplica(lambda rnd: None)
    params = _model(rng)
    replica.take(wire.announce(0, params)[0])
    grown = {"w": params["w"], "head": rng.standard_normal((6, 12)).astype(np.float32), "extra": np.ones(3, "f4")}
    frame, _ = wire.announce(1, grown)
    assert ModelRef.of(frame.meta).removed == ("b",)
    held = replica.take(frame)
    assert set(held) == {"w", "head", "extra"} and model_hash(held) == model_hash(grown)
    assert "catchup" not in wire.downlink.sync_frames()  # a shape change: only the full model bridges it


# docs/protocol.md P-7.3
def test_a_device_behind_catches_up_or_fetches_the_full_model() -> None:
    rng = np.random.default_rng(4)
    wire = Wire(catchup=3)
    behind, fresh = ModelReplica(lambda rnd: None), ModelReplica(lambda rnd: None)
    params = _model(rng)
    behind.take(wire.announce(0, params)[0])
    for version in range(1, 4):
        params = _perturb(rng, wire.downlink.served, 0.05)
        frame, _ = wire.announce(version, params)
    assert behind.take(frame) == CATCHUP and behind.version == 0  # nothing applied
    catchup, size = wire.sync("catchup")
    assert ModelRef.of(catchup.meta).base == 0
    assert behind.sync(catchup, CATCHUP, size) is None
    assert behind.version == 3 and behind.hash == wire.downlink.hash
    assert behind.report() == {"catchup": 1, "bytes": size} == behind.report()  # cumulative
    assert fresh.take(frame) == FULL
    full, size = wire.sync("full")
    assert fresh.sync(full, FULL, size) is None and fresh.hash == wire.downlink.hash
    # further behind than the catch-up reaches: the full model
    for version in range(4, 9):
        frame, _ = wire.announce(version, _perturb(rng, wire.downlink.served, 0.05))
    assert behind.take(frame) == CATCHUP
    stale = wire.sync("catchup")[0]
    assert ModelRef.of(stale.meta).base > behind.version
    assert behind.sync(stale, CATCHUP, 10) == FULL and behind.version == 3


def _forged(frame: Frame, **changes) -> Frame:
    meta = dict(frame.meta)
    meta["model"] = {**meta["model"], **changes.pop("model", {})}
    return dataclasses.replace(frame, meta=meta, **changes)


def test_forged_or_corrupted_deltas_are_never_kept() -> None:
    rng = np.random.default_rng(5)
    wire = Wire(positions=lambda rnd: {"w": np.ones(SHAPES["w"], bool)})
    replica = ModelReplica(wire.downlink.positions)
    params = _model(rng)
    replica.take(wire.announce(0, params)[0])
    before = {k: v.copy() for k, v in replica.params.items()}
    nxt = _perturb(rng, wire.downlink.served, 0.5)
    frame, _ = wire.announce(1, nxt)
    values = dict(frame.tensors)
    first = next(iter(values))
    t = values[first]  # its values altered in transit (the metadata and hash left as sent)
    bad_values = {
        **values,
        first: SparseTensor(t.shape, t.indices, t.values + 1) if isinstance(t, SparseTensor) else t + 1,
    }
    cases = {
        "hash_mismatch": _forged(frame, model={"hash": "0" * 32}),
        "hash_mismatch ": dataclasses.replace(frame, tensors=bad_values),
        "bad_delta": _forged(frame, model={"removed": ["nope"]}),
        "bad_delta ": dataclasses.replace(frame, tensors={**values, "b": SparseTensor((99,), [98], [1.0])}),
    }
    if ModelRef.of(frame.meta).derived:  # values that do not fit the derived positions
        cases["bad_delta  "] = dataclasses.replace(frame, tensors={**values, "w": np.ones(3, "f4")})
        inside = SparseTensor(SHAPES["w"], [0], [1.0])  # "outside" changes inside the positions
        cases["bad_delta   "] = dataclasses.replace(frame, tensors={**values, "w" + OUTSIDE: inside})
    stray = SparseTensor(SHAPES["b"], [0], [1.0])  # a companion of a tensor not sent as derived
    cases["bad_delta    "] = dataclasses.replace(frame, tensors={**values, "b" + OUTSIDE: stray})
    for reason, forged in cases.items():
        assert replica.take(forged) == FULL, reason
        assert replica.version == 0 and all(np.array_equal(before[k], replica.params[k]) for k in before)
    assert replica.totals["hash_mismatch"] == 2 and replica.totals["bad_delta"] >= 2
    wrong_base = _forged(frame, model={"base": 7, "version": 9})
    assert replica.take(wrong_base) == CATCHUP and replica.version == 0
    assert model_hash(replica.take(frame)) == wire.downlink.hash  # the genuine frame still applies


@pytest.mark.parametrize(
    "raw",
    [
        "x",
        {"version": -1, "base": None, "hash": "0" * 32},
        {"version": 3, "base": 3, "hash": "0" * 32},
        {"version": 3, "base": 2, "hash": "short"},
        {"version": 3, "base": None, "hash": "0" * 32, "removed": ["a"]},
        {"version": 3, "base": 2, "hash": "0" * 32, "derived": "w"},
        {"version": True, "base": None, "hash": "0" * 32},
    ],
)
# docs/protocol.md P-7.1, P-7.4
def test_malformed_model_metadata_is_a_clear_error(raw: object) -> None:
    with pytest.raises(ValueError, match="model"):
        ModelRef.of({"model": raw})


def test_a_restarted_aggregator_announces_the_full_model_and_steps_restart() -> None:
    rng = np.random.default_rng(6)
    params = _model(rng)
    wire = Wire()
    wire.announce(4, params)  # a fresh downlink (after a restart) at version 4
    frame, _ = wire.announce(4, params)
    assert ModelRef.of(frame.meta).base is None and set(frame.tensors) == set(SHAPES)
    assert "catchup" not in wire.downlink.sync_frames()
    full = wire.sync("full")[0]
    assert ModelRef.of(full.meta).version == 4


def test_sync_frames_are_lossless_for_float16_served_values() -> None:
    rng = np.random.default_rng(7)
    wire = Wire("float16")
    wire.announce(0, _model(rng))
    tensors, ref, dtype = wire.downlink.sync_frames()["full"]
    assert dtype == "float16"  # every served value came through float16
    rounded = decode(encode(Frame(Header(Kind.MODEL, "f", 0, 0, "aggregator", 1), {}, tensors), dtype)).tensors
    assert model_hash(rounded) == ref.hash
    assert not any(mask.any() for mask in changes(rounded, wire.downlink.served).values())


# docs/protocol.md P-1.1
def test_a_protocol_2_frame_carries_the_protocol_1_hash_and_a_protocol_1_frame_still_applies() -> None:
    """A protocol 2 announcement keeps ``hash`` (what a protocol 1 device checks) beside ``digest``;
    an announcement from a protocol 1 aggregator (no digest) is applied and checked by its hash."""
    wire = Wire()
    rng = np.random.default_rng(3)
    model = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    frame, _ = wire.announce(0, model)
    ref = ModelRef.of(frame.meta)
    assert ref.hash == model_hash(wire.downlink.served) and ref.digest == model_digest(wire.downlink.served)
    old = dict(frame.meta, model={k: v for k, v in frame.meta["model"].items() if k != "digest"})
    replica = ModelReplica(lambda rnd: None)
    assert model_hash(replica.take(dataclasses.replace(frame, meta=old))) == ref.hash
    forged = dict(old, model={**old["model"], "hash": "0" * 32})
    assert ModelReplica(lambda rnd: None).take(dataclasses.replace(frame, meta=forged)) == FULL
