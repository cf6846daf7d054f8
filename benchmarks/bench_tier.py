"""The tracking tier (issue 47): what `asv run` runs by default, every effect the history tracks, in minutes.

One setup_cache (``_Tier``) runs the tier's parts side by side (gemmdrift.history.tier.measure_tier: each whole, in a
process of its own) and returns each part's figures; each track_ looks one up by name (NaN when it was not measured:
asv records it as skipped, never 0). The sizes are the tier's (gemmdrift.history.tier.TIER), not the main job's: the
main job's figures (the other bench_ modules) keep their names and run with GEMMDRIFT_BENCH_FULL=1.
GEMMDRIFT_TIER_PARTS=decode,prefill computes a subset (parts: gemmdrift.history.tier.PARTS; the others are skipped).
"""

from . import common

DECODE_PAIR = "prefill:512,decode vs prefill:512,verify:2"
PREFILL_PAIR = "prefill:2048 vs prefill:128"
DECODE_TAPS = ["layer 0", "layer 5", "layer 17", "logits"]
KERNEL_PATHS = ("model", "quant:affine-q4-g64", "emulated:splitk4")
KERNEL_TS = (1, 2, 3, 4, 8, 16)
FP_PATHS = ("matmul:bfloat16", "matmul:float16", "matmul:float32", "quant:affine-q4-g64:bfloat16", "sum:float32",
            "sdpa:bfloat16", "emulated:splitk4:bfloat16")
OPS = ("sdpa", "rms_norm", "rope", "softmax")
# The tier's cache-state cases (past the window, k = 2): the classes and operations of bench_state.STATE_CASES.
STATE_CASES = (
    [f"{c}/{op}" for op in ("rollback", "save_load", "server_reuse")
     for c in ("KVCache", "RotatingKVCache", "QuantizedKVCache")]
    + [f"{c}/{op}" for op in ("trim", "trim_prompt_cache")
       for c in ("KVCache", "RotatingKVCache", "RotatingKVCache(keep=4)", "QuantizedKVCache", "ConcatenateKVCache",
                 "ChunkedKVCache", "CacheList", "BatchKVCache", "BatchRotatingKVCache")]
    + ["BatchKVCache/batch", "BatchRotatingKVCache/batch"]
)


def _get(f, part, *name):
    return common.figure(f.get(part, {}), *name)


class _Tier:
    """gemmdrift.history.tier.measure_tier: the tier's parts side by side; every tier benchmark inherits this setup."""

    timeout = 3600

    def setup_cache(self):
        import os

        from gemmdrift.history import tier

        only = [p.strip() for p in os.environ.get("GEMMDRIFT_TIER_PARTS", "").split(",") if p.strip()]
        return tier.measure_tier(common.model(), only=only)

    setup_cache.timeout = 3600


class TierDecodeVsVerify(_Tier):
    """Decode vs verify:2 after a 504-token prompt: the logits at 508..516 around the 512-token window's edge."""

    def track_identical_through(self, f):
        """The last position through which the logits are bit-identical (512 on the Linux CPU)."""
        return _get(f, "decode", "identical_through")

    track_identical_through.unit = "position"
    track_identical_through.version = "1"
    track_identical_through.direction = "higher"

    def track_first_drift(self, f):
        """The first position whose logits differ (513 on the Linux CPU; NaN: none of 508..516 does)."""
        return _get(f, "decode", "first_drift")

    track_first_drift.unit = "position"
    track_first_drift.version = "1"
    track_first_drift.direction = "higher"

    def track_max_abs_dlogit_upto_edge(self, f):
        return _get(f, "decode", "max_abs_dlogit_upto_edge")

    track_max_abs_dlogit_upto_edge.unit = "logits"
    track_max_abs_dlogit_upto_edge.version = "1"
    track_max_abs_dlogit_upto_edge.direction = "lower"

    def track_max_abs_dlogit_past_edge(self, f):
        return _get(f, "decode", "max_abs_dlogit_past_edge")

    track_max_abs_dlogit_past_edge.unit = "logits"
    track_max_abs_dlogit_past_edge.version = "1"
    track_max_abs_dlogit_past_edge.direction = "lower"

    def track_flips(self, f):
        """Argmax flips at positions 508..516."""
        return _get(f, "decode", "flips", DECODE_PAIR)

    track_flips.unit = "argmax flips"
    track_flips.version = "1"
    track_flips.direction = "lower"

    def track_ladder_verdict(self, f):
        """The precision ladder's verdict on the pair: 0 identical, 1 rounding, 2 unclear, 3 semantic, 4 unreliable."""
        return _get(f, "decode", "ladder_verdict")

    track_ladder_verdict.unit = "0=identical 1=rounding 2=unclear 3=semantic 4=unreliable"
    track_ladder_verdict.version = "1"
    track_ladder_verdict.direction = "either"


class TierDecodeLayers(_Tier):
    """Accumulated drift of the pair at a few layers (positions 504..519) and at float32 (the ladder's rung)."""

    params = (DECODE_TAPS,)
    param_names = ["tap"]

    def track_rel_l2(self, f, tap):
        return _get(f, "decode", "rel_l2", DECODE_PAIR, "accumulated", tap)

    track_rel_l2.unit = "relative L2"
    track_rel_l2.version = "1"
    track_rel_l2.direction = "lower"

    def track_rel_l2_float32(self, f, tap):
        return _get(f, "decode", "ladder_rel_l2_float32", DECODE_PAIR, tap)

    track_rel_l2_float32.unit = "relative L2"
    track_rel_l2_float32.version = "1"
    track_rel_l2_float32.direction = "lower"


class TierPrefillChunks(_Tier):
    """The first 300 tokens in one chunk vs chunks of 128: logits at 248..279, around position 256 (RoPE in bf16)."""

    def track_flips_upto_256(self, f):
        return _get(f, "prefill", "flips_upto_edge")

    track_flips_upto_256.unit = "argmax flips"
    track_flips_upto_256.version = "1"
    track_flips_upto_256.direction = "lower"

    def track_flips_past_256(self, f):
        """Argmax flips at positions 257..279 (mlx 0.29.x: RoPE positions rounded in bf16; 0 from 0.30.0)."""
        return _get(f, "prefill", "flips_past_edge")

    track_flips_past_256.unit = "argmax flips"
    track_flips_past_256.version = "1"
    track_flips_past_256.direction = "lower"

    def track_max_abs_dlogit_upto_256(self, f):
        return _get(f, "prefill", "max_abs_dlogit_upto_edge")

    track_max_abs_dlogit_upto_256.unit = "logits"
    track_max_abs_dlogit_upto_256.version = "1"
    track_max_abs_dlogit_upto_256.direction = "lower"

    def track_max_abs_dlogit_past_256(self, f):
        return _get(f, "prefill", "max_abs_dlogit_past_edge")

    track_max_abs_dlogit_past_256.unit = "logits"
    track_max_abs_dlogit_past_256.version = "1"
    track_max_abs_dlogit_past_256.direction = "lower"

    def track_first_drift(self, f):
        """The first of positions 248..279 whose logits differ (NaN: none does)."""
        return _get(f, "prefill", "first_drift")

    track_first_drift.unit = "position"
    track_first_drift.version = "1"
    track_first_drift.direction = "higher"


class TierState(_Tier):
    """The cache-state sweep past the window with k = 2 (every operation, every cache class of this mlx-lm)."""

    def track_state_bugs(self, f):
        return _get(f, "state", "state_bugs")

    track_state_bugs.unit = "cases"
    track_state_bugs.version = "1"
    track_state_bugs.direction = "lower"

    def track_cannot_run(self, f):
        """Cases this mlx-lm cannot run (an operation or cache class it lacks: not applicable) or not checked."""
        return _get(f, "state", "cannot_run")

    track_cannot_run.unit = "cases"
    track_cannot_run.version = "1"
    track_cannot_run.direction = "lower"

    def track_cases(self, f):
        return _get(f, "state", "cases")

    track_cases.unit = "cases"
    track_cases.version = "1"
    track_cases.direction = "either"


class TierStateCases(_Tier):
    """Per cache class and operation: the cases not bit-identical to a cache that never did it (NaN: cannot run)."""

    params = [STATE_CASES]
    param_names = ["case"]

    def track_non_exact(self, f, case):
        cache, op = case.rsplit("/", 1)
        return float(f.get("state", {}).get(f"non_exact.{cache}.{op}", float("nan")))

    track_non_exact.unit = "cases"
    track_non_exact.version = "1"
    track_non_exact.direction = "lower"


class TierDivergence(_Tier):
    """mlx-lm plain vs speculative (self-draft, K=2) greedy generation from a 500-token prompt, 26 tokens."""

    def track_first_divergence(self, f):
        """Generated tokens before the streams part (26 when they never do; see track_diverged)."""
        return _get(f, "diverge", "first_divergence")

    track_first_divergence.unit = "tokens"
    track_first_divergence.version = "1"
    track_first_divergence.direction = "higher"

    def track_diverged(self, f):
        return _get(f, "diverge", "diverged")

    track_diverged.unit = "divergences"
    track_diverged.version = "1"
    track_diverged.direction = "lower"

    def track_first_near_tie(self, f):
        """1 when the first divergence alone is a NEAR-TIE (numeric), 0 when outside the envelope (NaN: none)."""
        return _get(f, "diverge", "first_near_tie")

    track_first_near_tie.unit = "0/1"
    track_first_near_tie.version = "1"
    track_first_near_tie.direction = "higher"

    def track_outside_envelope(self, f):
        """1 when the triage's verdict on the streams is OUTSIDE ENVELOPE (a stream not what its schedule computes)."""
        return _get(f, "diverge", "outside_envelope")

    track_outside_envelope.unit = "0/1"
    track_outside_envelope.version = "1"
    track_outside_envelope.direction = "lower"

    def track_stream_first_outside(self, f):
        """The generated token from which the speculative stream is outside its own schedule's envelope (NaN: never)."""
        return _get(f, "diverge", "stream_first_outside")

    track_stream_first_outside.unit = "tokens"
    track_stream_first_outside.version = "1"
    track_stream_first_outside.direction = "higher"

    def track_self_draft_acceptance(self, f):
        return _get(f, "diverge", "self_draft_acceptance")

    track_self_draft_acceptance.unit = "fraction"
    track_self_draft_acceptance.version = "1"
    track_self_draft_acceptance.direction = "higher"


class TierKernelDrift(_Tier):
    """GEMV vs GEMM rows, worst over every projection of layers 0 and 5, at each T."""

    params = (list(KERNEL_PATHS), list(KERNEL_TS))
    param_names = ["path", "T"]

    def track_bits_lost(self, f, path, t):
        return _get(f, "kernels", "bits_lost", path, t)

    track_bits_lost.unit = "bits"
    track_bits_lost.version = "1"
    track_bits_lost.direction = "lower"


class TierFingerprint(_Tier):
    """Summation trees (K=512, T = 1..33), as bench_fingerprint.Fingerprint measures them."""

    params = (list(FP_PATHS),)
    param_names = ["path"]

    def track_distinct_trees(self, f, path):
        return float(f.get("fingerprint", {}).get(f"{path}.distinct_trees", float("nan")))

    track_distinct_trees.unit = "trees"
    track_distinct_trees.version = "1"
    track_distinct_trees.direction = "either"

    def track_tree_id_t1(self, f, path):
        return float(f.get("fingerprint", {}).get(f"{path}.tree_id_t1", float("nan")))

    track_tree_id_t1.unit = "tree id"
    track_tree_id_t1.version = "1"
    track_tree_id_t1.direction = "either"

    def track_tree_id_tmax(self, f, path):
        return float(f.get("fingerprint", {}).get(f"{path}.tree_id_tmax", float("nan")))

    track_tree_id_tmax.unit = "tree id"
    track_tree_id_tmax.version = "1"
    track_tree_id_tmax.direction = "either"


class TierOps(_Tier):
    """A block of T queries against each alone (attention, RMSNorm, RoPE at offsets, softmax)."""

    params = (list(OPS),)
    param_names = ["op"]

    def track_bits_lost(self, f, op):
        return _get(f, "ops", "ops_bits_lost", op)

    track_bits_lost.unit = "bits"
    track_bits_lost.version = "1"
    track_bits_lost.direction = "lower"


class TierGolden(_Tier):
    """The first 272 tokens of the shipped linux-cpu verify-2 base (mlx 0.32.4), rerun: KLD(base ‖ this release)."""

    def track_kld_mean(self, f):
        return _get(f, "golden", "kld_mean")

    track_kld_mean.unit = "nats"
    track_kld_mean.version = "1"
    track_kld_mean.direction = "lower"

    def track_kld_p999(self, f):
        return _get(f, "golden", "kld_p99.9")

    track_kld_p999.unit = "nats"
    track_kld_p999.version = "1"
    track_kld_p999.direction = "lower"

    def track_same_top1(self, f):
        return _get(f, "golden", "same_top1_share")

    track_same_top1.unit = "share"
    track_same_top1.version = "1"
    track_same_top1.direction = "higher"
