"""Speculative rollback: a cache trimmed after rejected drafts against one that never saw them."""

from __future__ import annotations

import copy
import math
from typing import Any, Sequence

from .reading import Diff, compare_readings, merge_diffs, read_caches
from .common import CONTINUATION, KS, Prefix, Setup, fed_after_rollback, material, forward, logit_diffs


def rollback_side(lm, setup: Setup, prefix: Prefix, p: int, mat: list[int], k: int, r: int, dtype=None):
    """One rollback case, both sides, from scratch (used for the precision ladder)."""
    from mlx_lm.models.cache import trim_prompt_cache

    y, drafts = mat[0], mat[1:1 + max(KS)]
    n = k - r
    cont = fed_after_rollback(mat, n, lm.vocab_size)
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
    mat = material(prefix.tokens, p, 2 + kmax + CONTINUATION)
    y, drafts = mat[0], mat[1:1 + kmax]
    base = setup.build(lm, prefix, p)
    conts = {n: fed_after_rollback(mat, n, vocab) for n in range(kmax + 1)}
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
