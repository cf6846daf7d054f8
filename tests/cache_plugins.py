"""Cache implementations planted for the test bench (loaded by tests as ``--cache-impl`` file:factory specs)."""

from __future__ import annotations

from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache


class TrimNothingRotating(RotatingKVCache):
    """Planted: says it can always trim, returns n, and keeps every entry (a do-nothing trim)."""

    def is_trimmable(self):
        return True

    def trim(self, n):
        return min(self.offset, n)


class TrimRaises(RotatingKVCache):
    """Planted: a trim that raises."""

    def is_trimmable(self):
        return True

    def trim(self, n):
        raise RuntimeError("this cache cannot trim")


def _swap(model, cls):
    return [cls(c.max_size, c.keep) if type(c) is RotatingKVCache else c for c in make_prompt_cache(model)]


def mlx_lm_own(model):
    """mlx-lm's own caches, as a plug-in (the grid must give today's verdicts)."""
    return make_prompt_cache(model)


def trim_nothing(model):
    return _swap(model, TrimNothingRotating)


def trim_raises(model):
    return _swap(model, TrimRaises)


def too_few(model):
    return make_prompt_cache(model)[:-1]


def not_caches(model):
    return [object() for _ in model.layers]


def factory_raises(model):
    raise ValueError("no caches today")


def two_args(model, extra):
    return make_prompt_cache(model)


def rollback_three(cache, n, extra):
    return 0


def every_layer_kv(model):
    return [KVCache() for _ in model.layers]


def rollback_none(cache, num_tokens):
    """Planted: a rewind that drops nothing and says it dropped everything."""
    return num_tokens
