"""What older mlx releases lack that gemmdrift's machinery uses (issue 47: the history measures every release).

One place, by feature, never by version number: the measurements never branch on versions.

* Pickling a bfloat16 ``mx.array`` (workers send prefixes, caches and taps between processes): mlx before 0.29
  pickles an array through NumPy, which has no bfloat16, and raises. :func:`install` registers a reducer that
  carries such an array as float32 (exact: every bfloat16 value is a float32 value) and casts it back; it is
  installed only where the release's own pickling fails, so releases that pickle bfloat16 are left as they are.
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
