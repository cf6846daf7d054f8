"""Order rows (issue 31): seeded operands on which a recipe's variants give different output bits.

On a model's captured rows (bf16 outputs) the variants of an open axis (``dot4``, ``contract``, sometimes
``mma``) often have different float32 partial sums that round to the same bf16 output, so ``replay check``
finds several variants identical and the calibration cannot pick. An *order case* is one small call
(kernel, path, T, K, N) with constructed operands -- magnitudes spread over many binades, and pairs of large
terms that cancel, so what a summation order absorbs survives the rounding to the output dtype -- searched
over seeds until every two variants of the recipe that differ on the axis give different output bits (the
replay's own variants decide; bounded, and the pairs it could not separate are said).

Operands are drawn by numpy's Generator on the host and rounded to the dtype there (never mx.random: its
Metal erfinv differs between chips), so a case is the same bits on every machine.

Paths: ``dense:<dtype>`` and ``quant:affine-q<bits>-g64[:<dtype>]`` (the dtype of the rows, scales and
biases; bfloat16 when not given, as in a ``replay:`` path). ``replay check`` runs its quantized paths in the
model's compute dtype (``--dtype``), and its order rows in the same one.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from ..errors import GemmdriftError
from . import variant_name
from .core import round_to

# The calls (T, K, N) the order cases are searched at, on each path: small enough for seconds on a GPU and well
# under a second per case on this CPU (compiled engine). Per chip each lands on the kernel its dispatch chooses
# (M3 at mlx 0.32.4, dense: gemv_wide, steel_gemm_splitk, steel_gemm; quantized: qmv_wide, qmm_t_splitk, qmv,
# qmv_fast, qmm_t); a kernel with no open axis there (gemv) gets no case, and only a kernel's first call counts.
# The last three reach the quantized matmul where the first five do not: the non-split qmm_t needs a T at or
# over the qmv batch limit (13 or 14 below K, N = 2048 on gen 13-16; 32 on an Ultra; 33 on gen 17) and, from
# mlx 0.31.2, a split-K of 1, which at small N means K = 64 (one group: K // 64 bounds the split) -- (16, 64,
# 64) on M1-M4, (33, 64, 64) on an Ultra (M5 takes NAX there: no recipe); (33, 256, 64) gives the Ultras and M5
# their qmm_t_splitk.
CALLS: tuple[tuple[int, int, int], ...] = ((2, 256, 64), (16, 256, 64), (16, 256, 512), (1, 256, 64), (1, 512, 64),
                                           (16, 64, 64), (33, 64, 64), (33, 256, 64))
PATHS = ("dense:bfloat16", "dense:float16", "quant:affine-q4-g64", "quant:affine-q4-g64:float16")
STYLES = ("cancel", "spread", "cancel-wide")  # operand constructions tried in turn, per seed
DEFAULT_TRIES = 6  # seeds per style before a pair is declared not separated


def parse_order_path(path: str):
    """(spec, dtype) of ``dense:<dtype>`` or ``quant:<mode>-q<bits>-g<group>[:<dtype>]`` (quantized: bfloat16
    unless given); one-line error otherwise."""
    from ..kernels.paths import parse_path
    from ..model import parse_dtype

    text = str(path).strip()
    head, _, tail = text.rpartition(":")
    if text.startswith("quant:") and head.count(":") == 1:  # quant:<label>:<dtype>
        spec, dtype = parse_path(head), parse_dtype(tail)
    else:
        spec = parse_path(text)
        dtype = spec.dtype if spec.kind == "dense" else "bfloat16"
    if spec.kind not in ("dense", "quant"):
        raise GemmdriftError(f"order rows: no order case on path {text!r} (dense:<dtype> or quant:...[:<dtype>])")
    return spec, dtype


def order_path(spec, dtype: str) -> str:
    """The order rows' spelling of a check path in ``dtype``: ``dense:<dtype>`` as it is; a quantized path
    with ``:<dtype>`` appended unless bfloat16 (``quant:affine-q4-g64:float16``)."""
    if spec.kind == "dense" or dtype == "bfloat16":
        return spec.text
    return f"{spec.text}:{dtype}"


@dataclass
class OrderOperands:
    """The operands of one order case, in the form :class:`gemmdrift.replay.check`'s device functions read."""

    dtype: str
    k: int
    n: int
    w: np.ndarray | None = None  # (N, K) dense weight (float32 holding dtype values)
    b: np.ndarray | None = None
    quant: tuple | None = None  # (wq, scales, biases, bits, group_size)
    mode: str = "affine"  # the quantization mode, as check's operands carry it (order cases are affine only)

    def real(self, x: np.ndarray) -> np.ndarray:
        """mlx's kernel on these operands (the device the check runs on)."""
        import mlx.core as mx

        from ..model import mx_dtype
        from ..model.taps import to_numpy

        dt = mx_dtype(self.dtype)
        xm = mx.array(x).astype(dt)
        if self.quant is None:
            y = xm @ mx.array(self.w).astype(dt).T
        else:
            wq, sc, bi, bits, g = self.quant
            y = mx.quantized_matmul(xm, mx.array(wq), mx.array(sc).astype(dt), mx.array(bi).astype(dt),
                                    transpose=True, group_size=g, bits=bits)
        return to_numpy(y)


@dataclass
class OrderCase:
    """One (kernel, axis) order case: the call, its rows and operands, and which pairs of values they separate."""

    kernel: str
    axis: str
    values: tuple[str, ...]
    path: str
    T: int
    K: int
    N: int
    dtype: str
    seed: int
    style: str
    x: np.ndarray
    ops: OrderOperands
    separated: list[tuple[str, str]] = field(default_factory=list)
    unseparated: list[tuple[str, str]] = field(default_factory=list)
    tries: int = 0
    seconds: float = 0.0

    @property
    def complete(self) -> bool:
        return not self.unseparated

    def describe(self) -> str:
        done = f"all {len(self.separated)} pair(s) of {'|'.join(self.values)} separated" if self.complete else (
            "not separated: " + ", ".join(f"{a}/{b}" for a, b in self.unseparated))
        return (f"{self.kernel} {self.axis} on {self.path} T={self.T} K={self.K} N={self.N} "
                f"(seed {self.seed}, {self.style}): {done}")


def _signed(rng: np.random.Generator, shape, lo: int, hi: int) -> np.ndarray:
    """Normal values times 2**e, e uniform in [lo, hi]: magnitudes over many binades (never subnormal)."""
    return (rng.standard_normal(shape) * 2.0 ** rng.integers(lo, hi + 1, shape)).astype(np.float32)


def _cancel_columns(rng: np.random.Generator, K: int, frac: float) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint column pairs (a, b) that will carry large terms of opposite sign."""
    m = max(2, int(K * frac)) // 2 * 2
    cols = rng.permutation(K)[:m]
    return cols[: m // 2], cols[m // 2:]


def make_operands(path: str, T: int, K: int, N: int, *, seed: int, style: str = "cancel"):
    """Seeded rows ``x`` (T, K) and operands of one call on ``path``, rounded to its dtype on the host.

    ``cancel``: terms over 2**-4..2**4 and an eighth of the columns in pairs of large terms (2**12..2**20) that
    cancel exactly, so the sum is small while a partial sum was large; ``spread``: every term over 2**-12..2**12;
    ``cancel-wide``: a quarter of the columns in pairs. float16 (max 65504): large terms 2**4..2**9, spread
    2**-6..2**6; quantized, scales 2**bits lower and spread 2**-6..2**2, so no output overflows. Quantized
    paths: rows, scales and biases in the path's dtype (bf16 unless it says float16).
    """
    if style not in STYLES:
        raise GemmdriftError(f"unknown order-row style {style!r} (known: {', '.join(STYLES)})")
    spec, dtype = parse_order_path(path)
    rng = np.random.default_rng([31, seed, T, K, N, STYLES.index(style)])
    half = dtype == "float16"  # float16 tops out at 65504: narrower spreads, smaller large terms
    lo, hi = ((-6, 6) if half else (-12, 12)) if style == "spread" else (-4, 4)
    big = (4, 9) if half else (12, 20)
    if spec.kind == "dense":
        x = _signed(rng, (T, K), lo, hi)
        w = _signed(rng, (N, K), lo, hi)
        if style != "spread":
            a, b = _cancel_columns(rng, K, 0.125 if style == "cancel" else 0.25)
            x[:, a] *= (2.0 ** rng.integers(big[0], big[1] + 1, (T, len(a)))).astype(np.float32)
            x = round_to(x, dtype)
            w = round_to(w, dtype)
            x[:, b] = x[:, a]
            w[:, b] = -w[:, a]  # x[t,a]*w[n,a] + x[t,b]*w[n,b] == 0 exactly, whatever the order
        return round_to(x, dtype), OrderOperands(dtype, K, N, w=round_to(w, dtype))
    bits, g = spec.quant.bits, spec.quant.group_size
    if half and style == "spread":
        lo, hi = -6, 2  # spread products of 2**6 rows and 2**6 weights overflow a float16 output
    # A weight dequantizes to s*q + b with q up to 2**bits - 1: float16 scales 2**bits lower keep it in range.
    s_hi = hi - bits if half else hi
    codes = rng.integers(0, 1 << bits, size=(N, K)).astype(np.uint32)
    per = 32 // bits
    wq = np.zeros((N, K // per), dtype=np.uint32)
    sc = round_to(2.0 ** rng.integers(lo, s_hi + 1, (N, K // g)) * rng.uniform(0.5, 1.0, (N, K // g)), dtype)
    bi = round_to(_signed(rng, (N, K // g), lo, hi), dtype)
    x = _signed(rng, (T, K), lo, hi)
    if style != "spread":
        # Pairs inside each group (so both columns dequantize with one scale and bias), the same code in both:
        # x[t,a]*w[n,a] + x[t,b]*w[n,b] == 0 and the group's sum of x has no net large part, exactly.
        per_group = [_cancel_columns(rng, g, 0.25 if style == "cancel" else 0.5) for _ in range(K // g)]
        a = np.concatenate([i * g + pa for i, (pa, _) in enumerate(per_group)])
        b = np.concatenate([i * g + pb for i, (_, pb) in enumerate(per_group)])
        x[:, a] *= (2.0 ** rng.integers(big[0], big[1] + 1, (T, len(a)))).astype(np.float32)
        x = round_to(x, dtype)
        x[:, b] = -x[:, a]
        codes[:, b] = codes[:, a]
    for i in range(per):
        wq |= codes[:, i::per] << np.uint32(bits * i)
    return round_to(x, dtype).astype(np.float32), OrderOperands(dtype, K, N, quant=(wq, sc, bi, bits, g))


def case_plan(chip: Any, path: str, T: int, K: int, N: int, mlx_version: str, variant: Any = None):
    """The plan ``chip`` dispatches for one call on a ``dense:``/``quant:`` path (:func:`parse_order_path`)."""
    from .paths import plan_for

    spec, dtype = parse_order_path(path)
    if spec.kind == "dense":
        return plan_for(chip, "matmul", T=T, K=K, N=N, dtype=dtype, mlx_version=mlx_version, variant=variant)
    return plan_for(chip, "quantized_matmul", T=T, K=K, N=N, dtype=dtype, mlx_version=mlx_version,
                    bits=spec.quant.bits, group_size=spec.quant.group_size, variant=variant)


def replay_all(plan, x: np.ndarray, ops: OrderOperands) -> dict[str, np.ndarray]:
    """Every full variant of the plan's recipe on the case: variant name -> output bits (uint32)."""
    from .paths import run_plan

    out = {}
    for var in plan.recipe.variants():
        bound = type(plan)(plan.recipe, plan.params, var, plan.source, plan.note)
        y = run_plan(bound, x, dtype=ops.dtype, w=ops.w, bias=ops.b, quant=ops.quant).y
        out[variant_name(var)] = np.ascontiguousarray(y, dtype=np.float32).view(np.uint32)
    return out


def separation(recipe, axis: str, bits: Mapping[str, np.ndarray]) -> tuple[list, list]:
    """(separated, unseparated) pairs of ``axis``'s values: a pair is separated when every two full variants
    with those values (any values of the other axes) give different output bits somewhere."""
    from . import parse_variant

    by: dict[str, list[np.ndarray]] = {v: [] for v in recipe.axes[axis]}
    for name, y in bits.items():
        by[parse_variant(recipe, name)[axis]].append(y)
    sep, unsep = [], []
    for a, b in itertools.combinations(recipe.axes[axis], 2):
        ok = all(not np.array_equal(u, v) for u in by[a] for v in by[b])
        (sep if ok else unsep).append((a, b))
    return sep, unsep


def order_case(chip: Any, path: str, T: int, K: int, N: int, axis: str, *, mlx_version: str,
               tries: int = DEFAULT_TRIES, styles: Sequence[str] = STYLES) -> OrderCase:
    """The first seeded construction (styles in turn, ``tries`` seeds each) on which every pair of ``axis``'s
    values is separated, else the one separating the most pairs (its ``unseparated`` says which were not)."""
    t0 = time.perf_counter()
    plan = case_plan(chip, path, T, K, N, mlx_version)
    rec = plan.recipe
    values = tuple(rec.axes.get(axis, ()))
    if len(values) < 2:
        raise GemmdriftError(f"{rec.kernel} has no open axis {axis!r} (open: "
                             f"{', '.join(a for a, v in rec.axes.items() if len(v) > 1) or 'none'})")
    best, n = None, 0
    for seed in range(tries):
        for style in styles:
            n += 1
            x, ops = make_operands(path, T, K, N, seed=seed, style=style)
            sep, unsep = separation(rec, axis, replay_all(plan, x, ops))
            case = OrderCase(rec.kernel, axis, values, path, T, K, N, ops.dtype, seed, style, x, ops, sep, unsep)
            if best is None or len(sep) > len(best.separated):
                best = case
            if not unsep:
                break
        if best is not None and best.complete:
            break
    best.tries, best.seconds = n, time.perf_counter() - t0
    return best


@dataclass(frozen=True)
class OrderUnit:
    """One order case before it is searched: the call and the (kernel, axis) it orders (dispatch only)."""

    kernel: str
    axis: str
    path: str
    T: int
    K: int
    N: int

    @property
    def name(self) -> str:
        """A file name for the unit (``replay check``'s checkpoint)."""
        import re

        return re.sub(r"[^A-Za-z0-9_.=-]+", "_", f"{self.path}__{self.kernel}__{self.axis}")


def order_units(chip: Any, *, mlx_version: str, paths: Sequence[str] = PATHS,
                calls: Sequence[tuple[int, int, int]] = CALLS) -> list[OrderUnit]:
    """One unit per (kernel, open axis, path) that ``chip`` dispatches at ``calls`` on ``paths`` (the first
    call per kernel). Calls whose kernel has no recipe on the chip (NAX, cuBLASLt, float32) are skipped."""
    out, seen = [], set()
    for path in paths:
        for T, K, N in calls:
            try:
                plan = case_plan(chip, path, T, K, N, mlx_version)
            except GemmdriftError:
                continue  # no recipe there: nothing to order
            for axis, values in plan.recipe.axes.items():
                if len(values) > 1 and (plan.recipe.kernel, axis, path) not in seen:
                    seen.add((plan.recipe.kernel, axis, path))
                    out.append(OrderUnit(plan.recipe.kernel, axis, path, T, K, N))
    return out


def order_cases(chip: Any, *, mlx_version: str, paths: Sequence[str] = PATHS,
                calls: Sequence[tuple[int, int, int]] = CALLS, tries: int = DEFAULT_TRIES) -> list[OrderCase]:
    """The searched case of every :func:`order_units` unit."""
    return [order_case(chip, u.path, u.T, u.K, u.N, u.axis, mlx_version=mlx_version, tries=tries)
            for u in order_units(chip, mlx_version=mlx_version, paths=paths, calls=calls)]


__all__ = ["CALLS", "PATHS", "parse_order_path", "order_path", "case_plan", "STYLES", "DEFAULT_TRIES",
           "OrderOperands", "OrderCase", "OrderUnit", "make_operands", "replay_all", "separation", "order_case",
           "order_units", "order_cases"]
