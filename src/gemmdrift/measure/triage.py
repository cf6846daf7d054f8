"""Triage of a divergence: the first token where two streams part, teacher-forced under both schedules, and the
verdict read from the logits there.

A divergence is a NEAR-TIE when the two competing tokens are closer than the envelope (the largest change of
a top-2 gap that switching schedules made on the same prefix); otherwise it is OUTSIDE ENVELOPE and a state
bug (cache rollback, offsets, masks) is the suspect. If the teacher-forced schedules are bit-identical there,
the divergence is not numeric at all. The streams themselves are generated in :mod:`gemmdrift.measure.diverge`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Sequence

import numpy as np

from .. import metrics
from ..errors import GemmdriftError
from ..text import logits, nth_generated
from ..model import native as native_kernels
from ..model.taps import Prefix, common_prefix, run_schedule
from ..result import Verdict
from ..schedules import parse_schedule


NEAR_TIE = Verdict.NEAR_TIE
OUTSIDE = Verdict.OUTSIDE
ENVELOPE_POSITIONS = 64  # prefix positions whose Δgap make the envelope when none is given
MIN_ENVELOPE_POSITIONS = 16  # fewer continuation positions than this: measure on the prompt too


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token over the common length; None if they agree."""
    for i, (x, y) in enumerate(zip(a, b)):
        if int(x) != int(y):
            return i
    return None


@dataclass
class Triage:
    """The verdict on one pair of streams, with the numbers behind it."""

    verdict: str  # NEAR-TIE | OUTSIDE ENVELOPE | IDENTICAL
    reason: str
    index: int | None  # first divergent generated token (None: the streams agree)
    position: int | None  # absolute position whose logits predict it
    token_a: int | None = None
    token_b: int | None = None
    schedule_a: str = ""
    schedule_b: str = ""
    top2_a: list[int] = field(default_factory=list)
    top2_b: list[int] = field(default_factory=list)
    gap_a: float | None = None  # top-2 gap under schedule A (teacher forced)
    gap_b: float | None = None
    dgap: float | None = None  # Δgap at the divergence
    margin: float | None = None  # how far apart the two competing tokens are (min over schedules)
    envelope: float | None = None  # max |Δgap| the schedule switch made on the shared prefix
    envelope_source: str = ""
    first_layer_differ: int | None = None  # first tap whose hidden state differs at the position
    bit_identical: bool | None = None  # teacher-forced schedules bit-identical on the shared prefix
    reproduces_a: bool | None = None  # teacher-forced argmax under A is stream A's token there
    reproduces_b: bool | None = None
    divergence_verdict: str | None = None  # the verdict on the first divergence alone
    stream_a_check: dict[str, Any] = field(default_factory=dict)  # see check_stream
    stream_b_check: dict[str, Any] = field(default_factory=dict)
    context: str = ""
    lengths: list[int] = field(default_factory=list)  # generated tokens of stream A and stream B

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def token_text(tokenizer, ids) -> str:
    if tokenizer is None:
        return " ".join(str(int(i)) for i in ids)
    return tokenizer.decode(list(ids))


def check_stream(logits: np.ndarray, stream: Sequence[int], envelope: float) -> dict[str, Any]:
    """Does a schedule, teacher-forced on a stream's own prefix, choose the stream's tokens?

    A greedy stream is the argmax of its generator's logits. Teacher forcing
    the same prefix through the same schedule recomputes those logits; where
    the argmax is another token by more than the envelope, the generator
    computed from a different state (a cache that was not rolled back, an
    offset, a mask), whatever the other stream did.

    Args:
        logits: (len(stream), vocab) teacher-forced logits predicting each token.
        stream: the generated tokens.
        envelope: the numeric envelope (logits).
    """
    logits = np.asarray(logits, dtype=np.float64)
    rows = np.arange(len(stream))
    best = logits.argmax(-1)
    chosen = logits[rows, np.asarray(stream, dtype=np.int64)]
    margin = logits[rows, best] - chosen  # >= 0; 0 where the stream's token is the argmax
    off = np.flatnonzero(margin > 0)
    bad = np.flatnonzero(margin > envelope)
    return {
        "tokens": int(len(stream)),
        "mismatches": int(len(off)),
        "first_mismatch": int(off[0]) if len(off) else None,
        "first_outside": int(bad[0]) if len(bad) else None,
        "margin_outside": float(margin[bad[0]]) if len(bad) else None,
        "max_margin": float(margin.max()) if len(margin) else 0.0,
        "margins": [float(m) for m in margin],  # per generated token, logits below the argmax
    }


def triage(lm, prompt: Sequence[int], stream_a: Sequence[int], stream_b: Sequence[int], schedule_a: str,
           schedule_b: str, *, envelope: float | None = None, envelope_positions: int = ENVELOPE_POSITIONS,
           prefix: Prefix | None = None, submit=None) -> Triage:
    """Teacher-force both streams under their schedules and judge them.

    Both schedules are two-phase (prompt | continuation); the split sits at the
    last prompt token, which mlx-lm feeds together with the continuation. Each
    stream is teacher-forced under its own schedule (one run each, logits at
    every generated position), which gives:

    * the envelope: max |Δgap| between the two schedules on the positions
      where both streams still agree (or ``envelope`` if given);
    * the first divergence, judged NEAR-TIE if the competing tokens are within
      the envelope, OUTSIDE ENVELOPE if not, and not numeric at all if the two
      schedules are bit-identical there;
    * a check of each stream against its own schedule (:func:`check_stream`):
      a stream its schedule does not reproduce by more than the envelope was
      generated from a wrong state, which makes the whole verdict OUTSIDE
      ENVELOPE even when the first divergence itself was a near-tie.

    Args:
        lm: the loaded model.
        prompt: prompt token ids (shared by both streams).
        stream_a, stream_b: generated tokens (without the prompt).
        schedule_a, schedule_b: e.g. 'prefill:2048,decode' and 'prefill:512,verify:2'.
        envelope: a known envelope (max |Δgap|, logits); measured here when None.
        envelope_positions: at most this many positions before the divergence make the envelope.
        prefix: the prompt's prefill computed earlier for these schedules (:func:`diverge` passes the one its
            streams started from); used where its blocks are the ones both teacher-forced runs share.
        submit: a :func:`gemmdrift.workers.pool` submitter: stream A's teacher-forced run goes to another
            process while this one runs stream B's (the same run in either).
    """
    from ..checks import check_envelope, check_vocab

    check_envelope(envelope, "envelope")
    for name, s in (("prompt", prompt), ("stream A", stream_a), ("stream B", stream_b)):
        check_vocab(s, lm.description.vocab_size, name)
    if len(prompt) == 0:
        raise GemmdriftError("the streams have no common prefix (empty prompt)")
    if not len(stream_a) or not len(stream_b):
        raise GemmdriftError("a stream has no generated tokens")
    sa, sb = parse_schedule(schedule_a), parse_schedule(schedule_b)
    prompt = [int(t) for t in prompt]
    stream_a, stream_b = [int(t) for t in stream_a], [int(t) for t in stream_b]
    d = first_divergence(stream_a, stream_b)
    common = d if d is not None else min(len(stream_a), len(stream_b))
    split = len(prompt) - 1  # the logits at split + i predict generated token i
    # A one-token prompt has no prefill: the whole sequence is the continuation.
    scheds = [type(s)(s.phases[1:]) if split < 1 and len(s.phases) == 2 else s for s in (sa, sb)]
    split_arg = split if split >= 1 else None
    # The envelope comes from the agreeing continuation, where the schedules
    # differ, when it is long enough, else from prompt positions too.
    last_shared = split + common - (0 if d is not None else 1)
    lo = max(split, last_shared - envelope_positions, 0)
    if last_shared + 1 - lo < MIN_ENVELOPE_POSITIONS:
        lo = max(0, last_shared - envelope_positions)
    tap_at = split + d if d is not None else split
    # Every generated position needs its logits (each stream is checked against
    # its own schedule), and the envelope needs `lo`.. : start at the earlier.
    first = min(lo, split)
    # Blocks before `first` cover prompt tokens only, the same for both streams: run once.
    with native_kernels.shared_prefix(lm.model) as replay:  # replayed kernels: the shared prefix natively
        shared = common_prefix(lm.model, prompt + stream_a[:-1], [x.text for x in scheds], split_arg, int(first),
                               reuse=prefix)
    native_kernels.say_prefix(replay, shared, "both teacher-forced runs")
    jobs = [dict(tokens=prompt + stream[:-1], schedule=sched.text, split=split_arg, positions=[tap_at],
                 logit_positions=np.arange(first, split + len(stream)), prefix=shared)
            for sched, stream in zip(scheds, (stream_a, stream_b))]
    if submit is not None:
        future = submit(_teacher_forced, **jobs[0])
        rb = _teacher_forced(lm, **jobs[1])
        ra = future.result()
    else:
        ra, rb = (_teacher_forced(lm, **job) for job in jobs)
    shared_pos = np.arange(lo, last_shared + 1)
    la, lb = ra.logits[ra.logit_rows(shared_pos)], rb.logits[rb.logit_rows(shared_pos)]
    drift = metrics.logit_drift(la, lb)
    if envelope is None:
        envelope = float(np.max(np.abs(drift["dgap"])))
        source = f"measured: max |Δgap| over {len(shared_pos)} teacher-forced positions {lo}..{last_shared}"
    else:
        source = "given"
    gen = {key: r.logits[r.logit_rows(np.arange(split, split + len(s)))]
           for key, r, s in (("a", ra, stream_a), ("b", rb, stream_b))}
    checks = {"a": check_stream(gen["a"], stream_a, envelope), "b": check_stream(gen["b"], stream_b, envelope)}
    bit_identical = bool(np.array_equal(la, lb) and (d is None or np.array_equal(ra.hidden, rb.hidden)))
    lengths = [len(stream_a), len(stream_b)]
    agree = "the streams agree"
    if lengths[0] != lengths[1]:
        agree += (f" on their common {common} tokens (stream A has {lengths[0]} generated tokens, stream B "
                  f"{lengths[1]}: the rest of the longer one is only checked against its own schedule)")
    out = Triage(Verdict.IDENTICAL, agree, d, None if d is None else tap_at, lengths=lengths,
                 schedule_a=sa.text, schedule_b=sb.text, envelope=float(envelope), envelope_source=source,
                 bit_identical=bit_identical, stream_a_check=checks["a"], stream_b_check=checks["b"])
    if d is not None:
        at_a, at_b = la[-1].astype(np.float64), lb[-1].astype(np.float64)
        ta, tb = stream_a[d], stream_b[d]
        margin = min(abs(at_a[ta] - at_a[tb]), abs(at_b[ta] - at_b[tb]))
        differ = [i for i in range(ra.hidden.shape[0]) if not np.array_equal(ra.hidden[i, -1], rb.hidden[i, -1])]
        a1, a2 = metrics.top2(at_a[None])
        b1, b2 = metrics.top2(at_b[None])
        if bit_identical:
            verdict = OUTSIDE
            reason = ("the teacher-forced schedules are bit-identical on the shared prefix: the streams differ "
                      "for a reason that is not numeric (state, cache, or different inputs)")
        elif margin <= envelope:
            verdict = NEAR_TIE
            reason = f"the competing tokens are {margin:.4g} apart, within the {envelope:.4g} envelope: numeric rounding"
        else:
            verdict = OUTSIDE
            reason = (f"the competing tokens are {margin:.4g} apart, outside the {envelope:.4g} envelope: "
                      "suspect a state bug (cache rollback, offset, mask)")
        ctx = token_text(lm.tokenizer, (prompt + stream_a[:d])[-12:])
        out = replace(out, verdict=verdict, reason=reason, divergence_verdict=verdict, token_a=ta, token_b=tb,
                      top2_a=[int(a1[0]), int(a2[0])], top2_b=[int(b1[0]), int(b2[0])],
                      gap_a=float(drift["gap_a"][-1]), gap_b=float(drift["gap_b"][-1]),
                      dgap=float(drift["dgap"][-1]), margin=float(margin),
                      first_layer_differ=differ[0] if differ else None,
                      reproduces_a=int(a1[0]) == ta, reproduces_b=int(b1[0]) == tb,
                      context=f"...{ctx}[{token_text(lm.tokenizer, [ta])!r} | {token_text(lm.tokenizer, [tb])!r}]")
    wrong = [(key, sched, checks[key]) for key, sched in (("a", sa), ("b", sb))
             if checks[key]["first_outside"] is not None]
    if wrong:
        notes = [f"stream {key.upper()} is not what {sched.text} computes from its own prefix: at "
                 f"{nth_generated(c['first_outside'])} its token is {logits(c['margin_outside'])} below the argmax, outside the "
                 f"{envelope:.4g} envelope, so its generator ran from a wrong state (e.g. a cache that was not "
                 "rolled back)" for key, sched, c in wrong]
        first = f"the first divergence alone: {out.divergence_verdict}, {out.reason}" if out.divergence_verdict else ""
        out = replace(out, verdict=OUTSIDE, reason="; ".join(notes + ([first] if first else [])))
    return out


def _teacher_forced(lm, *, tokens, schedule: str, split, positions, logit_positions, prefix):
    """One teacher-forced run of :func:`triage` (module level: it may run in another process)."""
    return run_schedule(lm.model, tokens, schedule, split=split, positions=positions,
                        logit_positions=logit_positions, prefix=prefix)


def triage_result(t: dict[str, Any], inputs: dict[str, Any], env: dict[str, Any]):
    """The ``triage`` Result of a triage record (:meth:`Triage.as_dict`)."""
    from ..result import Result, env_labels, tidy

    figures = {"outside_envelope": 1.0 if t.get("verdict") == OUTSIDE else 0.0,
               "diverged": 0.0 if t.get("index") is None else 1.0}
    for key in ("margin", "envelope", "dgap"):
        v = t.get(key)
        if v is not None and np.isfinite(v):
            figures[key] = float(v)
    model = inputs.get("model") or {}
    frame = tidy([{"metric": k, "value": v} for k, v in figures.items()], **env_labels(env),
                 model=model.get("source", "") if isinstance(model, dict) else "",
                 pair=f"{t.get('schedule_a')} vs {t.get('schedule_b')}", mode="teacher-forced")
    return Result(kind="triage", inputs=inputs, env=env, frame=frame, figures=figures, details={"triage": t})


def measure_triage(lm, prompt: Sequence[int], stream_a: Sequence[int], stream_b: Sequence[int], schedule_a: str,
                   schedule_b: str, *, env: dict[str, Any] | None = None, **kw):
    """:func:`triage` as a Result."""
    from ..machine.envinfo import environment
    from ..model import weights_record

    env = {**(env if env is not None else environment()), **weights_record(lm.description)}
    t = triage(lm, prompt, stream_a, stream_b, schedule_a, schedule_b, **kw).as_dict()
    inputs = {"model": lm.info, "tokens": [int(x) for x in prompt], "stream_a": [int(x) for x in stream_a],
              "stream_b": [int(x) for x in stream_b], "schedule_a": schedule_a, "schedule_b": schedule_b,
              **{k: v for k, v in kw.items()}}
    return triage_result(t, inputs, env)
