"""ConFedMADE's server half, ready for buffered rounds (docs/buffered.md, "Which methods"): an
upload is packed inside the MADE mask of the version it was trained on, which its header names,
so an update folded into a later version is unpacked with its own version's mask and averaged
per position with the others; a task's knowledge (A_t) rides on the update trained on the
task's last version, whichever version folds it, and is filed under that update's task.  The
method still refuses buffered rounds: its task-start knowledge frames would go out before the
task-end updates that fill them arrive."""

from __future__ import annotations

import math

import numpy as np

import methods
from aggregator.buffered import Buffer
from fclbases.made.options import upload_order
from fclcore.codec import Frame, Header, Kind
from fclcore.config import from_dict
from fclcore.made_spec import made_masks, mask_for_param
from fclcore.masked_upload import pack
from fclcore.schema import FederationSpec
from fclcore.strategy import Update
from methods.confedmade.wire import KB_PREFIX

FED, INPUT_DIM = "cfm", 6
ROUNDS_PER_TASK = 3  # versions 0-2 are task 0 (2 carries its knowledge), 3-5 task 1


def _strategy():
    spec = {
        "name": FED,
        "method": "confedmade",
        "num_tasks": 2,
        "rounds_per_task": ROUNDS_PER_TASK,
        "model": {"hidden_sizes": [8], "num_orders": 4},
        "options": {"order_per": "round"},
    }
    _, _, fed = methods.resolve(from_dict(FederationSpec, spec, "test"), "test")
    return methods.strategy_for(fed, INPUT_DIM)


def _update(strategy, client: str, trained_on: int, n_samples: int, value: float) -> Update:
    """An upload of every unit's base set to ``value`` inside version ``trained_on``'s mask."""
    masks = made_masks(strategy.made, upload_order(strategy.made, strategy.options, trained_on))
    tensors: dict = {}
    for name, shape in strategy.shapes.items():
        if name.endswith(".bias"):
            tensors[name] = np.full(shape, value, np.float32)
            continue
        tensors.update(pack(name, np.full(shape, value, np.float32), mask_for_param(masks, name), np.ones(shape[0])))
        if strategy.carries_knowledge(trained_on):
            tensors[KB_PREFIX + name] = np.full(shape, 10 * value, np.float32)
    frame = Frame(Header(Kind.UPDATE, FED, trained_on, 1, client, 1), {"n_samples": n_samples}, tensors)
    return Update(client, frame, n_samples, 0, 0, strategy.normalize(frame))


def test_updates_of_two_versions_fold_inside_their_own_masks_weighted_by_staleness() -> None:
    strategy = _strategy()
    model = strategy.initial_model()
    orders = {v: upload_order(strategy.made, strategy.options, v) for v in (3, 4)}
    assert orders[3] != orders[4]  # the two versions' masks differ: the case at hand
    buffer, running = Buffer(buffer_k=2, max_staleness=2), strategy.running_sum(model)
    kept = [
        buffer.fold(strategy, running, _update(strategy, "c0", 4, 2, 1.0), open_version=4),
        buffer.fold(strategy, running, _update(strategy, "c1", 3, 4, -1.0), open_version=4),
    ]
    closed = strategy.close(running, kept, model)
    w0, w1 = 2.0, 4.0 / math.sqrt(2.0)  # n_samples / sqrt(1 + staleness)
    both = (w0 * 1.0 + w1 * -1.0) / (w0 + w1)
    mask4, mask3 = (made_masks(strategy.made, orders[v]) for v in (4, 3))
    for name, value in model.items():
        if name.endswith(".bias"):
            np.testing.assert_allclose(closed[name], both, rtol=1e-6)
            continue
        in4, in3 = (np.broadcast_to(mask_for_param(m, name) > 0, value.shape) for m in (mask4, mask3))
        expected = np.where(in4 & in3, both, np.where(in4, 1.0, np.where(in3, -1.0, value)))
        np.testing.assert_allclose(closed[name], expected, rtol=1e-6, atol=1e-6)
        assert (in4 & ~in3).any() and (in3 & ~in4).any(), name  # positions only one of them sent


def test_a_task_end_update_folded_into_the_next_task_files_its_knowledge_under_its_own_task() -> None:
    strategy = _strategy()
    model = strategy.initial_model()
    buffer, running = Buffer(buffer_k=2, max_staleness=2), strategy.running_sum(model)
    kept = [  # sorted by client, as the intake closes them: the first one carries no knowledge
        buffer.fold(strategy, running, _update(strategy, "c0", 3, 2, 1.0), open_version=3),
        buffer.fold(strategy, running, _update(strategy, "c1", 2, 2, 1.0), open_version=3),
    ]
    strategy.close(running, kept, model)
    assert [(e.client, e.task) for e in strategy.knowledge] == [("c1", 0)]
    entry = strategy.knowledge[0].tensors
    assert set(entry) == {n for n in strategy.shapes if n.endswith(".weight")}
    assert all(np.all(np.asarray(getattr(t, "to_dense", lambda: t)()) == 10.0) for t in entry.values())
