"""Export what a device serves, chosen by its format (not by the method that trained it).

``export_served(served, path)`` dispatches on ``served.format``:

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

The exporters (onnx, torch) are imported only when a model is exported, so importing this
module is cheap.
"""

from __future__ import annotations

import os
from typing import Any

from export.publish import ExportError

__all__ = ["FORMATS", "ExportError", "export_served"]

FORMATS: tuple[str, ...] = ("made", "text-groups", "text-tasks", "image-classifier")


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
    fmt = getattr(served, "format", None)
    if fmt == "made":
        from export.onnx_made import export_served_model

        return export_served_model(
            served, path, parity_inputs=parity_inputs, int8=int8, toolkit_version=toolkit_version
        )
    if fmt == "text-groups":
        from export.onnx_text_groups import export_text_groups

        return export_text_groups(served, path, parity_inputs=parity_inputs, int8=int8, toolkit_version=toolkit_version)
    if fmt == "text-tasks":
        from export.onnx_text_tasks import export_text_tasks

        return export_text_tasks(served, path, parity_inputs=parity_inputs, int8=int8, toolkit_version=toolkit_version)
    if fmt == "image-classifier":
        from export.onnx_image import export_image_classifier

        return export_image_classifier(
            served, path, parity_inputs=parity_inputs, int8=int8, toolkit_version=toolkit_version
        )
    raise ExportError(
        f"no exporter for served format {fmt!r} ({type(served).__name__}); known formats: {', '.join(FORMATS)}"
    )
