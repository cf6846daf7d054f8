"""State exactness: every way mlx-lm rewinds, reuses or reshapes a KV cache, checked bit for bit.

For each case an *operation* (a speculative rollback, a trim, a save/load round
trip, a server prompt-cache reuse, a batch join or leave) runs on a cache, and a
*reference* computes the same tokens from the same starting state without the
operation, with the same blocks, so that an exact implementation gives
bit-identical results. Both sides are then compared:

* the cache contents in temporal order: every entry the next query can still
  attend to (for a ``RotatingKVCache`` the last ``max_size - 1`` entries, read
  through mlx-lm's own ``_temporal_order``), the offset and the class's other
  state fields (``keep``, ``max_size``, ``bits``, ...), right after the
  operation and again after the generator continues;
* the logits of the next position after the continuation.

Verdicts (:class:`gemmdrift.result.Verdict`): **EXACT** (bit-identical);
**ROUNDING** (same structure, the numbers differ, and at float32 the difference
shrinks by at least 100x, the precision ladder of ``gemmdrift stack``; with
``envelope`` given, also max|Δlogit| within it); **STATE BUG** (different
offsets or entries, a difference that does not shrink, or an operation the
library refused while the generator carried on, e.g. ``trim_prompt_cache``
returning 0); **not applicable** (the model has no cache the operation applies
to); **not checked** (a cache class this module does not know, e.g. from a
newer mlx-lm).

Where the code under test lives (mlx-lm 0.32.2, ``site-packages/mlx_lm``):
``models/cache.py`` (the cache classes, ``trim``/``is_trimmable``,
``can_trim_prompt_cache``/``trim_prompt_cache``, ``save_prompt_cache``/
``load_prompt_cache``, ``LRUPromptCache``/``PromptTrie``, ``BatchKVCache``/
``BatchRotatingKVCache`` ``merge``/``extend``/``filter``/``extract``) and
``generate.py`` (``speculative_generate_step``, whose ``_rewind_cache`` calls
``trim_prompt_cache(model_cache, num_draft - num_accept)`` and ignores what it
returns; ``maybe_quantize_kv_cache``, the ``kv_bits`` path).

**Prefix states.** Every case of one model starts from caches filled with the
keys and values of one real prefill of the prompt (all layers ``KVCache``, in
chunks, no LM head), poured into each cache class through its own
``update_and_fetch`` in chunks of ``prefill_step`` (512, what
``speculative_generate_step`` uses), so each class ends in the layout mlx-lm
gives it. ``QuantizedKVCache`` comes from ``maybe_quantize_kv_cache`` (kv_bits 8,
``quantized_kv_start`` 0). The prefill covers the shortest prefix (+16 tokens,
``compute_limit``); longer prefixes repeat the computed keys and values (the
cache's offset, ring position and layout are those of the long prefix, the
content repeats; both sides start from the same state, so the comparison is as
strict as with a computed prefix, at a fraction of the prefill time).

**Same schedule.** A rollback feeds ``[y, d1..dk]`` as one block, rejects the
last ``r`` drafts and continues with a block ``[c, x1, x2]``. Its reference feeds
``[y, d1..dn]`` (n = k - r) as one block and the same continuation block. The
kept rows are then computed in blocks of k+1 and n+1 rows: on a backend whose
kernels are row-invariant (measured for this CPU backend by ``gemmdrift
kernels``) an exact rollback is bit-identical; elsewhere block-size rounding
shows up as ROUNDING, never as a state bug.
"""

from __future__ import annotations

import copy
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import pandas as pd

from .errors import GemmdriftError
from .result import Result, Verdict, env_labels, tidy

KS = (1, 2, 3, 4)  # draft tokens per verification block
WHERE = ("below", "at", "past", "far")  # prefix length relative to the sliding window
PREFILL_STEP = 512  # speculative_generate_step's default prefill chunk
CONTINUATION = 3  # tokens of the block fed after an operation (a verify:2 block)
COMPUTE_LIMIT_EXTRA = 16  # the real prefill covers the shortest prefix + this; longer prefixes repeat it
LADDER_ROUNDING_SHRINK = 100.0  # as gemmdrift.stack: rounding shrinks by >= 100x at float32
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

# Cache classes of mlx_lm.models.cache this module knows how to read in temporal order.
KNOWN_CLASSES = ("KVCache", "RotatingKVCache", "QuantizedKVCache", "ConcatenateKVCache", "ChunkedKVCache",
                 "CacheList", "ArraysCache", "BatchKVCache", "BatchRotatingKVCache")
_NOT_CACHES = ("TokenBuffer", "PromptTrie", "PromptTrieResult", "LRUPromptCache")


def mlx_lm_version() -> str:
    from .envinfo import _version

    return str(_version("mlx-lm") or "")


def cache_classes() -> list[str]:
    """Every cache class defined in the installed ``mlx_lm.models.cache`` (subclasses of ``_BaseCache``)."""
    from mlx_lm.models import cache as C

    base = getattr(C, "_BaseCache", None)
    out = []
    for name, obj in vars(C).items():
        if isinstance(obj, type) and obj.__module__ == C.__name__ and not name.startswith("_"):
            if base is not None and issubclass(obj, base) and obj is not base and name not in _NOT_CACHES:
                out.append(name)
    return out


# --------------------------------------------------------------------------- reading a cache


class _Absent:
    """Stands in for a cache class the installed mlx-lm does not have (isinstance is always False)."""


def _cls(name: str):
    from mlx_lm.models import cache as C

    return getattr(C, name, _Absent)


def _np(x) -> np.ndarray:
    import mlx.core as mx

    if x.dtype in (mx.bfloat16, mx.float16):
        x = x.astype(mx.float32)
    return np.array(x, copy=True)


def _live(v, n: int, keep: int = 0):
    """The last ``n`` entries (axis 2) of a temporal-order array, plus its first ``keep``."""
    import mlx.core as mx

    if keep and v.shape[2] > n:
        return mx.concatenate([v[..., :keep, :], v[..., v.shape[2] - (n - keep):, :]], axis=2)
    return v[..., v.shape[2] - n:, :] if v.shape[2] >= n else v


def read_cache(c) -> dict[str, Any]:
    """What the next query of a cache can attend to, in temporal order, and its state fields.

    Returns ``{"class", "offset", "fields", "arrays", "short"}``: ``arrays`` is a
    list of mlx arrays (keys and values; three each for a quantized cache),
    ``short`` is True when the cache holds fewer live entries than its offset
    says it should. Raises KeyError for a class this module does not know.
    """
    from mlx_lm.models import cache as C

    name = type(c).__name__
    if isinstance(c, _cls("CacheList")):
        parts = [read_cache(x) for x in c.caches]
        return {"class": name, "offset": tuple(p["offset"] for p in parts),
                "fields": tuple((p["class"], p["fields"]) for p in parts),
                "arrays": [a for p in parts for a in p["arrays"]], "short": any(p["short"] for p in parts)}
    if isinstance(c, (_cls("BatchKVCache"), _cls("BatchRotatingKVCache"))):
        import mlx.core as mx

        mx.eval(c.offset, c.left_padding)
        if c.offset.size != 1:
            raise GemmdriftError("read_cache reads one-sequence batch caches; extract() the sequence first")
        return read_cache(c.extract(0))
    if isinstance(c, C.RotatingKVCache) or _rotating_like(c):
        if c.keys is None:
            return {"class": name, "offset": c.offset, "fields": (c.keep, c.max_size), "arrays": [], "short": False}
        n = min(c.offset, c.max_size - 1)
        k, v = c._temporal_order(c.keys), c._temporal_order(c.values)
        if k.shape[2] > c.offset:
            k, v = k[..., : c.offset, :], v[..., : c.offset, :]
        return {"class": name, "offset": c.offset, "fields": (c.keep, c.max_size),
                "arrays": [_live(k, n, c.keep), _live(v, n, c.keep)], "short": k.shape[2] < n}
    if isinstance(c, C.QuantizedKVCache):
        arrays = [] if c.keys is None else [x[..., : c.offset, :] for x in (*c.keys, *c.values)]
        short = c.keys is not None and c.keys[0].shape[2] < c.offset
        return {"class": name, "offset": c.offset, "fields": (c.group_size, c.bits), "arrays": arrays, "short": short}
    if isinstance(c, _cls("ConcatenateKVCache")):  # keys_and_values() ignores the offset: all keys are attended
        arrays = [] if c.keys is None else [c.keys, c.values]
        return {"class": name, "offset": c.offset, "fields": (), "arrays": arrays, "short": False}
    if isinstance(c, _cls("ChunkedKVCache")):
        end = c.offset - c.start_position
        arrays = [] if c.keys is None else [c.keys[..., :end, :], c.values[..., :end, :]]
        return {"class": name, "offset": c.offset, "fields": (c.chunk_size, c.start_position), "arrays": arrays,
                "short": c.keys is not None and c.keys.shape[2] < end}
    if type(c) is C.KVCache or (isinstance(c, (C.KVCache, _Foreign)) and name not in KNOWN_CLASSES):
        # KVCache and subclasses (e.g. a planted one in the tests) are read as KVCache.
        arrays = [] if c.keys is None else [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]
        return {"class": name, "offset": c.offset, "fields": (), "arrays": arrays,
                "short": c.keys is not None and c.keys.shape[2] < c.offset}
    raise KeyError(name)


def _rotating_like(c) -> bool:
    """A plug-in cache with RotatingKVCache's fields (read as one: temporal order, last max_size - 1 entries)."""
    return all(hasattr(c, a) for a in ("keys", "values", "offset", "max_size", "keep", "_temporal_order"))


class _ForeignMeta(type):
    """isinstance(c, _Foreign) -- a plug-in cache with KVCache's fields (keys, values, offset): read as one."""

    def __instancecheck__(cls, c):
        return type(c).__name__ not in KNOWN_CLASSES and all(hasattr(c, a) for a in ("keys", "values", "offset"))


_Foreign = _ForeignMeta("_Foreign", (), {})


def read_caches(cache: Sequence[Any]) -> list[dict[str, Any]]:
    return [read_cache(c) for c in cache]


@dataclass
class Diff:
    """How two cache readings (and optionally two logit rows) differ."""

    structure: bool = True  # same classes, offsets, fields and entry counts
    identical: bool = True  # bit-identical everywhere
    max_abs: float = 0.0  # largest |difference| of any cached entry
    rel_l2: float = 0.0  # relative L2 over all cached entries compared
    max_abs_dlogit: float = 0.0
    why: str = ""
    layers: list[int] = field(default_factory=list)  # layers that differ


def compare_readings(a: list[dict], b: list[dict]) -> Diff:
    """Compare two :func:`read_caches` results, entry by entry in temporal order."""
    import mlx.core as mx

    d = Diff()
    num = den = 0.0
    if len(a) != len(b):
        return Diff(False, False, math.inf, math.inf, why=f"{len(a)} vs {len(b)} layers")
    for i, (x, y) in enumerate(zip(a, b)):
        if x["class"] != y["class"] or x["fields"] != y["fields"]:
            d.structure = d.identical = False
            d.why = d.why or f"layer {i}: {x['class']}{x['fields']} vs {y['class']}{y['fields']}"
            d.layers.append(i)
            continue
        if x["offset"] != y["offset"]:
            d.structure = d.identical = False
            d.why = d.why or f"layer {i} ({x['class']}): offset {x['offset']} vs {y['offset']}"
            d.layers.append(i)
            continue
        if x["short"] or y["short"] or len(x["arrays"]) != len(y["arrays"]) or any(
                p.shape != q.shape for p, q in zip(x["arrays"], y["arrays"])):
            d.structure = d.identical = False
            d.why = d.why or (f"layer {i} ({x['class']}): live entries "
                              f"{[tuple(p.shape) for p in x['arrays']]} vs {[tuple(q.shape) for q in y['arrays']]}")
            d.layers.append(i)
            continue
        differs = False
        for p, q in zip(x["arrays"], y["arrays"]):
            if p.dtype != q.dtype:
                d.structure = d.identical = False
                d.why = d.why or f"layer {i}: dtype {p.dtype} vs {q.dtype}"
                differs = True
                break
            if not bool(mx.array_equal(p, q).item()):
                differs = True
                pf, qf = p.astype(mx.float32), q.astype(mx.float32)
                diff = pf - qf
                d.max_abs = max(d.max_abs, float(mx.max(mx.abs(diff)).item()))
                num += float(mx.sum(diff * diff).item())
                den += float(mx.sum(pf * pf).item())
            else:
                den += float(mx.sum(mx.square(p.astype(mx.float32))).item())
        if differs:
            d.identical = False
            d.layers.append(i)
            d.why = d.why or f"layer {i} ({x['class']}): entries differ (max |Δ| {d.max_abs:.3g})"
    d.rel_l2 = math.sqrt(num / den) if den > 0 else (0.0 if num == 0 else math.inf)
    return d


def merge_diffs(*diffs: Diff) -> Diff:
    out = Diff()
    for d in diffs:
        out.structure &= d.structure
        out.identical &= d.identical
        out.max_abs = max(out.max_abs, d.max_abs)
        out.rel_l2 = max(out.rel_l2, d.rel_l2)
        out.max_abs_dlogit = max(out.max_abs_dlogit, d.max_abs_dlogit)
        out.why = out.why or d.why
        out.layers = sorted(set(out.layers) | set(d.layers))
    return out


def logit_diff(a: np.ndarray | None, b: np.ndarray | None) -> Diff:
    if a is None or b is None:
        return Diff()
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if np.array_equal(a, b):
        return Diff()
    return Diff(True, False, 0.0, 0.0, float(np.max(np.abs(a - b))), why="next-position logits differ")


def judge(bf: Diff, f32: Diff | None = None, *, refused: bool = False, envelope: float | None = None,
          true_float32: bool = True) -> tuple[Verdict, str, float]:
    """The verdict of one case: (verdict, reason, ladder shrink or NaN).

    Args:
        bf: the difference at the model's dtype.
        f32: the same case at float32 (the precision ladder), when it was run.
        refused: the library refused the operation (e.g. ``trim_prompt_cache`` returned 0)
            and the generator went on as if it had succeeded.
        envelope: largest max|Δlogit| still called rounding (None: the ladder alone decides).
        true_float32: the float32 rerun was true float32 (:func:`gemmdrift.runenv.rung_true_float32`); on a
            TF32 rung rounding shrinks only ~8x, so a drift that shrank less than rounding would is UNRELIABLE,
            not a STATE BUG.
    """
    from .runenv import unreliable_reason

    if refused:
        why = "refused (trimmed nothing) and generation carried on as if it had"
        return Verdict.STATE_BUG, why + (f"; {bf.why}" if bf.why else ""), math.nan
    if bf.identical:
        return Verdict.EXACT, "bit-identical", math.nan
    if not bf.structure:
        return Verdict.STATE_BUG, bf.why, math.nan
    if f32 is None:
        return Verdict.STATE_BUG, bf.why + " (no precision ladder run)", math.nan
    if not f32.structure:
        return Verdict.STATE_BUG, "at float32: " + f32.why, math.nan
    lo = max(bf.rel_l2, bf.max_abs_dlogit)
    hi = max(f32.rel_l2, f32.max_abs_dlogit)
    shrink = math.inf if hi == 0 else lo / hi
    pieces = []
    for name, lo_v, hi_v in (("cache rel L2", bf.rel_l2, f32.rel_l2), ("max|Δlogit|", bf.max_abs_dlogit,
                                                                       f32.max_abs_dlogit)):
        if lo_v > 0:
            s = math.inf if hi_v == 0 else lo_v / hi_v
            pieces.append((name, s))
            shrink = min(shrink, s)
    if envelope is not None and bf.max_abs_dlogit > envelope:
        return Verdict.STATE_BUG, f"max|Δlogit| {bf.max_abs_dlogit:.3g} is outside the {envelope:.3g} envelope", shrink
    detail = ", ".join(f"{n} shrinks {s:.3g}x" for n, s in pieces)
    if shrink >= LADDER_ROUNDING_SHRINK:
        return Verdict.ROUNDING, f"{bf.why}; at float32 {detail}: rounding", shrink
    if not true_float32:
        return Verdict.UNRELIABLE, f"{bf.why}; at float32 {detail}, but {unreliable_reason()}", shrink
    return Verdict.STATE_BUG, f"{bf.why}; at float32 {detail}: does not shrink like rounding", shrink


# --------------------------------------------------------------------------- running the model


class _LastRow:
    """Stands in for the final norm: keeps the normed last row and ends the forward pass (no LM head)."""

    def __init__(self, norm, sink: list):
        self._norm, self._sink = norm, sink

    def __getattr__(self, name):
        return getattr(self._norm, name)

    def __call__(self, x, *args, **kwargs):
        from .taps import StopForward

        y = self._norm(x, *args, **kwargs)
        self._sink.append(y[:, -1:])
        raise StopForward


def forward(model, tokens: Sequence[int], cache: list, keep_last: bool = False):
    """Feed ``tokens`` as one block; update ``cache``; the normed last row (1, 1, hidden) if asked, else None.

    The LM head never runs here (:func:`head` runs it on the rows that are read).
    """
    import mlx.core as mx

    from .taps import StopForward, find_final_norm

    owner, name = find_final_norm(model)
    norm = owner[name]
    sink: list = []
    owner[name] = _LastRow(norm, sink)
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
    return _np(out[0])


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


# --------------------------------------------------------------------------- cache setups of a model


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


# --------------------------------------------------------------------------- windows and prefixes


def prefix_lengths(window: int | None, k_max: int = max(KS)) -> dict[str, int]:
    """Prefix lengths (tokens in the cache before the operation) relative to the sliding window.

    below: the whole verification block stays inside the window; at: the block crosses it;
    past: just past it; far: three windows in.
    """
    w = window or 64
    below = max(1, min(w // 2, w - k_max - 2))
    return {"below": below, "at": w - 2, "past": w + 3, "far": 3 * w}


def _window(lm) -> int | None:
    w = lm.description.sliding_window
    return int(w) if w else None


def _stream(lm, n: int, seed: int = 0) -> list[int]:
    """Real text when the model has a tokenizer (the built-in essay, repeated), else seeded random ids."""
    if lm.tokenizer is not None:
        from .prompts import builtin_stream

        return builtin_stream(lm, n)
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(2, lm.vocab_size, size=n)]


def _alt(t: int, vocab: int) -> int:
    """A token that is not ``t`` (a rejected draft, a correction)."""
    return (t + 1) % vocab


def _material(tokens: Sequence[int], p: int, n: int) -> list[int]:
    """``n`` tokens to feed at a prefix of length ``p`` (the stream there, or its tail for repeated prefixes)."""
    if p + n <= len(tokens):
        return list(tokens[p:p + n])
    return list(tokens[len(tokens) - n:])


# --------------------------------------------------------------------------- a: speculative rollback


def _continuation(mat: list[int], n: int, vocab: int) -> list[int]:
    """The block fed after a rollback that kept n drafts: the correction (not draft n+1), then the stream."""
    kmax = max(KS)
    c = _alt(mat[1 + n], vocab)  # mat[1 + n] is draft n+1 (or, for n = kmax, the bonus position's token)
    return [c] + mat[2 + kmax: 1 + kmax + CONTINUATION]


def _rollback_side(lm, setup: Setup, prefix: Prefix, p: int, mat: list[int], k: int, r: int, dtype=None):
    """One rollback case, both sides, from scratch (used for the precision ladder)."""
    from mlx_lm.models.cache import trim_prompt_cache

    y, drafts = mat[0], mat[1:1 + max(KS)]
    n = k - r
    cont = _continuation(mat, n, lm.vocab_size)
    base = setup.build(lm, prefix, p, dtype)
    ref = copy.deepcopy(base)
    forward(lm.model, [y] + drafts[:n], ref)
    ref_op = read_caches(ref)
    h_ref = forward(lm.model, cont, ref, keep_last=True)
    op = base
    forward(lm.model, [y] + drafts[:k], op)
    trimmed = trim_prompt_cache(op, r)
    op_op = read_caches(op)
    h_op = forward(lm.model, cont, op, keep_last=True)
    d = merge_diffs(compare_readings(op_op, ref_op), compare_readings(read_caches(op), read_caches(ref)),
                    *logit_diffs(lm.model, [(h_op, h_ref)]))
    return d, trimmed


def rollback_cases(lm, setup: Setup, prefix: Prefix, p: int, ks: Sequence[int] = KS) -> list[dict[str, Any]]:
    """Speculative rollback as ``speculative_generate_step`` does it, for every k in ``ks`` and every r.

    Per k: feed ``[y, d1..dk]``, then for each r: ``trim_prompt_cache(cache, r)`` (what
    ``_rewind_cache`` calls; its return value is ignored there), continue with
    ``[c, x1, x2]``. Reference per n = k - r: ``[y, d1..dn]``, the same continuation.
    The blocks shared between cases run once: the block ``[y, d1..dk]`` the operation of k
    trims is the same computation as the reference of n = k's first block, so both copy it.
    """
    from mlx_lm.models.cache import trim_prompt_cache

    vocab = lm.vocab_size
    kmax = max(KS)
    mat = _material(prefix.tokens, p, 2 + kmax + CONTINUATION)
    y, drafts = mat[0], mat[1:1 + kmax]
    base = setup.build(lm, prefix, p)
    conts = {n: _continuation(mat, n, vocab) for n in range(kmax + 1)}
    # The block [y, d1..dn] fed to a fresh copy of the prefix state, once per n: the reference of n continues
    # from a copy of it, and the operation of k (fed k drafts) trims a copy of it (the same computation).
    fed = {}
    for n in range(max(ks) + 1):
        c = copy.deepcopy(base)
        forward(lm.model, [y] + drafts[:n], c)
        fed[n] = c
    refs = {}
    rows_h = []
    for n in range(max(ks) + 1):
        ref = copy.deepcopy(fed[n])
        after_op = read_caches(ref)
        h = forward(lm.model, conts[n], ref, keep_last=True)
        refs[n] = (after_op, read_caches(ref), len(rows_h))
        rows_h.append(h)
    cases = []
    for k in ks:
        for r in range(k + 1):
            n = k - r
            op = copy.deepcopy(fed[k])
            try:
                trimmed = trim_prompt_cache(op, r)  # generate.py _rewind_cache: trim_prompt_cache(model_cache, k - n)
            except Exception as e:  # a plug-in's trim that raises: this case is refused, the others still run
                cases.append({"k": k, "r": r, "n": n, "trimmed": 0, "diff": None, "h": None, "mat": mat,
                              "raised": f"trim_prompt_cache raised {type(e).__name__}: {str(e)[:120]}"})
                continue
            after_op = read_caches(op)
            d = compare_readings(after_op, refs[n][0])
            try:
                h = forward(lm.model, conts[n], op, keep_last=True)
            except Exception as e:  # the generator could not even go on from this state
                d = merge_diffs(d, Diff(False, False, math.inf, math.inf,
                                        why=f"continuing raised {type(e).__name__}: {str(e)[:120]}"))
                cases.append({"k": k, "r": r, "n": n, "trimmed": int(trimmed), "diff": d, "h": None,
                              "h_ref": refs[n][2], "mat": mat})
                continue
            d = merge_diffs(d, compare_readings(read_caches(op), refs[n][1]))
            cases.append({"k": k, "r": r, "n": n, "trimmed": int(trimmed), "diff": d, "h": len(rows_h),
                          "h_ref": refs[n][2], "mat": mat})
            rows_h.append(h)
    live = [c for c in cases if c["h"] is not None and c["diff"] is not None]
    for c, ld in zip(live, logit_diffs(lm.model, [(rows_h[c["h"]], rows_h[c["h_ref"]]) for c in live])):
        c["diff"] = merge_diffs(c["diff"], ld)
    return cases


# --------------------------------------------------------------------------- b: trim, directly and through the list


def _synthetic_kv(n: int, heads: int = 1, dim: int = 64, seed: int = 0):
    import mlx.core as mx

    mx.random.seed(seed)
    # On the CPU stream: the same keys and values on every device (a GPU's erfinv may differ in the last bits).
    k = mx.random.normal((1, heads, n, dim), stream=mx.cpu).astype(mx.bfloat16)
    v = mx.random.normal((1, heads, n, dim), stream=mx.cpu).astype(mx.bfloat16)
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


# --------------------------------------------------------------------------- c: save / load


def save_load_case(lm, setup: Setup, prefix: Prefix, p: int, block: int, dtype=None) -> tuple[Diff, str]:
    """``save_prompt_cache`` then ``load_prompt_cache``, then continue with a block, against the cache never saved."""
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    mat = _material(prefix.tokens, p, block)
    ref = setup.build(lm, prefix, p, dtype)
    before = read_caches(ref)
    with tempfile.TemporaryDirectory(prefix="gemmdrift-state-") as tmp:
        path = os.path.join(tmp, "cache.safetensors")
        save_prompt_cache(path, ref, {"gemmdrift": "state"})
        op = load_prompt_cache(path)
        loaded = read_caches(op)
        h_op = forward(lm.model, mat, op, keep_last=True)
    h_ref = forward(lm.model, mat, ref, keep_last=True)
    d = merge_diffs(compare_readings(loaded, before), compare_readings(read_caches(op), read_caches(ref)),
                    *logit_diffs(lm.model, [(h_op, h_ref)]))
    return d, ""


# --------------------------------------------------------------------------- d: server prompt reuse


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
        list(prefix.tokens[:p]) + _material(prefix.tokens, p, 4))
    extra = _material(prefix.tokens, stored_len, 4)
    if kind == "longer":
        request = conv + extra
    elif kind == "shorter":
        request = conv[:p]
    elif kind == "branch":
        request = conv[:p] + [_alt(t, vocab) for t in conv[p:]]
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


# --------------------------------------------------------------------------- e: batch caches


def batch_vs_alone(lm, seq: Sequence[int], other: Sequence[int], *, op: str, steps: int = 2, before: int = 1,
                   caches: tuple[list, list] | None = None, cache_factory: Callable[[Any], list] | None = None,
                   dtype: str | None = None) -> dict[str, Any]:
    """One sequence decoded in a batch whose membership changes, against the same sequence alone.

    Reusable by any batch-generation check (it takes token lists and the loaded model):
    both sequences are prefilled alone (``seq[:-1]`` and ``other[:-1]``) with the model's
    own caches, which are merged into batch caches with mlx-lm's ``merge`` (``BatchKVCache``,
    ``BatchRotatingKVCache``). Then greedy decoding, T=1 per sequence per step:

    * ``op='extend'``: ``seq`` decodes alone in a batch of one for ``before`` steps, then
      ``other`` joins (``extend``) and both decode ``steps`` more;
    * ``op='filter'``: both decode ``before`` steps, then ``other`` leaves (``filter``) and
      ``seq`` decodes ``steps`` more.

    The reference decodes ``seq`` alone with plain caches, feeding the same tokens. The
    batch schedule is not the reference's (padding, masks, batched matmuls), so this is
    judged with the precision ladder: call it with ``dtype='float32'`` too and pass both
    to :func:`judge`. ``caches``: the two sequences' caches already filled with ``seq[:-1]``
    and ``other[:-1]`` (copied, not changed; their dtype must match the model's), instead of
    prefilling here. Returns ``{"diff": Diff, "steps", "members_after"}``.
    """
    from mlx_lm.models import cache as C

    if op not in ("extend", "filter"):
        raise GemmdriftError(f"unknown batch operation {op!r} (extend or filter)")
    make = cache_factory or (lambda m: C.make_prompt_cache(m))
    old = None
    if dtype is not None and dtype != lm.description.dtype:
        from .models import _cast

        old = lm.description.dtype
        _cast(lm.model, dtype)
    try:
        def prefill(tokens):
            c = make(lm.model)
            if len(tokens) > 1:
                for s in range(0, len(tokens) - 1, PREFILL_STEP):
                    forward(lm.model, tokens[s:min(s + PREFILL_STEP, len(tokens) - 1)], c)
            return c

        if caches is not None:
            alone, oth = copy.deepcopy(caches[0]), copy.deepcopy(caches[1])
        else:
            alone, oth = prefill(seq), prefill(other)
        batch = [type(c).merge([c]) for c in copy.deepcopy(alone)]
        feed_seq = [seq[-1]]
        feed_oth = [other[-1]]
        vocab = lm.vocab_size
        for i in range(before + steps):
            feed_seq.append(int((seq[-1] * 7 + 3 * i + 1) % vocab))
            feed_oth.append(int((other[-1] * 5 + 3 * i + 2) % vocab))
        rows_alone, rows_batch = [], []
        if op == "filter":
            batch = [type(a).merge([a, b]) for a, b in zip(copy.deepcopy(alone), oth)]
        members = 1 if op == "extend" else 2
        for i in range(before + steps):
            if op == "extend" and i == before:
                joined = [type(b).merge([b]) for b in oth]
                for a, b in zip(batch, joined):
                    a.extend(b)
                members = 2
            if op == "filter" and i == before:
                for a in batch:
                    a.filter([0])
                members = 1
            toks = [[feed_seq[i]]] + ([[feed_oth[i]]] if members == 2 else [])
            rows_batch.append(_forward_rows(lm.model, toks, batch))
            rows_alone.append(forward(lm.model, [feed_seq[i]], alone, keep_last=True))
        extracted = [c.extract(0) for c in batch]
        d = merge_diffs(compare_readings(read_caches(extracted), read_caches(alone)),
                        *logit_diffs(lm.model, list(zip(rows_batch, rows_alone))))
        return {"diff": d, "steps": before + steps, "members_after": members}
    finally:
        if old is not None:
            from .models import _cast

            _cast(lm.model, old)


def batch_check(lm, seq: Sequence[int], other: Sequence[int], *, op: str, steps: int = 2, before: int = 1,
                cache_factory: Callable[[Any], list] | None = None, envelope: float | None = None) -> dict[str, Any]:
    """:func:`batch_vs_alone` judged: EXACT, ROUNDING (the float32 rerun shrinks it), STATE BUG (or unreliable:
    a TF32 rerun that shrank too little).

    For batch generation checks elsewhere (e.g. a batch generator's own tests): give the two
    token sequences and the operation; both prefills happen here, at the model's dtype and
    (only when the result differs with the same structure) again at float32.
    Returns ``{"verdict", "reason", "shrink", "diff", "f32"}``.
    """
    kw = dict(op=op, steps=steps, before=before, cache_factory=cache_factory)
    d = batch_vs_alone(lm, seq, other, **kw)["diff"]
    f32 = batch_vs_alone(lm, seq, other, dtype="float32", **kw)["diff"] if (not d.identical and d.structure) else None
    from .runenv import rung_true_float32

    probe = rung_true_float32() if f32 is not None else None  # TF32 float32 cannot tell rounding from a bug
    verdict, reason, shrink = judge(d, f32, envelope=envelope, true_float32=probe is None or probe["true_float32"])
    return {"verdict": verdict, "reason": reason, "shrink": shrink, "diff": d, "f32": f32}


def _forward_rows(model, toks: list[list[int]], cache: list):
    """A batched T=1 step; the normed row of sequence 0."""
    import mlx.core as mx

    from .taps import StopForward, find_final_norm

    owner, name = find_final_norm(model)
    norm = owner[name]
    sink: list = []
    owner[name] = _LastRow(norm, sink)
    try:
        model(mx.array(np.asarray(toks, dtype=np.uint32)), cache=cache)
    except StopForward:
        pass
    finally:
        owner[name] = norm
    row = sink[0][:1]
    mx.eval(row, [c.state for c in cache])
    return row


# --------------------------------------------------------------------------- the sweep


def _row(cache: str, operation: str, where: str, prefix: int | None, window: int | None, params: str,
         verdict: Verdict, reason: str, diff: Diff | None = None, shrink: float = math.nan, **extra) -> dict[str, Any]:
    d = diff or Diff()
    return {"cache": cache, "operation": operation, "where": where, "prefix": prefix,
            "rel_window": (prefix - window) if (prefix is not None and window) else None, "params": params,
            "verdict": str(verdict), "reason": reason, "max_abs": d.max_abs, "rel_l2": d.rel_l2,
            "max_abs_dlogit": d.max_abs_dlogit, "shrink": shrink,
            "layers_differ": ",".join(map(str, d.layers)), "mlx_lm_function": OPERATIONS[operation],
            "mlx_lm_version": mlx_lm_version(), **extra}


class _Float32:
    """The model at float32 for the duration of a block (the precision ladder); bf16 values upcast exactly."""

    def __init__(self, lm):
        self.lm = lm

    def __enter__(self):
        from .models import _cast
        from .runenv import rung_true_float32

        self.old = self.lm.description.dtype
        _cast(self.lm.model, "float32")
        self.probe = rung_true_float32()  # TF32 (CUDA, M5-class GPUs) cannot tell rounding from a bug
        return self

    def __exit__(self, *exc):
        from .models import _cast

        _cast(self.lm.model, self.old)
        return False


def _raised(s: Setup) -> Verdict:
    """The verdict of a case that raised: a plug-in refused it; mlx-lm's own classes keep today's STATE BUG."""
    return Verdict.REFUSED if s.plugin else Verdict.STATE_BUG


def _progress(msg: str) -> None:
    print(f"gemmdrift state: {msg}", file=sys.stderr, flush=True)


def _sweep(lm, operations: Sequence[str], where: Sequence[str] | None, ks: Sequence[int] | None,
           setups: Sequence[Setup] | None, ladder: bool, envelope: float | None, compute_limit: int | None,
           caches: Sequence[str] | None, checkpoint=None) -> dict[str, Any]:
    """The cases of ``operations`` (arguments as :func:`measure_state`, validated): the table's rows in order,
    and what the prefix cost. ``checkpoint`` (:class:`gemmdrift.checkpoint.Checkpoints`): each rollback cell
    (setup x prefix position, the sweep's longest part) is saved before the ladder and loaded on a rerun."""
    where_for = (lambda name: DEFAULT_WHERE.get(name, WHERE)) if where is None else (lambda name, w=tuple(where): w)
    where = tuple(WHERE) if where is None else tuple(where)
    ks_for = (lambda name: DEFAULT_KS.get(name, KS)) if ks is None else (lambda name, ks=tuple(ks): ks)
    ks = tuple(KS) if ks is None else tuple(ks)
    window = _window(lm)
    lengths = {w: p for w, p in prefix_lengths(window, max(max(ks), max(KS))).items() if w in where}
    setups_given = setups
    setups = list(setups) if setups is not None else model_setups(lm)
    if caches is not None:
        setups = [s for s in setups if s.name in caches]
    elif setups_given is None:
        # ConcatenateKVCache is mlx-lm's mock cache (no model makes it for generation): model cases only when
        # asked for by name; the model-free trim cases always cover it.
        setups = [s for s in setups if s.name not in OPTIONAL_SETUPS]
    longest = max(lengths.values()) + 8 + max(KS) + CONTINUATION
    limit = compute_limit if compute_limit is not None else (min(lengths.values()) + COMPUTE_LIMIT_EXTRA)
    computed = min(max(lengths.values()), max(limit, 1))
    tokens = _stream(lm, max(longest, computed + 16))
    need_model = any(o in operations for o in ("rollback", "save_load", "server_reuse", "batch"))
    prefix = None
    if need_model:
        _progress(f"prefill of {computed} tokens (every layer a KVCache) for the prefix states")
        prefix = compute_prefix(lm, tokens, computed)
        _progress(f"  {prefix.seconds:.1f} s")
    rows: list[dict[str, Any]] = []
    ladder_jobs: list[tuple[int, Callable[[], Diff], Diff]] = []
    fp32_probe = None  # the float32 rung's probe, when the ladder ran
    vocab = lm.vocab_size

    def add(row, diff: Diff | None, refused: bool = False, rerun: Callable[[], Diff] | None = None):
        rows.append(row)
        if diff is not None and not refused and not diff.identical and diff.structure and ladder and rerun:
            ladder_jobs.append((len(rows) - 1, rerun, diff))

    def cells(op: str):
        """(setup, where, prefix) of every case of ``op``; a 'not applicable' row for a setup the model lacks."""
        for s in setups:
            if s.make is None:
                rows.append(_row(s.name, op, "", None, window, "", Verdict.NOT_APPLICABLE, s.note))
                continue
            for w, p in lengths.items():
                if w in where_for(s.name):
                    yield s, w, p

    # a. speculative rollback
    if "rollback" in operations:
        for s, w, p in cells("rollback"):
            t0 = time.perf_counter()
            saved = checkpoint.load("rollback-cell", s.name, w, p, check=lambda u: "cases" in u) if checkpoint else None
            if saved is not None:  # the rows as judged before the ladder, and what the ladder needs to rerun them
                mat = _material(prefix.tokens, p, 2 + max(KS) + CONTINUATION)
                for c in saved["cases"]:
                    add(c["row"], Diff(**c["diff"]), c["refused"], (lambda s=s, p=p, k=c["k"], r=c["r"], mat=mat:
                                                                    _rollback_side(lm, s, prefix, p, mat, k, r,
                                                                                   dtype=_f32())[0]))
                _progress(f"rollback {s.name} {w} (prefix {p}): done before (resumed)")
                continue
            cell = []
            try:
                found = rollback_cases(lm, s, prefix, p, ks_for(s.name))
            except Exception as e:  # the cache could not even take the prefix or the block
                found = [{"k": k, "r": r, "raised": f"raised {type(e).__name__}: {str(e)[:120]}"}
                         for k in ks_for(s.name) for r in range(k + 1)]
            for c in found:
                if "raised" in c:  # refused: kept like the others, without a ladder rerun
                    row = _row(s.name, "rollback", w, p, window, f"k={c['k']} r={c['r']}", _raised(s), c["raised"],
                               k=c["k"], r=c["r"], note=s.note)
                    add(row, None, True)
                    cell.append({"row": row, "diff": asdict(Diff()), "refused": True, "k": c["k"], "r": c["r"]})
                    continue
                refused = c["r"] > 0 and c["trimmed"] < c["r"]
                v, why, _ = judge(c["diff"], refused=refused,
                                  envelope=envelope)
                row = _row(s.name, "rollback", w, p, window, f"k={c['k']} r={c['r']}", v, why, c["diff"],
                           k=c["k"], r=c["r"], trimmed=c["trimmed"], note=s.note)
                add(row, c["diff"], refused, (lambda s=s, p=p, c=c: _rollback_side(
                    lm, s, prefix, p, c["mat"], c["k"], c["r"], dtype=_f32())[0]))
                cell.append({"row": row, "diff": asdict(c["diff"]), "refused": refused, "k": c["k"], "r": c["r"]})
            if checkpoint:
                checkpoint.save("rollback-cell", {"cases": cell}, s.name, w, p)
            _progress(f"rollback {s.name} {w} (prefix {p}): {time.perf_counter() - t0:.1f} s")

    # b. trim, directly and through trim_prompt_cache (no model: synthetic keys, window 16)
    if any(o in operations for o in ("trim", "trim_prompt_cache", "draft_trim")):
        syn_window = 16
        syn = prefix_lengths(syn_window, 2)
        facts = class_factories(syn_window)
        plug = {n: f for s in setups for n, f in (s.trim_makers or {}).items()}
        if plug:  # a plug-in is judged on its own classes, at their own window
            facts = plug
        wanted = [name for name in facts if plug or caches is None or name.split("(")[0] in caches]
        for name in wanted:
            make = facts[name]
            syn_window = getattr(make, "window", None) or 16
            syn = prefix_lengths(syn_window, 2)
            for via in ("trim", "trim_prompt_cache", "draft_trim"):
                if via not in operations:
                    continue
                if make == "absent":
                    rows.append(_row(name, via, "", None, None, "", Verdict.NOT_APPLICABLE,
                                     f"mlx-lm {mlx_lm_version()} has no {name.split('(')[0]}"))
                    continue
                if make is None:
                    rows.append(_row(name, via, "", None, None, "", Verdict.NOT_APPLICABLE,
                                     "no trim: a recurrent state (is_trimmable() is False); speculative_generate_step "
                                     "refuses such caches up front", note="model-free, synthetic keys"))
                    continue
                for w, p in syn.items():
                    if w not in where:
                        continue
                    # draft_trim: k = 3 drafting steps of one token, the draft's rewind of k - n - 1, then T=1
                    # (a rejection) or T=2 (all accepted: the last draft and the correction).
                    shapes = (((1, CONTINUATION), (2, CONTINUATION), (1, 1), (2, 1)) if via != "draft_trim"
                              else ((1, 1), (2, 1), (1, 2), (2, 2)))
                    for n, m in shapes:
                        params = (f"block=3 trim={n} then T={m}" if via != "draft_trim"
                                  else f"3 x T=1 trim={n} then T={m}")
                        try:
                            c = trim_case(make, p, 3, n, "trim_prompt_cache" if via == "draft_trim" else via,
                                          continuation=(m,), single=via == "draft_trim")
                        except Exception as e:  # a class that cannot even run the case is reported, not fatal
                            rows.append(_row(name, via, w, p, syn_window, params,
                                             Verdict.REFUSED if name in plug else Verdict.STATE_BUG,
                                             f"raised {type(e).__name__}: {e}", note="model-free, synthetic keys"))
                            continue
                        refused = c["trimmed"] < n
                        v, why, _ = judge(c["diff"], refused=refused and not c["diff"].identical)
                        if v == Verdict.STATE_BUG and not refused and c["diff"].structure:
                            why = c["diff"].why + " (no model here: moving data cannot round)"
                        if refused and c["diff"].identical:
                            why = f"trimmed {c['trimmed']} of {n}, yet the state matches"
                        why = (f"can_trim={c['can_trim']}, trimmed {c['trimmed']} of {n}; " + why)
                        rows.append(_row(name, via, w, p, syn_window, params, v, why, c["diff"],
                                         trimmed=c["trimmed"], note=f"model-free, synthetic keys, window {syn_window}"))
        _progress("trim: done")

    # c. save / load round trip
    if "save_load" in operations:
        for s, w, p in cells("save_load"):
            for block in (1, CONTINUATION):
                try:
                    d, _ = save_load_case(lm, s, prefix, p, block)
                except Exception as e:
                    rows.append(_row(s.name, "save_load", w, p, window, f"continue T={block}", _raised(s),
                                     f"raised {type(e).__name__}: {e}", note=s.note))
                    continue
                v, why, _ = judge(d, envelope=envelope)
                add(_row(s.name, "save_load", w, p, window, f"continue T={block}", v, why, d, note=s.note), d,
                    rerun=lambda s=s, p=p, block=block: save_load_case(lm, s, prefix, p, block, dtype=_f32())[0])
        _progress("save/load: done")

    # d. server prompt reuse
    if "server_reuse" in operations:
        lru = lru_prompt_cache_class()
        fetch = getattr(lru, "fetch_nearest_cache", None)
        for s in setups:
            if fetch is None:
                rows.append(_row(s.name, "server_reuse", "", None, window, "", Verdict.NOT_APPLICABLE,
                                 f"mlx-lm {mlx_lm_version()} has no LRUPromptCache.fetch_nearest_cache"))
                continue
            if s.make is None:
                rows.append(_row(s.name, "server_reuse", "", None, window, "", Verdict.NOT_APPLICABLE, s.note))
                continue
            for w, p in lengths.items():
                if w not in where_for(s.name):
                    continue
                for kind in ("longer", "shorter", "branch"):
                    params = f"{kind}"
                    try:
                        r = server_case(lm, s, prefix, p, kind)
                    except Exception as e:
                        rows.append(_row(s.name, "server_reuse", w, p, window, params, _raised(s),
                                         f"continuing from the fetched cache raised {type(e).__name__}: {str(e)[:120]}",
                                         note=s.note))
                        continue
                    if r["diff"] is None:
                        rows.append(_row(s.name, "server_reuse", w, p, window, params, Verdict.NOT_APPLICABLE,
                                         "the server did not reuse the stored cache (can_trim_prompt_cache is False): "
                                         "it recomputes the request from scratch" if r["reused"] == 0 else
                                         "nothing left to compute", reused=r["reused"], note=s.note))
                        continue
                    v, why, _ = judge(r["diff"], envelope=envelope)
                    add(_row(s.name, "server_reuse", w, p, window, params, v,
                             f"reused {r['reused']} tokens, computed {r['rest']}; {why}", r["diff"],
                             reused=r["reused"], note=s.note), r["diff"],
                        rerun=lambda s=s, p=p, kind=kind: server_case(lm, s, prefix, p, kind, dtype=_f32())["diff"])
        _progress("server reuse: done")

    # e. batch caches
    if "batch" in operations:
        for s in setups:
            if s.plugin:
                rows.append(_row(s.name, "batch", "", None, window, "", Verdict.NOT_APPLICABLE,
                                 "the batch case checks mlx-lm's Batch* classes (a plug-in's merge hands over to them)"))
                continue
            if s.name not in ("KVCache", "RotatingKVCache"):
                continue
            bname = "BatchKVCache" if s.name == "KVCache" else "BatchRotatingKVCache"
            if s.make is None or _cls(bname) is _Absent or not hasattr(_cls(s.name), "merge"):
                rows.append(_row(bname, "batch", "", None, window, "", Verdict.NOT_APPLICABLE,
                                 s.note if s.make is None else f"mlx-lm {mlx_lm_version()} cannot batch {s.name}"))
                continue
            for w, p in lengths.items():
                q = max(1, p // 2 + 1)
                for op in ("extend", "filter"):
                    def run(dtype=None, s=s, p=p, q=q, op=op):
                        seq_cache = s.build(lm, prefix, p, dtype)
                        oth_cache = s.build(lm, prefix, q, dtype)
                        seq = _material(prefix.tokens, p, 1)
                        oth = [_alt(t, vocab) for t in _material(prefix.tokens, q, 1)]
                        return batch_vs_alone(lm, seq, oth, op=op, caches=(seq_cache, oth_cache),
                                              cache_factory=s.make)["diff"]
                    try:
                        d = run()
                    except Exception as e:
                        rows.append(_row(bname, "batch", w, p, window, op, Verdict.STATE_BUG,
                                         f"raised {type(e).__name__}: {e}", note=s.note))
                        continue
                    v, why, _ = judge(d, envelope=envelope)
                    add(_row(bname, "batch", w, p, window, f"{op} (other sequence {q} tokens)", v, why, d,
                             note=f"from the {s.name} setup: {s.note}"), d,
                        rerun=lambda run=run: run(_f32()))
        _progress("batch: done")

    # The precision ladder for cases that differ with the same structure.
    if ladder_jobs:
        _progress(f"precision ladder: {len(ladder_jobs)} cases at float32")
        with _Float32(lm) as rung:
            fp32_probe = rung.probe
            for i, rerun, diff in ladder_jobs:
                f32 = rerun()
                v, why, shrink = judge(diff, f32, envelope=envelope, true_float32=rung.probe["true_float32"])
                rows[i].update(verdict=str(v), reason=why, shrink=shrink, f32_rel_l2=f32.rel_l2,
                               f32_max_abs_dlogit=f32.max_abs_dlogit)
    return {"rows": rows, "lengths": lengths, "setups": {s.name: s.note for s in setups}, "fp32_probe": fp32_probe,
            "computed_prefix": prefix.computed if prefix else 0, "prefix_seconds": prefix.seconds if prefix else 0.0}


def measure_state(lm, *, operations: Sequence[str] = DEFAULT_OPERATIONS, where: Sequence[str] | None = None,
                  ks: Sequence[int] | None = None, setups: Sequence[Setup] | None = None, ladder: bool = True,
                  envelope: float | None = None, compute_limit: int | None = None,
                  caches: Sequence[str] | None = None, workers: int | None = None, checkpoint=None,
                  implementations: dict[str, Any] | None = None) -> Result:
    """Check every cache operation of ``operations`` on the model's caches; one row per case.

    Args:
        lm: the loaded model (:func:`gemmdrift.models.load_model`).
        operations: any of :data:`OPERATIONS`.
        where: prefix lengths relative to the sliding window (:func:`prefix_lengths`). Default: all
            four, except below and past for the QuantizedKVCache; given explicitly, for every cache.
        ks: draft counts for the rollback (every r = 0..k is run). Default: 1..4, except
            k = 2 alone for the QuantizedKVCache (its CPU attention is slow, and its cache
            mechanics do not depend on the window); given explicitly, it applies to every cache.
        setups: cache setups (default :func:`model_setups`; tests pass planted ones).
        ladder: rerun cases that differ (with the same structure) at float32.
        envelope: largest max|Δlogit| still called rounding (None: the ladder decides).
        compute_limit: really compute at most this many prefix positions (default: the
            shortest prefix + 16); longer prefixes repeat the computed keys and values.
        caches: only these cache setups / classes (names as in the table).
        implementations: recorded in the Result's inputs (a --cache-impl's spec, file and sha256).
        workers: processes sharing the sweep (the rollback in one, the other operations in another),
            each loading the model again. Default: 2 on a CPU device with at least 2 cores when the
            sweep has model work on both sides and the model can be loaded again; else 1 (on a GPU the
            processes would only queue on the one device). The table is the same either way.
        checkpoint: an output directory: each finished half of the sweep (:data:`WORKER_GROUPS`) is saved
            under it (:mod:`gemmdrift.checkpoint`) and a rerun loads it; Ctrl-C raises
            :class:`gemmdrift.checkpoint.Interrupted` with the partial Result (planted ``setups``: no checkpoints).
    """
    from .checkpoint import Checkpoints, Interrupted, partial_inputs
    from .envinfo import environment

    unknown_ops = [o for o in operations if o not in OPERATIONS]
    if unknown_ops:
        raise GemmdriftError(f"unknown operation {unknown_ops[0]!r} (choose from {', '.join(OPERATIONS)})")
    bad_where = [w for w in (where or ()) if w not in WHERE]
    if bad_where:
        raise GemmdriftError(f"unknown prefix position {bad_where[0]!r} (choose from {', '.join(WHERE)})")
    if ks is not None and (not ks or min(ks) < 1):
        raise GemmdriftError("draft counts k must be positive")
    if lm.description.synthetic and lm.description.kind == "shape":
        raise GemmdriftError("gemmdrift state needs real weights or a small model (a shape: model is too big to run)")
    t_start = time.perf_counter()
    env = environment()
    impl_extra = {"implementations": implementations} if implementations else {}
    args = dict(where=where, ks=ks, ladder=ladder, envelope=envelope, compute_limit=compute_limit, caches=caches)
    groups = [tuple(o for o in g if o in operations) for g in WORKER_GROUPS]
    groups = [g for g in groups if g]
    n = _workers(lm, workers, groups, setups)
    # One checkpoint per half of the sweep; its rows are the same whichever process ran it.
    ck = Checkpoints(checkpoint if setups is None else None, "state", lm.description, args)
    if ck.dir is None and n == 1:
        groups = [tuple(operations)]  # nothing to keep: the one sweep, one prefix
    saved = {g: ck.load("-".join(g), list(g), check=lambda u: "rows" in u) for g in groups}
    todo = [g for g in groups if saved[g] is None]
    for g in groups:
        if saved[g] is not None:
            _progress(f"{', '.join(g)}: done before (resumed)")
    try:
        if n > 1 and len(todo) > 1:
            from .workers import run_jobs

            _progress(f"{len(todo)} processes share the sweep: " + "; ".join(", ".join(g) for g in todo))
            jobs = [dict(args, operations=g, checkpoint=ck.spec()) for g in todo]
            saved.update(zip(todo, run_jobs(lm, _sweep_job, jobs, n)))  # each also saved its own checkpoint
        else:
            for g in todo:
                saved[g] = _sweep(lm, g, setups=setups, checkpoint=ck if ck.dir else None, **args)
                ck.save("-".join(g), saved[g], list(g))
    except KeyboardInterrupt:
        parts = [p for p in (saved[g] or ck.load("-".join(g), list(g)) for g in groups) if p is not None]
        result = _state_result(lm, operations, where, ks, ladder, envelope, parts, n, env, t_start,
                               {**partial_inputs(len(parts), len(groups), "half of the sweep"), **impl_extra}) if parts else None
        raise Interrupted(result, len(parts), len(groups)) from None
    return _state_result(lm, operations, where, ks, ladder, envelope, [saved[g] for g in groups], n, env, t_start,
                         dict(impl_extra))


def _state_result(lm, operations, where, ks, ladder, envelope, parts, n, env, t_start, extra) -> Result:
    """The Result of :func:`measure_state` from its finished sweep parts."""
    rows = [row for part in parts for row in part["rows"]]
    lengths = parts[0]["lengths"]
    model_part = next((p for p in parts if p["computed_prefix"]), parts[0])
    window = _window(lm)

    # Classes of a newer mlx-lm that this module does not know.
    for name in cache_classes():
        if name not in KNOWN_CLASSES:
            for op in operations:
                rows.append(_row(name, op, "", None, window, "", Verdict.NOT_CHECKED,
                                 f"{name} is a cache class of mlx-lm {mlx_lm_version()} that gemmdrift does not know"))
    seconds = time.perf_counter() - t_start
    table = pd.DataFrame(rows)
    return _result(lm, env, table, {"operations": list(operations), "where": list(where or WHERE),
                                    "prefixes": lengths, "ks": list(ks or KS), "ladder": ladder, "envelope": envelope,
                                    "computed_prefix": model_part["computed_prefix"],
                                    "prefix_seconds": model_part["prefix_seconds"],
                                    "window": window, "setups": {k: v for p in parts for k, v in p["setups"].items()},
                                    "ladder_float32": next((p["fp32_probe"] for p in parts if p.get("fp32_probe")),
                                                           None),
                                    "workers": n, **extra}, seconds)


# The sweep's two halves when it runs in two processes (about equal time on the embedded Gemma).
WORKER_GROUPS = (("rollback",), ("trim", "trim_prompt_cache", "draft_trim", "save_load", "server_reuse", "batch"))
_MODEL_OPERATIONS = ("rollback", "save_load", "server_reuse", "batch")


def _workers(lm, workers: int | None, groups: list[tuple[str, ...]], setups) -> int:
    """How many processes run the sweep (see :func:`measure_state`): only the model's own cache setups can be
    rebuilt in another process, and a half without model work is not worth a model load."""
    from .workers import check_workers

    if workers is None and (setups is not None or sum(any(o in _MODEL_OPERATIONS for o in g) for g in groups) < 2):
        return 1
    if workers is not None and workers > 1 and setups is not None:
        raise GemmdriftError("a sweep in several processes needs the default cache setups (they are rebuilt there)")
    return check_workers(lm, workers, len(groups))


def _sweep_job(lm, **kwargs) -> dict[str, Any]:
    """One half of the sweep in a worker process; saved to its checkpoint there (the parent reads it back)."""
    from .checkpoint import Checkpoints

    ck = Checkpoints.from_spec(kwargs.pop("checkpoint", None))
    ops = kwargs.pop("operations")
    part = _sweep(lm, ops, setups=None, checkpoint=ck if ck.dir else None, **kwargs)
    ck.save("-".join(ops), part, list(ops))
    return part


def _f32():
    import mlx.core as mx

    return mx.float32


NON_EXACT = (str(Verdict.ROUNDING), str(Verdict.STATE_BUG), str(Verdict.REFUSED))


def figure_name(cache: str, operation: str) -> str:
    """The tracked figure counting the non-exact cases of one cache class and operation."""
    return f"non_exact.{cache}.{operation}"


def _result(lm, env, table: pd.DataFrame, inputs: dict[str, Any], seconds: float) -> Result:
    labels = env_labels(env)
    frame_rows = []
    figures: dict[str, float] = {}
    for _, r in table.iterrows():
        for metric in ("max_abs", "rel_l2", "max_abs_dlogit", "shrink"):
            val = r.get(metric)
            if val is None or (isinstance(val, float) and math.isnan(val)):
                continue
            frame_rows.append({"pair": r["cache"], "mode": r["operation"], "tap": r["params"],
                               "key_length": r["prefix"], "metric": metric, "value": float(val),
                               "where": r["where"], "verdict": r["verdict"]})
    for (cache, op), g in table.groupby(["cache", "operation"], sort=True):
        checked = g[g["verdict"].isin([str(Verdict.EXACT), *NON_EXACT])]
        if len(checked):
            figures[figure_name(cache, op)] = float(g["verdict"].isin(NON_EXACT).sum())
            figures[f"cases.{cache}.{op}"] = float(len(checked))
    figures["state_bugs"] = float((table["verdict"] == str(Verdict.STATE_BUG)).sum()) if len(table) else 0.0
    figures["seconds"] = float(seconds)
    frame = tidy(frame_rows, model=lm.description.source, dtype=lm.description.dtype, **labels)
    return Result(kind="state", inputs={"model": dict(lm.info), **inputs}, env=env, frame=frame, figures=figures,
                  tables={"state": table}, details={"mlx_lm": mlx_lm_version(), "seconds": seconds})


# The short sweep of `gemmdrift run` (suite.main_job), per size.
SHORT = {
    "cpu": dict(operations=("rollback", "trim", "trim_prompt_cache"), where=("below", "past"), ks=(2,),
                caches=("KVCache", "RotatingKVCache")),
    "gpu": dict(operations=("rollback", "trim", "trim_prompt_cache", "save_load"), where=WHERE, ks=(1, 2, 3),
                caches=("KVCache", "RotatingKVCache")),
    "quick": dict(operations=("rollback", "trim_prompt_cache"), where=("below",), ks=(1,), caches=("KVCache",),
                  compute_limit=32),
}


def short_sweep(lm, size: str = "cpu") -> Result:
    """The short version of the sweep that `gemmdrift run` includes (see :data:`SHORT`)."""
    if size not in SHORT:
        raise GemmdriftError(f"unknown size {size!r} (choose {', '.join(SHORT)})")
    return measure_state(lm, **SHORT[size])
