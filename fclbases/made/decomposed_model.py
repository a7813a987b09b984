"""MADE with FedWeIT-style decomposed weights (ConFedMADE, eq. 5).

For task i every masked layer uses

    W_i = B * sigmoid(m_i)[:, None] + A_i + sum_j alpha_i[j] * K_i[j]      (then * MADE mask)
    b_i = b + c_i

B (``weight``) and the bias b are the shared base that is federated; m_i (one logit per
output unit), A_i, alpha_i and the bias offset c_i are task-specific and stay on the
device; K_i are the knowledge-base entries (other clients' A) the device received for
task i, frozen.  The paper decomposes weights only; in a MADE the output biases are the
per-pixel marginals, which move with every new task, so they get a task-specific part too.
The sigmoid is applied inside forward, so the task loss trains m (a FedWeIT reference bug
computed it outside the graph).  Base parameter names equal plain MADE's, so the
aggregator, the wire and the export share one naming.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fclcore.made_spec import MadeConfig, input_order, made_masks


class DecomposedLinear(nn.Module):
    def __init__(self, n_in: int, n_out: int, bias: bool = True) -> None:
        super().__init__()
        bound = 1.0 / np.sqrt(n_in)
        self.weight = nn.Parameter(torch.empty(n_out, n_in).uniform_(-bound, bound))  # B (out, in)
        self.bias = nn.Parameter(torch.empty(n_out).uniform_(-bound, bound)) if bias else None
        self.unit_logits = nn.ParameterList()  # m_i (out,) per task
        self.adaptive = nn.ParameterList()  # A_i (out, in) per task
        self.attention = nn.ParameterList()  # alpha_i (n_kb_i,) per task
        self.bias_offsets = nn.ParameterList()  # c_i (out,) per task (empty without a bias)
        self.knowledge: list[Tensor] = []  # K_i (n_kb_i, out, in) per task, frozen
        self.settled: dict[int, Tensor] = {}  # sum_j alpha_i[j] K_i[j] of a finished task (K_i dropped)
        self.register_buffer("mask", torch.ones(n_out, n_in), persistent=False)

    def add_task(self, knowledge: Tensor, mask_init: float, lambda3: float) -> None:
        """Start a task: fresh m, A = B / lambda3, alpha = 0 over the given entries."""
        n_out, device = self.weight.shape[0], self.weight.device  # every new tensor beside B
        self.unit_logits.append(nn.Parameter(torch.full((n_out,), float(mask_init), device=device)))
        self.adaptive.append(nn.Parameter(self.weight.detach().clone() / lambda3))
        self.attention.append(nn.Parameter(torch.zeros(knowledge.shape[0], device=device)))
        self.knowledge.append(knowledge.detach().to(device))
        if self.bias is not None:
            self.bias_offsets.append(nn.Parameter(torch.zeros(n_out, device=device)))

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> "DecomposedLinear":
        """``to(device)`` and friends also move the frozen knowledge stacks and settled terms,
        which are neither parameters nor buffers (no checkpoint holds the stacks)."""
        super()._apply(fn, recurse)
        self.knowledge = [fn(k) for k in self.knowledge]
        self.settled = {i: fn(t) for i, t in self.settled.items()}
        return self

    def composed(self, task: int | None) -> Tensor:
        """The task's weight; ``None`` is the shared base alone (before any task).  Added up in
        place on the first product (the same values and gradients as ``a + b + c``; two
        weight-sized buffers a step fewer)."""
        if task is None:
            return self.weight
        w = (self.weight * torch.sigmoid(self.unit_logits[task])[:, None]).add_(self.adaptive[task])  # (out, in)
        if task in self.settled:
            w.add_(self.settled[task])
        elif self.knowledge[task].shape[0]:
            w.add_(torch.einsum("k,koi->oi", self.attention[task], self.knowledge[task]))
        return w

    @torch.no_grad()
    def settle(self, task: int, term: Tensor | None = None) -> None:
        """Task ``task`` is over (its alpha frozen): keep its knowledge term, computed now (or
        the given one, from a checkpoint), instead of its n_kb entries.  The same einsum on the
        same inputs, so composing the task gives the same bits with one (out, in) tensor."""
        if term is None:
            if task in self.settled or not self.knowledge[task].shape[0]:
                return
            term = torch.einsum("k,koi->oi", self.attention[task], self.knowledge[task])
        elif tuple(term.shape) != tuple(self.weight.shape):
            raise ValueError(f"settled knowledge of task {task}: expected shape {tuple(self.weight.shape)}")
        self.settled[task] = term.to(self.weight.device)
        self.knowledge[task] = torch.zeros(
            (0, *self.weight.shape), device=self.weight.device
        )  # the stack's memory goes

    def composed_bias(self, task: int | None) -> Tensor | None:
        if self.bias is None or task is None:
            return self.bias
        return self.bias + self.bias_offsets[task]

    def forward(self, x: Tensor, task: int | None) -> Tensor:
        w = self.composed(task)
        w = w * self.mask if task is None else w.mul_(self.mask)  # a task's composition is a fresh tensor
        return F.linear(x, w, self.composed_bias(task))


class DecomposedMADE(nn.Module):
    """x (B, D) in {0,1} -> logits (B, D) for a given task, autoregressive in the current order."""

    def __init__(self, cfg: MadeConfig) -> None:
        super().__init__()
        self.cfg = cfg
        sizes = (cfg.input_dim, *cfg.hidden_sizes)
        self.hidden = nn.ModuleList(DecomposedLinear(i, o) for i, o in zip(sizes[:-1], sizes[1:]))
        self.output = DecomposedLinear(sizes[-1], cfg.input_dim)
        self.direct = DecomposedLinear(cfg.input_dim, cfg.input_dim, bias=False) if cfg.direct else None
        self.order_index = -1
        self.set_order(0)

    @property
    def layers(self) -> dict[str, DecomposedLinear]:
        """Layer by parameter prefix, in param_shapes order."""
        out = {f"hidden.{i}": layer for i, layer in enumerate(self.hidden)}
        out["output"] = self.output
        if self.direct is not None:
            out["direct"] = self.direct
        return out

    @property
    def num_tasks(self) -> int:
        return len(self.output.adaptive)

    def set_order(self, order_index: int) -> None:
        """Switch order, recomputing every mask (hidden, output and direct)."""
        k = int(order_index) % self.cfg.num_orders
        if k == self.order_index:
            return
        masks = made_masks(self.cfg, k)
        for layer, m in zip(self.hidden, masks.hidden):
            layer.mask.copy_(torch.from_numpy(m))
        self.output.mask.copy_(torch.from_numpy(masks.output))
        if self.direct is not None:
            self.direct.mask.copy_(torch.from_numpy(masks.direct))
        self.order = input_order(self.cfg, k)
        self.order_index = k

    def add_task(self, knowledge: dict[str, Tensor], mask_init: float, lambda3: float) -> None:
        """``knowledge[prefix]`` is (n_kb, out, in) for each layer (n_kb may be 0)."""
        for prefix, layer in self.layers.items():
            layer.add_task(knowledge[prefix], mask_init, lambda3)

    def settle(self, task: int) -> None:
        """Task ``task`` is over: each layer keeps its knowledge term instead of the entries."""
        for layer in self.layers.values():
            layer.settle(task)

    def forward(self, x: Tensor, task: int | None) -> Tensor:
        h = x  # (B, D)
        for layer in self.hidden:
            h = F.relu(layer(h, task))  # (B, H_l)
        logits = self.output(h, task)  # (B, D)
        if self.direct is not None:
            logits = logits + self.direct(x, task)
        return logits

    def nll(self, x: Tensor, task: int | None) -> Tensor:
        """Per-sample NLL in nats, shape (B,)."""
        return F.binary_cross_entropy_with_logits(self(x, task), x, reduction="none").sum(dim=1)

    @torch.no_grad()
    def composed_params(self, task: int) -> dict[str, np.ndarray]:
        """Plain MADE parameters of task ``task`` (for serving and ONNX export)."""
        out = {}
        for prefix, layer in self.layers.items():
            out[f"{prefix}.weight"] = layer.composed(task).cpu().numpy().astype(np.float32)
            if layer.bias is not None:
                out[f"{prefix}.bias"] = layer.composed_bias(task).cpu().numpy().astype(np.float32)
        return out
