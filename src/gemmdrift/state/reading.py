"""Reading a cache in temporal order, comparing readings, and judging a difference (exact, rounding, state bug)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from ..errors import GemmdriftError
from ..result import Verdict
from ..text import fmt


LADDER_ROUNDING_SHRINK = 100.0  # as gemmdrift.measure.stack: rounding shrinks by >= 100x at float32


# Cache classes of mlx_lm.models.cache this module knows how to read in temporal order.
KNOWN_CLASSES = ("KVCache", "RotatingKVCache", "QuantizedKVCache", "ConcatenateKVCache", "ChunkedKVCache",
                 "CacheList", "ArraysCache", "BatchKVCache", "BatchRotatingKVCache")
_NOT_CACHES = ("TokenBuffer", "PromptTrie", "PromptTrieResult", "LRUPromptCache")


def mlx_lm_version() -> str:
    from ..machine.envinfo import dist_version

    return str(dist_version("mlx-lm") or "")


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


class Absent:
    """Stands in for a cache class the installed mlx-lm does not have (isinstance is always False)."""


def cache_class(name: str):
    from mlx_lm.models import cache as C

    return getattr(C, name, Absent)


def to_numpy(x) -> np.ndarray:
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
    if isinstance(c, cache_class("CacheList")):
        parts = [read_cache(x) for x in c.caches]
        return {"class": name, "offset": tuple(p["offset"] for p in parts),
                "fields": tuple((p["class"], p["fields"]) for p in parts),
                "arrays": [a for p in parts for a in p["arrays"]], "short": any(p["short"] for p in parts)}
    if isinstance(c, (cache_class("BatchKVCache"), cache_class("BatchRotatingKVCache"))):
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
    if isinstance(c, cache_class("ConcatenateKVCache")):  # keys_and_values() ignores the offset: all keys are attended
        arrays = [] if c.keys is None else [c.keys, c.values]
        return {"class": name, "offset": c.offset, "fields": (), "arrays": arrays, "short": False}
    if isinstance(c, cache_class("ChunkedKVCache")):
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
        true_float32: the float32 rerun was true float32 (:func:`gemmdrift.machine.runenv.rung_true_float32`); on a
            TF32 rung rounding shrinks only ~8x, so a drift that shrank less than rounding would is UNRELIABLE,
            not a STATE BUG.
    """
    from ..machine.runenv import unreliable_reason

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
        return Verdict.STATE_BUG, f"max|Δlogit| {fmt(bf.max_abs_dlogit)} is outside the {fmt(envelope)} envelope", shrink
    detail = ", ".join(f"{n} shrinks {s:.3g}x" for n, s in pieces)
    if shrink >= LADDER_ROUNDING_SHRINK:
        return Verdict.ROUNDING, f"{bf.why}; at float32 {detail}: rounding", shrink
    if not true_float32:
        return Verdict.UNRELIABLE, f"{bf.why}; at float32 {detail}, but {unreliable_reason()}", shrink
    return Verdict.STATE_BUG, f"{bf.why}; at float32 {detail}: does not shrink like rounding", shrink
