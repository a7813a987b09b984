"""Crash-safe state files: arrays plus JSON metadata in one ``.npz``, replaced atomically.

A checkpoint is written to a temporary file in the same directory, flushed and fsynced,
then renamed over the old one, and the directory is fsynced: after a crash at any moment
the file is either the previous checkpoint or the new one, never a mix.  Loading uses
``allow_pickle=False``: a state file is data, and a tampered one cannot run code.
"""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Mapping

import numpy as np

from fclcore.errors import StateError

META_KEY = "__meta__"


class CheckpointError(StateError):
    """A state file exists but cannot be used (truncated, tampered, wrong version)."""


@dataclass(frozen=True)
class FileBytes:
    """A file's bytes as a checkpoint array (uint8): ``save`` copies the file into the checkpoint
    in chunks, so what a process keeps on disk anyway (a device's knowledge frames) is never in
    its memory whole.  The file must not change while a checkpoint is written."""

    path: Path

    def read(self) -> bytes:
        return Path(self.path).read_bytes()


def write_atomic(path: str | os.PathLike, data: bytes | Callable[[BinaryIO], None]) -> None:
    """Write ``data`` to ``path`` so that a crash leaves either the old or the new content.

    ``data`` is the bytes, or a function that writes them to the file it is given (so a large
    file is never held in memory whole)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as handle:
        if callable(data):
            data(handle)
        else:
            handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def save(path: str | os.PathLike, meta: Mapping, arrays: Mapping[str, np.ndarray | FileBytes]) -> None:
    """One checkpoint: ``meta`` (JSON-able) and named arrays (numeric dtypes only, or
    ``FileBytes``, read back by ``load`` as a uint8 array)."""
    if META_KEY in arrays:
        raise ValueError(f"array name {META_KEY!r} is reserved")
    for name, array in arrays.items():
        if not isinstance(array, FileBytes) and np.asarray(array).dtype.kind not in "biuf":
            raise ValueError(f"{name}: only numeric arrays are stored, got {np.asarray(array).dtype}")
    blob = np.frombuffer(json.dumps(meta, allow_nan=False).encode("utf-8"), dtype=np.uint8)
    # Streamed into the file: a device's checkpoint (186 MB for ConFedMADE's MNIST model by its
    # fifth task) used to be built in memory first, the daemon's peak (firmware_notes/memory.md).
    write_atomic(path, lambda f: _write_npz(f, {META_KEY: blob, **arrays}))


def _write_npz(handle: BinaryIO, arrays: Mapping[str, np.ndarray | FileBytes]) -> None:
    """What ``np.savez`` writes (a stored zip of ``.npy`` members), ``FileBytes`` copied in chunks."""
    with zipfile.ZipFile(handle, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
        for name, value in arrays.items():
            with archive.open(f"{name}.npy", "w", force_zip64=True) as member:
                if not isinstance(value, FileBytes):
                    np.lib.format.write_array(member, np.asarray(value), allow_pickle=False)
                    continue
                with open(value.path, "rb") as source:
                    size = os.fstat(source.fileno()).st_size
                    header = {"descr": "|u1", "fortran_order": False, "shape": (size,)}
                    np.lib.format.write_array_header_1_0(member, header)
                    shutil.copyfileobj(source, member, 1 << 20)
                    if source.tell() != size:
                        raise OSError(f"{value.path}: changed while it was copied into a checkpoint")


def load(path: str | os.PathLike) -> tuple[dict, dict[str, np.ndarray]]:
    """(meta, arrays) of a checkpoint; CheckpointError if it is unreadable."""
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise CheckpointError(f"{path}: not a readable checkpoint ({exc})") from None
    blob = arrays.pop(META_KEY, None)
    if blob is None or blob.dtype != np.uint8 or blob.ndim != 1:
        raise CheckpointError(f"{path}: no metadata record")
    try:
        meta = json.loads(blob.tobytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{path}: metadata is not JSON ({exc})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: metadata is not an object")
    return meta, arrays


def load_versioned(path: Path, version: int) -> tuple[dict, dict[str, np.ndarray]] | None:
    """``load`` for a state file written with ``meta["version"]``; None if the file is absent."""
    if not Path(path).exists():
        return None
    meta, arrays = load(path)
    if meta.get("version") != version:
        raise CheckpointError(f"{path}: state version {meta.get('version')!r}, expected {version}")
    return meta, arrays


def fsync_dir(directory: Path) -> None:
    """Make renames in ``directory`` durable (best effort where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
