"""The ``fcl.*`` metadata schema of an exported MADE (format ``fcl-made/1``); pure Python.

Shared by the exporter (which writes it) and the torch-free runtime (which validates it).
Every value is a string in the ONNX ``metadata_props``; non-string values are JSON.  The
value parsers (``_int``, ``_hex``, ``_str_list``, ...) and :func:`read_entries` serve the
text formats' schemas too (``export.text_runtime``, ``export.text_tasks_runtime``).

| key                    | encoding | meaning |
|------------------------|----------|---------|
| fcl.format             | str      | ``fcl-made/1`` |
| fcl.method             | str      | learning method that produced the weights |
| fcl.task               | JSON int | task index the weights were served for |
| fcl.input_dim          | JSON int | D |
| fcl.hidden_sizes       | JSON list| hidden layer widths |
| fcl.direct             | JSON bool| direct input->output connection |
| fcl.mask_seed          | JSON int | MadeConfig.mask_seed |
| fcl.natural_order      | JSON bool| MadeConfig.natural_order |
| fcl.num_orders         | JSON int | MadeConfig.num_orders |
| fcl.order_index        | JSON int | order whose masks are baked in (already reduced mod num_orders) |
| fcl.input_order        | JSON list| ``order[p]`` = dimension at position p (sampling order) |
| fcl.binarize           | str      | how raw data were binarised, informational |
| fcl.toolkit_version    | str      | fcl-edge version that exported the file |
| fcl.quantization       | str      | ``none`` or ``int8-dynamic`` |
| fcl.int8_nll_delta     | JSON float | int8 files only: mean NLL(int8) - NLL(fp32), nats/sample |
| fcl.int8_eval          | str      | int8 files only: which inputs the delta was measured on |
| fcl.weights_sha256     | hex      | hash of the initializers (``export._proto.weights_digest``) |
| fcl.integrity_sha256   | hex      | hash of the whole file (``export._proto.integrity_digest``) |
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Callable

from fclcore.errors import BadInput

FORMAT = "fcl-made/1"
PREFIX = "fcl."
_HEX64 = re.compile(r"[0-9a-f]{64}")


class MetadataError(BadInput):
    """A missing or invalid ``fcl.*`` metadata entry."""


def _json(raw: str, key: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        raise MetadataError(f"{key} is not valid JSON: {raw[:60]!r}") from None


def _int(minimum: int) -> Callable[[str, str], int]:
    def parse(raw: str, key: str) -> int:
        v = _json(raw, key)
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise MetadataError(f"{key} must be an int >= {minimum}, got {raw[:60]!r}")
        return v

    return parse


def _bool(raw: str, key: str) -> bool:
    v = _json(raw, key)
    if not isinstance(v, bool):
        raise MetadataError(f"{key} must be true or false, got {raw[:60]!r}")
    return v


def _text(nonempty: bool) -> Callable[[str, str], str]:
    def parse(raw: str, key: str) -> str:
        if nonempty and not raw.strip():
            raise MetadataError(f"{key} must not be empty")
        return raw

    return parse


def _hex(raw: str, key: str) -> str:
    if not _HEX64.fullmatch(raw):
        raise MetadataError(f"{key} must be 64 lowercase hex characters")
    return raw


def _int_list(raw: str, key: str) -> list[int]:
    v = _json(raw, key)
    if not isinstance(v, list) or not v or any(isinstance(e, bool) or not isinstance(e, int) for e in v):
        raise MetadataError(f"{key} must be a non-empty JSON list of ints")
    return v


def _float(raw: str, key: str) -> float:
    v = _json(raw, key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise MetadataError(f"{key} must be a finite number, got {raw[:60]!r}")
    return float(v)


def _nested_int_lists(raw: str, key: str) -> list[list[int]]:
    v = _json(raw, key)
    if (
        not isinstance(v, list)
        or not v
        or any(
            not isinstance(row, list) or not row or any(isinstance(e, bool) or not isinstance(e, int) for e in row)
            for row in v
        )
    ):
        raise MetadataError(f"{key} must be a non-empty JSON list of non-empty int lists")
    return v


def _str_list(raw: str, key: str) -> list[str]:
    v = _json(raw, key)
    if not isinstance(v, list) or any(not isinstance(e, str) for e in v):
        raise MetadataError(f"{key} must be a JSON list of strings")
    return v


def _fraction(raw: str, key: str) -> float:
    v = _float(raw, key)
    if not 0.0 <= v <= 1.0:
        raise MetadataError(f"{key} must be in [0, 1], got {v}")
    return v


REQUIRED: dict[str, Callable[[str, str], Any]] = {
    "format": _text(True),
    "method": _text(True),
    "task": _int(0),
    "input_dim": _int(1),
    "hidden_sizes": _int_list,
    "direct": _bool,
    "mask_seed": _int(0),
    "natural_order": _bool,
    "num_orders": _int(1),
    "order_index": _int(0),
    "input_order": _int_list,
    "binarize": _text(False),
    "toolkit_version": _text(True),
    "quantization": _text(True),
    "weights_sha256": _hex,
    "integrity_sha256": _hex,
}
OPTIONAL: dict[str, Callable[[str, str], Any]] = {
    "int8_nll_delta": _float,
    "int8_eval": _text(False),
}


def encode(values: dict[str, Any]) -> dict[str, str]:
    """``{"task": 3, ...}`` -> ``{"fcl.task": "3", ...}`` (strings kept as they are, the rest JSON)."""
    return {PREFIX + k: v if isinstance(v, str) else json.dumps(v) for k, v in values.items()}


def read_entries(
    raw: dict[str, str],
    required: dict[str, Callable[[str, str], Any]],
    optional: dict[str, Callable[[str, str], Any]],
) -> dict[str, Any]:
    """Every ``required`` and each present ``optional`` ``fcl.*`` entry of ``raw``, read by its
    parser; keys without the prefix.  Shared by every format's schema."""
    out: dict[str, Any] = {}
    for name, fn in required.items():
        key = PREFIX + name
        if key not in raw:
            raise MetadataError(f"missing metadata {key}")
        out[name] = fn(raw[key], key)
    for name, fn in optional.items():
        if PREFIX + name in raw:
            out[name] = fn(raw[PREFIX + name], PREFIX + name)
    return out


def read_format(
    raw: dict[str, str],
    want: str,
    reader: str,
    required: dict[str, Callable[[str, str], Any]],
    optional: dict[str, Callable[[str, str], Any]],
    hints: dict[str, str] | None = None,
) -> dict[str, Any]:
    """:func:`read_entries` of a file whose ``fcl.format`` is ``want``; another format is refused
    naming ``reader`` (``"this ... runtime"``) and, from ``hints``, what that format is."""
    fmt = raw.get(PREFIX + "format")
    if fmt is None:
        raise MetadataError("no fcl.format metadata (not an fcl-edge export)")
    if fmt != want:
        hint = f" ({hints[fmt]})" if hints and fmt in hints else ""
        raise MetadataError(f"fcl.format is {fmt[:40]!r}, {reader} reads {want!r}{hint}")
    return read_entries(raw, required, optional)


def check_quantization(out: dict[str, Any], int8_key: str) -> None:
    """``fcl.quantization`` is ``none`` or ``int8-dynamic``, and an int8 file records ``int8_key``
    (what its exporter measured on it)."""
    if out["quantization"] not in ("none", "int8-dynamic"):
        raise MetadataError(f"fcl.quantization must be 'none' or 'int8-dynamic', got {out['quantization'][:40]!r}")
    if out["quantization"] == "int8-dynamic" and int8_key not in out:
        raise MetadataError(f"int8 model without {PREFIX}{int8_key}")


def parse(raw: dict[str, str]) -> dict[str, Any]:
    """Validate the ``fcl.*`` entries of ``raw``; return them parsed, keys without the prefix."""
    out = read_format(raw, FORMAT, "this runtime", REQUIRED, OPTIONAL)
    d = out["input_dim"]
    if any(h < 1 for h in out["hidden_sizes"]):
        raise MetadataError("fcl.hidden_sizes must all be >= 1")
    if sorted(out["input_order"]) != list(range(d)):
        raise MetadataError(f"fcl.input_order must be a permutation of range({d})")
    if out["order_index"] >= out["num_orders"]:
        raise MetadataError("fcl.order_index must be < fcl.num_orders")
    check_quantization(out, "int8_nll_delta")
    return out
