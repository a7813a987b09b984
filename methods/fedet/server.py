"""FedET on the aggregator: group assignment, the waiting window and entropy-aware multiple
distillation (paper section 3.2, eq. 6-8).  Trains on the server (torch).

Per group j and round, the uploads that arrive inside the waiting window are merged:

* targets on auxiliary texts: the old classes of j from f_old (group j when the task
  started), the new classes from the uploaded groups weighted by their entropy H^k::

      y_hat_i   = sum_k  H^k / H_sum(i) * y^k_i        (k over uploads that trained class i)
      y_ddot_i  = y_old_i - mean_old(y_old)             (old classes)
      y_ddot_i  = y_hat_i - mean_new(y_hat)             (new classes)
      L_emd     = 1/(m+n) sum_i (y_i - y_ddot_i)^2      (eq. 7)

  With every upload covering every new class this is eq. 8 verbatim (its y_hat_i is the
  entropy-weighted ensemble of eq. 6).  H_sum(i) = 0 (only one-class uploads) falls back to
  equal weights.
* auxiliary data: a pool of texts of a similar domain (labels, if any, are ignored) is
  pseudo-labelled by the global class prototypes; each round draws per-class quotas that
  follow the uploaded label distributions for the new classes and give each old class the
  mean new-class share.
* the student starts from the sample-weighted FedAvg of the uploads and is trained on L_emd.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import torch

from fclbases.minilm.backbone import FrozenBackbone
from fclbases.minilm.enhancer import (
    EnhancerConfig,
    EnhancerGroup,
    enhanced_logits,
    group_to_tensors,
    predict_logits,
    tensors_to_group,
    trainable_parameters,
)
from fclcore.aggregation import weighted_average
from fclcore.codec import Frame
from fclcore.text import EncodedDocs, entropy_nats
from methods.fedet.model import prototype_rows

__all__ = [
    "merge_class_sums",
    "assign_groups",
    "emd_weights",
    "emd_targets",
    "aux_quotas",
    "WaitingWindow",
    "AuxiliaryPool",
    "ReceivedGroup",
    "FedETServerConfig",
    "FedETAggregator",
]

ClassSums = Mapping[int, tuple[np.ndarray, int]]


# ------------------------------------------------------------------ pure functions


def _seeded(*parts: int) -> int:
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0])


def merge_class_sums(
    uploads: Sequence[ClassSums], into: dict[int, tuple[np.ndarray, int]] | None = None
) -> dict[int, tuple[np.ndarray, int]]:
    out = dict(into or {})
    for sums in uploads:
        for c, (s, n) in sums.items():
            prev_s, prev_n = out.get(int(c), (np.zeros_like(s, dtype=np.float64), 0))
            out[int(c)] = (prev_s + np.asarray(s, np.float64), prev_n + int(n))
    return out


def _unit(v: np.ndarray) -> np.ndarray:
    return v / max(float(np.linalg.norm(v)), 1e-12)


def assign_groups(
    new_classes: Sequence[int], prototypes: Mapping[int, np.ndarray], group_classes: Sequence[Sequence[int]]
) -> int:
    """The group that takes a task's new classes: the first empty group while one is left,
    else the group whose classes are most similar (mean over new classes of the best cosine
    to a class of the group)."""
    for j, classes in enumerate(group_classes):
        if not classes:
            return j
    scores = [
        np.mean([max(float(_unit(prototypes[c]) @ _unit(prototypes[k])) for k in classes) for c in new_classes])
        for classes in group_classes
    ]
    return int(np.argmax(scores))


def emd_weights(entropies: Sequence[float]) -> np.ndarray:
    """H^k / H_sum; equal weights when every entropy is 0."""
    h = np.asarray(entropies, dtype=np.float64)
    if h.size == 0 or (h < 0).any() or not np.isfinite(h).all():
        raise ValueError(f"entropies must be finite and >= 0, got {h.tolist()}")
    return h / h.sum() if h.sum() > 0 else np.full(h.size, 1.0 / h.size)


def emd_targets(
    old_logits: np.ndarray,
    upload_logits: Sequence[np.ndarray],
    upload_classes: Sequence[Sequence[int]],
    entropies: Sequence[float],
    new_classes: Sequence[int],
) -> np.ndarray:
    """Eq. 6-8: (B, m) f_old logits + per upload (B, n_k) logits over ``upload_classes[k]`` ->
    (B, m + n) targets in [old..., new_classes...] order.  Every new class needs an upload."""
    b = old_logits.shape[0]
    new = np.zeros((b, len(new_classes)))
    for i, c in enumerate(new_classes):
        ks = [k for k, cl in enumerate(upload_classes) if c in cl]
        if not ks:
            raise ValueError(f"no upload trained new class {c}")
        w = emd_weights([entropies[k] for k in ks])
        new[:, i] = sum(wk * upload_logits[k][:, list(upload_classes[k]).index(c)] for wk, k in zip(w, ks))
    return np.concatenate([_centered(old_logits.astype(np.float64)), _centered(new)], axis=1)


def _centered(x: np.ndarray) -> np.ndarray:
    return x - x.mean(1, keepdims=True) if x.shape[1] else x


def aux_quotas(old_classes: Sequence[int], new_counts: Mapping[int, int], total: int) -> dict[int, int]:
    """Per-class auxiliary sample counts summing to ``total`` (largest remainders)."""
    mass = {int(c): float(n) for c, n in new_counts.items() if n > 0}
    share = np.mean(list(mass.values())) if mass else 1.0
    mass.update({int(c): share for c in old_classes})
    raw = {c: total * m / sum(mass.values()) for c, m in mass.items()}
    out = {c: int(math.floor(v)) for c, v in raw.items()}
    for c in sorted(raw, key=lambda c: (out[c] - raw[c], c))[: total - sum(out.values())]:
        out[c] += 1
    return out


# ------------------------------------------------------------------ waiting window


class WaitingWindow:
    """Uploads for one (round, group), accepted until ``window_s`` after the first one arrived
    or until ``expected`` clients have sent; later or duplicate uploads are refused (counted)."""

    def __init__(self, window_s: float, expected: int) -> None:
        self.window_s, self.expected = window_s, expected
        self.opened_at: float | None = None
        self.uploads: dict[str, "ReceivedGroup"] = {}
        self.refused: dict[str, int] = {}

    def offer(self, upload: "ReceivedGroup", now: float) -> bool:
        reason = "late" if self.closed(now) else "duplicate" if upload.client in self.uploads else None
        if reason:
            self.refused[reason] = self.refused.get(reason, 0) + 1
            return False
        self.opened_at = now if self.opened_at is None else self.opened_at
        self.uploads[upload.client] = upload
        return True

    def closed(self, now: float) -> bool:
        if len(self.uploads) >= self.expected:
            return True
        return self.opened_at is not None and now - self.opened_at >= self.window_s


# ------------------------------------------------------------------ uploads and aux data


@dataclass
class ReceivedGroup:
    client: str
    group: int
    classes: tuple[int, ...]
    tensors: dict
    label_counts: dict[int, int]
    entropy: float
    n_samples: int

    @classmethod
    def from_frame(cls, frame: Frame) -> "ReceivedGroup":
        """Validate the meta of a decoded group upload (tensor shapes are checked on use)."""
        return cls.from_meta(frame.header.client, frame.meta, dict(frame.tensors))

    @classmethod
    def from_meta(cls, client: str, m: object, tensors: dict) -> "ReceivedGroup":
        """One group's upload from its meta (``GroupUpload.meta()``) and tensors."""
        try:
            classes = tuple(int(c) for c in m["classes"])
            counts = {int(c): int(n) for c, n in m["label_counts"]}
            up = cls(client, int(m["group"]), classes, tensors, counts, float(m["entropy"]), int(m["n_samples"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"fedet upload from {client!r}: bad meta ({exc!r})") from None
        if any(n < 0 for n in counts.values()) or not set(counts) <= set(classes) or up.n_samples < 1:
            raise ValueError(
                f"fedet upload from {up.client!r}: label_counts {counts} must be >= 0 and "
                f"within classes {classes}, n_samples {up.n_samples} >= 1"
            )
        if not abs(up.entropy - entropy_nats(list(counts.values()))) < 1e-6:
            raise ValueError(
                f"fedet upload from {up.client!r}: entropy {up.entropy} does not match "
                f"its label counts ({entropy_nats(list(counts.values()))})"
            )
        return up


@dataclass
class AuxiliaryPool:
    """Unlabelled texts of a similar domain with their frozen embeddings (rows aligned)."""

    docs: EncodedDocs
    pooled: np.ndarray

    def select(
        self, quotas: Mapping[int, int], prototypes: Mapping[int, np.ndarray], rng: np.random.Generator
    ) -> EncodedDocs:
        classes = np.array(sorted(prototypes))
        protos = np.stack([_unit(np.asarray(prototypes[c], np.float64)) for c in classes])
        unit = self.pooled / np.maximum(np.linalg.norm(self.pooled, axis=1, keepdims=True), 1e-12)
        pseudo = classes[np.argmax(unit @ protos.T, axis=1)]
        picked = [rng.permutation(np.flatnonzero(pseudo == c))[:q] for c, q in sorted(quotas.items())]
        rows = np.sort(np.concatenate(picked)) if picked else np.zeros(0, np.int64)
        if len(rows) == 0:
            raise ValueError("the auxiliary pool has no text near the group's classes")
        return self.docs.subset(rows)


# ------------------------------------------------------------------ the server


@dataclass(frozen=True)
class FedETServerConfig:
    enhancer: EnhancerConfig = field(default_factory=EnhancerConfig)
    num_groups: int = 2
    aux_per_round: int = 64
    distill_epochs: int = 4
    lr: float = 2e-3
    weight_decay: float = 0.01
    batch_size: int = 8
    seed: int = 0
    proto_init: float = 0.0  # as the devices' FedETConfig.proto_init


class FedETAggregator:
    def __init__(self, cfg: FedETServerConfig, backbone: FrozenBackbone, aux: AuxiliaryPool) -> None:
        self.cfg, self.backbone, self.aux = cfg, backbone, aux
        # the same seeded initial groups as every device (methods.fedet.client.seeded(seed, j))
        self.groups = [EnhancerGroup(cfg.enhancer, seed=_seeded(cfg.seed, j)) for j in range(cfg.num_groups)]
        self.sums: dict[int, tuple[np.ndarray, int]] = {}
        self.group_of: dict[int, int] = {}
        self.old: dict[int, EnhancerGroup] = {}  # f_old per group changed in this task

    @property
    def prototypes(self) -> dict[int, np.ndarray]:
        return {c: (s / max(n, 1)).astype(np.float32) for c, (s, n) in self.sums.items()}

    def open_task(self, stats: Sequence[ClassSums]) -> tuple[dict[int, int], dict[int, np.ndarray]]:
        """Merge the clients' class sums; give the task's new classes a group; snapshot f_old."""
        self.sums = merge_class_sums(stats, self.sums)
        new = sorted(c for c in self.sums if c not in self.group_of)
        self.old = {}
        if new:
            j = assign_groups(new, self.prototypes, [g.classes for g in self.groups])
            self.old[j] = self.groups[j].copy().eval()
            self.groups[j].extend_classes(new, prototype_rows(self.prototypes, self.cfg.proto_init))
            self.group_of.update({c: j for c in new})
        return dict(self.group_of), self.prototypes

    def aggregate(self, j: int, uploads: Sequence[ReceivedGroup], rnd: int) -> EnhancerGroup:
        """Entropy-aware multiple distillation of the uploads of group ``j`` -> the new global group."""
        group, old = self.groups[j], self.old.get(j, self.groups[j])
        received = [tensors_to_group(u.tensors, self.cfg.enhancer, u.classes) for u in uploads]
        if any(u.classes != group.classes for u in uploads):
            raise ValueError(f"group {j}: uploads must cover {group.classes}, got {[u.classes for u in uploads]}")
        new_classes = [c for c in group.classes if c not in old.classes]
        trained = [tuple(c for c, n in u.label_counts.items() if n > 0 and c in new_classes) for u in uploads]
        counts: dict[int, int] = {}
        for u in uploads:
            for c, n in u.label_counts.items():
                counts[c] = counts.get(c, 0) + n
        rng = np.random.default_rng((self.cfg.seed, rnd, j))
        aux = self.aux.select(aux_quotas(old.classes, counts, self.cfg.aux_per_round), self.prototypes, rng)
        covered = [c for c in new_classes if any(c in t for t in trained)]  # others keep their rows
        old_logits = predict_logits(self.backbone, old, aux.ids, aux.mask)
        up_logits = [
            predict_logits(self.backbone, g, aux.ids, aux.mask)[:, g.rows(cl)] for g, cl in zip(received, trained)
        ]
        targets = emd_targets(old_logits, up_logits, trained, [u.entropy for u in uploads], covered)
        cols = group.rows(list(old.classes) + covered)
        full = np.zeros((len(aux), len(group.classes)), np.float32)
        full[:, cols] = targets
        student = tensors_to_group(
            weighted_average(
                [(group_to_tensors(g), float(u.n_samples)) for g, u in zip(received, uploads)], group_to_tensors(group)
            ),
            self.cfg.enhancer,
            group.classes,
        )
        self._distill(student, aux, torch.from_numpy(full), torch.tensor(cols), rnd, j)
        self.groups[j] = student
        return student

    def _distill(
        self, student: EnhancerGroup, aux: EncodedDocs, targets: torch.Tensor, cols: torch.Tensor, rnd: int, j: int
    ) -> None:
        opt = torch.optim.AdamW(trainable_parameters(student), lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)
        gen = torch.Generator().manual_seed(_seeded(self.cfg.seed, rnd, j))
        student.train()
        for _ in range(self.cfg.distill_epochs):
            for rows in torch.randperm(len(aux), generator=gen).split(self.cfg.batch_size):
                idx = rows.numpy()
                logits = enhanced_logits(
                    self.backbone, student, torch.from_numpy(aux.ids[idx]), torch.from_numpy(aux.mask[idx])
                )  # (b, c)
                loss = ((logits[:, cols] - targets[rows][:, cols]) ** 2).mean()  # eq. 7
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        student.eval()
