"""This process's memory, as a device budget counts it: resident set now and its peak, in MiB.

Linux's ``/proc/self/status`` gives both (VmRSS, VmHWM).  Elsewhere the peak falls back to
``ru_maxrss`` (which Linux would carry over ``exec`` from a forking parent, hence VmHWM first)
and the current RSS is unknown (None).
"""

from __future__ import annotations

import resource
import sys

__all__ = ["rss_mb", "peak_rss_mb", "gpu_peak_mb"]


def _status_kb(field: str, pid: int | str = "self") -> int | None:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def rss_mb() -> float | None:
    """Resident set size now, MiB (None where /proc is missing)."""
    kb = _status_kb("VmRSS")
    return None if kb is None else round(kb / 1024, 1)


def peak_rss_mb(pid: int | None = None) -> float | None:
    """Peak resident set size of this process (or of the live process ``pid``, on Linux) so far, MiB."""
    kb = _status_kb("VmHWM", "self" if pid is None else pid)
    if kb is None and pid is not None:
        return None
    if kb is None:
        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        if sys.platform == "darwin":  # bytes there, KiB on Linux
            kb //= 1024
    return round(kb / 1024, 1)


def gpu_peak_mb() -> float | None:
    """Peak GPU memory torch allocated in this process, MiB; None where no GPU was used (torch is
    not imported for this: a device that trains on the CPU never loads CUDA to say so)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return round(torch.cuda.max_memory_allocated() / 2**20, 1)


_LIBC: object = None


def release_free_memory() -> None:
    """Hand the C heap's free pages back to the OS (glibc ``malloc_trim``; a no-op elsewhere).

    torch's CPU tensors live on the C heap, and a round frees and allocates many
    weight-sized buffers: without this, the freed ones stay resident as holes the next round
    may not fit into (measured in firmware_notes/memory.md).  Cheap: a few ms."""
    global _LIBC
    if _LIBC is None:
        try:
            import ctypes

            libc = ctypes.CDLL("libc.so.6")
            _LIBC = libc if hasattr(libc, "malloc_trim") else False
        except OSError:
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)
