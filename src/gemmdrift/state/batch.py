"""Batched caches (merge, extend/filter, extract) against the sequence run alone."""

from __future__ import annotations

import copy
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import GemmdriftError
from .reading import compare_readings, judge, merge_diffs, read_caches
from .common import PREFILL_STEP, LastRow, forward, logit_diffs


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
        from ..model import cast_model

        old = lm.description.dtype
        cast_model(lm.model, dtype)
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
            from ..model import cast_model

            cast_model(lm.model, old)


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
    from ..machine.runenv import rung_true_float32

    probe = rung_true_float32() if f32 is not None else None  # TF32 float32 cannot tell rounding from a bug
    verdict, reason, shrink = judge(d, f32, envelope=envelope, true_float32=probe is None or probe["true_float32"])
    return {"verdict": verdict, "reason": reason, "shrink": shrink, "diff": d, "f32": f32}


def _forward_rows(model, toks: list[list[int]], cache: list):
    """A batched T=1 step; the normed row of sequence 0."""
    import mlx.core as mx

    from ..model.taps import StopForward, find_final_norm

    owner, name = find_final_norm(model)
    norm = owner[name]
    sink: list = []
    owner[name] = LastRow(norm, sink)
    try:
        model(mx.array(np.asarray(toks, dtype=np.uint32)), cache=cache)
    except StopForward:
        pass
    finally:
        owner[name] = norm
    row = sink[0][:1]
    mx.eval(row, [c.state for c in cache])
    return row
