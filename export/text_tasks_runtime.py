"""Torch-free runtime for the ``text-tasks`` served format: a task-incremental text classifier
with one head per task (numpy + onnxruntime + tokenizers only).

A model file (format ``fcl-text-tasks/1``, written by ``export.onnx_text_tasks``) is validated
before onnxruntime sees it, as every fcl export is (``export.runtime.validate_model_bytes``:
protobuf structure, the ``fcl.*`` metadata below, weights and whole-file hashes), so a
truncated, corrupted, foreign or tampered file is a :class:`export.runtime.ModelFileError`.
Tokenization, truncation to ``max_length`` and the batching of texts are those of the
text-groups runtime (:class:`export.text_runtime.TokenizedRuntime`).

The graph: ``input_ids``, ``attention_mask`` (int64 [batch, seq]) -> ``logits`` (float32
[batch, T, W]): row t holds task t's head in its first ``len(labels[t])`` columns, ``-inf``
after them.  The caller's task id picks the head; the runtime reads only that task's columns.

Metadata (``fcl.*``; JSON unless noted):

| key                     | meaning |
|-------------------------|---------|
| fcl.format              | str ``fcl-text-tasks/1`` |
| fcl.method              | str, the learning method that trained it |
| fcl.task                | int, the last task trained (== number of tasks - 1) |
| fcl.labels              | per task: its global class ids in head-column order |
| fcl.class_names         | list of str, global class id -> name |
| fcl.max_length          | int, tokens per text incl. [CLS]/[SEP] |
| fcl.vocab_size          | int, token ids must be below it (the tokenizer's size) |
| fcl.toolkit_version     | str |
| fcl.quantization        | str ``none`` or ``int8-dynamic`` |
| fcl.weights_sha256 / fcl.integrity_sha256 | hex, see ``export._proto`` |
| fcl.tokenizer_sha256    | optional hex of the tokenizer.json bytes used at export |
| fcl.tokenizer_json      | optional str, the tokenizer.json itself |
| fcl.int8_label_agreement | int8 only: share of (parity text, task) pairs whose label equals the fp32 torch one |
| fcl.int8_min_agreement  | int8 only: the threshold the exporter enforced |
| fcl.int8_eval           | int8 only, str: which inputs the agreement was measured on |
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import onnxruntime as ort

from export import _meta
from export.runtime import InputError, ModelFileError
from export.text_runtime import FORMAT as GROUPS_FORMAT
from export.text_runtime import TokenizedRuntime, check_text_entries, check_token_inputs

__all__ = ["FORMAT", "TextTasksRuntime", "parse_metadata"]

FORMAT = "fcl-text-tasks/1"

REQUIRED: dict[str, Callable[[str, str], Any]] = {
    "format": _meta._text(True),
    "method": _meta._text(True),
    "task": _meta._int(0),
    "labels": _meta._nested_int_lists,
    "class_names": _meta._str_list,
    "max_length": _meta._int(2),
    "vocab_size": _meta._int(1),
    "toolkit_version": _meta._text(True),
    "quantization": _meta._text(True),
    "weights_sha256": _meta._hex,
    "integrity_sha256": _meta._hex,
}
OPTIONAL: dict[str, Callable[[str, str], Any]] = {
    "tokenizer_sha256": _meta._hex,
    "tokenizer_json": _meta._text(True),
    "int8_label_agreement": _meta._fraction,
    "int8_min_agreement": _meta._fraction,
    "int8_eval": _meta._text(False),
}
_OTHER_FORMATS = {
    _meta.FORMAT: "a MADE model: use fcl infer --op loglik|conditionals|sample",
    GROUPS_FORMAT: "a text-groups classifier: it takes no task id",
}


def parse_metadata(raw: dict[str, str]) -> dict[str, Any]:
    """Validate the ``fcl.*`` entries of a text-tasks model; return them parsed, keys without the prefix."""
    out = _meta.read_format(raw, FORMAT, "this text-tasks runtime", REQUIRED, OPTIONAL, _OTHER_FORMATS)
    labels, n_names = out["labels"], len(out["class_names"])
    if out["task"] != len(labels) - 1:
        raise _meta.MetadataError(f"fcl.task is {out['task']}, fcl.labels lists {len(labels)} tasks")
    for t, row in enumerate(labels):
        if len(set(row)) != len(row) or min(row) < 0 or max(row) >= n_names:
            raise _meta.MetadataError(
                f"fcl.labels[{t}] must be distinct class ids in [0, {n_names}) (one name each in fcl.class_names)"
            )
    check_text_entries(out)
    return out


def _softmax_top(z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(argmax column, its softmax probability) per row of finite logits (N, C)."""
    z = z.astype(np.float64)
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    col = e.argmax(axis=1)
    return col, e[np.arange(len(col)), col] / e.sum(axis=1)


class TextTasksRuntime(TokenizedRuntime):
    """A validated task-incremental text classifier: ``classify(texts, task)``.  Loading raises
    :class:`ModelFileError` for the file and :class:`~export.text_runtime.TokenizerError` for its
    tokenizer (``tokenizer=False``: token ids only)."""

    parse_metadata = staticmethod(parse_metadata)
    described = ("labels",)

    def _read_metadata(self, m: dict[str, Any]) -> None:
        self.labels: list[list[int]] = m["labels"]
        self.class_names: list[str] = m["class_names"]
        self.num_tasks = len(self.labels)
        self.width = max(len(row) for row in self.labels)

    def _check_io(self, session: ort.InferenceSession, meta: dict[str, Any], path: str) -> None:
        check_token_inputs(session, path)
        outs = session.get_outputs()
        tasks, width = len(meta["labels"]), max(len(row) for row in meta["labels"])
        if len(outs) != 1 or outs[0].name != "logits" or outs[0].type != "tensor(float)":
            raise ModelFileError(
                f"{path}: expected one output logits:float, got " + ", ".join(f"{o.name}:{o.type}" for o in outs)
            )
        if len(outs[0].shape) != 3 or list(outs[0].shape[1:]) != [tasks, width]:
            raise ModelFileError(
                f"{path}: output logits has shape {outs[0].shape}, metadata implies [batch, {tasks}, {width}] "
                "(tasks, most labels of a task)"
            )

    def _run(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        out = self._session.run(["logits"], {"input_ids": ids, "attention_mask": mask})[0]
        if out.shape != (len(ids), self.num_tasks, self.width):
            raise ModelFileError(
                f"{self.path}: the model returned logits of shape {out.shape}, "
                f"expected {(len(ids), self.num_tasks, self.width)}"
            )
        return out.astype(np.float32, copy=False)

    def _collect(self, n: int, batches: Any) -> np.ndarray:
        logits = np.empty((n, self.num_tasks, self.width), np.float32)
        for sl, ids, mask in batches:
            logits[sl] = self._run(ids, mask)
        return logits

    def predict_ids(self, ids: Any, mask: Any) -> np.ndarray:
        """Logits (N, T, W) for token ids and masks (N, L); fp32: chunks of rows, int8: one
        unpadded row at a time (as :class:`~export.text_runtime.TextClassifierRuntime`)."""
        a, m = self._check_ids(ids, mask)
        return self._collect(len(a), self._id_batches(a, m))

    def predict_texts(self, texts: Sequence[str]) -> np.ndarray:
        """Logits (N, T, W) for raw texts."""
        rows = self.encode(texts)
        return self._collect(len(rows), self._text_batches(rows))

    def check_task(self, task: Any) -> int:
        """``task`` as an int, or :class:`InputError` if it is not a task of this model."""
        if isinstance(task, bool) or not isinstance(task, (int, np.integer)):
            raise InputError(f"task must be an int, got {task!r}")
        if not 0 <= task < self.num_tasks:
            raise InputError(f"task {task} is out of range: this model has tasks 0..{self.num_tasks - 1}")
        return int(task)

    def task_predictions(self, logits: np.ndarray, task: int) -> tuple[np.ndarray, np.ndarray]:
        """(global class ids (N,), softmax probabilities within the task's columns (N,)) of task ``task``."""
        t = self.check_task(task)
        z = logits[:, t, : len(self.labels[t])]
        if not np.isfinite(z).all():
            raise ModelFileError(f"{self.path}: the model produced non-finite logits in task {t}'s columns")
        if len(z) == 0:
            return np.zeros(0, np.int64), np.zeros(0)
        col, prob = _softmax_top(z)
        return np.asarray(self.labels[t], np.int64)[col], prob

    def classify(self, texts: Sequence[str], task: int | None = None) -> list[Any]:
        """Per text ``{"task", "label", "class", "score"}`` for ``task`` (``score``: softmax
        probability of the label within the task's labels), or with ``task=None`` a list of
        those, one per task."""
        tasks = range(self.num_tasks) if task is None else [self.check_task(task)]
        logits = self.predict_texts(texts)
        per_task = []
        for t in tasks:
            labels, probs = self.task_predictions(logits, t)
            per_task.append(
                [
                    {"task": t, "label": int(c), "class": self.class_names[int(c)], "score": round(float(p), 6)}
                    for c, p in zip(labels, probs)
                ]
            )
        if task is not None:
            return per_task[0]
        return [list(row) for row in zip(*per_task)] if per_task else []
