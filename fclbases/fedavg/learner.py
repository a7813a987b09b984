"""The dense FedAvg learner a method may build on: a plain MADE trained on the current task's
rows and uploaded whole, every tensor dense (McMahan et al. 2017).  Subclasses change what a
round trains on (``training_data``) or add a regulariser (``penalty``); the FedAvg-family
baselines of ConFedMADE and FedAvgM's devices are such learners."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from fclbases.made.learner import MadeLearner, mean_nll
from fclcore import optim
from fclcore.codec import Frame, SparseTensor, Tensor
from fclcore.data import Dataset
from fclcore.models.made import MADE
from fclcore.schedule import RoundPlace
from fclcore.schema import FederationSpec
from fclcore.served import ServedModel


class FedAvgLearner(MadeLearner):
    def __init__(self, fed: FederationSpec, options: Any, input_dim: int, client_index: int) -> None:
        super().__init__(fed, options, input_dim, client_index)
        torch.manual_seed(fed.seed)
        self.model = MADE(self.made)
        self.optimizer = self._new_optimizer()
        self.global_params: list[torch.Tensor] = []

    def _new_optimizer(self) -> optim.Optimizer:
        train = self.fed.train
        if train.optimizer == "sgd":
            return optim.SGD(self.model.parameters(), lr=train.lr)
        return optim.Adam(self.model.parameters(), lr=train.lr, fused=True)

    def load_global(self, tensors: dict[str, Tensor], rnd: int, meta: dict | None = None) -> None:
        dense = {k: v.to_dense() if isinstance(v, SparseTensor) else v for k, v in tensors.items()}
        self.model.set_params(dense)
        self.global_params = [p.detach().clone() for p in self.model.parameters()]

    def start_task(self, task: int, downlink: Frame | None) -> None:
        super().start_task(task, downlink)
        self.optimizer = self._new_optimizer()  # stale moments from the last task only hurt

    def training_data(self, train: Sequence[Dataset]) -> np.ndarray:
        """The rows this round trains on: the current task's."""
        return train[-1].x

    def penalty(self) -> torch.Tensor | float:
        """Regulariser added to the NLL (none for plain FedAvg)."""
        return 0.0

    def train_round(self, train: Sequence[Dataset], rnd: int, place: RoundPlace) -> tuple[int, float]:
        x = torch.from_numpy(self.training_data(train))

        def loss(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            nll = self.model.nll(batch).mean()
            return nll, nll + self.penalty()

        train_nll = self.local_epochs(self.model, x, rnd, loss)
        self.model.set_order(0)  # the served order
        return len(x), train_nll

    def upload(self, rnd: int, place: RoundPlace) -> dict[str, Tensor]:
        return self.model.get_params()

    @torch.no_grad()
    def evaluate(self, tests: Sequence[Dataset | None]) -> list[float | None]:
        self.model.eval()
        self.model.set_order(0)
        return [mean_nll(self.model.nll, d, self.device) for d in tests]

    def served_model(self, task: int, binarize: str = "") -> ServedModel:
        return ServedModel(
            made=self.made,
            params=self.model.get_params(),
            order_index=0,
            method=self.fed.method,
            task=task,
            binarize=binarize,
        )
