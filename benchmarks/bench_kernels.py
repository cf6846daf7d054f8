"""GEMV (T=1) against GEMM (T>1) on real projections of the embedded Gemma, and their speed.

The drift figures on the Linux CPU backend are exactly 0 for every real path:
its matmuls are row-invariant. They are tracked as bits lost (log2(1 + max
ULP)), which asv can compare when the value is 0. The emulated split-K path is
the negative control: its figure must stay above 0 on every backend.
"""

from . import common


class _Probe:
    timeout = 7200

    def setup_cache(self):
        from gemmdrift import kernels, metrics

        projs, inputs = common.kernel_inputs()
        df = kernels.sweep(common.model(), inputs, projs, common.KERNEL_PATHS, common.KERNEL_TS)
        out = {}
        for (path, t), s in df.groupby(["path", "T"]):
            m = {k: g["value"] for k, g in s.groupby("metric")}
            out[(path, int(t))] = {
                "bits": metrics.bits_lost(float(m["max_ulp"].max())),
                "rows_differ": float(m["rows_differ"].sum()),
                "err_rel_l2": float(m["err_rel_l2"].max()),
            }
        return out

    setup_cache.timeout = 7200


class KernelDrift(_Probe):
    """Worst over the probed projections (layers 0 and 5, and the LM head) at each T."""

    params = (list(common.KERNEL_PATHS), list(common.KERNEL_TS))
    param_names = ["path", "T"]

    def track_bits_lost(self, f, path, t):
        """log2(1 + max ULP distance) between a row inside a T-row block and the same row alone."""
        return f[(path, t)]["bits"]

    track_bits_lost.unit = "bits"
    track_bits_lost.version = "1"

    def track_rows_differ(self, f, path, t):
        return f[(path, t)]["rows_differ"]

    track_rows_differ.unit = "rows"
    track_rows_differ.version = "1"

    def track_err_rel_l2(self, f, path, t):
        """Error against a float64 reference from the same stored operands."""
        return f[(path, t)]["err_rel_l2"]

    track_err_rel_l2.unit = "relative L2"
    track_err_rel_l2.version = "1"


class KernelSpeed:
    """What each path costs on one real projection (layer 0 mlp.gate_proj, K=640, N=2048)."""

    params = (list(common.SPEED_PATHS), list(common.SPEED_TS))
    param_names = ["path", "T"]
    timeout = 600
    # At most ~2 s per case on the reference-BLAS CPU: enough samples for a median.
    repeat = (3, 10, 2.0)
    warmup_time = 0.1

    def setup(self, path, t):
        from gemmdrift import kernels

        lm = common.model()
        proj = kernels.projections(lm, layers=[common.SPEED_LAYER], names=[common.SPEED_PROJECTION])[0]
        projs, inputs = common.kernel_inputs()
        rows = inputs.get(proj.key)
        self.body = kernels.time_projection(lm, proj, path, t, rows=rows)

    def time_projection(self, path, t):
        self.body()


class OpsDrift:
    """The other ops whose shape changes between decode and verification, at the model's geometry:
    a block of T queries against each query alone (attention, RMSNorm, RoPE at offsets, softmax)."""

    timeout = 1800
    params = (["sdpa", "rms_norm", "rope", "softmax"],)
    param_names = ["op"]

    def setup_cache(self):
        from gemmdrift import kernels, metrics

        df = kernels.ops_sweep(common.model())
        d = df[df["metric"] == "max_ulp"]
        return {op: metrics.bits_lost(float(s["value"].max())) for op, s in d.groupby("projection")}

    setup_cache.timeout = 1800

    def track_bits_lost(self, f, op):
        """log2(1 + max ULP distance) over query lengths 1..16 and key lengths around the kernel switches."""
        return f[op]

    track_bits_lost.unit = "bits"
    track_bits_lost.version = "1"
