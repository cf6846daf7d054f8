"""The gemv_t recipe: ``x @ W`` at T=1 with W (K, N) row-major (not transposed), as mlx's Metal GEMVTKernel adds.

The known answer is an emulation written here from ml-explore/mlx 846d176 ``mlx/backend/metal/kernels/gemv.h``
``GEMVTKernel::run`` (L296-433) and ``matmul.cpp`` ``gemv_axbpy`` (L1141-1163, the grid of L1210-1212), thread
by thread and column by column with float32 scalars (the 32 lanes of every simdgroup, ``simd_shuffle_down``
with its out-of-range lanes keeping their value, the tail column shifted inward, the threadgroup memory step),
without the replay's code; the recipe must equal it bit for bit, under both engines.
"""

from __future__ import annotations

import numpy as np
import pytest

from gemmdrift import replay as R
from gemmdrift.dispatch import chip_named, choose
from gemmdrift.errors import GemmdriftError
from gemmdrift.replay import dense as rd
from gemmdrift.replay.jit import dense_acc
from gemmdrift.replay.paths import plan_for, run_plan

F = np.float32


def _emulate_gemv_t(x: np.ndarray, W: np.ndarray, bm: int, bn: int, sm: int, sn: int, tm: int, tn: int):
    """float32 results of GEMVTKernel for x (K,) and W (K, N), every thread of every threadgroup run in turn."""
    K, N = W.shape
    blockM, blockN = bm * sm * tm, bn * sn * tn
    n_tgp = -(-N // blockN)  # matmul.cpp L1210: n_out_per_tgp = bn * sn * tn
    out = np.full(N, np.nan, dtype=F)
    for tid in range(n_tgp):
        n_sg = bn * bm  # group_dims (32, bn, bm)
        res = np.zeros((n_sg, 32, tn), dtype=F)
        meta = {}
        for g in range(n_sg):
            for lane in range(32):
                thrM, thrN = (lane // sn, lane % sn) if sn != 32 else (0, lane)
                sgM, sgN = (g // bn, g % bn) if bn != 1 else (g, 0)
                cm, cn = sm * sgM + thrM, sn * sgN + thrN
                row, out_col = cm * tm, tid * blockN + cn * tn
                if out_col < N:
                    out_col = out_col if out_col + tn < N else N - tn
                    n_iter = K // blockM
                    for _ in range(n_iter):
                        for t in range(tm):
                            vc = F(x[row + t])
                            for j in range(tn):
                                res[g, lane, j] = F(res[g, lane, j] + F(vc * F(W[row + t, out_col + j])))
                        row += blockM
                    if K - n_iter * blockM > 0:
                        t = 0
                        while t < tm and row + t < K:
                            for j in range(tn):
                                res[g, lane, j] = F(res[g, lane, j] + F(F(x[row + t]) * F(W[row + t, out_col + j])))
                            t += 1
                meta[g, lane] = (cm, sgM, thrM, out_col)
            for s in _halvings(sm):  # for (sm = SM / 2; sm >= 1; sm >>= 1): r += simd_shuffle_down(r, SN * sm)
                shifted = np.array([res[g, lane + sn * s] if lane + sn * s < 32 else res[g, lane]
                                    for lane in range(32)], dtype=F)
                res[g] = (res[g] + shifted).astype(F)
        if bm > 1:  # threadgroup memory: simdgroup 0 of each column adds simdgroups 1..BM-1 in order
            for g in range(n_sg):
                for lane in range(32):
                    cm, sgM, thrM, _ = meta[g, lane]
                    if thrM == 0 and sgM == 0:
                        for other in range(1, bm):
                            res[g, lane] = (res[g, lane] + res[other * bn + g % bn, lane]).astype(F)
        for g in range(n_sg):
            for lane in range(32):
                cm, _, _, out_col = meta[g, lane]
                if cm == 0 and out_col < N:
                    out[out_col:out_col + tn] = res[g, lane]
    return out


def _halvings(n: int):
    s = n // 2
    while s >= 1:
        yield s
        s //= 2


def _draw(seed: int, K: int, N: int, dtype=np.float16):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(K).astype(dtype).astype(F)
    W = rng.standard_normal((K, N)).astype(dtype).astype(F)
    return x, W


def _bits(a):
    return np.ascontiguousarray(a, dtype=F).view(np.uint32)


def _acc(params, x, W):
    """The recipe's float32 accumulator (numpy reference), products x[k] * W[k, n] as (K, 1, N)."""
    P = np.multiply(x[:, None, None], W[:, None, :], dtype=F)
    return rd.metal_gemv_t(P, params, {}, False)[0]


# (K, N, params): the host's two tilings (sm8 sn4; sm4 sn8 for K >= 8192 and N >= 2048) on small shapes with
# a K tail (K % blockM) and a column tail (N % tn), tn = 1 for N < 4, and BM = 2 (the kernel's threadgroup step;
# the host never sends it, the recipe has it).
KAT = [(203, 37, {"bm": 1, "bn": 2, "sm": 8, "sn": 4, "tm": 4, "tn": 4}),
       (203, 37, {"bm": 1, "bn": 2, "sm": 4, "sn": 8, "tm": 4, "tn": 4}),
       (77, 3, {"bm": 1, "bn": 2, "sm": 8, "sn": 4, "tm": 4, "tn": 1}),
       (150, 19, {"bm": 2, "bn": 2, "sm": 8, "sn": 4, "tm": 4, "tn": 4})]


@pytest.mark.parametrize("K, N, params", KAT)
def test_gemv_t_is_the_kernel_emulated_thread_by_thread(K, N, params):
    x, W = _draw(K + N, K, N)
    want = _emulate_gemv_t(x, W, **params)
    assert not np.isnan(want).any()  # every column written once at least
    assert np.array_equal(_bits(_acc(params, x, W)), _bits(want))
    for engine in ("numpy", "compiled"):
        y = R.replay_matmul("gemv_t", x[None], W.T, dtype="float16", params=params, engine=engine).y[0]
        assert np.array_equal(_bits(y), _bits(want.astype(np.float16).astype(F))), engine


def test_the_emulation_can_fail_gemv_t_is_not_a_chain_nor_gemv():
    # The known answer is not vacuous: a plain k-order chain and gemv's order (x @ W.T on the same numbers,
    # lane l adds k = 128i + 4l + j, shuffle 16..1) give other float32 bits on the same draw.
    K, N, params = KAT[0]
    x, W = _draw(K + N, K, N)
    want = _emulate_gemv_t(x, W, **params)
    chain = np.zeros(N, dtype=F)
    for k in range(K):
        chain = (chain + x[k] * W[k]).astype(F)
    assert not np.array_equal(_bits(chain), _bits(want))
    P = np.multiply(x[:, None, None], W[:, None, :], dtype=F)
    gemv = rd.metal_gemv(P, {"sn": 32, "bn": 1, "tn": 4}, {}, False)[0]
    assert not np.array_equal(_bits(gemv), _bits(want))


@pytest.mark.parametrize("engine", ["numpy", "compiled"])
def test_small_integers_give_x_at_w_exactly(engine):
    # Integers in [-3, 3]: every partial sum (|s| <= 9 * 203 < 2048) is exact in float32 and the result in
    # float16, so any order gives x @ W exactly; a wrong product index or a dropped tail row would not.
    K, N = 203, 37
    rng = np.random.default_rng(5)
    x = rng.integers(-3, 4, size=(1, K)).astype(F)
    W = rng.integers(-3, 4, size=(K, N)).astype(F)
    plan = plan_for("M1", "matmul", T=1, K=K, N=N, dtype="float16", mlx_version="0.32.0", b_transposed=False)
    assert plan.recipe.kernel == "gemv_t"
    y = R.replay_matmul(plan.recipe, x, W.T, dtype="float16", params=plan.params, engine=engine).y
    exact = (x.astype(np.int64) @ W.astype(np.int64)).astype(F)
    assert np.array_equal(y, exact)


def test_gemv_t_and_gemv_round_differently_on_a_seeded_draw():
    # The same product x @ W, once as x @ W (gemv_t, W (K, N)) and once as x @ (W.T).T with W.T stored (N, K)
    # (gemv): the two kernels' orders give other float32 sums on most outputs, and other float16 outputs on a
    # few (2048 -> 2048 at T=1 on an M1 Ultra; float16 hides most order differences).
    K = N = 2048
    x, W = _draw(1000, K, N)
    kw = dict(T=1, K=K, N=N, dtype="float16", mlx_version="0.32.0")
    t = plan_for("M1 Ultra", "matmul", b_transposed=False, **kw)
    g = plan_for("M1 Ultra", "matmul", **kw)
    assert (t.recipe.kernel, g.recipe.kernel) == ("gemv_t", "gemv")
    Wt = np.ascontiguousarray(W.T)
    acc_t = dense_acc(t.recipe.fn, x[None], Wt, t.params, {}, False)
    acc_g = dense_acc(g.recipe.fn, x[None], Wt, g.params, {}, False)
    assert np.mean(acc_t != acc_g) > 0.5
    yt = run_plan(t, x[None], dtype="float16", w=Wt).y
    yg = run_plan(g, x[None], dtype="float16", w=Wt).y
    assert 0 < np.sum(yt != yg) < N // 10


def test_gemv_t_bias_is_added_as_gemv_adds_it_rounded_twice():
    # GEMVTKernel's axpby store (L424-427) is gemv's: T(alpha) * T(result) + T(beta) * bias in half arithmetic.
    K, N = 203, 37
    x, W = _draw(3, K, N)
    bias = np.random.default_rng(4).standard_normal(N).astype(np.float16).astype(F) * F(4)
    params = KAT[0][2]
    acc = _acc(params, x, W)
    want = (acc.astype(np.float16).astype(np.float64) + bias).astype(np.float16).astype(F)  # exact sum, one RN
    for engine in ("numpy", "compiled"):
        got = R.replay_matmul("gemv_t", x[None], W.T, bias, dtype="float16", params=params, engine=engine).y[0]
        assert np.array_equal(_bits(got), _bits(want)), engine
    assert R.RECIPES["gemv_t"].bias == "twice"


# ------------------------------------------------------------------------------ dispatch


@pytest.mark.parametrize("version", ["0.30.5", "0.32.0", "0.32.4"])
def test_x_at_w_at_t1_dispatches_gemv_t_with_the_host_tiles(version):
    def ch(chip, K, N, T=1):
        return choose(chip_named(chip), "matmul", T=T, K=K, N=N, dtype="float16", mlx_version=version,
                      b_transposed=False)

    c = ch("M1 Ultra", 5120, 5120)
    assert c.kernel == "gemv_t" and dict(c.params) == {"bm": 1, "bn": 16, "sm": 8, "sn": 4, "tm": 4, "tn": 4}
    assert dict(ch("M5 Max", 8192, 2048).params)["sm"] == 4 and dict(ch("M5 Max", 8192, 2048).params)["sn"] == 8
    assert dict(ch("M3", 8192, 2047).params) == {"bm": 1, "bn": 4, "sm": 8, "sn": 4, "tm": 4, "tn": 4}
    assert dict(ch("M3", 640, 100).params)["bn"] == 2 and dict(ch("M3", 640, 3).params)["tn"] == 1
    # x @ W.T stays gemv; x @ W with one output column is gemv over x (mat = a), as the host's is_b_matrix.
    assert choose(chip_named("M1"), "matmul", T=1, K=640, N=2048, dtype="float16", mlx_version=version).kernel \
        == "gemv"
    assert ch("M1", 640, 1, T=3).kernel == "gemv"
    # CUDA's can_use_gemv needs b transposed at M == 1: x @ W is cuBLASLt there.
    assert ch("sm90", 640, 2048).kernel == "cublaslt"


def test_x_at_w_at_t3_is_steel_split_k_on_m1_ultra_with_the_order_of_x_at_w_t_and_nax_on_m5():
    kw = dict(T=3, K=5120, N=5120, dtype="float16", mlx_version="0.32.0")
    nn = choose(chip_named("M1 Ultra"), "matmul", b_transposed=False, **kw)
    nt = choose(chip_named("M1 Ultra"), "matmul", **kw)
    # Split-K's tiles and partitions come from M, N, K only (matmul.cpp L523-537); the transposition is strides.
    assert nn.kernel == nt.kernel == "steel_gemm_splitk" and nn.params == nt.params
    assert dict(nn.params)["partitions"] == 2 and dict(nn.params)["partition_size"] == 2560
    # gemv_wide takes b transposed only (L1520): an M3 at 0.32.1 runs it for x @ W.T, not for x @ W.
    m3 = dict(T=3, K=640, N=2048, dtype="float16", mlx_version="0.32.1")
    assert choose(chip_named("M3"), "matmul", **m3).kernel == "gemv_wide"
    assert choose(chip_named("M3"), "matmul", b_transposed=False, **m3).kernel == "steel_gemm"
    assert choose(chip_named("M5 Max"), "matmul", b_transposed=False, **kw).kernel == "steel_gemm_nax"
    with pytest.raises(GemmdriftError, match=r"x @ W, W not transposed.*steel_gemm_nax"):
        plan_for("M5 Max", "matmul", b_transposed=False, **kw)


def test_the_fused_steel_gemm_takes_bk16_for_x_at_w_where_x_at_w_t_takes_32():
    # GEMM_TPARAM_MACRO (matmul.cpp L90-171): nt 64/32/32 on small devices, nn 64/64/16 for half; bk decides
    # the fused kernel's tail tile, so with K % 32 == 16 the two orders differ.
    kw = dict(T=64, K=656, N=2048, dtype="float16", mlx_version="0.32.0")
    nt = choose(chip_named("M1"), "matmul", **kw)
    nn = choose(chip_named("M1"), "matmul", b_transposed=False, **kw)
    assert (nt.kernel, nn.kernel) == ("steel_gemm", "steel_gemm")
    assert (dict(nt.params)["bk"], dict(nn.params)["bk"]) == (32, 16)
    assert rd.steel_ranges(0, 656, 32, True) != rd.steel_ranges(0, 656, 16, True)
