"""Summaries of a Result: the machine-readable dict (``summary.json``, ``--json``) and the printed text.

Each kind registers its two functions in :data:`SUMMARIES` and :data:`TEXTS`;
a kind without its own gets the generic ones (its tracked figures). Both read
the Result only.
"""

from __future__ import annotations

from typing import Any, Callable

import pandas as pd

from .result import Result


def generic_summary(result: Result) -> dict[str, Any]:
    return {"kind": result.kind, "figures": dict(result.figures)}


def generic_text(result: Result) -> str:
    from .report import text_table

    if not result.figures:
        return f"{result.kind}: no tracked figures"
    df = pd.DataFrame({"figure": list(result.figures), "value": list(result.figures.values())})
    return f"== {result.kind}\n" + text_table(df)


SUMMARIES: dict[str, Callable[[Result], dict[str, Any]]] = {}
TEXTS: dict[str, Callable[[Result], str]] = {}


def summary(result: Result) -> dict[str, Any]:
    """The machine-readable summary of any Result."""
    return SUMMARIES.get(result.kind, generic_summary)(result)


def text(result: Result) -> str:
    """The printed summary of any Result."""
    return TEXTS.get(result.kind, generic_text)(result)


# ---- state


def _state_cells(table: pd.DataFrame) -> pd.DataFrame:
    """One row per cache class and operation, one column per prefix position: 'EXACT 14', 'STATE BUG 10/14'."""
    order = ["below", "at", "past", "far", ""]
    worst = ["STATE BUG", "rounding", "EXACT", "not applicable", "not checked"]
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
        "grid": _state_cells(t).to_dict(orient="records"),
        "state_bugs": bugs[["cache", "operation", "where", "prefix", "params", "reason"]].head(50).to_dict(
            orient="records"),
        "figures": dict(result.figures),
    }


def state_text(result) -> str:
    from .report import text_table

    t = result.tables["state"]
    s = state_summary(result)
    pre = ", ".join(f"{w} {p}" for w, p in s["prefixes"].items())
    lines = [f"== cache state exactness (mlx-lm {s['mlx_lm']}): {s['cases']} cases; prefixes {pre} "
             f"(window {s['window']}); {', '.join(f'{v} {k}' for k, v in s['verdicts'].items())}",
             text_table(_state_cells(t))]
    bugs = t[t["verdict"] == "STATE BUG"]
    if len(bugs):
        lines.append("first state bug per cache class and operation:")
        for (cache, op), g in bugs.groupby(["cache", "operation"], sort=False):
            r = g.iloc[0]
            lines.append(f"  {cache} {op} [{r['where']} {r['params']}]: {r['reason']}")
    lines.append(f"{s['seconds']:.0f} s")
    return "\n".join(lines)


SUMMARIES["state"] = state_summary
TEXTS["state"] = state_text
