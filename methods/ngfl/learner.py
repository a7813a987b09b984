"""The NGFL device: a feature extractor and a class head that grows with the device's own
task alignment table, on the device's own task clock (reading notes 3.4 G2-G3, G8-G10, G13).

Each round the daemon hands over every task that has arrived on this device (a scenario's
arrival rounds, or the valid folders of its task directory).  The learner

* adopts the aggregator's table and head (``load_global``: global rows in the global order,
  then this device's classes the aggregator lacks);
* starts the tasks that arrived since it last trained, in order: coverage against the
  aggregator's classes (full / semi / none), missing classes get zero rows.  Under
  pre-alignment a task whose classes the aggregator's table does not hold yet is announced
  instead and starts once they are there (later tasks wait behind it);
* trains them, E epochs each (self-attention per task, or total attention), and marks their
  union current; with no new task it trains the active one (a task stays active for
  ``rounds_per_task`` trained rounds, ``base_rounds`` for the first); with neither it sends a
  skip notice (``idle: skip``) or trains its last task again (``idle: train``);
* uploads the extractor and its head rows (partial fusion: the current classes' rows; total:
  every viewed class's) with the table.  Only the newest task's data is trained, except by the
  upper references (``replay``: self / global).
"""

from __future__ import annotations

import logging
import math
from typing import Sequence

import numpy as np
import torch

from fclcore import optim
from fclcore.codec import Frame, SparseTensor, Tensor
from fclcore.data import Dataset
from fclcore.device import float32_only
from fclcore.learner import Learner, round_seed
from fclcore.schedule import RoundPlace
from fclcore.schema import FederationSpec
from fclcore.served import ImageClassifierServed
from fclcore.sparsify import DELTA, Compression, Residuals
from methods.ngfl.config import NGFLOptions
from methods.ngfl.model import Extractor, GrowingHead, self_attention, total_attention
from methods.ngfl.table import DeviceTable, GlobalTable, TableError, check_labels
from methods.ngfl.wire import COMPRESSION, EXTRACTOR, HEAD_B, HEAD_W, META, ROWS_B, ROWS_W, extractor_shapes

log = logging.getLogger(__name__)
EVAL_BATCH = 1024
RESIDUAL, HELD = "residual/", "held/"  # checkpoint prefixes: the upload's residuals, the announced extractor
DEVICE = "this-device"  # who added a row, in the device's own slots (the aggregator names the sender)


class NGFLLearner(Learner):
    metric = "accuracy"

    def __init__(self, fed: FederationSpec, options: NGFLOptions, input_dim: int, client_index: int) -> None:
        super().__init__(fed, options, input_dim, client_index)
        self.o = options
        torch.manual_seed(fed.seed)
        self.extractor = Extractor(input_dim, options.hidden)
        self.head = GrowingHead(self.extractor.dim)
        self.shapes = extractor_shapes(input_dim, options.hidden)
        self.table = DeviceTable(DEVICE)
        self.pending_global: set[str] = set()  # rows the aggregator holds pending (pre-alignment)
        self.started: list[int] = []  # task slots started, in order
        self.slot_labels: dict[int, list[str]] = {}
        self.active: int | None = None  # the newest task, trained while ``left`` > 0
        self.left = 0
        self.sa_fallback = 0  # self-attention rounds of one-class tasks (trained with total attention)
        self.round_info: dict = {}  # what this round's report says
        self.warned_serving = False
        density = Compression.of(fed.wire, COMPRESSION).up_density
        # the extractor goes up compressed: its change from the announced one (``held``) plus residual
        self.residuals = None if density is None else Residuals(density, fed.wire.error_feedback)
        self.reads_upload = self.residuals is not None
        self.held: dict[str, np.ndarray] = {}  # the extractor as announced (its own start until one is)
        if self.residuals is not None:
            self.held = {name: value.detach().numpy().copy() for name, value in self._extractor_params()}
        self.device = torch.device("cpu")  # where the extractor and head train (``place``)

    def place(self, device: torch.device, amp: str) -> None:
        """The extractor and the head move to ``device``; each batch follows them there, the shards
        stay in host memory, uploads come back as host arrays.  No mixed precision (float32)."""
        float32_only(self.fed.method, amp)
        self.device = device
        self.extractor.to(device)
        self.head.to(device)

    # -- what arrives ----------------------------------------------------------------------
    def load_global(self, tensors: dict[str, Tensor], rnd: int, meta: dict | None = None) -> None:
        ng = (meta or {}).get(META)
        if not isinstance(ng, dict):
            raise ValueError(f"ngfl: the round message has no meta.{META}.table")
        table = GlobalTable.from_meta(ng.get("table"))  # TableError is a ValueError
        dense = {k: v.to_dense() if isinstance(v, SparseTensor) else np.asarray(v) for k, v in tensors.items()}
        expected = set(self.shapes) | ({HEAD_W, HEAD_B} if table.labels else set())
        if set(dense) != expected:
            raise ValueError(f"ngfl: expected tensors {sorted(expected)[:4]}..., got {sorted(dense)[:4]}...")
        for name, shape in self.shapes.items():
            if dense[name].shape != shape:
                raise ValueError(f"ngfl: {name} has shape {dense[name].shape}, expected {shape}")
        rows, dim = len(table.labels), self.extractor.dim
        if rows and (dense[HEAD_W].shape != (rows, dim) or dense[HEAD_B].shape != (rows,)):
            raise ValueError(f"ngfl: the head does not fit the table's {rows} labels")
        old_w, old_b = self.head.weight.detach().clone(), self.head.bias.detach().clone()
        mapping = self.table.adopt(table)
        weight, bias = torch.zeros(len(mapping), dim, device=self.device), torch.zeros(len(mapping), device=self.device)
        if rows:
            weight[:rows], bias[:rows] = torch.from_numpy(dense[HEAD_W]), torch.from_numpy(dense[HEAD_B])
        for i in range(rows, len(mapping)):  # this device's classes the aggregator lacks
            weight[i], bias[i] = old_w[mapping[i]], old_b[mapping[i]]
        self.head.weight, self.head.bias = torch.nn.Parameter(weight), torch.nn.Parameter(bias)
        with torch.no_grad():
            for i, layer in enumerate(self.extractor.layers):
                layer.weight.copy_(torch.from_numpy(dense[f"{EXTRACTOR}{i}.weight"]))
                layer.bias.copy_(torch.from_numpy(dense[f"{EXTRACTOR}{i}.bias"]))
        self.pending_global = set(table.pending)
        if self.residuals is not None:
            self.held = {name: np.array(dense[name], np.float32) for name in self.shapes}

    def start_task(self, task: int, downlink: Frame | None) -> None:
        """The federation's stage: this device's tasks come on its own clock (``train_round``)."""
        self.task = task

    # -- a round ---------------------------------------------------------------------------
    def train_round(self, train: Sequence[Dataset | None], rnd: int, place: RoundPlace) -> tuple[int, float | None]:
        started = self._start_arrivals(train, rnd)
        if started:
            slots = started
            self.active = started[-1]
            self.left = self._active_rounds(self.active)
        elif self.active is not None and self.left > 0:
            slots = [self.active]
        elif self.o.idle == "train" and self.started:
            slots = [self.started[-1]]
        else:
            slots = []
        if not slots:
            self.round_info["skip"] = True
            return 0, None
        self.table.current = list(dict.fromkeys(lab for t in slots for lab in self.slot_labels[t]))  # their union
        if self.active in slots and self.left > 0:
            self.left -= 1
        first = slots[0] == 0  # the base task (the device's first) has its own settings
        lr = self.o.base_lr if first else self.fed.train.lr
        decay = self.o.base_weight_decay if first else self.o.weight_decay
        params = [*self.extractor.parameters(), self.head.weight, self.head.bias]
        opt = optim.SGD(params, lr=lr, momentum=self.o.momentum, weight_decay=decay)  # fresh every round
        total, count = 0.0, 0
        for t in slots:
            x, y = self._training_rows(train, t)
            loss_sum, n = self._fit(opt, x, y, t, rnd)
            total, count = total + loss_sum, count + n
        return count, (total / count if count else None)

    def _start_arrivals(self, train: Sequence[Dataset | None], rnd: int) -> list[int]:
        """Start the tasks that arrived since the last round, in order; under pre-alignment a
        task with classes the aggregator's table lacks is announced and waits (with every later one)."""
        self.round_info = {"coverage": [], "announce": []}
        new = [t for t, d in enumerate(train) if d is not None and len(d) and t not in self.started]
        started = []
        for i, t in enumerate(new):
            labels = sorted(set(check_labels(sorted(set(train[t].label_names())), "task")))
            if self.o.alignment == "pre" and not set(labels) <= self.table.known:
                waiting = {lab for u in new[i:] for lab in sorted(set(train[u].label_names()))}
                self.round_info["announce"] = sorted(waiting - self.table.known)
                break
            cover, added = self.table.start_task(labels, rnd)
            self.head.grow(len(added))
            self.started.append(t)
            self.slot_labels[t] = labels
            self.round_info["coverage"].append(cover)
            started.append(t)
        return started

    def _active_rounds(self, slot: int) -> int:
        return self.o.base_rounds if slot == 0 else self.o.rounds_per_task

    def _training_rows(self, train: Sequence[Dataset | None], t: int) -> tuple[np.ndarray, np.ndarray]:
        """Task ``t``'s rows and their head rows; the upper references add their replay."""
        d = train[t]
        xs, names = [d.x], [d.label_names()]
        past = [s for s in self.started if s != t and self.started.index(s) < self.started.index(t)]
        if self.o.replay == "self":
            for s in past:
                if train[s] is not None:
                    xs.append(train[s].x)
                    names.append(train[s].label_names())
        elif self.o.replay == "global" and self.fleet_data is not None:
            size = sum(len(train[s]) for s in past if train[s] is not None)
            pool = [self.fleet_data[s] for s in range(t)]
            if size and pool:
                px = np.concatenate([p.x for p in pool])
                pn = np.concatenate([p.label_names() for p in pool])
                pick = np.random.default_rng((self.fed.seed, self.client_index, t, 9)).choice(
                    len(px), size=min(size, len(px)), replace=False
                )
                xs.append(px[np.sort(pick)])
                names.append(pn[np.sort(pick)])
        x, labels = np.concatenate(xs), np.concatenate(names)
        row_of = {lab: r for r, lab in enumerate(self.table.labels)}
        keep = np.array([lab in row_of for lab in labels], bool)  # replayed classes this head lacks are dropped
        return x[keep], np.array([row_of[lab] for lab in labels[keep]], np.int64)

    def _fit(self, opt: optim.Optimizer, x: np.ndarray, y: np.ndarray, t: int, rnd: int) -> tuple[float, int]:
        task_rows = [self.table.row(lab) for lab in self.slot_labels[t]]
        use_self = self.o.loss == "self" and len(task_rows) > 1
        if self.o.loss == "self" and not use_self:
            self.sa_fallback += 1  # one class: nothing to separate, total attention instead
        usable = torch.tensor(
            [lab not in self.pending_global or lab in self.table.viewed for lab in self.table.labels],
            device=self.device,
        )
        xt, yt = torch.from_numpy(np.asarray(x, np.float32)), torch.from_numpy(y)
        batch = self.fed.train.batch_size
        rng = np.random.default_rng(round_seed(self.fed.seed, self.client_index, rnd, t))
        total = 0.0
        self.extractor.train()
        for _ in range(self.fed.train.local_epochs):
            for idx in np.array_split(rng.permutation(len(y)), max(1, math.ceil(len(y) / batch))):
                idx_t = torch.from_numpy(idx)
                logits = self.head(self.extractor(xt[idx_t].to(self.device)))
                target = yt[idx_t].to(self.device)
                if use_self:
                    loss = self_attention(logits, target, task_rows)
                else:
                    loss = total_attention(logits, target, usable)
                opt.zero_grad()
                loss.backward()
                opt.step()
                total += float(loss.detach()) * len(idx)
        return total / self.fed.train.local_epochs, len(y)

    def upload(self, rnd: int, place: RoundPlace) -> dict[str, Tensor]:
        if self.round_info.get("skip"):
            return {}
        sent, rows = self.table.upload(self.o.partial)
        self.round_info["table"] = sent.to_meta()
        out: dict[str, Tensor] = {}
        for name, param in self._extractor_params():
            value = param.detach().cpu().numpy()
            if self.residuals is None:
                out[name] = value.copy()
            else:
                out[name + DELTA] = self.residuals.compress(name, value - self.held[name])
        index = torch.as_tensor(rows, dtype=torch.long, device=self.device)
        out[ROWS_W] = self.head.weight.detach()[index].cpu().numpy().copy()
        out[ROWS_B] = self.head.bias.detach()[index].cpu().numpy().copy()
        return out

    def _extractor_params(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [
            (f"{EXTRACTOR}{i}.{part}", getattr(layer, part))
            for i, layer in enumerate(self.extractor.layers)
            for part in ("weight", "bias")
        ]

    def uploaded(self, tensors: dict[str, Tensor]) -> None:
        self.residuals.sent(tensors)

    def report(self, place: RoundPlace) -> dict:
        info = self.round_info
        if info.get("skip"):
            return {META: {"skip": True, "announce": info.get("announce", [])}}
        return {
            META: {
                "table": info["table"],
                "announce": info.get("announce", []),
                "coverage": info.get("coverage", []),
                "sa_fallback": self.sa_fallback,
            }
        }

    # -- what it serves --------------------------------------------------------------------
    def logits(self, x: np.ndarray) -> np.ndarray:
        self.extractor.eval()
        with torch.no_grad():
            return np.concatenate(
                [
                    self.head(
                        self.extractor(torch.from_numpy(np.asarray(x[s : s + EVAL_BATCH], np.float32)).to(self.device))
                    )
                    .cpu()
                    .numpy()
                    for s in range(0, len(x), EVAL_BATCH)
                ]
            )

    def evaluate(self, tests: Sequence[Dataset | None]) -> list[float | None]:
        """Accuracy of the argmax over every row of the head, by class name."""
        out: list[float | None] = []
        for d in tests:
            if d is None or not len(d):
                out.append(None)
            elif not self.table.labels:
                out.append(0.0)
            else:
                predicted = np.array(self.table.labels, dtype=object)[self.logits(d.x).argmax(axis=1)]
                out.append(round(float(np.mean(predicted == d.label_names())), 6))
        return out

    def served_model(self, task: int, binarize: str = "") -> ImageClassifierServed | None:
        """The extractor and the head, with the table's labels as the class names."""
        side = math.isqrt(self.input_dim)
        if not self.table.labels or side * side != self.input_dim:
            if self.table.labels and not self.warned_serving:
                log.warning("ngfl: not serving: the image-classifier format needs square images")
                self.warned_serving = True
            return None
        layers: list[tuple[str, dict]] = [("flatten", {})]
        for layer in self.extractor.layers:
            layers += [("linear", _linear(layer.weight, layer.bias)), ("relu", {})]
        layers.append(("linear", _linear(self.head.weight, self.head.bias)))
        return ImageClassifierServed(
            image_side=side,
            layers=tuple(layers),
            class_names=tuple(self.table.labels),
            method=self.fed.method,
            task=task,
        )

    # -- restarts --------------------------------------------------------------------------
    def state(self) -> tuple[dict, dict[str, np.ndarray]]:
        meta = {
            "table": self.table.to_meta(),
            "pending_global": sorted(self.pending_global),
            "started": list(self.started),
            "slot_labels": {str(t): labels for t, labels in self.slot_labels.items()},
            "active": self.active,
            "left": self.left,
            "sa_fallback": self.sa_fallback,
        }
        arrays = {HEAD_W: self.head.weight.detach().cpu().numpy(), HEAD_B: self.head.bias.detach().cpu().numpy()}
        for i, layer in enumerate(self.extractor.layers):
            arrays[f"{EXTRACTOR}{i}.weight"] = layer.weight.detach().cpu().numpy()
            arrays[f"{EXTRACTOR}{i}.bias"] = layer.bias.detach().cpu().numpy()
        if self.residuals is not None:
            arrays.update(self.residuals.state(RESIDUAL))
            arrays.update({HELD + name: value for name, value in self.held.items()})
        return meta, arrays

    def load_state(self, meta: dict, arrays: dict[str, np.ndarray]) -> None:
        try:
            table = DeviceTable.from_meta(meta.get("table"))
            started = [int(t) for t in meta["started"]]
            slot_labels = {int(t): list(check_labels(v, "task")) for t, v in meta["slot_labels"].items()}
            pending = set(check_labels(meta.get("pending_global", []), "pending"))
        except (TableError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"ngfl checkpoint: {exc}") from None
        active = meta.get("active")
        if set(started) != set(slot_labels) or (active is not None and active not in started):
            raise ValueError("ngfl checkpoint: the started tasks, their classes and the active task disagree")
        named = {lab for labels in (table.current, table.viewed, *slot_labels.values()) for lab in labels}
        if not named <= set(table.labels):
            raise ValueError(f"ngfl checkpoint: classes without a head row {sorted(named - set(table.labels))[:3]}")
        rows, dim = len(table.labels), self.extractor.dim
        w, b = arrays.get(HEAD_W), arrays.get(HEAD_B)
        if w is None or b is None or w.shape != (rows, dim) or b.shape != (rows,):
            raise ValueError(f"ngfl checkpoint: the head does not fit the table's {rows} labels")
        with torch.no_grad():
            for i, layer in enumerate(self.extractor.layers):
                for part in ("weight", "bias"):
                    value = arrays.get(f"{EXTRACTOR}{i}.{part}")
                    if value is None or value.shape != tuple(getattr(layer, part).shape):
                        raise ValueError(f"ngfl checkpoint: {EXTRACTOR}{i}.{part} does not fit")
                    getattr(layer, part).copy_(torch.from_numpy(value))
        self.head.weight = torch.nn.Parameter(torch.from_numpy(np.array(w, np.float32)).to(self.device))
        self.head.bias = torch.nn.Parameter(torch.from_numpy(np.array(b, np.float32)).to(self.device))
        self.table, self.started, self.slot_labels, self.pending_global = table, started, slot_labels, pending
        self.active, self.left = meta.get("active"), int(meta.get("left", 0))
        self.sa_fallback = int(meta.get("sa_fallback", 0))
        if self.residuals is not None:  # a checkpoint from before compression has neither: the next round sets both
            held = {name: arrays[HELD + name] for name in self.shapes if HELD + name in arrays}
            if any(v.shape != self.shapes[name] for name, v in held.items()):
                raise ValueError("ngfl checkpoint: the announced extractor does not fit")
            self.residuals.load_state(arrays, RESIDUAL, self.shapes)
            self.held.update({name: np.array(v, np.float32) for name, v in held.items()})


def _linear(weight: torch.Tensor, bias: torch.Tensor) -> dict[str, np.ndarray]:
    return {"weight": weight.detach().cpu().numpy().copy(), "bias": bias.detach().cpu().numpy().copy()}
