"""How a ``compare`` Result reads: its summary, its printed text, its figure and its report section.

Every line names its side: *base* is the reference file (KLD(base ‖ other), Δp = p_other − p_base), *other* is
this run (or the ``--other`` file). Registered in :mod:`gemmdrift.view.summaries`, :mod:`gemmdrift.view.plots` and
:mod:`gemmdrift.report` like every kind.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from ..result import Result
from ..text import fmt, records, text_table

FLIP_COLUMNS = ["position", "target", "top1_base", "top1_other", "gap_base", "dgap", "kld", "dp", "verdict"]
SHOWN_FLIPS = 20


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def compare_summary(result: Result) -> dict[str, Any]:
    flips = result.tables.get("flips", pd.DataFrame())
    return {"kind": "compare", "base": dict(result.inputs.get("base", {})), "other": dict(result.inputs.get("other", {})),
            "kld": result.details.get("kld"), "envelope_source": result.details.get("envelope_source"),
            "figures": dict(result.figures),
            "flips": records(flips, FLIP_COLUMNS)}


def reading(result: Result) -> list[str]:
    """The figures in words, one line each, every line saying which side is which."""
    f, d = result.figures, result.details
    b, o = result.inputs.get("base", {}), result.inputs.get("other", {})
    n = int(f["positions"])
    kind = "exact" if f.get("kld_exact") else f"lower bound (base top-{b.get('top_k')} + one tail bucket)"
    se = f" ± {fmt(f['kld_se'])}" if "kld_se" in f else ""
    lines = [
        f"base:  {b.get('label')}  [{b.get('path')}]",
        f"other: {o.get('label')}  [{o.get('path')}]",
        f"{n} positions, token digest {str(result.inputs.get('token_digest'))[:12]} (same stream on both sides)",
        f"KLD(base ‖ other), {kind}: mean {fmt(f['kld_mean'])}{se}, max {fmt(f['kld_max'])}, "
        f"99.9% {fmt(f['kld_p99.9'])}, 99% {fmt(f['kld_p99'])}, 95% {fmt(f['kld_p95'])}, 90% {fmt(f['kld_p90'])}, "
        f"median {fmt(f['kld_p50'])}, 10% {fmt(f['kld_p10'])}, 5% {fmt(f['kld_p5'])}, 1% {fmt(f['kld_p1'])}, "
        f"0.1% {fmt(f['kld_p0.1'])}, min {fmt(f['kld_min'])}",
        f"Δp = p_other − p_base of the correct token: mean {fmt(f['dp_mean'])}, RMS {fmt(f['dp_rms'])}, "
        f"max {fmt(f['dp_max'])}, 99% {fmt(f['dp_p99'])}, 95% {fmt(f['dp_p95'])}, median {fmt(f['dp_p50'])}, "
        f"5% {fmt(f['dp_p5'])}, 1% {fmt(f['dp_p1'])}, min {fmt(f['dp_min'])}",
        f"perplexity: base {fmt(f['ppl_base'])}, other {fmt(f['ppl_other'])}, other/base {fmt(f['ppl_ratio'])}",
        f"same top-1 (base vs other): {int(f['same_top1'])}/{n} = {_pct(f['same_top1_share'])} "
        f"(95% Wilson {_pct(f['same_top1_lo'])} – {_pct(f['same_top1_hi'])})",
    ]
    if "max_abs_dgap" in f:
        lines.append(f"max|Δlogit| over the base's top-{b.get('top_k')}: {fmt(f.get('max_abs_dlogit', float('nan')))}; "
                     f"|Δgap| (base's top-2 gap minus the other's on the same two tokens): median "
                     f"{fmt(f['p50_abs_dgap'])}, 99% {fmt(f['p99_abs_dgap'])}, max {fmt(f['max_abs_dgap'])}")
    lines.append(f"argmax flips (base's top-1 ≠ other's): {int(f['flips'])}: {int(f['flips_near_tie'])} near-ties, "
                 f"{int(f['flips_outside'])} outside the envelope {fmt(f['envelope'])} ({d.get('envelope_source')})")
    return lines


def compare_text(result: Result) -> str:
    predicted = [f"{role} ({side.get('kernels')})" for role in ("base", "other")
                 if (side := result.inputs.get(role, {})).get("prediction")]
    lines = ["== compare: other against base" + (f" -- PREDICTION: {' and '.join(predicted)} computed with replayed "
                                                 "kernels, not measured on that chip" if predicted else "")]
    lines += reading(result)
    flips = result.tables.get("flips", pd.DataFrame())
    if len(flips):
        cols = [c for c in FLIP_COLUMNS if c in flips.columns]
        lines += ["", f"flips (gap_base: the base's top-2 gap; dgap: base gap − other's on the same tokens)"
                      + (f", the first {SHOWN_FLIPS} of {len(flips)}" if len(flips) > SHOWN_FLIPS else "") + ":",
                  text_table(flips[cols].head(SHOWN_FLIPS))]
    return "\n".join(lines)


def compare_figure(result: Result):
    """KLD per position (log scale) and the Δp distribution; flips marked."""
    import sys

    import matplotlib

    if "ipykernel" not in sys.modules:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    per = result.tables["positions"]
    f = result.figures
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
    kl = np.asarray(per["kld"], dtype=float)
    pos_kl = kl[kl > 0]
    ax = axes[0]
    if pos_kl.size:
        ax.hist(np.log10(pos_kl), bins=40, color="C0")
    ax.set_xlabel("log10 KLD(base ‖ other) per position")
    ax.set_ylabel("positions")
    ax.set_title(f"{int((kl == 0).sum())} of {len(kl)} positions exactly 0", fontsize=8)
    ax = axes[1]
    ax.hist(np.asarray(per["dp"], dtype=float), bins=40, color="C1")
    ax.axvline(0, color="0.3", lw=0.8)
    ax.set_xlabel("Δp = p_other − p_base (correct token)")
    ax.set_title(f"mean {fmt(f['dp_mean'])}, RMS {fmt(f['dp_rms'])}", fontsize=8)
    ax = axes[2]
    ax.plot(per["position"], np.where(kl > 0, kl, np.nan), ".", ms=2, color="C0", label="KLD")
    flips = ~per["same_top1"].astype(bool)
    if flips.any():
        ax.plot(per["position"][flips], np.where(kl[flips] > 0, kl[flips], np.nan), "x", color="C3", label="flip")
        ax.legend(fontsize=7)
    ax.set_yscale("log")
    ax.set_xlabel("position")
    ax.set_ylabel("KLD(base ‖ other)")
    ax.set_title(f"same top-1 {_pct(f['same_top1_share'])}; {int(f['flips'])} flips", fontsize=8)
    fig.tight_layout()
    return fig


def compare_part(result: Result) -> tuple[list[tuple], list[str]]:
    """The report section: the reading, the flips as a table."""
    lines = reading(result)
    blocks: list[tuple] = [("ul", lines)]
    flips = result.tables.get("flips", pd.DataFrame())
    if len(flips):
        cols = [c for c in FLIP_COLUMNS if c in flips.columns]
        blocks.append(("table", flips[cols].head(50).to_dict(orient="records")))
    f = result.figures
    said = (f"compare: KLD(base ‖ other) mean {fmt(f['kld_mean'])}, 99.9% {fmt(f['kld_p99.9'])}; same top-1 "
            f"{_pct(f['same_top1_share'])}; {int(f['flips'])} flips ({int(f['flips_outside'])} outside the envelope).")
    return blocks, [said]
