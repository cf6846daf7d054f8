"""Bisection: which commit of mlx-lm or mlx changed a figure of the tracking tier (issue 55).

The flow, one way:

* **what is measured**: a figure of the tracking tier (:mod:`.figures`: asv's benchmark name, or ``any`` answer
  figure), read from the one tier part that computes it (``TierState.track_state_bugs`` -> the ``state`` part);
  only the parts the figures need are run;
* **over what**: the commits of a git repository of mlx-lm or mlx from a good end to a bad end (:mod:`.gitrepo`:
  ``git rev-list --first-parent``), each installed into its own cached environment (:mod:`.commits`): an mlx-lm
  commit beside this mlx; an mlx commit built by the user's ``--build`` command, run with one mlx-lm release;
* **how**: :func:`.search.first_change` bisects to the first commit whose value differs from the good end's;
  a commit that does not install is skipped and marked, and the search goes on (``git bisect skip``);
* **stored**: one JSON per commit in the results directory, written after every part; a commit measured before
  is read, never measured again, so Ctrl-C loses only the part under way; at the end, every measured commit of
  the directory as asv's own results JSON too, under ``<results>/asv/`` (:mod:`.asv_json`).

gemmdrift ships no recipe that builds mlx (how to compile a commit of it is the ``--build`` command's business); it
exports each commit's tree, runs the command, checks that the environment's ``mlx.core`` is the built one, and
marks a commit whose build fails as skipped.
"""

from __future__ import annotations

import math
import re
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ...errors import GemmdriftError
from . import asv_json, commits, figures, gitrepo
from .worker import NOT_RUN
from .search import SKIP, EndSkipped, Outcome, first_change, same


@dataclass
class Bisection:
    """A bisection's answer: the range, the figures, the search's outcome and every commit's record."""

    project: str
    repo: Path
    range: list[gitrepo.Commit]
    figures: dict[str, tuple[str, str]]
    outcome: Outcome
    records: dict[str, dict[str, Any]] = field(default_factory=dict)
    results: Path | None = None
    build: commits.Build | None = None

    def value(self, i: int) -> Any:
        return self.outcome.values.get(i)


def _build_for(project: str, repo: Path, good: str, build: str | None, mlx_lm: str | None) -> commits.Build | None:
    """The checks of ``--build`` and ``--mlx-lm``: both belong to an mlx repository, and it needs the command; the
    mlx-lm release defaults to the one asv.conf.json's matrix pairs with the good end's release."""
    if project == "mlx-lm":
        if build or mlx_lm:
            flag = "--build" if build else "--mlx-lm"
            raise GemmdriftError(f"{flag} is for an mlx repository; --repo {repo} is mlx-lm, whose commits are "
                                 "installed as they are and run with the installed mlx")
        return None
    if not build or not build.strip():
        raise GemmdriftError(f"--repo {repo} is mlx: give --build CMD, a command that builds the commit's tree "
                             "($GEMMDRIFT_SRC) and installs it into $GEMMDRIFT_PYTHON's environment (gemmdrift "
                             "ships no recipe that builds mlx; see docs/bisect.md)")
    try:
        words = [w for w in shlex.split(build) if not re.match(r"^[A-Za-z_]\w*=", w)]  # VAR=value assignments
    except ValueError as e:
        raise GemmdriftError(f"--build {build!r}: {e}") from None
    prog = words[0] if words else ""
    if not (shutil.which(prog) or Path(prog).is_file() or prog in _SHELL_WORDS):
        raise GemmdriftError(f"--build {build!r}: {prog} is not a command here")
    from ... import matrix

    pairs = matrix.main_line(matrix.read_conf())
    tag = good.lstrip("v")
    if mlx_lm is None:
        if tag not in pairs:
            raise GemmdriftError(f"--good {good} is not a release the matrix pairs with an mlx-lm: give --mlx-lm "
                                 "VERSION, the mlx-lm release that runs the tier on every commit")
        mlx_lm = pairs[tag]
    if not re.fullmatch(r"\d+(\.\d+)+", mlx_lm):
        raise GemmdriftError(f"--mlx-lm {mlx_lm}: not a release number (e.g. 0.30.2)")
    if re.fullmatch(r"\d+(\.\d+)+", tag):  # the good end is a release: its mlx-lm must be able to run it
        matrix.check_pair(tag, mlx_lm, pairs)
    return commits.Build(build, mlx_lm)


_SHELL_WORDS = {"exec", "env", "cd", "set", "export", ":"}


def plan(repo: str | Path, good: str, bad: str, figure: str | dict[str, tuple[str, str]], *,
         build: str | None = None, mlx_lm: str | None = None):
    """Every check before any build: (project, the commits, the figures, the parts, the mlx build or None)."""
    repo = Path(repo).expanduser()
    project = gitrepo.project(repo)
    figs = figures.wanted(figure) if isinstance(figure, str) else dict(figure)
    rng = gitrepo.commit_range(repo, good, bad)
    how = _build_for(project, repo, good, build, mlx_lm)
    return project, rng, figs, figures.parts_of(figs), how


def bisect(repo: str | Path, good: str, bad: str, figure: str | dict[str, tuple[str, str]], *,
           results: Path | None = None, runner: commits.Runner = commits.tier_runner,
           say: Callable[[str], None] = lambda s: None, build: str | None = None,
           mlx_lm: str | None = None) -> Bisection:
    """The first commit of ``good..bad`` at which the figure(s) change (see the module docstring)."""
    project, rng, figs, parts, how = plan(repo, good, bad, figure, build=build, mlx_lm=mlx_lm)
    repo = Path(repo).expanduser()
    results = Path(results) if results else commits.default_results(project, how)
    with_lm = f" with mlx-lm {how.mlx_lm}" if how else ""
    say(f"{project} {good}..{bad}{with_lm}: {len(rng)} commits; measuring {', '.join(parts)}; results in {results}")
    records: dict[str, dict[str, Any]] = {}

    def measure(i: int) -> Any:
        c = rng[i]
        rec = commits.measure(repo, project, c, parts, results, runner=runner, say=say, build=how)
        records[c.sha] = rec
        if rec.get("skipped"):
            return SKIP
        cannot = [p for p in parts if NOT_RUN in (rec["parts"].get(p) or {})]
        if cannot:  # this commit cannot run a part the figure needs: not decided either way
            return SKIP
        return figures.read(figs, rec["parts"])

    try:
        outcome = first_change(len(rng), measure)
    except EndSkipped as e:
        c = rng[e.index]
        rec = records.get(c.sha, {})
        why = rec.get("skipped") or "; ".join(f"{p} cannot run: {v[NOT_RUN]}" for p, v in rec.get("parts", {}).items()
                                               if isinstance(v, dict) and NOT_RUN in v)
        end = "--good" if e.index == 0 else "--bad"
        if rec.get("skipped"):  # not kept: an end that does not install (no network, a missing build tool) is retried
            (results / f"{c.sha}.json").unlink(missing_ok=True)
        raise GemmdriftError(f"{end} {c.sha[:12]} cannot be measured ({why}): choose another end") from None
    asv_json.write(results, repo)
    return Bisection(project, repo, rng, figs, outcome, records, results, how)


def _fmt(v: float) -> str:
    if isinstance(v, float) and math.isnan(v):
        return "not measured"
    return f"{v:g}" if isinstance(v, float) and v == int(v) else repr(v)  # every bit of a non-integer


def link(project: str, c: gitrepo.Commit) -> str:
    base = gitrepo.PROJECTS.get(project, "")
    return f"{base}/pull/{c.pr}" if c.pr and base else (f"{base}/commit/{c.sha}" if base else c.sha)


def text(b: Bisection) -> str:
    """The answer in words: the first commit that changes the figures, with the values on each side."""
    o, rng = b.outcome, b.range
    n_skip = sum(1 for r in b.records.values() if r.get("skipped"))
    with_lm = f" with mlx-lm {b.build.mlx_lm}" if b.build else ""
    head = (f"{b.project} {rng[0].sha[:12]}..{rng[-1].sha[:12]}{with_lm} ({len(rng)} commits): "
            f"{len(o.measured)} measured, {n_skip} skipped")
    if not o.changed:
        vals = b.value(0)
        shown = "; ".join(f"{k} {_fmt(v)}" for k, v in list(vals.items())[:6])
        more = f" (and {len(vals) - 6} more)" if len(vals) > 6 else ""
        return f"{head}\nno change in this range: {shown}{more} at both ends"
    before, first = rng[o.before], rng[o.first]
    a, z = b.value(o.before), b.value(o.first)
    moved = [k for k in a if not same(a[k], z[k])]
    lines = [head]
    if o.skipped:
        cands = ", ".join(rng[i].sha[:12] for i in o.skipped)
        lines.append(f"the first change is at one of the skipped commits {cands} or at:")
    else:
        lines.append("first change:")
    pr = f" (PR #{first.pr}: {link(b.project, first)})" if first.pr else f" ({link(b.project, first)})"
    lines.append(f"  {first.sha} {first.subject}{pr}")
    lines.append(f"  after {before.sha[:12]} {before.subject}")
    for k in moved:
        lines.append(f"  {k}: {_fmt(a[k])} -> {_fmt(z[k])}")
    return "\n".join(lines)


__all__ = ["Bisection", "bisect", "plan", "text", "link"]
