"""The float32 arithmetic a recipe is written in (elementwise only, no library reduction).

Every function here is one elementwise IEEE operation (or a fixed composition
of them) on numpy float32 arrays, so the order of every addition is the
caller's. numpy's ``np.sum``/``np.add.reduce``/``matmul``/``einsum`` are never
used for a value that is replayed: their order is numpy's, not the kernel's.

* :func:`round_to` rounds float32 values to bfloat16/float16 (RNE, as
  mlx's ``_MLX_BFloat16(float)`` and Metal's conversions do), kept as float32.
* :func:`fma` is a fused multiply-add with one rounding, exact for any float32
  operands: the product is exact in float64 (24 + 24 bits), and the sum is
  rounded to odd in float64 before the one rounding to float32, which makes
  the double rounding correct (Boldo and Melquiond, "Emulation of FMA and
  correctly rounded sums: proved algorithms using rounding to odd", 2008).
* :func:`flush` is the Apple GPU's flush-to-zero of float32 subnormals
  (METAL-ORDERS §0.4, dougallj/applegpu); :func:`needs_ftz` says when it can
  change nothing (then the recipes skip it, which is exact, not an
  approximation).
* :func:`lane_tree` is the lane-0 result of an explicit ``simd_shuffle_down``
  ladder (or of an xor butterfly read at lane 0); :func:`chain` a sequential sum.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import GemmdriftError

F32 = np.float32
TINY = np.float32(2.0 ** -126)  # the smallest normal float32
OUT_DTYPES = ("bfloat16", "float16", "float32")


def f32(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float32)


def round_to(a: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values rounded (to nearest, ties to even) to ``dtype``, returned as float32."""
    a = f32(a)
    if dtype == "float32":
        return a
    if dtype == "float16":
        return a.astype(np.float16).astype(np.float32)  # numpy's float32 -> float16 cast is RNE
    if dtype == "bfloat16":
        a = np.ascontiguousarray(a)
        u = a.view(np.uint32)
        # RNE on the upper 16 bits, as mlx/types/bf16.h does (in place on one buffer: 5 passes).
        r = u >> np.uint32(16)
        r &= np.uint32(1)
        r += np.uint32(0x7FFF)
        r += u
        r &= np.uint32(0xFFFF0000)
        nan = np.isnan(a)
        if nan.any():  # NaN stays a quiet NaN
            r[nan] = np.uint32(0x7FC00000)
        return r.view(np.float32)
    raise GemmdriftError(f"no rounding to {dtype!r} (known: {', '.join(OUT_DTYPES)})")


def round_bf16_inplace(a: np.ndarray, tmp: np.ndarray) -> np.ndarray:
    """:func:`round_to` bfloat16 of a contiguous float32 ``a``, in place, with a uint32 scratch ``tmp`` of its shape.

    No NaN handling: for finite values only (callers check their result is finite; inf stays inf).
    """
    u = a.view(np.uint32)
    np.right_shift(u, np.uint32(16), out=tmp)
    np.bitwise_and(tmp, np.uint32(1), out=tmp)
    np.add(tmp, np.uint32(0x7FFF), out=tmp)
    np.add(u, tmp, out=u)
    np.bitwise_and(u, np.uint32(0xFFFF0000), out=u)
    return a


def flush(a: np.ndarray) -> np.ndarray:
    """Flush float32 subnormals to a zero of the same sign (Apple GPU fp32 FTZ)."""
    return np.where(np.abs(a) < TINY, np.copysign(np.float32(0), a), a).astype(np.float32)


def min_nonzero(a: np.ndarray, rows: int = 1 << 14) -> float:
    """The smallest nonzero |a| (inf if none), a slice of rows at a time (no full-size temporaries)."""
    a = f32(a)
    flat = a.reshape(-1, a.shape[-1]) if a.ndim > 1 else a.reshape(1, -1)
    best = np.inf
    for lo in range(0, flat.shape[0], rows):
        blk = np.abs(flat[lo:lo + rows])
        best = min(best, float(np.min(blk, initial=np.inf, where=blk > 0)))  # a minimum, not a sum
    return best


def needs_ftz(*operands: np.ndarray, quantum_bits: int = 24, mins: tuple[float, ...] = ()) -> bool:
    """True if a sum of products of these operands could ever hold a subnormal.

    Every nonzero partial sum of exact products is a multiple of the smallest
    quantum (the product of the operands' smallest nonzero ulps), and rounding
    keeps it one; if that quantum is at least the smallest normal, no partial
    can be subnormal and FTZ is a no-op. ``quantum_bits``: significant bits of
    the operands (24 for float32; a safe bound for bf16/fp16 too). ``mins``:
    smallest nonzero magnitudes already known (e.g. of a weight, computed once).
    """
    q = 1.0
    for m in [min_nonzero(a) for a in operands] + list(mins):
        if not np.isfinite(m):
            return False  # an all-zero operand: every product is 0
        q *= m * 2.0 ** -(quantum_bits - 1)
    return q < float(TINY)


def add_rounded(a: np.ndarray, b: np.ndarray, dtype: str) -> np.ndarray:
    """``a + b`` correctly rounded to ``dtype`` once (a native bfloat/half add on the GPU, MSL4 Table 8.4).

    ``a`` and ``b`` must be values of ``dtype``: their float64 sum is then exact
    (or, beyond a 45-bit exponent gap, the larger operand, which is also the
    correctly rounded result). A float32 add then a rounding to bf16 would round
    twice; rounding the exact sum to odd in float32 first makes the second
    rounding correct (24 >= 8 + 2 bits).
    """
    if dtype == "float32":
        return add(a, b)
    s = _round_odd_sum(f32(a).astype(np.float64), f32(b).astype(np.float64))
    return round_to(_odd_f32(s), dtype)


def _odd_f32(s: np.ndarray) -> np.ndarray:
    """float64 -> float32 rounded to odd: exact values stay, others go to the neighbour with an odd last bit."""
    r = s.astype(np.float32)
    inexact = (r.astype(np.float64) != s) & np.isfinite(s)
    even = (r.view(np.uint32) & np.uint32(1)) == 0
    other = np.where(r.astype(np.float64) > s, np.nextafter(r, np.float32(-np.inf)),
                     np.nextafter(r, np.float32(np.inf)))
    return np.where(inexact & even, other, r).astype(np.float32)


def add(a: np.ndarray, b: np.ndarray, ftz: bool = False) -> np.ndarray:
    """One float32 addition, RN (with FTZ of the result when ``ftz``)."""
    s = np.add(a, b, dtype=np.float32)
    return flush(s) if ftz else s


def mul(a: np.ndarray, b: np.ndarray, ftz: bool = False) -> np.ndarray:
    p = np.multiply(a, b, dtype=np.float32)
    return flush(p) if ftz else p


def _round_odd_sum(p: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float64 ``p + c``, rounded to odd wherever a later rounding to float32 could round twice wrongly.

    RN64 can land on a float32 midpoint (representable in float64) but never
    cross one, so RN32(RN64(x)) differs from RN32(x) only where the float64
    sum is exactly a float32 midpoint (low 29 bits 1 followed by zeros) or
    float32-subnormal: only there is the exact TwoSum error computed, and the
    sum rounded to odd (moved one float64 ulp toward the exact value where its last bit is even).
    ``p`` and ``c`` broadcast (a (T, N) accumulator plus an (N,) bias), as ``p + c`` does.
    """
    p, c = np.broadcast_arrays(p, c)  # the risky elements are indexed in both: same shape first
    s = p + c
    bits = s.view(np.int64)
    risky = ((bits & np.int64(0x1FFFFFFF)) == np.int64(0x10000000)) | (np.abs(s) < 2.0 ** -125)
    if not risky.any():
        return s
    idx = np.nonzero(risky)
    ps, cs, ss = p[idx], c[idx], s[idx]
    bp = ss - cs
    e = (ps - bp) + (cs - (ss - bp))
    # Round to odd: an inexact sum with an even last bit moves one ulp toward the exact value (aimed at the
    # infinity of e: ss + e rounds back to ss when |e| is below half an ulp); an odd one is already right.
    fix = (e != 0) & np.isfinite(ss) & ((ss.view(np.int64) & np.int64(1)) == 0)
    s = s.copy()
    s[idx] = np.where(fix, np.nextafter(ss, np.copysign(np.inf, e)), ss)
    return s


def fma(a: np.ndarray, b: np.ndarray, c: np.ndarray, ftz: bool = False) -> np.ndarray:
    """``RN32(a * b + c)`` with a single rounding, for float32 operands (see the module docstring)."""
    p = np.multiply(f32(a).astype(np.float64), f32(b).astype(np.float64))  # exact: 48 significant bits
    p, c64 = np.broadcast_arrays(p, f32(c).astype(np.float64))
    r = _round_odd_sum(np.ascontiguousarray(p), np.ascontiguousarray(c64)).astype(np.float32)
    return flush(r) if ftz else r


def chain(terms: Sequence[np.ndarray], start: np.ndarray | None = None, ftz: bool = False) -> np.ndarray:
    """``((start + t0) + t1) + ...`` in float32; ``start`` defaults to +0 (as ``AccT acc = 0`` does)."""
    acc = np.zeros_like(f32(terms[0])) if start is None else f32(start)
    for t in terms:
        acc = add(acc, t, ftz)
    return acc


def pairwise(terms: Sequence[np.ndarray], ftz: bool = False) -> np.ndarray:
    """Balanced tree, halves split at len // 2 (as fingerprint.pairwise)."""
    if len(terms) == 1:
        return f32(terms[0])
    h = len(terms) // 2
    return add(pairwise(terms[:h], ftz), pairwise(terms[h:], ftz), ftz)


def lane_tree(r: np.ndarray, axis: int = 0, ftz: bool = False) -> np.ndarray:
    """Lane 0 of ``for off = n/2 .. 1: r += simd_shuffle_down(r, off)`` over ``axis`` (n a power of two).

    Lane l < n - off reads lane l + off; the upper lanes never feed lane 0.
    The same association is an xor butterfly 16, 8, 4, 2, 1 read at lane 0.
    """
    cur = np.moveaxis(f32(r), axis, 0)
    n = cur.shape[0]
    if n & (n - 1):
        raise GemmdriftError(f"a shuffle ladder needs a power-of-two lane count, got {n}")
    while cur.shape[0] > 1:
        h = cur.shape[0] // 2
        cur = add(cur[:h], cur[h:2 * h], ftz)
    return cur[0]


def adjacent_tree(r: np.ndarray, axis: int = 0, ftz: bool = False) -> np.ndarray:
    """Lane 0 of an xor butterfly 1, 2, 4, 8, 16: neighbours first, ``((l0+l1)+(l2+l3))+...``."""
    cur = np.moveaxis(f32(r), axis, 0)
    while cur.shape[0] > 1:
        cur = add(cur[0::2], cur[1::2], ftz)
    return cur[0]


def sequential_lanes(r: np.ndarray, axis: int = 0, ftz: bool = False) -> np.ndarray:
    """``(((l0 + l1) + l2) + ...)``: lane 0 first, then each lane in order."""
    cur = np.moveaxis(f32(r), axis, 0)
    acc = cur[0]
    for i in range(1, cur.shape[0]):
        acc = add(acc, cur[i], ftz)
    return acc


SIMD_SUMS = {"xor16": lane_tree, "xor1": adjacent_tree, "sequential": sequential_lanes}


def exact_then_round(terms: Sequence[np.ndarray], rounding: str = "rn") -> np.ndarray:
    """The sum of float32 ``terms`` with one rounding to float32 (MMA hypothesis H3).

    Accumulated in float64 with every step rounded to odd; the final rounding
    is then correct while the terms span fewer than 2**28 binades of overlap
    (always, for the 9 terms of one MMA8 step on bf16 products of normal size).
    """
    acc = f32(terms[0]).astype(np.float64)
    for t in terms[1:]:
        acc = _round_odd_sum(acc, f32(t).astype(np.float64))
    return _to_f32(acc, rounding)


def _to_f32(x64: np.ndarray, rounding: str) -> np.ndarray:
    r = x64.astype(np.float32)
    if rounding == "rz":
        # Round toward zero: step back one ulp where RN went away from zero.
        away = np.abs(r.astype(np.float64)) > np.abs(x64)
        r = np.where(away, np.nextafter(r, np.float32(0)), r).astype(np.float32)
    return r


def aligned_sum(terms: Sequence[np.ndarray], frac_bits: int = 24) -> np.ndarray:
    """MMA hypothesis H4 (MMA-Sim's fused dot-add): align every term to the largest exponent, truncate each
    to ``frac_bits`` bits below it, add exactly, round once toward zero."""
    t64 = [f32(t).astype(np.float64) for t in terms]
    mags = np.stack([np.abs(t) for t in t64])
    _, e = np.frexp(mags.max(axis=0))  # 2**(e-1) <= max |term| < 2**e  (np.max: a maximum, not a sum)
    quantum = np.ldexp(1.0, e - frac_bits)
    acc = np.zeros_like(t64[0])
    for t in t64:
        acc = acc + np.trunc(t / quantum) * quantum  # exact: < 2**(frac_bits + 4) quanta in all
    return _to_f32(acc, "rz")


__all__ = ["F32", "TINY", "OUT_DTYPES", "f32", "round_to", "round_bf16_inplace", "add_rounded", "flush", "min_nonzero", "needs_ftz", "add", "mul", "fma", "chain",
           "pairwise", "lane_tree", "adjacent_tree", "sequential_lanes", "SIMD_SUMS", "exact_then_round",
           "aligned_sum"]
