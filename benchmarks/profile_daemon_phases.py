"""Peak RSS of every client daemon, phase by phase and round by round, over a whole ``fcl simulate`` run.

The daemons run unchanged: a ``sitecustomize`` put first on their ``PYTHONPATH`` wraps, as their
modules are imported, the methods a round goes through (``RoundWork``, ``DeviceLearner`` and
``Uplink`` since the daemon was split; ``ClientDaemon``'s own before).  Each
wrapped call starts a phase: the peak is reset (``5`` to ``/proc/self/clear_refs``) and, when the
next phase starts, the phase's RSS before, peak (VmHWM) and RSS after are logged.  Phases of
round r: ``evaluate`` (the held-out report), ``served`` (the snapshot for the export),
``start_tasks``, ``train+upload`` (from ``arrived`` to the update's encoding), ``frame``,
``checkpoint``, ``send`` (publish, export submitted, heap trimmed), then ``between`` (after the
round: the next announcement and any knowledge frame arriving).  The peak of the run is the
largest phase peak.  Resetting the peak makes the daemons' own ``max_rss_mb`` (wire.json)
meaningless in such a run: use ``bench_device_budget.py`` for that figure.

    python benchmarks/profile_daemon_phases.py --code . --out /tmp/phases.json \\
        configs/scenarios/seqmnist_confedmade.yaml --set federation.rounds_per_task=2

``--code`` is the source tree the daemons import (this checkout, or an export of another
commit: the hooks only wrap methods the daemon has had since before issue 20).  Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HOOK = r"""
import importlib.abc, importlib.machinery, json, os, sys

_LOG, _CUR = [], {"name": None, "rss": None, "round": -1}


def _status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return round(int(line.split()[1]) / 1024, 1)


def _phase(name):
    now = _status("VmRSS")
    if _CUR["name"] is not None:
        peak = _status("VmHWM")
        _LOG.append({"phase": _CUR["name"], "rss_before_mb": _CUR["rss"], "peak_mb": peak, "rss_after_mb": now})
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    _CUR["name"], _CUR["rss"] = name, now
    with open(os.path.join(os.environ["FCL_PHASE_DIR"], f"{os.getpid()}.json"), "w") as f:
        json.dump(_LOG, f)


_ROUND = ("_round", "round")  # the method that runs a round: None as phase, it names the round
# module -> class -> (method, phase): the split daemon's parts, and the daemon before the split
_HOOKS = {
    "edge_client.rounds": {"RoundWork": (("round", None), ("served", "served"), ("checkpoint", "checkpoint"))},
    "edge_client.learning": {"DeviceLearner": (("evaluate", "evaluate"), ("start_tasks", "start_tasks"),
                                               ("arrived", "train+upload"))},
    "edge_client.uplink": {"Uplink": (("frame", "frame"), ("send", "send"))},
    "edge_client.daemon": {"ClientDaemon": (("_round", None), ("_evaluate", "evaluate"), ("_served", "served"),
                                            ("_start_tasks", "start_tasks"), ("_arrived", "train+upload"),
                                            ("_frame", "frame"), ("_checkpoint", "checkpoint"), ("_send", "send"))},
}


def _wrap(cls, method, phase):
    inner = getattr(cls, method)

    def wrapped(self, *args, **kwargs):
        if method in _ROUND:
            _CUR["round"] = args[0].header.round
        if phase:
            _phase(f"{_CUR['round']} {phase}")
        out = inner(self, *args, **kwargs)
        if method in _ROUND:
            _phase(f"{_CUR['round']} between")
        return out

    setattr(cls, method, wrapped)


def _patch(module):
    for name, methods in _HOOKS[module.__name__].items():
        cls = getattr(module, name)
        for method, phase in methods:
            if hasattr(cls, method):  # the split daemon's ClientDaemon has none of the old ones
                _wrap(cls, method, phase)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _HOOKS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        loader.exec_module = exec_module
        return spec


if os.environ.get("FCL_PHASE_DIR"):
    sys.meta_path.insert(0, _Finder())
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scenario")
    ap.add_argument("--code", default=".", help="the source tree the run imports (default: this checkout)")
    ap.add_argument("--out", required=True, help="the JSON document to write")
    ap.add_argument("--set", action="append", default=[], help="scenario overrides, as for fcl simulate")
    args = ap.parse_args()
    code = Path(args.code).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        hooks, logs, run = Path(tmp) / "hooks", Path(tmp) / "logs", Path(tmp) / "run"
        hooks.mkdir()
        logs.mkdir()
        (hooks / "sitecustomize.py").write_text(HOOK)
        env = {**os.environ, "PYTHONPATH": f"{hooks}{os.pathsep}{code}", "FCL_PHASE_DIR": str(logs)}
        cmd = [sys.executable, "-m", "fcl_edge.cli", "simulate", args.scenario, "--out", str(run)]
        cmd += [a for s in args.set for a in ("--set", s)]
        subprocess.run(cmd, cwd=code, env=env, check=True, stdout=subprocess.DEVNULL)
        summary = json.loads((run / "summary.json").read_text())
        daemons = [json.loads(p.read_text()) for p in sorted(logs.glob("*.json"))]
    daemons = [d for d in daemons if d]  # processes that imported the daemon but ran no round
    peaks = [max(daemons_phase["peak_mb"] for daemons_phase in d) for d in daemons]
    doc = {
        "command": "python benchmarks/profile_daemon_phases.py " + " ".join(sys.argv[1:]),
        "load_average": os.getloadavg(),
        "final": summary["final"],
        "bytes": summary["bytes"],
        "peak_mb_by_daemon": peaks,
        "peak_mb_max": max(peaks),
        "top_phases_by_daemon": [sorted(d, key=lambda r: -r["peak_mb"])[:4] for d in daemons],
        "phases_by_daemon": daemons,
    }
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(json.dumps({k: doc[k] for k in ("peak_mb_by_daemon", "peak_mb_max", "load_average")}))


if __name__ == "__main__":
    main()
