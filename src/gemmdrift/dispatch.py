"""Which kernel MLX dispatches for a given number of rows T, per backend and mlx version.

Everything here was read from the mlx source (the mirrored repository, HEAD
846d176, version 0.32.2 in ``mlx/version.h``; release tags checked with ``git
tag --contains``), not recalled: each rule below names the file it models. It
is a pure table, with no mlx import, so it can label plots from any machine's
results.

A drift between T=1 and T>1 can only appear where the kernel (or its
reduction order) changes with T. :func:`thresholds` lists those change points
for one shape, as ``Threshold(T, label, source, note)``: "from T on, this
kernel runs".

Version window: the rules were checked at v0.30.5, v0.31.2, v0.32.0, v0.32.1
and HEAD. For older releases nothing is returned (not guessed); releases newer
than the mirror get HEAD's rules.

CPU: no thresholds. The CPU backend is row-invariant by construction:
``mlx/backend/cpu/gemms/simd_gemm.h`` (fp16/bf16) tiles M and N in blocks of 16
but walks K in the same order for every row, fp32 goes to ``cblas_sgemm``
(``mlx/backend/cpu/gemms/cblas.cpp``), and ``mlx/backend/cpu/quantized.cpp``
loops the rows of x one by one (``for (int m = 0; m < M; m++)``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import NamedTuple

from .errors import GemmdriftError

MIRROR_REVISION = "846d176 (mlx 0.32.2)"
VERIFIED_FROM = (0, 30, 5)
MIRROR_VERSION = (0, 32, 2)

METAL_MATMUL = "mlx/backend/metal/matmul.cpp"
METAL_QUANTIZED = "mlx/backend/metal/quantized.cpp"
METAL_SDPA = "mlx/backend/metal/scaled_dot_product_attention.cpp"
METAL_DEVICE = "mlx/backend/metal/device.cpp"
CUDA_MATMUL = "mlx/backend/cuda/matmul.cpp"
CUDA_GEMV = "mlx/backend/cuda/gemms/gemv.cu"
CUDA_QUANTIZED = "mlx/backend/cuda/quantized/quantized.cpp"
CUDA_QMM = "mlx/backend/cuda/quantized/qmm/qmm.cu"
CUDA_SDPA = "mlx/backend/cuda/scaled_dot_product_attention.cpp"
CUDA_SDPA_VECTOR = "mlx/backend/cuda/scaled_dot_product_attention.cu"

BACKENDS = ("metal", "cuda", "cpu")
OPS = ("matmul", "quantized_matmul", "sdpa")
CPU_NOTE = ("row-invariant by construction: mlx/backend/cpu/gemms/simd_gemm.h walks K in the same order for "
            "every row, fp32 uses cblas_sgemm, mlx/backend/cpu/quantized.cpp loops rows one by one")


class Threshold(NamedTuple):
    """From row count ``T`` on, kernel ``label`` runs (as read from ``source``)."""

    T: int
    label: str
    source: str
    note: str = ""


@dataclass(frozen=True)
class Chip:
    """A device as the dispatch code sees it.

    Metal: ``gen`` is the architecture generation of ``applegpu_gNNx`` (13 = M1
    ... 17 = M5) and ``size`` its last letter (p phone, g base, s Max, d
    Ultra). CUDA: ``gen`` is the compute-capability major.
    """

    name: str
    backend: str
    gen: int
    size: str = "g"
    # NAX needs gen >= 17 (18 for phones) and macOS 26.2 or later (is_nax_available in device.cpp).
    nax: bool = False


CHIPS = {c.name: c for c in (
    Chip("M1", "metal", 13), Chip("M1 Max", "metal", 13, "s"), Chip("M1 Ultra", "metal", 13, "d"),
    Chip("M2", "metal", 14), Chip("M2 Max", "metal", 14, "s"), Chip("M2 Ultra", "metal", 14, "d"),
    Chip("M3", "metal", 15), Chip("M3 Max", "metal", 15, "s"), Chip("M3 Ultra", "metal", 15, "d"),
    Chip("M4", "metal", 16), Chip("M4 Max", "metal", 16, "s"),
    Chip("M5", "metal", 17, nax=True), Chip("M5 Max", "metal", 17, "s", nax=True),
    Chip("sm80", "cuda", 8), Chip("sm90", "cuda", 9),
)}
DEFAULT_CHIP = {"metal": "M3 Max", "cuda": "sm90"}


def parse_version(text: str) -> tuple[int, int, int]:
    """'0.32.4' (or '0.32.4.dev20260801+abc') -> (0, 32, 4)."""
    m = re.match(r"\s*(\d+)\.(\d+)(?:\.(\d+))?", str(text))
    if not m:
        raise GemmdriftError(f"cannot read mlx version {text!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def _next_power_of_2(n: int) -> int:
    # mlx/utils.h next_power_of_2: n itself if a power of two, else 2**ceil(log2 n).
    return 1 if n <= 1 else 2 ** math.ceil(math.log2(n))


# ------------------------------------------------------------------------- Metal


def metal_matmul_kernel(M: int, K: int, N: int, dtype: str, chip: Chip, version: tuple[int, int, int]) -> str:
    """Kernel of ``x (M,K) @ W.T`` (nn.Linear: B transposed) on Metal; see matmul.cpp."""
    if M == 1:
        return "gemv"  # matmul.cpp: `if (std::min(M, N) == 1) return gemv(...)`
    # matmul.cpp gemv_wide_config (#3888, first in v0.32.1): gen >= 15, fp16/bf16, K % 4 == 0,
    # passes = (M + 4) / 5 <= 3 (so M <= 15); one pass keeps 32 K-lanes, more passes use 16.
    passes = (M + 4) // 5
    if (version >= (0, 32, 1) and chip.gen >= 15 and dtype in ("float16", "bfloat16") and K % 4 == 0
            and N > 1 and passes <= 3):
        lanes = 32 if passes == 1 or N <= 64 else 16
        return f"gemv_wide k_lanes={lanes}"
    tm, tn, tk = -(-M // 16), -(-N // 16), K // 16
    # NAX since v0.30.0 (#2772); fp32 joins it unless MLX_ENABLE_TF32=0 (default 1).
    use_nax = chip.nax
    min_tmn = 2048 if chip.size in ("s", "d") else 1024
    # matmul.cpp "Case 1": SIMD split-K; `!use_nax &&` was added in v0.31.2.
    if ((not use_nax or version < (0, 31, 2)) and tm * tn <= min_tmn and tk >= 8 and K >= max(M, N)):
        parts = min(max(2, _next_power_of_2(tk // (tm * tn))), 32)
        return f"steel split-K P={parts}"
    # matmul.cpp "Case 2": NAX split-K, partition size fixed by K alone.
    if use_nax and (K >= 3 * max(M, N) or (max(M, N) <= 1024 and K > 2 * max(M, N))):
        return "steel NAX split-K"
    return "steel NAX GEMM" if use_nax else "steel GEMM"


def qmv_batch_limit(K: int, N: int, chip: Chip, version: tuple[int, int, int]) -> int:
    """get_qmv_batch_limit(D=K, O=N) in quantized.cpp; the M3+ table changed in v0.32.1 (#3791)."""
    small, mid = K <= 2048 and N <= 2048, K <= 4096 and N <= 4096
    pick = lambda a, b, c: a if small else (b if mid else c)  # noqa: E731
    if version >= (0, 32, 1):
        if chip.gen >= 17 and chip.size != "d":
            return pick(33, 25, 13)
        if chip.gen >= 15 and chip.size != "d":
            return pick(13, 15, 13)
        if chip.gen >= 13:
            return pick(32, 18, 12) if chip.size == "d" else pick(14, 10, 6)
        return pick(32, 18, 12) if chip.size == "d" else pick(18, 12, 10)
    if chip.gen in (13, 14):
        return pick(32, 18, 12) if chip.size == "d" else pick(14, 10, 6)
    return pick(32, 18, 12) if chip.size == "d" else pick(18, 12, 10)


def metal_qmm_kernel(M: int, K: int, N: int, mode: str, bits: int, group_size: int, chip: Chip,
                     version: tuple[int, int, int]) -> str:
    """Kernel of ``quantized_matmul(x, w, transpose=True)`` on Metal; see quantized.cpp."""
    limit = qmv_batch_limit(K, N, chip, version)
    if M < limit:
        # QuantizedMatmul::eval_gpu -> qmv dispatch: qmv_quad for K in {64, 128} and power-of-2 bits.
        if K in (64, 128) and bits & (bits - 1) == 0:
            return "qmv_quad"
        # qmv_wide (#3764, v0.32.0) for M >= 2; affine only on gen >= 15 (use_qmv_wide).
        if M >= 2 and version >= (0, 32, 0) and (mode != "affine" or chip.gen >= 15):
            return "qmv_wide"
        # qmv() takes qmv_fast when N % 8 == 0 and K % qmv_fast_k_alignment(bits) == 0, where
        # the alignment is get_pack_factor(bits, 32) * (bits == 2 ? 1 : 2) * 32 (common/quantized.h).
        pack = 8 if bits in (3, 5) else (4 if bits == 6 else 32 // bits)
        align = pack * (1 if bits == 2 else 2) * 32
        return "qmv_fast" if N % 8 == 0 and K % align == 0 else "qmv"
    nax = chip.nax and K % 64 == 0
    if version >= (0, 31, 2):
        # qmm_splitk (#3120): split_k = 512 / (N tiles * M tiles of 32), whole groups, K divisible.
        split = max(1, 512 // (-(-N // 32) * -(-M // 32)))
        k_align = max(group_size, 32)
        split = min(split, K // k_align)
        while split > 1 and K % (split * k_align) != 0:
            split -= 1
        if split > 1:
            return f"qmm_splitk k={split}"
    return "qmm_t_nax" if nax else "qmm_t"


def metal_sdpa_kernel(q_len: int, k_len: int, head_dim: int, n_heads: int, n_kv_heads: int, chip: Chip,
                      version: tuple[int, int, int]) -> str:
    """Kernel of mx.fast.scaled_dot_product_attention on Metal; see scaled_dot_product_attention.cpp."""
    gqa = n_heads // n_kv_heads
    if q_len <= 8:
        # has_fused_kernel / v0.32.1 use_fallback: vector head dims, q_len <= k_len, q_len * gqa <= 32.
        ok = head_dim in (64, 96, 128, 256) or (version >= (0, 32, 2) and head_dim == 192)
        if not ok or q_len > k_len or q_len * gqa > 32:
            return "unfused (matmul, softmax, matmul)"
        # eval_gpu: 2-pass on Max/Ultra from 1024 keys, or with GQA from 4096 keys.
        two_pass = (chip.size in ("s", "d") and k_len >= 1024) or (gqa > 1 and k_len >= 4096)
        return "sdpa_vector_2pass" if two_pass else "sdpa_vector"
    # q_len > 8: full kernel for head dims 64..128; 192/256 stay unfused except on NAX
    # for q_len >= 1024 with head dim 256 and a causal mask (#3842, after v0.32.1).
    if version >= (0, 32, 2) and chip.nax and head_dim == 256 and q_len >= 1024:
        return "sdpa_full_nax (head-dim split)"
    if head_dim in (64, 72, 80, 96, 128):
        return "sdpa_full"
    return "unfused (matmul, softmax, matmul)"


# -------------------------------------------------------------------------- CUDA


def cuda_matmul_kernel(M: int, K: int, N: int, dtype: str, chip: Chip, version: tuple[int, int, int]) -> str:
    # cuda/gemms/gemv.cu can_use_gemv: (M == 1 && b_transposed) || (N == 1 && !a_transposed).
    return "gemv" if M == 1 else "cuBLASLt (heuristic algorithm)"


def cuda_qmm_kernel(M: int, K: int, N: int, mode: str, bits: int, group_size: int, chip: Chip,
                    version: tuple[int, int, int]) -> str:
    # cuda/quantized/quantized.cpp: sm90 uses qmv only for M == 1 (N, K <= 16384), sm80 and
    # the naive qmm for M * B < 8; the sm90/sm80 qmm need affine (sm90) and 4/8 bits (qmm.cu).
    if chip.gen == 9 and mode == "affine" and bits in (4, 8) and K % 64 == 0 and group_size >= K:
        return "qmv" if M == 1 and N <= 16384 and K <= 16384 else "qmm_sm90"
    if chip.gen >= 8 and bits in (4, 8) and N % 128 == 0 and K % max(64, group_size) == 0:
        return "qmv" if M < 8 else "qmm_sm80"
    return "qmv" if M < 8 else "qmm_naive"


def cuda_sdpa_kernel(q_len: int, k_len: int, head_dim: int, n_heads: int, n_kv_heads: int, chip: Chip,
                     version: tuple[int, int, int]) -> str:
    # scaled_dot_product_attention.cpp supports_sdpa_cudnn: sm80+, head dim <= 128 and % 8 == 0;
    # q_len == 1 only from a fixed-size cache with >= 256 keys (assumed here, as mlx-lm's KVCache).
    if chip.gen >= 8 and head_dim <= 128 and head_dim % 8 == 0 and (q_len > 1 or k_len >= 256):
        return "cuDNN SDPA"
    # scaled_dot_product_attention.cu supports_sdpa_vector: head dim 64/96/128 and q_len < 4.
    if head_dim in (64, 96, 128) and q_len < 4:
        return "sdpa_vector"
    return "unfused (matmul, softmax, matmul)"


_KERNELS = {
    ("metal", "matmul"): (metal_matmul_kernel, METAL_MATMUL),
    ("metal", "quantized_matmul"): (metal_qmm_kernel, METAL_QUANTIZED),
    ("metal", "sdpa"): (metal_sdpa_kernel, METAL_SDPA),
    ("cuda", "matmul"): (cuda_matmul_kernel, CUDA_MATMUL),
    ("cuda", "quantized_matmul"): (cuda_qmm_kernel, CUDA_QUANTIZED),
    ("cuda", "sdpa"): (cuda_sdpa_kernel, CUDA_SDPA),
}


def kernel_for(backend: str, op: str, T: int, *, mlx_version: str, chip: str | None = None, **shape) -> str:
    """The kernel ``op`` dispatches for T rows (T = query length for ``sdpa``).

    Shapes: matmul needs K, N (and dtype); quantized_matmul needs K, N, mode,
    bits, group_size; sdpa needs k_len, head_dim, n_heads, n_kv_heads.
    """
    fn, _ = _lookup(backend, op)
    if fn is None:
        return "cpu (row-invariant)"
    chip_obj = resolve_chip(backend, chip)
    version = parse_version(mlx_version)
    try:
        if op == "sdpa":
            return fn(T, shape["k_len"], shape["head_dim"], shape["n_heads"], shape["n_kv_heads"], chip_obj, version)
        if op == "matmul":
            return fn(T, shape["K"], shape["N"], shape.get("dtype", "bfloat16"), chip_obj, version)
        return fn(T, shape["K"], shape["N"], shape.get("mode", "affine"), shape.get("bits", 4),
                  shape.get("group_size", 64), chip_obj, version)
    except KeyError as e:
        raise GemmdriftError(f"dispatch for {op} needs the shape parameter {e.args[0]}") from None


def resolve_chip(backend: str, chip: str | None) -> Chip:
    name = chip or DEFAULT_CHIP.get(backend)
    found = CHIPS.get(name) if name else None
    if found is None or found.backend != backend:
        known = ", ".join(c.name for c in CHIPS.values() if c.backend == backend)
        raise GemmdriftError(f"unknown {backend} chip {chip!r} (known: {known})")
    return found


def _lookup(backend: str, op: str):
    if backend not in BACKENDS:
        raise GemmdriftError(f"unknown backend {backend!r} (known: {', '.join(BACKENDS)})")
    if op not in OPS:
        raise GemmdriftError(f"unknown op {op!r} (known: {', '.join(OPS)})")
    return _KERNELS.get((backend, op), (None, CPU_NOTE))


def thresholds(backend: str, mlx_version: str, op: str, *, chip: str | None = None, max_t: int = 2048,
               **shape) -> list[Threshold]:
    """Row counts at which the dispatched kernel changes, for one shape.

    Args:
        backend: ``metal``, ``cuda`` or ``cpu`` (always empty: row-invariant).
        mlx_version: e.g. ``"0.32.4"``; releases before 0.30.5 give ``[]``
            (their dispatch code was not read).
        op: ``matmul``, ``quantized_matmul`` or ``sdpa``.
        chip: a name in :data:`CHIPS` (default M3 Max / sm90).
        max_t: last row count examined.
        **shape: see :func:`kernel_for`.

    Returns:
        One entry per change, the first at T=1 (the decode kernel), each with
        the source file it was read from.
    """
    _, source = _lookup(backend, op)
    if backend == "cpu":
        return []
    if max_t < 1:
        raise GemmdriftError(f"max_t must be at least 1, got {max_t}")
    version = parse_version(mlx_version)
    if version < VERIFIED_FROM:
        return []
    note = f"{chip or DEFAULT_CHIP[backend]}, mlx {mlx_version}"
    if version > MIRROR_VERSION:
        note += f" (rules as of {MIRROR_REVISION})"
    out: list[Threshold] = []
    previous = None
    for t in range(1, max_t + 1):
        kernel = kernel_for(backend, op, t, mlx_version=mlx_version, chip=chip, **shape)
        if kernel != previous:
            out.append(Threshold(t, kernel, source, note))
            previous = kernel
    return out
