"""Accumulation-order fingerprints per kernel path, tracked across mlx releases.

Per path: the number of distinct summation trees over the T sweep (every row
position of every T-row block), and tree identifiers: the first 48 bits of
the fingerprint (sha256 of the canonical tree) as an integer, exact in
float64. Two releases with the same identifier sum in the same order; a
different identifier is a changed order (the identifier's size means
nothing, so read it with `gemmdrift history`, not as a drift that grows).
Inputs are pinned in common (FP_*, where the shared Probes setup computes them); the measurement is gemmdrift.fingerprint.measure.
"""

from . import common
from .common import FP_K, FP_N, FP_PATHS, FP_TS  # noqa: F401  (pinned in common, where Probes computes them)


class Fingerprint(common.Probes):
    """Summation trees of one output element, K=512, the probed row at every position of T rows.
    The setup (gemmdrift.fingerprint.measure with the inputs above) is shared with four other probes
    (common.Probes)."""

    params = (list(FP_PATHS),)
    param_names = ["path"]

    @staticmethod
    def _get(figures, name):
        # not measured (e.g. not recovered): NaN, which asv records as skipped
        return figures["fingerprint"].get(name, float("nan"))

    def track_distinct_trees(self, figures, path):
        """Distinct summation trees over the T sweep and every row position (1 = row-invariant)."""
        return self._get(figures, f"{path}.distinct_trees")

    track_distinct_trees.unit = "trees"
    track_distinct_trees.version = "1"
    track_distinct_trees.direction = "either"

    def track_tree_id_t1(self, figures, path):
        """The T=1 (decode) tree: first 48 bits of its fingerprint, as an integer."""
        return self._get(figures, f"{path}.tree_id_t1")

    track_tree_id_t1.unit = "tree id"
    track_tree_id_t1.version = "1"
    track_tree_id_t1.direction = "either"

    def track_tree_id_tmax(self, figures, path):
        """The tree at the largest T (33), row position 0."""
        return self._get(figures, f"{path}.tree_id_tmax")

    track_tree_id_tmax.unit = "tree id"
    track_tree_id_tmax.version = "1"
    track_tree_id_tmax.direction = "either"

    def track_unrecovered(self, figures, path):
        """Row positions whose tree could not be recovered (0 expected)."""
        return self._get(figures, f"{path}.unrecovered")

    track_unrecovered.unit = "rows"
    track_unrecovered.version = "1"
    track_unrecovered.direction = "lower"
