"""Figures (matplotlib, PNG). Each takes the tidy frames the library produces; DRAW holds the figures of a Result
per kind. The figures of history, fingerprint, state, batch and server live in their kind's view module
(history.py, fingerprint.py, state.py, batch.py) and are named here too."""

from __future__ import annotations

import numpy as np
import pandas as pd

from .batch import batch_figure, batch_layers_figure, server_figure
from .figure import pyplot as _plt, tight
from .fingerprint import fingerprint_figures
from .history import draw_history, plot_history, plot_layer_profile  # noqa: F401  (notebooks call plots.plot_history)
from .state import state_grid


MARKERS = "osD^v"


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
            # Later pairs get other markers and thinner lines, so identical curves stay visible.
            ax.plot(x, np.where(y > 0, y, np.nan), style, marker=MARKERS[k % len(MARKERS)], ms=3 + 1.5 * k,
                    mfc="none" if k else None, lw=max(0.8, 1.8 - 0.5 * k), color=c, label=f"{pair} ({mode})")
            zeros = x[y == 0]
            if len(zeros):
                ax.plot(zeros, np.full(len(zeros), floor), linestyle="none", marker="o", mfc="none", color=c)
    ax.set_yscale("log")
    n = len(layer_types)
    ax.set_xticks(list(range(n)) + [n])
    ax.set_xticklabels([str(i) for i in range(n)] + ["norm"], fontsize=7)
    ax.set_xlabel("decoder layer (shaded: global attention)")
    if len(positive):
        ax.set_ylabel(f"{metric} vs reference ({dtype})")
    else:  # a log axis around a made-up floor would suggest a size
        ax.set_yticks([])
        ax.set_yticks([], minor=True)
        ax.set_ylabel(f"{metric} vs reference ({dtype}): all exactly 0")
    ax.set_title(title or "Drift per layer")
    ax.text(0.0, -0.16, "open circles on the floor: exactly 0 (bit-identical)", transform=ax.transAxes, fontsize=7,
            color="0.35")
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
    # Gaps and Δgaps pile up near 0: linear below 1e-2 logits, logarithmic above.
    a1.set_xscale("symlog", linthresh=1e-2)
    a1.set_yscale("symlog", linthresh=1e-2)
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


def triage(t: dict, title: str = ""):
    """Per generated token: how far each stream's token sits below its own schedule's argmax.

    ``t`` is a triage record (:class:`gemmdrift.measure.diverge.Triage` as a dict).
    Zero where the stream's token is the argmax (drawn on the floor); the
    envelope is the horizontal line: a stream above it was not computed from
    the state its schedule gives. The first divergence is the vertical line.
    """
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 3.8))
    env = float(t.get("envelope") or 0.0)
    top = max(env, 0.1)
    for key, marker in (("a", "o"), ("b", "s")):
        margins = np.asarray((t.get(f"stream_{key}_check") or {}).get("margins", []), dtype=float)
        if not len(margins):
            continue
        top = max(top, float(margins.max()))
        x = np.arange(len(margins))
        ax.plot(x, margins, marker=marker, ms=4, lw=1, mfc="none" if key == "b" else None,
                label=f"stream {key.upper()} ({t.get(f'schedule_{key}', '')})")
    ax.axhline(env, color="k", ls=":", lw=1, label=f"envelope {env:.3g} logits")
    if t.get("index") is not None:
        ax.axvline(int(t["index"]), color="tab:red", lw=1, label=f"first divergence (token {t['index']})")
    # Margins are 0 (argmax) or anything up to tens of logits.
    ax.set_yscale("symlog", linthresh=1e-2)
    ax.set_ylim(0, top * 3)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("generated token")
    ax.set_ylabel("argmax − stream's token (logits)")
    ax.set_title(title or f"Each stream teacher-forced under its own schedule — verdict: {t.get('verdict')}",
                 fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def ladder(ladder_df: pd.DataFrame, base: str, high: str = "float32"):
    """rel_l2 drift per tap at the base dtype and at float32, per pair."""
    plt = _plt()
    pairs = list(dict.fromkeys(ladder_df["pair"]))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    cols = [f"rel_l2_{base}", f"rel_l2_{high}"]
    values = ladder_df[cols].to_numpy(float).ravel()
    positive = values[values > 0]
    # Exact zeros (bit-identical schedules, every run below the sliding window on the CPU) cannot sit on a log
    # axis: drawn as open markers on the bottom edge; all zero: a linear axis at 0 that says so.
    floor = float(positive.min()) / 4 if len(positive) else 0.0
    for k, pair in enumerate(pairs):
        s = ladder_df[ladder_df["pair"] == pair].sort_values("layer")
        c = colors[k % len(colors)]
        for col, style in zip(cols, ("-", ":")):
            x, y = s["layer"].to_numpy(), s[col].to_numpy(float)
            ax.plot(x, np.where(y > 0, y, np.nan) if len(positive) else y, style, marker=MARKERS[k % len(MARKERS)],
                    ms=3 + 1.5 * k, mfc="none" if k else None, lw=max(0.8, 1.8 - 0.5 * k), color=c,
                    label=f"{pair} {col.split('_')[-1]}")
            zeros = x[y == 0]
            if len(positive) and len(zeros):
                ax.plot(zeros, np.full(len(zeros), floor), linestyle="none", marker="o", mfc="none", color=c)
    taps = ladder_df.drop_duplicates("layer").sort_values("layer")
    ax.set_xticks(taps["layer"].to_list())
    ax.set_xticklabels([str(t).removeprefix("layer ") for t in taps["tap"]], fontsize=7)
    ax.set_xlabel("tap: decoder layer, final norm, logits")
    if len(positive):
        ax.set_yscale("log")
        ax.set_ylabel("rel_l2 drift between the schedules")
    else:
        ax.set_ylim(-1, 1)
        ax.set_yticks([0])
        ax.set_ylabel("rel_l2 drift between the schedules: all exactly 0 (bit-identical)")
    ax.set_title(f"Precision ladder: {base} (solid) vs {high} (dotted); rounding shrinks, semantics do not",
                 fontsize=10)
    ax.grid(True, which="both", axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def _bits(values) -> np.ndarray:
    from ..metrics import bits_lost

    return np.array([bits_lost(float(v)) if np.isfinite(v) else np.nan for v in np.ravel(values)]).reshape(
        np.shape(values))


def kernel_heatmap(df: pd.DataFrame, metric: str = "max_ulp", title: str = ""):
    """Layer x projection heatmap of the worst ``metric`` over T, one panel per path.

    ULP metrics are coloured as bits lost, log2(1 + ULPs): exactly 0 where
    every block row was bit-identical to its T=1 result, 1 for one ULP. The
    numbers in the cells are the raw worst values. Emulated paths are titled
    as such.
    """
    plt = _plt()
    t = df[df["metric"] == metric]
    paths = list(dict.fromkeys(t["path"]))
    names = list(dict.fromkeys(t["projection"]))
    layers = sorted(t["layer"].unique())
    ncols = min(3, max(1, len(paths)))
    nrows = -(-max(1, len(paths)) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols + 1, 0.28 * len(layers) * nrows + 2.5),
                             squeeze=False, gridspec_kw={"wspace": 0.45})
    ulp = metric.endswith("ulp")
    worst = t.groupby(["path", "layer", "projection"])["value"].max()
    vmax = max(1.0, float(np.nanmax(_bits(worst.to_numpy()))) if ulp and len(worst) else float(worst.max() or 1.0))
    image = None
    for ax, path in zip(axes.ravel(), paths):
        grid = worst.loc[path].unstack("projection").reindex(index=layers, columns=names)
        raw = grid.to_numpy(dtype=float)
        shown = _bits(raw) if ulp else raw
        image = ax.imshow(np.ma.masked_invalid(shown), aspect="auto", cmap="viridis", vmin=0, vmax=vmax,
                          interpolation="nearest")
        if len(layers) <= 40:
            for (i, j), v in np.ndenumerate(raw):
                if np.isfinite(v):
                    ax.text(j, i, f"{v:.3g}", ha="center", va="center", fontsize=6,
                            color="white" if (shown[i, j] if np.isfinite(shown[i, j]) else 0) < vmax / 2 else "black")
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels([n.rsplit(".", 1)[-1] for n in names], rotation=60, ha="right", fontsize=7)
        ax.set_yticks(range(len(layers)))
        head = set(t[t["projection"] == "lm_head"]["layer"])
        ax.set_yticklabels([f"{i} (head)" if i in head else str(i) for i in layers], fontsize=7)
        emulated = bool(t[t["path"] == path]["emulated"].any())
        ax.set_title(("EMULATED control: " if emulated else "") + path, fontsize=9,
                     color="darkred" if emulated else "black")
    for ax in axes.ravel()[len(paths):]:
        ax.axis("off")
    if image is not None:
        label = f"bits lost = log2(1 + worst {metric})" if ulp else f"worst {metric}"
        fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label=label)
    fig.suptitle(title or f"Worst {metric} over T of a T-row GEMM against T=1 GEMV")
    return fig


def kernel_vs_t(df: pd.DataFrame, thresholds=None, metric: str = "max_ulp", reference: str = "", title: str = ""):
    """Drift against T per projection (worst over layers), one line per path, with dispatch thresholds.

    Args:
        df: the kernels table (projection rows).
        thresholds: ``{projection: [(T, label, group), ...]}`` or one list for
            every panel; each is a vertical line with its label, coloured by
            ``group`` (e.g. matmul, quantized_matmul).
        metric: a ULP metric, drawn as bits lost (log2(1 + ULPs)).
        reference: where the thresholds come from, for the legend
            (e.g. "Metal (reference), M3 Max, mlx 0.32.4" for CPU data).
    """
    plt = _plt()
    t = df[(df["metric"] == metric) & (df["T"] > 1)]
    names = list(dict.fromkeys(t["projection"]))
    ncols = min(4, max(1, len(names)))
    nrows = -(-max(1, len(names)) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(3.8 * ncols, 3.1 * nrows + 1.0), squeeze=False, sharey=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    markers = "osD^vP*X"
    paths = list(dict.fromkeys(t["path"]))
    groups: list[str] = []
    for ax, name in zip(axes.ravel(), names):
        s = t[t["projection"] == name]
        for k, path in enumerate(paths):
            p = s[s["path"] == path].groupby("T")["value"].max()
            if p.empty:
                continue
            emulated = bool(s[s["path"] == path]["emulated"].any())
            # Later paths get open markers and thinner lines, so equal curves (all zero) stay visible.
            ax.plot(p.index, _bits(p.to_numpy()), "--" if emulated else "-", marker=markers[k % len(markers)],
                    ms=4, mfc="none" if k else None, lw=max(0.8, 2.2 - 0.5 * k), color=colors[k % len(colors)],
                    label=("EMULATED " if emulated else "") + path)
        marks = thresholds.get(name, []) if isinstance(thresholds, dict) else (thresholds or [])
        for mark in marks:
            T, label, group = (*mark, "")[:3]
            if group not in groups:
                groups.append(group)
            gi = groups.index(group)
            ax.axvline(T, color=("0.45", "tab:purple", "tab:brown")[gi % 3], lw=0.8, ls=":",
                       label=f"{reference} {group} switch".strip())
            # Groups alternate between the top and the bottom of the panel to keep labels apart.
            ax.text(T, 0.99 if gi % 2 == 0 else 0.01, f" {label} ", rotation=90, va="top" if gi % 2 == 0 else "bottom",
                    ha="right", fontsize=5.5, color="0.3", transform=ax.get_xaxis_transform())
        ax.set_xscale("log", base=2)
        ax.set_title(name, fontsize=8)
        ax.grid(True, alpha=0.3)
        ax.set_xlabel("T (rows in the block)", fontsize=7)
    for ax in axes.ravel()[len(names):]:
        ax.axis("off")
    axes[0, 0].set_ylabel(f"bits lost, log2(1 + {metric})", fontsize=8)
    handles: dict[str, object] = {}
    for ax in axes.ravel():
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=min(4, len(handles)), fontsize=7)
    fig.suptitle(title or "T-row GEMM against T=1 GEMV, worst over layers (dotted: kernel dispatch switches)",
                 fontsize=9)
    tight(fig, rect=(0, 0.08, 1, 0.96))
    return fig


def ops_vs_t(df: pd.DataFrame, thresholds=None, metric: str = "max_ulp", reference: str = "", title: str = ""):
    """The ops table: drift of each query of a T-query block against the query alone, one panel per op.

    One line per variant and key length (colour: key length; line style:
    variant), drawn as bits lost; ``thresholds`` is ``{op: [(T, label, group)]}``
    (see :func:`gemmdrift.kernels.ops_thresholds`), drawn as dotted lines.
    """
    plt = _plt()
    t = df[df["metric"] == metric]
    ops = list(dict.fromkeys(t["projection"]))
    fig, axes = plt.subplots(1, max(1, len(ops)), figsize=(3.9 * max(1, len(ops)), 3.6), squeeze=False, sharey=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    key_lengths = sorted(k for k in t["key_length"].dropna().unique())
    styles = ["-", "--", ":", "-."]
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    top = 1.0
    for ax, op in zip(axes[0], ops):
        s = t[t["projection"] == op]
        variants = list(dict.fromkeys(s["path"]))
        for j, variant in enumerate(variants):
            v = s[s["path"] == variant]
            for k_len, g in v.groupby(v["key_length"].fillna(-1), sort=True):
                c = colors[key_lengths.index(k_len) % len(colors)] if k_len in key_lengths else "k"
                worst = g.groupby("T")["value"].max()
                y = _bits(worst.to_numpy())
                top = max(top, float(np.nanmax(y)) if len(y) else 0.0)
                ax.plot(worst.index, y, styles[j % len(styles)], marker="o", ms=3 + 1.5 * j,
                        mfc="none" if j else None, color=c)
        marks = (thresholds or {}).get(op, [])
        for T, label, _ in marks:
            ax.axvline(T, color="0.45", lw=0.8, ls=":")
            ax.text(T, 0.98, f" {label} ", rotation=90, va="top", ha="right", fontsize=6, color="0.3",
                    transform=ax.get_xaxis_transform())
        # Legend: colour = key length, line style = variant.
        lengths = sorted(k for k in s["key_length"].dropna().unique())
        handles = [Line2D([], [], color=colors[key_lengths.index(k) % len(colors)], label=f"{int(k)} keys")
                   for k in lengths]
        handles += [Line2D([], [], color="0.3", ls=styles[j % len(styles)], label=v) for j, v in enumerate(variants)]
        ax.legend(handles=handles, fontsize=6)
        ax.set_title(op + (f"  (dotted: {reference} switch)" if marks else ""), fontsize=8)
        ax.set_xlabel("T (queries in the block)", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
    axes[0, 0].set_ylim(-0.1, top * 1.15)
    axes[0, 0].set_ylabel(f"bits lost, log2(1 + {metric})", fontsize=8)
    fig.suptitle(title or "Ops: each query inside a T-query block against the same query alone", fontsize=9)
    tight(fig)
    return fig


# ------------------------------------------------------------------ figures of a Result

# kind -> function(Result) -> {file name: matplotlib figure}; the store saves them.
DRAW: dict = {}


def draw(result) -> dict:
    """The figures of any Result, by file name (``{"stack_drift.png": fig, ...}``); none for unknown kinds."""
    fn = DRAW.get(result.kind)
    return fn(result) if fn else {}


# ---- stack


def draw_stack(result) -> dict:
    """stack_drift.png, dgap.png (when logits were compared) and ladder.png (with the ladder)."""
    model = result.inputs["model"]
    base = model["dtype"]
    synthetic = " [synthetic weights]" if model.get("synthetic") else ""
    out = {"stack_drift.png": stack_drift(result.tables["stack"], model.get("layer_types") or [], base,
                                          title=f"Drift per layer, {model['source']} {base}{synthetic}")}
    positions = result.tables.get("positions")
    if positions is not None and len(positions):
        out["dgap.png"] = dgap(positions, base)
    lad = result.tables.get("ladder")
    if lad is not None and len(lad):
        out["ladder.png"] = ladder(lad, base)
    return out


DRAW["stack"] = draw_stack


# ---- kernels


def draw_kernels(result) -> dict:
    """kernels_heatmap.png and kernels_vs_t.png (projections), ops_vs_t.png (ops), with the dispatch switches
    of the recorded backend and mlx version."""
    from ..kernels import is_op, normalize, ops_thresholds, plot_thresholds

    df = normalize(result.tables["kernels"])
    out = {}
    proj = df[~is_op(df)]
    if len(proj):
        synthetic = " [synthetic]" if proj["synthetic"].any() else ""
        model = result.inputs.get("model") or {}
        source = model.get("source", "") if isinstance(model, dict) else str(model)
        out["kernels_heatmap.png"] = kernel_heatmap(proj, title=f"GEMM vs GEMV drift per projection, {source}"
                                                                f"{synthetic}")
        marks, origin = plot_thresholds(proj, result.env)
        out["kernels_vs_t.png"] = kernel_vs_t(proj, marks, reference=origin)
    ops = df[is_op(df)]
    if len(ops):
        marks, origin = ops_thresholds(ops, result.env)
        out["ops_vs_t.png"] = ops_vs_t(ops, marks, reference=origin)
    return out


DRAW["kernels"] = draw_kernels


# ---- diverge, triage, divergence


DRAW["diverge"] = lambda r: {"triage.png": triage(r.details["triage"])} if r.details.get("triage") else {}
DRAW["triage"] = lambda r: {"triage.png": triage(r.details["triage"])}
DRAW["divergence"] = lambda r: {"divergence.png": divergence(r.tables["divergence"])}


# ---- history


DRAW["history"] = draw_history


# ---- fingerprint


DRAW["fingerprint"] = fingerprint_figures


# ---- state


DRAW["state"] = lambda result: {"state_grid.png": state_grid(
    result.tables["state"], f"Cache state exactness, mlx-lm {result.details.get('mlx_lm')}: worst verdict "
                            "per cell (cases with it / cases)")}


# ---- batch


def _draw_batch(result) -> dict:
    out = {"batch.png": batch_figure(result)}
    if "batch_layers" in result.tables and len(result.tables["batch_layers"]):
        out["batch_layers.png"] = batch_layers_figure(result.tables["batch_layers"])
    return out


DRAW["batch"] = _draw_batch


# ---- server


DRAW["server"] = lambda result: {"server.png": server_figure(result)}


# ---- compare (issue 23)


def _draw_compare(result) -> dict:
    from .compare import compare_figure

    return {"compare.png": compare_figure(result)}


DRAW["compare"] = _draw_compare


def _draw_predict(result) -> dict:  # issue 22: the figure lives in gemmdrift.view.predict
    from .predict import FIGURE, predict_figure

    return {FIGURE: predict_figure(result)}


DRAW["predict"] = _draw_predict


def _draw_attribute(result) -> dict:  # issue 29: the figure lives in gemmdrift.view.attribute
    from .attribute import FIGURE, attribute_figure

    return {FIGURE: attribute_figure(result)}


DRAW["attribute"] = _draw_attribute
