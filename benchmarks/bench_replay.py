"""What a replayed projection costs: each replay recipe on one projection shape of the embedded Gemma (layer 0
mlp.gate_proj, K=640, N=2048; seeded bf16 operands, 4-bit group-64 weights for the quantized recipes), and
its cost as a multiple of a numpy float32 matmul of the same shape, both timed interleaved in one run, the
fastest of each compared (gemmdrift.replay.check.speed_ratio; the replay runs on the compiled engine,
the default). A quantized recipe's tracked figure is the cached call (the weight's prepared tiles kept from
the call before, as for every call of a fixed weight in a model run after its first); speed_ratio also
returns the first call's (``first_ratio``). The issue's target is at most 10x; see docs/replay.md.
"""

from . import common

REPLAY_KERNELS = ("cpu_simd_gemm", "gemv", "gemv_wide", "steel_gemm", "steel_gemm_splitk", "cuda_gemv",
                  "cpu_qmm", "qmv_fast", "qmv_wide", "qmm_t")
REPLAY_TS = (1, 8, 33)
REPLAY_K, REPLAY_N = 640, 2048


class ReplayCost:
    """One replayed projection per case; the ratio to numpy's float32 matmul is tracked."""

    params = (list(REPLAY_KERNELS), list(REPLAY_TS))
    param_names = ["kernel", "T"]
    timeout = 600
    rounds = 1
    repeat = (2, 5, 2.0)
    warmup_time = 0.0

    def setup(self, kernel, t):
        common.skip_unless_full(None, "ReplayCost")
        from gemmdrift.replay.check import speed_ratio

        self._ratio = speed_ratio
        # One interleaved measurement per case (fastest of 5 pairs): the ratio is only meaningful within one run.
        self.figures = speed_ratio(kernel, t, REPLAY_K, REPLAY_N, reps=5)

    def time_replay(self, kernel, t):
        self._ratio(kernel, t, REPLAY_K, REPLAY_N, reps=1)

    # The hash asv gave this series from its source before the modules moved into wing folders (their
    # import lines changed, the measurement did not): pinned, so its history continues.
    time_replay.version = "f9e6b0162a949011441e9390fa52b3c60757456750fd06926ffda479ca9f4694"

    def track_ratio_to_numpy_matmul(self, kernel, t):
        """Seconds of the replay / seconds of numpy's float32 matmul of the same shape, same run."""
        return self.figures["ratio"]

    track_ratio_to_numpy_matmul.unit = "x numpy matmul"
    track_ratio_to_numpy_matmul.version = "1"
    track_ratio_to_numpy_matmul.direction = "lower"
