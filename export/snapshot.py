"""``served.npz``: the snapshot of a served model that the client daemon writes next to its model.

Every served format has one (``fcl export served.npz`` re-exports it to a verified ONNX
file).  A snapshot is a numpy ``.npz``, never pickled: plain arrays plus ``__meta__``, a
unicode string array (0-d or one element) holding one JSON object whose ``"format"`` says
which served format it holds.  ``save_snapshot`` writes atomically (temp file in the same
directory + ``os.replace``); ``load_snapshot`` reads with ``allow_pickle=False`` and validates
names, dtypes, shapes and values, raising :class:`SnapshotError` naming the file and the
problem.  numpy only here (and in ``export.snapshot_formats``): no torch, no onnx.

``fcl-served/1`` (format ``made``; a ``__meta__`` without ``"format"`` is read as this one):

* one float array per MADE parameter, named exactly as ``param_shapes(made)``
  (``hidden.0.weight``, ..., ``output.bias``, ``direct.weight``), already composed by the
  learning method;
* ``__meta__``::

      {"format": "fcl-served/1",
       "input_dim": 64, "hidden_sizes": [128], "direct": true, "natural_order": true,
       "num_orders": 1, "mask_seed": 0,                 # the MadeConfig fields
       "order_index": 0, "method": "fedavg", "task": 1, "binarize": "value>7"}

  (the MadeConfig fields may also be nested under ``"made"``).

The other formats (``fcl-served-image-classifier/1``, ``fcl-served-text-groups/1``,
``fcl-served-text-tasks/1``) are described in ``export.snapshot_formats``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from export.publish import published_mode
from fclcore.errors import BadInput
from fclcore.made_spec import MadeConfig
from fclcore.npfile import refusal

__all__ = [
    "SnapshotError",
    "save_snapshot",
    "load_snapshot",
    "read_npz",
    "write_npz",
    "meta_int",
    "meta_names",
    "meta_str",
    "no_other_arrays",
    "SNAPSHOT_FORMAT",
]

SNAPSHOT_FORMAT = "fcl-served/1"
META_KEY = "__meta__"
_MADE_FIELDS = tuple(f.name for f in dataclasses.fields(MadeConfig))
_MADE_DEFAULTS = {"connectivity_agnostic": False, "mask_rng": "pcg64"}  # fields added after the format was fixed
_OTHER_FIELDS = ("order_index", "method", "task", "binarize")


class SnapshotError(BadInput):
    """A served-model snapshot that cannot be used; the message names the file and the problem."""


def save_snapshot(served: Any, path: str | os.PathLike) -> None:
    """Write the snapshot of ``served`` to ``path`` atomically: a ``fclcore.served`` description
    (``made``, ``image-classifier``, ``text-groups``) or a staged text-tasks export
    (``export.snapshot_formats.TextTasksStage``).  SnapshotError if it has no snapshot."""
    if getattr(served, "format", None) == "made":
        meta, arrays = _encode_made(served)
    else:
        from export.snapshot_formats import encode

        meta, arrays = encode(served)
    write_npz(path, meta, arrays)


def write_npz(path: str | os.PathLike, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    """``arrays`` and ``__meta__`` (``meta`` as JSON) as an ``.npz`` at ``path``, atomically."""
    path = Path(path)
    if META_KEY in arrays:
        raise SnapshotError(f"array name {META_KEY!r} is reserved")
    arrays = {**arrays, META_KEY: np.array(json.dumps(meta))}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, published_mode())
        with os.fdopen(fd, "wb") as fh:
            np.savez(fh, **arrays)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _encode_made(model: Any) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    meta: dict[str, Any] = {"format": SNAPSHOT_FORMAT}
    meta.update({f: getattr(model.made, f) for f in _MADE_FIELDS})
    meta["hidden_sizes"] = list(model.made.hidden_sizes)
    meta.update({f: getattr(model, f) for f in _OTHER_FIELDS})
    return meta, {name: np.asarray(a, dtype=np.float32) for name, a in model.params.items()}


def _meta(raw: np.ndarray, where: str) -> dict[str, Any]:
    if raw.dtype.kind != "U" or raw.size != 1:
        raise SnapshotError(f"{where}: {META_KEY} must be one JSON string, got dtype {raw.dtype} shape {raw.shape}")
    try:
        meta = json.loads(str(raw.reshape(())))
    except ValueError:
        raise SnapshotError(f"{where}: {META_KEY} is not valid JSON") from None
    if not isinstance(meta, dict):
        raise SnapshotError(f"{where}: {META_KEY} must be a JSON object")
    return meta


def read_npz(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(``__meta__`` as a dict, the other arrays) of a snapshot file, read without unpickling."""
    where = os.fspath(path)
    try:
        npz = np.load(where, allow_pickle=False)
        if not isinstance(npz, np.lib.npyio.NpzFile):
            raise SnapshotError(f"{where}: not an .npz archive (a single .npy array?)")
        with npz:
            names = list(npz.files)
            if META_KEY not in names:
                raise SnapshotError(f"{where}: no {META_KEY} entry (not a served-model snapshot)")
            meta = _meta(npz[META_KEY], where)
            arrays = {n: npz[n] for n in names if n != META_KEY}
    except SnapshotError:
        raise
    except FileNotFoundError:
        raise SnapshotError(f"{where}: no such snapshot file") from None
    except (ValueError, OSError, EOFError, zipfile.BadZipFile, KeyError) as exc:
        # allow_pickle=False raises ValueError for object arrays; truncated zips raise BadZipFile/EOFError.
        raise SnapshotError(f"{where}: cannot read snapshot: {refusal(exc, 200)}") from None
    return meta, arrays


def load_snapshot(path: str | os.PathLike) -> Any:
    """Read and validate a snapshot: a ``ServedModel`` (made), an ``ImageClassifierServed``, an
    ``export.snapshot_formats.TextGroupsSnapshot`` or ``TextTasksStage``.  Raises SnapshotError."""
    where = os.fspath(path)
    meta, arrays = read_npz(where)
    fmt = meta.get("format", SNAPSHOT_FORMAT)
    if fmt == SNAPSHOT_FORMAT:
        return _decode_made(meta, arrays, where)
    from export.snapshot_formats import decode

    return decode(fmt, meta, arrays, where)


def _decode_made(meta: dict[str, Any], arrays: dict[str, np.ndarray], where: str) -> Any:
    from fclcore.served import ServedModel

    made_meta = meta.get("made", meta)
    if not isinstance(made_meta, dict):
        raise SnapshotError(f"{where}: 'made' must be a JSON object")
    made_meta = {**_MADE_DEFAULTS, **made_meta}
    missing = [f for f in _MADE_FIELDS if f not in made_meta] + [f for f in _OTHER_FIELDS if f not in meta]
    if missing:
        raise SnapshotError(f"{where}: {META_KEY} is missing {missing}")
    try:
        cfg = MadeConfig(**{f: made_meta[f] for f in _MADE_FIELDS})
        return ServedModel(
            made=cfg,
            params=arrays,
            order_index=meta["order_index"],
            method=meta["method"],
            task=meta["task"],
            binarize=meta["binarize"],
        )
    except (TypeError, ValueError) as exc:
        raise SnapshotError(f"{where}: {exc}") from None


# ------------------------------------------------------------------ checks of __meta__ fields
# (ValueError naming the field; the decoders turn it into a SnapshotError naming the file)


def meta_names(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or any(not isinstance(n, str) for n in value):
        raise ValueError(f"class_names must be a list of strings, got {value!r}")
    return tuple(value)


def meta_int(value: Any, name: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def meta_str(value: Any, name: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    return value


def no_other_arrays(arrays: Mapping[str, np.ndarray], used: set[str]) -> None:
    extra = sorted(set(arrays) - used)
    if extra:
        raise ValueError(f"unexpected arrays {extra[:5]}")
