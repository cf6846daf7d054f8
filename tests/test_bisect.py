"""gemmdrift bisect (issue 55): the search, and a planted mlx-lm repository whose figure changes at one known commit."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gemmdrift.history import bisect as B
from gemmdrift.history.bisect import gitrepo
from gemmdrift.history.bisect.search import SKIP, EndSkipped, first_change, same
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
        assert ("measured_at" in rec) == (i != BROKEN)  # when (asv's started_at)
    # resumed: nothing is measured or built again
    n = len(calls)
    b2 = B.bisect(planted, "v0.0.0", "v0.0.7", FIGS, results=res, runner=runner)
    assert len(calls) == n and b2.outcome.first == CHANGE


def test_a_cached_environment_is_layered_over_this_interpreter_again(planted, cache):
    """An environment made by a checkout that is gone (its .pth names a removed worktree's site-packages) lacked
    numpy and every other dependency, and the measurement failed: it is layered over this interpreter again."""
    from gemmdrift.history.bisect import commits as C

    sha = gitrepo.commit_range(planted, "v0.0.0", "v0.0.7")[0].sha
    python = C.python_of(planted, "mlx-lm", sha)
    (pth,) = python.parent.parent.glob(f"lib/python*/site-packages/{C.BASE_PTH}")
    pth.write_text("import site; site.addsitedir('/nonexistent/removed-worktree/site-packages')\n")
    probe = [str(python), "-c", "import numpy, mlx_lm"]
    assert subprocess.run(probe, capture_output=True).returncode != 0  # the stale layer: no numpy
    assert C.python_of(planted, "mlx-lm", sha) == python  # cached, not built again
    assert subprocess.run(probe, capture_output=True).returncode == 0


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
    from gemmdrift.history.bisect import commits as C
    from gemmdrift.history.bisect import figures as F
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


# ---------------------------------------------------------------- a planted mlx repository, built by --build

MLX_CHANGE = 2  # the mlx commit whose kernel rounds differently
MLX_BROKEN = 1  # this commit's build fails


@pytest.fixture(scope="module")
def planted_mlx(tmp_path_factory):
    """A tiny 'mlx' (mlx/ and python/src/, as mlx's tree has them) whose mlx.core.VALUE changes at commit 2; commit 1's
    build script fails. The --build command copies the tree's package into the commit's environment."""
    repo = tmp_path_factory.mktemp("planted") / "mlx"
    (repo / "mlx").mkdir(parents=True)
    (repo / "python" / "src").mkdir(parents=True)
    (repo / "python" / "src" / "core.cpp").write_text("// bindings\n")
    _git(repo, "init", "-q", "-b", "main")
    for i in range(5):
        (repo / "mlx" / "core.py").write_text(f"VALUE = {'2.0' if i >= MLX_CHANGE else '1.0'}\n")
        (repo / "mlx" / "__init__.py").write_text(f"# commit {i}\n")
        (repo / "build.sh").write_text("echo compiling; exit 1\n" if i == MLX_BROKEN else
                                       'site=$("$GEMMDRIFT_PYTHON" -c "import sysconfig; print(sysconfig.get_paths()'
                                       '[\'purelib\'])")\ncp -r "$GEMMDRIFT_SRC/mlx" "$site/"\n')
        _git(repo, "add", "-A")
        _git(repo, "commit", "-q", "-m", f"kernel {i} (#{200 + i})")
        if i in (0, 4):
            _git(repo, "tag", f"v0.99.{i}")
    return repo


def mlx_runner(python, parts):
    p = subprocess.run([str(python), "-c", "import json, mlx.core as c; print(json.dumps([c.VALUE, c.__file__]))"],
                       capture_output=True, text=True, check=True)
    value, where = json.loads(p.stdout)
    assert "/bisect/envs/mlx-" in where  # the commit's own build, not this interpreter's mlx
    return {"plant": {"value": value}, "_mlx": {"version": "0.9", "file": where}}


def _installed_lm():
    from importlib.metadata import version

    return version("mlx-lm")


def test_planted_mlx_repository_builds_each_commit_and_bisects(planted_mlx, cache):
    """An mlx repository is bisected through the user's --build command: the commit whose build fails is skipped and
    marked "does not build", the change is found exactly, and every record names the mlx-lm that ran the tier."""
    lm = _installed_lm()  # already installed: nothing is downloaded
    b = B.bisect(planted_mlx, "v0.99.0", "v0.99.4", FIGS, results=cache / "m", runner=mlx_runner,
                 build="bash build.sh", mlx_lm=lm)
    shas = [c.sha for c in b.range]
    assert b.project == "mlx" and b.build.mlx_lm == lm
    assert b.outcome.changed and b.outcome.first == MLX_CHANGE and b.outcome.before == 0
    assert b.outcome.skipped == [MLX_BROKEN] and not b.outcome.exact
    out = B.text(b)
    assert f"with mlx-lm {lm}" in out and "kernel 2 (#202)" in out and "1 -> 2" in out
    assert f"skipped commits {shas[MLX_BROKEN][:12]}" in out
    broken = json.loads((cache / "m" / f"{shas[MLX_BROKEN]}.json").read_text())
    assert broken["skipped"].startswith("does not build: the build command exited 1: compiling")
    good = json.loads((cache / "m" / f"{shas[0]}.json").read_text())
    assert good["mlx_lm"] == lm and good["mlx"] == f"built from {shas[0][:12]}"
    assert f"mlx-{shas[0][:12]}-lm{lm}" in good["mlx_imported"]["file"]  # which mlx the worker imported, recorded
    logs = cache / "cache" / "bisect" / "logs"
    assert (logs / f"mlx-{shas[MLX_BROKEN][:12]}-lm{lm}.log").read_text().strip() == "compiling"


def test_a_build_that_does_not_install_mlx_is_a_commit_that_does_not_build(planted_mlx, cache):
    """A build command that exits 0 but leaves no mlx in the commit's environment must not be measured with this
    interpreter's mlx underneath (it would read the installed release's bits as the commit's)."""
    with pytest.raises(GemmdriftError, match="did not install mlx into"):
        B.bisect(planted_mlx, "v0.99.0", "v0.99.4", FIGS, results=cache / "m2", runner=mlx_runner, build="true",
                 mlx_lm=_installed_lm())


def test_a_build_whose_library_lies_outside_its_environment_does_not_build(tmp_path, monkeypatch):
    """mlx's bindings once kept a RUNPATH naming the build directory: every cached environment then loaded the libmlx
    of whichever commit was built last. Such a build is refused (the check reads the library the process loaded)."""
    from gemmdrift.history.bisect import commits as C

    py = tmp_path / "env" / "bin" / "python"
    outside = subprocess.CompletedProcess([], 0, f"{tmp_path}/env/lib/mlx/core.so\n/build/tree/libmlx.so\n", "")
    inside = subprocess.CompletedProcess([], 0, f"{tmp_path}/env/lib/mlx/core.so\n{tmp_path}/env/lib/libmlx.so\n", "")
    real = subprocess.run
    for got, ok in ((outside, False), (inside, True)):
        monkeypatch.setattr(C.subprocess, "run", lambda cmd, *a, _g=got, **k: _g if cmd[:2] == [str(py), "-c"] else
                            real(cmd, *a, **k))
        build = C.Build("true", "0.30.2")
        if ok:
            C._build_mlx(tmp_path, py, "abc", build, tmp_path / "log")
        else:
            with pytest.raises(GemmdriftError, match="loads /build/tree/libmlx.so, outside its environment"):
                C._build_mlx(tmp_path, py, "abc", build, tmp_path / "log")


@pytest.mark.parametrize("kw,words", [
    ({}, "is mlx: give --build CMD"),
    ({"build": "no-such-builder --fast"}, "no-such-builder is not a command here"),
    ({"build": "bash 'unclosed"}, "No closing quotation"),
    ({"build": "bash build.sh", "mlx_lm": "latest"}, "--mlx-lm latest: not a release number"),
    ({"build": "bash build.sh"}, "--good v0.99.0 is not a release the matrix pairs"),
])
def test_mlx_refusals_are_one_line_before_any_build(planted_mlx, cache, kw, words):
    with pytest.raises(GemmdriftError, match=re.escape(words)) as e:
        B.plan(planted_mlx, "v0.99.0", "v0.99.4", FIGS, **kw)
    assert "\n" not in str(e.value)
    assert not (cache / "cache" / "bisect").exists()


def test_build_flags_are_refused_for_mlx_lm(planted):
    with pytest.raises(GemmdriftError, match="--build is for an mlx repository"):
        B.plan(planted, "v0.0.0", "v0.0.7", FIGS, build="bash x.sh")
    with pytest.raises(GemmdriftError, match="--mlx-lm is for an mlx repository"):
        B.plan(planted, "v0.0.0", "v0.0.7", FIGS, mlx_lm="0.30.2")


def test_the_mlx_lm_defaults_to_the_matrix_pairing_of_the_good_end(tmp_path):
    """mlx 0.29.4 ran with mlx-lm 0.30.2 in the history (asv.conf.json): a bisection from v0.29.4 uses it."""
    from gemmdrift.history.bisect import _build_for

    assert _build_for("mlx", tmp_path, "v0.29.4", "bash b.sh", None).mlx_lm == "0.30.2"
    # an mlx-lm that cannot run the good end's mlx is refused, naming the matrix's pairing (mlx-lm 0.32.2 needs a
    # newer mlx than 0.29.4)
    with pytest.raises(GemmdriftError, match="--mlx-lm 0.32.2 cannot run mlx 0.29.4.*pairs mlx 0.29.4 with mlx-lm 0.30.2"):
        _build_for("mlx", tmp_path, "v0.29.4", "bash b.sh", "0.32.2")


# ---------------------------------------------------------------- the ends against the shipped release results


def test_an_end_is_checked_against_the_shipped_release_result_bit_for_bit():
    """The shipped history ran mlx 0.32.4 with mlx-lm 0.31.3: 42 STATE BUG cases (benchmarks/reference). An end that
    measured 42 agrees; one that measured 42 + 2**-40 (a last-bit change) is named with both values."""
    from gemmdrift.history.bisect import shipped

    ok = shipped.check_end("mlx-lm", "v0.31.3", {"TierState.track_state_bugs": 42.0}, None, "0.32.4")
    assert ok == {"pair": "mlx0.32.4-lm0.31.3", "same": ["TierState.track_state_bugs"], "differ": []}
    bad = shipped.check_end("mlx-lm", "v0.31.3", {"TierState.track_state_bugs": 42.0 + 2**-40}, None, "0.32.4")
    assert bad["differ"] == [("TierState.track_state_bugs", 42.0 + 2**-40, 42.0)]
    line = shipped.describe("--bad", "ed1fca4cef15aa", bad)
    assert "1 of 1 figures differ from the shipped mlx0.32.4-lm0.31.3 result" in line and "42.0 shipped" in line
    # an mlx tag runs with the --mlx-lm release: mlx 0.29.4 with mlx-lm 0.30.2 is in the history (1 flip)
    m = shipped.check_end("mlx", "v0.29.4", {"TierDecodeVsVerify.track_flips": 1.0}, "0.30.2", "0.32.4")
    assert m["pair"] == "mlx0.29.4-lm0.30.2" and m["same"] == ["TierDecodeVsVerify.track_flips"]
    assert "no result of mlx 0.29.4 with mlx-lm 0.26.4" in shipped.check_end("mlx", "v0.29.4", {}, "0.26.4", "x")["none"]
    assert shipped.check_end("mlx", None, {}, "0.30.2", "x") == {"none": "not a release tag"}
    assert shipped.figure_name("bench_tier.TierStateCases.track_non_exact", "KVCache/rollback") == \
        "TierStateCases.track_non_exact[KVCache/rollback]"


def test_the_command_checks_both_ends(planted, cache, capsys, monkeypatch):
    """The planted ends are tags of no release the history ran: the answer says there is nothing to check against."""
    from gemmdrift.history.bisect import figures as F
    from gemmdrift.cli import main

    monkeypatch.setattr(F, "wanted", lambda figure, root=F.ROOT: FIGS)
    monkeypatch.setitem(B.bisect.__kwdefaults__, "runner", plant_runner)
    assert main(["bisect", "--repo", str(planted), "--good", "v0.0.0", "--bad", "v0.0.7", "--figure", "x",
                 "--results", str(cache / "r")]) == 0
    out = capsys.readouterr().out
    assert "--good " in out and "no shipped result to check against (the history has no result of mlx" in out
    assert "with mlx-lm 0.0.7)" in out


# ---------------------------------------------------------------- asv over mlx's own commits: the build step

ASV_BUILD = Path(B.__file__).parent / "asv_build.py"


@pytest.fixture()
def asv_env(tmp_path):
    """An empty environment, as asv makes one, and a tiny mlx tree."""
    from gemmdrift.machine.interpreter import uv_path

    d = tmp_path
    subprocess.run([uv_path(), "venv", "--quiet", "--python", sys.executable, d / "env"], check=True)
    (d / "tree" / "mlx").mkdir(parents=True)
    (d / "tree" / "mlx" / "__init__.py").write_text("")
    (d / "tree" / "mlx" / "core.py").write_text("VALUE = 3.0\n")
    return d


def _asv_build(d, build, **env):
    import sysconfig

    e = {k: v for k, v in os.environ.items() if not k.startswith("GEMMDRIFT_")}
    e.update(GEMMDRIFT_MLX_BUILD=build, GEMMDRIFT_MLX_LM=_installed_lm(),
             GEMMDRIFT_BASE_SITE=sysconfig.get_paths()["purelib"], **env)
    return subprocess.run([str(d / "env" / "bin" / "python"), str(ASV_BUILD), str(d / "tree")], env=e,
                          capture_output=True, text=True)


def test_asv_build_runs_the_users_command_into_asvs_environment(asv_env):
    """asv.mlx.conf.json's build step: the command builds the commit's tree into asv's environment, which is then
    layered over gemmdrift's site-packages; mlx.core must load from the environment itself."""
    copy = ('site=$("$GEMMDRIFT_PYTHON" -c "import sysconfig; print(sysconfig.get_paths()[\'purelib\'])")\n'
            'cp -r "$GEMMDRIFT_SRC/mlx" "$site/"')
    p = _asv_build(asv_env, copy)
    assert p.returncode == 0, p.stderr
    got = subprocess.run([str(asv_env / "env" / "bin" / "python"), "-c",
                          "import mlx.core as c, numpy; print(c.VALUE, c.__file__)"], capture_output=True, text=True)
    value, where = got.stdout.split()
    assert value == "3.0" and where.startswith(str(asv_env / "env"))  # the build's, and numpy from the layer


def test_asv_build_fails_a_commit_whose_build_fails_or_installs_nothing(asv_env):
    assert _asv_build(asv_env, "exit 4").returncode == 1
    p = _asv_build(asv_env, "true")
    assert p.returncode == 1 and "did not install mlx into" in p.stderr
    e = {k: v for k, v in os.environ.items() if not k.startswith("GEMMDRIFT_")}
    p = subprocess.run([sys.executable, str(ASV_BUILD), "x"], env=e, capture_output=True, text=True)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "set GEMMDRIFT_MLX_BUILD" in p.stderr


def test_asv_mlx_conf_runs_the_build_step_by_path():
    root = Path(B.__file__).parents[4]
    conf = json.loads((root / "asv.mlx.conf.json").read_text())
    assert conf["build_command"] == ["python {conf_dir}/src/gemmdrift/history/bisect/asv_build.py {build_dir}"]
    assert Path(conf["build_command"][0].split()[1].format(conf_dir=root)) == ASV_BUILD  # the step asv runs is this one
    assert conf["repo"] == ".asv/mlx.git" and conf["benchmark_dir"] == "benchmarks"


def test_asv_build_reads_the_library_as_the_command_does():
    """The two copies of the check (asv_build.py imports no gemmdrift) must stay one check."""
    import importlib.util

    from gemmdrift.history.bisect import commits as C

    spec = importlib.util.spec_from_file_location("asv_build", ASV_BUILD)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.WHERE == C._WHERE

def test_command_json_writes_a_figure_not_measured_as_null(planted, cache, capsys, monkeypatch):
    """``--figure any`` run for real (mlx-lm v0.27.1 -> v0.28.4): figures not measured at a commit (a cache operation
    that cannot run yet) are NaN, and ``--json`` printed them as ``NaN``, which is not JSON (a strict reader
    refuses it). Not measured is ``null``, as every other JSON file of gemmdrift writes it."""
    from gemmdrift.history.bisect import commits as C
    from gemmdrift.history.bisect import figures as F
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
