"""The mlx commits behind every modelled dispatch rule: each rule of :mod:`.metal` and :mod:`.cuda` that depends on
the release is keyed here by a name, the first tag that has it and the commit(s) that made it (issue 54).

Read from ml-explore/mlx's history (``git log vA..vB -- <the files of dispatch.tags.SOURCES>`` for every pair of
consecutive tags from v0.26.5 to HEAD 846d176, each diff read; ``git describe --contains`` gives the first tag).
A rule function asks :func:`has` (``has(version, "gemv_wide")``) instead of comparing versions, so a rule can be
reverted alone: :func:`at` gives a version with some rules switched off, and the prediction under
``at(new, {rule})`` is the prediction without that rule's change (tests/test_dispatch_commits.py proves, for
every rule, that it equals the older release's where the rule is the only change). Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from .base import Version

REPO = "https://github.com/ml-explore/mlx"


@dataclass(frozen=True)
class Commit:
    """One mlx commit: its hash (9 characters, as ``git log --format=%h``), subject and pull request."""

    hash: str
    subject: str
    pr: int

    @property
    def commit_url(self) -> str:
        return f"{REPO}/commit/{self.hash}"

    @property
    def pr_url(self) -> str:
        return f"{REPO}/pull/{self.pr}"

    def markdown(self) -> str:
        """``[hash](commit link) subject ([#pr](pull link))`` (no code span: the pages' HTML keeps links whole)."""
        return f"[{self.hash}]({self.commit_url}) {self.subject} ([#{self.pr}]({self.pr_url}))"

    def text(self) -> str:
        """``hash subject (#pr)``, for a terminal."""
        return f"{self.hash} {self.subject} (#{self.pr})"


@dataclass(frozen=True)
class Rule:
    """A dispatch rule that changed at ``first``: on ``backend`` for ``ops``, ``what`` it does, and its commits."""

    name: str
    first: Version
    backend: str
    ops: tuple[str, ...]
    what: str
    commits: tuple[Commit, ...]

    @property
    def first_tag(self) -> str:
        return ".".join(map(str, self.first))


def _r(name: str, first: Version, backend: str, ops: str, what: str, *commits: tuple[str, str, int]) -> Rule:
    return Rule(name, first, backend, tuple(ops.split()), what, tuple(Commit(*c) for c in commits))


M, Q, S = "matmul", "quantized_matmul", "sdpa"
_RULES = (
    # ---- Metal matmul (mlx/backend/metal/matmul.cpp)
    _r("gemv_small_k", (0, 29, 2), "metal", M, "gemv tiles: K <= 64 takes bm 1, sm 8, sn 4; K >= 16 N takes bm 1, "
       "bn 8 (8 simdgroups split K)", ("7c7e48dbd", "New tuning for small K gemv", 2620)),
    _r("nax", (0, 30, 0), "metal", f"{M} {Q} {S}", "the Neural Accelerator kernels (steel_gemm_nax, qmm_t_nax, "
       "sdpa_full_nax) on chips with NAX", ("54f1cc6e3", "Add Neural Accelerator Support", 2772)),
    _r("nax_splitk", (0, 30, 4), "metal", M, "NAX split-K (Case 2): M N >= 2048^2, K >= 10240 and K >= 3 max(M, N)",
       ("7ed2b6b93", "Add NAX Split-K GEMM for large-K matmuls to improve performance", 3018)),
    _r("splitk_tuning", (0, 30, 5), "metal", M, "SIMD split-K (Case 1): ceil(M/16) ceil(N/16) <= 1024 (2048 on Max "
       "and Ultra) and K >= max(M, N), partitions from K and the 32-tiles (before: floor(M/16) floor(N/16) <= 32, "
       "partitions 2/4/8/16 by K/16)", ("b56782be5", "[Metal] Tune splitk gemm dispatch conditions and partition "
                                        "sizes", 3087)),
    _r("nax_gemm_tiles", (0, 31, 1), "metal", M, "NAX GEMM tiles on Max/Ultra-class chips: bm 64, wm 2, bk 64 or 256",
       ("0879a6acb", "Add initial tuning for M5 pro and max", 3211)),
    _r("nax_splitk_tuning", (0, 31, 2), "metal", M, "NAX chips skip SIMD split-K; NAX split-K from K >= 3 max(M, N) "
       "(or K > 2 max(M, N) up to 1024), smaller tiles and a K-dependent partition",
       ("a6222f53d", "Speed up NAX split-K by better tuning and routing and fix NAX addmm", 3422)),
    _r("dot_product", (0, 32, 1), "metal", M, "M == N == 1 takes the dot_product kernel",
       ("36fde2757", "Implement batched matmul for large 1D dot products", 3580)),
    _r("gemv_wide", (0, 32, 1), "metal", M, "gemv_wide for fp16/bf16 with 2..15 rows on gen >= 15 (M3 and newer)",
       ("0ebcee8db", "metal: add gemv_wide for fp16/bf16 matmuls of a few rows", 3888)),
    # ---- Metal quantized matmul (mlx/backend/metal/quantized.cpp)
    _r("fp_mxfp4", (0, 29, 0), "metal", Q, "the mode parameter: mxfp4 kernels (group 32, 4 bits); affine only before",
       ("70560b6bd", "Add mode parameter for quantization", 2499)),
    _r("fp_nvfp4_mxfp8", (0, 30, 3), "metal", Q, "Metal kernels for nvfp4 (group 16) and mxfp8 (8 bits)",
       ("1eef1d155", "Metal/CPU nvfp4 and mxfp8", 2946)),
    _r("qmm_splitk", (0, 31, 2), "metal", Q, "qmm_t_splitk for small M (about 512 threadgroups)",
       ("38ad25708", "[Metal][Performance]: Add split-K for quantized matmul (small M)", 3120)),
    _r("qmv_wide", (0, 32, 0), "metal", Q, "qmv_wide for 2+ rows (affine on gen >= 15: M3 and newer)",
       ("548dd80e8", "Add small-batch quantized matvec kernel (qmv_wide)", 3764)),
    _r("qmv_batch_limit_m5", (0, 32, 1), "metal", Q, "qmv batch limits of gen 15+ and gen 17+",
       ("e7838d5e3", "Raise qmv batch limit for large matrices on M5-class GPUs", 3791)),
    _r("qmv_fast_alignment", (0, 32, 1), "metal", Q, "qmv_fast's K alignment from the bit width (512 before)",
       ("8056817bd", "Derive the qmv fast path K alignment from bits", 3965)),
    _r("qmm_splitk_k_align", (0, 32, 1), "metal", Q, "qmm split-K in whole chunks of max(group_size, 32)",
       ("6c0ea7fb0", "Fix incorrect nvfp4 quantized_matmul through the split-K path", 3854)),
    # ---- Metal sdpa (mlx/backend/metal/scaled_dot_product_attention.cpp)
    _r("sdpa_two_pass_tuning", (0, 30, 4), "metal", S, "2-pass sdpa_vector also on Max ('s') from 1024 keys, blocks "
       "by size class (32 before), and q_len * gqa <= 32 for the vector kernels",
       ("1935ab445", "Faster two pass sdpa", 3023)),
    _r("sdpa_vector_192_128", (0, 32, 0), "metal", S, "sdpa_vector for head dims (192, 128)",
       ("c9ccaba99", "Enable fused SDPA vector kernel for asymmetric Q/V head dims (192, 128)", 3637)),
    _r("sdpa_full_96", (0, 32, 1), "metal", S, "sdpa_full for head dim 96",
       ("ab946f90e", "Support head dimension 96 in Metal full attention", 3943)),
    _r("sdpa_full_72", (0, 32, 1), "metal", S, "sdpa_full for head dim 72 (not on NAX)",
       ("3a6219917", "Support head dimension 72 in Metal full attention", 4330)),
    _r("sdpa_nax_256", (0, 32, 2), "metal", S, "sdpa_full_nax for head dim 256 (head-dim split, causal, 1024+ "
       "queries)", ("714a7efcb", "Add a fused full-attention path for head_dim 256 on NAX devices", 3842)),
    _r("sdpa_gqa8", (0, 32, 2), "metal", S, "the GQA-8 pass-1 variant of sdpa_vector_2pass",
       ("fa0d4463e", "Read each K/V byte once in gqa-8 decode attention", 4077)),
    # ---- CUDA matmul (mlx/backend/cuda/matmul.cpp, gemms/gemv.cu)
    _r("cuda_gemv", (0, 27, 1), "cuda", M, "mlx's own gemv for one row (K % 128 == 0, 4 per thread); cuBLASLt before",
       ("d107d8d49", "add cuda gemv", 2400)),
    _r("cuda_gemv_sizes", (0, 28, 0), "cuda", M, "gemv for K % 32 == 0, 4, 2 or 1 per thread by K % 128 / 64",
       ("ab0e60886", "[CUDA] More sizes for gemv", 2429), ("d32519c8e", "fix gemv regression", 2445)),
    _r("cuda_gemv_any_k", (0, 31, 2), "cuda", M, "gemv for any K", ("d142de6a2", "[CUDA] gather_mm", 3414)),
    # ---- CUDA sdpa (mlx/backend/cuda/scaled_dot_product_attention.cpp, .cu)
    _r("cuda_sdpa_vector", (0, 28, 0), "cuda", S, "sdpa_vector for head dims 64/96/128 and q_len < 4 (always the "
       "unfused graph before)", ("a9bdd67ba", "Add CUDA sdpa vector", 2468)),
    _r("cuda_sdpa_cudnn", (0, 30, 0), "cuda", S, "cuDNN attention from sm80 (fp16/bf16, head dims <= 128, % 8), "
       "q_len == k_len", ("3b2ffcefc", "[CUDA] cuDNN forward attention", 2743)),
    _r("cuda_sdpa_cudnn_cross", (0, 30, 1), "cuda", S, "cuDNN also when q_len != k_len (not for a single query)",
       ("2b95d0c27", "[CUDA] Use cuDNN attention when T_q != T_kv", 2843)),
    _r("cuda_sdpa_causal_align", (0, 30, 5), "cuda", S, "no cuDNN for causal attention with q_len > k_len",
       ("0c6a895ed", "Use lower-right causal mask alignment consistently", 2967)),
    _r("cuda_sdpa_decode", (0, 31, 0), "cuda", S, "cuDNN before sdpa_vector, and for a single query from a "
       "fixed-size KV cache", ("54bb3eea4", "[CUDA] Use cuDNN SDPA for decoding when using fixed-size KV cache", 3113)),
    # ---- CUDA quantized matmul (mlx/backend/cuda/quantized/)
    _r("cuda_fp_qmv", (0, 30, 4), "cuda", Q, "QuantizedMatmul on CUDA: fp_qmv for fp modes, M <= 8 (no GPU "
       "implementation before)", ("4912cc47c", "Fp qmv", 2984)),
    _r("cuda_qmm_sm90", (0, 31, 0), "cuda", Q, "affine qmm_sm90 on compute capability 9.x",
       ("6304c285d", "[CUDA] FPxINT quantized matmul for Hopper", 3160)),
    _r("cuda_qmv", (0, 31, 1), "cuda", Q, "the affine qmv, and qmv for M == 1 where qmm_sm90 applies",
       ("3c565437a", "[CUDA] Quantized GEMV", 3180)),
    _r("cuda_qmm_sm80_naive", (0, 31, 2), "cuda", Q, "qmm_sm80 and the naive qmm (qmv below 8 rows)",
       ("1e855446b", "[CUDA] Pipelined QMM", 3255), ("1c9ee2f65", "[CUDA] Fallback QMM", 3315)),
    _r("cuda_qmm_sm90_bits", (0, 32, 0), "cuda", Q, "qmm_sm90 for 4 and 8 bits with TMA-aligned weights only",
       ("44540d121", "[CUDA] JIT-compile qmm_sm80/qmm_sm90/gather_gemm", 3706)),
)
RULES: dict[str, Rule] = {r.name: r for r in _RULES}


class At(tuple):
    """A version (a tuple, compared as one) with some rules reverted: see :func:`at`."""

    reverted: frozenset = frozenset()


def at(version: Version, reverted: Iterable[str] = ()) -> Version:
    """``version`` with the rules named in ``reverted`` switched off (each as before its first tag)."""
    names = frozenset(reverted)
    unknown = names - set(RULES)
    if unknown:
        raise KeyError(f"unknown dispatch rule(s): {', '.join(sorted(unknown))}")
    out = At(tuple(version))
    out.reverted = names | getattr(version, "reverted", frozenset())
    return out


def has(version: Version, rule: str) -> bool:
    """Does ``version`` have ``rule`` (from its first tag on, unless reverted)?"""
    r = RULES[rule]
    return tuple(version) >= r.first and rule not in getattr(version, "reverted", ())


def between(old: Version, new: Version, backend: str | None = None, op: str | None = None) -> list[Rule]:
    """The rules whose first tag lies in (old, new] (or (new, old] when new is older), on ``backend`` for ``op``,
    oldest first."""
    lo, hi = sorted((tuple(old), tuple(new)))
    return sorted((r for r in _RULES if lo < r.first <= hi and backend in (None, r.backend)
                   and (op is None or op in r.ops)), key=lambda r: r.first)


__all__ = ["Commit", "Rule", "RULES", "At", "at", "has", "between", "REPO"]
