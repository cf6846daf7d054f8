"""CUDA dispatch, read from the mlx source (ml-explore/mlx v0.30.5, v0.31.2, v0.32.0, v0.32.1, HEAD 846d176; matmul
and quantized matmul back to v0.26.5 through every commit that touched their files, issue 54). A condition that
changed is a named rule of :mod:`.commits` (its first tag, commit and pull request).

Where the library picks the algorithm (cuBLASLt's heuristic, cuDNN), the
order is not knowable from mlx's source: the Choice says so in its note.
"""

from __future__ import annotations

from .base import CUDA_GEMV, CUDA_MATMUL, CUDA_QMM, CUDA_QUANTIZED, CUDA_SDPA, CUDA_SDPA_VECTOR, Chip, Choice, Version
from .commits import has

CUBLAS_NOTE = "cuBLASLt: algorithm (tile, split-K, tensor-core order) chosen by its heuristic, not knowable from source"


def matmul(chip: Chip, M: int, K: int, N: int, dtype: str, version: Version, *, tf32: bool = True,
           b_transposed: bool = True) -> Choice:
    """``x @ W.T`` without bias (gemm_and_bias in cuda/matmul.cpp); ``b_transposed=False``: ``x @ W``, W (K, N)
    row-major, which at M == 1 is not a gemv (can_use_gemv needs b transposed there) but cuBLASLt.

    cu::can_use_gemv (cuda/gemms/gemv.cu): ``M == 1 && b_transposed``; before
    v0.31.2 also ``K % 32 == 0`` (v0.28.0 on) or ``K % 128 == 0`` (v0.27.1, lanes
    always 4 wide); no gemv before v0.27.1. Lanes take 4 consecutive k when K % 128 == 0
    (aligned), else 2 (K % 64 == 0) or 1; a warp reduces with cg::reduce.
    Everything else goes to cuBLASLt (float32 as TF32 unless MLX_ENABLE_TF32=0).
    """
    if not has(version, "cuda_gemv"):
        k_ok = False
    elif not has(version, "cuda_gemv_sizes"):
        k_ok = K % 128 == 0
    else:
        k_ok = has(version, "cuda_gemv_any_k") or K % 32 == 0
    gemv_ok = M == 1 and b_transposed and k_ok
    if gemv_ok:
        n = 4 if K % 128 == 0 else (2 if K % 64 == 0 else 1)
        return Choice("cuda_gemv", {"n_per_thread": n, "warp": 32}, f"{CUDA_GEMV} gemv",
                      "assumes 16-byte aligned operands for the n_per_thread choice")
    note = CUBLAS_NOTE + ("; float32 computed as TF32 (CUBLAS_COMPUTE_32F_FAST_TF32)"
                          if dtype == "float32" and tf32 else "")
    return Choice("cublaslt", {"compute": "32F_FAST_TF32" if dtype == "float32" and tf32 else "32F"},
                  f"{CUDA_MATMUL} gemm_and_bias", note)


def quantized_matmul(chip: Chip, M: int, K: int, N: int, dtype: str, version: Version, *, bits: int,
                     group_size: int, mode: str = "affine", tf32: bool = True) -> Choice:
    """QuantizedMatmul::eval_gpu (cuda/quantized/quantized.cpp) with the supports_* tests of qmm/qmm.cu.

    No GPU implementation before v0.30.4 (``NO_GPU(QuantizedMatmul)``). From
    v0.30.4 an affine quantized matmul raised "QMM NYI" on CUDA (only fp modes
    with M <= 8 ran, through fp_qmv); v0.31.0: affine on compute capability 9.x
    goes to qmm_sm90 for every M. v0.31.1: qmm_sm90 where it
    applies (qmv for M == 1), otherwise qmv for every M (there is no sm80 or
    naive qmm yet). From v0.31.2: sm90 uses qmv only for M == 1 (N, K <= 16384)
    when qmm_sm90 applies; sm80+ and the naive qmm use qmv for M < 8; qmm_sm90
    takes 4 or 8 bits from v0.32.0 (any even width before). Contiguous
    weights, scales and biases are assumed.
    """
    q = {"bits": bits, "group_size": group_size, "mode": mode}
    if not has(version, "cuda_fp_qmv"):
        return Choice("unsupported", q, "mlx/backend/cuda/primitives.cpp NO_GPU(QuantizedMatmul)",
                      "mlx has no CUDA quantized matmul before v0.30.4")
    if not has(version, "cuda_qmv"):
        if has(version, "cuda_qmm_sm90") and mode == "affine" and chip.gen == 9:
            return Choice("cuda_qmm", {**q, "variant": "sm90"}, f"{CUDA_QUANTIZED} QuantizedMatmul::eval_gpu",
                          "CUTLASS tile order; v0.31.0 sends every affine M to qmm_sm90 (2, 4 or 8 bits)")
        if mode == "affine" or M > 8:
            return Choice("unsupported", q, f"{CUDA_QUANTIZED} QuantizedMatmul::eval_gpu",
                          'mlx raises "QMM NYI" for this case before v0.31.1 (v0.31.0: but affine on 9.x)')
        return Choice("cuda_fp_qmv", q, f"{CUDA_QUANTIZED} QuantizedMatmul::eval_gpu")
    affine = mode == "affine"
    sm90_bits = bits in (4, 8) if has(version, "cuda_qmm_sm90_bits") else bits % 2 == 0
    tma = not has(version, "cuda_qmm_sm90_bits") or (N * 4) % 16 == 0  # TMA alignment of the uint32 weights (n * itemsize % 16)
    can_sm90 = (chip.gen == 9 and tma and K % 64 == 0 and affine and sm90_bits
                and group_size >= K)  # supports_qmm_sm90 needs biases (affine) and one group over all of K
    can_sm80 = (chip.gen >= 8 and N % 128 == 0 and K % max(64, group_size) == 0 and dtype in ("float16", "bfloat16")
                and bits in (4, 8))
    can_naive = K % max(64, group_size) == 0
    can_fp_qmv = chip.gen > 9 and M <= 8 and not affine
    can_qmv = K % 8 == 0 or can_fp_qmv
    qmv = Choice("cuda_fp_qmv" if can_fp_qmv else "cuda_qmv",
                 {**q, "accumulator": "float" if bits >= 8 else dtype}, f"{CUDA_QMM} supports_qmv",
                 "" if can_fp_qmv else "per-slot accumulators in the input dtype for bits < 8 (qmv.cu)")
    if can_sm90:
        if can_qmv and M == 1 and N <= 16384 and K <= 16384:
            return qmv
        return Choice("cuda_qmm", {**q, "variant": "sm90"}, f"{CUDA_QMM} supports_qmm_sm90", "CUTLASS tile order")
    if not has(version, "cuda_qmm_sm80_naive"):  # v0.31.1: no sm80 or naive qmm, qmv for every M
        return qmv if can_qmv else Choice("unsupported", q, f"{CUDA_QUANTIZED} QuantizedMatmul::eval_gpu",
                                          "mlx raises: no implementation")
    for ok, variant in ((can_sm80, "sm80"), (can_naive, "naive")):
        if ok:
            if can_qmv and M < 8:
                return qmv
            return Choice("cuda_qmm", {**q, "variant": variant}, f"{CUDA_QMM} supports_qmm_{variant}")
    if can_qmv:
        return qmv
    return Choice("unsupported", q, f"{CUDA_QUANTIZED} QuantizedMatmul::eval_gpu", "mlx raises: no implementation")


def sdpa(chip: Chip, q_len: int, k_len: int, head_dim: int, n_heads: int, n_kv_heads: int, dtype: str,
         version: Version, *, v_head_dim: int | None = None, causal: bool = True, tf32: bool = True) -> Choice:
    """ScaledDotProductAttention::use_fallback / eval_gpu (cuda/scaled_dot_product_attention.cpp, .cu), read from
    v0.26.5 to 846d176.

    No fused kernel before v0.28.0 (use_fallback returns true). sdpa_vector (v0.28.0 on) for head dims 64/96/128,
    q == v, q_len < 4. cuDNN (v0.30.0 on) from sm80 for fp16/bf16 with head dims <= 128 and % 8 == 0: at v0.30.0
    only q_len == k_len; from v0.30.1 anything but a single query against more keys; from v0.30.5 not causal with
    q_len > k_len. Up to v0.30.6 the vector kernel is tried first; from v0.31.0 cuDNN first, and a single query
    takes cuDNN from a fixed-size cache (assumed when k_len >= 256, as mlx-lm's KVCache grows in steps of 256).
    """
    dv = head_dim if v_head_dim is None else v_head_dim
    p = {"head_dim": head_dim, "v_head_dim": dv, "gqa": max(1, n_heads // max(1, n_kv_heads)), "k_len": k_len}
    unfused = Choice("sdpa_unfused", p, "mlx/fast.cpp scaled_dot_product_attention (fallback)",
                     "matmul, softmax(precise), matmul")
    vector = (Choice("cuda_sdpa_vector", p, f"{CUDA_SDPA_VECTOR} supports_sdpa_vector")
              if has(version, "cuda_sdpa_vector") and head_dim == dv and head_dim in (64, 96, 128) and q_len < 4
              else None)
    dims_ok = head_dim % 8 == 0 and head_dim <= 128 and dv % 8 == 0 and dv <= 128
    cudnn_ok = has(version, "cuda_sdpa_cudnn") and chip.gen >= 8 and dims_ok and dtype in ("float16", "bfloat16")
    if not has(version, "cuda_sdpa_cudnn_cross"):
        cudnn_ok = cudnn_ok and q_len == k_len
    elif not has(version, "cuda_sdpa_decode"):
        cudnn_ok = cudnn_ok and not (q_len == 1 and k_len != 1)
    else:
        cudnn_ok = cudnn_ok and (q_len > 1 or k_len >= 256)
    if has(version, "cuda_sdpa_causal_align"):
        cudnn_ok = cudnn_ok and not (causal and q_len > k_len)
    cudnn = (Choice("cudnn_sdpa", p, f"{CUDA_SDPA} supports_sdpa_cudnn",
                    "cuDNN: order chosen by the library at run time, not knowable from source") if cudnn_ok else None)
    first = (cudnn, vector) if has(version, "cuda_sdpa_decode") else (vector, cudnn)
    return next((c for c in first if c is not None), unfused)
