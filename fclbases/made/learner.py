"""The MADE learner loop a method may build on: a torch MADE-family model trained with the
synchronised order schedule (``fclbases.made.options``), its checkpoint (model + optimiser
moments) and its evaluation (mean NLL in batches)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import numpy as np
import torch

from fclbases.made.options import step_order
from fclcore import optim
from fclcore.data import Dataset
from fclcore.device import autocast, grad_scaler
from fclcore.learner import Learner, round_seed
from fclcore.made_spec import MadeConfig
from fclcore.procmem import release_free_memory
from fclcore.schema import FederationSpec

EVAL_BATCH = 1024


class MadeLearner(Learner):
    """A learner whose model is a MADE (plain or decomposed) built from ``federation.model``."""

    model: torch.nn.Module
    # True: each parameter is updated inside the backward pass as soon as its gradient is
    # complete, and that gradient dropped (``fclcore.optim.Optimizer.stepping_in_backward``):
    # the same values, without every gradient of the model held at once
    step_in_backward = False

    def __init__(self, fed: FederationSpec, options: Any, input_dim: int, client_index: int) -> None:
        super().__init__(fed, options, input_dim, client_index)
        self.made: MadeConfig = fed.model.made_config(input_dim)
        self.optimizer: optim.Optimizer | None = None  # set by the method
        self.device = torch.device("cpu")  # where the model trains (``place``); data stays in host memory
        self.amp = "off"

    def place(self, device: torch.device, amp: str) -> None:
        """The model and the optimiser's state move to ``device``; each batch follows it there."""
        if amp == "fp16" and self.step_in_backward:
            raise ValueError("train.amp fp16: its loss scaling cannot unscale updates made inside the backward pass")
        self.device, self.amp = device, amp
        before = list(self.model.parameters())
        self.model.to(device)  # may give new Parameter objects (a device type whose tensors cannot be swapped in)
        if self.optimizer is not None:
            saved = self.optimizer.state_dict()  # by position, so it loads into the moved parameters
            moved = dict(zip(map(id, before), self.model.parameters()))
            for group in self.optimizer.param_groups:
                group["params"] = [moved.get(id(p), p) for p in group["params"]]
            self.optimizer.load_state_dict(saved)  # moments cast to their parameters' device

    def local_epochs(
        self,
        model: torch.nn.Module,
        x: torch.Tensor,
        rnd: int,
        loss: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    ) -> float:
        """The shared local loop: shuffling seeded by (seed, client, round), the MADE order of
        each step from the synchronised schedule, one optimiser step per mini-batch.  ``x`` may
        hold uint8 0/1 pixels (``Learner.compact_pixels``): each batch is made float32.

        ``loss(batch)`` returns (mean NLL, NLL + regularisers); the mean NLL is returned."""
        generator = torch.Generator().manual_seed(round_seed(self.fed.seed, self.client_index, rnd))
        scaler = grad_scaler(self.device, self.amp)
        model.train()
        losses, step = [], 0
        for _ in range(self.fed.train.local_epochs):
            for batch in torch.randperm(len(x), generator=generator).split(self.fed.train.batch_size):
                model.set_order(step_order(self.made, self.options, rnd, step))
                self.optimizer.zero_grad(set_to_none=True)  # before the forward: old grads never meet its graph
                with autocast(self.device, self.amp):  # uint8 0/1 pixels: the same values as float32
                    nll, total = loss(x[batch].to(self.device, torch.float32))
                if scaler is not None:  # fp16 (never with step_in_backward: see ``place``)
                    scaler.scale(total).backward()
                    scaler.step(self.optimizer)
                    scaler.update()
                else:
                    with self.optimizer.stepping_in_backward() if self.step_in_backward else contextlib.nullcontext():
                        total.backward()
                    self.optimizer.step()  # what the backward pass did not update (all of it, unless step_in_backward)
                losses.append(nll.item())
                step += 1
        self.optimizer.zero_grad(set_to_none=True)  # no gradients held between rounds
        release_free_memory()  # the steps' freed buffers go back to the OS before the upload is packed
        return float(np.mean(losses))

    def state(self) -> tuple[dict, dict[str, np.ndarray]]:
        """(JSON meta, arrays): the model, the optimiser's moments, and method extras."""
        arrays = {f"model/{k}": v.detach().cpu().numpy() for k, v in self.model.state_dict().items()}  # views
        if self.optimizer is not None:
            for index, slots in self.optimizer.state_dict()["state"].items():
                for key, value in slots.items():
                    arrays[f"optim/{index}/{key}"] = torch.as_tensor(value).detach().cpu().numpy()
        return {"task": self.task}, arrays

    def load_state(self, meta: dict, arrays: dict[str, np.ndarray]) -> None:
        if meta.get("task") != self.task:
            raise ValueError(f"checkpoint is for task {meta.get('task')}, learner rebuilt to task {self.task}")
        model = {k[len("model/") :]: torch.from_numpy(v.copy()) for k, v in arrays.items() if k.startswith("model/")}
        try:
            self.model.load_state_dict(model, strict=True)
        except RuntimeError as exc:
            raise ValueError(f"model state does not fit: {str(exc).splitlines()[0]}") from None
        if self.optimizer is not None:
            state: dict[int, dict[str, torch.Tensor]] = {}
            for name, value in arrays.items():
                if name.startswith("optim/"):
                    index, key = name[len("optim/") :].split("/", 1)
                    state.setdefault(int(index), {})[key] = torch.from_numpy(value.copy())
            full = self.optimizer.state_dict()  # load_state_dict casts the moments to their parameters' device
            if not set(state) <= {i for g in full["param_groups"] for i in g["params"]}:
                raise ValueError("optimizer state does not fit the rebuilt optimizer")
            full["state"] = state
            self.optimizer.load_state_dict(full)


def mean_nll(nll, data: Dataset | None, device: torch.device = torch.device("cpu")) -> float | None:
    """Mean per-sample NLL over ``data`` in batches (None for no data); the data stays in host
    memory, each batch goes to ``device`` (the model's)."""
    if data is None:
        return None
    x = torch.from_numpy(data.x)  # float32, or uint8 0/1 pixels (converted per batch, the same values)
    total = sum(nll(x[i : i + EVAL_BATCH].to(device, torch.float32)).sum().item() for i in range(0, len(x), EVAL_BATCH))
    release_free_memory()  # the batches' buffers are not left under the next phase's peak
    return round(total / len(x), 4)
