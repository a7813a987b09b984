"""Where a device's memory goes: RSS of one client daemon's work, phase by phase (issue 20).

For each scenario the parent plans the federation (``fcl_edge.simulate.plan``), writes the
client configs (``write_configs``) and builds what the aggregator would send for round 0: the
strategy's initial model with the announcement's metadata (``aggregator/announcer.py``
``Announcer.announce``: run, federation, input_dim, schedule, ``announce_meta(0)``), and any per-client
frame ``client_downlinks(0)`` publishes, all encoded with ``fclcore.codec`` as on the wire.
Then a fresh Python process per scenario (so imports count from zero) plays ``client-0``:

    interpreter -> import numpy -> import edge_client.daemon (torch, methods) -> import onnxruntime, onnx
    -> load_client_data -> methods.learner_for -> decode + load_global + start_task(0)
    -> train_round + upload + encode -> evaluate (the daemon's DeviceLearner.evaluate) -> served_model + export_served

and records, after each phase, VmRSS (/proc/self/status) and the peak (ru_maxrss), which of
torch / onnx / onnxruntime / sklearn / scipy / matplotlib are in ``sys.modules``, and who
first imported sklearn / matplotlib (an import hook records the first caller outside them).

    python benchmarks/profile_device_memory.py
    python benchmarks/profile_device_memory.py --scenarios quickstart --eval-mode inference_mode

``--eval-mode no_grad|inference_mode`` runs the evaluation phase inside that torch context
(the learner's own ``evaluate``, unchanged), to size that cut.  Outputs go to
``benchmarks/results/device_memory_profile{,<suffix>}.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = ["quickstart", "digits_continual", "seqmnist_confedmade", "mnist_ngfl"]
WATCHED = ("torch", "onnx", "onnxruntime", "sklearn", "scipy", "matplotlib", "pandas")
PHASES = [
    ("interpreter", "1. interpreter start (stdlib only)"),
    ("numpy", "2. import numpy"),
    ("daemon_import", "3. import edge_client.daemon (torch, methods)"),
    ("data", "5. load_client_data"),
    ("learner", "6. methods.learner_for"),
    ("global_model", "6b. decode round 0 + load_global + start_task(0)"),
    ("train", "7. train_round + upload + encode"),
    ("evaluate", "8. evaluate (daemon _evaluate)"),
    ("export", "9. serve: snapshot + export (a MADE in a child process, others in process)"),
]


# --------------------------------------------------------------------------------------------
# The child: one device's work, measured.  Only the stdlib is imported before phase 1.
# --------------------------------------------------------------------------------------------
def _status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return round(int(line.split()[1]) / 1024, 1)
    raise RuntimeError(f"no {field} in /proc/self/status")


def _peak_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)  # kB on Linux


class _FirstImport:
    """A meta-path finder that finds nothing: it notes who first looks the watched packages up
    (torch._dynamo probes sklearn with find_spec without importing it: check sys.modules too)."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.by: dict[str, list[str]] = {}

    def find_spec(self, fullname, path=None, target=None):
        if fullname in self.names and fullname not in self.by:
            import traceback

            frames = [
                f"{Path(fr.filename).as_posix().split('site-packages/')[-1].replace(str(ROOT) + '/', '')}:{fr.lineno}"
                for fr in traceback.extract_stack()[:-1]
                if "importlib" not in fr.filename and "<frozen" not in fr.filename
            ]
            self.by[fullname] = frames[-8:]  # the innermost callers, outermost first
        return None


def child(args: argparse.Namespace) -> None:
    hook = _FirstImport(("sklearn", "matplotlib", "scipy", "sympy", "torch._dynamo"))
    sys.meta_path.insert(0, hook)
    rows: list[dict] = []
    seen = {m.split(".")[0] for m in sys.modules}
    started = time.perf_counter()
    extra: dict = {}

    def mark(key: str, skipped: str | None = None, **info) -> None:
        top = {m.split(".")[0] for m in list(sys.modules)}
        new = sorted(m for m in top - seen if not m.startswith("_"))
        seen.update(top)
        rows.append(
            {
                "phase": key,
                "rss_mb": _status_mb("VmRSS"),
                "peak_mb": _peak_mb(),  # ru_maxrss: Linux carries it over exec from the forking parent
                "hwm_mb": _status_mb("VmHWM"),  # this image's own peak
                "t_s": round(time.perf_counter() - started, 2),
                "modules": sorted(m for m in WATCHED if m in sys.modules),
                "n_modules": len(sys.modules),
                "new_packages": new,
                **({"skipped": skipped} if skipped else {}),
                **info,
            }
        )

    mark("interpreter")
    import numpy as np

    mark("numpy")
    import edge_client.daemon as daemon

    mark("daemon_import")

    import methods
    from edge_client.data import float_tasks, load_client_data
    from edge_client.learning import BUILD_LOCK, DeviceLearner
    from edge_client.protocol import places
    from edge_client.serving import ServedModelWriter
    from fclcore.codec import Frame, Header, Kind, decode, encode
    from fclcore.config import from_dict, load_config
    from fclcore.data import float_pixels
    from fclcore.schedule import RoundPlace
    from fclcore.schema import ClientConfig, FederationSpec

    cfg = load_config(ClientConfig, args.config)
    daemon.torch.set_num_threads(cfg.threads)  # as ClientDaemon.__init__ does
    data = load_client_data(cfg, compact=True)  # as ClientDaemon.__init__ loads it
    arrays = [d for d in (*data.train, *data.test, *(data.fleet or ())) if d is not None]
    extra["data"] = {
        "train_rows": [len(d) for d in data.train],
        "test_rows": [len(d) for d in data.test],
        "fleet_rows": [len(d) for d in data.fleet] if data.fleet else None,
        "x_dtype": str(data.train[0].x.dtype),
        "x_mb": round(sum(d.x.nbytes for d in arrays) / 2**20, 1),
        "y_mb": round(sum(d.y.nbytes for d in arrays) / 2**20, 1),
        "x_mb_as_uint8": round(sum(d.x.size for d in arrays) / 2**20, 1),
    }
    mark("data")

    payload = Path(args.round_frame).read_bytes()
    frame = decode(payload)  # the round message, as the device receives it
    fed = from_dict(FederationSpec, frame.meta["federation"], "round message", "federation")
    methods.resolve(fed, "round message")
    input_dim = frame.meta["input_dim"]
    with BUILD_LOCK:
        learner = methods.learner_for(fed, input_dim, cfg.data.client_index)
    learner.allow_embedding_upload = cfg.allow_embedding_upload
    learner.fleet_data = data.fleet
    if not learner.compact_pixels:  # DeviceLearner._fit_pixels
        data = float_tasks(data)
    mark("learner", learner=type(learner).__name__)

    knowledge = decode(Path(args.knowledge_frame).read_bytes()) if args.knowledge_frame else None
    learner.load_global(frame.tensors, frame.header.round, frame.meta)
    place, _ = places(frame)
    learner.start_task(place.task, knowledge)  # start_tasks: task 0's own frame, if the strategy sent one
    mark(
        "global_model",
        round_frame_bytes=len(payload),
        knowledge_frame_bytes=os.path.getsize(args.knowledge_frame) if args.knowledge_frame else 0,
    )

    device = DeviceLearner(cfg, data, None, Path(args.work))  # the daemon's learner and data, as it holds them
    device.learner, device.fed = learner, fed
    arrived = device.arrived(frame.header.round, place.task)
    n_samples, train_nll = learner.train_round(arrived, frame.header.round, place)
    tensors = learner.upload(frame.header.round, place)
    header = Header(Kind.UPDATE, cfg.federation, frame.header.round, place.task, cfg.client_id, 1)
    meta = {"n_samples": n_samples, "train_nll": train_nll, **learner.report(place)}
    update = encode(Frame(header, meta, tensors), fed.value_coding)
    mark("train", n_samples=n_samples, update_bytes=len(update))

    end_place = RoundPlace(place.task, place.task_start, True)  # a task's last round: every task seen
    if args.eval_mode == "plain":
        report = device.evaluate(frame.header.round, end_place)
    else:
        with getattr(daemon.torch, args.eval_mode)():
            report = device.evaluate(frame.header.round, end_place)
    mark("evaluate", eval_mode=args.eval_mode, report=report)

    writer = ServedModelWriter(Path(args.work), cfg.data.dataset, cfg.serve.int8)  # as the daemon serves
    job = writer.snapshot(learner, place.task, float_pixels(data.test[place.task]).x)
    if job is None:
        mark("export", skipped=f"{type(learner).__name__}.served_model returned None")
    else:
        rep = writer.write(job)
        keep = {k: rep[k] for k in ("parity_rows", "max_scaled_err") if k in rep} if rep else "failed"
        mark(
            "export",
            format=job.served.format,
            in_child=job.reference is not None,
            export_child_peak_rss_mb=writer.child_peak_rss_mb,
            parity=keep,
        )
    doc = {
        "phases": rows,
        "first_import": hook.by,
        "threads": cfg.threads,
        "method": fed.method,
        "torch": daemon.torch.__version__,
        "torch_threads": daemon.torch.get_num_threads(),
        "numpy": np.__version__,
        **extra,
    }
    Path(args.out).write_text(json.dumps(doc, indent=2, default=str) + "\n")


# --------------------------------------------------------------------------------------------
# The parent: plan, build round 0 as the aggregator would, run one child per scenario.
# --------------------------------------------------------------------------------------------
def prepare(name: str, work: Path) -> tuple[Path, Path, Path | None, str]:
    """The client-0 config, the encoded round-0 announcement and client-0's own round-0 frame."""
    sys.path.insert(0, str(ROOT))
    import methods
    from fcl_edge.simulate import plan, write_configs
    from fclcore import topics
    from fclcore.codec import Frame, Header, Kind, encode
    from fclcore.config import to_dict
    from fclcore.runid import new_run_id

    p = plan(str(ROOT / "configs/scenarios" / f"{name}.yaml"))
    work.mkdir(parents=True, exist_ok=True)
    written = write_configs(p, work, "mqtt://127.0.0.1:1883")
    client = p.client_ids[0]
    _, _, fed = methods.resolve(p.scenario.federation)
    strategy = methods.strategy_for(fed, p.input_dim)
    schedule = strategy.schedule
    global_params = strategy.initial_model()
    run = new_run_id()
    downlinks = strategy.client_downlinks(0, p.client_ids)  # published before the announcement
    knowledge = None
    if client in downlinks:
        kmeta, ktensors = downlinks[client]
        header = Header(Kind.KNOWLEDGE, fed.name, 0, 0, topics.AGGREGATOR_ID, 1)
        knowledge = work / "knowledge0.bin"
        knowledge.write_bytes(encode(Frame(header, {**kmeta, "run": run}, ktensors), fed.value_coding))
    meta = {  # aggregator/announcer.py Announcer.announce
        "run": run,
        "clock_us": time.time_ns() // 1000,
        "federation": to_dict(fed),
        "input_dim": p.input_dim,
        "total_rounds": fed.total_rounds,
        "attempt": 1,
        "schedule": {**schedule.place(0).to_meta(), "previous": None},
        **strategy.announce_meta(0),
    }
    header = Header(Kind.ROUND, fed.name, 0, schedule.task_of(0), topics.AGGREGATOR_ID, 2)
    frame_path = work / "round0.bin"
    frame_path.write_bytes(encode(Frame(header, meta, global_params), fed.value_coding))
    return written[client][1], frame_path, knowledge, fed.method


def run_child(name: str, work: Path, eval_mode: str) -> dict:
    """Plan in one process, measure in another: both forked from this small parent, so the
    child's ru_maxrss (which Linux carries over exec) starts below its own interpreter's RSS."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(":")}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--prepare", name, "--work", str(work)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{name}: prepare exited {done.returncode}:\n{done.stderr[-3000:]}")
    config, frame, knowledge, method = json.loads((work / "prepared.json").read_text())
    out = work / "profile.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--config", str(config)]
    cmd += ["--round-frame", str(frame), "--work", str(work), "--out", str(out), "--eval-mode", eval_mode]
    cmd += ["--knowledge-frame", str(knowledge)] if knowledge else []
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{name}: child exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    doc = json.loads(out.read_text())
    doc["scenario_method"] = method
    return doc


def table(results: dict[str, dict]) -> list[str]:
    names = list(results)
    head = "| phase | " + " | ".join(f"{n} ({results[n]['method']})" for n in names) + " |"
    md = [head, "|---|" + "---|" * len(names)]
    for key, label in PHASES:
        cells = []
        for n in names:
            rows = results[n]["phases"]
            i = next(j for j, r in enumerate(rows) if r["phase"] == key)
            r = rows[i]
            if r.get("skipped"):
                cells.append(f"skipped: {r['skipped']}")
                continue
            delta = r["rss_mb"] - rows[i - 1]["rss_mb"] if i else 0.0
            cells.append(f"{r['rss_mb']:.0f} ({delta:+.0f}) / {r['hwm_mb']:.0f}" if i else f"{r['rss_mb']:.0f}")
        md.append(f"| {label} | " + " | ".join(cells) + " |")
    for key, label in (("hwm_mb", "peak RSS (VmHWM)"), ("peak_mb", "peak RSS (ru_maxrss)")):
        md.append(f"| **{label}** | " + " | ".join(f"{results[n]['phases'][-1][key]:.0f}" for n in names) + " |")
    return md


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", nargs="+", default=SCENARIOS)
    parser.add_argument("--eval-mode", choices=["plain", "no_grad", "inference_mode"], default="plain")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/device_memory_profile.json"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--prepare", help=argparse.SUPPRESS)
    for flag in ("--config", "--round-frame", "--knowledge-frame", "--work"):
        parser.add_argument(flag, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    if args.prepare:
        paths = prepare(args.prepare, Path(args.work))
        (Path(args.work) / "prepared.json").write_text(
            json.dumps([str(x) if x else None for x in paths[:3]] + [paths[3]])
        )
        return
    import tempfile

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.scenarios:
            print(f"{name} ...", flush=True)
            results[name] = run_child(name, Path(tmp) / name, args.eval_mode)
            last = results[name]["phases"][-1]
            print(f"  final RSS {last['rss_mb']} MB, peak {last['peak_mb']} MB", flush=True)
    any_doc = next(iter(results.values()))
    command = " ".join(["python", os.path.relpath(__file__, ROOT), *sys.argv[1:]])
    doc = {
        "scenarios": results,
        "eval_mode": args.eval_mode,
        "machine": {
            "platform": platform.platform(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "torch": any_doc["torch"],
            "numpy": any_doc["numpy"],
        },
        "command": command,
    }
    out = Path(args.out)
    out.write_text(json.dumps(doc, indent=2, default=str) + "\n")
    m = doc["machine"]
    md = [
        "# Device memory, phase by phase",
        "",
        f"`{command}` on {m['platform']} ({m['cpus']} CPUs), Python {m['python']}, torch {m['torch']}, "
        f"numpy {m['numpy']}; evaluation mode: {args.eval_mode}.",
        "",
        "One fresh process per scenario plays client-0's round 0. Each cell: VmRSS in MB after the phase "
        "(delta from the previous phase) / VmHWM, the process's peak RSS so far, in MB.",
        "",
        *table(results),
        "",
        "| scenario | data x dtype | data x MB (as uint8) | train rows / task 0 | update bytes | export child peak MB "
        "| sklearn imported by | matplotlib imported by |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n, r in results.items():
        phases = {p["phase"]: p for p in r["phases"]}
        final = r["phases"][-1]["modules"]
        first = {k: v for k, v in r["first_import"].items() if k in final}  # looked up, not only probed
        md.append(
            f"| {n} | {r['data']['x_dtype']} | {r['data']['x_mb']} ({r['data']['x_mb_as_uint8']}) "
            f"| {r['data']['train_rows'][0]} | {phases['train'].get('update_bytes', '-')} "
            f"| {phases['export'].get('export_child_peak_rss_mb') or '- (in process)'} "
            f"| {' <- '.join(reversed(first['sklearn'][-3:])) if 'sklearn' in first else 'not imported'} "
            f"| {' <- '.join(reversed(first['matplotlib'][-3:])) if 'matplotlib' in first else 'not imported'} |"
        )
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
