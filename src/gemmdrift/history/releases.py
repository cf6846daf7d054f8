"""The whole history in one command: every Linux entry of asv.conf.json, one gemmdrift commit (issue 47).

``python -m gemmdrift.history.releases`` (``make history-run``) measures every release of the matrix in turn:

1. one clone of this repository at the commit (``.asv/history/src``) and one wheel of gemmdrift built from it, so
   every release runs the same benchmarks and the same library, and every difference is mlx's or mlx-lm's;
2. per matrix entry, a virtual environment built with uv (``<gemmdrift's cache>/history-envs/<label>``): the entry's pins, then
   gemmdrift ``--no-deps`` (its own ``mlx>=0.29`` would refuse the older releases the matrix measures);
3. ``asv run --environment existing:<that python> --set-commit-hash <commit> --machine <machine>``, and its result
   file copied into ``<results>/<machine>/`` (``benchmarks.json`` merged: the older machines' units stay).

Progress: one line per environment on stderr (its build and run seconds). Resumable: a status file
(``<results>/<machine>.status.json``, written after every environment) holds the commit and each environment's
outcome; a rerun skips every environment already finished (measured, not installable, or failed: ``--retry`` runs
those again) and refuses another commit. Ctrl-C stops at once; the environment under way is run again next time. An environment that does not build is
one line (``not installable: <reason>``), recorded in the status file, and the run goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from ..errors import GemmdriftError
from ..files import atomic_path, cache_dir
from ..matrix import bridges, entries, env_label, releases  # noqa: F401  (the matrix: one source, gemmdrift.matrix)
from .asvfiles import MACHINE, merge_benchmarks, write_machine

WORK = Path(".asv") / "history"
DONE, NOT_INSTALLABLE, FAILED = "measured", "not installable", "failed"
# What every environment gets besides the entry's pins: asv's runner (asv imports it inside the environment).
RUNNER = "asv_runner"
# What the history runs: the tier and the environment record. asv would start a process for each of the ~500 cases of
# the opt-in main-job benchmarks only to record it as skipped (minutes on a loaded 2-core machine).
BENCH = r"^bench_(tier|env)\."
BRIDGES = "bridges"  # the bridges' results: apart from the history's, so that its labels stay (changelog.bridged)


def requirement_specs(req: dict[str, str]) -> list[str]:
    """The entry's pins as installer arguments (``name==version``, or the bare name where asv's entry is '')."""
    return [f"{k}=={v}" if v else k for k, v in req.items()]


def read_status(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise GemmdriftError(f"cannot read the history status {path}: {e}") from None
    if not isinstance(d, dict) or not isinstance(d.get("envs", {}), dict):
        raise GemmdriftError(f"{path} is not a history status file")
    return d


def write_status(path: Path, status: dict[str, Any]) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(status, indent=1, sort_keys=True) + "\n")


def check_commit(status: dict[str, Any], commit: str, path: Path) -> None:
    """One gemmdrift commit for the whole history: a resumed run must be at the recorded one."""
    old = status.get("commit")
    if old and old != commit:
        raise GemmdriftError(f"{path} records the history at gemmdrift commit {old[:8]}, not {commit[:8]}: "
                             f"resume with --commit {old[:8]}, or give another --machine for a new history")


def last_line(text: str) -> str:
    lines = [x.strip() for x in (text or "").splitlines() if x.strip()]
    return lines[-1][:300] if lines else "no output"


def _run(cmd: Sequence[str], **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)


def build_env(uv: str, where: Path, req: dict[str, str], wheel: Path) -> None:
    """A fresh virtual environment at ``where`` with the entry's pins, asv's runner and gemmdrift (no deps).
    Raises GemmdriftError with the installer's last line when it fails."""
    if where.exists():
        shutil.rmtree(where)
    steps = [
        [uv, "venv", "--quiet", "--python", "3.11", where],
        [uv, "pip", "install", "--quiet", "--python", where / "bin" / "python", *requirement_specs(req), RUNNER],
        [uv, "pip", "install", "--quiet", "--no-deps", "--python", where / "bin" / "python", wheel],
    ]
    for cmd in steps:
        p = _run(cmd)
        if p.returncode != 0:
            raise GemmdriftError(last_line(p.stderr or p.stdout))


def asv_result_files(results: Path, machine: str, python: Path) -> list[Path]:
    """asv's result files of the existing environment ``python`` (its name holds the interpreter's path)."""
    key = str(python).replace(os.path.sep, "_")
    return sorted(p for p in (results / machine).glob("*.json") if key in p.name)


def parts_not_run(log_text: str) -> dict[str, str]:
    """The tier parts a release could not run, with their reasons, from asv's log of it (gemmdrift.history.tier.run_part's
    lines: ``gemmdrift tier: part NAME cannot run here: REASON``)."""
    out = {}
    for line in log_text.replace("\r", "\n").splitlines():
        head, sep, reason = line.partition(" cannot run here: ")
        if sep and "gemmdrift tier: part " in head:
            out[head.rsplit("gemmdrift tier: part ", 1)[1].strip()] = reason.strip()
    return out


def _say(msg: str) -> None:
    print(f"history: {msg}", file=sys.stderr, flush=True)


def _git(root: Path, *args: str) -> str:
    p = _run(["git", "-C", root, *args])
    if p.returncode != 0:
        raise GemmdriftError(f"git {' '.join(args)}: {last_line(p.stderr)}")
    return p.stdout.strip()


def resolve_commit(root: Path, rev: str) -> str:
    """The full hash of commit ``rev`` in ``root``; one line when there is no such commit (git's own message for an
    unknown revision ends in its usage line)."""
    try:
        found = _git(root, "rev-parse", "--verify", "--quiet", "--end-of-options", f"{rev}^{{commit}}")
    except GemmdriftError:
        found = ""
    if not found:
        raise GemmdriftError(f"--commit {rev}: no such commit in {root}")
    return found


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def prepare(root: Path, work: Path, commit: str, uv: str) -> tuple[Path, Path]:
    """The clone at ``commit`` and gemmdrift's wheel built from it (both reused while the commit is the same)."""
    src = work / "src"
    if not (src / ".git").exists() or _git(src, "rev-parse", "HEAD") != commit:
        if src.exists():
            shutil.rmtree(src)
        _git(root, "clone", "--quiet", "--shared", "--no-checkout", str(root), str(src))
        _git(src, "checkout", "--quiet", "--detach", commit)
    _git(src, "branch", "--force", "main", commit)  # asv.conf.json's branch (asv refuses a repository without it)
    wheels = work / "wheel" / commit[:12]
    found = sorted(wheels.glob("gemmdrift-*.whl"))
    if not found:
        p = _run([uv, "build", "--quiet", "--wheel", "--out-dir", wheels, src])
        if p.returncode != 0:
            raise GemmdriftError(f"building gemmdrift's wheel: {last_line(p.stderr)}")
        found = sorted(wheels.glob("gemmdrift-*.whl"))
    return src, found[-1]


def process_tree(pid: int) -> list[int]:
    """``pid``'s descendants (children first, then theirs), read from ``ps`` (Linux and macOS); [] without it."""
    try:
        p = subprocess.run(["ps", "-A", "-o", "pid=", "-o", "ppid="], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    children: dict[int, list[int]] = {}
    for line in p.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            children.setdefault(int(parts[1]), []).append(int(parts[0]))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(0), [])
        out += kids
        todo += kids
    return out


def stop_tree(pid: int, grace: float = 5.0) -> None:
    """Stop ``pid`` and every process below it, in whatever process group each one put itself (asv starts
    ``benchmark.py run_server`` in its own: the terminal's Ctrl-C never reaches it): SIGTERM, then SIGKILL for what
    is left after ``grace`` seconds."""
    import signal

    pids = [pid, *process_tree(pid)]
    groups = set()
    for q in pids:
        try:
            groups.add(os.getpgid(q))
        except OSError:
            pass
    groups.discard(os.getpgrp())  # never this process's own group

    def send(sig) -> None:
        for g in groups:
            try:
                os.killpg(g, sig)
            except OSError:
                pass
        for q in pids:
            try:
                os.kill(q, sig)
            except OSError:
                pass

    send(signal.SIGTERM)
    end = time.monotonic() + grace
    while time.monotonic() < end and any(_alive(q) for q in pids):
        time.sleep(0.1)
    send(signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)  # our own child: reaped once it stops
        if done:
            return False
    except ChildProcessError:
        pass
    except OSError:
        return False
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a zombie whose parent has not reaped it yet is stopped
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def run_asv(cmd: Sequence[Any], cwd: Path, env: dict[str, str], log: Path) -> int:
    """``asv run`` with its output in ``log``; its exit status. asv runs in a session of its own, and Ctrl-C here
    stops it and everything it started (the benchmark server included) before the interrupt goes on."""
    with open(log, "w") as fh:
        p = subprocess.Popen([str(c) for c in cmd], cwd=cwd, env=env, stdout=fh, stderr=subprocess.STDOUT,
                             start_new_session=True)
        try:
            while True:
                try:
                    return p.wait(timeout=0.5)
                except subprocess.TimeoutExpired:
                    continue
        except BaseException:
            stop_tree(p.pid)
            p.wait()
            raise


def run_history(root: Path, *, machine: str = MACHINE, results: Path | None = None, commit: str | None = None,
                only: Sequence[str] = (), bench: str | None = BENCH, dry_run: bool = False,
                retry: bool = False, bridged: bool = False) -> dict[str, Any]:
    """Measure every Linux entry of ``root``'s asv.conf.json not yet finished (see the module docstring);
    returns the status. ``retry``: run the environments whose asv run failed again. ``bridged``: the bridge
    entries (:func:`gemmdrift.matrix.bridges`) instead of the others, into ``<results>/bridges`` by default, at the
    history's gemmdrift commit by default."""
    root = root.resolve()
    history = (root / "benchmarks" / "reference").resolve()
    results = (results or (history / BRIDGES if bridged else history)).resolve()
    conf = json.loads((root / "asv.conf.json").read_text())
    bridge_labels = {lab for lab, _ in bridges(conf, "linux")}
    todo = [(lab, r) for lab, r in entries(conf, "linux") if (lab in bridge_labels) == bridged]
    labels = [lab for lab, _ in todo]
    unknown = [x for x in only if x not in labels]
    if unknown and (unknown[0] in bridge_labels) != bridged:
        raise GemmdriftError(f"--only {unknown[0]}: " + ("a bridge entry: give --bridges" if not bridged else
                                                         "not a bridge entry: leave out --bridges"))
    if unknown:
        raise GemmdriftError(f"--only {unknown[0]}: no such entry (the entries: {', '.join(labels)})")
    if only:
        todo = [(lab, r) for lab, r in todo if lab in only]
    status_path = results / f"{machine}.status.json"
    status = read_status(status_path)
    if bridged and not (commit or status.get("commit")):  # the bridges split the history's pairs: its commit
        commit = read_status(history / f"{machine}.status.json").get("commit")
    commit = resolve_commit(root, commit or status.get("commit") or "HEAD")
    check_commit(status, commit, status_path)
    status.setdefault("envs", {})
    status.update(commit=commit, machine=machine)
    final = (DONE, NOT_INSTALLABLE) + (() if retry else (FAILED,))
    finished = {k for k, v in status["envs"].items() if v.get("state") in final}
    pending = [(lab, r) for lab, r in todo if lab not in finished]
    _say(f"{plural(len(todo), 'environment')} at gemmdrift {commit[:8]} on machine {machine}: "
         f"{len(todo) - len(pending)} finished before, {len(pending)} to run")
    if dry_run:
        for lab, r in pending:
            _say(f"would run {lab}: {' '.join(requirement_specs(r))}")
        return status
    if not pending:
        return status
    from ..machine.interpreter import uv_path

    uv = uv_path()
    if uv is None:
        raise GemmdriftError("uv is not installed (make env installs it in .venv)")
    work = root / WORK
    src, wheel = prepare(root, work, commit, uv)
    asv = [sys.executable, "-m", "asv"]
    _run([*asv, "machine", "--config", src / "asv.conf.json", "--machine", machine, "--yes"], cwd=src)
    env = {**os.environ, "MLX_ENABLE_TF32": "0"}
    for i, (lab, req) in enumerate(pending, 1):
        # One stable place per machine (asv names an existing environment by its interpreter's path, and the
        # result file by that name): the same release keeps its name whichever checkout runs the history.
        where = cache_dir() / "history-envs" / lab
        rec: dict[str, Any] = {"mlx": req.get("mlx"), "mlx_lm": req.get("mlx-lm")}
        t0 = time.perf_counter()
        try:
            build_env(uv, where, req, wheel)
        except GemmdriftError as e:
            rec.update(state=NOT_INSTALLABLE, reason=str(e), build_s=round(time.perf_counter() - t0, 1))
            status["envs"][lab] = rec
            write_status(status_path, status)
            _say(f"[{i}/{len(pending)}] {lab}: not installable: {e}")
            continue
        rec["build_s"] = round(time.perf_counter() - t0, 1)
        python = where / "bin" / "python"
        t1 = time.perf_counter()
        cmd = [*asv, "run", "--config", src / "asv.conf.json", "--environment", f"existing:{python}",
               "--set-commit-hash", commit, "--machine", machine, "--quick", "--show-stderr",
               *(["--bench", bench] if bench else [])]
        log = work / "logs" / f"{lab}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        returncode = run_asv(cmd, src, env, log)
        rec["run_s"] = round(time.perf_counter() - t1, 1)
        missing = parts_not_run(log.read_text(errors="replace"))
        if missing:  # recorded as not measurable, with the reason: their figures are NaN (skipped), never 0
            rec["parts_not_run"] = missing
        files = asv_result_files(src / ".asv" / "results", machine, python)
        if not files:
            rec.update(state=FAILED, reason=f"asv run exited {returncode} and wrote no results (log {log})")
        else:
            if returncode != 0:  # asv exits 2 when a benchmark failed: it is recorded as failed (null), never 0
                rec["note"] = f"asv run exited {returncode}: some benchmarks failed (log {log})"
            out = results / machine
            out.mkdir(parents=True, exist_ok=True)
            for f in files:
                shutil.copy2(f, out / f.name)
            write_machine(src / ".asv" / "results" / machine / "machine.json", out / "machine.json", machine)
            merge_benchmarks(src / ".asv" / "results" / "benchmarks.json", results / "benchmarks.json")
            rec.update(state=DONE, files=[f.name for f in files])
        rec["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        status["envs"][lab] = rec
        write_status(status_path, status)
        _say(f"[{i}/{len(pending)}] {lab}: {rec['state']} (build {rec['build_s']:.0f} s, asv run {rec['run_s']:.0f} s)"
             + (f": {rec['reason']}" if rec.get("reason") else "")
             + (f"; parts not run: {', '.join(f'{k} ({v})' for k, v in missing.items())}" if missing else ""))
    return status


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gemmdrift.history.releases",
                                description="Run the asv benchmarks for every Linux entry of asv.conf.json at one "
                                            "gemmdrift commit, one uv-built environment per release; resumable.")
    p.add_argument("--machine", default=MACHINE, help=f"asv machine name of the results (default {MACHINE})")
    p.add_argument("--results", default=None, help="results directory (default benchmarks/reference)")
    p.add_argument("--commit", default=None, help="gemmdrift commit (default: the status file's, else HEAD)")
    p.add_argument("--only", default=None, help="comma-separated entry labels (e.g. mlx0.29.4-lm0.30.2; default: "
                   "every entry)")
    p.add_argument("--bench", default=BENCH, help=f"asv's --bench regex (default {BENCH!r}: the tier and the "
                   "environment record; '': everything, the opt-in benchmarks recorded as skipped)")
    p.add_argument("--retry", action="store_true", help="run the environments whose asv run failed again")
    p.add_argument("--bridges", action="store_true", help="the bridge entries instead (mlx B with the older mlx-lm "
                   "of a pair; default results benchmarks/reference/bridges, at the history's commit)")
    p.add_argument("--dry-run", action="store_true", help="list the environments still to run, run nothing")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    root = Path.cwd()
    while not (root / "asv.conf.json").is_file():
        if root.parent == root:
            print("history: no asv.conf.json here or above", file=sys.stderr)
            return 2
        root = root.parent
    only = [x.strip() for x in (args.only or "").split(",") if x.strip()]
    if args.only is not None and not only:
        print(f"history: --only {args.only!r}: give at least one entry label (e.g. mlx0.29.4-lm0.30.2); leave "
              "--only out for every entry", file=sys.stderr)
        return 2
    try:
        status = run_history(root, machine=args.machine, results=Path(args.results) if args.results else None,
                             commit=args.commit, only=only, bench=args.bench, dry_run=args.dry_run,
                             retry=args.retry, bridged=args.bridges)
    except GemmdriftError as e:
        print(f"history: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("history: interrupted (asv and its benchmark processes stopped); run the same command again to resume",
              file=sys.stderr)
        return 130
    if args.dry_run:
        return 0
    envs = [v for k, v in status.get("envs", {}).items() if not only or k in only]  # the entries asked for
    states = [v.get("state") for v in envs]
    build, run = (sum(float(v.get(k) or 0) for v in envs) for k in ("build_s", "run_s"))
    _say(f"{states.count(DONE)} measured, {states.count(NOT_INSTALLABLE)} not installable, "
         f"{states.count(FAILED)} failed; their builds {build / 60:.1f} min and asv runs {run / 60:.1f} min in all "
         f"(the status file keeps each one's)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
