"""FedET on the device: ``methods.fedet.client`` (Algorithm 1) behind the Learner API.

Each task runs in two phases that the aggregator announces in the round's meta
(``meta["fedet"]["phase"]``):

* ``sums`` (the task's first round): the device uploads, per class of its new data, the sum
  of the frozen backbone's unit embeddings and the count (a few kB); nothing is trained.
  The aggregator merges them into global class prototypes and gives the new classes a group.
* ``train`` (every later round): the round's meta carries the class -> group map and the
  prototypes; the device sets up Algorithm 1 for the task once, then trains and uploads only
  the groups that received its new classes, each with its label histogram and entropy.

Downlink tensors: ``prototypes`` (C, H) over ``meta.fedet.classes`` and, for each group the
aggregator changed in the previous round, ``g<j>/<name>``.  Test data is scored as
accuracy: the selector routes each text to a group, whose head predicts over all seen classes.

CPU (issue 20): the frozen features of a data set are computed once (its pooled embeddings
for the selector; for the current task's test texts, which are scored every round, also the
frozen prefix that ``methods.fedet.client`` describes: 98 kB per 64-token text, dropped when
the task changes).
"""

from __future__ import annotations

import copy
import logging
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from fclbases.minilm.backbone import FrozenBackbone, default_minilm_dir, load_minilm, pooled_embeddings
from fclbases.minilm.enhancer import (
    EnhancerConfig,
    EnhancerGroup,
    group_prefix,
    group_to_tensors,
    tensors_to_group,
    trainable_parameters,
)
from fclbases.minilm.prototypes import class_sums
from fclcore.codec import Tensor
from fclcore.data import Dataset
from fclcore.learner import Learner
from fclcore.optim import AdamW
from fclcore.schedule import RoundPlace
from fclcore.schema import FederationSpec
from fclcore.served import TextGroupsServed
from fclcore.text import EncodedDocs, entropy_nats
from methods.fedet.client import FedETClient, FedETConfig, GroupUpload, _TaskGroup, seeded, train_epochs
from methods.fedet.config import FedETOptions
from methods.fedet.model import pooled_and_prefix, prefix_states, prototype_rows
from methods.fedet.wire import META_KEY, parse_downlink

log = logging.getLogger(__name__)


def encoded(data: Dataset) -> EncodedDocs:
    """Token ids with padding id 0 -> the docs the backbone takes."""
    return EncodedDocs(data.x.astype(np.int64), (data.x != 0).astype(np.int64), data.y.astype(np.int64))


class FedETLearner(Learner):
    metric = "accuracy"

    def __init__(self, fed: FederationSpec, options: FedETOptions, input_dim: int, client_index: int) -> None:
        super().__init__(fed, options, input_dim, client_index)
        spec = options
        torch.manual_seed(fed.seed)
        self.backbone_dir = default_minilm_dir()  # an export child loads the backbone from here too
        self.backbone = FrozenBackbone(load_minilm(self.backbone_dir))
        self.enhancer = EnhancerConfig(
            hidden=self.backbone.cfg.hidden, bottleneck=spec.bottleneck, blocks=self.backbone.cfg.layers
        )
        self.cfg = FedETConfig(
            self.enhancer,
            self.groups_of(spec),
            spec.gamma,
            None,
            fed.train.lr,
            spec.weight_decay,
            fed.train.batch_size,
            fed.train.local_epochs,
            spec.distill_epochs,
            fed.seed,
            spec.proto_init,
            spec.prefix_cache,
            spec.teacher_from_training,
        )
        # the Enhancer passes' backbone: the same weights, blocks 1.. in int8 when asked; self.backbone
        # (float32) computes the selector's features and is what the served model exports
        passes = self.backbone.with_int8_blocks() if spec.int8_blocks else self.backbone
        self.client = FedETClient(self.cfg, passes, client_index)
        self.phase = "sums"
        self.group_of: dict[int, int] = {}
        self.prototypes: dict[int, np.ndarray] = {}
        self.started = -1  # the last task whose Algorithm-1 set-up ran
        self.out: tuple[dict[str, Tensor], dict] = ({}, {})
        self._pooled: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # id(x) -> (x, embeddings), frozen
        self._prefix: tuple[np.ndarray, torch.Tensor] | None = None  # (x, frozen prefix) of one test set

    @staticmethod
    def groups_of(options: FedETOptions) -> int:
        """J, the Enhancer groups (the single-group baselines override it)."""
        return options.num_groups

    # -- federation ----------------------------------------------------------------------
    def load_global(self, tensors: dict[str, Tensor], rnd: int, meta: dict | None = None) -> None:
        phase, group_of, prototypes, groups = parse_downlink(meta, tensors, self.enhancer, self.cfg.num_groups)
        self.phase = phase
        if prototypes:
            self.client.selector.update(prototypes, group_of)
            self.group_of, self.prototypes = group_of, prototypes
        for j, group in groups.items():
            self.client.load_group(j, group)

    def _embed(self, data: Dataset) -> np.ndarray:
        cached = self._pooled.get(id(data.x))
        if cached is None or cached[0] is not data.x:
            docs = encoded(data)
            cached = (data.x, pooled_embeddings(self.backbone, docs.ids, docs.mask))
            self._pooled[id(data.x)] = cached
        return cached[1]

    def _embed_with_prefix(self, data: Dataset) -> tuple[np.ndarray, torch.Tensor]:
        """Pooled embeddings and frozen prefix of the test set scored every round (one set
        only: the cache of the previous one is dropped).  Both come from one frozen pass."""
        if self._prefix is None or self._prefix[0] is not data.x:
            self._prefix = None  # free the previous set's prefix before building this one
            cached, docs = self._pooled.get(id(data.x)), encoded(data)
            if cached is not None and cached[0] is data.x:  # pooled already: only block 0 to run
                self._prefix = (data.x, prefix_states(self.backbone, docs.ids, docs.mask))
            else:
                pooled, prefix = pooled_and_prefix(self.backbone, docs.ids, docs.mask)
                self._pooled[id(data.x)], self._prefix = (data.x, pooled), (data.x, prefix)
        return self._embed(data), self._prefix[1]

    # -- training ------------------------------------------------------------------------
    def train_round(self, train: Sequence[Dataset], rnd: int, place: RoundPlace) -> tuple[int, float | None]:
        data = train[self.task]
        pooled = self._embed(data)
        if self.phase == "sums":
            sums = class_sums(pooled, data.y) if len(data) else {}
            classes = sorted(sums)
            tensors = {"sums": np.stack([sums[c][0] for c in classes])} if classes else {}
            self.out = (tensors, {"phase": "sums", "classes": classes, "counts": [sums[c][1] for c in classes]})
            return len(data), None  # nothing is trained in the class-sum round
        if self.started < self.task:
            missing = sorted(set(int(c) for c in np.unique(data.y)) - set(self.group_of))
            if missing:  # e.g. this device's class sums missed the task's first round
                log.warning(
                    "task %d: classes %s have no group from the aggregator; their texts are not used",
                    self.task,
                    missing,
                )
        uploads = self.train_groups(data, pooled, rnd)
        tensors: dict[str, Tensor] = {}
        for u in uploads:
            tensors.update({group_prefix(u.group) + k: v for k, v in u.tensors.items()})
        self.out = (tensors, {"phase": "train", "groups": [u.meta() for u in uploads]})
        return sum(u.n_samples for u in uploads), None  # several losses (temporary group, distillation)

    def train_groups(self, data: Dataset, pooled: np.ndarray, rnd: int) -> list[GroupUpload]:
        """Algorithm 1 for one round (set up once per task): the groups to upload."""
        if self.started < self.task:
            self.client.start_task(self.task, encoded(data), pooled, self.group_of, self.prototypes)
            self.started = self.task
        return self.client.train_round(rnd)

    def upload(self, rnd: int, place: RoundPlace) -> dict[str, Tensor]:
        return self.out[0]

    def report(self, place: RoundPlace) -> dict:
        return {META_KEY: self.out[1]}

    # -- serving -------------------------------------------------------------------------
    def evaluate(self, tests: Sequence[Dataset | None]) -> list[float | None]:
        """Accuracy on each task's test texts (None where not scored); 0 before any prototype."""
        out: list[float | None] = []
        for i, data in enumerate(tests):
            if data is None or len(data) == 0:
                out.append(None)
            elif not self.prototypes:
                out.append(0.0)
            else:
                if i == self.task and self.cfg.prefix_cache:  # scored every round: keep its frozen prefix
                    pooled, prefix = self._embed_with_prefix(data)
                else:  # an earlier task's texts, scored once per task
                    pooled, prefix = self._embed(data), None
                preds, _ = self.client.predict(encoded(data), pooled, prefix)
                out.append(round(float((preds == data.y).mean()), 6))
        return out

    def served_model(self, task: int, binarize: str = "") -> TextGroupsServed | None:
        """Backbone + prototype selector + Enhancer groups: one text classifier."""
        selector = self.client.selector
        if not selector.group_of:
            return None  # nothing learned yet
        prototypes = {int(c): selector.prototypes[i] for i, c in enumerate(selector.classes)}
        groups = [copy.deepcopy(g).eval() for g in self.client.groups]  # training goes on while it exports
        return TextGroupsServed(
            self.backbone,
            groups,
            prototypes,
            dict(selector.group_of),
            task=task,
            max_length=self.options.max_length,
            method=self.fed.method,
            backbone_source=str(self.backbone_dir),
        )

    # -- checkpoints ---------------------------------------------------------------------
    def state(self) -> tuple[dict, dict[str, np.ndarray]]:
        """Groups, selector, sample memory and the task's Algorithm-1 groups (the temporary
        group's optimiser moments are not kept: after a restart it continues with fresh ones)."""
        arrays: dict[str, np.ndarray] = {}
        meta = {
            "task": self.task,
            "phase": self.phase,
            "started": self.started,
            "group_of": sorted(self.group_of.items()),
            "groups": [],
            "active": [],
            "memory": {"observed": self.client.memory.observed, "classes": list(self.client.memory.classes)},
        }
        for j, group in enumerate(self.client.groups):
            meta["groups"].append(list(group.classes))
            _put(arrays, f"group/{j}", group)
        for c, p in self.prototypes.items():
            arrays[f"proto/{c}"] = p
        for c in self.client.memory.classes:
            docs = self.client.memory.docs((c,))
            arrays[f"memory/{c}/ids"] = docs.ids if docs is not None else np.zeros((0, 1), np.int64)
        for j, s in self.client.active.items():
            meta["active"].append({"group": j, "old": list(s.old.classes), "temp": list(s.temp.classes)})
            _put(arrays, f"active/{j}/old", s.old)
            _put(arrays, f"active/{j}/temp", s.temp)
            for name, d in (("data", s.data), ("distill", s.distill_set)):
                arrays[f"active/{j}/{name}/ids"], arrays[f"active/{j}/{name}/labels"] = d.ids, d.labels
        return meta, arrays

    def load_state(self, meta: dict, arrays: dict[str, np.ndarray]) -> None:
        if meta.get("task") != self.task:
            raise ValueError(f"checkpoint is for task {meta.get('task')}, learner rebuilt to task {self.task}")
        try:
            self.phase, self.started = meta["phase"], int(meta["started"])
            self.group_of = {int(c): int(j) for c, j in meta["group_of"]}
            self.prototypes = {int(k.split("/")[1]): v for k, v in arrays.items() if k.startswith("proto/")}
            if self.prototypes:
                self.client.selector.update(self.prototypes, self.group_of)
            self.client.groups = [
                _get(arrays, f"group/{j}", self.enhancer, classes, seeded(self.cfg.seed, j))
                for j, classes in enumerate(meta["groups"])
            ]
            memory = self.client.memory
            memory.observed = int(meta["memory"]["observed"])
            memory._by_class = {}
            for c in meta["memory"]["classes"]:
                ids = arrays[f"memory/{c}/ids"]
                memory._by_class[int(c)] = EncodedDocs(ids, (ids != 0).astype(np.int64), np.full(len(ids), c))
            self.client.task, self.client.active = self.started, {}
            for a in meta["active"]:
                j = int(a["group"])
                temp = _get(arrays, f"active/{j}/temp", self.enhancer, a["temp"])
                docs = {
                    n: _docs(arrays[f"active/{j}/{n}/ids"], arrays[f"active/{j}/{n}/labels"])
                    for n in ("data", "distill")
                }
                self.client.active[j] = _TaskGroup(
                    _get(arrays, f"active/{j}/old", self.enhancer, a["old"]).eval(),
                    temp,
                    self.client._optimizer(temp),
                    docs["data"],
                    docs["distill"],
                )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"fedet checkpoint does not fit: {exc!r}") from None


def _docs(ids: np.ndarray, labels: np.ndarray) -> EncodedDocs:
    return EncodedDocs(ids, (ids != 0).astype(np.int64), labels)


def _put(arrays: dict[str, np.ndarray], prefix: str, group: EnhancerGroup) -> None:
    if group.classes:
        arrays.update({f"{prefix}/{k}": v for k, v in group_to_tensors(group).items()})


def _get(
    arrays: dict[str, np.ndarray], prefix: str, cfg: EnhancerConfig, classes: list[int], seed: int = 0
) -> EnhancerGroup:
    if not classes:  # never trained: the seeded initial group every device and the aggregator share
        return EnhancerGroup(cfg, seed=seed)
    return tensors_to_group(
        {k[len(prefix) + 1 :]: v for k, v in arrays.items() if k.startswith(prefix + "/")},
        cfg,
        [int(c) for c in classes],
    )


class GroupFedAvgLearner(FedETLearner):
    """finetune-FL: one Enhancer group whose head covers every class seen so far, trained with
    cross-entropy on the current task's texts; the server averages it (``GroupFedAvgStrategy``).
    The class-sum round and the prototype selector are FedET's (with one group it always
    routes to group 0)."""

    replay = False  # also train on the sample memory of earlier tasks

    @staticmethod
    def groups_of(options: FedETOptions) -> int:
        return 1

    def train_groups(self, data: Dataset, pooled: np.ndarray, rnd: int) -> list[GroupUpload]:
        group = self.client.groups[0]
        new = sorted(c for c in self.group_of if c not in group.classes)  # as the aggregator extends it
        group.extend_classes(new, prototype_rows(self.prototypes, self.options.proto_init))
        if self.started < self.task:
            if self.replay and len(data):
                self.client.memory.add(encoded(data), pooled)
            self.started = self.task
        docs = self._training_docs(data, group.classes)
        if docs is None:
            return []
        rows = torch.from_numpy(np.array(group.rows(docs.labels)))
        generator = torch.Generator().manual_seed(seeded(self.cfg.seed, self.client_index, rnd))
        optimizer = AdamW(trainable_parameters(group), lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)
        train_epochs(
            self.client.backbone,
            group,
            docs,
            self.cfg.local_epochs,
            self.cfg.batch_size,
            optimizer,
            generator,
            lambda logits, batch: F.cross_entropy(logits, rows[batch]),
        )
        counts = {int(c): int(n) for c, n in zip(*np.unique(docs.labels, return_counts=True))}
        return [
            GroupUpload(
                0, tuple(group.classes), group_to_tensors(group), counts, entropy_nats(list(counts.values())), len(docs)
            )
        ]

    def _training_docs(self, data: Dataset, known: tuple[int, ...]) -> EncodedDocs | None:
        """This task's texts of classes the group covers, plus (replay) the memory of other classes."""
        docs = encoded(data)
        keep = np.isin(docs.labels, known)
        parts = [EncodedDocs(docs.ids[keep], docs.mask[keep], docs.labels[keep])] if keep.any() else []
        if self.replay:
            current = set(int(c) for c in np.unique(data.y))
            old = self.client.memory.docs(tuple(c for c in self.client.memory.classes if c not in current))
            if old is not None:
                parts.append(old)
        return EncodedDocs.concat(parts) if parts else None


class ReplayGroupLearner(GroupFedAvgLearner):
    """replay-FL: finetune-FL plus FedET's sample memory (same store ratio) mixed into training."""

    replay = True
