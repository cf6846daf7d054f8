"""Text formatting shared by the printed summaries and the report page: numbers, fixed-width and markdown tables.

Depends on nothing in gemmdrift (pandas only), so every layer above may use it.
"""

from __future__ import annotations

import math
from typing import Any

import pandas as pd


def fmt(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        if v == 0:
            return "0"
        if math.isinf(v):
            return "inf"
        if abs(v) >= 1e4 or abs(v) < 1e-3:
            return f"{v:.2e}"
        return f"{v:.4g}"
    return str(v)


def span(a: int, b: int) -> str:
    """A range of integers as every printed line writes it: both ends included, ``500..559`` (one: ``500``)."""
    return f"{a}" if a == b else f"{a}..{b}"


def t_list(ts) -> str:
    """The integers measured, exactly: runs of three or more as inclusive ranges, ``[1, 2, 3, 4, 8, 16, 33]`` ->
    ``1..4, 8, 16, 33`` (never ``1..33`` for a set with gaps)."""
    xs, out = sorted({int(t) for t in ts}), []
    i = 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out += [span(xs[i], xs[j])] if j - i >= 2 else [str(x) for x in xs[i:j + 1]]
        i = j + 1
    return ", ".join(out)


def logits(v: Any) -> str:
    """A size in logits as the printed lines write it, singular for exactly 1: '0.0625 logits', '1 logit'."""
    text = fmt(v)
    return f"{text} logit" if text == "1" else f"{text} logits"


def ordinal(n: int) -> str:
    """1 -> '1st', 22 -> '22nd', 23 -> '23rd', 11 -> '11th'."""
    n = int(n)
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n:,}{suffix}"


def nth_generated(i: int) -> str:
    """A generated token by its 0-based index (as results store it) in the words every printed line uses, counted
    from 1: index 22 -> 'the 23rd generated token'."""
    return f"the {ordinal(int(i) + 1)} generated token"


def records(df: pd.DataFrame, columns) -> list[dict[str, Any]]:
    """The rows of ``df``'s ``columns`` (those it has, in that order) as JSON-ready dicts: NaN as None."""
    cols = [c for c in columns if c in df.columns]
    return df[cols].astype(object).where(df[cols].notna(), None).to_dict(orient="records")


def text_table(df: pd.DataFrame) -> str:
    """A plain fixed-width table (no extra dependency)."""
    if df.empty:
        return "(empty)"
    cols = list(df.columns)
    cells = [[fmt(v) for v in row] for row in df.itertuples(index=False)]
    widths = [max(len(str(c)), *(len(r[i]) for r in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(cols, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) if i else v.ljust(w) for i, (v, w) in enumerate(zip(r, widths))) for r in cells]
    return "\n".join(lines)


def cell(v: Any) -> str:
    """One table cell, the same in markdown and HTML: '-' for a missing value."""
    return "-" if v is None else fmt(v)


def md_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "(none)"
    cols = list(rows[0])
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    # a '|' inside a cell (max|Δ| in a reason) would split the row: escaped, as GitHub's tables read it
    out += ["| " + " | ".join(cell(r.get(c)).replace("|", "\\|") for c in cols) + " |" for r in rows]
    return "\n".join(out)
