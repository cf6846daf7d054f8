"""The repository bisected: a git repository (bare or not) of mlx-lm or mlx, read with git alone.

What is checked before any build (each a one-line :class:`GemmdriftError`): the path is a git repository holding
mlx-lm (``mlx_lm/__init__.py``) or mlx (``mlx/`` and ``python/src``) at HEAD; a name that is not a commit or
tag of it (the nearest tags are named); a range given backwards or of two commits that are not one line of
history. The range is ``git rev-list --first-parent --reverse good..bad`` with ``good`` in front: the commits
merged into the bad end's branch, in order.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ...errors import GemmdriftError

PR = re.compile(r"\(#(\d+)\)\s*$|^Merge pull request #(\d+)")
PROJECTS = {"mlx-lm": "https://github.com/ml-explore/mlx-lm", "mlx": "https://github.com/ml-explore/mlx"}


@dataclass(frozen=True)
class Commit:
    sha: str
    subject: str

    @property
    def pr(self) -> int | None:
        """The pull request the subject names: GitHub's squash-merge "(#1234)" at its end, or "Merge pull request #N"."""
        m = PR.search(self.subject)
        return int(m.group(1) or m.group(2)) if m else None


def git(repo: Path, *args: str, check: bool = True) -> str:
    p = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    if check and p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["no message"])[-1]
        raise GemmdriftError(f"git {' '.join(args)}: {last}")
    return p.stdout.strip() if p.returncode == 0 else ""


def _vkey(tag: str) -> tuple:
    return tuple(int(x) for x in re.findall(r"\d+", tag)[:4]) or (0,)


def tags(repo: Path) -> list[str]:
    """The repository's tags, oldest release first (by their numbers)."""
    return sorted(git(repo, "tag", "--list").split(), key=_vkey)


def nearest_tags(repo: Path, name: str) -> list[str]:
    """The tags next to ``name``: the newest below it and the oldest above it by number; for a name with no
    number, the newest three."""
    ts = tags(repo)
    if not re.search(r"\d", name):
        return ts[-3:]
    k = _vkey(name)
    below = [t for t in ts if _vkey(t) < k]
    above = [t for t in ts if _vkey(t) > k]
    return ([below[-1]] if below else []) + ([above[0]] if above else [])


def project(repo: Path) -> str:
    """``mlx-lm`` or ``mlx``: what the repository at ``repo`` holds (read at HEAD's tree)."""
    if not Path(repo).is_dir() or git(repo, "rev-parse", "--git-dir", check=False) == "":
        raise GemmdriftError(f"--repo {repo}: not a git repository (give a clone of mlx or mlx-lm)")
    files = set(git(repo, "ls-tree", "-r", "--name-only", "HEAD", "--", "mlx_lm/__init__.py", "mlx/", "python/src/",
                    check=False).splitlines())
    if "mlx_lm/__init__.py" in files:
        return "mlx-lm"
    if any(f.startswith("mlx/") for f in files) and any(f.startswith("python/src/") for f in files):
        return "mlx"
    raise GemmdriftError(f"--repo {repo}: a git repository, but not of mlx or mlx-lm (no mlx_lm/__init__.py, no "
                         f"mlx/ and python/src/ at HEAD)")


def resolve(repo: Path, name: str, flag: str) -> str:
    """The full hash of the commit ``name`` (a tag, branch or hash) names in ``repo``."""
    sha = git(repo, "rev-parse", "--verify", "--quiet", f"{name}^{{commit}}", check=False)
    if not sha:
        near = nearest_tags(repo, name)
        hint = f" (the nearest tags: {', '.join(near)})" if near else " (it has no tags)"
        raise GemmdriftError(f"{flag} {name}: not a tag or commit of {repo}{hint}")
    return sha


def commit_range(repo: Path, good: str, bad: str) -> list[Commit]:
    """The commits from ``good`` to ``bad``, both included, oldest first (see the module docstring)."""
    g, b = resolve(repo, good, "--good"), resolve(repo, bad, "--bad")
    if g == b:
        raise GemmdriftError(f"--good {good} and --bad {bad} are the same commit: a range needs two")
    if subprocess.run(["git", "-C", str(repo), "merge-base", "--is-ancestor", g, b]).returncode != 0:
        if subprocess.run(["git", "-C", str(repo), "merge-base", "--is-ancestor", b, g]).returncode == 0:
            raise GemmdriftError(f"the range is backwards: {bad} is older than {good} (give --good {bad} --bad {good})")
        raise GemmdriftError(f"--good {good} is not an ancestor of --bad {bad}: not one line of history")
    lines = git(repo, "rev-list", "--first-parent", "--reverse", "--format=%H %s", f"{g}..{b}").splitlines()
    out = [Commit(g, git(repo, "log", "-1", "--format=%s", g))]
    for line in lines:
        if line.startswith("commit "):
            continue
        sha, _, subject = line.partition(" ")
        out.append(Commit(sha, subject))
    return out


def export(repo: Path, sha: str, where: Path) -> None:
    """The tree of ``sha`` written into the empty directory ``where`` (``git archive``: no work tree needed)."""
    where.mkdir(parents=True, exist_ok=True)
    arch = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", sha], capture_output=True)
    if arch.returncode != 0:
        raise GemmdriftError(f"git archive {sha[:12]}: {arch.stderr.decode(errors='replace').strip()[-200:]}")
    subprocess.run(["tar", "-x", "-C", str(where)], input=arch.stdout, check=True)


def tag_of(repo: Path, sha: str) -> str | None:
    """The release tag at exactly ``sha`` (the newest by number when several), or None."""
    names = git(repo, "tag", "--points-at", sha, check=False).split()
    return sorted(names, key=_vkey)[-1] if names else None
