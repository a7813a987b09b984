#!/usr/bin/env python
"""Where an aggregator's time goes per update and at a round's close, in one process.

Builds the flat fleet benchmark's aggregator (``bench_fleet.py``: FedAvg, a MADE of about
``--params`` parameters, ``--devices`` expected devices) on the in-process broker, feeds it
``--devices`` sparse updates at ``--density`` (``fleet_devices.UpdateFrames``, as the fleet's
devices send them) through the service's own accept path, and times:

* per update: the inbox's checks (the codec's decode with its CRC, header, sequence, meta,
  names and shapes), then the service's accept (``accept``), of which the fold into the
  round's ``RunningSum`` (``fold``, with the final flush of what is staged) and the journal
  append (``journal``: one record written to the round's journal file; made durable by one
  fdatasync per group, here every ``aggregator.state.SYNC_EVERY`` records since no queue runs
  dry, and the share of those syncs is in the figure), as wall and CPU milliseconds;
* at the close, each step the service runs between the last update and the FINISH going
  out: the model from the sums, the round's run-log rows, the commit (checkpoint, fsynced;
  the journal cleared), and the FINISH announcement (encoding the model and its sync frames).

No MQTT: ``bench_fleet.py`` measures the close over Mosquitto (to the FINISH reaching a
watcher).  Writes ``--out`` (benchmarks/results/round_close.json) and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import bench_fleet  # noqa: E402  (siblings: benchmarks/ is sys.path[0])
from bench_codec import machine_info  # noqa: E402
from fleet_devices import UpdateFrames  # noqa: E402

from aggregator.service import AggregatorService  # noqa: E402
from fclcore import fastfold  # noqa: E402
from fclcore.codec import Kind  # noqa: E402
from fclcore.config import load_config  # noqa: E402
from fclcore.inproc import InProcessBroker, InProcessLink  # noqa: E402
from fclcore.schema import AggregatorConfig  # noqa: E402
from fclcore.strategy import Update  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--devices", type=int, default=1000, help="updates in the round")
    parser.add_argument("--params", type=int, default=1_000_000, help="model parameters (about)")
    parser.add_argument("--density", type=float, default=0.1, help="share of each tensor an update carries")
    parser.add_argument("--seed", type=int, default=0, help="seed of the model and the update")
    parser.add_argument(
        "--out", type=Path, default=REPO / "benchmarks" / "results" / "round_close.json", help="JSON output"
    )
    return parser.parse_args(argv)


def build(args: argparse.Namespace, work: Path) -> AggregatorService:
    fed = bench_fleet.federation(argparse.Namespace(params=args.params, seed=args.seed, timeout=100))
    config = {
        "federation": fed,
        "input_dim": bench_fleet.INPUT_DIM,
        "max_clients": max(10_000, args.devices),
        "expected_clients": [f"dev-{i:05d}" for i in range(args.devices)],
        "out_dir": str(work / "root"),
        "broker": {"url": "mqtt://127.0.0.1:1"},  # never dialled: the link is in-process
    }
    (work / "aggregator.yaml").write_text(yaml.safe_dump(config))
    broker = InProcessBroker()
    cfg = load_config(AggregatorConfig, work / "aggregator.yaml")
    service = AggregatorService(cfg, link_factory=lambda url, cid, **kw: InProcessLink(broker, cid, **kw))
    service.link.start()
    return service


def _timed(totals: dict, name: str, fn):
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    wall, cpu = totals.setdefault(name, [0.0, 0.0])
    totals[name] = [wall + time.perf_counter() - t0, cpu + time.process_time() - c0]
    return out


def run(args: argparse.Namespace, work: Path) -> dict:
    service = build(args, work)
    fast = fastfold.warm()
    roster = service.clients.open_round(0, 0)
    sent = service._announce(Kind.ROUND, 0, 0)
    frames = UpdateFrames(service.fed.name, {k: v.shape for k, v in service.global_params.items()}, args.density, 0)
    model = service.global_params
    received: dict[str, Update] = {}
    per_update: dict[str, list[float]] = {}
    # the accept path's two heavy parts, timed where the service calls them
    fold, journal = service.sites.fold, service.store.journal
    service.sites.fold = lambda *a: _timed(per_update, "fold", lambda: fold(*a))
    service.store.journal = lambda *a: _timed(per_update, "journal", lambda: journal(*a))
    first_seq = service.inbox.min_seq + 1
    for i, client in enumerate(roster):
        payload = frames.frame(client, 0, 0, first_seq + i, 100 + i)
        update = _timed(
            per_update,
            "checks",
            lambda: service.inbox.check(client, payload, len(payload), 0, set(received), Kind.UPDATE),
        )
        assert isinstance(update, Update), update
        _timed(per_update, "accept", lambda: service.intake.accept(update, 0, payload, received, model, journal=True))
    _timed(per_update, "fold", service.intake.running(0, model)[0].flush)  # what is still staged is folding too
    close: dict[str, list[float]] = {}
    t0 = time.perf_counter()
    service.global_params = _timed(close, "model", lambda: service.intake.close(0, received, model))
    _timed(close, "run_log", lambda: service.report.record(0, 0, roster, received, sent, 1, 1.0, {}))
    _timed(close, "commit", lambda: (service.clients.close_round(roster, received), service._commit(0)))
    _timed(close, "finish", lambda: service._announce(Kind.FINISH, 1, 0))
    total = time.perf_counter() - t0
    if hasattr(service.store, "wait_swept"):  # a checkout from before the background deletion has none
        service.store.wait_swept(60)
    service.link.close("stopped")
    service.runlog.close()
    n = len(roster)
    return {
        "devices": n,
        "fold": f"numba {fastfold.version()}" if fast else "numpy",
        "per_update_ms": {
            k: {"wall": round(1e3 * w / n, 4), "cpu": round(1e3 * c / n, 4)} for k, (w, c) in per_update.items()
        },
        "close_s": {k: {"wall": round(w, 4), "cpu": round(c, 4)} for k, (w, c) in close.items()},
        "close_total_s": round(total, 4),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="round-close-") as tmp:
        result = run(args, Path(tmp))
    result.update(
        params=args.params,
        density=args.density,
        command=shlex.join([Path(sys.executable).name, *sys.argv]),
        machine={**machine_info(), "loadavg_before": [round(x, 2) for x in load_before]},
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
