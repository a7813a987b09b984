"""Enhancer groups inside the frozen backbone, and how a group travels on the wire.

An Enhancer is a bottleneck adapter ``h + W_up f(W_down h)`` placed after every encoder
block.  ``W_up`` starts at zero, so a fresh group leaves the backbone's hidden states
unchanged.  A group = one Enhancer per block + a linear head over the mean-pooled output,
covering the group's classes (global class ids, in head-row order).  Trainable = inside an
``Enhancer`` or an ``EnhancerGroup.head`` -- decided by module type, never by name.  FedET
trains them; the ``text-groups`` export serves them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from fclbases.minilm.backbone import FrozenBackbone, attention_bias, mean_pool
from fclcore.codec import SparseTensor


@dataclass(frozen=True)
class EnhancerConfig:
    hidden: int = 384  # n: the backbone width
    bottleneck: int = 64  # m
    blocks: int = 6  # D: one Enhancer per encoder block
    activation: str = "gelu"

    def __post_init__(self) -> None:
        if min(self.hidden, self.bottleneck, self.blocks) < 1:
            raise ValueError(f"EnhancerConfig sizes must be >= 1, got {self}")
        if self.activation not in _ACTIVATIONS:
            raise ValueError(
                f"EnhancerConfig.activation: expected one of {sorted(_ACTIVATIONS)}, got {self.activation!r}"
            )


_ACTIVATIONS = {"gelu": nn.GELU, "relu": nn.ReLU, "tanh": nn.Tanh}


class Enhancer(nn.Module):
    """h -> h + W_up f(W_down h); W_up = 0 at construction, so a fresh Enhancer is the identity."""

    def __init__(self, cfg: EnhancerConfig, device: str | None = None) -> None:
        super().__init__()
        self.down = nn.Linear(cfg.hidden, cfg.bottleneck, device=device)
        self.act = _ACTIVATIONS[cfg.activation]()
        self.up = nn.Linear(cfg.bottleneck, cfg.hidden, device=device)
        if device != "meta":
            nn.init.zeros_(self.up.weight)
            nn.init.zeros_(self.up.bias)

    def forward(self, h: Tensor) -> Tensor:
        return h + self.up(self.act(self.down(h)))  # (B, L, n) -> (B, L, m) -> (B, L, n)


def _linear(n_in: int, n_out: int, device: str | None = None) -> nn.Linear:
    """nn.Linear that also allows 0 outputs (a group before its first task) without a warning."""
    if n_out:
        return nn.Linear(n_in, n_out, device=device)
    layer = nn.Linear.__new__(nn.Linear)  # zero outputs: nothing to initialise, no RNG drawn, no warning
    nn.Module.__init__(layer)
    layer.in_features, layer.out_features = n_in, 0
    layer.weight = nn.Parameter(torch.empty(0, n_in, device=device))
    layer.bias = nn.Parameter(torch.empty(0, device=device))
    return layer


def _seeded_reset(module: nn.Module, generator: torch.Generator) -> None:
    """``nn.Linear``'s default initialisation, drawn from ``generator`` in construction order,
    then the Enhancers' zero up-projections: the values ``torch.manual_seed(seed)`` followed by
    construction gives, without the process-wide RNG (threads may share it)."""
    for sub in module.modules():
        if isinstance(sub, nn.Linear) and sub.weight.numel():  # a zero-class head draws nothing either way
            nn.init.kaiming_uniform_(sub.weight, a=math.sqrt(5), generator=generator)
            bound = 1 / math.sqrt(sub.in_features) if sub.in_features > 0 else 0
            nn.init.uniform_(sub.bias, -bound, bound, generator=generator)
    with torch.no_grad():
        for sub in module.modules():
            if isinstance(sub, Enhancer):
                sub.up.weight.zero_()
                sub.up.bias.zero_()


class EnhancerGroup(nn.Module):
    """One Enhancer per block + a head over the pooled output for ``classes`` (global ids)."""

    def __init__(self, cfg: EnhancerConfig, classes: Sequence[int] = (), seed: int | None = None) -> None:
        """``seed``: initialise from ``torch.manual_seed(seed)`` without touching the global RNG,
        so that devices and the aggregator build the same fresh group without sending it."""
        super().__init__()
        self.cfg = cfg
        self.classes: tuple[int, ...] = tuple(int(c) for c in classes)
        if len(set(self.classes)) != len(self.classes):
            raise ValueError(f"EnhancerGroup classes must be distinct, got {self.classes}")
        device = None if seed is None else "meta"  # seeded: no draw from the global RNG at all
        self.enhancers = nn.ModuleList(Enhancer(cfg, device) for _ in range(cfg.blocks))
        self.head = _linear(cfg.hidden, len(self.classes), device)
        if seed is not None:
            self.to_empty(device="cpu")
            _seeded_reset(self, torch.Generator().manual_seed(seed))

    def extend_classes(self, new: Sequence[int], rows: Mapping[int, np.ndarray] | None = None) -> None:
        """Append head rows for ``new`` classes, keeping the old rows.

        New rows start at zero, or at ``rows[c]`` (``prototype_rows``): either way every
        device and the aggregator extend a group alike without exchanging an initialisation."""
        new = [int(c) for c in new if int(c) not in self.classes]
        if not new:
            return
        head = _linear(self.cfg.hidden, len(self.classes) + len(new), "meta").to_empty(device="cpu")
        with torch.no_grad():
            head.weight.zero_()
            head.bias.zero_()
            head.weight[: len(self.classes)] = self.head.weight
            head.bias[: len(self.classes)] = self.head.bias
            for i, c in enumerate(new):
                if rows is not None and c in rows:
                    head.weight[len(self.classes) + i] = torch.from_numpy(np.asarray(rows[c], np.float32))
        self.head, self.classes = head, self.classes + tuple(new)

    def rows(self, classes: Sequence[int]) -> list[int]:
        """Head rows of ``classes`` (KeyError naming the class if the group does not cover it)."""
        index = {c: i for i, c in enumerate(self.classes)}
        try:
            return [index[int(c)] for c in classes]
        except KeyError as exc:
            raise KeyError(f"class {exc.args[0]} is not covered by this group {self.classes}") from None

    def copy(self) -> "EnhancerGroup":
        twin = EnhancerGroup(self.cfg, self.classes, seed=0)  # seed: leave the global RNG alone
        twin.load_state_dict(self.state_dict())
        return twin


def trainable_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Parameters inside an Enhancer or a group's head, found by module type (never by name)."""
    found: dict[int, nn.Parameter] = {}
    for sub in module.modules():
        owned = list(sub.parameters()) if isinstance(sub, Enhancer) else []
        if isinstance(sub, EnhancerGroup):
            owned = list(sub.head.parameters())
        for p in owned:
            found[id(p)] = p
    return list(found.values())


def enhanced_logits(
    backbone: FrozenBackbone, group: EnhancerGroup, input_ids: Tensor, attention_mask: Tensor
) -> Tensor:
    h, bias = backbone.encoder.embed(input_ids), attention_bias(attention_mask)  # (B, L, n)
    for block, enhancer, int8 in zip(backbone.encoder.blocks, group.enhancers, backbone.int8):
        h = enhancer(block(h, bias, int8))
    return group.head(mean_pool(h, attention_mask))  # (B, n) -> (B, C)


@torch.no_grad()
def predict_logits(
    backbone: FrozenBackbone, group: EnhancerGroup, ids: np.ndarray, mask: np.ndarray, batch_size: int = 32
) -> np.ndarray:
    """(N, L) token ids and mask -> (N, C) float32 logits of ``group``, in eval mode, batched."""
    was_training = group.training
    group.eval()
    out = [
        enhanced_logits(
            backbone, group, torch.from_numpy(ids[i : i + batch_size]), torch.from_numpy(mask[i : i + batch_size])
        ).numpy()
        for i in range(0, len(ids), batch_size)
    ]
    group.train(was_training)
    return np.concatenate(out) if out else np.zeros((0, len(group.classes)), np.float32)


def group_shapes(cfg: EnhancerConfig, num_classes: int) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor of a group with ``num_classes`` head rows (wire order)."""
    n, m = cfg.hidden, cfg.bottleneck
    shapes: dict[str, tuple[int, ...]] = {}
    for i in range(cfg.blocks):
        shapes.update(
            {
                f"enh.{i}.down.weight": (m, n),
                f"enh.{i}.down.bias": (m,),
                f"enh.{i}.up.weight": (n, m),
                f"enh.{i}.up.bias": (n,),
            }
        )
    shapes.update({"head.weight": (num_classes, n), "head.bias": (num_classes,)})
    return shapes


def _params_by_wire_name(group: EnhancerGroup) -> dict[str, Tensor]:
    out = {}
    for i, e in enumerate(group.enhancers):
        out.update(
            {
                f"enh.{i}.down.weight": e.down.weight,
                f"enh.{i}.down.bias": e.down.bias,
                f"enh.{i}.up.weight": e.up.weight,
                f"enh.{i}.up.bias": e.up.bias,
            }
        )
    out.update({"head.weight": group.head.weight, "head.bias": group.head.bias})
    return out


def group_prefix(j: int) -> str:
    """Group ``j``'s tensors travel as ``g<j>/<name>`` when a frame carries several groups."""
    return f"g{j}/"


def group_to_tensors(group: EnhancerGroup, sparse: bool = False) -> dict[str, np.ndarray | SparseTensor]:
    """A group's tensors for a codec Frame (its class list travels in the frame's meta).

    ``sparse``: wrap each tensor as a SparseTensor of its non-zeros; the codec then picks the
    smallest of dense / index list / bitmap, so this never costs more than a few bytes."""
    if not group.classes:
        raise ValueError("group_to_tensors: the group has no classes yet (nothing to send)")
    out: dict[str, np.ndarray | SparseTensor] = {}
    for name, p in _params_by_wire_name(group).items():
        arr = p.detach().cpu().numpy().astype(np.float32, copy=True)
        out[name] = SparseTensor.from_dense(arr) if sparse else arr
    return out


def tensors_to_group(
    tensors: Mapping[str, np.ndarray | SparseTensor], cfg: EnhancerConfig, classes: Sequence[int]
) -> EnhancerGroup:
    """A new group from received tensors; ValueError unless names and shapes match exactly."""
    expected = group_shapes(cfg, len(classes))
    missing, extra = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    if missing or extra:
        raise ValueError(f"group tensors: missing {missing}, unexpected {extra}")
    group = EnhancerGroup(cfg, classes, seed=0)  # every value is overwritten below
    params = _params_by_wire_name(group)
    with torch.no_grad():
        for name, shape in expected.items():
            t = tensors[name]
            arr = t.to_dense() if isinstance(t, SparseTensor) else np.asarray(t, dtype=np.float32)
            if tuple(arr.shape) != shape:
                raise ValueError(f"group tensor {name}: expected shape {shape}, got {tuple(arr.shape)}")
            if not np.isfinite(arr).all():
                raise ValueError(f"group tensor {name}: expected finite values")
            params[name].copy_(torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)))
    return group


def group_param_count(cfg: EnhancerConfig, num_classes: int) -> int:
    return sum(math.prod(s) for s in group_shapes(cfg, num_classes).values())
