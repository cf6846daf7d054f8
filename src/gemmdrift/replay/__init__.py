"""Replay: compute, on any machine, the bits an mlx kernel path computes, by adding in its order.

A *recipe* is one kernel path's reduction for one output element, read from
the mlx source (file and lines in :mod:`.dense` and
:mod:`.quant`), evaluated for every output of a (T, K) x (K, N)
product with elementwise float32 operations only (:mod:`.core`),
vectorised over rows and outputs, N in chunks. Where the source leaves an
order open (``simd_sum``'s pairing, the 8x8 MMA's order and rounding,
``dot(float4)``, whether ``a*b + c`` was contracted) the recipe has a variant
*axis*; the first value of each axis is the default (the best-supported
reading, METAL-ORDERS.md), and every result names the variant it used
(``mma=H1``, ``dot4=sequential``, ...).

Apple GPU recipes flush float32 subnormals (FTZ, METAL-ORDERS §0.4) when the
operands could produce one at all (:func:`.core.needs_ftz`); the CPU
and CUDA recipes never flush.

Which recipe runs for a shape comes from :func:`recipe_for` (a dispatch
``Choice``: kernel, params, source) or, for this machine's own backend, from
:func:`cpu_recipe`; nothing here re-derives a GPU's dispatch.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, NamedTuple, Sequence

import numpy as np

from ..errors import GemmdriftError
from . import dense as rd
from . import fpquant as rf
from . import quant as rq
from .core import SIMD_SUMS, f32, needs_ftz, round_to

METAL_REV = "ml-explore/mlx@846d176 (0.32.2-dev; kernel headers as in the 0.32.4 wheel, METAL-ORDERS §9)"
CPU_REV = "ml-explore/mlx v0.32.1 (CPU sources; simd_gemm.h identical to the installed 0.32.4 headers)"
CHUNK_ELEMENTS = 4 << 20  # float32 products per N chunk (16 MB): bounds memory on a 262144-row LM head
ENGINES = ("compiled", "numpy")  # compiled: replay.jit (numba), the same adds; numpy: the reference recipes


def replay_engine(engine: str | None = None) -> str:
    """The engine that runs a recipe: ``engine``, else ``$GEMMDRIFT_REPLAY_ENGINE``, else ``compiled``.

    Both give the same bits (tests/test_replay_jit.py); ``compiled`` falls back to numpy only where numba is
    not installed and no engine was asked for by name.
    """
    asked = engine or os.environ.get("GEMMDRIFT_REPLAY_ENGINE") or ""
    name = asked or "compiled"
    if name not in ENGINES:
        raise GemmdriftError(f"unknown replay engine {name!r} (known: {', '.join(ENGINES)})")
    if name == "compiled" and not asked:
        try:
            from . import jitcore as replay_jitcore  # noqa: F401  (imports numba after setting its cache directory)
        except ImportError:
            return "numpy"
    return name


@dataclass(frozen=True)
class Recipe:
    """One kernel path: ``fn`` computes the pre-rounding accumulator; ``bias`` is its epilogue rule."""

    kernel: str
    op: str  # "matmul" or "quantized_matmul"
    fn: Callable
    dtypes: tuple[str, ...]
    axes: Mapping[str, tuple[str, ...]]  # variant axis -> values (first: the default)
    source: str
    bias: str = "once"
    apple: bool = False  # Apple GPU: float32 FTZ
    note: str = ""
    prediction: bool = True  # False only for this machine's own backend, checked bit for bit here

    def variants(self) -> list[dict[str, str]]:
        """Every combination of the axes, the default first."""
        keys = list(self.axes)
        return [dict(zip(keys, combo)) for combo in itertools.product(*(self.axes[k] for k in keys))]

    def default(self) -> dict[str, str]:
        return {k: v[0] for k, v in self.axes.items()}


def _r(kernel, op, fn, dtypes, axes, source, **kw) -> Recipe:
    return Recipe(kernel, op, fn, tuple(dtypes), dict(axes), source, **kw)


HALF = ("bfloat16", "float16")
_MMA = {"mma": tuple(rd.MMA8)}
RECIPES: dict[str, Recipe] = {r.kernel: r for r in (
    _r("cpu_simd_gemm", "matmul", rd.cpu_sequential, HALF, {}, f"{CPU_REV}: mlx/backend/cpu/gemms/simd_gemm.h "
       "simd_gemm (max_size 1 on x86: one float32 accumulator, k in order)", prediction=False),
    _r("cpu_cblas_sgemm", "matmul", rd.cpu_sequential, ("float32",), {}, f"{CPU_REV}: mlx/backend/cpu/gemms/"
       "cblas.cpp -> reference SGEMM, TRANSA='T' loop (TEMP = TEMP + A*B, no FMA in the wheel's libblas)",
       bias="last-f32", prediction=False),
    _r("cpu_qmm", "quantized_matmul", rq.cpu_qmm_t, HALF + ("float32",), {}, f"{CPU_REV}: "
       "mlx/backend/cpu/quantized.cpp _qmm_t L155-212 (every op in the activation dtype)", prediction=False),
    _r("gemv", "matmul", rd.metal_gemv, HALF, {}, f"{METAL_REV}: mlx/backend/metal/kernels/gemv.h GEMVKernel "
       "L107-246; host matmul.cpp gemv_axbpy L1093-1227", bias="twice", apple=True),
    # x @ W with W (K, N) not transposed, T=1: the same GEMVTKernel order from v0.30.5 (kernels/gemv.metal) to
    # 846d176, and the same host tile rule (dense.py's docstring lists the revisions compared).
    _r("gemv_t", "matmul", rd.metal_gemv_t, HALF, {}, f"{METAL_REV}: mlx/backend/metal/kernels/gemv.h "
       "GEMVTKernel L253-434; host matmul.cpp gemv_axbpy L1141-1163 (transpose_mat)", bias="twice", apple=True,
       note="x @ W with W (K, N) row-major: pass w = W.T (N, K)"),
    _r("gemv_wide", "matmul", rd.metal_gemv_wide, HALF, {"dot4": tuple(rd.DOT4)}, f"{METAL_REV}: "
       "mlx/backend/metal/kernels/gemv.h GemvWide L785-897; host matmul.cpp gemv_wide_config L1299-1354",
       apple=True),
    _r("steel_gemm", "matmul", rd.metal_steel_gemm, HALF, _MMA, f"{METAL_REV}: steel/gemm/kernels/"
       "steel_gemm_fused.h L19-346, steel/gemm/mma.h L439-537", apple=True),
    _r("steel_gemm_splitk", "matmul", rd.metal_steel_gemm_splitk, HALF, _MMA, f"{METAL_REV}: steel/gemm/"
       "kernels/steel_gemm_splitk.h L9-227; host matmul.cpp steel_gemm_splitk_axpby L503-656", apple=True),
    _r("cuda_gemv", "matmul", rd.cuda_gemv, HALF + ("float32",), {}, f"{METAL_REV}: mlx/backend/cuda/gemms/"
       "gemv.cu gemv_impl L55-85, n_per_t L242-249; cg::reduce as an xor butterfly (NVIDIA coalesced_reduce.h)",
       bias="none"),
    _r("qmv", "quantized_matmul", rq.metal_qmv, HALF, {"simd_sum": tuple(SIMD_SUMS), "contrib": tuple(rq.CONTRIB)},
       f"{METAL_REV}: mlx/backend/metal/kernels/quantized.h qmv_impl L824-983, load_vector L28-105, qdot "
       "L191-290", apple=True),
    _r("qmv_fast", "quantized_matmul", rq.metal_qmv, HALF,
       {"simd_sum": tuple(SIMD_SUMS), "contrib": tuple(rq.CONTRIB)},
       f"{METAL_REV}: mlx/backend/metal/kernels/quantized.h qmv_fast_impl L757-822", apple=True),
    _r("qmv_wide", "quantized_matmul", rq.metal_qmv_wide, HALF, {"contract": tuple(rq.CONTRACT)},
       f"{METAL_REV}: mlx/backend/metal/kernels/quantized.h qmv_wide_impl L985-1080", apple=True),
    _r("qmm_t", "quantized_matmul", rq.metal_qmm_t, HALF, {**_MMA, "dequant": ("fma",),
       "partials": ("dtype",)}, f"{METAL_REV}: mlx/backend/metal/kernels/quantized.h qmm_t_impl L1192-1318",
       apple=True),
    _r("qmm_t_splitk", "quantized_matmul", rq.metal_qmm_t, HALF, {**_MMA, "dequant": ("fma",),
       "partials": ("dtype",)}, f"{METAL_REV}: quantized.h affine_qmm_t_splitk L1965-2022; host quantized.cpp "
       "qmm_splitk L1120-1217; reduction/reduce_col.h col_reduce_small", apple=True),
    # The fp modes (mxfp4, nvfp4, mxfp8; replay.fpquant): the same kernel order from v0.30.5 (fp_qmv, fp_qmm_t)
    # or v0.32.0 (fp_qmv_wide) to the 0.32.4 wheel's headers.
    _r("fp_qmv", "quantized_matmul", rf.metal_fp_qmv, HALF, {"simd_sum": tuple(SIMD_SUMS),
       "qdot_add": tuple(rf.QDOT_ADD)}, f"{METAL_REV}: mlx/backend/metal/kernels/fp_quantized.h fp_qmv_impl "
       "L400-559, qdot L81-100, dequantize_scale L30-38", apple=True),
    _r("fp_qmv_fast", "quantized_matmul", rf.metal_fp_qmv, HALF, {"simd_sum": tuple(SIMD_SUMS),
       "qdot_add": tuple(rf.QDOT_ADD)}, f"{METAL_REV}: mlx/backend/metal/kernels/fp_quantized.h fp_qmv_fast_impl "
       "L325-398, qdot L81-100", apple=True),
    _r("fp_qmv_wide", "quantized_matmul", rf.metal_fp_qmv_wide, HALF, {"dot4": tuple(rd.DOT4),
       "contract": tuple(rf.CONTRACT)}, f"{METAL_REV}: mlx/backend/metal/kernels/fp_quantized.h fp_qmv_wide_impl "
       "L561-674 (k_lanes 16, quantized.cpp L567)", apple=True),
    _r("fp_qmm_t", "quantized_matmul", rf.metal_fp_qmm_t, HALF, {**_MMA, "partials": ("dtype",)},
       f"{METAL_REV}: mlx/backend/metal/kernels/fp_quantized.h fp_qmm_t_impl L786-910, dequantize L138-147",
       apple=True),
    _r("fp_qmm_t_splitk", "quantized_matmul", rf.metal_fp_qmm_t, HALF, {**_MMA, "partials": ("dtype",)},
       f"{METAL_REV}: fp_quantized.h fp_qmm_t_splitk L1794-1846; host quantized.cpp qmm_splitk L1120-1217; "
       "reduction/reduce_col.h col_reduce_small", apple=True),
)}
# The dispatch's kernel names are mode-free (qmv, qmv_wide, ...): an fp mode's recipe is the fp_ one.
FP_KERNELS = {k: "fp_" + k for k in ("qmv", "qmv_fast", "qmv_wide", "qmm_t", "qmm_t_splitk")}
# Kernels whose order the source does not give: said, never guessed.
UNKNOWN = {
    "steel_gemm_nax": "NAX matmul2d (M5): accumulation order and rounding inside the unit are not in the source",
    "steel_gemm_splitk_nax": "NAX matmul2d (M5): accumulation order inside the unit is not in the source",
    "qmm_t_nax": "NAX matmul2d (M5): accumulation order inside the unit is not in the source",
    "cublaslt": "cuBLASLt: the algorithm (tensor-core order, split-K) is chosen at run time, not knowable from source",
    "cuda_qmv": "CUDA qmv: not replayed yet (bf16 slot accumulators, quantized/qmm/qmv.cu)",
    "cuda_qmm": "CUDA qmm: CUTLASS/tensor-core order not knowable from source",
    "qmv_quad": "qmv_quad (K in {64, 128}): not replayed (no such K in the models here)",
}


# ------------------------------------------------------------------------------ variants


def parse_variant(recipe: Recipe, text: str | Mapping[str, str] | None) -> dict[str, str]:
    """``"mma=H2,dot4=pairwise"`` (axes the recipe lacks are ignored, so one text can name a chip's variant
    across its recipes) -> a full variant of ``recipe``; unknown values are a one-line error."""
    var = recipe.default()
    if not text or text in ("default", "exact"):  # "exact": the name a recipe with no open order prints
        return var
    items = text.items() if isinstance(text, Mapping) else (p.partition("=")[::2] for p in str(text).split(","))
    for axis, value in items:
        axis, value = axis.strip(), value.strip()
        known = {a for r in RECIPES.values() for a in r.axes}
        if axis not in known:
            raise GemmdriftError(f"unknown variant axis {axis!r} (known: {', '.join(sorted(known))})")
        if axis in recipe.axes:
            if value not in recipe.axes[axis]:
                raise GemmdriftError(f"unknown {axis} variant {value!r} for {recipe.kernel} "
                                     f"(known: {', '.join(recipe.axes[axis])})")
            var[axis] = value
    return var


def check_variant_text(text: str | None) -> None:
    """Validate a variant text against every recipe's axes (before any model loads)."""
    if not text or text in ("default", "exact"):
        return
    seen: dict[str, str] = {}
    for p in str(text).split(","):
        axis, _, value = p.partition("=")
        axis, value = axis.strip(), value.strip()
        if not axis:
            raise GemmdriftError(f"variant {text!r}: an empty axis (write axis=value, e.g. mma=H2,dot4=pairwise)")
        if axis in seen:
            raise GemmdriftError(f"variant {text!r}: {axis} given twice ({seen[axis]} and {value}); give each axis once")
        seen[axis] = value
        values = {v for r in RECIPES.values() for v in r.axes.get(axis, ())}
        if not values:
            known = sorted({a for r in RECIPES.values() for a in r.axes})
            raise GemmdriftError(f"unknown variant axis {axis!r} (known: {', '.join(known)})")
        if value not in values:
            raise GemmdriftError(f"unknown {axis} variant {value!r} (known: {', '.join(sorted(values))})")


def unused_axes(variant: str | None, kernels) -> list[str]:
    """The axes a variant text names (``dot4=pairwise,mma=H2``) that none of ``kernels``' recipes has: a setting
    nothing used (M1 never runs gemv_wide, so ``dot4`` changes nothing there)."""
    if not variant or variant in ("default", "exact", "all"):
        return []
    have = {a for k in kernels if k in RECIPES for a in RECIPES[k].axes}
    given = [p.partition("=")[0].strip() for p in str(variant).split(",") if p.strip()]
    return [a for a in given if a not in have]


def variant_name(var: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in var.items()) or "exact"


def version_axes(recipe: Recipe, mlx_version: str) -> Recipe:
    """The recipe as a given mlx release wrote it (the per-version header differences of METAL-ORDERS §9)."""
    from ..dispatch import parse_version

    v = parse_version(mlx_version)
    if recipe.kernel.startswith("fp_") and v < (0, 30, 4):  # fp_quantized.h changed until #2984 (v0.30.4)
        raise GemmdriftError(f"mlx {'.'.join(map(str, v))}'s fp-mode Metal kernels (fp_quantized.h) were read from "
                             "0.30.4 on; replay 0.30.4 or newer")
    if recipe.kernel in ("fp_qmm_t", "fp_qmm_t_splitk"):
        if v == (0, 32, 3):
            raise GemmdriftError("mlx 0.32.3's quantized Metal headers were not read; replay 0.32.2 or 0.32.4")
        # fp_qmm_t_splitk writes T partials to 0.32.2 and float ones in the 0.32.4 wheel (fp_quantized.h).
        partials = ("float32",) if v >= (0, 32, 4) else ("dtype",)
        return Recipe(**{**recipe.__dict__, "axes": {**recipe.axes, "partials": partials}})
    if recipe.kernel in ("qmm_t", "qmm_t_splitk"):
        if v == (0, 32, 3):
            raise GemmdriftError("mlx 0.32.3's quantized Metal headers were not read; replay 0.32.2 or 0.32.4")
        # float math, one rounding (v0.32.1, 56e026d8a) vs bf16 arithmetic before; no contraction axis: s*q is exact.
        dq = ("dtype",) if v < (0, 32, 1) else ("fma",)
        partials = ("float32",) if v >= (0, 32, 4) else ("dtype",)
        return Recipe(**{**recipe.__dict__, "axes": {**recipe.axes, "dequant": dq, "partials": partials}})
    return recipe


def version_params(recipe: Recipe, mlx_version: str) -> dict[str, Any]:
    """Parameters a release fixes: qmv's load_vector sums bf16 quads (0.32.2 and older) or float (0.32.4)."""
    from ..dispatch import parse_version

    v = parse_version(mlx_version)
    if recipe.kernel in ("qmv", "qmv_fast"):
        if v == (0, 32, 3):
            raise GemmdriftError("mlx 0.32.3's quantized Metal headers were not read; replay 0.32.2 or 0.32.4")
        return {"float_sums": v >= (0, 32, 4), "fast": recipe.kernel == "qmv_fast"}
    if recipe.kernel in ("fp_qmv", "fp_qmv_fast"):
        return {"fast": recipe.kernel == "fp_qmv_fast"}
    return {}


# ------------------------------------------------------------------------------ running


class Replayed(NamedTuple):
    """A replayed output (float32 values of ``dtype``) and what produced it."""

    y: np.ndarray
    kernel: str
    variant: str
    ftz: bool
    source: str
    prediction: bool


def _check_dtype(recipe: Recipe, dtype: str) -> None:
    if dtype not in recipe.dtypes:
        raise GemmdriftError(f"{recipe.kernel} has no {dtype} recipe (it has: {', '.join(recipe.dtypes)})")


def replay_matmul(recipe: Recipe | str, x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None, *,
                  dtype: str, params: Mapping[str, Any] | None = None, variant: Any = None,
                  w_min: float | None = None, engine: str | None = None) -> Replayed:
    """``x @ w.T (+ bias)`` as the kernel adds it.

    Args:
        recipe: a :class:`Recipe` or its kernel name.
        x: (T, K) values of ``dtype`` (float32 holding them exactly).
        w: (N, K) values of ``dtype``. For ``x @ W`` with W (K, N) not transposed (the ``gemv_t`` recipe,
            :func:`.paths.plan_for` with ``b_transposed=False``) pass ``W.T``: the products
            ``x[t, k] * W[k, n]`` are the same numbers, and the recipe adds them in gemv_t's order.
        bias: (N,) or None.
        dtype: the operands' and output's dtype.
        params: the kernel's order-deciding parameters (a dispatch Choice's ``params``).
        variant: text or mapping (see :func:`parse_variant`).
        w_min: the smallest nonzero |w| if already known (it decides FTZ; a fixed weight's is computed once).
        engine: ``compiled`` or ``numpy`` (see :func:`replay_engine`; the same bits).
    """
    rec = get_recipe(recipe)
    if rec.op != "matmul":
        raise GemmdriftError(f"{rec.kernel} is a {rec.op} recipe")
    _check_dtype(rec, dtype)
    if bias is not None and rec.bias == "none":
        raise GemmdriftError(f"{rec.kernel} takes no bias (mlx sends a bias to cuBLASLt)")
    var = parse_variant(rec, variant)
    x, w = f32(x), f32(w)
    T, K = x.shape
    N = w.shape[0]
    if w.shape[1] != K:
        raise GemmdriftError(f"shapes do not match: x is {x.shape}, w is {w.shape}")
    if bias is not None and np.shape(bias) != (N,):
        raise GemmdriftError(f"the bias must have shape ({N},) for w of shape {w.shape}, not {np.shape(bias)}")
    compiled = replay_engine(engine) == "compiled"
    if compiled and w_min is None and rec.apple:
        from .jitcore import min_nonzero

        w_min = min_nonzero(np.ascontiguousarray(w))  # the same minimum as replay.core.min_nonzero, one pass
    ftz = rec.apple and (needs_ftz(x, w) if w_min is None else needs_ftz(x, mins=(w_min,)))
    if compiled:
        from .jit import dense_acc

        acc = dense_acc(rec.fn, x, w, dict(params or {}), var, ftz)
        if acc is not None:
            y = rd.epilogue(acc, None if bias is None else f32(bias), rec.bias, dtype)
            return Replayed(y, rec.kernel, variant_name(var), ftz, rec.source, rec.prediction)
    out = np.empty((T, N), dtype=np.float32)
    step = max(1, CHUNK_ELEMENTS // max(1, T * K))
    xt = np.ascontiguousarray(x.T)[:, :, None]
    prm = dict(params or {})
    for lo in range(0, N, step):
        hi = min(N, lo + step)
        # Products in float32: exact for bf16/fp16 operands (8+8 or 11+11 significant bits), RN for float32.
        P = np.multiply(xt, np.ascontiguousarray(w[lo:hi].T)[:, None, :], dtype=np.float32)  # (K, T, n)
        acc = rec.fn(P, prm, var, ftz)
        out[:, lo:hi] = rd.epilogue(acc, None if bias is None else f32(bias)[lo:hi], rec.bias, dtype)
    return Replayed(out, rec.kernel, variant_name(var), ftz, rec.source, rec.prediction)


def replay_quantized(recipe: Recipe | str, x: np.ndarray, wq: np.ndarray, scales: np.ndarray,
                     biases: np.ndarray, *, bits: int, group_size: int, dtype: str,
                     params: Mapping[str, Any] | None = None, variant: Any = None,
                     mlx_version: str | None = None, engine: str | None = None, mode: str = "affine") -> Replayed:
    """``quantized_matmul(x, wq, scales, biases, transpose=True, mode=mode)`` as the kernel adds it (``engine``:
    as :func:`replay_matmul`).

    ``mode`` ``affine`` (``biases`` the affine biases) or an fp mode (``mxfp4``, ``nvfp4``, ``mxfp8``: ``scales``
    the uint8 scale codes mx.quantize returns, ``biases`` None; the ``fp_`` recipes of :mod:`.fpquant`, numpy
    engine only)."""
    rec = get_recipe(recipe)
    if rec.op != "quantized_matmul":
        raise GemmdriftError(f"{rec.kernel} is a {rec.op} recipe")
    _check_dtype(rec, dtype)
    if (mode != "affine") != rec.kernel.startswith("fp_"):
        raise GemmdriftError(f"{rec.kernel} is not a recipe for mode {mode} (the fp modes' recipes: "
                             f"{', '.join(FP_KERNELS.values())})")
    if mode != "affine":
        return _replay_fp(rec, x, wq, scales, bits=bits, group_size=group_size, dtype=dtype, params=params,
                          variant=variant, mlx_version=mlx_version, mode=mode)
    if group_size != 64 and rec.apple:
        raise GemmdriftError(f"the Metal quantized recipes are for group size 64, not {group_size}")
    prm = {"bits": bits, "group_size": group_size, **(params or {})}
    rec, var, x = _quantized_prologue(rec, x, group_size, prm, mlx_version, variant)
    T, K = x.shape
    sc, bi = f32(scales), f32(biases)
    ftz = rec.apple and needs_ftz(x, sc, bi)
    if replay_engine(engine) == "compiled":
        from .jitcache import TILES
        from .jitquant import quant_acc

        out = np.empty((T, wq.shape[0]), dtype=np.float32)
        step = max(1, CHUNK_ELEMENTS // K)  # rows whose float32 codes (and dequantized weights) fit 16 MB
        for lo in range(0, wq.shape[0], step):
            hi = min(wq.shape[0], lo + step)
            # A fixed weight's prepared tiles are kept between calls (replay.jitcache: content-checked, bounded).
            acc = quant_acc(rec.fn, x, wq[lo:hi], sc[lo:hi], bi[lo:hi], prm, var, dtype, ftz, cache=TILES)
            if acc is None:
                break  # not compiled: the numpy recipe below
            out[:, lo:hi] = round_to(acc, dtype)
        else:
            return Replayed(out, rec.kernel, variant_name(var), ftz, rec.source, rec.prediction)
    q = rq.unpack(wq, bits, K)
    N = q.shape[0]
    out = np.empty((T, N), dtype=np.float32)
    step = max(1, CHUNK_ELEMENTS // max(1, 4 * T * K))  # qmm_t and the CPU recipe hold (K, T, n) products
    for lo in range(0, N, step):
        hi = min(N, lo + step)
        acc = rec.fn(x, q[lo:hi], sc[lo:hi], bi[lo:hi], prm, var, dtype, ftz)
        out[:, lo:hi] = round_to(acc, dtype)
    return Replayed(out, rec.kernel, variant_name(var), ftz, rec.source, rec.prediction)


def _quantized_prologue(rec: Recipe, x, group_size: int, prm: dict, mlx_version: str | None, variant):
    """What both quantized replays do first: the release's axes and parameters (``prm`` updated in place), the
    variant, ``x`` in float32, and K checked against the group size. Returns (recipe, variant, x)."""
    if mlx_version:
        rec = version_axes(rec, mlx_version)
        prm.update(version_params(rec, mlx_version))
    var = parse_variant(rec, variant)
    x = f32(x)
    if x.shape[1] % group_size:
        raise GemmdriftError(f"K={x.shape[1]} is not a multiple of the group size {group_size}")
    return rec, var, x


def _replay_fp(rec: Recipe, x, wq, scales, *, bits, group_size, dtype, params, variant, mlx_version,
               mode) -> Replayed:
    """The fp-mode recipes (numpy): codes and scales decoded exactly, then the recipe, N in chunks."""
    rf.mode_params(mode, bits, group_size)
    prm = {"bits": bits, "group_size": group_size, "mode": mode, **(params or {})}
    if rec.kernel in ("fp_qmv", "fp_qmv_fast"):
        prm.setdefault("fast", rec.kernel == "fp_qmv_fast")  # the kernel's name decides it, with or without a release
    rec, var, x = _quantized_prologue(rec, x, group_size, prm, mlx_version, variant)
    T, K = x.shape
    codes, sc = rf.decode(wq, scales, mode, K)
    # FTZ: a partial sum is a multiple of ulp(x) * ulp(code) * ulp(scale); needs_ftz bounds it from the minima.
    ftz = rec.apple and needs_ftz(x, codes, sc)
    N = codes.shape[0]
    out = np.empty((T, N), dtype=np.float32)
    step = max(1, CHUNK_ELEMENTS // max(1, 4 * T * K))
    for lo in range(0, N, step):
        hi = min(N, lo + step)
        out[:, lo:hi] = round_to(rec.fn(x, codes[lo:hi], sc[lo:hi], None, prm, var, dtype, ftz), dtype)
    return Replayed(out, rec.kernel, variant_name(var), ftz, rec.source, rec.prediction)


def get_recipe(recipe: Recipe | str) -> Recipe:
    if isinstance(recipe, Recipe):
        return recipe
    if recipe in RECIPES:
        return RECIPES[recipe]
    if recipe in UNKNOWN:
        raise GemmdriftError(f"{recipe}: {UNKNOWN[recipe]}")
    raise GemmdriftError(f"no recipe {recipe!r} (known: {', '.join(RECIPES)})")


# ------------------------------------------------------------------------------ which recipe


def cpu_recipe(op: str, dtype: str) -> Recipe:
    """This machine's own backend (mlx's Linux/x86 CPU), the same for every T."""
    if op == "matmul":
        return RECIPES["cpu_cblas_sgemm" if dtype == "float32" else "cpu_simd_gemm"]
    if op == "quantized_matmul":
        return RECIPES["cpu_qmm"]
    raise GemmdriftError(f"no CPU recipe for {op!r} (known: matmul, quantized_matmul)")


@dataclass(frozen=True)
class Plan:
    """A recipe bound to the parameters and variant one call uses."""

    recipe: Recipe
    params: Mapping[str, Any] = field(default_factory=dict)
    variant: Mapping[str, str] = field(default_factory=dict)
    source: str = ""  # where the dispatch rule was read
    note: str = ""


def recipe_for(choice: Any, variant: Any = None, *, mlx_version: str | None = None) -> Plan:
    """The recipe of a dispatch ``Choice`` (``kernel``, ``params``, ``source``, ``note``), bound to a variant.

    Kernels whose order the source does not give raise a one-line
    :class:`GemmdriftError` saying why (NAX, cuBLASLt): said, not guessed.
    """
    kernel = choice.kernel
    params = dict(choice.params or {})
    if params.get("mode", "affine") != "affine" and kernel in FP_KERNELS:
        kernel = FP_KERNELS[kernel]
    elif params.get("mode", "affine") != "affine" and kernel in ("cpu_qmm", "cuda_qmv", "cuda_qmm"):
        raise GemmdriftError(f"{kernel} with mode {params['mode']}: not replayed (fp-mode recipes exist for "
                             "the Metal kernels only)")
    if kernel == "cpu_simd_gemm" or kernel == "cpu_cblas_sgemm" or kernel == "cpu_qmm":
        rec = RECIPES[kernel]
    else:
        rec = get_recipe(kernel)
    if mlx_version:
        rec = version_axes(rec, mlx_version)
        params = {**version_params(rec, mlx_version), **params}
    if rec.kernel in ("qmm_t_splitk", "fp_qmm_t_splitk"):
        params.setdefault("split_k", params.get("split_k", 1))
    return Plan(rec, params, parse_variant(rec, variant), getattr(choice, "source", ""), getattr(choice, "note", ""))


__all__ = ["METAL_REV", "CPU_REV", "ENGINES", "replay_engine", "Recipe", "RECIPES", "FP_KERNELS", "UNKNOWN", "parse_variant",
           "check_variant_text", "unused_axes", "variant_name", "version_axes", "version_params", "Replayed", "replay_matmul",
           "replay_quantized", "get_recipe", "cpu_recipe", "Plan", "recipe_for"]
