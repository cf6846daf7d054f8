"""Model-free trim cases (trim, trim_prompt_cache, draft_trim) on synthetic keys and values."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from .reading import compare_readings, merge_diffs, read_cache
from .common import CONTINUATION, KV_BITS, PREFILL_STEP


def _synthetic_kv(n: int, heads: int = 1, dim: int = 64, seed: int = 0):
    import mlx.core as mx
    import numpy as np

    # numpy's Generator: the same keys and values on every platform and chip (mx.random.normal's erfinv differs
    # between Metal chips, mlx #3568, and its CPU kernel is not known to be identical across CPUs; issue 31).
    rng = np.random.default_rng(seed)
    k = mx.array(rng.standard_normal((1, heads, n, dim), dtype=np.float32)).astype(mx.bfloat16)
    v = mx.array(rng.standard_normal((1, heads, n, dim), dtype=np.float32)).astype(mx.bfloat16)
    mx.eval(k, v)
    return k, v


def class_factories(window: int = 16) -> dict[str, Callable[[], Any] | None]:
    """A fresh instance of every cache class of mlx_lm.models.cache this module checks (None: no trim there)."""
    from mlx_lm.models import cache as C

    out: dict[str, Callable[[], Any] | None] = {
        "KVCache": C.KVCache,
        "RotatingKVCache": lambda: C.RotatingKVCache(max_size=window),
        "RotatingKVCache(keep=4)": lambda: C.RotatingKVCache(max_size=window, keep=4),
        "QuantizedKVCache": lambda: C.QuantizedKVCache(group_size=64, bits=KV_BITS),
        "ConcatenateKVCache": lambda: C.ConcatenateKVCache(),
        "ChunkedKVCache": lambda: C.ChunkedKVCache(chunk_size=window),
        "CacheList": lambda: C.CacheList(C.KVCache(), C.RotatingKVCache(max_size=window)),
        "BatchKVCache": lambda: C.BatchKVCache([0]),
        "BatchRotatingKVCache": lambda: C.BatchRotatingKVCache(window, [0]),
        "ArraysCache": None,
    }
    # Classes an older mlx-lm does not have: "absent" (a not-applicable row, never an error).
    return {k: (v if hasattr(C, k.split("(")[0]) else "absent") for k, v in out.items()}


def _feed_direct(c, k, v) -> None:
    import mlx.core as mx
    from mlx_lm.models import cache as C

    if hasattr(c, "maybe_trim_front"):
        c.maybe_trim_front()
    if isinstance(c, C.CacheList):
        for x in c.caches:
            x.update_and_fetch(k, v)
    else:
        c.update_and_fetch(k, v)
    mx.eval(c.state if not isinstance(c, C.CacheList) else [x.state for x in c.caches])


def trim_case(make: Callable[[], Any], p: int, block: int, n: int, via: str, *, kv=None,
              continuation: Sequence[int] = (CONTINUATION, 1), single: bool = False) -> dict[str, Any]:
    """Trim a cache directly: fill ``p`` positions, feed a block of ``block``, trim ``n``, continue.

    Reference: the same fill, a block of ``block - n``, the same continuation blocks.
    No model: the keys and values are seeded random numbers, so any difference is a
    state difference (data movement cannot round). ``via`` is 'trim' (the method)
    or 'trim_prompt_cache' (mlx-lm's list function on ``[cache]``). ``single``: the block is fed one
    token at a time (the draft model's T=1 drafting before its rewind).
    """
    from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

    total = p + block + sum(continuation)
    k, v = kv if kv is not None else _synthetic_kv(total)
    sides = []
    for trimmed_side in (True, False):
        c = make()
        if p:
            for s in range(0, p, PREFILL_STEP):
                _feed_direct(c, k[..., s:min(s + PREFILL_STEP, p), :], v[..., s:min(s + PREFILL_STEP, p), :])
        fed = block if trimmed_side else block - n
        for s0, s1 in ([(p + j, p + j + 1) for j in range(fed)] if single else [(p, p + fed)] if fed else []):
            _feed_direct(c, k[..., s0:s1, :], v[..., s0:s1, :])
        info = {}
        if trimmed_side:
            info["can_trim"] = bool(can_trim_prompt_cache([c]))
            info["trimmed"] = int(c.trim(n) if via == "trim" else trim_prompt_cache([c], n))
        readings = [read_cache(c)]
        at = p + block - n
        for m in continuation:
            _feed_direct(c, k[..., at:at + m, :], v[..., at:at + m, :])
            at += m
            readings.append(read_cache(c))
        sides.append((readings, info))
    (op, info), (ref, _) = sides
    d = merge_diffs(*[compare_readings([a], [b]) for a, b in zip(op, ref)])
    return {"diff": d, **info}
