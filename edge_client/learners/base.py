"""What a learning method does on the device, independent of MQTT."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from fclcore.codec import Frame, Tensor
from fclcore.data import Dataset
from fclcore.made_spec import MadeConfig
from fclcore.orders import step_order
from fclcore.schema import FederationSpec

LEARNERS: dict[str, type["Learner"]] = {}


def register(*names: str) -> Callable[[type["Learner"]], type["Learner"]]:
    def wrap(cls: type[Learner]) -> type[Learner]:
        for name in names:
            LEARNERS[name] = cls
        return cls
    return wrap


def make_learner(fed: FederationSpec, made: MadeConfig, client_index: int) -> "Learner":
    if fed.method not in LEARNERS:
        raise ValueError(f"method: expected one of {sorted(LEARNERS)}, got {fed.method!r}")
    return LEARNERS[fed.method](fed, made, client_index)


def round_seed(*parts: int) -> int:
    """A 63-bit seed from integers (for per-client, per-round shuffling)."""
    return int(np.random.SeedSequence(list(parts)).generate_state(2, dtype=np.uint32).view(np.uint64)[0] >> 1)


class Learner:
    """One client's model and optimiser state across rounds and tasks."""

    def __init__(self, fed: FederationSpec, made: MadeConfig, client_index: int) -> None:
        self.fed = fed
        self.made = made
        self.client_index = client_index
        self.task = -1
        self.optimizer: torch.optim.Optimizer | None = None  # set by the method

    metric = "nll"  # what ``evaluate`` returns per task: "nll" (lower is better) or "accuracy"
    sees_all_tasks = False  # True: ``train_round`` gets every task's data from the start (offline)

    def load_global(self, tensors: dict[str, Tensor], rnd: int, meta: dict | None = None) -> None:
        """Merge the aggregator's model (``meta``: the round message's metadata); ValueError if
        names or shapes do not fit."""
        raise NotImplementedError

    def start_task(self, task: int, knowledge: Frame | None) -> None:
        """Called once before the first round of each task (with the knowledge frame, if any)."""
        self.task = task

    def train_round(self, train: Sequence[Dataset], rnd: int) -> tuple[int, float]:
        """Local training for round ``rnd``; ``train[i]`` is task i's data for i <= current task
        (for every task if ``sees_all_tasks``).

        Returns (samples used, mean train NLL)."""
        raise NotImplementedError

    def local_epochs(self, model: torch.nn.Module, x: torch.Tensor, rnd: int,
                     loss: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]) -> float:
        """The shared local loop: shuffling seeded by (seed, client, round), the MADE order of
        each step from the synchronised schedule, one optimiser step per mini-batch.

        ``loss(batch)`` returns (mean NLL, NLL + regularisers); the mean NLL is returned."""
        generator = torch.Generator().manual_seed(round_seed(self.fed.seed, self.client_index, rnd))
        model.train()
        losses, step = [], 0
        for _ in range(self.fed.train.local_epochs):
            for batch in torch.randperm(len(x), generator=generator).split(self.fed.train.batch_size):
                model.set_order(step_order(self.made, self.fed.options, rnd, step))
                nll, total = loss(x[batch])
                self.optimizer.zero_grad(set_to_none=True)
                total.backward()
                self.optimizer.step()
                losses.append(nll.item())
                step += 1
        return float(np.mean(losses))

    def upload(self, rnd: int, task_end: bool) -> dict[str, Tensor]:
        """The tensors to send for this round (``task_end``: the last round of a task)."""
        raise NotImplementedError

    def report(self, task_end: bool) -> dict:
        """Extra JSON metadata for this round's upload."""
        return {}

    def evaluate(self, tests: Sequence[Dataset | None]) -> list[float | None]:
        """Per task, the ``metric`` on its test data (mean NLL in nats per sample, or accuracy);
        None where no data is given."""
        raise NotImplementedError

    def served_params(self) -> dict[str, np.ndarray]:
        """Plain MADE parameters of what the device serves now (for export)."""
        raise NotImplementedError

    # -- checkpoints -------------------------------------------------------------------
    # A restarted daemon rebuilds the learner's structure by calling ``start_task`` for every
    # task it had started (with the same knowledge frames), then ``load_state``.  Methods add
    # their own state by extending both; names are "/"-separated, values numeric arrays.
    model: torch.nn.Module

    def state(self) -> tuple[dict, dict[str, np.ndarray]]:
        """(JSON meta, arrays): the model, the optimiser's moments, and method extras."""
        arrays = {f"model/{k}": v.detach().cpu().numpy().copy() for k, v in self.model.state_dict().items()}
        if self.optimizer is not None:
            for index, slots in self.optimizer.state_dict()["state"].items():
                for key, value in slots.items():
                    arrays[f"optim/{index}/{key}"] = torch.as_tensor(value).detach().cpu().numpy().copy()
        return {"task": self.task}, arrays

    def load_state(self, meta: dict, arrays: dict[str, np.ndarray]) -> None:
        """Inverse of ``state`` on a learner rebuilt to the same structure; ValueError if it
        does not fit."""
        if meta.get("task") != self.task:
            raise ValueError(f"checkpoint is for task {meta.get('task')}, learner rebuilt to task {self.task}")
        model = {k[len("model/"):]: torch.from_numpy(v.copy()) for k, v in arrays.items() if k.startswith("model/")}
        try:
            self.model.load_state_dict(model, strict=True)
        except RuntimeError as exc:
            raise ValueError(f"model state does not fit: {str(exc).splitlines()[0]}") from None
        if self.optimizer is not None:
            state: dict[int, dict[str, torch.Tensor]] = {}
            for name, value in arrays.items():
                if name.startswith("optim/"):
                    index, key = name[len("optim/"):].split("/", 1)
                    state.setdefault(int(index), {})[key] = torch.from_numpy(value.copy())
            full = self.optimizer.state_dict()
            if not set(state) <= {i for g in full["param_groups"] for i in g["params"]}:
                raise ValueError("optimizer state does not fit the rebuilt optimizer")
            full["state"] = state
            self.optimizer.load_state_dict(full)
