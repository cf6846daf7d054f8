"""The state kind in view: cache state exactness per cache class, operation and prefix position."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from ..text import text_table
from .figure import pyplot as _plt, tight


STATE_COLORS = {"EXACT": "#3a9d5d", "rounding": "#e3c542", "STATE BUG": "#c8423b", "not applicable": "#c9c9c9",
                "not checked": "#8fb3d9", "refused": "#7a3b8f"}


def state_grid(table: pd.DataFrame, title: str = ""):
    """Cache class x operation (rows) by prefix position (columns), colored by the worst verdict of the cell."""
    plt = _plt()
    from matplotlib.patches import Patch

    order = ["below", "at", "past", "far", ""]
    worst = ["STATE BUG", "refused", "rounding", "EXACT", "not applicable", "not checked"]
    keys = list(dict.fromkeys(zip(table["cache"], table["operation"])))
    cols = [w for w in order if (table["where"].fillna("") == w).any()]
    fig, ax = plt.subplots(figsize=(2.2 + 1.3 * len(cols), 0.8 + 0.32 * len(keys)))
    for i, (cache, op) in enumerate(keys):
        g = table[(table["cache"] == cache) & (table["operation"] == op)]
        for j, w in enumerate(cols):
            h = g[g["where"].fillna("") == w]
            if not len(h):
                continue
            counts = h["verdict"].value_counts()
            top = next(v for v in worst if v in counts.index)
            ax.add_patch(plt.Rectangle((j, i), 1, 1, color=STATE_COLORS[top], ec="white"))
            label = f"{int(counts[top])}/{len(h)}" if len(counts) > 1 else str(len(h))
            ax.text(j + 0.5, i + 0.5, label, ha="center", va="center", fontsize=7)
    ax.set_xlim(0, len(cols))
    ax.set_ylim(len(keys), 0)
    ax.set_xticks(np.arange(len(cols)) + 0.5)
    ax.set_xticklabels([c or "n/a" for c in cols], fontsize=8)
    ax.set_yticks(np.arange(len(keys)) + 0.5)
    ax.set_yticklabels([f"{c} · {o}" for c, o in keys], fontsize=7)
    ax.set_xlabel("prefix length relative to the sliding window", fontsize=8)
    ax.legend(handles=[Patch(color=c, label=v) for v, c in STATE_COLORS.items()], fontsize=6, loc="upper left",
              bbox_to_anchor=(1.01, 1))
    ax.set_title(title or "Cache state exactness: worst verdict per cell (cases with it / cases)", fontsize=9)
    tight(fig)
    return fig


STATE_SEVERITY = ["STATE BUG", "refused", "unreliable", "rounding", "EXACT", "not applicable", "not checked"]


def state_cells(table: pd.DataFrame) -> pd.DataFrame:
    """One row per cache class and operation, one column per prefix position: 'EXACT 14', 'STATE BUG 10/14'."""
    order = ["below", "at", "past", "far", ""]
    worst = STATE_SEVERITY
    rows = []
    for (cache, op), g in table.groupby(["cache", "operation"], sort=False):
        row = {"cache": cache, "operation": op}
        for where in order:
            h = g[g["where"].fillna("") == where]
            if not len(h):
                continue
            counts = h["verdict"].value_counts()
            top = next(v for v in worst if v in counts.index)
            row[where or "-"] = top if len(counts) == 1 else f"{top} {int(counts[top])}/{len(h)}"
        rows.append(row)
    return pd.DataFrame(rows).fillna("")


def state_findings(table: pd.DataFrame) -> list[dict[str, Any]]:
    """The findings as one table: cache x operation (rows) x prefix position (columns) -> verdict
    (:func:`state_cells`), with the number of cases and the first case that is not exact, with its reason."""
    cells = state_cells(table)
    worst = [v for v in STATE_SEVERITY if v not in ("EXACT", "not applicable", "not checked")]
    rows = []
    for _, c in cells.iterrows():
        g = table[(table["cache"] == c["cache"]) & (table["operation"] == c["operation"])]
        bad = g[g["verdict"].isin(worst)]
        if len(bad):
            bad = bad.assign(_rank=[worst.index(v) for v in bad["verdict"]]).sort_values("_rank", kind="stable")
            r0 = bad.iloc[0]
            first = f"{r0['where']} {r0['params']}: {r0['reason']}"
        else:
            first = ""
        rows.append({**c.to_dict(), "cases": int(len(g)), "first case not exact": first})
    return rows


def state_summary(result) -> dict[str, Any]:
    t = result.tables["state"]
    bugs = t[t["verdict"] == "STATE BUG"]
    return {
        "kind": "state",
        "mlx_lm": result.details.get("mlx_lm"),
        "cases": int(len(t)),
        "verdicts": {str(k): int(v) for k, v in t["verdict"].value_counts().items()},
        "prefixes": dict(result.inputs.get("prefixes") or {}),
        "window": result.inputs.get("window"),
        "seconds": result.figures.get("seconds"),
        "grid": state_cells(t).to_dict(orient="records"),
        "state_bugs": bugs[["cache", "operation", "where", "prefix", "params", "reason"]].head(50).to_dict(
            orient="records"),
        "figures": dict(result.figures),
    }


def state_text(result) -> str:
    t = result.tables["state"]
    s = state_summary(result)
    pre = ", ".join(f"{w} {p}" for w, p in s["prefixes"].items())
    lines = [f"== cache state exactness (mlx-lm {s['mlx_lm']}): {s['cases']} cases; prefixes {pre} "
             f"(window {s['window']}); {', '.join(f'{v} {k}' for k, v in s['verdicts'].items())}",
             text_table(state_cells(t))]
    bugs = t[t["verdict"] == "STATE BUG"]
    if len(bugs):
        lines.append("first state bug per cache class and operation:")
        for (cache, op), g in bugs.groupby(["cache", "operation"], sort=False):
            r = g.iloc[0]
            lines.append(f"  {cache} {op} [{r['where']} {r['params']}]: {r['reason']}")
    lines.append(f"{s['seconds']:.0f} s")
    return "\n".join(lines)
