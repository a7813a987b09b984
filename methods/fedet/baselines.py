"""The FedAvg baselines of the FedET benchmark, on the same frozen backbone + one Enhancer group.

* ``finetune``: one group whose head covers every class seen so far, trained with
  cross-entropy on the current task's local data only (forgets the old classes);
* ``replay``: the same plus the sample memory (same store ratio as FedET) mixed into training;
* ``multitask``: all of a client's data at once (the upper bound; the harness gives it a
  single task holding every class).

The server side is plain sample-weighted FedAvg of the group's tensors.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from fclbases.minilm.backbone import FrozenBackbone
from fclbases.minilm.enhancer import EnhancerGroup, group_to_tensors, predict_logits, trainable_parameters
from fclcore.text import EncodedDocs
from methods.fedet.client import FedETConfig, seeded, train_epochs
from methods.fedet.memory import SampleMemory

__all__ = ["GroupFedAvgClient"]


class GroupFedAvgClient:
    def __init__(self, cfg: FedETConfig, backbone: FrozenBackbone, client_index: int, replay: bool) -> None:
        self.cfg, self.backbone, self.client_index, self.replay = cfg, backbone, client_index, replay
        self.group = EnhancerGroup(cfg.enhancer)
        self.memory = SampleMemory(cfg.gamma, cfg.memory_max)
        self.train_set: EncodedDocs | None = None

    def start_task(self, docs: EncodedDocs, pooled: np.ndarray) -> None:
        old = self.memory.docs() if self.replay else None
        if self.replay:
            self.memory.add(docs, pooled)
        self.train_set = docs if old is None else EncodedDocs.concat([docs, old])

    def load_group(self, group: EnhancerGroup) -> None:
        self.group = group

    def train_round(self, rnd: int) -> tuple[dict[str, np.ndarray], int]:
        """One round of local training from the global group; (tensors to upload, samples used)."""
        data = self.train_set
        if data is None or len(data) == 0:
            raise ValueError("train_round before start_task (or with no local data)")
        gen = torch.Generator().manual_seed(seeded(self.cfg.seed, self.client_index, rnd))
        rows = torch.from_numpy(np.array(self.group.rows(data.labels)))
        opt = torch.optim.AdamW(trainable_parameters(self.group), lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)
        train_epochs(
            self.backbone,
            self.group,
            data,
            self.cfg.local_epochs,
            self.cfg.batch_size,
            opt,
            gen,
            lambda logits, b: F.cross_entropy(logits, rows[b]),
        )
        return group_to_tensors(self.group), len(data)

    def predict(self, docs: EncodedDocs, classes: tuple[int, ...] | None = None) -> np.ndarray:
        """Argmax over the head, restricted to ``classes`` when given (prefix evaluation)."""
        logits = predict_logits(self.backbone, self.group, docs.ids, docs.mask)
        allowed = np.array(self.group.classes)
        if classes is not None:
            keep = np.isin(allowed, classes)
            logits, allowed = logits[:, keep], allowed[keep]
        return allowed[logits.argmax(1)]
