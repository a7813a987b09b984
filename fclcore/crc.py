"""The wire codec's CRC32 (zlib's polynomial): ISA-L's when ``isal`` is installed (the
``fast`` extra, for an aggregator that checks a frame per device per round), zlib's
otherwise.  Both give the same number for the same bytes; ISA-L's folds 64 bytes at a time
with carry-less multiplies and runs about 15 times faster on x86_64 (0.005 ms against 0.09
ms for a 525 kB update, ``benchmarks/bench_aggregate.py``'s ``crc_seconds``)."""

from __future__ import annotations

import zlib
from typing import Callable

try:
    from isal.isal_zlib import crc32 as _isal_crc32
except ImportError:  # the extra is not installed: zlib's
    _isal_crc32 = None

crc32: Callable[..., int] = _isal_crc32 if _isal_crc32 is not None else zlib.crc32
"""``crc32(data, value=0)``: the running CRC32 of ``data`` continued from ``value``."""


def implementation() -> str:
    """``"isal"`` or ``"zlib"``: what ``crc32`` is (benchmarks record it)."""
    return "isal" if crc32 is _isal_crc32 else "zlib"
