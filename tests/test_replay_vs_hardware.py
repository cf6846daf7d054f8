"""The deterministic rows of the reconciliation with published hardware measurements (issue 31 item 1,
docs/replay-vs-hardware.md): where mlx's dispatch switches kernels on the chips lablup/mlxcel measured, at
the mlx they ran (ml-explore/mlx b7c3dd6d = v0.32.0 + 5 commits, before #3791), and what that means for the
block-vs-chain statistic (``metrics.differing_bytes``) when both arms run one row-invariant kernel."""

from __future__ import annotations

import numpy as np
import pytest

from gemmdrift.dispatch import chip_named, choose, qmv_batch_limit, parse_version
from gemmdrift.errors import GemmdriftError
from gemmdrift.replay.paths import plan_for, run_plan
from gemmdrift.metrics import differing_bytes

MLXCEL_MLX = "0.32.0"  # b7c3dd6d: v0.32.0-5 by git describe (its version.h says 0.32.1-dev)


def _kernel(chip: str, T: int, K: int, N: int, version: str = MLXCEL_MLX) -> str:
    return choose(chip_named(chip), "quantized_matmul", T=T, K=K, N=N, dtype="float16", mlx_version=version,
                  bits=4, group_size=64).kernel


def test_m1_ultra_is_qmv_to_t11_and_leaves_it_at_12_the_batch_limit():
    # mlxcel #1182: "bit-equal from T=1 up to T=11 and breaks at T=12, get_qmv_batch_limit exactly".
    c = chip_named("M1 Ultra")
    assert c.arch == "applegpu_g13d"
    assert qmv_batch_limit(5120, 17408, c, parse_version(MLXCEL_MLX)) == 12
    assert {_kernel("M1 Ultra", t, 5120, 17408) for t in range(1, 12)} == {"qmv_fast"}
    assert _kernel("M1 Ultra", 12, 5120, 17408).startswith("qmm")


def test_m5_max_takes_qmv_wide_from_t2_and_its_batch_limit_is_10_at_the_mlx_mlxcel_ran():
    # mlxcel #1186: the differing bytes step at T=2 (qmv_wide) and at T=10 (the batch limit) on 5376 -> 5376.
    c = chip_named("M5 Max")
    assert c.arch == "applegpu_g17s"
    for K, N in ((5120, 17408), (5376, 5376), (5120, 5120)):
        assert qmv_batch_limit(K, N, c, parse_version(MLXCEL_MLX)) == 10
        assert _kernel("M5 Max", 1, K, N).startswith("qmv") and _kernel("M5 Max", 1, K, N) != "qmv_wide"
        assert {_kernel("M5 Max", t, K, N) for t in range(2, 10)} == {"qmv_wide"}
        assert _kernel("M5 Max", 10, K, N).startswith("qmm")
    # From v0.32.1 (#3791) the large-shape limit moved: the boundary is a property of the release.
    assert qmv_batch_limit(5120, 17408, c, parse_version("0.32.1")) > 10


def _draws(seed, K, N, T):
    import mlx.core as mx

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, K)).astype(np.float16).astype(np.float32)
    wq, sc, bi = mx.quantize(mx.array(rng.standard_normal((N, K)).astype(np.float16)), group_size=64, bits=4)
    return x, (np.array(wq), np.array(sc.astype(mx.float32)), np.array(bi.astype(mx.float32)), 4, 64)


def _block_vs_chain(chip, T, K, N, version):
    x, quant = _draws(7, K, N, T)
    kw = dict(K=K, N=N, dtype="float16", mlx_version=version, bits=4, group_size=64)
    one, blk = plan_for(chip, "quantized_matmul", T=1, **kw), plan_for(chip, "quantized_matmul", T=T, **kw)
    block = run_plan(blk, x, dtype="float16", quant=quant).y.astype(np.float16)
    chain = np.concatenate([run_plan(one, x[t:t + 1], dtype="float16", quant=quant).y for t in range(T)])
    return differing_bytes(block, chain.astype(np.float16), axis=0), one.recipe.kernel, blk.recipe.kernel


@pytest.mark.parametrize("version", ["0.32.0", "0.32.4"])
def test_the_m1_ultra_row_is_zero_bytes_and_the_m5_max_row_is_not(version):
    # M1 Ultra, T=3: qmv_fast in both arms, one row's arithmetic independent of T: 0 bytes, as measured.
    d, k1, k3 = _block_vs_chain("M1 Ultra", 3, 1024, 256, version)
    assert (k1, k3) == ("qmv_fast", "qmv_fast") and d.tolist() == [0, 0, 0]
    # M5 Max, T=3: qmv_fast against qmv_wide, another order: bytes differ (the measured row differs too); at
    # 0.32.4 (float sums) rarely, so more outputs.
    d, k1, k3 = _block_vs_chain("M5 Max", 3, 1024, 256 if version == "0.32.0" else 4096, version)
    assert (k1, k3) == ("qmv_fast", "qmv_wide") and d.sum() > 0


def _dense_block_vs_chain(chip, T, K, N, version="0.32.0"):
    """mlxcel's dense arm, ``x @ W`` with W (K, N) not transposed: one T-row call against T one-row calls."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((T, K)).astype(np.float16).astype(np.float32)
    wt = np.ascontiguousarray(rng.standard_normal((K, N)).astype(np.float16).astype(np.float32).T)
    kw = dict(K=K, N=N, dtype="float16", mlx_version=version, b_transposed=False)
    one, blk = plan_for(chip, "matmul", T=1, **kw), plan_for(chip, "matmul", T=T, **kw)
    block = run_plan(blk, x, dtype="float16", w=wt).y.astype(np.float16)
    chain = np.concatenate([run_plan(one, x[t:t + 1], dtype="float16", w=wt).y for t in range(T)])
    return differing_bytes(block, chain.astype(np.float16), axis=0), one.recipe.kernel, blk.recipe.kernel


def test_the_dense_m1_ultra_row_differs_gemv_t_against_split_k_and_the_m5_t3_arm_is_refused():
    # M1 Ultra, x @ W at T=3: gemv_t at T=1, split-K at T=3: other orders, so some bytes differ (mlxcel #1182:
    # "the dense matmul differs"), a small fraction of them (float16 hides most float32 order differences).
    d, k1, k3 = _dense_block_vs_chain("M1 Ultra", 3, 1024, 1024)
    assert (k1, k3) == ("gemv_t", "steel_gemm_splitk")
    assert 0 < d.sum() and d.max() < 2048 // 20
    # M5 Max at T=3 runs NAX steel for float16 x @ W: no recipe, said in one line, never guessed.
    with pytest.raises(GemmdriftError, match="steel_gemm_nax"):
        _dense_block_vs_chain("M5 Max", 3, 1024, 1024)


def test_the_fp_rows_replay_fp_qmv_against_fp_qmv_wide_and_the_m1_ultra_qmv_wide_too():
    # mlxcel #1186's fp rows on the M5 Max: T=1 fp_qmv(_fast), T=2..4 fp_qmv_wide (fp modes take qmv_wide on
    # every generation: use_qmv_wide, quantized.cpp L537-540), so a block can differ from its rows by a few bytes.
    import mlx.core as mx

    rng = np.random.default_rng(12)
    K = N = 1024
    x = rng.standard_normal((4, K)).astype(np.float16).astype(np.float32)
    for mode, bits, g, t1 in (("mxfp4", 4, 32, "fp_qmv_fast"), ("nvfp4", 4, 16, "fp_qmv_fast")):
        wq, sc = (np.array(a) for a in mx.quantize(mx.array(rng.standard_normal((N, K)).astype(np.float16)),
                                                    mode=mode)[:2])
        kw = dict(K=K, N=N, dtype="float16", mlx_version=MLXCEL_MLX, mode=mode)
        one = plan_for("M5 Max", "quantized_matmul", T=1, **kw)
        blk = plan_for("M5 Max", "quantized_matmul", T=4, **kw)
        assert (one.recipe.kernel, blk.recipe.kernel) == (t1, "fp_qmv_wide")
        block = run_plan(blk, x, dtype="float16", quant=(wq, sc, None, bits, g)).y.astype(np.float16)
        chain = np.concatenate([run_plan(one, x[t:t + 1], dtype="float16", quant=(wq, sc, None, bits, g)).y
                                for t in range(4)]).astype(np.float16)
        d = differing_bytes(block, chain, axis=0)
        assert d.max() < 2 * N // 100  # a few bytes at most: the products are exact, only some sums round
    # An M1 Ultra (gen 13) sends fp modes to qmv_wide from T=2 as well (affine stays on qmv there).
    kernels = [plan_for("M1 Ultra", "quantized_matmul", T=t, K=K, N=N, dtype="float16", mlx_version=MLXCEL_MLX,
                        mode="mxfp4").recipe.kernel for t in (1, 2, 11)]
    assert kernels == ["fp_qmv_fast", "fp_qmv_wide", "fp_qmv_wide"]


def _script():
    """scripts/replay_vs_hardware.py, the reconciliation's statistics (imported by path: scripts/ is no package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "replay_vs_hardware.py"
    spec = importlib.util.spec_from_file_location("replay_vs_hardware", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_mlxcel_draws_are_mlx_normal_as_random_cpp_computes_it():
    # mlx/random.cpp normal (b7c3dd6d): a float32 uniform on (nextafter(-1, 0), 1), erfinv in float32, cast to
    # half, then times half(sqrt 2) in half; here rebuilt from the uniform and erfinv alone.
    import mlx.core as mx

    r = _script()
    x, quant = r.mlx_operands(5, 256, 64, 3)
    kx, _ = mx.random.split(mx.random.key(5))
    u = mx.random.uniform(low=float(np.nextafter(np.float32(-1), np.float32(0))), high=1.0, shape=(3, 256),
                          dtype=mx.float32, key=kx, stream=mx.cpu)
    e = np.array(mx.erfinv(u, stream=mx.cpu)).astype(np.float16)
    want = (np.float16(1.4140625) * e).astype(np.float16)  # half * half: exact in float32, one rounding
    assert np.array_equal(x.astype(np.float16).view(np.uint16), want.view(np.uint16))
    assert quant[0].shape == (64, 256 * 4 // 32) and quant[1].shape == (64, 256 // 64)


def test_the_scaled_x_sum_model_is_the_two_releases_at_its_ends_and_fits_a_target_between():
    # lam 0: 0.32.4's float sums; lam 1: 0.32.0's half quads, byte for byte the recipes' own statistic
    # (run_plan, T single-row calls), through another path (the float32 accumulators, blended in float64).
    r = _script()
    K, N, T = 1024, 2048, 3
    x, quant = r.operands(1000, K, N, T)
    acc = r.accumulators("M5 Max", K, N, T, x, quant)
    for lam, version in ((0.0, "0.32.4"), (1.0, "0.32.0")):
        d, k1, kT = r.block_vs_chain("M5 Max", K, N, T, version, x, quant)
        assert (k1, kT) == ("qmv_fast", "qmv_wide")
        assert np.array_equal(r.scaled_xsum(acc, lam), d), version
    per = 2 * N
    lo, hi = np.mean(r.scaled_xsum(acc, 0.0)) / per, np.mean(r.scaled_xsum(acc, 1.0)) / per
    assert lo < 0.01 < hi
    lam = r.lam_for(acc, 0.01, per)
    assert 0 < lam < 1 and abs(np.mean(r.scaled_xsum(acc, lam)) / per - 0.01) < 0.002
