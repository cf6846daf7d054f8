"""Which commit changed it: the shipped bisections, read for the changelog's pages and its timeline (issue 55).

A bisection lives in a directory of its own under a results directory's ``bisect/`` (the shipped ones in
``benchmarks/reference/bisect/``), named for its range and what ran beside it::

    mlx-lm-v0.31.2..v0.31.3-on-mlx0.32.4      mlx-lm's commits, each installed beside mlx 0.32.4
    mlx-v0.29.4..v0.30.0-with-lm0.30.2         mlx's commits, each run with mlx-lm 0.30.2

It holds one JSON per measured commit (``<sha>.json``) and one or more answers, each the output of
``gemmdrift bisect --json`` (``answer.json``: the directory's whole range; ``answer-<A>..<B>.json``: a second
bisection inside it, its ends a tag or the first 12 digits of a commit; one whose two ends are tags,
``answer-v0.30.2..v0.30.5.json``, lies on the release line as that range, not the directory's;
``answer-<A>..<B>.<what>.json``: another figure's answer over the same ends, ``what`` a word naming it). A
directory with no answer (asv's own result set, ``asv-mlx-lm-on-mlx0.32.4``) is not a bisection. An answer's ends
are commits: each is named by its tag where the directory's name or the answer file's name gives it
(``answer.json``'s ends are the directory's tags; an answer may also carry ``good_tag``/``bad_tag``), else by its
first 12 digits.

A page's pair contains a bisection when the bisected range of its package lies inside the page's range of that
package, compared as release versions (mlx-lm 0.30.2 -> 0.31.3 contains v0.30.2..v0.30.7 and v0.31.2..v0.31.3).
A page's ranges: mlx's when the two mlx differ; mlx-lm's from the two labels, or, for bare labels, the mlx-lm
releases each machine ran the pair with. The part of a range no answer covers is "not bisected yet", or outside
the history we have (:data:`HISTORY_END`): never guessed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from ..checks import split_release
from ..errors import GemmdriftError

BISECT = "bisect"  # a results directory's sub-directory of bisections
GITHUB = "https://github.com/ml-explore"  # each project's repository: <GITHUB>/<project>
# The last tag of each history we have (the repositories `fetch` brought, /work/.mirror/ml-explore+<project>/repo,
# read with `git tag` on 2026-12-07): mlx-lm's tags end at v0.31.3; mlx's at v0.32.1 (its HEAD, 846d176, is 26
# commits later with version.h saying 0.32.2, untagged, so where 0.32.2 was cut is not known). A range that ends
# after it is outside the history: never bisected, never guessed. Read here, not from the mirror (CI has none).
HISTORY_END = {"mlx-lm": "0.31.3", "mlx": "0.32.1"}
OTHER = {"on-mlx": "mlx", "with-lm": "mlx-lm"}  # the directory name's suffix -> the package held fixed
_V = r"v\d+(?:\.\d+)*"
_DIR = re.compile(rf"(?P<project>mlx-lm|mlx)-(?P<good>{_V})\.\.(?P<bad>{_V})"
                  rf"-(?P<how>on-mlx|with-lm)(?P<other>\d+(?:\.\d+)*)")
# answer.json, answer-<A>..<B>.json, answer-<A>..<B>.<what>.json (another figure's answer over the same ends)
_ANSWER = re.compile(r"answer(?:-(?P<good>[^/]+?)\.\.(?P<bad>[^/]+?)(?:\.(?P<what>[A-Za-z][\w-]*))?)?\.json")


def vkey(version: str) -> tuple[int, ...]:
    """A release version or tag (``v0.30.2``, ``0.30.2``) as a sort key."""
    return tuple(int(x) for x in re.findall(r"\d+", str(version))[:4])


@dataclass(frozen=True)
class Answer:
    """One answer of a bisection, as the pages print it."""

    project: str  # "mlx-lm" or "mlx": whose commits were bisected
    range: tuple[str, str]  # the directory's tags ("v0.30.2", "v0.30.7"), or the answer file's when both are tags
    good: str  # the good end as it is named: its tag, else its first 12 digits
    bad: str
    ran_with: str  # what was held fixed: "mlx 0.32.4", "mlx-lm 0.30.2"
    figures: tuple[str, ...]
    changed: bool
    commits: int  # how many commits the range has
    measured: int
    skipped: tuple[str, ...]
    first: Mapping[str, Any] = field(default_factory=dict)  # commit, subject, pr, values (changed only)
    before: Mapping[str, Any] = field(default_factory=dict)  # the last commit that agrees: commit, subject, values
    candidates: tuple[str, ...] = ()  # the skipped commits the change may be at, then the first
    values: Mapping[str, Any] = field(default_factory=dict)  # both ends' values (no change only)
    where: str = ""  # the answer file, as the page names it

    def commit_link(self, sha: str) -> str:
        return f"{GITHUB}/{self.project}/commit/{sha}"

    def pr_link(self, pr: Any) -> str:
        return f"{GITHUB}/{self.project}/pull/{pr}"

    def moved(self) -> list[tuple[str, Any, Any]]:
        """(figure, before, after) for each figure whose value differs between the two neighbours."""
        a, b = dict(self.before.get("values") or {}), dict(self.first.get("values") or {})
        return [(k, a.get(k), b[k]) for k in b if not _same(a.get(k), b[k])]

    def covers(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return vkey(self.range[0]), vkey(self.range[1])


def _same(a: Any, b: Any) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)


def _fail(path: Path, why: str) -> GemmdriftError:
    return GemmdriftError(f"cannot read the bisection {path}: {why}")


def read_dir(d: Path, shown=str) -> list[Answer]:
    """The answers of one bisection directory (none when it holds no answer file); a name that does not say the
    range, or an answer that is not ``gemmdrift bisect --json``'s, raises naming the file."""
    files = sorted(p for p in d.glob("answer*.json") if _ANSWER.fullmatch(p.name))
    if not files:
        return []
    m = _DIR.fullmatch(d.name)
    if m is None:
        raise _fail(d, "the directory's name does not say its range (<project>-<tag>..<tag>-on-mlx<version>, or "
                       "mlx-<tag>..<tag>-with-lm<version>)")
    docs = {}
    for p in files:
        try:
            doc = json.loads(p.read_text())
            str(doc["good"]), str(doc["bad"]), bool(doc["changed"]), list(doc["figures"])
            if doc["changed"]:
                str(doc["first"]["commit"]), dict(doc["first"]["values"]), dict(doc["before"]["values"])
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
            raise _fail(p, f"{e.__class__.__name__}: {e}") from None
        if doc.get("project", m["project"]) != m["project"]:
            raise _fail(p, f"its project {doc.get('project')} is not the directory's ({m['project']})")
        docs[p] = doc
    tags: dict[str, str] = {}  # sha -> tag, from every answer that names its ends
    for p, doc in docs.items():
        a = _ANSWER.fullmatch(p.name)
        ends = (a["good"], a["bad"]) if a["good"] else (m["good"], m["bad"])
        for sha, name, key in zip((doc["good"], doc["bad"]), ends, ("good_tag", "bad_tag")):
            name = doc.get(key) or name
            if re.fullmatch(_V, str(name)):
                tags[str(sha)] = str(name)
    out = []
    for p, doc in docs.items():
        a = _ANSWER.fullmatch(p.name)
        own = a["good"] and all(re.fullmatch(_V, e) for e in (a["good"], a["bad"]))  # tags as ends: its own range
        out.append(Answer(
            project=m["project"], range=(a["good"], a["bad"]) if own else (m["good"], m["bad"]),
            good=tags.get(str(doc["good"]), str(doc["good"])[:12]), bad=tags.get(str(doc["bad"]), str(doc["bad"])[:12]),
            ran_with=f"{OTHER[m['how']]} {m['other']}", figures=tuple(doc["figures"]), changed=bool(doc["changed"]),
            commits=int(doc.get("commits") or 0), measured=len(doc.get("measured") or ()),
            skipped=tuple(doc.get("skipped") or ()), first=dict(doc.get("first") or {}),
            before=dict(doc.get("before") or {}), candidates=tuple(doc.get("candidates") or ()),
            values=dict(doc.get("values") or {}), where=shown(p)))
    return out


def read_bisections(dirs: Iterable[Path], shown=str) -> list[Answer]:
    """Every answer in the bisection directories under each of ``dirs`` (a missing one holds none), in the order of
    their ranges (the answer over a directory's whole range before those inside it). ``shown`` names an answer
    file as the pages print it."""
    out: list[Answer] = []
    for d in dirs:
        if Path(d).is_dir():
            for sub in sorted(p for p in Path(d).iterdir() if p.is_dir()):
                out += read_dir(sub, shown)
    # by range; in one directory, its whole range's answer first, then those inside it (a later change); over the
    # same ends, answer-<A>..<B>.json before answer-<A>..<B>.<what>.json (another figure's)
    return sorted(out, key=lambda a: (a.project, a.covers(), a.good != a.range[0], _other_figure(a.where), a.where))


def _other_figure(where: str) -> bool:
    m = _ANSWER.fullmatch(Path(where).name)
    return bool(m and m["what"])


# ------------------------------------------------------------------ a page's ranges and its bisections


def ranges_of(old: str, new: str, machines: Sequence[Mapping[str, Any]] = ()) -> list[tuple[str, str, str]]:
    """(project, from, to) for each package the pair changes: mlx when the two mlx differ; mlx-lm from the labels
    (``0.32.4+lm0.30.2``), or for a bare label the mlx-lm releases each machine ran the pair with."""
    (mo, lo), (mn, ln) = split_release(old), split_release(new)
    out = [("mlx", mo, mn)] if mo != mn else []
    if lo and ln:
        lms = [(lo, ln)]
    else:
        lms = []
        for e in machines:
            a, b = (list(e.get("mlx_lm") or []) + ["", ""])[:2]
            if a and b and "," not in a + b:
                lms.append((a, b))
    out += [("mlx-lm", a, b) for a, b in dict.fromkeys(lms) if vkey(a) < vkey(b)]
    return out


def inside(answer: Answer, project: str, a: str, b: str) -> bool:
    lo, hi = answer.covers()
    return answer.project == project and vkey(a) <= lo and hi <= vkey(b)


@dataclass
class PageBisections:
    """What a page says of its bisections: the answers inside its ranges, and each range's parts no answer covers
    (``open``: not bisected yet; ``outside``: past the history we have)."""

    answers: list[Answer]
    open: list[tuple[str, str, str]]
    outside: list[tuple[str, str, str]]

    def changed(self) -> list[Answer]:
        return [a for a in self.answers if a.changed]


def for_pair(answers: Sequence[Answer], old: str, new: str,
             machines: Sequence[Mapping[str, Any]] = ()) -> PageBisections:
    """The bisections of the pair (old, new) and the parts of its ranges none covers."""
    found: list[Answer] = []
    gaps: list[tuple[str, str, str]] = []
    outside: list[tuple[str, str, str]] = []
    for project, a, b in ranges_of(old, new, machines):
        mine = [x for x in answers if inside(x, project, a, b)]
        found += [x for x in mine if x not in found]
        end = HISTORY_END.get(project)
        at = a
        covered = {(x.range[0].lstrip("v"), x.range[1].lstrip("v")) for x in mine}
        for lo, hi in sorted(covered, key=lambda r: vkey(r[0])):
            if vkey(lo) > vkey(at):
                gaps.append((project, at, lo))
            at = max(at, hi, key=vkey)
        if vkey(at) < vkey(b):
            if end is None or vkey(b) <= vkey(end):
                gaps.append((project, at, b))
            elif vkey(at) < vkey(end):
                gaps.append((project, at, end))
                outside.append((project, end, b))
            else:
                outside.append((project, at, b))
    return PageBisections(found, gaps, outside)


__all__ = ["Answer", "PageBisections", "read_bisections", "read_dir", "for_pair", "ranges_of", "HISTORY_END",
           "BISECT", "GITHUB", "vkey"]
