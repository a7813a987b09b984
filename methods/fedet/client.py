"""FedET on one device: local class-incremental learning (paper Algorithm 1, Local_ICL).

Per task, for every group j that receives new classes:

1. the new classes' training texts form L_j (their class -> group map comes from the
   federation-wide selector, so every device agrees on j);
2. a temporary group H^t with a head over the client's own new classes of j is randomly
   initialised and trained with cross-entropy on L_j (it persists over the task's rounds
   and trains ``local_epochs`` more each round, instead of being re-initialised each round:
   same fixed point, a fraction of the CPU);
3. typical samples of L_j enter the sample memory S (bounded by gamma);
4. the consolidated group (the global group j as last received, covering old + all new
   classes of j) is trained by double distillation (eq. 3-5) on U = L_j + the memory's
   samples of j's old classes, with f_old = group j as it was when the task started and f_t
   the temporary group.  The paper distils on the memory alone, augmented; our memory is a
   few texts, and L_j is the data this device has anyway, so U includes it;
5. the group is uploaded with its label histogram and entropy H(M^t) (server eq. 6).

CPU (issue 20): every pass over U starts from the frozen prefix (embedding + encoder block 0,
which no Enhancer changes) cached once per task (``_TaskGroup.prefix``, |U| x L x n float32:
98 kB per 64-token text at n = 384; rebuilt after a restore, never checkpointed); a teacher
pass whose logits the targets do not use is not run (f_old before the group has classes, a
one-class f_t); the optimisers are ``fclcore.optim``'s (torch's update arithmetic without
torch.optim's dynamo import).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from fclbases.minilm.backbone import FrozenBackbone
from fclbases.minilm.enhancer import (
    EnhancerConfig,
    EnhancerGroup,
    enhanced_logits,
    group_to_tensors,
    predict_logits,
    trainable_parameters,
)
from fclbases.minilm.prototypes import PrototypeSelector, class_sums
from fclcore.codec import SparseTensor
from fclcore.optim import AdamW, Optimizer
from fclcore.text import EncodedDocs
from methods.fedet.losses import distillation_loss, double_distillation_targets, label_entropy
from methods.fedet.memory import SampleMemory
from methods.fedet.model import enhanced_logits_from_prefix, predict_logits_from_prefix, prefix_states, prototype_rows

__all__ = ["FedETConfig", "GroupUpload", "FedETClient", "train_epochs", "seeded"]


@dataclass(frozen=True)
class FedETConfig:
    enhancer: EnhancerConfig = field(default_factory=EnhancerConfig)
    num_groups: int = 2  # J
    gamma: float = 0.03  # store ratio of the sample memory
    memory_max: int | None = None
    lr: float = 2e-3
    weight_decay: float = 0.01
    batch_size: int = 8
    local_epochs: int = 1  # temporary-group epochs per round
    distill_epochs: int = 1  # double-distillation epochs per round
    seed: int = 0
    proto_init: float = 0.0  # > 0: new head rows start as a nearest-prototype classifier of this logit scale
    prefix_cache: bool = True  # keep the frozen prefix of U per task (CPU for |U| * 98 kB of RAM)
    teacher_from_training: bool = False  # f_t's targets on L_j: its logits of the round's training pass

    def __post_init__(self) -> None:
        if self.num_groups < 1 or self.batch_size < 1 or self.lr <= 0:
            raise ValueError(f"FedETConfig: num_groups, batch_size >= 1 and lr > 0 expected, got {self}")


@dataclass
class GroupUpload:
    """One group's update: its tensors plus the JSON meta that travels with them."""

    group: int
    classes: tuple[int, ...]  # head rows, in order
    tensors: dict[str, np.ndarray | SparseTensor]  # non-zeros; the codec picks the smallest layout
    label_counts: dict[int, int]  # this client's samples per NEW class of the group
    entropy: float  # H(M^t) of label_counts, nats
    n_samples: int

    def meta(self) -> dict:
        return {
            "group": self.group,
            "classes": list(self.classes),
            "entropy": self.entropy,
            "label_counts": [[c, n] for c, n in sorted(self.label_counts.items())],
            "n_samples": self.n_samples,
        }


def seeded(*parts: int) -> int:
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0])


def train_epochs(
    backbone: FrozenBackbone,
    group: EnhancerGroup,
    docs: EncodedDocs,
    epochs: int,
    batch_size: int,
    optimizer: Optimizer | torch.optim.Optimizer,
    generator: torch.Generator,
    loss_fn,
    prefix: torch.Tensor | None = None,
    logits_out: torch.Tensor | None = None,
) -> float:
    """Shuffled mini-batches; ``loss_fn(logits, batch_rows)`` -> scalar.  Returns the mean loss.

    ``prefix``: ``prefix_states`` of ``docs``' rows; each batch then starts after the frozen
    prefix instead of at the token ids (the same logits, without recomputing block 0).
    ``logits_out`` (len(docs), C): filled with each row's logits of the last epoch, as computed
    for its training step (before that step's update)."""
    if prefix is not None and len(prefix) != len(docs):
        raise ValueError(f"prefix has {len(prefix)} rows for {len(docs)} docs")
    group.train()
    losses = []
    for _ in range(epochs):
        for rows in torch.randperm(len(docs), generator=generator).split(batch_size):
            idx = rows.numpy()
            mask = torch.from_numpy(docs.mask[idx])
            if prefix is None:
                logits = enhanced_logits(backbone, group, torch.from_numpy(docs.ids[idx]), mask)  # (b, C)
            else:
                logits = enhanced_logits_from_prefix(backbone, group, prefix[rows], mask)
            if logits_out is not None:
                logits_out[rows] = logits.detach()
            loss = loss_fn(logits, rows)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    group.eval()
    return float(np.mean(losses)) if losses else float("nan")


@dataclass
class _TaskGroup:
    old: EnhancerGroup  # f_old: group j when the task started (frozen teacher)
    temp: EnhancerGroup  # f_t: the client's new classes of j
    temp_opt: Optimizer
    data: EncodedDocs  # L_j: the first len(data) rows of U
    distill_set: EncodedDocs  # U
    old_logits: np.ndarray | None = None  # f_old on U (fixed for the task)
    prefix: torch.Tensor | None = None  # frozen prefix of U (|U|, L, n): a cache, rebuilt after a restore


class FedETClient:
    def __init__(self, cfg: FedETConfig, backbone: FrozenBackbone, client_index: int) -> None:
        self.cfg, self.backbone, self.client_index = cfg, backbone, client_index
        self.groups = [EnhancerGroup(cfg.enhancer, seed=seeded(cfg.seed, j)) for j in range(cfg.num_groups)]
        self.selector = PrototypeSelector()
        self.memory = SampleMemory(cfg.gamma, cfg.memory_max)
        self.task = -1
        self.active: dict[int, _TaskGroup] = {}

    def _optimizer(self, group: EnhancerGroup) -> Optimizer:
        return AdamW(trainable_parameters(group), lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)

    def _prefix(self, s: _TaskGroup) -> torch.Tensor | None:
        """U's frozen prefix, computed at the first pass of the task (or after a restore) in
        batches of the training batch size, so the training passes see the values they would
        compute themselves."""
        if not self.cfg.prefix_cache:
            return None
        if s.prefix is None:
            u = s.distill_set
            if len(s.data) > len(u) or not np.array_equal(u.ids[: len(s.data)], s.data.ids):
                raise ValueError("the task's L_j must be the first rows of U")
            s.prefix = prefix_states(self.backbone, u.ids, u.mask, self.cfg.batch_size)
        return s.prefix

    def _teacher_logits(
        self, group: EnhancerGroup, s: _TaskGroup, prefix: torch.Tensor | None, start: int = 0
    ) -> np.ndarray:
        """(|U| - start, C) logits of a frozen teacher on U's rows from ``start`` on."""
        u = s.distill_set
        if prefix is None:
            return predict_logits(self.backbone, group, u.ids[start:], u.mask[start:])
        return predict_logits_from_prefix(self.backbone, group, prefix[start:], u.mask[start:])

    @staticmethod
    def task_statistics(docs: EncodedDocs, pooled: np.ndarray) -> dict[int, tuple[np.ndarray, int]]:
        """Per new class: (sum of unit embeddings, count) -- the selector's upload at a task start."""
        return class_sums(pooled, docs.labels)

    def start_task(
        self,
        task: int,
        docs: EncodedDocs,
        pooled: np.ndarray,
        group_of: dict[int, int],
        prototypes: dict[int, np.ndarray],
    ) -> None:
        """Install the global selector, extend the selected groups, set up Algorithm 1 per group."""
        self.task, self.active = task, {}
        self.selector.update(prototypes, group_of)
        rows = prototype_rows(prototypes, self.cfg.proto_init)
        new_by_group: dict[int, list[int]] = {}
        for c, j in sorted(group_of.items()):
            if c not in {k for g in self.groups for k in g.classes}:
                new_by_group.setdefault(j, []).append(c)
        old_rows = self.memory.docs()
        self.memory.add(docs, pooled)  # Algorithm 1 line 9 (the memory only keeps a few typical rows)
        for j, new in new_by_group.items():
            old = self.groups[j].copy().eval()
            self.groups[j].extend_classes(new, rows)  # identical on every device and the server
            mine = np.flatnonzero(np.isin(docs.labels, new))
            if len(mine) == 0:
                continue
            local_new = tuple(sorted(int(c) for c in np.unique(docs.labels[mine])))
            seed = seeded(self.cfg.seed, self.client_index, task, j)
            if rows:  # the temporary head starts as the prototype classifier of its classes
                temp = EnhancerGroup(self.cfg.enhancer, seed=seed)
                temp.extend_classes(local_new, rows)
            else:
                temp = EnhancerGroup(self.cfg.enhancer, local_new, seed=seed)
            data = docs.subset(mine)
            replay = (
                None if old_rows is None else old_rows.subset(np.flatnonzero(np.isin(old_rows.labels, old.classes)))
            )
            distill = data if replay is None or len(replay) == 0 else EncodedDocs.concat([data, replay])
            self.active[j] = _TaskGroup(old, temp, self._optimizer(temp), data, distill)

    def load_group(self, j: int, group: EnhancerGroup) -> None:
        self.groups[j] = group

    def train_round(self, rnd: int) -> list[GroupUpload]:
        return [self._train_group(j, state, rnd) for j, state in sorted(self.active.items())]

    def _train_group(self, j: int, s: _TaskGroup, rnd: int) -> GroupUpload:
        gen = torch.Generator().manual_seed(seeded(self.cfg.seed, self.client_index, rnd, j))
        bs = self.cfg.batch_size
        rows = torch.from_numpy(np.array(s.temp.rows(s.data.labels)))
        teaches = len(s.temp.classes) > 1  # a one-class head has nothing to learn (its CE is always 0)
        if not s.old.classes and not teaches:  # one new class and no old ones: nothing to distil,
            return self._upload(j, s)  # the group goes up as it is (no pass over U at all)
        prefix = self._prefix(s)
        n_l, n_u = len(s.data), len(s.distill_set)
        seen = torch.empty(n_l, len(s.temp.classes)) if teaches and self.cfg.teacher_from_training else None
        if teaches:
            train_epochs(
                self.backbone,
                s.temp,
                s.data,
                self.cfg.local_epochs,
                bs,
                s.temp_opt,
                gen,
                lambda logits, b: F.cross_entropy(logits, rows[b]),
                None if prefix is None else prefix[:n_l],
                seen,
            )
        if s.old_logits is None:  # f_old is fixed for the task; a group without classes has no logits
            s.old_logits = self._teacher_logits(s.old, s, prefix) if s.old.classes else np.zeros((n_u, 0), np.float32)
        # f_t once this round's training is done: one pass over U (a one-class f_t is no teacher), or,
        # teacher_from_training, its logits of the training pass on L_j and one pass over the rest of U
        if not teaches:
            temp_logits = np.zeros((n_u, 0), np.float32)
        elif seen is None:
            temp_logits = self._teacher_logits(s.temp, s, prefix)
        else:  # (no pass at all when U is L_j alone)
            rest = self._teacher_logits(s.temp, s, prefix, start=n_l) if n_u > n_l else np.zeros((0, seen.shape[1]))
            temp_logits = np.concatenate([seen.numpy(), rest.astype(np.float32)])
        targets, have = self._targets(j, s, torch.from_numpy(s.old_logits), torch.from_numpy(temp_logits))
        student = self.groups[j]
        if have.any():
            train_epochs(
                self.backbone,
                student,
                s.distill_set,
                self.cfg.distill_epochs,
                bs,
                self._optimizer(student),
                gen,
                lambda logits, b: distillation_loss(logits, targets[b], have),
                prefix,
            )
        return self._upload(j, s)

    def _upload(self, j: int, s: _TaskGroup) -> GroupUpload:
        student = self.groups[j]
        counts = {int(c): int((s.data.labels == c).sum()) for c in s.temp.classes}
        return GroupUpload(
            j,
            student.classes,
            group_to_tensors(student, sparse=True),
            counts,
            label_entropy(list(counts.values())),
            len(s.distill_set),
        )

    def _targets(
        self, j: int, s: _TaskGroup, old: torch.Tensor, temp: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Eq. 5 targets placed on the student's head rows; rows without a teacher are masked.
        A one-class temporary group is no teacher: its centred logit is always 0, and pulling
        the student's row towards it would erase that class's initialisation."""
        student = self.groups[j]
        if len(s.temp.classes) < 2:  # (its logits are not even computed: ``_train_group``)
            temp = temp[:, :0]
        dd = double_distillation_targets(old, temp)  # (|U|, m + n_local) in [old..., temp...] order
        cols = student.rows(s.old.classes + (s.temp.classes if temp.shape[1] else ()))
        targets = torch.zeros(len(dd), len(student.classes))
        targets[:, cols] = dd
        have = torch.zeros(len(student.classes), dtype=torch.bool)
        have[cols] = True
        return targets, have

    def predict(
        self, docs: EncodedDocs, pooled: np.ndarray, prefix: torch.Tensor | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """(predicted class, routed group) per text: selector first, then the routed group's head
        (-1 where the routed group has no classes yet).  ``prefix``: the texts' ``prefix_states``
        (then block 0 is not run again)."""
        routes = self.selector.route(pooled)
        preds = np.full(len(docs), -1, dtype=np.int64)
        for j in np.unique(routes):
            idx = np.flatnonzero(routes == j)
            group = self.groups[int(j)]
            if not group.classes:  # routed to a group this device has not set up yet: no answer
                continue
            if prefix is None:
                logits = predict_logits(self.backbone, group, docs.ids[idx], docs.mask[idx])
            else:
                logits = predict_logits_from_prefix(self.backbone, group, prefix, docs.mask, rows=idx)
            preds[idx] = np.array(group.classes)[logits.argmax(1)]
        return preds, routes
