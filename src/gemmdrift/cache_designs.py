"""The documented plug-in path ``gemmdrift.cache_designs:unroll_cut``, kept working: the other cache designs
live in :mod:`gemmdrift.caches.designs`."""

from .caches.designs import UnrollCutRotatingKVCache, unroll_cut

__all__ = ["UnrollCutRotatingKVCache", "unroll_cut"]
