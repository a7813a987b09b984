"""The ``text-groups`` served format (:class:`fclcore.served.TextGroupsServed`) as one ONNX graph.

A frozen MiniLM-style backbone + a nearest-prototype selector + Enhancer groups (the state
FedET's clients serve; ``methods/fedet`` produces it), in at most two backbone passes per text:

    input_ids, attention_mask (int64 [batch, seq])
      -> embeddings -> block 0 ------------------------------------------------+
      -> blocks 1..D-1 -> mean pool -> unit vector -> cosine vs the class prototypes  |
      -> nearest class -> its group                                     => group (int64 [batch])
      -> the routed group only: (block 0's output, shared) -> Enhancer 0 -> (block -> Enhancer) x (D-1)
         -> mean pool -> the group's head
      -> its argmax, mapped to its global class id                       => label (int64 [batch])
      -> its logits in its classes' columns, -inf elsewhere               => logits (float32 [batch, C])

This is FedET's ``FedETClient.predict`` as a graph: the selector is ``PrototypeSelector.route``
and a group's logits are ``enhanced_logits``.  The groups' Enhancer weights and heads are
stacked as ``[J, ...]`` initializers and gathered per row by the routed group, so the adapted
pass runs only the routed group even in a batch that mixes groups, and every weight is stored
once (:class:`TextGroupsGraph`).  Block 0 comes before the first Enhancer, so both passes
share its output: 2D - 1 encoder blocks per text (11 for MiniLM's 6), against
1 + (non-empty groups) passes before (:class:`AllGroupsGraph`, kept as the benchmark's
baseline).  The encoder's attention is onnxruntime's fused ``com.microsoft::Attention``
(int8: ``QAttention``) on packed q|k|v weights; the rest is standard ONNX.  The outputs and
the metadata are what they were (format ``fcl-fedet/1``); the file also records
``fcl.backbone_passes``, which older runtimes ignore.

Entry points: :func:`export_text_groups` (what ``export.formats.export_served`` calls for this
format), :func:`export_text_classifier` (the lower-level function taking the parts) and
:func:`export_client_text_classifier` (anything with ``backbone``, ``groups``, ``selector``).

The graphs are ``export.text_groups_graph``'s, traced by ``export.text_groups_build``
(which also computes the torch reference); the checks and the int8 copy are
``export.text_groups_verify``'s.  Metadata: format ``fcl-fedet/1`` (the on-disk name,
kept for the files already written; see ``export.text_runtime``), sealed with the same weights
and integrity hashes as the MADE exports (``export.publish.seal``).

The exported file is written to a temporary file, reloaded and validated by the torch-free
:class:`export.text_runtime.TextClassifierRuntime`, parity-checked against the torch
computation, and only then moved over the destination with ``os.replace``.  int8: the
backbone's MatMuls and attentions get int8 weights; the selector's MatMul and the gathered
Enhancers and heads stay fp32 (see ``export.text_groups_verify._stack_gathers``).
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from export import scaffold
from export.publish import ExportError, int8_path_for, seal, write_synced
from export.text_export import parity_token_rows, tokenizer_metadata
from export.text_groups_build import build_selector, build_text_classifier_onnx, plan_groups, text_classifier_reference
from export.text_groups_graph import GRAPHS, AllGroupsGraph, TextGroupsGraph, backbone_passes
from export.text_groups_verify import (
    FORMAT,
    INT8_MIN_AGREEMENT,
    PARITY_TOL,
    ROUTE_TOL,
    verify_and_publish,
    write_stage,
)
from fclbases.minilm.backbone import FrozenBackbone
from fclbases.minilm.enhancer import EnhancerGroup
from fclcore.procmem import release_free_memory

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "export_text_groups",
    "export_text_classifier",
    "export_client_text_classifier",
    "build_text_classifier_onnx",
    "text_classifier_reference",
    "TextGroupsGraph",
    "AllGroupsGraph",
    "GRAPHS",
    "backbone_passes",
    "ExportError",
    "PARITY_TOL",
    "ROUTE_TOL",
    "INT8_MIN_AGREEMENT",
    "int8_path_for",
]


# ------------------------------------------------------------------ export


def export_text_classifier(
    backbone: FrozenBackbone,
    groups: Sequence[EnhancerGroup],
    prototypes: Mapping[int, np.ndarray],
    group_of: Mapping[int, int],
    path: str | os.PathLike,
    *,
    method: str,
    int8: bool = False,
    parity_ids: np.ndarray | None = None,
    parity_mask: np.ndarray | None = None,
    tokenizer_json: str | os.PathLike | None = None,
    embed_tokenizer: bool = True,
    max_length: int | None = None,
    class_names: Sequence[str] | None = None,
    task: int = 0,
    toolkit_version: str = "0.1.0",
    int8_min_agreement: float = INT8_MIN_AGREEMENT,
    int8_per_channel: bool = True,
    int8_exclude_selector: bool = True,
    graph: str = "two-pass",
    stage_dir: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Write the text classifier as ONNX to ``path`` atomically, after verifying the written bytes.

    ``groups``: every group of the state, indexed like ``group_of``'s values (empty groups are
    left out of the graph); ``prototypes``: class -> prototype (any scale, normalised as the
    selector does); ``group_of``: class -> group for the routed classes; ``method``: the name of
    the learning method that trained the state, recorded as ``fcl.method`` (required, non-empty).

    Checks, on ``parity_ids``/``parity_mask`` (default: 32 seeded random token rows): the file
    reloads in the torch-free runtime with its metadata intact; the routed group and the label
    equal the torch computation (:func:`text_classifier_reference`) on every row, except where the torch
    decision itself is a float32 tie (top-2 cosine or logit gap <= ``ROUTE_TOL``, counted in
    ``float32_ties``); every finite logit satisfies ``|onnx - torch| <= 1e-4 * max(1, |torch|)``
    (a 6-layer float32 transformer through different kernels differs by ~1e-6 relative on
    its embeddings; 1e-4 leaves margin without hiding a wrong weight).  With ``int8``, a copy
    ``<stem>.int8.onnx`` with int8 weights (onnxruntime ``quantize_dynamic``, per-output-channel
    weight scales unless ``int8_per_channel=False``: on BBC News they agreed with torch on 98.9%
    of the test texts vs 97.5% per tensor, see benchmarks/results/fedet_export.md; the selector's
    prototype MatMul stays fp32 unless ``int8_exclude_selector=False``) must give the torch
    label on at least ``int8_min_agreement`` of the parity rows (default 0.9); the agreement
    is stored in its metadata.  Both files are published only if both pass.

    ``graph``: ``"two-pass"`` (default, what is served) or ``"all-groups"`` (the 1 + J pass
    graph from before, for the benchmark's comparison); recorded as ``fcl.backbone_passes``.
    ``stage_dir``: only compute the torch reference and build the graph, and leave them there
    with what the checks need (``export.text_groups_verify.write_stage``: the graph unsealed,
    its weights as external data); the sealing, the checks, the int8 copy and the publication
    are then ``export.text_groups_verify.finish_stage``'s, in a process without
    torch (``export.child``).  Returns ``{"staged": stage_dir, "path": path}``.
    ``tokenizer_json``: the tokenizer the model expects; its sha256 is recorded and, with
    ``embed_tokenizer``, the file itself is embedded (the runtime then needs nothing else).
    ``max_length``: tokens per text the runtime keeps (default: min(128, backbone positions);
    128 is what the MiniLM tokenizer.json truncates to).  ``class_names``: one per exported
    class in class-id order, or a list indexed by class id.
    Returns a report dict; raises :class:`ExportError`.
    """
    if not isinstance(method, str) or not method.strip():
        raise ExportError(f"method must be the non-empty name of the method that trained the model, got {method!r}")
    path = scaffold.check_destination(path)
    scaffold.check_min_agreement(int8_min_agreement)
    if max_length is None:
        max_length = min(128, backbone.cfg.max_positions)
    selector = build_selector(prototypes, group_of)
    group_ids, classes = plan_groups(backbone, groups, selector, max_length)
    # the torch reference first, its activations freed before the graph and its copies of the weights exist
    ids, mask, desc = parity_token_rows(backbone.cfg.vocab_size, max_length, parity_ids, parity_mask)
    ref = text_classifier_reference(backbone, groups, selector, classes, ids, mask)
    gc.collect()
    release_free_memory()
    proto, _, _ = build_text_classifier_onnx(
        backbone,
        groups,
        selector,
        max_length=max_length,
        graph=graph,
        check=stage_dir is None,
        own_backbone=stage_dir is not None,  # staged: the export child's own backbone
    )
    if class_names is not None:
        if all(isinstance(n, str) for n in class_names) and len(class_names) > max(classes):
            class_names = [class_names[c] for c in classes]  # names indexed by class id
        if len(class_names) != len(classes) or any(not isinstance(n, str) for n in class_names):
            raise ExportError(
                f"class_names: expected {len(classes)} strings (or one per class id), got {class_names!r}"
            )
    metadata: dict[str, Any] = {
        "format": FORMAT,
        "method": method,
        "task": int(task),
        "classes": classes,
        "groups": group_ids,
        "group_classes": [list(groups[j].classes) for j in group_ids],
        "group_of": [[int(c), int(selector.group_of[int(c)])] for c in selector.classes],
        "max_length": int(max_length),
        "vocab_size": backbone.cfg.vocab_size,
        "hidden": backbone.cfg.hidden,
        "layers": backbone.cfg.layers,
        "bottleneck": groups[group_ids[0]].cfg.bottleneck,
        "toolkit_version": str(toolkit_version),
        "quantization": "none",
        "backbone_passes": backbone_passes(graph, len(group_ids)),
    }
    if class_names is not None:
        metadata["class_names"] = list(class_names)
    if tokenizer_json is not None:
        metadata.update(tokenizer_metadata(tokenizer_json, backbone.cfg.vocab_size, embed_tokenizer)[0])
    checks = {
        "path": str(path),
        "metadata": metadata,
        "parity": {"ids": ids, "mask": mask, "desc": desc, **ref},
        "classes": classes,
        "groups": group_ids,
        "int8": bool(int8),
        "int8_min_agreement": float(int8_min_agreement),
        "int8_per_channel": bool(int8_per_channel),
        "int8_exclude_selector": bool(int8_exclude_selector),
    }
    if stage_dir is not None:  # the checks and the publication are another process's
        write_stage(Path(stage_dir), proto, checks)  # unsealed, its weights as external data
        return {"staged": str(stage_dir), "path": str(path)}
    with scaffold.staged(path) as (tmp, temps):
        write_synced(tmp, seal(proto, metadata).SerializeToString())
        del proto
        return verify_and_publish(tmp, temps, checks)


def export_client_text_classifier(client: Any, path: str | os.PathLike, **kwargs: Any) -> dict[str, Any]:
    """:func:`export_text_classifier` of anything with ``backbone``, ``groups``, ``selector`` (a
    :class:`fclbases.minilm.prototypes.PrototypeSelector`) and optionally ``task`` (e.g. a
    ``FedETClient``): the state ``client.predict`` serves.  ``method`` (keyword, required unless
    the client has a non-empty ``method`` attribute) is recorded as ``fcl.method``."""
    try:
        backbone, groups, selector = client.backbone, list(client.groups), client.selector
    except AttributeError as exc:
        raise ExportError(f"expected an object with backbone, groups and selector: {exc}") from None
    prototypes = {int(c): selector.prototypes[i] for i, c in enumerate(selector.classes)}
    kwargs.setdefault("task", max(0, int(getattr(client, "task", 0))))
    kwargs.setdefault("method", getattr(client, "method", ""))
    return export_text_classifier(backbone, groups, prototypes, dict(selector.group_of), path, **kwargs)


# ------------------------------------------------------------------ the served format


def export_text_groups(
    served: Any,
    path: str | os.PathLike,
    *,
    stage_dir: str | os.PathLike | None = None,
    **options: Unpack[scaffold.ExportOptions],
) -> dict[str, Any]:
    """Export a :class:`~fclcore.served.TextGroupsServed` to ``path`` (verified, atomic;
    ``stage_dir``: staged for a second process, as in :func:`export_text_classifier`).

    ``parity_inputs``: int64 token ids ``(N, L)``, right-padded with id 0 (the attention mask
    is ``ids != 0``), or None for the exporter's seeded random token rows.  The recorded
    ``fcl.method`` is ``served.method``, which the learner that made ``served`` sets; an empty
    one is refused.  Raises :class:`ExportError`."""
    parity_inputs, int8, toolkit_version = scaffold.export_options(options)
    try:
        backbone, groups = served.backbone, list(served.groups)
        prototypes, group_of = dict(served.prototypes), dict(served.group_of)
        task, max_length, method = served.task, served.max_length, getattr(served, "method", "")
        class_names = list(getattr(served, "class_names", ())) or None
    except (AttributeError, TypeError) as exc:
        raise ExportError(f"not a text-groups served model: {exc}") from None
    if not isinstance(method, str) or not method.strip():
        raise ExportError(
            f"the served model names no method (served.method = {method!r}): the learner that made it must set it"
        )
    ids = mask = None
    if parity_inputs is not None:
        ids = np.asarray(parity_inputs)
        mask = (ids != 0).astype(np.int64)
    return export_text_classifier(
        backbone,
        groups,
        prototypes,
        group_of,
        path,
        method=method,
        int8=int8,
        parity_ids=ids,
        parity_mask=mask,
        task=task,
        max_length=max_length,
        toolkit_version=toolkit_version,
        stage_dir=stage_dir,
        class_names=class_names,
    )
