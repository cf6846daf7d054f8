"""The compiled replay engine (numba) is the numpy recipes bit for bit.

Every compiled recipe x variant x T class (1, 2..8, 16, 33) on K values that leave tails, with and without
bias, in each dtype the recipe takes, on operands that make subnormal partial sums (so FTZ changes bits),
signed zeros, and integer operands whose bf16 sums land on rounding ties. The float32 accumulators are
compared (the bf16 outputs would hide most order differences), and the end-to-end outputs of
``replay_matmul``/``replay_quantized`` under both engines.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from gemmdrift.errors import GemmdriftError
from gemmdrift import replay as R
from gemmdrift.replay import dense as rd
from gemmdrift.replay import quant as rq
from gemmdrift.replay.core import round_to
from gemmdrift.replay.jit import dense_acc
from gemmdrift.replay.jitquant import quant_acc

TS = (1, 3, 8, 16, 33)  # T classes: the GEMV, the small batches 2..8, 16, and a block past 32


def _same(a, b) -> bool:
    a, b = np.ascontiguousarray(a, np.float32), np.ascontiguousarray(b, np.float32)
    return a.shape == b.shape and bool(np.array_equal(a.view(np.uint32), b.view(np.uint32)))


def _operands(kind: str, T: int, K: int, N: int, dtype: str, seed: int):
    """x (T, K), w (N, K) as float32 values of dtype. ``tiny``: rows scaled so products and partial sums are
    float32 subnormals; ``ties``: small integers (bf16 sums past 256 fall on rounding ties); both carry
    signed zeros."""
    rng = np.random.default_rng(seed)
    if kind == "ties":
        x = rng.integers(-6, 7, size=(T, K)).astype(np.float32)
        w = rng.integers(-6, 7, size=(N, K)).astype(np.float32)
    else:
        x = rng.standard_normal((T, K)).astype(np.float32)
        w = (rng.standard_normal((N, K)) * 0.05).astype(np.float32)
    if kind == "tiny":
        # Every other row's products (and partial sums) fall below 2**-126, a few columns' stay normal.
        x[::2] *= np.float32(2.0 ** -60)
        w *= np.float32(2.0 ** -66)
        w[:, ::9] *= np.float32(2.0 ** 20)
    x[:, ::7] = -0.0
    w[::5, ::11] = -0.0
    return round_to(x, dtype), round_to(w, dtype)


def _products(x, w):
    return np.multiply(x.T[:, :, None], w.T[:, None, :], dtype=np.float32)


DENSE = [  # (kernel, params, K values with tails)
    ("cpu_simd_gemm", {}, (203, 64)),
    ("gemv", {"sn": 32, "bn": 1, "tn": 4}, (203, 256)),
    ("gemv", {"sn": 8, "bn": 4, "tn": 4}, (203,)),
    ("gemv_t", {"bm": 1, "bn": 16, "sm": 8, "sn": 4, "tm": 4, "tn": 4}, (203, 256)),
    ("gemv_t", {"bm": 2, "bn": 2, "sm": 4, "sn": 8, "tm": 4, "tn": 4}, (203,)),
    ("cuda_gemv", {}, (203, 384)),
    ("gemv_wide", {"k_lanes": 8}, (296, 68)),
    ("gemv_wide", {"k_lanes": 32}, (1032,)),
    ("steel_gemm", {"bk": 32}, (203, 256)),
    ("steel_gemm", {"bk": 16}, (203,)),
    ("steel_gemm_splitk", {"partitions": 4, "partition_size": 48, "bk": 16}, (203, 192)),
    ("steel_gemm_splitk", {"partitions": 2, "partition_size": 96, "bk": 16}, (203,)),
]


@pytest.mark.parametrize("kernel,params,ks", DENSE, ids=[f"{d[0]}-{i}" for i, d in enumerate(DENSE)])
def test_dense_accumulators_are_the_numpy_recipes_bit_for_bit(kernel, params, ks):
    rec = R.RECIPES[kernel]
    variants = rec.variants()  # every MMA8 hypothesis H1..H4 included
    ftz_mattered = 0
    for K in ks:
        for T in TS:
            for kind in ("normal", "tiny", "ties"):
                x, w = _operands(kind, T, K, 37 + T, "bfloat16", seed=K * T)
                P = _products(x, w)
                for var in variants:
                    for ftz in ((False, True) if rec.apple else (False,)):
                        want = rec.fn(P, params, var, ftz)
                        got = dense_acc(rec.fn, x, w, params, var, ftz)
                        assert got is not None and _same(got, want), (K, T, kind, var, ftz)
                    if rec.apple and kind == "tiny":
                        ftz_mattered += not _same(rec.fn(P, params, var, True), rec.fn(P, params, var, False))
    assert ftz_mattered or not rec.apple  # the FTZ case is a real one: flushing changed bits


def test_h3_h4_are_compiled_dense_and_fall_back_to_numpy_for_qmm_t():
    x, w = _operands("normal", 2, 64, 9, "bfloat16", seed=1)
    for how in ("H3", "H4"):
        assert dense_acc(rd.metal_steel_gemm, x, w, {"bk": 32}, {"mma": how}, False) is not None
        a = R.replay_matmul("steel_gemm", x, w, dtype="bfloat16", variant=f"mma={how}", engine="compiled")
        b = R.replay_matmul("steel_gemm", x, w, dtype="bfloat16", variant=f"mma={how}", engine="numpy")
        assert _same(a.y, b.y) and a.variant == b.variant
    assert not _same(*(dense_acc(rd.metal_steel_gemm, x, w, {"bk": 32}, {"mma": h}, False) for h in ("H3", "H4")))
    with pytest.raises(GemmdriftError, match="unknown MMA8 variant"):
        dense_acc(rd.metal_steel_gemm, x, w, {"bk": 32}, {"mma": "H9"}, False)
    x, wq, sc, bi = _quant_operands("normal", 2, 128, 9, 4, "bfloat16", seed=1)
    prm = {"group_size": 64, "bits": 4, "split_k": 1}
    for how in ("H3", "H4"):
        assert quant_acc(rq.metal_qmm_t, x, wq, sc, bi, prm, {"mma": how, "dequant": "fma", "partials": "float32"},
                         "bfloat16", False) is None


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_dense_end_to_end_with_bias_under_both_engines(dtype):
    """Outputs (epilogue, bias rule, FTZ decision) of every dense recipe taking dtype, compiled vs numpy."""
    for kernel, params, ks in DENSE:
        rec = R.RECIPES[kernel]
        if dtype not in rec.dtypes:
            continue
        for T in (1, 8, 33):
            x, w = _operands("tiny", T, ks[0], 45, dtype, seed=T)
            bias = round_to(np.random.default_rng(T).standard_normal(45).astype(np.float32), dtype)
            for b in (None, bias) if rec.bias != "none" else (None,):
                for var in rec.variants()[:2]:
                    a = R.replay_matmul(rec, x, w, b, dtype=dtype, params=params, variant=var, engine="compiled")
                    n = R.replay_matmul(rec, x, w, b, dtype=dtype, params=params, variant=var, engine="numpy")
                    assert _same(a.y, n.y) and (a.ftz, a.variant) == (n.ftz, n.variant), (kernel, T, var)


def _quant_operands(kind: str, T: int, K: int, N: int, bits: int, dtype: str, seed: int):
    rng = np.random.default_rng(seed)
    codes_ = rng.integers(0, 1 << bits, size=(N, K)).astype(np.uint32)
    per = 32 // bits
    wq = np.zeros((N, K // per), dtype=np.uint32)
    for i in range(per):
        wq |= codes_[:, i::per] << np.uint32(bits * i)
    x, _ = _operands(kind, T, K, 1, dtype, seed)
    sc = round_to(rng.random((N, K // 64)).astype(np.float32) * 0.01, dtype)
    bi = round_to(-rng.random((N, K // 64)).astype(np.float32) * 0.05, dtype)
    if kind == "tiny":
        sc[::2] = round_to(sc[::2] * np.float32(2.0 ** -70), dtype) if dtype != "float16" else sc[::2]
        bi[::3] = -0.0
    return x, wq, sc, bi


def _quant_cases():
    out = []
    for bits in (4, 8):
        out.append(("cpu_qmm", {"bits": bits}, [{}], (320,)))
        for fast, ks in ((False, (320, 192)), (True, (1024,))):
            for float_sums in (True, False):
                var = [{"simd_sum": s, "contrib": c} for s in rq.SIMD_SUMS for c in rq.CONTRIB] \
                    if not fast else [{"simd_sum": "xor16", "contrib": c} for c in rq.CONTRIB]
                out.append(("qmv", {"bits": bits, "fast": fast, "float_sums": float_sums}, var, ks))
        out.append(("qmv_wide", {"bits": bits}, [{"contract": c} for c in rq.CONTRACT], (320, 576)))
        for split in (1, 2, 5):
            out.append(("qmm_t", {"bits": bits, "split_k": split},
                        [{"mma": m, "dequant": d, "partials": p} for m in ("H1", "H2")
                         for d in ("fma", "mul-add", "dtype") for p in ("dtype", "float32")], (320,)))
    return out


QUANT = _quant_cases()


@pytest.mark.parametrize("kernel,params,variants,ks", QUANT,
                         ids=[f"{c[0]}-{'-'.join(f'{k}{v}' for k, v in c[1].items())}" for c in QUANT])
def test_quantized_accumulators_are_the_numpy_recipes_bit_for_bit(kernel, params, variants, ks):
    rec = R.RECIPES[kernel]
    prm = {"group_size": 64, **params}
    dtypes = rec.dtypes if kernel == "cpu_qmm" else ("bfloat16", "float16")
    ftz_mattered = 0
    for K in ks:
        for dtype in dtypes:
            for T in TS:
                kinds = ("normal", "tiny", "ties") if T in (1, 8, 33) else ("tiny",)
                for kind in kinds:
                    x, wq, sc, bi = _quant_operands(kind, T, K, 21, params["bits"], dtype, seed=K + T)
                    q = rq.unpack(wq, params["bits"], K)
                    for var in variants:
                        wants = []
                        for ftz in ((False, True) if rec.apple else (False,)):
                            wants.append(rec.fn(x, q, sc, bi, prm, var, dtype, ftz))
                            got = quant_acc(rec.fn, x, wq, sc, bi, prm, var, dtype, ftz)
                            assert got is not None and _same(got, wants[-1]), (K, dtype, T, kind, var, ftz)
                        ftz_mattered += len(wants) == 2 and not _same(*wants)
    assert ftz_mattered or not rec.apple  # the FTZ case is a real one: flushing changed bits


def test_quantized_end_to_end_and_versions_under_both_engines():
    for kernel, version in (("qmv", "0.32.2"), ("qmv_fast", "0.32.4"), ("qmv_wide", None), ("qmm_t_splitk", "0.32.2"),
                            ("qmm_t", "0.32.0"), ("cpu_qmm", None)):
        for T in (1, 4, 33):
            x, wq, sc, bi = _quant_operands("tiny", T, 1024, 70, 4, "bfloat16", seed=T)
            kw = dict(bits=4, group_size=64, dtype="bfloat16", mlx_version=version,
                      params={"split_k": 4} if kernel == "qmm_t_splitk" else None)
            a = R.replay_quantized(kernel, x, wq, sc, bi, engine="compiled", **kw)
            b = R.replay_quantized(kernel, x, wq, sc, bi, engine="numpy", **kw)
            assert _same(a.y, b.y) and (a.ftz, a.variant) == (b.ftz, b.variant), (kernel, T)


def test_engine_switch(monkeypatch):
    assert R.replay_engine() == "compiled"
    monkeypatch.setenv("GEMMDRIFT_REPLAY_ENGINE", "numpy")
    assert R.replay_engine() == "numpy" and R.replay_engine("compiled") == "compiled"
    monkeypatch.setenv("GEMMDRIFT_REPLAY_ENGINE", "fortran")
    with pytest.raises(GemmdriftError, match="unknown replay engine 'fortran' \\(known: compiled, numpy\\)"):
        R.replay_engine()


def test_compiled_bad_shapes_are_the_numpy_recipes_errors():
    x, w = _operands("normal", 1, 203, 8, "bfloat16", seed=0)
    for engine in ("compiled", "numpy"):
        with pytest.raises(GemmdriftError, match="K % 4 == 0"):
            R.replay_matmul("gemv_wide", x, w, dtype="bfloat16", params={"k_lanes": 8}, engine=engine)
        with pytest.raises(GemmdriftError, match="do not fit K=203"):
            R.replay_matmul("steel_gemm_splitk", x, w, dtype="bfloat16", engine=engine,
                            params={"partitions": 4, "partition_size": 64})


def test_fma_is_correctly_rounded_where_the_addend_is_below_half_an_ulp():
    """a*b on a float32 midpoint plus an addend too small to move the float64 sum: the exact value decides
    (found by the compiled engine: the numpy emulation used to round such ties to even)."""
    import fractions

    from gemmdrift.replay import core as C
    from gemmdrift.replay.jitcore import fma32, njit

    @njit
    def hw(a, b, c, out):
        for i in range(a.size):
            out[i] = fma32(a[i], b[i], c[i])

    rng = np.random.default_rng(5)
    a = round_to(rng.standard_normal(3000).astype(np.float32), "bfloat16")
    b = (rng.integers(1 << 20, 1 << 21, 3000) * 2.0 ** -24).astype(np.float32)  # a*b: up to 29 bits
    c = (rng.choice([-1.0, 1.0], 3000) * 2.0 ** -80).astype(np.float32)
    a[0], b[0], c[0] = np.float32(-1.9157867), np.float32(-0.021362305), np.float32(-6.5757646e-23)
    got, compiled = C.fma(a, b, c), np.empty(3000, np.float32)
    hw(a, b, c, compiled)
    F = fractions.Fraction
    ties = 0
    for i in range(3000):
        ex = F(float(a[i])) * F(float(b[i])) + F(float(c[i]))
        f = np.float32(float(ex))
        cands = [np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf))]
        want = min(cands, key=lambda v: abs(F(float(v)) - ex))
        m = F(float(a[i])) * F(float(b[i]))
        near = np.float32(float(m))
        ties += abs(m - F(float(near))) * 2 == F(float(np.spacing(np.abs(near))))  # a*b on a float32 midpoint
        assert _same(got[i], want) and _same(compiled[i], want), i
    assert ties > 100  # many a*b are float32 midpoints: the case is exercised


def test_compiled_min_nonzero_decides_ftz_as_numpy_does():
    from gemmdrift.replay import core as C
    from gemmdrift.replay.jitcore import min_nonzero

    cases = [np.zeros((3, 4)), [[0.0, -0.0, np.nan, 3e-45, -1e-40]], [[np.inf, 0.0]], [[np.nan, -2.5, 7.0]],
             np.random.default_rng(0).standard_normal((64, 33)) * 1e-39]
    want = [np.inf, 2.802596928649634e-45, np.inf, 2.5, None]
    for a, w in zip(cases, want):
        a = np.asarray(a, dtype=np.float32)
        assert min_nonzero(a) == C.min_nonzero(a) and (w is None or min_nonzero(a) == w)


def test_numba_caches_under_gemmdrift_s_cache_unless_the_user_chose(tmp_path):
    """The kernels' cache lands in <GEMMDRIFT_CACHE>/numba (set before numba is imported), and a user's
    NUMBA_CACHE_DIR is kept."""
    import os
    import subprocess
    import sys

    code = ("from gemmdrift import replay as R; R.replay_engine(); import numba; "
            "print(numba.config.CACHE_DIR)")
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "GEMMDRIFT_REPLAY_ENGINE")}
    env["GEMMDRIFT_CACHE"] = str(tmp_path / "g")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    from gemmdrift.replay.jitcore import THREADS

    # one or two cores: the quantized loops compile without threads, kept apart (numba's key lacks the flag)
    assert out.stdout.strip() == str(tmp_path / "g" / ("numba" if THREADS else "numba-serial"))
    assert THREADS == ((os.cpu_count() or 1) > 2)
    env["NUMBA_CACHE_DIR"] = str(tmp_path / "mine")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(tmp_path / "mine")


def test_a_kernel_s_first_compile_holds_the_compile_lock(tmp_path, monkeypatch):
    """compile_once: a kernel's first call in a process compiles it holding NUMBA_CACHE_DIR/<module>.<name>.lock,
    so a second process reaching it on an empty cache waits and loads the first's (issue 33: test workers)."""
    import fcntl

    from numba import njit

    from gemmdrift.replay.jitcore import compile_once

    @compile_once
    @njit
    def twice(a):
        return a * 2

    monkeypatch.setenv("NUMBA_CACHE_DIR", str(tmp_path))
    lock = tmp_path / f"{__name__}.twice.lock"
    held, compile = [], twice.kernel.compile

    def probe(sig):  # another open of the lock file cannot take it while the compile runs
        with open(lock, "a") as other:
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held.append(False)
            except BlockingIOError:
                held.append(True)
        return compile(sig)

    monkeypatch.setattr(twice.kernel, "compile", probe)
    assert np.array_equal(twice(np.arange(3.0)), [0.0, 2.0, 4.0])
    assert held and all(held)  # every compile ran under the lock
    assert len(twice.kernel.signatures) == 1  # compiled once, for the types the call dispatches on
    assert np.array_equal(twice(np.arange(2.0)), [0.0, 2.0]) and len(held) == 1  # later calls: no compile


def test_two_processes_on_an_empty_cache_compile_a_kernel_once(tmp_path):
    """Two processes released together onto an empty numba cache: one compiles (a cache miss), the other
    loads its result (a hit). Without the lock both compiled."""
    import os
    import subprocess
    import sys

    code = ("import sys, time, pathlib; import numpy as np; from gemmdrift.replay import jitcore as C; "
            "d = pathlib.Path(sys.argv[1]); (d / ('ready' + sys.argv[2])).touch()\n"
            "while not (d / 'go').exists(): time.sleep(0.005)\n"
            "assert C.min_nonzero(np.array([0, 3, 2], np.float32)) == 2.0; s = C._min_key.kernel.stats\n"
            "print(sum(s.cache_misses.values()), sum(s.cache_hits.values()))")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path), str(i)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for i in range(2)]
    deadline = time.time() + 300
    while not all((tmp_path / f"ready{i}").exists() for i in range(2)) and time.time() < deadline:
        time.sleep(0.01)
    (tmp_path / "go").touch()
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-500:] for o in outs]
    misses, hits = zip(*(map(int, o[0].split()) for o in outs))
    assert sorted(misses) == [0, 1] and sorted(hits) == [0, 1]
