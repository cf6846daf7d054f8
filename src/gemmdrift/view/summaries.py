"""Summaries of a Result: the machine-readable dict (``summary.json``, ``--json``) and the printed text.

Each kind registers its two functions in :data:`SUMMARIES` and :data:`TEXTS`;
a kind without its own gets the generic ones (its tracked figures). Both read
the Result only. The words of history, fingerprint, state, batch and server live in
their kind's view module (history.py, fingerprint.py, state.py, batch.py).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import pandas as pd

from .. import kernels, metrics
from ..model.projections import LM_HEAD
from ..result import Result
from ..text import fmt, logits, nth_generated, t_list, text_table
from .batch import batch_summary, batch_text, server_summary, server_text
from .fingerprint import fingerprint_summary, fingerprint_text
from .history import history_summary, history_text
from .state import state_summary, state_text


def generic_summary(result: Result) -> dict[str, Any]:
    return {"kind": result.kind, "figures": dict(result.figures)}


def generic_text(result: Result) -> str:
    if not result.figures:
        return f"{result.kind}: no tracked figures"
    df = pd.DataFrame({"figure": list(result.figures), "value": list(result.figures.values())})
    return f"== {result.kind}\n" + text_table(df)


SUMMARIES: dict[str, Callable[[Result], dict[str, Any]]] = {}
TEXTS: dict[str, Callable[[Result], str]] = {}


def summary(result: Result) -> dict[str, Any]:
    """The machine-readable summary of any Result."""
    out = SUMMARIES.get(result.kind, generic_summary)(result)
    rep = _replay_record(result)
    if rep:  # a replayed run (--kernels replay:<chip>): a prediction, and what was replayed
        out = {**out, "replay": {k: rep.get(k) for k in ("prediction", "chip", "mlx_version", "variant", "replayed",
                                                          "not_replayed", "prefix") if rep.get(k) is not None}
               | {"skipped": len(rep.get("skipped") or [])}}
    return out


def text(result: Result) -> str:
    """The printed summary of any Result (a replayed run says first that it is a prediction)."""
    body = TEXTS.get(result.kind, generic_text)(result)
    note = replay_note(result)
    return body if note is None else note + "\n\n" + body


def _replay_record(result: Result) -> Mapping[str, Any] | None:
    """The ReplayLog record of a run made under ``--kernels replay:<chip>`` (``predict`` keeps a list of its
    own runs' records there, and says what they are itself)."""
    rep = (result.details or {}).get("replay")
    return rep if isinstance(rep, Mapping) and "chip" in rep else None


def _once(not_replayed: Any) -> Any:
    """What a replay left on this machine's kernels, said once (records written before issue 53 repeat it)."""
    if not isinstance(not_replayed, str):
        return not_replayed
    for said in (" (this machine's kernels)", ": captured with this machine's kernels"):
        not_replayed = not_replayed.replace(said, "" if said.startswith(" (") else ", captured here")
    return not_replayed


def replay_note(result: Result) -> str | None:
    """What a replayed run (``--kernels replay:<chip>``) predicted and how, in one paragraph; None otherwise."""
    rep = _replay_record(result)
    if not rep:
        return None
    kernels = sorted({c["kernel"] for c in rep.get("calls") or []})
    unused = rep.get("variant_unused") or []
    variant = rep["variant"] + (f" (unused: no replayed call ran a kernel with {', '.join(unused)})" if unused else "")
    head = (f"PREDICTION for {rep['chip']} (replayed mlx {rep['mlx_version']} kernel orders, variant "
            f"{variant}), not a measurement on it. Replayed: {rep['replayed']} ({', '.join(kernels) or 'none'})"
            f"; on this machine's kernels: {_once(rep['not_replayed'])}."
            + (f" Shared prefix: {rep['prefix']}." if rep.get("prefix") else "")
            + (f" Not replayed, and not computed: {len(rep['skipped'])} (see details.replay.skipped)."
               if rep.get("skipped") else ""))
    return head


# ---- stack


def stack_frame(result: Result, dtype: str | None = None) -> pd.DataFrame:
    """A wide per-layer view for printing: accumulated and local rel_l2, ULPs, differing fraction."""
    t = result.tables["stack"]
    if dtype is None:
        dtype = result.inputs["model"]["dtype"]
    t = t[t["dtype"] == dtype]
    wide = t.pivot_table(index=["pair", "layer", "tap", "layer_type"], columns=["mode", "metric"], values="value",
                         aggfunc="first")
    cols = [c for c in [("accumulated", "frac_differ"), ("accumulated", "p99_ulp"), ("accumulated", "rel_l2"),
                        ("local", "rel_l2")] if c in wide.columns]
    out = wide[cols].copy()
    out.columns = [f"{m}:{k}" for m, k in cols]
    return out.reset_index().sort_values(["pair", "layer"])


def stack_summary(result: Result) -> dict[str, Any]:
    """The machine-readable summary (summary.json, and what --json prints)."""
    from ..measure.stack import gaps, pair_verdict

    base = result.inputs["model"]["dtype"]
    table = result.tables["stack"]
    env = result.tables.get("envelope", pd.DataFrame())
    ladder = result.tables.get("ladder")
    pairs = []
    for pair in dict.fromkeys(table["pair"]):
        t = table[(table["pair"] == pair) & (table["dtype"] == base)]
        acc = t[(t["mode"] == "accumulated") & (t["metric"] == "frac_differ") & (t["tap"].str.startswith("layer"))]
        first = acc[acc["value"] > 0]["layer"]
        item: dict[str, Any] = {
            "pair": pair,
            "first_layer_with_drift": int(first.min()) if len(first) else None,
            "max_rel_l2_hidden": float(t[(t["mode"] == "accumulated") & (t["metric"] == "rel_l2")
                                         & (t["tap"] != "logits")]["value"].max()),
        }
        e = env[(env["pair"] == pair) & (env["dtype"] == base) & (env["mode"] == "accumulated")] if len(env) else env
        if len(e):
            row = e.iloc[0]
            item.update({k: row[k] for k in ("positions", "max_abs_dlogit", "max_abs_dgap", "p99_abs_dgap", "flips",
                                             "max_gap_at_flip")})
            item["flip_gaps"] = gaps(row["flip_gaps"])
        if ladder is not None and len(ladder):
            item["ladder_verdict"] = pair_verdict(ladder, pair)
            item["ladder_true_float32"] = (result.inputs.get("ladder_float32") or {}).get("true_float32")
        pairs.append(item)
    return {"model": result.inputs["model"]["source"], "dtype": base, "tokens": len(result.inputs["tokens"]),
            "split": result.inputs["split"], "reference": result.inputs["reference"], "pairs": pairs}


def stack_text(result: Result) -> str:
    """Per-layer table and the envelope, as printed by `gemmdrift stack`."""
    lines = []
    wide = stack_frame(result)
    for pair, s in wide.groupby("pair", sort=False):
        lines.append(f"\n== {pair}  ({result.inputs['model']['dtype']})")
        lines.append(text_table(s.drop(columns=["pair", "layer"])))
    summ = stack_summary(result)
    lines.append("\n== logit envelope")
    rows = [{k: p.get(k) for k in ("pair", "positions", "max_abs_dlogit", "max_abs_dgap", "p99_abs_dgap", "flips",
                                   "max_gap_at_flip", "ladder_verdict") if k in p} for p in summ["pairs"]]
    lines.append(text_table(pd.DataFrame(rows)))
    ladder = result.tables.get("ladder")
    if ladder is not None and len(ladder):
        lines.append("\n== precision ladder (rel_l2 at the logits and the last layer)")
        last = ladder[ladder["tap"].isin(["logits", "norm"])]
        lines.append(text_table(last))
        rung = result.inputs.get("ladder_float32")
        if rung:
            lines.append(f"float32 rung: {rung['why']}")
    return "\n".join(lines)


SUMMARIES["stack"] = stack_summary
TEXTS["stack"] = stack_text


# ---- kernels


def kernels_summary(df: pd.DataFrame) -> dict[str, Any]:
    """Machine-readable summary (what ``--json`` prints): per path and per op, the worst drift and error."""
    df = kernels.normalize(df)
    proj = df[~kernels.is_op(df)]
    ops = df[kernels.is_op(df)]
    paths = []
    for path, s in proj.groupby("path", sort=False):
        drift = s[s["metric"] == "max_ulp"]
        err = {m: (s[(s["metric"] == m) & (s["T"] == 1)]["value"], s[(s["metric"] == m) & (s["T"] > 1)]["value"])
               for m in ("err_max_ulp", "err_rel_l2")}
        worst = drift.loc[drift["value"].idxmax()] if len(drift) else None
        item = {
            "path": path,
            "emulated": bool(s["emulated"].iloc[0]),
            "dtype": s["dtype"].iloc[0],
            "quant": s["quant"].iloc[0] or None,
            "units": int(s.groupby(["layer", "projection"]).ngroups),
            "max_T": int(s["T"].max()),
            "Ts": sorted(int(t) for t in set(s.loc[s["projection"] != LM_HEAD, "T"]) or set(s["T"])),
            "lm_head_Ts": sorted(int(t) for t in set(s.loc[s["projection"] == LM_HEAD, "T"])),
            "max_ulp": float(drift["value"].max()) if len(drift) else 0.0,
            "bits_lost": metrics.bits_lost(float(drift["value"].max())) if len(drift) else 0.0,
            "units_with_drift": int(drift[drift["value"] > 0].groupby(["layer", "projection"]).ngroups),
            "first_T_with_drift": int(drift[drift["value"] > 0]["T"].min()) if (drift["value"] > 0).any() else None,
            **{f"{m}_{kind}": float(v.max()) if len(v) else None
               for m, pair in err.items() for kind, v in zip(("gemv", "gemm"), pair)},
        }
        if worst is not None and worst["value"] > 0:
            item["worst"] = {"layer": int(worst["layer"]), "projection": worst["projection"], "T": int(worst["T"]),
                             "max_ulp": float(worst["value"])}
        paths.append(item)
    real = [p for p in paths if not p["emulated"]]
    out: dict[str, Any] = {
        "real_drift": any(p["max_ulp"] > 0 for p in real),
        "emulated_control_detected": (any(p["max_ulp"] > 0 for p in paths if p["emulated"])
                                      if any(p["emulated"] for p in paths) else None),
        "synthetic": bool(proj["synthetic"].any()) if len(proj) else None,
        "paths": paths,
    }
    if len(ops):
        d = ops[ops["metric"] == "max_ulp"]
        out["ops"] = [{"op": op, "variant": var, "max_ulp": float(s["value"].max()),
                       "first_T_with_drift": int(s[s["value"] > 0]["T"].min()) if (s["value"] > 0).any() else None,
                       "key_lengths_with_drift": sorted(int(k) for k in
                                                       s[s["value"] > 0]["key_length"].dropna().unique())}
                      for (op, var), s in d.groupby(["projection", "path"], sort=False)]
    return out


def measured_ts(paths: list[dict[str, Any]]) -> str:
    """The block sizes the kernels part measured, exactly (``T = 1..4, 8, 16, 33; the LM head at T = 1..4``), from
    :func:`kernels_summary`'s paths: never "up to 33" where not every T up to 33 was measured."""
    ts = sorted({t for p in paths for t in p.get("Ts", [])})
    head = sorted({t for p in paths for t in p.get("lm_head_Ts", [])})
    return f"T = {t_list(ts)}" + (f"; the LM head at T = {t_list(head)}" if head and head != ts else "")


def print_kernels(df: pd.DataFrame) -> str:
    """Per path: worst drift per projection name over layers and T, then the ops; emulated paths last, flagged."""
    df = kernels.normalize(df)
    lines = []
    proj = df[~kernels.is_op(df)]
    worst = kernels.worst_over_t(proj)
    errs = proj[proj["metric"] == "err_rel_l2"]
    order = sorted(dict.fromkeys(proj["path"]), key=lambda p: p.startswith("emulated"))
    for path in order:
        w = worst[worst["path"] == path]
        emulated = bool(w["emulated"].iloc[0]) if len(w) else False
        e = errs[errs["path"] == path]
        rows = []
        for name, s in w.groupby("projection", sort=False):
            top = s.loc[s["worst"].idxmax()]
            en = e[e["projection"] == name]
            rows.append({"projection": name, "layers": len(s), "max_ulp": float(top["worst"]),
                         "bits_lost": metrics.bits_lost(float(top["worst"])),
                         "worst_layer": int(top["layer"]) if top["worst"] > 0 else "-",
                         "first_T": float(s["first_T"].min()),
                         "err_rel_l2_T1": float(en[en["T"] == 1]["value"].max()),
                         "err_rel_l2_gemm": float(en[en["T"] > 1]["value"].max()) if (en["T"] > 1).any() else math.nan})
        flag = "  [EMULATED negative control, not an mlx kernel]" if emulated else ""
        flag += "  [synthetic]" if proj[proj["path"] == path]["synthetic"].any() else ""
        ts = sorted(int(t) for t in set(proj[proj["path"] == path]["T"]) if t > 1)
        lines.append(f"\n== {path}: drift of T = {t_list(ts)} blocks against T=1 (worst over layers and T){flag}")
        lines.append(text_table(pd.DataFrame(rows)))
    ops = df[kernels.is_op(df)]
    if len(ops):
        d = ops[ops["metric"] == "max_ulp"]
        rows = [{"op": op, "variant": var, "max_T": int(s["T"].max()), "key_lengths": s["key_length"].nunique(),
                 "max_ulp": float(s["value"].max()),
                 "first_T": float(s[s["value"] > 0]["T"].min()) if (s["value"] > 0).any() else math.nan}
                for (op, var), s in d.groupby(["projection", "path"], sort=False)]
        lines.append("\n== other ops: block of T queries against each query alone (seeded inputs)")
        lines.append(text_table(pd.DataFrame(rows)))
    return "\n".join(lines).lstrip("\n")


SUMMARIES["kernels"] = lambda r: {**kernels_summary(r.tables["kernels"]),
                                   **({"skipped": r.tables["skipped"].to_dict("records")} if "skipped" in r.tables else {})}
TEXTS["kernels"] = lambda r: "\n".join(filter(None, [print_kernels(r.tables["kernels"]),
                                                     kernels.describe_skipped(r.tables.get("skipped"))]))


# ---- triage (also the words of a diverge result's triage)


def triage_items(t: dict[str, Any], n: int | None = None) -> list[str]:
    """A triage record (:class:`gemmdrift.measure.diverge.Triage` as a dict) in plain words, one item per finding."""
    items = []
    lengths = t.get("lengths") or []
    if t.get("index") is None:
        items.append(f"the streams agree{f' over {n} generated tokens' if n else ''}")
        if len(lengths) == 2 and lengths[0] != lengths[1]:
            items.append(f"the streams have unequal lengths: A {lengths[0]}, B {lengths[1]} generated tokens; "
                         f"the first {min(lengths)} are compared")
    else:
        items += [
            f"the streams part at {nth_generated(t['index'])} (the logits of position {t.get('position')}): "
            f"`{t.get('context', '')}`",
            f"teacher-forced under `{t['schedule_a']}`: top-2 {t.get('top2_a')}, gap {fmt(t.get('gap_a'))}; under "
            f"`{t['schedule_b']}`: top-2 {t.get('top2_b')}, gap {fmt(t.get('gap_b'))}; Δgap {fmt(t.get('dgap'))}",
            f"the competing tokens {t.get('token_a')} and {t.get('token_b')} are {logits(t.get('margin'))} apart",
            (f"hidden states first differ at tap {t['first_layer_differ']}" if t.get("first_layer_differ") is not None
             else "hidden states are identical at every tap at that position") + "; the schedules are "
            f"{'' if t.get('bit_identical') else 'not '}bit-identical on the shared prefix; the divergence alone: "
            f"{t.get('divergence_verdict')}",
        ]
    items.append(f"envelope: {logits(t.get('envelope'))} ({t.get('envelope_source', '')})")
    for key in ("a", "b"):
        c = t.get(f"stream_{key}_check") or {}
        if c:
            at = ("none" if c.get("first_outside") is None
                  else f"{nth_generated(c['first_outside'])}, {logits(c.get('margin_outside'))} below the argmax")
            items.append(f"stream {key.upper()} teacher-forced under `{t.get(f'schedule_{key}')}`: "
                         f"{c.get('mismatches')} of {c.get('tokens')} tokens are not the argmax; first outside the "
                         f"envelope: {at}")
    items.append(f"**verdict: {t['verdict']}** — {t['reason']}")
    return items


def triage_lines(t: dict[str, Any]) -> list[str]:
    """:func:`triage_items` for a terminal: indented, without markdown."""
    lines = [("  " if i else "") + x.replace("`", "").replace("**", "") for i, x in enumerate(triage_items(t))]
    return lines + ([f"  which op (--explain): {t['explanation']['said']}"] if t.get("explanation") else [])


SUMMARIES["triage"] = lambda r: dict(r.details["triage"])
TEXTS["triage"] = lambda r: "\n".join(triage_lines(r.details["triage"]))


# ---- diverge


def diverge_text(result: Result) -> str:
    r = result.details
    n = r["n"]
    lines = [f"A ({r['stream_a']['label']}, {r['stream_a']['schedule']}): {r['text_a']!r}",
             f"B ({r['stream_b']['label']}, {r['stream_b']['schedule']}): {r['text_b']!r}"]
    if r["first_divergence"] is None:
        lines.append(f"no divergence in {n} tokens")
    elif not r.get("triage"):
        lines.append(f"first divergence at {nth_generated(r['first_divergence'])}")
    if r.get("triage"):
        lines += triage_lines(r["triage"])
    return "\n".join(lines)


SUMMARIES["diverge"] = lambda r: dict(r.details)
TEXTS["diverge"] = diverge_text


# ---- divergence (statistics over a prompt set)


def divergence_summary(df: pd.DataFrame) -> dict[str, Any]:
    """Divergence rates and the gap distribution at divergence points."""
    from ..result import Verdict

    div = df[df["first_divergence"].notna()]
    compared = int(df["compared"].sum())
    return {
        "prompts": int(len(df)),
        "diverged": int(len(div)),
        "tokens_compared": compared,
        "divergences_per_1k": 1000.0 * len(div) / compared if compared else 0.0,
        "median_first_divergence": float(div["first_divergence"].median()) if len(div) else None,
        "near_ties": int((div["verdict"] == Verdict.NEAR_TIE).sum()),
        "outside_envelope": int((div["verdict"] == Verdict.OUTSIDE).sum()),
        "margins": [float(x) for x in div["margin"]],
    }


def divergence_text(result: Result) -> str:
    df = result.tables["divergence"]
    s = divergence_summary(df)
    text = text_table(df[["prompt", "prompt_tokens", "first_divergence", "verdict", "margin", "envelope",
                          "acceptance"]])
    return text + (f"\n\n{s['diverged']} of {s['prompts']} prompts diverged; "
                   f"{s['divergences_per_1k']:.3g} divergences per 1,000 tokens; "
                   f"{s['near_ties']} near-ties, {s['outside_envelope']} outside the envelope")


SUMMARIES["divergence"] = lambda r: divergence_summary(r.tables["divergence"])
TEXTS["divergence"] = divergence_text


# ---- history (asv results by mlx version)


SUMMARIES["history"] = history_summary
TEXTS["history"] = history_text


# ---- fingerprint


SUMMARIES["fingerprint"] = fingerprint_summary
TEXTS["fingerprint"] = fingerprint_text


# ---- state


SUMMARIES["state"] = state_summary
TEXTS["state"] = state_text


# ---- batch


SUMMARIES["batch"] = batch_summary
TEXTS["batch"] = batch_text


# ---- server


SUMMARIES["server"] = server_summary
TEXTS["server"] = server_text


# ---- compare (issue 23): the words live in gemmdrift.view.compare


def _compare_summary(result: Result) -> dict[str, Any]:
    from .compare import compare_summary

    return compare_summary(result)


def _compare_text(result: Result) -> str:
    from .compare import compare_text

    return compare_text(result)


SUMMARIES["compare"] = _compare_summary
TEXTS["compare"] = _compare_text


# ---- predict (issue 22): the words live in gemmdrift.view.predict


def _predict_summary(result: Result) -> dict[str, Any]:
    from .predict import predict_summary

    return predict_summary(result)


def _predict_text(result: Result) -> str:
    from .predict import predict_text

    return predict_text(result)


SUMMARIES["predict"] = _predict_summary
TEXTS["predict"] = _predict_text


# ---- attribute (issue 29): the words live in gemmdrift.view.attribute


def _attribute_summary(result: Result) -> dict[str, Any]:
    from .attribute import attribute_summary

    return attribute_summary(result)


def _attribute_text(result: Result) -> str:
    from .attribute import attribute_text

    return attribute_text(result)


SUMMARIES["attribute"] = _attribute_summary
TEXTS["attribute"] = _attribute_text


# ---- upgrade (issue 48): the words live in gemmdrift.view.upgrade


def _upgrade_summary(result: Result) -> dict[str, Any]:
    from .upgrade import upgrade_summary

    return upgrade_summary(result)


def _upgrade_text(result: Result) -> str:
    from .upgrade import upgrade_text

    return upgrade_text(result)


SUMMARIES["upgrade"] = _upgrade_summary
TEXTS["upgrade"] = _upgrade_text
