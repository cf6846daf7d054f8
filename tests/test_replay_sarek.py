"""Known answers from a measurement on a real Apple GPU (issue 31 item 2): Sarek's Metal probes.

mathiasbourgoin/Sarek ``tools/probes/metal_simdgroup_matrix_probe.m`` @01927bd7 ran 1024 independent
``simdgroup_multiply_accumulate(D, A, B, C)`` problems (half x half -> float, C nonzero) on an Apple M4,
macOS 15.6.1, and found the device bit-equal, on 65536 of 65536 elements, to "acc = C, then the 8 products in
index order, each add rounded to binary32". Its inputs come from a host LCG (seed 12345), so every count of a
host model against that C-first chain is host-only and reproducible here: C-last sequential 51850, pairwise
(C last) 34914, the exact dot product 538 (and the probe's own control: C-last sequential vs pairwise differ on
23291). The generator and the four models are ported below from the probe's C source (the test's own
reference); the replay's default MMA step (``replay_dense.mma8``, variant H1) must then be that C-first chain
on all 65536.

``metal_math_mode_probe.m`` / ``metal_contraction_barrier_probe.m`` @4716bfc5: ``a*b + c`` in float is contracted
to an FMA on every observable element (8773 of 65536, host LCG seed 987654321) under every MTLCompileOptions
math mode, Safe included; only ``#pragma METAL fp contract(off)`` (or clang's) stops it. The observable count
is host-reproducible when the device's fma is correctly rounded: it is checked here with ``replay_core.fma``.
"""

from __future__ import annotations

import numpy as np
import pytest

from gemmdrift import replay as R
from gemmdrift.replay import core as C
from gemmdrift.replay import dense as rd
from gemmdrift.replay import quant as rq

NT = 1024  # independent 8x8x8 problems, as in the probe


def _lcg(seed: int, n: int) -> np.ndarray:
    """``s = s * 1103515245u + 12345u`` (unsigned 32-bit), the n states after the seed."""
    out = np.empty(n, dtype=np.uint64)
    s = seed
    for i in range(n):
        s = (s * 1103515245 + 12345) & 0xFFFFFFFF
        out[i] = s
    return out


def _operand(s: np.ndarray, exp_mask: int, exp_mod: int, exp_lo: int) -> np.ndarray:
    """``sign * ldexpf(1024 + ((s >> 7) & 0x3ff), e - 10)`` with ``e = exp_lo + ((s >> 19) & mask) % mod``."""
    m = 1024 + ((s >> 7) & 0x3FF).astype(np.int64)
    e = exp_lo + ((s >> 19) & exp_mask).astype(np.int64) % exp_mod
    sign = np.where(s & 0x40, -1.0, 1.0)
    return (sign * np.ldexp(m.astype(np.float64), e - 10)).astype(np.float32)


def sarek_mma_inputs():
    """A (NT, 8, 8), B (NT, 8, 8) half values and C (NT, 8, 8) float values, as the probe draws them."""
    s = _lcg(12345, 3 * NT * 64).reshape(NT * 64, 3)
    a = _operand(s[:, 0], 0xF, 11, -5)  # 11-bit significand, exponent in [-5, 5]
    b = _operand(s[:, 1], 0xF, 11, -5)
    c = _operand(s[:, 2], 0x1F, 21, -10)  # exponent in [-10, 10]
    for v in (a, b, c):  # every value is a half (the probe casts to _Float16): exact, checked
        assert np.array_equal(v.astype(np.float16).astype(np.float32), v)
    return a.reshape(NT, 8, 8), b.reshape(NT, 8, 8), c.reshape(NT, 8, 8)


def _products(a, b):
    """p[k, t, r, c] = float(A[t, r, k]) * float(B[t, k, c]): exact in binary32 (11 + 11 bits)."""
    return np.stack([np.multiply(a[:, :, k][:, :, None], b[:, k, :][:, None, :], dtype=np.float32)
                     for k in range(8)])


def _models(p, c):
    """The probe's host models, ported line for line (float32 adds; refd exact in float64)."""
    seq = np.zeros_like(c)
    for k in range(8):
        seq = (seq + p[k]).astype(np.float32)
    seq32 = (seq + c).astype(np.float32)  # C added last
    cfirst = c.copy()
    for k in range(8):
        cfirst = (cfirst + p[k]).astype(np.float32)  # C first
    l0 = ((p[0] + p[1]) + (p[2] + p[3])).astype(np.float32)
    l1 = ((p[4] + p[5]) + (p[6] + p[7])).astype(np.float32)
    tree32 = ((l0 + l1) + c).astype(np.float32)
    acc = np.zeros(c.shape, np.float64)
    for k in range(8):
        acc = acc + p[k].astype(np.float64)  # exact: the term span is 21 binades (asserted below)
    refd = acc + c.astype(np.float64)
    return seq32, cfirst, tree32, refd


@pytest.fixture(scope="module")
def mma():
    a, b, c = sarek_mma_inputs()
    p = _products(a, b)
    return p, c, _models(p, c)


def test_the_probe_s_host_models_reproduce_its_published_counts(mma):
    p, c, (seq32, cfirst, tree32, refd) = mma
    # The probe's exactness invariant: 9 terms spanning few enough binades that float64 sums them exactly.
    mags = np.concatenate([np.abs(p), np.abs(c)[None]])
    _, e = np.frexp(mags)
    span = int(np.max(e.max(axis=0) - e.min(axis=0)))
    assert span + 24 + 1 + 4 <= 53
    # The M4 equalled the C-first chain on every element, so each published "device bit-equal to model" count
    # is the model's agreement with the C-first chain.
    assert int(np.sum(seq32 == cfirst)) == 51850
    assert int(np.sum(tree32 == cfirst)) == 34914
    assert int(np.sum(cfirst.astype(np.float64) == refd)) == 538
    assert int(np.sum(seq32 != tree32)) == 23291  # the probe's own "order is observable" control


def test_the_replay_s_default_mma_step_is_the_chain_the_m4_matched(mma):
    p, c, (seq32, cfirst, tree32, refd) = mma
    steel = R.RECIPES["steel_gemm"]
    assert steel.default()["mma"] == "H1" and R.RECIPES["qmm_t"].default()["mma"] == "H1"
    h1 = rd.mma8(c, p, steel.default()["mma"], ftz=False)
    assert int(np.sum(h1.view(np.uint32) == cfirst.view(np.uint32))) == 65536
    # The other variants are the other models: H2 is acc + pairwise(p) = the probe's pairwise, C last.
    h2 = rd.mma8(c, p, "H2", ftz=False)
    assert np.array_equal(h2.view(np.uint32), tree32.view(np.uint32))
    assert int(np.sum(h2 == cfirst)) == 34914
    # H3 (the exact sum, rounded once) and H4 (MMA-Sim's truncating fused sum) are not what the M4 does.
    h3 = rd.mma8(c, p, "H3", ftz=False)
    assert np.array_equal(h3, refd.astype(np.float32))  # RN(exact): 9 exact terms, one rounding
    assert np.sum(h3 != cfirst) > 10000
    assert np.sum(rd.mma8(c, p, "H4", ftz=False) != cfirst) > 10000


def test_the_steel_recipe_chains_mma_steps_from_zero_as_the_probe_s_c_first_model():
    # One K = 16 output: the steel chain is MMA8(MMA8(0, p[0:8]), p[8:16]); with H1 that is 16 sequential adds
    # from +0, which is what the C-first model gives when the first step's C is the previous step's D.
    a, b, c = sarek_mma_inputs()
    x = np.concatenate([a[0], a[1]], axis=1)  # (8, 16): rows of A for two problems, side by side in K
    w = np.concatenate([b[0].T, b[1].T], axis=1)  # (8, 16): W = B.T, so x @ W.T = A0 B0 + A1 B1
    y = R.replay_matmul("steel_gemm", x, w, dtype="float16", params={"bk": 16}, engine="numpy").y
    want = np.zeros((8, 8), np.float32)
    for k in range(16):
        want = (want + np.multiply(x[:, k][:, None], w[:, k][None, :], dtype=np.float32)).astype(np.float32)
    assert np.array_equal(y, want.astype(np.float16).astype(np.float32))


def _contraction_inputs():
    s = _lcg(987654321, 3 * 65536).reshape(65536, 3)
    f = lambda v, d: (((v >> 8) & 0xFFFFF).astype(np.float32) / np.float32(d) + np.float32(0.5)).astype(np.float32)
    return f(s[:, 0], 8192), f(s[:, 1], 8192), f(s[:, 2], 4096)


def test_fma_contraction_is_observable_on_the_probe_s_8773_elements():
    a, b, c = _contraction_inputs()
    separate = (a * b + c).astype(np.float32)  # numpy: RN(RN(a*b) + c), never fused
    fused = C.fma(a, b, c)
    assert int(np.sum(separate.view(np.uint32) != fused.view(np.uint32))) == 8773


def test_the_replay_s_a_times_b_plus_c_default_is_fma():
    # Measured (M4): a*b+c is contracted under every math mode, Safe included, and only fp contract(off)
    # pragmas stop it; mlx's kernels carry no such pragma, so the replay's default for each contraction axis is
    # the fused form, and the unfused one is kept as the variant.
    assert R.RECIPES["qmv_wide"].default()["contract"] == "fma" and list(rq.CONTRACT) == ["fma", "none"]
    assert R.RECIPES["qmv"].default()["contrib"] == "fma" and R.RECIPES["qmv_fast"].default()["contrib"] == "fma"
    assert "Sarek" in rq.__doc__ and "Sarek" in rd.__doc__
