"""FedET's wire contract, used by both halves.

Each task runs in two phases that the aggregator announces in the round's meta
(``meta["fedet"]["phase"]``):

* ``sums`` (the task's first round): the device uploads, per class of its new data, the sum
  of the frozen backbone's unit embeddings and the count (tensor ``sums``, meta ``classes`` and
  ``counts``); nothing is trained.
* ``train`` (every later round): the device uploads the groups holding its new classes as
  ``g<j>/<name>`` with ``groups: [{group, classes, n_samples, label_counts, entropy}]``.

Downlink: ``meta.fedet = {phase, classes, group_of: [[class, group]], groups: [{group, classes}]}``
with tensors ``prototypes`` (C, H) over ``classes`` and, for each group the aggregator changed
in the previous round, ``g<j>/<name>``.  Every group starts from the same seeded values on
every device and the aggregator (``methods.fedet.client.seeded``).
"""

from __future__ import annotations

import numpy as np

from fclbases.minilm.enhancer import EnhancerConfig, EnhancerGroup, group_prefix, tensors_to_group
from fclcore.codec import SparseTensor, Tensor

META_KEY = "fedet"  # the round message's and the update's metadata key of this method
MAX_CLASS_ID = 1 << 20
PHASES = ("sums", "train")  # a FedET task's first round sends class sums, later rounds train groups


def phase_of(task_start: bool) -> str:
    return PHASES[0] if task_start else PHASES[1]


def downlink_meta(phase: str, group_of: dict[int, int], changed: list[tuple[int, list[int]]]) -> dict:
    """The announcement's ``meta.fedet`` (``changed``: (group, its classes) sent down this round)."""
    return {
        META_KEY: {
            "phase": phase,
            "classes": sorted(group_of),
            "group_of": [[c, group_of[c]] for c in sorted(group_of)],
            "groups": [{"group": j, "classes": list(classes)} for j, classes in changed],
        }
    }


def parse_downlink(
    meta: dict | None, tensors: dict[str, Tensor], cfg: EnhancerConfig, num_groups: int
) -> tuple[str, dict[int, int], dict[int, np.ndarray], dict[int, EnhancerGroup]]:
    """Validate a round's FedET content: (phase, class -> group, prototypes, changed groups)."""
    m = (meta or {}).get(META_KEY)
    if not isinstance(m, dict) or m.get("phase") not in PHASES:
        raise ValueError(f"meta.fedet: expected a mapping with phase in {PHASES}")
    try:
        classes = [int(c) for c in m.get("classes", [])]
        group_of = {int(c): int(j) for c, j in m.get("group_of", [])}
        groups_meta = [(int(g["group"]), [int(c) for c in g["classes"]]) for g in m.get("groups", [])]
    except (TypeError, ValueError, KeyError) as exc:
        raise ValueError(f"meta.fedet: malformed ({exc!r})") from None
    if sorted(group_of) != sorted(classes) or any(not 0 <= j < num_groups for j in group_of.values()):
        raise ValueError(f"meta.fedet: every class needs one group in [0, {num_groups})")
    prototypes: dict[int, np.ndarray] = {}
    if classes:
        table = tensors.get("prototypes")
        table = table.to_dense() if isinstance(table, SparseTensor) else table
        if table is None or tuple(table.shape) != (len(classes), cfg.hidden):
            raise ValueError(f"prototypes: expected shape {(len(classes), cfg.hidden)}")
        prototypes = {c: np.asarray(table[i], np.float32) for i, c in enumerate(classes)}
    groups = {}
    for j, group_classes in groups_meta:
        if not 0 <= j < num_groups or j in groups:
            raise ValueError(f"meta.fedet.groups: bad or repeated group {j}")
        prefix = group_prefix(j)
        groups[j] = tensors_to_group(
            {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}, cfg, group_classes
        )
    known = {"prototypes"} | {k for k in tensors for j in groups if k.startswith(group_prefix(j))}
    if set(tensors) - known:
        raise ValueError(f"tensors: unexpected {sorted(set(tensors) - known)[:5]}")
    return m["phase"], group_of, prototypes, groups
