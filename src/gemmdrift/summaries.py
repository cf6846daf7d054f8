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


# ---- batch


BATCH_COLUMNS = ["target", "companions", "B", "row", "verdict", "first_divergence", "envelope_batch", "margin",
                 "reference_envelope", "seconds_batch", "seconds_alone_all"]


def batch_summary(result: Result) -> dict[str, Any]:
    t = result.tables["batch"]
    cols = [c for c in BATCH_COLUMNS if c in t.columns]
    return {"kind": "batch", "figures": dict(result.figures),
            "rows": t[cols].astype(object).where(t[cols].notna(), None).to_dict(orient="records")}


def batch_text(result: Result) -> str:
    from .report import text_table

    t = result.tables["batch"]
    f = result.figures
    cols = BATCH_COLUMNS + [c for c in ("ladder", "ladder_envelope") if c in t.columns and (t[c].fillna("") != "").any()]
    lines = ["== batch: row j of mlx-lm's BatchGenerator vs the same prompt alone", text_table(t[cols]), ""]
    lines.append(f"{int(f['batch_rows'])} rows: {int(f['batch_identical'])} bit-identical, {int(f['batch_flips'])} "
                 f"parted from the lone stream, {int(f['batch_outside'])} outside the envelope; largest batch "
                 f"envelope (max |Δgap|) {f['batch_envelope']:.4g}"
                 + (f", single-sequence reference envelope {f['reference_envelope']:.4g}"
                    if "reference_envelope" in f else ""))
    if "batch_outside_rounding" in f:
        lines.append(f"precision ladder (float32 rerun) of the rows outside: {int(f['batch_outside_rounding'])} "
                     f"rounding, {int(f['batch_outside_semantic'])} semantic")
    if "batch_speedup" in f:
        lines.append(f"largest batch: {f['batch_speedup']:.2f}x the speed of the same streams one by one")
    return "\n".join(lines)


SUMMARIES["batch"] = batch_summary
TEXTS["batch"] = batch_text


# ---- server


SERVER_COLUMNS = ["case", "a", "b", "prompt_tokens", "tokens_a", "tokens_b", "first_divergence", "verdict",
                  "margin", "envelope", "seconds_a", "seconds_b"]


def server_summary(result: Result) -> dict[str, Any]:
    t = result.tables["server"]
    cols = [c for c in SERVER_COLUMNS if c in t.columns]
    return {"kind": "server", "figures": dict(result.figures),
            "cases": t[cols].astype(object).where(t[cols].notna(), None).to_dict(orient="records")}


def server_text(result: Result) -> str:
    from .report import text_table

    t = result.tables["server"]
    f = result.figures
    cols = [c for c in SERVER_COLUMNS if c in t.columns]
    lines = ["== mlx_lm.server: greedy streams over HTTP", text_table(t[cols]), ""]
    lines.append(f"{int(f['server_divergences'])} of {len(t)} pairs diverged")
    if "server_tokens_per_s" in f:
        same = "the same tokens as" if f.get("server_matches_inprocess") == 1.0 else "OTHER tokens than"
        lines.append(f"server {f['server_tokens_per_s']:.3g} tokens/s (request wall time, prompt included) vs "
                     f"{f['inprocess_tokens_per_s']:.3g} tokens/s for mlx-lm generate in process; its lone stream has "
                     f"{same} in-process generate")
    return "\n".join(lines)


SUMMARIES["server"] = server_summary
TEXTS["server"] = server_text
