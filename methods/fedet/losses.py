"""FedET's local losses (paper eq. 3-5) as small pure functions of logits.

Double distillation (Zhang et al. 2020, DMC): the consolidated group imitates the old group on
the old classes and the temporary group on the new classes.  Each teacher's logits are
centred on its own block, because two separately trained heads have unrelated offsets::

    y_dot_i = y_old_i - mean_j(y_old_j)    for the m old classes      (eq. 5, first case)
    y_dot_i = y_tmp_i - mean_j(y_tmp_j)    for the n new classes      (eq. 5, second case)
    L_dd    = 1/(m+n) * sum_i (y_i - y_dot_i)^2, averaged over the samples U   (eq. 3, 4)

Blocks of one class centre to 0 (a one-class head carries no information); a client that saw
a single new class therefore also reports entropy 0 and gets no weight on the server (eq. 6).
"""

from __future__ import annotations

import torch
from torch import Tensor

from fclcore.text import entropy_nats

__all__ = ["centered", "double_distillation_targets", "distillation_loss", "label_entropy"]

label_entropy = entropy_nats  # H(M^t) of a client's new-class label histogram (nats)


def centered(logits: Tensor) -> Tensor:
    """(B, k) -> (B, k) minus the row mean; (B, 0) stays empty."""
    if logits.shape[1] == 0:
        return logits
    return logits - logits.mean(dim=1, keepdim=True)


def double_distillation_targets(old_logits: Tensor, new_logits: Tensor) -> Tensor:
    """Eq. 5: (B, m) old-group and (B, n) temporary-group logits -> (B, m + n) targets."""
    if old_logits.shape[0] != new_logits.shape[0]:
        raise ValueError(f"batch sizes differ: {old_logits.shape[0]} vs {new_logits.shape[0]}")
    return torch.cat([centered(old_logits), centered(new_logits)], dim=1)


def distillation_loss(student: Tensor, targets: Tensor, have_target: Tensor | None = None) -> Tensor:
    """Eq. 3-4: mean over samples of the mean squared gap over the classes with a target.

    ``have_target`` (c,) bool leaves out head rows no teacher speaks for (classes of the group
    that this client never saw); with all rows present this is exactly 1/(m+n) sum_i (...)^2."""
    if student.shape != targets.shape:
        raise ValueError(f"student {tuple(student.shape)} and targets {tuple(targets.shape)} differ")
    if have_target is None:
        return ((student - targets) ** 2).mean()
    cols = have_target.nonzero().squeeze(1)
    if cols.numel() == 0:
        raise ValueError("distillation_loss: no class has a target")
    return ((student[:, cols] - targets[:, cols]) ** 2).mean()
