"""Measuring one commit, and where its measurement is kept.

* **Store**: one JSON per commit in the results directory (``<sha>.json``, written atomically after every part),
  holding the commit, its subject, the mlx release it ran with, the tier parts' figures (``parts``) and seconds,
  or ``skipped`` with the reason when the commit does not install. A commit's parts already there are never
  measured again, and a skipped commit is not tried again: an interrupted bisection resumes where it stopped.
* **Environment**: one virtual environment per commit, cached under ``<gemmdrift's cache>/bisect/envs/``, made
  with uv on this interpreter and layered over this interpreter's site-packages (a ``.pth`` file: every other
  dependency is the same for every commit, so every difference is the commit's). Built in a temporary sibling and
  renamed when whole.

  * mlx-lm (pure Python, ``mlx-lm-<sha12>``): the commit's tree (``git archive``) installed ``--no-deps``; the
    installed mlx runs it.
  * mlx (``mlx-<sha12>-lm<version>``): the mlx-lm release that ``Build.mlx_lm`` names, installed ``--no-deps``,
    then the user's build command (``Build.command``, run by bash) with ``GEMMDRIFT_SRC`` (the commit's tree),
    ``GEMMDRIFT_PYTHON`` (the environment's interpreter) and ``GEMMDRIFT_COMMIT``; it must install the commit's
    mlx into that environment, which is checked (``mlx.core`` must load from it). gemmdrift ships no recipe that
    builds mlx: how to compile it (compilers, BLAS, ccache) is the command's business. Its output goes to
    ``<cache>/bisect/logs/<env>.log``; a command that fails is a commit that "does not build".
* **Runner**: the tier parts the figures need, run in that interpreter with this checkout first on ``PYTHONPATH``
  (``python -m gemmdrift.history.bisect.worker``): their figures, or ``_not_run`` with the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from ...errors import GemmdriftError
from ...files import atomic_path, cache_dir, to_json
from . import gitrepo

Runner = Callable[[Path, Sequence[str]], dict[str, dict[str, Any]]]


@dataclass(frozen=True)
class Build:
    """How an mlx commit becomes an environment: the build command, and the mlx-lm release that runs the tier."""

    command: str
    mlx_lm: str


def _installed(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "none"


def mlx_version() -> str:
    return _installed("mlx")


def default_results(project: str, build: Build | None = None) -> Path:
    name = f"mlx-with-lm{build.mlx_lm}" if build else f"{project}-on-mlx{mlx_version()}"
    return cache_dir() / "bisect" / "results" / name


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


def env_dir(project: str, sha: str, build: Build | None = None) -> Path:
    name = f"{project}-{sha[:12]}" + (f"-lm{build.mlx_lm}" if build else "")
    return cache_dir() / "bisect" / "envs" / name


def _run(cmd: Sequence[Any]) -> None:
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if p.returncode != 0:
        raise GemmdriftError(_last(p.stderr or p.stdout))


def _build_mlx(src: Path, python: Path, sha: str, build: Build, log: Path) -> None:
    """Run the user's build command on the commit's tree, its output to ``log``; then check that ``mlx.core`` loads
    from the environment itself (not from this interpreter's site-packages underneath)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "GEMMDRIFT_SRC": str(src), "GEMMDRIFT_PYTHON": str(python), "GEMMDRIFT_COMMIT": sha}
    with open(log, "w") as f:
        p = subprocess.run(["bash", "-c", build.command], cwd=src, env=env, stdout=f, stderr=subprocess.STDOUT)
    if p.returncode != 0:
        raise GemmdriftError(f"the build command exited {p.returncode}: {_last(log.read_text(errors='replace'))} "
                             f"(log: {log})")
    where = subprocess.run([str(python), "-c", _WHERE], capture_output=True, text=True,
                           env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    home = str(python.parent.parent)
    core, _, lib = where.stdout.strip().partition("\n")
    if where.returncode != 0 or not core.startswith(home):
        raise GemmdriftError(f"the build command did not install mlx into {home} (mlx.core: "
                             f"{core or _last(where.stderr)})")
    if lib and not lib.startswith(home):  # e.g. a RUNPATH naming the build directory: the next build changes it
        raise GemmdriftError(f"the built mlx.core loads {lib}, outside its environment {home}: a later build would "
                             "change this commit's library (make the environment self-contained)")


# mlx.core's file, and the libmlx it loaded (Linux: /proc/self/maps; elsewhere not known, so not checked)
_WHERE = ("import os, mlx.core as mx; print(mx.__file__); m = '/proc/self/maps'; print(next((l.split()[-1] for l in "
          "open(m) if 'libmlx' in l), '') if os.path.exists(m) else '')")


def build_env(repo: Path, sha: str, where: Path, uv: str, build: Build | None = None) -> None:
    """The commit's environment at ``where`` (see the module docstring); GemmdriftError with the installer's (or
    the build's) last line when the commit does not install."""
    where.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=where.name + ".", dir=where.parent))
    try:
        src, venv = tmp / "src", tmp / "venv"
        python = venv / "bin" / "python"
        gitrepo.export(repo, sha, src)
        _run([uv, "venv", "--quiet", "--python", sys.executable, venv])
        layer(venv)
        if build is None:
            _run([uv, "pip", "install", "--quiet", "--no-deps", "--python", python, src])
        else:
            if build.mlx_lm != _installed("mlx-lm"):  # the installed one comes with the layered site-packages
                _run([uv, "pip", "install", "--quiet", "--no-deps", "--python", python, f"mlx-lm=={build.mlx_lm}"])
            _build_mlx(src, python, sha, build, where.parent.parent / "logs" / f"{where.name}.log")
        shutil.rmtree(src)
        if where.exists():
            shutil.rmtree(where)
        venv.rename(where)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


BASE_PTH = "zz_gemmdrift_base.pth"


def layer(venv: Path) -> None:
    """Layer the environment ``venv`` over this interpreter's site-packages (a .pth file), so that every commit runs
    with the same mlx (for mlx-lm), numpy and the rest. Called for a cached environment too: the checkout whose
    interpreter made it may be gone (a removed worktree), and its environment would then lack everything but the
    commit's own package."""
    site = next(venv.glob("lib/python*/site-packages"), None)
    if site is None:
        raise GemmdriftError(f"{venv} is not a virtual environment (no lib/python*/site-packages)")
    line = f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n"
    pth = site / BASE_PTH
    if not pth.exists() or pth.read_text() != line:
        with atomic_path(pth) as tmp:
            tmp.write_text(line)


def python_of(repo: Path, project: str, sha: str, build: Build | None = None) -> Path:
    """The commit's interpreter, built once and cached (and layered over this interpreter: :func:`layer`)."""
    from ...machine.interpreter import uv_path

    where = env_dir(project, sha, build)
    python = where / "bin" / "python"
    if not python.exists():
        uv = uv_path()
        if uv is None:
            raise GemmdriftError("uv is not installed (make env installs it in .venv)")
        build_env(repo, sha, where, uv, build)
    else:
        layer(where)
    return python


def tier_runner(python: Path, parts: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The tier parts in ``python`` (:mod:`gemmdrift.history.bisect.worker`): ``{part: figures | {"_not_run": why}}``."""
    from ...attribution.release_ops import checkout_env

    env = {**checkout_env(), "MLX_ENABLE_TF32": "0"}
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "figures.json"
        p = subprocess.run([str(python), "-m", "gemmdrift.history.bisect.worker", "--parts", ",".join(parts), "--out",
                            str(out)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if p.returncode != 0 or not out.exists():
            raise GemmdriftError(f"measuring in {python} failed (exit {p.returncode}): {_last(p.stderr)}")
        return json.loads(out.read_text())


def measure(repo: Path, project: str, commit: gitrepo.Commit, parts: Sequence[str], results: Path,
            runner: Runner = tier_runner, say: Callable[[str], None] = lambda s: None,
            build: Build | None = None) -> dict[str, Any]:
    """The commit's record with every part of ``parts`` measured (only the missing ones are run)."""
    ran_with = ({"mlx": f"built from {commit.sha[:12]}", "mlx_lm": build.mlx_lm} if build else {"mlx": mlx_version()})
    rec = load(results, commit.sha) or {"commit": commit.sha, "subject": commit.subject, "project": project,
                                        **ran_with, "parts": {}, "seconds": {}}
    if rec.get("skipped"):
        return rec
    todo = [p for p in parts if p not in rec["parts"]]
    if not todo:
        return rec
    t0 = time.perf_counter()
    if build and not env_dir(project, commit.sha, build).exists():
        say(f"{commit.sha[:12]}: building mlx ({commit.subject[:60]})")
    try:
        python = python_of(repo, project, commit.sha, build)
    except GemmdriftError as e:
        verb = "does not build" if build else "does not install"
        rec.update(skipped=f"{verb}: {e}", install_s=round(time.perf_counter() - t0, 1))
        save(results, rec)
        say(f"{commit.sha[:12]}: skipped ({verb}: {e})")
        return rec
    rec.setdefault("install_s", round(time.perf_counter() - t0, 1))
    for part in todo:  # one part at a time: each is saved as soon as it is measured
        t1 = time.perf_counter()
        got = runner(python, [part])
        rec["parts"][part] = got.get(part, {"_not_run": "the worker returned nothing"})
        rec.update({k.lstrip("_") + "_imported": got[k] for k in ("_mlx", "_mlx_lm") if k in got})
        rec["seconds"][part] = round(time.perf_counter() - t1, 1)
        rec["measured_at"] = int(time.time() * 1000)  # asv's started_at (ms since the epoch)
        save(results, rec)
    say(f"{commit.sha[:12]}: measured {', '.join(todo)} in {time.perf_counter() - t0:.0f} s")
    return rec
