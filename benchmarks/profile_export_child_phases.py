"""Where FedET's export child spends its memory, step by step (issue 20): the resident set and
the peak so far after each step of each half, on the job of ``profile_export_child.py``
(MiniLM, two groups of seeded weights, int8 on).

    python benchmarks/profile_export_child_phases.py

Each half runs in a fresh process (``--half torch`` / ``--half onnxruntime``, which this
script starts), with the export's own functions wrapped to print ``rss_mb`` and
``peak_rss_mb`` before and after them; the numbers are the same process's as in
``export.child``, plus the wrappers' few lines (a step an older commit lacks is skipped, so a
copy of this file profiles that commit's export too).  Prints one line per step; nothing is
written under ``benchmarks/results``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _mark(what: str) -> None:
    from fclcore.procmem import peak_rss_mb, rss_mb

    print(f"{what:44s} rss {rss_mb():7.1f} MB   peak {peak_rss_mb():7.1f} MB", flush=True)


def _wrap(module: object, name: str) -> None:
    fn = getattr(module, name, None)
    if fn is None:  # an older commit's export (the script also profiles those)
        return

    def wrapped(*args: object, **kwargs: object) -> object:
        _mark(f"before {name}")
        out = fn(*args, **kwargs)
        _mark(f"after {name}")
        return out

    setattr(module, name, wrapped)


def torch_half(job_dir: Path) -> None:
    _mark("start")
    import numpy as np
    import onnx  # noqa: F401
    import torch  # noqa: F401

    _mark("torch and onnx imported")
    import export.onnx_text_groups as groups
    from export.text_groups_job import read_text_groups_job

    job = json.loads((job_dir / "job.json").read_text())
    served = read_text_groups_job(job_dir, job["served"])
    _mark("the served model read (backbone loaded)")
    for name in ("text_classifier_reference", "trace_token_model", "write_stage"):
        _wrap(groups, name)
    parity = np.load(job_dir / "parity.npy", allow_pickle=False)
    groups.export_text_groups(served, job["path"], parity_inputs=parity, int8=job["int8"], stage_dir=job_dir / "stage")
    _mark("done")


def onnxruntime_half(job_dir: Path) -> None:
    _mark("start")
    import onnx

    import export.text_groups_verify as verify

    _mark("onnx imported")
    for name in ("load_staged_model", "seal", "verify_and_publish", "_load", "_quantize", "_export_int8"):
        _wrap(verify, name)
    _wrap(onnx.checker, "check_model")
    verify.finish_stage(job_dir / "stage")
    _mark("done")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--half", choices=["torch", "onnxruntime"], help=argparse.SUPPRESS)
    parser.add_argument("--job", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.half:
        (torch_half if args.half == "torch" else onnxruntime_half)(Path(args.job))
        return 0
    from profile_export_child import write_job

    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    )
    print(f"load average {os.getloadavg()[0]:.2f}")
    with tempfile.TemporaryDirectory(prefix="fcl-export-phases-") as tmp:
        job_dir = Path(tmp) / "job"
        job_dir.mkdir()
        write_job(job_dir, Path(tmp) / "model.onnx", 32, 5, 64)
        for half in ("torch", "onnxruntime"):
            print(f"== the {half} half")
            cmd = [sys.executable, __file__, "--half", half, "--job", str(job_dir)]
            subprocess.run(cmd, check=True, env=env)
    print(f"load average {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
