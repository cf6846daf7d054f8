"""The compiled engine's tile cache: a cached call gives the bits of the first, a different weight (or the same
array changed in place) is never served another's tiles, and the cache stays within its budget."""

from __future__ import annotations

import numpy as np
import pytest

from gemmdrift.errors import GemmdriftError
from gemmdrift import replay as R
from gemmdrift.replay import jitcache as JC
from gemmdrift.replay import quant as rq
from gemmdrift.replay.check import seeded_q4_weight
from gemmdrift.replay.core import round_to
from gemmdrift.replay.jitquant import prepare


def _same(a, b) -> bool:
    return bool(np.array_equal(np.asarray(a, np.float32).view(np.uint32), np.asarray(b, np.float32).view(np.uint32)))


def _weight(N: int, K: int, seed: int):
    return seeded_q4_weight(np.random.default_rng(seed), N, K)


KERNELS = (("cpu_qmm", None), ("qmv", None), ("qmv_wide", None), ("qmm_t", None), ("qmm_t_splitk", {"split_k": 2}))


@pytest.fixture
def cache():
    JC.clear()
    yield JC.TILES
    JC.clear()


@pytest.mark.parametrize("kernel,params", KERNELS, ids=[k for k, _ in KERNELS])
def test_cached_call_gives_the_first_call_s_bits_and_the_numpy_recipe_s(kernel, params, cache):
    K, N = 256, 150  # N: two full tiles of 64 and a partial one
    wq, sc, bi = _weight(N, K, seed=1)
    x = round_to(np.random.default_rng(2).standard_normal((9, K)).astype(np.float32), "bfloat16")
    kw = dict(bits=4, group_size=64, dtype="bfloat16", params=params)
    first = R.replay_quantized(kernel, x, wq, sc, bi, engine="compiled", **kw)
    assert (cache.misses, cache.hits, len(cache)) == (1, 0, 1)
    again = R.replay_quantized(kernel, x, wq, sc, bi, engine="compiled", **kw)
    assert (cache.misses, cache.hits) == (1, 1)
    ref = R.replay_quantized(kernel, x, wq, sc, bi, engine="numpy", **kw)
    assert _same(first.y, again.y) and _same(again.y, ref.y)


def test_a_different_weight_is_never_served_another_s_tiles(cache):
    K, N = 128, 70
    x = round_to(np.random.default_rng(3).standard_normal((2, K)).astype(np.float32), "bfloat16")
    kw = dict(bits=4, group_size=64, dtype="bfloat16")
    wq, sc, bi = _weight(N, K, seed=4)
    a = R.replay_quantized("qmv", x, wq, sc, bi, **kw).y
    # The same arrays changed in place (the same addresses and shapes): one code, then one scale, then one bias.
    for arr, i in ((wq, (5, 3)), (sc, (64, 1)), (bi, (0, 0))):
        old = arr[i]
        arr[i] = (old ^ np.uint32(0x10)) if arr.dtype == np.uint32 else round_to(np.float32([old * 3 + 0.5]),
                                                                                   "bfloat16")[0]
        got = R.replay_quantized("qmv", x, wq, sc, bi, **kw).y
        want = R.replay_quantized("qmv", x, wq, sc, bi, engine="numpy", **kw).y
        assert _same(got, want) and not _same(got, a)
        arr[i] = old
    assert cache.hits == 0  # every changed weight was prepared anew
    assert _same(R.replay_quantized("qmv", x, wq, sc, bi, **kw).y, a) and cache.hits == 1
    # The same weight as fresh arrays (other addresses, the same bits): its entry, not a new one.
    n = len(cache)
    assert _same(R.replay_quantized("qmv", x, wq.copy(), sc.copy(), bi.copy(), **kw).y, a)
    assert (cache.hits, len(cache)) == (2, n)
    # Another weight of the same shape at another address; and a -0.0 bias against +0.0 (equal as floats,
    # different bits: compared as bits).
    wq2, sc2, bi2 = _weight(N, K, seed=5)
    b = R.replay_quantized("qmv", x, wq2, sc2, bi2, **kw).y
    assert _same(b, R.replay_quantized("qmv", x, wq2, sc2, bi2, engine="numpy", **kw).y) and not _same(a, b)
    z = np.zeros_like(bi)
    nz = -z
    key = (4, 64, -1, 0, False)
    tz = cache.get((wq, sc, z), key, lambda: prepare(wq, sc, z, 4, 64, key[2:]))
    tnz = cache.get((wq, sc, nz), key, lambda: prepare(wq, sc, nz, 4, 64, key[2:]))
    assert np.signbit(tnz[2][0, 0, 0]) and not np.signbit(tz[2][0, 0, 0])


def test_the_cache_keeps_within_its_budget_and_refuses_what_does_not_fit(monkeypatch, cache):
    K, N = 128, 64
    x = round_to(np.random.default_rng(6).standard_normal((1, K)).astype(np.float32), "bfloat16")
    kw = dict(bits=4, group_size=64, dtype="bfloat16")
    weights = [_weight(N, K, seed=s) for s in range(3)]
    R.replay_quantized("qmv_wide", x, *weights[0], **kw)
    one = cache.nbytes
    # W (K+1) x 64 floats, S and B (G+1) x 64 each, and the copies of wq, scales, biases.
    assert one == 4 * (K + 1) * 64 + 2 * 4 * (K // 64 + 1) * 64 + N * K // 2 + 2 * 4 * N * (K // 64)
    JC.clear()
    monkeypatch.setenv("GEMMDRIFT_REPLAY_TILE_CACHE_MB", "0")
    for w in weights:
        y = R.replay_quantized("qmv_wide", x, *w, **kw).y
        assert _same(y, R.replay_quantized("qmv_wide", x, *w, engine="numpy", **kw).y)
    assert (cache.nbytes, len(cache), cache.refused) == (0, 0, 3)
    small = JC.TileCache(budget=2 * one)
    for w in weights + weights:
        small.get(w, (4, 64, 1, 0, False), lambda w=w: prepare(*w, 4, 64, (1, 0, False)))
    assert (len(small), small.nbytes, small.hits, small.refused) == (2, 2 * one, 2, 2)
    monkeypatch.setenv("GEMMDRIFT_REPLAY_TILE_CACHE_MB", "lots")
    with pytest.raises(GemmdriftError, match="GEMMDRIFT_REPLAY_TILE_CACHE_MB must be a whole number"):
        JC.budget_bytes()


def test_the_lm_head_s_chunks_are_cached_one_entry_each(monkeypatch, cache):
    # replay_quantized splits a weight of more than CHUNK_ELEMENTS / K rows: each chunk is its own entry.
    monkeypatch.setattr(R, "CHUNK_ELEMENTS", 64 * 128)
    K, N = 128, 200
    wq, sc, bi = _weight(N, K, seed=7)
    x = round_to(np.random.default_rng(8).standard_normal((3, K)).astype(np.float32), "bfloat16")
    kw = dict(bits=4, group_size=64, dtype="bfloat16")
    a = R.replay_quantized("cpu_qmm", x, wq, sc, bi, **kw).y
    b = R.replay_quantized("cpu_qmm", x, wq, sc, bi, **kw).y
    assert (len(cache), cache.misses, cache.hits) == (4, 4, 4)
    assert _same(a, b) and _same(a, R.replay_quantized("cpu_qmm", x, wq, sc, bi, engine="numpy", **kw).y)
    assert rq.cpu_qmm_t is R.RECIPES["cpu_qmm"].fn


def test_speed_ratio_times_the_first_call_on_an_emptied_cache_and_the_cached_call(cache):
    from gemmdrift.replay.check import speed_ratio

    f = speed_ratio("qmv", 1, 128, 64, reps=3)
    # Each round: one miss (the cache emptied first), then one hit.
    assert (cache.misses, cache.hits) == (1, 1) and len(cache) == 1
    assert f["ratio"] == f["replay_s"] / f["numpy_s"] and f["first_ratio"] == f["first_replay_s"] / f["numpy_s"]
    d = speed_ratio("gemv", 1, 128, 64, reps=2)  # dense: nothing cached, the first call is every call
    assert d["first_replay_s"] == d["replay_s"]
