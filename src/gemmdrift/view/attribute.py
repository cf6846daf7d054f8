"""The words and figures of an ``attribute`` Result (:mod:`gemmdrift.attribution.attribute`): summary, text, report section,
and the figure (an op x layer heatmap of local drift, a bar chart of the envelope left per counterfactual class).

Every table row and every figure panel carries the one ``gemmdrift attribute ...`` command that recomputes just
that cell (:func:`command`): its positions, its op class, its counterfactual direction.
"""

from __future__ import annotations

import shlex
from typing import Any

import numpy as np
import pandas as pd

from ..result import Result
from ..text import fmt

TITLE = "Which op: local drift per op and layer, and the counterfactual per op class"
FIGURE = "attribute.png"
SHOWN = 40  # rows of drifting ops printed on the terminal


def command(result: Result, positions: str | None = None, ops: str | None = None,
            counterfactual: str | None = None) -> str:
    """``gemmdrift attribute ...`` recomputing one cell of ``result`` (default: all of it)."""
    i = result.inputs
    model = i.get("model") or {}
    parts = ["gemmdrift", "attribute", "--model", str(model.get("source") or "embedded"),
             "--dtype", str(model.get("dtype") or "bfloat16")]
    if i.get("prompt_flag"):  # the prompt as it was given (--prompt TEXT, --prompt-file, --prompt-ids)
        parts += [str(x) for x in i["prompt_flag"]]
    elif i.get("prompt_ids_file"):
        parts += ["--prompt-ids", str(i["prompt_ids_file"])]
    parts += ["--tokens", str(len(i.get("tokens") or [])), "--schedules", *i.get("schedules", [])]
    if i.get("split") is not None:
        parts += ["--split", str(i["split"])]
    parts += ["--positions", positions or _range(i.get("positions") or [])]
    directions = counterfactual or ",".join(i.get("counterfactual") or []) or "none"
    if ops is None and "ops_given" in i:  # the classes the run was given (none: every class)
        ops = ",".join(i["ops_given"]) if i["ops_given"] else None
    elif ops is None:  # an older result, or the main job's part: the classes it ran
        ops = ",".join(i.get("ops") or []) or None
    if ops and directions != "none":  # --ops with --counterfactual none is refused
        parts += ["--ops", ops]
    parts += ["--counterfactual", directions]
    if i.get("kernels"):
        parts += ["--kernels", str(i["kernels"])]
    return " ".join(shlex.quote(p) for p in parts)


def _range(ps) -> str:
    ps = [int(p) for p in ps]
    if not ps:
        return "none"
    return f"{ps[0]}:{ps[-1] + 1}" if ps == list(range(ps[0], ps[-1] + 1)) else ",".join(map(str, ps))


def attribute_summary(result: Result) -> dict[str, Any]:
    ops = result.tables.get("ops", pd.DataFrame())
    hit = ops[ops["positions_differ"] > 0] if len(ops) else ops
    cf = result.tables.get("counterfactual", pd.DataFrame())
    env = result.tables.get("envelope", pd.DataFrame())
    return {"kind": "attribute", "schedules": list(result.inputs.get("schedules", [])),
            "verdict": result.details.get("verdict"), "kernels": result.inputs.get("kernels"),
            "envelope": env.to_dict(orient="records")[0] if len(env) else {},
            "ops_with_local_drift": hit[["layer", "op", "positions_differ", "max_ulp", "first_position"]].to_dict(
                orient="records") if len(hit) else [],
            "counterfactual": cf.to_dict(orient="records") if len(cf) else []}


def counterfactual_rows(result: Result) -> list[dict[str, Any]]:
    """The envelope left per (direction, class), each row with the command that recomputes it."""
    cf = result.tables.get("counterfactual", pd.DataFrame())
    rows = []
    for _, r in cf.iterrows() if len(cf) else []:
        rows.append({"made invariant": r["class"] if r["direction"] == "each" else f"all but {r['class']}",
                     "max abs dlogit left": fmt(r["max_abs_dlogit"]), "max abs dgap left": fmt(r["max_abs_dgap"]),
                     "flips left": int(r["flips"]), "KLD mean": fmt(r["kld_mean"]),
                     "same top-1": fmt(r["same_top1_share"]),
                     "recompute": command(result, ops=r["class"], counterfactual=r["direction"])})
    return rows


def _unheld(result: Result) -> str:
    """The classes all-but-one could not hold (the attention core reads the cache): their drift is in every row."""
    from ..model.optaps import short_class

    unheld = result.details.get("all_but_one_unheld") or []
    return (f"all but: {', '.join(short_class(c) for c in unheld)} cannot be held (it reads the cache): its own "
            "drift stays in every all-but-one row" if unheld else "")


def ops_rows(result: Result) -> list[dict[str, Any]]:
    """The (layer, op) cells with local drift, each with the command that recomputes it."""
    ops = result.tables.get("ops", pd.DataFrame())
    hit = ops[ops["positions_differ"] > 0] if len(ops) else ops
    return [{"layer": int(r["layer"]), "op": r["op"], "positions differing": int(r["positions_differ"]),
             "max ULP": fmt(r["max_ulp"]), "rel L2": fmt(r["rel_l2"]), "first position": int(r["first_position"]),
             "recompute": command(result, positions=f"{int(r['first_position'])}:{int(r['first_position']) + 1}",
                                  ops=r["class"], counterfactual="each")}
            for _, r in hit.iterrows()] if len(hit) else []


def attribute_text(result: Result) -> str:
    lines = [str(result.details.get("verdict", ""))]
    if result.inputs.get("kernels"):
        lines.append(f"projections replayed as {result.inputs['kernels']}: a prediction for that chip, not a "
                     "measurement on it")
    hit = ops_rows(result)
    if hit:
        lines.append("ops with local drift (layer, op: positions differing, max ULP, first position):")
        lines += [f"  {r['layer']:3d} {r['op']:28s} {r['positions differing']:5d}  {r['max ULP']:>8s}  "
                  f"{r['first position']}" for r in hit[:SHOWN]]
        if len(hit) > SHOWN:
            lines.append(f"  (the first {SHOWN} of {len(hit)} rows; every row is in ops.csv and the report)")
    cf = [] if result.details.get("counterfactual_skipped") else counterfactual_rows(result)
    if cf:
        lines.append("envelope left per counterfactual (max|dlogit|, flips):")
        lines += [f"  {r['made invariant']:34s} {r['max abs dlogit left']:>10s}  {r['flips left']}" for r in cf]
        unheld = _unheld(result)
        if unheld:
            lines.append(unheld)
    lines.append(f"recompute: {command(result)}")
    return "\n".join(lines)


def report_part(result: Result) -> tuple[list[tuple], list[str]]:
    """The report section: the verdict, the drifting ops, the envelope left per class; the figure follows."""
    blocks: list[tuple] = [
        ("p", f"Pair {' vs '.join(result.inputs.get('schedules', []))}: each op fed the reference's input to it "
              "(local drift: what differs is that op's own), then each op class made invariant (its outputs "
              "replaced by the reference's) to see what is left of the logit envelope. A cause drifts on its own "
              "and its counterfactual removes the flips; an op downstream of it removes them too, and is not "
              "called one. \"All but X\" keeps X as it is and holds every other drifting class (its own drift "
              "removed, what it carries kept): what X does on its own; \"all but lm_head\" is the head's own "
              "drift. Each row's command recomputes just that cell."),
        ("p", f"**{result.details.get('verdict', '')}**"),
    ]
    rows = ops_rows(result)
    blocks.append(("table", rows) if rows else ("p", "No op drifts on its own input at any position computed up to the last compared one."))
    skipped = result.details.get("counterfactual_skipped")
    cf = [] if skipped else counterfactual_rows(result)  # skipped: its rows are the base envelope, no run's
    if cf:
        blocks.append(("table", cf))
        if _unheld(result):
            blocks.append(("p", _unheld(result)))
    if not rows and not cf:  # nothing drifted (the counterfactual skipped): the run's own command
        blocks.append(("p", f"Recompute: `{command(result)}`"))
    return blocks, [str(result.details.get("verdict", ""))]


def attribute_figure(result: Result):
    """Left: op x layer heatmap of local drift (log2(1 + max ULP)); right: max|dlogit| left per counterfactual
    class (the pair as it is drawn as a line). Each panel names the command that recomputes it."""
    import sys

    import matplotlib

    if "ipykernel" not in sys.modules:  # a notebook keeps its inline backend, so the figure shows
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = result.tables.get("ops", pd.DataFrame())
    cf = result.tables.get("counterfactual", pd.DataFrame())
    env = result.tables.get("envelope", pd.DataFrame())
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 5.5), gridspec_kw={"width_ratios": [1.2, 1]})
    if len(ops):
        layer_ops = [o for o in dict.fromkeys(ops.sort_values("order")["op"])]
        layers = sorted(set(int(x) for x in ops["layer"]))
        grid = np.full((len(layer_ops), len(layers)), np.nan)
        for _, r in ops.iterrows():
            grid[layer_ops.index(r["op"]), layers.index(int(r["layer"]))] = np.log2(1 + float(r["max_ulp"]))
        im = a.imshow(grid, aspect="auto", cmap="magma_r", vmin=0, vmax=max(1.0, float(np.nanmax(grid))))
        a.set_yticks(range(len(layer_ops)), layer_ops, fontsize=7)
        a.set_xticks(range(len(layers)), [str(x) if x < max(layers) else "head" for x in layers], fontsize=7)
        a.set_xlabel("layer")
        fig.colorbar(im, ax=a, label="local drift: log2(1 + max ULP)")
    a.set_title("local drift per op and layer", fontsize=10)
    a.text(0, -0.16, _wrap(command(result, counterfactual="none")), transform=a.transAxes, fontsize=5.5,
           va="top", family="monospace")
    each = cf[cf["direction"] == "each"] if len(cf) else cf
    if len(each):
        y = np.arange(len(each))
        b.barh(y, each["max_abs_dlogit"], color=["C3" if f == 0 and len(env) and env["flips"].iloc[0] > 0 else "C0"
                                                  for f in each["flips"]])
        b.set_yticks(y, list(each["class"]), fontsize=7)
        if len(env):
            b.axvline(float(env["max_abs_dlogit"].iloc[0]), color="k", ls="--", lw=1, label="the pair as it is")
            b.legend(fontsize=7)
        b.set_xlabel("max|dlogit| left with the class made invariant (red: no flip left)")
    b.set_title("envelope left per counterfactual class", fontsize=10)
    b.text(0, -0.16, _wrap(command(result, counterfactual="each")), transform=b.transAxes, fontsize=5.5, va="top",
           family="monospace")
    fig.suptitle(str(result.details.get("verdict", ""))[:160], fontsize=9)
    fig.tight_layout()
    return fig


def _wrap(text: str, width: int = 110) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width))


__all__ = ["command", "attribute_summary", "attribute_text", "report_part", "attribute_figure", "TITLE", "FIGURE"]
