"""The global model on the downlink: versions, deltas, hashes (the contract both halves use).

The aggregator numbers its global model: version ``v`` is the model after ``v`` committed
rounds, the one round ``v`` is announced with.  A round announcement (ROUND or FINISH) carries
the model as a *delta* from the version before, holding only the tensors whose values changed,
each coded the cheapest of three ways:

* **derived**: the values at positions both sides derive from the seed (a method's
  ``MethodSpec.downlink_positions``; for ConFedMADE, the aggregated round's MADE mask), as a
  1-D array in row-major order: no index information on the wire; the few changes outside
  them (ConFedMADE's catch-up entries) travel beside it as ``<name>@outside``, a SparseTensor;
* **sparse**: a ``SparseTensor`` (the codec then picks an index list or a bitmap);
* **dense**: the whole tensor (also for a tensor that is new or changed shape).

Its metadata is ``meta.model = {"version": v, "base": b, "hash": h, "digest": d, "derived":
[...], "removed": [...]}``: the frame turns any model of a version in ``[b, v)`` into version
``v`` (``b = v - 1`` for a round's delta; ``base: null`` for a full model), and ``h`` and ``d``
are hashes of the whole model as the device must then hold it: ``h`` the protocol 1 hash (it
hashes Python's ``repr`` of each shape, so only Python reproduces it easily), ``d`` the protocol
2 digest over a byte encoding any language writes (docs/protocol.md, rules P-7.5 and P-7.6).
The Python device checks both (the digest when the frame has one); a device in another
language checks the digest.  A device that does not hold a version in
``[b, v)`` (it just joined, restarted or missed rounds), or whose hash differs after applying,
fetches a sync frame instead: the catch-up frame (every entry changed over the last few
versions) or the full model, both published retained and coded without loss.
"""

from __future__ import annotations

import hashlib
import re
import struct
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from fclcore.codec import SparseTensor, Tensor

# (federation, options, input_dim, rnd) -> {tensor name: bool mask of its shape} or None: the
# positions the aggregation of round ``rnd`` can change, derived on both sides from the seed
Positions = Callable[..., "Mapping[str, np.ndarray] | None"]
MAX_NAMES = 4096
VALUE_BYTES = {"float32": 4, "float16": 2, "int8": 1}  # bytes per value on the wire, by ``wire.value_dtype``
OUTSIDE = "@outside"  # suffix of a derived tensor's changes outside its derived positions
_HASH_CHARS = 32
DIGEST_CHARS = 64
_HEX = re.compile(f"[0-9a-f]{{{DIGEST_CHARS}}}")
_DIGEST_MAGIC = b"FCLM\x02"  # "FCLM", then the digest's format number
_FLOAT32 = 1  # the codec's dtype code, the one dtype a held model has
# a device's sync report (update ``meta.sync``, cumulative): besides the model's sync frames
# ("full", "catchup", their "bytes", ...), the full knowledge frames it fetched because its own
# named entries it no longer held, and their bytes
SYNC_KNOWLEDGE, SYNC_KNOWLEDGE_BYTES = "knowledge", "knowledge_bytes"


def model_hash(params: Mapping[str, np.ndarray]) -> str:
    """A digest of a whole model: names, shapes and float32 values (order of the mapping ignored)."""
    digest = hashlib.sha256()
    for name in sorted(params):
        value = np.ascontiguousarray(params[name], dtype="<f4")
        digest.update(name.encode() + b"\0" + repr(value.shape).encode() + b"\0")
        digest.update(value.data)
    return digest.hexdigest()[:_HASH_CHARS]


def model_digest(params: Mapping[str, np.ndarray]) -> str:
    """The protocol 2 digest of a whole model: SHA-256 over a little-endian byte encoding of each
    tensor's name, dtype, shape and float32 values, in byte order of the UTF-8 names."""
    digest = hashlib.sha256(_DIGEST_MAGIC + struct.pack("<I", len(params)))
    for raw, name in sorted((n.encode(), n) for n in params):
        value = np.asarray(params[name], dtype="<f4")  # (ascontiguousarray would make a scalar 1-D)
        digest.update(struct.pack(f"<H{len(raw)}sBB{value.ndim}I", len(raw), raw, _FLOAT32, value.ndim, *value.shape))
        digest.update(value.tobytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class ModelRef:
    """What a frame says about the model it carries (``meta.model``)."""

    version: int
    base: int | None  # the frame applies to any held version in [base, version); None: a full model
    hash: str
    derived: tuple[str, ...] = ()  # tensors sent as values at derived positions
    removed: tuple[str, ...] = ()  # tensors the new version no longer has
    digest: str | None = None  # the protocol 2 digest (``model_digest``); None from a protocol 1 aggregator

    def to_meta(self) -> dict:
        return {
            "version": self.version,
            "base": self.base,
            "hash": self.hash,
            **({"digest": self.digest} if self.digest is not None else {}),
            "derived": list(self.derived),
            "removed": list(self.removed),
        }

    def matches(self, params: Mapping[str, np.ndarray]) -> bool:
        """Whether ``params`` is the model this ref names: its hash, and its digest when it has one."""
        return model_hash(params) == self.hash and (self.digest is None or model_digest(params) == self.digest)

    def applies_to(self, held: int | None) -> bool:
        """Whether a device holding version ``held`` can apply this frame."""
        return self.base is None or (held is not None and self.base <= held < self.version)

    @classmethod
    def of(cls, meta: Mapping) -> ModelRef | None:
        """The frame's ``meta.model``, None when it has none; ValueError when it is malformed."""
        raw = meta.get("model")
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise ValueError("model: expected an object with version, base and hash")
        version, base, digest = raw.get("version"), raw.get("base"), raw.get("hash")
        if not _count(version) or not (base is None or (_count(base) and base < version)):
            raise ValueError(f"model: expected version >= 0 and base null or below it, got {version!r}, {base!r}")
        if not isinstance(digest, str) or len(digest) != _HASH_CHARS:
            raise ValueError(f"model.hash: expected {_HASH_CHARS} hex characters")
        neutral = raw.get("digest")
        if neutral is not None and not (isinstance(neutral, str) and _HEX.fullmatch(neutral)):
            raise ValueError(f"model.digest: expected {DIGEST_CHARS} lower-case hex characters")
        derived, removed = _names(raw.get("derived", []), "derived"), _names(raw.get("removed", []), "removed")
        if base is None and (derived or removed):
            raise ValueError("model: a full model has no derived or removed tensors")
        return cls(int(version), None if base is None else int(base), digest, derived, removed, neutral)


def delta(
    held: Mapping[str, np.ndarray] | None,
    new: Mapping[str, np.ndarray],
    positions: Mapping[str, np.ndarray] | None = None,
    value_bytes: int = 4,
) -> tuple[dict[str, Tensor], tuple[str, ...], tuple[str, ...]]:
    """(tensors, derived names, removed names) that turn ``held`` into ``new``; everything,
    dense, when ``held`` is None.  ``value_bytes``: bytes per value on the wire (picks the
    cheapest coding per tensor)."""
    if held is None:
        return {k: np.asarray(v, dtype=np.float32) for k, v in new.items()}, (), ()
    tensors: dict[str, Tensor] = {}
    derived = []
    for name, value in new.items():
        value = np.asarray(value, dtype=np.float32)
        before = held.get(name)
        if before is None or before.shape != value.shape:
            tensors[name] = value
            continue
        pos = positions.get(name) if positions else None
        coded, is_derived = _cheapest(name, value, _differs(before, value), pos, value_bytes)
        tensors.update(coded)
        if is_derived:
            derived.append(name)
    removed = tuple(sorted(set(held) - set(new)))
    return tensors, tuple(derived), removed


def apply(
    held: Mapping[str, np.ndarray] | None,
    ref: ModelRef,
    tensors: Mapping[str, Tensor],
    positions: Mapping[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """The model after a frame (``ref`` and its tensors); ``held`` is not changed (a tensor the
    frame does not touch is shared with it).  ValueError naming the tensor if the frame does
    not fit ``held``: the caller then resyncs, it never keeps a half-applied model."""
    if ref.base is None:
        if any(isinstance(t, SparseTensor) for t in tensors.values()):
            raise ValueError("model: a full model is dense")
        return {k: np.asarray(v, dtype=np.float32) for k, v in tensors.items()}
    if held is None:
        raise ValueError("model: a delta needs a held model")
    out = dict(held)
    for name in ref.removed:
        if out.pop(name, None) is None:
            raise ValueError(f"{name}: removed, but not in the held model")
    missing = sorted(set(ref.derived) - set(tensors))
    if missing:
        raise ValueError(f"{missing[0]}: listed as derived but not sent")
    stray = sorted(k for k in tensors if k.endswith(OUTSIDE) and k[: -len(OUTSIDE)] not in ref.derived)
    if stray:
        raise ValueError(f"{stray[0]}: changes outside derived positions of a tensor not sent as derived")
    for name, t in tensors.items():
        if name.endswith(OUTSIDE):
            continue
        before = held.get(name)
        if name in ref.derived:
            pos = positions.get(name) if positions else None
            if before is None or pos is None or pos.shape != before.shape:
                raise ValueError(f"{name}: derived positions do not fit the held model")
            values = np.asarray(t)
            if isinstance(t, SparseTensor) or values.shape != (int(np.count_nonzero(pos)),):
                raise ValueError(f"{name}: expected {int(np.count_nonzero(pos))} values at the derived positions")
            value = before.copy()
            value[pos] = values
            outside = tensors.get(name + OUTSIDE)
            if outside is not None:
                if not isinstance(outside, SparseTensor) or outside.shape != before.shape:
                    raise ValueError(f"{name + OUTSIDE}: expected a sparse tensor of shape {before.shape}")
                if pos.reshape(-1)[outside.indices].any():
                    raise ValueError(f"{name + OUTSIDE}: entries inside the derived positions")
                value.reshape(-1)[outside.indices] = outside.values
        elif isinstance(t, SparseTensor):
            if before is None or before.shape != t.shape:
                raise ValueError(f"{name}: a sparse change of a tensor the held model lacks or shapes otherwise")
            value = before.copy()
            value.reshape(-1)[t.indices] = t.values
        else:
            value = np.array(t, dtype=np.float32)
        out[name] = value
    return out


def changes(held: Mapping[str, np.ndarray], new: Mapping[str, np.ndarray]) -> dict[str, np.ndarray] | None:
    """name -> bool mask of the entries that differ; None when a tensor appeared, vanished or
    changed shape (only a full model then bridges the two)."""
    if set(held) != set(new) or any(held[k].shape != new[k].shape for k in new):
        return None
    return {k: _differs(held[k], new[k]) for k in new}


def catchup(
    steps: list[Mapping[str, np.ndarray]], new: Mapping[str, np.ndarray], value_bytes: int
) -> dict[str, Tensor]:
    """The tensors of a catch-up frame: ``new``'s values wherever any of ``steps`` (``changes``
    masks of consecutive versions) changed an entry, sparse or dense, whichever is smaller."""
    tensors: dict[str, Tensor] = {}
    for name, value in new.items():
        mask = np.zeros(value.shape, dtype=bool)
        for step in steps:
            mask |= step[name]
        tensors.update(_cheapest(name, value, mask, None, value_bytes)[0])
    return tensors


def _cheapest(
    name: str, value: np.ndarray, changed: np.ndarray, pos: np.ndarray | None, value_bytes: int
) -> tuple[dict[str, Tensor], bool]:
    """``value``'s ``changed`` entries coded the cheapest way, and whether as derived values:
    the values at the derived positions ``pos`` (a 1-D array, plus the changes outside them as
    a SparseTensor named ``name + OUTSIDE``), a SparseTensor, or the whole tensor."""
    nnz = int(np.count_nonzero(changed))
    if nnz == 0:
        return {}, False
    costs = {"dense": value.size * value_bytes, "sparse": _sparse_bytes(nnz, value.size, value_bytes)}
    if pos is not None and pos.shape == value.shape:
        outside = changed & ~pos
        n_out = int(np.count_nonzero(outside))
        costs["derived"] = int(np.count_nonzero(pos)) * value_bytes
        costs["derived"] += _sparse_bytes(n_out, value.size, value_bytes) if n_out else 0
    best = min(costs, key=costs.__getitem__)
    if best == "derived":
        out: dict[str, Tensor] = {name: np.ascontiguousarray(value[pos])}
        if n_out:
            flat = np.flatnonzero(outside)
            out[name + OUTSIDE] = SparseTensor(value.shape, flat, value.reshape(-1)[flat])
        return out, True
    if best == "sparse":
        flat = np.flatnonzero(changed)
        return {name: SparseTensor(value.shape, flat, value.reshape(-1)[flat])}, False
    return {name: value}, False


def _sparse_bytes(nnz: int, numel: int, value_bytes: int) -> int:
    """A SparseTensor's bytes on the wire: its count, an index list or a bitmap, its values."""
    return 4 + nnz * value_bytes + min(nnz * (2 if numel <= 65536 else 4), -(-numel // 8))


def lossless_dtype(params: Mapping[str, Tensor]) -> str:
    """float16 when every value survives it exactly, else float32 (sync frames must not round)."""
    for t in params.values():
        values = t.values if isinstance(t, SparseTensor) else np.asarray(t)
        if values.dtype != np.float16 and not np.array_equal(values.astype(np.float16).astype(np.float32), values):
            return "float32"
    return "float16"


def _differs(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Entries whose float32 bits differ (so 0.0 and -0.0 count as a change, as in the hash)."""
    return np.ascontiguousarray(a, dtype="<f4").view("<u4") != np.ascontiguousarray(b, dtype="<f4").view("<u4")


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**32


def _names(value: object, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or len(value) > MAX_NAMES or not all(isinstance(n, str) for n in value):
        raise ValueError(f"model.{where}: expected a list of tensor names")
    return tuple(value)
