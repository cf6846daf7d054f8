"""Cache candidates for speculative decoding past the sliding window (issue 24), judged side by side.

mlx-lm 0.32.2's own caches, the overlay cache gemmdrift ships (``gemmdrift.caches.exact``) and the
unroll-and-cut design of mlx-swift-lm #584 rebuilt from its description (``gemmdrift.caches.designs``):
the state grid's non-exact cases per candidate (``CacheCandidates``), and the decode speed and cache
memory against mlx-lm's (``CacheDecodeCost``, a long benchmark on the CPU: three prefills of the essay).
"""

from . import common

CANDIDATES = {
    "mlx-lm": "mlx_lm.models.cache:make_prompt_cache",
    "overlay": "gemmdrift.caches.exact:make_cache",
    "unroll-cut": "gemmdrift.caches.designs:unroll_cut",
}
# Pinned grid: every operation a speculative server performs, below and just past the window, k = 1..3.
GRID = dict(operations=("rollback", "trim", "trim_prompt_cache", "draft_trim", "save_load", "server_reuse"),
            where=("below", "past"), ks=(1, 2, 3))
DECODE_N = 16  # greedy tokens per timed run, after the essay (past the 512 window)
DECODE_REPEATS = 3  # paired rounds after one warm-up round (the median is tracked)


def _grid_counts(r):
    from gemmdrift import state

    t = r.tables["state"]
    return {"non_exact": float(t["verdict"].isin(state.NON_EXACT).sum()),
            "state_bugs": float((t["verdict"] == "STATE BUG").sum()),
            "refused": float((t["verdict"] == "refused").sum()), "cases": float(len(t))}


class CacheCandidates:
    """The state grid (GRID) on each candidate's caches: cases that are not bit-identical to never trimming."""

    timeout = 3600
    params = [list(CANDIDATES)]
    param_names = ["cache"]

    def setup_cache(self):
        if not common.full_benchmarks():
            return common.skipped_full()
        from gemmdrift import suite

        # Each candidate's grid computes on one core (a plug-in's sweep runs in one process): side by side,
        # a process each, two at a time (gemmdrift.suite.side_by_side; each computes what it computes alone).
        parts = {name: (suite.cache_impl_part, dict(spec=spec, **GRID)) for name, spec in CANDIDATES.items()}
        results = suite.side_by_side(common.model(), parts)
        return {name: _grid_counts(results[name]) for name in CANDIDATES}

    def setup(self, f, *params):
        common.skip_unless_full(f, "CacheCandidates")

    def track_non_exact(self, f, cache):
        """Rounding, STATE BUG or refused cases of the grid (0: exact wherever it applies)."""
        return f[cache]["non_exact"]

    track_non_exact.unit = "cases"
    track_non_exact.version = "1"
    track_non_exact.direction = "lower"

    def track_state_bugs(self, f, cache):
        """STATE BUG cases of the grid."""
        return f[cache]["state_bugs"]

    track_state_bugs.unit = "cases"
    track_state_bugs.version = "1"
    track_state_bugs.direction = "lower"


class CacheDecodeCost:
    """Greedy decode after the essay with each candidate's caches against mlx-lm's, in one run
    (gemmdrift.state.bench.decode_cost: paired rounds, median)."""

    timeout = 7200
    params = [[c for c in CANDIDATES if c != "mlx-lm"]]
    param_names = ["cache"]

    def setup_cache(self):
        if not common.long_benchmarks():
            return common.skipped_long()
        from gemmdrift.state import bench as cachebench
        from gemmdrift.caches import plugins
        from gemmdrift.prompts import builtin_text

        lm = common.model()
        ids = lm.tokenizer.encode(builtin_text("essay"))
        factories = {name: plugins.load_cache_impl(spec).obj for name, spec in CANDIDATES.items()}
        df = cachebench.decode_cost(lm, ids, DECODE_N, factories, repeats=DECODE_REPEATS)
        return {row["cache"]: {"ratio": float(row["ratio"]), "extra": float(row["extra_bytes_per_layer"])}
                for _, row in df.iterrows()}

    setup_cache.timeout = 7200

    def setup(self, f, *params):
        common.skip_unless_long(f, "CacheDecodeCost")

    def track_speed_ratio(self, f, cache):
        """Decode tokens/s with this candidate over mlx-lm's, median of paired rounds (1: no cost)."""
        return f[cache]["ratio"]

    track_speed_ratio.unit = "ratio"
    track_speed_ratio.version = "1"
    track_speed_ratio.direction = "higher"

    def track_extra_bytes_per_layer(self, f, cache):
        """Peak cache bytes per layer above mlx-lm's during the decode."""
        return f[cache]["extra"]

    track_extra_bytes_per_layer.unit = "bytes"
    track_extra_bytes_per_layer.version = "1"
    track_extra_bytes_per_layer.direction = "lower"
