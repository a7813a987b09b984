"""8-bit block quantization of a flat value array (the codec's int8 value encoding).

Values are cut into blocks of ``block`` consecutive entries; each block carries one float32
scale s and one int8 code c in [-127, 127] per value, and a value is read back as c * s.
The error bound and the wire layout are stated in :mod:`fclcore.codec`; this module is the
arithmetic only, in float64 so that the bound is not eaten by float32 rounding on the way.

Why float32 scales: an update late in training has blocks whose largest entry is 1e-6 or
less, and such a scale (1e-6 / 127) is below float16's smallest subnormal, so a float16
scale would read back as 0 and erase the block.  Four bytes per 64 values is half a bit
per value.

A block whose values are all integers of magnitude <= 127 gets scale 1 (or 0 when all are
zero): its codes are the values themselves, so 0/1 maps, labels and small counts that
travel as tensors arrive exactly.  The bound holds for such blocks trivially (error 0).
"""

from __future__ import annotations

import numpy as np

CODE_MAX = 127  # codes lie in [-CODE_MAX, CODE_MAX]; -128 is not a valid code


def _max_scale() -> np.float32:
    """The largest float32 scale with 127 * scale <= float32 max, so c * s never overflows."""
    top = float(np.finfo(np.float32).max)
    scale = np.float32(top / CODE_MAX)
    while float(scale) * CODE_MAX > top:
        scale = np.nextafter(scale, np.float32(0))
    return scale


MAX_SCALE = _max_scale()
MAX_ABS = float(MAX_SCALE) * CODE_MAX  # largest |value| a code can stand for (float32 max less 2^-23 of it)


def block_count(count: int, block: int) -> int:
    return -(-count // block)


def _blocks(values: np.ndarray, block: int, dtype: type = np.float64) -> np.ndarray:
    """(n,) -> (ceil(n / block), block), the last block padded with zeros (a fresh array)."""
    flat = np.asarray(values).reshape(-1)
    padded = np.zeros(block_count(flat.size, block) * block, dtype=dtype)
    padded[: flat.size] = flat
    return padded.reshape(-1, block)


def _small_integer_blocks(blocks: np.ndarray, top: np.ndarray) -> np.ndarray:
    """Which blocks hold only integers within [-127, 127] (their first entry screens them cheaply)."""
    first = blocks[:, 0]
    candidates = np.flatnonzero((top <= CODE_MAX) & (first == np.rint(first)))
    chosen = blocks[candidates]
    out = np.zeros(len(blocks), dtype=bool)
    out[candidates] = (chosen == np.rint(chosen)).all(axis=1)
    return out


def _scales(blocks: np.ndarray) -> np.ndarray:
    """Per-block float32 scale: max|block| / 127 rounded up (codes then stay within 127)."""
    top = np.maximum(blocks.max(axis=1, initial=0.0), 0.0 - blocks.min(axis=1, initial=0.0))  # never -0.0
    exact = top / CODE_MAX
    scales = exact.astype(np.float32)
    scales = np.where(scales < exact, np.nextafter(scales, np.float32(np.inf)), scales)
    return np.where(_small_integer_blocks(blocks, top) & (top > 0), np.float32(1), scales).astype(np.float32)


def quantize(values: np.ndarray, block: int, rng: np.random.Generator | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Finite values with |v| <= float32 max -> (float32 scales, int8 codes), one code per value.

    ``rng`` None rounds to nearest (ties to even); a generator rounds stochastically: up with
    probability equal to the fractional part, which makes the decoded value unbiased."""
    ratio = _blocks(values, block)  # (nblocks, block) float64, worked on in place
    # the few float32 values above MAX_ABS move down by < 2^-23 of themselves, far inside
    # the bound (s / 2 is then about 2^-8 of them)
    np.clip(ratio, -MAX_ABS, MAX_ABS, out=ratio)
    scales = _scales(ratio)
    ratio /= np.where(scales > 0, scales, 1.0)[:, None]  # all-zero blocks: codes 0
    if rng is None:
        np.rint(ratio, out=ratio)
    else:
        ratio += rng.random(ratio.shape)
        np.floor(ratio, out=ratio)
    np.clip(ratio, -CODE_MAX, CODE_MAX, out=ratio)
    return scales, ratio.reshape(-1)[: np.asarray(values).size].astype(np.int8)


def dequantize(scales: np.ndarray, codes: np.ndarray, block: int) -> np.ndarray:
    """(float32 scales, int8 codes) -> float32 values.  One float32 multiply is enough: c * s
    is exact in float64 (8 + 24 significant bits) and IEEE rounds the float32 product from it."""
    codes, scales = np.asarray(codes).reshape(-1), np.asarray(scales, dtype=np.float32)
    values = np.empty(codes.size, np.float32)
    whole = codes.size // block * block  # the full blocks, then the short last one (if any)
    np.multiply(codes[:whole].reshape(-1, block), scales[: whole // block, None], out=values[:whole].reshape(-1, block))
    np.multiply(codes[whole:], scales[whole // block :], out=values[whole:])  # at most one scale left
    return values
