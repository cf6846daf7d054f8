"""Layer taps and stack drift on a tiny mlx-lm gemma3_text (sliding window 8)."""

import numpy as np
import pytest

from conftest import make_tiny, plant_zero_first_key
from gemmdrift import metrics
from gemmdrift.errors import GemmdriftError
from gemmdrift.measure.stack import compare_taps, measure_stack, pair_verdict
from gemmdrift.model.taps import run_schedule

TOKENS = np.random.default_rng(0).integers(0, 97, 128).tolist()


def test_taps_are_the_models_own_hidden_states(tiny):
    import mlx.core as mx

    taps = run_schedule(tiny.model, TOKENS[:12], "prefill:12", logit_positions=range(12))
    # The norm tap is what the backbone returns, the logits what the model returns.
    h = tiny.model.model(mx.array([TOKENS[:12]]))
    logits = tiny.model(mx.array([TOKENS[:12]]))
    assert np.array_equal(taps.hidden[-1], np.array(h[0].astype(mx.float32)))
    assert np.array_equal(taps.logits, np.array(logits[0].astype(mx.float32)))
    # The last layer tap is the norm's input.
    normed = tiny.model.model.norm(mx.array(taps.hidden[-2][None]).astype(mx.bfloat16))
    assert np.array_equal(np.array(normed[0].astype(mx.float32)), taps.hidden[-1])


def test_logits_only_at_requested_positions(tiny):
    taps = run_schedule(tiny.model, TOKENS[:20], "prefill:8,verify:2", split=8, positions=[3, 15],
                        logit_positions=[9, 10, 19])
    assert taps.hidden.shape == (tiny.n_layers + 1, 2, 64)
    assert taps.logits.shape == (3, 97)
    full = run_schedule(tiny.model, TOKENS[:20], "prefill:8,verify:2", split=8, logit_positions=range(20))
    assert np.array_equal(full.logits[[9, 10, 19]], taps.logits)
    assert np.array_equal(full.hidden[:, [3, 15]], taps.hidden)


def test_model_is_restored_even_when_a_layer_raises(tiny):
    layers = list(tiny.model.layers)
    norm = tiny.model.model.norm

    class Boom:
        def __call__(self, *a, **k):
            raise RuntimeError("boom")

    tiny.model.model.layers[2] = Boom()
    with pytest.raises(RuntimeError):
        run_schedule(tiny.model, TOKENS[:8], "decode")
    assert isinstance(tiny.model.model.layers[2], Boom)
    tiny.model.model.layers[2] = layers[2]
    run_schedule(tiny.model, TOKENS[:8], "decode")
    assert list(tiny.model.layers) == layers and tiny.model.model.norm is norm


def test_schedules_below_the_window_are_bit_identical(tiny):
    # On this backend every matmul is row-invariant; below the sliding window
    # decode and verification see the same keys in the same order.
    r = measure_stack(tiny, TOKENS[:8], ["prefill:2,decode", "prefill:2,verify:2", "prefill:8"], split=2)
    t = r.tables["stack"]
    ratios = t["metric"].isin(["same_top1_share", "ppl_ratio"])  # the two-run statistics whose identity is 1
    assert ratios.any() and (t["value"][ratios] == 1).all()
    assert (t["value"][(t["metric"] != "n") & ~ratios] == 0).all()
    assert (r.tables["envelope"]["flips"] == 0).all() and (r.tables["envelope"]["max_abs_dlogit"] == 0).all()


def test_cache_layout_drift_past_the_window_is_found_from_the_first_layer():
    # Past the window, T=1 decoding writes a ring buffer in place while blocks
    # concatenate in temporal order: same keys, another summation order.
    lm = make_tiny("float32")
    taps = {}
    r = measure_stack(lm, TOKENS[:24], ["prefill:4,decode", "prefill:4,verify:2"], split=4, keep_taps=taps)
    acc = r.tables["stack"][(r.tables["stack"]["mode"] == "accumulated") & (r.tables["stack"]["metric"] == "frac_differ")]
    assert acc[acc["tap"] == "layer 0"]["value"].iloc[0] > 0
    ref = taps[("prefill:4,decode", "accumulated", "float32")]
    other = taps[("prefill:4,verify:2", "accumulated", "float32")]
    rows = ref.rows(other.positions)
    same = [np.array_equal(ref.hidden[:, i], other.hidden[:, j]) for j, i in enumerate(rows)]
    first_differ = other.positions[same.index(False)]
    assert first_differ >= 8 and all(same[: int(first_differ) - 4])  # positions < window identical


def _perturbing(layer, position, delta):
    """A layer that adds `delta` to element 0 of its output at one absolute position."""
    import mlx.core as mx

    state = {"offset": 0}

    def call(x, mask=None, cache=None):
        out = layer(x, mask, cache)
        T = out.shape[1]
        p = position - state["offset"]
        state["offset"] += T
        if 0 <= p < T:
            bump = mx.zeros(out.shape, dtype=out.dtype)
            bump[0, p, 0] = delta
            out = out + bump
        return out

    return call, state


def test_planted_difference_is_found_at_its_layer_with_its_magnitude():
    lm = make_tiny("float32")
    toks = TOKENS[:8]  # below the window: the schedules themselves agree bit for bit
    ref = run_schedule(lm.model, toks, "prefill:8", logit_positions=range(8))
    original = lm.model.model.layers[2]
    delta = 0.5
    call, state = _perturbing(original, 5, delta)
    lm.model.model.layers[2] = call
    try:
        acc = run_schedule(lm.model, toks, "decode", logit_positions=range(8))
        state["offset"] = 0
        loc = run_schedule(lm.model, toks, "decode", logit_positions=range(8), reference=ref)
    finally:
        lm.model.model.layers[2] = original
    kinds = lm.info["layer_types"]
    labels = {"pair": "p", "reference": "prefill:8", "schedule": "decode", "dtype": "float32"}
    acc_rows, _, _ = compare_taps(ref, acc, kinds, {**labels, "mode": "accumulated"})
    loc_rows, _, _ = compare_taps(ref, loc, kinds, {**labels, "mode": "local"})

    def by_layer(rows, metric):
        return {r["layer"]: r["value"] for r in rows if r["metric"] == metric}

    acc_max = by_layer(acc_rows, "max_abs")
    loc_max = by_layer(loc_rows, "max_abs")
    assert acc_max[0] == acc_max[1] == 0 and acc_max[2] == pytest.approx(delta, rel=1e-6)
    assert acc_max[3] > 0  # carried upward
    assert loc_max[2] == pytest.approx(delta, rel=1e-6)
    assert all(v == 0 for k, v in loc_max.items() if k not in (2,) and k <= lm.n_layers)
    assert by_layer(acc_rows, "frac_differ")[2] == pytest.approx(1 / (8 * 64))


def test_ladder_calls_rounding_rounding():
    lm = make_tiny("bfloat16")
    r = measure_stack(lm, TOKENS[:100], ["prefill:4,decode", "prefill:4,verify:2"], split=4, ladder=True, local=False)
    pair = r.tables["ladder"]["pair"].iloc[0]
    assert pair_verdict(r.tables["ladder"], pair) == "rounding"
    logits = r.tables["ladder"][r.tables["ladder"]["tap"] == "logits"].iloc[0]
    assert 0 < logits["rel_l2_float32"] < metrics.UNIT_ROUNDOFF["bfloat16"]
    if logits["rel_l2_bfloat16"] > 0:
        assert logits["shrink"] > 1000
    else:
        # No bf16 rounding flipped: with mlx < 0.30 (CPU RoPE fallback computing its angles in bf16)
        # this model's bf16 streams are bit-identical under both schedules; the f32 drift is rounding.
        assert logits["shrink"] == 0
    assert lm.info["dtype"] == "bfloat16" and str(lm.model.lm_head.weight.dtype) == "mlx.core.bfloat16"


def test_ladder_flags_a_planted_semantic_difference():
    lm = make_tiny("bfloat16")
    plant_zero_first_key(lm)
    r = measure_stack(lm, TOKENS[:24], ["prefill:4,decode", "prefill:4,verify:2"], split=4, ladder=True, local=False)
    assert pair_verdict(r.tables["ladder"], r.tables["ladder"]["pair"].iloc[0]) == "semantic"
    assert r.tables["ladder"][r.tables["ladder"]["tap"] == "logits"]["shrink"].iloc[0] < 2


def test_stack_input_errors(tiny):
    with pytest.raises(GemmdriftError):
        measure_stack(tiny, TOKENS[:10], ["decode"], split=4)
    with pytest.raises(GemmdriftError):
        measure_stack(tiny, TOKENS[:10], ["decode", "verify:2"], positions=[3, 10])
    with pytest.raises(GemmdriftError):
        measure_stack(tiny, TOKENS[:10], ["prefill:4,decode", "prefill:4,verify:2"], split=10)
    with pytest.raises(GemmdriftError):
        measure_stack(tiny, TOKENS[:10], ["decode", "verify:2"], positions=[])
    with pytest.raises(GemmdriftError):
        measure_stack(make_tiny("float32"), TOKENS[:10], ["decode", "verify:2"], ladder=True)


def test_one_layer_model_and_single_position():
    lm = make_tiny("float32", num_hidden_layers=1, sliding_window_pattern=1)
    r = measure_stack(lm, TOKENS[:12], ["prefill:2,decode", "prefill:2,verify:3"], split=2, positions=[11],
                      logit_positions=[11])
    assert set(r.tables["stack"]["tap"]) == {"layer 0", "norm", "logits"}
    assert r.tables["envelope"]["positions"].iloc[0] == 1


def test_ulp_metric_in_stack_matches_numpy(tiny):
    taps = {}
    r = measure_stack(make_tiny("float32"), TOKENS[:20], ["prefill:4,decode", "prefill:4,verify:2"], split=4,
                      keep_taps=taps, local=False)
    ref = taps[("prefill:4,decode", "accumulated", "float32")]
    other = taps[("prefill:4,verify:2", "accumulated", "float32")]
    a, b = ref.hidden[1, ref.rows(other.positions)], other.hidden[1]
    expected = np.max(np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64)))
    got = r.tables["stack"][(r.tables["stack"]["tap"] == "layer 1") & (r.tables["stack"]["metric"] == "max_ulp")]["value"].iloc[0]
    assert got == expected  # same-sign values: the ULP distance is the integer distance of the bits
    assert metrics.compare(a, b, "float32")["max_ulp"] == got


def test_shared_prefix_gives_bit_identical_results():
    # Runs that start from a copy of the shared prefix's caches must equal runs from scratch.
    lm = make_tiny("float32")
    schedules = ["prefill:5,decode", "prefill:5,verify:2"]
    kwargs = dict(split=10, positions=range(12, 30), logit_positions=range(12, 30))
    shared_taps, fresh_taps = {}, {}
    shared = measure_stack(lm, TOKENS[:30], schedules, keep_taps=shared_taps, **kwargs)
    fresh = measure_stack(lm, TOKENS[:30], schedules, share_prefix=False, keep_taps=fresh_taps, **kwargs)
    assert shared.tables["stack"].equals(fresh.tables["stack"])
    for key, taps in shared_taps.items():
        assert np.array_equal(taps.logits, fresh_taps[key].logits)
    # The copied caches are independent: the prefix can be reused again.
    from gemmdrift.model.taps import common_prefix

    p = common_prefix(lm.model, TOKENS[:30], schedules, 10, 12)
    assert p.length == 10 and p.blocks == [(0, 5), (5, 10)]
    a = run_schedule(lm.model, TOKENS[:30], schedules[0], split=10, prefix=p, logit_positions=[20])
    b = run_schedule(lm.model, TOKENS[:30], schedules[0], split=10, prefix=p, logit_positions=[20])
    assert np.array_equal(a.logits, b.logits) and np.array_equal(a.hidden, b.hidden)
    with pytest.raises(GemmdriftError):
        run_schedule(lm.model, TOKENS[:30], schedules[0], split=10, prefix=p, positions=[3])


def test_quantized_model_with_blocks_that_read_no_logits():
    # Regression: handing the LM head zero rows crashed mlx's CPU quantized_matmul (SIGFPE).
    import mlx.nn as nn

    lm = make_tiny("bfloat16")
    nn.quantize(lm.model, group_size=32, bits=4)
    taps = run_schedule(lm.model, TOKENS[:20], "prefill:8,verify:2", split=8, positions=[15], logit_positions=[15])
    assert taps.logits.shape == (1, 97) and np.isfinite(taps.logits).all()


def test_stack_resumes_from_its_checkpoint(tmp_path, monkeypatch):
    from gemmdrift.measure import stack

    lm = make_tiny("float32")
    kwargs = dict(split=10, ladder=False, checkpoint=tmp_path)
    first = measure_stack(lm, TOKENS[:24], ["prefill:5,decode", "prefill:5,verify:2"], **kwargs)
    assert len(list(tmp_path.glob("*.npz"))) == 3  # reference, accumulated, local

    def fail(*a, **k):
        raise AssertionError("saved runs must not run again")

    monkeypatch.setattr(stack, "run_schedule", fail)
    again = measure_stack(lm, TOKENS[:24], ["prefill:5,decode", "prefill:5,verify:2"], **kwargs)
    assert again.tables["stack"].equals(first.tables["stack"])
    assert again.tables["positions"].equals(first.tables["positions"])


def test_peak_memory_does_not_grow_with_depth_beyond_the_taps():
    # A long prefill block whose last rows are tapped: plain mlx-lm frees each layer's
    # output as the next layer runs; the tapped run must not hold them all until the end.
    import mlx.core as mx

    from gemmdrift.model.taps import run_plain

    toks = TOKENS[:128]
    extra = {}
    for layers in (4, 16):
        lm = make_tiny("float32", num_hidden_layers=layers)
        peaks = []
        for run in (lambda: run_plain(lm.model, toks, "prefill:64"),
                    lambda: run_schedule(lm.model, toks, "prefill:64", positions=range(124, 128))):
            mx.clear_cache()
            base = mx.get_active_memory()
            mx.reset_peak_memory()
            run()
            peaks.append(mx.get_peak_memory() - base)
        extra[layers] = peaks[1] - peaks[0]
    block_bytes = 64 * 64 * 4  # one block's hidden states in one layer (64 rows, hidden 64, float32)
    per_layer = (extra[16] - extra[4]) / 12
    assert per_layer < block_bytes / 2, (extra, per_layer)


# The precision ladder under TF32. Regression: on CUDA and on M5-class (NAX) Metal, mlx runs float32
# matmuls as TF32 unless MLX_ENABLE_TF32=0, so the ladder's "float32" rung gained 3 mantissa bits, not 16,
# and rounding drift that barely shrank was called "semantic".

def _env(backend, arch="", mlx="0.32.4", tf32=None):
    return {"backend": backend, "architecture": arch, "mlx": mlx, "env": {"MLX_ENABLE_TF32": tf32}}


@pytest.mark.parametrize("env,mode", [
    (_env("cpu"), "float32"),
    (_env("cpu", tf32="1"), "float32"),  # the CPU backend has no TF32 path
    (_env("cuda"), "tf32"),
    (_env("cuda", tf32="0"), "float32"),
    (_env("cuda", tf32="false"), "float32"),  # mlx reads it with atoi: 'false' is 0
    (_env("cuda", tf32="2"), "tf32"),
    (_env("metal", "applegpu_g17s"), "tf32"),  # M5 Max: neural accelerators
    (_env("metal", "applegpu_g17g", tf32="0"), "float32"),
    (_env("metal", "applegpu_g16s"), "float32"),  # M4: no NAX
    (_env("metal", "applegpu_g17s", mlx="0.29.4"), "float32"),  # NAX kernels came with mlx 0.30.0
    (_env("metal", "applegpu_g17p"), "float32"),  # phone GPUs need gen 18
    (_env("metal", "applegpu_g18p"), "tf32"),
    (_env("gpu"), "unknown"),
])
def test_fp32_matmul_mode_from_the_env_record(env, mode):
    from gemmdrift.machine.envinfo import fp32_matmul_mode

    assert fp32_matmul_mode(env) == mode


def test_ladder_verdicts_on_a_tf32_rung_are_unreliable():
    from gemmdrift.result import Verdict
    from gemmdrift.measure.stack import float32_rung, ladder_table, ladder_verdict

    # bf16 -> TF32 shrinks rounding drift ~8x: below the 10x "semantic" line.
    assert ladder_verdict(1e-2, 1.25e-3, true_float32=True)[1] == Verdict.SEMANTIC
    assert ladder_verdict(1e-2, 1.25e-3, true_float32=False)[1] == Verdict.UNRELIABLE
    assert ladder_verdict(1e-2, 3e-3, true_float32=False)[1] == Verdict.UNRELIABLE  # was unclear (3.3x)
    assert ladder_verdict(1e-2, 1e-6, true_float32=False)[1] == Verdict.ROUNDING  # a 10^4 shrink is still rounding
    assert ladder_verdict(0.0, 0.0, true_float32=False)[1] == "identical"
    # The rung record: the env record decides without a probe, a measured probe decides with one.
    assert not float32_rung(_env("cuda"))["true_float32"]
    assert float32_rung(_env("cuda", tf32="0"))["true_float32"]
    assert float32_rung(_env("cpu"))["true_float32"]
    r = float32_rung(_env("metal", "applegpu_g17s"), probe={"rel_err": 4e-4, "true_float32": False})
    assert not r["true_float32"] and r["mode"] == "tf32" and "MLX_ENABLE_TF32=0" in r["why"]
    assert float32_rung(_env("metal", "applegpu_g17s"), probe={"rel_err": 4e-7, "true_float32": True})["true_float32"]
    # On a real (planted-semantic) ladder table, a TF32 rung turns "semantic" into "unreliable".
    lm = make_tiny("bfloat16")
    plant_zero_first_key(lm)
    r = measure_stack(lm, TOKENS[:24], ["prefill:4,decode", "prefill:4,verify:2"], split=4, ladder=True, local=False)
    assert r.inputs["ladder_float32"]["true_float32"] and r.inputs["ladder_float32"]["probe"]["rel_err"] < 1e-5
    pair = r.tables["ladder"]["pair"].iloc[0]
    assert pair_verdict(r.tables["ladder"], pair) == "semantic"
    assert pair_verdict(ladder_table(r.tables["stack"], "bfloat16", true_float32=False), pair) == "unreliable"


def test_fp32_probe_tells_tf32_from_float32(monkeypatch):
    from gemmdrift.machine import envinfo

    def tf32(a, b):  # numpy: inputs rounded to nearest with 10 mantissa bits, as tensor cores do
        def r(x):
            u = x.view(np.uint32).astype(np.uint64)
            return ((u + 0x1000) & 0xFFFFE000).astype(np.uint32).view(np.float32)
        return r(a).astype(np.float64) @ r(b).astype(np.float64)

    assert envinfo.probe_fp32_matmul()["true_float32"]  # mlx on this machine's default device
    p = envinfo.probe_fp32_matmul(tf32)
    assert not p["true_float32"] and p["rel_err"] > 10 * envinfo.FP32_PROBE_TOLERANCE
    monkeypatch.delenv("MLX_ENABLE_TF32", raising=False)
    monkeypatch.setattr(envinfo, "TF32_FORCED_OFF", False)
    assert envinfo.force_true_float32() and envinfo.TF32_FORCED_OFF
    import os

    assert os.environ["MLX_ENABLE_TF32"] == "0" and not envinfo.force_true_float32()


def test_a_corrupt_stack_checkpoint_is_discarded_and_recomputed(tmp_path, capsys):
    # Regression: a corrupt .npz checkpoint crashed the resume with a traceback.
    lm = make_tiny("float32")
    kwargs = dict(split=10, ladder=False, local=False, checkpoint=tmp_path)
    first = measure_stack(lm, TOKENS[:24], ["prefill:5,decode", "prefill:5,verify:2"], **kwargs)
    victim = sorted(tmp_path.glob("*.npz"))[0]
    victim.write_bytes(victim.read_bytes()[:100])  # truncated
    capsys.readouterr()
    again = measure_stack(lm, TOKENS[:24], ["prefill:5,decode", "prefill:5,verify:2"], **kwargs)
    err = capsys.readouterr().err
    assert f"checkpoint {victim} is corrupt" in err and err.count("done before (resumed)") == 1
    assert again.tables["stack"].equals(first.tables["stack"])
    from gemmdrift.model.taps import load_taps

    load_taps(victim)  # rewritten whole


def test_ladder_rungs_in_two_processes_give_the_same_result(tmp_path):
    """The rungs of the ladder (bfloat16 and float32) side by side in two processes (gemmdrift.workers), each
    loading the model again, give the tables one process gives; local drift and the float32 record too."""
    from gemmdrift.model import load_model
    from test_models import save_tiny

    save_tiny(tmp_path / "m")
    lm = load_model(str(tmp_path / "m"), dtype="bfloat16")
    kw = dict(split=4, ladder=True, local=True)
    one = measure_stack(lm, TOKENS[:24], ["prefill:4,decode", "prefill:4,verify:2"], workers=1, **kw)
    two = measure_stack(lm, TOKENS[:24], ["prefill:4,decode", "prefill:4,verify:2"], workers=2, **kw)
    for name in ("stack", "envelope", "ladder"):
        a, b = one.tables[name], two.tables[name]
        assert len(a) and a.equals(b), name
    assert set(one.tables["stack"]["dtype"]) == {"bfloat16", "float32"}
    assert one.figures == two.figures
    assert one.inputs["ladder_float32"] == two.inputs["ladder_float32"]


def test_runs_that_share_nothing_in_two_processes_give_the_same_result(tmp_path, capsys, monkeypatch):
    """Without the ladder and local drift, schedules that share no leading block (prefill chunks of 24 vs 8)
    run in two processes: the tables one process gives; their checkpoints resume in one process."""
    from gemmdrift.model import load_model
    from test_models import save_tiny

    save_tiny(tmp_path / "m")
    lm = load_model(str(tmp_path / "m"), dtype="bfloat16")
    schedules, kw = ["prefill:24", "prefill:8"], dict(positions=np.arange(16, 24), local=False)
    one = measure_stack(lm, TOKENS[:24], schedules, workers=1, **kw)
    from gemmdrift import workers

    calls, real = [], workers.run_jobs
    monkeypatch.setattr(workers, "run_jobs", lambda lm, fn, jobs, n, **k: calls.append((fn.__name__, len(jobs), n))
                        or real(lm, fn, jobs, n, **k))
    two = measure_stack(lm, TOKENS[:24], schedules, workers=2, checkpoint=tmp_path / "ck", **kw)
    assert calls[0] == ("_taps_job", 2, 2)
    for name in ("stack", "envelope", "positions"):
        a, b = one.tables[name], two.tables[name]
        assert len(a) and a.equals(b), name
    assert one.figures == two.figures
    assert len(list((tmp_path / "ck").glob("*.npz"))) == 2
    capsys.readouterr()
    again = measure_stack(lm, TOKENS[:24], schedules, workers=1, checkpoint=tmp_path / "ck", **kw)
    assert capsys.readouterr().err.count("done before (resumed)") == 2
    assert again.tables["stack"].equals(one.tables["stack"])


def _default_workers_here(lm, parts):
    from gemmdrift import workers

    return workers.default_workers(lm, parts)


def test_side_by_side_runs_whole_parts_that_start_no_processes_of_their_own(tmp_path):
    """suite.side_by_side: each part whole in a worker, which gives any measurement there one process
    (no nested pools); the results come back by name, as the parts give them alone."""
    from gemmdrift import suite, workers
    from gemmdrift.model import load_model
    from test_models import save_tiny

    save_tiny(tmp_path / "m")
    lm = load_model(str(tmp_path / "m"), dtype="bfloat16")
    if workers.default_workers(lm, 2) < 2:
        pytest.skip("one core: no worker processes")
    kw = dict(positions=np.arange(16, 24), local=False)
    out = suite.side_by_side(lm, {
        "nested": (_default_workers_here, dict(parts=4)),
        "stack": (measure_stack, dict(tokens=TOKENS[:24], schedules=["prefill:24", "prefill:8"], **kw)),
    })
    assert list(out) == ["nested", "stack"] and out["nested"] == 1
    alone = measure_stack(lm, TOKENS[:24], ["prefill:24", "prefill:8"], workers=1, **kw)
    assert out["stack"].figures == alone.figures and out["stack"].tables["stack"].equals(alone.tables["stack"])


def test_a_prefix_store_shares_the_prefix_bit_for_bit(tmp_path, capsys):
    """measure_stack and attribute with a prefix store (what `gemmdrift run` gives its decode family and its
    which-op part): the first computes the shared blocks and saves their caches, one file per dtype (the ladder's
    float32 rung its own); the next reads them instead. Every table is the one computed without a store, past the
    tiny model's window of 8 (the RotatingKVCache's ring is in the file), where the pair drifts. Other tokens get
    another file; a damaged file is computed again and rewritten."""
    from gemmdrift.attribution.attribute import attribute
    from gemmdrift.model.taps import _load_prefix

    lm = make_tiny("bfloat16")
    schedules = ["prefill:10,decode", "prefill:10,verify:2"]
    kw = dict(split=10, positions=range(10, 30), ladder=True)
    plain = measure_stack(lm, TOKENS[:30], schedules, **kw)
    t = plain.tables["stack"]
    assert t[t["metric"] == "rel_l2"]["value"].max() > 0  # past the window: the pair drifts
    store = tmp_path / "store"
    first = measure_stack(lm, TOKENS[:30], schedules, prefix_store=store, **kw)
    files = sorted(store.glob("*.safetensors"))
    assert len(files) == 2 and "read from the run's store" not in capsys.readouterr().err
    second = measure_stack(lm, TOKENS[:30], schedules, prefix_store=store, **kw)
    assert capsys.readouterr().err.count("read from the run's store") == 2
    for r in (first, second):
        for name in ("stack", "envelope", "ladder"):
            assert r.tables[name].equals(plain.tables[name]), name
        assert r.figures == plain.figures
    # The which-op part reads the bfloat16 file the stack saved.
    alone = attribute(lm, TOKENS[:30], schedules, split=10, counterfactual=("each",), ops=("sdpa",))
    shared = attribute(lm, TOKENS[:30], schedules, split=10, counterfactual=("each",), ops=("sdpa",),
                       prefix_store=str(store))
    assert sorted(store.glob("*.safetensors")) == files
    assert shared.tables["local"].equals(alone.tables["local"]) and shared.figures == alone.figures
    assert shared.tables["counterfactual"].equals(alone.tables["counterfactual"])
    # Other tokens: another key, another file.
    other = list(TOKENS[1:31])
    measure_stack(lm, other, schedules, prefix_store=store, split=10, local=False)
    assert len(list(store.glob("*.safetensors"))) == 3
    # A damaged file: computed again, the same tables, the file rewritten whole.
    for f in files:
        f.write_bytes(f.read_bytes()[:200])
    capsys.readouterr()
    third = measure_stack(lm, TOKENS[:30], schedules, prefix_store=store, **kw)
    assert "read from the run's store" not in capsys.readouterr().err
    assert third.tables["stack"].equals(plain.tables["stack"])
    assert all(_load_prefix(f, lm.model) is not None for f in files)
