"""Shared inputs of the benchmarks, memoised per process.

Must not be changed -- only appended: a tracked figure is comparable across
mlx versions only while its inputs stay the same. Benchmarks hold no
measurement logic of their own; they call gemmdrift's library (the same
functions `gemmdrift run` and the notebooks call). Imports of gemmdrift
happen inside functions, so this suite imports with any version of it.
"""

from functools import lru_cache

# Kernel probe: real projection shapes of the embedded Gemma 3 270M.
KERNEL_LAYERS = (0, 5)  # a sliding-attention and a global-attention layer
KERNEL_TS = (1, 2, 3, 4, 8, 16, 33)  # dense around the small-T dispatch thresholds
KERNEL_PATHS = ("model", "quant:affine-q4-g64", "quant:affine-q8-g64", "emulated:splitk4")
KERNEL_ROWS = 16
# Speed: one real projection, mlp.gate_proj of layer 0 (K=640, N=2048).
SPEED_LAYER, SPEED_PROJECTION = 0, "mlp.gate_proj"
SPEED_TS = (1, 2, 4, 8, 16, 32, 64)
SPEED_PATHS = ("model", "dense:float32", "quant:affine-q4-g64", "quant:affine-q8-g64")
# Fingerprints (bench_fingerprint.Fingerprint) and the cache-state sweep (bench_state.StateExactness): pinned
# here, where Probes computes them; the two benchmark modules import them from here (no import back).
FP_PATHS = ("matmul:bfloat16", "matmul:float16", "matmul:float32", "quant:affine-q4-g64:bfloat16",
            "sum:float32", "sdpa:bfloat16", "emulated:splitk4:bfloat16")
FP_K = 512
FP_TS = (1, 2, 3, 4, 8, 16, 33)
FP_N = 64
# The default sweep of `gemmdrift state` on the embedded Gemma (None: the library's defaults, i.e.
# below/at/past/far and k = 1..4, with below/past and k = 2 for the QuantizedKVCache).
STATE_OPERATIONS = ("rollback", "trim", "trim_prompt_cache", "save_load", "server_reuse", "batch")
STATE_WHERE = None
STATE_KS = None
# The golden logits (bench_golden.GoldenLogits, computed by Probes): the first GOLDEN_TOKENS tokens of each
# shipped base, which cross the embedded Gemma's 512-token sliding window, so the RotatingKVCache's paths are
# compared as well.
GOLDEN_SET = "linux-cpu"
GOLDEN_BASES = ("decode", "verify-2")
GOLDEN_TOKENS = 576
# Which op (bench_attribute.Attribution, computed by Probes): the main job's pair, decode vs verify:2 past the
# sliding window at sizes(), with the counterfactual of every op class the model exposes (None).
ATTRIBUTE_PAIR = ("prefill:512,decode", "prefill:512,verify:2")
ATTRIBUTE_OPS = None


@lru_cache(maxsize=None)
def model(dtype="bfloat16"):
    from gemmdrift.model import load_model

    return load_model("embedded", dtype=dtype)


def sizes():
    """The main job's sizes for this backend (cpu, or gpu on Metal/CUDA), as pinned in BENCH_SIZES below."""
    from gemmdrift import suite

    return suite.Sizes(**BENCH_SIZES[suite.default_sizes()])


@lru_cache(maxsize=None)
def kernel_inputs():
    from gemmdrift import kernels, suite

    lm = model()
    projs = kernels.projections(lm, layers=list(KERNEL_LAYERS) + [lm.n_layers])
    return projs, kernels.capture_inputs(lm, suite.stream(lm, 128), projs, max_rows=KERNEL_ROWS)



def figure(figures, *parts):
    """One tracked figure from the figures of a gemmdrift Result (what each setup_cache returns:
    ``dict(result.figures)``, plain floats, cheap for asv to unpickle in every track_ process), by the
    parts of its name, joined as gemmdrift.result.figure_name joins them. NaN when the measurement did
    not produce it: asv records NaN as skipped, never as 0.0."""
    name = "/".join(str(p) for p in parts)
    return float(figures.get(name, float("nan")))



# The sizes of the main-job measurements the benchmarks track, pinned here rather than read from
# gemmdrift.suite.SIZES: `gemmdrift run` may retune its sizes, the tracked figures must not move with
# it. The values are the ones the reference results (benchmarks/reference) were measured with.
BENCH_SIZES = {
    "cpu": dict(tokens=560, split=500, ladder=True, kernel_layers=(0, 5), kernel_ts=(1, 2, 3, 4, 8, 16, 33),
                kernel_paths=("model", "quant:affine-q4-g64", "emulated:splitk4"), kernel_rows=16,
                diverge_prompt=500, diverge_n=32),
    "gpu": dict(tokens=2600, split=2300, ladder=True, kernel_layers=tuple(range(18)),
                kernel_ts=(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 24, 32, 33, 64, 128, 512),
                kernel_paths=("model", "dense:float16", "dense:float32", "quant:affine-q4-g64",
                              "quant:affine-q8-g64", "emulated:splitk4"),
                kernel_rows=64, diverge_prompt=1000, diverge_n=128,
                # The GPU kernel probe's FLOP budget (the CPU's default 2e9 cut the LM head at T=4).
                flop_budget=1e12),
}


# Long benchmarks: the whole prompt set's speculative streams (ExactRollbackDivergence), the real
# server past the sliding window (Server) and the batch sweep (Batch) take minutes on Metal or CUDA
# but up to hours on the reference-BLAS CPU backend. They run on a GPU backend and, elsewhere, only when
# asked: GEMMDRIFT_BENCH_LONG=1 runs them everywhere, GEMMDRIFT_BENCH_LONG=0 nowhere. Skipped ones are
# recorded by asv as skipped (setup raises NotImplementedError), never as a value.
def long_benchmarks() -> bool:
    import os

    flag = os.environ.get("GEMMDRIFT_BENCH_LONG")
    if flag in ("0", "1"):
        return flag == "1"
    from gemmdrift import suite

    return suite.default_sizes() == "gpu"


def skipped_long():
    """What a long benchmark's setup_cache returns when it does not run: a marker, not None (asv passes
    a None cache to nobody, so setup could not see it)."""
    return {"skipped_long": 1.0}


def skip_unless_long(cache, name):
    """For a long benchmark's setup: skip it (asv records it as skipped) when its setup_cache did not run."""
    if cache.get("skipped_long"):
        raise NotImplementedError(f"{name} is a long benchmark: skipped on this backend "
                                  "(GEMMDRIFT_BENCH_LONG=1 runs it)")


# The main job's figures (everything but the tracking tier, bench_tier, and the environment record, bench_env) are
# opt-in (issue 47): `asv run` runs the tier by default, at sizes chosen so that every release of the history runs
# in minutes. GEMMDRIFT_BENCH_FULL=1 runs them too (their names, versions and meaning unchanged). A skipped one is
# recorded by asv as skipped (setup raises NotImplementedError), never as a value. The long benchmarks above are
# opt-in on the CPU on their own flag (GEMMDRIFT_BENCH_LONG).
def full_benchmarks() -> bool:
    import os

    return os.environ.get("GEMMDRIFT_BENCH_FULL") == "1"


def skipped_full():
    """What an opt-in benchmark's setup_cache returns when it does not run (a marker, as skipped_long)."""
    return {"skipped_full": 1.0}


def skip_unless_full(cache=None, name="this benchmark"):
    """For an opt-in benchmark's setup: skip it (asv records it as skipped) unless GEMMDRIFT_BENCH_FULL=1."""
    if (isinstance(cache, dict) and cache.get("skipped_full")) or not full_benchmarks():
        raise NotImplementedError(f"{name} is a main-job figure: opt-in (GEMMDRIFT_BENCH_FULL=1 runs it); "
                                  "the tracking tier (bench_tier) runs by default")


class Probes:
    """One setup_cache for the measurements of the decode/verify stack (bench_stack.DecodeVsVerify*), the
    cache-state sweep (bench_state.StateExactness), the divergence probe (bench_diverge.Divergence), the
    prefill chunks (bench_stack.PrefillChunks*), the kernel probe (bench_kernels.KernelDrift), the
    fingerprints (bench_fingerprint.Fingerprint), the ops probe (bench_kernels.OpsDrift) and the golden
    logits, one part per shipped base (bench_golden.GoldenLogits) and the attribution of the main job's pair to
    op classes (bench_attribute.Attribution): they inherit it, and asv runs a setup_cache once per source location.

    The ten run whole, side by side, each in a process of its own, two at a time on a multi-core CPU
    (gemmdrift.suite.side_by_side), longest first. One at a time, each left a core idle for part of its
    run (the divergence probe's prompt prefill and speculative stream, the ops probe, every measurement's
    model loads); together the two cores stay busy. The golden bases joined them (issue 33): in a setup of
    their own the shorter base's core idled while the decode base ran on; so did the attribution's, one process
    for its 21 runs. Each part computes what it computes alone, with the same pinned inputs (tests compare).
    Returns ``{part: figures}``.

    The cost: `asv run --bench` with any one of these benchmarks computes all ten (about 12 minutes on a
    2-core CPU). GEMMDRIFT_BENCH_PARTS=diverge,kernels (a comma-separated subset of PROBE_PARTS) computes
    only those; the others' benchmarks are then skipped (NaN), never 0.
    """

    timeout = 7200

    def setup_cache(self):
        if not full_benchmarks():
            return skipped_full()
        import os
        from dataclasses import replace

        from gemmdrift import kernels, state, suite

        s = sizes()
        # The kernel probe on kernel_inputs() (128 tokens, KERNEL_* above), as suite.kernel_probe runs it.
        probe = replace(s, tokens=128, kernel_layers=KERNEL_LAYERS, kernel_ts=KERNEL_TS, kernel_paths=KERNEL_PATHS,
                        kernel_rows=KERNEL_ROWS)
        parts = {
            "decode": (suite.decode_family, dict(sizes=s)),
            "state": (state.measure_state, dict(operations=STATE_OPERATIONS, where=STATE_WHERE, ks=STATE_KS)),
            "diverge": (suite.divergence_probe, dict(sizes=s)),
            "prefill": (suite.prefill_family, dict(sizes=s)),
            "kernels": (suite.kernel_probe, dict(sizes=probe)),
            "fingerprint": (suite.fingerprint_part, dict(paths=list(FP_PATHS), K=FP_K, ts=FP_TS, N=FP_N,
                                                         draw_k=0)),
            "ops": (kernels.measure_ops, {}),
            "attribute": (suite.attribute_stream, dict(n_tokens=s.tokens, schedules=list(ATTRIBUTE_PAIR),
                                                       split=s.split, ops=ATTRIBUTE_OPS)),
        }
        golden = {f"golden:{b}": (suite.golden_part, dict(name=f"{GOLDEN_SET}/{b}", n_tokens=GOLDEN_TOKENS))
                  for b in GOLDEN_BASES}
        parts = {p: {**parts, **golden}[p] for p in PROBE_PARTS}  # the start order: longest first
        only = [p.strip() for p in os.environ.get("GEMMDRIFT_BENCH_PARTS", "").split(",") if p.strip()]
        unknown = [p for p in only if p not in parts]
        if unknown:
            raise ValueError(f"GEMMDRIFT_BENCH_PARTS: unknown part {unknown[0]!r} (choose from {', '.join(parts)})")
        results = suite.side_by_side(model(), {k: v for k, v in parts.items() if not only or k in only})
        return {name: dict(results[name].figures) if name in results else {} for name in parts}

    setup_cache.timeout = 7200

    def setup(self, cache, *params):
        skip_unless_full(cache, type(self).__name__)


# The parts of Probes, longest first (the order they start in; the attribution, 21 tapped runs of the main job's
# pair, is the longest on the CPU, then the golden decode base, 576 teacher-forced T=1 steps).
PROBE_PARTS = ("attribute", "golden:decode", "decode", "state", "diverge", "golden:verify-2", "prefill", "kernels",
               "fingerprint", "ops")


def on_gpu() -> bool:
    """True when the benchmarks run on Metal or CUDA (the 'gpu' sizes): GPU timings warm up before they time."""
    from gemmdrift import suite

    return suite.default_sizes() == "gpu"
