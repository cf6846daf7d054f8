"""The state sweep's shared ground: its constants, the model forward and head, prefixes, setups and token streams."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import GemmdriftError
from .reading import Diff, to_numpy, logit_diff


KS = (1, 2, 3, 4)  # draft tokens per verification block
WHERE = ("below", "at", "past", "far")  # prefix length relative to the sliding window
PREFILL_STEP = 512  # speculative_generate_step's default prefill chunk
CONTINUATION = 3  # tokens of the block fed after an operation (a verify:2 block)
COMPUTE_LIMIT_EXTRA = 16  # the real prefill covers the shortest prefix + this; longer prefixes repeat it
KV_BITS = 8  # mlx-lm's --kv-bits for the QuantizedKVCache setup
OPTIONAL_SETUPS = ("ConcatenateKVCache",)  # model cases only with --caches naming them
DEFAULT_KS = {"QuantizedKVCache": (2,)}  # rollback draft counts by cache when none are given
# Prefix positions by cache when none are given: CPU quantized attention is slow over long caches, and a
# QuantizedKVCache's mechanics do not depend on the window.
DEFAULT_WHERE = {"QuantizedKVCache": ("below", "past")}

OPERATIONS = {
    "rollback": "generate.speculative_generate_step/_rewind_cache -> cache.trim_prompt_cache",
    "trim": "cache.<class>.trim",
    "trim_prompt_cache": "cache.can_trim_prompt_cache + cache.trim_prompt_cache",
    "save_load": "cache.save_prompt_cache + cache.load_prompt_cache",
    "server_reuse": "cache.LRUPromptCache.fetch_nearest_cache (PromptTrie.search, trim_prompt_cache)",
    "batch": "cache.<class>.merge + extend/filter + extract",
    # Not in the default sweep (the tracked counts stay comparable); run with --ops or --cache-impl.
    "draft_trim": "generate.speculative_generate_step/_rewind_cache -> trim_prompt_cache(draft_cache) after T=1 drafts",
}
DEFAULT_OPERATIONS = tuple(o for o in OPERATIONS if o != "draft_trim")


class LastRow:
    """Stands in for the final norm: keeps the normed last row and ends the forward pass (no LM head)."""

    def __init__(self, norm, sink: list):
        self._norm, self._sink = norm, sink

    def __getattr__(self, name):
        return getattr(self._norm, name)

    def __call__(self, x, *args, **kwargs):
        from ..model.taps import StopForward

        y = self._norm(x, *args, **kwargs)
        self._sink.append(y[:, -1:])
        raise StopForward


def forward(model, tokens: Sequence[int], cache: list, keep_last: bool = False):
    """Feed ``tokens`` as one block; update ``cache``; the normed last row (1, 1, hidden) if asked, else None.

    The LM head never runs here (:func:`head` runs it on the rows that are read).
    """
    import mlx.core as mx

    from ..model.taps import StopForward, find_final_norm

    owner, name = find_final_norm(model)
    norm = owner[name]
    sink: list = []
    owner[name] = LastRow(norm, sink)
    try:
        model(mx.array(np.asarray(tokens, dtype=np.uint32))[None], cache=cache)
    except StopForward:
        pass
    finally:
        owner[name] = norm
    row = sink[0] if (sink and keep_last) else None
    mx.eval([row] if row is not None else [], [c.state for c in cache if c is not None])
    return row


def head(model, rows: list) -> np.ndarray:
    """Logits of stacked normed rows (one LM-head call for all rows, float32 numpy)."""
    import mlx.core as mx

    h = mx.concatenate(rows, axis=1)
    inner = getattr(model, "model", None)
    if "lm_head" in model:
        out = model.lm_head(h)
    elif inner is not None and hasattr(inner, "embed_tokens"):
        out = inner.embed_tokens.as_linear(h)
    else:
        raise GemmdriftError("cannot find the model's LM head (lm_head or tied embed_tokens)")
    cap = getattr(getattr(model, "args", None), "final_logit_softcapping", None)
    if cap:
        out = mx.tanh(out / cap) * cap
    mx.eval(out)
    return to_numpy(out[0])


def logit_diffs(model, pairs: list[tuple[Any, Any]]) -> list[Diff]:
    """Next-position logits compared for each (operation row, reference row) of normed final hidden states.

    Rows that are bit-identical give bit-identical logits (the same deterministic LM head on the
    same input), so the head runs only on pairs that differ, all of them in one call.
    """
    import mlx.core as mx

    out = [Diff() for _ in pairs]
    differ = [i for i, (a, b) in enumerate(pairs) if not bool(mx.array_equal(a, b).item())]
    if differ:
        logits = head(model, [x for i in differ for x in pairs[i]])
        for j, i in enumerate(differ):
            out[i] = logit_diff(logits[2 * j], logits[2 * j + 1])
            if out[i].identical:  # the hidden rows differ, the logits do not: still not bit-identical state
                out[i] = Diff(True, False, 0.0, 0.0, 0.0, why="final hidden state differs")
    return out


@dataclass
class Prefix:
    """Keys and values of a real prefill (every layer a KVCache), and the token stream."""

    tokens: list[int]
    keys: list  # per layer, (1, kv_heads, computed, head_dim)
    values: list
    computed: int  # positions really computed
    seconds: float

    def kv(self, layer: int, n: int, dtype=None):
        """Positions 0..n-1 of one layer (repeating the computed ones past ``computed``)."""
        import mlx.core as mx

        k, v = self.keys[layer], self.values[layer]
        if n > self.computed:
            idx = mx.array(np.arange(n) % self.computed)
            k, v = mx.take(k, idx, axis=2), mx.take(v, idx, axis=2)
        else:
            k, v = k[..., :n, :], v[..., :n, :]
        if dtype is not None:
            k, v = k.astype(dtype), v.astype(dtype)
        return k, v


def compute_prefix(lm, tokens: Sequence[int], n: int, chunk: int = PREFILL_STEP) -> Prefix:
    """One real prefill of ``tokens[:n]`` with a KVCache in every layer (no LM head)."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    t0 = time.perf_counter()
    cache = [KVCache() for _ in lm.model.layers]
    for s in range(0, n, chunk):
        forward(lm.model, tokens[s:min(s + chunk, n)], cache)
        mx.clear_cache()
    keys = [c.keys[..., :n, :] for c in cache]
    values = [c.values[..., :n, :] for c in cache]
    mx.eval(keys, values)
    return Prefix(list(map(int, tokens)), keys, values, n, time.perf_counter() - t0)


def fill(c, k, v, chunk: int = PREFILL_STEP) -> None:
    """Pour keys/values into a cache through its own ``update_and_fetch``, ``chunk`` positions at a time."""
    import mlx.core as mx

    n = k.shape[2]
    for s in range(0, n, chunk):
        if hasattr(c, "maybe_trim_front"):
            c.maybe_trim_front()  # as llama4 does before every forward pass
        c.update_and_fetch(k[..., s:min(s + chunk, n), :], v[..., s:min(s + chunk, n), :])
    mx.eval(c.state)


@dataclass
class Setup:
    """A list of caches for a model: how to make it empty, and what it is called in the table."""

    name: str  # the cache class under test
    make: Callable[[Any], list] | None  # model -> fresh caches; None: not applicable
    note: str = ""
    post: Callable[[list], list] | None = None  # applied after the prefix is poured in (kv_bits path)
    plugin: bool = False  # a --cache-impl under test: where it raises, the case is REFUSED
    trim_makers: dict[str, Callable[[], Any]] | None = None  # its classes for the model-free trim cases

    def build(self, lm, prefix: Prefix, n: int, dtype=None) -> list:
        cache = self.make(lm.model)
        for i, c in enumerate(cache):
            k, v = prefix.kv(i, n, dtype)
            if n:
                fill(c, k, v)
        if self.post is not None:
            cache = self.post(cache)
        return cache


def _kv_group(lm) -> int:
    dims = [getattr(lay.self_attn, "head_dim", None) for lay in lm.model.layers if hasattr(lay, "self_attn")]
    d = next((x for x in dims if x), 64)
    return 64 if d % 64 == 0 else 32


def model_setups(lm) -> list[Setup]:
    """The cache lists mlx-lm runs this model with (plus the simple classes it can also run with)."""
    from mlx_lm.generate import maybe_quantize_kv_cache
    from mlx_lm.models import cache as C

    own = C.make_prompt_cache(lm.model)
    own_classes = sorted({type(c).__name__ for c in own})
    n = len(lm.model.layers)
    standard = all(hasattr(lay, "self_attn") for lay in lm.model.layers)
    group = _kv_group(lm)

    def quantize(cache):
        maybe_quantize_kv_cache(cache, quantized_kv_start=0, kv_group_size=group, kv_bits=KV_BITS)
        return cache

    out = [Setup("KVCache", (lambda m: [C.KVCache() for _ in range(n)]) if standard else None,
                 "every layer a KVCache (sliding layers masked by the window)")]
    if any(isinstance(c, C.RotatingKVCache) for c in own):
        out.append(Setup("RotatingKVCache", lambda m: C.make_prompt_cache(m),
                         f"the model's own make_prompt_cache: {', '.join(own_classes)}"))
    else:
        out.append(Setup("RotatingKVCache", None, f"make_prompt_cache gives {', '.join(own_classes)}: no sliding window"))
    out.append(Setup("QuantizedKVCache", (lambda m: [C.KVCache() for _ in range(n)]) if standard else None,
                     f"kv_bits={KV_BITS}, kv_group_size={group}, quantized_kv_start=0 (maybe_quantize_kv_cache); "
                     "mlx-lm cannot quantize a RotatingKVCache (to_quantized raises NotImplementedError), so every "
                     "layer starts as a KVCache", post=quantize))
    concat = hasattr(C, "ConcatenateKVCache")
    out.append(Setup("ConcatenateKVCache", (lambda m: [C.ConcatenateKVCache() for _ in range(n)])
                     if (standard and concat) else None,
                     "every layer a ConcatenateKVCache" if concat else "not in this mlx-lm"))
    return out


def prefix_lengths(window: int | None, k_max: int = max(KS)) -> dict[str, int]:
    """Prefix lengths (tokens in the cache before the operation) relative to the sliding window.

    below: the whole verification block stays inside the window; at: the block crosses it;
    past: just past it; far: three windows in.
    """
    w = window or 64
    below = max(1, min(w // 2, w - k_max - 2))
    return {"below": below, "at": w - 2, "past": w + 3, "far": 3 * w}


def window_of(lm) -> int | None:
    w = lm.description.sliding_window
    return int(w) if w else None


def token_stream(lm, n: int, seed: int = 0) -> list[int]:
    """Real text when the model has a tokenizer (the built-in essay, repeated), else seeded random ids."""
    if lm.tokenizer is not None:
        from ..prompts import builtin_stream

        return builtin_stream(lm, n)
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(2, lm.vocab_size, size=n)]


def other_token(t: int, vocab: int) -> int:
    """A token that is not ``t`` (a rejected draft, a correction)."""
    return (t + 1) % vocab


def material(tokens: Sequence[int], p: int, n: int) -> list[int]:
    """``n`` tokens to feed at a prefix of length ``p`` (the stream there, or its tail for repeated prefixes)."""
    if p + n <= len(tokens):
        return list(tokens[p:p + n])
    return list(tokens[len(tokens) - n:])


def fed_after_rollback(mat: list[int], n: int, vocab: int) -> list[int]:
    """The block fed after a rollback that kept n drafts: the correction (not draft n+1), then the stream."""
    kmax = max(KS)
    c = other_token(mat[1 + n], vocab)  # mat[1 + n] is draft n+1 (or, for n = kmax, the bonus position's token)
    return [c] + mat[2 + kmax: 1 + kmax + CONTINUATION]
