"""The text-groups graphs as torch modules, traced by ``export.text_groups_build``.

:class:`TextGroupsGraph` is what is served: FedET's ``FedETClient.predict`` in at most two
backbone passes per text, the routed group's Enhancers and head gathered per row from stacked
``[J, ...]`` tensors.  :class:`AllGroupsGraph` (1 + J passes) is kept as the benchmark's
baseline.  Both route with the selector's prototypes (:class:`_RoutedGraph`).  The encoder's
attention is exported as onnxruntime's fused ``com.microsoft::Attention`` (:class:`_Attention`).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from export.publish import ExportError
from fclbases.minilm.backbone import FrozenBackbone, attention_bias, mean_pool
from fclbases.minilm.enhancer import EnhancerGroup
from fclbases.minilm.prototypes import PrototypeSelector

__all__ = ["TextGroupsGraph", "AllGroupsGraph", "GRAPHS", "backbone_passes"]


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


class _RoutedGraph(nn.Module):
    """What both graphs share: the backbone and the selector's routing (``PrototypeSelector.route``)."""

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
        pos_of = {int(j): i for i, j in enumerate(group_ids)}
        proto_groups = [selector.group_of[int(c)] for c in selector.classes]
        # (D, K): stored transposed so the selector's MatMul reads it directly (and int8 can skip it)
        self.register_buffer("prototypes_t", torch.from_numpy(np.ascontiguousarray(selector.prototypes.T)))
        self.register_buffer("proto_group", torch.tensor(proto_groups, dtype=torch.int64))
        self.register_buffer("proto_pos", torch.tensor([pos_of[j] for j in proto_groups], dtype=torch.int64))
        self._build(groups, classes)

    def _build(self, groups: Sequence[EnhancerGroup], classes: Sequence[int]) -> None:
        """The graph's own tensors of the exported ``groups`` (in ``group_ids`` order) and ``classes``."""
        raise NotImplementedError

    def _route(self, pooled: Tensor) -> tuple[Tensor, Tensor]:
        """(group id, position in the exported groups) per row: ``PrototypeSelector.route``."""
        unit = pooled / torch.linalg.vector_norm(pooled, dim=1, keepdim=True).clamp_min(1e-12)  # normalize_rows
        nearest = torch.argmax(unit @ self.prototypes_t, dim=1)  # (B,) prototype row
        return self.proto_group[nearest], self.proto_pos[nearest]


class TextGroupsGraph(_RoutedGraph):
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

    def _build(self, groups: Sequence[EnhancerGroup], classes: Sequence[int]) -> None:
        acts = {type(e.act) for g in groups for e in g.enhancers}
        if len(acts) != 1:
            raise ExportError(f"the groups' Enhancers use different activations {sorted(a.__name__ for a in acts)}")
        backbone = self.backbone
        self.act = groups[0].enhancers[0].act
        self.heads, self.layers, self.n_classes = backbone.cfg.heads, backbone.cfg.layers, len(classes)
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


class AllGroupsGraph(_RoutedGraph):
    """The graph before the two-pass one (1 + J backbone passes: the frozen pass, then EVERY
    exported group on every text), kept only as the comparison baseline of
    ``benchmarks/bench_fedet_export.py`` and the tests (``export_text_classifier(...,
    graph="all-groups")``); not what the exporter writes by default."""

    def _build(self, groups: Sequence[EnhancerGroup], classes: Sequence[int]) -> None:
        self.groups = nn.ModuleList(groups)
        col = {int(c): i for i, c in enumerate(classes)}
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
        group, pos = self._route(pooled)
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
