"""FIL-VER's networks and its loss (torch), shared by the device and the server step.

* ``Encoder``: [conv 5x5, ReLU, maxpool 2] x 2, two ReLU linear layers, then the heads: ``mu``
  and ``log_sigma`` (the log of a standard deviation, clamped), or ``mu`` alone when
  deterministic (EBR).  ``z = mu + sigma * eps`` (``sample``); ``mu`` is the noise-free path
  used at inference and in the served model.
* ``Classifier``: latent -> hidden -> hidden -> classes, ReLU.
* ``ver_loss``: batch-mean cross-entropy + beta * KL(N(mu, sigma) || N(0, I)), the KL summed
  over dimensions and averaged over the batch (notes 1.4 item 3).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from methods.filver.config import FILVEROptions
from methods.filver.wire import conv_out, image_side


class Encoder(nn.Module):
    def __init__(self, o: FILVEROptions, input_dim: int) -> None:
        super().__init__()
        self.side = image_side(input_dim)
        c1, c2 = o.channels
        self.conv1 = nn.Conv2d(1, c1, 5, padding=o.padding)
        self.conv2 = nn.Conv2d(c1, c2, 5, padding=o.padding)
        flat = c2 * conv_out(self.side, o.padding) ** 2
        self.fc1 = nn.Linear(flat, o.hidden)
        self.fc2 = nn.Linear(o.hidden, o.hidden)
        self.mu = nn.Linear(o.hidden, o.latent)
        self.log_sigma = nn.Linear(o.hidden, o.latent) if o.variational else None
        self.bounds = (o.log_sigma_min, o.log_sigma_max)

    def trunk(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(len(x), 1, self.side, self.side)
        h = F.max_pool2d(F.relu(self.conv1(h)), 2)
        h = F.max_pool2d(F.relu(self.conv2(h)), 2)
        return F.relu(self.fc2(F.relu(self.fc1(h.flatten(1)))))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(mu, log sigma), log sigma None for a deterministic encoder."""
        h = self.trunk(x)
        if self.log_sigma is None:
            return self.mu(h), None
        return self.mu(h), self.log_sigma(h).clamp(*self.bounds)


class Classifier(nn.Module):
    def __init__(self, o: FILVEROptions) -> None:
        super().__init__()
        self.fc1 = nn.Linear(o.latent, o.hidden)
        self.fc2 = nn.Linear(o.hidden, o.hidden)
        self.out = nn.Linear(o.hidden, o.classes)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.out(F.relu(self.fc2(F.relu(self.fc1(z)))))


def sample(mu: torch.Tensor, log_sigma: torch.Tensor | None, generator: torch.Generator | None = None) -> torch.Tensor:
    """z = mu + sigma * eps, eps ~ N(0, I) (Eq. 4); mu itself when there is no sigma."""
    if log_sigma is None:
        return mu
    eps = torch.randn(mu.shape, generator=generator, dtype=mu.dtype)  # the CPU generator's draws on any device
    return mu + log_sigma.exp() * eps.to(mu.device)


def kl_standard_normal(mu: torch.Tensor, log_sigma: torch.Tensor) -> torch.Tensor:
    """Per sample, KL(N(mu, sigma^2 I) || N(0, I)) = sum_d [(mu^2 + sigma^2 - 1) / 2 - log sigma]."""
    return (0.5 * (mu.pow(2) + (2 * log_sigma).exp() - 1) - log_sigma).sum(dim=1)


def ver_loss(
    logits: torch.Tensor, y: torch.Tensor, mu: torch.Tensor, log_sigma: torch.Tensor | None, beta: float
) -> torch.Tensor:
    """Cross-entropy + beta * KL (Eq. 9); cross-entropy alone for a deterministic encoder (EBR)."""
    loss = F.cross_entropy(logits, y)
    if log_sigma is not None and beta > 0:
        loss = loss + beta * kl_standard_normal(mu, log_sigma).mean()
    return loss


def load_params(module: nn.Module, prefix: str, arrays: dict) -> None:
    """Copy ``arrays[prefix + name]`` into each parameter; ValueError on a missing name or shape."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            value = arrays.get(prefix + name)
            if value is None or tuple(value.shape) != tuple(p.shape):
                got = None if value is None else tuple(value.shape)
                raise ValueError(f"{prefix}{name}: expected shape {tuple(p.shape)}, got {got}")
            p.copy_(torch.as_tensor(value, dtype=torch.float32))


def get_params(module: nn.Module, prefix: str) -> dict:
    return {prefix + name: p.detach().cpu().numpy().copy() for name, p in module.named_parameters()}
