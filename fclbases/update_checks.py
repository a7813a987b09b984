"""Checks a strategy's ``normalize`` runs on an update, written once for the methods that share
them: no tensor beyond the expected ones, and a metadata report that parses and is about the
round's task."""

from __future__ import annotations

from typing import Any, Callable, Collection, Mapping

from fclcore.strategy import Rejected


def refuse_unexpected(tensors: Collection[str], expected: Collection[str]) -> None:
    """ValueError (counted as ``content``) naming up to five tensors not in ``expected``."""
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise ValueError(f"tensors: unexpected {extra[:5]}")


def task_report(parse: Callable[[Mapping], dict], meta: Mapping, task: int, key: str) -> dict[str, Any]:
    """``parse(meta)``, rejected as ``meta`` when it does not parse or its ``task`` is not the
    round's (``key``: the method's metadata key, for the message)."""
    try:
        report = parse(meta)
    except ValueError as exc:
        raise Rejected("meta", str(exc)) from None
    if report["task"] != task:
        raise Rejected("meta", f"meta.{key}.task {report['task']}, the round is task {task}")
    return report
