"""The weight-sized part of ConFedMADE's regulariser (eq. 6) with a hand-written backward.

For one layer at task t, with M the mask of the L1 term (the current MADE mask, or 1):

    lambda1 * sum_{i<=t} |A_i * M|_1  +  lambda2 * sum_{i<t} ||dB * sigmoid(m_i) + dA_i||^2

(dB and dA_i the change since the task started; m_i, i < t, frozen).  Written with autograd,
the penalty keeps a graph of about 2t + 2 weight-sized tensors per layer from the forward to
the backward pass: 100 MB of a Sequential MNIST device's peak by task 4
(``benchmarks/profile_confedmade_step.py``).  Here the forward keeps nothing and the backward
recomputes each drift term on its own, so at most four weight-sized temporaries of one layer
exist at a time.  Those temporaries are views of a ``Workspace`` that lives as long as the
learner: a step allocates only the gradients it returns (about 60 fewer weight-sized buffers per
step at the fifth task), so the C heap is not cut into holes that a step's buffers then fault
in all over (``firmware_notes/memory.md``, third pass).

The gradients are bit-for-bit autograd's (``tests/methods/test_decomposed.py`` compares them): the
same operations in the same order, and where autograd sums several contributions to one
tensor (dB over the earlier tasks) they are summed in the order its engine runs them, the
last task's first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


class Workspace:
    """Scratch buffers for the penalty of one layer at a time, reused across layers and steps,
    on the device the learner trains on."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device
        self._flat = torch.empty(0, device=device)

    def reserve(self, numel: int) -> None:
        """Room for the largest layer's three buffers (allocated once, not during a step)."""
        if self._flat.numel() < 3 * numel:
            self._flat = torch.empty(0, device=self.device)  # the old buffer goes first
            self._flat = torch.empty(3 * numel, device=self.device)

    def views(self, shape: tuple[int, ...]) -> tuple[Tensor, Tensor, Tensor]:
        numel = math.prod(shape)
        self.reserve(numel)
        return tuple(self._flat[i * numel : (i + 1) * numel].view(shape) for i in range(3))


@dataclass(frozen=True)
class PenaltyTerms:
    """What the penalty of one layer needs besides B and the A_i (all frozen during a step)."""

    base0: Tensor  # B at the task start (out, in)
    adaptive0: list[Tensor]  # A_i at the task start, i < t
    gates: list[Tensor]  # sigmoid(m_i)[:, None] of the frozen earlier masks, i < t, (out, 1)
    mask: Tensor | float  # M of the L1 term
    lambda1: float
    lambda2: float
    work: Workspace  # where the temporaries go


class WeightPenalty(torch.autograd.Function):
    """``apply(terms, B, A_0, ..., A_t)`` -> the penalty (a 0-dim tensor)."""

    @staticmethod
    def forward(ctx: Any, terms: PenaltyTerms, base: Tensor, *adaptive: Tensor) -> Tensor:
        ctx.terms = terms
        ctx.save_for_backward(base, *adaptive)
        with torch.no_grad():  # the value (to float32 precision), in the workspace
            scratch, d_base, _ = terms.work.views(tuple(base.shape))
            total = terms.lambda1 * sum(float(torch.mul(a, terms.mask, out=scratch).abs_().sum()) for a in adaptive)
            torch.sub(base, terms.base0, out=d_base)
            for i, gate in enumerate(terms.gates):
                drift = torch.mul(d_base, gate, out=scratch).add_(adaptive[i]).sub_(terms.adaptive0[i])
                total += terms.lambda2 * float(drift.square_().sum())
        return base.new_tensor(total)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        if not torch.equal(grad, torch.ones_like(grad)):
            raise RuntimeError("WeightPenalty is a loss term: its backward expects a gradient of 1")
        terms: PenaltyTerms = ctx.terms
        base, *adaptive = ctx.saved_tensors
        # the gradients returned are the only new buffers; the rest is the workspace, in place
        grads = [torch.mul(a, terms.mask).sgn_().mul_(terms.lambda1).mul_(terms.mask) for a in adaptive]  # L1
        drift, d_base, moved = terms.work.views(tuple(base.shape))
        torch.sub(base, terms.base0, out=d_base)
        grad_base = None
        for i in reversed(range(len(terms.gates))):  # autograd's order: the last task's term first
            torch.mul(d_base, terms.gates[i], out=drift)
            drift += torch.sub(adaptive[i], terms.adaptive0[i], out=moved)
            g = drift.mul_(2.0).mul_(terms.lambda2)  # d(lambda2 * drift**2) / d drift
            grads[i] += g
            g.mul_(terms.gates[i])  # the part of it that reaches B
            grad_base = g.clone() if grad_base is None else grad_base.add_(g)
        return (None, grad_base, *grads)
