"""Devices online a share of the time: synchronous rounds against buffered (FedBuff) rounds, on
one seeded availability trace, side by side in one run (issue 37, item 5; docs/buffered.md).

Each mode runs the real services: a Mosquitto broker (``MosquittoProcess``), the aggregator
service and one ``fcl client`` daemon per device, each device reaching the broker only through
its own ``LinkRelay`` on 127.0.0.1 (fcl_edge/links.py).  The bench replays each device's
seeded trace (benchmarks/async_trace.py) on its relay: offline, the relay cuts the device's
connection and refuses new ones, so the device really cannot reach the broker; a third of the
devices also get the ``3g`` profile's relay delay and stalls (no bandwidth shaping: that needs
network namespaces).  Both modes replay the same traces from their first round.

Time is scaled down so both runs fit in about ten minutes on a 2-core machine: a device trains
a round for ``--train-s`` seconds (spread 0.5x to 1.5x per device, ``train_time_shim.py``) and
its sessions average ``--mean-online-s`` seconds; at ``--scale 10`` these stand for a device
that trains for about a minute in sessions of a few minutes.  The devices start, load and
connect, the aggregator sees them all online (the fleet enrolls together), and then the trace
begins, as the first round is announced: its clock is the one every time here is measured on.
Once the last version is published every device comes online for the final evaluation, so that
every record is complete.

Per mode: the time from the first round until the first version whose metric reached the
target was published; the final version's metric (its NLL on the last task's test data, from
the devices' evaluations: a device evaluates the task it is in at every round, all tasks at a
task's end; the final mean over both tasks is reported beside it); bytes up and down (the
devices' meters); and what became of each round of device training (``async_trace.outcomes``:
folded, refused by reason, lost, double counted).  The target is the synchronous run's final
metric plus 1 nat.

    python benchmarks/bench_async.py                 # 24 devices online 30% of the time

Writes ``benchmarks/results/async.json`` and ``async.md``.  Timings depend on the machine and
its load; both are recorded.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks/results"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import async_trace  # noqa: E402

from fcl_edge.broker import MosquittoProcess  # noqa: E402
from fcl_edge.links import PROFILES, LinkProfile, LinkRelay  # noqa: E402
from fcl_edge.simulate import plan, write_configs  # noqa: E402

SCENARIO = "configs/scenarios/quickstart.yaml"
DIRECT = LinkProfile("direct", up_kbit=0, down_kbit=0, rtt_ms=0)  # the relay only cuts and refuses
SLOW = PROFILES["3g"]  # its relay delay and stalls (the relay does not shape bandwidth)
TICK_S = 0.1


def mode_overrides(args: argparse.Namespace, mode: str) -> list[str]:
    common = [
        "compare=[]",
        "federation.method=fedavg",
        f"clients={args.devices}",
        f"federation.seed={args.seed}",
        f"federation.rounds.deadline_s={args.deadline_s}",
        "federation.rounds.start_timeout_s=120",
        "federation.rounds.max_attempts=5",
        "federation.rounds.resend_after_s=10",
    ]
    if mode == "sync":
        return [
            *common,
            f"federation.rounds_per_task={args.rounds_per_task}",
            f"federation.rounds.quorum={args.quorum}",
        ]
    return [
        *common,
        f"federation.rounds_per_task={args.versions_per_task}",
        "federation.rounds.mode=buffered",
        f"federation.rounds.buffer_k={args.buffer_k}",
        f"federation.rounds.max_staleness={args.max_staleness}",
    ]


class Trace:
    """Replays each device's sessions on its relay from ``start()``; ``all_online()`` ends it."""

    def __init__(self, relays: dict[str, LinkRelay], sessions: dict[str, async_trace.Sessions]) -> None:
        self.relays, self.sessions = relays, sessions
        self.t0: float | None = None
        self.ended = threading.Event()
        self.stop = threading.Event()

    def start(self) -> None:
        self.t0 = time.monotonic()
        self._apply()
        threading.Thread(target=self._run, name="trace", daemon=True).start()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def all_online(self) -> None:
        self.ended.set()
        for relay in self.relays.values():
            relay.set_online(True)

    def _apply(self) -> None:
        t = self.elapsed()
        for device, relay in self.relays.items():
            online = async_trace.online_at(self.sessions[device], t)
            if online != relay.online and not self.ended.is_set():
                relay.set_online(online)

    def _run(self) -> None:
        while not self.stop.wait(TICK_S) and not self.ended.is_set():
            self._apply()


def run_mode(args: argparse.Namespace, mode: str, sessions: dict, train_s: dict[str, float], work: Path) -> dict:
    out = work / mode
    (out / "logs").mkdir(parents=True, exist_ok=True)
    p = plan(str(ROOT / SCENARIO), mode_overrides(args, mode))
    broker = MosquittoProcess(out / "broker").start()
    relays = {
        c: LinkRelay("127.0.0.1", ("127.0.0.1", broker.port), SLOW if i % 3 == 2 else DIRECT, args.seed * 7919 + i)
        for i, c in enumerate(p.client_ids)
    }
    procs: dict[str, subprocess.Popen] = {}
    trace = Trace(relays, sessions)
    watch = async_trace.UpdateWatch(broker.port)
    try:
        configs = write_configs(p, out, broker.url, lambda c, _url: f"mqtt://127.0.0.1:{relays[c].port}")
        for client in p.client_ids:
            _patient_device(configs[client][1])
        for client in p.client_ids:
            argv = [sys.executable, str(ROOT / "benchmarks/train_time_shim.py"), f"{train_s[client]:.2f}", "client"]
            procs[client] = _spawn(client, [*argv, "--config", str(configs[client][1])], out)
        _wait_connected(out, p.client_ids, procs)
        procs["aggregator"] = _spawn(
            "aggregator",
            [sys.executable, "-m", "fcl_edge.cli", "aggregator", "--config", str(configs["aggregator"][1])],
            out,
        )
        _wait_logged(out / "logs/aggregator.log", f"{args.devices}/{args.devices} clients online", procs["aggregator"])
        trace.start()  # the fleet enrolled together; from its first round on, each device keeps its trace
        published = _follow(out / "metrics.jsonl", procs["aggregator"], trace, p.scenario.federation.total_rounds, args)
        wall = trace.elapsed()
        for client in p.client_ids:  # each device ends after its final evaluation; a straggler is stopped
            _stop(procs[client], wait=max(5.0, 90.0 - (trace.elapsed() - wall)))
        code = procs["aggregator"].returncode
    finally:
        trace.stop.set()
        watch.stop()
        for proc in procs.values():
            _stop(proc, wait=0)
        for relay in relays.values():
            relay.close()
        broker.stop()
    after_end = watch.after(_final_evaluation_closed(out / "logs/aggregator.log"))
    return measure(out, p, published, wall, code, sessions, after_end)


def _patient_device(path: Path) -> None:
    """A device that boots out of coverage keeps trying (it does not exit after 10 s), and
    retries its link every 2 s at most: the scaled-down stand-in for a network-up event."""
    cfg = yaml.safe_load(path.read_text())
    cfg["broker"] = {**cfg["broker"], "connect_timeout_s": 3600.0, "reconnect_max_s": 2.0}
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))


def _spawn(name: str, argv: list[str], out: Path) -> subprocess.Popen:
    log = open(out / "logs" / f"{name}.log", "w")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT, env=env)


def _wait_connected(out: Path, clients: list[str], procs: dict, timeout: float = 600.0) -> None:
    """Until every device has loaded and connected once (the trace's clock starts after)."""
    deadline = time.monotonic() + timeout
    waiting = set(clients)
    while waiting:
        waiting = {c for c in waiting if "connected to" not in (out / "logs" / f"{c}.log").read_text()}
        dead = [c for c in waiting if procs[c].poll() is not None]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"devices did not connect: {sorted(dead or waiting)}; logs in {out / 'logs'}")
        time.sleep(0.5)


def _wait_logged(log: Path, text: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{log} did not say {text!r}")
        time.sleep(0.05)


def _follow(metrics: Path, aggregator: subprocess.Popen, trace: Trace, total: int, args) -> dict[int, float]:
    """Seconds after the aggregator's start at which each version was published (its ``round``
    event appeared); after the last one, every device comes online for the final evaluation."""
    published: dict[int, float] = {}
    deadline = time.monotonic() + args.timeout
    while aggregator.poll() is None and time.monotonic() < deadline:
        _note_published(metrics, published, trace.elapsed())
        if total - 1 in published and not trace.ended.is_set():
            trace.all_online()
        time.sleep(0.2)
    if aggregator.poll() is None:
        trace.all_online()  # the run overran --timeout: what it has so far is measured
        _stop(aggregator, wait=30)
    _note_published(metrics, published, trace.elapsed())  # versions of the last poll interval
    return published


def _note_published(metrics: Path, published: dict[int, float], now: float) -> None:
    for e in async_trace.read_events(metrics):
        if e.get("event") == "round" and e["round"] not in published:
            published[e["round"]] = round(now, 2)


def _stop(proc: subprocess.Popen, wait: float) -> None:
    try:
        proc.wait(wait)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the daemon writes its wire.json as it stops
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _final_evaluation_closed(log: Path) -> float:
    """When the aggregator's final evaluation closed (its log line; +inf if it never did)."""
    for line in log.read_text().splitlines():
        if "aggregator.service: final evaluation from" in line:
            return datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    return math.inf


def measure(
    out: Path, p, published: dict[int, float], wall: float, code: int | None, sessions: dict, after_end: set
) -> dict:
    events = async_trace.read_events(out / "metrics.jsonl")
    trained, sent, up, down = {}, {}, 0, 0
    for client in p.client_ids:
        path = out / "clients" / client / "wire.json"
        wire = json.loads(path.read_text()) if path.exists() else {}
        trained[client], sent[client] = async_trace.device_records(wire)
        up += wire.get("up", {}).get("bytes", 0)
        down += wire.get("down", {}).get("bytes", 0)
    folded, refused = async_trace.aggregator_records(events)
    fate = async_trace.outcomes(trained, sent, folded, refused, after_end)
    tasks = p.scenario.federation.num_tasks
    metrics = async_trace.version_metrics(events, tasks - 1)
    every_task = async_trace.all_tasks_metric(events, p.scenario.federation.total_rounds - 1, tasks)
    last = p.scenario.federation.total_rounds - 1
    horizon = max(published.values(), default=wall)
    return {
        "final_metric": round(metrics[last], 4) if last in metrics else None,
        "final_all_tasks": None if every_task is None else round(every_task, 4),
        "bytes_up": up,
        "bytes_down": down,
        "training_used_share": None if fate.training_used_share is None else round(fate.training_used_share, 4),
        "versions": len(published),
        "published_at": published,
        "version_metric": {v: round(m, 4) for v, m in metrics.items()},
        "wall_s": round(wall, 1),
        "aggregator_exit": code,
        "device_rounds_trained": fate.trained,
        "device_rounds_folded": fate.folded,
        "refused": fate.refused,
        "lost_updates": fate.lost,
        "after_end": fate.after_end,
        "double_counted": fate.double_counted,
        "online_share_measured": round(
            sum(async_trace.online_fraction(s, horizon) for s in sessions.values()) / len(sessions), 3
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=24)
    ap.add_argument("--online-share", type=float, default=0.3)
    ap.add_argument("--mean-online-s", type=float, default=20.0, help="mean online session (trace seconds)")
    ap.add_argument("--train-s", type=float, default=6.0, help="a device's mean training time per round")
    ap.add_argument("--scale", type=float, default=10.0, help="real seconds one trace second stands for (docs only)")
    ap.add_argument("--rounds-per-task", type=int, default=6, help="synchronous rounds per task")
    ap.add_argument("--quorum", type=float, default=0.25, help="synchronous rounds' quorum")
    ap.add_argument("--versions-per-task", type=int, default=30, help="buffered versions per task")
    ap.add_argument("--buffer-k", type=int, default=3)
    ap.add_argument("--max-staleness", type=int, default=4)
    ap.add_argument("--deadline-s", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds a mode may run")
    ap.add_argument("--out", type=Path, default=RESULTS / "async.json")
    ap.add_argument("--keep", type=Path, default=None, help="keep the run directories here")
    ap.add_argument("--render", action="store_true", help="only rewrite the table from the --out file")
    args = ap.parse_args()
    if args.render:
        args.out.with_suffix(".md").write_text(table(json.loads(args.out.read_text())))
        return

    devices = [f"client-{i}" for i in range(args.devices)]
    sessions = async_trace.traces(devices, 4 * args.timeout, args.online_share, args.mean_online_s, args.seed)
    spread = random.Random(args.seed)
    train_s = {d: args.train_s * spread.uniform(0.5, 1.5) for d in devices}
    work = args.keep or Path(tempfile.mkdtemp(prefix="bench-async-"))
    load_before = os.getloadavg()
    runs = {}
    for mode in ("sync", "buffered"):
        if (work / mode).exists():
            shutil.rmtree(work / mode)
        runs[mode] = run_mode(args, mode, sessions, train_s, work)
        brief = {k: v for k, v in runs[mode].items() if k not in ("published_at", "version_metric")}
        print(f"{mode}: {json.dumps(brief)}")
    result = summarize(args, runs, load_before, sys.argv[1:])
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(table(result))
    print(table(result))
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)


def summarize(args: argparse.Namespace, runs: dict, load_before: tuple, argv: list[str]) -> dict:
    sync_final = runs["sync"]["final_metric"]
    target = None if sync_final is None else round(sync_final + 1.0, 4)
    result: dict = {}
    for mode, run in runs.items():
        published = {int(v): t for v, t in run["published_at"].items()}
        metrics = {int(v): m for v, m in run["version_metric"].items()}
        result[mode] = {
            "time_to_target_s": None if target is None else async_trace.time_to_target(published, metrics, target),
            "final_metric": run["final_metric"],
            "bytes_up": run["bytes_up"],
            "bytes_down": run["bytes_down"],
            "training_used_share": run["training_used_share"],
        }
    return {
        **result,
        "target_metric": target,
        "devices": args.devices,
        "online_share": args.online_share,
        "lost_updates": sum(r["lost_updates"] for r in runs.values()),
        "double_counted": sum(r["double_counted"] for r in runs.values()),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}; "
        f"load average (1 min) {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after",
        "command": " ".join(["python benchmarks/bench_async.py", *argv]),
        "details": {
            "metric": "NLL (nats) of a version on the last task's test data, from the devices' evaluations",
            "target": "the synchronous run's final metric + 1 nat",
            "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            **{mode: run for mode, run in runs.items()},
        },
    }


def table(result: dict) -> str:
    s, b, d = result["sync"], result["buffered"], result["details"]
    cfg = d["settings"]
    rows = [
        ("time to target (s)", s["time_to_target_s"], b["time_to_target_s"]),
        ("final metric (last task's NLL, nats)", s["final_metric"], b["final_metric"]),
        ("final mean NLL over both tasks", d["sync"]["final_all_tasks"], d["buffered"]["final_all_tasks"]),
        ("versions published", d["sync"]["versions"], d["buffered"]["versions"]),
        (
            "wall time to the last version (s)",
            max(d["sync"]["published_at"].values(), default=None),
            max(d["buffered"]["published_at"].values(), default=None),
        ),
        ("device training rounds done", d["sync"]["device_rounds_trained"], d["buffered"]["device_rounds_trained"]),
        ("of them folded", d["sync"]["device_rounds_folded"], d["buffered"]["device_rounds_folded"]),
        ("training used share", s["training_used_share"], b["training_used_share"]),
        ("refused updates by reason", _reasons(d["sync"]["refused"]), _reasons(d["buffered"]["refused"])),
        ("sent after the run's end", d["sync"]["after_end"], d["buffered"]["after_end"]),
        (
            "lost / double-counted updates",
            f"{d['sync']['lost_updates']} / {d['sync']['double_counted']}",
            f"{d['buffered']['lost_updates']} / {d['buffered']['double_counted']}",
        ),
        ("bytes up", f"{s['bytes_up']:,}", f"{b['bytes_up']:,}"),
        ("bytes down", f"{s['bytes_down']:,}", f"{b['bytes_down']:,}"),
    ]
    lines = [
        "# Availability trace: synchronous against buffered rounds",
        "",
        f"{result['devices']} FedAvg devices (quickstart model, 2 tasks), each online {result['online_share']:.0%} "
        f"of the time (measured {d['sync']['online_share_measured']:.0%} and "
        f"{d['buffered']['online_share_measured']:.0%} until the last version) "
        f"in sessions of {cfg['mean_online_s']:g} s on average, training {cfg['train_s']:g} s a round on average "
        f"(x{cfg['scale']:g}: sessions of {cfg['mean_online_s'] * cfg['scale'] / 60:.1f} min, "
        f"{cfg['train_s'] * cfg['scale']:.0f} s of training). Synchronous: {cfg['rounds_per_task']} rounds per task, "
        f"quorum {cfg['quorum']}; buffered: {cfg['versions_per_task']} versions per task, buffer_k {cfg['buffer_k']}, "
        f"max_staleness {cfg['max_staleness']}. Target: the last task's NLL <= {result['target_metric']} "
        "(the synchronous run's final + 1 nat).",
        "",
        "| | synchronous | buffered |",
        "|---|---:|---:|",
        *[f"| {name} | {_cell(x)} | {_cell(y)} |" for name, x, y in rows],
        "",
        f"`{result['command']}`; {result['machine']}.",
        "",
    ]
    return "\n".join(lines)


def _reasons(counts: dict[str, int]) -> str:
    return ", ".join(f"{r} {n}" for r, n in counts.items()) or "none"


def _cell(x: object) -> str:
    if x is None:
        return "not reached"
    if isinstance(x, float):
        return f"{x:.4g}" if x < 1 else f"{x:,.1f}" if x >= 100 else f"{x:.2f}"
    return str(x)


if __name__ == "__main__":
    main()
