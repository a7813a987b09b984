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

The graph is traced with torch's TorchScript-based exporter (``dynamo=False``; the
torch.export-based one needs onnxscript, which is not installed), opset 17 (+ com.microsoft 1),
with dynamic ``batch`` and ``seq`` axes.  Metadata: format ``fcl-fedet/1`` (the on-disk name,
kept for the files already written; see ``export.text_runtime``), sealed with the same weights
and integrity hashes as the MADE exports (``export.publish.seal``).

The exported file is written to a temporary file, reloaded and validated by the torch-free
:class:`export.text_runtime.TextClassifierRuntime`, parity-checked against the torch
computation, and only then moved over the destination with ``os.replace``.  int8: the
backbone's MatMuls and attentions get int8 weights; the selector's MatMul and the gathered
Enhancers and heads stay fp32 (see :func:`_stack_gathers`).
"""

from __future__ import annotations

import gc
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import onnx
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from export.publish import ExportError, int8_path_for, remove_temps, seal, temp_path, write_synced
from export.text_export import parity_token_rows, tokenizer_metadata, trace_token_model
from export.text_groups_verify import (
    FORMAT,
    INT8_MIN_AGREEMENT,
    PARITY_TOL,
    ROUTE_TOL,
    verify_and_publish,
    write_stage,
)
from fclbases.minilm.backbone import FrozenBackbone, attention_bias, mean_pool, pooled_embeddings
from fclbases.minilm.enhancer import EnhancerGroup, predict_logits
from fclbases.minilm.prototypes import PrototypeSelector, normalize_rows
from fclcore.procmem import release_free_memory

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


# ------------------------------------------------------------------ the graph


class _Attention(torch.autograd.Function):
    """A BertBlock's multi-head self-attention on packed q|k|v weights (``w`` (D, 3D), ``b`` (3D,)),
    exported as onnxruntime's fused ``com.microsoft::Attention`` (int8: ``QAttention``).

    The torch forward (run while tracing) is ``BertBlock``'s attention; the op's padding
    mask adds -10000 (its ``mask_filter_value``) where ``BertBlock`` adds the float32
    minimum: both give padded keys a softmax weight of exactly 0 in float32 (exp underflows
    below -104) unless attention scores reach the thousands.  The exporter's parity check
    runs on padded batches."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, b: Tensor, mask: Tensor, heads: int) -> Tensor:
        bsz, n, d = x.shape
        q, k, v = (x @ w + b).view(bsz, n, 3 * heads, d // heads).transpose(1, 2).split(heads, dim=1)
        bias = (1.0 - mask[:, None, None, :].float()) * -10000.0
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).reshape(bsz, n, d)

    @staticmethod
    def symbolic(g: Any, x: Any, w: Any, b: Any, mask: Any, heads: int) -> Any:
        out = g.op("com.microsoft::Attention", x, w, b, mask, num_heads_i=heads)
        out.setType(x.type())
        return out


class TextGroupsGraph(nn.Module):
    """The served graph, at most two backbone passes per text: (label, group, logits).

    1. The frozen pass (embeddings, D blocks, mean pool) the selector routes on.
    2. One adapted pass through the routed group only: block 0's output is the frozen
       pass's (an Enhancer follows each block, so the two passes first differ after block 0),
       then ``Enhancer_0``, ``block_1``, ``Enhancer_1``, ... ``Enhancer_{D-1}``, mean pool,
       head -- ``enhanced_logits``.  2D - 1 blocks per text in all.

    Each text's group is chosen by data, not by the graph's structure: the exported groups'
    Enhancer weights are stacked as ``[J, ...]`` initializers (bottlenecks zero-padded to the
    widest; a zero column adds exactly 0) and gathered by each row's routed group, and the
    adapted pass runs per-row (batched) MatMuls, so a batch may mix groups and every weight is
    stored once.  The heads are stacked the same way, padded to the largest group; padded
    columns are -inf before the argmax.  The encoder blocks mirror ``BertBlock.forward`` with
    the attention as one fused op (:class:`_Attention`)."""

    def __init__(
        self,
        backbone: FrozenBackbone,
        groups: Sequence[EnhancerGroup],
        group_ids: Sequence[int],
        selector: PrototypeSelector,
        classes: Sequence[int],
    ) -> None:
        super().__init__()
        acts = {type(e.act) for g in groups for e in g.enhancers}
        if len(acts) != 1:
            raise ExportError(f"the groups' Enhancers use different activations {sorted(a.__name__ for a in acts)}")
        self.backbone, self.act = backbone, groups[0].enhancers[0].act
        self.heads, self.layers, self.n_classes = backbone.cfg.heads, backbone.cfg.layers, len(classes)
        self._routing(selector, group_ids)
        for i, blk in enumerate(backbone.encoder.blocks):
            qkv = (blk.query, blk.key, blk.value)
            self.register_buffer(f"qkv_weight_{i}", torch.cat([m.weight for m in qkv]).T.contiguous())
            self.register_buffer(f"qkv_bias_{i}", torch.cat([m.bias for m in qkv]))
        n, m, width = backbone.cfg.hidden, max(g.cfg.bottleneck for g in groups), max(len(g.classes) for g in groups)
        n_groups = len(groups)
        for i in range(self.layers):  # stack_*: per-group tensors, gathered by the routed group
            down_w, down_b = torch.zeros(n_groups, n, m), torch.zeros(n_groups, 1, m)
            up_w, up_b = torch.zeros(n_groups, m, n), torch.zeros(n_groups, 1, n)
            for j, g in enumerate(groups):
                e = g.enhancers[i]
                k = e.down.out_features
                down_w[j, :, :k], down_b[j, 0, :k] = e.down.weight.T, e.down.bias
                up_w[j, :k], up_b[j, 0] = e.up.weight.T, e.up.bias
            for name, t in (("down_weight", down_w), ("down_bias", down_b), ("up_weight", up_w), ("up_bias", up_b)):
                self.register_buffer(f"stack_{name}_{i}", t)
        head_w, head_b = torch.zeros(n_groups, n, width), torch.zeros(n_groups, width)
        valid, head_classes = (
            torch.zeros(n_groups, width, dtype=torch.bool),
            torch.zeros(n_groups, width, dtype=torch.int64),
        )
        col_rows = torch.zeros(n_groups, len(classes), dtype=torch.int64)
        col_mask = torch.zeros(n_groups, len(classes), dtype=torch.bool)
        for j, g in enumerate(groups):
            c = len(g.classes)
            head_w[j, :, :c], head_b[j, :c], valid[j, :c] = g.head.weight.T, g.head.bias, True
            head_classes[j, :c] = torch.tensor(g.classes, dtype=torch.int64)
            rows = {cls: r for r, cls in enumerate(g.classes)}
            col_rows[j] = torch.tensor([rows.get(int(cls), 0) for cls in classes], dtype=torch.int64)
            col_mask[j] = torch.tensor([int(cls) in rows for cls in classes])
        for name, t in (
            ("head_weight", head_w),
            ("head_bias", head_b),
            ("head_valid", valid),
            ("head_classes", head_classes),
            ("col_rows", col_rows),
            ("col_mask", col_mask),
        ):
            self.register_buffer(f"stack_{name}", t)

    def _routing(self, selector: PrototypeSelector, group_ids: Sequence[int]) -> None:
        pos_of = {int(j): i for i, j in enumerate(group_ids)}
        proto_groups = [selector.group_of[int(c)] for c in selector.classes]
        # (D, K): stored transposed so the selector's MatMul reads it directly (and int8 can skip it)
        self.register_buffer("prototypes_t", torch.from_numpy(np.ascontiguousarray(selector.prototypes.T)))
        self.register_buffer("proto_group", torch.tensor(proto_groups, dtype=torch.int64))
        self.register_buffer("proto_pos", torch.tensor([pos_of[j] for j in proto_groups], dtype=torch.int64))

    def _route(self, pooled: Tensor) -> tuple[Tensor, Tensor]:
        """(group id, position in the stacks) per row: ``PrototypeSelector.route``."""
        unit = pooled / torch.linalg.vector_norm(pooled, dim=1, keepdim=True).clamp_min(1e-12)  # normalize_rows
        nearest = torch.argmax(unit @ self.prototypes_t, dim=1)  # (B,) prototype row
        return self.proto_group[nearest], self.proto_pos[nearest]

    def _block(self, i: int, x: Tensor, mask: Tensor) -> Tensor:
        """``BertBlock.forward`` (post-LN) with the fused attention."""
        blk = self.backbone.encoder.blocks[i]
        ctx = _Attention.apply(x, getattr(self, f"qkv_weight_{i}"), getattr(self, f"qkv_bias_{i}"), mask, self.heads)
        x = blk.attn_norm(x + blk.attn_out(ctx))
        return blk.ffn_norm(x + blk.ffn_out(F.gelu(blk.ffn_in(x))))

    def _enhance(self, i: int, h: Tensor, pos: Tensor) -> Tensor:
        """Each row's group's ``Enhancer`` i: h + W_up f(W_down h), per-row weights (B, ...)."""
        s = lambda name: getattr(self, f"stack_{name}_{i}")[pos]  # noqa: E731
        return h + (
            torch.matmul(self.act(torch.matmul(h, s("down_weight")) + s("down_bias")), s("up_weight")) + s("up_bias")
        )

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        h0, mask = self.backbone.encoder.embed(input_ids), attention_mask.to(torch.int32)
        first = h = self._block(0, h0, mask)  # shared by both passes
        for i in range(1, self.layers):
            h = self._block(i, h, mask)
        group, pos = self._route(mean_pool(h, attention_mask))  # FrozenBackbone.pooled -> the selector
        h = first
        for i in range(self.layers):
            h = self._enhance(i, self._block(i, h, mask) if i else h, pos)
        pooled = mean_pool(h, attention_mask)
        lg = torch.matmul(pooled[:, None, :], self.stack_head_weight[pos])[:, 0] + self.stack_head_bias[pos]
        lg = torch.where(self.stack_head_valid[pos], lg, float("-inf"))  # (B, widest head)
        label = torch.gather(self.stack_head_classes[pos], 1, torch.argmax(lg, dim=1, keepdim=True))[:, 0]
        spread = torch.gather(lg, 1, self.stack_col_rows[pos])  # (B, C)
        return label, group, torch.where(self.stack_col_mask[pos], spread, float("-inf"))


class AllGroupsGraph(nn.Module):
    """The graph before the two-pass one (1 + J backbone passes: the frozen pass, then EVERY
    exported group on every text), kept only as the comparison baseline of
    ``benchmarks/bench_fedet_export.py`` and the tests (``export_text_classifier(...,
    graph="all-groups")``); not what the exporter writes by default."""

    def __init__(
        self,
        backbone: FrozenBackbone,
        groups: Sequence[EnhancerGroup],
        group_ids: Sequence[int],
        selector: PrototypeSelector,
        classes: Sequence[int],
    ) -> None:
        super().__init__()
        self.backbone = backbone
        self.groups = nn.ModuleList(groups)
        pos_of = {int(j): i for i, j in enumerate(group_ids)}
        proto_groups = [selector.group_of[int(c)] for c in selector.classes]
        col = {int(c): i for i, c in enumerate(classes)}
        self.register_buffer("prototypes_t", torch.from_numpy(np.ascontiguousarray(selector.prototypes.T)))
        self.register_buffer("proto_group", torch.tensor(proto_groups, dtype=torch.int64))
        self.register_buffer("proto_pos", torch.tensor([pos_of[j] for j in proto_groups], dtype=torch.int64))
        for i, g in enumerate(groups):
            rows = {c: r for r, c in enumerate(g.classes)}
            self.register_buffer(f"classes_{i}", torch.tensor(g.classes, dtype=torch.int64))
            self.register_buffer(
                f"col_rows_{i}", torch.tensor([rows.get(int(c), 0) for c in classes], dtype=torch.int64)
            )
            self.register_buffer(f"col_mask_{i}", torch.tensor([int(c) in rows for c in classes]))
        self.n_classes = len(col)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        enc = self.backbone.encoder
        h0, bias = enc.embed(input_ids), attention_bias(attention_mask)
        h = h0
        for block in enc.blocks:
            h = block(h, bias)
        pooled = mean_pool(h, attention_mask)  # (B, D), FrozenBackbone.pooled
        unit = pooled / torch.linalg.vector_norm(pooled, dim=1, keepdim=True).clamp_min(1e-12)  # normalize_rows
        nearest = torch.argmax(unit @ self.prototypes_t, dim=1)  # (B,) prototype row
        group, pos = self.proto_group[nearest], self.proto_pos[nearest]
        label = torch.full_like(group, -1)
        logits = torch.full_like(pooled[:, :1], float("-inf")).expand(-1, self.n_classes)
        for i, g in enumerate(self.groups):
            h = h0
            for block, enhancer in zip(enc.blocks, g.enhancers):
                h = enhancer(block(h, bias))
            lg = g.head(mean_pool(h, attention_mask))  # (B, C_i), enhanced_logits
            sel = pos == i
            label = torch.where(sel, getattr(self, f"classes_{i}")[torch.argmax(lg, dim=1)], label)
            spread = lg[:, getattr(self, f"col_rows_{i}")]  # (B, C)
            logits = torch.where(sel[:, None] & getattr(self, f"col_mask_{i}")[None, :], spread, logits)
        return label, group, logits


GRAPHS = {"two-pass": TextGroupsGraph, "all-groups": AllGroupsGraph}


def backbone_passes(graph: str, n_groups: int) -> int:
    """Backbone passes per text of a graph kind with ``n_groups`` exported groups (the
    two-pass graph shares block 0 between its passes: 2D - 1 blocks)."""
    return 2 if graph == "two-pass" else 1 + n_groups


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


def _selector(prototypes: Mapping[int, np.ndarray], group_of: Mapping[int, int]) -> PrototypeSelector:
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


def _plan(
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
    group_ids, classes = _plan(backbone, groups, selector, max_length)
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
    path = Path(path)
    if not isinstance(method, str) or not method.strip():
        raise ExportError(f"method must be the non-empty name of the method that trained the model, got {method!r}")
    if not path.parent.is_dir():
        raise ExportError(f"output directory {path.parent} does not exist")
    if not 0.0 <= int8_min_agreement <= 1.0:
        raise ExportError(f"int8_min_agreement must be in [0, 1], got {int8_min_agreement}")
    if max_length is None:
        max_length = min(128, backbone.cfg.max_positions)
    selector = _selector(prototypes, group_of)
    group_ids, classes = _plan(backbone, groups, selector, max_length)
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
    temps: list[Path] = []
    try:
        tmp = temp_path(path)
        temps.append(tmp)
        write_synced(tmp, seal(proto, metadata).SerializeToString())
        del proto
        return verify_and_publish(tmp, temps, checks)
    finally:
        remove_temps(temps)


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
    parity_inputs: np.ndarray | None = None,
    int8: bool = False,
    toolkit_version: str = "0.1.0",
    stage_dir: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Export a :class:`~fclcore.served.TextGroupsServed` to ``path`` (verified, atomic;
    ``stage_dir``: staged for a second process, as in :func:`export_text_classifier`).

    ``parity_inputs``: int64 token ids ``(N, L)``, right-padded with id 0 (the attention mask
    is ``ids != 0``), or None for the exporter's seeded random token rows.  The recorded
    ``fcl.method`` is ``served.method``, which the learner that made ``served`` sets; an empty
    one is refused.  Raises :class:`ExportError`."""
    try:
        backbone, groups = served.backbone, list(served.groups)
        prototypes, group_of = dict(served.prototypes), dict(served.group_of)
        task, max_length, method = served.task, served.max_length, getattr(served, "method", "")
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
    )
