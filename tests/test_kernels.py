"""Kernel isolation: GEMV (T=1) against batched GEMM (T>1), per projection.

Mostly on the tiny seeded gemma3_text; the real embedded Gemma only for two
projections of layer 0 (q_proj, down_proj) at T in {1, 2, 3, 8}, and its
down_proj under the emulated control at T=64.
"""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from gemmdrift import dispatch, kernels, metrics, store
from gemmdrift.view import summaries
from gemmdrift.errors import GemmdriftError
from gemmdrift.model import load_model

REAL_PATHS = ["model", "dense:float32", "quant:affine-q4-g64", "quant:affine-q8-g64"]
DRIFT = ["frac_differ", "max_ulp", "rows_differ"]


def _tokens(n: int = 40, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 97, n).tolist()


def _value(df, metric, t, path=None, projection=None):
    s = df[(df["metric"] == metric) & (df["T"] == t)]
    if path is not None:
        s = s[s["path"] == path]
    if projection is not None:
        s = s[s["projection"] == projection]
    assert len(s) == 1, f"expected one {metric} row at T={t}, got {len(s)}"
    return float(s["value"].iloc[0])


def _set_weight(proj, w: np.ndarray) -> None:
    import mlx.core as mx

    proj.module.weight = mx.array(w.astype(np.float32)).astype(mx.bfloat16)
    mx.eval(proj.module.weight)


def _gemv(proj, rows: np.ndarray) -> np.ndarray:
    """The real kernel, one row at a time, as float32 numpy."""
    import mlx.core as mx

    x = mx.array(rows.astype(np.float32)).astype(mx.bfloat16)
    out = [proj.module(x[i:i + 1][None]) for i in range(len(rows))]
    mx.eval(out)
    return np.concatenate([np.array(o[0].astype(mx.float32)) for o in out])


# ------------------------------------------------------------------ projections


def test_projections_lists_every_linear_and_the_head(tiny):
    projs = kernels.projections(tiny)
    names = {p.name for p in projs if p.layer == 0}
    assert names == {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                     "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
    assert len(projs) == 7 * tiny.n_layers + 1
    head = projs[-1]
    assert (head.layer, head.name, head.in_dims, head.out_dims) == (tiny.n_layers, "lm_head", 64, 97)
    q = kernels.projections(tiny, layers=[1], names=["q_proj"])
    assert [(p.layer, p.name, p.in_dims, p.out_dims) for p in q] == [(1, "self_attn.q_proj", 64, 64)]


def test_tied_and_quantized_heads_and_linears_are_found(tiny):
    import mlx.nn as nn

    tiny.model.tie_word_embeddings = True
    (head,) = kernels.projections(tiny, names=["lm_head"])
    assert isinstance(head.module, nn.Embedding) and (head.in_dims, head.out_dims) == (64, 97)
    nn.quantize(tiny.model, group_size=32, bits=4)
    projs = kernels.projections(tiny, layers=[0, tiny.n_layers], names=["down_proj", "lm_head"])
    assert [type(p.module).__name__ for p in projs] == ["QuantizedLinear", "QuantizedEmbedding"]
    assert [(p.in_dims, p.out_dims) for p in projs] == [(128, 64), (64, 97)]


@pytest.mark.linux_cpu_reference
def test_stored_quantized_modules_are_measured_as_loaded(tiny):
    import mlx.nn as nn

    nn.quantize(tiny.model, group_size=32, bits=4)
    projs = kernels.projections(tiny, layers=[0, tiny.n_layers], names=["q_proj", "lm_head"])
    inputs = kernels.capture_inputs(tiny, _tokens(), projs, max_rows=8, synthetic=False)
    df = kernels.sweep(tiny, inputs, projs, ["model", "dense:float32"], ts=[1, 2, 8])
    model = df[df["path"] == "model"]
    assert set(model["quant"]) == {"affine-q4-g32"} and set(df[df["path"] == "dense:float32"]["quant"]) == {""}
    assert (df[df["metric"].isin(DRIFT)]["value"] == 0).all()
    # Both paths are scored against the exact dequantized weights: the float32 one is near exact, the
    # CPU's bf16 quantized kernel (scalar _qmm_t, accumulating in bf16) is not.
    err = df[df["metric"] == "err_rel_l2"].groupby("path")["value"].max()
    assert err["dense:float32"] < 1e-6 and 1e-4 < err["model"] < 5e-2


def test_projections_reject_unknown_layer_and_name(tiny):
    with pytest.raises(GemmdriftError, match="unknown layer 99"):
        kernels.projections(tiny, layers=[99])
    with pytest.raises(GemmdriftError, match="unknown projection 'nope'.*self_attn.q_proj"):
        kernels.projections(tiny, names=["nope"])
    with pytest.raises(GemmdriftError, match="no projection matches"):
        kernels.projections(tiny, layers=[0], names=["lm_head"])


# ------------------------------------------------------------------------ capture


def test_capture_records_real_rows_and_restores_the_model(tiny):
    import mlx.core as mx

    model = tiny.model
    projs = kernels.projections(tiny, layers=[0, tiny.n_layers], names=["q_proj", "down_proj", "lm_head"])
    originals = [p.parent[p.attr] for p in projs if not p.is_head]
    norm = model.model["norm"]
    tokens = _tokens()
    before = model(mx.array(tokens)[None])
    inputs = kernels.capture_inputs(tiny, tokens, projs, max_rows=8, synthetic=False)

    # q_proj's input is layer 0's input_layernorm of the scaled embedding.
    h = model.model.embed_tokens(mx.array(tokens)[None])
    h = h * mx.array(64**0.5, mx.bfloat16).astype(h.dtype)
    ln = np.array(model.layers[0].input_layernorm(h)[0].astype(mx.float32))
    key = (0, "self_attn.q_proj")
    assert inputs[key].shape == (8, 64)
    np.testing.assert_array_equal(inputs[key], ln[inputs.positions[key]])
    # The LM head's input is the final norm's output.
    final = np.array(model.model(mx.array(tokens)[None])[0].astype(mx.float32))
    head = (tiny.n_layers, "lm_head")
    np.testing.assert_array_equal(inputs[head], final[inputs.positions[head]])
    assert inputs[(0, "mlp.down_proj")].shape == (8, 128)
    assert not inputs.synthetic and inputs.dtype == "bfloat16"

    # Every proxy is gone and the model computes what it computed before.
    assert all(a is b for a, b in zip([p.parent[p.attr] for p in projs if not p.is_head], originals))
    assert model.model["norm"] is norm
    np.testing.assert_array_equal(np.array(model(mx.array(tokens)[None]).astype(mx.float32)),
                                  np.array(before.astype(mx.float32)))


def test_capture_keeps_distinct_rows_only():
    rows = np.array([[1, 2], [1, 2], [3, 4], [1, 2], [5, 6]], np.float32)
    np.testing.assert_array_equal(kernels.distinct_rows(rows, 10), [0, 2, 4])
    np.testing.assert_array_equal(kernels.distinct_rows(rows, 2), [0, 4])


def test_synthetic_rows_are_seeded_unit_rms_bf16(tiny):
    projs = kernels.projections(tiny, layers=[0], names=["q_proj"])
    a = kernels.capture_inputs(tiny, [], projs, max_rows=5)  # the tiny model's weights are synthetic
    b = kernels.capture_inputs(tiny, [], projs, max_rows=5)
    rows = a[(0, "self_attn.q_proj")]
    assert a.synthetic and rows.shape == (5, 64)
    np.testing.assert_array_equal(rows, b[(0, "self_attn.q_proj")])
    np.testing.assert_allclose(np.sqrt(np.mean(rows.astype(np.float64) ** 2, axis=1)), 1.0, rtol=1e-2)
    metrics.storage_bits(rows, "bfloat16")  # raises unless every value is a bfloat16 value


# --------------------------------------------------------------- (a) real kernels


@pytest.mark.linux_cpu_reference
def test_real_cpu_kernels_are_row_invariant_on_captured_rows(tiny):
    # The honest CPU result: every real path gives bit-identical rows at every T.
    projs = kernels.projections(tiny, layers=[0, 3, tiny.n_layers])
    inputs = kernels.capture_inputs(tiny, _tokens(48), projs, max_rows=16, synthetic=False)
    df = kernels.sweep(tiny, inputs, projs, REAL_PATHS, ts=[*range(1, 18), 33, 64])
    drift = df[df["metric"].isin(DRIFT)]
    # T=1 repeats the first row alone: run-to-run determinism.
    assert set(drift["T"]) == {*range(1, 18), 33, 64}
    assert len(drift) == len(projs) * len(REAL_PATHS) * 19 * len(DRIFT)
    assert (drift["value"] == 0).all()
    assert not df["emulated"].any()
    assert set(df[df["metric"] == "worst_position"]["value"]) == {-1.0}
    summary = summaries.kernels_summary(df)
    assert summary["real_drift"] is False and summary["emulated_control_detected"] is None


@pytest.mark.linux_cpu_reference
@pytest.mark.slow
def test_real_gemma_layer0_is_row_invariant_and_the_control_is_not(embedded):
    from gemmdrift.prompts import builtin_text

    projs = kernels.projections(embedded, layers=[0], names=["q_proj", "down_proj"])
    tokens = embedded.tokenizer.encode(builtin_text("essay"))[:96]
    inputs = kernels.capture_inputs(embedded, tokens, projs, max_rows=64)
    assert not inputs.synthetic and len(inputs[(0, "mlp.down_proj")]) == 64
    df = kernels.sweep(embedded, inputs, projs, ["model", "quant:affine-q4-g64"], ts=[1, 2, 3, 8])
    drift = df[df["metric"].isin(DRIFT)]
    assert sorted(set(drift["T"])) == [1, 2, 3, 8] and len(drift) == 2 * 2 * 4 * len(DRIFT)
    assert (drift["value"] == 0).all()
    assert not df["synthetic"].any() and set(df["inputs"]) == {"captured"}
    # bf16 dense with fp32 accumulation: output rounding only (rel. error well below 2**-8).
    assert _value(df, "err_rel_l2", 1, path="model", projection="self_attn.q_proj") < 2 ** -8
    # The emulated split-K control flips bf16 roundings on the same real rows (K=2048, 64 x 640 outputs).
    control = kernels.sweep(embedded, inputs, projs[:1], ["emulated:splitk4"], ts=[1, 64])
    assert projs[0].name == "mlp.down_proj" and _value(control, "rows_differ", 64) > 0


# ------------------------------------------------------- (b) the negative control


def _split_k_operands(rng, rows: int, n: int):
    """Dyadic operands whose split-K partial sums are exact in float32 in any summation order.

    K=64 in 3 partitions [0,22), [22,43), [43,64). Partition 0 holds integer
    products (sums < 2**21), partition 2 their exact negatives, partition 1
    products on a 2**-16 grid (sums < 21). Adding partition 1 to partition 0's
    large sum rounds in float32, so the order of the reduction shows in the
    bf16 result while every partial is order-independent.
    """
    x = np.zeros((rows, 64))
    w = np.zeros((n, 64))
    x[:, :21] = rng.integers(-255, 256, (rows, 21))
    w[:, :21] = rng.integers(-255, 256, (n, 21))
    x[:, 22:43] = rng.integers(-255, 256, (rows, 21)) / 256
    w[:, 22:43] = rng.integers(-255, 256, (n, 21)) / 256
    x[:, 43:64] = x[:, :21]
    w[:, 43:64] = -w[:, :21]
    return x, w


def test_emulated_split_k_is_detected_and_matches_numpy(tiny):
    rng = np.random.default_rng(3)
    (proj,) = kernels.projections(tiny, layers=[0], names=["gate_proj"])
    x, w = _split_k_operands(rng, 16, proj.out_dims)
    _set_weight(proj, w)
    ts = [1, 2, 3, 8, 16, 33]
    df = kernels.sweep(tiny, {proj.key: x.astype(np.float32)}, [proj], ["emulated:splitk3"], ts=ts)
    assert df["emulated"].all() and set(df["path"]) == {"emulated:splitk3"}

    # Independent numpy: float32 partials (exact by construction), summed in order, rounded to bf16.
    x32, w32 = x.astype(np.float32), w.astype(np.float32)
    acc = np.zeros((16, proj.out_dims), np.float32)
    for lo, hi in [(0, 22), (22, 43), (43, 64)]:
        acc = acc + x32[:, lo:hi] @ w32[:, lo:hi].T
    split = metrics.round_to(acc.astype(np.float64), "bfloat16").astype(np.float32)
    single = _gemv(proj, x)
    exact = x @ w.T
    for t in ts[1:]:
        idx = np.arange(t) % 16
        expect = metrics.compare(single[idx], split[idx], "bfloat16")
        rows_differ = np.count_nonzero((single[idx] != split[idx]).any(axis=1))
        assert _value(df, "frac_differ", t) == expect["frac_differ"]
        assert _value(df, "max_ulp", t) == expect["max_ulp"]
        assert _value(df, "rows_differ", t) == rows_differ
        assert _value(df, "err_max_ulp", t) == metrics.error_vs_exact(split[idx], exact[idx], "bfloat16")["err_max_ulp"]
    assert _value(df, "rows_differ", 16) > 0 and _value(df, "max_ulp", 16) >= 1
    assert summaries.kernels_summary(df)["emulated_control_detected"] is True


def test_emulated_control_runs_the_real_kernel_at_t1(tiny):
    projs = kernels.projections(tiny, layers=[0, 1])
    inputs = kernels.capture_inputs(tiny, _tokens(48), projs, max_rows=16, synthetic=False)
    df = kernels.sweep(tiny, inputs, projs, ["emulated:splitk3", "model"], ts=[1])
    a = df[df["path"] == "model"].set_index(["layer", "projection", "metric"])["value"]
    b = df[df["path"] == "emulated:splitk3"].set_index(["layer", "projection", "metric"])["value"]
    assert {"err_rel_l2", "err_max_ulp", "max_ulp"} <= set(a.index.get_level_values("metric"))
    assert len(a) == len(b) and a.sort_index().equals(b.sort_index())


# ------------------------------------------------------ (c) float64 reference


def test_integer_operands_are_exact_on_every_path(tiny):
    rng = np.random.default_rng(5)
    (proj,) = kernels.projections(tiny, layers=[0], names=["gate_proj"])
    w = rng.integers(0, 16, (proj.out_dims, 64)).astype(np.float64)
    w[:, 0], w[:, 1] = 0, 15  # every 64-group spans 0..15: q4 scale 1, bias 0, integer codes
    x = np.zeros((12, 64))
    for r in range(12):
        x[r, rng.choice(64, size=8, replace=False)] = 1  # sums <= 120: exact in bf16 in any order
    _set_weight(proj, w)
    paths = ["model", "dense:float16", "dense:float32", "quant:affine-q4-g64", "emulated:splitk3"]
    df = kernels.sweep(tiny, {proj.key: x.astype(np.float32)}, [proj], paths, ts=[1, 2, 5, 12])
    err = df[df["metric"].str.startswith("err_")]
    assert set(err["path"]) == set(paths) and set(err["T"]) == {1, 2, 5, 12}
    assert (err["value"] == 0).all()


def test_bf16_output_rounding_gives_known_error(tiny):
    (proj,) = kernels.projections(tiny, layers=[0], names=["gate_proj"])
    w = np.zeros((proj.out_dims, 64))
    w[:, 0], w[:, 1], w[:, 2] = 255, 1, 1
    x = np.zeros((4, 64))
    x[:, :3] = 1
    x[np.arange(4), 3 + np.arange(4)] = 1  # distinct rows; column 3+ holds zero weights
    _set_weight(proj, w)
    df = kernels.sweep(tiny, {proj.key: x.astype(np.float32)}, [proj], ["model", "dense:float32"], ts=[1, 4])
    # 257 is exact in float32; bf16 rounds it to 256 (ties to even): half a ULP, the correct rounding.
    for t in (1, 4):
        assert _value(df, "err_max_abs", t, path="model") == 1.0
        assert _value(df, "err_max_ulp", t, path="model") == 0.0
        assert _value(df, "err_max_abs", t, path="dense:float32") == 0.0


# ----------------------------------------------------------- plan and checkpoint


def test_plan_respects_budget_and_keeps_smallest_block():
    ts = kernels.DEFAULT_TS
    assert kernels.plan_ts(ts, 1.0, 64, flop_budget=1e12) == [t for t in ts if t >= 2]
    assert kernels.plan_ts(ts, 1.0, 64, flop_budget=1e12, max_t=64) == [t for t in ts if 2 <= t <= 64]
    # Each block costs T GEMM rows plus GEMV rows for the distinct rows it needs.
    assert kernels.plan_ts([1, 2, 3, 4], 1.0, 64, flop_budget=2 + 2 + 3 + 1, always_t=1) == [2, 3]
    assert kernels.plan_ts([2, 512], 1e9, 64, flop_budget=1.0, always_t=1) == [2]
    # A vocabulary-sized head still gets the small block sizes.
    assert kernels.plan_ts(kernels.DEFAULT_TS, 3.35e8, 64) == [2, 3, 4]
    assert kernels.plan_ts([1], 1.0, 4) == []


def test_checkpoint_resumes_without_recomputing(tiny, tmp_path, monkeypatch):
    projs = kernels.projections(tiny, layers=[0], names=["q_proj", "k_proj"])
    inputs = kernels.capture_inputs(tiny, _tokens(), projs, max_rows=4, synthetic=False)
    first = kernels.sweep(tiny, inputs, projs, ["model", "emulated:splitk3"], ts=[1, 2, 3], checkpoint=tmp_path)
    assert len(list((tmp_path / "units").glob("*.csv"))) == 4

    def fail(*args, **kwargs):
        raise AssertionError("a checkpointed unit was recomputed")

    monkeypatch.setattr(kernels.runs, "build_operator", fail)
    again = kernels.sweep(tiny, inputs, projs, ["model", "emulated:splitk3"], ts=[1, 2, 3], checkpoint=tmp_path)
    cols = ["layer", "projection", "path", "quant", "emulated", "T", "metric", "value"]
    assert again[cols].equals(first[cols])
    with pytest.raises(GemmdriftError, match="belongs to another sweep"):
        kernels.sweep(tiny, inputs, projs, ["model"], ts=[1, 2], checkpoint=tmp_path)


# -------------------------------------------------------------------- other ops


@pytest.mark.linux_cpu_reference
def test_ops_are_row_invariant_on_cpu(tiny):
    df = kernels.ops_sweep(tiny, query_lengths=[1, 2, 8, 9], key_lengths=[16, 40])
    assert set(df["projection"]) == {"sdpa", "softmax", "rope", "rms_norm"}
    assert set(df[df["projection"] == "sdpa"]["path"]) == {"mask=causal", "mask=array"}
    assert df["synthetic"].all() and set(df["inputs"]) == {"synthetic"}
    # The tiny model has one attention geometry per RoPE base: sliding and global layers.
    assert set(df["layer"]) == {0, 1}
    drift = df[df["metric"].isin(DRIFT)]
    assert (drift["value"] == 0).all()
    assert set(drift[drift["projection"] == "sdpa"]["T"]) == {1, 2, 8, 9}


# ----------------------------------------------------------------- bad input


def test_bad_input_is_a_user_error(tiny, monkeypatch):
    projs = kernels.projections(tiny, layers=[0], names=["q_proj"])
    inputs = kernels.capture_inputs(tiny, [], projs, max_rows=2)
    with pytest.raises(GemmdriftError, match="positive"):
        kernels.sweep(tiny, inputs, projs, ["model"], ts=[0, 2])
    with pytest.raises(GemmdriftError, match="positive"):
        kernels.plan_ts([-1], 1.0, 4)
    with pytest.raises(GemmdriftError, match="at least 1"):
        kernels.time_projection(tiny, projs[0], "model", 0)
    with pytest.raises(GemmdriftError, match="unknown quantization mode 'foo'"):
        kernels.parse_path("quant:foo-q4-g64")
    with pytest.raises(GemmdriftError, match="unsupported bits 7"):
        kernels.parse_path("quant:affine-q7-g64")
    with pytest.raises(GemmdriftError, match="unknown path"):
        kernels.parse_path("gemm")
    with pytest.raises(GemmdriftError, match="P >= 2"):
        kernels.parse_path("emulated:splitk1")
    with pytest.raises(GemmdriftError, match="no input rows"):
        kernels.sweep(tiny, {}, projs, ["model"], ts=[1, 2])
    monkeypatch.setattr("gemmdrift.model.available_quant_modes", lambda: ["affine"])
    with pytest.raises(GemmdriftError, match="mxfp4.*not available"):
        kernels.parse_path("quant:mxfp4-q4-g32")


# -------------------------------------------------------------- timing, output


def test_time_projection_evaluates_one_block(tiny, monkeypatch):
    import mlx.core as mx

    (proj,) = kernels.projections(tiny, layers=[0], names=["up_proj"])
    body = kernels.time_projection(tiny, proj, "quant:affine-q4-g64", 8)
    calls = []
    original = mx.eval
    monkeypatch.setattr(mx, "eval", lambda *a: calls.append(a) or original(*a))
    assert body() is None
    assert len(calls) == 1 and calls[0][0].shape == (1, 8, proj.out_dims)
    assert calls[0][0].dtype == mx.bfloat16


def test_write_kernels_outputs(tiny, tmp_path):
    projs = kernels.projections(tiny, layers=[0, tiny.n_layers], names=["q_proj", "lm_head"])
    inputs = kernels.capture_inputs(tiny, [], projs, max_rows=4)
    df = kernels.sweep(tiny, inputs, projs, ["model", "emulated:splitk3"], ts=[1, 2, 16])

    df = pd.concat([df, kernels.ops_sweep(tiny, ops=["rope"], query_lengths=[1, 2], key_lengths=[8])],
                   ignore_index=True)
    env = {"backend": "cpu", "mlx": "0.32.4"}
    result = kernels.kernels_result(df, {"model": tiny.info, "inputs": inputs.describe()}, env)
    written = store.write_result(result, tmp_path)
    for name in ("kernels.csv", "meta.json", "summary.json", "kernels_heatmap.png", "kernels_vs_t.png",
                 "ops_vs_t.png", "result.json"):
        assert (tmp_path / name).stat().st_size > 0
    assert {"kernels", "meta", "summary", "fig_kernels_heatmap", "fig_kernels_vs_t", "fig_ops_vs_t"} <= set(written)
    # The tracked figures: worst over projections per path and T, as bits lost.
    assert result.figure("bits_lost/model/2") == 0.0 and result.figure("ops_bits_lost/rope") == 0.0
    assert result.figure("rows_differ/model/16") == 0.0 and result.figure("err_rel_l2/model/1") > 0
    assert store.read_result(tmp_path).figures == result.figures
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["real_drift"] is False and summary["synthetic"] is True
    assert [p["path"] for p in summary["paths"]] == ["model", "emulated:splitk3"]
    assert summary["ops"][0]["op"] == "rope"
    text = summaries.print_kernels(df)
    assert "EMULATED negative control" in text and "== model" in text and "rope" in text
    # The CSV reads back into the same printout and summary (empty quant labels come back as NaN).
    saved = pd.read_csv(tmp_path / "kernels.csv")
    assert summaries.print_kernels(saved) == text
    assert json.loads(json.dumps(summaries.kernels_summary(saved))) == summary
    marks, origin = kernels.plot_thresholds(df, env)
    assert origin.startswith("Metal (reference)") and set(marks) == {"self_attn.q_proj", "lm_head"}
    assert (2, "gemv_wide k_lanes=32", "matmul") in marks["self_attn.q_proj"]


# ------------------------------------------------------------------ dispatch


def test_dispatch_thresholds_from_source():
    def gemma(chip, version, op, **kw):
        return [(t.T, t.label) for t in dispatch.thresholds("metal", version, op, chip=chip, max_t=64, **kw)]

    assert dispatch.thresholds("cpu", "0.32.4", "matmul") == []
    # gemv_wide (M3+, bf16, K % 4 == 0) arrived in v0.32.1.
    assert gemma("M3 Max", "0.32.1", "matmul", K=640, N=1024, dtype="bfloat16")[:2] == [
        (1, "gemv"), (2, "gemv_wide k_lanes=32")]
    assert gemma("M3 Max", "0.32.0", "matmul", K=640, N=1024, dtype="bfloat16")[1][1] != "gemv_wide k_lanes=32"
    # Field reports: M1 Ultra 4-bit linears break at T=12, M5 Max at T=2 and T=10 (v0.32.0, Gemma 4 31B).
    q = dict(K=5376, N=21504, mode="affine", bits=4, group_size=64)
    assert [t for t, _ in gemma("M1 Ultra", "0.32.0", "quantized_matmul", **q)] == [1, 12]
    assert [t for t, _ in gemma("M5 Max", "0.32.0", "quantized_matmul", **q)] == [1, 2, 10]
    # Gemma 3 270M attention: vector kernel up to 8 queries, head dim 256 is unfused beyond.
    sdpa = gemma("M3 Max", "0.32.4", "sdpa", k_len=1024, head_dim=256, n_heads=4, n_kv_heads=1)
    assert sdpa == [(1, "sdpa_vector_2pass"), (9, "unfused (matmul, softmax, matmul)")]
    assert all(t.source.startswith("mlx/backend/") for t in dispatch.thresholds(
        "cuda", "0.32.4", "quantized_matmul", K=640, N=1024, mode="affine", bits=4, group_size=64, max_t=16))
    assert dispatch.thresholds("metal", "0.26.3", "matmul", K=640, N=1024) == []  # older than the first tag read
    assert [t.T for t in dispatch.thresholds("metal", "0.29.0", "matmul", K=640, N=1024)] == [1, 2, 16]


@pytest.mark.linux_cpu_reference
def test_shape_models_probe_one_projection_at_real_shapes():
    # Synthetic weights at Gemma 4 31B shapes: one projection is materialized, never the model.
    import importlib.util

    name = "shape:gemma4-31b" if importlib.util.find_spec("mlx_lm.models.gemma4_text") else "shape:gemma3-27b"
    lm = load_model(name)
    projs = kernels.projections(lm, layers=[0], names=["self_attn.k_proj"])
    assert (projs[0].in_dims, projs[0].out_dims) == ((5376, 4096) if "gemma4" in name else (5376, 2048))
    inputs = kernels.capture_inputs(lm, [], projs, max_rows=4)
    df = kernels.sweep(lm, inputs, projs, ["model"], [1, 2])
    assert df["synthetic"].all() and set(df["inputs"]) == {"synthetic"}
    assert summaries.kernels_summary(df)["synthetic"] is True
    drift = df[(df["metric"] == "max_ulp") & (df["T"] == 2)]["value"]
    assert (drift == 0).all()  # row-invariant on this backend, synthetic or not


def test_ops_thresholds_follow_the_metal_sdpa_rule():
    # Metal's sdpa_vector takes q_len <= 8 with q_len * (heads / kv_heads) <= 32 (scaled_dot_product_attention.cpp);
    # head dim 256 has no full kernel, so past that it is the unfused path.
    def rows(heads, kv_heads):
        return pd.DataFrame([{"layer": 0, "projection": "sdpa", "path": "mask=causal", "dtype": "bfloat16",
                              "quant": "", "emulated": False, "synthetic": True, "inputs": "synthetic", "K": 256,
                              "N": np.nan, "key_length": 1024, "T": t, "metric": "max_ulp", "value": 0.0,
                              "heads": heads, "kv_heads": kv_heads} for t in range(1, 17)])

    env = {"backend": "cpu", "mlx": "0.32.4"}
    marks, origin = kernels.ops_thresholds(rows(4, 1), env)  # Gemma 3 270M: 4 heads, 1 KV head
    assert marks == {"sdpa": [(9, "unfused (matmul, softmax, matmul)", "sdpa")]}
    assert origin.startswith("Metal (reference)")
    assert kernels.ops_thresholds(rows(8, 1), env)[0]["sdpa"][0][0] == 5  # 5 * 8 > 32
    # Before v0.30.4 (#3023) no q_len * gqa <= 32 gate: the vector kernel up to 8 queries whatever the GQA.
    assert kernels.ops_thresholds(rows(8, 1), {"backend": "cpu", "mlx": "0.29.4"})[0]["sdpa"][0][0] == 9
    assert kernels.ops_thresholds(rows(8, 1), {"backend": "cpu", "mlx": "0.26.3"})[0] == {}  # rules not read


@pytest.mark.parametrize("damage", ["garbage", "empty", "record"])
def test_a_corrupt_kernels_checkpoint_is_discarded_and_recomputed(tiny, tmp_path, capsys, damage):
    # Regression: a corrupt unit CSV (or sweep.json) crashed the resume with a traceback.
    projs = kernels.projections(tiny, layers=[0], names=["q_proj"])
    inputs = kernels.capture_inputs(tiny, _tokens(), projs, max_rows=4, synthetic=False)
    first = kernels.sweep(tiny, inputs, projs, ["model"], ts=[1, 2, 3], checkpoint=tmp_path)
    [unit] = list((tmp_path / "units").glob("*.csv"))
    victim = {"garbage": unit, "empty": unit, "record": tmp_path / "sweep.json"}[damage]
    victim.write_text({"garbage": "a,b\n1,2\n", "empty": "", "record": "{not json"}[damage])
    capsys.readouterr()
    again = kernels.sweep(tiny, inputs, projs, ["model"], ts=[1, 2, 3], checkpoint=tmp_path)
    assert "is corrupt" in capsys.readouterr().err
    cols = ["layer", "projection", "path", "T", "metric", "value"]
    assert again[cols].equals(first[cols])
    assert unit.is_file() and json.loads((tmp_path / "sweep.json").read_text())["ts"] == [1, 2, 3]


def test_units_in_two_processes_are_the_units_of_one(tmp_path):
    """sweep() runs its (projection, path) units in two processes (gemmdrift.workers), longest first: the same
    table, in the same order, and every unit checkpointed by the process that measured it."""
    from gemmdrift.model import load_model
    from test_models import save_tiny

    save_tiny(tmp_path / "m")
    lm = load_model(str(tmp_path / "m"), dtype="bfloat16")
    projs = kernels.projections(lm, layers=[0, lm.n_layers])
    inputs = kernels.capture_inputs(lm, _tokens(), projs, max_rows=4, synthetic=False)
    paths = ["model", "quant:affine-q4-g64", "emulated:splitk3"]
    one = kernels.sweep(lm, inputs, projs, paths, ts=[1, 2, 3], workers=1)
    two = kernels.sweep(lm, inputs, projs, paths, ts=[1, 2, 3], workers=2, checkpoint=tmp_path / "ck")
    assert len(one) and one.equals(two)
    assert len(list((tmp_path / "ck" / "units").glob("*.csv"))) == len(projs) * len(paths)
    assert set(one["projection"]) == {p.name for p in projs}


@pytest.mark.parametrize("stored", ["dense", "quantized"])
def test_a_detached_projection_computes_what_the_model_s_does(tiny, stored):
    """kernels.detach/attach carry one projection out of the model (pickled, for asv's time_ processes): the
    rebuilt module gives bit for bit the outputs of the loaded one on every path, linears and a tied head."""
    import pickle

    import mlx.core as mx
    import mlx.nn as nn

    tiny.model.tie_word_embeddings = True
    if stored == "quantized":
        nn.quantize(tiny.model, group_size=32, bits=4)
    projs = kernels.projections(tiny, layers=[0, tiny.n_layers], names=["up_proj", "lm_head"])
    rows = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)
    for proj in projs:
        lm2, proj2 = kernels.attach(pickle.loads(pickle.dumps(kernels.detach(tiny, proj))))
        assert type(proj2.module) is type(proj.module) and (proj2.in_dims, proj2.out_dims) == (proj.in_dims, proj.out_dims)
        x = mx.array(rows[:, :proj.in_dims] if proj.in_dims <= 64 else np.tile(rows, (1, 2)))[None].astype(mx.bfloat16)
        for path in ("model", "dense:float32", "quant:affine-q8-g32", "emulated:splitk3"):
            a = kernels.build_operator(tiny, proj, kernels.parse_path(path))
            b = kernels.build_operator(lm2, proj2, kernels.parse_path(path))
            for run in ("run", "run_block"):
                ya, yb = getattr(a, run)(x.astype(getattr(mx, a.in_dtype))), getattr(b, run)(x.astype(getattr(mx, b.in_dtype)))
                assert ya.dtype == yb.dtype and np.array_equal(np.array(ya.astype(mx.float32)),
                                                               np.array(yb.astype(mx.float32))), (proj.name, path, run)
    with pytest.raises(GemmdriftError, match="cannot detach"):
        kernels.detach(tiny, kernels.Projection(0, "x", 1, 1, object(), None, None))
