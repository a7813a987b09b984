"""FedMADE: every MADE tensor is trained locally and averaged by the aggregator."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from edge_client.learners.base import Learner, register
from fclcore.codec import SparseTensor, Tensor
from fclcore.data import Dataset
from fclcore.made_spec import MadeConfig, order_schedule
from fclcore.models.made import MADE
from fclcore.schema import FederationSpec

EVAL_BATCH = 1024


@register("fedavg")
class FedAvgMade(Learner):
    def __init__(self, fed: FederationSpec, made: MadeConfig, client_index: int) -> None:
        super().__init__(fed, made, client_index)
        torch.manual_seed(fed.seed)
        self.model = MADE(made)
        self.optimizer = self._new_optimizer()

    def _new_optimizer(self) -> torch.optim.Optimizer:
        train = self.fed.train
        if train.optimizer == "sgd":
            return torch.optim.SGD(self.model.parameters(), lr=train.lr)
        return torch.optim.Adam(self.model.parameters(), lr=train.lr)

    def load_global(self, tensors: dict[str, Tensor]) -> None:
        dense = {k: v.to_dense() if isinstance(v, SparseTensor) else v for k, v in tensors.items()}
        self.model.set_params(dense)

    def start_task(self, task: int) -> None:
        self.optimizer = self._new_optimizer()  # stale moments from the last task only hurt

    def train_round(self, data: Dataset, rnd: int) -> tuple[int, float]:
        train = self.fed.train
        seed = np.random.SeedSequence([self.fed.seed, self.client_index, rnd]).generate_state(1)[0]
        generator = torch.Generator().manual_seed(int(seed))
        x = torch.from_numpy(data.x)
        self.model.train()
        losses, step = [], 0
        for _ in range(train.local_epochs):
            for batch in torch.randperm(len(x), generator=generator).split(train.batch_size):
                self.model.set_order(order_schedule(self.made, rnd, step))
                loss = self.model.nll(x[batch]).mean()
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                self.optimizer.step()
                losses.append(loss.item())
                step += 1
        self.model.set_order(0)  # the served order
        return len(x), float(np.mean(losses))

    def upload(self) -> dict[str, Tensor]:
        return self.model.get_params()

    @torch.no_grad()
    def evaluate(self, tests: Sequence[Dataset]) -> list[float]:
        self.model.eval()
        self.model.set_order(0)
        out = []
        for data in tests:
            x = torch.from_numpy(data.x)
            total = sum(self.model.nll(x[i:i + EVAL_BATCH]).sum().item() for i in range(0, len(x), EVAL_BATCH))
            out.append(round(total / len(x), 4))
        return out
