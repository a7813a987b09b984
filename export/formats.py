"""The served formats a device can export, each registered with its exporter and runtime.

``export_served(served, path)`` looks ``served.format`` up in :data:`REGISTRY` and runs that
format's exporter (which verifies the written file with the format's runtime):

* ``made`` (:class:`fclcore.served.ServedModel`) -> :func:`export.onnx_made.export_served_model`;
  ``parity_inputs`` are binary rows ``(N, D)``;
* ``text-groups`` (:class:`fclcore.served.TextGroupsServed`) ->
  :func:`export.onnx_text_groups.export_text_groups`; ``parity_inputs`` are int64 token ids
  ``(N, L)`` right-padded with 0 (mask = ids != 0);
* ``text-tasks`` (:class:`fclcore.served.TextTasksServed`) ->
  :func:`export.onnx_text_tasks.export_text_tasks`; ``parity_inputs`` as for ``text-groups``;
* ``image-classifier`` (:class:`fclcore.served.ImageClassifierServed`) ->
  :func:`export.onnx_image.export_image_classifier`; ``parity_inputs`` are float rows
  ``(N, side*side)`` of flattened images, as the device's data has them.

A format is registered by name with ``module:attribute`` references, imported only when a model
of that format is exported or loaded (the exporters import onnx and torch), so importing this
module is cheap.  A new served format is one :func:`register` call here plus its exporter and
runtime modules.

``export_with_snapshot`` is what a device runs: the verified ONNX file and, next to it, the
snapshot ``fcl export`` re-exports (``export.snapshot``; a text-tasks model is traced once for
both).  ``export_snapshot`` is what ``fcl export`` runs on a loaded snapshot.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Any

from export.publish import ExportError
from fclcore.procmem import release_free_memory

__all__ = [
    "FORMATS",
    "REGISTRY",
    "ServedFormat",
    "ExportError",
    "export_served",
    "export_snapshot",
    "export_with_snapshot",
    "register",
]


@dataclass(frozen=True)
class ServedFormat:
    """One served format: its name (``served.format``), the ``fcl.format`` its files carry,
    its exporter (``export_served``'s signature: ``(served, path, *, parity_inputs, int8,
    toolkit_version) -> report``) and the torch-free runtime that loads (and, at export,
    verifies) its files, both as ``module:attribute``."""

    name: str
    file_format: str
    exporter: str
    runtime: str

    def load_exporter(self) -> Any:
        return _resolve(self.exporter)

    def load_runtime(self) -> Any:
        return _resolve(self.runtime)


def _resolve(ref: str) -> Any:
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


REGISTRY: dict[str, ServedFormat] = {}


def register(fmt: ServedFormat) -> ServedFormat:
    """Add ``fmt`` to :data:`REGISTRY` (a name registers once)."""
    if fmt.name in REGISTRY:
        raise ValueError(f"served format {fmt.name!r} is already registered")
    REGISTRY[fmt.name] = fmt
    return fmt


register(ServedFormat("made", "fcl-made/1", "export.onnx_made:export_served_model", "export.runtime:MadeRuntime"))
register(
    ServedFormat(
        "text-groups",
        "fcl-fedet/1",
        "export.onnx_text_groups:export_text_groups",
        "export.text_runtime:TextClassifierRuntime",
    )
)
register(
    ServedFormat(
        "text-tasks",
        "fcl-text-tasks/1",
        "export.onnx_text_tasks:export_text_tasks",
        "export.text_tasks_runtime:TextTasksRuntime",
    )
)
register(
    ServedFormat(
        "image-classifier",
        "fcl-image-classifier/1",
        "export.onnx_image:export_image_classifier",
        "export.image_runtime:ImageClassifierRuntime",
    )
)

FORMATS: tuple[str, ...] = tuple(REGISTRY)


def export_served(
    served: Any,
    path: str | os.PathLike,
    *,
    parity_inputs: Any = None,
    int8: bool = False,
    toolkit_version: str = "0.1.0",
) -> dict[str, Any]:
    """Write ``served`` as a verified ONNX file at ``path`` (plus ``<stem>.int8.onnx`` with
    ``int8``) and return the exporter's report.  Raises :class:`ExportError`, also for a
    format no exporter knows."""
    name = getattr(served, "format", None)
    fmt = REGISTRY.get(name) if isinstance(name, str) else None
    if fmt is None:
        raise ExportError(
            f"no exporter for served format {name!r} ({type(served).__name__}); known formats: {', '.join(FORMATS)}"
        )
    return fmt.load_exporter()(served, path, parity_inputs=parity_inputs, int8=int8, toolkit_version=toolkit_version)


def export_with_snapshot(
    served: Any,
    path: str | os.PathLike,
    snapshot: str | os.PathLike,
    *,
    parity_inputs: Any = None,
    int8: bool = False,
) -> tuple[dict[str, Any], str | None]:
    """:func:`export_served`, and the snapshot of ``served`` written at ``snapshot`` first:
    (the report, None) or (the report, why the snapshot could not be written) -- a model
    without a snapshot is still served.  Raises :class:`ExportError` if the export fails."""
    from export.snapshot import SnapshotError, save_snapshot

    stage = None
    if getattr(served, "format", None) == "text-tasks":  # traced once, for the snapshot and the export
        from export.onnx_text_tasks import random_rows_stage, stage_text_tasks
        from export.text_tasks_publish import publish_text_tasks

        stage = stage_text_tasks(served, parity_inputs=parity_inputs)
    try:
        save_snapshot(served if stage is None else random_rows_stage(stage, served), snapshot)
        problem = None
    except (SnapshotError, OSError) as exc:
        problem = str(exc)
    if stage is not None:
        release_free_memory()  # the trace's and the snapshot's buffers, freed but resident, before publishing
        held, stage = [stage], None  # the call takes the only reference: the graph's bytes go once parsed
        return publish_text_tasks(held.pop(), path, int8=int8), problem
    return export_served(served, path, parity_inputs=parity_inputs, int8=int8), problem


def export_snapshot(
    loaded: Any, path: str | os.PathLike, *, int8: bool = False, toolkit_version: str = "0.1.0"
) -> dict[str, Any]:
    """Export what ``export.snapshot.load_snapshot`` returned, other than a MADE (whose parity
    data ``fcl export`` chooses): parity on the exporter's seeded random rows, or for a
    text-tasks snapshot on the rows and torch logits it holds.  Raises :class:`ExportError`,
    or ``SnapshotError`` if a text-groups snapshot's backbone cannot be found."""
    from export.snapshot_formats import TextGroupsSnapshot, TextTasksStage

    if isinstance(loaded, TextTasksStage):
        from export.text_tasks_publish import publish_text_tasks  # no torch

        return publish_text_tasks(loaded, path, int8=int8, toolkit_version=toolkit_version)
    served = loaded.served() if isinstance(loaded, TextGroupsSnapshot) else loaded
    return export_served(served, path, int8=int8, toolkit_version=toolkit_version)
