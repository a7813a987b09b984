"""FedSeIT and FedWeIT-on-CNN on the device (FedSeIT paper eq. 1-5, Alg. 1; notes G2-G12).

Loss for task t (eq. 5 as the notes G6 settle it):

    mean CE + lambda1 * sum_{i<=t} |A_i|_1 + lambda2 * sum_{i<t} ||dB * sigmoid(m_i) + dA_i||^2

over the convs (and, with DLS, W_f and W_c), d = the change since the end of task t-1.  The
paper prints ``dB * m_i - dA_i``; what it means (and what FedWeIT does) is the drift of
theta_i, so the sum is used.  Earlier tasks' m_i, biases, slots, projections and heads are
frozen; their A_i stay trainable.  Every round the optimiser starts afresh (Adam), the
batch order and dropout are seeded by (seed, client, round), so a device restored from its
checkpoint continues identically.

Each round the device uploads ``B * sigmoid(m_t)`` on its kept units and merges the average
back as ``B <- G / sigmoid(m_t)`` on the entries it sent (notes G11) that the announcement
changed: under the default sparse announcements (``wire``) an entry it left as it was is stale,
and the device's own value is the newer one; at a task's end, A_t's largest entries
(``shared_adaptive``); with SIT, at a task's first round, the centres of the task's documents.
"""

from __future__ import annotations

import copy
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from fclcore import optim
from fclcore.codec import Frame, SparseTensor, Tensor
from fclcore.data import Dataset
from fclcore.device import float32_only
from fclcore.learner import Learner, round_seed
from fclcore.masked_upload import MIN_GATE, dense, pack, top_units
from fclcore.schedule import RoundPlace
from fclcore.schema import FederationSpec
from fclcore.served import FrozenTable, TextTasksServed
from fclcore.sparsify import kept_count, top_k
from fclcore.text import default_tokenizer_json
from methods.fedseit import sit
from methods.fedseit.config import FedSeITOptions
from methods.fedseit.model import SPECIAL_IDS, WORD_EMBEDDINGS, ServedTextCNN, TextCNN, load_embedding
from methods.fedseit.wire import CENTRES, KB_PREFIX, META_KEY, WC_NAME, conv_name, knowledge_key, parse_entries, wf_name

EVAL_BATCH = 128


class FedSeITLearner(Learner):
    metric = "accuracy"
    segregated = True  # FedSeIT's separate foreign branches; False: FedWeIT's sum in the filters

    def __init__(self, fed: FederationSpec, options: FedSeITOptions, input_dim: int, client_index: int) -> None:
        super().__init__(fed, options, input_dim, client_index)
        self.opts = options
        torch.manual_seed(fed.seed)
        embedding, self.embed_scale = load_embedding(options.embed_rms)
        self.model = TextCNN(
            embedding,
            options.kernel_sizes,
            options.filters,
            options.num_slots,
            options.dropout,
            self.segregated,
            options.dls and self.segregated,
        )
        self.labels: list[list[int]] = []  # per task: global class ids in head order
        self.slot_ids: list[list[str]] = []  # per task: entry ids in its slots
        self.uploaded: dict[int, list[np.ndarray]] = {}  # own task -> the A it sent (per conv)
        self.sent: dict[str, np.ndarray] = {}  # base name -> entries uploaded last round
        self.held: dict[str, np.ndarray] = {}  # base name -> the global model as last announced
        self.anchor: dict[str, tuple[torch.Tensor, list[torch.Tensor]]] = {}  # end of the previous task
        self._cache: dict[tuple[int, int], tuple[np.ndarray, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.values_sent = 0
        self.centres: np.ndarray | None = None  # SIT's key of the task in hand, sent with its first update
        self.device = torch.device("cpu")  # where the model trains (``place``)

    def place(self, device: torch.device, amp: str) -> None:
        """The model moves to ``device`` with its frozen word-embedding table (read by every
        forward pass: a lookup there beats sending (B, L, D) embeddings per batch), the foreign
        slots and the drift anchors; each batch's token ids follow it, the shards stay in host
        memory, uploads and the served model come back to the CPU.  float32 only."""
        float32_only(self.fed.method, amp)
        self.device = device
        self.model.to(device)
        self.anchor = {
            n: (base.to(device), [a.to(device) for a in adaptive]) for n, (base, adaptive) in self.anchor.items()
        }
        self._cache = {}  # slot features: computed again on the device

    # -- names -----------------------------------------------------------------------------
    def bases(self) -> dict[str, object]:
        """Federated base name -> its ``Decomposed`` (the wire's names)."""
        out = {conv_name(k): c for k, c in zip(self.opts.kernel_sizes, self.model.convs)}
        if self.model.dls:
            out.update({wf_name(k): w for k, w in zip(self.opts.kernel_sizes, self.model.wf)})
            out[WC_NAME] = self.model.wc
        return out

    # -- federation ------------------------------------------------------------------------
    @torch.no_grad()
    def load_global(self, tensors: dict[str, Tensor], rnd: int, meta: dict | None = None) -> None:
        bases = self.bases()
        values = {}
        for name, d in bases.items():
            t = tensors.get(name)
            flat = (d.shape[0], int(np.prod(d.shape[1:])))
            if t is None or tuple(t.shape) != flat:
                raise ValueError(f"{name}: expected a tensor of shape {flat} in the global model")
            values[name] = torch.from_numpy(dense(t).reshape(d.shape))
            if not torch.isfinite(values[name]).all():
                raise ValueError(f"{name}: NaN or infinite values in the global model")
        for name, d in bases.items():
            before, self.held[name] = self.held.get(name), values[name].numpy().reshape(d.shape[0], -1).copy()
            g = values[name].to(self.device)
            if self.task < 0:
                d.base.copy_(g)  # first contact: the global model is the base
                continue
            sent = self.sent.get(name)
            if sent is None:
                continue  # nothing sent yet in this life of the learner: keep the local base
            if before is not None and before.shape == sent.shape:  # what the announcement left is stale
                sent = sent & (before.view(np.uint32) != self.held[name].view(np.uint32))
            gate = torch.sigmoid(d.masks[self.task]).clamp_min(MIN_GATE).reshape(d.gate(self.task).shape)
            d.base.copy_(torch.where(torch.from_numpy(sent).reshape(d.shape).to(self.device), g / gate, d.base))

    def start_task(self, task: int, downlink: Frame | None) -> None:
        entries = self._entries(downlink, task) if downlink is not None else None  # validate first
        super().start_task(task, downlink)
        self.model.add_task(self.opts.mask_init, self.opts.adaptive_div)
        for d in self.model.decomposed:  # earlier tasks' masks and everything else they own is frozen
            for i in range(task):
                d.masks[i].requires_grad_(False)
        for parts in self.model.tasks[:task]:
            parts.requires_grad_(False)
        self.slot_ids.append([])
        if entries:
            self._fill(task, *entries)

    def receive_frame(self, frame: Frame, rnd: int) -> None:
        """SIT's choice for the task in hand (its second round)."""
        if self.slot_ids[self.task]:
            raise ValueError(f"task {self.task}'s slots are filled already")
        self._fill(self.task, *self._entries(frame, self.task))

    def _entries(self, frame: Frame, task: int) -> tuple[list, list[list[torch.Tensor] | None]]:
        """The frame's entries and, per entry, its A per conv; ValueError if anything is off."""
        entries = parse_entries(frame.meta, task)
        if len(entries) > self.model.slots:
            raise ValueError(f"knowledge: {len(entries)} entries for {self.model.slots} slots")
        me = self._me(entries)
        weights = []
        for e in entries:
            if e.own:
                if e.client != me:
                    raise ValueError(f"knowledge: {e.id} is not an entry this device uploaded")
                # a device being rebuilt from its checkpoint gets its uploads (and this slot) back
                # from ``load_state``; until then, or if it never sent that A, the slot stays empty
                own = self.uploaded.get(e.task)
                weights.append(None if own is None else [torch.from_numpy(a) for a in own])
                continue
            per_conv = []
            for k, conv in zip(self.opts.kernel_sizes, self.model.convs):
                t = frame.tensors.get(knowledge_key(e.id, conv_name(k)))
                flat = (conv.shape[0], int(np.prod(conv.shape[1:])))
                if t is None or tuple(t.shape) != flat:
                    raise ValueError(f"knowledge entry {e.id}: missing or misshaped {conv_name(k)}")
                a = dense(t)
                if not np.isfinite(a).all():
                    raise ValueError(f"knowledge entry {e.id}: NaN or infinite values")
                per_conv.append(torch.from_numpy(a.reshape(conv.shape)))
            weights.append(per_conv)
        return entries, weights

    def _me(self, entries: list) -> str | None:
        own = {e.client for e in entries if e.own}
        if len(own) > 1:
            raise ValueError("knowledge: entries of two different clients are marked as this device's own")
        return own.pop() if own else None

    def _fill(self, task: int, entries: list, weights: list[list[torch.Tensor] | None]) -> None:
        total = sum(max(e.score, 0.0) for e in entries)
        for slot, (e, w) in enumerate(zip(entries, weights)):
            if w is None:
                continue
            if self.segregated:  # normalised score; never 0 (a dead ReLU would get no gradient)
                alpha = e.score / total if total > 0 else 1.0 / len(entries)
                alpha = alpha if alpha > 0 else 1.0 / len(entries)
            else:
                alpha = 0.0  # FedWeIT: attention starts at 0
            self.model.fill_slot(task, slot, w, alpha)
        self.slot_ids[task] = [e.id for e in entries]
        self._cache = {k: v for k, v in self._cache.items() if k[0] != task}

    # -- training --------------------------------------------------------------------------
    def train_round(self, train: Sequence[Dataset], rnd: int, place: RoundPlace) -> tuple[int, float | None]:
        t = self.task
        data = train[t]
        self._ensure_head(t, data)
        if self.opts.sit and place.task_start:
            self.centres = self._centres(data)
        seed = round_seed(self.fed.seed, self.client_index, rnd)
        torch.manual_seed(seed)
        rng = np.random.default_rng(seed)
        ids = torch.from_numpy(data.x.astype(np.int64))
        y = torch.from_numpy(self._targets(t, data.y))
        cache = self._slot_cache(t, data.x) if self.segregated else None
        self.model.train()
        params = self._trainable(t)
        opt = optim.Adam(params, lr=self.fed.train.lr)
        total, batches = 0.0, 0
        bs = self.fed.train.batch_size
        for _ in range(self.fed.train.local_epochs):
            order = torch.from_numpy(rng.permutation(len(y)))
            for start in range(0, len(y), bs):
                idx = order[start : start + bs]
                batch_cache = (cache[0][idx], cache[1][idx]) if cache is not None else None
                logits = self.model.logits(ids[idx].to(self.device), t, batch_cache)
                ce = F.cross_entropy(logits, y[idx].to(self.device))
                loss = ce + self._regularizer(t)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                total, batches = total + ce.item(), batches + 1
        self.model.eval()
        if place.task_end:
            self._set_anchor()
        return len(y), total / max(batches, 1)

    def _ensure_head(self, task: int, data: Dataset) -> None:
        if self.model.tasks[task].head is None:
            labels = sorted(int(c) for c in np.unique(data.y))
            if not labels:
                raise ValueError(f"task {task}: no training data")
            self.labels.append(labels)
            self.model.add_head(task, len(labels))

    def _targets(self, task: int, y: np.ndarray) -> np.ndarray:
        lookup = {c: i for i, c in enumerate(self.labels[task])}
        return np.array([lookup.get(int(c), -1) for c in y], dtype=np.int64)

    def _trainable(self, t: int) -> list[torch.nn.Parameter]:
        """This task's parameters, the shared bases and every earlier task's A."""
        params: list[torch.nn.Parameter] = []
        for d in self.model.decomposed:
            params += [d.base, d.masks[t], *d.adaptive[: t + 1]]
        parts = self.model.tasks[t]
        params += [p for p in parts.parameters()]
        return params

    def _regularizer(self, t: int) -> torch.Tensor:
        total = torch.zeros((), device=self.device)
        for name, d in self.bases().items():
            total = total + self.opts.lambda1 * sum(a.abs().sum() for a in d.adaptive[: t + 1])
            if t == 0 or self.opts.lambda2 == 0 or name not in self.anchor:
                continue
            base0, adaptive0 = self.anchor[name]
            d_base = d.base - base0
            for i in range(t):
                drift = d_base * d.gate(i) + (d.adaptive[i] - adaptive0[i])
                total = total + self.opts.lambda2 * drift.pow(2).sum()
        return total

    @torch.no_grad()
    def _set_anchor(self) -> None:
        """The drift anchor of the next task: B and every A_i as this task ends (notes G6)."""
        self.anchor = {
            name: (d.base.detach().clone(), [a.detach().clone() for a in d.adaptive])
            for name, d in self.bases().items()
        }

    @torch.no_grad()
    def _slot_cache(self, task: int, x: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Max and min over time of every slot's conv on ``x`` (frozen inputs: computed once)."""
        key = (task, id(x))
        hit = self._cache.get(key)
        if hit is None or hit[0] is not x:
            ids = torch.from_numpy(x.astype(np.int64))
            parts = [
                self.model.slot_features(ids[i : i + EVAL_BATCH].to(self.device), task)
                for i in range(0, len(ids), EVAL_BATCH)
            ]
            hit = (x, (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])))
            self._cache[key] = hit
        return hit[1]

    def _centres(self, data: Dataset) -> np.ndarray:
        """k-means centres of the task's documents' mean (unscaled) word embeddings (notes G7-G8)."""
        ids = torch.from_numpy(data.x.astype(np.int64)).to(self.device)
        keep = ~torch.isin(ids, torch.tensor(SPECIAL_IDS, device=self.device))
        vectors = (F.embedding(ids, self.model.embedding) * keep[..., None]).sum(1) / keep.sum(
            1, keepdim=True
        ).clamp_min(1)
        vectors = (vectors / self.embed_scale).cpu().numpy()
        q = sit.centre_count(len(vectors), self.opts.sit_q)
        return sit.kmeans(vectors, q, (self.fed.seed, self.client_index, self.task))

    # -- upload ----------------------------------------------------------------------------
    @torch.no_grad()
    def upload(self, rnd: int, place: RoundPlace) -> dict[str, Tensor]:
        out: dict[str, Tensor] = {}
        self.values_sent = 0
        for name, d in self.bases().items():
            gate = torch.sigmoid(d.masks[self.task])
            units = top_units(gate.cpu().numpy(), self.opts.keep_units)
            effective = (d.base * d.gate(self.task)).reshape(d.shape[0], -1).cpu().numpy()
            out.update(pack(name, effective, None, units))
            self.sent[name] = np.broadcast_to(units[:, None], effective.shape).copy()
            self.values_sent += int(self.sent[name].sum())
        if place.task_end:
            kept = []
            for k, conv in zip(self.opts.kernel_sizes, self.model.convs):
                a = shared_adaptive(conv.adaptive[self.task].detach().cpu().numpy(), self.opts)
                kept.append(a)
                out[KB_PREFIX + conv_name(k)] = SparseTensor.from_dense(a.reshape(conv.shape[0], -1))
            self.uploaded[self.task] = kept
        if self.opts.sit and place.task_start:
            out[CENTRES] = self.centres
        return out

    def report(self, place: RoundPlace) -> dict:
        rep: dict = {"task": self.task, "foreign": list(self.slot_ids[self.task])}
        if place.task_end:
            rep["alpha"] = [round(float(a), 5) for a in self.model.tasks[self.task].alpha.detach().mean(1)]
            rep["kb_values"] = int(sum(int(np.count_nonzero(a)) for a in self.uploaded.get(self.task, [])))
        return {META_KEY: rep, "base_values": self.values_sent}

    # -- evaluation and serving ------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, tests: Sequence[Dataset | None]) -> list[float | None]:
        self.model.eval()
        out: list[float | None] = []
        for i, d in enumerate(tests):
            if d is None or len(d) == 0:
                out.append(None)
                continue
            if i >= len(self.labels):  # no head yet (before its first round): it classifies nothing
                out.append(0.0)
                continue
            cache = self._slot_cache(i, d.x) if self.segregated else None
            ids = torch.from_numpy(d.x.astype(np.int64))
            preds = []
            for s in range(0, len(ids), EVAL_BATCH):
                part = (cache[0][s : s + EVAL_BATCH], cache[1][s : s + EVAL_BATCH]) if cache is not None else None
                preds.append(self.model.logits(ids[s : s + EVAL_BATCH].to(self.device), i, part).argmax(1))
            y = self._targets(i, d.y)
            out.append(float((torch.cat(preds).cpu().numpy() == y).mean()))
        return out

    @torch.no_grad()
    def served_model(self, task: int, binarize: str = "") -> TextTasksServed | None:
        trained = len(self.labels)
        if trained == 0:
            return None
        emb = self.model.embedding
        # the frozen table and the slots of tasks before this one (never written again: a task's
        # slots are filled while it is the task in hand) are shared, not copied, on the CPU
        memo = {id(fa): fa for per_conv in self.model.foreign[: self.task] for fa in per_conv}
        snapshot = copy.deepcopy(self.model, memo={id(emb): emb, **memo}).cpu()
        snapshot.eval()
        for p in snapshot.parameters():
            p.requires_grad_(False)
        module = ServedTextCNN(snapshot, trained, [len(lab) for lab in self.labels]).eval()
        table = FrozenTable(  # load_embedding's rescaled wordpiece table: named by the snapshot, not copied
            emb.numpy(), str(default_tokenizer_json().parent), WORD_EMBEDDINGS, self.embed_scale, (0,)
        )
        return TextTasksServed(
            module=module,
            labels=[list(lab) for lab in self.labels],
            class_names=[str(c) for c in range(1 + max(max(lab) for lab in self.labels))],
            task=trained - 1,
            max_length=self.opts.max_length,
            method=self.fed.method,
            frozen=(table,),
        )

    # -- checkpoints -----------------------------------------------------------------------
    def state(self) -> tuple[dict, dict[str, np.ndarray]]:
        arrays = {f"model/{k}": v.detach().cpu().numpy().copy() for k, v in self.model.state_dict().items()}
        for t, per_conv in enumerate(self.model.foreign):
            for j, fa in enumerate(per_conv):
                arrays[f"foreign/{t}/{j}"] = fa.cpu().numpy().copy()
        for name, sent in self.sent.items():
            arrays[f"sent/{name}"] = sent.astype(np.uint8)
        for name, held in self.held.items():
            arrays[f"held/{name}"] = held
        for name, (base, adaptive) in self.anchor.items():
            arrays[f"anchor/{name}/base"] = base.cpu().numpy().copy()
            for i, a in enumerate(adaptive):
                arrays[f"anchor/{name}/adaptive/{i}"] = a.cpu().numpy().copy()
        for t, per_conv in self.uploaded.items():
            for j, a in enumerate(per_conv):
                arrays[f"uploaded/{t}/{j}"] = a
        meta = {
            "labels": self.labels,
            "slot_ids": self.slot_ids,
            "uploaded": sorted(self.uploaded),
            "anchor": {name: len(a) for name, (_, a) in self.anchor.items()},
        }
        return meta, arrays

    def load_state(self, meta: dict, arrays: dict[str, np.ndarray]) -> None:
        try:
            labels = [[int(c) for c in lab] for lab in meta["labels"]]
            for t, lab in enumerate(labels):
                if t < len(self.model.tasks) and self.model.tasks[t].head is None:
                    self.model.add_head(t, len(lab))
            state = {
                k[len("model/") :]: torch.from_numpy(v.copy()) for k, v in arrays.items() if k.startswith("model/")
            }
            self.model.load_state_dict(state, strict=True)
            for t, per_conv in enumerate(self.model.foreign):
                for j in range(len(per_conv)):
                    per_conv[j] = torch.from_numpy(arrays[f"foreign/{t}/{j}"].copy()).to(self.device)
            self.sent = {k[len("sent/") :]: v.astype(bool) for k, v in arrays.items() if k.startswith("sent/")}
            self.held = {k[len("held/") :]: v.copy() for k, v in arrays.items() if k.startswith("held/")}
            self.anchor = {
                name: (
                    torch.from_numpy(arrays[f"anchor/{name}/base"].copy()).to(self.device),
                    [torch.from_numpy(arrays[f"anchor/{name}/adaptive/{i}"].copy()).to(self.device) for i in range(n)],
                )
                for name, n in meta["anchor"].items()
            }
            self.uploaded = {
                int(t): [arrays[f"uploaded/{t}/{j}"].copy() for j in range(len(self.model.convs))]
                for t in meta["uploaded"]
            }
        except (KeyError, RuntimeError, TypeError) as exc:
            raise ValueError(f"fedseit checkpoint does not fit: {exc}") from None
        self.labels, self.slot_ids = labels, [list(s) for s in meta["slot_ids"]]
        self._cache = {}


def shared_adaptive(a: np.ndarray, opts: FedSeITOptions) -> np.ndarray:
    """What of A_t goes to the knowledge base: its ``kb_density`` largest entries by magnitude,
    none below ``kb_threshold``; the rest 0.  The device keeps its own A_t whole."""
    out = np.zeros_like(a)
    flat = np.where(np.abs(a) < opts.kb_threshold, 0.0, a).reshape(-1)
    index = top_k(flat, kept_count(flat.size, opts.kb_density))
    out.reshape(-1)[index] = flat[index]
    return out


class FedWeITCNNLearner(FedSeITLearner):
    """FedWeIT on the text CNN: the foreign A's summed into the filters with attention alpha."""

    segregated = False
