"""Tiny served models of the image-classifier, text-tasks and text-groups formats, for the
export and snapshot tests (the text-groups one with a tiny backbone saved as a model directory,
as the daemon's export child loads it)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

from fclcore.served import FrozenTable, ImageClassifierServed, TextGroupsServed, TextTasksServed

TASK_LABELS = [[3, 0, 4], [1, 2]]  # task 0: 3 labels, task 1: 2 labels (+ one -inf column)
BBC_NAMES = ("business", "entertainment", "politics", "sports", "tech")


def tiny_image(seed: int = 0, side: int = 8) -> ImageClassifierServed:
    """conv 1->2 k3 p1, relu, maxpool2, flatten, linear -> 10 digits, random weights."""
    rng = np.random.default_rng(seed)
    flat = 2 * (side // 2) ** 2
    layers = [
        ("conv2d", {"weight": rng.normal(0, 0.5, (2, 1, 3, 3)), "bias": rng.normal(0, 0.1, 2), "padding": 1}),
        ("relu", {}),
        ("maxpool2", {}),
        ("flatten", {}),
        ("linear", {"weight": rng.normal(0, 0.3, (10, flat)), "bias": rng.normal(0, 0.1, 10)}),
    ]
    return ImageClassifierServed(side, layers, [str(d) for d in range(10)], method="filver", task=1)


class TinyTasks(nn.Module):
    """Mean of token embeddings -> one linear head per task; logits (B, T, W), -inf padded."""

    def __init__(self, sizes=(3, 2), vocab: int = 30522, dim: int = 8, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, dim)
        self.heads = nn.ModuleList(nn.Linear(dim, n) for n in sizes)
        self.width = max(sizes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        m = attention_mask.unsqueeze(-1).to(torch.float32)  # (B, L, 1)
        pooled = (self.embed(input_ids) * m).sum(1) / m.sum(1).clamp_min(1.0)  # (B, D)
        return self.stack_heads(pooled)

    def stack_heads(self, pooled: torch.Tensor) -> torch.Tensor:
        rows = []
        for head in self.heads:
            lg = head(pooled)  # (B, n_t)
            if lg.shape[1] < self.width:
                pad = torch.full((lg.shape[0], self.width - lg.shape[1]), float("-inf"))
                lg = torch.cat([lg, pad], dim=1)
            rows.append(lg)
        return torch.stack(rows, dim=1)  # (B, T, W)


def tiny_text_tasks(seed: int = 0) -> TextTasksServed:
    """A text-tasks model whose classes are named by their numbers, as FedSeIT's learner names them."""
    return TextTasksServed(
        TinyTasks(seed=seed).eval(), TASK_LABELS, [str(c) for c in range(5)], task=1, max_length=32, method="fedseit"
    )


def save_backbone_dir(encoder, cfg, path: Path) -> Path:
    """A Hugging Face style model directory (config.json + model.safetensors) of ``encoder``."""
    from fclbases.minilm.safetensors import hf_name

    path.mkdir()
    hf = {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "intermediate_size": cfg.intermediate,
        "max_position_embeddings": cfg.max_positions,
        "type_vocab_size": cfg.type_vocab,
        "layer_norm_eps": cfg.eps,
    }
    (path / "config.json").write_text(json.dumps(hf))
    write_safetensors(path / "model.safetensors", {hf_name(n): v.numpy() for n, v in encoder.state_dict().items()})
    return path


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """float32 ``tensors`` as a safetensors file (u64 header size, JSON header, raw data)."""
    header, blobs, offset = {}, [], 0
    for name, value in tensors.items():
        raw = np.ascontiguousarray(value, "<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(value.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"".join(blobs))


class TinyBufferTasks(TinyTasks):
    """:class:`TinyTasks` reading its embedding from a non-persistent buffer (as FedSeIT's
    TextCNN does; the tracer makes a Constant node of it, not an initializer)."""

    def __init__(self, table: torch.Tensor, **kwargs) -> None:
        super().__init__(**kwargs)
        self.register_buffer("table", table, persistent=False)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        m = attention_mask.unsqueeze(-1).to(torch.float32)  # (B, L, 1)
        pooled = (nn.functional.embedding(input_ids, self.table) * m).sum(1) / m.sum(1).clamp_min(1.0)  # (B, D)
        return self.stack_heads(pooled)


def tiny_text_tasks_with_table(
    model_dir: Path, seed: int = 0, scale: float = 0.37, buffer: bool = False
) -> TextTasksServed:
    """:func:`tiny_text_tasks` whose embedding is a frozen table from a shipped file: tensor
    ``emb`` of ``model_dir/model.safetensors`` (written here), row 0 zeroed, times ``scale``
    (``buffer``: held as a buffer, as FedSeIT holds it, instead of an ``nn.Embedding``)."""
    served = tiny_text_tasks(seed)
    shipped = np.random.default_rng(seed).normal(0, 1, tuple(served.module.embed.weight.shape)).astype(np.float32)
    model_dir.mkdir(parents=True, exist_ok=True)
    write_safetensors(model_dir / "model.safetensors", {"emb": shipped})
    table = torch.from_numpy(shipped.copy())
    table[0] = 0.0
    table = table * scale  # as FedSeIT's load_embedding scales its table
    if buffer:
        served = dataclasses.replace(served, module=TinyBufferTasks(table, seed=seed).eval())
        array = served.module.table.numpy()
    else:
        with torch.no_grad():
            served.module.embed.weight.copy_(table)
        array = served.module.embed.weight.detach().numpy()
    return dataclasses.replace(served, frozen=(FrozenTable(array, str(model_dir), "emb", scale, (0,)),))


def tiny_text_groups(backbone_dir: Path) -> tuple[TextGroupsServed, np.ndarray]:
    """(a tiny text-groups model whose backbone was loaded from ``backbone_dir``, created there
    if missing; six parity token rows).  Classes 0, 1 in group 0, class 2 in group 2."""
    from fclbases.minilm.backbone import BertEncoder, FrozenBackbone, load_minilm, pooled_embeddings, tiny_config
    from fclbases.minilm.enhancer import EnhancerConfig, EnhancerGroup

    torch.manual_seed(0)
    cfg = tiny_config()
    if not backbone_dir.exists():
        save_backbone_dir(BertEncoder(cfg), cfg, backbone_dir)
    backbone = FrozenBackbone(load_minilm(backbone_dir))
    ecfg = EnhancerConfig(hidden=32, bottleneck=8, blocks=2)
    groups = [EnhancerGroup(ecfg, [0, 1], seed=1), EnhancerGroup(ecfg), EnhancerGroup(ecfg, [2], seed=2)]
    rng = np.random.default_rng(0)
    ids = np.zeros((6, 10), np.int64)
    for r, n in enumerate([10, 7, 4, 10, 5, 8]):
        ids[r, :n] = np.concatenate([[2], rng.integers(4, 40, n - 2), [3]])
    pooled = pooled_embeddings(backbone, ids, (ids != 0).astype(np.int64))
    served = TextGroupsServed(
        backbone,
        [g.eval() for g in groups],
        {c: pooled[c] for c in range(3)},
        {0: 0, 1: 0, 2: 2},
        task=1,
        max_length=16,
        method="fedet",
        backbone_source=str(backbone_dir),
    )
    return served, ids
