"""FedET's own uses of the shared Enhancer groups (``fclbases.minilm``): the pool of groups
over one backbone, the frozen-prefix cache that spares every training pass the first block,
and the head rows that start a fresh group as a nearest-prototype classifier."""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch
from torch import Tensor, nn

from fclbases.minilm.backbone import FrozenBackbone, attention_bias, mean_pool
from fclbases.minilm.enhancer import EnhancerConfig, EnhancerGroup, enhanced_logits


class EnhancedTransformer(nn.Module):
    """Frozen backbone + a pool of J Enhancer groups; ``logits`` runs one group end to end."""

    def __init__(self, backbone: FrozenBackbone, cfg: EnhancerConfig, num_groups: int) -> None:
        super().__init__()
        if cfg.hidden != backbone.cfg.hidden or cfg.blocks != backbone.cfg.layers:
            raise ValueError(
                f"EnhancerConfig hidden/blocks {cfg.hidden}/{cfg.blocks} do not match the "
                f"backbone {backbone.cfg.hidden}/{backbone.cfg.layers}"
            )
        self.backbone, self.cfg = backbone, cfg
        self.groups = nn.ModuleList(EnhancerGroup(cfg) for _ in range(num_groups))

    def group_of(self, cls: int) -> int | None:
        for j, g in enumerate(self.groups):
            if cls in g.classes:
                return j
        return None

    def logits(self, input_ids: Tensor, attention_mask: Tensor, group: int | EnhancerGroup) -> Tensor:
        """(B, L) ids and mask -> (B, len(group.classes)) logits through ``group``'s Enhancers."""
        g = self.groups[group] if isinstance(group, int) else group
        return enhanced_logits(self.backbone, g, input_ids, attention_mask)


def frozen_prefix(backbone: FrozenBackbone, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """(B, L) ids and mask -> (B, L, n): the embedding and the first encoder block, the part of
    every pass that no Enhancer changes (Enhancer 0 comes after block 0).  Computed without
    autograd: nothing below Enhancer 0 is trained, so no gradient ever flows into it."""
    with torch.no_grad():
        return backbone.encoder.blocks[0](backbone.encoder.embed(input_ids), attention_bias(attention_mask))


def enhanced_logits_from_prefix(
    backbone: FrozenBackbone, group: EnhancerGroup, prefix: Tensor, attention_mask: Tensor
) -> Tensor:
    """``enhanced_logits`` continued from ``frozen_prefix``'s (B, L, n) output: the same
    operations in the same order, so the logits equal ``enhanced_logits``' (to float32
    rounding when the prefix was computed in a batch of another size)."""
    bias = attention_bias(attention_mask)
    h = group.enhancers[0](prefix)
    for block, enhancer, int8 in zip(backbone.encoder.blocks[1:], group.enhancers[1:], backbone.int8[1:]):
        h = enhancer(block(h, bias, int8))
    return group.head(mean_pool(h, attention_mask))  # (B, n) -> (B, C)


def prefix_states(backbone: FrozenBackbone, ids: np.ndarray, mask: np.ndarray, batch_size: int = 32) -> Tensor:
    """(N, L) ids and mask -> (N, L, n) float32 ``frozen_prefix`` of every row, batched: a cache
    for texts that pass through the model many times (N * L * n * 4 bytes)."""
    n = backbone.cfg.hidden
    out = torch.empty((len(ids), ids.shape[1], n), dtype=torch.float32)
    for i in range(0, len(ids), batch_size):
        out[i : i + batch_size] = frozen_prefix(
            backbone, torch.from_numpy(ids[i : i + batch_size]), torch.from_numpy(mask[i : i + batch_size])
        )
    return out


@torch.no_grad()
def predict_logits_from_prefix(
    backbone: FrozenBackbone,
    group: EnhancerGroup,
    prefix: Tensor,
    mask: np.ndarray,
    batch_size: int = 32,
    rows: np.ndarray | None = None,
) -> np.ndarray:
    """``predict_logits`` from ``prefix_states`` instead of token ids: of every row of ``prefix``
    and ``mask``, or of ``rows`` only (gathered batch by batch, never copied whole)."""
    order = np.arange(len(prefix)) if rows is None else np.asarray(rows, dtype=np.int64)
    was_training = group.training
    group.eval()
    out = []
    for i in range(0, len(order), batch_size):
        idx = order[i : i + batch_size]
        states = prefix[i : i + batch_size] if rows is None else prefix[torch.from_numpy(idx)]
        out.append(enhanced_logits_from_prefix(backbone, group, states, torch.from_numpy(mask[idx])).numpy())
    group.train(was_training)
    return np.concatenate(out) if out else np.zeros((0, len(group.classes)), np.float32)


@torch.no_grad()
def pooled_and_prefix(
    backbone: FrozenBackbone, ids: np.ndarray, mask: np.ndarray, batch_size: int = 32
) -> tuple[np.ndarray, Tensor]:
    """``pooled_embeddings`` and ``prefix_states`` of the same rows from one frozen pass (the
    pooled values are ``pooled_embeddings``' bit for bit: same batches, same operations)."""
    n = backbone.cfg.hidden
    pooled = np.zeros((len(ids), n), np.float32)
    states = torch.empty((len(ids), ids.shape[1], n), dtype=torch.float32)
    for i in range(0, len(ids), batch_size):
        m = torch.from_numpy(mask[i : i + batch_size])
        h, bias = backbone.encoder.embed(torch.from_numpy(ids[i : i + batch_size])), attention_bias(m)
        for k, block in enumerate(backbone.encoder.blocks):
            h = block(h, bias)
            if k == 0:
                states[i : i + batch_size] = h
        pooled[i : i + batch_size] = mean_pool(h, m).numpy()
    return pooled, states


def prototype_rows(
    prototypes: Mapping[int, np.ndarray], scale: float, pooled_norm: float = 2.84
) -> dict[int, np.ndarray]:
    """Head rows that make a fresh group a nearest-prototype (cosine) classifier.

    A fresh group's Enhancers are the identity, so its head sees the frozen mean-pooled
    embedding h (|h| ~= ``pooled_norm`` for all-MiniLM-L6-v2); row c = ``scale`` *
    unit(prototype_c) / pooled_norm gives logits ~= ``scale`` * cos(h, prototype_c).  The
    prototypes are rounded to float16 first, so devices (which may receive them as float16)
    and the aggregator compute the same rows.  ``scale`` 0: no rows (zero initialisation)."""
    if scale <= 0:
        return {}
    out = {}
    for c, p in prototypes.items():
        v = np.asarray(p, np.float16).astype(np.float64)
        out[int(c)] = (scale / pooled_norm * v / max(float(np.linalg.norm(v)), 1e-12)).astype(np.float32)
    return out
