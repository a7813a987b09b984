"""What the device serves: after each task (or each round) the learner's served model is
exported as a verified ONNX file ``model.onnx`` in the client's out dir (and, for the MADE
format, the snapshot ``served.npz`` that ``fcl export`` reads).

The export runs off the round's hot path: the daemon takes a snapshot of the served model
(``snapshot``: a copy, cheap) when the round starts and hands it to ``submit`` after its
update is sent; one background thread exports it, the newest snapshot winning if exports
fall behind.  Writes are atomic (temporary file, verify, rename), so ``fcl infer --watch``
never reads a half-written model.  A failed export is logged and the previous model stays
in service: serving must never stop training.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fclcore.learner import Learner

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


class ServedModelWriter:
    def __init__(self, out_dir: Path, dataset: str, int8: bool) -> None:
        self.out_dir = out_dir
        self.binarize = BINARIZATION.get(dataset, "")
        self.int8 = int8
        self._cond = threading.Condition()
        self._next: ServeJob | None = None
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None

    @property
    def model_path(self) -> Path:
        return self.out_dir / "model.onnx"

    def snapshot(self, learner: Learner, task: int, parity_inputs: np.ndarray) -> ServeJob | None:
        """The learner's served model now, as a job for ``submit`` (None: nothing to serve yet)."""
        served = learner.served_model(task, self.binarize)
        if served is None:
            return None
        return ServeJob(served, np.array(parity_inputs[:PARITY_ROWS], copy=True))

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
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def write(self, job: ServeJob) -> dict | None:
        """Export one served model now; the report, or None if the export failed."""
        try:
            from export.formats import ExportError, export_served
            from export.snapshot import SnapshotError, save_snapshot
        except ImportError as exc:  # a device installed without the export extra keeps training
            log.error("cannot export the served model (pip install 'fcl-edge[export]'): %s", exc)
            return None
        served = job.served
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            if served.format == "made":
                save_snapshot(served, self.out_dir / "served.npz")
            with _EXPORT_LOCK:
                report = export_served(served, self.model_path, parity_inputs=job.parity_inputs, int8=self.int8)
        except (ExportError, SnapshotError, ValueError, OSError) as exc:
            log.error("export after task %d failed, previous model stays in service: %s", served.task, exc)
            return None
        log.info("serving task %d model (%s): %s", served.task, served.format, self.model_path)
        return report
