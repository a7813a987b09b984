"""The FedAvg-family baselines of ConFedMADE's comparison: every MADE tensor is trained and
averaged (the dense FedAvg learner and strategy of ``fclbases.fedavg``), the devices differ.

* ``fedavg`` / ``fedcl-finetune`` (``fclbases.fedavg.learner.FedAvgLearner``): plain local
  training on the current task;
* ``fedprox`` (``FedProxLearner``): + mu/2 ||w - w_global||^2 (Li et al. 2020);
* ``fedcurv`` (``FedCurvLearner``): + an EWC penalty sum_i lambda/2 F_i (w - w_i*)^2 with the
  diagonal Fisher of each finished task computed on local data (FedCurv shares such
  penalties; here each device keeps its own, i.e. federated EWC);
* ``fedcl-cumulative-replay`` (``ReplayLearner``): trains on the union of every task seen so far;
* ``offline`` (``OfflineLearner``): trains on the union of ALL tasks from the first round (the
  joint, non-continual reference; run it with one client for the single-device offline model).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from fclbases.fedavg.learner import FedAvgLearner
from fclcore.codec import Frame
from fclcore.data import Dataset
from fclcore.schedule import RoundPlace
from fclcore.schema import FederationSpec


class FedProxLearner(FedAvgLearner):
    def penalty(self) -> torch.Tensor | float:
        if not self.global_params:
            return 0.0
        mu = self.options.prox_mu
        return mu / 2 * sum(((p - g) ** 2).sum() for p, g in zip(self.model.parameters(), self.global_params))


class ReplayLearner(FedAvgLearner):
    def training_data(self, train: Sequence[Dataset]) -> np.ndarray:
        return np.concatenate([d.x for d in train])


class OfflineLearner(ReplayLearner):
    sees_all_tasks = True  # task starts are only evaluation points

    def start_task(self, task: int, downlink: Frame | None) -> None:
        self.task = task  # one optimiser for the whole run


class FedCurvLearner(FedAvgLearner):
    def __init__(self, fed: FederationSpec, options: Any, input_dim: int, client_index: int) -> None:
        super().__init__(fed, options, input_dim, client_index)
        self.fisher: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []  # (F_i, w_i*) per task

    def penalty(self) -> torch.Tensor | float:
        total: torch.Tensor | float = 0.0
        lam = self.options.ewc_lambda
        params = list(self.model.parameters())
        for fisher, anchor in self.fisher:
            total = total + lam / 2 * sum((f * (p - a) ** 2).sum() for p, f, a in zip(params, fisher, anchor))
        return total

    def train_round(self, train: Sequence[Dataset], rnd: int, place: RoundPlace) -> tuple[int, float]:
        out = super().train_round(train, rnd, place)
        if place.task_end:
            self.fisher.append(self._fisher(train[-1]))  # this task's anchor, before it is averaged away
        return out

    def state(self) -> tuple[dict, dict[str, np.ndarray]]:
        meta, arrays = super().state()
        for t, (fisher, anchor) in enumerate(self.fisher):
            for i, (f, a) in enumerate(zip(fisher, anchor)):
                arrays[f"fisher/{t}/{i}"], arrays[f"anchor/{t}/{i}"] = f.cpu().numpy().copy(), a.cpu().numpy().copy()
        return {**meta, "fisher_tasks": len(self.fisher)}, arrays

    def load_state(self, meta: dict, arrays: dict[str, np.ndarray]) -> None:
        super().load_state(meta, arrays)
        n_params = len(list(self.model.parameters()))
        try:
            self.fisher = [
                (
                    [torch.from_numpy(arrays[f"fisher/{t}/{i}"].copy()).to(self.device) for i in range(n_params)],
                    [torch.from_numpy(arrays[f"anchor/{t}/{i}"].copy()).to(self.device) for i in range(n_params)],
                )
                for t in range(int(meta.get("fisher_tasks", 0)))
            ]
        except KeyError as exc:
            raise ValueError(f"checkpoint lacks {exc}") from None

    def _fisher(self, data: Dataset, max_samples: int = 512) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Diagonal empirical Fisher of the NLL on up to ``max_samples`` local samples."""
        x = torch.from_numpy(data.x[:max_samples]).to(self.device)
        fisher = [torch.zeros_like(p) for p in self.model.parameters()]
        for i in range(0, len(x), 32):
            self.model.zero_grad(set_to_none=True)
            self.model.nll(x[i : i + 32]).mean().backward()
            for f, p in zip(fisher, self.model.parameters()):
                f += p.grad.detach() ** 2 * len(x[i : i + 32]) / len(x)
        return fisher, [p.detach().clone() for p in self.model.parameters()]
