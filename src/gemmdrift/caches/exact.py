"""An exact sliding-window cache for speculative decoding: the newest rows live in an overlay, apart from the ring.

``OverlayRotatingKVCache`` is a drop-in ``RotatingKVCache`` (same constructor, state,
masks and reading) whose rollback is exact by construction, at any offset:

* every row a forward pass adds goes first to an **overlay** (a small tail of at most
  ``reserve`` rows, kept in temporal order) and is never written into the ring while it
  may still be rejected;
* ``trim(n)`` with ``n <= len(overlay)`` drops the overlay's newest ``n`` rows: nothing
  that was overwritten has to be recovered, so nothing is lost;
* a row moves into mlx-lm's ring (``RotatingKVCache.update_and_fetch`` itself, so the
  ring's layout is mlx-lm's) only once it is older than ``reserve`` rows, or when
  code reads the ring's arrays directly (``keys``/``values``: batching, reading in
  temporal order); ``state`` (evaluated after every prefill chunk, saved by
  ``save_prompt_cache``) carries the overlay apart and commits nothing;
* what attention sees is computed from the logical sequence alone: the ring in temporal
  order, then the overlay, cut to the last ``max_size - 1`` rows (keeping the first
  ``keep``), then the new rows -- what mlx-lm's concatenating path returns. It depends
  on the tokens kept, never on the ring's layout or on what was trimmed before, so a
  rollback followed by a block gives bit for bit what never feeding the rejected rows
  gives.

**Why an overlay and not a reserve inside the ring** (mlx-swift-lm #622's design keeps
``max_size + R`` rows in the ring and masks the extra ``R``): a reserve in the ring
makes every mask, ``_idx`` and ``size`` depend on how many reserve rows are live, and
mlx-lm's masks (``make_mask``'s rolled T=1 mask, ``create_causal_mask`` offsets) would
all have to be rewritten and kept in step with the ring; a rejected row overwrote a
ring slot that the reserve must then resurrect in the right place. The overlay never
writes a draft into the ring, so the ring stays exactly mlx-lm's and the masks of the
T>1 path are mlx-lm's own; only the T=1 mask is given in temporal order (the view is in
temporal order). The costs: one concatenation of the window per update (the view), and
at most ``reserve`` rows per layer more than mlx-lm keeps (16 by default, far less than
one window).

Speculative decoding trims the target by ``num_draft - num_accept`` (<= k) and the
draft by at most ``k - 1``; any ``reserve >= k + 1`` covers both. A trim deeper than the
overlay past the window is refused honestly (it returns what it trimmed).

Plug-in entry points (``--cache-impl gemmdrift.caches.exact:make_cache``,
``--rollback gemmdrift.caches.exact:rollback``): :func:`make_cache` and :func:`rollback`.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as _C
from mlx_lm.models.cache import RotatingKVCache

RESERVE = 16  # overlay rows per layer: covers k + 1 for every draft count up to 15


class OverlayRotatingKVCache(RotatingKVCache):
    """A ``RotatingKVCache`` whose newest ``reserve`` rows sit in an overlay until they are old enough to keep."""

    # Class-level defaults: ``from_state`` (load_prompt_cache) makes instances without ``__init__``.
    reserve = RESERVE
    _ok = None  # overlay keys, (B, heads, rows, dim), temporal order
    _ov = None
    _k = None
    _v = None
    _off = 0
    _tail = None  # (keys, values) of the last view: the newest logical rows, reused by the next update

    def __init__(self, max_size, keep=0, reserve: int = RESERVE):
        super().__init__(max_size, keep)
        self.reserve = int(reserve)
        self._ok = self._ov = None

    # -- the ring's arrays and offset: reading them commits the overlay (its rows are then the ring's)

    @property
    def keys(self):
        self._commit_all()
        return self._k

    @keys.setter
    def keys(self, v):
        self._k = v

    @property
    def values(self):
        self._commit_all()
        return self._v

    @values.setter
    def values(self, v):
        self._v = v

    @property
    def offset(self):
        return self._off + self._overlay_len()

    @offset.setter
    def offset(self, v):
        # Only the ring (mlx-lm's own methods, with the overlay empty) and state setters assign it.
        self._off = int(v) - self._overlay_len()

    def _overlay_len(self) -> int:
        return 0 if self._ok is None else int(self._ok.shape[2])

    def _commit(self, rows: int) -> None:
        """Move the overlay's oldest ``rows`` rows into the ring, as one block through mlx-lm's own update."""
        if self._ok is None or rows <= 0:
            return
        k, v = self._ok[..., :rows, :], self._ov[..., :rows, :]
        rest_k, rest_v = self._ok[..., rows:, :], self._ov[..., rows:, :]
        keep_rest = rest_k.shape[2] > 0
        self._ok = self._ov = None  # the ring's update sees an empty overlay (offset is the ring's)
        RotatingKVCache.update_and_fetch(self, k, v)
        if keep_rest:
            self._ok, self._ov = rest_k, rest_v

    def _commit_all(self) -> None:
        if self._ok is not None:
            self._commit(self._overlay_len())

    # -- the cache protocol

    def update_and_fetch(self, keys, values):
        # What attention sees: ring (temporal) + overlay, cut to the last max_size - 1 rows (keeping `keep`),
        # then the new rows -- mlx-lm's concatenating view, computed without writing the new rows anywhere.
        # The last view holds the newest rows in temporal order (data movement only, so bit for bit what the
        # ring + overlay hold): reusing it costs one concatenation per update instead of three.
        past_k, past_v = self._tail if self._tail is not None else self._logical()
        if past_k is None:
            view_k, view_v = keys, values
        else:
            cut = past_k.shape[2] - self.max_size + 1
            view_k = self._trim(cut, past_k, keys)
            view_v = self._trim(cut, past_v, values)
        # The new rows join the overlay; the oldest beyond the reserve go to the ring.
        self._ok = keys if self._ok is None else mx.concatenate([self._ok, keys], axis=2)
        self._ov = values if self._ov is None else mx.concatenate([self._ov, values], axis=2)
        self._commit(self._overlay_len() - self.reserve)
        self._tail = (view_k, view_v)
        return view_k, view_v

    def _logical(self):
        """Every live row in temporal order (ring, then overlay), without committing anything."""
        ring_k = ring_v = None
        if self._k is not None and self._off > 0:
            ring_k, ring_v = self._ring_temporal(self._k), self._ring_temporal(self._v)
            if ring_k.shape[2] > self._off:
                ring_k, ring_v = ring_k[..., : self._off, :], ring_v[..., : self._off, :]
        if self._ok is None:
            return ring_k, ring_v
        if ring_k is None:
            return self._ok, self._ov
        return mx.concatenate([ring_k, self._ok], axis=2), mx.concatenate([ring_v, self._ov], axis=2)

    def _ring_temporal(self, v):
        # RotatingKVCache._temporal_order with the ring's own offset (self.offset also counts the overlay).
        if self._idx == v.shape[2]:
            return v
        if self._idx < self._off:
            return mx.concatenate([v[..., : self.keep, :], v[..., self._idx:, :], v[..., self.keep: self._idx, :]],
                                  axis=2)
        return v[..., : self._idx, :]

    def is_trimmable(self):
        # Always: trim returns what it could trim (the overlay's rows, and the ring's below the window).
        return True

    def trim(self, n):
        n = max(0, min(int(n), self.offset))
        done = self._trim_rows(n)
        if self._tail is not None:
            # The last view stays valid cut by the trimmed rows while it still holds every row a view needs.
            rows = self._tail[0].shape[2] - done
            if done and rows >= min(self.offset, self.max_size - 1):
                self._tail = (self._tail[0][..., :rows, :], self._tail[1][..., :rows, :])
            elif done:
                self._tail = None
        return done

    def _trim_rows(self, n):
        from_overlay = min(n, self._overlay_len())
        if from_overlay:
            keep = self._overlay_len() - from_overlay
            if keep:
                self._ok, self._ov = self._ok[..., :keep, :], self._ov[..., :keep, :]
            else:
                self._ok = self._ov = None
        rest = n - from_overlay
        if rest and self._off < self.max_size:  # below the window the ring's own trim is exact
            rest_done = RotatingKVCache.trim(self, rest)
            return from_overlay + rest_done
        return from_overlay

    def make_mask(self, N: int, window_size=None, return_array: bool = False):
        if N > 1:  # the view has mlx-lm's concatenating layout: its own mask
            return RotatingKVCache.make_mask(self, N, window_size=window_size, return_array=return_array)
        if window_size is None:
            return None
        # T=1: the view is in temporal order, min(offset, max_size - 1) rows + the new one.
        size = min(self.offset, self.max_size - 1) + 1
        if size <= window_size:
            return None
        return mx.arange(size) >= (size - window_size)

    def size(self):
        return min(self.offset, self.max_size)

    def empty(self):
        return self._k is None and self._ok is None

    @property
    def nbytes(self):
        out = 0 if self._k is None else self._k.nbytes + self._v.nbytes
        return out + (0 if self._ok is None else self._ok.nbytes + self._ov.nbytes)

    @property
    def state(self):
        # mlx-lm's six fields for the ring (its own offset), then the overlay: evaluating or saving the state
        # (mlx-lm evaluates it after every prefill chunk) must not commit rows that may still be trimmed.
        return self._k, self._v, self._off, self.keep, self.max_size, self._idx, self._ok, self._ov

    @state.setter
    def state(self, v):
        self._ok = self._ov = self._tail = None
        self._k, self._v, off, self.keep, self.max_size, self._idx = v[:6]
        self._off = int(off)
        if len(v) > 6 and v[6] is not None:
            self._ok, self._ov = v[6], v[7]


# load_prompt_cache finds classes by name in mlx_lm.models.cache: register this one there (at runtime, the
# installed file is untouched) so a saved cache loads back as itself.
if not hasattr(_C, OverlayRotatingKVCache.__name__):
    setattr(_C, OverlayRotatingKVCache.__name__, OverlayRotatingKVCache)


def make_cache(model) -> list[Any]:
    """The model's own caches (``make_prompt_cache``) with every ``RotatingKVCache`` an overlay one."""
    caches = _C.make_prompt_cache(model)
    return [OverlayRotatingKVCache(c.max_size, c.keep) if type(c) is RotatingKVCache else c for c in caches]


def rollback(cache: list, num_tokens: int) -> int:
    """The rewind step of ``speculative_generate_step`` (its ``trim_prompt_cache`` call): trim every layer.

    Unlike mlx-lm's ``trim_prompt_cache`` it does not give up on the whole list when one layer
    says it cannot trim; it trims every layer and returns the smallest count trimmed, so a
    short trim is visible to the caller.
    """
    if not cache or num_tokens <= 0:
        return 0
    return min(int(c.trim(num_tokens)) for c in cache)
