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


# ---- fingerprint


def _fp_runs(table: pd.DataFrame) -> list[dict[str, Any]]:
    """One row per path and run of consecutive T with the same trees and the same predicted kernel."""
    out: list[dict[str, Any]] = []
    for path, s in table.groupby("path", sort=False):
        if (s["status"] == "not recoverable").all():
            out.append({"path": path, "T": "", "trees": "not recoverable", "predicted": "",
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
        entry: dict[str, Any] = {"status": "not recoverable" if (s["status"] == "not recoverable").all()
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
    from .report import text_table

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


SUMMARIES["fingerprint"] = fingerprint_summary
TEXTS["fingerprint"] = fingerprint_text
