"""This release against the shipped golden logits (gemmdrift.measure.golden, issue 23): distribution-level drift.

The shipped bases (src/gemmdrift/data/golden/linux-cpu) were computed on the Linux CPU backend with mlx 0.32.4
in bfloat16. Each run teacher-forces the same tokens under the same schedule and compares with
gemmdrift.measure.golden.compare_golden: KLD(base ‖ this release) mean and 99.9th percentile, and the share of
positions whose top-1 token agrees. On the release and backend that made the base, KLD is exactly 0 and the
share 1; a kernel or cache change of a later mlx or mlx-lm moves them, and `gemmdrift history` shows it.
"""

from . import common
from .common import GOLDEN_BASES, GOLDEN_SET, GOLDEN_TOKENS  # noqa: F401  (pinned in common, where Probes computes them)


class GoldenLogits(common.Probes):
    """The embedded Gemma (bfloat16) against the shipped linux-cpu bases (computed by common.Probes, a part per
    base: ``golden:<base>``)."""

    params = [list(GOLDEN_BASES)]
    param_names = ["base"]

    def track_kld_mean(self, figures, base):
        """Mean KLD(shipped base ‖ this release) per position (a lower bound: the base keeps its top-64)."""
        return float(figures[f"golden:{base}"].get("kld_mean", float("nan")))

    track_kld_mean.unit = "nats"
    track_kld_mean.version = "1"
    track_kld_mean.direction = "lower"

    def track_kld_p999(self, figures, base):
        """The 99.9th percentile of the per-position KLD(shipped base ‖ this release)."""
        return float(figures[f"golden:{base}"].get("kld_p99.9", float("nan")))

    track_kld_p999.unit = "nats"
    track_kld_p999.version = "1"
    track_kld_p999.direction = "lower"

    def track_same_top1(self, figures, base):
        """The share of positions whose top-1 token is the shipped base's."""
        return float(figures[f"golden:{base}"].get("same_top1_share", float("nan")))

    track_same_top1.unit = "share"
    track_same_top1.version = "1"
    track_same_top1.direction = "higher"
