"""The words and the figure of a ``predict`` Result (:mod:`gemmdrift.replay.predict`): summary, text, report section.

Every predicted line is labelled as what it is: a prediction for that chip (mlx version, variant), not a
measurement on it; the measured CPU line is drawn beside it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from ..result import Result
from ..text import fmt

TITLE = "Predicted GPU drift (replay)"
FIGURE = "predict_drift.png"


def _label(result: Result, chip: str) -> str:
    """'prediction for M1 (mlx 0.32.4, variant mma=H1; band over mma=H1..mma=H4), not a measurement'."""
    variants = (result.inputs.get("variants") or {}).get(chip) or []
    version = result.inputs.get("mlx_replayed")
    default = variants[0] if variants else ""
    which = ("no variant: its recipes leave no order open" if default in ("", "exact") else f"variant {default}")
    band = f"; band over {len(variants)} variants {', '.join(variants)}" if len(variants) > 1 else ""
    if (result.inputs.get("sizes") or {}).get("variants") == "default" and which.startswith("variant"):
        band = "; the default only, other variants not run"
    return f"prediction for {chip} (mlx {version}, {which}{band}), not a measurement"


def _here(result: Result) -> str:
    """'this machine (cpu)': the measured line is this machine's own kernels, whatever its backend."""
    return f"this machine ({(result.env or {}).get('backend') or 'unknown backend'})"


def _pair(schedule: str) -> str:
    from ..replay.predict import CUDA_PAIR

    return "decode: CUDA gemv vs this machine's" if schedule == CUDA_PAIR else schedule


def _not_knowable(reason: str) -> str:
    """'... mlx 0.32.4 dispatches cublaslt, which ...' -> 'not knowable (mlx 0.32.4 dispatches cublaslt)'."""
    head = str(reason).split(", which", 1)[0]
    return "not knowable (" + head.split(": ", 1)[-1] + ")"


def predict_summary(result: Result) -> dict[str, Any]:
    """Per chip: its label, its envelope spread per schedule, its refused pairs; the measured CPU envelope."""
    env = result.tables.get("spread_envelope", pd.DataFrame())
    refused = result.tables.get("refused", pd.DataFrame())
    chips: dict[str, Any] = {}
    for chip in (result.inputs.get("sizes") or {}).get("chips", []):
        rows = env[(env["chip"] == chip)].to_dict(orient="records") if len(env) else []
        chips[chip] = {"label": _label(result, chip), "envelope": rows,
                       "refused": refused[refused["chip"] == chip].to_dict(orient="records") if len(refused) else []}
    measured = env[env["source"] == "measured"].to_dict(orient="records") if len(env) else []
    return {"kind": "predict", "sizes": result.inputs.get("sizes"), "schedules": result.inputs.get("schedules"),
            "mlx_replayed": result.inputs.get("mlx_replayed"), "chips": chips, "measured": measured,
            "seconds": (result.details or {}).get("seconds", {})}


def envelope_table(result: Result) -> list[dict[str, Any]]:
    """One row per (chip, schedule): the logit envelope, default variant [min..max over the variants]."""
    env = result.tables.get("spread_envelope", pd.DataFrame())
    rows = []
    for _, r in env.iterrows() if len(env) else []:
        row = {"chip": r["chip"] if r["source"] == "prediction" else f"{_here(result)}, measured",
               "pair": _pair(r["schedule"]), "variants": int(r["variants"])}
        # (no '|' in a column name: it would split the markdown table)
        for m, name in (("max_abs_dlogit", "max Δlogit"), ("max_abs_dgap", "max Δgap"), ("flips", "flips"),
                        ("same_top1_share", "same top-1")):
            if f"{m}_default" not in r or pd.isna(r[f"{m}_default"]):
                continue
            lo, hi, d = r[f"{m}_min"], r[f"{m}_max"], r[f"{m}_default"]
            row[name] = fmt(d) + ("" if lo == hi else f" [{fmt(lo)}..{fmt(hi)}]")
        rows.append(row)
    refused = result.tables.get("refused", pd.DataFrame())
    for _, r in refused.iterrows() if len(refused) else []:
        rows.append({"chip": r["chip"], "pair": _pair(r["schedule"]), "variants": 0,
                     "max Δlogit": _not_knowable(r["reason"])})
    return rows


def predict_text(result: Result) -> str:
    from ..text import text_table

    s = predict_summary(result)
    lines = [f"== {TITLE}: {', '.join(s['schedules'] or [])}; sizes {s['sizes']}"]
    for chip, c in s["chips"].items():
        lines.append(f"{chip}: {c['label']}")
    lines.append(text_table(pd.DataFrame(envelope_table(result))))
    return "\n".join(lines)


def reading(result: Result) -> list[str]:
    s = predict_summary(result)
    out = []
    for chip, c in s["chips"].items():
        for r in c["envelope"]:
            out.append(f"`{chip}` {_pair(r['schedule'])}: max |Δlogit| {fmt(r.get('max_abs_dlogit_default'))} "
                       f"(variants {fmt(r.get('max_abs_dlogit_min'))}..{fmt(r.get('max_abs_dlogit_max'))}), "
                       f"{fmt(r.get('flips_default'))} flips: a {c['label']}.")
        for r in c["refused"]:
            out.append(f"`{chip}` `{r['schedule']}`: not predicted, its kernel order is not knowable ({r['reason']}).")
    for r in s["measured"]:
        out.append(f"{_here(result)}, measured, `{r['schedule']}`: "
                   f"max |Δlogit| {fmt(r.get('max_abs_dlogit_default'))}, "
                   f"{fmt(r.get('flips_default'))} flips.")
    return out


def report_part(result: Result) -> tuple[list[tuple], list[str]]:
    """The report section: what was predicted and how big, the envelope table; the figure follows."""
    sizes = result.inputs.get("sizes") or {}
    secs = (result.details or {}).get("seconds", {})
    blocks: list[tuple] = [
        ("p", f"Decode vs verification on the first {sizes.get('tokens')} tokens of the built-in essay (prompt "
              f"{sizes.get('split')} token(s), positions {sizes.get('split')}..{(sizes.get('tokens') or 1) - 1} "
              "compared, logits at every one, below the sliding window), every projection and the LM head "
              f"replayed with each chip's kernel orders (mlx {result.inputs.get('mlx_replayed')}); attention, "
              "norms and the cache stay on this machine's kernels. **These are predictions, not measurements "
              "on those chips**; the measured line (this machine's own kernels, the same pairs) is beside "
              f"them. A small sample: a kernel pair whose orders rarely disagree (M3's gemv_wide against gemv: "
              "a few outputs in 10^4) can show no drift at these positions. "
              f"Cost here: {sum(secs.values()):.0f} s."),
        ("ul", [_label(result, c) for c in sizes.get("chips", [])]),
        ("table", envelope_table(result)),
    ]
    return blocks, reading(result)


def predict_figure(result: Result):
    """Per chip: rel_l2 per layer of each pair, the default variant's line with the min/max band over the
    variants, next to the measured CPU line; each panel titled as a prediction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lay = result.tables.get("spread_layers", pd.DataFrame())
    chips = list((result.inputs.get("sizes") or {}).get("chips", []))
    fig, axes = plt.subplots(len(chips) or 1, 1, figsize=(9, 2.8 * max(len(chips), 1)), squeeze=False)
    measured = lay[lay["source"] == "measured"] if len(lay) else lay
    for ax, chip in zip(axes[:, 0], chips):
        mine = lay[(lay["chip"] == chip) & (lay["source"] == "prediction")] if len(lay) else lay
        for i, (sched, g) in enumerate(mine.groupby("schedule", sort=False) if len(mine) else []):
            g = g.sort_values("layer")
            x = g["layer"].to_numpy()
            ax.plot(x, g["rel_l2_default"], marker="o", ms=3, color=f"C{i}", label=f"{_pair(sched)} (predicted)")
            if (g["rel_l2_min"] != g["rel_l2_max"]).any() or int(g["variants"].max()) > 1:
                ax.fill_between(x, g["rel_l2_min"], g["rel_l2_max"], color=f"C{i}", alpha=0.25,
                                label=f"{sched}: min..max over variants")
        for j, (sched, g) in enumerate(measured.groupby("schedule", sort=False) if len(measured) else []):
            g = g.sort_values("layer")
            ax.plot(g["layer"], g["rel_l2_default"], color="k", ls=":", marker="x", ms=3,
                    label=f"{sched}: {_here(result)}, measured")
        if not len(mine):
            ax.text(0.5, 0.5, "nothing knowable to predict", transform=ax.transAxes, ha="center")
        taps = sorted(set(zip(lay["layer"], lay["tap"]))) if len(lay) else []
        ax.set_xticks([t[0] for t in taps], [str(t[1]).replace("layer ", "") for t in taps], fontsize=6)
        ax.set_ylabel("rel L2 vs decode", fontsize=8)
        refused = result.tables.get("refused", pd.DataFrame())
        no = refused[refused["chip"] == chip] if len(refused) else refused
        ax.set_title(_label(result, chip) + (f"; {', '.join(no['schedule'])}: {_not_knowable(no['reason'].iloc[0])}"
                                             if len(no) else ""), fontsize=7)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6, loc="upper left")
    axes[-1, 0].set_xlabel("tap (decoder layer, norm, logits)", fontsize=8)
    fig.suptitle("Predicted GPU drift (replay), decode vs verification below the window", fontsize=9)
    fig.tight_layout()
    return fig


__all__ = ["predict_summary", "predict_text", "report_part", "predict_figure", "envelope_table", "reading",
           "TITLE", "FIGURE"]
