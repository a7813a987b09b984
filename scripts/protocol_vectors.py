"""Write the golden vectors of docs/protocol.md to docs/protocol-vectors/ (or check them).

    python scripts/protocol_vectors.py            # (re)write the files
    python scripts/protocol_vectors.py --check    # exit 1 if a file differs from what is written

``frames.json``: frames of every kind, layout and value dtype, a signed one and a derived
delta, each as hex with its decoded content; ``invalid.json``: frames a decoder must reject,
with the field its error names; ``model-digest.json``: a model and its protocol 1 hash and
protocol 2 digest; ``splitmix64.json``: the first outputs of a few SplitMix64 streams;
``derived-positions.json``: a MADE with ``mask_rng: splitmix64``, its orders, degrees and the
derived positions of its first announcements (rule P-7.9).
Everything here is deterministic: the same bytes on every machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import struct
import sys
from pathlib import Path

import numpy as np

from fclcore.codec import Frame, Header, Kind, SparseTensor, ValueCoding, decode, encode
from fclcore.config import to_dict
from fclcore.crc import crc32
from fclcore.made_spec import MadeConfig, hidden_degrees, input_order, made_masks, mask_for_param, order_schedule
from fclcore.model_sync import ModelRef, model_digest, model_hash
from fclcore.schema import FederationSpec, ModelSpec
from fclcore.signing import sign
from fclcore.splitmix import SplitMix64

OUT = Path(__file__).resolve().parents[1] / "docs" / "protocol-vectors"
KEY = bytes(range(32))  # the signed vector's device key
RUN = "0006f1c2a3b4c5d6-1a2b3c4d"
_LAYOUTS = {0: "dense", 1: "index", 2: "bitmap"}
_DTYPES = {1: "float32", 2: "float16", 3: "int8"}


def _header(kind: Kind, rnd: int = 3, client: str = "dev-1", seq: int = 1_700_000_000_000_001) -> Header:
    return Header(kind, "fed", rnd, 1, client, seq)


def _agg(kind: Kind, rnd: int = 3) -> Header:
    return _header(kind, rnd, "aggregator", 42)


def _model() -> dict[str, np.ndarray]:
    return {
        "net.0.weight": (np.arange(12, dtype=np.float32).reshape(3, 4) - 5.5) / 4,
        "net.0.bias": np.array([0.5, -0.0, 2.0], np.float32),
        "s": np.array(1.25, np.float32),
    }


def _sparse(numel: int, positions: list[int], shape: tuple[int, ...] | None = None) -> SparseTensor:
    values = np.arange(1, len(positions) + 1, dtype=np.float32) * np.float32(-0.75)
    return SparseTensor(shape or (numel,), np.asarray(positions), values)


def frames() -> list[tuple[str, str, bytes, list[str]]]:
    """(name, what it shows, payload, rules it exercises)."""
    model = _model()
    ref = ModelRef(4, None, model_hash(model), digest=model_digest(model))
    fed = FederationSpec(name="fed", method="fedavg", num_tasks=2, rounds_per_task=4, model=ModelSpec(hidden_sizes=[3]))
    fed = dataclasses.replace(fed, wire=dataclasses.replace(fed.wire, value_dtype="float32"))  # as announced: resolved
    round_meta = {
        "run": RUN,
        "federation": to_dict(fed),
        "clock_us": 1_700_000_000_000_000,
        "input_dim": 4,
        "total_rounds": 8,
        "attempt": 1,
        "schedule": {"task": 1, "task_start": False, "task_end": False, "previous": None},
        "model": ref.to_meta(),
    }
    changed = dict(model, **{"net.0.bias": np.array([0.5, 1.0, 2.0], np.float32)})
    delta_ref = ModelRef(5, 4, model_hash(changed), ("net.0.weight",), digest=model_digest(changed))
    delta_meta = {**round_meta, "model": delta_ref.to_meta()}
    eval_meta = {"eval": {"round": 7, "task": 1, "nll": [None, 12.5]}, "rejected": {}}
    update_meta = {"n_samples": 20, "train_nll": 3.25, "rejected": {"run": 1}}
    cases = [
        ("round-full-dense", "ROUND with a full model, dense float32", _agg(Kind.ROUND), round_meta, model, "float32"),
        (
            "update-index-u16",
            "UPDATE, index list with u16 indices",
            _header(Kind.UPDATE),
            update_meta,
            {"w": _sparse(100, [0, 7, 99])},
            "float32",
        ),
        (
            "update-index-u32",
            "UPDATE, index list with u32 indices (numel > 65536)",
            _header(Kind.UPDATE),
            update_meta,
            {"w": _sparse(70000, [1, 65536, 69999], (7, 10000))},
            "float32",
        ),
        (
            "update-bitmap",
            "UPDATE, bitmap (13 elements: 3 padding bits)",
            _header(Kind.UPDATE),
            update_meta,
            {"w": _sparse(13, [0, 1, 2, 5, 8, 12])},
            "float32",
        ),
        (
            "update-float16",
            "UPDATE, float16 values, dense and sparse",
            _header(Kind.UPDATE),
            update_meta,
            {"w": model["net.0.weight"], "v": _sparse(100, [3, 50])},
            "float16",
        ),
        (
            "update-int8",
            "UPDATE, int8 blocks (frame version 2), block 4, dense and sparse",
            _header(Kind.UPDATE),
            update_meta,
            {"w": model["net.0.weight"], "v": _sparse(100, [3, 50, 60])},
            ValueCoding("int8", block=4),
        ),
        (
            "round-derived-delta",
            "ROUND delta: a derived tensor (values at positions 0, 5, 10), its @outside, a dense change",
            _agg(Kind.ROUND, 5),
            delta_meta,
            {
                "net.0.weight": np.array([1.0, 2.0, 3.0], np.float32),
                "net.0.weight@outside": _sparse(12, [3], (3, 4)),
                "net.0.bias": changed["net.0.bias"],
            },
            "float32",
        ),
        ("eval", "EVAL answering FINISH", _header(Kind.EVAL, 8), eval_meta, {}, "float32"),
        (
            "finish",
            "FINISH with a full model",
            _agg(Kind.FINISH, 8),
            {**round_meta, "model": ref.to_meta()},
            model,
            "float32",
        ),
        (
            "request",
            "REQUEST naming two devices",
            _agg(Kind.REQUEST),
            {"missing": ["dev-1", "dev-2"], "kind": "UPDATE", "run": RUN},
            {},
            "float32",
        ),
        (
            "model-full",
            "MODEL on model/full, float16 (lossless here)",
            _agg(Kind.MODEL),
            {"run": RUN, "model": ref.to_meta()},
            model,
            "float16",
        ),
        (
            "knowledge",
            "KNOWLEDGE with one entry",
            _agg(Kind.KNOWLEDGE),
            {"run": RUN, "for_task": 1, "entries": [{"id": "dev-2/t0", "client": "dev-2", "task": 0}]},
            {"dev-2/t0|net.0.weight": model["net.0.weight"]},
            "float32",
        ),
    ]
    out = [(n, w, encode(Frame(h, m, t), c), _rules(t, c)) for n, w, h, m, t, c in cases]
    signed = encode(Frame(_header(Kind.UPDATE), update_meta, {"w": model["net.0.weight"]}))
    out.append(
        ("update-signed", "UPDATE in a signed envelope (key: bytes 00..1f)", sign(signed, KEY), ["P-6.1", "P-6.2"])
    )
    return out


def _rules(tensors: dict, coding) -> list[str]:
    rules = ["P-4.1", "P-4.6"]
    if any(isinstance(t, SparseTensor) for t in tensors.values()):
        rules += ["P-5.2", "P-5.3"]
    if isinstance(coding, ValueCoding):
        rules += ["P-1.2", "P-5.7"]
    return rules


def decoded(payload: bytes) -> dict:
    """A frame's content as JSON: header, meta, and per tensor its wire layout, dtype, shape,
    positions (sparse) and float32 values as decoded (flat, row-major).  Every tensor of a
    frame this encoder writes has the same dtype, the frame's value coding."""
    frame_bytes = payload[36:] if payload[:4] == b"FCLS" else payload
    frame = decode(frame_bytes)
    h = frame.header
    tensors = {}
    for name, tensor in frame.tensors.items():
        entry = {"layout": _layout(tensor), "dtype": _DTYPES[_first_dtype(frame_bytes)], "shape": list(tensor.shape)}
        if isinstance(tensor, SparseTensor):
            entry["indices"] = [int(i) for i in tensor.indices]
            values = tensor.values
        else:
            values = np.asarray(tensor).reshape(-1)
        entry["values"] = [float(v) for v in values]
        tensors[name] = entry
    header = {"version": frame_bytes[4], "kind": h.kind.name, "round": h.round, "task": h.task}
    header.update({"sequence": h.sequence, "federation": h.federation, "client": h.client})
    return {"header": header, "meta": frame.meta, "tensors": tensors}


def _layout(tensor) -> str:
    if not isinstance(tensor, SparseTensor):
        return "dense"
    return "bitmap" if tensor.bitmap is not None else "index"


def _first_dtype(frame: bytes) -> int:
    """The dtype byte of the first tensor record (header, strings, meta, count, name, layout)."""
    pos = 24
    pos += 1 + frame[pos]
    pos += 1 + frame[pos]
    pos += 4 + struct.unpack_from("<I", frame, pos)[0] + 2
    return frame[pos + 1 + frame[pos] + 1]


def _with_crc(body: bytes) -> bytes:
    return body + struct.pack("<I", crc32(body))


def invalid() -> list[tuple[str, str, bytes, str]]:
    """(name, what is wrong, bytes, the field the error names)."""
    good = encode(Frame(_header(Kind.UPDATE), {"n_samples": 1}, {"w": _sparse(100, [0, 7, 99])}))
    body = bytearray(good[:-4])
    cases = [("bad-crc", "CRC of other bytes", good[:-4] + bytes(4), "checksum")]

    def patched(name: str, what: str, offset: int, value: bytes, field: str) -> None:
        changed = bytearray(body)
        changed[offset : offset + len(value)] = value
        cases.append((name, what, _with_crc(bytes(changed)), field))

    patched("bad-magic", "magic FCLX", 0, b"FCLX", "header.magic")
    patched("bad-version", "frame version 3", 4, b"\x03", "header.version")
    patched("bad-kind", "kind 10", 5, b"\x0a", "header.kind")
    patched("bad-flags", "flags 1", 6, b"\x01\x00", "header.flags")
    idx = body.rfind(struct.pack("<HHH", 0, 7, 99))
    patched("unordered-indices", "indices 0, 99, 7", idx, struct.pack("<HHH", 0, 99, 7), "indices")
    patched("index-out-of-range", "index 100 of 100 elements", idx + 4, struct.pack("<H", 100), "indices")
    int8 = bytearray(encode(Frame(_header(Kind.UPDATE), {}, {"w": np.ones(4, np.float32)}), ValueCoding("int8"))[:-4])
    cases.append(
        ("int8-in-v1", "dtype 3 in a version 1 frame", _with_crc(bytes(int8[:4]) + b"\x01" + bytes(int8[5:])), "dtype")
    )
    int8[-1] = 0x80
    cases.append(("int8-code-128", "int8 code -128", _with_crc(bytes(int8)), "codes"))
    nan = bytearray(encode(Frame(_header(Kind.UPDATE), {}, {"w": np.ones(2, np.float32)}))[:-4])
    nan[-4:] = struct.pack("<I", 0x7FC00000)
    cases.append(("nan-value", "a NaN value", _with_crc(bytes(nan)), "values"))
    meta = encode(Frame(_header(Kind.UPDATE), {"a": 123, "b": 2}, {}))[:-4]
    cases.append(("meta-nan", "meta with NaN", _with_crc(meta.replace(b'"a":123', b'"a":NaN')), "meta"))
    cases.append(("meta-duplicate-key", "meta with a key twice", _with_crc(meta.replace(b'"b":2', b'"a":2')), "meta"))
    cases.append(("trailing-bytes", "a byte after the tensor table", _with_crc(bytes(body) + b"\x00"), "trailing"))
    cases.append(("truncated", "the last tensor cut short", _with_crc(bytes(body[:-2])), "values"))
    return cases


def splitmix() -> list[dict]:
    out = []
    for seed, keys in ((0, ()), (7, (0,)), (7, (1, 3)), (2**64 - 1, (12345,))):
        rng = SplitMix64(seed, *keys)
        outputs = [f"{rng.next():016x}" for _ in range(4)]
        below = [rng.below(10) for _ in range(8)]
        out.append(
            {
                "seed": seed,
                "keys": list(keys),
                "next": outputs,
                "then_below_10": below,
                "permutation_16": SplitMix64(seed, *keys).permutation(16),
            }
        )
    return out


MADE = MadeConfig(6, (5, 4), direct=True, natural_order=False, num_orders=3, mask_seed=7, mask_rng="splitmix64")


def derived_positions() -> dict:
    """P-7.9: for announcement r (r >= 1), the masks of order ((r - 1) * 7919) mod num_orders."""
    made = {k: getattr(MADE, k) for k in ("input_dim", "direct", "natural_order", "num_orders", "mask_seed")}
    made.update(hidden_sizes=list(MADE.hidden_sizes), connectivity_agnostic=False, mask_rng=MADE.mask_rng)
    announcements = {}
    for rnd in (1, 2, 3):
        masks = made_masks(MADE, order_schedule(MADE, rnd - 1, 0))
        names = [f"hidden.{i}.weight" for i in range(len(MADE.hidden_sizes))] + ["output.weight", "direct.weight"]
        announcements[str(rnd)] = {n: mask_for_param(masks, n).astype(int).tolist() for n in names}
    return {
        "model": made,
        "orders": [input_order(MADE, k).tolist() for k in range(MADE.num_orders)],
        "degrees": [m.tolist() for m in hidden_degrees(MADE)],
        "positions_by_announcement": announcements,
    }


def documents() -> dict[str, object]:
    model = _model()
    return {
        "frames.json": [
            {
                "name": n,
                "shows": w,
                "rules": r,
                "hex": p.hex(),
                **({"key": KEY.hex()} if p[:4] == b"FCLS" else {}),
                "decoded": decoded(p),
            }
            for n, w, p, r in frames()
        ],
        "invalid.json": [{"name": n, "wrong": w, "hex": p.hex(), "error_field": f} for n, w, p, f in invalid()],
        "model-digest.json": {
            "tensors": {
                k: {"shape": list(v.shape), "values": [float(x) for x in v.reshape(-1)]} for k, v in model.items()
            },
            "hash": model_hash(model),
            "digest": model_digest(model),
        },
        "splitmix64.json": splitmix(),
        "derived-positions.json": derived_positions(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a committed file differs")
    args = parser.parse_args()
    stale = []
    OUT.mkdir(parents=True, exist_ok=True)
    for name, doc in documents().items():
        text = json.dumps(doc, indent=1) + "\n"
        path = OUT / name
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        print(f"stale vectors: {', '.join(stale)} (run python scripts/protocol_vectors.py)", file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
