"""The ``text-groups`` served format (:class:`fclcore.served.TextGroupsServed`) as ONNX.

A thin adapter: the graph, its parity checks and the int8 copy are those of
:func:`export.onnx_fedet.export_fedet` (backbone + prototype selector + Enhancer groups).
``export.formats.export_served`` calls :func:`export_text_groups` for this format.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from export.onnx_fedet import export_fedet
from export.publish import ExportError

__all__ = ["export_text_groups"]


def export_text_groups(served: Any, path: str | os.PathLike, *, parity_inputs: np.ndarray | None = None,
                       int8: bool = False, toolkit_version: str = "0.1.0") -> dict[str, Any]:
    """Export a :class:`~fclcore.served.TextGroupsServed` to ``path`` (verified, atomic).

    ``parity_inputs``: int64 token ids ``(N, L)``, right-padded with id 0 (the attention mask
    is ``ids != 0``), or None for the exporter's seeded random token rows.  The recorded
    ``fcl.method`` is ``served.method`` when it is set.  Raises :class:`ExportError`."""
    try:
        backbone, groups = served.backbone, list(served.groups)
        prototypes, group_of = dict(served.prototypes), dict(served.group_of)
        task, max_length, method = served.task, served.max_length, getattr(served, "method", "")
    except (AttributeError, TypeError) as exc:
        raise ExportError(f"not a text-groups served model: {exc}") from None
    ids = mask = None
    if parity_inputs is not None:
        ids = np.asarray(parity_inputs)
        mask = (ids != 0).astype(np.int64)
    kwargs: dict[str, Any] = {"method": method} if isinstance(method, str) and method.strip() else {}
    return export_fedet(backbone, groups, prototypes, group_of, path, int8=int8, parity_ids=ids, parity_mask=mask,
                        task=task, max_length=max_length, toolkit_version=toolkit_version, **kwargs)
