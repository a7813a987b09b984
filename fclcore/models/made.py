"""Torch MADE (Germain et al., 2015), in the spirit of karpathy/pytorch-made.

Masks are never computed here: they come from ``fclcore.made_spec.made_masks``,
the same torch-free function the aggregator uses, so both sides agree on the
connectivity for every ``(MadeConfig, order_index)`` by construction.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fclcore.made_spec import MadeConfig, input_order, made_masks, param_shapes


class MaskedLinear(nn.Linear):
    """nn.Linear whose weight is multiplied by a fixed 0/1 mask in the forward pass."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias)
        # Non-persistent: masks are a pure function of (cfg, order_index), so they are
        # kept out of state_dict (a loaded mask could contradict self.order_index).
        self.register_buffer("mask", torch.ones(out_features, in_features), persistent=False)

    def set_mask(self, mask: np.ndarray) -> None:
        """Copy a (out, in) 0/1 mask into the buffer (in place: keeps device and dtype)."""
        m = torch.tensor(np.asarray(mask, dtype=np.float32))
        if m.shape != self.mask.shape:
            raise ValueError(f"mask shape {tuple(m.shape)} != expected {tuple(self.mask.shape)}")
        self.mask.copy_(m)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight * self.mask, self.bias)


class MADE(nn.Module):
    """Binary MADE: x (B, D) in {0,1} -> Bernoulli logits (B, D), autoregressive in the current order."""

    def __init__(self, cfg: MadeConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, sizes = cfg.input_dim, (cfg.input_dim, *cfg.hidden_sizes)
        # Registration order defines named_parameters() order == param_shapes(cfg) order.
        self.hidden = nn.ModuleList(MaskedLinear(i, o) for i, o in zip(sizes[:-1], sizes[1:]))
        self.output = MaskedLinear(sizes[-1], d)
        self.direct = MaskedLinear(d, d, bias=False) if cfg.direct else None
        self.order_index = -1  # forces the first set_order to install masks
        self.order = np.arange(d)
        self.set_order(0)

    def set_order(self, order_index: int) -> None:
        """Switch to order ``order_index % num_orders``, recomputing ALL masks.

        Every mask changes with the order (first hidden, output and direct masks
        all use the input degrees), so none may be kept from the previous order.
        """
        k = int(order_index) % self.cfg.num_orders
        if k == self.order_index:
            return
        masks = made_masks(self.cfg, k)
        for layer, m in zip(self.hidden, masks.hidden):
            layer.set_mask(m)
        self.output.set_mask(masks.output)
        if self.direct is not None:
            self.direct.set_mask(masks.direct)
        self.order = input_order(self.cfg, k)
        self.order_index = k

    def forward(self, x: Tensor) -> Tensor:
        if x.ndim != 2 or x.shape[1] != self.cfg.input_dim:
            raise ValueError(f"expected input of shape (B, {self.cfg.input_dim}), got {tuple(x.shape)}")
        h = x  # (B, D)
        for layer in self.hidden:
            h = F.relu(layer(h))  # (B, H_l)
        logits = self.output(h)  # (B, D)
        if self.direct is not None:
            logits = logits + self.direct(x)  # (B, D)
        return logits

    def nll(self, x: Tensor) -> Tensor:
        """Per-sample negative log-likelihood in nats, shape (B,)."""
        return F.binary_cross_entropy_with_logits(self(x), x, reduction="none").sum(dim=1)

    def get_params(self) -> dict[str, np.ndarray]:
        """float32 numpy copies of the trainable tensors, keyed like ``param_shapes``."""
        return {n: p.detach().cpu().numpy().astype(np.float32, copy=True) for n, p in self.named_parameters()}

    def set_params(self, params: dict[str, np.ndarray]) -> None:
        """Load parameters, validating names and shapes before touching anything.

        Validation happens first so a malformed update (e.g. from another config)
        never leaves the model half-overwritten.
        """
        expected = param_shapes(self.cfg)
        missing = [n for n in expected if n not in params]
        unexpected = [n for n in params if n not in expected]
        if missing or unexpected:
            raise ValueError(f"parameter names mismatch: missing {missing}, unexpected {unexpected}")
        arrays = {}
        for name, shape in expected.items():
            a = np.asarray(params[name], dtype=np.float32)
            if a.shape != shape:
                raise ValueError(f"parameter {name!r}: expected shape {shape}, received {a.shape}")
            arrays[name] = a
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(torch.tensor(arrays[name]))

    @torch.no_grad()
    def sample(self, n: int, generator: torch.Generator | None = None) -> Tensor:
        """Draw ``n`` samples (n, D) in {0,1}, one dimension at a time in the current order.

        ``generator`` must live on the model's device.
        """
        w = self.output.weight
        x = torch.zeros(n, self.cfg.input_dim, device=w.device, dtype=w.dtype)
        for d in self.order:  # D forward passes; output d only sees already-sampled dims
            probs = torch.sigmoid(self(x)[:, int(d)])  # (n,)
            x[:, int(d)] = torch.bernoulli(probs, generator=generator)
        return x


def served_logits(served, x: np.ndarray) -> np.ndarray:
    """The logits of a served MADE (``fclcore.served.ServedModel``) on binary rows ``x``, from
    this torch MADE with the served params and order: the reference an export is checked against."""
    net = MADE(served.made)
    net.set_params(dict(served.params))
    net.set_order(served.order_k)
    net.eval()
    with torch.no_grad():
        return net(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))).numpy()
