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
