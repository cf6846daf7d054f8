"""mlx_lm.server's prompt-cache reuse (LRUPromptCache.fetch_nearest_cache)."""

from __future__ import annotations

from typing import Any

from ..errors import GemmdriftError
from .reading import compare_readings, merge_diffs, read_caches
from .common import Prefix, Setup, other_token, material, forward, logit_diffs


def lru_prompt_cache_class():
    """mlx-lm's server prompt cache (``models/cache.py`` in 0.32; ``server.py`` before), or None."""
    from mlx_lm.models import cache as C

    if hasattr(C, "LRUPromptCache"):
        return C.LRUPromptCache
    try:
        from mlx_lm import server
    except Exception:  # the server's own imports may be missing
        return None
    return getattr(server, "LRUPromptCache", None)


def server_case(lm, setup: Setup, prefix: Prefix, p: int, kind: str, dtype=None) -> dict[str, Any]:
    """mlx-lm server's prompt-cache reuse: a cached conversation of ``p + 4`` tokens, then a new request.

    kind: 'longer' (the cached tokens plus 4 more), 'shorter' (the first ``p`` tokens),
    'branch' (the first ``p`` tokens, then 4 others). The new request is served from
    ``LRUPromptCache.fetch_nearest_cache`` (a deep copy of the stored cache, trimmed to the
    common prefix when that is shorter) and the rest of its tokens; the reference
    computes the request's tokens from a cache of its common prefix that was never stored.
    """
    LRUPromptCache = lru_prompt_cache_class()
    vocab = lm.vocab_size
    stored_len = p + 4
    toks = prefix.tokens if stored_len + 4 <= len(prefix.tokens) else None
    conv = list(prefix.tokens[:stored_len]) if toks is not None else (
        list(prefix.tokens[:p]) + material(prefix.tokens, p, 4))
    extra = material(prefix.tokens, stored_len, 4)
    if kind == "longer":
        request = conv + extra
    elif kind == "shorter":
        request = conv[:p]
    elif kind == "branch":
        request = conv[:p] + [other_token(t, vocab) for t in conv[p:]]
    else:
        raise GemmdriftError(f"unknown server case {kind!r}")
    lru = LRUPromptCache(max_size=4)
    stored = setup.build(lm, prefix, p, dtype)
    forward(lm.model, conv[p:], stored)  # the conversation's last 4 tokens, as the server's generation step
    lru.insert_cache("model", conv, stored)
    cache, rest = lru.fetch_nearest_cache("model", request)
    reused = len(request) - len(rest)
    if cache is None:
        return {"reused": 0, "rest": len(rest), "diff": None}
    if not rest:
        return {"reused": reused, "rest": 0, "diff": None}
    # Reference: the request's first `reused` tokens in a cache built the same way, never stored or trimmed.
    common = 0
    while common < min(len(conv), len(request)) and conv[common] == request[common]:
        common += 1
    ref = setup.build(lm, prefix, p, dtype)
    if reused > p:
        forward(lm.model, conv[p:reused], ref)
    elif reused < p:
        ref = setup.build(lm, prefix, reused, dtype)
    after = read_caches(ref)
    fetched = read_caches(cache)
    h_op = forward(lm.model, rest, cache, keep_last=True)
    h_ref = forward(lm.model, rest, ref, keep_last=True)
    d = merge_diffs(compare_readings(fetched, after), compare_readings(read_caches(cache), read_caches(ref)),
                    *logit_diffs(lm.model, [(h_op, h_ref)]))
    return {"reused": reused, "rest": len(rest), "common": common, "diff": d}
