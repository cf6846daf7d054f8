"""The other ops whose shape changes between decode and verification (sdpa, RMSNorm, RoPE,
softmax), a block of T queries against each query alone. See :mod:`gemmdrift.kernels`."""

from __future__ import annotations

import json
import math
import zlib
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import pandas as pd

from .. import metrics
from ..errors import GemmdriftError
from ..model.taps import to_numpy
from ..model.projections import INPUT_SEED
from .table import OP_NAMES, TABLE_COLUMNS, block_drift

DEFAULT_QUERY_LENGTHS = tuple(range(1, 17))
# Around the Metal SDPA boundaries (mlx/backend/metal/scaled_dot_product_attention.cpp,
# eval_gpu): the vector kernel goes 2-pass from 1024 keys on Max/Ultra and from
# 4096 with GQA; 256 is mlx-lm's KV-cache step and the cuDNN decode minimum
# (mlx/backend/cuda/scaled_dot_product_attention.cpp, use_cudnn_for_decoding).
DEFAULT_KEY_LENGTHS = (256, 1023, 1024, 1025, 2048, 4096)


# ---------------------------------------------------------------------- other ops


def _attention_geometries(lm) -> list[tuple[int, Any]]:
    """(layer index, attention module) for the first layer of each distinct geometry."""
    seen, out = set(), []
    for i, layer in enumerate(lm.layers):
        attn = layer.get("self_attn") if hasattr(layer, "get") else None
        if attn is None or not all(hasattr(attn, a) for a in ("n_heads", "n_kv_heads", "head_dim", "scale", "rope")):
            continue
        rope = attn.rope
        geom = (attn.n_heads, attn.n_kv_heads, attn.head_dim, float(attn.scale), type(rope).__name__,
                json.dumps({k: v for k, v in vars(rope).items() if isinstance(v, (int, float, bool, str))},
                           sort_keys=True))
        if geom not in seen:
            seen.add(geom)
            out.append((i, attn))
    if not out:
        raise GemmdriftError("cannot read the attention geometry (n_heads, n_kv_heads, head_dim, scale, rope) "
                             "of this architecture")
    return out


def _seeded(shape: tuple[int, ...], dtype: str, seed: int, salt: str) -> np.ndarray:
    rng = np.random.default_rng([seed, zlib.crc32(salt.encode())])
    # Stored activations are values of the compute dtype: round once, to nearest even.
    return metrics.round_to(rng.standard_normal(shape), dtype).astype(np.float32)


def _alone_and_blocks(alone: Callable[[int], Any], block: Callable[[int], Any], lmax: int, qls: Sequence[int],
                      rows_of: Callable[[np.ndarray], np.ndarray]):
    """Yield (L, rows computed alone, the same rows from one block of L) for every query length L.

    ``alone(j)`` computes query j of the largest block by itself, ``block(L)``
    the last L queries together; ``rows_of`` puts the query axis first.
    """
    import mlx.core as mx

    singles = [alone(j) for j in range(lmax)]
    mx.eval(singles)
    single = np.stack([rows_of(to_numpy(a))[0] for a in singles])
    for ql in (q for q in qls if q <= lmax):
        out = block(ql)
        mx.eval(out)
        yield ql, single[lmax - ql:], rows_of(to_numpy(out))


def ops_sweep(lm, *, ops: Sequence[str] = OP_NAMES, query_lengths: Iterable[int] = DEFAULT_QUERY_LENGTHS,
              key_lengths: Iterable[int] = DEFAULT_KEY_LENGTHS, seed: int = INPUT_SEED) -> pd.DataFrame:
    """Row invariance of the non-matmul ops whose shape changes between decode and verification.

    For each query length L and key length kL, a block of L queries at
    positions kL-L .. kL-1 (one forward pass of verification) is compared
    row by row with each query computed alone, as decoding computes it:

    * ``sdpa``: mx.fast.scaled_dot_product_attention with the model's heads,
      KV heads, head dim and scale; alone: keys 0..p, no mask (what mlx-lm's
      KVCache gives at T=1); block: all kL keys with the mask mlx-lm's
      ``create_attention_mask`` makes (``mask=causal``: the string,
      ``mask=array``: the boolean array). Sliding windows are not applied:
      this isolates the op, not the cache layout.
    * ``softmax``: mx.softmax(precise=True) as the unfused attention applies
      it: a row of p+1 scores alone, zero-padded to kL, vs the same row
      inside the block with the later scores masked (their probabilities
      must come out exactly 0).
    * ``rope``: the layer's own RoPE at offset p alone vs inside a block
      starting at kL-L.
    * ``rms_norm``: the layer's input RMSNorm on one row vs a block.

    Inputs are seeded (``inputs='synthetic'``); ``layer`` is the first layer
    of each distinct attention geometry, ``key_length`` is kL, ``K`` the
    length of the rows compared (head dim, kL for softmax, hidden size).

    Args:
        lm: the loaded model (only its attention geometry, RoPE and norms are used).
        ops: a subset of :data:`OP_NAMES`.
        query_lengths: block sizes L (T in the table).
        key_lengths: key lengths kL.
        seed: seed of the inputs.
    """
    import mlx.core as mx

    from ..machine.compat import attention_mask as create_attention_mask
    from ..model import mx_dtype

    bad = [o for o in ops if o not in OP_NAMES]
    if bad:
        raise GemmdriftError(f"unknown op {bad[0]!r} (choose from {', '.join(OP_NAMES)})")
    qls = sorted({int(q) for q in query_lengths})
    kls = sorted({int(k) for k in key_lengths})
    if not qls or qls[0] < 1 or not kls or kls[0] < 1:
        raise GemmdriftError("query and key lengths must be positive integers")
    dtype = lm.description.dtype
    dt = mx_dtype(dtype)
    rows: list[dict] = []
    heads_first = lambda a: a[0].transpose(1, 0, 2)  # noqa: E731  (1, H, L, D) -> (L, H, D)

    def seeded(shape, salt):
        return mx.array(_seeded(shape, dtype, seed, salt)).astype(dt)

    def add(layer, op, variant, width, k_len, results, heads=(math.nan, math.nan)):
        labels = {"layer": layer, "projection": op, "path": variant, "dtype": dtype, "quant": "",
                  "emulated": False, "synthetic": True, "inputs": "synthetic", "K": width, "N": math.nan,
                  "key_length": k_len, "heads": heads[0], "kv_heads": heads[1]}
        for ql, single, block in results:
            rows.extend({**labels, "T": ql, "metric": k, "value": float(v)}
                        for k, v in block_drift(single, block, dtype).items())

    for li, attn in _attention_geometries(lm):
        h, hkv, d, scale = attn.n_heads, attn.n_kv_heads, attn.head_dim, attn.scale
        for k_len in kls:
            lmax = min(max(qls), k_len)
            p0 = k_len - lmax  # position of the first query of the largest block
            salt = f"{li}:{k_len}"
            if "sdpa" in ops:
                q, k, v = seeded((1, h, lmax, d), "q" + salt), *(seeded((1, hkv, k_len, d), c + salt) for c in "kv")
                for variant, as_array in (("mask=causal", False), ("mask=array", True)):
                    add(li, "sdpa", variant, d, k_len, heads=(h, hkv), results=_alone_and_blocks(
                        lambda j: mx.fast.scaled_dot_product_attention(
                            q[:, :, j:j + 1], k[:, :, :p0 + j + 1], v[:, :, :p0 + j + 1], scale=scale, mask=None),
                        lambda L, a=as_array: mx.fast.scaled_dot_product_attention(
                            q[:, :, lmax - L:], k, v, scale=scale,
                            mask=create_attention_mask(L, k_len - L, return_array=a, window_size=None)),
                        lmax, qls, heads_first))
            if "softmax" in ops:
                scores = seeded((1, h, lmax, k_len), "s" + salt)

                def masked_softmax(L):
                    mask = create_attention_mask(L, k_len - L, return_array=True, window_size=None)
                    blk = scores[:, :, lmax - L:]
                    # As the unfused attention masks: the dtype's lowest finite value (mlx/fast.cpp).
                    return mx.softmax(blk if mask is None else mx.where(mask, blk, mx.finfo(dt).min), axis=-1,
                                      precise=True)

                add(li, "softmax", "masked", k_len, k_len, _alone_and_blocks(
                    lambda j: mx.pad(mx.softmax(scores[:, :, j:j + 1, :p0 + j + 1], axis=-1, precise=True),
                                     [(0, 0), (0, 0), (0, 0), (0, lmax - 1 - j)]),
                    masked_softmax, lmax, qls, heads_first))
            if "rope" in ops:
                x = seeded((1, h, lmax, d), "r" + salt)
                add(li, "rope", "offset", d, k_len, _alone_and_blocks(
                    lambda j: attn.rope(x[:, :, j:j + 1], offset=p0 + j),
                    lambda L: attn.rope(x[:, :, lmax - L:], offset=k_len - L), lmax, qls, heads_first))
        norm = lm.layers[li].get("input_layernorm")
        if "rms_norm" in ops and norm is not None:
            hidden, lmax = int(norm["weight"].shape[-1]), max(qls)
            x = seeded((1, lmax, hidden), f"n{li}")
            add(li, "rms_norm", "input_layernorm", hidden, math.nan, _alone_and_blocks(
                lambda j: norm(x[:, j:j + 1]), lambda L: norm(x[:, lmax - L:]), lmax, qls, lambda a: a[0]))
    return pd.DataFrame(rows, columns=TABLE_COLUMNS)

__all__ = ["DEFAULT_QUERY_LENGTHS", "DEFAULT_KEY_LENGTHS", "ops_sweep"]
