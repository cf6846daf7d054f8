"""gemmdrift bisect (issue 55): the search, and a planted mlx-lm repository whose figure changes at one known commit."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from gemmdrift import bisect as B
from gemmdrift.bisect import gitrepo
from gemmdrift.bisect.search import SKIP, EndSkipped, first_change, same
from gemmdrift.errors import GemmdriftError


def _counting(values):
    seen = []

    def measure(i):
        seen.append(i)
        return values[i]

    return measure, seen


@pytest.mark.parametrize("n,at", [(2, 1), (3, 1), (3, 2), (15, 7), (15, 14), (15, 1), (64, 33)])
def test_first_change_finds_the_one_commit(n, at):
    values = [45.0] * at + [42.0] * (n - at)
    measure, seen = _counting(values)
    o = first_change(n, measure)
    assert o.changed and o.first == at and o.before == at - 1 and o.exact
    assert len(seen) == len(set(seen))  # never measures a commit twice
    assert len(seen) <= 2 + math.ceil(math.log2(n)) + 1


def test_first_change_no_change_when_the_ends_agree():
    measure, seen = _counting([{"x": 1.0}] * 3 + [{"x": 2.0}] + [{"x": 1.0}] * 4)
    o = first_change(8, measure)
    assert not o.changed and seen == [0, 7]


def test_first_change_goes_around_skipped_commits():
    values = [1.0, 1.0, SKIP, 1.0, SKIP, 2.0, 2.0, 2.0]
    o = first_change(len(values), _counting(values)[0])
    assert o.changed and o.first == 5 and o.before == 3 and o.skipped == [4] and not o.exact
    values = [1.0, SKIP, SKIP, 2.0]
    o = first_change(4, _counting(values)[0])
    assert (o.first, o.before, o.skipped) == (3, 0, [1, 2])
    o = first_change(5, _counting([1.0, 1.0, SKIP, 1.0, 2.0])[0])
    assert (o.first, o.before, o.skipped) == (4, 3, [])


def test_first_change_refuses_an_end_that_cannot_be_measured():
    with pytest.raises(EndSkipped):
        first_change(3, _counting([SKIP, 1.0, 2.0])[0])


def test_same_is_bit_for_bit():
    assert same({"a": math.nan}, {"a": math.nan}) and not same({"a": 0.0}, {"a": math.nan})
    assert not same(1.0, 1.0 + 2**-40)


def test_pull_request_from_the_subject():
    assert gitrepo.Commit("x", "Fix trim of rotating cache (#812)").pr == 812
    assert gitrepo.Commit("x", "Merge pull request #77 from a/b").pr == 77
    assert gitrepo.Commit("x", "version bump").pr is None


# ---------------------------------------------------------------- the planted repository

CHANGE = 5  # the commit whose rounding differs: 1.0 + 2**-30 from here on
ROUNDING = {i: "1.0" if i < CHANGE else "1.0 + 2**-30" for i in range(8)}
BROKEN = 3  # this commit's setup.py does not run: it does not install
FIGS = {"Plant.track_value": ("plant", "value")}


def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                   env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin"})


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """A tiny 'mlx_lm' whose value (a rounding) changes at commit 5 (PR #105); commit 3 does not install."""
    repo = tmp_path_factory.mktemp("planted") / "mlx-lm"
    (repo / "mlx_lm").mkdir(parents=True)
    _git(repo, "init", "-q", "-b", "main")
    for i, expr in ROUNDING.items():
        (repo / "mlx_lm" / "__init__.py").write_text(f"VALUE = {expr}\n")
        setup = "from setuptools import setup\nsetup(name='mlx-lm', version='0.0.%d', packages=['mlx_lm'])\n" % i
        (repo / "setup.py").write_text("raise SystemExit('broken on purpose')\n" if i == BROKEN else setup)
        _git(repo, "add", "-A")
        _git(repo, "commit", "-q", "-m", f"change {i} (#{100 + i})")
        if i in (0, 7):
            _git(repo, "tag", f"v0.0.{i}")
    return repo


def plant_runner(python, parts):
    """The planted package's figure, read in the commit's own interpreter (as the tier worker does)."""
    p = subprocess.run([str(python), "-c", "import json, mlx_lm; print(json.dumps({'plant': {'value': mlx_lm.VALUE},"
                        " 'file': mlx_lm.__file__}))"], capture_output=True, text=True, check=True)
    out = json.loads(p.stdout)
    assert "/bisect/envs/" in out["file"]  # the commit's own mlx_lm, not this interpreter's
    return {"plant": out["plant"]}


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GEMMDRIFT_CACHE", str(tmp_path / "cache"))
    return tmp_path


def test_planted_repository_bisects_to_the_known_commit(planted, cache):
    calls = []

    def runner(python, parts):
        calls.append(Path(python).parent.parent.name)
        return plant_runner(python, parts)

    res = cache / "results"
    b = B.bisect(planted, "v0.0.0", "v0.0.7", FIGS, results=res, runner=runner)
    shas = [c.sha for c in b.range]
    assert len(shas) == 8
    assert b.outcome.changed and b.outcome.first == CHANGE and b.outcome.exact
    assert BROKEN in b.outcome.measured and b.value(BROKEN) is SKIP  # tried, skipped, and the search went on
    out = B.text(b)
    assert f"{shas[CHANGE]} change 5 (#105)" in out and "PR #105" in out and "1 -> 1.0000000009313226" in out
    # every measured commit is one JSON; the broken one is marked skipped when it was tried
    files = {p.stem for p in res.glob("*.json")}
    assert files == {shas[i] for i in b.outcome.measured}
    for i in b.outcome.measured:
        rec = json.loads((res / f"{shas[i]}.json").read_text())
        assert ("skipped" in rec) == (i == BROKEN)
    # resumed: nothing is measured or built again
    n = len(calls)
    b2 = B.bisect(planted, "v0.0.0", "v0.0.7", FIGS, results=res, runner=runner)
    assert len(calls) == n and b2.outcome.first == CHANGE


def test_planted_repository_skips_the_commit_that_does_not_install(planted, cache):
    shas = [c.sha for c in gitrepo.commit_range(planted, "v0.0.0", "v0.0.7")]
    b = B.bisect(planted, shas[2], shas[5], FIGS, results=cache / "r2", runner=plant_runner)
    # commits 2, 3, 4, 5: 3 (tried first) does not install; the change is at 5 and found exactly
    assert b.outcome.exact and b.range[b.outcome.first].sha == shas[CHANGE]
    assert json.loads((cache / "r2" / f"{shas[3]}.json").read_text())["skipped"].startswith("does not install")


def test_planted_repository_no_change(planted, cache):
    b = B.bisect(planted, "v0.0.0", "HEAD~3", FIGS, results=cache / "r3", runner=plant_runner)
    assert not b.outcome.changed and "no change in this range" in B.text(b)


@pytest.mark.parametrize("good,bad,words", [
    ("v0.0.9", "v0.0.7", "--good v0.0.9: not a tag or commit of"),
    ("v0.0.7", "v0.0.0", "the range is backwards"),
])
def test_bad_ranges_are_one_line(planted, good, bad, words):
    with pytest.raises(GemmdriftError, match=words) as e:
        B.plan(planted, good, bad, FIGS)
    assert "\n" not in str(e.value)
    if "v0.0.9" in good:
        assert "the nearest tags: v0.0.7" in str(e.value)


def test_not_a_repository_of_mlx_lm(tmp_path):
    with pytest.raises(GemmdriftError, match="not a git repository"):
        B.plan(tmp_path, "a", "b", FIGS)
    _git(tmp_path, "init", "-q")
    (tmp_path / "x.py").write_text("1\n")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-q", "-m", "x")
    with pytest.raises(GemmdriftError, match="not of mlx or mlx-lm"):
        B.plan(tmp_path, "HEAD", "HEAD", FIGS)


def test_a_figure_the_tier_does_not_track():
    with pytest.raises(GemmdriftError, match="does not track it .*TierState.track_state_bugs"):
        B.figures.wanted("TierState.track_nothing")
    assert B.figures.wanted("bench_tier.TierState.track_state_bugs") == {
        "TierState.track_state_bugs": ("state", "state_bugs")}
    assert B.figures.parts_of(B.figures.wanted("TierStateCases.track_non_exact[KVCache/rollback]")) == ["state"]


# ---------------------------------------------------------------- the command


@pytest.mark.parametrize("argv,words", [
    (["--good", "v0.0.9", "--bad", "v0.0.7", "--figure", "TierState.track_state_bugs"],
     "--good v0.0.9: not a tag or commit of"),
    (["--good", "v0.0.7", "--bad", "v0.0.0", "--figure", "TierState.track_state_bugs"], "the range is backwards"),
    (["--good", "v0.0.0", "--bad", "v0.0.7", "--figure", "TierState.track_nothing"], "does not track it"),
])
def test_command_refuses_bad_input_in_one_line_before_any_build(planted, cache, capsys, argv, words):
    """Bad input is one line and exit 2, and nothing is built or measured (no environment, no result)."""
    from gemmdrift.cli import main

    assert main(["bisect", "--repo", str(planted), *argv, "--results", str(cache / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err
    assert not (cache / "r").exists() and not (cache / "cache" / "bisect").exists()


def test_command_refuses_a_path_that_is_not_mlx_lm(tmp_path, capsys):
    from gemmdrift.cli import main

    assert main(["bisect", "--repo", str(tmp_path), "--good", "a", "--bad", "b", "--figure", "any"]) == 2
    assert capsys.readouterr().err.strip().endswith("not a git repository (give a clone of mlx or mlx-lm)")


def test_command_prints_the_first_commit(planted, cache, capsys, monkeypatch):
    """The command's answer: the planted commit, its PR and both values (the tier's runner replaced by the plant's)."""
    from gemmdrift.bisect import commits as C
    from gemmdrift.bisect import figures as F
    from gemmdrift.cli import main

    monkeypatch.setattr(F, "wanted", lambda figure, root=F.ROOT: FIGS)
    monkeypatch.setattr(C, "tier_runner", plant_runner)
    monkeypatch.setitem(B.bisect.__kwdefaults__, "runner", plant_runner)
    assert main(["bisect", "--repo", str(planted), "--good", "v0.0.0", "--bad", "v0.0.7", "--figure", "x",
                 "--results", str(cache / "r"), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    shas = [c.sha for c in gitrepo.commit_range(planted, "v0.0.0", "v0.0.7")]
    assert out["changed"] and out["first"]["commit"] == shas[CHANGE] and out["first"]["pr"] == 105
    assert out["before"]["values"] == {"Plant.track_value": 1.0}
    assert out["first"]["values"] == {"Plant.track_value": 1.0 + 2**-30}
    assert shas[BROKEN] in out["skipped"]


def test_a_figure_named_cannot_run_is_not_a_part_that_failed(planted, cache):
    """The state part's figure ``cannot_run`` (a count of cases) once read as 'this part could not run': every commit
    was skipped and the good end refused."""

    def runner(python, parts):
        got = plant_runner(python, parts)
        return {"plant": {**got["plant"], "cannot_run": 4.0}}

    b = B.bisect(planted, "v0.0.0", "v0.0.7", FIGS, results=cache / "r4", runner=runner)
    assert b.outcome.exact and b.outcome.first == CHANGE


def test_an_end_that_does_not_install_is_one_line_and_not_kept(planted, cache):
    """An end that does not install (e.g. offline, a build tool missing) is refused, and its failure is not stored: a
    rerun tries it again rather than refusing forever."""
    shas = [c.sha for c in gitrepo.commit_range(planted, "v0.0.0", "v0.0.7")]
    with pytest.raises(GemmdriftError, match=f"--bad {shas[BROKEN][:12]} cannot be measured .does not install"):
        B.bisect(planted, "v0.0.0", shas[BROKEN], FIGS, results=cache / "r5", runner=plant_runner)
    assert not (cache / "r5" / f"{shas[BROKEN]}.json").exists() and (cache / "r5" / f"{shas[0]}.json").exists()


def test_command_json_writes_a_figure_not_measured_as_null(planted, cache, capsys, monkeypatch):
    """``--figure any`` run for real (mlx-lm v0.27.1 -> v0.28.4): figures not measured at a commit (a cache operation
    that cannot run yet) are NaN, and ``--json`` printed them as ``NaN``, which is not JSON (a strict reader
    refuses it). Not measured is ``null``, as every other JSON file of gemmdrift writes it."""
    from gemmdrift.bisect import commits as C
    from gemmdrift.bisect import figures as F
    from gemmdrift.cli import main

    figs = {**FIGS, "Plant.track_absent": ("plant", "absent")}  # the runner never gives 'absent': NaN on both sides
    monkeypatch.setattr(F, "wanted", lambda figure, root=F.ROOT: figs)
    monkeypatch.setattr(C, "tier_runner", plant_runner)
    monkeypatch.setitem(B.bisect.__kwdefaults__, "runner", plant_runner)
    assert main(["bisect", "--repo", str(planted), "--good", "v0.0.0", "--bad", "v0.0.7", "--figure", "any",
                 "--results", str(cache / "r6"), "--json"]) == 0

    def refuse(name):
        raise AssertionError(f"{name} is not JSON")

    out = json.loads(capsys.readouterr().out, parse_constant=refuse)
    assert out["before"]["values"] == {"Plant.track_value": 1.0, "Plant.track_absent": None}
    assert out["first"]["values"] == {"Plant.track_value": 1.0 + 2**-30, "Plant.track_absent": None}
