"""CPU dispatch, read for Linux x86_64 only (mlx 846d176; the files below are unchanged in kind since v0.30.5).

``cpu-linux-x86``: fp16/bf16 matmul is ``matmul<T>`` of
mlx/backend/cpu/gemms/simd_bf16.cpp / simd_fp16.cpp (simd_gemm.h: M and N in
blocks of 16, K walked in the same order for every row; x86 builds have
``simd::max_size`` 1), float32 goes to ``cblas_sgemm`` (gemms/cblas.cpp, the
reference BLAS in the mlx-cpu wheel), quantized matmul loops the rows of x
one by one (mlx/backend/cpu/quantized.cpp), and sdpa always falls back to the
unfused graph on a CPU stream (``use_fallback``). So every row takes the same
path for every T: row-invariant by construction.

``cpu-other`` (macOS, Linux aarch64, ...): not read. macOS builds with
Accelerate, so fp16/bf16 go to BNNS (gemms/bnns.cpp, ``MLX_BUILD_ACCELERATE``
in mlx/backend/cpu/CMakeLists.txt) and float32 to Accelerate's cblas_sgemm;
aarch64 Linux takes the NEON simd path. No kernel is predicted there.
"""

from __future__ import annotations

from .base import CPU_CBLAS, CPU_QUANTIZED, CPU_SIMD_GEMM, Chip, Choice, Version
from .chips import CPU_LINUX_X86

ROW_INVARIANT = "row-invariant by construction: the same K order for every row"
NOT_READ = "CPU dispatch not read for this platform (rules read for Linux x86_64 only)"


def choose(chip: Chip, op: str, M: int, K: int, N: int, dtype: str, version: Version) -> Choice:
    """The CPU kernel of ``op``; ``cpu_not_read`` for any platform but Linux x86_64."""
    if chip.name != CPU_LINUX_X86:
        return Choice("cpu_not_read", {}, "mlx/backend/cpu/CMakeLists.txt", chip.note or NOT_READ)
    if op == "quantized_matmul":
        return Choice("cpu_qmm", {"rows": "one at a time"}, f"{CPU_QUANTIZED} _qmm_t", ROW_INVARIANT)
    if op == "sdpa":
        return Choice("sdpa_unfused", {}, "mlx/fast.cpp scaled_dot_product_attention (fallback on a CPU stream)",
                      ROW_INVARIANT)
    if dtype == "float32":
        return Choice("cpu_cblas_sgemm", {}, f"{CPU_CBLAS} matmul<float>", ROW_INVARIANT)
    return Choice("cpu_simd_gemm", {"block_m": 16, "block_n": 16}, f"{CPU_SIMD_GEMM} simd_gemm", ROW_INVARIANT)
