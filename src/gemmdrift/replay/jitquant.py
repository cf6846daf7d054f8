"""The compiled replay of the affine-quantized recipes: their loops (numpy reference: :mod:`.quant`).

As in :mod:`.jit`: the output axis innermost, NB columns of independent
accumulators, the same operations in the same order as the numpy recipe of
each kernel. The packed codes are first decoded and transposed into tiles of
NB weight rows (:func:`k_prep`) and, where the recipe dequantizes (the CPU's
``T(T(s*q) + b)``, qmv_wide's float ``fma(s, q, b)``, qmm_t's threadgroup
weights), dequantized, exactly as the numpy recipes do before their loops;
those tiles depend only on the weight, so :func:`quant_acc` can take them from
:mod:`.jitcache` (a fixed weight's are prepared once).

Two reorderings of *independent* work, neither of which changes any output's
own sequence of operations: rows t0..t0+TB of x run side by side inside each
step (a weight row is read once per TB rows, from L1), and the tiles are
spread over numba's threads (``prange``: a tile's outputs are computed by one
thread; ``NUMBA_NUM_THREADS``, default the core count; only on a machine with
more than two cores, :data:`.jitcore.THREADS`). Each tile loop is compiled
twice, with FTZ a literal (the flush tests fold away where off).
"""

from __future__ import annotations

from typing import Any, Mapping

from ..errors import GemmdriftError
from . import quant as rq
from .jit import mma_h1, mma_h2, lane_ladder, quant_tile, dense_tile
from .jitcache import TileCache
from .jitcore import (THREADS, DTYPE_CODE, NB, ZERO, to_bf16, to_f16, add_rounded, compile_once, fl, fma32, njit,
                      np, prange, rnd)

DEQUANT = {"cpu": 0, "fma": 1, "mul-add": 2, "dtype": 3}
CONTRIB = {name: i for i, name in enumerate(rq.CONTRIB)}  # fma, fma-bias, mul-add
SIMD = {"xor16": 0, "xor1": 1, "sequential": 2}


TB = 8  # rows of x per pass over a tile: each weight row read from L1 TB times, not once per row from L2


@compile_once
@njit(cache=True, parallel=THREADS)
def k_prep(wq, scales, biases, bits, gs, mode, code, ftz, W, S, B):
    """Every tile of a weight, as the kernels read it: W[i] (K+1, NB) the transposed rows i*NB.. of the codes
    (mode -1) or of their dequantization (:func:`.jit._deq`), S[i], B[i] (G+1, NB) the scales and
    biases; missing rows and the last row +0 (W, S, B come zeroed)."""
    for i in prange(W.shape[0]):  # tiles are independent: one thread each, the same values
        quant_tile(wq, scales, biases, bits, gs, mode, code, ftz, i * NB, W[i], S[i], B[i])
        if mode < 0:
            dense_tile(scales, i * NB, S[i])
            dense_tile(biases, i * NB, B[i])


@compile_once
@njit(cache=True, parallel=THREADS)
def k_cpu_qmm(x, W, code, N, out):
    """rq.cpu_qmm_t's loop: ``sum = T(float32(sum + T(x*w)))``, k = 0..K-1 from 0, ``w = T(T(s*q)+b)`` (W, mode 0).
    Rows t0..t0+TB run side by side, k outermost: each row's own adds are in the same order."""
    T, K = x.shape
    for i in prange(W.shape[0]):  # a tile's outputs on one thread, each in its own order: threads change no bit
        acc = np.empty((TB, NB), np.float32)
        wt = W[i]
        n0 = i * NB
        for t0 in range(0, T, TB):
            nt = min(TB, T - t0)
            acc[:, :] = ZERO
            for k in range(K):
                for tt in range(nt):
                    xv = x[t0 + tt, k]
                    if code == 1:  # one loop per dtype, not a branch per element: each vectorises
                        for j in range(NB):
                            acc[tt, j] = to_bf16(acc[tt, j] + to_bf16(xv * wt[k, j]))
                    elif code == 2:
                        for j in range(NB):
                            acc[tt, j] = to_f16(acc[tt, j] + to_f16(xv * wt[k, j]))
                    else:
                        for j in range(NB):
                            acc[tt, j] = acc[tt, j] + xv * wt[k, j]
            for tt in range(nt):
                for j in range(min(NB, N - n0)):
                    out[t0 + tt, n0 + j] = acc[tt, j]


@njit
def _xsum(x, t, k0, vpt, bits, float_sums, code, ftz):
    """rq._partial_sum of one lane's x values (a scalar per row and lane)."""
    s = ZERO
    if bits == 8:
        for i in range(vpt):
            s = fl(s + x[t, k0 + i], ftz)
    elif float_sums:
        for i in range(0, vpt, 4):
            s = fl(s + fl(fl(fl(x[t, k0 + i] + x[t, k0 + i + 1], ftz) + x[t, k0 + i + 2], ftz)
                          + x[t, k0 + i + 3], ftz), ftz)
    else:  # bf16/fp16 quads (0.32.2 and older): native dtype adds, into a float sum
        for i in range(0, vpt, 4):
            quad = add_rounded(add_rounded(add_rounded(x[t, k0 + i], x[t, k0 + i + 1], code), x[t, k0 + i + 2],
                                           code), x[t, k0 + i + 3], code)
            s = fl(s + quad, ftz)
    return s


@njit(inline="always")  # inlined with a literal ftz (as _deq_row): the flush tests fold away when off
def _qmv_tile(x, qt, st, bt, n0, N, bits, gs, vpt, float_sums, code, contrib, simd, ftz, r, a, out):
    """k_qmv on one tile (its rows t0..t0+TB side by side)."""
    T, K = x.shape
    block = 32 * vpt
    for t0 in range(0, T, TB):
        nt = min(TB, T - t0)
        r[:, :, :] = ZERO
        for lo in range(0, K, block):
            for l in range(min(32, (K - lo) // vpt)):
                k0 = lo + vpt * l
                g = k0 // gs
                for tt in range(nt):
                    t = t0 + tt
                    sx = _xsum(x, t, k0, vpt, bits, float_sums, code, ftz)
                    a[:] = ZERO
                    if bits == 8:  # vpt 4 or 8: four products per pass over a
                        for i4 in range(k0, k0 + vpt, 4):
                            x0, x1, x2, x3 = x[t, i4], x[t, i4 + 1], x[t, i4 + 2], x[t, i4 + 3]
                            for j in range(NB):
                                v = fl(a[j] + x0 * qt[i4, j], ftz)
                                v = fl(v + x1 * qt[i4 + 1, j], ftz)
                                v = fl(v + x2 * qt[i4 + 2, j], ftz)
                                a[j] = fl(v + x3 * qt[i4 + 3, j], ftz)
                    else:  # vpt 8 or 16: two quads per pass over a
                        for i8 in range(k0, k0 + vpt, 8):
                            x0, x1, x2, x3 = x[t, i8], x[t, i8 + 1], x[t, i8 + 2], x[t, i8 + 3]
                            x4, x5, x6, x7 = x[t, i8 + 4], x[t, i8 + 5], x[t, i8 + 6], x[t, i8 + 7]
                            for j in range(NB):
                                q0 = fl(fl(fl(x0 * qt[i8, j] + x1 * qt[i8 + 1, j], ftz) + x2 * qt[i8 + 2, j],
                                           ftz) + x3 * qt[i8 + 3, j], ftz)
                                q1 = fl(fl(fl(x4 * qt[i8 + 4, j] + x5 * qt[i8 + 5, j], ftz)
                                           + x6 * qt[i8 + 6, j], ftz) + x7 * qt[i8 + 7, j], ftz)
                                a[j] = fl(fl(a[j] + q0, ftz) + q1, ftz)
                    for j in range(NB):
                        s, b = st[g, j], bt[g, j]
                        if contrib == 0:
                            c = fl(fma32(s, a[j], fl(sx * b, ftz)), ftz)
                        elif contrib == 1:
                            c = fl(fma32(sx, b, fl(s * a[j], ftz)), ftz)
                        else:
                            c = fl(fl(s * a[j], ftz) + fl(sx * b, ftz), ftz)
                        r[tt, l, j] = fl(r[tt, l, j] + c, ftz)
        for tt in range(nt):
            rt = r[tt]
            if simd == 0:
                lane_ladder(rt, 0, 32, ftz)
            elif simd == 1:
                h = 16
                while h >= 1:  # xor 1, 2, 4, ...: neighbours first (in place: row l reads rows 2l, 2l+1 >= l)
                    for l in range(h):
                        for j in range(NB):
                            rt[l, j] = fl(rt[2 * l, j] + rt[2 * l + 1, j], ftz)
                    h //= 2
            else:
                for l in range(1, 32):
                    for j in range(NB):
                        rt[0, j] = fl(rt[0, j] + rt[l, j], ftz)
            for j in range(min(NB, N - n0)):
                out[t0 + tt, n0 + j] = rt[0, j]


@compile_once
@njit(cache=True, parallel=THREADS)
def k_qmv(x, W, S, B, N, bits, gs, vpt, float_sums, code, contrib, simd, ftz, out):
    """rq.metal_qmv on the code tiles W (mode -1): lane l of block b covers ``k = 32*vpt*b + vpt*l + [0, vpt)``;
    its ``accum`` (8-bit: each product; 4-bit: quads ``((p0+p1)+p2)+p3``) and x-sum make
    ``r += contrib(scale, accum, sum, bias)``; lanes past K add nothing; then simd_sum (xor16 ladder, xor1
    butterfly, or sequential). Rows t0..t0+TB run side by side inside each lane (its vpt code rows stay in
    L1); every row's lane registers take the same adds in the same order."""
    for i in prange(W.shape[0]):  # as k_cpu_qmm: one thread per tile
        r = np.empty((TB, 32, NB), np.float32)
        a = np.empty(NB, np.float32)
        if ftz:  # a literal FTZ in each copy of the tile loop: LLVM drops the flush tests where they are off
            _qmv_tile(x, W[i], S[i], B[i], i * NB, N, bits, gs, vpt, float_sums, code, contrib, simd, True, r, a, out)
        else:
            _qmv_tile(x, W[i], S[i], B[i], i * NB, N, bits, gs, vpt, float_sums, code, contrib, simd, False, r, a,
                      out)


@njit(inline="always")  # inlined with a literal ftz, as _qmv_tile
def _wide_tile(x, W, i, N, gs, contract, ftz, r, out):
    """k_qmv_wide on tile i."""
    T, K = x.shape
    G = K // gs
    wt = W[i]
    n0 = i * NB
    for t0 in range(0, T, TB):
        nt = min(TB, T - t0)
        r[:, :, :] = ZERO
        for lo_g in range(0, G, 8):
            for sc in range(gs // 8):
                for l in range(min(8, G - lo_g)):
                    b = (lo_g + l) * gs + sc * 8
                    for tt in range(nt):
                        t = t0 + tt
                        x0, x1, x2, x3 = x[t, b], x[t, b + 1], x[t, b + 2], x[t, b + 3]
                        x4, x5, x6, x7 = x[t, b + 4], x[t, b + 5], x[t, b + 6], x[t, b + 7]
                        if contract:  # the 8 steps of one sub-chunk in registers, i = 0..7 in order
                            for j in range(NB):
                                a = fl(fma32(x0, wt[b, j], ZERO), ftz)
                                a = fl(fma32(x1, wt[b + 1, j], a), ftz)
                                a = fl(fma32(x2, wt[b + 2, j], a), ftz)
                                a = fl(fma32(x3, wt[b + 3, j], a), ftz)
                                a = fl(fma32(x4, wt[b + 4, j], a), ftz)
                                a = fl(fma32(x5, wt[b + 5, j], a), ftz)
                                a = fl(fma32(x6, wt[b + 6, j], a), ftz)
                                a = fl(fma32(x7, wt[b + 7, j], a), ftz)
                                r[tt, l, j] = fl(r[tt, l, j] + a, ftz)
                        else:
                            for j in range(NB):
                                a = fl(ZERO + fl(x0 * wt[b, j], ftz), ftz)
                                a = fl(a + fl(x1 * wt[b + 1, j], ftz), ftz)
                                a = fl(a + fl(x2 * wt[b + 2, j], ftz), ftz)
                                a = fl(a + fl(x3 * wt[b + 3, j], ftz), ftz)
                                a = fl(a + fl(x4 * wt[b + 4, j], ftz), ftz)
                                a = fl(a + fl(x5 * wt[b + 5, j], ftz), ftz)
                                a = fl(a + fl(x6 * wt[b + 6, j], ftz), ftz)
                                a = fl(a + fl(x7 * wt[b + 7, j], ftz), ftz)
                                r[tt, l, j] = fl(r[tt, l, j] + a, ftz)
        for tt in range(nt):
            rt = r[tt]
            lane_ladder(rt, 0, 8, ftz)
            for j in range(min(NB, N - n0)):
                out[t0 + tt, n0 + j] = rt[0, j]


@compile_once
@njit(cache=True, parallel=THREADS)
def k_qmv_wide(x, W, N, gs, contract, ftz, out):
    """rq.metal_qmv_wide on W (mode 1, float32, FTZ as the call's): lane l takes groups l, l+8, ...; per 8-value
    sub-chunk ``acc = sum x*w`` from +0 (``fma(x, w, acc)`` or ``acc + RN(x*w)``), then ``r += acc``; then the
    ladder 4, 2, 1. Rows t0..t0+TB side by side per sub-chunk, each in its own registers."""
    for i in prange(W.shape[0]):  # as k_cpu_qmm: one thread per tile
        r = np.empty((TB, 8, NB), np.float32)
        if ftz:  # a literal FTZ in each copy of the tile loop (as k_qmv)
            _wide_tile(x, W, i, N, gs, contract, True, r, out)
        else:
            _wide_tile(x, W, i, N, gs, contract, False, r, out)


@njit(inline="always")  # inlined with a literal ftz, as _qmv_tile
def _mma_tile(x, W, i, N, ranges, pstart, h2, ftz, acc, ks, out):
    """k_mma_q on tile i."""
    T, K = x.shape
    wt = W[i]
    n0 = i * NB
    for t0 in range(0, T, TB):
        nt = min(TB, T - t0)
        for p in range(len(pstart) - 1):
            acc[:, :] = ZERO
            for ri in range(pstart[p], pstart[p + 1]):
                lo, hi = ranges[ri, 0], ranges[ri, 1]
                for c in range(lo, hi, 8):
                    for e in range(8):
                        ks[e] = c + e if c + e < hi else K  # the zero row: a +0 product
                    k0, k1, k2, k3, k4, k5, k6, k7 = ks[0], ks[1], ks[2], ks[3], ks[4], ks[5], ks[6], ks[7]
                    for tt in range(nt):
                        t = t0 + tt
                        x0 = x[t, k0] if k0 < K else ZERO
                        x1 = x[t, k1] if k1 < K else ZERO
                        x2 = x[t, k2] if k2 < K else ZERO
                        x3 = x[t, k3] if k3 < K else ZERO
                        x4 = x[t, k4] if k4 < K else ZERO
                        x5 = x[t, k5] if k5 < K else ZERO
                        x6 = x[t, k6] if k6 < K else ZERO
                        x7 = x[t, k7] if k7 < K else ZERO
                        if h2:  # two loops, not a branch per column: each vectorises on its own
                            for j in range(NB):
                                acc[tt, j] = mma_h2(acc[tt, j], x0 * wt[k0, j], x1 * wt[k1, j], x2 * wt[k2, j],
                                                 x3 * wt[k3, j], x4 * wt[k4, j], x5 * wt[k5, j], x6 * wt[k6, j],
                                                 x7 * wt[k7, j], ftz)
                        else:
                            for j in range(NB):
                                acc[tt, j] = mma_h1(acc[tt, j], x0 * wt[k0, j], x1 * wt[k1, j], x2 * wt[k2, j],
                                                 x3 * wt[k3, j], x4 * wt[k4, j], x5 * wt[k5, j], x6 * wt[k6, j],
                                                 x7 * wt[k7, j], ftz)
            for tt in range(nt):
                for j in range(min(NB, N - n0)):
                    out[p, t0 + tt, n0 + j] = acc[tt, j]


@compile_once
@njit(cache=True, parallel=THREADS)
def k_mma_q(x, W, N, ranges, pstart, h2, ftz, out):
    """replay.jit.k_mma on the dequantized tiles W (qmm_t, qmm_t_splitk): partition p chains its K ranges from
    +0, one MMA8 step per 8 products (H1 in order, H2 pairwise), a range's last step zero-padded (row K of
    W); out[p] its float32 result. Rows t0..t0+TB side by side per step, each in its own accumulator."""
    for i in prange(W.shape[0]):  # as k_cpu_qmm: one thread per tile
        acc = np.empty((TB, NB), np.float32)
        ks = np.empty(8, np.int64)
        if ftz:  # a literal FTZ in each copy of the tile loop (as k_qmv)
            _mma_tile(x, W, i, N, ranges, pstart, h2, True, acc, ks, out)
        else:
            _mma_tile(x, W, i, N, ranges, pstart, h2, False, acc, ks, out)


@compile_once
@njit(cache=True)
def k_partials_dtype(parts, code, out):
    """rq.qmm_partials with ``partials=dtype``: each partition's float32 chain rounded to the dtype; thread y of
    ty = min(8, S) adds partitions y, y+ty, ... from +0, then ``total = t_y + total`` for y = 1.. (each add
    rounded once to the dtype, :func:`.jitcore.add_rounded`)."""
    S, T, N = parts.shape
    ty = min(8, S)
    for t in range(T):
        for n in range(N):
            total = ZERO
            for y in range(ty):
                acc = ZERO
                for j in range(y, S, ty):
                    acc = add_rounded(acc, rnd(parts[j, t, n], code), code)
                total = acc if y == 0 else add_rounded(acc, total, code)
            out[t, n] = total


def _c(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


def _prep_key(fn, params: Mapping[str, Any], var: Mapping[str, str], dtype: str, ftz: bool) -> tuple | None:
    """(mode, dtype code, ftz) of the tiles recipe ``fn`` reads: exactly what the tiles depend on besides the
    operands (qmv reads the codes: neither dtype nor FTZ enter), or None where ``fn`` is not compiled."""
    if fn is rq.cpu_qmm_t:
        return 0, DTYPE_CODE[dtype], False
    if fn is rq.metal_qmv:
        return -1, 0, False
    if fn is rq.metal_qmv_wide:
        return 1, 0, bool(ftz)  # w = ftz(fma(s, q, b)) in float
    if fn is rq.metal_qmm_t and var["mma"] in ("H1", "H2"):
        if var["dequant"] not in DEQUANT or var["dequant"] == "cpu":
            raise GemmdriftError(f"unknown dequantization variant {var['dequant']!r} (known: fma, mul-add, dtype)")
        return DEQUANT[var["dequant"]], DTYPE_CODE[dtype], bool(ftz)
    return None


def prepare(wq, scales, biases, bits: int, gs: int, prep: tuple) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The tiles (W, S, B) of :func:`k_prep` for packed codes ``wq`` (N, K*bits/32) under ``prep`` = (mode,
    dtype code, ftz): 4 (K+1) bytes per weight row in W, 8 (G+1) in S and B (rows rounded up to NB)."""
    N = wq.shape[0]
    K = wq.shape[1] * 32 // bits
    G = scales.shape[1]
    n_t = -(-N // NB)
    W = np.zeros((n_t, K + 1, NB), np.float32)
    S = np.zeros((n_t, G + 1, NB), np.float32)
    B = np.zeros((n_t, G + 1, NB), np.float32)
    mode, code, ftz = prep
    k_prep(wq, scales, biases, bits, gs, mode, code, ftz, W, S, B)
    return W, S, B


def quant_acc(fn, x, wq, scales, biases, params: Mapping[str, Any], var: Mapping[str, str], dtype: str,
              ftz: bool, cache: TileCache | None = None) -> np.ndarray | None:
    """The pre-rounding float32 result (T, N) on packed codes ``wq`` of the quantized recipe whose numpy
    function is ``fn``, or None where it is not compiled (qmm_t with MMA8 H3/H4, a recipe this module does not
    know). ``cache``: where the weight's prepared tiles are kept between calls (:mod:`.jitcache`; the
    same tiles, so the same bits); None prepares them for this call only."""
    x = _c(x)
    T, K = x.shape
    bits, g = int(params["bits"]), int(params["group_size"])
    if bits not in (4, 8):
        raise GemmdriftError(f"replay has affine recipes for 4 and 8 bits, not {bits}")
    prep = _prep_key(fn, params, var, dtype, ftz)
    if prep is None:
        return None
    wq = np.ascontiguousarray(wq, dtype=np.uint32)
    N = wq.shape[0]
    ftz = bool(ftz)
    if fn is rq.metal_qmv:
        fast = bool(params.get("fast", False))
        vpt, block = rq.qmv_geometry(bits, fast)
        if fast and K % block:
            raise GemmdriftError(f"qmv_fast {bits}-bit needs K % {block} == 0, got K={K}")
    if fn is rq.metal_qmm_t:
        split = int(params.get("split_k", 1))
        if K % (32 * split):
            raise GemmdriftError(f"qmm_t with split_k={split} needs K % {32 * split} == 0, got K={K}")
    sc, bi = _c(scales), _c(biases)

    def build():
        return prepare(wq, sc, bi, bits, g, prep)

    W, S, B = build() if cache is None else cache.get((wq, sc, bi), (bits, g) + prep, build)
    out = np.empty((T, N), dtype=np.float32)
    if fn is rq.cpu_qmm_t:
        k_cpu_qmm(x, W, DTYPE_CODE[dtype], N, out)
    elif fn is rq.metal_qmv:
        k_qmv(x, W, S, B, N, bits, g, vpt, bool(params.get("float_sums", True)), DTYPE_CODE[dtype],
              CONTRIB[var["contrib"]], SIMD[var["simd_sum"]], ftz, out)
    elif fn is rq.metal_qmv_wide:
        k_qmv_wide(x, W, N, g, var["contract"] == "fma", ftz, out)
    else:
        ps = K // split
        ranges = np.array([(p * ps, (p + 1) * ps) for p in range(split)], dtype=np.int64).reshape(-1, 2)
        pstart = np.arange(split + 1, dtype=np.int64)
        parts = np.empty((split, T, N), dtype=np.float32)
        k_mma_q(x, W, N, ranges, pstart, var["mma"] == "H2", ftz, parts)
        if split > 1 and var["partials"] == "dtype":  # numpy's add_rounded passes cost more than the chains
            k_partials_dtype(parts, DTYPE_CODE[dtype], out)
            return out
        return rq.qmm_partials(list(parts), var, dtype, ftz)
    return out


__all__ = ["TB", "k_prep", "k_cpu_qmm", "k_qmv", "k_qmv_wide", "k_mma_q", "k_partials_dtype", "prepare",
           "quant_acc"]
