"""What older mlx releases lack that gemmdrift's machinery uses (issue 47: the history measures every release).

One place, by feature, never by version number: the measurements never branch on versions.

* Pickling a bfloat16 ``mx.array`` (workers send prefixes, caches and taps between processes): mlx before 0.29
  pickles an array through NumPy, which has no bfloat16, and raises. :func:`install` registers a reducer that
  carries such an array as float32 (exact: every bfloat16 value is a float32 value) and casts it back; it is
  installed only where the release's own pickling fails, so releases that pickle bfloat16 are left as they are.
* ``mlx_lm.models.cache.create_attention_mask(N, offset, ...)`` (the op probe's masks): mlx-lm before it had another
  function of that name in ``models.base``; :func:`attention_mask` builds the same mask there.
"""

from __future__ import annotations

_INSTALLED = False


def _rebuild(values, dtype_name: str):
    import mlx.core as mx

    return mx.array(values).astype(getattr(mx, dtype_name))


def _reduce(a):
    import numpy as np

    import mlx.core as mx

    if a.dtype == mx.bfloat16:
        return _rebuild, (np.array(a.astype(mx.float32)), "bfloat16")
    return _rebuild, (np.array(a), str(a.dtype).rsplit(".", 1)[-1])


def bfloat16_pickles() -> bool:
    import pickle

    import mlx.core as mx

    try:
        pickle.dumps(mx.array([1.0], dtype=mx.bfloat16))
        return True
    except TypeError:
        return False


def install() -> bool:
    """Make bfloat16 arrays pickle where this mlx cannot (idempotent); True when the reducer is in place."""
    global _INSTALLED
    if _INSTALLED:
        return True
    if bfloat16_pickles():
        return False
    import copyreg

    import mlx.core as mx

    copyreg.pickle(mx.array, _reduce)
    _INSTALLED = True
    return True


def attention_mask(n: int, offset: int, return_array: bool, window_size: int | None):
    """mlx-lm's ``models.cache.create_attention_mask(N, offset, return_array, window_size)`` (the op probe's masks).

    mlx-lm releases before it had only ``models.base.create_attention_mask(h, cache)``; there, the same rule is
    built here from ``create_causal_mask``, which every release has (mlx_lm/models/cache.py of 0.32.2: a window
    gives the array; one query, no mask; else the array when asked, else the string "causal")."""
    try:
        from mlx_lm.models.cache import create_attention_mask
    except ImportError:
        return _attention_mask(n, offset, return_array, window_size)
    return create_attention_mask(n, offset, return_array=return_array, window_size=window_size)


def _attention_mask(n: int, offset: int, return_array: bool, window_size: int | None):
    from mlx_lm.models.base import create_causal_mask

    if window_size is not None:
        return create_causal_mask(n, offset, window_size=window_size)
    if n == 1:
        return None
    return create_causal_mask(n, offset, window_size=window_size) if return_array else "causal"
