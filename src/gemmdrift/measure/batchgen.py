"""mlx-lm's ``BatchGenerator`` driven greedily: a stream as row j of a padded batch (its tokens, its per-step
log-probabilities, and with ``follow`` its row of every layer's output), and the same stream alone with
``mlx_lm.generate.generate_step``; plus the planted one-row mask shift the tests and the readiness check use.
What the runs are compared for is :mod:`gemmdrift.measure.batch`."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from ..errors import GemmdriftError


@dataclass
class Run:
    """Greedy streams of one generation: tokens per row, log-probs of the rows kept, wall time."""

    tokens: list[list[int]]
    logprobs: dict[int, np.ndarray]  # row -> (n, vocab) float32
    seconds: float
    hidden: np.ndarray | None = None  # followed row: (layers + final norm, decode steps, hidden) float32
    followed_rows: list[int] = field(default_factory=list)  # the followed sequence's row in each decode step


def _np(a) -> np.ndarray:
    import mlx.core as mx

    return np.asarray(a.astype(mx.float32))


def generate_alone(model, prompt: Sequence[int], n: int, prefill_step: int = 2048) -> Run:
    """``mlx_lm.generate.generate_step``, greedy, with the log-probs of every step."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    t0 = time.perf_counter()
    toks, lps = [], []
    for (tok, lp), _ in zip(generate_step(mx.array([int(t) for t in prompt]), model, max_tokens=n,
                                          prefill_step_size=prefill_step), range(n)):
        toks.append(int(tok))
        lps.append(_np(lp.reshape(-1)))
    return Run([toks], {0: np.stack(lps)}, time.perf_counter() - t0)


def shift_row_mask(caches, row: int, by: int = 1) -> None:
    """A planted padding bug: row ``row``'s left padding grows by ``by`` in every batch cache, so its
    mask hides its first real token(s) (known-answer tests only)."""
    import mlx.core as mx

    for c in caches:
        lp = getattr(c, "left_padding", None)
        if lp is None:
            continue
        bump = mx.zeros(lp.shape, dtype=lp.dtype).at[row].add(by)
        c.left_padding = lp + bump


class _RowRecorder:
    """What the taps' layer proxies hand their outputs to: keeps one row of every decode step (T=1)."""

    reference = None  # never local mode

    def __init__(self, n_taps: int) -> None:
        self.row: int | None = None  # the followed sequence's row in the current step, None outside steps
        self.steps: list[list] = [[] for _ in range(n_taps)]
        self.rows: list[int] = []  # its row at every step (it moves when others join or leave)

    def capture(self, tap: int, h) -> None:
        if self.row is not None and h.ndim == 3 and h.shape[1] == 1:
            self.steps[tap].append(h[self.row, 0])

    def hidden(self) -> np.ndarray:
        from ..model.taps import to_numpy

        n = min(len(s) for s in self.steps)
        return np.stack([np.stack([to_numpy(x) for x in s[:n]]) if n else np.zeros((0, 0), np.float32)
                         for s in self.steps])


@contextlib.contextmanager
def _following(model, rec: _RowRecorder, uid: int):
    """Layer proxies on ``model`` (and its final norm) and the followed row set at every decode step of
    mlx-lm's ``GenerationBatch._step`` (by the sequence's uid); everything restored afterwards."""
    import mlx.core as mx

    from ..model.taps import LayerProxy, find_final_norm, swapped

    try:
        from mlx_lm.generate import GenerationBatch as cls
    except ImportError:
        cls = None
    if cls is None or not hasattr(cls, "_step"):
        raise GemmdriftError("following a row through the batch needs mlx-lm's GenerationBatch (mlx-lm 0.32 or "
                             "newer); run without --layers")
    step = cls._step

    def followed_step(self):
        rec.row = self.uids.index(uid) if uid in self.uids else None
        if rec.row is not None:
            rec.rows.append(rec.row)
        try:
            out = step(self)
            mx.eval([s[-1] for s in rec.steps if s] if rec.row is not None else [])
            return out
        finally:
            rec.row = None

    owner, norm = find_final_norm(model)
    slots = [(model.layers, i, LayerProxy(layer, i, rec)) for i, layer in enumerate(list(model.layers))]
    slots.append((owner, norm, LayerProxy(owner[norm], len(model.layers), rec)))
    with swapped(slots):
        cls._step = followed_step
        try:
            yield
        finally:
            cls._step = step


def generate_batch(model, prompts: Sequence[Sequence[int]], n: int, *, keep: Sequence[int] = (),
                   prefill_step: int = 2048, plant: Callable[[list], None] | None = None,
                   follow: int | None = None) -> Run:
    """mlx-lm's ``BatchGenerator`` over all prompts at once (greedy, no stop tokens, ``n`` tokens each).

    Args:
        keep: rows whose per-step log-probs are returned.
        plant: called once with the generation batch's caches after the first
            decode step is queued (tests plant bugs with it).
        follow: a row whose every layer's output is kept at every decode step (``Run.hidden``).
    """
    from mlx_lm.generate import BatchGenerator

    B = len(prompts)
    if B < 1:
        raise GemmdriftError("a batch needs at least one prompt")
    if any(len(p) < 1 for p in prompts):
        raise GemmdriftError("a batch prompt is empty")
    if n <= 0:
        raise GemmdriftError(f"the number of tokens must be positive, got {n}")
    t0 = time.perf_counter()
    gen = BatchGenerator(model, max_tokens=n, prefill_step_size=prefill_step, prefill_batch_size=max(8, B),
                         completion_batch_size=max(32, B))
    toks: list[list[int]] = [[] for _ in range(B)]
    lps: dict[int, list[np.ndarray]] = {int(j): [] for j in keep}
    rec = None
    try:
        uids = gen.insert([list(map(int, p)) for p in prompts], [n] * B)
        row_of = {u: i for i, u in enumerate(uids)}
        planted = plant is None
        stack = contextlib.ExitStack()
        if follow is not None:
            rec = _RowRecorder(len(model.layers) + 1)
            stack.enter_context(_following(model, rec, uids[follow]))
        with stack:
            _drain(gen, toks, lps, row_of, n, B, plant, planted)
    finally:
        gen.close()
    return Run(toks, {j: np.stack(v) for j, v in lps.items()}, time.perf_counter() - t0,
               hidden=rec.hidden()[:, :n] if rec is not None else None,
               followed_rows=rec.rows[:n] if rec is not None else [])


def _drain(gen, toks, lps, row_of, n, B, plant, planted) -> None:
    """Collect the batch generator's responses until every row has ``n`` tokens."""
    while any(len(t) < n for t in toks):
        responses = gen.next_generated()
        if not planted and len(gen._generation_batch) == B:
            plant(gen._generation_batch.prompt_cache)
            planted = True
        if not responses and not gen._unprocessed_sequences and len(gen._generation_batch) == 0:
            break
        for r in responses:
            i = row_of[r.uid]
            toks[i].append(int(r.token))
            if i in lps:
                lps[i].append(_np(r.logprobs.reshape(-1)))
