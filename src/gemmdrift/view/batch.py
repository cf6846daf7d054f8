"""The batch and server kinds in view: a stream beside others (a BatchGenerator row, an mlx_lm.server request)
against the same stream alone."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from ..result import Result
from ..text import records, text_table
from .figure import pyplot as _plt, tight


def batch_figure(result):
    """Batch envelope (max |Δgap|) and first divergence against B, per companion set and row position."""
    plt = _plt()
    t = result.tables["batch"]
    n = int(result.inputs.get("n") or 0)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    styles = {"first": "o-", "last": "s--", "middle": "^:"}
    for (comp, where), g in t.assign(where=np.where(t["row"] == 0, "first",
                                                    np.where(t["row"] == t["B"] - 1, "last", "middle"))
                                     ).groupby(["companions", "where"]):
        g = g.groupby("B").agg(env=("envelope_batch", "max"), first=("first_divergence", "min")).reset_index()
        label = f"{comp}, {where} row"
        axes[0].plot(g["B"], g["env"], styles.get(where, "o-"), label=label, ms=5)
        first = g["first"].fillna(n)
        axes[1].plot(g["B"], first, styles.get(where, "o-"), label=label, ms=5)
    ref = result.figures.get("reference_envelope")
    if ref is not None:
        axes[0].axhline(ref, color="0.4", lw=0.8, ls=":", label="single-sequence envelope")
    axes[0].set_ylabel("batch envelope: max |Δgap| (logits)")
    axes[1].set_ylabel(f"first divergent token ({n} = none)")
    for ax in axes:
        ax.set_xlabel("B (sequences in the batch)")
        ax.set_xscale("log", base=2)
        bs = sorted(int(b) for b in t["B"].unique())
        ax.set_xticks(bs, [str(b) for b in bs])
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Row j of mlx-lm's BatchGenerator vs the same prompt alone", fontsize=9)
    tight(fig)
    return fig


def batch_layers_figure(table: pd.DataFrame, title: str = ""):
    """Per-layer drift of the row (rel L2 against the same stream alone) at every tap, one line per batch size,
    row position and companion set (log scale; bit-identical layers on the floor as open markers)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 4.2))
    positive = table["rel_l2"][table["rel_l2"] > 0]
    floor = float(positive.min()) / 4 if len(positive) else 1e-8
    taps = table.drop_duplicates("layer").sort_values("layer")
    for (target, comp, B, row), g in table.groupby(["target", "companions", "B", "row"], sort=True):
        g = g.sort_values("layer")
        xs, ys = g["layer"].to_numpy(), g["rel_l2"].to_numpy(float)
        many = table["target"].nunique() > 1
        label = (f"{target}, " if many else "") + f"{comp}, B={B}, row {row}"
        line, = ax.plot(xs, np.where(ys > 0, ys, np.nan), marker="o", ms=3, label=label)
        if (ys == 0).any():
            ax.plot(xs[ys == 0], np.full(int((ys == 0).sum()), floor), "o", mfc="none", color=line.get_color())
    ax.set_yscale("log")
    ax.set_xticks(taps["layer"], [t.replace("layer ", "") for t in taps["tap"]], fontsize=7)
    ax.set_xlabel("decoder layer (norm: the final norm's output)")
    ax.set_ylabel("rel L2 of the row vs alone")
    ax.set_title(title or "Per-layer drift of one row through the padded batch (open markers on the floor: "
                          "bit-identical)", fontsize=9)
    ax.grid(True, which="both", axis="y", alpha=0.3)
    if table.groupby(["target", "companions", "B", "row"]).ngroups <= 16:
        ax.legend(fontsize=6, ncol=2)
    tight(fig)
    return fig


def server_figure(result):
    """First divergence per server case (the number generated when the streams never part)."""
    plt = _plt()
    t = result.tables["server"]
    n = int(result.inputs.get("n") or 0)
    fig, ax = plt.subplots(figsize=(6, 3))
    first = t["first_divergence"].fillna(n)
    colors = ["C3" if v == "OUTSIDE ENVELOPE" else "C1" if v == "NEAR-TIE" else "C2" for v in t["verdict"]]
    ax.bar(t["case"], first, color=colors)
    ax.axhline(n, color="0.4", lw=0.8, ls=":")
    ax.set_ylabel(f"first divergent token ({n} = none)")
    ax.set_title("mlx_lm.server: green identical, orange near-tie, red outside the envelope", fontsize=8)
    tight(fig)
    return fig


BATCH_COLUMNS = ["target", "companions", "B", "row", "verdict", "first_divergence", "envelope_batch", "margin",
                 "reference_envelope", "seconds_batch", "seconds_alone_all"]


def batch_summary(result: Result) -> dict[str, Any]:
    return {"kind": "batch", "figures": dict(result.figures), "rows": records(result.tables["batch"], BATCH_COLUMNS)}


def batch_text(result: Result) -> str:
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
        counts = ", ".join(f"{int(f[k])} {k.removeprefix('batch_outside_')}" for k in
                           ("batch_outside_rounding", "batch_outside_semantic", "batch_outside_unclear",
                            "batch_outside_unreliable", "batch_outside_identical") if k in f)  # runs before 'unclear'/'unreliable' were counted
        lines.append(f"precision ladder (float32 rerun) of the rows outside: {counts}")
    if "batch_speedup" in f:
        lines.append(f"largest batch: {f['batch_speedup']:.2f}x the speed of the same streams one by one")
    lt = result.tables.get("batch_layers")
    if lt is not None and len(lt):
        lines += ["", "per-layer drift of the row through the batch (rel L2 vs alone, over the positions whose "
                      "input both share; the first layer that differs and the final norm):"]
        for (target, comp, B, row), g in lt.groupby(["target", "companions", "B", "row"], sort=True):
            g = g.sort_values("layer")
            differ = g[g["frac_differ"] > 0]
            first = differ["tap"].iloc[0] if len(differ) else "none"
            norm = g[g["tap"] == "norm"]["rel_l2"]
            lines.append(f"  {target} {comp} B={B} row {row}: {int(g['positions'].iloc[0])} positions, first layer "
                         f"that differs: {first}, norm rel L2 {float(norm.iloc[0]) if len(norm) else float('nan'):.3g}")
    return "\n".join(lines)


SERVER_COLUMNS = ["case", "a", "b", "prompt_tokens", "tokens_a", "tokens_b", "first_divergence", "verdict",
                  "margin", "envelope", "seconds_a", "seconds_b"]


def server_summary(result: Result) -> dict[str, Any]:
    return {"kind": "server", "figures": dict(result.figures),
            "cases": records(result.tables["server"], SERVER_COLUMNS)}


def server_text(result: Result) -> str:
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
