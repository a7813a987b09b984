"""A text-groups export job for the export child (``export.child``), so that the daemon never
holds the ONNX export of a transformer (FedET's exported after each task in process: 948 MB
peak on BBC News instead of about 0.5 GB while training, ``firmware_notes/memory.md``).

The daemon writes (``write_text_groups_job``; numpy and the torch it has loaded):

* the served model's snapshot (``export.snapshot_formats``, format ``fcl-served-text-groups/1``):
  ``served.npz`` next to the model, the file ``fcl export`` re-exports, which holds the Enhancer
  groups and prototypes and names the frozen backbone by its directory and hash;
* ``parity.npy``: the token rows of the parity check;
* ``job.json``: ``{"format": "text-groups", "served": snapshot path, "path", "int8",
  "toolkit_version"}``.

The child (``read_text_groups_job``) loads the snapshot (``allow_pickle=False``), loads the
backbone again from its directory and exports the same model the daemon serves; its torch
reference for the parity check is computed there, on the same weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from export.snapshot import load_snapshot, save_snapshot
from export.snapshot_formats import TextGroupsSnapshot
from fclcore.served import TextGroupsServed

__all__ = ["write_text_groups_job", "read_text_groups_job"]


def write_text_groups_job(
    job_dir: Path, served: TextGroupsServed, parity: np.ndarray, path: Path, int8: bool, snapshot: Path | None = None
) -> None:
    """Describe the export of ``served`` (with a ``backbone_source``) to ``path``; its snapshot
    is written at ``snapshot`` (default: ``job_dir/served.npz``)."""
    if not served.backbone_source:
        raise ValueError("the served text model names no backbone_source: a child cannot load its backbone")
    snapshot = Path(snapshot) if snapshot is not None else job_dir / "served.npz"
    save_snapshot(served, snapshot)
    np.save(job_dir / "parity.npy", np.ascontiguousarray(parity, dtype=np.int64), allow_pickle=False)
    job = {
        "format": "text-groups",
        "served": str(snapshot.resolve()),
        "path": str(path),
        "int8": bool(int8),
        "toolkit_version": "0.1.0",
    }
    (job_dir / "job.json").write_text(json.dumps(job))


def read_text_groups_job(job_dir: Path, snapshot: Any) -> TextGroupsServed:
    """The served model a job describes; ValueError (SnapshotError) naming what is wrong."""
    if not isinstance(snapshot, str):
        raise ValueError("job.json: expected 'served', the snapshot's path")
    loaded = load_snapshot(snapshot)
    if not isinstance(loaded, TextGroupsSnapshot):
        raise ValueError(f"{snapshot}: not a text-groups snapshot")
    return loaded.served()
