"""The ends of a bisected range against the shipped release results: the bisection's own known answer.

An end that is a release tag ran a pair of releases the history measured (an mlx-lm tag with the installed mlx;
an mlx tag, built from source, with the ``--mlx-lm`` release): its figures must equal the shipped tier result of
that pair (``benchmarks/reference/reference-linux-cpu-tier``), bit for bit. Where they do not, the answer says so
and names the figures: a from-source build that does not reproduce the release's wheel, or a machine that differs.
An end that is not a tag, or a pair the history never ran, is said to have no shipped result.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..asvfiles import MACHINE
from .search import same


def figure_name(benchmark: str, params: str) -> str:
    """asv's row -> the bisection's figure name: ``TierStateCases.track_non_exact[KVCache/rollback]``."""
    name = benchmark.removeprefix("bench_tier.")
    return f"{name}[{params}]" if params else name


def shipped_figures(mlx: str, mlx_lm: str, root: Path | None = None) -> dict[str, float]:
    """The shipped tier figures of the pair (mlx, mlx-lm), or {} when the history has no such result."""
    from ...matrix import project_root
    from ...measure.history import REFERENCE_RESULTS, read_results

    root = root if root is not None else (project_root() or Path(".")) / REFERENCE_RESULTS
    if not (root / MACHINE).is_dir():
        return {}
    df = read_results(root)
    rows = df[(df.machine == MACHINE) & (df.mlx == mlx) & (df.mlx_lm == mlx_lm)
              & df.benchmark.str.startswith("bench_tier.")]
    return {figure_name(b, p or ""): float(v) for b, p, v in zip(rows.benchmark, rows.params, rows.value)}


def compare(measured: dict[str, float], shipped: dict[str, float]) -> tuple[list[str], list[tuple[str, float, float]]]:
    """(the figures equal bit for bit, [(figure, measured, shipped)] for those that differ); a figure the shipped
    result lacks is in neither."""
    equal, differ = [], []
    for k, v in measured.items():
        if k in shipped:
            (equal.append(k) if same(v, shipped[k]) else differ.append((k, v, shipped[k])))
    return equal, differ


def end_pair(project: str, tag: str, mlx_lm: str | None, installed_mlx: str) -> tuple[str, str]:
    """(mlx, mlx-lm) an end ran: an mlx tag with ``mlx_lm``; an mlx-lm tag with the installed mlx."""
    v = tag.lstrip("v")
    return (v, mlx_lm or "") if project == "mlx" else (installed_mlx, v)


def check_end(project: str, tag: str | None, measured: dict[str, float], mlx_lm: str | None, installed_mlx: str,
              root: Path | None = None) -> dict[str, Any]:
    """One end against its shipped result: ``{"pair", "same", "differ"}``, or ``{"none": why}``."""
    if not tag:
        return {"none": "not a release tag"}
    mlx, lm = end_pair(project, tag, mlx_lm, installed_mlx)
    shipped = shipped_figures(mlx, lm, root)
    if not shipped:
        return {"none": f"the history has no result of mlx {mlx} with mlx-lm {lm}"}
    same, differ = compare(measured, shipped)
    return {"pair": f"mlx{mlx}-lm{lm}", "same": same, "differ": differ}


def describe(end: str, sha: str, got: dict[str, Any]) -> str:
    """One line: the end against its shipped result."""
    if "none" in got:
        return f"{end} {sha[:12]}: no shipped result to check against ({got['none']})"
    n, differ = len(got["same"]) + len(got["differ"]), got["differ"]
    if not differ:
        return f"{end} {sha[:12]}: all {n} figures measured equal the shipped {got['pair']} result, bit for bit"
    shown = "; ".join(f"{k} {a!r} here, {b!r} shipped" for k, a, b in differ[:4])
    more = f" (and {len(differ) - 4} more)" if len(differ) > 4 else ""
    return (f"{end} {sha[:12]}: {len(differ)} of {n} figures differ from the shipped {got['pair']} result: "
            f"{shown}{more}")


def check_ends(b, root: Path | None = None) -> list[tuple[str, str, dict[str, Any]]]:
    """Both ends of a bisection against their shipped results: [(``--good``/``--bad``, sha, :func:`check_end`)],
    over every tier figure of the parts each end measured (not only the bisected ones)."""
    from . import commits, figures, gitrepo

    known = figures.tier_figures()
    out = []
    for end, c in (("--good", b.range[0]), ("--bad", b.range[-1])):
        parts = (b.records.get(c.sha) or {}).get("parts") or {}
        measured = figures.read({k: v for k, v in known.items() if v[0] in parts}, parts)
        lm = b.build.mlx_lm if b.build else None
        out.append((end, c.sha, check_end(b.project, gitrepo.tag_of(b.repo, c.sha), measured, lm,
                                          commits.mlx_version(), root)))
    return out
