"""The numerics changelog of mlx: per release pair, what changed in the bits (issue 30).

Three sections per pair of releases (labels as `gemmdrift history` and `gate` name them: ``0.31.2``,
``0.32.4+lm0.31.3``):

* **Measured here**, from asv's results (:func:`gemmdrift.measure.history.read_results`): every tracked figure of
  a machine and backend both releases ran on that changed (before, after, ratio), computed by the gate's
  own comparison (:func:`gemmdrift.measure.history.gate`, so the count is the gate's: the emulated negative
  controls are not mlx kernels and are left out); the figures that did not change are counted, not
  listed; the summation trees (``track_tree_id_*``) that changed, with their path and T; the op probe
  rows (``bench_kernels``) that changed bits; the golden-logit figures (``bench_golden``) of both.
* **Which op moved**, from the release comparison's ops files (:mod:`gemmdrift.attribution.release_ops`: every op
  recomputed from captured inputs under both releases' interpreters), read by :func:`read_ops`.
* **Predicted per chip**, from the dispatch tables read from the mlx source and the replay
  (:mod:`gemmdrift.changelog.predicted`).

Before them, **which commit changed it**: the bisections of the pair's ranges (:mod:`gemmdrift.changelog.bisected`),
or what is not bisected yet or outside the history we have.

This module gathers the measured part and the pairs; :mod:`gemmdrift.changelog.pages` writes the pages.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import pandas as pd

from ..measure import history
from ..checks import split_release
from ..errors import GemmdriftError

PAGES = Path("docs") / "changelog"  # where the shipped pages live (make changelog)
OPS_DIR = Path("benchmarks") / "release_ops"  # the shipped release comparisons of ops (one JSON per pair)
TREE = "track_tree_id"
PROBE = "bench_kernels."
GOLDEN = "bench_golden."


@dataclass
class Measured:
    """The measured part of one pair: one entry per machine and backend both releases ran on."""

    old: str
    new: str
    machines: list[dict[str, Any]] = field(default_factory=list)  # see measured()
    only: dict[str, list[str]] = field(default_factory=dict)  # release -> its machines, when it has results
    note: str = ""  # why there is nothing measured (a release without results)
    commits: dict[str, list[str]] = field(default_factory=dict)  # release -> the gemmdrift commits it was measured at


def commits_of(df: pd.DataFrame, release: str) -> list[str]:
    """The gemmdrift commits (asv's ``commit_hash``, 8 digits) a release's results were measured at."""
    return sorted(set(df.loc[df["release"] == release, "commit"]))


def page_name(old: str, new: str) -> str:
    """The file stem of a pair's page: ``0.29.4..0.30.6``."""
    return f"{old}..{new}"


def machines_of(df: pd.DataFrame, release: str) -> list[str]:
    """The "machine (backend)" entries a release has tracked figures on."""
    t = df[df["release"] == release]
    return sorted({f"{m} ({b})" for m, b in zip(t["machine"], t["backend"])})


def measured_releases(df: pd.DataFrame | None) -> list[str]:
    """The release labels of the results with tracked figures, oldest first."""
    if df is None:
        return []
    return sorted(set(history.tracked(df)["release"]), key=history.release_key)


def dispatch_releases() -> list[str]:
    """The mlx releases whose dispatch rules were read from the mlx source (the tags, and the mirror's)."""
    from ..dispatch import MIRROR_VERSION, TAGS_READ

    out = [t[1:] for t in TAGS_READ if t.startswith("v")] + [".".join(map(str, MIRROR_VERSION))]
    return sorted(set(out), key=history.version_key)


def known_releases(df: pd.DataFrame | None) -> list[str]:
    """Every release a page can be written for: those with results, and the mlx releases whose dispatch was
    read (a bare mlx version already named by a measured label is not listed twice)."""
    measured = measured_releases(df)
    mlx_measured = {split_release(r)[0] for r in measured}
    return sorted(set(measured) | {r for r in dispatch_releases() if r not in mlx_measured}, key=history.release_key)


def resolve(spec: str, df: pd.DataFrame | None, flag: str) -> str:
    """A release given on the command line: a label of the results, an mlx version (with the newest mlx-lm it
    ran with, as the gate resolves it), or an mlx release whose dispatch was read. Unknown: a one-line error
    listing the known ones."""
    measured = measured_releases(df)
    try:
        return history.resolve_release(spec, measured, flag)
    except GemmdriftError:
        pass
    if spec in dispatch_releases():
        return spec
    raise GemmdriftError(f"{flag}: unknown release {spec}: no results ({history.nearest_text(spec, measured)}) and "
                         f"its dispatch was not read (known: {', '.join(known_releases(df))})")


def main_line(releases: Sequence[str]) -> list[str]:
    """Each mlx once, with the newest mlx-lm it has (as the gate pairs them), oldest first."""
    by_mlx: dict[str, list[str]] = {}
    for r in sorted(releases, key=history.release_key):
        by_mlx.setdefault(split_release(r)[0], []).append(r)
    return [rs[-1] for _, rs in sorted(by_mlx.items(), key=lambda kv: history.version_key(kv[0]))]


def lm_pairs(releases: Sequence[str]) -> list[tuple[str, str]]:
    """The mlx-lm releases measured with one mlx, each with the next."""
    by_mlx: dict[str, list[str]] = {}
    for r in sorted(releases, key=history.release_key):
        by_mlx.setdefault(split_release(r)[0], []).append(r)
    return [p for rs in by_mlx.values() for p in zip(rs, rs[1:])]


def releases_by_machine(df: pd.DataFrame | None) -> dict[str, set[str]]:
    """{"machine (backend)": the release labels it has tracked figures of}."""
    if df is None:
        return {}
    t = history.tracked(df)
    return {f"{m} ({b})": set(g["release"]) for (m, b), g in t.groupby(["machine", "backend"], sort=True)}


def machine_lm_pairs(df: pd.DataFrame | None) -> list[tuple[str, str]]:
    """:func:`lm_pairs` on each machine and backend's own releases (two machines that paired one mlx with
    different mlx-lm releases do not make an mlx-lm pair between them)."""
    if df is None:
        return []
    t = history.tracked(df)
    out: list[tuple[str, str]] = []
    for _, g in t.groupby(["machine", "backend"], sort=True):
        out += lm_pairs(sorted(set(g["release"]), key=history.release_key))
    return list(dict.fromkeys(out))


def default_pairs(df: pd.DataFrame | None) -> list[tuple[str, str]]:
    """Every consecutive pair of the releases present: the measured main line (each mlx with the newest mlx-lm
    it ran with, one mlx after the other, as the gate pairs them), the mlx-lm releases measured with one mlx
    (one after the other), and the main line of every release present, measured or whose dispatch was read
    (so a release known only by its dispatch sits between its neighbours), and each machine's own main line (where
    machines paired one mlx with different mlx-lm releases). Oldest first, by the newer release.
    With every release measured, the three reduce to the consecutive mlx pairs and the mlx-lm pairs."""
    measured = measured_releases(df)
    main = main_line(measured)
    pairs = list(zip(main, main[1:])) + machine_lm_pairs(df)
    for rs in releases_by_machine(df).values():  # each machine's own main line (its own mlx-lm pairings)
        own = main_line(sorted(rs, key=history.release_key))
        pairs += list(zip(own, own[1:]))
    every = main_line(known_releases(df))
    pairs += list(zip(every, every[1:]))
    return sorted(dict.fromkeys(pairs), key=lambda p: (history.release_key(p[1]), history.release_key(p[0])))


def _tree_t(benchmark: str) -> str:
    tail = benchmark.rpartition(TREE)[2].lstrip("_")
    return {"t1": "T=1", "tmax": "the largest T"}.get(tail, tail or "-")


def measured(df: pd.DataFrame | None, old: str, new: str, *, threshold: float = history.GATE_THRESHOLD,
             strict: bool = True) -> Measured:
    """The measured part of the pair (old, new).

    For every machine and backend both releases have tracked figures on: ``compared`` (the gate's count),
    ``identical``, ``changed`` (figures whose value differs: benchmark, params, old, new, ratio, regression),
    ``trees`` (summation trees that changed: path, T, old and new id), ``probe`` (op probe rows that changed),
    ``golden`` (golden-logit figures of both releases, changed or not), ``regressions`` (the gate's count).
    A pair where both releases have results but on no common machine raises, naming each one's machines
    (``strict=False``, for the default pairs: the note says so instead).
    """
    out = Measured(old, new)
    have = set(measured_releases(df))
    missing = [r for r in (old, new) if r not in have]
    for r in (old, new):
        if r in have:
            out.only[r] = machines_of(history.tracked(df), r)
    if missing:
        read = set(dispatch_releases())
        out.note = (f"No results measured here for {' and '.join(missing)}"
                    + (": the dispatch of mlx " + " and ".join(missing) + " was read from the mlx source, so this "
                       "page predicts only" if all(m in read for m in missing) else ""))
        return out
    a, b = set(out.only[old]), set(out.only[new])
    if not a & b:
        why = (f"{old} and {new} have no machine in common ({old}: {', '.join(sorted(a))}; "
               f"{new}: {', '.join(sorted(b))})")
        if strict:
            raise GemmdriftError(why)
        out.note = f"Not measured on one machine: {why}"
        return out
    from .classify import classify, figures_of, pair_ladder

    g = history.gate(df, candidate=new, baseline=old, threshold=threshold)
    out.commits = {r: commits_of(df, r) for r in (old, new)}
    for (machine, backend), rows in g.groupby(["machine", "backend"], sort=True):
        ident = rows["benchmark"].str.contains(TREE, regex=False)
        differ = rows["old"] != rows["new"]
        changed = rows[differ & ~ident]
        trees = rows[differ & ident]
        entry = {
            "machine": machine, "backend": backend, "compared": int(len(rows)), "identical": int((~differ).sum()),
            "changed": [_figure(r) for _, r in changed[~changed["benchmark"].str.startswith((PROBE, GOLDEN))]
                        .iterrows()],
            "probe": [_figure(r) for _, r in changed[changed["benchmark"].str.startswith(PROBE)].iterrows()],
            "trees": [{"path": r["params"], "T": _tree_t(r["benchmark"]), "old": _tree_id(r["old"]),
                       "new": _tree_id(r["new"])} for _, r in trees.iterrows()],
            "golden": [_figure(r) for _, r in rows[rows["benchmark"].str.startswith(GOLDEN)].iterrows()],
        }
        # The count the page prints is of the rows it marks (pages.past_gate): one flag, counted over the same rows.
        entry["regressions"] = sum(r["regression"] for k in ("changed", "probe", "golden") for r in entry[k])
        entry["mlx_lm"] = [_lm_of(df, r, machine, backend) for r in (old, new)]
        a_figs, b_figs = (figures_of(df, r, machine, backend) for r in (old, new))
        entry["class"] = classify(a_figs, b_figs, ladder=pair_ladder(a_figs, b_figs))
        out.machines.append(entry)
    return out


def _lm_of(df: pd.DataFrame, release: str, machine: str, backend: str) -> str:
    """The mlx-lm version(s) a release ran with on one machine and backend ("" when the results do not say): a bare
    label hides it (``0.31.2`` is mlx 0.31.2 with whichever mlx-lm that machine paired it with)."""
    t = df[(df["release"] == release) & (df["machine"] == machine) & (df["backend"] == backend)]
    lms = sorted({str(v) for v in t.get("mlx_lm", pd.Series(dtype=object)).dropna()}, key=history.version_key)
    return ", ".join(lms)


def _tree_id(v: float) -> str:
    return f"{int(v):x}" if math.isfinite(v) and float(v).is_integer() else f"{v:g}"


def _figure(r) -> dict[str, Any]:
    return {"benchmark": r["benchmark"], "params": r["params"], "old": float(r["old"]), "new": float(r["new"]),
            "ratio": float(r["ratio"]), "regression": bool(r["regression"]), "direction": r["direction"]}


# ------------------------------------------------------------------ which op moved (release comparisons)


def read_ops(ops_dirs: Sequence[str | Path], old: str, new: str) -> list[dict[str, Any]]:
    """The release comparisons of ops (written by ``gemmdrift.attribution.release_ops``) that compare the pair's mlx
    releases, in either direction: each a dict with ``from``/``to`` ({mlx, mlx_lm}), ``changed`` (ops whose
    output bits differ, forward order), ``compared`` and optionally ``counterfactual``. A corrupt file raises,
    naming it."""
    want = {split_release(old)[0], split_release(new)[0]}
    found = []
    for d in ops_dirs:
        for path in sorted(Path(d).glob("*.json")):
            try:
                doc = json.loads(path.read_text())
                pair = {str(doc["from"]["mlx"]), str(doc["to"]["mlx"])}
                doc["changed"], doc["compared"]
            except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
                raise GemmdriftError(f"cannot read the release comparison {path}: {e.__class__.__name__}: {e}") \
                    from None
            if pair == want:
                found.append({**doc, "file": path.name})
    return found


__all__ = ["Measured", "measured", "default_pairs", "main_line", "lm_pairs", "machine_lm_pairs", "releases_by_machine", "commits_of", "known_releases", "resolve", "page_name", "read_ops",
           "dispatch_releases", "measured_releases", "PAGES", "OPS_DIR"]
