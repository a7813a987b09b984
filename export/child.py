"""Export a served model in a short-lived process, so the training daemon never holds onnx,
onnxruntime or the export's buffers (``edge_client.serving`` starts it; see
``firmware_notes/memory.md``).

    python -m export.child JOB_DIR
    python -m export.child --finish JOB_DIR

A text-groups model (FedET's) is a job of ``export.text_groups_job`` (``"format": "text-groups"``
in ``job.json``) in two processes, so that none holds torch and the backbone together with
onnxruntime and the int8 copy: the first imports torch, loads the frozen backbone itself,
computes the torch reference, builds the graph and leaves them in ``JOB_DIR/stage`` (the
graph unsealed, its weights as ONNX external data: ``export.text_groups_verify.write_stage``),
reporting ``"next": "finish"``; the caller then runs ``--finish``, which seals, checks,
quantises and publishes without torch (``export.text_groups_verify.finish_stage``).
A MADE's ``JOB_DIR`` holds what the daemon wrote with :func:`write_job`:

* ``parity.npy`` and ``reference.npy``: the parity rows and the torch MADE's logits on them,
  computed by the daemon, so this process needs no torch;
* ``job.json``: ``{"served": ..., "path": ..., "int8": bool, "toolkit_version": ...}``, where
  ``served`` is the snapshot the daemon serves next to its model (``export.snapshot``, read
  with ``allow_pickle=False``).

It runs ``export.onnx_made.export_served_model`` (the same verified, atomic publication as in
process) and writes ``report.json``: ``{"ok": true, "report": {...}, "peak_rss_mb": ...,
"imported": [the frameworks the process loaded]}`` (a staged text-groups job: also ``"next":
"finish"``) or ``{"ok": false, "error": "..."}``.  Exit status 0 on success, 1 on a failed
export, 2 on a malformed job.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import Callable

import numpy as np

from export.publish import ExportError
from export.snapshot import SnapshotError, load_snapshot
from fclcore.procmem import peak_rss_mb

__all__ = ["run_job", "finish_job", "write_job", "STAGE"]

STAGE = "stage"  # a text-groups job's stage directory, inside JOB_DIR


def write_job(job_dir: Path, snapshot: Path, parity: np.ndarray, reference: np.ndarray, path: Path, int8: bool) -> None:
    """Describe an export of the snapshot at ``snapshot`` to ``path`` (the daemon's side; numpy only)."""
    np.save(job_dir / "parity.npy", np.ascontiguousarray(parity, dtype=np.float32), allow_pickle=False)
    np.save(job_dir / "reference.npy", np.ascontiguousarray(reference, dtype=np.float32), allow_pickle=False)
    spec = {"served": str(snapshot), "path": str(path), "int8": bool(int8), "toolkit_version": "0.1.0"}
    (job_dir / "job.json").write_text(json.dumps(spec))


def run_job(job_dir: Path) -> dict:
    """Run the export a job describes; the ``report.json`` document."""
    try:
        job = json.loads((job_dir / "job.json").read_text())
        if not isinstance(job, dict) or not isinstance(job.get("path"), str) or not isinstance(job.get("int8"), bool):
            raise ValueError("job.json: expected {'served': ..., 'path': str, 'int8': bool}")
        export = _text_groups_export(job_dir, job) if job.get("format") == "text-groups" else _made_export(job_dir, job)
    except (OSError, ValueError, SnapshotError) as exc:
        raise SystemExit(_done(job_dir, {"ok": False, "error": f"malformed job: {exc}"}, 2)) from None
    try:
        report = export(job["path"], int8=job["int8"], toolkit_version=str(job.get("toolkit_version", "0.1.0")))
    except (ExportError, ValueError, OSError) as exc:
        raise SystemExit(_done(job_dir, {"ok": False, "error": str(exc)}, 1)) from None
    doc = {"ok": True, "report": report, "peak_rss_mb": peak_rss_mb(), "imported": _frameworks()}
    if "staged" in report:
        doc["next"] = "finish"
    _done(job_dir, doc, 0)
    return doc


def finish_job(job_dir: Path) -> dict:
    """The second process of a staged text-groups job (no torch): its ``report.json`` document."""
    from export.text_groups_verify import finish_stage

    try:
        report = finish_stage(job_dir / STAGE)
    except ExportError as exc:
        raise SystemExit(_done(job_dir, {"ok": False, "error": str(exc)}, 1)) from None
    except (OSError, ValueError) as exc:
        raise SystemExit(_done(job_dir, {"ok": False, "error": f"malformed job: {exc}"}, 2)) from None
    doc = {"ok": True, "report": report, "peak_rss_mb": peak_rss_mb(), "imported": _frameworks()}
    _done(job_dir, doc, 0)
    return doc


def _frameworks() -> list[str]:
    """The heavy frameworks this process has imported (the report says which half held what)."""
    return [m for m in ("torch", "onnx", "onnxruntime") if m in sys.modules]


def _made_export(job_dir: Path, job: dict) -> Callable[..., dict]:
    """A MADE job's export, its inputs read and checked."""
    if not isinstance(job.get("served"), str):
        raise ValueError("job.json: expected 'served', the snapshot's path")
    served = load_snapshot(job["served"])
    parity = np.load(job_dir / "parity.npy", allow_pickle=False)
    reference = np.load(job_dir / "reference.npy", allow_pickle=False)
    from export.onnx_made import export_served_model

    return functools.partial(export_served_model, served, parity_inputs=parity, reference_logits=reference)


def _text_groups_export(job_dir: Path, job: dict) -> Callable[..., dict]:
    """A text-groups job's first half, its model rebuilt (torch; the backbone loaded from its
    directory): built and staged for ``finish_job``."""
    from export.onnx_text_groups import export_text_groups
    from export.text_groups_job import read_text_groups_job

    served = read_text_groups_job(job_dir, job.get("served"))
    parity = np.load(job_dir / "parity.npy", allow_pickle=False)
    return functools.partial(export_text_groups, served, parity_inputs=parity, stage_dir=job_dir / STAGE)


def _done(job_dir: Path, doc: dict, status: int) -> int:
    tmp = job_dir / "report.json.tmp"
    tmp.write_text(json.dumps(doc, default=str))
    os.replace(tmp, job_dir / "report.json")
    return status


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    finish = bool(args) and args[0] == "--finish"
    if finish:
        args = args[1:]
    if len(args) != 1 or args[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if args and args[0] in ("-h", "--help") else 2
    (finish_job if finish else run_job)(Path(args[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
