"""Why numpy refused a file, said without numpy's advice to unpickle it.

Files are always read with ``allow_pickle=False``.  numpy's error for a file that is not an
``.npy``/``.npz`` of plain arrays (a text file, a pickle, an object array) suggests loading it
"unsafely" with ``allow_pickle``; a toolkit that never unpickles must not suggest it either.
"""

from __future__ import annotations


def refusal(exc: BaseException, limit: int = 160) -> str:
    """One line: what was wrong with the file numpy refused (``exc`` from ``np.load``)."""
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if "pickle" in first.lower():
        return "not a file of plain numpy arrays (it holds pickled or object data, which is never loaded)"
    return first[:limit]
