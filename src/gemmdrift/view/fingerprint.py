"""The fingerprint kind in view: the recovered accumulation-order trees drawn per path and block size."""

from __future__ import annotations

from typing import Any

import pandas as pd

from ..result import Result
from ..text import text_table
from .figure import pyplot as _plt, tight


def _tree_xy(tree):
    """Dendrogram coordinates: leaves at their index, a node at the height of its tallest child + 1."""
    segs, pos = [], {}

    def walk(t):
        if isinstance(t, int):
            return float(t), 0
        pts = [walk(c) for c in t]
        x = sum(p[0] for p in pts) / len(pts)
        y = max(p[1] for p in pts) + 1
        for cx, cy in pts:
            segs.append(((cx, cy), (x, y)))
        return x, y

    import sys
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, 100000))
    try:
        top = walk(tree)
    finally:
        sys.setrecursionlimit(old)
    return segs, top


def fingerprint_figures(result) -> dict:
    from ..fingerprint import from_text

    plt = _plt()
    out = {}
    table = result.tables["fingerprints"]
    ok = table[table["status"] != "not recoverable"]
    paths = list(dict.fromkeys(ok["path"]))
    origin = result.details.get("prediction_origin", "")
    if paths:
        fig, axes = plt.subplots(len(paths), 1, figsize=(8, 1.6 + 1.5 * len(paths)), squeeze=False)
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for ax, path in zip(axes[:, 0], paths):
            s = ok[ok["path"] == path]
            fps = [f for f in dict.fromkeys(s["fingerprint"]) if f]
            for i, f in enumerate(fps):
                g = s[s["fingerprint"] == f]
                ax.scatter(g["T"], g["position"], s=12, color=colors[i % len(colors)],
                           label=f"{f}: {str(g['description'].iloc[0])[:60]}")
            bad = s[s["status"] != "recovered"]
            if len(bad):
                ax.scatter(bad["T"], bad["position"], s=14, marker="x", color="k", label="not recovered")
            prev = None
            for t, g in s.groupby("T", sort=True):
                k = g["predicted_kernel"].iloc[0]
                if k and k != prev:
                    ax.axvline(t, color="0.5", lw=0.8, ls=":")
                    ax.text(t, 0.98, f" {k}", rotation=90, va="top", fontsize=6, color="0.3",
                            transform=ax.get_xaxis_transform())
                prev = k
            ax.set_title(f"{path}: {len(fps)} distinct tree(s) over T (dotted: {origin} kernel switch)", fontsize=8)
            ax.set_ylabel("row position", fontsize=8)
            ax.legend(fontsize=6, loc="upper left")
        axes[-1, 0].set_xlabel("T (rows in the block)", fontsize=8)
        fig.suptitle(f"Summation tree per T and row position, K={result.inputs.get('K')}", fontsize=9)
        tight(fig)
        out["fingerprint_vs_t.png"] = fig
    small = {p: v for p, v in result.details.get("small_trees", {}).items() if v.get("tree")}
    if small:
        fig, axes = plt.subplots(len(small), 1, figsize=(8, 1.2 + 1.8 * len(small)), squeeze=False)
        for ax, (path, v) in zip(axes[:, 0], small.items()):
            segs, (tx, ty) = _tree_xy(from_text(v["tree"]))
            for (x0, y0), (x1, y1) in segs:
                ax.plot([x0, x0, x1], [y0, y1, y1], color="C0", lw=0.8)
            ax.set_xticks(range(int(v["K"])))
            ax.tick_params(labelsize=6)
            ax.set_ylabel("height", fontsize=7)
            ax.set_title(f"{path}, K={v['K']}: {v['description'][:90]}", fontsize=8)
        axes[-1, 0].set_xlabel("term index k", fontsize=8)
        tight(fig)
        out["trees_small_k.png"] = fig
    return out


_FP_UNMEASURED = ("not recoverable", "fp16 subnormals flushed on this device")  # fingerprint.FP16_FLUSHED


def _fp_runs(table: pd.DataFrame) -> list[dict[str, Any]]:
    """One row per path and run of consecutive T with the same trees and the same predicted kernel."""
    out: list[dict[str, Any]] = []
    for path, s in table.groupby("path", sort=False):
        if s["status"].isin(_FP_UNMEASURED).all():  # not recoverable, or fp16 subnormals flushed here
            out.append({"path": path, "T": "", "trees": s["status"].iloc[0], "predicted": "",
                        "description": s["description"].iloc[0]})
            continue
        prev = None
        for t, g in s.groupby("T", sort=True):
            fps = [f or "not recovered" for f in dict.fromkeys(g["fingerprint"])]
            pred = g["predicted_kernel"].iloc[0]
            key = (tuple(fps), pred if isinstance(pred, str) else "")  # read back from CSV, "" is NaN
            desc = "; ".join(dict.fromkeys(g["description"]))
            if prev is not None and prev["key"] == key:
                prev["T1"] = int(t)
                continue
            prev = {"path": path, "T0": int(t), "T1": int(t), "key": key, "description": desc}
            out.append(prev)
    rows = []
    for r in out:
        if "key" not in r:
            rows.append(r)
            continue
        fps, pred = r["key"]
        rows.append({"path": r["path"], "T": str(r["T0"]) if r["T0"] == r["T1"] else f"{r['T0']}-{r['T1']}",
                     "trees": ", ".join(fps), "predicted": pred, "description": r["description"]})
    return rows


def fingerprint_summary(result: Result) -> dict[str, Any]:
    table = result.tables["fingerprints"]
    acc = result.tables.get("accumulator")
    paths: dict[str, Any] = {}
    for path, s in table.groupby("path", sort=False):
        ok = s[s["status"] == "recovered"]
        entry: dict[str, Any] = {"status": s["status"].iloc[0] if s["status"].isin(_FP_UNMEASURED).all()
                                 else ("recovered" if len(ok) == len(s) else "partly not recovered"),
                                 "distinct_trees": int(ok["fingerprint"].nunique()),
                                 "not_recovered": int((s["status"] == "not recovered").sum())}
        if len(ok):
            entry["trees_by_T"] = {str(int(t)): sorted(set(g["fingerprint"])) for t, g in ok.groupby("T")}
            entry["ts"] = sorted(int(t) for t in ok["T"].unique())
            entry["description"] = ok["description"].iloc[0]
            entry["probes"] = int(s.drop_duplicates("T")["probes"].sum())
            entry["calls"] = int(s.drop_duplicates("T")["calls"].sum())
            entry["seconds"] = round(float(s.drop_duplicates("T")["seconds"].sum()), 2)
        else:
            entry["reason"] = s["description"].iloc[0]
        if acc is not None and len(acc) and path in set(acc["path"]):
            a = acc[acc["path"] == path].iloc[0]
            entry["accumulator_check"] = {"units": int(a["units"]), "sum": float(a["sum"]), "exact": bool(a["exact"])}
        small = result.details.get("small_trees", {}).get(path)
        if small:
            entry["small_tree"] = small
        paths[path] = entry
    return {"kind": result.kind, "K": result.inputs.get("K"), "N": result.inputs.get("N"), "ts": result.inputs.get("ts"),
            "prediction_origin": result.details.get("prediction_origin", ""), "paths": paths,
            "runs": _fp_runs(table), "figures": dict(result.figures)}


def fingerprint_text(result: Result) -> str:
    s = fingerprint_summary(result)
    lines = [f"== accumulation-order fingerprints: K={s['K']}, N={s['N']} columns per call, T in {s['ts']}",
             f"predicted kernel: {s['prediction_origin'] or 'none'} (dispatch.kernel_for)"]
    runs = pd.DataFrame(s["runs"])
    if len(runs):
        runs = runs.rename(columns={"predicted": "predicted kernel"})
        runs["description"] = runs["description"].str.slice(0, 110)
        lines.append(text_table(runs))
    for path, e in s["paths"].items():
        a = e.get("accumulator_check")
        if a:
            verdict = "exact" if a["exact"] else f"gave {a['sum']:g}: the accumulator is narrower than the output"
            lines.append(f"{path}: {e['distinct_trees']} distinct tree(s); all-unit sum of {a['units']} {verdict}"
                         + (f"; {e['probes']} probes in {e['calls']} calls, {e['seconds']} s" if "probes" in e else ""))
        st = e.get("small_tree")
        if st and st.get("tree") and len(st["tree"]) <= 160:
            lines.append(f"  K={st['K']}: {st['tree']}")
    return "\n".join(lines)
