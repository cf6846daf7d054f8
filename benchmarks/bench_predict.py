"""The predicted GPU drift (gemmdrift.replay.predict, the main job's replay part): decode vs verify:2 and verify:3 below
the window on the embedded Gemma, replayed for M1, M3 and the CUDA gemv with the recipes of the installed mlx.

A new mlx release whose kernels changed (a recipe, a dispatch limit) moves these series in `gemmdrift
history`, per chip; ``stat`` is the default variant or the max over the chip's variants (the envelope's upper
edge). CUDA has only its gemv decode against this machine's decode (``decode-vs-cpu``): its verify runs
cuBLASLt, whose order is not knowable (NaN: skipped). Every value is a prediction, not a measurement on the chip.
"""

from . import common

# Pinned here (not read from gemmdrift.replay.predict.SIZES, which `gemmdrift run` may retune): a one-token prompt,
# positions 1..4 compared, every variant of the recipes each chip runs for those calls.
PREDICT_SIZES = dict(tokens=5, split=1, chips=("M1", "M3", "sm90"), variants="all")
CHIPS = ["M1", "M3", "sm90"]
SCHEDULES = ["verify:2", "verify:3", "decode-vs-cpu"]
STATS = ["default", "max"]


def _figure(f, metric, chip, schedule, stat):
    return common.figure(f, metric, chip, schedule, stat)  # NaN (skipped) where nothing was predicted


class PredictedDrift:
    """One predict_drift run (in this process: the replay proxies live here) serves every track_."""

    params = (CHIPS, SCHEDULES, STATS)
    param_names = ["chip", "schedule", "stat"]
    timeout = 3600

    def setup_cache(self):
        if not common.full_benchmarks():
            return common.skipped_full()
        from gemmdrift.replay.predict import PredictSizes, predict_drift

        return dict(predict_drift(common.model(), PredictSizes(**PREDICT_SIZES)).figures)

    setup_cache.timeout = 3600

    def setup(self, f, *params):
        common.skip_unless_full(f, "PredictedDrift")

    def track_max_dlogit(self, f, chip, schedule, stat):
        return _figure(f, "max_abs_dlogit", chip, schedule, stat)

    track_max_dlogit.unit = "logits"
    track_max_dlogit.version = "1"
    track_max_dlogit.direction = "lower"

    def track_max_dgap(self, f, chip, schedule, stat):
        return _figure(f, "max_abs_dgap", chip, schedule, stat)

    track_max_dgap.unit = "logits"
    track_max_dgap.version = "1"
    track_max_dgap.direction = "lower"

    def track_flips(self, f, chip, schedule, stat):
        return _figure(f, "flips", chip, schedule, stat)

    track_flips.unit = "argmax flips"
    track_flips.version = "1"
    track_flips.direction = "lower"

    def track_last_layer_rel_l2(self, f, chip, schedule, stat):
        """rel L2 of the last decoder layer's hidden states (accumulated drift)."""
        return _figure(f, "last_layer_rel_l2", chip, schedule, stat)

    track_last_layer_rel_l2.unit = "relative L2"
    track_last_layer_rel_l2.version = "1"
    track_last_layer_rel_l2.direction = "lower"
