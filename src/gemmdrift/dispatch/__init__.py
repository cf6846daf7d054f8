"""Which kernel MLX dispatches for a given number of rows T, per chip and mlx version.

Everything here was read from the mlx source (ml-explore/mlx at HEAD 846d176,
0.32.2 in ``mlx/version.h``, the tags v0.30.5, v0.31.2, v0.32.0, v0.32.1, and
every commit that touched the dispatch files from v0.26.5 on; where a condition
changed, it is a named rule of :mod:`.commits` with its first tag, commit and
pull request), not recalled: each rule names the file and function it models. It is pure
Python with no mlx import, so it can label results from any machine.

The structured interface (used by the reduction-order replayer):

* :class:`Chip` and :func:`chip_from_env` (the chip of an environment record:
  ``applegpu_gNNx`` plus the macOS version on Metal, ``sm_XY`` on CUDA, the
  platform on the CPU; ``None`` for an architecture it cannot read) and
  :func:`chip_named` ("M1", "M3 Max", "sm90", ...);
* :func:`choose`, which returns a :class:`Choice`: the kernel in mlx's own
  spelling (``gemv``, ``gemv_wide``, ``steel_gemm``, ``steel_gemm_splitk``,
  ``qmv_wide``, ``qmm_t_splitk``, ``sdpa_vector``, ...), the parameters that
  decide its reduction order, and the source it was read from.

The string functions (:func:`kernel_for`, :func:`thresholds` and the
``metal_*``/``cuda_*`` ones) are derived from :func:`choose`, so there is one
source of truth. A drift between T=1 and T>1 can appear only where the kernel
(or its reduction order) changes with T; :func:`thresholds` lists those change
points for one shape: "from T on, this kernel runs".

Version window: the rules were read from v0.26.5 to HEAD (CUDA sdpa and the CPU
from v0.30.5: :data:`.tags.READ_FROM`). Older releases get nothing (not guessed:
``thresholds`` returns ``[]``, :func:`choose` refuses, saying the release is
older than the first tag read); releases newer than the mirror get HEAD's
rules, and say so in the Choice's note. ``choose(..., reverted={"gemv_wide"})``
evaluates a release with named rules reverted (:func:`.commits.at`).

CPU: the rule was read for Linux x86_64 (``cpu-linux-x86``: row-invariant by
construction, no thresholds); any other platform is ``cpu-other``, not read
(see :mod:`.cpu`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, NamedTuple

from ..errors import GemmdriftError
from . import cpu as _cpu
from . import cuda as _cuda
from . import metal as _metal
from .base import (BACKENDS, CPU_CBLAS, CPU_QUANTIZED, CPU_SIMD_GEMM, CUDA_GEMV, CUDA_MATMUL, CUDA_QMM,
                   CUDA_QUANTIZED, CUDA_SDPA, CUDA_SDPA_VECTOR, METAL_DEVICE, METAL_MATMUL, METAL_QUANTIZED,
                   METAL_SDPA, MIRROR_REVISION, MIRROR_VERSION, OPS, TAGS_READ, VERIFIED_FROM, Chip, Choice,
                   Version, parse_version)
from .commits import RULES, at, between
from .chips import (CHIPS, CPU_LINUX_X86, CPU_OTHER, DEFAULT_CHIP, SIZE_LABEL, chip_from_env, chip_named,
                    describe_chip, not_a_chip)
from .metal import qmv_batch_limit

CPU_NOTE = _cpu.ROW_INVARIANT + (" (Linux x86_64): mlx/backend/cpu/gemms/simd_gemm.h walks K in the same order "
                                 "for every row, fp32 uses cblas_sgemm, mlx/backend/cpu/quantized.cpp loops rows "
                                 "one by one")
DTYPES = ("bfloat16", "float16", "float32")
# mlx's quantization defaults per mode (quantization_params_from_mode in mlx/ops.cpp): (bits, group size).
QUANT_DEFAULTS = {"affine": (4, 64), "nvfp4": (4, 16), "mxfp4": (4, 32), "mxfp8": (8, 32)}


class Threshold(NamedTuple):
    """From row count ``T`` on, kernel ``label`` runs (as read from ``source``)."""

    T: int
    label: str
    source: str
    note: str = ""


def _version(mlx_version: str | Version) -> Version:
    version = mlx_version if isinstance(mlx_version, tuple) else parse_version(mlx_version)
    if version < VERIFIED_FROM:
        first = ".".join(map(str, VERIFIED_FROM))
        raise GemmdriftError(f"mlx {'.'.join(map(str, version))} is older than the first tag read (v{first}): "
                             f"dispatch was read from v{first} on; older releases are not modelled")
    return version


def choose(chip: Chip, op: str, *, T: int, K: int, N: int, dtype: str, mlx_version: str | Version,
           bits: int | None = None, group_size: int | None = None, mode: str = "affine", reverted=(),
           **extra: Any) -> Choice:
    """The kernel ``op`` dispatches on ``chip`` for T rows, as the mlx source of ``mlx_version`` reads.

    Args:
        chip: from :func:`chip_from_env` or :func:`chip_named`.
        op: ``matmul`` (``x (T, K) @ W.T`` with W (N, K), no bias, batch 1), ``quantized_matmul``
            (``quantized_matmul(x, w, transpose=True)``), or ``sdpa`` (T queries; K is the key
            length and N the head dim, unless ``k_len``/``head_dim`` are given).
        dtype: ``bfloat16``, ``float16`` or ``float32``.
        mlx_version: e.g. ``"0.31.2"``; before 0.26.5 raises, newer than the mirror uses its rules.
        bits, group_size: quantization (default: mlx's per ``mode``, e.g. affine 4 bits, group 64).
        mode: ``affine``, ``mxfp4``, ``mxfp8`` or ``nvfp4``.
        reverted: names of :data:`.commits.RULES` to evaluate as before their first tag (the release without
            that change alone).
        **extra: ``tf32`` (MLX_ENABLE_TF32; default the chip's, which is a record's or mlx's 1); for matmul ``b_transposed`` (default
            True: ``x @ W.T`` with W (N, K); False: ``x @ W`` with W (K, N) row-major, gemv_t at T=1 on
            Metal, no gemv on CUDA; the CPU's rule, read for ``x @ W.T``, does not look at it); for sdpa ``n_heads``,
            ``n_kv_heads`` (default 1), ``v_head_dim`` (default the head dim), ``causal`` (default True).

    Returns:
        A :class:`Choice`. When the chip's NAX is unknown (``nax=None``) and NAX would change the
        kernel, the non-NAX choice is returned with a note naming the NAX one. A setting of the chip's
        record (``chip.settings``) that changed the kernel or its order is named in the note
        ("MLX_ENABLE_TF32=0 decided: steel_gemm, not steel_gemm_nax").
    """
    if op not in OPS:
        raise GemmdriftError(f"unknown op {op!r} (known: {', '.join(OPS)})")
    if chip.backend not in BACKENDS:
        raise GemmdriftError(f"unknown backend {chip.backend!r} (known: {', '.join(BACKENDS)})")
    if dtype not in DTYPES:
        raise GemmdriftError(f"unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
    if T < 1 or K < 1 or N < 1:
        raise GemmdriftError(f"T, K and N must be positive, got T={T}, K={K}, N={N}")
    version = _version(mlx_version)
    if reverted:
        version = at(version, reverted)
    choice = _choose_on(chip, op, T, K, N, dtype, version, bits, group_size, mode, extra)
    # The record's settings (MLX_ENABLE_TF32=0, MLX_METAL_GPU_ARCH, the macOS version): the one that changed
    # the kernel, or the parameters that decide its order, is named.
    for what, without in chip.settings:
        other = _choose_on(without, op, T, K, N, dtype, version, bits, group_size, mode, extra)
        if (other.kernel, dict(other.params)) != (choice.kernel, dict(choice.params)):
            choice = Choice(choice.kernel, choice.params, choice.source,
                            _join(choice.note, f"{what} decided: {_differs(choice, other)}"))
    return choice


def _differs(choice: Choice, other: Choice) -> str:
    """'steel_gemm, not steel_gemm_nax' or, for one kernel, the parameters that differ ('compute=32F, not ...')."""
    if choice.kernel != other.kernel:
        return f"{choice.kernel}, not {other.kernel}"
    keys = [k for k in {**choice.params, **other.params} if choice.params.get(k) != other.params.get(k)]
    return (" ".join(f"{k}={choice.params.get(k)}" for k in keys) + ", not "
            + " ".join(f"{k}={other.params.get(k)}" for k in keys))


def _choose_on(chip: Chip, op: str, T: int, K: int, N: int, dtype: str, version: Version, bits, group_size, mode,
               extra: dict[str, Any]) -> Choice:
    if chip.nax is None and chip.backend == "metal":
        args = (op, T, K, N, dtype, version, bits, group_size, mode, extra)
        off, on = _choose_on(_with_nax(chip, False), *args), _choose_on(_with_nax(chip, True), *args)
        if on.kernel == off.kernel and on.params == off.params:
            return off
        return Choice(off.kernel, off.params, off.source,
                      _join(off.note, f"{chip.note or 'NAX unknown'}; with NAX: {on.kernel}"))
    choice = _choose(chip, op, T, K, N, dtype, version, bits, group_size, mode, extra)
    if version > MIRROR_VERSION:
        return Choice(choice.kernel, choice.params, choice.source,
                      _join(choice.note, f"mlx {'.'.join(map(str, version))} is newer than the source read "
                                         f"({MIRROR_REVISION}): the rules read there are used"))
    return choice


def changed_by(chip: Chip, op: str, old: str | Version, new: str | Version, **kw: Any) -> list:
    """The rules of :mod:`.commits` (first tag between ``old`` and ``new``) that move this call's kernel or its
    parameters from one release to the other. The newer release with every such rule reverted dispatches as the
    older one (tests/test_dispatch_commits.py); the rules are then restored one at a time, oldest first, and each
    one whose restoring changes the Choice is named. ``kw``: :func:`choose`'s (T, K, N, dtype, ...). Empty when
    both releases dispatch alike."""
    def key(c: Choice) -> tuple:
        return c.kernel, tuple(sorted(c.params.items()))

    vo, vn = _version(old), _version(new)
    newer = max(vo, vn)
    if key(choose(chip, op, mlx_version=newer, **kw)) == key(choose(chip, op, mlx_version=min(vo, vn), **kw)):
        return []
    rules = between(vo, vn, chip.backend, op)
    names = [r.name for r in rules]
    out, prev = [], key(choose(chip, op, mlx_version=newer, reverted=names, **kw))
    for i, rule in enumerate(rules):
        cur = key(choose(chip, op, mlx_version=newer, reverted=names[i + 1:], **kw))
        if cur != prev:
            out.append(rule)
        prev = cur
    return out


def _join(*notes: str) -> str:
    return "; ".join(n for n in notes if n)


def _with_nax(chip: Chip, nax: bool) -> Chip:
    return replace(chip, nax=nax, settings=())


def _choose(chip: Chip, op: str, T: int, K: int, N: int, dtype: str, version: Version, bits, group_size, mode,
            extra: dict[str, Any]) -> Choice:
    tf32 = bool(extra.get("tf32", chip.tf32))
    if chip.backend == "cpu":
        return _cpu.choose(chip, op, T, K, N, dtype, version)
    backend = _metal if chip.backend == "metal" else _cuda
    if op == "matmul":
        return backend.matmul(chip, T, K, N, dtype, version, tf32=tf32,
                              b_transposed=bool(extra.get("b_transposed", True)))
    if op == "quantized_matmul":
        if mode not in QUANT_DEFAULTS:
            raise GemmdriftError(f"unknown quantization mode {mode!r} (known: {', '.join(QUANT_DEFAULTS)})")
        d_bits, d_group = QUANT_DEFAULTS[mode]
        return backend.quantized_matmul(chip, T, K, N, dtype, version, bits=d_bits if bits is None else bits,
                                        group_size=d_group if group_size is None else group_size, mode=mode,
                                        tf32=tf32)
    k_len, head_dim = int(extra.get("k_len", K)), int(extra.get("head_dim", N))
    n_heads, n_kv = int(extra.get("n_heads", 1)), int(extra.get("n_kv_heads", 1))
    if n_kv < 1 or n_heads < n_kv or n_heads % n_kv:
        raise GemmdriftError(f"sdpa needs heads a positive multiple of kv heads, got {n_heads} and {n_kv}")
    return backend.sdpa(chip, T, k_len, head_dim, n_heads, n_kv, dtype, version,
                        v_head_dim=extra.get("v_head_dim"), causal=bool(extra.get("causal", True)), tf32=tf32)


# ------------------------------------------------------------ labels (the string interface)


def label(choice: Choice) -> str:
    """The short label of a Choice used in tables and plots: 'gemv_wide k_lanes=32', 'steel split-K P=4', ..."""
    k, p = choice.kernel, choice.params
    if k == "gemv_wide":
        return f"gemv_wide k_lanes={p['k_lanes']}"
    if k == "steel_gemm_splitk":
        return f"steel split-K P={p['partitions']}"
    if k == "qmm_t_splitk":
        return f"qmm_splitk k={p['split_k']}"
    if k == "sdpa_full_nax" and p.get("head_dim_split"):
        return "sdpa_full_nax (head-dim split)"
    if k == "cuda_qmm":
        return f"qmm_{p['variant']}"
    return {"steel_gemm": "steel GEMM", "steel_gemm_nax": "steel NAX GEMM",
            "steel_gemm_splitk_nax": "steel NAX split-K",
            "sdpa_unfused": "unfused (matmul, softmax, matmul)", "sdpa_full_nax": "sdpa_full_nax",
            "cuda_gemv": "gemv", "cublaslt": "cuBLASLt (heuristic algorithm)", "cuda_qmv": "qmv",
            "cuda_fp_qmv": "fp_qmv", "cudnn_sdpa": "cuDNN SDPA", "cuda_sdpa_vector": "sdpa_vector",
            "cpu_simd_gemm": "cpu (row-invariant)", "cpu_cblas_sgemm": "cpu (row-invariant)",
            "cpu_qmm": "cpu (row-invariant)", "cpu_not_read": "cpu (not read)"}.get(k, k)


def resolve_chip(backend: str, chip: str | Chip | None) -> Chip:
    """A Chip for ``backend``: the object itself, a name (:func:`chip_named`), or None for the backend's default."""
    if isinstance(chip, Chip):
        found = chip
    elif chip is None and backend == "cpu":
        found = CHIPS[CPU_LINUX_X86]
    else:
        name = chip or DEFAULT_CHIP.get(backend)
        try:
            found = chip_named(name) if name else None
        except GemmdriftError:
            found = None
    if found is None or found.backend != backend:
        known = ", ".join(c.name for c in CHIPS.values() if c.backend == backend)
        raise GemmdriftError(f"unknown {backend} chip {getattr(chip, 'name', chip)!r} (known: {known})")
    return found


def _lookup(backend: str, op: str) -> str:
    if backend not in BACKENDS:
        raise GemmdriftError(f"unknown backend {backend!r} (known: {', '.join(BACKENDS)})")
    if op not in OPS:
        raise GemmdriftError(f"unknown op {op!r} (known: {', '.join(OPS)})")
    return {("metal", "matmul"): METAL_MATMUL, ("metal", "quantized_matmul"): METAL_QUANTIZED,
            ("metal", "sdpa"): METAL_SDPA, ("cuda", "matmul"): CUDA_MATMUL,
            ("cuda", "quantized_matmul"): CUDA_QUANTIZED, ("cuda", "sdpa"): CUDA_SDPA}.get((backend, op), CPU_NOTE)


def _shape_args(op: str, T: int, shape: dict[str, Any]) -> dict[str, Any]:
    try:
        if op == "sdpa":
            return {"T": T, "K": int(shape["k_len"]), "N": int(shape["head_dim"]),
                    "dtype": shape.get("dtype", "bfloat16"),
                    "n_heads": shape["n_heads"], "n_kv_heads": shape["n_kv_heads"],
                    **{k: shape[k] for k in ("v_head_dim", "causal", "tf32") if k in shape}}
        out = {"T": T, "K": int(shape["K"]), "N": int(shape["N"]), "dtype": shape.get("dtype", "bfloat16"),
               **({"tf32": shape["tf32"]} if "tf32" in shape else {})}
        if op == "quantized_matmul":
            out.update(mode=shape.get("mode", "affine"), bits=shape.get("bits", 4),
                       group_size=shape.get("group_size", 64))
        return out
    except KeyError as e:
        raise GemmdriftError(f"dispatch for {op} needs the shape parameter {e.args[0]}") from None


def kernel_for(backend: str, op: str, T: int, *, mlx_version: str, chip: str | Chip | None = None, **shape) -> str:
    """The label of the kernel ``op`` dispatches for T rows (T = query length for ``sdpa``).

    Shapes: matmul needs K, N (and dtype); quantized_matmul needs K, N, mode,
    bits, group_size; sdpa needs k_len, head_dim, n_heads, n_kv_heads.
    ``chip`` is a :class:`Chip`, a name, or None (the CPU rule on ``cpu``; the
    reference chip of :data:`DEFAULT_CHIP` on a GPU backend).
    """
    _lookup(backend, op)
    chip_obj = resolve_chip(backend, chip)
    return label(choose(chip_obj, op, mlx_version=mlx_version, **_shape_args(op, T, shape)))


def thresholds(backend: str, mlx_version: str, op: str, *, chip: str | Chip | None = None, max_t: int = 2048,
               **shape) -> list[Threshold]:
    """Row counts at which the dispatched kernel changes, for one shape.

    Args:
        backend: ``metal``, ``cuda`` or ``cpu`` (always empty: row-invariant on Linux x86, not read elsewhere).
        mlx_version: e.g. ``"0.32.4"``; releases before 0.26.5 give ``[]``
            (their dispatch code was not read).
        op: ``matmul``, ``quantized_matmul`` or ``sdpa``.
        chip: a :class:`Chip` or a name (default M3 Max / sm90: a reference, for CPU data only).
        max_t: last row count examined.
        **shape: see :func:`kernel_for`.

    Returns:
        One entry per change, the first at T=1 (the decode kernel), each with
        the source file it was read from.
    """
    source = _lookup(backend, op)
    if backend == "cpu":
        return []
    if max_t < 1:
        raise GemmdriftError(f"max_t must be at least 1, got {max_t}")
    version = parse_version(mlx_version)
    if version < VERIFIED_FROM:  # older than the first tag read: nothing is guessed
        return []
    chip_obj = resolve_chip(backend, chip)
    note = f"{chip_obj.name}, mlx {mlx_version}"
    if version > MIRROR_VERSION:
        note += f" (rules as of {MIRROR_REVISION})"
    out: list[Threshold] = []
    previous = None
    for t in range(1, max_t + 1):
        kernel = label(choose(chip_obj, op, mlx_version=version, **_shape_args(op, t, shape)))
        if kernel != previous:
            out.append(Threshold(t, kernel, source, note))
            previous = kernel
    return out


# ----------------------------------------------- the older per-backend string functions


def metal_matmul_kernel(M: int, K: int, N: int, dtype: str, chip: Chip, version: Version) -> str:
    """Label of ``x (M,K) @ W.T`` on Metal; see :func:`gemmdrift.dispatch.metal.matmul`."""
    return label(_metal.matmul(chip, M, K, N, dtype, version))


def metal_qmm_kernel(M: int, K: int, N: int, mode: str, bits: int, group_size: int, chip: Chip,
                     version: Version) -> str:
    """Label of ``quantized_matmul(x, w, transpose=True)`` on Metal."""
    return label(_metal.quantized_matmul(chip, M, K, N, "bfloat16", version, bits=bits, group_size=group_size,
                                         mode=mode))


def metal_sdpa_kernel(q_len: int, k_len: int, head_dim: int, n_heads: int, n_kv_heads: int, chip: Chip,
                      version: Version) -> str:
    """Label of mx.fast.scaled_dot_product_attention on Metal."""
    return label(_metal.sdpa(chip, q_len, k_len, head_dim, n_heads, n_kv_heads, "bfloat16", version))


def cuda_matmul_kernel(M: int, K: int, N: int, dtype: str, chip: Chip, version: Version) -> str:
    return label(_cuda.matmul(chip, M, K, N, dtype, version))


def cuda_qmm_kernel(M: int, K: int, N: int, mode: str, bits: int, group_size: int, chip: Chip,
                    version: Version) -> str:
    return label(_cuda.quantized_matmul(chip, M, K, N, "bfloat16", version, bits=bits, group_size=group_size,
                                        mode=mode))


def cuda_sdpa_kernel(q_len: int, k_len: int, head_dim: int, n_heads: int, n_kv_heads: int, chip: Chip,
                     version: Version) -> str:
    return label(_cuda.sdpa(chip, q_len, k_len, head_dim, n_heads, n_kv_heads, "bfloat16", version))


__all__ = ["Chip", "Choice", "Threshold", "CHIPS", "DEFAULT_CHIP", "SIZE_LABEL", "CPU_LINUX_X86", "CPU_OTHER",
           "CPU_NOTE", "BACKENDS", "OPS", "MIRROR_REVISION", "MIRROR_VERSION", "VERIFIED_FROM", "TAGS_READ",
           "QUANT_DEFAULTS", "DTYPES", "RULES", "between", "changed_by", "chip_from_env", "chip_named", "describe_chip", "not_a_chip", "choose", "label",
           "kernel_for",
           "thresholds", "resolve_chip", "parse_version", "qmv_batch_limit", "metal_matmul_kernel",
           "metal_qmm_kernel", "metal_sdpa_kernel", "cuda_matmul_kernel", "cuda_qmm_kernel", "cuda_sdpa_kernel",
           "METAL_MATMUL", "METAL_QUANTIZED", "METAL_SDPA", "METAL_DEVICE", "CUDA_MATMUL", "CUDA_GEMV",
           "CUDA_QUANTIZED", "CUDA_QMM", "CUDA_SDPA", "CUDA_SDPA_VECTOR", "CPU_CBLAS", "CPU_QUANTIZED",
           "CPU_SIMD_GEMM"]
