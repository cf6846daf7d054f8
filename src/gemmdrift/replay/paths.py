"""Chips and paths of the replay: which recipe a chip runs for one call comes from the chip-aware dispatch
(:func:`gemmdrift.dispatch.choose`, for the chip, op, dtype, T, N, K and the mlx version replayed); this
module binds that Choice to a recipe (:func:`.recipe_for`) and spells the ``replay:`` paths.

Chips: ``cpu`` (this machine's own backend, mlx's Linux x86 CPU: checked bit for bit here), ``M1``,
``M3``, ``M5`` and any other name :func:`gemmdrift.dispatch.chip_named` knows (``M3 Max`` as ``M3-Max``),
``sm90`` (its own gemv at T=1 only; cuBLASLt is not knowable from source). A kernel whose order the source
does not give (NAX on M5 for T >= 16, cuBLASLt, CUDA qmv/qmm) is a one-line error that says so: nothing is
guessed.

Paths (``gemmdrift fingerprint --paths``): ``replay:<chip>[@<variant>]:matmul:<dtype>`` and
``replay:<chip>[@<variant>]:quant:affine-q<bits>-g64[:<dtype>]``; the variant is ``axis=value[,...]``
(:data:`.RECIPES` lists each recipe's axes).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..dispatch import chip_named, choose
from ..errors import GemmdriftError
from . import UNKNOWN, Plan, check_variant_text, recipe_for, replay_matmul, replay_quantized

REPLAY_CHIPS = ("cpu", "M1", "M3", "M5", "sm90")
DTYPES = ("bfloat16", "float16", "float32")
PATH_HELP = ("replay:<chip>[@<variant>]:matmul:<dtype> or replay:<chip>[@<variant>]:quant:affine-q<4|8>-g64"
             f"[:<dtype>] (chips: {', '.join(REPLAY_CHIPS)} or any chip name; variant axis=value,...)")
_QUANT = re.compile(r"^affine-q(4|8)-g64$")


def installed_mlx() -> str:
    import mlx.core as mx

    return mx.__version__


@dataclass(frozen=True)
class ReplayPath:
    text: str
    chip: str
    variant: str
    op: str  # matmul | quantized_matmul
    dtype: str
    bits: int = 0
    group_size: int = 0
    mode: str = ""


def parse_chip(text: str):
    """A chip for replay (one-line error naming what exists)."""
    try:
        return chip_named(str(text).replace("-", " "))
    except GemmdriftError as e:
        raise GemmdriftError(f"unknown replay chip {text!r} (replay chips: {', '.join(REPLAY_CHIPS)}; {e})") from None


def parse_replay_path(text: str) -> ReplayPath:
    """'replay:M3:matmul:bfloat16', 'replay:M1@mma=H2:quant:affine-q4-g64:bfloat16', ..."""
    parts = str(text).strip().split(":")
    bad = GemmdriftError(f"unsupported replay path {text!r} (known: {PATH_HELP})")
    if len(parts) < 4 or parts[0] != "replay":
        raise bad
    chip, _, variant = parts[1].partition("@")
    parse_chip(chip)
    check_variant_text(variant)
    if parts[2] == "matmul" and len(parts) == 4 and parts[3] in DTYPES:
        return ReplayPath(text, chip, variant, "matmul", parts[3])
    if parts[2] == "quant" and len(parts) in (4, 5):
        m = _QUANT.match(parts[3])
        dtype = parts[4] if len(parts) == 5 else "bfloat16"
        if m and dtype in DTYPES:
            return ReplayPath(text, chip, variant, "quantized_matmul", dtype, int(m.group(1)), 64, "affine")
    raise bad


def plan_for(chip: Any, op: str, *, T: int, K: int, N: int, dtype: str, mlx_version: str | None = None,
             bits: int | None = None, group_size: int | None = None, variant: Any = None,
             b_transposed: bool = True, mode: str = "affine") -> Plan:
    """The recipe ``chip`` runs for one call, bound to ``variant``; a kernel with no known order is an error.

    ``b_transposed`` (matmul only): True for ``x @ W.T`` with W (N, K) (a Linear), False for ``x @ W`` with W
    (K, N) row-major (``gemv_t`` at T=1 on Metal); :func:`run_plan` takes the weight as (N, K) either way
    (``W.T`` for the second). ``mode`` (quantized only): ``affine`` or an fp mode (``mxfp4``, ``nvfp4``,
    ``mxfp8``), whose Metal kernels have the ``fp_`` recipes.
    """
    c = parse_chip(chip) if isinstance(chip, str) else chip
    version = mlx_version or installed_mlx()
    kw = ({"bits": bits, "group_size": group_size, "mode": mode} if op == "quantized_matmul"
          else {"b_transposed": b_transposed})
    choice = choose(c, op, T=T, K=K, N=N, dtype=dtype, mlx_version=version, **kw)
    if choice.kernel in UNKNOWN or choice.kernel in ("cpu_not_read", "unsupported", "dot_product", "cuda_fp_qmv"):
        why = UNKNOWN.get(choice.kernel, choice.note or "no recipe")
        shape = "" if kw.get("b_transposed", True) else " (x @ W, W not transposed)"
        shape += "" if mode == "affine" or op != "quantized_matmul" else f" {mode}"
        raise GemmdriftError(f"{c.name} {op}{shape} {dtype} T={T} K={K} N={N}: mlx {version} dispatches "
                             f"{choice.kernel}, which has no replay recipe ({why})")
    plan = recipe_for(choice, variant, mlx_version=version)
    if dtype not in plan.recipe.dtypes:
        raise GemmdriftError(f"{plan.recipe.kernel} has no {dtype} recipe (it has: {', '.join(plan.recipe.dtypes)})")
    return plan


def run_plan(plan: Plan, x: np.ndarray, *, dtype: str, w: np.ndarray | None = None, bias=None, quant=None,
             w_min: float | None = None):
    """Run a plan on dense ``w`` (N, K) (for an ``x @ W`` plan, ``W.T``) or ``quant = (wq, scales, biases, bits,
    group_size)`` (an fp mode's plan: ``scales`` the uint8 codes, ``biases`` None)."""
    if plan.recipe.op == "matmul":
        return replay_matmul(plan.recipe, x, w, bias, dtype=dtype, params=plan.params, variant=plan.variant,
                             w_min=w_min)
    wq, scales, biases, bits, group_size = quant
    return replay_quantized(plan.recipe, x, wq, scales, biases, bits=bits, group_size=group_size, dtype=dtype,
                            params=plan.params, variant=plan.variant, mode=plan.params.get("mode", "affine"))


def replay_probe(text: str, K: int, T: int, N: int) -> tuple[Callable[[np.ndarray], np.ndarray], int, dict]:
    """For :mod:`gemmdrift.fingerprint`: ``fn(values (P, K)) -> outputs (P, T)`` replaying the path's recipe.

    The recipe is the one the chip dispatches at (T, K, N); the probes ride in
    W's rows (dense, x all ones) or in x (quantized; W dequantizes to exactly 1:
    codes 0, scale 1, bias 1). Every probe value (0, 1, +-2**40 in bf16) is
    exact in the dtype.
    """
    rp = parse_replay_path(text)
    plan = plan_for(rp.chip, rp.op, T=T, K=K, N=N, dtype=rp.dtype, bits=rp.bits or None,
                    group_size=rp.group_size or None, variant=rp.variant)
    meta = {"N": N, "kernel": plan.recipe.kernel, "variant": ",".join(f"{k}={v}" for k, v in plan.variant.items()),
            "params": dict(plan.params), "prediction": plan.recipe.prediction}
    if rp.op == "matmul":
        x = np.ones((T, K), dtype=np.float32)

        def fn(vals: np.ndarray) -> np.ndarray:
            return run_plan(plan, x, dtype=rp.dtype, w=vals.astype(np.float32)).y.T

        return fn, 1 << 12, meta
    bits, g = rp.bits, rp.group_size
    wq = np.zeros((1, K * bits // 32), dtype=np.uint32)
    ones = np.ones((1, K // g), dtype=np.float32)

    def qfn(vals: np.ndarray) -> np.ndarray:
        x = np.repeat(vals.astype(np.float32), T, axis=0)  # probe p at every position of its T-row block
        y = run_plan(plan, x, dtype=rp.dtype, quant=(wq, ones, ones, bits, g)).y
        return y.reshape(len(vals), T)

    return qfn, 1 << 10, {**meta, "bits": bits, "group_size": g, "mode": "affine"}


__all__ = ["REPLAY_CHIPS", "PATH_HELP", "ReplayPath", "parse_chip", "parse_replay_path", "plan_for", "run_plan",
           "replay_probe", "installed_mlx"]
