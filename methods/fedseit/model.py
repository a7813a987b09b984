"""The FedSeIT text CNN (paper eq. 1-3, App. B; reading notes G2-G7, G12) in torch.

A Kim CNN over a frozen word-embedding table: convs of kernel sizes {3, 4, 5}, ReLU, max-pool
over time.  Only the conv filters are decomposed per task i,

    theta_i = B * sigmoid(m_i) + A_i          (m_i over output channels, sigmoid in forward)

with B shared (federated), m_i, A_i and the conv bias per task.  Each task also has K
foreign slots holding other tasks' A (frozen) with an attention alpha per (slot, kernel size):

* ``segregated=False`` (FedWeIT on the CNN): the slots are summed into the filters,
  ``theta_i + sum_s alpha_s A_s``; pooled features -> dropout -> the task's head.
* ``segregated=True`` (FedSeIT): each slot is its own branch ``relu(maxpool(conv(x, alpha_s
  A_s)) + b_s)``, projected per kernel size by W_f (slots * F -> F, no bias, ReLU); then
  ``z = relu(W_c dropout([z_c; z_f]))`` and the task's head.  An empty slot outputs exactly
  0 (its alpha and b get no gradient).  With ``dls`` W_f and W_c are decomposed like the
  convs (shared base, per-task m and A) so their bases can be federated.

A slot's pooled conv does not depend on alpha except through its sign (max for alpha >= 0,
min otherwise), so ``slot_features`` computes the max and min once per document and the
branch costs almost nothing to train (notes G5); ``logits`` gives the same numbers with or
without that cache.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fclbases.minilm.safetensors import read_safetensors
from fclcore.text import default_tokenizer_json

SPECIAL_IDS = (0, 101, 102)  # [PAD], [CLS], [SEP] of the MiniLM vocabulary
WORD_EMBEDDINGS = "embeddings.word_embeddings.weight"


def load_embedding(rms: float, model_dir: str | Path | None = None) -> tuple[Tensor, float]:
    """MiniLM's wordpiece table (V, D) with the [PAD] row zeroed, rescaled once to RMS ``rms``
    (notes G7), and the scale factor c (the unscaled rows are ``table / c``)."""
    d = Path(model_dir) if model_dir is not None else default_tokenizer_json().parent
    table = torch.from_numpy(read_safetensors(d / "model.safetensors", [WORD_EMBEDDINGS])[WORD_EMBEDDINGS])
    table[0] = 0.0
    c = float(rms / table[1:].pow(2).mean().sqrt())
    return table * c, c


class Decomposed(nn.Module):
    """Per-task weights ``base * sigmoid(m_i) + A_i``; ``m_i`` gates the first axis."""

    def __init__(self, shape: Sequence[int]) -> None:
        super().__init__()
        self.shape = tuple(shape)
        self.base = nn.Parameter(torch.zeros(self.shape))
        self.masks = nn.ParameterList()
        self.adaptive = nn.ParameterList()

    def add_task(self, mask_init: float, adaptive_div: float) -> None:
        self.masks.append(nn.Parameter(torch.full((self.shape[0],), float(mask_init), device=self.base.device)))
        self.adaptive.append(nn.Parameter(self.base.detach() / adaptive_div))

    def gate(self, i: int) -> Tensor:
        return torch.sigmoid(self.masks[i]).reshape(-1, *([1] * (len(self.shape) - 1)))

    def weight(self, i: int) -> Tensor:
        return self.base * self.gate(i) + self.adaptive[i]


class TaskParts(nn.Module):
    """What task i owns besides its conv m_i, A_i: bias, slots, projections, head."""

    def __init__(self, n_kernels: int, filters: int, slots: int, segregated: bool, dls: bool) -> None:
        super().__init__()
        self.conv_bias = nn.Parameter(torch.zeros(n_kernels, filters))
        self.alpha = nn.Parameter(torch.zeros(slots, n_kernels))
        self.register_buffer("filled", torch.zeros(slots))  # 1.0 where a slot holds an entry
        self.head: nn.Linear | None = None  # created when the task's labels are known
        if segregated:
            self.slot_bias = nn.Parameter(torch.zeros(slots, n_kernels, filters))
            width = n_kernels * filters
            self.wc_bias = nn.Parameter(torch.zeros(width))
            if not dls:  # with DLS these are the task's slices of Decomposed bases
                self.wf = nn.ParameterList(
                    [nn.Parameter(_linear_init(filters, slots * filters)) for _ in range(n_kernels)]
                )
                self.wc = nn.Parameter(_linear_init(width, 2 * width))


def _linear_init(out: int, fan_in: int) -> Tensor:
    bound = 1.0 / fan_in**0.5
    return torch.empty(out, fan_in).uniform_(-bound, bound)


class TextCNN(nn.Module):
    def __init__(
        self,
        embedding: Tensor,
        kernel_sizes: Sequence[int],
        filters: int,
        slots: int,
        dropout: float,
        segregated: bool,
        dls: bool = False,
    ) -> None:
        super().__init__()
        self.register_buffer("embedding", embedding, persistent=False)  # frozen, never saved
        self.kernel_sizes = list(kernel_sizes)
        self.filters, self.slots, self.segregated, self.dls = filters, slots, segregated, dls
        dim = embedding.shape[1]
        self.convs = nn.ModuleList([Decomposed((filters, dim, k)) for k in self.kernel_sizes])
        n = len(self.kernel_sizes)
        self.wf = nn.ModuleList([Decomposed((filters, slots * filters)) for _ in range(n)]) if dls else None
        self.wc = Decomposed((n * filters, 2 * n * filters)) if dls else None
        self.tasks = nn.ModuleList()
        self.dropout = nn.Dropout(dropout)
        # foreign A per task: (slots, filters, dim, k) per kernel size, frozen
        self.foreign: list[list[Tensor]] = []

    @property
    def decomposed(self) -> list[Decomposed]:
        """Every decomposed weight: the convs, then (DLS) W_f and W_c."""
        return list(self.convs) + ([*self.wf, self.wc] if self.dls else [])

    def add_task(self, mask_init: float, adaptive_div: float) -> None:
        for d in self.decomposed:
            d.add_task(mask_init, adaptive_div)
        n, device = len(self.kernel_sizes), self.embedding.device  # made on the CPU (its draws), used there
        self.tasks.append(TaskParts(n, self.filters, self.slots, self.segregated, self.dls).to(device))
        dim = self.embedding.shape[1]
        self.foreign.append([torch.zeros(self.slots, self.filters, dim, k, device=device) for k in self.kernel_sizes])

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> "TextCNN":
        """``to(device)`` and friends also move the foreign slots (neither parameters nor buffers)."""
        super()._apply(fn, recurse)
        self.foreign = [[fn(fa) for fa in per_conv] for per_conv in self.foreign]
        return self

    @torch.no_grad()
    def fill_slot(self, task: int, slot: int, weights: Sequence[Tensor], alpha: float) -> None:
        """Put an entry's A (one (filters, dim, k) tensor per conv) in a slot of ``task``."""
        for j, w in enumerate(weights):
            self.foreign[task][j][slot] = w
        parts = self.tasks[task]
        parts.filled[slot] = 1.0
        parts.alpha[slot] = alpha

    def add_head(self, task: int, n_labels: int) -> None:
        head = nn.Linear(len(self.kernel_sizes) * self.filters, n_labels)  # drawn on the CPU
        self.tasks[task].head = head.to(self.embedding.device)

    # -- forward ---------------------------------------------------------------------------
    def embed(self, ids: Tensor) -> Tensor:
        return F.embedding(ids, self.embedding).transpose(1, 2)  # (B, D, L)

    def conv_weight(self, task: int, j: int) -> Tensor:
        w = self.convs[j].weight(task)
        if not self.segregated:  # FedWeIT: sum_s alpha_s A_s inside the filters
            alpha = self.tasks[task].alpha[:, j].reshape(-1, 1, 1, 1)
            w = w + (alpha * self.foreign[task][j]).sum(0)
        return w

    def slot_features(self, ids: Tensor, task: int) -> tuple[Tensor, Tensor]:
        """(max, min) over time of every slot's conv: (B, slots, kernels, filters) each."""
        e = self.embed(ids)
        maxes, mins = [], []
        for j, k in enumerate(self.kernel_sizes):
            fa = self.foreign[task][j]
            out = F.conv1d(e, fa.reshape(self.slots * self.filters, -1, k))  # (B, S*F, L')
            maxes.append(out.amax(-1).reshape(-1, self.slots, self.filters))  # -1: batch stays dynamic in ONNX
            mins.append(out.amin(-1).reshape(-1, self.slots, self.filters))
        return torch.stack(maxes, 2), torch.stack(mins, 2)

    def logits(self, ids: Tensor, task: int, slot_cache: tuple[Tensor, Tensor] | None = None) -> Tensor:
        parts = self.tasks[task]
        e = self.embed(ids)
        zc = torch.cat(
            [
                F.relu(F.conv1d(e, self.conv_weight(task, j), parts.conv_bias[j]).amax(-1))
                for j in range(len(self.kernel_sizes))
            ],
            1,
        )
        if not self.segregated:
            return parts.head(self.dropout(zc))
        hi, lo = slot_cache if slot_cache is not None else self.slot_features(ids, task)
        alpha = parts.alpha[None, :, :, None]
        pooled = torch.where(alpha >= 0, alpha * hi, alpha * lo) + parts.slot_bias[None]
        zhat = F.relu(pooled) * parts.filled[None, :, None, None]  # (B, S, n, F)
        zf = torch.cat(
            [F.relu(zhat[:, :, j, :].flatten(1) @ self.wf_weight(task, j).T) for j in range(len(self.kernel_sizes))],
            1,
        )
        z = F.relu(self.dropout(torch.cat([zc, zf], 1)) @ self.wc_weight(task).T + parts.wc_bias)
        return parts.head(z)

    def wf_weight(self, task: int, j: int) -> Tensor:
        return self.wf[j].weight(task) if self.dls else self.tasks[task].wf[j]

    def wc_weight(self, task: int) -> Tensor:
        return self.wc.weight(task) if self.dls else self.tasks[task].wc


class ServedTextCNN(nn.Module):
    """What a device serves: every trained task's head at once, ``(ids, mask) -> (B, T, W)``
    logits, columns past a task's labels -inf.  Holds a detached copy of the weights."""

    def __init__(self, model: TextCNN, tasks: int, widths: Sequence[int]) -> None:
        super().__init__()
        self.model = model
        self.tasks = tasks
        self.widths = list(widths)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        input_ids = input_ids * attention_mask  # masked positions read the zero [PAD] row
        width = max(self.widths)
        out = []
        for t in range(self.tasks):
            logits = self.model.logits(input_ids, t)
            if self.widths[t] < width:
                pad = torch.full_like(logits[:, :1], float("-inf")).expand(-1, width - self.widths[t])
                logits = torch.cat([logits, pad], 1)
            out.append(logits)
        return torch.stack(out, 1)
