"""Accumulation-order fingerprints per kernel path, tracked across mlx releases.

Per path: the number of distinct summation trees over the T sweep (every row
position of every T-row block), and tree identifiers: the first 48 bits of
the fingerprint (sha256 of the canonical tree) as an integer, exact in
float64. Two releases with the same identifier sum in the same order; a
different identifier is a changed order (the identifier's size means
nothing, so read it with `gemmdrift history`, not as a drift that grows).
Inputs are pinned here; the measurement is gemmdrift.fingerprint.measure.
"""

FP_PATHS = ("matmul:bfloat16", "matmul:float16", "matmul:float32", "quant:affine-q4-g64:bfloat16",
            "sum:float32", "sdpa:bfloat16", "emulated:splitk4:bfloat16")
FP_K = 512
FP_TS = (1, 2, 3, 4, 8, 16, 33)
FP_N = 64


class Fingerprint:
    """Summation trees of one output element, K=512, the probed row at every position of T rows."""

    params = (list(FP_PATHS),)
    param_names = ["path"]
    timeout = 7200

    def setup_cache(self):
        from gemmdrift import fingerprint

        r = fingerprint.measure(list(FP_PATHS), K=FP_K, ts=FP_TS, N=FP_N, draw_k=0)
        return dict(r.figures)

    setup_cache.timeout = 7200

    @staticmethod
    def _get(figures, name):
        return figures.get(name, float("nan"))  # not measured (e.g. not recovered): asv records it skipped

    def track_distinct_trees(self, figures, path):
        """Distinct summation trees over the T sweep and every row position (1 = row-invariant)."""
        return self._get(figures, f"{path}.distinct_trees")

    track_distinct_trees.unit = "trees"
    track_distinct_trees.version = "1"

    def track_tree_id_t1(self, figures, path):
        """The T=1 (decode) tree: first 48 bits of its fingerprint, as an integer."""
        return self._get(figures, f"{path}.tree_id_t1")

    track_tree_id_t1.unit = "tree id"
    track_tree_id_t1.version = "1"

    def track_tree_id_tmax(self, figures, path):
        """The tree at the largest T (33), row position 0."""
        return self._get(figures, f"{path}.tree_id_tmax")

    track_tree_id_tmax.unit = "tree id"
    track_tree_id_tmax.version = "1"

    def track_unrecovered(self, figures, path):
        """Row positions whose tree could not be recovered (0 expected)."""
        return self._get(figures, f"{path}.unrecovered")

    track_unrecovered.unit = "rows"
    track_unrecovered.version = "1"
