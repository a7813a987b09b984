"""ConFedMADE and FedWeIT-MADE on the device (ConFedMADE paper, eq. 5-6, Algorithms 1-2).

Loss for task t (eq. 6, as specified for this toolkit):

    NLL + lambda1 * sum_{i<=t} |A_i * M|_1 + lambda2 * sum_{i<t} ||dB * sigmoid(m_i) + dA_i||^2

with M the *current* MADE mask (the reference code used the build-time mask), dB and dA_i
the change since the start of the task.  The methods differ in three switches:

* ``confedmade``: masks synchronised by seed, M inside the L1 term, uploads restricted to
  the round's MADE mask;
* ``fedweit-made-star``: synchronised masks, FedWeIT's unmasked L1, unmasked uploads;
* ``fedweit-made``: the naive combination: every client draws its own MADE masks.

Each round the device uploads B * sigmoid(m_t) on the kept units (the ``keep_units`` share
ranked by sigmoid(m_t)) and, for confedmade, inside the MADE mask; it merges the average
back as B <- G / sigmoid(m_t) on exactly the entries it sent, so its effective base equals
the federation's.  At the end of a task it sends A_t, thresholded, for the knowledge base.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Sequence

import numpy as np
import torch

from fclbases.made.decomposed_model import DecomposedMADE
from fclbases.made.learner import MadeLearner, mean_nll
from fclbases.made.options import step_order, upload_order
from fclcore import optim
from fclcore.codec import Frame, SparseTensor, Tensor
from fclcore.data import Dataset
from fclcore.made_spec import made_masks, mask_for_param
from fclcore.masked_upload import MIN_GATE, dense, pack, selection, top_units
from fclcore.procmem import release_free_memory
from fclcore.schedule import RoundPlace, TaskSchedule
from fclcore.schema import FederationSpec
from fclcore.served import ServedModel
from methods.confedmade.kbstore import KnowledgeStore
from methods.confedmade.penalty import PenaltyTerms, WeightPenalty, Workspace
from methods.confedmade.wire import EXTRA, HELD, KB_PREFIX, knowledge_key, parse_knowledge_meta, shares_knowledge


class DecomposedLearner(MadeLearner):
    """FedWeIT-MADE*: synchronised masks, FedWeIT's unmasked L1, unmasked uploads."""

    masked_l1 = False  # M inside the L1 term
    restrict_to_made_mask = False  # uploads restricted to the round's MADE mask (with upload_made_mask)
    own_masks = False  # every client draws its own MADE masks
    compact_pixels = True  # uint8 0/1 shards are converted per batch (local_epochs, mean_nll)
    step_in_backward = True  # B and the A_i: up to 6 weight-sized gradients per layer never held together
    masked_moments = False  # options.masked_moments when the scenario leaves it unset

    def __init__(self, fed: FederationSpec, options: Any, input_dim: int, client_index: int) -> None:
        super().__init__(fed, options, input_dim, client_index)
        if self.own_masks:  # independent masks: the naive combination
            self.made = dataclasses.replace(self.made, mask_seed=self.made.mask_seed + 7919 * (client_index + 1))
        self.opts = options
        self.masked = self.masked_l1
        self.restrict_upload = self.restrict_to_made_mask and options.upload_made_mask
        self.hold = self.masked_moments if options.masked_moments is None else options.masked_moments
        torch.manual_seed(fed.seed)
        self.model = DecomposedMADE(self.made)
        self.sent: dict[str, np.ndarray] = {}  # layer prefix -> entries uploaded last round
        self.global_weight: dict[str, np.ndarray] = {}  # layer prefix -> the global B*sigmoid(m) last loaded
        self.anchor: dict[str, tuple[torch.Tensor, list[torch.Tensor]]] = {}  # B, A_i at task start
        self.entries: list[list[str]] = []  # knowledge-base entry ids per task
        self.values_sent = 0
        self.work = Workspace()  # the penalty's scratch buffers
        self.kb: KnowledgeStore | None = None
        self.num_tasks = TaskSchedule.from_federation(fed).num_tasks

    def place(self, device: torch.device, amp: str) -> None:
        """The model with its knowledge stacks and settled terms, the optimiser's moments, the
        drift anchors and the penalty's workspace move to ``device``; what a task start builds
        is built there.  The knowledge store stays on disk and each frame's entries in host
        memory until the task that uses them starts; uploads come back as host arrays."""
        super().place(device, amp)
        self.anchor = {p: _moved(a, device) for p, a in self.anchor.items()}
        self.work = Workspace(device)
        if self.model.num_tasks:
            self.work.reserve(max(layer.weight.numel() for layer in self.model.layers.values()))
        if self.optimizer is not None and self.optimizer.held:  # keyed by the moved parameters and masks
            self.optimizer.hold_outside(self._held())

    # -- federation ----------------------------------------------------------------------
    @torch.no_grad()
    def load_global(self, tensors: dict[str, Tensor], rnd: int, meta: dict | None = None) -> None:
        layers = self.model.layers
        for prefix, layer in layers.items():
            names = [f"{prefix}.weight"] + ([f"{prefix}.bias"] if layer.bias is not None else [])
            for name in names:
                if name not in tensors:
                    raise ValueError(f"{name}: missing from the global model")
                value = tensors[name].to_dense() if isinstance(tensors[name], SparseTensor) else tensors[name]
                target = layer.weight if name.endswith("weight") else layer.bias
                if tuple(value.shape) != tuple(target.shape):
                    raise ValueError(f"{name}: expected shape {tuple(target.shape)}, got {tuple(value.shape)}")
        for prefix, layer in layers.items():
            self.global_weight[prefix] = dense(tensors[f"{prefix}.weight"])  # read only: the caller's array
            g = torch.from_numpy(self.global_weight[prefix]).to(self.device)
            if layer.bias is not None:
                layer.bias.copy_(torch.from_numpy(dense(tensors[f"{prefix}.bias"])))
            if self.task < 0:
                layer.weight.copy_(g)  # first contact: the global model is the base
                continue
            sent = torch.from_numpy(self.sent.get(prefix, np.zeros(g.shape, bool))).to(self.device)
            gate = torch.sigmoid(layer.unit_logits[self.task]).clamp_min(MIN_GATE)[:, None]  # (out, 1)
            layer.weight.copy_(torch.where(sent, g / gate, layer.weight))

    def start_task(self, task: int, downlink: Frame | None) -> None:
        downlink, carried = self._kb().complete(downlink)  # + the named entries it holds (kbstore)
        ids = self._knowledge_ids(downlink)  # validate before any state changes
        self._kb().keep(downlink, carried)
        super().start_task(task, downlink)
        # The last task's optimiser moments and anchors are replaced below: freed first, so the
        # new task's knowledge stack is never built beside them.
        self.optimizer, self.anchor = None, {}
        for layer in self.model.layers.values():  # earlier tasks' masks and attention are frozen
            for i in range(task):
                layer.unit_logits[i].requires_grad_(False)
                layer.attention[i].requires_grad_(False)
        if task > 0:  # the last task's alpha is final: its entries collapse to one term per layer
            self.model.settle(task - 1)  # (before the new stack is built: the device never holds both)
        release_free_memory()  # what was just freed goes back to the OS before the new stack is mapped
        self.anchor = {p: _snapshot(l) for p, l in self.model.layers.items()}
        self.model.add_task(self._knowledge(downlink, ids), self.opts.mask_init, self.opts.lambda3)
        self.work.reserve(max(layer.weight.numel() for layer in self.model.layers.values()))
        self.entries.append(ids)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = optim.Adam(trainable, lr=self.fed.train.lr, fused=True)
        if self.hold and self.opts.order_per == "batch":
            # the mask changes each step: every step reads the buffers set_order fills in place
            self.optimizer.hold_outside(self._held())

    def lacks(self, downlink: Frame) -> list[str]:
        return self._kb().missing(downlink)

    def _kb(self) -> KnowledgeStore:
        """The knowledge-base entries this device holds (on disk in ``store_dir``)."""
        if self.kb is None or self.kb.requested != self.store_dir:
            self.kb = KnowledgeStore(self.store_dir)
        return self.kb

    def _knowledge_ids(self, frame: Frame | None) -> list[str]:
        """The frame's entry ids, once every entry has every layer's weight in its shape."""
        ids = parse_knowledge_meta(frame.meta) if frame else []
        for prefix, layer in self.model.layers.items():
            for entry in ids:
                t = frame.tensors.get(knowledge_key(entry, f"{prefix}.weight"))
                if t is None or tuple(t.shape) != tuple(layer.weight.shape):
                    raise ValueError(f"knowledge entry {entry}: missing or misshaped {prefix}.weight")
        return ids

    def _knowledge(self, frame: Frame | None, ids: list[str]) -> dict[str, torch.Tensor]:
        """Stack the (validated) entries per layer: prefix -> (n_kb, out, in), each entry
        densified straight into its slot (no second copy of the stack)."""
        out = {}
        for prefix, layer in self.model.layers.items():
            stack = torch.empty((len(ids), *layer.weight.shape), device=self.device)
            for j, entry in enumerate(ids):
                stack[j] = torch.from_numpy(dense(frame.tensors[knowledge_key(entry, f"{prefix}.weight")]))
            out[prefix] = stack
        return out

    # -- training ------------------------------------------------------------------------
    def train_round(self, train: Sequence[Dataset], rnd: int, place: RoundPlace) -> tuple[int, float]:
        x = torch.from_numpy(train[-1].x)
        if not self.optimizer.state:  # a task's first round: the moments are made before the steps'
            self.optimizer.init_state()  # temporaries (not among them), once the knowledge frame is gone

        def loss(batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            nll = self.model.nll(batch, self.task).mean()
            return nll, nll + self._regularizer()

        hold = contextlib.nullcontext()
        if self.hold and self.opts.order_per == "round":
            # one MADE mask all round: the hold over the round ends where a per-step hold would
            # (the forward is masked, eq. 6's terms elementwise; tests/methods/test_decomposed.py)
            self.model.set_order(step_order(self.made, self.opts, rnd, 0))
            hold = self.optimizer.holding_outside(self._held())
        with hold:
            nll = self.local_epochs(self.model, x, rnd, loss)
        return len(x), nll

    def _held(self) -> dict[torch.Tensor, torch.Tensor]:
        """B and the A_i of each layer -> the layer's MADE mask buffer (masked_moments)."""
        return {p: layer.mask for layer in self.model.layers.values() for p in (layer.weight, *layer.adaptive)}

    def _regularizer(self) -> torch.Tensor:
        """Eq. 6's L1 and drift terms: the weight-sized part through ``WeightPenalty`` (no
        autograd graph kept), the bias part through autograd."""
        total = torch.zeros((), device=self.device)
        t = self.task
        drift = t > 0 and self.opts.lambda2 != 0
        for prefix, layer in self.model.layers.items():
            base0, adaptive0, bias0, offsets0 = self.anchor[prefix]
            terms = PenaltyTerms(
                base0,
                adaptive0[:t] if drift else [],
                [torch.sigmoid(layer.unit_logits[i]).detach()[:, None] for i in range(t)] if drift else [],
                layer.mask if self.masked else 1.0,
                self.opts.lambda1,
                self.opts.lambda2,
                self.work,
            )
            total = total + WeightPenalty.apply(terms, layer.weight, *layer.adaptive)
            if drift and layer.bias is not None:  # the task's bias b + c_i is held the same way
                for i in range(t):
                    bias_drift = (layer.bias - bias0) + (layer.bias_offsets[i] - offsets0[i])
                    total = total + self.opts.lambda2 * (bias_drift**2).sum()
        return total

    # -- upload --------------------------------------------------------------------------
    @torch.no_grad()
    def upload(self, rnd: int, place: RoundPlace) -> dict[str, Tensor]:
        masks = made_masks(self.made, upload_order(self.made, self.opts, rnd)) if self.restrict_upload else None
        out: dict[str, Tensor] = {}
        self.values_sent = 0
        for prefix, layer in self.model.layers.items():
            gate = torch.sigmoid(layer.unit_logits[self.task])  # (out,)
            units = top_units(gate.cpu().numpy(), self.opts.keep_units)
            made_mask = mask_for_param(masks, f"{prefix}.weight") if masks else None
            effective = (layer.weight * gate[:, None]).cpu().numpy()
            out.update(pack(f"{prefix}.weight", effective, made_mask, units))
            self.sent[prefix] = np.array(selection(made_mask, units) & np.ones(effective.shape, bool))
            if self._catching_up(rnd, prefix):
                extra = self._furthest(prefix, effective)
                out[f"{prefix}.weight{EXTRA}"] = SparseTensor(effective.shape, extra, effective.reshape(-1)[extra])
                self.sent[prefix].reshape(-1)[extra] = True
            self.values_sent += int(self.sent[prefix].sum())
            if layer.bias is not None:
                out[f"{prefix}.bias"] = layer.bias.cpu().numpy().copy()
            if place.task_end and shares_knowledge(place.task, self.num_tasks):
                adaptive = layer.adaptive[self.task].cpu().numpy().copy()
                adaptive[np.abs(adaptive) < self.opts.kb_threshold] = 0.0
                out[f"{KB_PREFIX}{prefix}.weight"] = SparseTensor.from_dense(adaptive)
        return out

    def _catching_up(self, rnd: int, prefix: str) -> bool:
        every = self.opts.catchup_every
        return self.restrict_upload and every > 0 and (rnd + 1) % every == 0 and prefix in self.global_weight

    def _furthest(self, prefix: str, effective: np.ndarray) -> np.ndarray:
        """Flat indices of the entries outside this round's selection whose value is furthest from
        the global model's, the ``catchup_share`` of the weight (ascending, ties to lower index)."""
        moved = np.abs(effective - self.global_weight[prefix]).reshape(-1)
        moved[self.sent[prefix].reshape(-1)] = 0.0
        k = min(int(round(self.opts.catchup_share * moved.size)), int(np.count_nonzero(moved)))
        if k == 0:
            return np.zeros(0, np.int64)
        return np.sort(np.argsort(-moved, kind="stable")[:k]).astype(np.int64)

    def report(self, place: RoundPlace) -> dict:
        """Base weight values in this upload; at a task end also the learned attention over the
        knowledge-base entries (mean over layers)."""
        out = {"base_values": self.values_sent}
        ids = self.entries[self.task] if self.task >= 0 else []
        if place.task_end:
            out[HELD] = self._kb().ids()  # the aggregator sends only the entries this device lacks
        if place.task_end and ids:
            alpha = torch.stack([layer.attention[self.task].detach() for layer in self.model.layers.values()])
            out["attention"] = {"entries": ids, "alpha": [round(float(a), 5) for a in alpha.mean(0)]}
        return out

    # -- checkpoints ---------------------------------------------------------------------
    def state(self) -> tuple[dict, dict[str, np.ndarray]]:
        meta, arrays = super().state()
        for prefix, sent in self.sent.items():
            arrays[f"sent/{prefix}"] = sent.astype(np.uint8)
        for prefix, (base, adaptive, bias, offsets) in self.anchor.items():
            arrays[f"anchor/{prefix}/base"] = base.cpu().numpy()
            for i, a in enumerate(adaptive):
                arrays[f"anchor/{prefix}/adaptive/{i}"] = a.cpu().numpy()
            for i, c in enumerate(offsets):
                arrays[f"anchor/{prefix}/offset/{i}"] = c.cpu().numpy()
            if bias is not None:
                arrays[f"anchor/{prefix}/bias"] = bias.cpu().numpy()
        for prefix, layer in self.model.layers.items():
            for i, term in layer.settled.items():
                arrays[f"settled/{prefix}/{i}"] = term.cpu().numpy()
        return {**meta, "entries": self.entries}, arrays

    def load_state(self, meta: dict, arrays: dict[str, np.ndarray]) -> None:
        super().load_state(meta, arrays)
        if meta.get("entries") != self.entries:
            raise ValueError("knowledge-base entries differ from the checkpoint's")
        try:
            self.sent = {p: arrays[f"sent/{p}"].astype(bool) for p in self.model.layers if f"sent/{p}" in arrays}
            for prefix in self.model.layers:
                if f"anchor/{prefix}/base" not in arrays:
                    continue

                def stack(kind: str, prefix: str = prefix) -> list[torch.Tensor]:
                    n = sum(1 for k in arrays if k.startswith(f"anchor/{prefix}/{kind}/"))
                    return [torch.from_numpy(arrays[f"anchor/{prefix}/{kind}/{i}"].copy()) for i in range(n)]

                bias = arrays.get(f"anchor/{prefix}/bias")
                anchor = (
                    torch.from_numpy(arrays[f"anchor/{prefix}/base"].copy()),
                    stack("adaptive"),
                    None if bias is None else torch.from_numpy(bias.copy()),
                    stack("offset"),
                )
                self.anchor[prefix] = _moved(anchor, self.device)
            for prefix, layer in self.model.layers.items():  # start_task settled them with the alphas of then
                for i in list(layer.settled):
                    layer.settle(i, torch.from_numpy(arrays[f"settled/{prefix}/{i}"].copy()))
        except KeyError as exc:
            raise ValueError(f"checkpoint lacks {exc}") from None

    # -- serving -------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, tests: Sequence[Dataset | None]) -> list[float | None]:
        """Task i is scored with task i's composition (task-incremental, as in FedWeIT)."""
        self.model.eval()
        self.model.set_order(0)
        if self.task < 0:  # before any task: the shared base alone
            return [mean_nll(lambda x: self.model.nll(x, None), d, self.device) for d in tests]
        return [
            mean_nll(lambda x, i=i: self.model.nll(x, min(i, self.task)), d, self.device) for i, d in enumerate(tests)
        ]

    def served_model(self, task: int, binarize: str = "") -> ServedModel | None:
        if self.task < 0:
            return None
        return ServedModel(
            made=self.made,
            params=self.model.composed_params(self.task),
            order_index=0,
            method=self.fed.method,
            task=task,
            binarize=binarize,
        )


class FedWeITMadeLearner(DecomposedLearner):
    """FedWeIT-MADE: the naive combination, every client with its own MADE masks."""

    own_masks = True


class ConFedMADELearner(DecomposedLearner):
    """ConFedMADE: M in the L1 term, uploads inside the round's MADE mask, Adam held outside it."""

    masked_l1 = True
    restrict_to_made_mask = True
    masked_moments = True


def _snapshot(layer) -> tuple:
    """B, A_i, b and c_i at a task start: the anchor of the drift penalty."""
    bias = layer.bias.detach().clone() if layer.bias is not None else None
    return (
        layer.weight.detach().clone(),
        [a.detach().clone() for a in layer.adaptive],
        bias,
        [c.detach().clone() for c in layer.bias_offsets],
    )


def _moved(anchor: tuple, device: torch.device) -> tuple:
    """A ``_snapshot`` on ``device`` (the same tensors where they are there already)."""
    base, adaptive, bias, offsets = anchor
    return (
        base.to(device),
        [a.to(device) for a in adaptive],
        None if bias is None else bias.to(device),
        [c.to(device) for c in offsets],
    )
