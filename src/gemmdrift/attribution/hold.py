"""An op class held to the reference: its own drift removed, what it carries kept (the all-but-one counterfactual,
issue 53).

``each`` makes a class invariant by handing on the reference run's output: whatever reached the op from upstream is
gone with it. ``all-but-one`` cannot work that way: keeping class X makes every other drifting class invariant,
and an op downstream of X (``o_proj`` after ``q_proj``, ``down_proj`` after ``up_proj``, the head after all) would
wipe X's drift at the next op. So a class is *held* instead: each of its ops computes on this run's own input, in
the blocks the reference schedule computes (the rows of the reference's block that this run has not computed are
the reference's inputs there; a row of a row-wise op depends on its own row and the block's shape alone, so the
rows taken are what the reference's kernel gives on this run's input). Its own local drift is gone, what it
carries from upstream is kept. Exact where the op is row-wise: projections, the LM head, norms, the residual adds
and RoPE (its offset is the reference block's start). The attention core reads the cache, whose layout is the
schedule's own: it cannot be held, and its own drift stays in every all-but-one row (said in the result).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..errors import GemmdriftError
from ..model import optaps

HOLDABLE = ("linear", "head", "norm", "residual", "rope")  # row-wise kinds (attention reads the cache)


def holdable(kinds: Mapping[str, str], cls: str) -> bool:
    """Whether an op class can be held (its kind is row-wise); ``kinds``: op name -> kind
    (:func:`gemmdrift.model.optaps.exposed_ops`)."""
    return any(k in HOLDABLE for n, k in kinds.items() if optaps.op_class(n) == cls)


def holder(reference: optaps.OpRecord, blocks: Sequence[tuple[int, int]],
           logit_positions: Sequence[int]) -> Callable:
    """``hold(key, fn, args, kwargs, row_args, positions) -> output`` for :func:`gemmdrift.model.optaps.run_ops`:
    the op ``fn`` recomputed in the reference's ``blocks`` ([start, stop) of each forward pass; the LM head's rows
    are the ``logit_positions`` in a block) on this run's per-row inputs, the rows of ``positions`` returned.
    ``reference``: a record run with its inputs kept at every position it computed."""
    starts = np.asarray([b[0] for b in blocks], dtype=np.int64)
    lp = np.asarray(logit_positions, dtype=np.int64)

    def hold(key, fn, args, kwargs, row_args, positions) -> Any:
        import mlx.core as mx

        pos = np.asarray(positions, dtype=np.int64)
        which = np.searchsorted(starts, pos, side="right") - 1
        pieces = []
        for b in dict.fromkeys(int(w) for w in which):
            a0, a1 = blocks[b]
            rows = np.arange(a0, a1)
            if key[1] == optaps.LM_HEAD:
                rows = rows[np.isin(rows, lp)]
            mine = pos[which == b]
            here = {int(p): i for i, p in enumerate(pos)}
            idx = mx.array([here.get(int(q), len(pos) + k) for k, q in enumerate(rows)], dtype=mx.int32)
            given = list(args)
            for n_arg, j in enumerate(row_args):
                ref = reference.inp[key][n_arg][reference.rows(key, rows)]
                x = args[j]
                ref_x = mx.moveaxis(mx.array(ref), 0, -2).astype(x.dtype)
                given[j] = mx.take(mx.concatenate([x, ref_x], axis=-2), idx, axis=-2)
            kw = dict(kwargs)
            if "offset" in kw:  # RoPE: the position of the block's first row
                kw["offset"] = int(a0)
            elif optaps.op_class(key[1]).endswith("rope"):
                raise GemmdriftError(f"op {key[1]} of layer {key[0]}: RoPE called without an offset cannot be held")
            out = fn(*given, **kw)
            take = np.searchsorted(rows, mine)
            pieces.append(mx.take(out, mx.array(take.astype(np.int32)), axis=-2))
        return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=-2)

    return hold


__all__ = ["HOLDABLE", "holdable", "holder"]
