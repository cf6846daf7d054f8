"""What two releases' runs say about each other (numpy only): the logits compared, where the greedy streams part
and the verdict there, the speed ratio, and the figures the class is judged from.

* The logits: :func:`gemmdrift.measure.twostats.two_run_stats` on every logit of both releases (KLD exact),
  the old release as the base.
* The parting: the first generated token where the two greedy streams differ. Both releases computed the
  logits there from the same prefix (the streams agree before it), so each side's own step is its
  teacher-forced logits: the margin between the two competing tokens is read under each release, and the
  verdict is triage's: NEAR-TIE when the smaller margin is within the envelope (the largest |Δgap| the release
  switch made at the compared positions where the top-1 agrees), OUTSIDE ENVELOPE otherwise.
* The class: :func:`gemmdrift.changelog.classify.classify` on one mapping of figures per release (every logit
  as a digest, each compared position's top-1, each greedy token, the decode vs verify:2 envelope and flips,
  and the ops that moved); the answer figures are the top-1s and the greedy tokens.
* The direction: each class figure's, declared in :data:`DIRECTIONS` beside the names :func:`class_figures` gives
  them, and :func:`by_direction` judges the pair's changes as the gate judges a tracked figure
  (:func:`gemmdrift.directions.judge`).
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping, Sequence

import numpy as np

from .. import defaults
from .. import directions as D
from ..measure.twostats import two_run_stats, view_from_logits
from ..result import Verdict

IDENTICAL, NEAR_TIE, OUTSIDE = Verdict.IDENTICAL.value, Verdict.NEAR_TIE.value, Verdict.OUTSIDE.value
ANSWER_PREFIXES = ("top1/", "greedy/")


# Which way is better for each class figure, by the part of its name before '/' (gemmdrift.directions): the decode vs
# verify:2 drift is lower-is-better; the logits' bits, a position's top-1, a greedy token and the count of ops that
# moved are news either way (another token is neither better nor worse: the class and the parting judge it).
DIRECTIONS = {"logits": D.EITHER, "ops": D.EITHER, "decode_verify2": D.LOWER, "top1": D.EITHER, "greedy": D.EITHER}


def direction(name: str) -> str | None:
    """The declared direction of a class figure (None: undeclared, news)."""
    return DIRECTIONS.get(name.partition("/")[0])


def by_direction(old: Mapping[str, float], new: Mapping[str, float],
                 threshold: float = defaults.GATE_THRESHOLD) -> dict[str, list[dict[str, Any]]]:
    """The class figures measured on both sides that changed, judged by their direction as the gate judges:
    ``{worse, better, within, news: [{figure, old, new}]}`` (``worse``: past the gate's threshold)."""
    out: dict[str, list[dict[str, Any]]] = {v: [] for v in (D.WORSE, D.BETTER, D.WITHIN, D.NEWS)}
    for name in sorted(set(old) & set(new)):
        a, b = float(old[name]), float(new[name])
        if np.isnan(a) or np.isnan(b):
            continue
        verdict = D.judge(direction(name), a, b, threshold)
        if verdict in out:
            out[verdict].append({"figure": name, "old": a, "new": b})
    return out


def is_answer(name: str) -> bool:
    """The upgrade's answer figures: a compared position's top-1 token, a greedy token."""
    return name.startswith(ANSWER_PREFIXES)


def digest(a: np.ndarray) -> float:
    """The bits of an array as an exact float (52 bits of its sha256): equal arrays, equal figures."""
    return float(int(hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()[:13], 16))


def logits_stats(tokens: Sequence[int], positions: np.ndarray, old: np.ndarray, new: np.ndarray) -> dict[str, Any]:
    """two_run_stats of the new release's logits against the old one's, every logit (exact KLD)."""
    targets = np.asarray(tokens, np.int64)[np.asarray(positions) + 1]
    va = view_from_logits(old, positions, targets, 2, full=True)
    vb = view_from_logits(new, positions, targets, 2, full=True)
    st = two_run_stats(va, vb)
    s = st["summary"]
    return {"positions": int(len(positions)), "kld_mean": s["kld_mean"], "kld_p99.9": s["kld_p99.9"],
            "same_top1": int(s["same_top1"]), "same_top1_share": s["same_top1_share"], "flips": int(s["flips"]),
            "flips_near_tie": int(s["flips_near_tie"]), "flips_outside": int(s["flips_outside"]),
            "max_abs_dlogit": s.get("max_abs_dlogit", 0.0), "max_abs_dgap": s.get("max_abs_dgap", 0.0),
            "envelope": s["envelope"], "envelope_source": st["envelope_source"],
            "bit_identical": bool(np.array_equal(old, new)),
            "flip_positions": [int(p) for p, same in zip(positions, st["positions"]["same_top1"]) if not same]}


def parting(old: Mapping[str, np.ndarray], new: Mapping[str, np.ndarray], envelope: float) -> dict[str, Any]:
    """Where the greedy streams part and triage's verdict there (see the module docstring). ``greedy``: the
    tokens; ``greedy_logits``: each step's logits (every logit of the vocabulary)."""
    a, b = np.asarray(old["greedy"]), np.asarray(new["greedy"])
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    out: dict[str, Any] = {"generated": int(n), "envelope": float(envelope)}
    if not differ.size:
        return {**out, "index": None, "verdict": IDENTICAL, "reason": f"the {n} greedy tokens agree"}
    i = int(differ[0])
    ta, tb = int(a[i]), int(b[i])
    la, lb = np.asarray(old["greedy_logits"][i], np.float64), np.asarray(new["greedy_logits"][i], np.float64)
    gap_old, gap_new = float(la[ta] - la[tb]), float(lb[tb] - lb[ta])  # each release's margin for its own token
    margin = min(gap_old, gap_new)
    near = margin <= envelope
    verdict = NEAR_TIE if near else OUTSIDE
    reason = (f"the two tokens are {margin:.4g} apart, within the envelope {envelope:.4g}: a near-tie the release "
              "switch tipped" if near else
              f"the two tokens are {margin:.4g} apart, outside the envelope {envelope:.4g}: the releases compute "
              "this step differently, not only rounding")
    return {**out, "index": i, "token_old": ta, "token_new": tb, "margin_old": gap_old, "margin_new": gap_new,
            "margin": margin, "verdict": verdict, "reason": reason}


def speed(rounds: Sequence[tuple[Mapping[str, float], Mapping[str, float]]]) -> dict[str, Any]:
    """Medians of rounds measured alternately (old, new), and new / old."""
    out: dict[str, Any] = {"rounds": len(rounds)}
    for key in ("prefill_tok_s", "decode_tok_s"):
        o = float(np.median([r[0][key] for r in rounds]))
        n = float(np.median([r[1][key] for r in rounds]))
        out[key] = {"old": o, "new": n, "ratio": n / o if o else float("nan")}
    return out


def class_figures(run: Mapping[str, Any], arrays: Mapping[str, np.ndarray], ops_changed: int) -> dict[str, float]:
    """One release's figures for the class: the logits' bits, each position's top-1, each greedy token, the
    decode vs verify:2 envelope and flips, and how many captured ops computed other bits than the old release."""
    logits = arrays["logits"]
    figs = {"logits/digest": digest(logits), "ops/changed": float(ops_changed),
            "decode_verify2/max_abs_dlogit": float(run["envelope"]["max_abs_dlogit"]),
            "decode_verify2/envelope": float(run["envelope"]["envelope"]),
            "decode_verify2/flips": float(run["envelope"]["flips"])}
    for p, t in zip(arrays["positions"], np.argmax(logits, axis=1)):
        figs[f"top1/{int(p)}"] = float(t)
    for i, t in enumerate(arrays["greedy"]):
        figs[f"greedy/{i}"] = float(t)
    return figs
