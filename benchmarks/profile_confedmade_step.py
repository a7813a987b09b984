"""Where ConFedMADE's memory goes inside a training round at a late task (issue 20).

One process builds the Sequential MNIST ConFedMADE learner (784-500-784 with direct
connections, ``configs/scenarios/seqmnist_confedmade.yaml``'s federation), plays tasks
0..T-1 with a few steps each on seeded random binary rows, and hands it at every task start
a knowledge frame of ``--entries-per-task`` entries per earlier task (the scenario's 4 other
clients: all of their earlier tasks, as ``kb_policy: all`` does), each a thresholded
``A``-like tensor as the aggregator forwards it.  At the last task it measures, around each
phase of one optimiser step (forward NLL, regulariser, backward, step) and of the
evaluation and of the checkpoint, the RSS before and the phase's own peak: the peak is reset before the phase by
writing 5 to ``/proc/self/clear_refs`` and read from VmHWM after it.

    python benchmarks/profile_confedmade_step.py
    python benchmarks/profile_confedmade_step.py --tasks 5 --steps 3

Linux only (``/proc/self/clear_refs``).  Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fclcore import checkpoint  # noqa: E402
from fclcore.codec import Frame, Header, Kind, SparseTensor  # noqa: E402
from fclcore.config import load_config  # noqa: E402
from fclcore.data import Dataset  # noqa: E402
from fclcore.procmem import release_free_memory, rss_mb  # noqa: E402
from fclcore.schedule import TaskSchedule  # noqa: E402
from fclcore.schema import Scenario  # noqa: E402
from methods import learner_for, resolve, strategy_for  # noqa: E402
from methods.confedmade.wire import entry_id, knowledge_key, knowledge_meta  # noqa: E402

SCENARIO = ROOT / "configs/scenarios/seqmnist_confedmade.yaml"
D = 784


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def hwm_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    raise RuntimeError("no VmHWM in /proc/self/status")


def knowledge_frame(learner, task: int, per_task: int, rng: np.random.Generator) -> Frame | None:
    """``per_task`` entries for every earlier task, A-like values (B / lambda3 scale), thresholded."""
    if task == 0:
        return None
    entries, tensors = [], {}
    for t in range(task):
        for c in range(per_task):
            eid = entry_id(f"other-{c}", t)
            entries.append((eid, f"other-{c}", t))
            for prefix, layer in learner.model.layers.items():
                a = (rng.standard_normal(tuple(layer.weight.shape)) * 0.01).astype(np.float32)
                a[np.abs(a) < learner.opts.kb_threshold] = 0.0
                tensors[knowledge_key(eid, f"{prefix}.weight")] = SparseTensor.from_dense(a)
    return Frame(Header(Kind.KNOWLEDGE, "seqmnist", 0, task, "client-0", 1), knowledge_meta(task, entries), tensors)


def measure(rows: list, name: str, fn):
    release_free_memory()
    before = rss_mb()
    reset_peak()
    out = fn()
    rows.append({"phase": name, "rss_before_mb": before, "phase_peak_mb": hwm_mb(), "rss_after_mb": rss_mb()})
    return out


def step_phases(rows: list, learner, batch: torch.Tensor) -> None:
    """One optimiser step of ``local_epochs``, phase by phase."""
    learner.model.train()
    learner.optimizer.zero_grad(set_to_none=True)
    nll = measure(rows, "forward NLL", lambda: learner.model.nll(batch, learner.task).mean())
    total = measure(rows, "regulariser", lambda: nll + learner._regularizer())
    measure(rows, "backward", total.backward)
    measure(rows, "optimiser step", learner.optimizer.step)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=5, help="tasks to play; the last one is measured")
    ap.add_argument("--entries-per-task", type=int, default=4, help="knowledge entries per earlier task")
    ap.add_argument("--steps", type=int, default=2, help="optimiser steps per task before the measured one")
    ap.add_argument("--rows", type=int, default=6000, help="training rows (about one client's digit shard)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    sc = load_config(Scenario, SCENARIO, [f"federation.num_tasks={args.tasks}"])
    _, _, fed = resolve(sc.federation, str(SCENARIO))
    rng = np.random.default_rng(args.seed)
    x = (rng.random((args.rows, D)) > 0.8).astype(np.float32)
    data = Dataset(x, np.zeros(args.rows, np.int64))
    learner = learner_for(fed, D, 0)
    learner.load_global(strategy_for(fed, D).initial_model(), 0)
    place = TaskSchedule.uniform(args.tasks, 2).place(0)
    rows: list[dict] = []
    for task in range(args.tasks):
        # the frame is built inside the phase and dropped after it (the daemon keeps it raw only)
        measure(
            rows,
            f"task {task}: start_task",
            lambda: learner.start_task(task, knowledge_frame(learner, task, args.entries_per_task, rng)),
        )
        if task < args.tasks - 1:
            small = Dataset(x[: args.steps * fed.train.batch_size], data.y[: args.steps * fed.train.batch_size])
            measure(rows, f"task {task}: train {args.steps} steps", lambda: learner.train_round([small], 0, place))
    step_phases(rows, learner, torch.from_numpy(x[: fed.train.batch_size]))
    measure(rows, "train_round (whole shard)", lambda: learner.train_round([data], 1, place))
    measure(
        rows, "evaluate (5 test sets of 1,000 rows)", lambda: learner.evaluate([Dataset(x[:1000], data.y[:1000])] * 5)
    )
    with tempfile.TemporaryDirectory() as tmp:
        measure(
            rows,
            "checkpoint (state + fclcore.checkpoint.save)",
            lambda: checkpoint.save(Path(tmp) / "c.npz", *learner.state()),
        )
        rows[-1]["file_mb"] = round((Path(tmp) / "c.npz").stat().st_size / 2**20, 1)
    doc = {
        "command": "python benchmarks/profile_confedmade_step.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.platform()}, {platform.machine()}",
        "torch": torch.__version__,
        "args": vars(args),
        "phases": rows,
    }
    print(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
