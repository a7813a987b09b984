"""ConFedMADE's knowledge downlink sends each device only the entries it lacks: the device keeps
every entry it received (``methods.confedmade.kbstore``) and declares them at each task's end
(``kb_held``); its next frame names every entry but carries only the new ones.  Built from
stored + new entries, every stack is bit-identical to the one the full frames give; a device
that lost its store gets (or fetches) the full frame, and a frame naming an entry the device
neither holds nor gets is refused before anything changes."""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest
import torch
from support.builders import federation_spec

from fclcore.codec import Frame, Header, Kind, decode, encode
from fclcore.data import Dataset
from fclcore.schedule import TaskSchedule
from fclcore.schema import FederationSpec
from fclcore.strategy import Update
from methods import learner_for, strategy_for
from methods.confedmade.kbstore import KnowledgeStore, MissingKnowledge
from methods.confedmade.wire import HELD, KB_PREFIX, parse_knowledge_meta

D, CLIENTS, TASKS = 10, 3, 4


def _fed(**options) -> FederationSpec:
    return federation_spec(num_tasks=TASKS, rounds_per_task=1, options={"kb_threshold": 0.01, **options})


def _data(seed: int, n: int = 40) -> Dataset:
    rng = np.random.default_rng(seed)
    return Dataset((rng.random((n, D)) > 0.5).astype(np.float32), np.zeros(n, np.int64))


def _wire(kind: Kind, rnd: int, task: int, client: str, meta: dict, tensors: dict) -> tuple[Frame, int]:
    payload = encode(Frame(Header(kind, "t", rnd, task, client, rnd + 1), meta, tensors), "float16")
    return decode(payload), len(payload)


@dataclasses.dataclass
class Run:
    learners: list
    stacks: dict  # (client, task) -> {layer: the task's knowledge stack as built}
    frames: dict  # (client, task) -> (the frame as received, its payload bytes)
    fulls: dict  # (client, task) -> the full frame published beside it
    strategy: object


def _federation(tmp_path, declare: bool = True, fed: FederationSpec | None = None, lose=None) -> Run:
    """A small federation through the codec; ``declare=False``: updates never say what their
    device holds (every frame is then full, as before); ``lose(task, learners)``: called
    before each task start (to wipe a device's store)."""
    fed = fed or _fed()
    strategy = strategy_for(fed, D)
    clients = [f"c{i}" for i in range(CLIENTS)]
    learners = []
    for i in range(CLIENTS):
        learner = learner_for(fed, D, i)
        learner.store_dir = None if tmp_path is None else str(tmp_path / clients[i])
        learner.load_global(strategy.initial_model(), 0)
        learners.append(learner)
    schedule = TaskSchedule.uniform(TASKS, 1)
    current = strategy.initial_model()
    run = Run(learners, {}, {}, {}, strategy)
    for rnd in range(fed.total_rounds):
        place = schedule.place(rnd)
        task = place.task
        if lose is not None:
            lose(task, learners)
        downs, fulls = strategy.client_downlinks(rnd, clients), strategy.full_downlinks(rnd, clients)
        for i, (client, learner) in enumerate(zip(clients, learners)):
            frame, size = _wire(Kind.KNOWLEDGE, rnd, task, "aggregator", *downs[client])
            run.frames[client, task] = (frame, size)
            if client in fulls:
                run.fulls[client, task] = _wire(Kind.KNOWLEDGE, rnd, task, "aggregator", *fulls[client])[0]
            if learner.lacks(frame):
                frame = run.fulls[client, task]  # what the daemon fetches then
            learner.start_task(task, frame)
            run.stacks[client, task] = {p: layer.knowledge[task].clone() for p, layer in learner.model.layers.items()}
        updates = []
        for i, (client, learner) in enumerate(zip(clients, learners)):
            learner.train_round([_data(10 * i + task)], rnd, place)
            meta = {"n_samples": 40, **learner.report(place)}
            if not declare:
                meta.pop(HELD, None)
            frame, _ = _wire(Kind.UPDATE, rnd, task, client, meta, learner.upload(rnd, place))
            updates.append(Update(client, frame, 40, 0, 0, strategy.normalize(frame)))
        current = strategy.aggregate(updates, current)
        for learner in learners:
            learner.load_global(current, rnd + 1)
    return run


def _carried(frame: Frame) -> set[str]:
    return {name.split("|")[0] for name in frame.tensors}


def test_stacks_from_stored_and_new_entries_are_bit_identical_to_the_full_frames(tmp_path):
    delta = _federation(tmp_path / "delta")
    full = _federation(None, declare=False)
    for key, stacks in full.stacks.items():
        for prefix, stack in stacks.items():
            assert torch.equal(delta.stacks[key][prefix], stack), (key, prefix)
            assert stack.shape[0] == (CLIENTS - 1) * key[1]  # every other client's every earlier task
    for a, b in zip(delta.learners, full.learners):  # and so the whole run: the same models
        for (name, x), (_, y) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
            assert torch.equal(x, y), name
    for (client, task), (frame, size) in delta.frames.items():
        named = parse_knowledge_meta(frame.meta)
        assert named == parse_knowledge_meta(full.frames[client, task][0].meta)  # the same entries, in order
        assert _carried(frame) == {e for e in named if e.endswith(f"/t{task - 1}")}  # only the new ones
        if task >= 2:
            assert size < full.frames[client, task][1]
            assert _carried(delta.fulls[client, task]) == set(named)  # the full frame, for a resync
        else:
            assert (client, task) not in delta.fulls  # nothing left out, no full frame
    assert sum(s for _, s in delta.frames.values()) < 0.7 * sum(s for _, s in full.frames.values())
    # the last task's A_t would reach nobody: it is not uploaded, and the knowledge base ends before it
    last = TaskSchedule.uniform(TASKS, 1).place(TASKS - 1)
    assert last.task_end and not any(k.startswith(KB_PREFIX) for k in delta.learners[0].upload(TASKS - 1, last))
    assert {e.task for e in delta.strategy.knowledge} == set(range(TASKS - 1))
    # the entries were kept on disk: one file per entry received, nothing kept twice
    files = sorted(p.name for p in (tmp_path / "delta" / "c0").iterdir())
    assert len(files) == (CLIENTS - 1) * (TASKS - 1) and all(f.endswith(".npz") for f in files)


def test_a_device_that_lost_its_store_gets_the_full_frame_and_the_same_stacks(tmp_path):
    def lose(task, learners):
        if task == 3:  # c1's store is wiped after its task-2 update declared what it held
            shutil.rmtree(tmp_path / "delta" / "c1")
            learners[1].kb = None  # as a restarted device would find it

    delta = _federation(tmp_path / "delta", lose=lose)
    reference = _federation(tmp_path / "reference")
    frame = delta.frames["c1", 3][0]
    assert sorted(delta.learners[1].lacks(frame)) == []  # it holds them again, from the full frame
    lacking = set(parse_knowledge_meta(frame.meta)) - _carried(frame)
    assert lacking == {"c0/t0", "c0/t1", "c2/t0", "c2/t1"}  # what the frame relied on
    for prefix, stack in reference.stacks["c1", 3].items():
        assert torch.equal(delta.stacks["c1", 3][prefix], stack)


def test_a_new_device_or_one_that_never_declared_gets_every_entry(tmp_path):
    run = _federation(tmp_path, declare=False)
    for (client, task), (frame, _) in run.frames.items():
        assert _carried(frame) == set(parse_knowledge_meta(frame.meta))
    assert run.fulls == {}


def test_a_frame_naming_an_entry_neither_held_nor_sent_is_refused_before_anything_changes(tmp_path):
    run = _federation(tmp_path / "run")
    learner = learner_for(_fed(), D, 0)
    learner.store_dir = str(tmp_path / "c0")
    for task in range(TASKS - 1):
        learner.start_task(task, run.frames["c0", task][0])
    frame = run.frames["c0", TASKS - 1][0]  # carries task 2's entries, relies on the stored others
    named = parse_knowledge_meta(frame.meta)
    partial = Frame(frame.header, frame.meta, {k: v for k, v in frame.tensors.items() if not k.startswith("c1/t2|")})
    assert learner.lacks(frame) == [] and learner.lacks(partial) == ["c1/t2"]
    before = (learner.task, list(learner.entries), len(learner.model.output.knowledge))
    with pytest.raises(MissingKnowledge, match="c1/t2"):
        learner.start_task(TASKS - 1, partial)
    assert (learner.task, list(learner.entries), len(learner.model.output.knowledge)) == before
    assert "c1/t2" not in KnowledgeStore(tmp_path / "c0").ids()  # nothing of it was kept either
    learner.start_task(TASKS - 1, run.fulls["c0", TASKS - 1])  # the full frame then completes it
    assert learner.entries[TASKS - 1] == named
    for prefix, layer in learner.model.layers.items():
        assert torch.equal(layer.knowledge[TASKS - 1], run.stacks["c0", TASKS - 1][prefix])


def test_a_restarted_device_rebuilds_from_its_frames_even_without_its_store(tmp_path):
    run = _federation(tmp_path)
    fed = _fed()
    for wiped in (False, True):
        if wiped:
            shutil.rmtree(tmp_path / "c0")
        rebuilt = learner_for(fed, D, 0)
        rebuilt.store_dir = str(tmp_path / "c0")
        for task in range(TASKS):  # as the daemon replays the frames it kept in its checkpoint
            rebuilt.start_task(task, run.frames["c0", task][0])
        rebuilt.load_state(*run.learners[0].state())
        for prefix, layer in rebuilt.model.layers.items():
            assert torch.equal(layer.knowledge[TASKS - 1], run.stacks["c0", TASKS - 1][prefix])
        assert rebuilt.report(TaskSchedule.uniform(TASKS, 1).place(TASKS - 1))[HELD] == [
            f"{c}/t{t}" for c in ("c1", "c2") for t in range(TASKS - 1)
        ]


def test_the_aggregator_keeps_what_devices_hold_across_a_restart_and_refuses_a_malformed_declaration(tmp_path):
    run = _federation(tmp_path)
    strategy = run.strategy
    again = strategy_for(_fed(), D)
    again.restore(*strategy.state())
    assert again.held == strategy.held and strategy.held["c0"] == frozenset(
        f"{c}/t{t}" for c in ("c1", "c2") for t in range(TASKS - 1)
    )
    last = TASKS - 1
    tensors = run.learners[0].upload(last, TaskSchedule.uniform(TASKS, 1).place(last))
    for held, ok in (([], True), (["c1/t0"], True), ("c1/t0", False), ([3], False)):
        frame = _wire(Kind.UPDATE, last, last, "c0", {"n_samples": 4, HELD: held}, tensors)[0]
        if ok:
            strategy.normalize(frame)
        else:
            with pytest.raises(ValueError, match=HELD):
                strategy.normalize(frame)


def test_the_budget_and_the_frame_cap_still_bound_what_is_sent(tmp_path):
    budget = 0.001  # MB: fewer entries than the policy chooses (in 8-bit values, the default)
    bounded = _federation(tmp_path / "b", fed=_fed(kb_budget_mb=budget))
    for (client, task), (frame, size) in bounded.frames.items():
        header = len(encode(Frame(frame.header, frame.meta, {}), "float16"))
        assert size <= budget * 1e6 + header + 64 * len(frame.tensors), (client, task)
    named = parse_knowledge_meta(bounded.frames["c0", TASKS - 1][0].meta)
    assert 0 < len(named) < (CLIENTS - 1) * (TASKS - 1)  # the budget left some out
