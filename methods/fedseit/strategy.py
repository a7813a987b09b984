"""FedSeIT on the aggregator (NumPy only): masked FedAvg of the conv bases, a knowledge base
of task-adaptive A's keyed by their task's document centres, and each device's slots.

* Every round: the sample-weighted mean of ``B * sigmoid(m)`` over the devices that sent
  each element (``fclcore.aggregation.weighted_average``), as FedWeIT does (notes G11).  By
  default that mean is the true model ``W`` (``W`` where nobody sent) and the announcement
  moves the held model towards it by top-k (``wire.COMPRESSION``).
* A task's last round: each device's sparse A_t (its largest entries) becomes entry ``<client>/t<task>``.
* Slots (the per-client downlink): without SIT, at a task's first round, the previous
  task's entries of up to ``slots`` clients, the device's own first (sent by id: it has
  it).  With SIT, the device's centres arrive with the task's first update; at the second
  round every stored entry of an earlier task (own included) is scored against them (mean
  pairwise cosine, ``methods.fedseit.sit``) and the top K go down with their scores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from fclbases.update_checks import refuse_unexpected, task_report
from fclcore.aggregation import RunningSum
from fclcore.codec import Frame, SparseTensor, Tensor
from fclcore.masked_upload import UNITS, unpack
from fclcore.schema import FederationSpec
from fclcore.sparsify import REJECT, Compression, TrueModel, kept_count
from fclcore.strategy import Checked, Downlinks, Rejected, Strategy, Update, tensor_nbytes, without_tensors
from methods.fedseit import sit
from methods.fedseit.config import FedSeITOptions
from methods.fedseit.wire import (
    CENTRES,
    COMPRESSION,
    KB_PREFIX,
    Entry,
    base_shapes,
    conv_name,
    embedding_dim,
    entry_id,
    kept_units,
    knowledge_key,
    parse_report,
)

TRUE = "true/"  # checkpoint prefix of the bases' true mean (the announcement's residual is W - A)


@dataclass(frozen=True)
class Parsed:
    task: int
    foreign: list[str]
    centres: np.ndarray | None


class FedSeITStrategy(Strategy):
    streams = True  # the bases are a weighted sum; centres and A_t are kept per update (small)

    def __init__(self, fed: FederationSpec, options: FedSeITOptions, input_dim: int, aux_dir: str | None = None):
        super().__init__(fed, options, input_dim, aux_dir)
        self.opts = options
        self.embed_dim = embedding_dim()
        self.shapes = base_shapes(options.kernel_sizes, options.filters, self.embed_dim, options.num_slots, options.dls)
        self.convs = [conv_name(k) for k in options.kernel_sizes]
        self.knowledge: dict[tuple[str, int], dict[str, SparseTensor]] = {}  # (client, task) -> A_t per conv
        self.keys: dict[tuple[str, int], np.ndarray] = {}  # (client, task) -> centres (q, D)
        self.sent: dict[str, list[str]] = {}  # client -> entry ids in its slots for the task in hand
        compression = Compression.of(fed.wire, COMPRESSION)
        if compression.up_density is not None:
            raise ValueError(
                "federation.wire.sparsify: fedseit sends the masked base on its kept units "
                "(options.keep_units); leave sparsify out or set it to none"
            )
        down = compression.down_density
        self.true = None if down is None else TrueModel(down, fed.wire.error_feedback)

    def initial_model(self) -> dict[str, np.ndarray]:
        """Each base drawn like torch's default conv/linear init: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
        rng = np.random.default_rng((self.fed.seed, 17))
        return {
            name: rng.uniform(-1, 1, shape).astype(np.float32) / np.float32(np.sqrt(shape[1]))
            for name, shape in self.shapes.items()
        }

    # -- rounds ----------------------------------------------------------------------------
    def _sit_round(self, rnd: int) -> bool:
        """The round whose per-client frames carry SIT's choice: a task's second round."""
        place = self.schedule.place(rnd)
        return self.opts.sit and not place.task_start and rnd == self.schedule.starts[place.task] + 1

    def announce_meta(self, rnd: int) -> dict:
        place = self.schedule.place(rnd)
        frames = place.task > 0 and (self._sit_round(rnd) if self.opts.sit else place.task_start)
        return {"client_frames": frames}

    def client_downlinks(self, rnd: int, clients: Sequence[str]) -> Downlinks:
        if not self.announce_meta(rnd)["client_frames"]:
            return {}
        task = self.schedule.task_of(rnd)
        out: Downlinks = {}
        for client in clients:
            chosen = self._select(client, task)
            self.sent[client] = [e.id for e in chosen]
            tensors: dict[str, Tensor] = {}
            for e in chosen:
                if not e.own:
                    for name, t in self.knowledge[(e.client, e.task)].items():
                        tensors[knowledge_key(e.id, name)] = t
            out[client] = ({"for_task": task, "sit": self.opts.sit, "entries": [e.to_meta() for e in chosen]}, tensors)
        return out

    def _select(self, client: str, task: int) -> list[Entry]:
        if not self.opts.sit:
            stored = sorted((c for (c, t) in self.knowledge if t == task - 1), key=lambda c: (c != client, c))
            n = len(stored[: self.opts.slots])
            return [Entry(entry_id(c, task - 1), c, task - 1, 1.0 / n, c == client) for c in stored[:n]]
        query = self.keys.get((client, task))
        pool = {e: self.keys[e] for e in self.knowledge if e[1] < task and e in self.keys}
        if query is None or not pool:
            return []  # no centres from this device for this task (it missed the first round)
        best = sit.top_k(query, pool, self.opts.sit_k, self.opts.sit_tau)
        return [Entry(entry_id(c, t), c, t, s, c == client) for (c, t), s in best]

    def downlink_log(self, meta: dict) -> dict:
        return {"entries": [e["id"] for e in meta["entries"]], "scores": [e["score"] for e in meta["entries"]]}

    # -- updates ---------------------------------------------------------------------------
    def normalize(self, frame: Frame) -> Checked:
        rnd, client = frame.header.round, frame.header.client
        place = self.schedule.place(rnd)
        out: dict[str, Tensor] = {}
        expected = set()
        for name, shape in self.shapes.items():
            out[name] = unpack(name, frame.tensors, shape, None)
            expected |= {name, name + UNITS}
            units, bound = out[name].nnz // shape[1], kept_units(self.opts.keep_units, shape[0])
            if units > bound:
                raise Rejected(REJECT, f"{name}{UNITS}: {units} units, at most {bound} (keep_units)")
        if place.task_end:
            for name in self.convs:
                t = frame.tensors.get(KB_PREFIX + name)
                if t is None or tuple(t.shape) != self.shapes[name]:
                    raise Rejected("knowledge", f"{KB_PREFIX}{name}: expected shape {self.shapes[name]} at a task end")
                nnz = t.nnz if isinstance(t, SparseTensor) else int(np.count_nonzero(t))
                bound = kept_count(int(np.prod(self.shapes[name])), self.opts.kb_density)
                if nnz > bound:
                    raise Rejected(REJECT, f"{KB_PREFIX}{name}: {nnz} entries, at most {bound} (kb_density)")
                out[KB_PREFIX + name] = t
                expected.add(KB_PREFIX + name)
        centres = None
        if self.opts.sit and place.task_start:
            centres = self._centres(frame.tensors.get(CENTRES))
            expected.add(CENTRES)
        refuse_unexpected(frame.tensors, expected)
        for name, t in out.items():
            values = t.values if isinstance(t, SparseTensor) else t
            if not np.isfinite(values).all():
                raise Rejected("nonfinite", f"{name}: NaN or infinite values")
        report = task_report(parse_report, frame.meta, place.task, "fedseit")
        unknown = [i for i in report["foreign"] if i not in self.sent.get(client, [])]
        if place.task > 0 and unknown:
            raise Rejected("entries", f"meta.fedseit.foreign names entries never sent to {client}: {unknown[:3]}")
        return Checked(out, Parsed(report["task"], report["foreign"], centres))

    def bytes_by_kind(self, tensors, meta=None) -> dict[str, int]:
        out = {"base": 0, "adaptive": 0, "centres": 0}
        for name, t in tensors.items():
            kind = "adaptive" if name.startswith(KB_PREFIX) else "centres" if name == CENTRES else "base"
            out[kind] += tensor_nbytes(t)
        return out

    def _centres(self, t: Tensor | None) -> np.ndarray:
        if t is None or isinstance(t, SparseTensor) or t.ndim != 2 or t.shape[1] != self.embed_dim:
            raise Rejected("centres", f"{CENTRES}: expected a dense (q, {self.embed_dim}) matrix")
        if not 1 <= t.shape[0] <= self.opts.sit_q:
            raise Rejected("centres", f"{CENTRES}: {t.shape[0]} centres, expected 1..{self.opts.sit_q}")
        if not np.isfinite(t).all() or not (np.linalg.norm(t, axis=1) > 0).all():
            raise Rejected("centres", f"{CENTRES}: NaN, infinite or all-zero centres")
        return np.array(t, dtype=np.float32)

    def fold(self, running: RunningSum, update: Update) -> Update:
        running.add({k: v for k, v in update.tensors.items() if k in self.shapes}, float(update.n_samples))
        return without_tensors(update, keep={k: v for k, v in update.tensors.items() if k.startswith(KB_PREFIX)})

    def close(self, running: RunningSum, kept: Sequence[Update], current: dict[str, np.ndarray]) -> dict:
        if self.true is None:
            merged = running.result(current)
        else:  # W becomes the masked mean (W where nobody sent); devices get a top-k move towards it
            true = {n: self.true.values.get(n, current[n]) for n in self.shapes}
            merged = running.result(true)
            merged = {n: self.true.step(n, current[n], merged[n].astype(np.float64) - true[n]) for n in merged}
        place = self.schedule.place(kept[0].frame.header.round)
        for u in kept:
            if u.parsed is not None and u.parsed.centres is not None:
                self.keys[(u.client, place.task)] = u.parsed.centres
            if place.task_end:
                self.knowledge[(u.client, place.task)] = {
                    name: _sparse(u.tensors[KB_PREFIX + name]) for name in self.convs
                }
        return merged

    # -- checkpoint ------------------------------------------------------------------------
    def state(self) -> tuple[dict, dict[str, np.ndarray]]:
        arrays: dict[str, np.ndarray] = {}
        entries = []
        for i, ((client, task), tensors) in enumerate(sorted(self.knowledge.items())):
            for name, t in tensors.items():
                arrays[f"kb/{i}/{name}/indices"] = t.indices
                arrays[f"kb/{i}/{name}/values"] = t.values.astype(np.float32)
            entries.append({"client": client, "task": task})
        keys = []
        for i, ((client, task), centres) in enumerate(sorted(self.keys.items())):
            arrays[f"key/{i}"] = centres
            keys.append({"client": client, "task": task})
        if self.true is not None:
            arrays.update(self.true.state(TRUE))
        return {"knowledge": entries, "keys": keys, "sent": self.sent}, arrays

    def restore(self, meta: dict, arrays: dict[str, np.ndarray]) -> None:
        try:
            knowledge = {}
            for i, e in enumerate(meta.get("knowledge", [])):
                knowledge[(str(e["client"]), int(e["task"]))] = {
                    name: SparseTensor(
                        self.shapes[name], arrays[f"kb/{i}/{name}/indices"], arrays[f"kb/{i}/{name}/values"]
                    )
                    for name in self.convs
                }
            keys = {(str(e["client"]), int(e["task"])): arrays[f"key/{i}"] for i, e in enumerate(meta.get("keys", []))}
        except (KeyError, TypeError) as exc:
            raise ValueError(f"fedseit checkpoint: missing or malformed {exc}") from None
        if self.true is not None:  # a checkpoint from before compression has none: devices hold W
            self.true.restore(arrays, TRUE, self.shapes)
        self.knowledge, self.keys = knowledge, keys
        self.sent = {str(c): [str(i) for i in ids] for c, ids in dict(meta.get("sent", {})).items()}


def _sparse(t: Tensor) -> SparseTensor:
    return t if isinstance(t, SparseTensor) else SparseTensor.from_dense(np.asarray(t, dtype=np.float32))
