"""The compiled replay's per-weight cache of prepared weight tiles (used by :mod:`.jitquant`).

A model's weights never change between calls, yet every quantized call used to
decode, transpose and dequantize the packed weight tile by tile before its
loops (about 1 ms of a 1.3-2 ms T=1 projection, K=640, N=2048). The prepared
tiles are a pure function of the packed codes, scales, biases and the
preparation (bits, group size, dequantization mode, dtype, FTZ), so they can be
kept per fixed weight and served again: the kernels then read the same float32
values they would have computed, and give the same bits.

Keying: an entry is served only if the operands' **contents** are bit for bit
those it was built from (a full comparison with copies kept in the entry,
about 0.05 ms for a 2048 x 640 4-bit weight; another weight differs in its
first words, so rejecting one costs microseconds), under the same preparation
and shapes: a different weight, or the same array changed in place, is never
served another's tiles, and the same weight passed as a fresh array (another
address) still finds its entry. The entry last built at the operands'
addresses is tried first.

Memory: bounded by ``GEMMDRIFT_REPLAY_TILE_CACHE_MB`` (default 1024; 0 turns the
cache off). When the next entry would not fit it is not admitted (nothing is
evicted): a model's projections repeat in a fixed cycle, where least-recently-used
eviction would miss on every call once the cycle exceeds the budget, while
keeping the first entries keeps serving those.
"""

from __future__ import annotations

import os
from typing import Callable

from .jitcore import compile_once, njit, np

DEFAULT_MB = 1024


@compile_once
@njit(cache=True)
def _same_words(a, b):
    """a == b bit for bit (flat uint32 arrays of one size), stopping at the first difference."""
    for i in range(a.size):
        if a[i] != b[i]:
            return False
    return True


def _words(a: np.ndarray) -> np.ndarray:
    """The raw 32-bit words of a contiguous 4-byte array (float32 compared by bits: -0, NaN payloads)."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint32)


def budget_bytes() -> int:
    """The cache's bound in bytes, from ``GEMMDRIFT_REPLAY_TILE_CACHE_MB`` (an integer >= 0)."""
    from ..errors import GemmdriftError

    text = os.environ.get("GEMMDRIFT_REPLAY_TILE_CACHE_MB", "").strip() or str(DEFAULT_MB)
    if not text.isdigit():
        raise GemmdriftError(f"GEMMDRIFT_REPLAY_TILE_CACHE_MB must be a whole number of MB >= 0, got {text!r}")
    return int(text) << 20


class TileCache:
    """Prepared tiles per (operands' contents, preparation), at most ``budget`` bytes in all."""

    def __init__(self, budget: int | None = None):
        self.budget = budget
        self.entries: dict[tuple, list] = {}  # (prep, shapes) -> [(addresses, copies, tiles, size), ...]
        self.nbytes = 0
        self.hits = self.misses = self.refused = 0

    def __len__(self) -> int:
        return sum(len(v) for v in self.entries.values())

    def clear(self) -> None:
        self.entries.clear()
        self.nbytes = 0
        self.hits = self.misses = self.refused = 0

    def get(self, operands: tuple[np.ndarray, ...], prep: tuple, build: Callable[[], tuple]) -> tuple:
        """The tiles ``build()`` returns for ``operands`` (contiguous 4-byte arrays) under ``prep``, from the
        cache when the same contents were prepared the same way before."""
        key = (prep,) + tuple((a.shape, a.dtype.str) for a in operands)
        addresses = tuple(a.ctypes.data for a in operands)
        words = [_words(a) for a in operands]
        bucket = self.entries.setdefault(key, [])
        for entry in sorted(bucket, key=lambda e: e[0] != addresses):  # the entry built here first
            if all(_same_words(w, c) for w, c in zip(words, entry[1])):
                self.hits += 1
                return entry[2]
        self.misses += 1
        tiles = build()
        copies = tuple(w.copy() for w in words)
        size = sum(t.nbytes for t in tiles) + sum(c.nbytes for c in copies)
        budget = budget_bytes() if self.budget is None else self.budget
        if self.nbytes + size <= budget:
            bucket.append((addresses, copies, tiles, size))
            self.nbytes += size
        else:
            self.refused += 1
        return tiles


TILES = TileCache()  # the engine's cache (budget read from the environment at each admission)


def clear() -> None:
    """Empty the engine's tile cache (a first call after this prepares its tiles again)."""
    TILES.clear()


__all__ = ["DEFAULT_MB", "TileCache", "TILES", "budget_bytes", "clear"]
