"""Cache state exactness (gemmdrift state): the number of non-exact cases per cache class and operation.

A release of mlx-lm that fixes the speculative rollback of a full RotatingKVCache
shows here as ``track_non_exact`` of ``RotatingKVCache/rollback`` dropping to 0.
"""

from . import common

# Pinned inputs: the default sweep of `gemmdrift state` on the embedded Gemma (None: the library's
# defaults, i.e. below/at/past/far and k = 1..4, with below/past and k = 2 for the QuantizedKVCache).
STATE_OPERATIONS = ("rollback", "trim", "trim_prompt_cache", "save_load", "server_reuse", "batch")
STATE_WHERE = None
STATE_KS = None
STATE_CASES = (
    [f"{c}/{op}" for op in ("rollback", "save_load", "server_reuse")
     for c in ("KVCache", "RotatingKVCache", "QuantizedKVCache")]
    + [f"{c}/{op}" for op in ("trim", "trim_prompt_cache")
       for c in ("KVCache", "RotatingKVCache", "RotatingKVCache(keep=4)", "QuantizedKVCache", "ConcatenateKVCache",
                 "ChunkedKVCache", "CacheList", "BatchKVCache", "BatchRotatingKVCache")]
    + ["BatchKVCache/batch", "BatchRotatingKVCache/batch"]
)


class StateExactness:
    timeout = 3600
    params = [STATE_CASES]
    param_names = ["case"]

    def setup_cache(self):
        from gemmdrift import state

        r = state.measure_state(common.model(), operations=STATE_OPERATIONS, where=STATE_WHERE, ks=STATE_KS)
        return dict(r.figures)  # picklable: name -> value

    setup_cache.timeout = 3600

    def track_non_exact(self, figures, case):
        """Cases of this cache class and operation that are not bit-identical to a cache that never did it
        (rounding or state bug); NaN where this mlx-lm has no such case."""
        cache, op = case.rsplit("/", 1)
        return float(figures.get(f"non_exact.{cache}.{op}", float("nan")))

    track_non_exact.unit = "cases"
    track_non_exact.version = "1"

    def track_state_bugs(self, figures, case):
        """All STATE BUG cases of the sweep (the same number for every case parameter)."""
        return float(figures.get("state_bugs", float("nan")))

    track_state_bugs.unit = "cases"
    track_state_bugs.version = "1"
