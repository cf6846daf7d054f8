"""Writing results: tidy CSVs, a metadata record, figures, printed and markdown summaries.

Every output directory gets ``meta.json`` with the environment record (see
:mod:`envinfo`) and the exact inputs, so a table never travels without the
machine, versions, model and tokens it was measured on.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pandas as pd

from . import files, plots
from .stack import StackResult, pair_verdict, summary_frame


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


def stack_summary(result: StackResult) -> dict[str, Any]:
    """The machine-readable summary (also what --json prints)."""
    base = result.inputs["model"]["dtype"]
    env = result.envelope
    pairs = []
    for pair in dict.fromkeys(result.table["pair"]):
        t = result.table[(result.table["pair"] == pair) & (result.table["dtype"] == base)]
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
            item["flip_gaps"] = list(row["flip_gaps"])
        if result.ladder is not None and len(result.ladder):
            item["ladder_verdict"] = pair_verdict(result.ladder, pair)
        pairs.append(item)
    return {"model": result.inputs["model"]["source"], "dtype": base, "tokens": len(result.inputs["tokens"]),
            "split": result.inputs["split"], "reference": result.inputs["reference"], "pairs": pairs}


def write_stack(result: StackResult, out: str | Path, env: dict[str, Any]) -> dict[str, Path]:
    """stack.csv, positions.csv, envelope.csv, ladder.csv, meta.json, summary.json and figures."""
    out = Path(out)
    base = result.inputs["model"]["dtype"]
    written = {
        "table": files.write_csv(out / "stack.csv", result.table),
        "positions": files.write_csv(out / "positions.csv", result.positions),
        "envelope": files.write_csv(out / "envelope.csv", result.envelope),
        "meta": files.write_json(out / "meta.json", {"env": env, "inputs": result.inputs}),
        "summary": files.write_json(out / "summary.json", stack_summary(result)),
    }
    kinds = result.inputs["model"].get("layer_types") or []
    synthetic = " [synthetic weights]" if result.inputs["model"].get("synthetic") else ""
    written["fig_layers"] = files.save_figure(
        out / "stack_drift.png",
        plots.stack_drift(result.table, kinds, base, title=f"Drift per layer, {result.inputs['model']['source']} "
                                                          f"{base}{synthetic}"))
    if len(result.positions):
        written["fig_dgap"] = files.save_figure(out / "dgap.png", plots.dgap(result.positions, base))
    if result.ladder is not None and len(result.ladder):
        written["ladder"] = files.write_csv(out / "ladder.csv", result.ladder)
        written["fig_ladder"] = files.save_figure(out / "ladder.png", plots.ladder(result.ladder, base))
    return written


def print_stack(result: StackResult) -> str:
    """Per-layer table and the envelope, as printed by `gemmdrift stack`."""
    lines = []
    wide = summary_frame(result)
    for pair, s in wide.groupby("pair", sort=False):
        lines.append(f"\n== {pair}  ({result.inputs['model']['dtype']})")
        lines.append(text_table(s.drop(columns=["pair", "layer"])))
    summ = stack_summary(result)
    lines.append("\n== logit envelope")
    rows = [{k: p.get(k) for k in ("pair", "positions", "max_abs_dlogit", "max_abs_dgap", "p99_abs_dgap", "flips",
                                   "max_gap_at_flip", "ladder_verdict") if k in p} for p in summ["pairs"]]
    lines.append(text_table(pd.DataFrame(rows)))
    if result.ladder is not None and len(result.ladder):
        lines.append("\n== precision ladder (rel_l2 at the logits and the last layer)")
        last = result.ladder[result.ladder["tap"].isin(["logits", "norm"])]
        lines.append(text_table(last))
    return "\n".join(lines)


def _md_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "(none)"
    cols = list(rows[0])
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(fmt(r.get(c)) if r.get(c) is not None else "-" for c in cols) + " |" for r in rows]
    return "\n".join(out)


def _stack_rows(summary: dict[str, Any]) -> list[dict[str, Any]]:
    keys = ("pair", "first_layer_with_drift", "max_abs_dlogit", "max_abs_dgap", "p99_abs_dgap", "flips",
            "max_gap_at_flip", "ladder_verdict")
    return [{k: p.get(k) for k in keys if k in p or k == "ladder_verdict"} for p in summary["pairs"]]


def main_report(model: dict[str, Any], env: dict[str, Any], sizes_name: str, sizes, sections: dict[str, Any]) -> str:
    """report.md of `gemmdrift run`."""
    from .models import describe

    dec, pre, div = sections["stack-decode"], sections["stack-prefill"], sections["diverge"]
    k = sections["kernels"]
    lines = [
        "# gemmdrift run",
        "",
        f"- model: {describe(model)}",
        f"- mlx {env['mlx']}, mlx-lm {env['mlx_lm']}, backend **{env['backend']}** ({env['device_name']}, "
        f"{env['architecture']}), {env['os']}, python {env['python']}",
        f"- sizes: '{sizes_name}' — stream of {sizes.tokens} tokens of the built-in essay, prompt/continuation split "
        f"at {sizes.split} (sliding window: {model.get('sliding_window')})",
        f"- recorded {env['time_utc']}; the full environment record is in env.json and every part's meta.json",
        "",
        "## 1. Kernels: the same row as a GEMV (T=1) and inside a GEMM block (T>1)",
        "",
        "Real input rows captured from a forward pass, every projection of the probed layers and the LM head. "
        "`rows_differ` counts rows that are not bit-identical to their T=1 result.",
        "",
        "```",
        sections["kernels_text"],
        "```",
        "",
        "![kernel heatmap](kernels/kernels_heatmap.png)",
        "![drift vs T](kernels/kernels_vs_t.png)",
        "",
        "## 2. Layer stack: decode (T=1) vs speculative verification (T=3, T=4)",
        "",
        f"Same tokens, same prefill; the continuation ({dec['split']}..{dec['tokens']}) fed one token at a time or "
        "in verification blocks. Drift at every layer is in stack-decode/stack.csv; the logit envelope:",
        "",
        _md_table(_stack_rows(dec)),
        "",
        "![drift per layer](stack-decode/stack_drift.png)",
        "![delta gap](stack-decode/dgap.png)",
    ]
    if any("ladder_verdict" in p for p in dec["pairs"]):
        lines += ["![precision ladder](stack-decode/ladder.png)", ""]
    lines += [
        "## 3. Prefill chunk sizes: 2048 vs 512",
        "",
        _md_table(_stack_rows(pre)),
        "",
        "![drift per layer](stack-prefill/stack_drift.png)",
        "",
        "## 4. Greedy divergence: mlx-lm generate vs speculative generate (self-draft, K=2)",
        "",
    ]
    t = div.get("triage")
    if div.get("first_divergence") is None:
        lines.append(f"No divergence in {div['n']} generated tokens.")
    else:
        lines += [
            f"The streams part at generated token {div['first_divergence']}: "
            f"`{t['context']}`",
            "",
            f"- teacher-forced top-2 gap: {fmt(t['gap_a'])} under {t['schedule_a']}, {fmt(t['gap_b'])} under "
            f"{t['schedule_b']}; the competing tokens are {fmt(t['margin'])} apart",
            f"- hidden states first differ at tap {t['first_layer_differ']}; the divergence alone is a "
            f"{t['divergence_verdict']}",
        ]
    if t:
        lines.append(f"- envelope: {fmt(t['envelope'])} ({t['envelope_source']})")
        for key, label in (("a", "plain"), ("b", "speculative")):
            c = t[f"stream_{key}_check"]
            where = ("none" if c["first_outside"] is None
                     else f"token {c['first_outside']}, {fmt(c['margin_outside'])} logits below the argmax")
            lines.append(f"- the {label} stream teacher-forced under its own schedule: {c['mismatches']} of "
                         f"{c['tokens']} tokens are not the argmax; first outside the envelope: {where}")
        lines.append(f"- **verdict: {t['verdict']}** — {t['reason']}")
    lines += [
        "",
        f"plain: {div['text_a']!r}",
        "",
        f"speculative: {div['text_b']!r}",
        "",
        "## Reading this",
        "",
        "- A *near-tie* flips the argmax where Δgap exceeds the top-2 gap; that is rounding, expected wherever "
        "kernels or cache layouts differ. A flip far outside the envelope is a state bug.",
        "- The precision ladder reruns at float32 with the same weights: rounding drift shrinks by orders of "
        "magnitude, a semantic difference does not.",
        "- On the Linux CPU backend every dense and quantized matmul is row-invariant, so kernel drift is exactly "
        "0 there; the emulated split-K path shows what the sweep reports when a kernel does change with T. The drift "
        "that remains on CPU comes from the sliding-window KV cache: T=1 decoding writes a ring buffer in place, "
        "blocks concatenate in temporal order, so past the window attention sums the same keys in another order.",
    ]
    return "\n".join(lines) + "\n"
