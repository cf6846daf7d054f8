"""The generation primitives of the divergence probe (stream records, schedule names) and gemmdrift's
exact speculative step: mlx-lm's draft-and-verify loop with a rollback that restores a snapshot where
``trim_prompt_cache`` cannot trim (split out of diverge.py, issue 25)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from ..errors import GemmdriftError


@dataclass
class Generation:
    """One greedy stream and how it was produced."""

    tokens: list[int]
    label: str  # 'plain' | 'speculative'
    schedule: str  # the teacher-forced equivalent, e.g. 'prefill:2048,decode'
    seconds: float
    stats: dict[str, Any] = field(default_factory=dict)


def check_prompt(prompt: Sequence[int], n: int) -> None:
    if n <= 0:
        raise GemmdriftError(f"the number of tokens to generate must be positive, got {n}")
    if len(prompt) < 1:
        raise GemmdriftError("the prompt is empty")


def plain_schedule(prefill_step: int) -> str:
    # generate_step prefills prompt[:-1] and feeds the last prompt token as the first decode step.
    return f"prefill:{prefill_step},decode"


def speculative_schedule(prefill_step: int, k: int) -> str:
    # speculative_generate_step prefills prompt[:-1]; the last prompt token opens the first verify block.
    return f"prefill:{prefill_step},verify:{k}"


def _rewind(model, cache: list, snapshot: list, fed: Sequence[int], keep: int) -> tuple[list, int]:
    """Keep the first ``keep`` of the ``fed`` tokens a cache took: mlx-lm's trim where it can trim, else the
    snapshot taken before they were fed, fed the kept tokens again as one block. Returns the cache and
    whether the snapshot was restored (0 or 1)."""
    import mlx.core as mx
    from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

    if keep >= len(fed):
        return cache, 0
    if can_trim_prompt_cache(cache):
        trim_prompt_cache(cache, len(fed) - keep)
        return cache, 0
    model(mx.array(fed[:keep], dtype=mx.uint32)[None], cache=snapshot)
    mx.eval([c.state for c in snapshot])
    return snapshot, 1


def speculative_exact_step(prompt: Sequence[int], model, draft_model, *, num_draft_tokens: int = 2,
                           max_tokens: int = 256, prefill_step_size: int = 512, prompt_cache=None):
    """Greedy speculative decoding with mlx-lm's loop, but with an exact cache rollback.

    The same draft-and-verify loop as ``speculative_generate_step`` in mlx-lm 0.32.2
    (``site-packages/mlx_lm/generate.py``): prefill ``prompt[:-1]`` in chunks, draft
    ``k`` tokens with the draft model (T=1), verify ``[y, d1..dk]`` in one block, accept
    the longest agreeing prefix, emit the target's token after it, rewind. The one
    difference is the rewind: mlx-lm calls ``trim_prompt_cache`` and ignores that it
    trims nothing once a ``RotatingKVCache`` is full (``is_trimmable()`` is False). Here
    each cache list is snapshotted (deep copy) before it takes the tokens that may be
    rejected; when a rejection has to be undone and ``can_trim_prompt_cache`` says the
    list cannot be trimmed, the snapshot is restored and the accepted tokens are fed
    again as one block. Where mlx-lm's trim works, it is used unchanged, so both
    decoders do the same thing below the window.

    ``prompt_cache``: target caches followed by draft caches, as mlx-lm takes them.

    Yields ``(token, from_draft, restored)``; ``restored`` counts snapshot restores so far.
    """
    import copy

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    def step(m, cache, toks):
        logits = m(mx.array(list(toks), dtype=mx.uint32)[None], cache=cache)
        return logits[0]

    def greedy(logits):
        # As mlx-lm's _process_and_sample with its greedy sampler: argmax of the log-probabilities.
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return mx.argmax(logprobs, axis=-1)

    def prefill(m, cache, y):
        while len(y) > 1:
            n = min(prefill_step_size, len(y) - 1)
            m(mx.array(y[:n], dtype=mx.uint32)[None], cache=cache)
            mx.eval([c.state for c in cache])
            y = y[n:]
        return y

    prompt = [int(t) for t in prompt]
    if prompt_cache is None:
        model_cache, draft_cache = make_prompt_cache(model), make_prompt_cache(draft_model)
    else:
        model_cache, draft_cache = prompt_cache[:len(model.layers)], prompt_cache[len(model.layers):]
    restored = 0
    draft_y = prefill(draft_model, draft_cache, prompt)
    y = prefill(model, model_cache, prompt)
    ntoks = 0
    while ntoks < max_tokens:
        num_draft = min(max_tokens - ntoks, num_draft_tokens)
        # Draft num_draft tokens, T=1 after the first call (as _draft_generate does).
        draft_snapshot = copy.deepcopy(draft_cache)
        draft_fed: list[int] = []
        drafts: list[int] = []
        dy = list(draft_y)
        for _ in range(num_draft):
            logits = step(draft_model, draft_cache, dy)
            draft_fed += dy
            tok = int(greedy(logits[-1:])[0].item())
            drafts.append(tok)
            dy = [tok]
        # Verify [y, d1..dk] in one block.
        snapshot = copy.deepcopy(model_cache)
        block = list(y) + drafts
        logits = step(model, model_cache, block)
        target = [int(t) for t in greedy(logits[-(num_draft + 1):]).tolist()]
        n = 0
        while n < num_draft and target[n] == drafts[n]:
            n += 1
            ntoks += 1
            yield drafts[n - 1], True, restored
            if ntoks == max_tokens:
                break
        if ntoks < max_tokens:
            ntoks += 1
            yield target[n], False, restored
        if ntoks == max_tokens:
            break
        # Target: keep y and the n accepted drafts. Draft: it has processed draft_y and d1..d(k-1); keep
        # draft_y and d1..dn.
        model_cache, r_t = _rewind(model, model_cache, snapshot, block, len(y) + n)
        draft_cache, r_d = _rewind(draft_model, draft_cache, draft_snapshot, draft_fed, len(draft_y) + n)
        restored += r_t + r_d
        y = [target[n]]
        draft_y = ([drafts[-1]] if n == num_draft else []) + y


def generate_speculative_exact(model, prompt: Sequence[int], n: int, k: int = 2, draft=None,
                               prefill_step: int = 512, prompt_cache=None) -> Generation:
    """Greedy tokens from :func:`speculative_exact_step` (mlx-lm's loop with an exact rollback)."""
    import time

    check_prompt(prompt, n)
    if k <= 0:
        raise GemmdriftError(f"the number of draft tokens K must be positive, got {k}")
    t0 = time.perf_counter()
    out, accepted, restored = [], 0, 0
    for tok, from_draft, restored in speculative_exact_step(prompt, model, draft if draft is not None else model,
                                                            num_draft_tokens=k, max_tokens=n,
                                                            prefill_step_size=prefill_step,
                                                            prompt_cache=prompt_cache):
        out.append(int(tok))
        accepted += bool(from_draft)
    stats = {"draft": "self" if draft is None else "separate", "k": k, "accepted_drafts": accepted,
             "acceptance": accepted / len(out) if out else 0.0, "rollback": "exact", "restores": restored}
    return Generation(out, "speculative-exact", speculative_schedule(prefill_step, k), time.perf_counter() - t0, stats)
