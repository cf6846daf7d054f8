"""The compiled replay: the recipes' loops in numba, the same adds in the same order as numpy's.

Each kernel here is the loop of one or more numpy recipes (named in its
docstring; those are the readable reference and stay the spec), rewritten so
that the output axis n is innermost: a tile of ``NB`` weight rows is
transposed into a (K, NB) scratch and every accumulator of the recipe (a lane
register, a partition, a simdgroup) becomes a vector of NB independent float32
values, which LLVM vectorises without reordering any single output's sum.
Products are formed in the loop (``x[t, k] * w[n, k]``, the same float32 RN
product as the numpy recipes' ``P``), so no (K, T, N) array is built. Where
the numpy recipes zero-pad K (the kernels' safe loads), the padded products
are ``+0 * +0 = +0`` from a zero row, as numpy's ``np.zeros`` padding.

Compiled: ``cpu_simd_gemm``, ``cpu_cblas_sgemm``, ``gemv``, ``gemv_t``, ``cuda_gemv`` (one
lane kernel), ``gemv_wide`` (both dot4), ``steel_gemm`` and
``steel_gemm_splitk`` (MMA8 H1..H4), ``cpu_qmm``, ``qmv``/``qmv_fast`` (every
simd_sum and contribution variant, float and bf16 quad sums), ``qmv_wide``
(both contractions), ``qmm_t``/``qmm_t_splitk`` (H1, H2; every dequantization
and partials rule). MMA8 H3 and H4 of ``qmm_t`` stay on numpy (:func:`.jitquant.quant_acc`
returns None for them).
"""

from __future__ import annotations

from typing import Any, Mapping

from ..errors import GemmdriftError
from . import dense as rd
import math

from .jitcore import (DTYPE_CODE, NB, ZERO, round_odd_sum, add_rounded, compile_once, fl, fma32, njit, np,
                             rnd)

MMA_CODE = {"H1": 1, "H2": 2, "H3": 3, "H4": 4}  # k_mma's how: an integer, one loop per hypothesis


@njit
def dense_tile(w, n0, wt):
    """Rows n0..n0+NB of w (N, K), transposed into wt (K+1, NB); missing rows and row K stay +0."""
    N, K = w.shape
    nb = min(NB, N - n0)
    k8 = K - K % 8
    for k0 in range(0, k8, 8):  # 8 values of a row read at once, 8 lines written: both stay in L1
        for j in range(nb):
            n = n0 + j
            a0, a1, a2, a3 = w[n, k0], w[n, k0 + 1], w[n, k0 + 2], w[n, k0 + 3]
            a4, a5, a6, a7 = w[n, k0 + 4], w[n, k0 + 5], w[n, k0 + 6], w[n, k0 + 7]
            wt[k0, j], wt[k0 + 1, j], wt[k0 + 2, j], wt[k0 + 3, j] = a0, a1, a2, a3
            wt[k0 + 4, j], wt[k0 + 5, j], wt[k0 + 6, j], wt[k0 + 7, j] = a4, a5, a6, a7
    for k in range(k8, K):
        for j in range(nb):
            wt[k, j] = w[n0 + j, k]
    for j in range(nb, NB):
        for k in range(K):
            wt[k, j] = ZERO


@njit(inline="always")  # inlined in numba's IR: LLVM may not inline it into the large k_mma on its own
def _deq(c, s, b, mode, code, ftz):
    """One weight from its code c, scale s and bias b: mode -1 the code itself (qmv); 0 ``T(T(s*c) + b)``
    (rq.cpu_qmm_t: a float32 add, then the dtype); 1 ``T(ftz(fma(s, c, b)))`` (qmv_wide with T = float32,
    qmm_t's ``fma``); 2 ``T(ftz(ftz(s*c) + b))`` (qmm_t ``mul-add``); 3 ``add_rounded(T(s*c), b)`` (qmm_t
    ``dtype``, before v0.32.1): the numpy recipes' dequantizations, element by element."""
    if mode == -1:
        return c
    if mode == 0:
        return rnd(rnd(s * c, code) + b, code)
    if mode == 1:
        return rnd(fl(fma32(s, c, b), ftz), code)
    if mode == 2:
        return rnd(fl(fl(s * c, ftz) + b, ftz), code)
    return add_rounded(rnd(s * c, code), b, code)


@njit(inline="always")  # inlined with literal mode and dtype: LLVM folds the branches, the row loop vectorises
def _deq_row(wt, st, bt, k, g, mode, code, ftz):
    for j in range(NB):
        wt[k, j] = _deq(wt[k, j], st[g, j], bt[g, j], mode, code, ftz)


@njit
def quant_tile(wq, scales, biases, bits, gs, mode, code, ftz, n0, wt, st, bt):
    """As :func:`dense_tile`, for the weights of packed affine codes ``wq`` (rq.unpack's layout: code e of a
    uint32 word in bits [bits*e, bits*(e+1))): the codes are transposed into wt, then (mode >= 0)
    dequantized in place by :func:`_deq` with the scales and biases tiled into st, bt (G+1, NB)."""
    N = wq.shape[0]
    K = wt.shape[0] - 1
    nb = min(NB, N - n0)
    per = 32 // bits
    mask = np.uint32((1 << bits) - 1)
    for i0 in range(0, K // per, 2):  # two words (8 or 16 codes) of a row at a time
        for j in range(nb):
            for i in range(i0, min(i0 + 2, K // per)):
                word = wq[n0 + j, i]
                for e in range(per):
                    wt[i * per + e, j] = np.float32((word >> np.uint32(bits * e)) & mask)
    for j in range(nb, NB):
        for k in range(K):
            wt[k, j] = ZERO
    if mode < 0:
        return
    dense_tile(scales, n0, st)
    dense_tile(biases, n0, bt)
    for k in range(K):
        g = k // gs
        # Literal modes and dtypes for the combinations the recipes use: each row loop then vectorises.
        if mode == 0 and code == 1:
            _deq_row(wt, st, bt, k, g, 0, 1, ftz)
        elif mode == 0 and code == 0:
            _deq_row(wt, st, bt, k, g, 0, 0, ftz)
        elif mode == 1 and code == 0:
            _deq_row(wt, st, bt, k, g, 1, 0, ftz)
        elif mode == 1 and code == 1:
            _deq_row(wt, st, bt, k, g, 1, 1, ftz)
        elif mode == 2 and code == 1:
            _deq_row(wt, st, bt, k, g, 2, 1, ftz)
        else:
            _deq_row(wt, st, bt, k, g, mode, code, ftz)


@njit
def lane_ladder(r, base, n, ftz):
    """lane_tree over rows base..base+n of r, in place: row base holds lane 0's result."""
    h = n // 2
    while h >= 1:
        for l in range(h):
            for j in range(NB):
                r[base + l, j] = fl(r[base + l, j] + r[base + l + h, j], ftz)
        h //= 2


# ------------------------------------------------------------------------------ dense


@compile_once
@njit(cache=True)
def k_lanes(x, w, block, tn, kend, sn, bn, ftz, out):
    """rd.cpu_sequential (block = tn = sn = bn = 1), rd.metal_gemv (kend: K padded to the block), rd.cuda_gemv
    and rd.metal_gemv_t (kend = K: lanes past K add nothing; gemv_t's tn is its TM, sn its SM, bn its BM):
    lane ``(k % block) // tn`` adds product k, k in order; then per simdgroup the shuffle-down ladder over sn
    lanes, and simdgroup 0 adds the others in order."""
    T, K = x.shape
    N = w.shape[0]
    wt = np.zeros((K + 1, NB), np.float32)
    r = np.empty((block // tn, NB), np.float32)
    for n0 in range(0, N, NB):
        dense_tile(w, n0, wt)
        for t in range(T):
            r[:, :] = ZERO
            quads = kend // 4 if (tn % 4 == 0 or block == tn) else 0  # 4 consecutive k in one lane
            for k0 in range(0, 4 * quads, 4):
                lane = (k0 % block) // tn
                ka, kb, kc, kd = min(k0, K), min(k0 + 1, K), min(k0 + 2, K), min(k0 + 3, K)  # K: the zero row
                xa = x[t, k0] if k0 < K else ZERO
                xb = x[t, k0 + 1] if k0 + 1 < K else ZERO
                xc = x[t, k0 + 2] if k0 + 2 < K else ZERO
                xd = x[t, k0 + 3] if k0 + 3 < K else ZERO
                for j in range(NB):
                    v = fl(r[lane, j] + xa * wt[ka, j], ftz)
                    v = fl(v + xb * wt[kb, j], ftz)
                    v = fl(v + xc * wt[kc, j], ftz)
                    r[lane, j] = fl(v + xd * wt[kd, j], ftz)
            for k in range(4 * quads, kend):
                lane = (k % block) // tn
                kk = k if k < K else K
                xv = x[t, k] if k < K else ZERO
                for j in range(NB):
                    r[lane, j] = fl(r[lane, j] + xv * wt[kk, j], ftz)
            if sn > 1:
                for s in range(bn):
                    lane_ladder(r, s * sn, sn, ftz)
            for s in range(1, bn):
                for j in range(NB):
                    r[0, j] = fl(r[0, j] + r[s * sn, j], ftz)
            for j in range(min(NB, N - n0)):
                out[t, n0 + j] = r[0, j]


@njit
def _dot4(x0, x1, x2, x3, wt, k, j, pairwise, ftz):
    p0, p1, p2, p3 = x0 * wt[k, j], x1 * wt[k + 1, j], x2 * wt[k + 2, j], x3 * wt[k + 3, j]
    if pairwise:
        return fl(fl(p0 + p1, ftz) + fl(p2 + p3, ftz), ftz)
    return fl(fl(fl(p0 + p1, ftz) + p2, ftz) + p3, ftz)


@compile_once
@njit(cache=True)
def k_wide(x, w, kl, pairwise, ftz, out):
    """rd.metal_gemv_wide: per block of 8*kl vec4s, lane l's ``a`` adds dot4s i*kl + l (i = 0..7) from +0,
    then ``r += a``; tail vec4s go straight into r; then the ladder over kl lanes."""
    T, K = x.shape
    N = w.shape[0]
    n_v4 = K // 4
    n_main = n_v4 - n_v4 % (kl * 8)
    wt = np.zeros((K + 1, NB), np.float32)
    r = np.empty((kl, NB), np.float32)
    a = np.empty((kl, NB), np.float32)
    for n0 in range(0, N, NB):
        dense_tile(w, n0, wt)
        for t in range(T):
            r[:, :] = ZERO
            for b in range(n_main // (8 * kl)):
                a[:, :] = ZERO
                for i in range(8):
                    for l in range(kl):
                        k = 4 * (b * 8 * kl + i * kl + l)
                        x0, x1, x2, x3 = x[t, k], x[t, k + 1], x[t, k + 2], x[t, k + 3]
                        for j in range(NB):
                            a[l, j] = fl(a[l, j] + _dot4(x0, x1, x2, x3, wt, k, j, pairwise, ftz), ftz)
                for l in range(kl):
                    for j in range(NB):
                        r[l, j] = fl(r[l, j] + a[l, j], ftz)
            for v in range(n_main, n_v4):
                l = (v - n_main) % kl
                k = 4 * v
                x0, x1, x2, x3 = x[t, k], x[t, k + 1], x[t, k + 2], x[t, k + 3]
                for j in range(NB):
                    r[l, j] = fl(r[l, j] + _dot4(x0, x1, x2, x3, wt, k, j, pairwise, ftz), ftz)
            lane_ladder(r, 0, kl, ftz)
            for j in range(min(NB, N - n0)):
                out[t, n0 + j] = r[0, j]


@njit(inline="always")
def mma_h1(a, p0, p1, p2, p3, p4, p5, p6, p7, ftz):
    """rd.mma8 H1: ``a + p0 + ... + p7`` in order, each add rounded (and flushed under FTZ)."""
    v = fl(a + p0, ftz)
    v = fl(v + p1, ftz)
    v = fl(v + p2, ftz)
    v = fl(v + p3, ftz)
    v = fl(v + p4, ftz)
    v = fl(v + p5, ftz)
    v = fl(v + p6, ftz)
    return fl(v + p7, ftz)


@njit(inline="always")
def mma_h2(a, p0, p1, p2, p3, p4, p5, p6, p7, ftz):
    """rd.mma8 H2: ``a + pairwise(p0..p7)``."""
    s = fl(fl(fl(p0 + p1, ftz) + fl(p2 + p3, ftz), ftz) + fl(fl(p4 + p5, ftz) + fl(p6 + p7, ftz), ftz), ftz)
    return fl(a + s, ftz)


@njit(inline="always")
def _h3(a, p0, p1, p2, p3, p4, p5, p6, p7):
    """replay.core.exact_then_round([a, p0..p7]): float64 steps rounded to odd where it matters, one RN
    rounding to float32 (no FTZ, as the numpy recipe)."""
    s = np.float64(a)
    s = round_odd_sum(s, np.float64(p0))
    s = round_odd_sum(s, np.float64(p1))
    s = round_odd_sum(s, np.float64(p2))
    s = round_odd_sum(s, np.float64(p3))
    s = round_odd_sum(s, np.float64(p4))
    s = round_odd_sum(s, np.float64(p5))
    s = round_odd_sum(s, np.float64(p6))
    s = round_odd_sum(s, np.float64(p7))
    return np.float32(s)


@njit(inline="always")
def _trunc_to(t, q):
    return np.trunc(np.float64(t) / q) * q  # exact: q is a power of two


@njit(inline="always")
def _h4(a, p0, p1, p2, p3, p4, p5, p6, p7):
    """replay.core.aligned_sum([a, p0..p7]) with 24 fraction bits: each term truncated to the quantum of the
    largest exponent, added exactly in float64, rounded toward zero to float32 (no FTZ, as the numpy recipe)."""
    m = max(abs(np.float64(a)), abs(np.float64(p0)), abs(np.float64(p1)), abs(np.float64(p2)),
            abs(np.float64(p3)), abs(np.float64(p4)), abs(np.float64(p5)), abs(np.float64(p6)),
            abs(np.float64(p7)))
    e = math.frexp(m)[1]  # 2**(e-1) <= m < 2**e (e = 0 for m = 0, as np.frexp)
    q = math.ldexp(1.0, e - 24)
    s = 0.0
    s = s + _trunc_to(a, q)
    s = s + _trunc_to(p0, q)
    s = s + _trunc_to(p1, q)
    s = s + _trunc_to(p2, q)
    s = s + _trunc_to(p3, q)
    s = s + _trunc_to(p4, q)
    s = s + _trunc_to(p5, q)
    s = s + _trunc_to(p6, q)
    s = s + _trunc_to(p7, q)
    r = np.float32(s)
    if abs(np.float64(r)) > abs(s):  # RN went away from zero: one ulp back (round toward zero)
        r = np.nextafter(r, ZERO)
    return r


@compile_once
@njit(cache=True)
def k_mma(x, w, ranges, pstart, how, ftz, out):
    """rd._mma_chain per partition (steel fused, split-K): partition p chains its K ranges
    ``ranges[pstart[p]:pstart[p+1]]`` from +0, one MMA8 step per 8 products (how = MMA_CODE: 1 H1, acc + p0 +
    ... + p7 in order; 2 H2, acc + pairwise(p0..p7); 3 H3 and 4 H4 as :func:`_h3`, :func:`_h4`), a range's
    last step zero-padded; out[p] is its float32 result.
    Weights: w (N, K) (qmm_t's chain over dequantized tiles is replay.jitquant's)."""
    T, K = x.shape
    N = w.shape[0]
    wt = np.zeros((K + 1, NB), np.float32)
    acc = np.empty(NB, np.float32)
    xs = np.empty(8, np.float32)
    ks = np.empty(8, np.int64)
    for n0 in range(0, N, NB):
        dense_tile(w, n0, wt)
        for t in range(T):
            for p in range(len(pstart) - 1):
                acc[:] = ZERO
                for ri in range(pstart[p], pstart[p + 1]):
                    lo, hi = ranges[ri, 0], ranges[ri, 1]
                    for c in range(lo, hi, 8):
                        for i in range(8):
                            ks[i] = c + i if c + i < hi else K  # the zero row: a +0 product
                            xs[i] = x[t, c + i] if c + i < hi else ZERO
                        x0, x1, x2, x3, x4, x5, x6, x7 = xs[0], xs[1], xs[2], xs[3], xs[4], xs[5], xs[6], xs[7]
                        k0, k1, k2, k3, k4, k5, k6, k7 = ks[0], ks[1], ks[2], ks[3], ks[4], ks[5], ks[6], ks[7]
                        if how == 2:  # a loop per hypothesis, not a branch per column: each vectorises alone
                            for j in range(NB):
                                acc[j] = mma_h2(acc[j], x0 * wt[k0, j], x1 * wt[k1, j], x2 * wt[k2, j],
                                             x3 * wt[k3, j], x4 * wt[k4, j], x5 * wt[k5, j], x6 * wt[k6, j],
                                             x7 * wt[k7, j], ftz)
                        elif how == 3:
                            for j in range(NB):
                                acc[j] = _h3(acc[j], x0 * wt[k0, j], x1 * wt[k1, j], x2 * wt[k2, j],
                                             x3 * wt[k3, j], x4 * wt[k4, j], x5 * wt[k5, j], x6 * wt[k6, j],
                                             x7 * wt[k7, j])
                        elif how == 4:
                            for j in range(NB):
                                acc[j] = _h4(acc[j], x0 * wt[k0, j], x1 * wt[k1, j], x2 * wt[k2, j],
                                             x3 * wt[k3, j], x4 * wt[k4, j], x5 * wt[k5, j], x6 * wt[k6, j],
                                             x7 * wt[k7, j])
                        else:
                            for j in range(NB):
                                acc[j] = mma_h1(acc[j], x0 * wt[k0, j], x1 * wt[k1, j], x2 * wt[k2, j],
                                             x3 * wt[k3, j], x4 * wt[k4, j], x5 * wt[k5, j], x6 * wt[k6, j],
                                             x7 * wt[k7, j], ftz)
                for j in range(min(NB, N - n0)):
                    out[p, t, n0 + j] = acc[j]


def _c(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


def _mma(x, w, parts: list[list[tuple[int, int]]], how: str, ftz: bool) -> np.ndarray:
    """k_mma on dense w: one float32 result per partition, (P, T, N)."""
    if how not in MMA_CODE:
        raise GemmdriftError(f"unknown MMA8 variant {how!r} (known: {', '.join(MMA_CODE)})")
    ranges = np.array([r for p in parts for r in p], dtype=np.int64).reshape(-1, 2)
    pstart = np.cumsum([0] + [len(p) for p in parts]).astype(np.int64)
    out = np.empty((len(parts), x.shape[0], w.shape[0]), dtype=np.float32)
    k_mma(x, w, ranges, pstart, MMA_CODE[how], bool(ftz), out)
    return out


def dense_acc(fn, x: np.ndarray, w: np.ndarray, params: Mapping[str, Any], var: Mapping[str, str],
              ftz: bool) -> np.ndarray | None:
    """The pre-epilogue float32 accumulator (T, N) of the dense recipe whose numpy function is ``fn``, or None
    where it is not compiled (a recipe this module does not know)."""
    x, w = _c(x), _c(w)
    T, K = x.shape
    out = np.empty((T, w.shape[0]), dtype=np.float32)
    ftz = bool(ftz)
    if fn is rd.cpu_sequential:
        k_lanes(x, w, 1, 1, K, 1, 1, False, out)
    elif fn is rd.metal_gemv:
        sn, bn, tn = int(params.get("sn", 32)), int(params.get("bn", 1)), int(params.get("tn", 4))
        block = sn * tn * bn
        k_lanes(x, w, block, tn, -(-K // block) * block, sn, bn, ftz, out)
    elif fn is rd.metal_gemv_t:
        # Thread c = (k % block) // tm adds its rows in k order; no zero fill past K (kend = K), then the ladder
        # over the SM threads of each simdgroup and the BM simdgroups in order: k_lanes' lanes exactly.
        bm, sm, tm = int(params.get("bm", 1)), int(params.get("sm", 8)), int(params.get("tm", 4))
        if sm & (sm - 1):
            raise GemmdriftError(f"a shuffle ladder needs a power-of-two lane count, got {sm}")
        k_lanes(x, w, bm * sm * tm, tm, K, sm, bm, ftz, out)
    elif fn is rd.cuda_gemv:
        n = int(params.get("n_per_thread", rd.cuda_n_per_thread(K)))
        if K % n:
            raise GemmdriftError(f"cuda gemv with {n} values per thread needs K % {n} == 0, got K={K}")
        k_lanes(x, w, 32 * n, n, K, 32, 1, ftz, out)
    elif fn is rd.metal_gemv_wide:
        if K % 4:
            raise GemmdriftError(f"gemv_wide needs K % 4 == 0, got K={K}")
        kl = int(params["k_lanes"])
        if kl & (kl - 1):
            raise GemmdriftError(f"a shuffle ladder needs a power-of-two lane count, got {kl}")
        k_wide(x, w, kl, {"sequential": False, "pairwise": True}[var["dot4"]], ftz, out)
    elif fn is rd.metal_steel_gemm:
        bk = int(params.get("bk", 32))
        return _mma(x, w, [rd.steel_ranges(0, K, bk, tail_first=True)], var["mma"], ftz)[0]
    elif fn is rd.metal_steel_gemm_splitk:
        parts, ps = int(params["partitions"]), int(params["partition_size"])
        bk = int(params.get("bk", 16))
        if parts < 1 or ps < 1 or parts * ps > K:
            raise GemmdriftError(f"split-K: {parts} partitions of {ps} do not fit K={K}")
        ranges = [rd.steel_ranges(p * ps, K if p == parts - 1 else (p + 1) * ps, bk, tail_first=False)
                  for p in range(parts)]
        part = _mma(x, w, ranges, var["mma"], ftz)
        return rd.splitk_sum(list(part), ftz)
    else:
        return None
    return out


__all__ = ["k_lanes", "k_wide", "k_mma", "dense_acc", "DTYPE_CODE", "add_rounded", "fma32", "rnd"]
