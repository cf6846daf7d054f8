"""Measuring one commit, and where its measurement is kept.

* **Store**: one JSON per commit in the results directory (``<sha>.json``, written atomically after every part),
  holding the commit, its subject, the mlx release it ran with, the tier parts' figures (``parts``) and seconds,
  or ``skipped`` with the reason when the commit does not install. A commit's parts already there are never
  measured again, and a skipped commit is not tried again: an interrupted bisection resumes where it stopped.
* **Environment** (mlx-lm, pure Python): one virtual environment per commit, cached under
  ``<gemmdrift's cache>/bisect/envs/mlx-lm-<sha12>``: made with uv on this interpreter, holding only mlx-lm
  installed ``--no-deps`` from a ``git archive`` export of the commit, layered over this interpreter's
  site-packages (a ``.pth`` file: the installed mlx and every other dependency, the same for every commit, so
  every difference is the commit's). Built in a temporary sibling and renamed when whole.
* **Runner**: the tier parts the figures need, run in that interpreter with this checkout first on ``PYTHONPATH``
  (``python -m gemmdrift.bisect.worker``): their figures, or ``_not_run`` with the reason.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from ..errors import GemmdriftError
from ..files import atomic_path, cache_dir, to_json
from . import gitrepo

Runner = Callable[[Path, Sequence[str]], dict[str, dict[str, Any]]]


def mlx_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mlx")
    except PackageNotFoundError:
        return "none"


def default_results(project: str) -> Path:
    return cache_dir() / "bisect" / "results" / f"{project}-on-mlx{mlx_version()}"


def load(results: Path, sha: str) -> dict[str, Any]:
    p = results / f"{sha}.json"
    if not p.exists():
        return {}
    try:
        rec = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise GemmdriftError(f"cannot read the measured commit {p}: {e}") from None
    if not isinstance(rec, dict) or rec.get("commit") != sha:
        raise GemmdriftError(f"{p} is not a bisection record of commit {sha[:12]}")
    return rec


def save(results: Path, rec: dict[str, Any]) -> None:
    results.mkdir(parents=True, exist_ok=True)
    with atomic_path(results / f"{rec['commit']}.json") as tmp:
        tmp.write_text(to_json(rec) + "\n")


def _last(text: str) -> str:
    lines = [x.strip() for x in (text or "").splitlines() if x.strip()]
    return lines[-1][:300] if lines else "no output"


def env_dir(project: str, sha: str) -> Path:
    return cache_dir() / "bisect" / "envs" / f"{project}-{sha[:12]}"


def build_env(repo: Path, sha: str, where: Path, uv: str) -> None:
    """The commit's environment at ``where`` (see the module docstring); GemmdriftError with the installer's last
    line when the commit does not install."""
    where.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=where.name + ".", dir=where.parent))
    try:
        src, venv = tmp / "src", tmp / "venv"
        gitrepo.export(repo, sha, src)
        for cmd in ([uv, "venv", "--quiet", "--python", sys.executable, venv],
                    [uv, "pip", "install", "--quiet", "--no-deps", "--python", venv / "bin" / "python", src]):
            p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
            if p.returncode != 0:
                raise GemmdriftError(_last(p.stderr or p.stdout))
        site = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()"
                               "['purelib'])"], capture_output=True, text=True, check=True).stdout.strip()
        base = sysconfig.get_paths()["purelib"]
        Path(site, "zz_gemmdrift_base.pth").write_text(f"import site; site.addsitedir({base!r})\n")
        shutil.rmtree(src)
        if where.exists():
            shutil.rmtree(where)
        venv.rename(where)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def python_of(repo: Path, project: str, sha: str) -> Path:
    """The commit's interpreter, built once and cached."""
    from ..machine.interpreter import uv_path

    where = env_dir(project, sha)
    python = where / "bin" / "python"
    if not python.exists():
        uv = uv_path()
        if uv is None:
            raise GemmdriftError("uv is not installed (make env installs it in .venv)")
        build_env(repo, sha, where, uv)
    return python


def tier_runner(python: Path, parts: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The tier parts in ``python`` (:mod:`gemmdrift.bisect.worker`): ``{part: figures | {"_not_run": why}}``."""
    from ..attribution.release_ops import checkout_env

    env = {**checkout_env(), "MLX_ENABLE_TF32": "0"}
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "figures.json"
        p = subprocess.run([str(python), "-m", "gemmdrift.bisect.worker", "--parts", ",".join(parts), "--out",
                            str(out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if p.returncode != 0 or not out.exists():
            raise GemmdriftError(f"measuring in {python} failed (exit {p.returncode}): {_last(p.stderr)}")
        return json.loads(out.read_text())


def measure(repo: Path, project: str, commit: gitrepo.Commit, parts: Sequence[str], results: Path,
            runner: Runner = tier_runner, say: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """The commit's record with every part of ``parts`` measured (only the missing ones are run)."""
    rec = load(results, commit.sha) or {"commit": commit.sha, "subject": commit.subject, "project": project,
                                        "mlx": mlx_version(), "parts": {}, "seconds": {}}
    if rec.get("skipped"):
        return rec
    todo = [p for p in parts if p not in rec["parts"]]
    if not todo:
        return rec
    t0 = time.perf_counter()
    try:
        python = python_of(repo, project, commit.sha)
    except GemmdriftError as e:
        rec.update(skipped=f"does not install: {e}", install_s=round(time.perf_counter() - t0, 1))
        save(results, rec)
        say(f"{commit.sha[:12]}: skipped (does not install: {e})")
        return rec
    rec.setdefault("install_s", round(time.perf_counter() - t0, 1))
    for part in todo:  # one part at a time: each is saved as soon as it is measured
        t1 = time.perf_counter()
        got = runner(python, [part])
        rec["parts"][part] = got.get(part, {"_not_run": "the worker returned nothing"})
        rec["seconds"][part] = round(time.perf_counter() - t1, 1)
        save(results, rec)
    say(f"{commit.sha[:12]}: measured {', '.join(todo)} in {time.perf_counter() - t0:.0f} s")
    return rec
