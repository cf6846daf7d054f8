"""The two environments of ``gemmdrift upgrade``: one interpreter per mlx release, made with uv (pip where uv is
missing), cached under the tool's cache directory keyed by the exact versions, and reused after.

An environment is a virtual environment at ``<cache>/envs/py<X.Y>-<platform>/mlx-<V>+lm-<W>/`` holding mlx (with
this platform's backend wheel), mlx-lm and their dependencies, nothing of gemmdrift: the measuring process runs
``python -m gemmdrift.upgrade.worker`` there with this checkout on ``PYTHONPATH`` (as
:func:`gemmdrift.attribution.release_ops.recompute_in` does). It is built in a temporary sibling and renamed into
place when its install succeeded, so a cached directory is always a whole one; ``env.json`` in it records the
exact versions installed.

Which mlx-lm a release gets is asv.conf.json's pairing (:mod:`gemmdrift.matrix`), or ``--mlx-lm`` where it can run
that mlx; a cached environment is reused only for exactly the pair asked for.

Every check here runs before any model loads: the release exists and has a wheel for this platform (the nearest
that exist are named otherwise), an interpreter given with ``--python`` imports mlx and mlx-lm and knows the
model's architecture, and without a network an environment that is not cached is one line naming an interpreter
that would do.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from .. import matrix
from ..errors import GemmdriftError

_VERSION = re.compile(r"^\d+(\.\d+){1,3}$")
_PROBE = r"""
import ast, json, sys, importlib.util, importlib.metadata, os
out = {"python": sys.version.split()[0], "executable": sys.executable}
try:
    import mlx.core as mx
    out["mlx"] = mx.__version__
except Exception as e:
    out["error"] = f"{e.__class__.__name__}: {e}"
try:  # not imported (mlx-lm's __init__ imports transformers: seconds); its files read
    spec = importlib.util.find_spec("mlx_lm")
except Exception:
    spec = None
out["mlx_lm"] = None
if spec is not None and spec.submodule_search_locations:
    try:
        out["mlx_lm"] = importlib.metadata.version("mlx-lm")
    except Exception:
        out["mlx_lm"] = "?"
    pkg = list(spec.submodule_search_locations)[0]
    mt = sys.argv[1] if len(sys.argv) > 1 else ""
    if mt:
        try:
            tree = ast.parse(open(os.path.join(pkg, "utils.py")).read())
            for node in ast.walk(tree):
                names = [getattr(t, "id", "") for t in getattr(node, "targets", [])]
                if isinstance(node, ast.Assign) and "MODEL_REMAPPING" in names:
                    mt = ast.literal_eval(node.value).get(mt, mt)
        except Exception:
            pass
        out["model_type_known"] = os.path.isfile(os.path.join(pkg, "models", mt + ".py"))
print(json.dumps(out))
"""


class Offline(GemmdriftError):
    """The package index cannot be reached."""


@dataclass
class Side:
    """One side of the comparison: a release and the interpreter that runs it."""

    label: str  # "from" or "to"
    python: str  # the interpreter
    mlx: str
    mlx_lm: str | None
    how: str  # "this interpreter", "--python", "cached", "built"
    info: dict[str, Any] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        rec = {"mlx": self.mlx, "mlx_lm": self.mlx_lm, "python": self.python, "how": self.how,
               "python_version": self.info.get("python")}
        if "build_seconds" in self.info:  # made by this run (uv or pip)
            rec["build_seconds"] = round(self.info["build_seconds"], 1)
        return rec

    def key(self) -> str:
        return f"{self.mlx}+lm{self.mlx_lm}@{self.python}"


vtuple = matrix.vkey


def check_version(text: str, flag: str) -> str:
    if not _VERSION.match(text or ""):
        raise GemmdriftError(f"{flag} {text!r}: not a release number (e.g. 0.31.2)")
    return text


def nearest(version: str, available: Sequence[str]) -> list[str]:
    """The releases next to ``version``: the newest below it and the oldest above it."""
    vs = sorted(set(available), key=vtuple)
    below = [v for v in vs if vtuple(v) < vtuple(version)]
    above = [v for v in vs if vtuple(v) > vtuple(version)]
    return ([below[-1]] if below else []) + ([above[0]] if above else [])


def backend_package() -> tuple[str, str]:
    """(the package whose wheels say a release exists for this platform, the install requirement's extra)."""
    if sys.platform == "darwin":
        return "mlx-metal", ""
    try:
        from importlib.metadata import version

        for cuda in ("mlx-cuda-13", "mlx-cuda-12"):
            try:
                version(cuda)
                return cuda, "cuda13" if cuda.endswith("13") else "cuda12"
            except Exception:  # noqa: BLE001 - not installed
                pass
    except ImportError:
        pass
    return "mlx-cpu", "cpu"


def index_versions(package: str) -> list[str]:
    """The releases of ``package`` with a wheel for this interpreter and platform, from the package index
    (pip's own resolver filters by platform tags). :class:`Offline` when the index cannot be reached."""
    try:
        r = subprocess.run([sys.executable, "-m", "pip", "index", "versions", package, "--disable-pip-version-check",
                            "--timeout", "15", "--retries", "1"],
                           capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.SubprocessError) as e:
        raise Offline(f"cannot ask the package index ({e.__class__.__name__})") from None
    m = re.search(r"Available versions:\s*(.+)", r.stdout)
    if m:
        return [v.strip() for v in m.group(1).split(",") if v.strip()]
    err = (r.stderr or r.stdout).strip()
    if unreachable(err):  # pip says "No matching distribution" offline too, after its connection warnings
        said = [line.strip() for line in err.splitlines() if unreachable(line)]
        why = re.search(r"Failed to establish a new connection: [^')\"]*|Name or service not known|Temporary failure "
                        r"in name resolution|Network is unreachable|Connection refused|timed out|not a trusted or "
                        r"secure host", said[0])
        raise Offline(f"cannot ask the package index ({why.group(0) if why else said[0][:160]})")
    if "No matching distribution" in err:
        return []
    raise Offline(f"cannot ask the package index ({(err.splitlines() or ['no answer'])[-1][:160]})")


_UNREACHABLE = re.compile(r"connection broken|NewConnectionError|Failed to establish a new connection|Max retries|"
                          r"Could not fetch URL|resolve host|Name or service not known|Temporary failure in name "
                          r"resolution|Network is unreachable|Connection refused|timed out|offline|"
                          r"not a trusted or secure host", re.I)


def unreachable(text: str) -> bool:
    """Whether an installer's output says the package index could not be reached (not that a release is missing)."""
    return bool(_UNREACHABLE.search(text or ""))


def env_root() -> Path:
    from ..files import cache_dir

    tag = f"py{sys.version_info[0]}.{sys.version_info[1]}-{sys.platform}-{platform.machine()}"
    return cache_dir() / "envs" / tag


def env_dir(mlx: str, mlx_lm: str) -> Path:
    return env_root() / f"mlx-{mlx}+lm-{mlx_lm}"


def _python_of(d: Path) -> Path:
    return d / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python")


def cached(mlx: str, mlx_lm: str) -> Path | None:
    """The interpreter of the whole cached environment of exactly this pair (mlx ``mlx`` with mlx-lm ``mlx_lm``),
    or None: an environment of the same mlx with another mlx-lm is never taken for it."""
    d = env_dir(mlx, mlx_lm)
    rec = d / "env.json"
    if not rec.is_file() or not _python_of(d).exists():
        return None
    try:
        got = json.loads(rec.read_text())
    except (OSError, ValueError):
        return None
    return _python_of(d) if got.get("mlx") == mlx and got.get("mlx_lm") == mlx_lm else None


def interpreters_with(mlx: str) -> list[str]:
    """Interpreters on this machine that hold mlx ``mlx`` (asv's environments, read from their metadata): what
    ``--python`` could be given when nothing can be built."""
    out = []
    for base in [Path(".asv") / "env", env_root()]:
        for py in sorted(base.glob("*/bin/python")):
            if list(py.parent.parent.glob(f"lib/python*/site-packages/mlx-{mlx}.dist-info")):
                out.append(str(py))
    return out


def probe(python: str, model_type: str | None = None, flag: str = "--python") -> dict[str, Any]:
    """{python, mlx, mlx_lm, model_type_known} of an interpreter; one line when it is not a Python with mlx and
    mlx-lm (:func:`gemmdrift.machine.interpreter.probe`), or when its mlx-lm has no ``model_type``."""
    from ..machine.interpreter import probe as probe_interpreter

    info = probe_interpreter(python, _PROBE, [model_type or ""], flag=flag)
    if model_type and info.get("model_type_known") is False:
        raise GemmdriftError(f"mlx-lm {info['mlx_lm']} (with mlx {info['mlx']}, {flag} {python}) cannot load the "
                             f"model: it has no {model_type!r} architecture")
    return info


def _installer() -> list[str] | None:
    """uv (beside this interpreter, or on PATH: :func:`gemmdrift.machine.interpreter.uv_path`), or None (pip)."""
    from ..machine.interpreter import uv_path

    uv = uv_path()
    return [uv] if uv else None


def build(mlx: str, mlx_lm: str, log: Callable[[str], None] = print) -> tuple[Path, float]:
    """Make the environment of mlx ``mlx`` and mlx-lm ``mlx_lm`` (both pinned: :func:`plan_side` chose the pair);
    returns its interpreter and the seconds it took. Built in a temporary sibling, renamed into place when whole."""
    import time

    _, extra = backend_package()
    base = getattr(sys, "_base_executable", None) or sys.executable
    root = env_root()
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".building-{mlx}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    reqs = [f"mlx[{extra}]=={mlx}" if extra else f"mlx=={mlx}", f"mlx-lm=={mlx_lm}"]
    if extra == "cpu":
        reqs.append(f"mlx-cpu=={mlx}")
    uv = _installer()
    t0 = time.perf_counter()
    log(f"gemmdrift upgrade: making an environment for mlx {mlx} ({' '.join(reqs)}) with {'uv' if uv else 'pip'}")
    try:
        if uv:
            steps = [[*uv, "venv", "--quiet", "--python", base, str(tmp)],
                     [*uv, "pip", "install", "--quiet", "--python", str(_python_of(tmp)), *reqs]]
        else:
            steps = [[base, "-m", "venv", str(tmp)],
                     [str(_python_of(tmp)), "-m", "pip", "install", "--quiet", *reqs]]
        for cmd in steps:
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                last = [line for line in (r.stderr or r.stdout).strip().splitlines() if line.strip()]
                text = " ".join(last[-3:])[:300] or "no message"
                if unreachable(text) or re.search(r"connect|network|unreachable", text, re.I):
                    raise Offline(f"installing mlx {mlx} failed: the package index cannot be reached ({text})")
                raise GemmdriftError(f"installing mlx {mlx} failed: {text}")
        info = probe(str(_python_of(tmp)), flag=f"the new environment for mlx {mlx}")
        if info["mlx"] != mlx or info["mlx_lm"] != mlx_lm:
            raise GemmdriftError(f"the new environment for mlx {mlx} with mlx-lm {mlx_lm} holds mlx {info['mlx']} "
                                 f"with mlx-lm {info['mlx_lm']}")
        dest = env_dir(mlx, info["mlx_lm"])
        record = {"mlx": info["mlx"], "mlx_lm": info["mlx_lm"], "python": info["python"], "requirements": reqs,
                  "installer": "uv" if uv else "pip", "seconds": round(time.perf_counter() - t0, 1)}
        (tmp / "env.json").write_text(json.dumps(record, indent=2))
        if dest.exists():  # another process finished the same environment first
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _python_of(dest), time.perf_counter() - t0


@dataclass
class Plan:
    """What each side needs, decided before any model loads: an interpreter, or a release to build."""

    side: str
    mlx: str | None = None
    mlx_lm: str | None = None
    python: str | None = None  # known interpreter (given, cached or this one)
    how: str = ""
    info: dict[str, Any] = field(default_factory=dict)


def this_interpreter(model_type: str | None) -> Plan:
    info = probe(sys.executable, model_type, flag="this interpreter")
    return Plan("from", info["mlx"], info["mlx_lm"], sys.executable, "this interpreter", info)


def known_pairs() -> tuple[dict[str, str], str]:
    """({mlx: the mlx-lm asv.conf.json's matrix pairs with it} on this platform, why it is empty when it is)."""
    try:
        return matrix.main_line(matrix.read_conf()), ""
    except GemmdriftError as e:
        return {}, str(e)


def plan_side(side: str, version: str | None, mlx_lm: str | None, python: str | None, model_type: str | None,
              versions: Callable[[str], list[str]] | None = None) -> Plan:
    """The interpreter of one side, or the release to build for it; every check that needs no model.
    ``versions``: the releases of a package with a wheel here (default :func:`index_versions`).

    The pair is ``mlx_lm`` when given (refused when it cannot run ``version``: :func:`gemmdrift.matrix.check_pair`),
    else the one asv.conf.json's matrix pairs with ``version``; a cached environment is taken only for exactly
    that pair. A release the matrix does not pair is refused, naming the nearest known pairings."""
    versions = versions or index_versions
    flag = "--python" if side == "to" else "--from-python"
    if python:
        info = probe(python, model_type, flag=flag)
        if version and info["mlx"] != version:
            raise GemmdriftError(f"{flag} {python} holds mlx {info['mlx']}, not {version} "
                                 f"(--{side} {version}); leave --{side} out or give the interpreter of {version}")
        if info.get("mlx_lm"):  # an interpreter whose mlx-lm cannot run its mlx fails at the load: refused now
            matrix.check_pair(info["mlx"], info["mlx_lm"], known_pairs()[0], flag=f"{flag} {python}: mlx-lm")
        return Plan(side, info["mlx"], info["mlx_lm"], python, flag, info)
    if version is None:
        return this_interpreter(model_type)
    pairs, why = known_pairs()
    if mlx_lm:
        matrix.check_pair(version, mlx_lm, pairs)
    lm = mlx_lm or pairs.get(version)
    hit = cached(version, lm) if lm else None
    if hit is not None:
        info = probe(str(hit), model_type, flag=f"the cached environment of mlx {version}")
        return Plan(side, version, info["mlx_lm"], str(hit), "cached", info)
    pkg, _ = backend_package()
    try:
        known = versions(pkg)
    except Offline as e:
        others = interpreters_with(version)
        hint = (f"--{'python' if side == 'to' else 'from-python'} {others[0]} would do" if others else
                f"give an interpreter that has mlx {version} and mlx-lm with "
                f"--{'python' if side == 'to' else 'from-python'} PATH")
        raise GemmdriftError(f"mlx {version}: no cached environment and {e}; {hint}") from None
    if version not in known:
        near = nearest(version, known)
        raise GemmdriftError(f"mlx {version}: no such release with a wheel for this platform ({pkg}); "
                             + (f"the nearest that exist: {', '.join(near)}" if near else "none exist"))
    if lm is None:
        how = ("give the mlx-lm to pair it with: --mlx-lm VERSION" if side == "to" else
               "give an interpreter of it with the mlx-lm you want: --from-python PATH")
        near = matrix.nearest_pairs(version, pairs)
        raise GemmdriftError(f"mlx {version}: " + (f"asv.conf.json's matrix does not pair it with an mlx-lm (the "
                                                    f"nearest known pairings: {matrix.describe_pairs(near)})"
                                                    if pairs else f"its mlx-lm is unknown ({why})") + f"; {how}")
    try:
        lms = versions("mlx-lm")
    except Offline:
        lms = [lm]
    if lm not in lms:
        near = nearest(lm, lms)
        raise GemmdriftError(f"mlx-lm {lm}: no such release"
                             + (f"; the nearest that exist: {', '.join(near)}" if near else ""))
    return Plan(side, version, lm, None, "to build")


def realise(plan: Plan, model_type: str | None, log: Callable[[str], None] = print) -> Side:
    """The side's interpreter, building its environment where the plan says so."""
    if plan.python is None:
        py, seconds = build(plan.mlx, plan.mlx_lm, log)
        info = probe(str(py), model_type, flag=f"the environment of mlx {plan.mlx}")
        return Side(plan.side, str(py), info["mlx"], info["mlx_lm"], "built", {**info, "build_seconds": seconds})
    return Side(plan.side, plan.python, plan.mlx, plan.mlx_lm, plan.how, plan.info)
