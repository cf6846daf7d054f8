"""The gemv recipe when N == 1 and M > 1: mlx runs the kernel the other way round, with M output rows.

Known answers read from ml-explore/mlx 846d176 ``mlx/backend/metal/matmul.cpp`` ``gemv_axbpy`` (L1116-1122:
``is_b_matrix = N != 1``, ``out_vector_len = is_b_matrix ? N : M``; the tiles L1164-1179; byte-identical at
v0.30.5 adcbb91, v0.31.2 68cf2fd, v0.32.0 7a1d4f5, b7c3dd6d and v0.32.1 3a62199), and ``kernels/gemv.h``
``GEMVKernel::run`` (L107-246) for the order, transcribed here without the replay's code.
"""

from __future__ import annotations

import numpy as np
import pytest

from gemmdrift.dispatch import chip_named, choose
from gemmdrift.replay import dense as rd
from gemmdrift.replay.paths import plan_for, run_plan

F = np.float32


def _host_tiles(M: int, N: int, K: int) -> dict[str, int]:
    # gemv_axbpy, the `else` (mat not transposed) branch, keyed by out_vector_len.
    out_len = N if N != 1 else M
    tm, tn, sm, sn, bm, bn = 4, 4, 1, 32, 1, 1
    bm = 8 if out_len >= 4096 else 4
    if K <= 64:
        bm, sm, sn = 1, 8, 4
    elif K >= 16 * out_len:
        bm, bn = 1, 8
    tm = 1 if out_len < tm else tm
    return {"bm": bm, "bn": bn, "sm": sm, "sn": sn, "tm": tm, "tn": tn}


# (M, N, K) -> the host's tiles; the first rows are N == 1 with 16 M > K >= 16 (K > 64), where reading N
# instead of M gives bn 8.
KAT = [
    ((16, 1, 128), {"bm": 4, "bn": 1, "sm": 1, "sn": 32, "tm": 4, "tn": 4}),
    ((64, 1, 512), {"bm": 4, "bn": 1, "sm": 1, "sn": 32, "tm": 4, "tn": 4}),
    ((5000, 1, 4096), {"bm": 8, "bn": 1, "sm": 1, "sn": 32, "tm": 4, "tn": 4}),
    ((8, 1, 256), {"bm": 1, "bn": 8, "sm": 1, "sn": 32, "tm": 4, "tn": 4}),  # 256 >= 16 * 8
    ((3, 1, 512), {"bm": 1, "bn": 8, "sm": 1, "sn": 32, "tm": 1, "tn": 4}),  # M < 4: tm 1
    ((16, 1, 64), {"bm": 1, "bn": 1, "sm": 8, "sn": 4, "tm": 4, "tn": 4}),  # K <= 64
    ((1, 640, 2048), {"bm": 4, "bn": 1, "sm": 1, "sn": 32, "tm": 4, "tn": 4}),  # N > 1: keyed by N
    ((1, 64, 2048), {"bm": 1, "bn": 8, "sm": 1, "sn": 32, "tm": 4, "tn": 4}),
]


@pytest.mark.parametrize("mnk,want", KAT)
def test_gemv_tiles_are_the_hosts(mnk, want):
    M, N, K = mnk
    assert _host_tiles(M, N, K) == want
    for version in ("0.30.5", "0.32.0", "0.32.1"):
        c = choose(chip_named("M1"), "matmul", T=M, K=K, N=N, dtype="float16", mlx_version=version)
        if M == N == 1 and version >= "0.32.1":
            continue
        assert c.kernel == "gemv" and c.params == want, (mnk, version, c)


def _emulate_gemv_bn1(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """float32 results of GEMVKernel with BN = 1, SN = 32, TN = 4 (blockN = 128), mat = x (M, K), in_vec = w,
    every output row at once: lane l adds ``inter[tn] * v_coeff[tn]`` for k = 128 i + 4 l + tn (i outer), the
    tail zero-filled (load_safe, so +0 is added), then ``result += simd_shuffle_down(result, s)`` for
    s = 16, 8, 4, 2, 1 (an out-of-range lane reads its own value); lane 0 writes."""
    M, K = x.shape
    res = np.zeros((32, M), dtype=F)
    for i in range(-(-K // 128)):
        for lane in range(32):
            for t in range(4):
                k = 128 * i + 4 * lane + t
                prod = x[:, k] * w[k] if k < K else np.zeros(M, dtype=F)
                res[lane] = (res[lane] + prod.astype(F)).astype(F)
    s = 16
    while s >= 1:
        res = np.stack([res[l] + (res[l + s] if l + s < 32 else res[l]) for l in range(32)]).astype(F)
        s //= 2
    return res[0]


def test_n1_replay_is_the_kernel_over_m_rows():
    # M = 256, K = 2000 < 16 M: bn 1 (sixteen 128-blocks per lane, the last partial); the old tiles (bn 8
    # from N = 1: eight simdgroups of two 128-blocks each) add in another order, and on this draw round
    # differently.
    M, K = 256, 2000
    rng = np.random.default_rng(31)
    x = rng.standard_normal((M, K)).astype(np.float16).astype(F)
    w = rng.standard_normal((1, K)).astype(np.float16).astype(F)
    want = _emulate_gemv_bn1(x, w[0]).astype(np.float16).astype(F)
    plan = plan_for("M1", "matmul", T=M, K=K, N=1, dtype="float16", mlx_version="0.32.0")
    assert plan.recipe.kernel == "gemv" and plan.params["bn"] == 1
    got = run_plan(plan, x, dtype="float16", w=w).y[:, 0]
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    P = np.multiply(x.T[:, :, None], w.T[:, None, :], dtype=F)  # (K, M, 1)
    old = rd.metal_gemv(P, {"sn": 32, "bn": 8, "tn": 4}, {}, False)[:, 0].astype(np.float16).astype(F)
    assert not np.array_equal(old.view(np.uint32), want.view(np.uint32))
