"""The changelog's index as a timeline: one row per release (per pair where a release has two predecessors: the
mlx before it and the mlx-lm before it), a column per measured machine and backend and per predicted chip, each
cell the class of the pair (:mod:`gemmdrift.changelog.classify`).

Measured cells come from each pair's :class:`gemmdrift.changelog.Measured` (its machines' ``class``); a machine
that lacks either release says "not measured". Predicted cells come from
:func:`gemmdrift.changelog.predicted.chip_class` (``{"cls", "cell", "reason"}``). The figure is drawn by
:mod:`gemmdrift.view.timeline`.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ..checks import split_release
from . import Measured, bridged, page_name
from .bisected import PageBisections
from .classify import CLASSES
from .pages import disagree, lm_also

FIRST = "first"  # the oldest release: no pair ends at it
NOT_MEASURED = "not measured"
BISECTED = "†"  # the figure's mark of a measured cell whose pair was bisected to a commit


def measured_columns(pages: Sequence[tuple[Measured, Mapping[str, Any]]]) -> list[str]:
    """Every "machine (backend)" any release of the pages has results on, sorted."""
    cols = set()
    for m, _ in pages:
        for ms in m.only.values():
            cols |= set(ms)
    return sorted(cols)


def bisected_to(b: PageBisections | None) -> list[str]:
    """The first commits a pair's bisections found, as the index's "from" cell names them: the project and the pull
    request's number linked, else the commit's first 12 digits linked (each once)."""
    out = []
    for a in (b.changed() if b is not None else []):
        pr, sha = a.first.get("pr"), str(a.first.get("commit", ""))
        out.append(f"[{a.project} #{pr}]({a.pr_link(pr)})" if pr else f"[{a.project} {sha[:12]}]({a.commit_link(sha)})")
    return list(dict.fromkeys(out))


def rows(releases: Sequence[str], pages: Sequence[tuple[Measured, Mapping[str, Any]]],
         chips: Sequence[str], have: Mapping[str, set[str]] | None = None,
         bisected: Mapping[tuple[str, str], PageBisections] | None = None) -> tuple[list[str], list[dict[str, Any]]]:
    """(columns, rows): a row per pair ending at a release (oldest first), and one for a release no pair ends at;
    each row ``{"release", "from", "page", "cells": {column: {"cls", "cell", "reason"}}, "bisected"}``. ``pages``
    holds each pair's Measured and its predicted classes by chip; ``have`` each "machine (backend)"'s releases
    (:func:`gemmdrift.changelog.releases_by_machine`; default: read from the pages); ``bisected`` each pair's
    bisections (:func:`gemmdrift.changelog.bisected.for_pair`): a pair bisected to a commit lists the commits in
    ``bisected``, and its measured cells with a class other than BIT-FOR-BIT are marked (``"bisected": True``)."""
    if have is None:
        have = {}
        for m, _ in pages:
            for r, ms in m.only.items():
                for c in ms:
                    have.setdefault(c, set()).add(r)
    measured_cols = sorted(set(measured_columns(pages)) | set(have))
    columns = measured_cols + [f"{c} (predicted)" for c in chips]
    by_new: dict[str, list[tuple[Measured, Mapping[str, Any]]]] = {}
    for m, pred in pages:
        by_new.setdefault(m.new, []).append((m, pred))
    out = []
    for r in releases:
        ending = by_new.get(r, [])
        if not ending:
            out.append({"release": r, "from": None, "page": None,
                        "cells": {c: {"cls": None, "cell": FIRST if r in have.get(c, ()) else NOT_MEASURED,
                                      "reason": ""} for c in measured_cols}
                        | {f"{c} (predicted)": {"cls": None, "cell": "-", "reason": ""} for c in chips}})
            continue
        for m, pred in ending:
            cells: dict[str, dict[str, Any]] = {}
            entries = {f"{e['machine']} ({e['backend']})": e for e in m.machines}
            for c in measured_cols:
                e = entries.get(c)
                if e is None or "class" not in e:
                    cells[c] = {"cls": None, "cell": NOT_MEASURED, "reason": ""}
                else:
                    cells[c] = {"cls": e["class"].cls, "cell": e["class"].cls, "reason": e["class"].reason}
                    lm = lm_also(e)
                    if e.get("split", {}).get("steps"):  # split at a bridge: whose change it was
                        cells[c].update(cell=bridged.cell(e), whose=bridged.short(e))
                    elif lm and split_release(m.old)[0] != split_release(m.new)[0]:
                        # an mlx pair this machine ran with two mlx-lm releases: the class may be mlx-lm's
                        cells[c].update(cell=f"{e['class'].cls} ({lm} too)", lm=lm)
            found = bisected_to((bisected or {}).get((m.old, m.new)))
            for c in measured_cols:
                if found and cells[c]["cls"] not in (None, "BIT-FOR-BIT"):
                    cells[c]["bisected"] = True
            for c in chips:
                cells[f"{c} (predicted)"] = dict(pred.get(c) or {"cls": None, "cell": "-", "reason": ""})
            out.append({"release": r, "from": m.old, "page": page_name(m.old, m.new), "cells": cells,
                        "disagree": disagree(m), "bisected": found})
    return columns, out


def worst(classes: Sequence[str | None]) -> str | None:
    """The most severe class among those given (None when there is none)."""
    known = [c for c in classes if c in CLASSES]
    return max(known, key=CLASSES.index) if known else None


def index_blocks(columns: Sequence[str], table: Sequence[dict[str, Any]], inputs: str,
                 figure: str | None = None) -> list[tuple]:
    """The index: the timeline as a table (newest first), the figure, and the classes' meaning."""
    head = ["release", "from"] + list(columns)
    body = []
    for row in reversed(table):
        link = f"[{row['from']}]({row['page']}.md)" if row["page"] else "-"
        if row.get("disagree"):  # no one class for the pair: each machine's cell is its own
            link += " (machines disagree)"
        if row.get("bisected"):
            link += f" ({BISECTED} bisected: {', '.join(row['bisected'])})"
        body.append([row["release"], link] + [row["cells"][c]["cell"] for c in columns])
    out: list[tuple] = [
        ("h", 1, "The numerics changelog of mlx"),
        ("p", "Per pair of releases: its class, what changed in the bits on the machines measured here, which op "
              "moved, and what each chip's dispatch predicts (predictions, never measurements). Written by "
              f"`gemmdrift changelog` from {inputs}; `make changelog` writes these pages again."),
        ("p", "**Classes** (one function, `gemmdrift.changelog.classify`): **BIT-FOR-BIT**, every figure measured "
              "on both sides identical; **ROUNDOFF**, figures moved, the precision ladder says rounding (predicted: "
              "the replay reorders the same adds) and no answer figure changed; **ANSWER-CHANGING**, argmax flips, "
              "the divergence point or a state verdict changed, or the ladder says semantics (or no ladder verdict "
              "shows the move is rounding). A cell per measured machine and backend, and per predicted chip; "
              "\"not measured\", \"not read\" (a release's dispatch source not read), \"not knowable\" (an order "
              "chosen at run time, cuBLASLt, or hidden in hardware, NAX) and \"not replayed\" are not classes; a "
              "predicted class other than BIT-FOR-BIT names the mlx commits on its page. A measured cell that "
              "names an mlx-lm change (\"mlx-lm 0.27.1 → 0.28.0 too\"; `*` in the figure) is an mlx pair that "
              "machine ran with two mlx-lm releases: the class may be mlx-lm's (its page says which figure decided "
              "it). A class is a machine's: where the machines that measured a pair give it different classes, its "
              "\"from\" cell says \"machines disagree\" and its page gives a class per machine. Newest first."),
    ]
    if figure:
        out.append(("img", "the timeline of classes", figure))
    out.append(("table", head, body))
    if any(row.get("bisected") for row in table):
        out.append(("p", f"{BISECTED} **Bisected to a commit**: see the page. A \"from\" cell that says \"{BISECTED} "
                         "bisected\" is a pair with a range bisected to the first commit that changed its figures "
                         "(`gemmdrift bisect`), named by its project and pull request (else its hash); the figure "
                         f"marks that row's measured cells other than BIT-FOR-BIT with {BISECTED}. The page's section "
                         "\"Which commit "
                         "changed it\" gives each commit's hash, subject and pull request, and the figures before and "
                         "after."))
    return out


__all__ = ["rows", "index_blocks", "measured_columns", "worst", "bisected_to", "FIRST", "NOT_MEASURED", "BISECTED"]
