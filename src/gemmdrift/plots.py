"""Figures (matplotlib, PNG). Each takes the tidy frames the library produces."""

from __future__ import annotations

import numpy as np
import pandas as pd


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _shade_global(ax, layer_types):
    for i, kind in enumerate(layer_types):
        if kind == "global":
            ax.axvspan(i - 0.5, i + 0.5, color="0.9", zorder=0)


def stack_drift(table: pd.DataFrame, layer_types: list[str], dtype: str, metric: str = "rel_l2", title: str = ""):
    """Drift per layer for each schedule pair, log scale; global-attention layers shaded.

    Accumulated drift is drawn solid, local drift dashed. Exact zeros cannot sit
    on a log axis: they are drawn as open markers on the bottom edge.
    """
    plt = _plt()
    t = table[(table["dtype"] == dtype) & (table["metric"] == metric) & (table["tap"] != "logits")]
    pairs = list(dict.fromkeys(t["pair"]))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    _shade_global(ax, layer_types)
    positive = t["value"][t["value"] > 0]
    floor = float(positive.min()) / 4 if len(positive) else 1e-8
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, pair in enumerate(pairs):
        for mode, style in (("accumulated", "-"), ("local", "--")):
            s = t[(t["pair"] == pair) & (t["mode"] == mode)].sort_values("layer")
            if s.empty:
                continue
            x, y = s["layer"].to_numpy(), s["value"].to_numpy(dtype=float)
            c = colors[k % len(colors)]
            ax.plot(x, np.where(y > 0, y, np.nan), style, marker="o", ms=3, color=c,
                    label=f"{pair} ({mode})")
            zeros = x[y == 0]
            if len(zeros):
                ax.plot(zeros, np.full(len(zeros), floor), linestyle="none", marker="o", mfc="none", color=c)
    ax.set_yscale("log")
    n = len(layer_types)
    ax.set_xticks(list(range(n)) + [n])
    ax.set_xticklabels([str(i) for i in range(n)] + ["norm"], fontsize=7)
    ax.set_xlabel("decoder layer (shaded: global attention)")
    ax.set_ylabel(f"{metric} vs reference ({dtype})")
    ax.set_title(title or "Drift per layer (open markers on the floor: bit-identical)")
    ax.grid(True, which="both", axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    return fig


def dgap(positions: pd.DataFrame, dtype: str, title: str = ""):
    """Left: |Δgap| against the reference's top-2 gap (points above y=x flip). Right: Δgap histogram."""
    plt = _plt()
    p = positions[(positions["dtype"] == dtype) & (positions["mode"] == "accumulated")]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for pair, s in p.groupby("pair", sort=False):
        g, d = s["gap_a"].to_numpy(float), np.abs(s["dgap"].to_numpy(float))
        a1.scatter(g, d, s=10, alpha=0.6, label=pair)
        flips = s["flip"].to_numpy(bool)
        if flips.any():
            a1.scatter(g[flips], d[flips], s=40, facecolors="none", edgecolors="red")
        a2.hist(s["dgap"].to_numpy(float), bins=40, alpha=0.5, label=pair)
    lim = max(float(p["gap_a"].max()) if len(p) else 1.0, 1e-3)
    a1.plot([0, lim], [0, lim], "k:", lw=1)
    a1.set_xlabel("top-2 gap of the reference (logits)")
    a1.set_ylabel("|Δgap|")
    a1.set_title("flip where |Δgap| > gap (red: argmax flipped)")
    a2.set_xlabel("Δgap (logits)")
    a2.set_ylabel("positions")
    a2.set_title("Δgap distribution")
    for a in (a1, a2):
        a.legend(fontsize=7)
        a.grid(alpha=0.3)
    fig.suptitle(title or f"Logit envelope ({dtype})")
    return fig


def divergence(df: pd.DataFrame, title: str = ""):
    """Left: where the streams first diverged. Right: margin of the competing tokens vs the envelope."""
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    div = df[df["first_divergence"].notna()]
    n = int(df["n"].max()) if len(df) else 1
    a1.hist(div["first_divergence"].astype(float), bins=min(20, max(1, n)), range=(0, n), color="C0")
    a1.set_xlabel("first divergent generated token")
    a1.set_ylabel("prompts")
    a1.set_title(f"{len(div)} of {len(df)} prompts diverged")
    x = np.arange(len(div))
    colors = ["C2" if v == "NEAR-TIE" else "C3" for v in div["verdict"]]
    a2.bar(x, div["margin"].astype(float), color=colors, label="margin (green: near-tie, red: outside)")
    a2.plot(x, div["envelope"].astype(float), "k_", ms=20, mew=2, linestyle="none", label="envelope")
    a2.set_xticks(x)
    a2.set_xticklabels(div["prompt"].astype(str), rotation=45, fontsize=7)
    a2.set_ylabel("logits")
    a2.set_title("gap between the competing tokens at divergence")
    a2.legend(fontsize=7)
    for a in (a1, a2):
        a.grid(alpha=0.3)
    fig.suptitle(title or "Greedy divergence between schedules")
    return fig


def ladder(ladder_df: pd.DataFrame, base: str, high: str = "float32"):
    """rel_l2 drift per tap at the base dtype and at float32, per pair."""
    plt = _plt()
    pairs = list(dict.fromkeys(ladder_df["pair"]))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, pair in enumerate(pairs):
        s = ladder_df[ladder_df["pair"] == pair].sort_values("layer")
        c = colors[k % len(colors)]
        for col, style in ((f"rel_l2_{base}", "-"), (f"rel_l2_{high}", ":")):
            y = s[col].to_numpy(float)
            ax.plot(s["layer"], np.where(y > 0, y, np.nan), style, marker="o", ms=3, color=c,
                    label=f"{pair} {col.split('_')[-1]}")
    ax.set_yscale("log")
    ax.set_xlabel("tap (layers, norm, logits)")
    ax.set_ylabel("rel_l2 drift")
    ax.set_title(f"Precision ladder: {base} (solid) vs {high} (dotted); rounding shrinks, semantics do not")
    ax.grid(True, which="both", axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    return fig
