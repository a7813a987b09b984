"""The FIL-VER device: phase 0, then a classifier on a frozen variational encoder that
rehearses its past tasks from the (mu, log sigma) it kept of them.

* Phase 0 (rounds ``< phase0_rounds``): encoder and classifier train on task 1 with the VER
  loss (Adam, fresh every round) and both go up for FedAvg.
* The frozen encoder arrives once, in a frame of its own (``receive_frame`` mid-task, or
  with ``start_task`` for a device that enrolls later).
* Each later round: the classifier trains on z sampled afresh every epoch from the current
  task's (mu, sigma) and, with ``rehearsal``, from the kept items of earlier tasks.
* A task's rehearsal items: a class-balanced ``share`` of its shard, seeded per device and
  task.  While the task runs they are uploaded once each, spread over its remaining rounds
  (a sampled z, (mu, log sigma), or EBR's embedding), if this device allows embedding uploads;
  when the next task starts they join the kept store.  The store holds (mu, log sigma, y)
  only: no image outlives its task.
* Compressed (``wire.COMPRESSION``, the default): what the device trains goes up as the top-k
  of its change from the model it was announced (``held``) plus its residual (the encoder's
  whole change by default: ``wire.density``); both are checkpointed, and the encoder's
  residuals go with phase 0.
"""

from __future__ import annotations

import logging
import math
from typing import Sequence

import numpy as np
import torch
from torch.nn import functional as F

from fclcore import optim
from fclcore.codec import Frame, SparseTensor, Tensor
from fclcore.data import Dataset
from fclcore.device import float32_only
from fclcore.learner import Learner, round_seed
from fclcore.schedule import RoundPlace, TaskSchedule
from fclcore.schema import FederationSpec
from fclcore.served import ImageClassifierServed
from fclcore.sparsify import DELTA, Compression, Residuals
from methods.filver.config import FILVEROptions
from methods.filver.model import Classifier, Encoder, get_params, load_params, sample, ver_loss
from methods.filver.wire import CLS, COMPRESSION, EMB_LOG_SIGMA, EMB_MU, EMB_Y, EMB_Z, ENC, density

log = logging.getLogger(__name__)
EVAL_BATCH = 512
RESIDUAL, HELD = "residual/", "held/"  # checkpoint prefixes: the upload's residuals, the announced model


class Items:
    """Rehearsal items: (mu, log sigma or None, y, task) rows, as NumPy arrays."""

    def __init__(self, mu: np.ndarray, log_sigma: np.ndarray | None, y: np.ndarray, task: np.ndarray) -> None:
        self.mu, self.log_sigma, self.y, self.task = mu, log_sigma, y, task

    @classmethod
    def empty(cls, latent: int, variational: bool) -> "Items":
        z = np.zeros((0, latent), np.float32)
        return cls(z, z.copy() if variational else None, np.zeros(0, np.int64), np.zeros(0, np.int64))

    def __len__(self) -> int:
        return len(self.y)

    def take(self, rows: np.ndarray) -> "Items":
        ls = None if self.log_sigma is None else self.log_sigma[rows]
        return Items(self.mu[rows], ls, self.y[rows], self.task[rows])

    def plus(self, other: "Items") -> "Items":
        ls = None if self.log_sigma is None else np.concatenate([self.log_sigma, other.log_sigma])
        return Items(
            np.concatenate([self.mu, other.mu]),
            ls,
            np.concatenate([self.y, other.y]),
            np.concatenate([self.task, other.task]),
        )

    def arrays(self, prefix: str) -> dict[str, np.ndarray]:
        out = {f"{prefix}/mu": self.mu, f"{prefix}/y": self.y, f"{prefix}/task": self.task}
        if self.log_sigma is not None:
            out[f"{prefix}/log_sigma"] = self.log_sigma
        return out

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], prefix: str, latent: int, variational: bool) -> "Items":
        try:
            mu, y, task = arrays[f"{prefix}/mu"], arrays[f"{prefix}/y"], arrays[f"{prefix}/task"]
            log_sigma = arrays[f"{prefix}/log_sigma"] if variational else None
        except KeyError as exc:
            raise ValueError(f"filver checkpoint: missing {exc}") from None
        n = len(y)
        if mu.shape != (n, latent) or len(task) != n or (log_sigma is not None and log_sigma.shape != (n, latent)):
            raise ValueError(f"filver checkpoint: {prefix} arrays do not fit ({mu.shape}, {n} labels)")
        return cls(mu.astype(np.float32), None if log_sigma is None else log_sigma.astype(np.float32), y, task)


class FILVERLearner(Learner):
    metric = "accuracy"

    def __init__(self, fed: FederationSpec, options: FILVEROptions, input_dim: int, client_index: int) -> None:
        super().__init__(fed, options, input_dim, client_index)
        self.o = options
        torch.manual_seed(fed.seed)
        self.encoder = Encoder(options, input_dim)
        self.classifier = Classifier(options)
        self.schedule = TaskSchedule.from_federation(fed)
        self.frozen = False  # the encoder is the federation's frozen one (after phase 0)
        self.store = Items.empty(options.latent, options.variational)  # kept items of finished tasks
        self.pending = Items.empty(options.latent, options.variational)  # the task in hand's items
        self.items_sent = 0  # of ``pending``, sent so far
        self.current: tuple[int, Items] | None = None  # (task, every row's stats): recomputed, never saved
        self.form = "none"  # what the last upload carried
        self.warned = False
        up = Compression.of(fed.wire, COMPRESSION).up_density
        self.residuals = None if up is None else Residuals(up, fed.wire.error_feedback)
        self.reads_upload = self.residuals is not None
        self.held: dict[str, np.ndarray] = {}  # the trained tensors as last announced (compressed uploads only)
        self.device = torch.device("cpu")  # where the encoder and classifier run (``place``)

    def place(self, device: torch.device, amp: str) -> None:
        """The encoder and the classifier move to ``device``; each batch follows them there (a
        round's rehearsal items too), the shards and the kept items stay in host memory, and
        random draws come from the CPU generators as before.  No mixed precision (float32)."""
        float32_only(self.fed.method, amp)
        self.device = device
        self.encoder.to(device)
        self.classifier.to(device)

    # -- what arrives ----------------------------------------------------------------------
    def load_global(self, tensors: dict[str, Tensor], rnd: int, meta: dict | None = None) -> None:
        dense = {k: v.to_dense() if isinstance(v, SparseTensor) else np.asarray(v) for k, v in tensors.items()}
        if any(k.startswith(ENC) for k in dense):  # phase 0: the encoder is still being trained
            if self.frozen:
                raise ValueError("filver: the global model carries an encoder after phase 0")
            load_params(self.encoder, ENC, dense)
        load_params(self.classifier, CLS, dense)
        unknown = sorted(k for k in dense if not k.startswith((ENC, CLS)))
        if unknown:
            raise ValueError(f"filver: unexpected tensors {unknown[:3]}")
        if self.residuals is not None:  # after phase 0 the encoder is no longer announced: its residuals go
            self.held = {k: np.array(v, np.float32) for k, v in dense.items()}
            self.residuals.residuals = {k: r for k, r in self.residuals.residuals.items() if k in dense}

    def start_task(self, task: int, downlink: Frame | None) -> None:
        if len(self.pending) and int(self.pending.task[0]) < task:  # the task that ended: its items are kept
            self.store = self.store.plus(self.pending)
            self.pending = Items.empty(self.o.latent, self.o.variational)
            self.items_sent = 0
        self.current = None
        super().start_task(task, downlink)
        if downlink is not None:
            self._install_encoder(downlink)

    def receive_frame(self, frame: Frame, rnd: int) -> None:
        self._install_encoder(frame)

    def _install_encoder(self, frame: Frame) -> None:
        if frame.meta.get("encoder") is not True:
            raise ValueError("filver: expected the frozen encoder (meta.encoder: true)")
        dense = {k: v.to_dense() if isinstance(v, SparseTensor) else np.asarray(v) for k, v in frame.tensors.items()}
        load_params(self.encoder, ENC, dense)
        self.frozen = True
        self.current = None
        for p in self.encoder.parameters():
            p.requires_grad_(False)
            p.grad = None  # phase 0's last step

    # -- training --------------------------------------------------------------------------
    def in_phase0(self, rnd: int) -> bool:
        return rnd < self.o.phase0_rounds

    def train_round(self, train: Sequence[Dataset], rnd: int, place: RoundPlace) -> tuple[int, float]:
        gen = torch.Generator().manual_seed(round_seed(self.fed.seed, self.client_index, rnd))
        torch.manual_seed(round_seed(self.fed.seed, self.client_index, rnd, 1))
        if self.in_phase0(rnd):
            return self._phase0(train[0], gen)
        if not self.frozen:
            raise ValueError("filver: no frozen encoder has arrived for this round")
        items = self._training_items(train, place.task)
        return len(items), self._train_classifier(items, gen)

    def _phase0(self, data: Dataset, gen: torch.Generator) -> tuple[int, float]:
        params = list(self.encoder.parameters()) + list(self.classifier.parameters())
        opt = optim.Adam(params, lr=self.o.phase0_lr)
        x, y = torch.from_numpy(data.x), torch.from_numpy(data.y)
        total, count = 0.0, 0
        self.encoder.train()
        for _ in range(self.fed.train.local_epochs):
            for rows in torch.randperm(len(x), generator=gen).split(self.fed.train.batch_size):
                mu, log_sigma = self.encoder(x[rows].to(self.device))
                logits = self.classifier(sample(mu, log_sigma, gen))
                loss = ver_loss(logits, y[rows].to(self.device), mu, log_sigma, self.o.beta)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                total, count = total + loss.item() * len(rows), count + len(rows)
        self.encoder.eval()
        return len(x), total / max(count, 1)

    def _training_items(self, train: Sequence[Dataset], task: int) -> Items:
        """This round's items: the current task's rows (+ the kept store with rehearsal)."""
        current = self._current(train[task], task)
        return current.plus(self.store) if self.o.rehearsal and len(self.store) else current

    def _current(self, data: Dataset, task: int) -> Items:
        """Every row's stats of task ``task`` under the frozen encoder (cached for the task);
        chooses the task's rehearsal items the first time."""
        if self.current is None or self.current[0] != task:
            self.current = (task, self.stats(data, task))
            if not len(self.pending) and not self.items_sent:
                self.pending = self.current[1].take(self.rehearsal_rows(data.y, task))
        return self.current[1]

    def rehearsal_rows(self, y: np.ndarray, task: int) -> np.ndarray:
        """A class-balanced ``share`` of the task's rows, seeded by (seed, device, task)."""
        rng = np.random.default_rng((self.fed.seed, self.client_index, task, 31))
        rows = [
            rng.permutation(np.flatnonzero(y == c))[: round(self.o.share * int((y == c).sum()))] for c in np.unique(y)
        ]
        return rng.permutation(np.concatenate(rows or [np.zeros(0, np.int64)])).astype(np.int64)

    @torch.no_grad()
    def stats(self, data: Dataset, task: int) -> Items:
        mus, sigmas = [], []
        for start in range(0, len(data.x), EVAL_BATCH):
            mu, log_sigma = self.encoder(torch.from_numpy(data.x[start : start + EVAL_BATCH]).to(self.device))
            mus.append(mu.cpu().numpy())
            sigmas.append(None if log_sigma is None else log_sigma.cpu().numpy())
        latent = self.o.latent
        mu = np.concatenate(mus) if mus else np.zeros((0, latent), np.float32)
        ls = (
            None
            if not self.o.variational
            else (np.concatenate(sigmas) if sigmas else np.zeros((0, latent), np.float32))
        )
        return Items(mu, ls, data.y.astype(np.int64), np.full(len(data.y), task, np.int64))

    def _train_classifier(self, items: Items, gen: torch.Generator) -> float:
        train = self.fed.train
        params = self.classifier.parameters()
        if train.optimizer == "sgd":
            opt: optim.Optimizer = optim.SGD(params, lr=train.lr, momentum=self.o.momentum)
        else:
            opt = optim.Adam(params, lr=train.lr)
        mu, y = torch.from_numpy(items.mu).to(self.device), torch.from_numpy(items.y).to(self.device)
        log_sigma = None if items.log_sigma is None else torch.from_numpy(items.log_sigma).to(self.device)
        total, count = 0.0, 0
        for _ in range(train.local_epochs):
            z = sample(mu, log_sigma, gen)  # drawn afresh every epoch
            for rows in torch.randperm(len(y), generator=gen).split(train.batch_size):
                loss = F.cross_entropy(self.classifier(z[rows]), y[rows])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                total, count = total + loss.item() * len(rows), count + len(rows)
        return total / max(count, 1)

    # -- what goes up ----------------------------------------------------------------------
    def upload(self, rnd: int, place: RoundPlace) -> dict[str, Tensor]:
        params = get_params(self.classifier, CLS)
        self.form = "none"
        if self.in_phase0(rnd):
            return self._compressed({**get_params(self.encoder, ENC), **params})
        out = self._compressed(params)
        items = self._items_to_send(rnd, place.task)
        if items is None:
            return out
        out[EMB_Y] = items.y.astype(np.float32)
        if self.o.upload == "stats":
            out[EMB_MU], out[EMB_LOG_SIGMA] = items.mu, items.log_sigma
        else:  # one draw per item in its life (EBR: the deterministic embedding itself)
            gen = torch.Generator().manual_seed(round_seed(self.fed.seed, self.client_index, rnd, 3))
            ls = None if items.log_sigma is None else torch.from_numpy(items.log_sigma)
            out[EMB_Z] = sample(torch.from_numpy(items.mu), ls, gen).numpy()
        self.form = self.o.upload
        return out

    def _compressed(self, params: dict[str, np.ndarray]) -> dict[str, Tensor]:
        """``params`` as they go up: whole, or each as ``<name>@delta`` (top-k of change + residual)."""
        if self.residuals is None:
            return dict(params)
        missing = sorted(set(params) - set(self.held))
        if missing:
            raise ValueError(f"filver: no announced model to compress {missing[:3]} against")
        stage = self.residuals.density
        return {
            name + DELTA: self.residuals.compress(name, value - self.held[name], density(name, stage, self.o))
            for name, value in params.items()
        }

    def uploaded(self, tensors: dict[str, Tensor]) -> None:
        self.residuals.sent(tensors)

    def _items_to_send(self, rnd: int, task: int) -> Items | None:
        """This round's share of the task's items not yet sent, or None."""
        remaining = len(self.pending) - self.items_sent
        if self.o.upload == "none" or remaining <= 0:
            return None
        if not self.allow_embedding_upload:
            if not self.warned:
                log.warning("embeddings not uploaded: this device's config does not set allow_embedding_upload")
                self.warned = True
            return None
        rounds_left = max(1, self.schedule.last_round(task) - rnd + 1)
        k = min(remaining, math.ceil(remaining / rounds_left), self.o.max_embed_per_round)
        items = self.pending.take(np.arange(self.items_sent, self.items_sent + k))
        self.items_sent += k
        return items

    def report(self, place: RoundPlace) -> dict:
        return {"filver": {"task": place.task, "form": self.form}}

    # -- evaluation and serving ------------------------------------------------------------
    @torch.no_grad()
    def predict(self, x: np.ndarray) -> np.ndarray:
        self.encoder.eval()
        out = []
        for start in range(0, len(x), EVAL_BATCH):
            mu, _ = self.encoder(torch.from_numpy(x[start : start + EVAL_BATCH]).to(self.device))
            out.append(self.classifier(mu).argmax(dim=1).cpu().numpy())
        return np.concatenate(out) if out else np.zeros(0, np.int64)

    def evaluate(self, tests: Sequence[Dataset | None]) -> list[float | None]:
        return [None if d is None or not len(d.y) else float((self.predict(d.x) == d.y).mean()) for d in tests]

    def served_model(self, task: int, binarize: str = "") -> ImageClassifierServed:
        e, c = self.encoder, self.classifier
        layers = [
            ("conv2d", {**_linear(e.conv1), "padding": self.o.padding}),
            ("relu", {}),
            ("maxpool2", {}),
            ("conv2d", {**_linear(e.conv2), "padding": self.o.padding}),
            ("relu", {}),
            ("maxpool2", {}),
            ("flatten", {}),
            ("linear", _linear(e.fc1)),
            ("relu", {}),
            ("linear", _linear(e.fc2)),
            ("relu", {}),
            ("linear", _linear(e.mu)),  # the noise-free path: z = mu
            ("linear", _linear(c.fc1)),
            ("relu", {}),
            ("linear", _linear(c.fc2)),
            ("relu", {}),
            ("linear", _linear(c.out)),
        ]
        return ImageClassifierServed(
            image_side=e.side,
            layers=tuple(layers),
            class_names=tuple(str(i) for i in range(self.o.classes)),
            method=self.fed.method,
            task=task,
        )

    # -- checkpoint ------------------------------------------------------------------------
    def state(self) -> tuple[dict, dict[str, np.ndarray]]:
        arrays = {**get_params(self.encoder, ENC), **get_params(self.classifier, CLS)}
        arrays.update(self.store.arrays("store"))
        arrays.update(self.pending.arrays("pending"))
        if self.residuals is not None:
            arrays.update(self.residuals.state(RESIDUAL))
            arrays.update({HELD + name: value for name, value in self.held.items()})
        return {"frozen": self.frozen, "uploaded": self.items_sent}, arrays

    def load_state(self, meta: dict, arrays: dict[str, np.ndarray]) -> None:
        load_params(self.encoder, ENC, arrays)
        load_params(self.classifier, CLS, arrays)
        o = self.o
        self.store = Items.from_arrays(arrays, "store", o.latent, o.variational)
        self.pending = Items.from_arrays(arrays, "pending", o.latent, o.variational)
        uploaded = meta.get("uploaded")
        if not isinstance(uploaded, int) or not 0 <= uploaded <= len(self.pending):
            raise ValueError(f"filver checkpoint: uploaded {uploaded!r} does not fit {len(self.pending)} items")
        self.items_sent, self.frozen, self.current = uploaded, bool(meta.get("frozen")), None
        for p in self.encoder.parameters():
            p.requires_grad_(not self.frozen)
        if self.residuals is not None:
            shapes = {
                k: v.shape for k, v in {**get_params(self.encoder, ENC), **get_params(self.classifier, CLS)}.items()
            }
            held = {k[len(HELD) :]: v for k, v in arrays.items() if k.startswith(HELD)}
            if any(shapes.get(k) != v.shape for k, v in held.items()):
                raise ValueError("filver checkpoint: the announced model does not fit")
            self.residuals.load_state(arrays, RESIDUAL, shapes)
            self.held = {k: np.array(v, np.float32) for k, v in held.items()}


class FILVEROfflineLearner(FILVERLearner):
    """The offline reference: after phase 0 the classifier trains on every task's rows."""

    sees_all_tasks = True

    def _training_items(self, train: Sequence[Dataset], task: int) -> Items:
        if self.current is None:
            every = [self.stats(d, t) for t, d in enumerate(train)]
            merged = every[0]
            for part in every[1:]:
                merged = merged.plus(part)
            self.current = (-1, merged)
        return self.current[1]


def _linear(layer: torch.nn.Module) -> dict[str, np.ndarray]:
    return {"weight": layer.weight.detach().cpu().numpy().copy(), "bias": layer.bias.detach().cpu().numpy().copy()}
