"""GPU sizes measure what they claim: a FLOP budget per size set, and the T values a budget leaves out are said."""

from __future__ import annotations

import numpy as np
import pandas as pd

from gemmdrift import kernels, store, suite
from gemmdrift.view import summaries

# Gemma 3 270M's projections (K, N): the MLP's gate/up and down, and the vocabulary-sized LM head.
GATE, DOWN, HEAD = (640, 2048), (2048, 640), (640, 262144)


def _plan(sizes, k_n):
    return kernels.plan_ts(sizes.kernel_ts, 2.0 * k_n[0] * k_n[1], sizes.kernel_rows, sizes.flop_budget)


def test_the_gpu_sizes_measure_every_t_they_list():
    gpu = suite.SIZES["gpu"]
    every = [t for t in gpu.kernel_ts if t >= 2]
    for k_n in (GATE, DOWN, HEAD):
        assert _plan(gpu, k_n) == every, k_n  # the head's gemv -> gemv_wide -> steel region (T 5..17) included
    # With the CPU's budget the same sweep stopped where the finding says: T=128 for the MLP, T=4 for the head.
    cut = suite.Sizes(**{**gpu.__dict__, "flop_budget": kernels.DEFAULT_FLOP_BUDGET})
    assert max(_plan(cut, GATE)) == 128 and max(_plan(cut, HEAD)) == 4


def test_the_cpu_sizes_keep_the_budget_they_were_measured_with():
    assert suite.SIZES["cpu"].flop_budget == suite.SIZES["quick"].flop_budget == kernels.DEFAULT_FLOP_BUDGET == 2e9
    from benchmarks import common  # noqa: the asv sizes too (tests/conftest puts the repo on the path)

    assert suite.Sizes(**common.BENCH_SIZES["cpu"]).flop_budget == 2e9
    assert suite.Sizes(**common.BENCH_SIZES["gpu"]).flop_budget == suite.SIZES["gpu"].flop_budget
    # On the CPU the LM head measures T <= 4 of (1, 2, 3, 4, 8, 16, 33), as before.
    assert _plan(suite.SIZES["cpu"], HEAD) == [2, 3, 4]


def _frame(units):
    rows = []
    for (layer, name, path, k, n), ts in units.items():
        rows += [{"layer": layer, "projection": name, "path": path, "dtype": "bfloat16", "quant": "",
                  "emulated": path.startswith("emulated"), "synthetic": False, "inputs": "captured", "K": k, "N": n,
                  "key_length": np.nan, "T": t, "metric": "max_ulp", "value": 0.0} for t in ts]
    return pd.DataFrame(rows, columns=kernels.TABLE_COLUMNS)


def test_skipped_t_values_are_listed_per_projection_and_path():
    df = _frame({(0, "mlp.up_proj", "model", 640, 2048): [1, 2, 3, 4, 8],
                 (18, "lm_head", "model", 640, 262144): [1, 2, 3, 4],
                 (18, "lm_head", "emulated:splitk4", 640, 262144): [1, 2, 3, 4]})
    skipped = kernels.skipped_table(df, [1, 2, 3, 4, 8, 16])
    assert skipped[["layer", "projection", "path", "T"]].values.tolist() == [
        [0, "mlp.up_proj", "model", 16], [18, "lm_head", "model", 8], [18, "lm_head", "model", 16],
        [18, "lm_head", "emulated:splitk4", 8], [18, "lm_head", "emulated:splitk4", 16]]
    text = kernels.describe_skipped(skipped)
    # All paths skipped the head's 8 and 16; only "model" is probed on up_proj, which is every path there is.
    assert "mlp.up_proj T=16" in text and "lm_head T=8,16." in text
    partial = kernels.describe_skipped(skipped[skipped["path"] == "model"].iloc[:1].pipe(
        lambda s: pd.concat([s, skipped[skipped["path"] == "emulated:splitk4"]])))
    assert "mlp.up_proj T=16 (model)" in partial
    assert kernels.skipped_table(df, [1, 2, 3]).empty and kernels.describe_skipped(None) is None


def test_a_budget_cut_sweep_says_what_it_left_out(tiny, tmp_path):
    projs = kernels.projections(tiny, layers=[0], names=["q_proj", "down_proj"])
    inputs = kernels.capture_inputs(tiny, np.random.default_rng(0).integers(0, 97, 40).tolist(), projs, max_rows=8,
                                    synthetic=False)
    ts = [1, 2, 3, 4, 8, 16]
    budget = 2.0 * projs[0].in_dims * projs[0].out_dims * 30  # T=8 fits (2+3+4+8 rows + 8 singles), 16 does not
    r = kernels.measure_kernels(tiny, inputs, projs, ["model"], ts, flop_budget=budget)
    measured = {p.name: sorted(set(r.tables["kernels"].query("projection == @p.name")["T"])) for p in projs}
    expected = {p.name: [1] + kernels.plan_ts(ts, p.flops_per_row, 8, budget) for p in projs}
    assert measured == expected and measured != {p.name: ts for p in projs}
    skipped = r.tables["skipped"]
    assert {(row.projection, row.T) for row in skipped.itertuples()} == {
        (p.name, t) for p in projs for t in ts if t not in expected[p.name]}
    assert "Not measured" in summaries.text(r)
    store.write_result(r, tmp_path)
    back = store.read_result(tmp_path)
    assert back.tables["skipped"][["projection", "T"]].values.tolist() == skipped[["projection", "T"]].values.tolist()
    from gemmdrift.report import build_report

    assert "Not measured (over the FLOP budget" in build_report(tmp_path)["markdown"].read_text()


# ------------------------------------------------------------------ GPU timings warm up


def test_tap_overhead_warms_up_on_a_gpu_only(monkeypatch, tiny):
    from benchmarks import bench_overhead, common
    from gemmdrift.model import taps

    calls = []
    monkeypatch.setattr(common, "model", lambda: tiny)
    monkeypatch.setattr(suite, "stream", lambda lm, n: list(range(1, n + 1)))
    monkeypatch.setattr(taps, "run_plain", lambda *a, **k: calls.append("plain"))
    monkeypatch.setattr(taps, "run_schedule", lambda *a, **k: calls.append("tapped"))
    bench = bench_overhead.TapOverhead()
    monkeypatch.setattr(common, "on_gpu", lambda: False)
    bench.setup(bench_overhead.SCHEDULES[0])
    assert calls == []  # the CPU series is timed as it always was
    monkeypatch.setattr(common, "on_gpu", lambda: True)
    bench.setup(bench_overhead.SCHEDULES[0])
    assert calls == ["plain", "tapped"]  # one untimed run of each body before the timed one
    bench.time_tapped(bench_overhead.SCHEDULES[0])
    assert calls[-1] == "tapped" and len(calls) == 3


def test_the_batch_sweep_warms_every_batch_size_before_timing_it(monkeypatch, tiny):
    from gemmdrift.measure import batch

    events = []
    real_alone, real_batch = batch.generate_alone, batch.generate_batch

    def alone(model, prompt, n, step):
        events.append(("alone", n))
        return real_alone(model, prompt, n, step)

    def in_batch(model, prompts, n, **kw):
        events.append(("batch", len(prompts), n))
        return real_batch(model, prompts, n, **kw)

    monkeypatch.setattr(batch, "generate_alone", alone)
    monkeypatch.setattr(batch, "generate_batch", in_batch)
    target, comps = [5, 6, 7, 8], [[9, 10, 11], [12, 13]]
    batch.sweep(tiny, target, {"short": comps}, 3, batch_sizes=(1, 2), reference=False)
    assert events[:2] == [("alone", 2), ("alone", 3)]  # two warm-up tokens (a decode step), then the timed run
    timed = [e for e in events if e[0] == "batch"]
    # Per B: one untimed 2-token batch, then the timed rows (first and last) with n=3.
    assert timed == [("batch", 1, 2), ("batch", 1, 3), ("batch", 2, 2), ("batch", 2, 3), ("batch", 2, 3)]


def test_the_size_set_is_recorded_beside_the_figures(monkeypatch):
    from benchmarks import bench_env, common
    from gemmdrift.measure import history

    assert set(bench_env.SIZE_CODES) == set(common.BENCH_SIZES)
    assert bench_env.track_sizes() == 0.0  # this CPU runs the cpu sizes
    monkeypatch.setattr(suite, "default_sizes", lambda: "gpu")
    assert bench_env.track_sizes() == 1.0
    # A label for history, never drawn or gated as a drift figure.
    df = pd.DataFrame({"benchmark": ["bench_env.track_sizes", "bench_stack.PrefillChunks.track_flips"],
                       "value": [1.0, 2.0], "mlx": ["0.32.4", "0.32.4"]})
    assert list(history.tracked(df)["benchmark"]) == ["bench_stack.PrefillChunks.track_flips"]
