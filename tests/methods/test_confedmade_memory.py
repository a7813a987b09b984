"""ConFedMADE's memory cuts (firmware_notes/memory.md, third pass) change no number.

The device learner trains on uint8 pixels, updates each parameter inside the backward pass,
keeps the penalty's temporaries in a workspace, composes a task's weight in place, makes the
Adam moments before a task's first step, and a daemon keeps its knowledge frames in files of
its state directory.  Here a plain reference (float32 pixels, out-of-place composition,
the penalty through autograd, ``backward()`` then ``step()`` with lazily made moments, Adam
held outside the MADE mask at every step rather than over the round) trains the same tasks,
and a learner rebuilt from a checkpoint continues, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import autograd_penalty

from fclcore.codec import Frame, Header, Kind, SparseTensor, decode, encode
from fclcore.config import to_dict
from fclcore.data import Dataset
from fclcore.schedule import TaskSchedule
from fclcore.schema import FederationSpec, ModelSpec, TrainSpec
from methods import learner_for, strategy_for
from methods.confedmade.decomposed_learner import DecomposedLearner
from methods.confedmade.wire import entry_id, knowledge_key, knowledge_meta

D, TASKS, ROUNDS = 12, 4, 2  # four tasks: three drift terms reach B (their order matters)


def _fed(method: str) -> FederationSpec:
    return FederationSpec(
        name="t",
        method=method,
        num_tasks=TASKS,
        rounds_per_task=ROUNDS,
        model=ModelSpec(hidden_sizes=[16], num_orders=3, mask_seed=3, direct=True),
        train=TrainSpec(batch_size=8, lr=0.01),
        options={"order_per": "round", "keep_units": 0.5, "lambda1": 0.01, "lambda2": 50.0},
    )


def _pixels(seed: int, n: int = 40) -> np.ndarray:
    return (np.random.default_rng(seed).random((n, D)) > 0.5).astype(np.uint8)


def _knowledge(learner: DecomposedLearner, task: int) -> bytes | None:
    """A knowledge frame on the wire: two float16 entries per earlier task, thresholded."""
    if task == 0:
        return None
    rng = np.random.default_rng(100 + task)
    entries, tensors = [], {}
    for t in range(task):
        for c in ("a", "b"):
            eid = entry_id(c, t)
            entries.append((eid, c, t))
            for prefix, layer in learner.model.layers.items():
                a = (rng.standard_normal(tuple(layer.weight.shape)) * 0.1).astype(np.float32)
                a[np.abs(a) < 0.05] = 0.0
                tensors[knowledge_key(eid, f"{prefix}.weight")] = SparseTensor.from_dense(a)
    header = Header(Kind.KNOWLEDGE, "t", task * ROUNDS, task, "aggregator", 1)
    return encode(Frame(header, knowledge_meta(task, entries), tensors), "float16")


class PlainTraining:
    """The reference, mixed into the method's learner class: every cut undone."""

    compact_pixels = False
    step_in_backward = False

    def train_round(self, train, rnd, place):
        x = torch.from_numpy(train[-1].x)  # float32: no per-batch conversion, no early moments
        if self.hold:  # Adam held outside the MADE mask at every step, not split for the round
            self.optimizer.hold_outside(self._held())

        def loss(batch):
            nll = _plain_nll(self.model, batch, self.task).mean()
            return nll, nll + autograd_penalty(self)

        return len(x), self.local_epochs(self.model, x, rnd, loss)


def _plain_nll(model, x: torch.Tensor, task: int) -> torch.Tensor:
    def linear(layer, h):
        w = layer.weight * torch.sigmoid(layer.unit_logits[task])[:, None] + layer.adaptive[task]
        if task in layer.settled:
            w = w + layer.settled[task]
        elif layer.knowledge[task].shape[0]:
            w = w + torch.einsum("k,koi->oi", layer.attention[task], layer.knowledge[task])
        return F.linear(h, w * layer.mask, layer.composed_bias(task))

    h = x
    for layer in model.hidden:
        h = F.relu(linear(layer, h))
    logits = linear(model.output, h) + linear(model.direct, x)
    return F.binary_cross_entropy_with_logits(logits, x, reduction="none").sum(dim=1)


def _params(learner) -> list[torch.Tensor]:
    return [p.detach().clone() for p in learner.model.parameters()]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _play(learner, rounds: range, knowledge: dict[int, bytes | None], pixels) -> list:
    """Rounds of the schedule; per round the parameters, the upload and the held-out NLLs."""
    schedule, out = TaskSchedule.uniform(TASKS, ROUNDS), []
    for rnd in rounds:
        place = schedule.place(rnd)
        if place.task != learner.task:
            raw = knowledge.get(place.task)
            learner.start_task(place.task, None if raw is None else decode(raw))
        x = pixels(place.task, rnd)
        learner.train_round([Dataset(x, np.zeros(len(x), np.int64))], rnd, place)
        upload = learner.upload(rnd, place)
        tests = [Dataset(pixels(t, 99), np.zeros(40, np.int64)) for t in range(place.task + 1)]
        out.append((_params(learner), sorted(upload), learner.evaluate(tests)))
    return out


@pytest.mark.parametrize("method", ["confedmade", "fedweit-made-star"])
def test_the_cut_learner_trains_the_plain_reference_bit_for_bit(method):
    fed = _fed(method)
    ours = learner_for(fed, D, 0)
    plain = type("Plain", (PlainTraining, type(ours)), {})(fed, ours.opts, D, 0)
    assert isinstance(ours, DecomposedLearner) and ours.compact_pixels and ours.step_in_backward
    start = strategy_for(fed, D).initial_model()
    knowledge = {t: _knowledge(ours, t) for t in range(TASKS)}
    runs = []
    for learner, dtype in ((ours, np.uint8), (plain, np.float32)):
        learner.load_global(start, 0)
        runs.append(
            _play(learner, range(TASKS * ROUNDS), knowledge, lambda t, r, d=dtype: _pixels(10 * t + r).astype(d))
        )
    assert not _equal(runs[0][0][0], runs[0][-1][0])  # it trained
    for (p_ours, up_ours, nll_ours), (p_plain, up_plain, nll_plain) in zip(*runs):
        assert _equal(p_ours, p_plain)
        assert up_ours == up_plain and nll_ours == nll_plain


def test_a_learner_rebuilt_from_a_checkpoint_with_spilled_knowledge_continues_bit_for_bit(tmp_path):
    """The daemon's path: knowledge frames spilled to the state directory, the checkpoint
    written (copying them in), the learner rebuilt by ``learner_from_state`` and trained on:
    the same parameters as the learner that was never stopped.  Checkpoints are taken right
    after a task start (no moments yet) and after a task's first round."""
    from edge_client.state import ClientState, ClientStateStore, learner_from_state

    fed = _fed("confedmade")
    start = strategy_for(fed, D).initial_model()
    probe = learner_for(fed, D, 0)
    knowledge = {t: _knowledge(probe, t) for t in range(TASKS)}

    def pixels(t, r):
        return _pixels(10 * t + r)

    for stop in (2, 3):  # rounds done before the checkpoint: task 1 started (round 2), one round of it
        learner = learner_for(fed, D, 0)
        learner.load_global(start, 0)
        _play(learner, range(stop), knowledge, pixels)
        if stop == 2:
            learner.start_task(1, decode(knowledge[1]))
        store = ClientStateStore(tmp_path / f"state{stop}")
        spilled = {t: store.spill(t, raw) for t, raw in knowledge.items() if raw is not None and t <= learner.task}
        assert not any(isinstance(v, bytes) for v in spilled.values())
        meta, arrays = learner.state()
        store.save(ClientState("c", to_dict(fed), learner.task, stop - 1, 1, spilled, None, meta, arrays, D))
        assert store.load().frames == {t: knowledge[t] for t in spilled}  # the files' bytes, copied in
        rebuilt, _ = learner_from_state(store.path.parent)
        rebuilt.load_global(start, stop)  # (the next round's global model, the same for both)
        learner.load_global(start, stop)
        assert _equal(_params(rebuilt), _params(learner))
        rest = range(stop, TASKS * ROUNDS)
        for (p_a, up_a, nll_a), (p_b, up_b, nll_b) in zip(
            _play(learner, rest, knowledge, pixels), _play(rebuilt, rest, knowledge, pixels)
        ):
            assert _equal(p_a, p_b) and up_a == up_b and nll_a == nll_b
