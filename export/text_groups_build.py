"""Building a text-groups graph: the served state validated (:func:`plan_groups`, :func:`build_selector`), the
torch reference the exported file is checked against (:func:`text_classifier_reference`), and
the traced, patched ONNX proto (:func:`build_text_classifier_onnx`).

The graph is traced with torch's TorchScript-based exporter (``dynamo=False``; the
torch.export-based one needs onnxscript, which is not installed), opset 17 (+ com.microsoft 1),
with dynamic ``batch`` and ``seq`` axes; the modules traced are ``export.text_groups_graph``'s.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator, Mapping, Sequence

import numpy as np
import onnx
from torch import nn

from export.publish import ExportError
from export.text_export import trace_token_model
from export.text_groups_graph import GRAPHS, backbone_passes
from fclbases.minilm.backbone import FrozenBackbone, pooled_embeddings
from fclbases.minilm.enhancer import EnhancerGroup, predict_logits
from fclbases.minilm.prototypes import PrototypeSelector, normalize_rows

__all__ = ["text_classifier_reference", "build_selector", "plan_groups", "build_text_classifier_onnx", "WORD_TABLE"]


# ------------------------------------------------------------------ the torch reference


def text_classifier_reference(
    backbone: FrozenBackbone,
    groups: Sequence[EnhancerGroup],
    selector: PrototypeSelector,
    classes: Sequence[int],
    ids: np.ndarray,
    mask: np.ndarray,
) -> dict[str, np.ndarray]:
    """The served prediction (FedET's ``FedETClient.predict``) on (ids, mask), plus what the
    parity check needs.

    Returns ``label``, ``group`` (N,), ``logits`` (N, C) laid out like the graph's output,
    ``route_margin`` (top-2 cosine gap of the selector) and ``label_margin`` (top-2 logit gap
    of the routed head; inf for one-class heads)."""
    pooled = pooled_embeddings(backbone, ids, mask)
    sims = normalize_rows(pooled) @ selector.prototypes.T
    routes = selector.route(pooled)
    col = {int(c): i for i, c in enumerate(classes)}
    n = len(ids)
    label = np.full(n, -1, dtype=np.int64)
    logits = np.full((n, len(col)), -np.inf, dtype=np.float32)
    label_margin = np.full(n, np.inf)
    for j in np.unique(routes):
        idx = np.flatnonzero(routes == j)
        g = groups[int(j)]
        lg = predict_logits(backbone, g, ids[idx], mask[idx])
        label[idx] = np.asarray(g.classes)[lg.argmax(1)]
        logits[np.ix_(idx, [col[c] for c in g.classes])] = lg
        if lg.shape[1] > 1:
            top = np.sort(lg, axis=1)
            label_margin[idx] = top[:, -1] - top[:, -2]
    top = np.sort(sims, axis=1)
    route_margin = top[:, -1] - top[:, -2] if sims.shape[1] > 1 else np.full(n, np.inf)
    return {
        "label": label,
        "group": routes.astype(np.int64),
        "logits": logits,
        "route_margin": route_margin,
        "label_margin": label_margin,
    }


# ------------------------------------------------------------------ building


def build_selector(prototypes: Mapping[int, np.ndarray], group_of: Mapping[int, int]) -> PrototypeSelector:
    if not prototypes:
        raise ExportError("the selector has no prototypes: nothing can be routed (start a task first)")
    sel = PrototypeSelector()
    try:
        sel.update(
            {int(c): np.asarray(p, np.float32) for c, p in prototypes.items()},
            {int(c): int(group_of[c]) for c in prototypes if c in group_of},
        )
    except (ValueError, KeyError) as exc:
        raise ExportError(f"selector: {exc}") from None
    return sel


def plan_groups(
    backbone: FrozenBackbone, groups: Sequence[EnhancerGroup], selector: PrototypeSelector, max_length: int
) -> tuple[list[int], list[int]]:
    """Validate the state; return (exported group indices, sorted classes)."""
    if not isinstance(backbone, FrozenBackbone):
        raise ExportError(f"backbone must be a FrozenBackbone, got {type(backbone).__name__}")
    if len(selector.classes) == 0:
        raise ExportError("the selector has no prototypes: nothing can be routed (start a task first)")
    group_ids = [j for j, g in enumerate(groups) if g.classes]
    if not group_ids:
        raise ExportError("every group is empty: nothing to export")
    owner: dict[int, int] = {}
    for j in group_ids:
        g = groups[j]
        if g.cfg.hidden != backbone.cfg.hidden or len(g.enhancers) != backbone.cfg.layers:
            raise ExportError(
                f"group {j}: hidden/blocks {g.cfg.hidden}/{len(g.enhancers)} do not match the backbone "
                f"{backbone.cfg.hidden}/{backbone.cfg.layers}"
            )
        for c in g.classes:
            if c in owner:
                raise ExportError(f"class {c} is in groups {owner[c]} and {j}")
            owner[c] = j
    if selector.prototypes.shape[1] != backbone.cfg.hidden:
        raise ExportError(f"prototypes have width {selector.prototypes.shape[1]}, the backbone {backbone.cfg.hidden}")
    for c in selector.classes.tolist():
        j = selector.group_of[c]
        if owner.get(c) != j:
            raise ExportError(
                f"class {c} is routed to group {j}, which does not cover it "
                f"(groups: { {k: groups[k].classes for k in group_ids} })"
            )
    if not 2 <= max_length <= backbone.cfg.max_positions:
        raise ExportError(f"max_length must be in [2, {backbone.cfg.max_positions}], got {max_length}")
    if not np.isfinite(selector.prototypes).all():
        raise ExportError("prototypes contain NaN or infinite values")
    return group_ids, sorted(owner)


def _inline_initializer_aliases(proto: onnx.ModelProto) -> int:
    """Replace ``Identity(initializer)`` nodes by the initializer itself; returns how many.

    The exporter stores a weight used by several passes once and feeds the other uses through
    Identity nodes; int8 quantisation only sees a MatMul weight when it is an initializer
    input, so without this the backbone would stay fp32 (and be stored twice) in passes 2+."""
    graph = proto.graph
    inits = {t.name for t in graph.initializer}
    outputs = {o.name for o in graph.output}
    alias: dict[str, str] = {}
    keep = []
    for node in graph.node:
        src = alias.get(node.input[0], node.input[0]) if node.input else None
        if node.op_type == "Identity" and src in inits and node.output[0] not in outputs:
            alias[node.output[0]] = src
        else:
            keep.append(node)
    for node in keep:
        node.input[:] = [alias.get(i, i) for i in node.input]
    del graph.node[:]
    graph.node.extend(keep)
    return len(alias)


def _type_fused_outputs(proto: onnx.ModelProto) -> None:
    """Declare the float type of every ``com.microsoft`` node's outputs: onnx's shape inference
    does not know those ops, and the int8 quantiser needs the type of every MatMul input."""
    known = {v.name for v in proto.graph.value_info}
    for node in proto.graph.node:
        if node.domain == "com.microsoft":
            for name in node.output:
                if name not in known:
                    proto.graph.value_info.append(
                        onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None)
                    )


WORD_TABLE = "backbone.encoder.word.weight"  # the token embeddings' initializer in both graphs


@contextmanager
def _light_word_table(backbone: FrozenBackbone) -> Iterator[Callable[[onnx.ModelProto], None]]:
    """Trace with a one-row token embedding table; yields ``put_back(proto)``, which gives the
    proto's :data:`WORD_TABLE` initializer the real table's dims and bytes.

    The table is a third of MiniLM's weights (30522 x 384 float32, 45 MiB), and the tracer
    holds the weights three times at its peak (its ModelProto, that serialised, and the bytes
    handed to Python).  The table only feeds the Gather of the input ids (nothing is folded
    from it and no shape in the graph depends on its row count; the traced inputs are all
    id 0), so the proto differs from the one traced with the full table only in that
    initializer's dims and ``raw_data``; ``put_back`` restores those, checked by the sha256
    of the published files in ``benchmarks/profile_export_child.py``."""
    word = backbone.encoder.word
    full = word.weight
    word.weight = nn.Parameter(full.detach()[:1].clone(), requires_grad=False)

    def put_back(proto: onnx.ModelProto) -> None:
        found = [t for t in proto.graph.initializer if t.name == WORD_TABLE]
        if len(found) != 1 or list(found[0].dims) != [1, full.shape[1]] or not found[0].HasField("raw_data"):
            raise ExportError(f"the traced graph has no one-row {WORD_TABLE} initializer to fill in")
        found[0].dims[:] = list(full.shape)
        found[0].raw_data = full.detach().numpy().astype("<f4", copy=False).tobytes()

    try:
        yield put_back
    finally:
        word.weight = full


def build_text_classifier_onnx(
    backbone: FrozenBackbone,
    groups: Sequence[EnhancerGroup],
    selector: PrototypeSelector,
    *,
    max_length: int = 128,
    graph: str = "two-pass",
    check: bool = True,
    own_backbone: bool = False,
) -> tuple[onnx.ModelProto, list[int], list[int]]:
    """Trace the graph (unsealed); returns (proto, exported group indices, classes).

    ``graph``: ``"two-pass"`` (:class:`TextGroupsGraph`, what is served) or ``"all-groups"``
    (:class:`AllGroupsGraph`, the 1 + J pass baseline the benchmark compares against).
    ``check``: run ``onnx.checker`` on the proto (which serialises and parses a whole copy of
    it); a staged export checks the written file in its second process instead.
    ``own_backbone``: this process owns ``backbone`` (the export child): the token embedding
    table is traced as a one-row stand-in and put into the proto afterwards
    (:func:`_light_word_table`), which keeps three copies of it out of the tracer's peak; the
    bytes are the same.  It swaps the backbone's parameter during the trace, so never with a
    backbone another thread may run."""
    if graph not in GRAPHS:
        raise ExportError(f"graph must be one of {sorted(GRAPHS)}, got {graph!r}")
    group_ids, classes = plan_groups(backbone, groups, selector, max_length)
    module = GRAPHS[graph](backbone, [groups[j] for j in group_ids], group_ids, selector, classes).eval()
    was = [g.training for g in groups]
    for g in groups:
        g.eval()
    try:
        if own_backbone:
            with _light_word_table(backbone) as put_back:
                proto = trace_token_model(module, max_length, ["label", "group", "logits"])
            put_back(proto)
        else:
            proto = trace_token_model(module, max_length, ["label", "group", "logits"])
    finally:
        for g, w in zip(groups, was):
            g.train(w)
    _inline_initializer_aliases(proto)
    _type_fused_outputs(proto)
    proto.producer_name = "fcl-edge"
    proto.graph.name = "fcl_text_groups"
    proto.graph.doc_string = (
        f"text-groups classifier: prototype selector over {len(selector.classes)} classes + "
        f"Enhancer groups {group_ids} on a frozen {backbone.cfg.layers}-layer encoder, "
        f"{backbone_passes(graph, len(group_ids))} backbone passes per text; "
        "input_ids, attention_mask -> label, group, logits"
    )
    if check:
        onnx.checker.check_model(proto)
    return proto, group_ids, classes
