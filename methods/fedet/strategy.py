"""FedET on the aggregator: the round protocol around ``methods.fedet.server``.

Each task's first round is the ``sums`` phase: devices send per-class sums of frozen
embeddings; ``aggregate`` merges them into prototypes and gives the new classes a group
(``FedETAggregator.open_task``).  Every later round is a ``train`` phase: per group, the
uploads accepted in the round (the service's collection window: until every device replied
or ``rounds.deadline_s``) are merged by entropy-aware multiple distillation on auxiliary
texts, and only the groups that changed travel down in the next announcement.

The auxiliary texts are ``*.txt`` files under ``aux_dir`` (labels, if any, are never read).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Sequence

import numpy as np

from fclbases.minilm.backbone import FrozenBackbone, backbone_param_count, load_minilm, pooled_embeddings
from fclbases.minilm.enhancer import (
    EnhancerConfig,
    group_param_count,
    group_prefix,
    group_to_tensors,
    tensors_to_group,
)
from fclcore.aggregation import weighted_average
from fclcore.codec import Frame, SparseTensor
from fclcore.errors import ConfigError
from fclcore.schema import FederationSpec
from fclcore.strategy import Checked, Strategy, Update
from fclcore.text import TextTokenizer, default_tokenizer_json
from methods.fedet.config import FedETOptions
from methods.fedet.server import AuxiliaryPool, FedETAggregator, FedETServerConfig, ReceivedGroup
from methods.fedet.wire import MAX_CLASS_ID, META_KEY, downlink_meta, phase_of

log = logging.getLogger(__name__)
MAX_AUX_TEXTS = 100_000


def load_aux_pool(aux_dir: str | None, backbone: FrozenBackbone, max_length: int) -> AuxiliaryPool:
    """Every ``*.txt`` under ``aux_dir`` (sorted paths), tokenised and embedded once."""
    if not aux_dir:
        raise ConfigError("aux_dir: fedet needs a folder of auxiliary .txt files for server distillation")
    paths = sorted(Path(aux_dir).rglob("*.txt"))[:MAX_AUX_TEXTS]
    if not paths:
        raise ConfigError(f"aux_dir: no .txt files under {aux_dir}")
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in paths]
    docs = TextTokenizer(default_tokenizer_json(), max_length).encode(texts)
    return AuxiliaryPool(docs, pooled_embeddings(backbone, docs.ids, docs.mask))


class FedETStrategy(Strategy):
    min_samples = 0  # a device that holds none of a task's classes has nothing to send but its reply
    distils = True  # merge a group's uploads by entropy-aware distillation on auxiliary texts

    @staticmethod
    def groups_of(options: FedETOptions) -> int:
        """J, the Enhancer groups (the single-group baselines override it)."""
        return options.num_groups

    def __init__(self, fed: FederationSpec, options: FedETOptions, input_dim: int, aux_dir: str | None = None) -> None:
        super().__init__(fed, options, input_dim, aux_dir)
        spec = options
        self.backbone = FrozenBackbone(load_minilm())
        self.enhancer = EnhancerConfig(
            hidden=self.backbone.cfg.hidden, bottleneck=spec.bottleneck, blocks=self.backbone.cfg.layers
        )
        self.server = FedETAggregator(
            FedETServerConfig(
                self.enhancer,
                self.groups_of(spec),
                spec.aux_per_round,
                spec.server_epochs,
                fed.train.lr,
                spec.weight_decay,
                fed.train.batch_size,
                fed.seed,
                spec.proto_init,
            ),
            self.backbone,
            load_aux_pool(aux_dir, self.backbone, spec.max_length) if self.distils else None,
        )
        self.changed: list[int] = []  # groups in the current downlink

    # -- the references of byte shares (docs/wire.md "References") ----------------------------
    @property
    def dense_fp32_bytes(self) -> int:
        """Dense fp32 FedAvg of what FedET trains: every group's Enhancers and the head rows of
        the classes so far (the frozen backbone never travels, so it is not counted)."""
        enhancers = self.server.cfg.num_groups * group_param_count(self.enhancer, 0)
        return 4 * (enhancers + self._head_params())

    @property
    def full_finetune_fp32_bytes(self) -> int:
        """The paper's reference: full fine-tuning, the whole model (backbone and head) every round."""
        return 4 * (backbone_param_count(self.backbone) + self._head_params())

    def _head_params(self) -> int:
        classes = len(self.server.group_of)
        return (self.backbone.cfg.hidden + 1) * classes

    def phase(self, rnd: int) -> str:
        return phase_of(self.schedule.place(rnd).task_start)

    def initial_model(self) -> dict[str, np.ndarray]:
        return {}  # every group starts from the same seeded values on every device

    def fits(self, params: dict[str, np.ndarray]) -> bool:
        return True  # the downlink changes shape as classes arrive; ``restore`` checks the groups

    def announce_meta(self, rnd: int) -> dict:
        return downlink_meta(
            self.phase(rnd), self.server.group_of, [(j, list(self.server.groups[j].classes)) for j in self.changed]
        )

    # -- uploads -------------------------------------------------------------------------
    def normalize(self, frame: Frame) -> Checked:
        """Validated once: the parsed sums or group uploads are kept for ``aggregate``."""
        m = frame.meta.get(META_KEY)
        phase = self.phase(frame.header.round)
        if not isinstance(m, dict) or m.get("phase") != phase:
            raise ValueError(f"meta.fedet: expected phase {phase!r} in round {frame.header.round}")
        parsed = self._sums(frame, m) if phase == "sums" else self._groups(frame, m)
        return Checked(dict(frame.tensors), parsed)

    def _sums(self, frame: Frame, m: dict) -> dict[int, tuple[np.ndarray, int]]:
        classes, counts = m.get("classes"), m.get("counts")
        ok = (
            isinstance(classes, list)
            and isinstance(counts, list)
            and len(classes) == len(counts)
            and all(isinstance(c, int) and not isinstance(c, bool) and 0 <= c < MAX_CLASS_ID for c in classes)
            and len(set(classes)) == len(classes)
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in counts)
        )
        if not ok:
            raise ValueError("meta.fedet: expected distinct class ids and counts >= 1 of equal length")
        if not classes:
            if frame.tensors:
                raise ValueError("tensors: a device without new classes sends none")
            return {}
        sums = frame.tensors.get("sums")
        sums = sums.to_dense() if isinstance(sums, SparseTensor) else sums
        if set(frame.tensors) != {"sums"} or tuple(sums.shape) != (len(classes), self.enhancer.hidden):
            raise ValueError(f"tensors: expected only 'sums' of shape {(len(classes), self.enhancer.hidden)}")
        # a sum of n unit vectors has norm <= n; the wire's value coding may lengthen a row by up
        # to its share of the whole tensor's norm (``ValueCoding.norm_error``: int8 rounds values)
        error = self.fed.value_coding.norm_error()
        spare = np.linalg.norm(sums) * error / (1 - error) if error < 1 else np.inf
        if not (np.linalg.norm(sums, axis=1) <= np.asarray(counts) * (1 + 1e-3) + spare).all():
            raise ValueError("sums: a class sum is longer than its count of unit embeddings allows")
        return {c: (np.asarray(sums[i], np.float64), n) for i, (c, n) in enumerate(zip(classes, counts))}

    def _groups(self, frame: Frame, m: dict) -> list[ReceivedGroup]:
        groups = m.get("groups")
        if not isinstance(groups, list) or len(groups) > self.server.cfg.num_groups:
            raise ValueError("meta.fedet.groups: expected a list of at most one upload per group")
        out, used = [], set()
        for g in groups:
            if (
                not isinstance(g, dict)
                or not isinstance(g.get("group"), int)
                or g["group"] in used
                or not 0 <= g["group"] < self.server.cfg.num_groups
            ):
                raise ValueError("meta.fedet.groups: bad or repeated group index")
            j = used.add(g["group"]) or g["group"]
            prefix = group_prefix(j)
            up = ReceivedGroup.from_meta(
                frame.header.client, g, {k[len(prefix) :]: v for k, v in frame.tensors.items() if k.startswith(prefix)}
            )
            if up.classes != self.server.groups[j].classes:
                raise ValueError(f"group {j}: expected classes {self.server.groups[j].classes}, got {up.classes}")
            tensors_to_group(up.tensors, self.enhancer, up.classes)  # names, shapes, finite values
            out.append(up)
        if set(frame.tensors) - {k for k in frame.tensors for j in used if k.startswith(group_prefix(j))}:
            raise ValueError("tensors: only the uploaded groups' tensors are expected")
        return out

    # -- rounds --------------------------------------------------------------------------
    def aggregate(self, updates: Sequence[Update], current: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rnd = updates[0].frame.header.round
        self.changed = []
        if self.phase(rnd) == "sums":
            self.server.open_task([u.parsed for u in updates])
        else:
            by_group: dict[int, list[ReceivedGroup]] = {}
            for u in updates:
                for up in u.parsed:
                    by_group.setdefault(up.group, []).append(up)
            for j, uploads in sorted(by_group.items()):
                self.merge(j, uploads, rnd)
                self.changed.append(j)
        return self.downlink()

    def merge(self, j: int, uploads: list[ReceivedGroup], rnd: int) -> None:
        """Group ``j``'s uploads -> the new global group ``j`` (entropy-aware distillation)."""
        if not self.distils:
            self.average(j, uploads)
            return
        try:
            self.server.aggregate(j, uploads, rnd)
        except ValueError as exc:  # e.g. no auxiliary text near the group's classes
            log.warning("round %d group %d: distillation skipped (%s); sample-weighted average instead", rnd, j, exc)
            self.average(j, uploads)

    def average(self, j: int, uploads: list[ReceivedGroup]) -> None:
        """Sample-weighted FedAvg of group ``j``'s uploads."""
        current = self.server.groups[j]
        average = weighted_average(
            [
                (group_to_tensors(tensors_to_group(u.tensors, self.enhancer, u.classes)), float(u.n_samples))
                for u in uploads
            ],
            group_to_tensors(current),
        )
        self.server.groups[j] = tensors_to_group(average, self.enhancer, current.classes)

    def downlink(self) -> dict[str, np.ndarray]:
        """Prototypes of every known class and the tensors of the groups changed last round."""
        out: dict[str, np.ndarray] = {}
        protos = self.server.prototypes
        if protos:
            out["prototypes"] = np.stack([protos[c] for c in sorted(protos)]).astype(np.float32)
        for j in self.changed:
            out.update({group_prefix(j) + k: v for k, v in group_to_tensors(self.server.groups[j]).items()})
        return out

    # -- checkpoints ---------------------------------------------------------------------
    def state(self) -> tuple[dict, dict[str, np.ndarray]]:
        s = self.server
        meta = {
            "changed": self.changed,
            "group_of": sorted(s.group_of.items()),
            "groups": [list(g.classes) for g in s.groups],
            "old": {str(j): list(g.classes) for j, g in s.old.items()},
            "counts": {str(c): n for c, (_, n) in s.sums.items()},
        }
        arrays = {f"sums/{c}": v for c, (v, _) in s.sums.items()}
        for j, g in enumerate(s.groups):
            if g.classes:
                arrays.update({f"group/{j}/{k}": v for k, v in group_to_tensors(g).items()})
        for j, g in s.old.items():
            if g.classes:
                arrays.update({f"old/{j}/{k}": v for k, v in group_to_tensors(g).items()})
        return meta, arrays

    def restore(self, meta: dict, arrays: dict[str, np.ndarray]) -> None:
        s = self.server

        def group(prefix: str, classes: list[int], fallback):
            if not classes:
                return fallback
            return tensors_to_group(
                {k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)},
                self.enhancer,
                [int(c) for c in classes],
            ).eval()

        s.group_of = {int(c): int(j) for c, j in meta["group_of"]}
        s.sums = {int(c): (arrays[f"sums/{c}"], int(n)) for c, n in meta["counts"].items()}
        s.groups = [group(f"group/{j}/", cl, s.groups[j]) for j, cl in enumerate(meta["groups"])]
        s.old = {int(j): group(f"old/{j}/", cl, s.groups[int(j)].copy().eval()) for j, cl in meta["old"].items()}
        self.changed = [int(j) for j in meta["changed"]]


class GroupFedAvgStrategy(FedETStrategy):
    """The FedAvg baselines: one Enhancer group over every class seen so far, its uploads
    averaged by sample count (no auxiliary data, no distillation)."""

    distils = False

    @staticmethod
    def groups_of(options: FedETOptions) -> int:
        return 1
