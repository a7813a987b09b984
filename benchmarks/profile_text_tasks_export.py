"""Where a text-tasks export's memory goes, phase by phase (issue 40: FedSeIT's daemon).

Rebuilds a device's learner from its checkpoint (``RUN/clients/<id>/state``, as a restarted
daemon does: tasks started with their frames, then the learner's state), takes the served
snapshot and exports it in process as the daemon's serving thread does
(``ServedModelWriter.write``), printing VmRSS and the peak since the previous line (VmHWM, reset
through ``/proc/self/clear_refs``) around each phase of the export.  Linux only.

    fcl simulate configs/scenarios/bbc_fedseit.yaml --set federation.rounds_per_task=2 --out /tmp/fs
    python benchmarks/profile_text_tasks_export.py /tmp/fs --client client-0
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _status_mb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) // 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def mark(what: str) -> None:
    """One line: RSS now and the peak since the last line; then the peak starts over."""
    print(f"{what:46s} rss {_status_mb('VmRSS'):5d} MB  peak since last {_status_mb('VmHWM'):5d} MB", flush=True)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def traced(module, name: str) -> None:
    """Mark entry and exit of ``module.name`` (a function the export calls by module attribute;
    one an older tree lacks is skipped, so the script profiles a checkout from before issue 40 too)."""
    fn = getattr(module, name, None)
    if fn is None:
        return

    def wrapper(*args, **kwargs):
        mark(f"  > {module.__name__.split('.')[-1]}.{name}")
        try:
            return fn(*args, **kwargs)
        finally:
            mark(f"  < {module.__name__.split('.')[-1]}.{name}")

    setattr(module, name, wrapper)


def restore(state_dir: Path):
    import methods
    from edge_client.state import ClientStateStore
    from fclcore.codec import CodecLimits, decode
    from fclcore.config import from_dict
    from fclcore.schema import FederationSpec

    state = ClientStateStore(state_dir).load()
    if state is None:
        raise SystemExit(f"no checkpoint in {state_dir}")
    fed = from_dict(FederationSpec, state.federation, "checkpoint", "federation")
    learner = methods.learner_for(fed, state.input_dim, 0)
    for t in range(state.task + 1):
        raw = state.frames.get(t)
        learner.start_task(t, None if raw is None else decode(raw, CodecLimits()))
    learner.load_state(state.learner_meta, state.learner_arrays)
    return learner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="a run directory of fcl simulate (a text-tasks method: fedseit, fedweit-cnn)")
    parser.add_argument("--client", default="client-0")
    args = parser.parse_args()
    mark("start")
    import numpy as np

    import export.onnx_text_tasks as staging
    import export.snapshot as snapshot
    import export.text_tasks_publish as publish
    from edge_client.serving import ServedModelWriter
    from export.publish import file_sha256
    from fclcore.procmem import release_free_memory

    mark("imports")
    learner = restore(Path(args.run) / "clients" / args.client / "state")
    release_free_memory()
    mark(f"learner restored at task {learner.task}")
    for module, names in [
        (staging, ["build_text_tasks_onnx", "_leave_out_frozen", "random_rows_stage"]),
        (snapshot, ["save_snapshot"]),
        # publish_text_tasks is not wrapped: a wrapper's arguments would keep the stage's graph alive
        (publish, ["_check_graph", "_put_back_frozen", "sealed_chunks", "write_chunks"]),
        (publish.scaffold, ["open_written"]),
    ]:
        for name in names:
            traced(module, name)
    with tempfile.TemporaryDirectory() as tmp:
        writer = ServedModelWriter(Path(tmp), "bbc", int8=False)
        ids = np.random.default_rng(0).integers(1000, 20000, (64, learner.opts.max_length)).astype(np.int64)
        job = writer.snapshot(learner, learner.task, ids)
        mark("snapshot taken")
        if writer.write(job) is None:
            raise SystemExit("the export failed (see the log)")
        mark("export written")
        size = (Path(tmp) / "model.onnx").stat().st_size
        digest, snapshot_digest = file_sha256(Path(tmp) / "model.onnx"), file_sha256(Path(tmp) / "served.npz")
    print(f"model.onnx: {size / 2**20:.1f} MB, sha256 {digest}; served.npz sha256 {snapshot_digest}")


if __name__ == "__main__":
    main()
