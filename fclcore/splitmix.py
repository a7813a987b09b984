"""SplitMix64: the random stream protocol 2 defines for what both sides derive from a seed.

Why not NumPy's generators: a device in another language would have to reimplement PCG64 and
NumPy's bounded-integer and shuffle algorithms bit for bit.  SplitMix64 (Steele, Lea and
Flood, 2014) is a counter plus a 64-bit finaliser, a few lines in any language, and a stream
is keyed by the seed and stream ids without any state to carry.  The definition is normative:
docs/protocol.md, rule P-7.8; the golden vector ``docs/protocol-vectors/splitmix64.json``.
"""

from __future__ import annotations

_MASK = 2**64 - 1
_GOLDEN = 0x9E3779B97F4A7C15


def mix(z: int) -> int:
    """SplitMix64's finaliser (a bijection of 64-bit integers)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


class SplitMix64:
    """The stream ``stream(seed, *keys)`` of rule P-7.8: seed and keys are integers in [0, 2^64)."""

    def __init__(self, seed: int, *keys: int) -> None:
        for value in (seed, *keys):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MASK:
                raise ValueError(f"splitmix64 key: expected an integer in [0, 2^64), got {value!r}")
        state = mix((seed + _GOLDEN) & _MASK)
        for key in keys:
            state = mix(state ^ key)
        self.state = state

    def next(self) -> int:
        self.state = (self.state + _GOLDEN) & _MASK
        return mix(self.state)

    def below(self, n: int) -> int:
        """A uniform integer in [0, n), by rejection (no modulo bias)."""
        if not 1 <= n <= _MASK:
            raise ValueError(f"below: expected 1 <= n < 2^64, got {n}")
        limit = 2**64 - (2**64 % n)
        while True:
            x = self.next()
            if x < limit:
                return x % n

    def integers(self, low: int, high: int, size: int) -> list[int]:
        """``size`` uniform integers in [low, high] (both ends included)."""
        return [low + self.below(high - low + 1) for _ in range(size)]

    def permutation(self, n: int) -> list[int]:
        """A uniform permutation of range(n) (Fisher-Yates, from the end)."""
        p = list(range(n))
        for i in range(n - 1, 0, -1):
            j = self.below(i + 1)
            p[i], p[j] = p[j], p[i]
        return p
