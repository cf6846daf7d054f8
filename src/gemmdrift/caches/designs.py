"""Other public designs of a trimmable sliding-window cache, rebuilt from their descriptions (no code copied).

**Unroll and cut** (described in mlx-swift-lm #584: "unrolls the ring and cuts the newest
rows"): ``trim(n)`` on a full ring puts it in temporal order and drops its newest ``n``
rows. Rebuilt here as :class:`UnrollCutRotatingKVCache` from that one sentence, on top of
mlx-lm 0.32.2's ``RotatingKVCache``: this is our reading of the description, not that
port's code, and it is judged as such. What to expect: after a block of T rows mlx-lm's
concatenating path keeps ``max_size - 1 + T`` rows, so cutting ``r < T`` of them leaves
the whole window (exact); after T=1 updates the ring holds only ``max_size`` rows, and
cutting ``r >= 2`` leaves fewer than the ``max_size - 1`` the next query must see: the
rows that the rejected ones overwrote are gone.

Plug-in entry point: ``--cache-impl gemmdrift.caches.designs:unroll_cut``.
"""

from __future__ import annotations

from typing import Any

from mlx_lm.models import cache as _C
from mlx_lm.models.cache import RotatingKVCache


class UnrollCutRotatingKVCache(RotatingKVCache):
    """``RotatingKVCache`` whose trim always works: temporal order, then the newest ``n`` rows cut off."""

    def is_trimmable(self):
        return True

    def trim(self, n):
        n = min(self.offset, int(n))
        if n <= 0 or self.keys is None:
            return 0
        if self.offset < self.max_size:  # not wrapped yet: mlx-lm's own trim
            return RotatingKVCache.trim(self, n)
        k, v = self._temporal_order(self.keys), self._temporal_order(self.values)
        keep = max(k.shape[2] - n, 0)
        self.keys, self.values = k[..., :keep, :], v[..., :keep, :]
        self.offset -= n
        self._idx = keep
        return n


# load_prompt_cache finds classes by name in mlx_lm.models.cache (registered at runtime, the file untouched).
if not hasattr(_C, UnrollCutRotatingKVCache.__name__):
    setattr(_C, UnrollCutRotatingKVCache.__name__, UnrollCutRotatingKVCache)


def unroll_cut(model) -> list[Any]:
    """The model's own caches with every ``RotatingKVCache`` an unroll-and-cut one."""
    return [UnrollCutRotatingKVCache(c.max_size, c.keep) if type(c) is RotatingKVCache else c
            for c in _C.make_prompt_cache(model)]
