"""A text-groups export job for the export child (``export.child``), so that the daemon never
holds the ONNX export of a transformer (FedET's exported after each task in process: 948 MB
peak on BBC News instead of about 0.5 GB while training, ``firmware_notes/memory.md``).

The daemon writes (``write_text_groups_job``; numpy and the torch it has loaded):

* ``groups.npz``: each non-empty Enhancer group's tensors as ``g<j>/<wire name>``
  (``fclbases.minilm.enhancer.group_to_tensors``), the class prototypes ``prototypes``
  (classes, hidden) and their class ids ``prototype_classes``;
* ``parity.npy``: the token rows of the parity check;
* ``job.json``: ``{"format": "text-groups", "path", "int8", "toolkit_version", "served": {...}}``
  with the served model's routing, sizes and ``backbone_dir``, the directory the frozen backbone
  was loaded from (``TextGroupsServed.backbone_source``).

The child (``read_text_groups_job``) loads the backbone again from that directory, rebuilds the
groups from their arrays (``allow_pickle=False``) and exports the same model the daemon serves;
its torch reference for the parity check is computed there, on the same weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from fclbases.minilm.backbone import FrozenBackbone, load_minilm
from fclbases.minilm.enhancer import EnhancerConfig, EnhancerGroup, group_prefix, group_to_tensors, tensors_to_group
from fclcore.served import TextGroupsServed

__all__ = ["write_text_groups_job", "read_text_groups_job"]


def write_text_groups_job(job_dir: Path, served: TextGroupsServed, parity: np.ndarray, path: Path, int8: bool) -> None:
    """Describe the export of ``served`` (with a ``backbone_source``) to ``path``."""
    if not served.backbone_source:
        raise ValueError("the served text model names no backbone_source: a child cannot load its backbone")
    groups = list(served.groups)
    arrays: dict[str, np.ndarray] = {}
    for j, group in enumerate(groups):
        if group.classes:
            arrays.update({group_prefix(j) + k: np.asarray(v) for k, v in group_to_tensors(group).items()})
    classes = sorted(int(c) for c in served.prototypes)
    arrays["prototypes"] = np.stack([np.asarray(served.prototypes[c], np.float32) for c in classes])
    arrays["prototype_classes"] = np.asarray(classes, np.int64)
    np.savez(job_dir / "groups.npz", **arrays)
    np.save(job_dir / "parity.npy", np.ascontiguousarray(parity, dtype=np.int64), allow_pickle=False)
    cfg = groups[0].cfg
    spec = {
        "backbone_dir": str(served.backbone_source),
        "enhancer": {
            "hidden": cfg.hidden,
            "bottleneck": cfg.bottleneck,
            "blocks": cfg.blocks,
            "activation": cfg.activation,
        },
        "group_classes": [list(g.classes) for g in groups],
        "group_of": [[int(c), int(j)] for c, j in served.group_of.items()],
        "task": int(served.task),
        "max_length": int(served.max_length),
        "method": served.method,
    }
    job = {"format": "text-groups", "served": spec, "path": str(path), "int8": bool(int8), "toolkit_version": "0.1.0"}
    (job_dir / "job.json").write_text(json.dumps(job))


def read_text_groups_job(job_dir: Path, spec: Any) -> TextGroupsServed:
    """The served model a job describes; ValueError (or OSError) naming what is wrong."""
    try:
        cfg = EnhancerConfig(**spec["enhancer"])
        group_classes = [[int(c) for c in row] for row in spec["group_classes"]]
        group_of = {int(c): int(j) for c, j in spec["group_of"]}
        task, max_length, method = int(spec["task"]), int(spec["max_length"]), str(spec["method"])
        backbone_dir = Path(spec["backbone_dir"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"job.json: malformed text-groups model ({type(exc).__name__}: {exc})") from None
    with np.load(job_dir / "groups.npz", allow_pickle=False) as npz:
        arrays = {name: npz[name] for name in npz.files}
    groups = []
    for j, classes in enumerate(group_classes):
        prefix = group_prefix(j)
        tensors = {k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)}
        groups.append(tensors_to_group(tensors, cfg, classes) if classes else EnhancerGroup(cfg, (), seed=0))
    protos, ids = arrays.get("prototypes"), arrays.get("prototype_classes")
    if protos is None or ids is None or protos.ndim != 2 or len(protos) != len(ids):
        raise ValueError("groups.npz: expected prototypes (classes, hidden) and prototype_classes (classes,)")
    return TextGroupsServed(
        FrozenBackbone(load_minilm(backbone_dir)),
        [g.eval() for g in groups],
        {int(c): p for c, p in zip(ids, protos)},
        group_of,
        task=task,
        max_length=max_length,
        method=method,
        backbone_source=str(backbone_dir),
    )
