"""Tracked figures across mlx versions, from asv's results directory; regression gating.

asv plots a benchmark against the project's commits and draws each matrix
entry (here: each mlx version) as a separate line. The question an MLX
maintainer asks is different: *did this release change the envelope?* So this
module reads asv's results JSON itself and puts the mlx version on the x-axis,
one line per machine and backend.

Layout read (asv 0.6): ``<results>/<machine>/machine.json``,
``<results>/<machine>/<commit>-<env>.json`` with ``result_columns`` naming
the fields of each entry of ``results``; parameterized benchmarks carry the
parameter value lists (as repr strings) and a flat value list in
``itertools.product`` order. ``<results>/benchmarks.json`` holds units.
The mlx version comes from the ``track_mlx_version`` benchmark, which reports
what was really imported (the env's pins are only what was asked for); the
mlx-lm version likewise from ``track_mlx_lm_version`` (older results: the pin).

A *release* is the pair (mlx, mlx-lm): the matrix can pair one mlx release with
several mlx-lm releases, so that an mlx-lm change shows on its own. Its label
(the ``release`` column, the history's columns, the gate's ``--candidate`` and
``--baseline``) is the mlx version alone where the results hold one mlx-lm for
that mlx, else ``MLX+lmMLXLM`` (``0.32.4+lm0.31.3``). On the command line a bare
mlx version names that mlx with the newest mlx-lm it ran with.
"""

from __future__ import annotations

import ast
import itertools
import json
import math
import re
from pathlib import Path
from typing import Any, Sequence

import pandas as pd

from .. import defaults, directions
from ..checks import LM_TAG, check_gate_versions, release_order_key, split_release
from ..errors import GemmdriftError
from ..matrix import project_root  # noqa: F401  (the checkout: gemmdrift.matrix, beside the pairing it reads)

VERSION_BENCH = "bench_env.track_mlx_version"
LM_VERSION_BENCH = "bench_env.track_mlx_lm_version"
BACKEND_BENCH = "bench_env.track_backend"
SIZES_BENCH = "bench_env.track_sizes"  # which size set ran (follows the backend): a label, not a figure
BACKEND_CODES = {0: "cpu", 1: "metal", 2: "cuda"}  # track_backend's numbering
GATE_THRESHOLD = defaults.GATE_THRESHOLD  # relative growth of a drift figure that fails the gate
GATE_ABS_TOL = directions.ABS_TOL  # growth from exactly zero by less than this is not a regression
MANIFEST = Path("benchmarks") / "manifest.json"  # every benchmark's unit, version and direction (the gate reads it)


def encode_version(version: str) -> float:
    """'0.32.4' -> 3204.0, the number track_mlx_version returns (asv tracks numbers only)."""
    parts = [int("".join(c for c in p if c.isdigit()) or 0) for p in version.split(".")[:3]]
    parts += [0] * (3 - len(parts))
    return float(parts[0] * 10000 + parts[1] * 100 + parts[2])


def decode_version(code: float) -> str:
    c = int(round(code))
    return f"{c // 10000}.{(c // 100) % 100}.{c % 100}"


def version_key(version: str) -> tuple:
    return tuple(int(p) if p.isdigit() else 0 for p in str(version).split("."))


def release_label(mlx: str, mlx_lm: str | None, several: bool) -> str:
    """The label of the release (mlx, mlx-lm): the mlx version, plus the mlx-lm one when ``several`` mlx-lm
    releases ran with this mlx."""
    return f"{mlx}{LM_TAG}{mlx_lm}" if (several and mlx_lm) else str(mlx)


def release_key(label: str) -> tuple:
    """Sort key of a release label: by mlx, then by mlx-lm (:func:`gemmdrift.checks.release_order_key`)."""
    return release_order_key(label)


def label_releases(df: pd.DataFrame) -> pd.DataFrame:
    """Add the ``release`` column (see the module's docstring) to rows with ``mlx`` and ``mlx_lm``."""
    df = df.copy()
    several = df.groupby("mlx", dropna=True)["mlx_lm"].nunique(dropna=True)
    df["release"] = [None if pd.isna(m) else release_label(m, None if pd.isna(lm) else lm, several.get(m, 0) > 1)
                     for m, lm in zip(df["mlx"], df["mlx_lm"])]
    return df


def resolve_release(spec: str, releases: Sequence[str], flag: str) -> str:
    """A release given on the command line: a label of the results, or an mlx version, which names that mlx
    with the newest mlx-lm it ran with (the matrix's main line pairs each mlx with its own newest mlx-lm)."""
    if spec in releases:
        return spec
    matching = sorted((r for r in releases if split_release(r)[0] == spec), key=release_key)
    if matching:
        return matching[-1]
    raise GemmdriftError(f"{flag}: no results for {spec} ({nearest_text(spec, releases)}; have "
                         f"{', '.join(sorted(releases, key=release_key))})")


def nearest(spec: str, releases: Sequence[str]) -> tuple[str | None, str | None]:
    """The releases with results just before and just after ``spec`` (a release label or an mlx version), by mlx
    version then mlx-lm version; None where there is none on that side."""
    try:
        key = release_key(spec)
    except (TypeError, ValueError):
        return None, None
    ordered = sorted(set(releases), key=release_key)
    before = [r for r in ordered if release_key(r) < key]
    after = [r for r in ordered if release_key(r) > key]
    return (before[-1] if before else None), (after[0] if after else None)


def nearest_text(spec: str, releases: Sequence[str]) -> str:
    """'the nearest releases with results: 0.29.4 (before) and 0.30.6 (after)', for a one-line refusal."""
    before, after = nearest(spec, releases)
    named = [f"{r} ({side})" for r, side in ((before, "before"), (after, "after")) if r]
    return "the nearest releases with results: " + " and ".join(named) if named else "no release has results"


def _param_value(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


REFERENCE_RESULTS = Path("benchmarks") / "reference"  # committed asv results (see its README.md)
LOCAL_RESULTS = Path(".asv") / "results"  # asv.conf.json's results_dir


def directions_of(root: Path | None = None) -> dict[str, str]:
    """``{asv benchmark name: direction}``: what each track_ benchmark declares beside its unit and version
    (:mod:`gemmdrift.directions`), as benchmarks/manifest.json of this checkout records it."""
    root = project_root() if root is None else root
    return directions.read_manifest(root / MANIFEST) if root is not None else {}


def default_results() -> tuple[Path, str]:
    """(results directory, why): this checkout's .asv/results when it holds results, else the
    committed reference results (four mlx releases on a Linux CPU, so a fresh clone has real data)."""
    root = project_root()
    if root is None:
        raise GemmdriftError("no asv.conf.json here or above: give --results DIR (asv's results directory)")
    local = root / LOCAL_RESULTS
    if any(p.name != "machine.json" for p in local.glob("*/*.json")):
        return local, f"asv results of this checkout ({local})"
    ref = root / REFERENCE_RESULTS
    if ref.is_dir():
        return ref, (f"no asv results in {local}: the committed reference results ({ref}); "
                     "run `asv run` for your own, or pass both with --results")
    raise GemmdriftError(f"no asv results in {local} and no reference results in {ref} (run `asv run` first)")


def read_results(results_dir: str | Path | Sequence[str | Path]) -> pd.DataFrame:
    """One row per (result file, benchmark, parameter combination) with its value.

    Args:
        results_dir: asv's results directory, or several (e.g. your own beside
            the committed reference results). A machine is a subdirectory; the
            same machine name in two directories is refused, since its results
            would be drawn as one machine.

    Columns: machine, env, commit, date, mlx, mlx_pinned, mlx_lm, backend,
    benchmark, params, value, unit, release.
    """
    if not isinstance(results_dir, (str, Path)):
        dirs = [Path(d).expanduser() for d in results_dir]
        if not dirs:
            raise GemmdriftError("no asv results directory given")
        seen: dict[str, Path] = {}
        for d in dirs:
            for m in (x for x in d.glob("*") if x.is_dir()):
                if m.name in seen and seen[m.name].resolve() != d.resolve():
                    raise GemmdriftError(f"machine {m.name!r} is in both {seen[m.name]} and {d}: results of two "
                                         "machines would be drawn as one; rename one (asv machine --machine NAME)")
                seen[m.name] = d
        frames = [read_results(d) for d in dict.fromkeys(d.resolve() for d in dirs)]
        return label_releases(pd.concat(frames, ignore_index=True))
    root = Path(results_dir).expanduser()
    if not root.is_dir():
        raise GemmdriftError(f"no asv results directory at {root} (run `asv run` first)")
    units = {}
    bj = root / "benchmarks.json"
    if bj.exists():
        try:
            units = {k: v.get("unit") for k, v in json.loads(bj.read_text()).items() if isinstance(v, dict)}
        except (OSError, UnicodeDecodeError, ValueError, AttributeError):
            units = {}  # units only label the axes
    rows = []
    for path in sorted(root.glob("*/*.json")):
        if path.name == "machine.json":
            continue
        try:
            # asv writes bare NaN/Infinity; Python's json reads them.
            d = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise GemmdriftError(f"cannot read asv result {path}: {e}") from None
        if not isinstance(d, dict) or "result_columns" not in d or "results" not in d:
            continue
        try:
            rows += _file_rows(path, d, units)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            raise GemmdriftError(f"asv result {path} does not have asv 0.6's layout "
                                 f"({e.__class__.__name__}: {e})") from None
    cols = ["machine", "backend", "env", "commit", "date", "mlx", "mlx_pinned", "mlx_lm", "benchmark", "params",
            "value", "unit"]
    df = pd.DataFrame(rows, columns=cols)
    if df.empty:
        raise GemmdriftError(f"no asv results under {root}")
    return label_releases(df)


def _file_rows(path: Path, d: dict[str, Any], units: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of one asv result file (see :func:`read_results`); layout errors raise."""
    cols = d["result_columns"]
    i_res, i_par = cols.index("result"), cols.index("params")
    req = d.get("requirements") or {}
    file_rows = []
    for bench, entry in d["results"].items():
        values = entry[i_res]
        params = entry[i_par] if len(entry) > i_par else []
        combos = list(itertools.product(*params)) if params else [()]
        if values is None:  # the benchmark failed
            values = [None] * len(combos)
        elif not isinstance(values, list):
            values = [values]
        for combo, v in zip(combos, values):
            file_rows.append({
                "machine": d.get("params", {}).get("machine", path.parent.name),
                "env": d.get("env_name", ""),
                "commit": str(d.get("commit_hash", ""))[:8],
                "date": d.get("date"),
                "mlx_pinned": req.get("mlx") or None,
                "mlx_lm": req.get("mlx-lm") or None,
                "benchmark": bench,
                "params": ", ".join(str(_param_value(p)) for p in combo),
                "value": None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v),
                "unit": units.get(bench),
            })
    tracked = {r["benchmark"]: r["value"] for r in file_rows if not r["params"]}
    mlx = decode_version(tracked[VERSION_BENCH]) if tracked.get(VERSION_BENCH) is not None else None
    lm = decode_version(tracked[LM_VERSION_BENCH]) if tracked.get(LM_VERSION_BENCH) is not None else None
    backend = BACKEND_CODES.get(int(tracked[BACKEND_BENCH])) if tracked.get(BACKEND_BENCH) is not None else None
    for r in file_rows:
        r["mlx"] = mlx or r["mlx_pinned"]
        r["mlx_lm"] = lm or r["mlx_lm"]
        r["backend"] = backend or "unknown"
    return file_rows


def mixed_commits(df: pd.DataFrame) -> list[tuple[str, str, list[str]]]:
    """(machine, release, commits) for every release one machine holds results of at two or more gemmdrift
    commits. Different releases measured at different commits are not listed (the shipped reference results
    hold three commits, one per release measured): a pair of them is compared with a note on its page."""
    t = df[df["release"].notna()]
    out = []
    for (machine, release), g in t.groupby(["machine", "release"], sort=True):
        commits = sorted(set(g["commit"]))
        if len(commits) > 1:
            out.append((str(machine), str(release), commits))
    return out


def check_one_commit(df: pd.DataFrame) -> None:
    """Refuse results where one machine holds one release at two gemmdrift commits (a difference between
    releases could then be gemmdrift's, and which one a figure came from is a guess)."""
    mixed = mixed_commits(df)
    if mixed:
        machine, release, commits = mixed[0]
        more = f" ({len(mixed) - 1} more release(s) alike)" if len(mixed) > 1 else ""
        raise GemmdriftError(f"the results of machine {machine} mix gemmdrift commits {' and '.join(commits)} for "
                             f"release {release}{more}: keep one commit's files ({machine}/<commit>-<env>.json) or "
                             "give the other commit's results another machine name")


def tracked(df: pd.DataFrame) -> pd.DataFrame:
    """Only the drift figures (track_*), without the environment bookkeeping ones."""
    t = df[df["benchmark"].str.contains(r"\.track_")
           & ~df["benchmark"].isin([VERSION_BENCH, LM_VERSION_BENCH, BACKEND_BENCH, SIZES_BENCH])]
    return t[t["value"].notna() & t["mlx"].notna()]


def latest_per_version(df: pd.DataFrame) -> pd.DataFrame:
    """For each machine/backend/benchmark/params/release (mlx, mlx-lm), the most recent measurement."""
    if "release" not in df.columns:
        df = label_releases(df)
    df = df.sort_values("date")
    return df.groupby(["machine", "backend", "benchmark", "params", "release"], as_index=False, dropna=False).last()


def series_name(benchmark: str, params: str) -> str:
    return benchmark + (f"[{params}]" if params else "")


def history_table(df: pd.DataFrame) -> pd.DataFrame:
    """Wide view: one row per tracked series and machine, one column per release (mlx, or mlx+lm)."""
    t = latest_per_version(tracked(df))
    if t.empty:
        return t
    t = t.assign(series=[series_name(b, p) for b, p in zip(t["benchmark"], t["params"])])
    wide = t.pivot_table(index=["machine", "backend", "series"], columns="release", values="value", aggfunc="first")
    wide = wide[sorted(wide.columns, key=release_key)].reset_index()
    wide.columns.name = None
    # Natural order: [model, 2] before [model, 16].
    natural = [tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", str(x))) for x in wide["series"]]
    order = sorted(range(len(wide)), key=lambda i: (wide["machine"].iloc[i], wide["backend"].iloc[i], natural[i]))
    return wide.iloc[order].reset_index(drop=True)


def gate(df: pd.DataFrame, candidate: str | None = None, baseline: str | None = None,
         threshold: float = GATE_THRESHOLD, include: str = "",
         declared: dict[str, str] | None = None) -> pd.DataFrame:
    """Every tracked figure of ``candidate`` against ``baseline``'s, judged by its direction.

    Args:
        candidate: release to judge: a release label, or an mlx version that names one (default: the
            newest with results).
        baseline: release to compare with (default: the newest release of the mlx before the
            candidate's). To see an mlx-lm change alone, give two labels of one mlx
            (``--candidate 0.32.4+lm0.32.2 --baseline 0.32.4+lm0.31.3``).
        threshold: allowed relative move the wrong way (0.10 = 10%): a lower-is-better figure that grows,
            a higher-is-better one that falls, by more fails; growth from exactly 0 fails as soon as it
            exceeds GATE_ABS_TOL.
        include: only series whose benchmark name contains this text.
        declared: ``{benchmark: direction}`` (default: :func:`directions_of`, what each benchmark declares).
    Series of the emulated negative control (params with ``emulated:``) are not gated.

    Returns:
        One row per compared series with ``old``, ``new``, ``ratio``, ``direction`` (higher, lower, either, or
        undeclared), ``verdict`` (:func:`gemmdrift.directions.judge`: worse, better, within, news, same),
        ``regression`` (verdict worse: the gate fails) and ``changed`` (the value differs).
    """
    check_gate_versions(candidate, baseline)
    t = latest_per_version(tracked(df))
    t = t[~t["params"].str.contains("emulated:", regex=False)]  # negative controls, not mlx kernels
    if include:
        if t.empty:
            raise GemmdriftError("no tracked drift figures in the asv results")
        t = t[t["benchmark"].str.contains(include, regex=False)]
        if t.empty:
            raise GemmdriftError(f"--include {include}: no tracked figure's benchmark name contains it")
    if t.empty:
        raise GemmdriftError("no tracked drift figures in the asv results")
    releases = sorted(set(t["release"]), key=release_key)
    given = (candidate, baseline)
    candidate = resolve_release(candidate, releases, "--candidate") if candidate else releases[-1]
    if baseline is None:
        # The newest release of the mlx before the candidate's; with one mlx only, the release before.
        older = [r for r in releases if release_key(r)[0] < release_key(candidate)[0]]
        older = older or [r for r in releases if release_key(r) < release_key(candidate)]
        if not older:
            raise GemmdriftError(f"no release before {candidate} to compare with")
        baseline = older[-1]
    else:
        baseline = resolve_release(baseline, releases, "--baseline")
    try:
        check_gate_versions(candidate, baseline)
    except GemmdriftError as e:  # say what a bare mlx version named, so the suggested order is the one to type
        named = [f"{spec} is {label}" for spec, label in zip(given, (candidate, baseline)) if spec and spec != label]
        raise GemmdriftError(str(e) + (f"; {' and '.join(named)}, the newest mlx-lm it ran with" if named else "")) \
            from None
    keys = ["machine", "backend", "benchmark", "params"]
    old = t[t["release"] == baseline].set_index(keys)["value"]
    new = t[t["release"] == candidate].set_index(keys)["value"]
    both = pd.concat({"old": old, "new": new}, axis=1).dropna().reset_index()
    declared = directions_of() if declared is None else declared
    both["direction"] = [declared.get(b, directions.UNDECLARED) for b in both["benchmark"]]
    both["ratio"] = [n / o if o else (math.inf if n > 0 else 1.0) for o, n in zip(both["old"], both["new"])]
    both["verdict"] = [directions.judge(d, o, n, threshold)
                       for d, o, n in zip(both["direction"], both["old"], both["new"])]
    both["regression"] = both["verdict"] == directions.WORSE
    both["changed"] = both["old"] != both["new"]
    both.insert(0, "candidate", candidate)
    both.insert(1, "baseline", baseline)
    return both


_TAP = re.compile(r"^(layer (\d+)|norm|logits)$")


def layer_profiles(df: pd.DataFrame) -> dict[tuple[str, str, str, str], pd.DataFrame]:
    """Per-layer series regrouped: {(machine, backend, benchmark, other params): rows with a `tap_index`}.

    A series is per-layer when one of its parameters is a tap ('layer 3',
    'norm', 'logits'); its other parameters name the profile.
    """
    t = latest_per_version(tracked(df))
    out: dict[tuple[str, str, str, str], list[dict]] = {}
    for row in t.itertuples(index=False):
        parts = [p.strip() for p in str(row.params).split(",")] if row.params else []
        taps = [p for p in parts if _TAP.match(p)]
        if len(taps) != 1:
            continue
        tap = taps[0]
        m = _TAP.match(tap)
        index = int(m.group(2)) if m.group(2) is not None else (10_000 if tap == "norm" else 10_001)
        key = (row.machine, row.backend, row.benchmark, ", ".join(p for p in parts if p != tap))
        out.setdefault(key, []).append({"tap": tap, "tap_index": index, "release": row.release, "value": row.value,
                                        "unit": row.unit})
    return {k: pd.DataFrame(v) for k, v in out.items()}


def figure_names(t: pd.DataFrame) -> dict[str, tuple]:
    """The figures of a history table, by file name under ``figures/``: ``(benchmark, params)`` for one
    series against the mlx version, ``(machine, backend, benchmark, rest)`` for a per-layer profile."""
    out: dict[str, tuple] = {}
    for (bench, params), _ in t.groupby(["benchmark", "params"], sort=True):
        name = (bench + ("_" + params if params else "")).replace("/", "_").replace(" ", "").replace(",", "_")
        out[f"figures/{name[:150]}.png"] = (bench, params)
    for key in layer_profiles(t):
        machine, backend, bench, rest = key
        name = f"layers_{bench}_{rest}_{machine}_{backend}".replace(" ", "").replace(",", "_").replace("/", "_")
        out[f"figures/{name[:150]}.png"] = key
    return out


def history_result(df: pd.DataFrame, include: str = "", results: Sequence[str] = ()):
    """The ``history`` Result of asv's results (:func:`read_results`): the latest figure per machine, backend,
    series and mlx version (table ``history``) and its wide view (``history_wide``)."""
    from ..result import Result, tidy

    t = latest_per_version(tracked(df))
    if include:
        t = t[t["benchmark"].str.contains(include, regex=False)]
    if t.empty:
        raise GemmdriftError("no tracked figures match")
    frame = tidy(t.drop(columns=["mlx"]).rename(columns={"benchmark": "metric", "release": "mlx"})
                 .assign(pair=t["params"], model="embedded")[["backend", "mlx", "model", "pair", "metric", "value",
                                                              "machine"]])
    releases = coverage(df)
    return Result(kind="history", inputs={"results": [str(r) for r in results], "include": include}, env={},
                  frame=frame, tables={"history": t, "history_wide": history_table(t), "releases": releases,
                                       "skipped": skipped_table(df, t, releases)})


SKIPPED = "skipped"  # asv recorded no value (NaN: the benchmark skipped or failed; never 0)
NOT_RUN = "not run"  # the results of that release do not have the benchmark at all


def coverage(df: pd.DataFrame) -> pd.DataFrame:
    """Every (machine, backend, release) with a result file, in release order: the history's x axis."""
    t = df[df["release"].notna()][["machine", "backend", "release"]].drop_duplicates()
    t = t.assign(_k=t["release"].map(release_key)).sort_values(["machine", "backend", "_k"])
    return t.drop(columns="_k").reset_index(drop=True)


def skipped_table(df: pd.DataFrame, t: pd.DataFrame, releases: pd.DataFrame | None = None) -> pd.DataFrame:
    """Every (machine, backend, series, release) the history has no value for although that machine has results
    of that release: ``why`` is :data:`SKIPPED` (asv recorded NaN) or :data:`NOT_RUN` (no such benchmark in its
    results). A figure draws these as skipped, never as a value of 0 or a silent gap."""
    releases = coverage(df) if releases is None else releases
    have = {k: set(g["release"]) for k, g in releases.groupby(["machine", "backend"])}
    nan = df[df["value"].isna()]
    nan_keys = set(zip(nan["machine"], nan["backend"], nan["benchmark"], nan["params"], nan["release"]))
    rows = []
    for (machine, backend, bench, params), g in t.groupby(["machine", "backend", "benchmark", "params"], sort=True):
        for rel in sorted(have.get((machine, backend), set()) - set(g["release"]), key=release_key):
            why = SKIPPED if (machine, backend, bench, params, rel) in nan_keys else NOT_RUN
            rows.append({"machine": machine, "backend": backend, "benchmark": bench, "params": params,
                         "release": rel, "why": why})
    return pd.DataFrame(rows, columns=["machine", "backend", "benchmark", "params", "release", "why"])
