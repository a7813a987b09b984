"""What a device serves, described by format, for ``export`` (which knows formats, not methods).

* ``ServedModel`` (format ``made``): plain MADE weights composed by the learning method;
* ``TextGroupsServed`` (format ``text-groups``): a frozen transformer backbone, Enhancer
  groups and the prototype selector that routes a text to its group;
* ``TextTasksServed`` (format ``text-tasks``): a task-incremental text classifier, one head
  per task, the caller's task id picks the head.

A learner's ``served_model`` returns one of these; ``export.formats.export_served`` writes
it as a verified ONNX file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from fclcore.made_spec import MadeConfig, param_shapes


@dataclass(frozen=True, eq=False)
class ServedModel:
    """The plain MADE weights a device serves, plus where they came from.

    ``params`` are already composed by the learning method (e.g. ``B*sigmoid(m) + A + sum
    alpha*A_kb``) and keyed like ``param_shapes(made)``; they are validated and stored as
    read-only float32 copies.
    """

    made: MadeConfig
    params: dict[str, np.ndarray]
    order_index: int
    method: str
    task: int
    binarize: str = ""
    format = "made"

    def __post_init__(self) -> None:
        if not isinstance(self.made, MadeConfig):
            raise ValueError(f"made must be a MadeConfig, got {type(self.made).__name__}")
        for name, minimum in (("order_index", 0), ("task", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {v!r}")
            object.__setattr__(self, name, int(v))
        if not isinstance(self.method, str) or not self.method.strip():
            raise ValueError(f"method must be a non-empty string, got {self.method!r}")
        if not isinstance(self.binarize, str):
            raise ValueError(f"binarize must be a string, got {self.binarize!r}")
        if not isinstance(self.params, dict):
            raise ValueError(f"params must be a dict of arrays, got {type(self.params).__name__}")
        expected = param_shapes(self.made)
        missing = [n for n in expected if n not in self.params]
        unexpected = [n for n in self.params if n not in expected]
        if missing or unexpected:
            raise ValueError(f"parameter names mismatch: missing {missing}, unexpected {unexpected}")
        params = {}
        for name, shape in expected.items():
            a = np.asarray(self.params[name])
            if a.dtype == object or not np.issubdtype(a.dtype, np.floating):
                raise ValueError(f"parameter {name!r} must be a float array, got dtype {a.dtype}")
            if a.shape != shape:
                raise ValueError(f"parameter {name!r}: expected shape {shape}, got {a.shape}")
            a = np.array(a, dtype=np.float32, order="C", copy=True)
            if not np.isfinite(a).all():
                raise ValueError(f"parameter {name!r} contains NaN or infinite values")
            a.flags.writeable = False
            params[name] = a
        object.__setattr__(self, "params", params)

    @property
    def order_k(self) -> int:
        """The order index reduced modulo ``num_orders`` (the masks that get baked in)."""
        return self.order_index % self.made.num_orders


@dataclass(frozen=True, eq=False)
class TextGroupsServed:
    """A text classifier: backbone + Enhancer groups + nearest-prototype group selection.

    ``prototypes`` maps a class id to its global prototype (unit embedding mean) and
    ``group_of`` a class id to the group that classifies it.  ``backbone`` and ``groups`` are
    the torch modules of ``fclcore.models.enhancer``.
    """

    backbone: Any
    groups: Sequence[Any]
    prototypes: Mapping[int, np.ndarray]
    group_of: Mapping[int, int]
    task: int
    max_length: int
    method: str = ""
    extra: dict = field(default_factory=dict)
    format = "text-groups"


@dataclass(frozen=True, eq=False)
class TextTasksServed:
    """A task-incremental text classifier: token ids -> one head per task (the task id picks it).

    ``module`` is a torch ``nn.Module`` (never imported here):
    ``forward(input_ids int64 [B, L], attention_mask int64 [B, L]) -> logits float32 [B, T, W]``
    with T = ``len(labels)`` tasks and W = the most labels of a task; task t's head fills its
    first ``len(labels[t])`` columns and the columns past them are ``-inf``.  ``labels`` and
    ``class_names`` are validated and stored as tuples.
    """

    module: Any
    labels: Sequence[Sequence[int]]  # per task: global class ids in head-column order
    class_names: Sequence[str]  # global class id -> name
    task: int  # the last task trained (== len(labels) - 1)
    max_length: int  # tokens per text incl. [CLS]/[SEP] (padding with id 0)
    method: str = ""
    extra: dict = field(default_factory=dict)
    format = "text-tasks"

    def __post_init__(self) -> None:
        if isinstance(self.class_names, str) or not isinstance(self.class_names, Sequence):
            raise ValueError(f"class_names must be a sequence of strings, got {type(self.class_names).__name__}")
        names = tuple(self.class_names)
        if any(not isinstance(n, str) for n in names):
            raise ValueError(f"class_names must all be strings, got {names!r}")
        object.__setattr__(self, "class_names", names)
        object.__setattr__(self, "labels", _task_labels(self.labels, len(names)))
        for name, minimum in (("task", 0), ("max_length", 2)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {v!r}")
            object.__setattr__(self, name, int(v))
        if self.task != len(self.labels) - 1:
            raise ValueError(f"task must be len(labels) - 1 = {len(self.labels) - 1} (the last task), got {self.task}")
        if not isinstance(self.method, str):
            raise ValueError(f"method must be a string, got {self.method!r}")
        if not isinstance(self.extra, dict):
            raise ValueError(f"extra must be a dict, got {type(self.extra).__name__}")


def _task_labels(labels: Any, n_classes: int) -> tuple[tuple[int, ...], ...]:
    """``labels`` as a tuple of per-task tuples of distinct class ids in ``[0, n_classes)``."""
    if isinstance(labels, (str, bytes)) or not isinstance(labels, (Sequence, np.ndarray)) or len(labels) == 0:
        raise ValueError(f"labels must be a non-empty sequence of per-task label lists, got {labels!r}")
    out = []
    for t, row in enumerate(labels):
        if isinstance(row, (str, bytes)) or not isinstance(row, (Sequence, np.ndarray)) or len(row) == 0:
            raise ValueError(f"labels[{t}] must be a non-empty sequence of class ids, got {row!r}")
        if any(isinstance(c, bool) or not isinstance(c, (int, np.integer)) for c in row):
            raise ValueError(f"labels[{t}] must contain ints, got {list(row)!r}")
        ids = tuple(int(c) for c in row)
        if len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= n_classes:
            raise ValueError(f"labels[{t}] must be distinct class ids in [0, {n_classes}) (class_names), got {ids}")
        out.append(ids)
    return tuple(out)
