"""The report's first screen: the answer to the question users come with, computed from the parts' Results.

Would speculative decoding on this machine reproduce plain greedy, and if not, why? Three to five lines,
each a :class:`Claim` with its figures and the parts they come from:

* the teacher-forced logits of decode against verification (a ``stack`` part whose pairs verify), below and
  past the sliding window;
* what the drift is, where there is some: rounding or not (the precision ladder), in which op (the ``attribute``
  part's local drift), and whether any projection changes with T (the ``kernels`` part);
* mlx-lm's plain and speculative greedy streams (the ``diverge`` part's triage);
* the caches' rollback and trim (the ``state`` part);
* what a GPU would compute (the ``predict`` part's replay), where there is room;
* the parts not measured yet.

Every word is computed from the Results: nothing here holds a figure. A replayed part (``--kernels
replay:<chip>``) is said to be a prediction for that chip, a partial part to be partial.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import pandas as pd

from ..result import Result, Verdict
from ..text import fmt, logits, nth_generated

MAX_LINES = 5
WHERE = {"below": "below the window", "at": "at the window", "past": "past the window", "far": "far past the window"}
# The question, as the first screen's heading.
QUESTION = "Would speculative decoding here reproduce plain greedy?"
# What each part adds to the answer, for the line that says what is not measured yet.
TOPICS = {"stack-decode": "decode vs verification", "diverge": "greedy generation", "state": "cache state",
          "attribute": "which op", "kernels": "GEMV vs GEMM", "predict": "the GPU prediction"}


@dataclass(frozen=True)
class Part:
    """One part of a results directory as the answer reads it: its directory name, kind, number on the page and
    Result (None: not finished)."""

    name: str
    kind: str
    number: int
    result: Result | None


@dataclass(frozen=True)
class Claim:
    """One line of the answer. ``topic``: logits, drift, greedy, state, gpu or missing. ``verdict``: what the
    line says, in the words the parts use (bit-identical, drift, rounding, semantic, unclear, unreliable, not
    laddered; IDENTICAL, NEAR-TIE, OUTSIDE ENVELOPE; EXACT, STATE BUG, refused; predicted; not measured).
    ``parts``: the page numbers of the parts its figures come from."""

    topic: str
    verdict: str
    text: str
    parts: tuple[int, ...]

    def line(self) -> str:
        refs = ", ".join(str(p) for p in self.parts)
        return self.text + (f" — part{'s' if len(self.parts) > 1 else ''} {refs}" if self.parts else "") + "."


def _replay_chip(result: Result) -> str | None:
    rep = (result.details or {}).get("replay")
    return rep.get("chip") if isinstance(rep, dict) and "chip" in rep else None


def _partial(result: Result) -> str:
    p = (result.inputs or {}).get("partial")
    return (f" (partial: {p.get('done')} of {p.get('total')} {p.get('unit', 'units')})"
            if isinstance(p, dict) else "")


def _subject(result: Result) -> str:
    chip = _replay_chip(result)
    if chip:
        return f"Predicted for {chip} (its kernels replayed here, not a measurement on it), speculative decoding"
    backend = (result.env or {}).get("backend")
    return f"Speculative decoding on this machine{f' ({backend} backend)' if backend else ''}"


def _span(lo: int, hi: int) -> str:
    return f"position {lo}" if lo == hi else f"positions {lo}–{hi}"


def _first(parts: Sequence[Part], kind: str, name: str) -> Part | None:
    """The part named ``name``, else the first finished part of ``kind``."""
    named = [p for p in parts if p.name == name and p.result is not None and p.kind == kind]
    return (named or [p for p in parts if p.kind == kind and p.result is not None] or [None])[0]


# ------------------------------------------------------------------ the teacher-forced logits (stack, kernels, attribute)


def stack_facts(result: Result) -> dict[str, Any]:
    """Decode vs verification in one stack Result: the verifying pairs, the positions compared, the window, where
    the logits first move, the envelope, the ladder's verdict."""
    from .summaries import stack_summary

    s = stack_summary(result)
    verify = [p for p in s["pairs"] if "verify" in p["pair"]] or s["pairs"]
    pos = result.tables.get("positions", pd.DataFrame())
    if len(pos):
        pos = pos[(pos["mode"] == "accumulated") & (pos["dtype"] == s["dtype"])
                  & pos["pair"].isin([p["pair"] for p in verify])]
    lo = int(pos["position"].min()) if len(pos) else None
    hi = int(pos["position"].max()) if len(pos) else None
    moved = pos[pos["max_abs_dlogit"] > 0] if len(pos) else pos
    drifting = [p for p in verify if p.get("first_layer_with_drift") is not None or (p.get("max_abs_dlogit") or 0) > 0]
    ladder = result.tables.get("ladder", pd.DataFrame())
    shrink = ladder[ladder["pair"].isin([p["pair"] for p in drifting]) & (ladder["shrink"] > 0)]["shrink"] \
        if len(ladder) and "shrink" in ladder.columns else []
    verdicts = [p.get("ladder_verdict") for p in drifting]
    return {
        "pairs": [p["pair"] for p in verify], "schedules": [p["pair"].split(" vs ")[-1] for p in verify],
        "lo": lo, "hi": hi, "window": ((result.inputs or {}).get("model") or {}).get("sliding_window"),
        "drift": bool(drifting), "first_moved": int(moved["position"].min()) if len(moved) else None,
        "first_layer": min((p["first_layer_with_drift"] for p in drifting
                            if p.get("first_layer_with_drift") is not None), default=None),
        "max_abs_dlogit": max((float(p.get("max_abs_dlogit") or 0) for p in verify), default=0.0),
        "max_abs_dgap": max((float(p.get("max_abs_dgap") or 0) for p in verify), default=0.0),
        "flips": max((int(p.get("flips") or 0) for p in verify), default=0),  # the worst pair's (same positions)
        "ladder": (None if not drifting or any(v is None for v in verdicts) else
                   next((v for v in (Verdict.SEMANTIC, Verdict.UNRELIABLE, Verdict.UNCLEAR, Verdict.ROUNDING)
                         if v in verdicts), Verdict.NO_DRIFT)),
        "least_shrink": float(min(shrink)) if len(shrink) else math.nan,
    }


def _where(f: dict[str, Any]) -> str:
    """The positions compared, against the window: 'positions 500–559, across the 512-token sliding window'."""
    lo, hi, w = f["lo"], f["hi"], f["window"]
    if lo is None:
        return "the positions compared not recorded"
    text = _span(lo, hi)
    if not w:
        return text
    if hi < w:
        return f"{text}, all below the {w}-token sliding window (past it is not measured at these sizes)"
    if lo >= w:
        return f"{text}, all past the {w}-token sliding window"
    return f"{text}, across the {w}-token sliding window"


def _local_classes(result: Result | None) -> list[str] | None:
    """The op classes that drift on their own input (the attribute part), None when it did not see the drift."""
    if result is None:
        return None
    ops = result.tables.get("ops", pd.DataFrame())
    hit = ops[ops["positions_differ"] > 0] if len(ops) else ops
    env = result.tables.get("envelope", pd.DataFrame())
    if not len(hit) and (not len(env) or float(env["max_abs_dlogit"].max()) == 0):
        return None  # nothing drifted at its positions: it says nothing about the drift found elsewhere
    col = "class" if "class" in hit.columns else "op"
    return list(dict.fromkeys(str(c) for c in hit[col])) if len(hit) else []


def _kernels_note(result: Result | None) -> str:
    if result is None:
        return ""
    from .summaries import kernels_summary, measured_ts

    real = [p for p in kernels_summary(result.tables["kernels"])["paths"] if not p["emulated"]]
    if not real:
        return ""
    worst = max(real, key=lambda p: p["max_ulp"])
    if worst["max_ulp"] == 0:
        return f"; no projection changes with T (GEMV vs GEMM at {measured_ts(real)}: 0 ULP)"
    return f"; projections change with T ({worst['path']}: up to {fmt(worst['max_ulp'])} ULP)"


def logits_claims(stack: Part, kernels: Part | None, attribute: Part | None) -> list[Claim]:
    r = stack.result
    f = stack_facts(r)
    sched = ", ".join(f"`{s.split(',')[-1]}`" for s in f["schedules"])
    subject, part = _subject(r), _partial(r)
    if not f["drift"]:
        return [Claim("logits", "bit-identical",
                      f"{subject} reproduces plain decoding bit for bit: {sched} against decode, max |Δlogit| 0 at "
                      f"{_where(f)}{part}", (stack.number,))]
    w, first = f["window"], f["first_moved"]
    below_clean = bool(w and first is not None and f["lo"] is not None and f["lo"] < w <= first)
    out = []
    if below_clean:
        out.append(Claim("logits", "bit-identical",
                         f"{subject} reproduces plain decoding bit for bit below the {w}-token sliding window "
                         f"({sched} against decode, {_span(f['lo'], w - 1)}: max |Δlogit| 0){part}", (stack.number,)))
    else:
        if first is not None and w and first < w:
            where = f"from position {first}, below the {w}-token sliding window ({_span(f['lo'], f['hi'])} compared)"
        elif first is not None:
            where = f"from position {first} ({_where(f)})"
        else:
            where = f"in the hidden states from layer {f['first_layer']}, not at the logits ({_where(f)})"
        out.append(Claim("logits", "drift",
                         f"{subject} does not reproduce plain decoding bit for bit: {sched} against decode "
                         f"differ{'s' if len(f['schedules']) == 1 else ''} {where}{part}", (stack.number,)))
    lad = f["ladder"]
    nature, why = {
        Verdict.ROUNDING: ("by rounding", ""),
        Verdict.SEMANTIC: ("by more than rounding", "; at float32 the drift does not shrink: the schedules compute "
                                                    "different things, such as keys, offsets or cache state"),
        Verdict.UNCLEAR: ("by rounding or not (unclear)", "; at float32 the drift shrinks, but less than rounding "
                                                           "would"),
        Verdict.UNRELIABLE: ("by rounding or not (unreliable to tell)", "; the float32 rung ran TF32 matmuls"),
        Verdict.NO_DRIFT: ("with nothing left at float32", ""),
        None: ("by rounding or not", "; the precision ladder did not run at these sizes")}[lad]
    lead = f"Past it (from position {first}), the schedules differ" if below_clean else "They differ"
    classes = _local_classes(attribute.result if attribute else None)
    parts = [stack.number]
    ops = ""
    if classes is not None and attribute is not None:
        parts.append(attribute.number)
        ops = (f" in {', '.join(f'`{c}`' for c in classes)}" if classes else
               ", with no op drifting on its own input (unattributed),")
        if _replay_chip(attribute.result) and not _replay_chip(r):
            ops += f" (which op: predicted for {_replay_chip(attribute.result)})"
    figures = (f"max |Δlogit| {fmt(f['max_abs_dlogit'])}, max |Δgap| {fmt(f['max_abs_dgap'])}, "
               f"{'no' if not f['flips'] else f['flips']} argmax flip{'' if f['flips'] == 1 else 's'}")
    if lad == Verdict.ROUNDING and math.isfinite(f["least_shrink"]):
        figures += f"; at float32 it shrinks at least {f['least_shrink']:,.0f}×"
    figures += why
    note = _kernels_note(kernels.result if kernels else None)
    if note:
        parts.append(kernels.number)
    out.append(Claim("drift", str(lad) if lad is not None else "not laddered",
                     f"{lead}{ops} {nature} ({figures}{note})", tuple(sorted(parts))))
    return out


# ------------------------------------------------------------------ greedy generation (diverge)


def greedy_claim(diverge: Part) -> Claim:
    r = diverge.result.details
    t = r.get("triage") or {}
    a, b = r.get("stream_a") or {}, r.get("stream_b") or {}
    window = ((diverge.result.inputs or {}).get("model") or {}).get("sliding_window")
    p0, n = int(r.get("prompt_tokens") or 0), int(r.get("n") or 0)
    where = ""
    if window:
        where = ", " + ("across" if p0 < window <= p0 + n - 1 else "past" if p0 >= window else "below") + \
                f" the {window}-token window"
    chip = _replay_chip(diverge.result)
    head = (f"Greedy generation (mlx-lm, {a.get('label') or 'A'} vs {b.get('label') or 'B'}, {n} tokens after a "
            f"{p0}-token prompt{where}{f'; predicted for {chip}' if chip else ''}){_partial(diverge.result)}")
    d = r.get("first_divergence")
    if not t:
        return Claim("greedy", "IDENTICAL" if d is None else "not triaged",
                     f"{head} gives the same tokens" if d is None else
                     f"{head} parts at {nth_generated(d)} (not triaged)", (diverge.number,))
    v = str(t.get("verdict"))
    if v == Verdict.IDENTICAL:
        return Claim("greedy", v, f"{head} gives the same tokens, each what its own schedule computes (**IDENTICAL**)",
                     (diverge.number,))
    env, margin = fmt(t.get("envelope")), logits(t.get("margin"))
    if v == Verdict.NEAR_TIE:
        return Claim("greedy", v, f"{head} parts at {nth_generated(t['index'])} on a **NEAR-TIE** (the two tokens "
                                  f"{margin} apart, within the {env} envelope): rounding, not a bug",
                     (diverge.number,))
    if t.get("index") is None:
        text = f"{head} gives the same tokens, but is **OUTSIDE ENVELOPE**"
    elif t.get("bit_identical"):
        text = (f"{head} parts at {nth_generated(t['index'])} though the schedules are bit-identical: "
                "**OUTSIDE ENVELOPE**, not numeric")
    elif str(t.get("divergence_verdict")) == Verdict.NEAR_TIE:
        text = (f"{head} parts at {nth_generated(t['index'])} on a near-tie ({margin} apart, within the {env} "
                "envelope), and is **OUTSIDE ENVELOPE**")
    else:
        text = (f"{head} parts at {nth_generated(t['index'])}, the two tokens {margin} apart: **OUTSIDE "
                f"ENVELOPE** (the envelope is {env})")
    wrong = []
    for key, s in (("a", a), ("b", b)):
        c = t.get(f"stream_{key}_check") or {}
        if c.get("first_outside") is not None:
            wrong.append(f"the {s.get('label') or key.upper()} stream is not what its own schedule computes from "
                         f"{nth_generated(c['first_outside'])} ({logits(c.get('margin_outside'))} below the "
                         "argmax), so it ran from a wrong state")
    return Claim("greedy", v, text + (f": {'; '.join(wrong)}" if wrong else ""), (diverge.number,))


# ------------------------------------------------------------------ cache state (state)


def state_claim(state: Part) -> Claim:
    t = state.result.tables["state"]
    impl = (state.result.inputs or {}).get("implementations")
    said = {Verdict.STATE_BUG: "a **STATE BUG** under `{op}`", Verdict.REFUSED: "**refused** under `{op}` (it raised)",
            Verdict.UNRELIABLE: "not judged under `{op}` (the float32 rung was TF32)",
            Verdict.ROUNDING: "different by rounding under `{op}`"}
    groups = []  # (verdict, cache, what it is under the operation), the worst verdicts first
    for verdict, words in said.items():
        for (cache, op), g in t[t["verdict"] == str(verdict)].groupby(["cache", "operation"], sort=False):
            n = int(((t["cache"] == cache) & (t["operation"] == op)).sum())
            wheres = ", ".join(WHERE.get(str(w), str(w)) for w in dict.fromkeys(g["where"])
                               if str(w) not in ("", "nan"))
            groups.append((verdict, cache, words.format(op=op) + f" in {len(g)} of {n} cases"
                           + (f" ({wheres})" if wheres else "")))
    exact = t.groupby("cache")["verdict"].agg(lambda v: set(v) == {str(Verdict.EXACT)})
    clean = [c for c, ok in exact.items() if ok]
    under = " (the cache under test)" if impl else ""
    checked = t[t["verdict"] == str(Verdict.EXACT)]
    if not groups:
        if not len(checked):
            return Claim("state", str(Verdict.NOT_APPLICABLE), "No cache operation was checked here (none applies to "
                                                               "this model's caches)", (state.number,))
        return Claim("state", str(Verdict.EXACT),
                     f"Every cache operation checked is exact{under}: "
                     f"{', '.join(f'`{c}`' for c in dict.fromkeys(checked['cache']))} × "
                     f"{', '.join(f'`{o}`' for o in dict.fromkeys(checked['operation']))}, "
                     f"{len(checked)} cases{_partial(state.result)}", (state.number,))
    lines = []
    for cache in dict.fromkeys(g[1] for g in groups):
        lines.append(f"`{cache}`{under} is " + " and ".join(g[2] for g in groups if g[1] == cache))
    text = ("The stock " if not impl else "") + "; ".join(lines)
    if clean:
        text += f"; {', '.join(f'`{c}`' for c in clean)} exact in every case"
    bugs = [g for g in groups if g[0] == Verdict.STATE_BUG]
    if bugs and not impl and any(op in g[2] for g in bugs for op in ("`rollback`", "`trim_prompt_cache`")):
        text += (" (speculative decoding rewinds rejected drafts with `trim_prompt_cache`). An exact cache to put "
                 "through the same grid: `gemmdrift state --cache-impl gemmdrift.caches.exact:make_cache`")
    return Claim("state", str(groups[0][0]), text + _partial(state.result), (state.number,))


# ------------------------------------------------------------------ a GPU (predict)


def _verify_of(schedule: Any) -> str:
    """``prefill:1,verify:3`` -> ``verify:3``: the pair's verification step, as the README names it."""
    steps = [x for x in str(schedule).split(",") if x.startswith("verify")]
    return steps[-1] if steps else str(schedule)


def gpu_claim(predict: Part) -> Claim | None:
    from .predict import predict_summary

    s = predict_summary(predict.result)
    said = []
    for chip, c in s["chips"].items():
        rows = [r for r in c["envelope"] if "verify" in str(r.get("schedule"))]
        if rows:
            # The verification pair that drifts most (its default variant), named: verify:2 and verify:3 differ
            # (the README quotes M1's verify:2, 0.375; verify:3 reads 0.3818).
            top = max(rows, key=lambda r: (float(r.get("max_abs_dlogit_default") or 0),
                                           float(r.get("flips_default") or 0)))
            worst = float(top.get("max_abs_dlogit_default") or 0)
            flips = int(max(float(r.get("flips_default") or 0) for r in rows))  # the most of any pair
            which = f" ({_verify_of(top.get('schedule'))})" if len(rows) > 1 else ""
            said.append(f"`{chip}` " + (f"max |Δlogit| {fmt(worst)}{which}, {flips} flip{'' if flips == 1 else 's'}"
                                        if worst > 0 else "bit-identical"))
        elif any("verify" in str(r.get("schedule")) for r in c["refused"]):
            said.append(f"`{chip}` not knowable")
    if not said:
        return None
    return Claim("gpu", "predicted", f"On a GPU, predicted by replaying its kernels here (not a measurement), decode "
                                     f"vs verification below the window: {'; '.join(said)}{_partial(predict.result)}",
                 (predict.number,))


# ------------------------------------------------------------------ the answer


def answer(parts: Sequence[Part], missing: Sequence[str] = ()) -> list[Claim]:
    """The first screen's lines (at most :data:`MAX_LINES`), from the parts of a results directory; ``missing``:
    the names of the parts not finished (said in one line). A part named in ``missing`` that holds a Result (an
    interrupted part, partial, or one whose ``done.json`` was never written) is unfinished: the page says so, and
    none of its figures is used here."""
    unfinished = [p for p in parts if p.name in missing and p.result is not None]
    parts = [p for p in parts if p.name not in missing]
    stack = next((p for p in parts if p.kind == "stack" and p.result is not None
                  and any("verify" in pair for pair in p.result.tables["stack"]["pair"])), None)
    kernels, attribute = _first(parts, "kernels", "kernels"), _first(parts, "attribute", "attribute")
    diverge, state, predict = (_first(parts, "diverge", "diverge"), _first(parts, "state", "state"),
                               _first(parts, "predict", "predict"))
    claims: list[Claim] = []
    if stack:
        claims += logits_claims(stack, kernels, attribute)
    if diverge:
        claims.append(greedy_claim(diverge))
    if state:
        claims.append(state_claim(state))
    end = []
    # the parts the answer reads, the answer's own first; one with a Result (partial) says so in its own line
    started = {p.name: p for p in unfinished}
    missing = [m for m in TOPICS if m in missing and m not in {p.name for p in parts if p.result is not None}]
    if missing:
        said = [f"Not measured yet: {', '.join(TOPICS.get(m, m) + f' (`{m}/`)' for m in missing if m not in started)}"
                if any(m not in started for m in missing) else ""]
        if started:
            notes = {m: _partial(started[m].result).strip(" ()") for m in started}
            said.append("unfinished, so not used here: " + ", ".join(
                f"{TOPICS.get(m, m)} (`{m}/`" + (f", {notes[m]}" if notes[m] else "") + ")"
                for m in missing if m in started))
        text = "; ".join(w for w in said if w)
        end.append(Claim("missing", "not measured", text[0].upper() + text[1:] + "; rerun `gemmdrift run` with the "
                         "same `--out` to finish", ()))
    elif not stack and not diverge:
        end.append(Claim("missing", "not measured",
                         "Not measured here: no part compares decode with verification (a `stack` part with a verify "
                         "schedule) or plain with speculative greedy generation (a `diverge` part)", ()))
    gpu = gpu_claim(predict) if predict else None
    if gpu and len(claims) + len(end) < MAX_LINES:
        claims.append(gpu)
    return claims[:MAX_LINES - len(end)] + end
