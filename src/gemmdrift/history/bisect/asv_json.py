"""How results are stored, second form: each measured commit as asv's own results JSON (issue 55).

A bisection's records (``<results>/<sha>.json``) are gemmdrift's; this writes beside them what ``asv run`` over the
bisected repository would have written for the tracking tier, so that asv (``compare``, ``publish``) reads the
commit-level results as it reads the release-level ones:

* ``<results>/asv/benchmarks.json``: the tier benchmarks' entries of asv's benchmark list (the shipped one);
* ``<results>/asv/<machine>/machine.json`` and ``<results>/asv/<machine>/<sha8>-<env>.json``, asv's results
  format 2: ``commit_hash`` the bisected repository's commit, ``date`` its author date (as asv records it), the
  environment named after what ran beside it (``bisect-lm0.30.2`` for an mlx commit, ``bisect-mlx0.32.4`` for an
  mlx-lm one).

Each benchmark's value is computed by benchmarks/bench_tier.py's own ``track_`` method from the commit's part
figures, as asv computes it from the tier's setup_cache, so the names, parameters (asv's ``repr`` strings),
versions and NaN-as-null are asv's. A benchmark is written where the commit measured the part it reads; a commit
that was skipped (does not build or install) has no file. ``started_at`` is when the record's last part was
measured (``measured_at``), or the commit's date for a record written before it was kept.
"""

from __future__ import annotations

import itertools
import json
import math
import platform
from pathlib import Path
from typing import Any

from ...errors import GemmdriftError
from ...files import atomic_path
from . import figures, gitrepo

PREFIX = "bench_tier."
COLUMNS = ["result", "params", "version", "started_at", "duration", "stats_ci_99_a", "stats_ci_99_b", "stats_q_25",
           "stats_q_75", "stats_number", "stats_repeat", "samples", "profile"]  # asv's results format 2


def machine_name() -> str:
    """The results' machine: the bisections of one OS and backend are one machine to asv (``bisect-linux-cpu``)."""
    import mlx.core as mx

    return f"bisect-{platform.system().lower()}-{'gpu' if mx.default_device() == mx.gpu else 'cpu'}"


def _value(v: Any) -> float | None:
    v = float(v)
    return None if math.isnan(v) else v


def tier_results(parts: dict[str, Any], root: Path = figures.ROOT) -> dict[str, dict[str, Any]]:
    """``{asv name: {"result", "params", "version", "part"}}`` for every tier benchmark whose part is in ``parts``."""
    part_of = {name.partition("[")[0]: part for name, (part, _) in figures.tier_figures(root).items()}
    out = {}
    for name, method, params in figures.tier_benchmarks(root):
        if part_of.get(name) not in parts:
            continue
        out[PREFIX + name] = {"result": [_value(method(parts, *c)) for c in itertools.product(*params)],
                              "params": [[repr(p) for p in ps] for ps in params],
                              "version": str(getattr(method, "version", "")), "part": part_of[name]}
    return out


def _env(rec: dict[str, Any]) -> tuple[str, dict[str, str]]:
    if rec.get("project") == "mlx":
        return f"bisect-lm{rec['mlx_lm']}", {"mlx-lm": str(rec["mlx_lm"])}
    return f"bisect-mlx{rec['mlx']}", {"mlx": str(rec["mlx"])}


def commit_file(rec: dict[str, Any], date_ms: int, machine: str, root: Path = figures.ROOT) -> dict[str, Any]:
    """One commit's record as asv's results file (format 2)."""
    env, req = _env(rec)
    parts = {p: f for p, f in (rec.get("parts") or {}).items() if isinstance(f, dict)}
    secs = rec.get("seconds") or {}
    results = {name: [r["result"], r["params"], r["version"], rec.get("measured_at", date_ms), secs.get(r["part"])]
               for name, r in tier_results(parts, root).items()}
    python = ".".join(platform.python_version_tuple()[:2])
    return {"commit_hash": rec["commit"], "env_name": env, "date": date_ms,
            "params": {"machine": machine, "python": python, **req}, "python": python, "requirements": req,
            "env_vars": {}, "result_columns": COLUMNS, "results": results,
            "durations": {f"<part {p}>": s for p, s in secs.items()}, "version": 2}


def _write(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=4, sort_keys=True) + "\n")


def write(results: Path, repo: Path, machine: str | None = None, root: Path = figures.ROOT) -> list[Path]:
    """asv JSON for every measured commit of the results directory ``results`` (the commits of ``repo``); returns
    the commit files written. Run after every bisection: it rewrites all of them, each from its record."""
    from ..asvfiles import write_machine

    machine = machine or machine_name()
    out = results / "asv"
    written = []
    for p in sorted(results.glob("*.json")):
        if p.name.startswith("answer"):
            continue
        try:
            rec = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            raise GemmdriftError(f"cannot read the measured commit {p}: {e}") from None
        if not isinstance(rec, dict) or "commit" not in rec or rec.get("skipped") or not rec.get("parts"):
            continue
        date_ms = int(gitrepo.git(repo, "show", "-s", "--format=%at", rec["commit"])) * 1000
        data = commit_file(rec, date_ms, machine, root)
        if not data["results"]:  # no part of the tier (a planted figure): nothing asv would have recorded
            continue
        env, _ = _env(rec)
        dst = out / machine / f"{rec['commit'][:8]}-{env}.json"
        _write(dst, data)
        written.append(dst)
    if written:
        shipped = json.loads((root / "benchmarks" / "reference" / "benchmarks.json").read_text())
        names = {n for f in written for n in json.loads(f.read_text())["results"]}
        _write(out / "benchmarks.json", {**{k: v for k, v in shipped.items() if k in names}, "version": 2})
        write_machine(out / machine / "machine.json", out / machine / "machine.json", machine)
    return written
