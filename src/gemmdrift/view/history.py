"""The history kind in view: tracked figures against the mlx release, and per-layer profiles by mlx version."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import pandas as pd

from ..result import Result
from .figure import pyplot as _plt


def plot_history(df: pd.DataFrame, benchmark: str, params: str = "", releases: pd.DataFrame | None = None,
                 skipped: pd.DataFrame | None = None):
    """One tracked figure against the release (mlx, or mlx+lm), one line per machine/backend, every release of
    those machines on the x axis in release order (``releases``: :func:`gemmdrift.measure.history.coverage`). A
    release with no value (``skipped``: :func:`gemmdrift.measure.history.skipped_table`) is marked "skipped" or
    "not run" at the foot of the axis, and the line breaks there: never a point at 0, never a silent gap."""
    plt = _plt()

    from ..measure.history import label_releases, release_key, series_name

    if "release" not in df.columns:
        df = label_releases(df)
    s = df[(df["benchmark"] == benchmark) & (df["params"] == params)]
    lines = sorted(set(zip(s["machine"], s["backend"])))
    rel = set(s["release"])
    if releases is not None and len(releases):
        cov = releases[[(m, b) in lines for m, b in zip(releases["machine"], releases["backend"])]]
        rel |= set(cov["release"])
    versions = sorted(rel, key=release_key)
    x = {v: i for i, v in enumerate(versions)}
    miss = pd.DataFrame(columns=["machine", "backend", "release", "why"])
    if skipped is not None and len(skipped):
        miss = skipped[(skipped["benchmark"] == benchmark) & (skipped["params"].fillna("") == params)]
    fig, ax = plt.subplots(figsize=(max(8, 0.45 * len(versions)), 4))
    for machine, backend in lines:
        g = s[(s["machine"] == machine) & (s["backend"] == backend)]
        ys = np.full(len(versions), np.nan)
        for v, y in zip(g["release"], g["value"]):
            ys[x[v]] = y
        line, = ax.plot(range(len(versions)), ys, marker="o", label=f"{machine} ({backend})")
        m = miss[(miss["machine"] == machine) & (miss["backend"] == backend)]
        for v, why in zip(m["release"], m["why"]):
            ax.plot([x[v]], [0.04], marker="x", ms=7, color=line.get_color(), transform=ax.get_xaxis_transform(),
                    clip_on=False)
            ax.text(x[v], 0.09, why, rotation=90, fontsize=6, ha="center", va="bottom", color=line.get_color(),
                    transform=ax.get_xaxis_transform())
    if len(miss):
        ax.plot([], [], "x", color="grey", label="no value here (skipped / not run): not 0")
    ax.set_xticks(range(len(versions)))
    ax.set_xticklabels(versions, fontsize=7 if len(versions) > 5 else None, rotation=45 if len(versions) > 8 else 0,
                       ha="right" if len(versions) > 8 else "center")
    ax.set_xlabel("release, in release order: mlx version (+lm: the mlx-lm version, where one mlx ran with several)")
    unit = s["unit"].dropna().iloc[0] if s["unit"].notna().any() else ""
    ax.set_ylabel(unit or "value")
    ax.set_title(series_name(benchmark, params), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def plot_layer_profile(profile: pd.DataFrame, title: str):
    """Drift at every layer, one line per release (log scale; exact zeros on the floor as open markers)."""
    from ..measure.history import release_key

    plt = _plt()
    taps = profile.drop_duplicates("tap").sort_values("tap_index")
    x = {tap: i for i, tap in enumerate(taps["tap"])}
    positive = profile["value"][profile["value"] > 0]
    floor = float(positive.min()) / 4 if len(positive) else 1e-8
    fig, ax = plt.subplots(figsize=(9, 4.2))
    for version in sorted(set(profile["release"]), key=release_key):
        s = profile[profile["release"] == version].sort_values("tap_index")
        xs, ys = np.array([x[t] for t in s["tap"]]), s["value"].to_numpy(float)
        line, = ax.plot(xs, np.where(ys > 0, ys, np.nan), marker="o", ms=3, label=f"mlx {version}")
        if (ys == 0).any():
            ax.plot(xs[ys == 0], np.full(int((ys == 0).sum()), floor), "o", mfc="none", color=line.get_color())
    ax.set_yscale("log")
    ax.set_xticks(range(len(x)))
    ax.set_xticklabels([t.replace("layer ", "") for t in x], fontsize=7)
    ax.set_xlabel("decoder layer")
    unit = profile["unit"].dropna().iloc[0] if profile["unit"].notna().any() else "value"
    ax.set_ylabel(unit)
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def draw_history(result) -> dict:
    """figures/<series>.png for every tracked series, figures/layers_*.png for every per-layer profile."""
    from ..measure.history import figure_names, layer_profiles

    t = result.tables["history"]
    profiles = layer_profiles(t)

    def make(key):
        if len(key) == 2:
            return plot_history(t, *key, releases=result.tables.get("releases"), skipped=result.tables.get("skipped"))
        machine, backend, bench, rest = key
        return plot_layer_profile(profiles[key], f"{bench} [{rest}] on {machine} ({backend}): drift per "
                                                 "layer by mlx version")

    return LazyFigures(figure_names(t), make)


class LazyFigures(Mapping):
    """{file name: figure}, each figure drawn when it is read: the writer saves and closes one before the
    next is drawn (hundreds of history figures open at once make matplotlib warn and hold the memory)."""

    def __init__(self, keys: dict, make) -> None:
        self._keys, self._make = dict(keys), make

    def __getitem__(self, name):
        return self._make(self._keys[name])

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def history_summary(result: Result) -> dict[str, Any]:
    from ..measure.history import figure_names

    from ..measure.history import label_releases, release_key

    t, wide = result.tables["history"], result.tables["history_wide"]
    if "release" not in t.columns:
        t = label_releases(t)
    return {"series": int(len(wide)), "versions": sorted(set(t["release"]), key=release_key),
            "machines": sorted(set(t["machine"])),
            "figures": list(figure_names(t)), "table": wide.to_dict(orient="records")}


def history_text(result: Result) -> str:
    """The wide table as printed: a column per release of the machines shown, in release order; a cell with no
    value says "skipped" (asv recorded NaN) or "not run" (no such benchmark in that release's results), never 0
    and never a blank that reads as one."""
    from ..measure.history import release_key, series_name
    from ..text import text_table

    wide = result.tables["history_wide"].copy()
    rel, sk = result.tables.get("releases"), result.tables.get("skipped")
    if rel is None or sk is None or wide.empty:
        return text_table(wide)
    fixed = ["machine", "backend", "series"]
    shown = set(zip(wide["machine"], wide["backend"]))
    extra = {r for m, b, r in zip(rel["machine"], rel["backend"], rel["release"]) if (m, b) in shown}
    cols = sorted((set(wide.columns) - set(fixed)) | extra, key=release_key)
    wide = wide.reindex(columns=fixed + cols).astype(object)
    where = {k: i for i, k in enumerate(zip(wide["machine"], wide["backend"], wide["series"]))}
    for m, b, bench, params, r, why in zip(sk["machine"], sk["backend"], sk["benchmark"], sk["params"].fillna(""),
                                           sk["release"], sk["why"]):
        i = where.get((m, b, series_name(bench, str(params))))
        if i is not None and r in wide.columns:
            wide.iat[i, wide.columns.get_loc(r)] = why
    return text_table(wide)

