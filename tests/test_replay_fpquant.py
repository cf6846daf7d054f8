"""The fp-quantized recipes (mxfp4, nvfp4, mxfp8; issue 31 item 6): fp_qmv, fp_qmv_fast, fp_qmv_wide, fp_qmm_t.

Known answers, written here without the replay's code:

* a lane-by-lane emulation of ml-explore/mlx 846d176 ``mlx/backend/metal/kernels/fp_quantized.h``
  (``fp_qmv_fast_impl`` L325-398, ``fp_qmv_impl`` L400-559, ``qdot`` L81-100, ``fp_qmv_wide_impl`` L561-674,
  the ``dequantize`` of ``fp_qmm_t_impl``'s loader L138-147) with float32 scalars vectorised over the outputs
  only, its own unpacking of the uint32 words and its own decoding of the codes through the kernels' half bit
  tricks (``fp4.h`` L36-40, ``fp8.h`` L32-38 and L74-77); fma through the 64-bit long double (exact product,
  one rounding to 64 bits, then to 24: 64 >= 2*24 + 2, so the double rounding is innocuous);
* with exactly representable inputs (few-bit x, codes and scales chosen so every partial sum is exact even
  in float16), the float64 product of ``mx.dequantize``'s weights, which ``mx.quantized_matmul`` on this CPU
  must equal too;
* on a seeded wide-range input the qmv recipes are not a plain chain (so the emulation test can fail).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from gemmdrift import replay as R
from gemmdrift.errors import GemmdriftError
from gemmdrift.replay import fpquant as rf
from gemmdrift.replay.paths import plan_for, run_plan

F = np.float32
MODES = {"mxfp4": (4, 32), "nvfp4": (4, 16), "mxfp8": (8, 32)}


# ------------------------------------------------------------------------------ the test's own kernel reading


def _half_bits(u) -> np.ndarray:
    return np.asarray(u, dtype=np.uint16).view(np.float16).astype(F)


def _codes_and_scales(wq: np.ndarray, sc: np.ndarray, bits: int, g: int):
    """Element values (N, K) and scale values (N, K/g), decoded as fp4.h / fp8.h do (half bit patterns)."""
    N, words = wq.shape
    per = 32 // bits
    raw = np.zeros((N, words * per), dtype=np.uint32)
    for j in range(words):
        for i in range(per):
            raw[:, j * per + i] = (wq[:, j].astype(np.uint32) >> (bits * i)) & ((1 << bits) - 1)
    if bits == 4:  # half((b & 7) << 9) * 16384, negated if b & 8
        mag = _half_bits((raw & 7) << 9) * F(16384)
        vals = np.where(raw & 8, -mag, mag).astype(F)
    else:  # half((b & 127) << 7) * 256, negated if b & 128
        mag = (_half_bits((raw & 127) << 7) * F(256)).astype(F)
        vals = np.where(raw & 128, -mag, mag).astype(F)
    s = sc.astype(np.uint32)
    if g == 16:
        smag = (_half_bits((s & 127) << 7) * F(256)).astype(F)
        svals = np.where(s & 128, -smag, smag).astype(F)
    else:
        svals = np.where(s == 0, np.uint32(0x400000), s << np.uint32(23)).astype(np.uint32).view(F)
    return vals, svals


def _fma(a, b, c):
    L = np.longdouble
    return (np.asarray(a, F).astype(L) * np.asarray(b, F).astype(L) + np.asarray(c, F).astype(L)).astype(F)


def _shuffle_ladder(vals: list, offsets) -> np.ndarray:
    """Lane 0 after ``r += simd_shuffle_down(r, off)`` for each offset (lanes past the end keep their value)."""
    n = len(vals)
    for off in offsets:
        vals = [(vals[i] + (vals[i + off] if i + off < n else vals[i])).astype(F) for i in range(n)]
    return vals[0]


def _emulate_qmv(x, vals, svals, bits: int, g: int, fast: bool) -> np.ndarray:
    """fp_qmv(_fast): every lane of the simdgroup in turn, blocks in order; simd_sum read as the xor ladder 16..1."""
    T, K = x.shape
    N = vals.shape[0]
    vpt = (32 // bits) * (2 if fast else 1)
    block = 32 * vpt
    lanes = []
    for lane in range(32):
        result = np.zeros((T, N), dtype=F)
        for b0 in range(0, K, block):
            k0 = b0 + lane * vpt
            if k0 >= K:  # remaining == 0: this lane adds nothing in the tail block
                continue
            accum = np.zeros((T, N), dtype=F)
            if bits == 4:
                for i in range(vpt // 4):
                    ks = [k0 + 4 * i + j for j in range(4)]
                    p = [(x[:, k:k + 1] * vals[:, k][None, :]).astype(F) for k in ks]
                    accum = (accum + (((p[0] + p[1]).astype(F) + p[2]).astype(F) + p[3]).astype(F)).astype(F)
            else:
                for k in range(k0, k0 + vpt):
                    accum = (accum + (x[:, k:k + 1] * vals[:, k][None, :]).astype(F)).astype(F)
            s = svals[:, k0 // g][None, :]
            result = (result + (s * accum).astype(F)).astype(F)  # qdot returns scale * accum; result += it
        lanes.append(result)
    return _shuffle_ladder(lanes, (16, 8, 4, 2, 1))


def _emulate_qmv_wide(x, vals, svals, g: int) -> np.ndarray:
    """fp_qmv_wide, k_lanes 16: lane l takes groups l, l+16, ...; dot() as ((p0+p1)+p2)+p3; fma(s, acc, r)."""
    T, K = x.shape
    N = vals.shape[0]
    lanes = []
    for lane in range(16):
        result = np.zeros((T, N), dtype=F)
        for grp in range(lane, K // g, 16):
            acc = np.zeros((T, N), dtype=F)
            for j in range(g // 4):
                ks = [grp * g + 4 * j + i for i in range(4)]
                p = [(x[:, k:k + 1] * vals[:, k][None, :]).astype(F) for k in ks]
                acc = (acc + (((p[0] + p[1]).astype(F) + p[2]).astype(F) + p[3]).astype(F)).astype(F)
            result = _fma(svals[:, grp][None, :], acc, result)
        lanes.append(result)
    return _shuffle_ladder(lanes, (8, 4, 2, 1))


def _round(a, dtype: str) -> np.ndarray:
    a = np.asarray(a, F)
    if dtype == "float16":
        return a.astype(np.float16).astype(F)
    return np.array(mx.array(a).astype(mx.bfloat16).astype(mx.float32))


def _emulate_qmm_t(x, vals, svals, g: int, dtype: str) -> np.ndarray:
    """fp_qmm_t, split 1: weights T(T(s) * code) in threadgroup memory, then the MMA8 chain (H1: k in order)."""
    w = _round(_round(np.repeat(svals, g, axis=1), dtype) * vals, dtype)
    acc = np.zeros((x.shape[0], w.shape[0]), dtype=F)
    for k in range(x.shape[1]):
        acc = (acc + (x[:, k:k + 1] * w[:, k][None, :]).astype(F)).astype(F)
    return acc


def _quantized(seed: int, N: int, K: int, mode: str, dtype=np.float16):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((N, K)).astype(dtype)
    wq, sc = mx.quantize(mx.array(w), mode=mode)[:2]
    return np.array(wq), np.array(sc)


def _cancelling(seed: int, T: int, N: int, K: int, mode: str, dtype: str):
    """x and the quantized weight whose second half of K repeats the first (rotated by a group) with x negated:
    every exact output is 0, and each order leaves its own rounding residue (so a wrong order shows)."""
    rng = np.random.default_rng(seed)
    half = rng.standard_normal((N, K // 2)).astype(np.float16)
    g = MODES[mode][1]  # the repeat is rotated by one group, so no lane holds a term and its negation
    w = np.concatenate([half, np.roll(half, g, axis=1)], axis=1)
    wq, sc = (np.array(a) for a in mx.quantize(mx.array(w), mode=mode))
    xh = _wide_x(seed + 1, T, K // 2, dtype)
    return np.concatenate([xh, -np.roll(xh, g, axis=1)], axis=1), wq, sc


def _chain(x, vals, svals, g: int) -> np.ndarray:
    """The plain chain k = 0..K-1 of x * (scale * code) in float32 from +0."""
    w = vals * np.repeat(svals, g, axis=1)
    acc = np.zeros((x.shape[0], w.shape[0]), dtype=F)
    for k in range(x.shape[1]):
        acc = (acc + (x[:, k:k + 1] * w[:, k][None, :]).astype(F)).astype(F)
    return acc


def _wide_x(seed: int, T: int, K: int, dtype: str) -> np.ndarray:
    """Normal draws times 2**U(-8, 8): partial sums that round, so the order shows."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, K)) * 2.0 ** rng.uniform(-8, 8, (T, K))
    return _round(x.astype(F), dtype)


# ------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("mode", list(MODES))
def test_the_decoded_weights_are_mx_dequantize_bit_for_bit(mode):
    wq, sc = _quantized(1, 24, 256, mode)
    mine = rf.dequantize(wq, sc, mode, 256)
    ref = np.array(mx.dequantize(mx.array(wq), mx.array(sc), mode=mode, dtype=mx.float32))
    np.testing.assert_array_equal(mine.view(np.uint32), ref.view(np.uint32))
    vals, svals = _codes_and_scales(wq, sc, *MODES[mode])  # the test's own reading agrees with both
    np.testing.assert_array_equal((vals * np.repeat(svals, MODES[mode][1], axis=1)).view(np.uint32),
                                  ref.view(np.uint32))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("mode", list(MODES))
def test_the_numpy_quantizer_is_mx_quantize_bit_for_bit(mode, dtype):
    # mlx 0.32.4 rounds the e8m0 exponent up (846d176's fallback rounded log2 to the nearest): half the groups.
    rng = np.random.default_rng(13)
    mdt = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}[dtype]
    for scale in (1.0, 1e-3, 300.0):
        w = rng.standard_normal((32, 256)) * scale * 2.0 ** rng.uniform(-3, 3, (32, 1))
        if mode != "nvfp4":
            w[3, :64] = 0  # all-zero groups: exponent 0
        wm = mx.array(w.astype(F)).astype(mdt)
        wq, sc = rf.quantize(np.array(wm.astype(mx.float32)), mode, dtype)
        rq, rs = (np.array(a) for a in mx.quantize(wm, mode=mode)[:2])
        np.testing.assert_array_equal(sc, rs)
        np.testing.assert_array_equal(wq, rq)


def test_the_lookup_tables_cover_every_code():
    # e2m1: 0, 0.5, ..., 6 then the negatives (code 8 is -0); e8m0 0 is 2**-127, 255 +inf; e4m3 0x7E = 448.
    assert list(rf.E2M1[:8]) == [0, 0.5, 1, 1.5, 2, 3, 4, 6] and np.signbit(rf.E2M1[8]) and rf.E2M1[15] == -6
    assert rf.E8M0[127] == 1.0 and rf.E8M0[0] == F(2.0 ** -127) and np.isinf(rf.E8M0[255])
    assert rf.E4M3[0x7E] == 448 and rf.E4M3[0x38] == 1.0 and rf.E4M3[1] == 2.0 ** -9 and rf.E4M3[0xB8] == -1.0
    b = np.arange(127, dtype=np.uint32)  # every finite positive e4m3 code, through the kernel's half trick
    np.testing.assert_array_equal(rf.E4M3[:127], (_half_bits(b << 7) * F(256)).astype(F))


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kernel,fast", [("fp_qmv_fast", True), ("fp_qmv", False)])
def test_qmv_recipes_equal_the_lane_by_lane_emulation(mode, kernel, fast):
    bits, g = MODES[mode]
    K = 512 if fast else 320  # 320: a partial last block (fp_qmv's tail)
    x, wq, sc = _cancelling(2, 2, 16, K, mode, "bfloat16")
    vals, svals = _codes_and_scales(wq, sc, bits, g)
    want = _round(_emulate_qmv(x, vals, svals, bits, g, fast), "bfloat16")
    assert np.any(want != _round(_chain(x, vals, svals, g), "bfloat16"))  # the input tells orders apart
    got = R.replay_quantized(kernel, x, wq, sc, None, bits=bits, group_size=g, dtype="bfloat16", mode=mode).y
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("mode", list(MODES))
def test_qmv_wide_equals_the_lane_by_lane_emulation(mode):
    bits, g = MODES[mode]
    K = 1024 if g == 32 else 800  # 800 / 16 = 50 groups: the last round of 16 lanes is partial
    x, wq, sc = _cancelling(4, 3, 16, K, mode, "float16")
    vals, svals = _codes_and_scales(wq, sc, bits, g)
    want = _round(_emulate_qmv_wide(x, vals, svals, g), "float16")
    assert np.any(want != _round(_chain(x, vals, svals, g), "float16"))
    got = R.replay_quantized("fp_qmv_wide", x, wq, sc, None, bits=bits, group_size=g, dtype="float16", mode=mode,
                             params={"k_lanes": 16}).y
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("mode", list(MODES))
def test_qmm_t_equals_the_emulated_chain_on_rounded_weights(mode):
    bits, g = MODES[mode]
    x, wq, sc = _cancelling(6, 3, 16, 256, mode, "float16")
    vals, svals = _codes_and_scales(wq, sc, bits, g)
    want = _round(_emulate_qmm_t(x, vals, svals, g, "float16"), "float16")
    got = R.replay_quantized("fp_qmm_t", x, wq, sc, None, bits=bits, group_size=g, dtype="float16", mode=mode).y
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def _exact_operands(mode: str, N: int, K: int, seed: int):
    """Few-bit operands: x integers in [-2, 2], codes of magnitude <= 2 (e2m1) or e4m3 values 0.5..3, scales
    2**-1..2**1 (e8m0) or e4m3 0.5..2: every product is a multiple of 2**-2, and the sums stay far below
    2**9, so every partial sum is exact even in float16."""
    bits, g = MODES[mode]
    rng = np.random.default_rng(seed)
    if bits == 4:
        codes = rng.choice([0, 1, 2, 3, 4, 8, 9, 10, 11, 12], size=(N, K)).astype(np.uint32)  # 0..2 and signs
    else:
        codes = rng.choice([0x30, 0x38, 0x3C, 0x40, 0x44, 0xB8, 0xC0, 0x00], size=(N, K)).astype(np.uint32)
    per = 32 // bits
    words = np.zeros((N, K // per), dtype=np.uint32)
    for i in range(per):
        words |= codes[:, i::per] << np.uint32(bits * i)
    sc = rng.choice([126, 127, 128] if g == 32 else [0x30, 0x38, 0x40], size=(N, K // g)).astype(np.uint8)
    x = rng.integers(-2, 3, size=(3, K)).astype(F)
    return x, words, sc


@pytest.mark.parametrize("mode", list(MODES))
def test_exact_inputs_give_the_exact_product_in_every_recipe_and_on_this_cpu(mode):
    bits, g = MODES[mode]
    K = 512
    x, wq, sc = _exact_operands(mode, 16, K, 8)
    w64 = np.array(mx.dequantize(mx.array(wq), mx.array(sc), mode=mode, dtype=mx.float32)).astype(np.float64)
    exact = x.astype(np.float64) @ w64.T
    assert np.all(np.abs(exact) < 2 ** 9) and np.all(exact * 4 == np.round(exact * 4))
    want = exact.astype(F)  # exactly representable in float16 (and float32)
    cpu = np.array(mx.quantized_matmul(mx.array(x.astype(np.float16)), mx.array(wq), mx.array(sc), transpose=True,
                                       group_size=g, bits=bits, mode=mode).astype(mx.float32))
    np.testing.assert_array_equal(cpu, want)
    for kernel, rec in R.RECIPES.items():
        if not kernel.startswith("fp_"):
            continue
        for var in rec.variants():
            got = R.replay_quantized(kernel, x, wq, sc, None, bits=bits, group_size=g, dtype="float16", mode=mode,
                                     variant=var, params={"k_lanes": 16, "split_k": 2}).y
            np.testing.assert_array_equal(got, want, err_msg=f"{kernel} {var}")


@pytest.mark.parametrize("kernel", ["fp_qmv_fast", "fp_qmv", "fp_qmv_wide"])
def test_the_qmv_orders_are_not_a_plain_chain(kernel):
    # Guards the emulation tests: the lane orders round differently from k = 0..K-1 on a cancelling input.
    x, wq, sc = _cancelling(9, 2, 64, 512, "nvfp4", "float16")
    vals, svals = _codes_and_scales(wq, sc, 4, 16)
    got = R.replay_quantized(kernel, x, wq, sc, None, bits=4, group_size=16, dtype="float16", mode="nvfp4",
                             params={"k_lanes": 16}).y
    assert int(np.sum(got != _round(_chain(x, vals, svals, 16), "float16"))) > 16


def test_the_m5_max_rows_dispatch_fp_qmv_at_t1_and_fp_qmv_wide_from_t2():
    # mlxcel #1186's two fp rows (M5 Max, mlx b7c3dd6d = 0.32.0's fp kernels): T=1 qmv(_fast), T=2..4 qmv_wide.
    for mode, K, t1 in (("mxfp4", 5120, "fp_qmv_fast"), ("nvfp4", 5376, "fp_qmv")):
        kernels = [plan_for("M5 Max", "quantized_matmul", T=t, K=K, N=K, dtype="float16", mlx_version="0.32.0",
                            mode=mode).recipe.kernel for t in range(1, 5)]
        assert kernels == [t1, "fp_qmv_wide", "fp_qmv_wide", "fp_qmv_wide"]
    # The qmm on NAX (M5, T at the batch limit and split_k 1) has no recipe: one line that says so.
    with pytest.raises(GemmdriftError, match="qmm_t_nax"):
        plan_for("M5 Max", "quantized_matmul", T=40, K=4096, N=16384, dtype="float16", mlx_version="0.32.4",
                 mode="mxfp4")


def test_a_plan_runs_and_the_mode_must_match_the_recipe():
    wq, sc = _quantized(11, 16, 512, "mxfp4")
    x = _wide_x(12, 1, 512, "float16")
    plan = plan_for("M3", "quantized_matmul", T=1, K=512, N=16, dtype="float16", mlx_version="0.32.4", mode="mxfp4")
    y = run_plan(plan, x, dtype="float16", quant=(wq, sc, None, 4, 32))
    assert y.kernel == "fp_qmv_fast" and y.y.shape == (1, 16)
    with pytest.raises(GemmdriftError, match="not a recipe for mode"):
        R.replay_quantized("qmv_fast", x, wq, sc, None, bits=4, group_size=32, dtype="float16", mode="mxfp4")
    with pytest.raises(GemmdriftError, match="groups of 32"):
        R.replay_quantized("fp_qmv_fast", x, wq, sc, None, bits=4, group_size=16, dtype="float16", mode="mxfp4")


def test_replay_check_runs_the_fp_paths_and_finds_a_planted_fp_variant():
    # No Mac here: a planted device (the replay of M3 Max under a chosen variant, through the check's own code)
    # must be found identical under that variant on the fp paths, and the defaults must not all be.
    import json
    from pathlib import Path

    from gemmdrift import kernels
    from gemmdrift.model import load_model
    from gemmdrift.replay.check import check_paths, check_replay, planted_device

    records = json.loads((Path(__file__).parent / "data" / "env_records.json").read_text())
    env = {**records["M3 Max"], "mlx": "0.32.4"}
    lm = load_model("embedded", dtype="float16")  # float16 outputs show more of the order than bf16
    projs = kernels.projections(lm, layers=[0], names=["k_proj", "down_proj"])
    rng = np.random.default_rng(31)
    inputs = {p.key: rng.standard_normal((4, p.in_dims)) * 2.0 ** rng.integers(-10, 11, (4, p.in_dims))
              for p in projs}
    paths = ["quant:mxfp4-q4-g32", "quant:nvfp4-q4-g16"]
    assert [s.quant.mode for s in check_paths(paths)] == ["mxfp4", "nvfp4"]
    planted = "simd_sum=xor1,contract=none,qdot_add=fma"
    result = check_replay(lm, inputs, projs, paths, (1, 2), env=env, mlx_version="0.32.4",
                          device=planted_device("M3 Max", planted, "0.32.4"))
    t = result.tables["replay_check"]
    kern = set(t["kernel"])
    assert kern == {"fp_qmv", "fp_qmv_fast", "fp_qmv_wide"}  # k_proj K=640: fp_qmv; down_proj K=2048: fast
    for k, want in (("fp_qmv", "simd_sum=xor1,qdot_add=fma"), ("fp_qmv_fast", "simd_sum=xor1,qdot_add=fma"),
                    ("fp_qmv_wide", "dot4=sequential,contract=none")):
        rows = t[t["kernel"] == k]
        assert len(rows[rows["variant"] == want]) >= 2 and rows[rows["variant"] == want]["identical"].all()
        # The rows tell some other variant apart (each kernel's cells: two paths, one or two projections).
        assert not rows[rows["variant"] != want]["identical"].all(), k
    assert not t[(t["kernel"] == "fp_qmv") & (t["variant"] == "simd_sum=xor16,qdot_add=mul-add")]["identical"].all()
    with pytest.raises(GemmdriftError):
        check_paths(["quant:mxfp4-q8-g32"])  # mlx's quantize has mxfp4 at 4 bits only
