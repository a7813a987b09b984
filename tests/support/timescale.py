"""Time limits in tests, scaled for slow machines.

Every wait a test makes (a process to exit, a round to close, pytest-timeout's per-test limit)
is written for a quiet machine like CI's and multiplied by ``FCL_TEST_TIME_SCALE`` (default 1):
on a board or runner four times slower, ``FCL_TEST_TIME_SCALE=4 pytest`` gives every limit four
times longer instead of failing at a fixed one.  Nothing a test asserts depends on speed."""

from __future__ import annotations

import os


def _scale() -> float:
    raw = os.environ.get("FCL_TEST_TIME_SCALE", "1")
    try:
        value = float(raw)
    except ValueError:
        raise SystemExit(f"FCL_TEST_TIME_SCALE: expected a number >= 1, got {raw!r}") from None
    if not value >= 1:
        raise SystemExit(f"FCL_TEST_TIME_SCALE: expected a number >= 1, got {raw!r}")
    return value


SCALE = _scale()


def scaled(seconds: float) -> float:
    """``seconds`` on this machine: the quiet machine's limit times ``FCL_TEST_TIME_SCALE``."""
    return seconds * SCALE
