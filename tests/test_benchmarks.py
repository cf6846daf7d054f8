"""The asv benchmarks import, carry a unit and a pinned version, and return finite numbers.

They run here on the embedded Gemma with the main job's 'quick' sizes and a
smaller kernel probe (asv itself runs them at the 'cpu' or 'gpu' sizes).
"""

import inspect
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import (bench_attribute, bench_diverge, bench_env, bench_golden, bench_kernels, bench_overhead,  # noqa: E402
                        bench_predict, bench_replay, bench_stack, common)

MODULES = [bench_diverge, bench_env, bench_golden, bench_kernels, bench_overhead, bench_predict, bench_replay,
           bench_stack]


def tracked(module):
    """(class or None, name, function) of every track_ benchmark in a module."""
    out = []
    for name, obj in vars(module).items():
        if name.startswith("track_") and callable(obj):
            out.append((None, name, obj))
        elif inspect.isclass(obj) and not name.startswith("_") and obj.__module__ == module.__name__:
            out += [(obj, n, getattr(obj, n)) for n in dir(obj) if n.startswith("track_")]
    return out


def test_every_track_benchmark_has_a_unit_and_a_pinned_version():
    found = [t for m in MODULES for t in tracked(m)]
    assert len(found) >= 15
    for cls, name, fn in found:
        assert getattr(fn, "unit", None), f"{cls.__name__ if cls else ''}.{name}: no unit"
        assert getattr(fn, "version", None), f"{cls.__name__ if cls else ''}.{name}: no pinned version"


def finite(value):
    assert isinstance(value, float) and math.isfinite(value) and value >= 0, value
    return value


@pytest.fixture
def quick(monkeypatch, embedded):
    from gemmdrift import suite

    monkeypatch.setattr(common, "sizes", lambda: suite.SIZES["quick"])
    monkeypatch.setattr(common, "KERNEL_LAYERS", (0,))
    monkeypatch.setattr(common, "KERNEL_TS", (1, 2))
    monkeypatch.setattr(common, "KERNEL_PATHS", ("model", "emulated:splitk4"))
    monkeypatch.setattr(common, "KERNEL_ROWS", 4)
    common.kernel_inputs.cache_clear()
    yield
    common.kernel_inputs.cache_clear()


@pytest.mark.linux_cpu_reference
@pytest.mark.slow
def test_env_benchmarks():
    import mlx.core as mx

    from gemmdrift.measure.history import decode_version

    assert decode_version(finite(bench_env.track_mlx_version())) == ".".join(mx.__version__.split(".")[:3])
    assert finite(bench_env.track_backend()) == 0.0  # the CPU backend here


def _all_tracks(cls, cache):
    """Every track_ of a benchmark class at every parameter combination: {(name, combo): value}."""
    import itertools

    bench = cls()
    combos = list(itertools.product(*getattr(cls, "params", ())))
    return {(name, combo): fn(bench, cache, *combo)
            for _, name, fn in [t for t in tracked(sys.modules[cls.__module__]) if t[0] is cls] for combo in combos}


@pytest.fixture
def small_fingerprints(monkeypatch):
    from benchmarks import bench_fingerprint

    for m in (common, bench_fingerprint):  # common.Probes computes with common's; the test reads the benchmark's
        monkeypatch.setattr(m, "FP_PATHS", ("matmul:float32", "emulated:splitk4:float32"))
        monkeypatch.setattr(m, "FP_K", 32)
        monkeypatch.setattr(m, "FP_TS", (1, 2))
    return bench_fingerprint


@pytest.fixture
def small_state(monkeypatch):
    from benchmarks import bench_state

    for m in (common, bench_state):  # as small_fingerprints
        monkeypatch.setattr(m, "STATE_OPERATIONS", ("rollback", "trim_prompt_cache"))
        monkeypatch.setattr(m, "STATE_WHERE", ("below",))
        monkeypatch.setattr(m, "STATE_KS", (1,))
    return bench_state


@pytest.mark.linux_cpu_reference
@pytest.mark.slow
def test_the_shared_probe_setup_serves_every_probe_as_each_alone(quick, small_fingerprints, small_state, embedded,
                                                                  monkeypatch):
    """common.Probes computes the decode/verify stack, the state sweep, the divergence probe, the prefill
    chunks, the kernel probe, the fingerprints, the ops probe, the golden logits and the attribution side by side,
    each in a process of its own; every figure is the one the part gives when run alone, and every benchmark
    that inherits the setup reads its figures from it."""
    from concurrent.futures import ThreadPoolExecutor

    from gemmdrift import fingerprint, kernels, state, suite
    from gemmdrift.measure import golden

    classes = (bench_stack.DecodeVsVerify, bench_stack.DecodeVsVerifyLayers, small_state.StateExactness,
               bench_diverge.Divergence, bench_stack.PrefillChunks, bench_stack.PrefillChunksLayers,
               bench_kernels.KernelDrift, bench_kernels.OpsDrift, small_fingerprints.Fingerprint,
               bench_golden.GoldenLogits, bench_attribute.Attribution)
    assert len({cls.setup_cache for cls in classes}) == 1  # one source location: asv runs it once
    # Speed (issue 25, item 7): setup_cache runs its parts in worker processes (each loads the model
    # itself; the parent's copy only gives their recipe, so the session's copy serves) while this process
    # computes alone the parts whose setup call is not the benchmark's own library call, instead of one after
    # the other: the two halves share no state. The parts whose setup call *is* that library call (decode,
    # state, diverge, prefill, ops) are checked by the call the setup makes, recorded here: the same function
    # and inputs give the same figures in a process of their own (test_taps_stack's side_by_side test), and
    # computing each again here cost about 100 s of CPU (issue 33).
    monkeypatch.setattr(common, "model", lambda dtype="bfloat16": embedded)
    monkeypatch.setattr(common, "GOLDEN_TOKENS", 12)
    monkeypatch.setattr(common, "ATTRIBUTE_OPS", ("sdpa",))  # one counterfactual class keeps the test short
    calls = {}
    side_by_side = suite.side_by_side

    def recorded(lm, parts, **kw):
        assert lm is embedded
        calls.update(parts)
        return side_by_side(lm, parts, **kw)

    monkeypatch.setattr(suite, "side_by_side", recorded)
    with ThreadPoolExecutor(1) as side:
        probes = side.submit(common.Probes().setup_cache)
        sizes = common.sizes()
        # The cheap parts once more in this process (fingerprint, the golden bases at 12 tokens); that the kernel
        # probe and the attribution are their benchmarks' calls is the tiny-model test's after this one (computing
        # them here again on the embedded Gemma cost about 40 s of CPU, issue 33).
        alone_parts = {}
        alone_parts["fingerprint"] = dict(fingerprint.measure(
            list(small_fingerprints.FP_PATHS), K=small_fingerprints.FP_K, ts=small_fingerprints.FP_TS,
            N=small_fingerprints.FP_N, draw_k=0).figures)
        for b in common.GOLDEN_BASES:
            alone_parts[f"golden:{b}"] = dict(golden.compare_golden(embedded, f"linux-cpu/{b}", 12)[0].figures)
        cache = probes.result()
    # The benchmarks' own library calls, as bench_stack / bench_state / bench_diverge / bench_kernels document them.
    assert calls["decode"] == (suite.decode_family, dict(sizes=sizes))
    assert calls["state"] == (state.measure_state, dict(operations=small_state.STATE_OPERATIONS,
                                                        where=small_state.STATE_WHERE, ks=small_state.STATE_KS))
    assert calls["diverge"] == (suite.divergence_probe, dict(sizes=sizes))
    assert calls["prefill"] == (suite.prefill_family, dict(sizes=sizes))
    assert calls["ops"] == (kernels.measure_ops, {})
    assert calls["attribute"] == (suite.attribute_stream, dict(
        n_tokens=sizes.tokens, schedules=list(common.ATTRIBUTE_PAIR), split=sizes.split, ops=("sdpa",)))
    for b in common.GOLDEN_BASES:
        assert calls[f"golden:{b}"] == (suite.golden_part, dict(name=f"linux-cpu/{b}", n_tokens=12))
    assert list(calls) == list(common.PROBE_PARTS)
    assert tuple(cache) == common.PROBE_PARTS
    for cls in (bench_stack.PrefillChunks, bench_stack.PrefillChunksLayers, bench_diverge.Divergence,
                bench_kernels.OpsDrift):
        for value in _all_tracks(cls, cache).values():
            finite(value)
    for (name, combo), value in {**_all_tracks(bench_stack.DecodeVsVerify, cache),
                                 **_all_tracks(bench_stack.DecodeVsVerifyLayers, cache)}.items():
        if name == "track_logits_rel_l2_float32":
            # Regression (issue 12): without a ladder (quick sizes) this returned 0.0, a fake
            # "no drift at float32"; a figure that was not measured is NaN, which asv skips.
            assert math.isnan(value)
        else:
            finite(value)
    # Below the sliding window (quick sizes) decode and verification agree bit for bit on this backend.
    assert bench_stack.DecodeVsVerify().track_max_abs_dlogit(cache, "verify2") == 0.0
    st = small_state.StateExactness()
    assert st.track_non_exact(cache, "KVCache/rollback") == 0.0
    assert math.isnan(st.track_non_exact(cache, "QuantizedKVCache/save_load"))  # not measured: NaN, never 0
    kd = bench_kernels.KernelDrift()
    for path in common.KERNEL_PATHS:  # the smaller probe of the quick fixture
        for t in common.KERNEL_TS:
            for fn in (kd.track_bits_lost, kd.track_rows_differ, kd.track_err_rel_l2):
                finite(fn(cache, path, t))
    assert kd.track_bits_lost(cache, "model", 2) == 0.0  # row-invariant CPU kernels
    fp = small_fingerprints.Fingerprint()
    assert fp.track_distinct_trees(cache, "matmul:float32") == 1.0
    assert fp.track_unrecovered(cache, "matmul:float32") == 0.0
    assert math.isnan(fp.track_distinct_trees(cache, "sum:bfloat16"))
    div = bench_diverge.Divergence()  # never-diverged is told apart from diverged-at-n
    assert div.track_diverged(cache) in (0.0, 1.0)
    if div.track_diverged(cache) == 0.0:
        assert div.track_first_divergence(cache) == common.sizes().diverge_n
    # The same figures as each part alone, in this process (with the workers it would start itself).
    assert cache["state"]["seconds"] > 0  # the sweep's wall time
    assert cache["kernels"] and cache["attribute"]
    assert cache["fingerprint"] == alone_parts["fingerprint"]
    for b in common.GOLDEN_BASES:
        assert cache[f"golden:{b}"] == alone_parts[f"golden:{b}"] and cache[f"golden:{b}"]
    at = bench_attribute.Attribution()
    assert at.track_local_bits(cache, "sdpa") == 0.0  # below the window (quick sizes): bit-identical
    assert at.track_left_flips(cache, "sdpa") == 0.0
    assert math.isnan(at.track_left_flips(cache, "self_attn.q_proj"))  # not run: NaN, skipped
    assert at.track_local_bits(cache, "self_attn.q_proj") == 0.0  # local drift is measured for every class
    # The golden logits: this machine made the shipped bases; on their mlx and backend KLD is exactly 0 and the
    # top-1 all agree (a test of its own once; its setup computed the two bases a second time).
    import mlx.core as mx

    from gemmdrift.measure.golden import read_logits, resolve_golden

    gl = bench_golden.GoldenLogits()
    for b in bench_golden.GOLDEN_BASES:
        values = [finite(gl.track_kld_mean(cache, b)), finite(gl.track_kld_p999(cache, b)),
                  finite(gl.track_same_top1(cache, b))]
        if read_logits(resolve_golden(f"linux-cpu/{b}")).header["env"]["mlx"] == mx.__version__:
            assert values == [0.0, 0.0, 1.0], (b, values)


def _same_figures(a, b):
    return a.keys() == b.keys() and all(a[k] == b[k] or (math.isnan(a[k]) and math.isnan(b[k])) for k in a)


def test_the_shared_setups_kernel_probe_and_attribution_are_the_benchmarks_calls(monkeypatch):
    """The kernel probe and the attribution parts, as the shared setup hands them to its processes (captured, not
    run there), give on the tiny model the figures of the calls their benchmarks document: KernelDrift's
    measure_kernels on common.kernel_inputs(), Attribution's attribute of the main job's pair (each class). The
    test above checks these two parts only by what the benchmarks read (computing them again on the embedded
    Gemma there cost about 40 s of CPU, issue 33)."""
    from conftest import make_tiny
    from gemmdrift import kernels, suite
    from gemmdrift.attribution.attribute import attribute

    # float32: past its window the tiny model's attention core drifts at these sizes, so the attribution has a
    # counterfactual to run (with nothing drifting it is skipped, issue 46)
    tiny = make_tiny("float32")
    monkeypatch.delenv("GEMMDRIFT_BENCH_PARTS", raising=False)
    monkeypatch.setattr(common, "model", lambda dtype="bfloat16": tiny)
    monkeypatch.setattr(common, "sizes", lambda: suite.SIZES["quick"])
    monkeypatch.setattr(suite, "stream", lambda lm, n: [(7 * i + 3) % 97 for i in range(n)])  # no tokenizer
    monkeypatch.setattr(common, "KERNEL_LAYERS", (0, 1))
    monkeypatch.setattr(common, "KERNEL_TS", (1, 2))
    monkeypatch.setattr(common, "KERNEL_PATHS", ("model", "emulated:splitk4"))
    monkeypatch.setattr(common, "KERNEL_ROWS", 4)
    monkeypatch.setattr(common, "ATTRIBUTE_OPS", ("sdpa",))
    calls = {}

    def captured(lm, parts, **kw):
        assert lm is tiny
        calls.update(parts)
        return {}

    monkeypatch.setattr(suite, "side_by_side", captured)
    common.kernel_inputs.cache_clear()
    try:
        assert common.Probes().setup_cache()["kernels"] == {}  # nothing ran: captured only
        fn, kw = calls["kernels"]
        got = dict(fn(tiny, **kw).figures)
        projs, inputs = common.kernel_inputs()
        want = dict(kernels.measure_kernels(tiny, inputs, projs, common.KERNEL_PATHS, common.KERNEL_TS).figures)
        assert got and _same_figures(got, want)
        s = common.sizes()
        fn, kw = calls["attribute"]
        got = dict(fn(tiny, **kw).figures)
        want = dict(attribute(tiny, suite.stream(tiny, s.tokens), list(common.ATTRIBUTE_PAIR), split=s.split,
                              counterfactual=("each",), ops=("sdpa",)).figures)
        assert got and _same_figures(got, want)
        assert any(k.startswith("attr_left_") and "sdpa" in k for k in got)  # the counterfactual ran
    finally:
        common.kernel_inputs.cache_clear()


def test_the_shared_setup_refuses_an_unknown_part(monkeypatch):
    monkeypatch.setenv("GEMMDRIFT_BENCH_PARTS", "kernels,stack")
    with pytest.raises(ValueError, match="unknown part 'stack'"):
        common.Probes().setup_cache()


@pytest.mark.slow
def test_kernel_speed_benchmark(quick):
    speed = bench_kernels.KernelSpeed()
    cache = speed.setup_cache()
    rows, operand = cache
    assert rows.shape == (common.KERNEL_ROWS, 640)
    projs, inputs = common.kernel_inputs()  # the rows the kernel probe captures with every projection
    assert np.array_equal(rows, inputs[(common.SPEED_LAYER, common.SPEED_PROJECTION)])
    assert (operand.layer, operand.name, operand.in_dims) == (common.SPEED_LAYER, common.SPEED_PROJECTION, 640)
    for path, t in (("model", 1), ("quant:affine-q4-g64", 2)):
        speed.setup(cache, path, t)
        assert speed.time_projection(cache, path, t) is None


@pytest.mark.slow
def test_overhead_benchmarks_run(monkeypatch, embedded):
    monkeypatch.setattr(bench_overhead, "TOKENS", 12)
    monkeypatch.setattr(bench_overhead, "SPLIT", 8)
    bench = bench_overhead.TapOverhead()
    for schedule in bench_overhead.SCHEDULES:
        bench.setup(schedule)
        bench.time_plain_mlx_lm(schedule)
        bench.time_tapped(schedule)


# ------------------------------------------------------------------ the manifest

MANIFEST = ROOT / "benchmarks" / "manifest.json"


def current_manifest():
    """Every benchmark as asv discovers it: name -> type, unit, version, parameter names and values, and a
    track_ benchmark's direction (higher, lower, either or label: gemmdrift.directions)."""
    discovery = pytest.importorskip("asv_runner.discovery")
    out = {}
    for b in discovery.disc_benchmarks(str(ROOT / "benchmarks")):
        out[b.name] = {"type": b.type, "unit": b.unit, "version": b.version, "param_names": list(b.param_names),
                       "params": [list(p) for p in b.params]}
        if b.type == "track":
            out[b.name]["direction"] = getattr(b.func, "direction", None)
    return dict(sorted(out.items()))


def test_every_tracked_figure_has_a_direction():
    """Regression (issue 53, item 2): only two figures had a direction, so the gate failed improvements (a stream
    leaving its envelope later, top-1 agreement rising to 1). Every track_ benchmark declares one beside its unit
    and version, the manifest records it, and the gate reads the manifest."""
    from gemmdrift import directions
    from gemmdrift.measure import history

    now = current_manifest()
    tracks = {n: v for n, v in now.items() if v["type"] == "track"}
    assert len(tracks) >= 90
    missing = sorted(n for n, v in tracks.items() if v["direction"] not in directions.DIRECTIONS)
    assert not missing, f"track_ benchmarks without a direction (set track_x.direction): {missing}"
    assert history.directions_of() == {n: v["direction"] for n, v in tracks.items()}  # what the gate reads
    assert now["bench_tier.TierDivergence.track_stream_first_outside"]["direction"] == directions.HIGHER
    assert now["bench_tier.TierGolden.track_same_top1"]["direction"] == directions.HIGHER
    assert now["bench_tier.TierFingerprint.track_tree_id_t1"]["direction"] == directions.EITHER


def test_figure_names_in_benchmarks_are_the_library_names():
    from gemmdrift.result import figure_name

    for parts in (("rel_l2", "prefill:512,decode vs prefill:512,verify:2", "local", "layer 3"),
                  ("bits_lost", "quant:affine-q4-g64", 33), ("ops_bits_lost", "sdpa"), ("diverged",)):
        assert common.figure({figure_name(*parts): 1.5}, *parts) == 1.5
    assert math.isnan(common.figure({}, "flips", "a vs b"))


def test_no_tracked_series_changes_without_its_version():
    """asv keys history by benchmark name, parameters and version: a renamed benchmark or a changed
    parameter set under the same version would silently mix or orphan series. benchmarks/manifest.json
    records all three; add a new benchmark to it with `python tests/test_benchmarks.py --write-manifest`
    (and a changed one only together with a new `version`)."""
    problems = manifest_problems(json.loads(MANIFEST.read_text()), current_manifest())
    assert not problems, "\n".join(problems)


def manifest_problems(saved, now):
    gone = sorted(set(saved) - set(now))
    out = [f"renamed or removed (its history would be orphaned): {n}" for n in gone]
    out += [f"new benchmark {n}: add it to {MANIFEST.name} (python tests/test_benchmarks.py --write-manifest)"
            for n in sorted(set(now) - set(saved))]
    for name in sorted(set(saved) & set(now)):
        was, cur = saved[name], now[name]
        changed = [k for k in ("params", "param_names", "unit", "type") if cur[k] != was[k]]
        if cur.get("direction") != was.get("direction"):  # metadata: no new version, but the manifest says it
            out.append(f"{name}: direction {was.get('direction')} -> {cur.get('direction')}: rewrite {MANIFEST.name}")
        if cur["version"] == was["version"] and changed:
            out.append(f"{name}: {', '.join(changed)} changed without a new version")
        elif cur["version"] != was["version"]:
            out.append(f"{name}: version {was['version']} -> {cur['version']}: a deliberate new series? then "
                       f"rewrite {MANIFEST.name}")
    return out


def test_the_manifest_check_catches_planted_changes():
    saved = json.loads(MANIFEST.read_text())
    now = json.loads(json.dumps(saved))
    assert manifest_problems(saved, now) == []
    key = "bench_kernels.KernelDrift.track_bits_lost"
    now[key]["params"][1] = now[key]["params"][1][:-1]  # a T dropped, same version
    assert manifest_problems(saved, now) == [f"{key}: params changed without a new version"]
    now[key]["version"] = "2"  # bumped: flagged until the manifest is rewritten on purpose
    assert "version 1 -> 2" in manifest_problems(saved, now)[0]
    renamed = {("x" + k if k == key else k): v for k, v in saved.items()}
    assert len(manifest_problems(saved, renamed)) == 2  # one gone, one new


if __name__ == "__main__" and "--write-manifest" in sys.argv:
    MANIFEST.write_text(json.dumps(current_manifest(), indent=1) + "\n")
    print(f"wrote {MANIFEST}")


def test_benchmark_sizes_are_pinned_in_common_not_read_from_the_suite(monkeypatch):
    # Regression (issue 11): the benchmarks read gemmdrift.suite.SIZES, so retuning `gemmdrift run`'s
    # sizes would have moved every tracked figure without any benchmark's version changing.
    from dataclasses import replace

    from gemmdrift import suite

    monkeypatch.setattr(suite, "default_sizes", lambda: "cpu")
    pinned = common.sizes()
    assert (pinned.tokens, pinned.split, pinned.diverge_prompt, pinned.diverge_n) == (560, 500, 500, 32)
    assert pinned.kernel_ts == (1, 2, 3, 4, 8, 16, 33) and pinned.kernel_layers == (0, 5)
    retuned = dict(suite.SIZES, cpu=replace(suite.SIZES["cpu"], tokens=999))
    monkeypatch.setattr(suite, "SIZES", retuned)
    assert common.sizes() == pinned


def test_long_benchmarks_are_skipped_on_the_cpu_unless_asked(monkeypatch):
    # Regression: the prompt-set rollback comparison, the long server run and the batch sweep made one
    # `asv run` take hours on the reference-BLAS CPU backend; there they are opt-in, and skipped (not 0).
    from benchmarks import bench_batch, bench_state
    from gemmdrift import suite

    monkeypatch.delenv("GEMMDRIFT_BENCH_LONG", raising=False)
    monkeypatch.setattr(suite, "default_sizes", lambda: "cpu")
    assert not common.long_benchmarks()
    for cls in (bench_state.ExactRollbackDivergence, bench_batch.Batch, bench_batch.Server):
        bench = cls()
        cache = bench.setup_cache()  # returns at once: nothing is measured
        assert cache == {"skipped_long": 1.0}  # not None: asv hands setup no cache at all when it is None
        with pytest.raises(NotImplementedError, match="long benchmark"):
            bench.setup(cache, *[p[0] for p in getattr(cls, "params", [])])
    monkeypatch.setattr(suite, "default_sizes", lambda: "gpu")
    assert common.long_benchmarks()
    monkeypatch.setenv("GEMMDRIFT_BENCH_LONG", "0")
    assert not common.long_benchmarks()
    monkeypatch.setenv("GEMMDRIFT_BENCH_LONG", "1")
    monkeypatch.setattr(suite, "default_sizes", lambda: "cpu")
    assert common.long_benchmarks()
    bench_state.ExactRollbackDivergence().setup({"exact": {}}, "exact")  # a measured cache is not skipped


def test_replay_cost_benchmark_runs():
    bench = bench_replay.ReplayCost()
    for kernel in ("gemv", "qmv_fast"):
        bench.setup(kernel, 1)
        bench.time_replay(kernel, 1)
        ratio = bench.track_ratio_to_numpy_matmul(kernel, 1)
        assert math.isfinite(ratio) and ratio > 0


@pytest.mark.slow
def test_predicted_drift_benchmarks_at_quick_sizes(monkeypatch, embedded):
    """bench_predict at a smaller size (M3's default variant and the CUDA gemv decode): every predicted figure
    is finite, what was not predicted (M1 here; CUDA's cuBLASLt verify) is NaN (skipped), never 0."""
    from gemmdrift.replay.predict import SIZES

    monkeypatch.setattr(bench_predict, "PREDICT_SIZES", {**bench_predict.PREDICT_SIZES, "chips": ("M3", "sm90"),
                                                         "variants": "default"})
    assert SIZES["quick"].chips == ("M3", "sm90")
    bench = bench_predict.PredictedDrift()
    cache = bench.setup_cache()
    values = _all_tracks(bench_predict.PredictedDrift, cache)
    for (name, (chip, schedule, stat)), v in values.items():
        if chip == "M3" and schedule != "decode-vs-cpu" or chip == "sm90" and schedule == "decode-vs-cpu":
            finite(v)
        else:
            assert math.isnan(v), (name, chip, schedule, stat)
    assert values[("track_max_dlogit", ("M3", "verify:2", "max"))] == values[("track_max_dlogit",
                                                                               ("M3", "verify:2", "default"))]
