"""FedMADE and the FedAvg-family baselines: every MADE tensor is trained and averaged.

* ``fedavg`` / ``fedcl-finetune``: plain local training on the current task;
* ``fedprox``: + mu/2 ||w - w_global||^2 (Li et al. 2020);
* ``fedcurv``: + an EWC penalty sum_i lambda/2 F_i (w - w_i*)^2 with the diagonal Fisher of
  each finished task computed on local data (FedCurv shares such penalties; here each
  device keeps its own, i.e. federated EWC);
* ``fedcl-cumulative-replay``: trains on the union of every task seen so far (upper bound);
* ``offline``: trains on the union of ALL tasks from the first round (the joint, non-continual
  reference; run it with one client for the paper's single-device offline model).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from edge_client.learners.base import Learner, register
from fclcore.codec import Frame, SparseTensor, Tensor
from fclcore.data import Dataset
from fclcore.made_spec import MadeConfig
from fclcore.models.made import MADE
from fclcore.schema import FederationSpec

EVAL_BATCH = 1024


@register("fedavg", "fedcl-finetune", "fedprox", "fedcurv", "fedcl-cumulative-replay", "offline")
class FedAvgMade(Learner):
    def __init__(self, fed: FederationSpec, made: MadeConfig, client_index: int) -> None:
        super().__init__(fed, made, client_index)
        self.sees_all_tasks = fed.method == "offline"
        torch.manual_seed(fed.seed)
        self.model = MADE(made)
        self.optimizer = self._new_optimizer()
        self.global_params: list[torch.Tensor] = []
        self.fisher: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []  # (F_i, w_i*) per task

    def _new_optimizer(self) -> torch.optim.Optimizer:
        train = self.fed.train
        if train.optimizer == "sgd":
            return torch.optim.SGD(self.model.parameters(), lr=train.lr)
        return torch.optim.Adam(self.model.parameters(), lr=train.lr, fused=True)

    def load_global(self, tensors: dict[str, Tensor], rnd: int, meta: dict | None = None) -> None:
        dense = {k: v.to_dense() if isinstance(v, SparseTensor) else v for k, v in tensors.items()}
        self.model.set_params(dense)
        self.global_params = [p.detach().clone() for p in self.model.parameters()]

    def start_task(self, task: int, knowledge: Frame | None) -> None:
        super().start_task(task, knowledge)
        if not self.sees_all_tasks:  # offline: task starts are only evaluation points
            self.optimizer = self._new_optimizer()  # stale moments from the last task only hurt

    def train_round(self, train: Sequence[Dataset], rnd: int) -> tuple[int, float]:
        union = self.fed.method in ("fedcl-cumulative-replay", "offline")
        data = np.concatenate([d.x for d in train]) if union else train[-1].x
        x = torch.from_numpy(data)

        def loss(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            nll = self.model.nll(batch).mean()
            return nll, nll + self._penalty()

        train_nll = self.local_epochs(self.model, x, rnd, loss)
        self.model.set_order(0)  # the served order
        if self.fed.method == "fedcurv" and (rnd + 1) % self.fed.rounds_per_task == 0:
            self.fisher.append(self._fisher(train[-1]))  # this task's anchor, before it is averaged away
        return len(x), train_nll

    def _penalty(self) -> torch.Tensor | float:
        params = list(self.model.parameters())
        total: torch.Tensor | float = 0.0
        if self.fed.method == "fedprox" and self.global_params:
            mu = self.fed.options.prox_mu
            total = total + mu / 2 * sum(((p - g) ** 2).sum() for p, g in zip(params, self.global_params))
        if self.fed.method == "fedcurv":
            lam = self.fed.options.ewc_lambda
            for fisher, anchor in self.fisher:
                total = total + lam / 2 * sum((f * (p - a) ** 2).sum() for p, f, a in zip(params, fisher, anchor))
        return total

    def upload(self, rnd: int, task_end: bool) -> dict[str, Tensor]:
        return self.model.get_params()

    def state(self) -> tuple[dict, dict[str, np.ndarray]]:
        meta, arrays = super().state()
        for t, (fisher, anchor) in enumerate(self.fisher):
            for i, (f, a) in enumerate(zip(fisher, anchor)):
                arrays[f"fisher/{t}/{i}"], arrays[f"anchor/{t}/{i}"] = f.numpy().copy(), a.numpy().copy()
        return {**meta, "fisher_tasks": len(self.fisher)}, arrays

    def load_state(self, meta: dict, arrays: dict[str, np.ndarray]) -> None:
        super().load_state(meta, arrays)
        n_params = len(list(self.model.parameters()))
        try:
            self.fisher = [([torch.from_numpy(arrays[f"fisher/{t}/{i}"].copy()) for i in range(n_params)],
                            [torch.from_numpy(arrays[f"anchor/{t}/{i}"].copy()) for i in range(n_params)])
                           for t in range(int(meta.get("fisher_tasks", 0)))]
        except KeyError as exc:
            raise ValueError(f"checkpoint lacks {exc}") from None

    def _fisher(self, data: Dataset, max_samples: int = 512) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Diagonal empirical Fisher of the NLL on up to ``max_samples`` local samples."""
        x = torch.from_numpy(data.x[:max_samples])
        fisher = [torch.zeros_like(p) for p in self.model.parameters()]
        for i in range(0, len(x), 32):
            self.model.zero_grad(set_to_none=True)
            self.model.nll(x[i:i + 32]).mean().backward()
            for f, p in zip(fisher, self.model.parameters()):
                f += p.grad.detach() ** 2 * len(x[i:i + 32]) / len(x)
        return fisher, [p.detach().clone() for p in self.model.parameters()]

    @torch.no_grad()
    def evaluate(self, tests: Sequence[Dataset | None]) -> list[float | None]:
        self.model.eval()
        self.model.set_order(0)
        return [mean_nll(self.model.nll, d) for d in tests]

    def served_params(self) -> dict[str, np.ndarray]:
        return self.model.get_params()


def mean_nll(nll, data: Dataset | None) -> float | None:
    """Mean per-sample NLL over ``data`` in batches (None for no data)."""
    if data is None:
        return None
    x = torch.from_numpy(data.x)
    total = sum(nll(x[i:i + EVAL_BATCH]).sum().item() for i in range(0, len(x), EVAL_BATCH))
    return round(total / len(x), 4)
