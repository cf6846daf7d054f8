"""This release against the shipped golden logits (gemmdrift.golden, issue 23): distribution-level drift.

The shipped bases (src/gemmdrift/data/golden/linux-cpu) were computed on the Linux CPU backend with mlx 0.32.4
in bfloat16. Each run teacher-forces the same tokens under the same schedule and compares with
gemmdrift.golden.compare_golden: KLD(base ‖ this release) mean and 99.9th percentile, and the share of
positions whose top-1 token agrees. On the release and backend that made the base, KLD is exactly 0 and the
share 1; a kernel or cache change of a later mlx or mlx-lm moves them, and `gemmdrift history` shows it.
"""

# Pinned inputs (never change them, only append): the first GOLDEN_TOKENS tokens of each shipped base, which
# cross the embedded Gemma's 512-token sliding window, so the RotatingKVCache's paths are compared as well.
GOLDEN_SET = "linux-cpu"
GOLDEN_BASES = ("decode", "verify-2")
GOLDEN_TOKENS = 576


class GoldenLogits:
    """The embedded Gemma (bfloat16) against the shipped linux-cpu bases."""

    params = [list(GOLDEN_BASES)]
    param_names = ["base"]
    timeout = 7200

    def setup_cache(self):
        from gemmdrift import suite

        from . import common

        # Each base's teacher-forced run computes on one core: the two side by side, a process each
        # (gemmdrift.suite.side_by_side; each computes what it computes alone).
        parts = {b: (suite.golden_part, dict(name=f"{GOLDEN_SET}/{b}", n_tokens=GOLDEN_TOKENS)) for b in GOLDEN_BASES}
        results = suite.side_by_side(common.model(), parts)
        return {b: dict(results[b].figures) for b in GOLDEN_BASES}

    def track_kld_mean(self, figures, base):
        """Mean KLD(shipped base ‖ this release) per position (a lower bound: the base keeps its top-64)."""
        return float(figures[base].get("kld_mean", float("nan")))

    track_kld_mean.unit = "nats"
    track_kld_mean.version = "1"

    def track_kld_p999(self, figures, base):
        """The 99.9th percentile of the per-position KLD(shipped base ‖ this release)."""
        return float(figures[base].get("kld_p99.9", float("nan")))

    track_kld_p999.unit = "nats"
    track_kld_p999.version = "1"

    def track_same_top1(self, figures, base):
        """The share of positions whose top-1 token is the shipped base's."""
        return float(figures[base].get("same_top1_share", float("nan")))

    track_same_top1.unit = "share"
    track_same_top1.version = "1"
