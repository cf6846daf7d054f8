"""Two-run statistics of teacher-forced logits: KL divergence, Δp, same top-1, perplexity, flips.

numpy only (no mlx). The figures are llama.cpp's ``llama-perplexity --kl-divergence`` ones (KLD(base ‖ other)
with its spread and percentiles, the change Δp = p_other − p_base of the correct token's probability, the share
of positions with the same top-1 token, the perplexity of each side) plus gemmdrift's own at the logits
(max|Δlogit|, Δgap, argmax flips judged against an envelope, as triage judges a divergence).

What a run says about its logits at each position is a :class:`LogitView`: either every logit (``full``), or
the logits of a set of known token ids (its top-k, possibly with more ids appended, e.g. a live run's logits at
the base's top-k ids), always with the log-sum-exp over the whole vocabulary and the correct token's logit and
rank. :func:`two_run_stats` takes two views and is the one statistics function: `gemmdrift compare`, `stack`'s
logit comparison and the asv benchmarks all call it.

The KLD with partial views is computed over the ids both sides know (S) plus one tail bucket for the rest
(R): KL_S + p_R log(p_R / q_R). By the log-sum inequality p_R log(p_R/q_R) ≤ Σ_{i∈R} p_i log(p_i/q_i), so
this is a lower bound on the exact KLD, equal to it when both views are full.

Percentiles are on the 0-100 scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import metrics
from ..result import Verdict

Z95 = 1.959963984540054  # two-sided 95% quantile of the standard normal
PERCENTILES = (99.9, 99, 95, 90, 50, 10, 5, 1, 0.1)  # besides max and min, as llama-perplexity prints them
FULL_CHUNK = 16  # rows per float64 pass over a full vocabulary (16 x 262,144 x 8 bytes = 32 MB)
NEAR_TIE, OUTSIDE = Verdict.NEAR_TIE.value, Verdict.OUTSIDE.value  # triage's words
UNJUDGED = "no gap"  # a flip where the base's top-2 gap is unknown (a top-1 base)


@dataclass(frozen=True)
class LogitView:
    """One run's logits at ``positions`` (absolute positions of the token stream).

    Attributes:
        positions: (n,) the positions; ``targets[i]`` is the token that follows ``positions[i]``.
        targets: (n,) the correct next token at each position.
        values: (n, V) every logit when ``ids`` is None; else (n, m) the logits of ``ids``.
        ids: None (full), or (n, m) token ids whose first ``top_k`` columns are the run's top-k in
            descending order (ties: the lower id first, as :func:`gemmdrift.metrics.top2`).
        top_k: how many leading columns of ``ids`` are the run's own top-k.
        lse: (n,) float64 log-sum-exp over the whole vocabulary.
        target_logit: (n,) the correct token's logit; ``target_rank``: logits strictly above it (0 = top-1).
        vocab: vocabulary size.
    """

    positions: np.ndarray
    targets: np.ndarray
    values: np.ndarray
    ids: np.ndarray | None
    top_k: int
    lse: np.ndarray
    target_logit: np.ndarray
    target_rank: np.ndarray
    vocab: int

    @property
    def full(self) -> bool:
        return self.ids is None

    def __len__(self) -> int:
        return int(self.positions.shape[0])

    def top(self, j: int) -> np.ndarray:
        """The j-th token (0: argmax) of every position."""
        if self.ids is not None:
            return self.ids[:, j]
        t1, t2 = metrics.top2(self.values)
        return (t1, t2)[j]

    def logprob_target(self) -> np.ndarray:
        return self.target_logit.astype(np.float64) - self.lse

    def select(self, rows: np.ndarray) -> "LogitView":
        """The view restricted to some rows (e.g. a prefix of the positions)."""
        return LogitView(self.positions[rows], self.targets[rows], self.values[rows],
                         None if self.ids is None else self.ids[rows], self.top_k, self.lse[rows],
                         self.target_logit[rows], self.target_rank[rows], self.vocab)


def logsumexp_rows(x: np.ndarray) -> np.ndarray:
    """float64 log-sum-exp of every row, in chunks (a full vocabulary row is 262,144 logits)."""
    out = np.empty(x.shape[0], np.float64)
    for s in range(0, x.shape[0], FULL_CHUNK):
        c = np.asarray(x[s:s + FULL_CHUNK], dtype=np.float64)  # float64: the sum of 262,144 exps loses nothing
        m = np.max(c, axis=1, keepdims=True)
        out[s:s + FULL_CHUNK] = m[:, 0] + np.log(np.sum(np.exp(c - m), axis=1))
    return out


def top_k_ids(x: np.ndarray, k: int) -> np.ndarray:
    """(n, k) ids of the k largest logits per row, descending, ties broken by the lower id."""
    n, v = x.shape
    k = min(k, v)
    part = np.argpartition(-x, k - 1, axis=1)[:, :k] if k < v else np.tile(np.arange(v), (n, 1))
    vals = np.take_along_axis(x, part, axis=1)
    # The k-th value may be tied with ids outside the partition: take every id tied with it, then sort.
    kth = vals.min(axis=1)
    out = np.empty((n, k), np.int64)
    for i in range(n):
        cand = part[i]
        ties = np.flatnonzero(x[i] == kth[i])
        if ties.size > np.count_nonzero(vals[i] == kth[i]):
            cand = np.union1d(cand[vals[i] > kth[i]], ties)
        order = np.lexsort((cand, -x[i, cand]))
        out[i] = cand[order[:k]]
    return out


VIEW_CHUNK = 64  # rows reduced at a time: argpartition of a 262,144-wide row needs 8 bytes per logit


def view_from_logits(logits: np.ndarray, positions: np.ndarray, targets: np.ndarray, top_k: int, *,
                     full: bool = False, extra_ids: np.ndarray | None = None) -> LogitView:
    """Reduce full logits (n, V) to a view: the top-k (and ``extra_ids``' logits), or all of them (``full``).

    Args:
        logits: (n, V) float32 logits (values of the storage dtype: exact).
        positions, targets: (n,) positions and the correct next token at each.
        top_k: the k of the top-k kept.
        full: keep every logit.
        extra_ids: (n, e) more ids whose logits are kept after the top-k (a live run keeps the base's top-k).
    """
    logits = np.asarray(logits)
    n, v = logits.shape
    if n > VIEW_CHUNK:  # a long prefill block: bounded memory, the same view
        return concat_views([view_from_logits(logits[s:s + VIEW_CHUNK], positions[s:s + VIEW_CHUNK],
                                              targets[s:s + VIEW_CHUNK], top_k, full=full,
                                              extra_ids=None if extra_ids is None else extra_ids[s:s + VIEW_CHUNK])
                             for s in range(0, n, VIEW_CHUNK)])
    targets = np.asarray(targets, dtype=np.int64)
    rows = np.arange(n)
    target_logit = logits[rows, targets]
    rank = np.count_nonzero(logits > target_logit[:, None], axis=1)
    lse = logsumexp_rows(logits)
    ids = top_k_ids(logits, top_k)
    if extra_ids is not None:
        ids = np.concatenate([ids, np.asarray(extra_ids, dtype=np.int64)], axis=1)
    values = logits.astype(np.float32, copy=True) if full else np.take_along_axis(logits, ids, axis=1).astype(np.float32)
    return LogitView(np.asarray(positions, np.int64), targets, values, None if full else ids, int(min(top_k, v)),
                     lse, target_logit.astype(np.float32), rank.astype(np.int64), int(v))


def concat_views(views: list[LogitView]) -> LogitView:
    """Views of consecutive blocks, as one."""
    first = views[0]
    cat = lambda name: np.concatenate([getattr(w, name) for w in views])  # noqa: E731
    return LogitView(cat("positions"), cat("targets"), cat("values"), None if first.ids is None else cat("ids"),
                     first.top_k, cat("lse"), cat("target_logit"), cat("target_rank"), first.vocab)


def gather(view: LogitView, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The view's logits at ``ids`` (n, m) and whether it knows them (float64, NaN where unknown)."""
    ids = np.asarray(ids, dtype=np.int64)
    if view.ids is None:
        return np.take_along_axis(view.values, ids, axis=1).astype(np.float64), np.ones(ids.shape, bool)
    eq = ids[:, :, None] == view.ids[:, None, :]
    known = eq.any(axis=2)
    col = eq.argmax(axis=2)
    vals = np.take_along_axis(view.values, col, axis=1).astype(np.float64)
    return np.where(known, vals, np.nan), known


def _first_occurrence(ids: np.ndarray) -> np.ndarray:
    """True where an id appears for the first time in its row (an extended view may list an id twice)."""
    order = np.argsort(ids, axis=1, kind="stable")
    s = np.take_along_axis(ids, order, axis=1)
    first_sorted = np.ones(ids.shape, bool)
    first_sorted[:, 1:] = s[:, 1:] != s[:, :-1]
    out = np.empty(ids.shape, bool)
    np.put_along_axis(out, order, first_sorted, axis=1)
    return out


def _kld_exact(base: LogitView, other: LogitView) -> np.ndarray:
    out = np.empty(len(base), np.float64)
    for s in range(0, len(base), FULL_CHUNK):
        lp = base.values[s:s + FULL_CHUNK].astype(np.float64) - base.lse[s:s + FULL_CHUNK, None]
        lq = other.values[s:s + FULL_CHUNK].astype(np.float64) - other.lse[s:s + FULL_CHUNK, None]
        out[s:s + FULL_CHUNK] = np.sum(np.exp(lp) * (lp - lq), axis=1)
    return out


def kld(base: LogitView, other: LogitView) -> tuple[np.ndarray, bool]:
    """Per-position KLD(base ‖ other) and whether it is exact (both full) or the tail-bucket lower bound."""
    if base.full and other.full:
        return _kld_exact(base, other), True
    if not base.full:
        ids = base.ids[:, : base.top_k]  # unique by construction
        lp = base.values[:, : base.top_k].astype(np.float64) - base.lse[:, None]
        lo, known = gather(other, ids)
    else:
        ids = other.ids
        known = _first_occurrence(ids)
        lp = np.take_along_axis(base.values, ids, axis=1).astype(np.float64) - base.lse[:, None]
        lo = other.values.astype(np.float64)
    lq = lo - other.lse[:, None]
    p = np.where(known, np.exp(lp), 0.0)
    q = np.where(known, np.exp(np.where(known, lq, 0.0)), 0.0)
    body = np.sum(np.where(known, p * (lp - np.where(known, lq, 0.0)), 0.0), axis=1)
    # The rest's mass is 1 minus a sum of m terms, known to about m ulps: below that it is rounding, taken as 0
    # for the base (no tail term) and as that resolution for the other (a larger q keeps the bound a bound).
    noise = 4.0 * (p.shape[1] + 1) * np.finfo(np.float64).eps
    p_rest = 1.0 - p.sum(axis=1)
    p_rest = np.where(p_rest > noise, p_rest, 0.0)
    q_rest = np.maximum(1.0 - q.sum(axis=1), noise)
    tail = np.where(p_rest > 0, p_rest * (np.log(np.where(p_rest > 0, p_rest, 1.0)) - np.log(q_rest)), 0.0)
    return body + tail, False


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a binomial share (95% by default)."""
    if n <= 0:
        raise ValueError("no trials")
    p = successes / n
    d = 1.0 + z * z / n
    center = (p + z * z / (2 * n)) / d
    half = z / d * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, center - half), min(1.0, center + half)


def distribution(x: np.ndarray, name: str) -> dict[str, float]:
    """max, the :data:`PERCENTILES`, min and mean of ``x`` as ``{name}_max``, ``{name}_p99.9``, ..."""
    x = np.asarray(x, dtype=np.float64)
    out = {f"{name}_max": float(x.max()), f"{name}_min": float(x.min()), f"{name}_mean": float(x.mean())}
    for q, v in zip(PERCENTILES, np.percentile(x, PERCENTILES)):
        out[f"{name}_p{q:g}"] = float(v)
    return out


def _check_pair(base: LogitView, other: LogitView) -> None:
    if len(base) == 0:
        raise ValueError("no positions compared")
    if base.vocab != other.vocab:
        raise ValueError(f"vocabularies differ: {base.vocab} vs {other.vocab}")
    if not (np.array_equal(base.positions, other.positions) and np.array_equal(base.targets, other.targets)):
        raise ValueError("the two views cover different positions or tokens")


def two_run_stats(base: LogitView, other: LogitView, *, envelope: float | None = None) -> dict[str, Any]:
    """Everything two runs' logits say about each other, per position and summarised.

    Args:
        base: the reference run (KLD(base ‖ other); Δp = p_other − p_base).
        other: the run compared with it, over the same positions and tokens.
        envelope: the largest |Δgap| still called rounding; default: the largest |Δgap| at the positions whose
            top-1 agrees (the runs' own envelope, as triage measures it where the streams agree).

    Returns:
        ``positions``: dict of per-position arrays (position, target, kld, logp_base, logp_other, p_base,
        p_other, dp, top1_base, top1_other, same_top1, gap_base, dgap, max_abs_dlogit, verdict);
        ``summary``: the figures (``kld_mean``, ``kld_se``, ``kld_p99.9``, ..., ``dp_rms``, ``ppl_ratio``,
        ``same_top1_share`` with ``same_top1_lo``/``_hi`` (95% Wilson), ``flips``, ...);
        ``kld_exact``: True when the KLD is exact, False when it is the top-k lower bound;
        ``envelope_source``: where the envelope came from.
    """
    _check_pair(base, other)
    n = len(base)
    kl, exact = kld(base, other)
    lpb, lpo = base.logprob_target(), other.logprob_target()
    pb, po = np.exp(lpb), np.exp(lpo)
    dp = po - pb
    t1b, t1o = base.top(0), other.top(0)
    t2b = base.top(1) if base.full or base.top_k >= 2 else None  # a top-1 base knows no top-2 gap
    same = t1b == t1o
    # gemmdrift's own figures, on raw logits: over the base's top-k (every logit when both are full).
    if base.full and other.full:
        drift = metrics.logit_drift(base.values, other.values)
        gap, dgap, max_abs = drift["gap_a"], drift["dgap"], drift["max_abs_dlogit"]
    else:
        ids = base.ids[:, : base.top_k] if not base.full else other.ids[:, : other.top_k]
        la, _ = gather(base, ids)
        lb, known = gather(other, ids)
        d = np.abs(la - lb)
        max_abs = np.where(known.any(axis=1), np.nanmax(np.where(known, d, -np.inf), axis=1), np.nan)
        if t2b is None:
            gap = dgap = np.full(n, np.nan)
        else:
            pair = np.stack([t1b, t2b], axis=1)
            a2, _ = gather(base, pair)
            b2, _ = gather(other, pair)
            gap = a2[:, 0] - a2[:, 1]
            dgap = gap - (b2[:, 0] - b2[:, 1])  # NaN where the other does not know both of the base's top two
    flips = ~same
    agree = np.abs(dgap[same & np.isfinite(dgap)])
    if envelope is not None:
        env, source = float(envelope), "given"
    elif agree.size:
        env, source = float(agree.max()), "max |Δgap| where the top-1 agrees"
    else:
        finite = np.abs(dgap[np.isfinite(dgap)])
        env, source = (float(finite.max()) if finite.size else 0.0), "max |Δgap| (no position agrees)"
    verdict = np.where(flips, np.where(np.isnan(gap), UNJUDGED, np.where(gap <= env, NEAR_TIE, OUTSIDE)), "")
    ppl_b, ppl_o = math.exp(-float(np.mean(lpb))), math.exp(-float(np.mean(lpo)))
    lo, hi = wilson(int(same.sum()), n)
    s: dict[str, float] = {"positions": float(n), "kld_exact": float(exact)}
    s.update(distribution(kl, "kld"))
    if n > 1:
        s["kld_se"] = float(np.std(kl, ddof=1) / math.sqrt(n))
    s.update(distribution(dp, "dp"))
    s["dp_rms"] = float(math.sqrt(np.mean(dp * dp)))
    s.update({"ppl_base": ppl_b, "ppl_other": ppl_o, "ppl_ratio": ppl_o / ppl_b,
              "same_top1": float(same.sum()), "same_top1_share": float(same.mean()), "same_top1_lo": lo,
              "same_top1_hi": hi, "flips": float(flips.sum()),
              "flips_near_tie": float(np.count_nonzero(verdict == NEAR_TIE)),
              "flips_outside": float(np.count_nonzero(verdict == OUTSIDE)), "envelope": env})
    fin_abs = max_abs[np.isfinite(max_abs)]
    if fin_abs.size:
        s["max_abs_dlogit"] = float(fin_abs.max())
    fd = np.abs(dgap[np.isfinite(dgap)])
    if fd.size:
        s.update({"max_abs_dgap": float(fd.max()), "p50_abs_dgap": float(np.percentile(fd, 50)),
                  "p99_abs_dgap": float(np.percentile(fd, 99))})
    if flips.any():
        s["max_gap_at_flip"] = float(np.max(gap[flips]))
    per = {"position": base.positions, "target": base.targets, "kld": kl, "logp_base": lpb, "logp_other": lpo,
           "p_base": pb, "p_other": po, "dp": dp, "rank_base": base.target_rank, "rank_other": other.target_rank,
           "top1_base": t1b, "top1_other": t1o, "same_top1": same, "gap_base": gap, "dgap": dgap,
           "max_abs_dlogit": max_abs, "verdict": verdict}
    return {"positions": per, "summary": s, "kld_exact": exact, "envelope_source": source}
