#!/usr/bin/env python
"""Fleet benchmark: one round of N synthetic devices over real Mosquitto brokers.

``--layout flat``: one Mosquitto and one ``fcl aggregator`` process; every device connects to
that broker.  ``--layout sites``: a root Mosquitto and ``fcl aggregator`` (its clients are the
sites), and per site a Mosquitto bridged to the root with deploy/mosquitto/site-bridge.conf and
an ``fcl site`` process; the devices are spread evenly over the site brokers.

The model is a FedAvg MADE on 784 inputs with two hidden layers sized to about ``--params``
parameters; every device sends the same sparse update at ``--density`` (fleet_devices.py:
encoded once, per device only the header differs) with its own sample count.  The federation
has one round; the root's FINISH announcement is the global model going out.

Measured, per run:

* ``folds_per_s``: devices / (last - first device update folded), from the wall-clock times
  the flat aggregator's ``round`` event (or the sites' ``partial`` events) records: the rate
  the whole system took in updates, bounded by its slowest stage;
* ``close_latency_s``: last device update folded -> the root's FINISH (the new global model)
  received by a watcher on the root broker;
* ``aggregator_peak_rss_mb``: VmHWM of each aggregator process (root and sites), the largest;
  ``aggregator_cpu_s`` / ``broker_cpu_s``: utime + stime of those processes and the Mosquittos;
* ``bytes_per_device``: the MQTT PUBLISH packet bytes a device sent (status, update) and received
  (the round announcement), averaged over devices;
* ``scrape`` (``--scrape N``, flat): the aggregator's Prometheus endpoint scraped N times after
  the round closed (while it waits for the devices' final evaluations), each device's status
  carrying the ``health`` field a real device sends: seconds per scrape (median, max) plain and
  gzipped, the series served (per device and in all) and the page's bytes;
* ``completed``: every device's update acknowledged, the FINISH seen, and the root's run log
  counting each device once (flat: N accepted updates; sites: the sites' ``partial`` events
  name every device once and the root's accepted sample counts sum to the devices' total).

Writes ``--out`` (benchmarks/results/fleet.json, one entry per (devices, layout), replacing an
earlier entry of the same pair) and the markdown table beside it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import paho.mqtt.client as mqtt
import yaml

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # allow `python benchmarks/bench_fleet.py` without installing
    sys.path.insert(0, str(REPO))

from bench_codec import machine_info  # noqa: E402  (a sibling script: benchmarks/ is sys.path[0])

from fcl_edge.broker import MosquittoProcess, free_port, site_bridge_config  # noqa: E402
from fclcore import topics  # noqa: E402
from fclcore.codec import decode  # noqa: E402
from fclcore.made_spec import param_shapes  # noqa: E402
from fclcore.procmem import peak_rss_mb  # noqa: E402
from fclcore.schema import ModelSpec  # noqa: E402

FED = "fleet"
INPUT_DIM = 784
DEVICES_PER_WORKER = 2500  # a paho client holds 3 descriptors; this keeps a worker far below 20,000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--devices", type=int, default=1000, help="synthetic devices in the round")
    parser.add_argument("--layout", choices=("flat", "sites"), default="flat", help="one aggregator, or root + sites")
    parser.add_argument("--sites", type=int, default=10, help="site aggregators (--layout sites)")
    parser.add_argument("--params", type=int, default=1_000_000, help="model parameters (about)")
    parser.add_argument("--density", type=float, default=0.1, help="share of each tensor an update carries")
    parser.add_argument("--workers", type=int, default=None, help="device processes (default: 1 per 2,500, >= 2)")
    parser.add_argument("--window", type=int, default=32, help="connects / fetch-and-sends in progress per broker")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model, the update and the sample counts")
    parser.add_argument("--timeout", type=float, default=1800, help="give up on the round after this many seconds")
    parser.add_argument("--workdir", type=Path, default=None, help="brokers' and aggregators' files (default: tmp)")
    parser.add_argument("--scrape", type=int, default=0, help="time this many scrapes of /metrics (flat layout)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 20 devices, 20,000 parameters, 2 sites")
    parser.add_argument(
        "--out", type=Path, default=REPO / "benchmarks" / "results" / "fleet.json", help="JSON results (merged)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.devices, args.params, args.sites = min(args.devices, 20), min(args.params, 20_000), min(args.sites, 2)
    if args.devices < 1 or not 0 < args.density <= 1 or args.params < 2000 or args.window < 1:
        parser.error("expected devices >= 1, 0 < density <= 1, params >= 2000, window >= 1")
    if args.scrape and args.layout != "flat":
        parser.error("--scrape: the flat layout's aggregator is the one scraped")
    if args.layout == "sites" and not 1 <= args.sites <= args.devices:
        parser.error(f"--sites: expected 1 to {args.devices} (the devices), got {args.sites}")
    args.workers = args.workers or max(2, math.ceil(args.devices / DEVICES_PER_WORKER))
    return args


def model_spec(params: int) -> ModelSpec:
    """Two equal hidden layers H with H^2 + 2*784*H + 2*H + 784 ~ params (no direct connection)."""
    b = 2 * INPUT_DIM + 2
    hidden = max(1, round((-b + math.sqrt(b * b + 4 * max(0, params - INPUT_DIM))) / 2))
    return ModelSpec(hidden_sizes=[hidden, hidden], direct=False, natural_order=True, num_orders=1, mask_seed=1)


def federation(args: argparse.Namespace) -> dict:
    spec = model_spec(args.params)
    return {
        "name": FED,
        "method": "fedavg",
        "seed": args.seed,
        "num_tasks": 1,
        "rounds_per_task": 1,
        "model": {k: getattr(spec, k) for k in ("hidden_sizes", "direct", "natural_order", "num_orders", "mask_seed")},
        # one attempt, no re-send requests: a missing update shows as a run that does not complete
        "rounds": {"deadline_s": args.timeout, "quorum": 1.0, "start_timeout_s": args.timeout, "max_attempts": 1}
        | {"resend_after_s": args.timeout},
        "wire": {"value_dtype": "float32", "max_frame_mb": 64},
    }


# -- processes ------------------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    """utime + stime of a live process (/proc/<pid>/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_fcl(kind: str, config: dict, work: Path, name: str) -> subprocess.Popen:
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(work / f"{name}.log", "w") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(
            [sys.executable, "-m", "fcl_edge.cli", kind, "--config", str(path)], env=env, stdout=log, stderr=log
        )


def stop(proc: subprocess.Popen, timeout: float = 60) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Watcher:
    """Times the root's announcements (ROUND, FINISH) on the root broker."""

    def __init__(self, port: int) -> None:
        self.seen: dict[str, float] = {}
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="bench-fleet-watcher")
        self.client.on_connect = lambda c, u, f, rc, p: c.subscribe(topics.round_topic(FED), qos=1)
        self.client.on_message = self._on_message
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()

    def _on_message(self, client, userdata, message) -> None:
        if message.payload:
            kind = decode(message.payload).header.kind
            self.seen.setdefault(kind.name, time.time())

    def close(self) -> None:
        self.client.loop_stop()
        self.client.disconnect()


# -- one run --------------------------------------------------------------------------------
def run(args: argparse.Namespace, work: Path) -> dict:
    devices = [(f"dev-{i:05d}", 1 + (i * 7919 + args.seed) % 200) for i in range(args.devices)]
    fed = federation(args)
    brokers: list[MosquittoProcess] = []
    aggregators: dict[str, subprocess.Popen] = {}
    workers: list[subprocess.Popen] = []
    root = MosquittoProcess(work / "root-broker").start()
    brokers.append(root)
    watcher = Watcher(root.port)
    try:
        groups = _topology(args, fed, devices, work, root, brokers, aggregators)
        workers = _start_workers(args, fed, groups)
        deadline = time.monotonic() + args.timeout
        while "FINISH" not in watcher.seen and time.monotonic() < deadline:
            if any(p.poll() is not None for p in (*aggregators.values(), *workers)):
                break
            time.sleep(0.1)
        scraped = args.scrape and "FINISH" in watcher.seen and aggregators["root"].poll() is None
        scrape = time_scrapes(args.metrics_port, args.scrape, aggregators["root"].pid) if scraped else None
        peaks = {name: peak_rss_mb(p.pid) for name, p in aggregators.items()}
        agg_cpu = {name: cpu_seconds(p.pid) for name, p in aggregators.items() if p.poll() is None}
        broker_cpu = sum(cpu_seconds(b.proc.pid) for b in brokers)
        counts = [_stop_worker(p) for p in workers]
    finally:
        watcher.close()
        for proc in (*workers, *aggregators.values()):
            stop(proc)
        for broker in brokers:
            broker.stop()
    return _result(args, devices, watcher.seen, peaks, agg_cpu, broker_cpu, counts, work) | (
        {"scrape": scrape} if args.scrape else {}
    )


def time_scrapes(port: int, n: int, pid: int) -> dict:
    """Seconds per GET of the whole /metrics page, plain and gzipped (as Prometheus asks), the
    aggregator's CPU seconds per GET (``pid``: its process; barely moved by other load), and
    what the page holds."""
    out: dict = {"scrapes": n, "loadavg": [round(x, 2) for x in os.getloadavg()]}
    for name, headers in (("plain", {}), ("gzip", {"Accept-Encoding": "gzip"})):
        times, cpu = [], cpu_seconds(pid)
        for _ in range(n):
            request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=headers)
            started = time.perf_counter()
            with urllib.request.urlopen(request, timeout=60) as response:
                body = response.read()
            times.append(time.perf_counter() - started)
        out[f"{name}_s_median"], out[f"{name}_s_max"] = round(statistics.median(times), 4), round(max(times), 4)
        out[f"{name}_cpu_s"] = round((cpu_seconds(pid) - cpu) / n, 4)
        out[f"{name}_bytes"] = len(body)
        if name == "plain":
            lines = [line for line in body.decode().splitlines() if line and not line.startswith("#")]
            out["series"] = len(lines)
            out["device_series"] = sum(line.startswith("fcl_device_") for line in lines)
    return out


def _topology(args, fed, devices, work, root, brokers, aggregators) -> list[dict]:
    """Start the aggregator(s) (and the site brokers); the devices of each broker."""
    base = {"federation": fed, "input_dim": INPUT_DIM, "max_clients": max(10_000, len(devices))}
    if args.layout == "flat":
        cfg = {**base, "expected_clients": [d for d, _ in devices], "out_dir": str(work / "root")}
        if args.scrape:
            args.metrics_port = cfg["metrics_port"] = free_port()
        aggregators["root"] = start_fcl("aggregator", {**cfg, "broker": {"url": root.url}}, work, "root")
        return [{"port": root.port, "devices": devices}]
    sites = [f"site-{s:02d}" for s in range(args.sites)]
    cfg = {**base, "expected_clients": sites, "sites": sites, "out_dir": str(work / "root")}
    aggregators["root"] = start_fcl("aggregator", {**cfg, "broker": {"url": root.url}}, work, "root")
    groups = []
    for s, site in enumerate(sites):
        share = devices[s :: len(sites)]
        broker = MosquittoProcess(work / f"{site}-broker", site_bridge_config(FED, site, "127.0.0.1", root.port))
        brokers.append(broker.start())
        site_cfg = {
            "federation": fed,
            "site_id": site,
            "expected_clients": [d for d, _ in share],
            "broker": {"url": broker.url},
            "out_dir": str(work / site),
            "input_dim": INPUT_DIM,
        }
        aggregators[site] = start_fcl("site", site_cfg, work, site)
        groups.append({"port": broker.port, "devices": share})
    return groups


def _start_workers(args, fed, groups: list[dict]) -> list[subprocess.Popen]:
    """Deal every group's devices over the worker processes (each worker: one group slice per broker)."""
    shapes = {k: list(v) for k, v in param_shapes(model_spec(args.params).made_config(INPUT_DIM)).items()}
    procs = []
    for w in range(args.workers):
        spec = {
            "federation": FED,
            "name": f"bench-fleet-worker-{w}",
            "window": max(1, args.window // args.workers),
            "shapes": shapes,
            "update": [args.density, args.seed],
            "groups": [{"port": g["port"], "devices": g["devices"][w :: args.workers]} for g in groups],
            "health": bool(args.scrape),
        }
        spec["groups"] = [g for g in spec["groups"] if g["devices"]]
        cmd = [sys.executable, str(Path(__file__).with_name("fleet_devices.py")), json.dumps(spec)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True))
    return procs


def _stop_worker(proc: subprocess.Popen) -> dict:
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    lines = out.strip().splitlines()
    return json.loads(lines[-1]) if lines else {"devices": 0, "acked": 0, "up_bytes": 0, "down_bytes": 0}


# -- results --------------------------------------------------------------------------------
def _events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def fold_span(args, work: Path) -> tuple[float, float] | None:
    """Wall-clock times of the first and last device update folded in round 0, from the run logs
    (the root's ``round`` event, or every site's ``partial`` event)."""
    if args.layout == "flat":
        spans = [e for e in _events(work / "root" / "metrics.jsonl") if e["event"] == "round" and e["round"] == 0]
    else:
        spans = [e for e in site_events(args, work) if e["event"] == "partial" and e["round"] == 0]
    if not spans or len(spans) < (1 if args.layout == "flat" else args.sites):
        return None
    return min(e["first_update_t"] for e in spans), max(e["last_update_t"] for e in spans)


def site_events(args, work: Path) -> list[dict]:
    return [e for s in range(args.sites) for e in _events(work / f"site-{s:02d}" / "metrics.jsonl")]


def counted_once(args, devices: list[tuple[str, int]], work: Path) -> str | None:
    """None when the root's run log counts every device's update once, else what is wrong."""
    root = _events(work / "root" / "metrics.jsonl")
    rows = [e for e in root if e["event"] == "round_client" and e["round"] == 0 and e["status"] == "accepted"]
    samples = sum(e["n_samples"] for e in rows)
    if samples != sum(n for _, n in devices):
        return f"the root's accepted n_samples sum to {samples}, the devices' to {sum(n for _, n in devices)}"
    if args.layout == "flat":
        named = [e["client"] for e in rows]
    else:
        named = [
            d for e in site_events(args, work) if e["event"] == "partial" and e["round"] == 0 for d in e["devices"]
        ]
    if sorted(named) != sorted(d for d, _ in devices):
        return f"{len(named)} device updates named ({len(set(named))} distinct), expected {len(devices)}"
    return None


def _result(args, devices, seen, peaks, agg_cpu, broker_cpu, counts, work) -> dict:
    n = len(devices)
    acked = sum(c["acked"] for c in counts)
    span = fold_span(args, work)
    problem = None
    if acked < n:
        problem = f"{acked} of {n} updates acknowledged by the broker"
    elif span is None or "FINISH" not in seen:
        problem = "the round did not close before --timeout (or an aggregator exited): see the logs in the workdir"
    else:
        problem = counted_once(args, devices, work)
    first, last = span or (None, None)
    closed = span is not None and "FINISH" in seen
    up, down = sum(c["up_bytes"] for c in counts), sum(c["down_bytes"] for c in counts)
    rss = [v for v in peaks.values() if v is not None]
    return {
        "devices": n,
        "layout": args.layout,
        "sites": args.sites if args.layout == "sites" else 0,
        "model_params": sum(
            math.prod(s) for s in param_shapes(model_spec(args.params).made_config(INPUT_DIM)).values()
        ),
        "density": args.density,
        "completed": problem is None,
        "folds_per_s": round(n / (last - first), 1) if span and last > first else None,
        "close_latency_s": round(seen["FINISH"] - last, 3) if closed else None,
        "aggregator_peak_rss_mb": max(rss, default=None),
        "broker_cpu_s": round(broker_cpu, 2),
        "bytes_per_device": round((up + down) / n),
        # extras
        "problem": problem,
        "up_bytes_per_device": round(up / n),
        "down_bytes_per_device": round(down / n),
        "root_peak_rss_mb": peaks.get("root"),
        "site_peak_rss_mb": max((v for k, v in peaks.items() if k != "root" and v is not None), default=None),
        "aggregator_cpu_s": round(sum(agg_cpu.values()), 2),
        "fold_span_s": round(last - first, 3) if span else None,
        # > 0: updates waited at the aggregators after the broker acknowledged the last one (their backlog)
        "last_ack_to_last_fold_s": round(last - max(c["last_ack"] for c in counts if c["last_ack"]), 3)
        if span and acked
        else None,
        "round_s": round(seen["FINISH"] - seen["ROUND"], 3) if {"ROUND", "FINISH"} <= seen.keys() else None,
        **(_site_extras(args, work) if args.layout == "sites" else {}),
        "device_disconnects": sum(c.get("disconnects", 0) for c in counts),
        "workers": args.workers,
    }


def _site_extras(args, work: Path) -> dict:
    """The partial-sum frames' size and the root's span of merging them (first to last partial in)."""
    partials = [e for e in site_events(args, work) if e["event"] == "partial" and e["round"] == 0]
    root = [e for e in _events(work / "root" / "metrics.jsonl") if e["event"] == "round" and e["round"] == 0]
    merged = root[0]["last_update_t"] - root[0]["first_update_t"] if root else None
    return {
        "partial_frame_bytes_max": max((e["bytes"] for e in partials), default=None),
        "root_merge_span_s": None if merged is None else round(merged, 3),
    }


def save(args: argparse.Namespace, entry: dict, load_before: tuple) -> dict:
    """Merge ``entry`` into --out (replacing the same devices and layout), write the table beside it."""
    report = json.loads(args.out.read_text()) if args.out.exists() else {"runs": []}
    runs = [r for r in report["runs"] if (r["devices"], r["layout"]) != (entry["devices"], entry["layout"])]
    entry |= {
        "command": shlex.join(["python", "benchmarks/bench_fleet.py", *sys.argv[1:]]),
        "timestamp": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "loadavg_before": [round(x, 2) for x in load_before],
    }
    runs.append(entry)
    report["runs"] = sorted(runs, key=lambda r: (r["devices"], r["layout"]))
    report["machine"] = machine_info()
    report["command"] = "; ".join(r["command"] for r in report["runs"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report))
    return report


def markdown(report: dict) -> str:
    m = report["machine"]
    lines = [
        "# Fleet run: one round of synthetic devices over Mosquitto",
        "",
        f"Machine: {m['cpu_count']} cores, {m['platform']}, Python {m['python']}.  "
        "Each run's command is in its row's `command` in fleet.json.",
        "",
        "| devices | layout | sites | params | density | completed | folds/s | close s | agg. peak RSS MiB "
        "| broker CPU s | agg. CPU s | bytes/device (up + down) | load avg before | command |",
        "|---:|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in report["runs"]:
        lines.append(
            f"| {r['devices']:,} | {r['layout']} | {r['sites']} | {r['model_params']:,} | {r['density']} | "
            f"{r['completed']} | {r['folds_per_s']} | {r['close_latency_s']} | {r['aggregator_peak_rss_mb']} | "
            f"{r['broker_cpu_s']} | {r['aggregator_cpu_s']} | {r['bytes_per_device']:,} "
            f"({r['up_bytes_per_device']:,} + {r['down_bytes_per_device']:,}) | {r['loadavg_before'][0]} "
            f"| `{r['command']}` |"
        )
    scraped = [r for r in report["runs"] if r.get("scrape")]
    if scraped:
        lines += [
            "",
            "Prometheus scrapes of the aggregator after the round closed (`--scrape N`; seconds per GET of "
            "/metrics, median / max of N):",
            "",
            "| devices | series (per-device) | page bytes (gzip) | plain s | gzip s | aggregator CPU s per scrape "
            "(plain, gzip) | load avg at scrape |",
            "|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in scraped:
            sc = r["scrape"]
            lines.append(
                f"| {r['devices']:,} | {sc['series']:,} ({sc['device_series']:,}) | {sc['plain_bytes']:,} "
                f"({sc['gzip_bytes']:,}) | {sc['plain_s_median']} / {sc['plain_s_max']} | {sc['gzip_s_median']} / "
                f"{sc['gzip_s_max']} | {sc.get('plain_cpu_s')}, {sc.get('gzip_cpu_s')} | {sc['loadavg'][0]} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # for us and the brokers we start
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-fleet-", dir=args.workdir) as tmp:
        entry = run(args, Path(tmp))
    report = save(args, entry, load_before)
    print(markdown(report))
    if entry["problem"]:
        print(f"not completed: {entry['problem']}", file=sys.stderr)
    return 0 if entry["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
