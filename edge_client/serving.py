"""What the device serves: after each task (or each round) the learner's current model is
written as ``served.npz`` and a verified ONNX file ``model.onnx`` in the client's out dir.

Both writes are atomic (temporary file, verify, rename), so ``fcl infer --watch`` never reads
a half-written model.  A failed export is logged and the previous model stays in service:
serving must never stop training.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from edge_client.learners import Learner

log = logging.getLogger(__name__)

BINARIZATION = {"digits": "value>7", "mnist": "pixel>127"}  # fclcore.data's defaults
PARITY_ROWS = 64


class ServedModelWriter:
    def __init__(self, out_dir: Path, dataset: str, int8: bool) -> None:
        self.out_dir = out_dir
        self.binarize = BINARIZATION.get(dataset, "")
        self.int8 = int8

    @property
    def model_path(self) -> Path:
        return self.out_dir / "model.onnx"

    def write(self, learner: Learner, task: int, parity_inputs: np.ndarray) -> dict | None:
        """Export the learner's served model; the report, or None if the export failed."""
        if learner.fed.method == "fedet":
            return self._write_fedet(learner, task, parity_inputs)
        try:
            from export.onnx_made import ExportError, ServedModel, export_served_model
            from export.snapshot import SnapshotError, save_snapshot
        except ImportError as exc:  # a device installed without the export extra keeps training
            log.error("cannot export the served model (pip install 'fcl-edge[export]'): %s", exc)
            return None
        try:
            model = ServedModel(made=learner.made, params=learner.served_params(), order_index=0,
                                method=learner.fed.method, task=task, binarize=self.binarize)
            self.out_dir.mkdir(parents=True, exist_ok=True)
            save_snapshot(model, self.out_dir / "served.npz")
            report = export_served_model(model, self.model_path, parity_inputs=parity_inputs[:PARITY_ROWS],
                                         int8=self.int8)
        except (ExportError, SnapshotError, ValueError, OSError) as exc:
            log.error("export after task %d failed, previous model stays in service: %s", task, exc)
            return None
        log.info("serving task %d model: %s (%d bytes, parity error %.2g)", task, self.model_path,
                 report["bytes"], report["max_scaled_err"])
        return report

    def _write_fedet(self, learner: Learner, task: int, parity_ids: np.ndarray) -> dict | None:
        """Backbone + prototype selector + Enhancer groups as one ONNX text classifier, with
        the tokenizer embedded (``fcl infer --text``); parity-checked on the task's test texts."""
        if not learner.client.selector.group_of:
            return None  # nothing learned yet
        try:
            from export.onnx_fedet import ExportError, export_fedet_client
        except ImportError as exc:
            log.error("cannot export the served model (pip install 'fcl-edge[export]'): %s", exc)
            return None
        ids = np.asarray(parity_ids[:PARITY_ROWS], dtype=np.int64)
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            report = export_fedet_client(learner.client, self.model_path, int8=self.int8, parity_ids=ids,
                                         parity_mask=(ids != 0).astype(np.int64), task=task,
                                         max_length=int(ids.shape[1]))
        except (ExportError, ValueError, OSError) as exc:
            log.error("export after task %d failed, previous model stays in service: %s", task, exc)
            return None
        log.info("serving task %d text classifier: %s", task, self.model_path)
        return report
