"""Replay with an (N,) bias, on every recipe that takes one (issue 31 item 6).

``replay_matmul(..., bias)`` with the (N,) bias its docstring asks for raised IndexError in the gemv recipe's
bias add (``replay_core._round_odd_sum`` indexed the 1-D bias with the 2-D index of the risky elements). The
known answers here are computed in the test, apart from the replay's epilogue: the bias rule of each kernel
(METAL-ORDERS §2, §3, §4; the CPU's simd_gemm and SGEMM stores) applied to the recipe's float32 accumulator,
with the roundings done from float64 by ``np.frexp``/``np.rint`` (not by ``replay_core.round_to``).
"""

from __future__ import annotations

import numpy as np
import pytest

from gemmdrift import replay as R
from gemmdrift.replay.paths import plan_for

K, N = 640, 2048  # Gemma 3 270M's hidden -> FFN shape, where the IndexError was seen (M1, T = 1)


def _rne(v64: np.ndarray, bits: int) -> np.ndarray:
    """float64 values rounded to ``bits`` significant bits, ties to even (normal range only)."""
    m, e = np.frexp(v64)  # v = m * 2**e, 0.5 <= |m| < 1
    return np.ldexp(np.rint(np.ldexp(m, bits)), e - bits)


def _bf16(v64):
    return _rne(np.asarray(v64, np.float64), 8).astype(np.float32)


def _operands(seed: int = 31, k: int = K, n: int = N):
    rng = np.random.default_rng(seed)
    x = _bf16(rng.standard_normal((16, k)))
    w = _bf16(rng.standard_normal((n, k)) * 0.05)
    bias = _bf16(4.0 * rng.standard_normal(n))  # bf16 of 4 * N(0, 1), as in the report
    return x, w, bias


# (chip, T, K, N): the dispatch picks each Metal recipe with a bias epilogue (split-K needs K >= N; the fused
# steel GEMM a large T).
CASES = [("M1", 1, K, N, "gemv"), ("M3", 2, K, N, "gemv_wide"), ("M3", 8, K, N, "gemv_wide"),
         ("M1", 2, N, K, "steel_gemm_splitk"), ("M3", 16, N, K, "steel_gemm_splitk"), ("M1", 16, K, N, "steel_gemm")]


def _acc(plan, x, w):
    """The recipe's float32 accumulator before its epilogue (numpy engine: the reference recipe)."""
    P = np.multiply(np.ascontiguousarray(x.T)[:, :, None], np.ascontiguousarray(w.T)[:, None, :],
                    dtype=np.float32)
    return plan.recipe.fn(P, dict(plan.params), dict(plan.variant), False)


@pytest.mark.parametrize("engine", ["numpy", "compiled"])
@pytest.mark.parametrize("chip, T, k, n, kernel", CASES)
def test_every_metal_recipe_with_a_bias_adds_it_by_its_rule(chip, T, k, n, kernel, engine):
    x, w, bias = _operands(k=k, n=n)
    plan = plan_for(chip, "matmul", T=T, K=k, N=n, dtype="bfloat16", mlx_version="0.32.4")
    assert plan.recipe.kernel == kernel
    xs = x[:T]
    got = R.replay_matmul(plan.recipe, xs, w, bias, dtype="bfloat16", params=plan.params, variant=plan.variant,
                          engine=engine).y
    acc = _acc(plan, xs, w).astype(np.float64)
    if plan.recipe.bias == "twice":  # gemv: bf16(bf16(acc) + bias), the add a native bf16 op (one rounding)
        want = _bf16(_bf16(acc).astype(np.float64) + bias)  # two bf16 values: their float64 sum is exact
    else:  # once: bf16(RN32(acc + bias))
        want = _bf16((acc.astype(np.float32) + bias).astype(np.float64))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    nobias = R.replay_matmul(plan.recipe, xs, w, None, dtype="bfloat16", params=plan.params,
                             variant=plan.variant, engine=engine).y
    assert np.mean(nobias != got) > 0.9  # the bias was added (not a test that passes on a dropped bias)


def test_gemv_bias_rounds_twice_where_steel_would_round_once():
    # The two rules differ on these operands (non-vacuous): gemv's double rounding is what the recipe does.
    x, w, bias = _operands()
    plan = plan_for("M1", "matmul", T=1, K=K, N=N, dtype="bfloat16", mlx_version="0.32.4")
    got = R.replay_matmul(plan.recipe, x[:1], w, bias, dtype="bfloat16", params=plan.params).y
    acc = _acc(plan, x[:1], w)
    once = _bf16((acc + bias).astype(np.float64))
    assert 0 < np.sum(got != once) < N // 4


@pytest.mark.parametrize("kernel, dtype", [("cpu_simd_gemm", "bfloat16"), ("cpu_cblas_sgemm", "float32")])
def test_cpu_recipes_with_a_bias_equal_mlx_addmm(kernel, dtype):
    import mlx.core as mx

    x, w, bias = _operands()
    xs = x[:3]
    got = R.replay_matmul(kernel, xs, w, bias, dtype=dtype).y
    dt = getattr(mx, dtype)
    real = mx.addmm(mx.array(bias).astype(dt), mx.array(xs).astype(dt), mx.array(w).astype(dt).T)
    assert np.array_equal(np.array(real.astype(mx.float32)).view(np.uint32), got.view(np.uint32))


def test_a_bias_of_the_wrong_length_is_one_line():
    from gemmdrift.errors import GemmdriftError

    x, w, bias = _operands()
    with pytest.raises(GemmdriftError, match="bias must have shape"):
        R.replay_matmul("gemv", x[:1], w, bias[:7], dtype="bfloat16", engine="numpy")
