"""Metal dispatch, read from the mlx source: matmul (``x @ W.T``, or ``x @ W``), quantized_matmul (transposed)
and sdpa.

Read at ml-explore/mlx v0.30.5, v0.31.2, v0.32.0, v0.32.1 and HEAD 846d176
(0.32.2 in mlx/version.h), and back to v0.26.5 through every commit that touched
these files (issue 54). Where a condition changed, it is a named rule of
:mod:`.commits` (``has(version, "gemv_wide")``): its first tag (``git describe
--contains``) and the commit and pull request that made it. Every function
returns a :class:`~gemmdrift.dispatch.base.Choice`.
"""

from __future__ import annotations

from dataclasses import replace

from .base import (METAL_MATMUL, METAL_QUANTIZED, METAL_SDPA, Chip, Choice, Version, cdiv, next_power_of_2,
                   pack_factor)
from .commits import has

_HALF = ("float16", "bfloat16")


def _nax(chip: Chip, dtype: str, tf32: bool) -> bool:
    # use_nax in steel_matmul_axpby (matmul.cpp): is_nax_available() && !complex && (enable_tf32() || !float32).
    return bool(chip.nax) and (tf32 or dtype != "float32")


# float32 on NAX: the NAX kernels build their matmul2d_descriptor with relaxed precision on (the sixth
# argument, ``true``, in steel/gemm/nax.h at v0.30.0 and every tag read since), which is why mlx lets float32 in
# only under MLX_ENABLE_TF32 (default 1). So float32 on NAX is computed from truncated operands, as CUDA's TF32.
NAX_F32_NOTE = ("float32 computed as TF32 on NAX (operands truncated: matmul2d relaxed precision, which "
                "MLX_ENABLE_TF32=1, mlx's default, allows)")


def _nax_note(dtype: str, what: str = "NAX: order inside matmul2d unknown") -> str:
    return what + ("; " + NAX_F32_NOTE if dtype == "float32" else "")


def _no_nax_before(chip: Chip, version: Version) -> Chip:
    # No NAX kernel before v0.30.0 (#2772): every chip dispatches as one without NAX.
    return chip if has(version, "nax") or not chip.nax else replace(chip, nax=False)


def gemm_tparams(chip: Chip, M: int, N: int, K: int, dtype: str, b_transposed: bool = True) -> dict[str, int]:
    """GEMM_TPARAM_MACRO(devc) (matmul.cpp L90-171 at 846d176; unchanged from v0.30.5) for a not transposed:
    the nt case (``x @ W.T``) or, with ``b_transposed=False``, the nn case (``x @ W``). Only bk decides the
    order (the fused kernel's tail tile, steel_ranges); nn takes bk 16 where nt takes 32 on 'g', 'p', 'd'."""
    size = chip.size
    default = {"bm": 64, "bn": 64, "bk": 16, "wm": 2, "wn": 2}  # steel_matmul_regular_axpby's initial values
    nt = {"bm": 64, "bn": 32, "bk": 32, "wm": 2, "wn": 2}
    if size in ("g", "p"):
        # nt: 64, 32, 32, 2, 2 for every real dtype (only complex64 differs); nn: 64, 64, 16, 1, 2 for half and
        # bfloat, the default for float.
        if b_transposed:
            return nt
        return {"bm": 64, "bn": 64, "bk": 16, "wm": 1, "wn": 2} if dtype != "float32" else default
    if size == "d":
        if M * N >= 1 << 20:  # batch_size_out * M * N, batch 1
            if dtype != "float32":
                if 2 * max(M, N) > K:
                    return {"bm": 64, "bn": 64, "bk": 16, "wm": 1, "wn": 2}
                return nt if b_transposed else {"bm": 32, "bn": 64, "bk": 16, "wm": 1, "wn": 2}
            return default  # float takes the default
        if dtype != "float32":
            return nt if b_transposed else {"bm": 64, "bn": 64, "bk": 16, "wm": 1, "wn": 2}
        return {"bm": 32, "bn": 64, "bk": 16, "wm": 1, "wn": 2} if b_transposed else nt
    return default  # medium device ('s' and anything else)


def _splitk(M: int, N: int, K: int, version: Version = (0, 32, 2)) -> dict[str, int]:
    # steel_gemm_splitk_axpby (matmul.cpp): tiles of 32 for the partition count, K in steps of bk = 16;
    # before v0.30.5 (#3087) 2, 4, 8 or 16 partitions by K / 16 alone.
    tm, tn, tk = cdiv(M, 32), cdiv(N, 32), K // 16
    if has(version, "splitk_tuning"):
        parts = min(max(2, next_power_of_2(tk // (tm * tn))), 32)
    else:
        parts = 2 if tk < 16 else 4 if tk < 32 else 8 if tk < 64 else 16
    return {"partitions": parts, "partition_size": ((K // 16) // parts) * 16, "bm": 16 if M < 40 else 32,
            "bn": 16 if N < 40 else 32, "bk": 16, "wm": 2, "wn": 2}


def _splitk_nax(M: int, N: int, K: int, version: Version) -> dict[str, int]:
    # steel_gemm_splitk_axpby_nax: fixed 128/128/512 tiles and a 3072 partition from v0.30.4 (#3018) to v0.31.1;
    # from v0.31.2 smaller tiles for small problems and a partition size that grows with K.
    if not has(version, "nax_splitk_tuning"):
        ps = 3072
        t = {"bm": 128, "bn": 128, "bk": 512, "wm": 4, "wn": 4}
    else:
        t = ({"bm": 64, "bn": 64, "bk": 256, "wm": 2, "wn": 2} if (M + N) // 2 < 512 or K <= 4096
             else {"bm": 128, "bn": 128, "bk": 512, "wm": 4, "wn": 4})
        ps = K // 2 if K <= 1024 else 1024 if K <= 2048 else 2048 if K <= 4096 else 4096
    return {"partitions": cdiv(K, ps), "partition_size": ps, **t}


def _gemm_nax(chip: Chip, M: int, N: int, K: int, version: Version) -> dict[str, int]:
    # steel_matmul_regular_axpby_nax: 128/128/512/4/4; from v0.31.1 's', 'c', 'd' take bm 64, wm 2 and bk 64
    # (K >= 8192 and K > M + N) or 256.
    t = {"bm": 128, "bn": 128, "bk": 512, "wm": 4, "wn": 4}
    if has(version, "nax_gemm_tiles") and chip.size in ("s", "c", "d"):
        t.update(bm=64, wm=2, bk=64 if K >= 8192 and K > M + N else 256)
    return t


def gemv_t_params(N: int, K: int) -> dict[str, int]:
    """gemv_axbpy for ``x @ W`` with one row and W (K, N) not transposed (``transpose_mat``: the ``gemv_t_``
    kernel, GEMVTKernel), matmul.cpp L1141-1163 at 846d176, byte-identical at v0.30.5, v0.31.2, v0.32.0,
    b7c3dd6d and v0.32.1. sm and tm decide the order (blockM = sm * tm rows per step); bn, sn, tn pick columns."""
    sm, sn = (4, 8) if K >= 8192 and N >= 2048 else (8, 4)
    bn = 16 if N >= 2048 else 4 if N >= 512 else 2
    return {"bm": 1, "bn": bn, "sm": sm, "sn": sn, "tm": 4, "tn": 1 if N < 4 else 4}


def gemv_params(M: int, N: int, K: int, version: Version = (0, 32, 2)) -> dict[str, int]:
    """gemv_axbpy's tiles for the ``gemv_`` kernel (mat not transposed: ``x @ W.T``, or ``x @ W`` with N == 1),
    matmul.cpp L1164-1179 at 846d176, byte-identical at v0.30.5, v0.31.2, v0.32.0, b7c3dd6d and v0.32.1.

    The tiles are keyed by ``out_vector_len``, which is N, except when N == 1 (``is_b_matrix = N != 1``,
    L1116-1122): then mat is x itself and the kernel runs the other way round, over M output rows. sn, bn and
    tn decide the K order (bn = 8 when K >= 16 out_vector_len); bm, sm and tm pick rows. Before v0.29.2
    (#2620) neither the K <= 64 nor the K >= 16 out_vector_len tiles: bm 8 or 4, sn 32 for every K."""
    out = N if N != 1 else M
    bm, bn, sm, sn, tm, tn = (8 if out >= 4096 else 4), 1, 1, 32, 4, 4
    if not has(version, "gemv_small_k"):
        pass
    elif K <= 64:
        bm, sm, sn = 1, 8, 4
    elif K >= 16 * out:
        bm, bn = 1, 8  # 8 simdgroups split K, combined in order through threadgroup memory
    if out < tm:
        tm = 1
    return {"bm": bm, "bn": bn, "sm": sm, "sn": sn, "tm": tm, "tn": tn}


def matmul(chip: Chip, M: int, K: int, N: int, dtype: str, version: Version, *, tf32: bool = True,
           b_transposed: bool = True) -> Choice:
    """``x (M, K) @ W.T`` (nn.Linear without bias: a not transposed, b transposed), batch 1; with
    ``b_transposed=False``, ``x @ W`` with W (K, N) row-major (check_transpose: strides (N, 1) read as not
    transposed).

    Matmul::eval_gpu (matmul.cpp): dot_product for M == N == 1 (from v0.32.1),
    gemv_wide (from v0.32.1; b transposed only, L1520), gemv for min(M, N) == 1 (``gemv_t`` for x @ W with
    N > 1: gemv_axbpy's mat = b, transpose_mat = !transpose_b, L1116-1120), else steel_matmul_axpby:
    SIMD split-K ("Case 1"), NAX split-K ("Case 2"), or the fused kernel (NAX or not); the steel kernels take
    the transposition as strides only (mma.h L469-474), so their K order is the nt one but for the fused
    kernel's bk (:func:`gemm_tparams`).
    ``tf32``: MLX_ENABLE_TF32 (mlx's default 1), which lets float32 use NAX.
    """
    chip = _no_nax_before(chip, version)
    if M == 1 and N == 1 and has(version, "dot_product"):
        return Choice("dot_product", {"items_per_thread": 32, "threadgroup": 512}, f"{METAL_MATMUL} dot_product")
    # gemv_wide_config (#3888, first tag v0.32.1): gen >= 15, M >= 2, N >= 2, K % 4 == 0, fp16/bf16,
    # vec4-aligned offsets (contiguous rows assumed), passes = (M + 4) / 5 <= 3.
    passes = (M + 4) // 5
    if (b_transposed and has(version, "gemv_wide") and chip.gen >= 15 and M > 1 and N > 1 and K % 4 == 0
            and dtype in _HALF and passes <= 3):
        lanes = 32 if passes == 1 or N <= 64 else 16
        return Choice("gemv_wide", {"k_lanes": lanes, "passes": passes, "vecs_per_tg": cdiv(M, passes),
                                    "grid_x": 1 if N >= 65536 else passes},
                      f"{METAL_MATMUL} gemv_wide_config", "assumes contiguous, 8-element aligned rows")
    if min(M, N) == 1:
        if not b_transposed and N > 1:
            return Choice("gemv_t", gemv_t_params(N, K), f"{METAL_MATMUL} gemv_axbpy (transpose_mat)")
        return Choice("gemv", gemv_params(M, N, K, version), f"{METAL_MATMUL} gemv_axbpy")
    tm, tn, tk = cdiv(M, 16), cdiv(N, 16), K // 16
    use_nax = _nax(chip, dtype, tf32)
    nax_note = _nax_note(dtype) if use_nax else ""
    min_tmn = 2048 if chip.size in ("s", "d") else 1024
    # Case 1, SIMD split-K; `!use_nax &&` joined the condition in v0.31.2 (#3422). Before v0.30.5 (#3087):
    # floor(M/16) floor(N/16) <= 32 and K / 16 >= 8, whatever K against M and N.
    if has(version, "splitk_tuning"):
        case1 = tm * tn <= min_tmn and tk >= 8 and K >= max(M, N)
    else:
        case1 = (M // 16) * (N // 16) <= 32 and tk >= 8
    if (not use_nax or not has(version, "nax_splitk_tuning")) and case1:
        return Choice("steel_gemm_splitk", _splitk(M, N, K, version), f"{METAL_MATMUL} steel_matmul_axpby (Case 1)")
    if use_nax:
        if not has(version, "nax_splitk"):  # no NAX split-K before v0.30.4 (#3018)
            split = False
        elif has(version, "nax_splitk_tuning"):
            split = K >= 3 * max(M, N) or (max(M, N) <= 1024 and K > 2 * max(M, N))
        else:  # v0.30.4 .. v0.31.1 (#3018): M*N >= 2048^2, K >= 10240 and K >= 3 max(M, N)
            split = M * N >= 2048 * 2048 and K >= 10240 and K >= 3 * max(M, N)
        if split:
            return Choice("steel_gemm_splitk_nax", _splitk_nax(M, N, K, version),
                          f"{METAL_MATMUL} steel_matmul_axpby (Case 2)", nax_note)
        return Choice("steel_gemm_nax", _gemm_nax(chip, M, N, K, version),
                      f"{METAL_MATMUL} steel_matmul_regular_axpby_nax", nax_note)
    return Choice("steel_gemm", gemm_tparams(chip, M, N, K, dtype, b_transposed),
                  f"{METAL_MATMUL} steel_matmul_regular_axpby")


def qmv_batch_limit(K: int, N: int, chip: Chip, version: Version) -> int:
    """get_qmv_batch_limit(D=K, O=N) in quantized.cpp (the same from v0.26.5); gen 15+ and gen 17+ rows added in
    v0.32.1 (#3791)."""
    small, mid = K <= 2048 and N <= 2048, K <= 4096 and N <= 4096

    def pick(a: int, b: int, c: int) -> int:
        return a if small else (b if mid else c)

    ultra = chip.size == "d"
    if has(version, "qmv_batch_limit_m5"):
        if chip.gen >= 17 and not ultra:
            return pick(33, 25, 13)
        if chip.gen >= 15 and not ultra:
            return pick(13, 15, 13)
        if chip.gen >= 13:
            return pick(32, 18, 12) if ultra else pick(14, 10, 6)
    elif chip.gen in (13, 14):  # v0.30.5 compared the architecture's digits as a string, same result
        return pick(32, 18, 12) if ultra else pick(14, 10, 6)
    return pick(32, 18, 12) if ultra else pick(18, 12, 10)


def qmv_fast_alignment(bits: int, version: Version) -> int:
    """K alignment of qmv_fast: 512 for every bit width up to v0.32.0; qmv_fast_k_alignment from v0.32.1."""
    if not has(version, "qmv_fast_alignment"):
        return 512
    return pack_factor(bits, 32) * (1 if bits == 2 else 2) * 32


def quantized_matmul(chip: Chip, M: int, K: int, N: int, dtype: str, version: Version, *, bits: int,
                     group_size: int, mode: str = "affine", tf32: bool = True) -> Choice:
    """``quantized_matmul(x, w, transpose=True)``, w non-batched (QuantizedMatmul::eval_gpu, quantized.cpp)."""
    q = {"bits": bits, "group_size": group_size, "mode": mode}
    if mode != "affine" and not has(version, "fp_mxfp4"):  # no mode parameter before v0.29.0 (#2499)
        return Choice("unsupported", q, f"{METAL_QUANTIZED} QuantizedMatmul::eval_gpu",
                      "mlx has no quantization modes but affine before v0.29.0")
    if mode in ("nvfp4", "mxfp8") and not has(version, "fp_nvfp4_mxfp8"):  # kernels from v0.30.3 (#2946)
        return Choice("unsupported", q, "mlx/backend/metal/kernels/fp_quantized.metal",
                      "no Metal kernel for this mode before v0.30.3 (mxfp4 only: group 32, 4 bits)")
    chip = _no_nax_before(chip, version)
    limit = qmv_batch_limit(K, N, chip, version)
    if M < limit:
        src = f"{METAL_QUANTIZED} dispatch_qmv"
        # qmv_quad for K in {64, 128} and power-of-2 bits.
        if K in (64, 128) and bits & (bits - 1) == 0:
            return Choice("qmv_quad", {**q, "batch_limit": limit, "split_k": 1}, src)
        # qmv_wide (#3764, first tag v0.32.0) for M >= 2; affine only on gen >= 15 (use_qmv_wide).
        if M >= 2 and has(version, "qmv_wide") and (mode != "affine" or chip.gen >= 15):
            tiles = (M + 4) // 5
            return Choice("qmv_wide", {**q, "batch_limit": limit, "split_k": 1, "vecs_per_tg": cdiv(M, tiles),
                                       "k_lanes": 8 if mode == "affine" else 16}, f"{METAL_QUANTIZED} qmv_wide")
        fast = N % 8 == 0 and K % qmv_fast_alignment(bits, version) == 0
        return Choice("qmv_fast" if fast else "qmv", {**q, "batch_limit": limit, "split_k": 1},
                      f"{METAL_QUANTIZED} qmv")
    nax = bool(chip.nax) and K % 64 == 0 and (tf32 or dtype != "float32")
    if has(version, "qmm_splitk"):
        # qmm_splitk (#3120, first tag v0.31.2): ~512 threadgroups of 32x32 tiles, whole K-chunks of
        # max(group_size, 32) from v0.32.1 (group_size before), K divisible by split_k * chunk.
        split = max(1, 512 // (cdiv(N, 32) * cdiv(M, 32)))
        k_align = max(group_size, 32) if has(version, "qmm_splitk_k_align") else group_size
        split = min(split, K // k_align)
        while split > 1 and K % (split * k_align) != 0:
            split -= 1
        if split > 1:
            return Choice("qmm_t_splitk", {**q, "batch_limit": limit, "split_k": split,
                                           "partition_size": K // split}, f"{METAL_QUANTIZED} qmm_splitk",
                          "partials in the input dtype, reduced by strided_reduce_general_dispatch")
    if nax:
        return Choice("qmm_t_nax", {**q, "batch_limit": limit, "split_k": 1}, f"{METAL_QUANTIZED} qmm (qmm_nax)",
                      _nax_note(dtype))
    return Choice("qmm_t", {**q, "batch_limit": limit, "split_k": 1, "bm": 32, "bn": 32, "bk": 32},
                  f"{METAL_QUANTIZED} qmm")


def sdpa_blocks(chip: Chip, n_simds: int, k_len: int, version: Version = (0, 32, 2)) -> int:
    """Key blocks of the 2-pass vector kernel (sdpa_vector_2pass; the same rule from v0.30.4 to 846d176; 32 for
    every chip before, #3023).

    ``n_simds`` is gqa * q_len, so a verify step (q_len > 1) can get other blocks, i.e. another tree, than T=1.
    """
    if not has(version, "sdpa_two_pass_tuning"):
        return 32
    if chip.size == "s":
        if k_len > 1024 and n_simds > 4:
            return 128 if k_len <= 8192 else 256 if k_len <= 32768 else 512 if k_len <= 65536 else 1024
        return 64
    if chip.size == "d":
        if n_simds <= 2 and k_len > 8192:
            return 256
        if n_simds >= 6 and k_len >= 16384:
            return 512 if k_len < 65536 else 1024
        return 128
    return 64 if n_simds >= 4 else 32


def sdpa(chip: Chip, q_len: int, k_len: int, head_dim: int, n_heads: int, n_kv_heads: int, dtype: str,
         version: Version, *, v_head_dim: int | None = None, causal: bool = True, tf32: bool = True) -> Choice:
    """mx.fast.scaled_dot_product_attention at inference (no mask array, no logsumexp), as read in
    ScaledDotProductAttention::use_fallback / has_fused_kernel / eval_gpu (scaled_dot_product_attention.cpp)."""
    dv = head_dim if v_head_dim is None else v_head_dim
    gqa = max(1, n_heads // max(1, n_kv_heads))
    p = {"head_dim": head_dim, "v_head_dim": dv, "gqa": gqa, "k_len": k_len}
    src = f"{METAL_SDPA} use_fallback"
    chip = _no_nax_before(chip, version)
    nax = bool(chip.nax) and (tf32 or dtype != "float32")
    unfused = Choice("sdpa_unfused", p, "mlx/fast.cpp scaled_dot_product_attention (fallback)",
                     "matmul, softmax(precise), matmul: each is dispatched as a matmul"
                     + (" (float32: those that take NAX are computed as TF32)" if nax and dtype == "float32" else ""))
    if q_len <= 8:
        # Vector head dims: {64, 96, 128, 256} with q == v; (192, 128) from v0.32.0; 192/192 is fused-capable
        # after v0.32.1 but use_fallback still sends it to the unfused path.
        ok = (head_dim == dv and head_dim in (64, 96, 128, 256)) or (
            has(version, "sdpa_vector_192_128") and head_dim == 192 and dv == 128)
        # q_len * gqa <= 32 from v0.30.4 (#3023).
        if not ok or q_len > k_len or (q_len * gqa > 32 and has(version, "sdpa_two_pass_tuning")):
            return unfused
        # eval_gpu: 2-pass on 'd' (and 's' from v0.30.4, #3023) from 1024 keys, or with GQA from 4096 keys.
        big = ("s", "d") if has(version, "sdpa_two_pass_tuning") else ("d",)
        if (chip.size in big and k_len >= 1024) or (n_kv_heads < n_heads and k_len >= 4096):
            blocks = sdpa_blocks(chip, gqa * q_len, k_len, version)
            # The GQA-8 pass-1 variant (after v0.32.1): one query, no mask array, head dim 64 or 128, 8192+ keys.
            gqa8 = has(version, "sdpa_gqa8") and q_len == 1 and gqa == 8 and head_dim == dv in (64, 128) and k_len >= 8192
            return Choice("sdpa_vector_2pass", {**p, "blocks": blocks, "pass1_gqa": gqa8},
                          f"{METAL_SDPA} sdpa_vector_2pass",
                          "blocks are the device default (MLX_SDPA_BLOCKS overrides them from v0.32.0)")
        return Choice("sdpa_vector", p, f"{METAL_SDPA} eval_gpu (sdpa_vector)")
    # q_len > 8. After v0.32.1 (846d176): head dim 256, causal, q_len >= 1024 on NAX takes the fused kernel.
    if has(version, "sdpa_nax_256") and nax and head_dim == 256 and q_len >= 1024 and causal:
        return Choice("sdpa_full_nax", {**p, "head_dim_split": True}, src,
                      _nax_note(dtype, "NAX head-dim split kernel: order unknown"))
    full_dims = ((64,) + ((72,) if has(version, "sdpa_full_72") else ()) + (80,)
                 + ((96,) if has(version, "sdpa_full_96") else ()) + (128,))
    if head_dim != dv or head_dim not in full_dims or (causal and q_len > k_len):
        return unfused
    # sdpa_full_self_attention_metal: NAX unless head dim 80 (and 72 from v0.32.1); at 846d176 only 64/96/128/256.
    nax_dims = (tuple(d for d in full_dims if d not in (72, 80))
                + ((256,) if has(version, "sdpa_nax_256") else ()))
    if nax and head_dim in nax_dims:
        return Choice("sdpa_full_nax", p, f"{METAL_SDPA} sdpa_full_self_attention_nax",
                      _nax_note(dtype, "NAX: order unknown"))
    return Choice("sdpa_full", p, f"{METAL_SDPA} sdpa_full_self_attention_metal")
