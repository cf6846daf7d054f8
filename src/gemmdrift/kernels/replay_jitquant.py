"""Replay, compiled engine, part 3: the affine-quantized recipes' loops (numpy reference: :mod:`.replay_quant`).

As in :mod:`.replay_jit`: the output axis innermost, NB columns of independent
accumulators, the same operations in the same order as the numpy recipe of
each kernel. The packed codes are decoded, and where the recipe dequantizes
(the CPU's ``T(T(s*q) + b)``, qmv_wide's float ``fma(s, q, b)``, qmm_t's
threadgroup weights) dequantized, while each tile of weight rows is
transposed (:func:`.replay_jit._qtile`), exactly as the numpy recipes do before
their loops; qmm_t then runs :func:`.replay_jit.k_mma`.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..errors import GemmdriftError
from . import replay_quant as rq
from .replay_jit import _ladder, _mma, _qtile, _tile
from .replay_jitcore import DTYPE_CODE, NB, ZERO, _bf16, _f16, add_rounded, fl, fma32, njit, np, rnd

DEQUANT = {"cpu": 0, "fma": 1, "mul-add": 2, "dtype": 3}
CONTRIB = {name: i for i, name in enumerate(rq.CONTRIB)}  # fma, fma-bias, mul-add
SIMD = {"xor16": 0, "xor1": 1, "sequential": 2}


@njit(cache=True)
def k_cpu_qmm(x, wq, scales, biases, bits, gs, code, out):
    """rq.cpu_qmm_t's loop: ``sum = T(float32(sum + T(x*w)))``, k = 0..K-1 from 0, ``w = T(T(s*q)+b)``."""
    T, K = x.shape
    N = wq.shape[0]
    wt = np.zeros((K + 1, NB), np.float32)
    st = np.zeros((scales.shape[1] + 1, NB), np.float32)
    bt = np.zeros((scales.shape[1] + 1, NB), np.float32)
    acc = np.empty(NB, np.float32)
    for n0 in range(0, N, NB):
        _qtile(wq, scales, biases, bits, gs, 0, code, False, n0, wt, st, bt)
        for t in range(T):
            acc[:] = ZERO
            for k in range(K):
                xv = x[t, k]
                if code == 1:  # one loop per dtype, not a branch per element: each vectorises
                    for j in range(NB):
                        acc[j] = _bf16(acc[j] + _bf16(xv * wt[k, j]))
                elif code == 2:
                    for j in range(NB):
                        acc[j] = _f16(acc[j] + _f16(xv * wt[k, j]))
                else:
                    for j in range(NB):
                        acc[j] = acc[j] + xv * wt[k, j]
            for j in range(min(NB, N - n0)):
                out[t, n0 + j] = acc[j]


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


@njit(cache=True)
def k_qmv(x, wq, scales, biases, bits, gs, vpt, float_sums, code, contrib, simd, ftz, out):
    """rq.metal_qmv: lane l of block b covers ``k = 32*vpt*b + vpt*l + [0, vpt)``; its ``accum`` (8-bit: each
    product; 4-bit: quads ``((p0+p1)+p2)+p3``) and x-sum make ``r += contrib(scale, accum, sum, bias)``; lanes
    past K add nothing; then simd_sum (xor16 ladder, xor1 butterfly, or sequential)."""
    T, K = x.shape
    N = wq.shape[0]
    G = scales.shape[1]
    block = 32 * vpt
    qt = np.zeros((K + 1, NB), np.float32)
    st = np.zeros((G + 1, NB), np.float32)
    bt = np.zeros((G + 1, NB), np.float32)
    r = np.empty((32, NB), np.float32)
    a = np.empty(NB, np.float32)
    for n0 in range(0, N, NB):
        _qtile(wq, scales, biases, bits, gs, -1, 0, False, n0, qt, st, bt)  # the codes
        _tile(scales, n0, st)
        _tile(biases, n0, bt)
        for t in range(T):
            r[:, :] = ZERO
            for lo in range(0, K, block):
                for l in range(min(32, (K - lo) // vpt)):
                    k0 = lo + vpt * l
                    g = k0 // gs
                    sx = _xsum(x, t, k0, vpt, bits, float_sums, code, ftz)
                    a[:] = ZERO
                    if bits == 8:  # vpt 4 or 8: four products per pass over a
                        for i in range(k0, k0 + vpt, 4):
                            x0, x1, x2, x3 = x[t, i], x[t, i + 1], x[t, i + 2], x[t, i + 3]
                            for j in range(NB):
                                v = fl(a[j] + x0 * qt[i, j], ftz)
                                v = fl(v + x1 * qt[i + 1, j], ftz)
                                v = fl(v + x2 * qt[i + 2, j], ftz)
                                a[j] = fl(v + x3 * qt[i + 3, j], ftz)
                    else:  # vpt 8 or 16: two quads per pass over a
                        for i in range(k0, k0 + vpt, 8):
                            x0, x1, x2, x3 = x[t, i], x[t, i + 1], x[t, i + 2], x[t, i + 3]
                            x4, x5, x6, x7 = x[t, i + 4], x[t, i + 5], x[t, i + 6], x[t, i + 7]
                            for j in range(NB):
                                q0 = fl(fl(fl(x0 * qt[i, j] + x1 * qt[i + 1, j], ftz) + x2 * qt[i + 2, j], ftz)
                                        + x3 * qt[i + 3, j], ftz)
                                q1 = fl(fl(fl(x4 * qt[i + 4, j] + x5 * qt[i + 5, j], ftz) + x6 * qt[i + 6, j], ftz)
                                        + x7 * qt[i + 7, j], ftz)
                                a[j] = fl(fl(a[j] + q0, ftz) + q1, ftz)
                    for j in range(NB):
                        s, b = st[g, j], bt[g, j]
                        if contrib == 0:
                            c = fl(fma32(s, a[j], fl(sx * b, ftz)), ftz)
                        elif contrib == 1:
                            c = fl(fma32(sx, b, fl(s * a[j], ftz)), ftz)
                        else:
                            c = fl(fl(s * a[j], ftz) + fl(sx * b, ftz), ftz)
                        r[l, j] = fl(r[l, j] + c, ftz)
            if simd == 0:
                _ladder(r, 0, 32, ftz)
            elif simd == 1:
                h = 16
                while h >= 1:  # xor 1, 2, 4, ...: neighbours first (in place: row l reads rows 2l, 2l+1 >= l)
                    for l in range(h):
                        for j in range(NB):
                            r[l, j] = fl(r[2 * l, j] + r[2 * l + 1, j], ftz)
                    h //= 2
            else:
                for l in range(1, 32):
                    for j in range(NB):
                        r[0, j] = fl(r[0, j] + r[l, j], ftz)
            for j in range(min(NB, N - n0)):
                out[t, n0 + j] = r[0, j]


@njit(cache=True)
def k_qmv_wide(x, wq, scales, biases, bits, gs, contract, ftz, out):
    """rq.metal_qmv_wide: lane l takes groups l, l+8, ...; per 8-value sub-chunk ``acc = sum x*w`` from +0
    (``fma(x, w, acc)`` or ``acc + RN(x*w)``), then ``r += acc``; then the ladder 4, 2, 1."""
    T, K = x.shape
    N = wq.shape[0]
    G = K // gs
    wt = np.zeros((K + 1, NB), np.float32)
    st = np.zeros((G + 1, NB), np.float32)
    bt = np.zeros((G + 1, NB), np.float32)
    r = np.empty((8, NB), np.float32)
    for n0 in range(0, N, NB):
        _qtile(wq, scales, biases, bits, gs, 1, 0, ftz, n0, wt, st, bt)  # w = ftz(fma(s, q, b)) in float
        for t in range(T):
            r[:, :] = ZERO
            for lo_g in range(0, G, 8):
                for sc in range(gs // 8):
                    for l in range(min(8, G - lo_g)):
                        b = (lo_g + l) * gs + sc * 8
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
                                r[l, j] = fl(r[l, j] + a, ftz)
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
                                r[l, j] = fl(r[l, j] + a, ftz)
            _ladder(r, 0, 8, ftz)
            for j in range(min(NB, N - n0)):
                out[t, n0 + j] = r[0, j]


def _c(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


def quant_acc(fn, x, wq, scales, biases, params: Mapping[str, Any], var: Mapping[str, str], dtype: str,
              ftz: bool) -> np.ndarray | None:
    """The pre-rounding float32 result (T, N) on packed codes ``wq`` of the quantized recipe whose numpy
    function is ``fn``, or None where it is not compiled (qmm_t with MMA8 H3/H4, a recipe this module does not know)."""
    x = _c(x)
    T, K = x.shape
    bits, g = int(params["bits"]), int(params["group_size"])
    if bits not in (4, 8):
        raise GemmdriftError(f"replay has affine recipes for 4 and 8 bits, not {bits}")
    wq = np.ascontiguousarray(wq, dtype=np.uint32)
    N = wq.shape[0]
    out = np.empty((T, N), dtype=np.float32)
    ftz = bool(ftz)
    if fn is rq.cpu_qmm_t:
        k_cpu_qmm(x, wq, _c(scales), _c(biases), bits, g, DTYPE_CODE[dtype], out)
    elif fn is rq.metal_qmv:
        fast = bool(params.get("fast", False))
        vpt, block = rq.qmv_geometry(bits, fast)
        if fast and K % block:
            raise GemmdriftError(f"qmv_fast {bits}-bit needs K % {block} == 0, got K={K}")
        k_qmv(x, wq, _c(scales), _c(biases), bits, g, vpt, bool(params.get("float_sums", True)), DTYPE_CODE[dtype],
              CONTRIB[var["contrib"]], SIMD[var["simd_sum"]], ftz, out)
    elif fn is rq.metal_qmv_wide:
        k_qmv_wide(x, wq, _c(scales), _c(biases), bits, g, var["contract"] == "fma", ftz, out)
    elif fn is rq.metal_qmm_t and var["mma"] in ("H1", "H2"):
        split = int(params.get("split_k", 1))
        if var["dequant"] not in ("fma", "mul-add", "dtype"):
            raise GemmdriftError(f"unknown dequantization variant {var['dequant']!r} (known: fma, mul-add, dtype)")
        if K % (32 * split):
            raise GemmdriftError(f"qmm_t with split_k={split} needs K % {32 * split} == 0, got K={K}")
        ps = K // split
        quant = (wq, _c(scales), _c(biases), bits, g, DEQUANT[var["dequant"]], DTYPE_CODE[dtype])
        parts = _mma(x, None, [[(p * ps, (p + 1) * ps)] for p in range(split)], var["mma"], ftz, quant)
        return rq.qmm_partials(list(parts), var, dtype, ftz)
    else:
        return None
    return out


__all__ = ["k_cpu_qmm", "k_qmv", "k_qmv_wide", "quant_acc"]
