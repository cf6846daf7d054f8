"""Replay: the float32 arithmetic, the recipes' trees (fingerprinted, against trees built here by hand), and
bit-exactness of this machine's own recipes against mlx on random operands and on the embedded Gemma.

Embedded-Gemma coverage (the unit tests; the exhaustive run is ``gemmdrift replay check``): every projection
of layer 0 and of the last layer, and the first 4096 rows of the 262144-row LM head, at T = 1, 2, 3, 4, 8,
16, 33, on rows captured from one forward pass, for dense bfloat16, dense float32 and affine q4/q8 g64.
"""

from __future__ import annotations

import fractions

import numpy as np
import pytest

from gemmdrift import fingerprint as F
from gemmdrift.errors import GemmdriftError
from gemmdrift import replay as R
from gemmdrift.replay import core as C
from gemmdrift.replay.paths import parse_replay_path, plan_for

TS = (1, 2, 3, 4, 8, 16, 33)


def _bits_equal(a, b) -> bool:
    return bool(np.array_equal(np.asarray(a, np.float32).view(np.uint32), np.asarray(b, np.float32).view(np.uint32)))


def _nearest(exact: fractions.Fraction, candidates, last_bit: int = 0) -> np.float32:
    """The correctly rounded value among candidates (ties to an even last bit: bit 0 for float32, 16 for
    bfloat16 held in float32), from exact rationals."""
    return min(candidates, key=lambda v: (abs(fractions.Fraction(float(v)) - exact),
                                          (int(np.asarray(v, np.float32).view(np.uint32)) >> last_bit) & 1))


# ------------------------------------------------------------------ arithmetic


def test_fma_rounds_once_exactly():
    rng = np.random.default_rng(0)
    a = rng.standard_normal(400).astype(np.float32)
    b = (rng.standard_normal(400) * 1e-3).astype(np.float32)
    c = rng.standard_normal(400).astype(np.float32)
    # Force float64 midpoints: c = -(a*b) + half a float32 ulp cases come from exact cancellation too.
    c[:50] = (-(a[:50].astype(np.float64) * b[:50])).astype(np.float32)
    got = C.fma(a, b, c)
    for i in range(len(a)):
        ex = fractions.Fraction(float(a[i])) * fractions.Fraction(float(b[i])) + fractions.Fraction(float(c[i]))
        f = np.float32(float(ex))
        want = _nearest(ex, [np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf))])
        assert _bits_equal(got[i], want), i


def test_double_rounding_case_is_caught():
    # a*b + c lands exactly on a float32 midpoint in float64 while the exact value is just above it.
    a, b = np.float32(1 + 2 ** -23), np.float32(1 + 2 ** -23)
    c = np.float32(-2 ** -23)
    exact = fractions.Fraction(float(a)) * fractions.Fraction(float(b)) + fractions.Fraction(float(c))
    f = np.float32(float(exact))
    want = _nearest(exact, [np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf))])
    assert _bits_equal(C.fma(np.array([a]), np.array([b]), np.array([c]))[0], want)


def test_bfloat16_rounding_and_native_adds_match_mlx_and_exact_rounding():
    import mlx.core as mx

    rng = np.random.default_rng(1)
    x = (rng.standard_normal(20000) * 3).astype(np.float32)
    x[:3] = [np.nan, np.inf, -0.0]
    mine = C.round_to(x, "bfloat16")
    theirs = np.array(mx.array(x).astype(mx.bfloat16).astype(mx.float32))
    assert np.array_equal(np.isnan(mine), np.isnan(theirs))
    assert _bits_equal(mine[1:], theirs[1:])
    # A native bf16 add rounds once; float32-then-bf16 rounds twice and differs on some pairs.
    a = C.round_to(rng.standard_normal(3000).astype(np.float32), "bfloat16")
    b = C.round_to((rng.standard_normal(3000) * 2.0 ** -9).astype(np.float32), "bfloat16")
    got = C.add_rounded(a, b, "bfloat16")
    for i in range(0, 3000, 7):
        ex = fractions.Fraction(float(a[i])) + fractions.Fraction(float(b[i]))
        cands = C.round_to(np.array([float(ex)], np.float32), "bfloat16")
        lo = (cands.view(np.uint32) - np.uint32(0x10000)).view(np.float32)
        hi = (cands.view(np.uint32) + np.uint32(0x10000)).view(np.float32)
        assert _bits_equal(got[i], _nearest(ex, [lo[0], cands[0], hi[0]], last_bit=16)), i


def test_ftz_and_when_it_is_needed():
    tiny = np.float32(2.0 ** -130)
    assert C.flush(np.array([tiny, -tiny, 1.0], np.float32)).tolist() == [0.0, 0.0, 1.0]
    assert np.signbit(C.flush(np.array([-tiny], np.float32))[0])
    assert not C.needs_ftz(np.array([1.0, 0.5], np.float32), np.array([2.0 ** -60], np.float32))
    assert C.needs_ftz(np.array([2.0 ** -70], np.float32), np.array([2.0 ** -70], np.float32))


def test_lane_trees_known_answers():
    # Lane 0 of shuffle-down 2, 1 over 4 lanes: (r0 + r2) + (r1 + r3); seen through an absorbing big value.
    big = np.float32(2.0 ** 30)
    r = np.array([big, 1.0, -big, 1.0], np.float32)[:, None]
    assert C.lane_tree(r)[0] == 0.0 + 2.0  # r0 + r2 cancels exactly, the ones survive
    assert C.adjacent_tree(r)[0] == 0.0  # (big + 1) + (-big + 1): both ones absorbed
    assert C.sequential_lanes(r)[0] == 1.0  # ((big + 1) - big) + 1


# ------------------------------------------------------------------ CPU recipes against mlx


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_cpu_recipes_are_bit_identical_to_mlx_on_random_operands(dtype):
    import mlx.core as mx

    rng = np.random.default_rng(2)
    T, K, N = 5, 704, 96  # K not a multiple of 16 or 128: the tails of simd_gemm's blocks
    x = C.round_to(rng.standard_normal((T, K)).astype(np.float32), dtype)
    w = C.round_to((rng.standard_normal((N, K)) * 0.05).astype(np.float32), dtype)
    b = C.round_to(rng.standard_normal(N).astype(np.float32), dtype)
    dt = getattr(mx, dtype)
    X, W, B = mx.array(x).astype(dt), mx.array(w).astype(dt), mx.array(b).astype(dt)
    rec = R.cpu_recipe("matmul", dtype)
    assert _bits_equal(R.replay_matmul(rec, x, w, dtype=dtype).y, np.array((X @ W.T).astype(mx.float32)))
    assert _bits_equal(R.replay_matmul(rec, x, w, b, dtype=dtype).y,
                       np.array(mx.addmm(B, X, W.T).astype(mx.float32)))
    for bits in (4, 8):
        wq, s, bb = mx.quantize(W, group_size=64, bits=bits)
        want = np.array(mx.quantized_matmul(X, wq, s, bb, transpose=True, group_size=64, bits=bits).astype(mx.float32))
        got = R.replay_quantized("cpu_qmm", x, np.array(wq), np.array(s.astype(mx.float32)),
                                 np.array(bb.astype(mx.float32)), bits=bits, group_size=64, dtype=dtype)
        assert _bits_equal(got.y, want), bits
        assert got.variant == "exact" and not got.prediction


def test_a_wrong_order_is_not_identical():
    """The comparison can fail: the Metal gemv order on the same operands is not the CPU's bits."""
    import mlx.core as mx

    rng = np.random.default_rng(3)
    # Order differences mostly vanish in the bf16 rounding of the output: take 8192 outputs.
    x = C.round_to(rng.standard_normal((1, 2048)).astype(np.float32), "bfloat16")
    w = C.round_to((rng.standard_normal((8192, 2048)) * 0.05).astype(np.float32), "bfloat16")
    real = np.array((mx.array(x).astype(mx.bfloat16) @ mx.array(w).astype(mx.bfloat16).T).astype(mx.float32))
    gemv = R.replay_matmul("gemv", x, w, dtype="bfloat16", params={"sn": 32, "bn": 1, "tn": 4})
    assert not _bits_equal(gemv.y, real)
    assert gemv.prediction and gemv.kernel == "gemv"


def test_variants_change_bits_and_are_named():
    """Every variant is a different order: the float32 accumulators differ (the bf16 outputs rarely do, which
    is the drift being studied), and each result names its variant."""
    from gemmdrift.replay import dense as D

    rng = np.random.default_rng(4)
    x = C.round_to(rng.standard_normal((2, 1024)).astype(np.float32), "bfloat16")
    w = C.round_to((rng.standard_normal((512, 1024)) * 0.05).astype(np.float32), "bfloat16")
    P = np.multiply(x.T[:, :, None], w.T[:, None, :], dtype=np.float32)
    accs = {v: D.metal_steel_gemm(P, {"bk": 32}, {"mma": v}, False) for v in D.MMA8}
    for v in ("H2", "H3", "H4"):
        assert not _bits_equal(accs["H1"], accs[v]), v
    wide = {v: D.metal_gemv_wide(P, {"k_lanes": 32}, {"dot4": v}, False) for v in D.DOT4}
    assert not _bits_equal(wide["sequential"], wide["pairwise"])
    names = [R.replay_matmul("steel_gemm", x[:1], w[:8], dtype="bfloat16", params={"bk": 32}, variant=f"mma={v}").variant
             for v in D.MMA8]
    assert names == [f"mma={v}" for v in D.MMA8]
    from gemmdrift.replay import quant as Q

    q = rng.integers(0, 16, size=(64, 1024)).astype(np.float32)
    sc = C.round_to(rng.random((64, 16)).astype(np.float32) * 0.01, "bfloat16")
    bi = C.round_to(-rng.random((64, 16)).astype(np.float32) * 0.05, "bfloat16")
    prm = {"bits": 4, "group_size": 64, "fast": True, "float_sums": True}
    qmv = {(s_, c_): Q.metal_qmv(x, q, sc, bi, prm, {"simd_sum": s_, "contrib": c_}, "bfloat16", False)
           for s_ in C.SIMD_SUMS for c_ in Q.CONTRIB}
    assert len({a.tobytes() for a in qmv.values()}) == len(qmv)
    wide_q = {c_: Q.metal_qmv_wide(x, q, sc, bi, {"group_size": 64}, {"contract": c_}, "bfloat16", False)
              for c_ in Q.CONTRACT}
    assert len({a.tobytes() for a in wide_q.values()}) == len(wide_q)


def test_bias_rules_differ_where_the_source_says():
    # gemv rounds the accumulator to bf16 before a native bf16 bias add; steel rounds acc + bias once.
    from gemmdrift.replay.dense import epilogue

    acc = np.array([1.0 + 2 ** -8 + 2 ** -12], np.float32)  # just above a bf16 tie: bf16(acc) = 1 + 2**-7
    bias = np.array([2.0 ** -8], np.float32)
    once = epilogue(acc, bias, "once", "bfloat16")  # bf16(1 + 2**-7 + 2**-12) = 1 + 2**-7
    twice = epilogue(acc, bias, "twice", "bfloat16")  # bf16(1 + 2**-7 + 2**-8): a tie, to even = 1 + 2**-6
    assert float(once[0]) == 1.0 + 2 ** -7
    assert float(twice[0]) == 1.0 + 2 ** -6


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("text, match", [
    ("replay:M9:matmul:bfloat16", "unknown replay chip"),
    ("replay:M3@mma=H9:matmul:bfloat16", "unknown mma variant"),
    ("replay:M3@colour=red:matmul:bfloat16", "unknown variant axis"),
    ("replay:M3:matmul:int8", "unsupported replay path"),
    ("replay:M3:quant:affine-q3-g64", "unsupported replay path"),
])
def test_bad_replay_paths_are_one_line_errors(text, match):
    with pytest.raises(GemmdriftError, match=match):
        parse_replay_path(text)


def test_unknowable_kernels_are_said_not_guessed():
    with pytest.raises(GemmdriftError, match="NAX"):
        plan_for("M5", "matmul", T=16, K=640, N=2048, dtype="bfloat16", mlx_version="0.32.4")
    with pytest.raises(GemmdriftError, match="cuBLASLt"):
        plan_for("sm90", "matmul", T=2, K=640, N=2048, dtype="bfloat16", mlx_version="0.32.4")
    assert plan_for("M5", "matmul", T=3, K=640, N=2048, dtype="bfloat16", mlx_version="0.32.4").recipe.kernel \
        == "gemv_wide"
    with pytest.raises(GemmdriftError, match="K % 4"):
        R.replay_matmul("gemv_wide", np.ones((2, 6), np.float32), np.ones((3, 6), np.float32), dtype="bfloat16",
                        params={"k_lanes": 32})
    with pytest.raises(GemmdriftError, match="has no float32 recipe"):
        plan_for("M3", "matmul", T=1, K=640, N=64, dtype="float32", mlx_version="0.32.4")


def test_release_changes_the_recipe_where_the_source_did():
    old = plan_for("M3", "matmul", T=3, K=640, N=2048, dtype="bfloat16", mlx_version="0.32.0")
    new = plan_for("M3", "matmul", T=3, K=640, N=2048, dtype="bfloat16", mlx_version="0.32.1")
    assert (old.recipe.kernel, new.recipe.kernel) == ("steel_gemm", "gemv_wide")  # gemv_wide from v0.32.1
    q2 = plan_for("M3", "quantized_matmul", T=1, K=640, N=2048, dtype="bfloat16", mlx_version="0.32.2", bits=4,
                  group_size=64)
    q4 = plan_for("M3", "quantized_matmul", T=1, K=640, N=2048, dtype="bfloat16", mlx_version="0.32.4", bits=4,
                  group_size=64)
    assert (q2.params["float_sums"], q4.params["float_sums"]) == (False, True)
    s2 = plan_for("M1", "quantized_matmul", T=33, K=640, N=640, dtype="bfloat16", mlx_version="0.32.2", bits=4,
                  group_size=64)
    s4 = plan_for("M1", "quantized_matmul", T=33, K=640, N=640, dtype="bfloat16", mlx_version="0.32.4", bits=4,
                  group_size=64)
    assert s2.recipe.kernel == "qmm_t_splitk" and s2.recipe.axes["partials"] == ("dtype",)
    assert s4.recipe.axes["partials"] == ("float32",)


# ------------------------------------------------------------------ fingerprints: each recipe is its tree


def _join(a, b):
    """A node of two subtrees; an empty lane (None) adds nothing (a +0 is not a leaf)."""
    return a if b is None else b if a is None else (a, b)


def _shuffle(lanes):
    """Lane 0 of a shuffle-down ladder n/2 .. 1 (built by hand, independently of replay_core)."""
    while len(lanes) > 1:
        h = len(lanes) // 2
        lanes = [_join(lanes[i], lanes[i + h]) for i in range(h)]
    return lanes[0]


def _seq(items):
    out = None
    for it in items:
        out = _join(out, it)
    return out


def _gemv(K, sn=32):
    return _shuffle([_seq([128 * i + 4 * l + j for i in range(K // 128) for j in range(4)]) for l in range(sn)])


def _gemv_split(K, bn=8, sn=32):
    """gemv with K >= 16N: simdgroup s's lanes take k = 1024i + 128s + 4l + j; simdgroups added in order."""
    per_sg = [_shuffle([_seq([sn * 4 * bn * i + sn * 4 * s_ + 4 * l + j for i in range(K // (sn * 4 * bn))
                              for j in range(4)]) for l in range(sn)]) for s_ in range(bn)]
    return _seq(per_sg)


def _gemv_wide(K, kl, pairwise_dot=False):
    n_v4 = K // 4
    n_main = n_v4 - n_v4 % (kl * 8)
    if pairwise_dot:
        d = [((4 * v, 4 * v + 1), (4 * v + 2, 4 * v + 3)) for v in range(n_v4)]
    else:
        d = [F.chain([4 * v + c for c in range(4)]) for v in range(n_v4)]
    lanes = []
    for l in range(kl):
        blocks = [_seq([d[b + i * kl + l] for i in range(8)]) for b in range(0, n_main, 8 * kl)]
        tail = [d[v] for v in range(n_main + l, n_v4, kl)]
        lanes.append(_seq(blocks + tail))
    return _shuffle(lanes)


def _mma_h2(ks):
    return _seq([F.pairwise(list(ks[c:c + 8])) for c in range(0, len(ks), 8)])


def _splitk(K, parts, ps, part_tree):
    return _seq([part_tree(list(range(p * ps, K if p == parts - 1 else (p + 1) * ps))) for p in range(parts)])


def _qmv(K, vpt, quads: bool):
    lanes = []
    for l in range(32):
        blocks = []
        for lo in range(0, K, 32 * vpt):
            ks = list(range(lo + vpt * l, lo + vpt * (l + 1)))
            if ks[-1] >= K:
                continue
            blocks.append(_seq([F.chain(ks[i:i + 4]) for i in range(0, vpt, 4)]) if quads else F.chain(ks))
        lanes.append(_seq(blocks))
    return _shuffle(lanes)


def _qmv_wide(K, g=64):
    G = K // g
    return _shuffle([_seq([F.chain([gi * g + sc * 8 + i for i in range(8)]) for gi in range(l, G, 8)
                           for sc in range(g // 8)]) for l in range(8)])


def _recover(path, K, T, N):
    red = F.make_reducer(F.parse_path(path), K, T, N)
    recs, _ = F.recover(red)
    assert all(r.ok for r in recs), [r.problem for r in recs if not r.ok][:1]
    assert len({F.fingerprint(r.tree) for r in recs}) == 1  # every row position of the block has the same tree
    return F.canonical(recs[0].tree), red.meta


CASES = [
    # (path, K, T, N, kernel it must dispatch to, the tree built by hand)
    ("replay:cpu:matmul:bfloat16", 256, 1, 64, "cpu_simd_gemm", lambda: F.chain(list(range(256)))),
    ("replay:cpu:matmul:bfloat16", 256, 33, 64, "cpu_simd_gemm", lambda: F.chain(list(range(256)))),
    ("replay:cpu:matmul:float32", 256, 8, 64, "cpu_cblas_sgemm", lambda: F.chain(list(range(256)))),
    ("replay:M3:matmul:bfloat16", 256, 1, 64, "gemv", lambda: _gemv(256)),
    ("replay:M1:matmul:bfloat16", 256, 1, 64, "gemv", lambda: _gemv(256)),
    ("replay:M1:matmul:bfloat16", 1024, 1, 64, "gemv", lambda: _gemv_split(1024)),  # K >= 16N: bn = 8
    ("replay:sm90:matmul:bfloat16", 256, 1, 64, "cuda_gemv", lambda: _gemv(256)),
    ("replay:M3:matmul:bfloat16", 1280, 2, 128, "gemv_wide", lambda: _gemv_wide(1280, 32)),
    ("replay:M3@dot4=pairwise:matmul:bfloat16", 1280, 5, 128, "gemv_wide", lambda: _gemv_wide(1280, 32, True)),
    ("replay:M3:matmul:bfloat16", 1280, 8, 128, "gemv_wide", lambda: _gemv_wide(1280, 16)),
    ("replay:M5:matmul:bfloat16", 1280, 15, 128, "gemv_wide", lambda: _gemv_wide(1280, 16)),
    ("replay:M3@mma=H2:matmul:bfloat16", 256, 16, 4096, "steel_gemm", lambda: _mma_h2(list(range(256)))),
    ("replay:M3:matmul:bfloat16", 256, 16, 4096, "steel_gemm", lambda: F.chain(list(range(256)))),
    ("replay:M1@mma=H2:matmul:bfloat16", 256, 2, 64, "steel_gemm_splitk", lambda: _splitk(256, 8, 32, _mma_h2)),
    ("replay:M3:matmul:bfloat16", 1280, 16, 64, "steel_gemm_splitk", lambda: _splitk(1280, 32, 32, F.chain)),
    ("replay:cpu:quant:affine-q4-g64:bfloat16", 256, 4, 64, "cpu_qmm", lambda: F.chain(list(range(256)))),
    ("replay:M3:quant:affine-q4-g64:bfloat16", 256, 1, 64, "qmv", lambda: _qmv(256, 8, True)),
    ("replay:M1:quant:affine-q8-g64:bfloat16", 256, 3, 64, "qmv_fast", lambda: _qmv(256, 8, False)),
    ("replay:M3:quant:affine-q4-g64:bfloat16", 640, 2, 64, "qmv_wide", lambda: _qmv_wide(640)),
    ("replay:M3:quant:affine-q4-g64:bfloat16", 256, 16, 64, "qmm_t_splitk", lambda: _splitk(256, 4, 64, F.chain)),
]


@pytest.mark.parametrize("path, K, T, N, kernel, tree", CASES, ids=[f"{c[0]}-K{c[1]}-T{c[2]}" for c in CASES])
def test_each_recipe_fingerprints_to_the_tree_it_states(path, K, T, N, kernel, tree):
    got, meta = _recover(path, K, T, N)
    assert meta["kernel"] == kernel
    assert got == F.canonical(tree())


def test_a_different_tree_is_told_apart():
    """The comparison can fail: gemv's tree is not a chain, kl32's is not kl16's."""
    assert F.canonical(_gemv(256)) != F.canonical(F.chain(list(range(256))))
    assert F.canonical(_gemv_wide(1280, 32)) != F.canonical(_gemv_wide(1280, 16))


def test_the_cpu_recipe_tree_is_mlx_s_own_tree():
    """Fingerprinting the real kernel and its replay gives the same tree (dense and quantized)."""
    for real, rep in (("matmul:bfloat16", "replay:cpu:matmul:bfloat16"),
                      ("quant:affine-q4-g64:bfloat16", "replay:cpu:quant:affine-q4-g64:bfloat16")):
        a = F.recover(F.make_reducer(F.parse_path(real), 128, 2, 16))[0][0]
        b = F.recover(F.make_reducer(F.parse_path(rep), 128, 2, 16))[0][0]
        assert a.ok and b.ok and F.fingerprint(a.tree) == F.fingerprint(b.tree)


# ------------------------------------------------------------------ the embedded Gemma, bit for bit


@pytest.fixture(scope="module")
def gemma_rows(embedded):
    from gemmdrift import kernels
    from gemmdrift.prompts import builtin_text

    last = embedded.n_layers - 1
    projs = kernels.projections(embedded, layers=[0, last, embedded.n_layers])
    tokens = embedded.tokenizer.encode(builtin_text("essay"))[:48]
    return projs, kernels.capture_inputs(embedded, tokens, projs, max_rows=33)


GROUPS = ("layer 0", "last layer", "lm_head rows 0-4095")


@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("path", ["dense:bfloat16", "dense:float32", "quant:affine-q4-g64", "quant:affine-q8-g64"])
def test_replay_cpu_is_bit_identical_to_mlx_on_the_embedded_gemma(embedded, gemma_rows, path, group):
    from gemmdrift.replay.check import check_replay

    projs, rows = gemma_rows
    layer = {GROUPS[0]: 0, GROUPS[1]: embedded.n_layers - 1, GROUPS[2]: embedded.n_layers}[group]
    projs = [p for p in projs if p.layer == layer]
    r = check_replay(embedded, rows, projs, [path], TS, head_rows=4096)
    table = r.tables["replay_check"]
    assert len(table) == len(projs) * len(TS)  # one variant ("exact") per projection and T
    kernel = {"dense:float32": "cpu_cblas_sgemm", "dense:bfloat16": "cpu_simd_gemm"}.get(path, "cpu_qmm")
    assert set(table["kernel"]) == {kernel}
    bad = table[~table["identical"]]
    assert bad.empty, bad.head().to_string()
    assert (table["max_ulp"] == 0).all()
    assert set(table["T"]) == set(TS) and table["projection"].nunique() == (1 if layer == embedded.n_layers else 7)
    assert all(rec["identical"] for rec in r.details["records"])


# ------------------------------------------------------------------ dispatch Choice -> recipe, and the CLI


def test_recipe_for_takes_a_dispatch_choice():
    from gemmdrift.dispatch import Choice

    plan = R.recipe_for(Choice("gemv_wide", {"k_lanes": 16, "passes": 2}, "matmul.cpp gemv_wide_config"),
                        "dot4=pairwise")
    assert plan.recipe.kernel == "gemv_wide" and plan.params["k_lanes"] == 16
    assert plan.variant == {"dot4": "pairwise"} and plan.source == "matmul.cpp gemv_wide_config"
    split = R.recipe_for(Choice("steel_gemm_splitk", {"partitions": 4, "partition_size": 512, "bk": 16}))
    assert split.variant == {"mma": "H1"}  # the default: an FMA chain
    for kernel, why in (("steel_gemm_nax", "NAX"), ("cublaslt", "cuBLASLt")):
        with pytest.raises(GemmdriftError, match=why):
            R.recipe_for(Choice(kernel, {}))
    with pytest.raises(GemmdriftError, match="no recipe 'warp_drive'"):
        R.recipe_for(Choice("warp_drive", {}))


@pytest.mark.parametrize("argv, match", [
    (["--chip", "M9"], "unknown replay chip"),
    (["--variant", "mma=H7"], "unknown mma variant"),
    (["--paths", "quant:affine-q3-g64"], "no recipe for path"),
    (["--paths", "emulated:splitk4"], "no recipe for path"),
    (["--ts", "0,1"], "must be positive"),
    (["--head-rows", "0"], "--head-rows must be positive"),
    (["--mlx-version", "abc"], "cannot read mlx version"),
])
def test_replay_check_bad_input_exits_2_before_loading(argv, match, capsys, monkeypatch):
    from gemmdrift import cli, model as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    assert cli.main(["replay", "check", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert match in err and len(err.splitlines()) == 1


def test_replay_check_cli_json_on_the_embedded_gemma(tmp_path, capsys, monkeypatch):
    import json

    from gemmdrift import cli, store

    base = ["replay", "check", "--layers", "0", "--projections", "k_proj", "--ts", "1,2", "--tokens", "16",
            "--rows", "4", "--paths", "dense:bfloat16,quant:affine-q4-g64", "--json"]
    assert cli.main(base + ["--out", str(tmp_path / "own")]) == 0
    doc = json.loads(capsys.readouterr().out)
    recs = doc["records"]
    assert {(r["path"], r["T"]) for r in recs} == {(p, t) for p in ("dense:bfloat16", "quant:affine-q4-g64")
                                                   for t in (1, 2)}
    assert all(r["identical"] and r["max_ulp"] == 0 and r["variant"] == "exact" for r in recs)
    assert not doc["prediction"]
    assert not (tmp_path / "own" / "checkpoint").exists()  # finished: the Result holds every unit (issue 33 D13)
    # Interrupted after the last unit, before the Result is written: the units stay for a rerun.
    write = store.write_result

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(store, "write_result", interrupted)
    assert cli.main(base + ["--out", str(tmp_path / "cut")]) == 130
    assert "kept in" in capsys.readouterr().err
    monkeypatch.setattr(store, "write_result", write)
    units = sorted((tmp_path / "cut" / "checkpoint" / "units").glob("*.csv"))
    assert len(units) == 2  # one per (projection, path): a rerun resumes from them
    dense_unit = next(u for u in units if "dense" in u.name)
    dense_unit.write_text(dense_unit.read_text().replace("cpu_simd_gemm", "cpu_simd_gemm_kept"))
    assert cli.main(base[:-1] + ["--ts", "1", "--json", "--out", str(tmp_path / "cut")]) == 2  # another config
    assert "belongs to another replay check" in capsys.readouterr().err
    assert cli.main(base + ["--out", str(tmp_path / "cut")]) == 0  # resumes: reads the units, computes nothing
    again = json.loads(capsys.readouterr().out)["records"]
    assert {r["kernel"] for r in again if r["path"] == "dense:bfloat16"} == {"cpu_simd_gemm_kept"}
    assert [r["identical"] for r in again] == [r["identical"] for r in recs]
    assert not (tmp_path / "cut" / "checkpoint").exists()
    # Another chip's recipes against this CPU: every variant gets a record, marked as a prediction.
    assert cli.main(base + ["--chip", "M3", "--out", str(tmp_path / "m3")]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["prediction"]
    dense = {(r["T"], r["variant"]): r for r in doc["records"] if r["path"] == "dense:bfloat16"}
    assert set(dense) == {(1, "exact"), (2, "dot4=sequential"), (2, "dot4=pairwise")}
    assert {r["kernel"] for r in doc["records"]} == {"gemv", "gemv_wide", "qmv", "qmv_wide"}
    assert all(r["max_ulp"] is not None and r["max_ulp"] >= 0 for r in doc["records"])


# ------------------------------------------------------------------ the whole model under replay (library)


def test_the_model_under_replay_cpu_is_the_model_bit_for_bit_and_under_m3_a_prediction(tiny):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from gemmdrift.replay.model import replayed

    tokens = mx.array([[3, 14, 15, 92, 65, 35, 89, 79]])

    def logits(t):
        return np.array(tiny.model(t, cache=make_prompt_cache(tiny.model)).astype(mx.float32))

    plain = logits(tokens)
    with replayed(tiny, "cpu") as log:
        same = logits(tokens)
    assert _bits_equal(plain, same)
    n_proj = 4 * 7 + 1
    assert sum(log.calls.values()) == n_proj and {k[1] for k in log.calls} == {"cpu_simd_gemm"}
    assert _bits_equal(logits(tokens), plain)  # the model is restored
    with replayed(tiny, "M3", "dot4=pairwise") as log3:
        logits(tokens[:, :1])  # T=1: gemv
        logits(tokens[:, :3])  # T=3: gemv_wide, the named variant
    kernels = {(k[1], k[2], k[3]) for k in log3.calls}
    assert ("gemv", "exact", 1) in kernels and ("gemv_wide", "dot4=pairwise", 3) in kernels
    rec = log3.record()
    assert rec["prediction"] and rec["chip"] == "M3" and rec["variant"] == "dot4=pairwise"


def test_stack_under_replay_cpu_equals_stack_and_under_m3_says_it_is_a_prediction(tiny):
    from gemmdrift.replay.model import KernelsOption
    from gemmdrift.measure.stack import measure_stack

    toks = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79]
    scheds = ["prefill:8,decode", "prefill:8,verify:3"]
    plain = measure_stack(tiny, toks, scheds, split=8, local=False, workers=1)
    results = {}
    for text in ("replay:cpu", "replay:M3@dot4=pairwise"):
        opt = KernelsOption(text)
        assert opt.workers == 1 and opt.checkpoint != "checkpoint"
        with opt.installed(tiny):
            results[text] = opt.label(measure_stack(tiny, toks, scheds, split=8, local=False, workers=opt.workers))
    assert results["replay:cpu"].figures == plain.figures  # exact replay: the same measurement
    rec = results["replay:M3@dot4=pairwise"].details["replay"]
    assert rec["prediction"] and rec["chip"] == "M3" and rec["variant"] == "dot4=pairwise"
    assert {c["kernel"] for c in rec["calls"]} >= {"gemv", "gemv_wide"}  # decode T=1, verify T=4
    assert results["replay:M3@dot4=pairwise"].inputs["kernels"] == "replay:M3@dot4=pairwise"
    assert KernelsOption(None).label(plain) is plain


@pytest.mark.parametrize("argv, match", [
    (["--kernels", "replay:M9"], "unknown replay chip"),
    (["--kernels", "metal:M3"], "expected replay:<chip>"),
    (["--kernels", "replay:M3@mma=H8"], "unknown mma variant"),
    (["--kernels", "replay:M3", "--ladder"], "--ladder with --kernels"),
])
def test_stack_kernels_bad_input_exits_2_before_loading(argv, match, capsys, monkeypatch, tmp_path):
    from gemmdrift import cli, model as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    assert cli.main(["stack", "--out", str(tmp_path / "s"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert match in err and len(err.splitlines()) == 1
