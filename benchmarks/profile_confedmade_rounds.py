"""ConFedMADE's training rounds at the fifth task: RSS before, peak, RSS after and CPU seconds.

Builds the learner of ``profile_confedmade_step.py`` (Sequential MNIST MADE, tasks 0-3 played
with a few steps each, 4 knowledge entries per earlier task), starts task 4 and trains two whole
rounds on ``--rows`` seeded random rows, each measured alone (the heap trimmed and the peak reset
before it).  The first round of a task is where the Adam moments appear; the second shows the
steady state.  The C allocator's settings come from the environment (``MALLOC_*`` or
``GLIBC_TUNABLES``), so the same command measures them.  ``--code`` runs another source tree's
learner (an export of an earlier commit).  ``check`` is a sum over the direct layer's weights
after both rounds: equal between two runs means the same bits were trained (to float64 sum).

    python benchmarks/profile_confedmade_rounds.py
    MALLOC_MMAP_THRESHOLD_=131072 python benchmarks/profile_confedmade_rounds.py
    python benchmarks/profile_confedmade_rounds.py --code /tmp/fcl-main
    python benchmarks/profile_confedmade_rounds.py --set federation.options.masked_moments=false

Linux only.  Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("--code", default=str(Path(__file__).resolve().parent.parent), help="source tree to import")
ap.add_argument("--rows", type=int, default=6000)
ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a scenario override (repeatable)")
args = ap.parse_args()
sys.path[:0] = [args.code, str(Path(__file__).resolve().parent)]

import numpy as np  # noqa: E402
import torch  # noqa: E402

from fclcore.config import load_config  # noqa: E402
from fclcore.data import Dataset  # noqa: E402
from fclcore.procmem import release_free_memory, rss_mb  # noqa: E402
from fclcore.schedule import TaskSchedule  # noqa: E402
from fclcore.schema import Scenario  # noqa: E402
from methods import learner_for, resolve, strategy_for  # noqa: E402


def main() -> None:
    # after fclcore and methods: its own sys.path entry (this checkout) must not shadow --code
    from profile_confedmade_step import SCENARIO, D, hwm_mb, knowledge_frame, reset_peak

    torch.set_num_threads(1)
    sc = load_config(Scenario, SCENARIO, ["federation.num_tasks=5", *args.set])
    _, _, fed = resolve(sc.federation, str(SCENARIO))
    rng = np.random.default_rng(0)
    x = (rng.random((args.rows, D)) > 0.8).astype(np.float32)
    data = Dataset(x, np.zeros(args.rows, np.int64))
    learner = learner_for(fed, D, 0)
    learner.load_global(strategy_for(fed, D).initial_model(), 0)
    place = TaskSchedule.uniform(5, 2).place(0)
    for task in range(5):
        learner.start_task(task, knowledge_frame(learner, task, 4, rng))
        if task < 4:
            learner.train_round([Dataset(x[:128], data.y[:128])], 0, place)
    out = {"command": "python benchmarks/profile_confedmade_rounds.py " + " ".join(sys.argv[1:])}
    out["allocator_env"] = {k: v for k, v in os.environ.items() if k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    for r in (1, 2):
        release_free_memory()
        before = rss_mb()
        reset_peak()
        cpu = time.process_time()
        learner.train_round([data], r, place)
        out[f"round{r}"] = {
            "rss_before_mb": before,
            "peak_mb": hwm_mb(),
            "rss_after_mb": rss_mb(),
            "cpu_s": round(time.process_time() - cpu, 3),
        }
    out["check"] = float(learner.model.direct.weight.detach().double().sum())
    out["load_average"] = os.getloadavg()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
