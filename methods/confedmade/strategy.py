"""The ConFedMADE package on the server: for ConFedMADE and FedWeIT-MADE, masked sparse FedAvg
of B*sigmoid(m) and a knowledge base of task-adaptive parameters (Algorithms 1-2 of the ConFedMADE paper).

Uploads of the base arrive packed (``fclcore.masked_upload``): for ``confedmade`` the
positions are the round's MADE mask (derived here from the seed, never sent) intersected
with the units the client kept; each element is averaged over the clients that sent it.
The last update of a task also carries ``kb:<weight>`` tensors, the client's thresholded
A_t, which become knowledge-base entries handed to other clients at the next task start, and
``kb_held``, the entries the client holds: its next knowledge frame names every entry chosen
for it but carries only the others (the full frame goes beside it, for a device that lost some).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from fclbases.fedavg.strategy import FedAvgStrategy
from fclbases.made.options import upload_order
from fclcore.aggregation import RunningSum
from fclcore.codec import CodecLimits, Frame, SparseTensor, Tensor
from fclcore.made_spec import made_masks, mask_for_param
from fclcore.masked_upload import UNITS, unpack
from fclcore.model_sync import VALUE_BYTES
from fclcore.schema import FederationSpec
from fclcore.strategy import Downlinks, Update, without_tensors
from methods.confedmade.wire import (
    EXTRA,
    HELD,
    KB_PREFIX,
    entry_id,
    knowledge_key,
    knowledge_meta,
    parse_held,
    shares_knowledge,
)

MAX_FRAME_TENSORS = CodecLimits().max_tensors


@dataclass(frozen=True)
class KnowledgeEntry:
    client: str
    task: int
    tensors: dict[str, Tensor]  # weight name -> thresholded A (full shape)

    @property
    def entry_id(self) -> str:
        return entry_id(self.client, self.task)


class DecomposedStrategy(FedAvgStrategy):
    """FedWeIT-MADE(*): masked FedAvg of the uploaded base, a knowledge base of A_t."""

    partial_sums = False  # a task end's A_t entries are kept per device (and sent back per device)
    restrict_to_made_mask = False  # uploads restricted to the round's MADE mask (with upload_made_mask)

    def __init__(self, fed: FederationSpec, options: Any, input_dim: int, aux_dir: str | None = None) -> None:
        super().__init__(fed, options, input_dim, aux_dir)
        self.mask_restricted = self.restrict_to_made_mask and options.upload_made_mask
        self.weights = [n for n in self.shapes if n.endswith(".weight")]
        self.knowledge: list[KnowledgeEntry] = []
        self.held: dict[str, frozenset[str]] = {}  # client -> the entries it declared it holds (kb_held)

    def carries_knowledge(self, rnd: int) -> bool:
        """Whether round ``rnd``'s updates carry their A_t (a task's last round, but the last task's)."""
        place = self.schedule.place(rnd)
        return place.task_end and shares_knowledge(place.task, self.schedule.num_tasks)

    def announce_meta(self, rnd: int) -> dict:
        return {"client_frames": self.schedule.place(rnd).task_start}

    def normalize(self, frame: Frame) -> dict[str, Tensor]:
        rnd = frame.header.round
        masks = made_masks(self.made, upload_order(self.made, self.options, rnd)) if self.mask_restricted else None
        out: dict[str, Tensor] = {}
        expected = set()
        for name, shape in self.shapes.items():
            if name.endswith(".bias"):
                out[name] = _dense(frame.tensors, name, shape)
                expected.add(name)
                continue
            out[name] = unpack(name, frame.tensors, shape, mask_for_param(masks, name) if masks else None)
            expected |= {name, name + UNITS, name + EXTRA}
            if name + EXTRA in frame.tensors:
                out[name] = _with_extra(out[name], frame.tensors[name + EXTRA], name + EXTRA)
            if self.carries_knowledge(rnd):
                out[KB_PREFIX + name] = _full_shape(frame.tensors, KB_PREFIX + name, shape)
                expected.add(KB_PREFIX + name)
        extra = sorted(set(frame.tensors) - expected)
        if extra:
            raise ValueError(f"tensors: unexpected {extra}")
        parse_held(frame.meta)
        return out

    def fold(self, running: RunningSum, update: Update) -> Update:
        """The base is summed; a task end's ``kb:`` tensors are kept for the knowledge base."""
        base = {k: v for k, v in update.tensors.items() if not k.startswith(KB_PREFIX)}
        running.add(base, float(update.n_samples))
        return without_tensors(update, keep={k: v for k, v in update.tensors.items() if k.startswith(KB_PREFIX)})

    def close(self, running: RunningSum, kept: Sequence[Update], current: dict[str, np.ndarray]) -> dict:
        merged = running.result(current)
        for u in kept:
            held = parse_held(u.frame.meta)
            if held is not None:
                self.held[u.client] = frozenset(held)
        for u in sorted(kept, key=lambda u: u.client):
            trained_on = u.frame.header.round  # buffered rounds: each update its own version's
            if self.carries_knowledge(trained_on):
                kb = {k[len(KB_PREFIX) :]: v for k, v in u.tensors.items() if k.startswith(KB_PREFIX)}
                self.knowledge.append(KnowledgeEntry(u.client, self.schedule.task_of(trained_on), kb))
        return merged

    def client_downlinks(self, rnd: int, clients: Sequence[str]) -> Downlinks:
        """At a task start: each client's knowledge frame (other clients' earlier entries), with
        the tensors of the entries it does not declare it holds."""
        return self._knowledge_frames(rnd, clients, full=False)

    def full_downlinks(self, rnd: int, clients: Sequence[str]) -> Downlinks:
        """The full knowledge frame of each client whose frame leaves out entries it holds."""
        return self._knowledge_frames(rnd, clients, full=True)

    def _knowledge_frames(self, rnd: int, clients: Sequence[str], full: bool) -> Downlinks:
        place = self.schedule.place(rnd)
        if not place.task_start:
            return {}
        out = {}
        for index, client in enumerate(clients):
            chosen = self._select(client, index, place.task)
            held = self.held.get(client, frozenset())
            if full and not any(e.entry_id in held for e in chosen):
                continue  # its own frame carries every entry
            sent = [e for e in chosen if full or e.entry_id not in held]
            tensors = {knowledge_key(e.entry_id, name): t for e in sent for name, t in e.tensors.items()}
            out[client] = (knowledge_meta(place.task, [(e.entry_id, e.client, e.task) for e in chosen]), tensors)
        return out

    def downlink_log(self, meta: dict) -> dict:
        return {"entries": [e["id"] for e in meta["entries"]]}

    def state(self) -> tuple[dict, dict[str, np.ndarray]]:
        """The knowledge base, each tensor stored sparse (index, value) with its shape in meta."""
        entries, arrays = [], {}
        for i, entry in enumerate(self.knowledge):
            shapes = {}
            for name, tensor in entry.tensors.items():
                sparse = tensor if isinstance(tensor, SparseTensor) else SparseTensor.from_dense(tensor)
                arrays[f"kb/{i}/{name}/indices"] = sparse.indices
                arrays[f"kb/{i}/{name}/values"] = sparse.values.astype(np.float32)
                shapes[name] = list(sparse.shape)
            entries.append({"client": entry.client, "task": entry.task, "shapes": shapes})
        return {"knowledge": entries, "held": {c: sorted(h) for c, h in sorted(self.held.items())}}, arrays

    def restore(self, meta: dict, arrays: dict[str, np.ndarray]) -> None:
        knowledge = []
        for i, entry in enumerate(meta.get("knowledge", [])):
            tensors = {}
            for name, shape in entry["shapes"].items():
                if tuple(shape) != tuple(self.shapes.get(name, ())):
                    raise ValueError(
                        f"knowledge entry {i}: {name} has shape {shape}, the model {self.shapes.get(name)}"
                    )
                tensors[name] = SparseTensor(
                    tuple(shape), arrays[f"kb/{i}/{name}/indices"], arrays[f"kb/{i}/{name}/values"]
                )
            knowledge.append(KnowledgeEntry(str(entry["client"]), int(entry["task"]), tensors))
        self.knowledge = knowledge
        held = meta.get("held", {})
        if not isinstance(held, dict):
            raise ValueError("held: expected an object of client -> entry ids")
        self.held = {str(c): frozenset(parse_held({HELD: ids}) or ()) for c, ids in held.items()}

    def _select(self, client: str, index: int, task: int) -> list[KnowledgeEntry]:
        """Entries of other clients' earlier tasks, by the configured policy."""
        pool = [e for e in self.knowledge if e.client != client and e.task < task]
        opts = self.options
        if opts.kb_policy == "recent":
            pool = sorted(pool, key=lambda e: (e.task, e.client))[-opts.kb_k :]
        elif opts.kb_policy == "random" and len(pool) > opts.kb_k:
            rng = np.random.default_rng((self.fed.seed, task, index))
            pool = [pool[i] for i in sorted(rng.choice(len(pool), opts.kb_k, replace=False))]
        budget = math.inf if opts.kb_budget_mb is None else opts.kb_budget_mb * 1e6
        room, kept = MAX_FRAME_TENSORS // max(1, len(self.weights)), set()  # a frame carries at most that many
        for entry in sorted(pool, key=lambda e: (-e.task, e.client)):  # the most recent tasks first
            cost = self._entry_bytes(entry) if budget < math.inf else 0
            if cost <= budget and len(kept) < room:
                budget -= cost
                kept.add(id(entry))
        return [e for e in pool if id(e) in kept]

    def _entry_bytes(self, entry: KnowledgeEntry) -> int:
        """An entry's bytes on the wire: each tensor sparse (values + u32 indices) or dense, the smaller."""
        value = VALUE_BYTES.get(self.fed.wire.value_dtype, 4)
        total = 0
        for t in entry.tensors.values():
            numel = int(np.prod(t.shape))
            nnz = t.nnz if isinstance(t, SparseTensor) else int(np.count_nonzero(t))
            total += min(numel * value, nnz * (value + 4))
        return total


def _with_extra(base: SparseTensor, extra: Tensor, name: str) -> SparseTensor:
    """The packed selection plus the catch-up entries (outside it) as one sparse tensor."""
    if not isinstance(extra, SparseTensor) or extra.shape != base.shape:
        raise ValueError(f"{name}: expected a sparse tensor of shape {base.shape}")
    if np.intersect1d(base.indices, extra.indices).size:
        raise ValueError(f"{name}: catch-up entries inside the round's selection")
    order = np.argsort(np.concatenate([base.indices, extra.indices]), kind="stable")
    indices = np.concatenate([base.indices, extra.indices])[order]
    return SparseTensor(base.shape, indices, np.concatenate([base.values, extra.values])[order])


def _dense(tensors: dict[str, Tensor], name: str, shape: tuple[int, ...]) -> np.ndarray:
    t = tensors.get(name)
    if not isinstance(t, np.ndarray) or t.shape != tuple(shape):
        raise ValueError(f"{name}: expected a dense tensor of shape {tuple(shape)}")
    return t


def _full_shape(tensors: dict[str, Tensor], name: str, shape: tuple[int, ...]) -> Tensor:
    t = tensors.get(name)
    if t is None or tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected a tensor of shape {tuple(shape)} at the end of a task")
    return t


class ConFedMADEStrategy(DecomposedStrategy):
    restrict_to_made_mask = True
