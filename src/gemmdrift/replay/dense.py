"""The dense recipes, one function per kernel path, as read from the mlx source.

Each recipe maps the exact float32 products ``P[k, t, n] = x[t, k] * w[n, k]``
(exact for bf16/fp16 inputs; RN for float32) of one chunk of outputs to the
kernel's output, adding in the kernel's order with :mod:`.core`'s
elementwise float32 operations. Sources (ml-explore/mlx; Metal and CUDA at
commit 846d176 (v0.32.1 + 0.32.2 patch bump, the kernels unchanged in the
0.32.4 wheel's headers per METAL-ORDERS §9), CPU at tag v0.32.1, whose
``simd_gemm.h`` is byte-identical to the header the installed 0.32.4 wheel
ships):

* ``cpu_simd_gemm``: ``mlx/backend/cpu/gemms/simd_gemm.h`` ``simd_gemm`` with
  ``simd::max_size<float> == 1`` on x86 (``simd/base_simd.h`` L24): the 16-wide
  K blocks and the tail all add ``a*b`` into one float32 ``c_block`` entry, so
  the order is k = 0..K-1 from +0; the store is ``static_cast<T>(alpha * c)``
  or ``static_cast<T>(alpha * c + beta * bias)``: one rounding to bf16/fp16.
* ``cpu_cblas_sgemm``: ``mlx/backend/cpu/gemms/cblas.cpp`` calls
  ``cblas_sgemm(RowMajor, NoTrans, Trans)`` for ``x @ W.T``; the row-major
  CBLAS swaps operands, so the reference Fortran SGEMM runs its TRANSA='T',
  TRANSB='N' loop: ``TEMP = 0; DO L: TEMP = TEMP + A(L,I)*B(L,J)``, then
  ``C = ALPHA*TEMP (+ BETA*C)``: sequential from +0, bias added last. The
  wheel's libblas has no FMA instruction (objdump: no ``vfmadd``), so every
  product rounds before its add.
* ``metal_gemv``: ``kernels/gemv.h`` ``GEMVKernel::run`` L107-246.
* ``metal_gemv_t``: ``kernels/gemv.h`` ``GEMVTKernel::run`` L296-433 (the struct L253-434), ``x @ W`` with W
  (K, N) row-major at T=1; host ``matmul.cpp`` ``gemv_axbpy`` L1141-1163 (the ``transpose_mat`` branch).
  The struct is the same at v0.30.5 and v0.31.2 (``kernels/gemv.metal``; only a ``size_t`` index cast
  differs) and at v0.32.0, b7c3dd6d and v0.32.1 (``git show <rev>:... | diff``), and the host branch is
  byte-identical at every one of those revisions: one recipe serves every release the replay supports.
* ``metal_gemv_wide``: ``kernels/gemv.h`` ``GemvWide::run`` L785-897.
* ``metal_steel_gemm``: ``steel/gemm/kernels/steel_gemm_fused.h`` L19-346 with
  ``steel/gemm/mma.h`` L439-537 and ``gemm.h`` ``gemm_loop`` L79-137.
* ``metal_steel_gemm_splitk``: ``steel_gemm_splitk.h`` L9-227; host
  ``mlx/backend/metal/matmul.cpp`` ``steel_gemm_splitk_axpby`` L503-656.
* ``cuda_gemv``: ``mlx/backend/cuda/gemms/gemv.cu`` ``gemv_impl`` L55-85,
  ``n_per_t`` L242-249; ``cg::reduce`` is an xor butterfly read at lane 0.

The MMA8 default, H1 (the accumulator first, then the 8 products in index
order, each add rounded to float32), is the one order measured on a GPU:
mathiasbourgoin/Sarek ``tools/probes/metal_simdgroup_matrix_probe.m`` @01927bd7
found ``simdgroup_multiply_accumulate`` equal to it on 65536 of 65536 elements
(against C-last sequential 51850, pairwise 34914, exact 538; reproduced from the
probe's host generator in tests/test_replay_sarek.py). **Measured:** half x half
operands with a float accumulator and a nonzero C, 8x8x8, on an Apple M4
(macOS 15.6.1), the same bits for threadgroup sizes 32..256. **Not measured:**
float x float operands holding bf16 or fp16 values, which is how mlx's steel
GEMM loads its fragments (``steel/gemm/mma.h``: ``simdgroup_matrix<AccumType,
8, 8>``); other generations (M1-M3, M5); subnormals (FTZ); the M5's NAX units.
H2-H4 stay as variants until a chip's ``gemmdrift replay check`` rules them out.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ..errors import GemmdriftError
from .core import (add, add_rounded, aligned_sum, chain, exact_then_round, f32, lane_tree, pairwise,
                          round_to)

# Apple's 8x8 simdgroup MMA: how one step adds 8 products to the accumulator (METAL-ORDERS §0.6, §4; [unk]).
MMA8 = {
    "H1": "sequential acc+p0+...+p7, each add rounded (an FMA chain)",
    "H2": "acc + pairwise(p0..p7)",
    "H3": "exact 9-term sum, one rounding",
    "H4": "MMA-Sim fused sum: align to the largest exponent, truncate to 24 bits, add exactly, round toward zero",
}
DOT4 = {"sequential": "((p0+p1)+p2)+p3", "pairwise": "(p0+p1)+(p2+p3)"}


def mma8(acc: np.ndarray, chunk: np.ndarray, how: str, ftz: bool) -> np.ndarray:
    """One 8-wide MMA step: ``acc`` (..) plus the 8 products ``chunk`` (8, ..)."""
    terms = [chunk[i] for i in range(chunk.shape[0])]
    if how == "H1":
        return chain(terms, acc, ftz)
    if how == "H2":
        return add(acc, pairwise(terms, ftz), ftz)
    if how == "H3":
        return exact_then_round([acc] + terms)
    if how == "H4":
        return aligned_sum([acc] + terms)
    raise GemmdriftError(f"unknown MMA8 variant {how!r} (known: {', '.join(MMA8)})")


def _pad_k(P: np.ndarray, multiple: int) -> np.ndarray:
    """Zero-pad the K axis to a multiple (the kernels' zero-filled safe loads add +0, which can turn -0 into +0)."""
    k = P.shape[0]
    extra = (-k) % multiple
    if not extra:
        return P
    return np.concatenate([P, np.zeros((extra,) + P.shape[1:], dtype=np.float32)])


# ------------------------------------------------------------------------------ CPU


def cpu_sequential(P: np.ndarray, params: Mapping[str, Any], var: Mapping[str, str], ftz: bool) -> np.ndarray:
    """simd_gemm (bf16/fp16, float32 accumulator) and the reference SGEMM: k = 0..K-1 from +0."""
    acc = np.zeros(P.shape[1:], dtype=np.float32)
    for k in range(P.shape[0]):
        acc = np.add(acc, P[k], out=acc)
    return acc


# ------------------------------------------------------------------------------ Metal


def metal_gemv(P: np.ndarray, params: Mapping[str, Any], var: Mapping[str, str], ftz: bool) -> np.ndarray:
    """GEMVKernel: lane l of simdgroup s adds ``k = B*i + 4*sn*s + 4*l + j`` (j = 0..3 inner) from +0
    (gemv.h L139-199, zero-filled tail), a shuffle-down ladder sn/2..1 (L202-208), then simdgroup 0 adds the
    other simdgroups' results in order (L211-231; bn = 8 when K >= 16 N, 16 M when N == 1)."""
    sn = int(params.get("sn", 32))
    bn = int(params.get("bn", 1))
    tn = int(params.get("tn", 4))
    block = sn * tn * bn
    Q = _pad_k(P, block)
    Q = Q.reshape((Q.shape[0] // block, bn, sn, tn) + P.shape[1:])
    r = np.zeros((bn, sn) + P.shape[1:], dtype=np.float32)
    for i in range(Q.shape[0]):
        for j in range(tn):
            r = add(r, Q[i, :, :, j], ftz)
    per_sg = lane_tree(r, axis=1, ftz=ftz)  # (bn, ...)
    out = per_sg[0]
    for s in range(1, bn):
        out = add(out, per_sg[s], ftz)
    return out


def metal_gemv_t(P: np.ndarray, params: Mapping[str, Any], var: Mapping[str, str], ftz: bool) -> np.ndarray:
    """GEMVTKernel (``x @ W``, W (K, N) row-major; P[k] = x[k] * W[k, n]): thread ``c = SM*sgM + thrM`` of
    the BM*SM threads down K adds rows ``k = blockM*i + TM*c + tm`` (blockM = BM*SM*TM), i outer and tm
    inner, from +0 (gemv.h L347-369); the last partial block adds only the rows that exist, no zero fill
    (``tm < TM && bm + tm < in_vec_size``, L371-385); then per simdgroup ``r += simd_shuffle_down(r, SN*sm)``
    for sm = SM/2..1 (L389-395: a ladder over the SM threads of one column), and with BM > 1 simdgroup 0
    adds the others' results in order (L398-418; the host always sends BM = 1, matmul.cpp L1137).
    The order of one output does not depend on SN, BN or TN (which only pick the column a thread serves)."""
    bm, sm, tm = int(params.get("bm", 1)), int(params.get("sm", 8)), int(params.get("tm", 4))
    lanes = bm * sm
    block = lanes * tm
    K = P.shape[0]
    full = K - K % block
    r = np.zeros((lanes,) + P.shape[1:], dtype=np.float32)
    Q = P[:full].reshape((full // block, lanes, tm) + P.shape[1:])
    for i in range(Q.shape[0]):
        for j in range(tm):
            r = add(r, Q[i, :, j], ftz)
    for j in range(tm):  # the leftover rows: thread c adds k = full + tm*c + j where it exists
        ks = full + tm * np.arange(lanes) + j
        live = np.nonzero(ks < K)[0]
        if len(live):
            r[live] = add(r[live], P[ks[live]], ftz)
    per_sg = [lane_tree(r[s * sm:(s + 1) * sm], axis=0, ftz=ftz) for s in range(bm)]
    out = per_sg[0]
    for s in range(1, bm):
        out = add(out, per_sg[s], ftz)
    return out


def dot4(P4: np.ndarray, how: str, ftz: bool) -> np.ndarray:
    """``dot(float4, float4)`` of the 4 products on axis 1 (its order is not documented: a variant)."""
    if how == "sequential":
        return add(add(add(P4[:, 0], P4[:, 1], ftz), P4[:, 2], ftz), P4[:, 3], ftz)
    if how == "pairwise":
        return add(add(P4[:, 0], P4[:, 1], ftz), add(P4[:, 2], P4[:, 3], ftz), ftz)
    raise GemmdriftError(f"unknown dot4 variant {how!r} (known: {', '.join(DOT4)})")


def metal_gemv_wide(P: np.ndarray, params: Mapping[str, Any], var: Mapping[str, str], ftz: bool) -> np.ndarray:
    """GemvWide: lane l of kl adds, per block of 8*kl vec4s, ``a = sum_i d[base + i*kl + l]`` from +0 and then
    ``r += a`` (L844-861); the tail vec4s ``v = n_main + l + kl*t`` go straight into r (L862-868); then a
    shuffle-down ladder kl/2..1 (L872-878)."""
    kl = int(params["k_lanes"])
    K = P.shape[0]
    if K % 4:
        raise GemmdriftError(f"gemv_wide needs K % 4 == 0, got K={K}")
    n_v4 = K // 4
    D = dot4(P.reshape((n_v4, 4) + P.shape[1:]), var["dot4"], ftz)
    n_main = n_v4 - n_v4 % (kl * 8)
    r = np.zeros((kl,) + P.shape[1:], dtype=np.float32)
    M = D[:n_main].reshape((n_main // (8 * kl), 8, kl) + P.shape[1:])
    for b in range(M.shape[0]):
        a = np.zeros_like(r)
        for i in range(8):
            a = add(a, M[b, i], ftz)
        r = add(r, a, ftz)
    tail = D[n_main:]
    for lo in range(0, len(tail), kl):
        seg = tail[lo:lo + kl]
        r[: len(seg)] = add(r[: len(seg)], seg, ftz)  # lanes past the end add nothing
    return lane_tree(r, axis=0, ftz=ftz)


def _mma_chain(P: np.ndarray, ks: list[tuple[int, int]], how: str, ftz: bool) -> np.ndarray:
    """From +0, one MMA8 step per 8-chunk of each (lo, hi) range of K in the order given (zero-padded)."""
    acc = np.zeros(P.shape[1:], dtype=np.float32)
    for lo, hi in ks:
        seg = _pad_k(P[lo:hi], 8)
        for c in range(0, seg.shape[0], 8):
            acc = mma8(acc, seg[c:c + 8], how, ftz)
    return acc


def steel_ranges(lo: int, hi: int, bk: int, tail_first: bool) -> list[tuple[int, int]]:
    """The K ranges of a steel loop over [lo, hi): full BK tiles in order; the partial tile (zero-padded to BK)
    first in the fused kernel (steel_gemm_fused.h L133-163), last in split-K (steel_gemm_splitk.h L140-155)."""
    full = lo + (hi - lo) // bk * bk
    tiles = [(k, k + bk) for k in range(lo, full, bk)]
    if full == hi:
        return tiles
    return [(full, hi)] + tiles if tail_first else tiles + [(full, hi)]


def metal_steel_gemm(P: np.ndarray, params: Mapping[str, Any], var: Mapping[str, str], ftz: bool) -> np.ndarray:
    """Fused steel GEMM: one chain of MMA8 steps over K (independent of BM/BN/WM/WN), tail tile first."""
    bk = int(params.get("bk", 32))
    return _mma_chain(P, steel_ranges(0, P.shape[0], bk, tail_first=True), var["mma"], ftz)


def splitk_partitions(M: int, N: int, K: int) -> tuple[int, int]:
    """(partitions, partition size) of the non-NAX split-K GEMM (matmul.cpp L523-537)."""
    tm, tn, tk = -(-M // 32), -(-N // 32), K // 16
    q = max(1, tk // (tm * tn))
    p2 = 1 << (q - 1).bit_length()  # next_power_of_2
    parts = min(max(2, p2), 32)
    return parts, ((K // 16) // parts) * 16


def metal_steel_gemm_splitk(P: np.ndarray, params: Mapping[str, Any], var: Mapping[str, str],
                            ftz: bool) -> np.ndarray:
    """Split-K: partition p chains [p*ps, (p+1)*ps) from +0; the last one runs on to K (tail last); the
    float32 partials are added in order from +0 by the accumulate kernel (steel_gemm_splitk.h L172-193)."""
    K = P.shape[0]
    parts, ps = int(params["partitions"]), int(params["partition_size"])
    bk = int(params.get("bk", 16))
    if parts < 1 or ps < 1 or parts * ps > K:
        raise GemmdriftError(f"split-K: {parts} partitions of {ps} do not fit K={K}")
    return splitk_sum([_mma_chain(P, steel_ranges(p * ps, K if p == parts - 1 else (p + 1) * ps, bk,
                                                  tail_first=False), var["mma"], ftz) for p in range(parts)], ftz)


def splitk_sum(partials, ftz: bool) -> np.ndarray:
    """The accumulate kernel: the float32 partials added in order from +0."""
    out = np.zeros(partials[0].shape, dtype=np.float32)
    for a in partials:
        out = add(out, a, ftz)
    return out


# ------------------------------------------------------------------------------ CUDA


def cuda_n_per_thread(K: int) -> int:
    """gemv.cu L242-249 (aligned operands assumed: contiguous rows)."""
    return 4 if K % 128 == 0 else 2 if K % 64 == 0 else 1


def cuda_gemv(P: np.ndarray, params: Mapping[str, Any], var: Mapping[str, str], ftz: bool) -> np.ndarray:
    """Lane l adds ``col = n*l + 32n*i + j`` (j inner) from +0, lanes past K add nothing; then the warp's
    xor butterfly, read at lane 0 (the lane that writes)."""
    K = P.shape[0]
    n = int(params.get("n_per_thread", cuda_n_per_thread(K)))
    if K % n:
        raise GemmdriftError(f"cuda gemv with {n} values per thread needs K % {n} == 0, got K={K}")
    r = np.zeros((32,) + P.shape[1:], dtype=np.float32)
    for lo in range(0, K, 32 * n):
        blk = P[lo:lo + 32 * n]
        lanes = blk.shape[0] // n
        blk = blk.reshape((lanes, n) + P.shape[1:])
        for j in range(n):
            r[:lanes] = add(r[:lanes], blk[:, j], ftz)
    return lane_tree(r, axis=0, ftz=ftz)


# ------------------------------------------------------------------------------ epilogues


def epilogue(acc: np.ndarray, bias: np.ndarray | None, rule: str, dtype: str) -> np.ndarray:
    """The output rounding and bias rule of a kernel.

    ``once``: ``dtype(acc + bias)``, one rounding (steel, gemv_wide, the CPU's
    simd_gemm store, split-K's axpby); ``last-f32``: float32 ``acc + bias``
    (SGEMM's ``ALPHA*TEMP + BETA*C``); ``twice``: ``dtype(dtype(acc) + bias)``
    with the add a native bf16/fp16 op (Metal gemv's ``T(alpha)*T(result) +
    T(beta)*bias``, gemv.h L237-240).
    """
    if bias is None:
        return round_to(acc, dtype)
    b = f32(bias)
    if rule in ("once", "last-f32"):
        return round_to(add(acc, b), dtype)
    if rule == "twice":
        return add_rounded(round_to(acc, dtype), b, dtype)
    raise GemmdriftError(f"no bias rule {rule!r}")


__all__ = ["MMA8", "DOT4", "mma8", "cpu_sequential", "metal_gemv", "metal_gemv_t", "dot4", "metal_gemv_wide", "steel_ranges",
           "metal_steel_gemm", "splitk_partitions", "metal_steel_gemm_splitk", "splitk_sum", "cuda_n_per_thread",
           "cuda_gemv", "epilogue"]
