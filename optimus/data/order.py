"""Sample order: keyed permutations that make the order a pure function of (seed, index).

Why a permutation is written here: sample order must be a pure function of
(seed, global sample index) so a resumed job at any dp degree reads exactly what an
uninterrupted one would. `torch.randperm` would give that, but needs O(num_samples) memory
and time per epoch (billions of samples); a small Feistel network with cycle-walking is a
keyed bijection on [0, n) evaluated in O(1) memory per index.

Plain Python, no torch: the loader and a mixture's blocks (optimus/data/mixture.py) draw from
it, and `optimus data audit` recomputes a mixture's sources from it without the data.
"""

from __future__ import annotations

_MASK64 = (1 << 64) - 1
_BLOCK_SALT = 0xB10C_5EED  # a mixture block's permutation key, apart from any epoch's


def _mix64(x: int) -> int:
    """splitmix64 finalizer: a fast, well-mixed 64-bit hash."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class FeistelPermutation:
    """Keyed bijection on [0, n): balanced Feistel network on 2h bits, cycle-walked into n."""

    rounds = 6

    def __init__(self, n: int, key: int):
        if n < 1:
            raise ValueError(f"permutation needs n >= 1, got {n}")
        self.n = n
        self._half = max(1, ((n - 1).bit_length() + 1) // 2)
        self._mask = (1 << self._half) - 1
        key = _mix64(key & _MASK64)
        self._keys = [_mix64(key ^ _mix64(r)) for r in range(self.rounds)]

    def _encrypt(self, x: int) -> int:
        left, right = x >> self._half, x & self._mask
        for k in self._keys:
            left, right = right, left ^ (_mix64(k ^ right) & self._mask)
        return (left << self._half) | right

    def __call__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(f"{i} is outside [0, {self.n})")
        x = self._encrypt(i)
        while x >= self.n:  # domain is < 4n, so this walks < 4 times on average
            x = self._encrypt(x)
        return x


class SampleOrder:
    """Which sample window each global index reads: epoch e shuffled by key (seed, e)."""

    def __init__(self, num_samples: int, seed: int):
        self.num_samples, self.seed = num_samples, seed
        self._epoch, self._perm = -1, None

    def sample_id(self, g: int) -> int:
        if g < 0:
            raise IndexError(f"global sample index must be >= 0, got {g}")
        epoch, pos = divmod(g, self.num_samples)
        if epoch != self._epoch:
            key = _mix64(_mix64(self.seed) ^ (epoch * 0xD1B54A32D192ED03 & _MASK64))
            self._epoch, self._perm = epoch, FeistelPermutation(self.num_samples, key)
        return self._perm(pos)


def block_permutation(seed: int, b: int, size: int) -> FeistelPermutation:
    """The permutation of mixture block b's `size` slots onto its sources' quota ranges."""
    key = _mix64(_mix64(seed ^ _BLOCK_SALT) ^ (b * 0x9E3779B97F4A7C15 & _MASK64))
    return FeistelPermutation(size, key)
