"""The documented plug-in path ``gemmdrift.exact_cache:make_cache`` (and ``:rollback``), kept working: the
exact cache lives in :mod:`gemmdrift.caches.exact`."""

from .caches.exact import RESERVE, OverlayRotatingKVCache, make_cache, rollback

__all__ = ["RESERVE", "OverlayRotatingKVCache", "make_cache", "rollback"]
