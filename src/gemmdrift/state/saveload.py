"""save_prompt_cache + load_prompt_cache round trips."""

from __future__ import annotations

import os
import tempfile

from .reading import Diff, compare_readings, merge_diffs, read_caches
from .common import Prefix, Setup, material, forward, logit_diffs


def save_load_case(lm, setup: Setup, prefix: Prefix, p: int, block: int, dtype=None) -> tuple[Diff, str]:
    """``save_prompt_cache`` then ``load_prompt_cache``, then continue with a block, against the cache never saved."""
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    mat = material(prefix.tokens, p, block)
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
