"""What the device serves: after each task (or each round) the learner's served model is
exported as a verified ONNX file ``model.onnx`` in the client's out dir, with the snapshot
``served.npz`` beside it that ``fcl export`` re-exports (``export.snapshot``; every served
format has one).  The served model's classes carry the dataset's names (``class_names``: BBC
News's folder names), so ``fcl infer`` prints them.

The export runs off the round's hot path: the daemon takes a snapshot of the served model
(``snapshot``: a copy, cheap) when the round starts and hands it to ``submit`` after its
update is sent; one background thread exports it, the newest snapshot winning if exports
fall behind.  The next round waits for it before it evaluates and trains (``wait``), so the
export's peak memory never adds to the round's (issue 40).  Writes are atomic (temporary
file, verify, rename), so ``fcl infer --watch`` never reads a half-written model.  A failed
export is logged and the previous model stays in service: serving must never stop training.

A MADE is exported by a short-lived child process (``python -m export.child``): the daemon
writes the snapshot, the parity rows and the torch MADE's logits on them (``export.child.write_job``) (``snapshot``
computes those, so the child needs no torch), and waits for it at most
``serve.export_timeout_s``.  The daemon thereby never imports onnx or onnxruntime and never
holds the export's buffers (``firmware_notes/memory.md``).  A text-groups model whose frozen
backbone came unchanged from a model directory (FedET's) is exported by the same child, which
loads the backbone itself (``export.text_groups_job``).  The other formats are traced from
torch modules and export in process.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from fclcore.learner import Learner
from fclcore.procmem import release_free_memory
from fclcore.served import with_class_names

log = logging.getLogger(__name__)

BINARIZATION = {"digits": "value>7", "mnist": "pixel>127"}  # fclcore.data's defaults
PARITY_ROWS = 64
# torch.onnx.export keeps process-wide state: devices sharing a process (fcl simulate
# --in-process) export one at a time.
_EXPORT_LOCK = threading.Lock()


@dataclass(frozen=True)
class ServeJob:
    served: Any  # a fclcore.served description (already a copy of the learner's state)
    parity_inputs: np.ndarray
    reference: np.ndarray | None = None  # the torch MADE's logits on parity_inputs: exported in a child

    @property
    def in_child(self) -> bool:
        """A MADE with its reference logits, or a text-groups model a child can load again."""
        return self.reference is not None or bool(getattr(self.served, "backbone_source", ""))


class ServedModelWriter:
    def __init__(
        self,
        out_dir: Path,
        dataset: str,
        int8: bool,
        timeout_s: float = 600.0,
        child_command: Sequence[str] | None = None,
        class_names: Sequence[str] | None = None,
    ) -> None:
        self.out_dir = out_dir
        self.class_names = tuple(class_names) if class_names else None
        self.binarize = BINARIZATION.get(dataset, "")
        self.int8 = int8
        self.timeout_s = timeout_s
        self.child_command = list(child_command or (sys.executable, "-m", "export.child"))
        self.child_peak_rss_mb = 0.0  # the largest export child's peak RSS so far
        self._cond = threading.Condition()
        self._next: ServeJob | None = None
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None

    @property
    def model_path(self) -> Path:
        return self.out_dir / "model.onnx"

    @property
    def snapshot_path(self) -> Path:
        return self.out_dir / "served.npz"

    def snapshot(self, learner: Learner, task: int, parity_inputs: np.ndarray) -> ServeJob | None:
        """The learner's served model now, as a job for ``submit`` (None: nothing to serve yet)."""
        served = with_class_names(learner.served_model(task, self.binarize), self.class_names)
        if served is None:
            return None
        parity = np.array(parity_inputs[:PARITY_ROWS], copy=True)
        if served.format != "made":
            return ServeJob(served, parity)
        from fclcore.models.made import served_logits  # torch: the daemon has it loaded

        return ServeJob(served, parity, served_logits(served, parity))

    def submit(self, job: ServeJob | None) -> None:
        """Export ``job`` in the background (a job still waiting is replaced: the newest wins)."""
        if job is None:
            return
        with self._cond:
            if self._closed:
                return
            self._next = job
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="serve-export", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def wait(self, timeout: float = 600.0) -> bool:
        """Block until every submitted export finished; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._next is None and not self._busy, timeout)

    def close(self, timeout: float = 600.0) -> None:
        """Finish the export in progress (and a waiting one), then stop the worker."""
        self.wait(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def _work(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._next is not None or self._closed)
                if self._next is None:
                    return
                job, self._next, self._busy = self._next, None, True
            try:
                self.write(job)
            except Exception:
                log.exception("export of the served model failed")
            finally:
                job = None  # not held until the next export: a copy of the whole model (issue 40)
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def write(self, job: ServeJob) -> dict | None:
        """Export one served model now; the report, or None if the export failed."""
        if job.in_child:
            return self._write_in_child(job)
        try:
            from export.formats import ExportError, export_with_snapshot
            from export.snapshot import SnapshotError
        except ImportError as exc:  # a device installed without the export extra keeps training
            log.error("cannot export the served model (pip install 'fcl-edge[export]'): %s", exc)
            return None
        served = job.served
        release_free_memory()  # the round's freed buffers, before the export's peak adds to them
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            with _EXPORT_LOCK:
                report, problem = export_with_snapshot(
                    served, self.model_path, self.snapshot_path, parity_inputs=job.parity_inputs, int8=self.int8
                )
        except (ExportError, SnapshotError, ValueError, OSError) as exc:
            log.error("export after task %d failed, previous model stays in service: %s", served.task, exc)
            return None
        finally:  # an in-process export's graph and buffers are freed but would stay resident
            release_free_memory()
        if problem:
            log.warning("no snapshot of the task %d model (fcl export cannot re-export it): %s", served.task, problem)
        log.info("serving task %d model (%s): %s", served.task, served.format, self.model_path)
        return report

    def _write_in_child(self, job: ServeJob) -> dict | None:
        """``python -m export.child`` on a job directory (format in ``export.child``)."""
        from export.snapshot import SnapshotError

        served = job.served
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(prefix=".export-", dir=self.out_dir) as tmp:
                job_dir = Path(tmp)
                self._write_job(job_dir, job)
                done, doc = self._run_child(job_dir)
                if done.returncode == 0 and doc.get("ok") and doc.get("next") == "finish":
                    # a staged job (text-groups): its checks and int8 copy in a second, torch-free process
                    self.child_peak_rss_mb = max(self.child_peak_rss_mb, float(doc.get("peak_rss_mb", 0.0)))
                    (job_dir / "report.json").unlink()
                    done, doc = self._run_child(job_dir, "--finish")
        except subprocess.TimeoutExpired:
            log.error(
                "export after task %d timed out after %.0f s (child killed), previous model stays in service",
                served.task,
                self.timeout_s,
            )
            return None
        except (SnapshotError, ValueError, OSError) as exc:
            log.error("export after task %d failed, previous model stays in service: %s", served.task, exc)
            return None
        if done.returncode != 0 or not doc.get("ok"):
            why = doc.get("error") or (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
            log.error("export after task %d failed, previous model stays in service: %s", served.task, why)
            return None
        self.child_peak_rss_mb = max(self.child_peak_rss_mb, float(doc.get("peak_rss_mb", 0.0)))
        log.info("serving task %d model (%s): %s", served.task, served.format, self.model_path)
        return doc["report"]

    def _run_child(self, job_dir: Path, *flags: str) -> tuple[subprocess.CompletedProcess, dict]:
        """One ``export.child`` process on ``job_dir`` (TimeoutExpired past ``timeout_s``): its
        exit and its ``report.json`` document ({} if it wrote none)."""
        done = subprocess.run(
            [*self.child_command, *flags, str(job_dir)],
            capture_output=True,
            text=True,
            timeout=self.timeout_s,
            env=_child_env(),
        )
        report_file = job_dir / "report.json"
        return done, json.loads(report_file.read_text()) if report_file.is_file() else {}

    def _write_job(self, job_dir: Path, job: ServeJob) -> None:
        """The job directory ``export.child`` reads (no onnx imported here)."""
        if job.served.format == "text-groups":
            from export.text_groups_job import write_text_groups_job

            write_text_groups_job(
                job_dir, job.served, job.parity_inputs, self.model_path.resolve(), self.int8, self.snapshot_path
            )
            return
        from export.child import write_job
        from export.snapshot import save_snapshot

        snapshot = self.snapshot_path  # what `fcl export` reads, and the child too
        save_snapshot(job.served, snapshot)
        write_job(job_dir, snapshot.resolve(), job.parity_inputs, job.reference, self.model_path.resolve(), self.int8)


def _child_env() -> dict[str, str]:
    """The export child's environment: one thread, and this package importable from it."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    spec = importlib.util.find_spec("export")  # located, not imported (it would not import onnx anyway)
    if spec is not None and spec.submodule_search_locations:
        root = str(Path(list(spec.submodule_search_locations)[0]).parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env
