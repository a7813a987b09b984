"""Frozen linear layers as int8 matmuls: what ``FrozenBackbone.with_int8_blocks`` runs the
backbone's blocks 1.. with, so that the Enhancer passes cost less device CPU."""

from __future__ import annotations

import warnings

import torch
from torch import Tensor


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
