"""Whose change moved the figures: an mlx pair a machine ran with two mlx-lm releases, split at a bridge (issue 55).

A page of mlx A → B whose machine ran A with mlx-lm X and B with mlx-lm Y (a "starred" cell: "mlx-lm X → Y too")
cannot say by itself whether mlx or mlx-lm moved its figures. The **bridge** is one more release measured on the
same machine: mlx B with mlx-lm X (else mlx A with mlx-lm Y, where X cannot run B). Then the pair is two steps,
each changing one package: A+X → B+X is mlx's change alone, B+X → B+Y mlx-lm's alone (with the other bridge,
A+X → A+Y is mlx-lm's, A+Y → B+Y mlx's). Each step is classed by the changelog's own :func:`gemmdrift.changelog.measured`.

The bridges' results live apart from the history's, in ``<results>/bridges/`` (``python -m gemmdrift.history.releases
--bridges``): beside the history they would name a second mlx-lm for mlx B, and every label of B would change
(``0.29.0`` would become ``0.29.0+lm0.27.1``), with every page name and every command line that names it. Their
status file (``bridges/<machine>.status.json``) says why a bridge was not installable; an mlx-lm that asks for a
newer mlx than the pair's older one is refused by its own requirement (:func:`gemmdrift.matrix.check_pair`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

import pandas as pd

from ..checks import split_release
from ..errors import GemmdriftError
from . import Measured, measured
from .pages import figure, num

BRIDGES = "bridges"  # beside each results directory: the bridges' own asv results and status file
MLX, LM = "mlx", "mlx-lm"


def read_bridges(dirs: Sequence[Path]) -> tuple[pd.DataFrame | None, dict[tuple[str, str, str], dict]]:
    """(the bridges' results, {(machine, mlx, mlx-lm): the status file's record}) of the existing ``dirs``."""
    from ..measure.history import read_results

    have = [Path(d) for d in dirs if Path(d).is_dir()]
    df = None
    if any(p.is_dir() for d in have for p in d.iterdir()):
        df = read_results([str(d) for d in have])
    status: dict[tuple[str, str, str], dict] = {}
    for d in have:
        for f in sorted(d.glob("*.status.json")):
            try:
                doc = json.loads(f.read_text())
                envs = doc["envs"].values()
            except (OSError, UnicodeDecodeError, ValueError, KeyError, AttributeError) as e:
                raise GemmdriftError(f"cannot read the bridges' status {f}: {e.__class__.__name__}: {e}") from None
            for rec in envs:
                status[(str(doc.get("machine", f.name.split(".status")[0])), str(rec.get("mlx")),
                        str(rec.get("mlx_lm")))] = rec
    return df, status


def _rows(df: pd.DataFrame | None, machine: str, backend: str, mlx: str, lm: str) -> pd.DataFrame:
    if df is None:
        return pd.DataFrame()
    return df[(df["machine"] == machine) & (df["backend"] == backend) & (df["mlx"] == mlx) & (df["mlx_lm"] == lm)]


def _refusal(mlx: str, lm: str) -> str:
    """Why mlx-lm ``lm`` cannot run mlx ``mlx`` by its own requirement, else ''."""
    from ..matrix import check_pair

    try:
        check_pair(mlx, lm, flag="mlx-lm")
    except GemmdriftError as e:
        return str(e).split(" (its wheel")[0]
    return ""


def _not_run(status: Mapping, machine: str, mlx: str, lm: str) -> str:
    rec = status.get((machine, mlx, lm))
    if rec and rec.get("state") in ("not installable", "failed"):
        return f"mlx {mlx} with mlx-lm {lm} {rec['state']}: {rec.get('reason', 'no reason recorded')}"
    return ""


def split_entry(df: pd.DataFrame, bridges: pd.DataFrame | None, status: Mapping, m: Measured,
                e: Mapping[str, Any]) -> dict[str, Any] | None:
    """The split of one machine's entry of an mlx pair run with two mlx-lm releases (None for any other entry):
    ``{"bridge": (mlx, mlx-lm), "steps": [(package, Measured entry, from, to)], "whose": ...}``, or ``{"why": ...}``
    where no bridge was measured on that machine."""
    (a, _), (b, _) = split_release(m.old), split_release(m.new)
    x, y = (list(e.get("mlx_lm") or []) + ["", ""])[:2]
    if a == b or not x or not y or x == y:
        return None
    machine, backend = e["machine"], e["backend"]
    why = []
    for mlx, lm in ((b, x), (a, y)):
        for where, rows in ((BRIDGES + "/", bridges), ("the history's results", df)):  # the mlx-lm axis is one
            found = _rows(rows, machine, backend, mlx, lm)
            if not found.empty:
                return {**_split(df, found, m, e, (mlx, lm)), "where": where}
        why.append(_refusal(mlx, lm) or _not_run(status, machine, mlx, lm))
    if all(why):
        return {"why": f"no single mlx-lm installs with both mlx {a} and mlx {b}: {why[0]}; {why[1]}"}
    elsewhere = sorted({k for k in (bridges["machine"] + " (" + bridges["backend"] + ")")
                        [(bridges["mlx"] == b) & (bridges["mlx_lm"] == x)]}) if bridges is not None else []
    return {"why": f"the bridge, mlx {b} with mlx-lm {x}, was not measured on this machine"
                   + (f" (it was on {', '.join(elsewhere)})" if elsewhere else "")}


def _split(df: pd.DataFrame, bridge_rows: pd.DataFrame, m: Measured, e: Mapping[str, Any],
           bridge: tuple[str, str]) -> dict[str, Any]:
    from ..measure.history import label_releases

    machine, backend = e["machine"], e["backend"]
    ends = df[(df["machine"] == machine) & (df["backend"] == backend) & df["release"].isin([m.old, m.new])]
    sub = label_releases(pd.concat([ends, bridge_rows], ignore_index=True).drop(columns="release"))
    (a, _), (b, _) = split_release(m.old), split_release(m.new)
    x, y = e["mlx_lm"][:2]
    path = [(a, x), bridge, (b, y)]
    labels = [sub.loc[(sub["mlx"] == mlx) & (sub["mlx_lm"] == lm), "release"].iloc[0] for mlx, lm in path]
    steps = []
    for (p, q), (lp, lq) in zip(zip(path, path[1:]), zip(labels, labels[1:])):
        (step,) = measured(sub, lp, lq).machines
        package = MLX if p[0] != q[0] else LM
        steps.append((package, step, p, q))
    moved = [pkg for pkg, s, _, _ in steps if s["class"].cls != "BIT-FOR-BIT"]
    whose = ("neither change moved a figure" if not moved else f"{moved[0]}'s change" if len(moved) == 1 else
             "both changes moved figures")
    commits = sorted(set(sub["commit"]))
    return {"bridge": bridge, "steps": steps, "whose": whose, "commits": commits}


def attach(df: pd.DataFrame, bridges: pd.DataFrame | None, status: Mapping, m: Measured) -> None:
    """Each machine entry of ``m`` that ran the mlx pair with two mlx-lm releases gets its ``split``."""
    for e in m.machines:
        s = split_entry(df, bridges, status, m, e)
        if s is not None:
            e["split"] = s


def _step_name(package: str, p: tuple[str, str], q: tuple[str, str]) -> str:
    if package == MLX:
        return f"mlx {p[0]} → {q[0]} with mlx-lm {p[1]}"
    return f"mlx-lm {p[1]} → {q[1]} with mlx {p[0]}"


def _moved(step: Mapping[str, Any], n: int = 6) -> str:
    """The figures a step moved, the first few with before → after ('' when none moved)."""
    figs = [f"{figure(r)} {num(r['old'])} → {num(r['new'])}" for k in ("changed", "probe") for r in step[k]]
    figs += [f"the summation tree of `{t['path']}` ({t['T']})" for t in step["trees"]]
    more = f" and {len(figs) - n} more" if len(figs) > n else ""
    return f"; it moved {', '.join(figs[:n])}{more}" if figs else ""


def cell(e: Mapping[str, Any]) -> str:
    """The index cell of a split entry: its class, whose change it was, and each step's class."""
    s = e["split"]
    each = ", ".join(f"{_step_name(pkg, p, q).split(' with ')[0]} {st['class'].cls}" for pkg, st, p, q in s["steps"])
    return f"{e['class'].cls} ({s['whose']}: {each})"


def short(e: Mapping[str, Any]) -> str:
    """The timeline figure's mark of a split entry: the package(s) whose change moved figures ("" for neither)."""
    moved = [pkg for pkg, st, _, _ in e["split"]["steps"] if st["class"].cls != "BIT-FOR-BIT"]
    return "+".join(moved)


def blocks(m: Measured) -> list[tuple]:
    """The "Whose change moved the figures" section of a page, for the machines that ran its mlx pair with two
    mlx-lm releases (none otherwise)."""
    split = [e for e in m.machines if e.get("split")]
    if not split:
        return []
    out: list[tuple] = [("h", 2, "Whose change moved the figures")]
    for e in split:
        s, who = e["split"], f"{e['machine']} ({e['backend']})"
        x, y = e["mlx_lm"][:2]
        if "why" in s:
            out.append(("p", f"On {who} the pair changes mlx {split_release(m.old)[0]} → {split_release(m.new)[0]} "
                             f"and mlx-lm {x} → {y} at once, and is not split: {s['why']}."))
            continue
        mlx, lm = s["bridge"]
        at = (f", all at gemmdrift {s['commits'][0]}" if len(s["commits"]) == 1 else
              f"; measured at gemmdrift {' and '.join(s['commits'])}: a difference could be gemmdrift's")
        where = f"`{s['where']}`" if s["where"].endswith("/") else s["where"]
        out.append(("p", f"On {who}, measured with one mlx-lm on both mlx releases: the bridge is mlx {mlx} with "
                         f"mlx-lm {lm} ({where}{at}). The pair is two steps, each changing one package:"))
        out.append(("list", [f"{_step_name(pkg, p, q)}: **{st['class'].cls}** ({st['class'].reason}{_moved(st)})"
                             for pkg, st, p, q in s["steps"]]))
        out.append(("p", f"So on {who}: **{s['whose']}** ({e['class'].cls} for the pair)."))
    return out


__all__ = ["BRIDGES", "read_bridges", "attach", "split_entry", "blocks", "cell", "short"]
