"""The verdict of an attribution (issue 29, and issue 46 for the rules under a replay): which op classes cause
the flips, what is left unattributed, in one line.

The rules, each a test (``tests/test_attribute_replay.py``):

* a **cause** of the flip at position ``p`` is a class that drifts locally (its own output differs on the
  reference's input), whose local drift starts at or before ``p``, and whose counterfactual (the class made
  invariant) removes the flip at ``p``. A class that only carries the drift (a norm, the residual adds) has no
  local drift of its own: that replacing it removes a flip proves nothing, it replaced everything upstream;
* the final norm and the LM head (:data:`DOWNSTREAM`) sit after every other op: replacing them replaces the
  logits. They are never a cause, and ``all-but-one`` never replaces them (it holds them like every other
  class, :mod:`gemmdrift.attribution.hold`: the head's own drift is its own row);
* what differs at the logits must show in some op's local drift, or is said ``unattributed``, naming what: a
  difference made between two tapped ops (the MLP activation, an inline residual add, the embedding) shows as a
  differing *input* of the next op (:func:`unattributed`).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import pandas as pd

from ..model import optaps
from ..text import fmt

DOWNSTREAM = (optaps.FINAL_NORM, optaps.LM_HEAD)  # after every other op: replacing them replaces the logits


def ops_summary(local: pd.DataFrame) -> pd.DataFrame:
    """Per (layer, op): positions with differing bits, the largest share, ULP and rel L2, the first such position."""
    rows = []
    for (layer, op), g in local.groupby(["layer", "op"], sort=False):
        hit = g[g["frac_differ"] > 0]
        rows.append({"layer": int(layer), "op": op, "class": g["class"].iloc[0], "kind": g["kind"].iloc[0],
                     "order": int(g["order"].iloc[0]), "positions_differ": int(len(hit)),
                     "frac_differ": float(g["frac_differ"].max()), "max_ulp": float(g["max_ulp"].max()),
                     "rel_l2": float(g["rel_l2"].max()),
                     "first_position": int(hit["position"].min()) if len(hit) else -1})
    return pd.DataFrame(rows).sort_values("order", kind="stable").reset_index(drop=True) if rows else pd.DataFrame()


def first_drift(summary: pd.DataFrame) -> dict[str, int]:
    """Per class with local drift: the first position where any of its ops' output bits differ."""
    if not len(summary):
        return {}
    hit = summary[summary["positions_differ"] > 0]
    return {c: int(g["first_position"].min()) for c, g in hit.groupby("class", sort=False)}


def causes_of(position: int, each: pd.DataFrame, summary: pd.DataFrame) -> list[str]:
    """The classes that cause the flip at ``position``: local drift starting at or before it, not downstream of
    every op, and their ``each`` counterfactual (rows of ``each``: class, flip_positions) leaves no flip there."""
    first = first_drift(summary)
    return [c for c, f in zip(each["class"], each["flip_positions"]) if c not in DOWNSTREAM and c in first
            and first[c] <= position and int(position) not in [int(x) for x in f]]


def _untapped_before(op: str, layer: int) -> str:
    """What computes an op's input without a tap of its own."""
    if optaps.op_class(op) == "mlp.down_proj":
        return "the MLP activation (gelu/silu of gate_proj times up_proj)"
    if layer == 0 and op == "input_layernorm":
        return "the embedding lookup and scale"
    if optaps.op_class(op) in ("residual", "input_layernorm"):
        return "the residual stream between the layers (an inline add)"
    return f"the computation feeding {op} (no tapped op makes it)"


def unattributed(local: pd.DataFrame) -> list[dict[str, Any]]:
    """Differences made between two tapped ops: per op whose computed input differs from the reference's (a local
    run with its inputs kept), what made that input, in which layers, from which position."""
    if not len(local) or "input_differ" not in local:
        return []
    hit = local[local["input_differ"] > 0]
    out: dict[str, dict[str, Any]] = {}
    for (layer, op), g in hit.groupby(["layer", "op"], sort=False):
        what = _untapped_before(op, int(layer))
        u = out.setdefault(what, {"what": what, "before": op, "layers": [], "first_position": int(g["position"].min())})
        u["layers"].append(int(layer))
        u["first_position"] = min(u["first_position"], int(g["position"].min()))
    return list(out.values())


def _positions_text(ps: Sequence[int]) -> str:
    ps = list(ps)
    if len(ps) > 4:
        return f"{len(ps)} positions ({', '.join(map(str, ps[:3]))}, ..., {ps[-1]})"
    return " and ".join([", ".join(map(str, ps[:-1])), str(ps[-1])]) if len(ps) > 1 else str(ps[0])


def _flips_text(flips: Sequence[int], each: pd.DataFrame, summary: pd.DataFrame) -> list[str]:
    short = optaps.short_class
    groups: dict[tuple, list[int]] = {}
    for p in flips:
        causes = tuple(causes_of(p, each, summary))
        removers = tuple(c for c, f in zip(each["class"], each["flip_positions"]) if int(p) not in list(f))
        groups.setdefault((causes, removers if not causes else ()), []).append(int(p))
    parts = []
    for (causes, removers), ps in groups.items():
        where = f"the flip{'s' if len(ps) > 1 else ''} at {_positions_text(ps)}"
        verb = "disappear" if len(ps) > 1 else "disappears"
        if causes:
            parts.append(f"{where} {verb} when {' or '.join(short(c) for c in causes)} "
                         f"{'is' if len(causes) == 1 else 'are each'} made invariant")
        elif removers:
            parts.append(f"{where} {verb} only when a class with no local drift at or before it is "
                         f"replaced ({', '.join(short(c) for c in removers[:4])})")
        else:
            parts.append(f"{where} {'survive' if len(ps) > 1 else 'survives'} every single op class made invariant")
    return parts


def verdict_line(pair: str, base: Mapping[str, Any], counterfactual: pd.DataFrame, summary: pd.DataFrame,
                 unattributed_: Sequence[Mapping[str, Any]] = (), skipped: str | None = None) -> str:
    """One line per pair: which op classes the flips (or the logit drift) come from, what is unattributed, and
    whether a projection matters (the rules: this module's docstring)."""
    hit = summary[summary["positions_differ"] > 0] if len(summary) else summary
    if base["max_abs_dlogit"] == 0 and not len(hit) and not unattributed_:
        return (f"{pair}: bit-identical at the logits and at every op; nothing to attribute"
                + (f" ({skipped})" if skipped else ""))
    short = optaps.short_class
    parts = []
    drifting = list(dict.fromkeys(hit["class"])) if len(hit) else []
    if len(hit):
        layers = {c: sorted(set(int(x) for x in hit[hit["class"] == c]["layer"])) for c in drifting}
        parts.append("local drift in " + "; ".join(f"{short(c)} (layer{'s' if len(v) > 1 else ''} "
                                                    f"{','.join(map(str, v))})" for c, v in layers.items())
                     + f" from position {int(hit['first_position'].min())}")
    elif not unattributed_:
        parts.append("no op drifts on its own input")
    for u in unattributed_:
        parts.append(f"unattributed: {u['what']} (the input of {short(u['before'])} differs in layer"
                     f"{'s' if len(u['layers']) > 1 else ''} {','.join(map(str, u['layers']))} from position "
                     f"{u['first_position']})")
    if base["max_abs_dlogit"] > 0 and not len(hit) and not unattributed_:
        parts.append("unattributed: the logits differ though every tapped op and every op's input are "
                     "bit-identical (outside the taps)")
    each = counterfactual[counterfactual["direction"] == "each"] if len(counterfactual) else counterfactual
    flips = list(base["flip_positions"])
    if flips and len(each):
        parts += _flips_text(flips, each, summary)
    elif len(each) and base["max_abs_dlogit"] > 0:
        mine = each[each["class"].isin(drifting) & ~each["class"].isin(DOWNSTREAM)]
        zero = [short(r["class"]) for _, r in mine.iterrows() if r["max_abs_dlogit"] == 0]
        if zero:
            parts.append(f"no flips; the logit drift (max|dlogit| {fmt(base['max_abs_dlogit'])}) is gone when "
                         f"{' or '.join(zero)} {'is' if len(zero) == 1 else 'are each'} made invariant")
        elif len(mine):
            best = mine.sort_values("max_abs_dlogit", kind="stable").iloc[0]
            if best["max_abs_dlogit"] < base["max_abs_dlogit"]:
                parts.append(f"no flips; max|dlogit| {fmt(base['max_abs_dlogit'])} shrinks most with "
                             f"{short(best['class'])} made invariant (to {fmt(best['max_abs_dlogit'])})")
            else:  # every class with local drift made invariant leaves as much or more (issue 53)
                parts.append(f"no flips; no class with local drift made invariant shrinks max|dlogit| "
                             f"{fmt(base['max_abs_dlogit'])} (the least left is {fmt(best['max_abs_dlogit'])}, with "
                             f"{short(best['class'])})")
    if skipped:
        parts.append(skipped)
    proj_hit = sorted(set(hit[hit["kind"].isin(["linear", "head"])]["class"])) if len(hit) else []
    parts.append("projections with local drift: " + ", ".join(short(c) for c in proj_hit) if proj_hit
                 else "no projection matters")
    return f"{pair}: " + "; ".join(parts)


def mark_causes(cf: pd.DataFrame, base: Mapping[str, Any], summary: pd.DataFrame) -> pd.DataFrame:
    """The counterfactual table with ``removes_flips`` (its flips are gone), ``drifts_locally`` and ``cause``
    (a cause of at least one flip, :func:`causes_of`; ``each`` rows only)."""
    if not len(cf):
        return cf
    drifting = set(first_drift(summary))
    flips = list(base["flip_positions"])
    each = cf[cf["direction"] == "each"]
    causes = {c for p in flips for c in causes_of(p, each, summary)}
    cf = cf.copy()
    cf["removes_flips"] = (cf["flips"] == 0) & (base["flips"] > 0)
    cf["drifts_locally"] = cf["class"].isin(drifting)
    cf["cause"] = (cf["direction"] == "each") & cf["class"].isin(causes)
    return cf


__all__ = ["DOWNSTREAM", "ops_summary", "first_drift", "causes_of", "unattributed", "verdict_line", "mark_causes"]
