"""Drift metrics: pure numpy, no mlx.

Tensors arrive as float32 (or float64) numpy arrays holding values that are
exactly representable in their *storage* dtype (bfloat16, float16, float32):
upcasting bf16/fp16 to float32 is exact, so nothing is lost. ULP distances are
counted in the storage dtype, never in float32.

Percentiles are always given on the 0-100 scale (``p99`` is the 99th).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

STORAGE_DTYPES = ("bfloat16", "float16", "float32", "float64")
# Unit roundoff u = 2**-(mantissa bits + 1) of each storage dtype.
UNIT_ROUNDOFF = {"bfloat16": 2.0**-8, "float16": 2.0**-11, "float32": 2.0**-24, "float64": 2.0**-53}
PERCENTILES = (50, 99, 99.9)


def storage_bits(x: np.ndarray, dtype: str) -> tuple[np.ndarray, int]:
    """The bit patterns of ``x`` in ``dtype`` and their width.

    Raises ValueError if a value is not exactly representable in ``dtype``
    (that would be a bug upstream: values must be stored, not computed, ones).
    """
    x = np.asarray(x)
    if dtype == "bfloat16":
        bits32 = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
        if np.any(bits32 & 0xFFFF):
            raise ValueError("values are not bfloat16-representable")
        return (bits32 >> 16).astype(np.uint16), 16
    if dtype == "float16":
        h = x.astype(np.float16)
        if not np.array_equal(h.astype(x.dtype), x, equal_nan=True):
            raise ValueError("values are not float16-representable")
        return h.view(np.uint16), 16
    if dtype == "float32":
        f = x.astype(np.float32)
        if not np.array_equal(f.astype(x.dtype), x, equal_nan=True):
            raise ValueError("values are not float32-representable")
        return f.view(np.uint32), 32
    if dtype == "float64":
        return np.ascontiguousarray(x, dtype=np.float64).view(np.uint64), 64
    raise ValueError(f"unknown storage dtype {dtype!r}")


def ordered_int(bits: np.ndarray, width: int) -> np.ndarray:
    """Map IEEE bit patterns to integers whose order is the order of the values.

    Adjacent representable numbers map to adjacent integers; +0 and -0 both map
    to 0. The difference of two such integers is the ULP distance.
    """
    sign = 1 << (width - 1)
    if width == 64:  # object arrays: exact Python ints
        b = bits.astype(np.uint64).astype(object)
        return np.array([-(v & (sign - 1)) if v & sign else v for v in b.ravel()], dtype=object).reshape(b.shape)
    b = bits.astype(np.int64)
    return np.where(b >= sign, sign - b, b)  # a set sign bit: -(b - sign)


def ulp_distance(a: np.ndarray, b: np.ndarray, dtype: str) -> np.ndarray:
    """Number of ``dtype`` values between a and b, elementwise (0 = bit-equal up to the sign of 0)."""
    ba, w = storage_bits(a, dtype)
    bb, _ = storage_bits(b, dtype)
    d = np.abs(ordered_int(ba, w) - ordered_int(bb, w))
    return d.astype(np.float64) if w == 64 else d


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """Round float64 values to ``dtype`` (round to nearest, ties to even), returned as float64.

    numpy rounds float64 -> float16/float32 correctly in one step. For bfloat16
    a detour through float32 could round twice, so the two bfloat16 neighbours
    are formed and the nearer one chosen directly.
    """
    x = np.asarray(x, dtype=np.float64)
    if dtype == "float64":
        return x.copy()
    if dtype in ("float32", "float16"):
        return x.astype(np.float32 if dtype == "float32" else np.float16).astype(np.float64)
    if dtype != "bfloat16":
        raise ValueError(f"unknown storage dtype {dtype!r}")
    f = x.astype(np.float32)
    bits = f.view(np.uint32)
    lo = (bits & 0xFFFF0000).view(np.float32).astype(np.float64)  # toward zero
    step = np.where(np.isfinite(f), (bits & 0xFFFF0000) + 0x10000, bits & 0xFFFF0000)
    hi = step.astype(np.uint32).view(np.float32).astype(np.float64)  # away from zero
    dlo, dhi = np.abs(x - lo), np.abs(x - hi)
    lo_even = ((bits >> 16) & 1) == 0
    pick_hi = (dhi < dlo) | ((dhi == dlo) & ~lo_even)
    out = np.where(pick_hi, hi, lo)
    return np.where(np.isfinite(x), out, x)


def _pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if values.size else 0.0


def compare(a: np.ndarray, b: np.ndarray, dtype: str) -> dict[str, float]:
    """Drift between two tensors of the same storage dtype (a is the reference).

    Returns:
        n: elements compared; frac_differ: fraction not bit-identical;
        max_ulp / p50_ulp / p99_ulp / p99.9_ulp: ULP distance in ``dtype``;
        max_abs: max |a-b|; rel_l2: ||a-b|| / ||a||;
        nmse: mse(a, b) / mse(a, 0), as llama.cpp's test-backend-ops defines it.
    """
    a = np.asarray(a)
    b = np.asarray(b)
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch {a.shape} vs {b.shape}")
    if a.size == 0:
        raise ValueError("nothing to compare (no elements)")
    ba, w = storage_bits(a, dtype)
    bb, _ = storage_bits(b, dtype)
    ulps = np.abs(ordered_int(ba, w) - ordered_int(bb, w)).astype(np.float64).ravel()
    a64 = a.astype(np.float64)
    d = a64 - b.astype(np.float64)
    sq_d = float(np.sum(d * d))
    sq_a = float(np.sum(a64 * a64))
    out = {
        "n": float(a.size),
        "frac_differ": float(np.count_nonzero(ba != bb)) / a.size,
        "max_ulp": float(ulps.max()),
        "max_abs": float(np.max(np.abs(d))),
        "rel_l2": math.sqrt(sq_d / sq_a) if sq_a > 0 else (0.0 if sq_d == 0 else math.inf),
        "nmse": sq_d / sq_a if sq_a > 0 else (0.0 if sq_d == 0 else math.inf),
    }
    # One partition for all percentiles (np.percentile gives each the same value as a call of its own).
    for q, v in zip(PERCENTILES, np.percentile(ulps, PERCENTILES)):
        out[f"p{q:g}_ulp"] = float(v)
    return out


def error_vs_exact(y: np.ndarray, exact: np.ndarray, dtype: str) -> dict[str, float]:
    """Error of a computed tensor ``y`` against a float64 reference ``exact``.

    ``ulp_vs_rounded`` counts ULPs from the correctly rounded result, so 0
    means the kernel returned the best answer its storage dtype allows.
    """
    exact = np.asarray(exact, dtype=np.float64)
    y64 = np.asarray(y, dtype=np.float64)
    d = y64 - exact
    sq_e = float(np.sum(exact * exact))
    ulps = ulp_distance(y, round_to(exact, dtype), dtype)
    return {
        "err_max_abs": float(np.max(np.abs(d))),
        "err_rel_l2": math.sqrt(float(np.sum(d * d)) / sq_e) if sq_e > 0 else 0.0,
        "err_max_ulp": float(np.max(ulps)),
        "err_mean_ulp": float(np.mean(ulps)),
    }


def top2(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Indices of the largest and second-largest logit per row (first index wins ties): the first two of a
    stable descending sort, found with two argmax passes instead of sorting 262,144 logits per row."""
    x = np.asarray(logits)
    if x.shape[-1] < 2 or x.size == 0 or np.isnan(x).any():
        order = np.argsort(-x, axis=-1, kind="stable")  # NaN sorts last; argmax would pick it first
        return order[..., 0], order[..., 1]
    t1 = np.argmax(x, axis=-1)
    rest = x.copy()
    np.put_along_axis(rest, t1[..., None], -np.inf, axis=-1)
    t2 = np.argmax(rest, axis=-1)
    # Where the runner-up is -inf, the mask cannot be told from it: sort those rows.
    low = np.take_along_axis(rest, t2[..., None], axis=-1)[..., 0] == -np.inf
    if low.any():
        order = np.argsort(-x[low], axis=-1, kind="stable")
        t1[low], t2[low] = order[..., 0], order[..., 1]
    return t1, t2


def logit_drift(la: np.ndarray, lb: np.ndarray) -> dict[str, np.ndarray]:
    """Per-position logit comparison of schedule B against schedule A.

    With t1, t2 the top-2 tokens of A:
        gap_a = lA[t1] - lA[t2]
        dgap  = (lA[t1] - lA[t2]) - (lB[t1] - lB[t2])
    B ranks t2 above t1 exactly where dgap > gap_a. B's argmax can also move
    to a third token, so flips are counted from argmax directly.

    Args:
        la, lb: (positions, vocab) logits.
    Returns:
        arrays per position: argmax_a, argmax_b, gap_a, gap_b (B's own top-2
        gap), dgap, max_abs_dlogit, flip (bool).
    """
    a_in, b_in = np.asarray(la), np.asarray(lb)
    la = np.asarray(la, dtype=np.float64)
    lb = np.asarray(lb, dtype=np.float64)
    if la.shape != lb.shape or la.ndim != 2:
        raise ValueError(f"logits must be matching (positions, vocab) arrays, got {la.shape} and {lb.shape}")
    rows = np.arange(la.shape[0])
    t1, t2 = top2(a_in)  # the inputs' own dtype: widening to float64 keeps every order and tie
    b1, b2 = top2(b_in)
    gap_a = la[rows, t1] - la[rows, t2]
    dgap = gap_a - (lb[rows, t1] - lb[rows, t2])
    return {
        "argmax_a": t1,
        "argmax_b": b1,
        "gap_a": gap_a,
        "gap_b": lb[rows, b1] - lb[rows, b2],
        "dgap": dgap,
        "max_abs_dlogit": np.max(np.abs(la - lb), axis=-1),
        "flip": t1 != b1,
    }


def envelope_summary(per_position: dict[str, np.ndarray]) -> dict[str, Any]:
    """The envelope figures of one schedule pair from :func:`logit_drift` output."""
    dgap = np.abs(per_position["dgap"])
    flips = per_position["flip"]
    n = int(dgap.size)
    if n == 0:
        raise ValueError("no positions compared")
    return {
        "positions": n,
        "max_abs_dlogit": float(np.max(per_position["max_abs_dlogit"])),
        "max_abs_dgap": float(np.max(dgap)),
        "p50_abs_dgap": _pct(dgap, 50),
        "p99_abs_dgap": _pct(dgap, 99),
        "flips": int(np.count_nonzero(flips)),
        "flip_gaps": [float(g) for g in per_position["gap_a"][flips]],
        "max_gap_at_flip": float(np.max(per_position["gap_a"][flips])) if flips.any() else 0.0,
    }


def bits_lost(max_ulp: float) -> float:
    """log2(1 + max ULP distance): 0 exactly when bit-identical, 1 for one ULP, ~k for 2**k ULPs.

    The form asv tracks: a ratio-based comparison of a raw drift that is
    legitimately 0 would divide by zero, while bits lost stay finite and
    grow by one each time the drift doubles.
    """
    if max_ulp < 0 or math.isnan(max_ulp):
        raise ValueError(f"invalid ULP distance {max_ulp}")
    return math.log2(1.0 + max_ulp) if math.isfinite(max_ulp) else 64.0


def position_bytes(x: np.ndarray, axis: int = 0, dtype: str | None = None) -> np.ndarray:
    """The bytes of ``x`` per position along ``axis``: a (positions, bytes per position) uint8 array.

    ``dtype`` None: ``x``'s own bytes (an integer array of storage bits, say the uint16 words of a bf16 output).
    ``dtype`` given: ``x`` holds values of that storage dtype (float32 or float64 holding bf16, fp16, fp32 values,
    as everywhere in this module) and the bytes are those of the values *stored* in ``dtype``.
    """
    x = np.asarray(x)
    if dtype is not None:
        x, _ = storage_bits(x, dtype)
    x = np.moveaxis(x, axis, 0)
    n = x.shape[0]
    return np.ascontiguousarray(x).view(np.uint8).reshape(n, -1)


def differing_bytes(block: np.ndarray, chain: np.ndarray, axis: int = 0, dtype: str | None = None) -> np.ndarray:
    """Bytes of the output that differ, per position: position t of a T-row ("block") call against the t-th of T
    single-row ("chain") calls, byte for byte (lablup/mlxcel's block-vs-chain statistic,
    ``tests/metal_block_vs_chain_op_parity.rs``: ``per_position``).

    Args:
        block: the block call's output, positions along ``axis``.
        chain: the single calls' outputs stacked along the same axis (the same shape as ``block``).
        axis: the position axis.
        dtype: as :func:`position_bytes` (None: compare the arrays' own bytes).

    Returns:
        int64 array of length T; all zeros exactly when the two are bit-identical. Out of
        ``block.size // T * itemsize`` bytes per position (for bf16, one ULP moves one byte, or two when the
        low byte carries into the high one).
    """
    a, b = np.asarray(block), np.asarray(chain)
    if a.shape != b.shape:
        raise ValueError(f"block and chain shapes differ: {a.shape} vs {b.shape}")
    if a.dtype != b.dtype:
        raise ValueError(f"block and chain dtypes differ: {a.dtype} vs {b.dtype}")
    return np.count_nonzero(position_bytes(a, axis, dtype) != position_bytes(b, axis, dtype), axis=1).astype(np.int64)
