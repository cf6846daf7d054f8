"""Cache state exactness (gemmdrift state): the number of non-exact cases per cache class and operation.

A release of mlx-lm that fixes the speculative rollback of a full RotatingKVCache
shows here as ``track_non_exact`` of ``RotatingKVCache/rollback`` dropping to 0.
"""

from . import common
from .common import STATE_KS, STATE_OPERATIONS, STATE_WHERE  # noqa: F401  (pinned in common, where Probes computes them)

# The tracked cases of the pinned sweep (STATE_* in common: the default sweep of `gemmdrift state`).
STATE_CASES = (
    [f"{c}/{op}" for op in ("rollback", "save_load", "server_reuse")
     for c in ("KVCache", "RotatingKVCache", "QuantizedKVCache")]
    + [f"{c}/{op}" for op in ("trim", "trim_prompt_cache")
       for c in ("KVCache", "RotatingKVCache", "RotatingKVCache(keep=4)", "QuantizedKVCache", "ConcatenateKVCache",
                 "ChunkedKVCache", "CacheList", "BatchKVCache", "BatchRotatingKVCache")]
    + ["BatchKVCache/batch", "BatchRotatingKVCache/batch"]
)


class StateExactness(common.Probes):
    """The cache-state sweep (gemmdrift.state.measure_state with the inputs above); its setup is shared with
    the other probes (common.Probes)."""

    params = [STATE_CASES]
    param_names = ["case"]

    def track_non_exact(self, figures, case):
        """Cases of this cache class and operation that are not bit-identical to a cache that never did it
        (rounding or state bug); NaN where this mlx-lm has no such case."""
        cache, op = case.rsplit("/", 1)
        return float(figures["state"].get(f"non_exact.{cache}.{op}", float("nan")))

    track_non_exact.unit = "cases"
    track_non_exact.version = "1"
    track_non_exact.direction = "lower"

    def track_state_bugs(self, figures, case):
        """All STATE BUG cases of the sweep (the same number for every case parameter)."""
        return float(figures["state"].get("state_bugs", float("nan")))

    track_state_bugs.unit = "cases"
    track_state_bugs.version = "1"
    track_state_bugs.direction = "lower"


# The built-in prompts, each after the built-in essay (past the 512-token window), 32 greedy tokens,
# self-draft with K=2: plain vs mlx-lm's speculative decoding and plain vs the exact-rollback one.
ROLLBACK_N = 32
ROLLBACK_K = 2


class ExactRollbackDivergence:
    timeout = 14400
    params = [["mlx-lm", "exact"]]
    param_names = ["rollback"]

    def setup_cache(self):
        if not common.long_benchmarks():
            return common.skipped_long()
        from gemmdrift.measure import diverge
        from gemmdrift.prompts import builtin_prompts, builtin_text

        lm = common.model()
        prefix = builtin_text("essay") + "\n\n"
        ids = [lm.tokenizer.encode(prefix + t) for t in builtin_prompts()]
        df = diverge.rollback_comparison(lm, ids, ROLLBACK_N, k=ROLLBACK_K)
        out = {}
        for rollback, g in df.groupby("rollback"):
            div = g[g["first_divergence"].notna()]
            out[rollback] = {"diverged": float(len(div)), "outside": float((g["verdict"] == "OUTSIDE ENVELOPE").sum()),
                             "near_ties": float((div["verdict"] == "NEAR-TIE").sum())}
        return out

    setup_cache.timeout = 14400

    def setup(self, f, *params):
        common.skip_unless_long(f, "ExactRollbackDivergence")

    def track_outside_envelope(self, f, rollback):
        """Prompts whose speculative stream is judged a state bug (OUTSIDE ENVELOPE); 0 expected with the
        exact rollback."""
        return f.get(rollback, {}).get("outside", float("nan"))

    track_outside_envelope.unit = "prompts"
    track_outside_envelope.version = "1"
    track_outside_envelope.direction = "lower"

    def track_near_ties(self, f, rollback):
        """Prompts whose first divergence is a near-tie (numeric) and whose stream is otherwise sound."""
        return f.get(rollback, {}).get("near_ties", float("nan"))

    track_near_ties.unit = "prompts"
    track_near_ties.version = "1"
    track_near_ties.direction = "lower"

    def track_diverged(self, f, rollback):
        """Prompts whose speculative stream parts from plain greedy decoding within the tokens generated."""
        return f.get(rollback, {}).get("diverged", float("nan"))

    track_diverged.unit = "prompts"
    track_diverged.version = "1"
    track_diverged.direction = "lower"
