"""The affine-quantized recipes (``quantized_matmul(x, w, scales, biases, transpose=True)``).

Operands: ``x`` (T, K) float32 values of the activation dtype, ``q`` (N, K)
integer codes, ``scales``/``biases`` (N, K / group) float32 values of that
dtype. Sources (ml-explore/mlx; Metal at 846d176 with the 0.32.4 wheel's
header differences of METAL-ORDERS §9, CPU at v0.32.1):

* ``cpu_qmm_t``: ``mlx/backend/cpu/quantized.cpp`` ``_qmm_t`` L155-212
  (``_qmm_t_simd`` needs ``simd::max_size<T> % (32/bits) == 0``, and
  max_size is 1 on x86, L297-303): ``T sum = 0; sum += x * (scale * q +
  bias)`` with every operator a ``_MLX_BFloat16`` op (``mlx/types/bf16.h``:
  float arithmetic, then RNE to bf16), so each of the four operations rounds,
  and the add rounds twice (float32, then bf16).
* ``metal_qmv`` (and qmv_fast): ``kernels/quantized.h`` ``qmv_impl``
  L824-983, ``qmv_fast_impl`` L757-822, ``load_vector`` L28-105, ``qdot``
  L191-290: ``result += scale * accum + sum * bias`` per lane and block, then
  ``simd_sum``.
* ``metal_qmv_wide``: ``quantized.h`` ``qmv_wide_impl`` L985-1080 (8 lanes,
  group-strided, shuffle-down 4, 2, 1).
* ``metal_qmm_t``: ``quantized.h`` ``qmm_t_impl`` L1192-1318 with
  ``QuantizedBlockLoader`` L571-698 (weights dequantized to the dtype in
  threadgroup memory, then the steel MMA8 chain, BK 32); split-K
  ``affine_qmm_t_splitk`` L1965-2022, host ``quantized.cpp`` ``qmm_splitk``
  L1120-1217, reduction ``reduction/reduce_col.h`` L1-92.

Contraction (``contrib``, ``contract``): the default is the fused form. Measured
on an Apple M4 (macOS 15.6.1; mathiasbourgoin/Sarek ``tools/probes/
metal_math_mode_probe.m`` and ``metal_contraction_barrier_probe.m`` @4716bfc5):
float ``a*b + c`` is contracted to an FMA on every observable element (8773 of
65536; the count is reproduced from the probe's host generator in
tests/test_replay_sarek.py) under every MTLCompileOptions math mode, Safe
included; only ``#pragma METAL fp contract(off)`` or ``#pragma clang fp
contract(off)`` stops it. mlx has no such pragma (``git grep -i contract
mlx/backend/metal`` at 846d176 finds only a licence text); its metallib is built
with ``-fno-fast-math`` (``kernels/CMakeLists.txt`` L18) and its JIT kernels
with ``MathMode::Safe`` (``device.cpp`` L38-62), which do not stop contraction.
Which of two products in ``a*b + c*d`` is fused is the compiler's choice
(``fma``: clang's ``fmuladd(a, b, c*d)``; ``fma-bias`` the other); not
measured, nor on any other generation.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ..errors import GemmdriftError
from .core import SIMD_SUMS, add, add_rounded, f32, fma, lane_tree, mul, round_bf16_inplace, round_to
from .dense import mma8

CONTRIB = {
    "fma": "fma(scale, accum, RN(sum*bias)): clang's contraction of a*b + c*d",
    "fma-bias": "fma(sum, bias, RN(scale*accum))",
    "mul-add": "RN(RN(scale*accum) + RN(sum*bias)): no contraction",
}
# Whether qmv_wide's ``acc += x * w_dq`` is an FMA (w_dq is a float, not bf16-exact, so it matters). Its
# ``w = s*q + b`` needs no axis: s*q is exact in float32 for bf16/fp16 scales (8 or 11 bits times <= 8 bits),
# so fma(s, q, b) == RN(RN(s*q) + b). The same holds for qmm_t's dequantization.
CONTRACT = {"fma": "acc = fma(x, w, acc)", "none": "acc = RN(acc + RN(x*w))"}


def unpack(wq: np.ndarray, bits: int, K: int) -> np.ndarray:
    """Integer codes (N, K) of mlx's packed uint32 weights (element i of a word in bits [bits*i, bits*(i+1)))."""
    if bits not in (4, 8):
        raise GemmdriftError(f"replay has affine recipes for 4 and 8 bits, not {bits}")
    w = np.ascontiguousarray(wq, dtype=np.uint32)
    per = 32 // bits
    shifts = (np.arange(per, dtype=np.uint32) * bits)
    codes = (w[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    return codes.reshape(w.shape[0], -1)[:, :K].astype(np.float32)


def _groups(a: np.ndarray, group_size: int, K: int) -> np.ndarray:
    """Per-group (N, K/g) values repeated to (N, K)."""
    return np.repeat(f32(a), group_size, axis=1)[:, :K]


# ------------------------------------------------------------------------------ CPU


def cpu_qmm_t(x, q, scales, biases, params: Mapping[str, Any], var, dtype: str, ftz: bool) -> np.ndarray:
    """k = 0..K-1: ``w = T(T(scale*q) + bias)``, ``sum = T(float32(sum + T(x*w)))`` from 0 (see module)."""
    g = int(params["group_size"])
    K = q.shape[1]
    s, b = _groups(scales, g, K), _groups(biases, g, K)
    # scale*q is exact in float32 (8 x 8 bits), then each bf16 operator rounds its float result.
    w = round_to(add(round_to(mul(s, q), dtype), b), dtype)
    # x*w: exact in float32 for bf16/fp16 (8+8, 11+11 bits), then the operator's rounding; all k at once.
    t = round_to(np.multiply(f32(x).T[:, :, None], w.T[:, None, :], dtype=np.float32), dtype)  # (K, T, N)
    acc = np.zeros(t.shape[1:], dtype=np.float32)
    if dtype == "bfloat16" and np.isfinite(t).all():
        tmp = np.empty(acc.shape, dtype=np.uint32)
        for k in range(K):
            np.add(acc, t[k], out=acc)  # float32 add, then the bf16 store: two roundings
            round_bf16_inplace(acc, tmp)
        if np.isfinite(acc).all():
            return acc
        acc[...] = 0  # an overflow on the way: redo with NaN-aware rounding
    for k in range(K):
        acc = round_to(np.add(acc, t[k], out=acc), dtype)
    return acc


# ------------------------------------------------------------------------------ Metal qmv


def qmv_geometry(bits: int, fast: bool) -> tuple[int, int]:
    """(values per lane, block) of qmv_fast / qmv (quantized.h L757-835)."""
    pack = 32 // bits
    vpt = pack * 2 if fast else pack
    return vpt, vpt * 32


def _partial_sum(xb: np.ndarray, bits: int, float_sums: bool, dtype: str, ftz: bool) -> np.ndarray:
    """``load_vector``'s sum over one lane's values (axis 0): 4-bit adds quads ``x0+x1+x2+x3`` (bf16 ops at
    0.32.2 and older, float at 0.32.4) into a float sum; 8-bit adds each x into a float sum."""
    if bits == 8 or float_sums:  # the same float adds, in the same order, as qdot's accum
        return qdot_accum(xb, bits, ftz)
    s = np.zeros(xb.shape[1:], dtype=np.float32)
    for i in range(0, xb.shape[0], 4):
        quad = add_rounded(add_rounded(add_rounded(xb[i], xb[i + 1], dtype), xb[i + 2], dtype), xb[i + 3], dtype)
        s = add(s, quad, ftz)
    return s


def qdot_accum(pb: np.ndarray, bits: int, ftz: bool) -> np.ndarray:
    """``qdot``'s accum (axis 0 = the lane's exact products x*q), from +0: 4-bit per uint16,
    ``accum += ((p0+p1)+p2)+p3``; 8-bit ``accum += p`` each (the affine and the fp kernels' qdot alike)."""
    a = np.zeros(pb.shape[1:], dtype=np.float32)
    if bits == 8:
        for i in range(pb.shape[0]):
            a = add(a, pb[i], ftz)
        return a
    for i in range(0, pb.shape[0], 4):
        a = add(a, add(add(add(pb[i], pb[i + 1], ftz), pb[i + 2], ftz), pb[i + 3], ftz), ftz)
    return a


def _contrib(scale, accum, sx, bias, how: str, ftz: bool) -> np.ndarray:
    if how == "fma":
        return fma(scale, accum, mul(sx, bias, ftz), ftz)
    if how == "fma-bias":
        return fma(sx, bias, mul(scale, accum, ftz), ftz)
    if how == "mul-add":
        return add(mul(scale, accum, ftz), mul(sx, bias, ftz), ftz)
    raise GemmdriftError(f"unknown contribution variant {how!r} (known: {', '.join(CONTRIB)})")


def qmv_blocks(x, q, vpt: int, block: int, bits: int, ftz: bool):
    """The lane blocks of qmv and fp_qmv (the affine and the fp kernels walk K alike): for each block of ``block``
    values, (lanes, ks, xb, acc) with ``ks`` (lane, value) the indices lane l reads, ``xb`` (lane, vpt, T, 1) its
    x values and ``acc`` (lane, T, N) its ``qdot`` of the exact products x * q (bf16 x an integer code or an exact
    fp code) in the kernel's order. Lanes past K (the safe tail) are not in the block."""
    K = q.shape[1]
    for lo in range(0, K, block):
        lanes = min(32, (K - lo) // vpt)
        ks = lo + np.arange(lanes * vpt).reshape(lanes, vpt)  # (lane, value)
        xb = np.moveaxis(x[:, ks], 0, 2)[..., None]  # (lane, vpt, T, 1)
        qb = np.moveaxis(q[:, ks], 0, 2)[:, :, None, :]  # (lane, vpt, 1, N)
        pb = np.multiply(xb, qb, dtype=np.float32)  # exact
        yield lanes, ks, xb, qdot_accum(np.moveaxis(pb, 1, 0), bits, ftz)


def metal_qmv(x, q, scales, biases, params: Mapping[str, Any], var, dtype: str, ftz: bool) -> np.ndarray:
    """qmv / qmv_fast: lane l, block b covers ``k = B*b + vpt*l + [0, vpt)`` (one group); per block
    ``r += contrib(scale, accum, sum, bias)`` from +0; lanes past K (qmv's safe tail) add nothing; then
    ``simd_sum`` over the 32 lanes (its order: a variant), then the dtype."""
    bits, g = int(params["bits"]), int(params["group_size"])
    fast = bool(params.get("fast", False))
    vpt, block = qmv_geometry(bits, fast)
    T, K, N = x.shape[0], q.shape[1], q.shape[0]
    if fast and K % block:
        raise GemmdriftError(f"qmv_fast {bits}-bit needs K % {block} == 0, got K={K}")
    float_sums = bool(params.get("float_sums", True))
    r = np.zeros((32, T, N), dtype=np.float32)
    for lanes, ks, xb, acc in qmv_blocks(x, q, vpt, block, bits, ftz):
        grp = ks[:, 0] // g
        s = f32(scales)[:, grp].T[:, None, :]  # (lane, 1, N)
        b = f32(biases)[:, grp].T[:, None, :]
        sx = _partial_sum(np.moveaxis(xb, 1, 0), bits, float_sums, dtype, ftz)  # (lane, T, 1)
        c = _contrib(np.broadcast_to(s, acc.shape), acc, np.broadcast_to(sx, acc.shape),
                     np.broadcast_to(b, acc.shape), var["contrib"], ftz)
        r[:lanes] = add(r[:lanes], c, ftz)
    return SIMD_SUMS[var["simd_sum"]](r, axis=0, ftz=ftz)


# ------------------------------------------------------------------------------ Metal qmv_wide


def _dequant(s, q, b, contracted: bool, ftz: bool) -> np.ndarray:
    return fma(s, q, b, ftz) if contracted else add(mul(s, q, ftz), b, ftz)


def metal_qmv_wide(x, q, scales, biases, params: Mapping[str, Any], var, dtype: str, ftz: bool) -> np.ndarray:
    """qmv_wide (affine, 8 lanes): lane l takes groups l, l+8, ...; per 8-value sub-chunk
    ``acc = sum_i x_i * w_i`` from +0 with ``w = s*q + b`` in float, then ``r += acc``; shuffle-down 4, 2, 1."""
    g = int(params["group_size"])
    T, K, N = x.shape[0], q.shape[1], q.shape[0]
    G = K // g
    dot_fma = var["contract"] == "fma"
    # The float dequantization of every weight (the same for every lane that reads it), made once.
    w = _dequant(_groups(scales, g, K), q, _groups(biases, g, K), True, ftz)  # (N, K)
    xt = np.ascontiguousarray(f32(x).T)  # (K, T)
    wt = np.ascontiguousarray(w.T)  # (K, N)
    r = np.zeros((8, T, N), dtype=np.float32)
    for lo_g in range(0, G, 8):
        lanes = min(8, G - lo_g)
        base = (lo_g + np.arange(lanes)) * g  # lane l's group starts here
        for sc_i in range(g // 8):
            acc = np.zeros((lanes, T, N), dtype=np.float32)
            for i in range(8):
                ks = base + sc_i * 8 + i  # one k per lane
                xv, wv = xt[ks][:, :, None], wt[ks][:, None, :]  # (lane, T, 1), (lane, 1, N)
                acc = fma(xv, wv, acc, ftz) if dot_fma else add(acc, mul(xv, wv, ftz), ftz)
            r[:lanes] = add(r[:lanes], acc, ftz)
    return lane_tree(r, axis=0, ftz=ftz)


# ------------------------------------------------------------------------------ Metal qmm_t


def qmm_split_k(M: int, N: int, K: int, group_size: int) -> int:
    """split_k of ``qmm_splitk`` (quantized.cpp L1120-1217)."""
    step = max(group_size, 32)
    s = max(1, 512 // (-(-N // 32) * -(-M // 32)))
    s = min(s, K // step)
    while s > 1 and K % (s * step):
        s -= 1
    return max(1, s)


def _qmm_weights(q, scales, biases, g: int, dq: str, dtype: str, ftz: bool) -> np.ndarray:
    """The dequantized weights in threadgroup memory: ``T(fma(s, q, b))`` (float math, one rounding; from
    v0.32.1, commit 56e026d8a), ``T(RN(RN(s*q)+b))``, or ``T(T(s*q) + b)`` in bf16 arithmetic before v0.32.1."""
    K = q.shape[1]
    s, b = _groups(scales, g, K), _groups(biases, g, K)
    if dq == "fma":
        return round_to(fma(s, q, b, ftz), dtype)
    if dq == "mul-add":
        return round_to(add(mul(s, q, ftz), b, ftz), dtype)
    if dq == "dtype":
        return add_rounded(round_to(mul(s, q), dtype), b, dtype)
    raise GemmdriftError(f"unknown dequantization variant {dq!r} (known: fma, mul-add, dtype)")


def metal_qmm_t(x, q, scales, biases, params: Mapping[str, Any], var, dtype: str, ftz: bool) -> np.ndarray:
    """qmm_t: the MMA8 chain over K of ``x * T(w)`` (exact products); with split_k > 1 each contiguous
    partition's chain is rounded to the partial dtype and the partials reduced (``partials`` variant:
    ``dtype`` = bf16 partials summed by col_reduce_small in bf16 (0.32.2 and older), ``float32`` = float32
    partials summed in order (0.32.4; its reduction is not known from the wheel: an assumption))."""
    w = _qmm_weights(q, scales, biases, int(params["group_size"]), var["dequant"], dtype, ftz)
    return qmm_chain(x, w, int(params.get("split_k", 1)), var, dtype, ftz)


def qmm_chain(x, w, split: int, var, dtype: str, ftz: bool) -> np.ndarray:
    """The steel MMA8 chain over K of ``x * w`` (w: the dequantized weights of the dtype, (N, K)), in ``split``
    contiguous partitions reduced by :func:`qmm_partials` (shared by affine and fp qmm_t)."""
    K = w.shape[1]
    P = np.multiply(f32(x).T[:, :, None], w.T[:, None, :], dtype=np.float32)  # (K, T, N), exact
    if K % (32 * split):
        raise GemmdriftError(f"qmm_t with split_k={split} needs K % {32 * split} == 0, got K={K}")
    ps = K // split
    parts = []
    for p in range(split):
        acc = np.zeros(P.shape[1:], dtype=np.float32)
        for c in range(p * ps, (p + 1) * ps, 8):
            acc = mma8(acc, P[c:c + 8], var["mma"], ftz)
        parts.append(acc)
    return qmm_partials(parts, var, dtype, ftz)


def qmm_partials(parts, var, dtype: str, ftz: bool) -> np.ndarray:
    """qmm_t's split-K reduction of the partitions' float32 chains (one partition: its chain)."""
    split = len(parts)
    if split == 1:
        return parts[0]
    if var["partials"] == "float32":
        out = np.zeros_like(parts[0])
        for a in parts:
            out = add(out, a, ftz)
        return out
    # bf16 partials; col_reduce_small: thread y of ty = min(8, S) adds partitions y, y+ty, ... from 0, then
    # total = t_j + total for j = 1.. (all native dtype adds).
    bp = [round_to(a, dtype) for a in parts]
    ty = min(8, split)
    ts = []
    for y in range(ty):
        t = np.zeros_like(bp[0])
        for j in range(y, split, ty):
            t = add_rounded(t, bp[j], dtype)
        ts.append(t)
    total = ts[0]
    for t in ts[1:]:
        total = add_rounded(t, total, dtype)
    return total


__all__ = ["CONTRIB", "CONTRACT", "unpack", "qdot_accum", "cpu_qmm_t", "qmv_geometry", "metal_qmv", "metal_qmv_wide",
           "qmm_split_k", "metal_qmm_t", "qmm_chain", "qmm_partials"]
