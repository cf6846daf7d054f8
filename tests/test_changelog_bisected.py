"""Which commit changed it (issue 55): the bisections shipped beside the results, on the changelog's pages, its index
and its timeline. A planted bisection directory in a tmp benchmarks tree gives a page with the commit's link, subject,
pull-request link and values; a page with no bisection says "not bisected yet"; a range past the history we have
says so, never a guess; the index and the figure mark the bisected pair."""

import json
from pathlib import Path

import pytest

from gemmdrift.changelog import bisected as B
from gemmdrift.cli.changelog import write_changelog
from gemmdrift.errors import GemmdriftError
from test_changelog import write_release

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "docs" / "changelog"
GOOD, BAD, FIRST, BEFORE = "1" * 40, "2" * 40, "3" * 40, "4" * 40
MID, SKIP = "5" * 40, "6" * 40
FIG = "TierState.track_state_bugs"


def answer(good, bad, first=None, before=None, *, pr=4242, subject="Planted cache fix (#4242)", values=(7.0, 5.0),
           skipped=(), project="mlx-lm"):
    """An answer as `gemmdrift bisect --json` writes it (a change found, or none when ``first`` is None)."""
    out = {"project": project, "good": good, "bad": bad, "commits": 20, "figures": [FIG], "changed": first is not None,
           "results": "elsewhere", "measured": [good, bad, before, first], "skipped": list(skipped)}
    if first is None:
        return {**out, "values": {FIG: values[0]}}
    return {**out, "first": {"commit": first, "subject": subject, "pr": pr, "link": "ignored",
                             "values": {FIG: values[1], "TierState.track_cases": 108.0}},
            "before": {"commit": before, "subject": "The commit before (#4241)",
                       "values": {FIG: values[0], "TierState.track_cases": 108.0}},
            "candidates": list(skipped) + [first]}


def plant(results, name, files):
    d = results / "bisect" / name
    d.mkdir(parents=True)
    (d / f"{GOOD}.json").write_text(json.dumps({"commit": GOOD, "subject": "s", "project": "mlx-lm", "mlx": "0.32.4",
                                                "parts": {}, "seconds": {}}))  # a measured commit: not an answer
    for fname, doc in files.items():
        (d / fname).write_text(json.dumps(doc))
    return d


@pytest.fixture
def lm_tree(tmp_path):
    """A tmp benchmarks tree: mlx 0.32.4 with mlx-lm 0.31.2 and 0.31.3 (the envelope moves), mlx-lm's range bisected
    twice (the whole range, and a second change inside it, with a skipped commit), and asv's own result set."""
    results = tmp_path / "benchmarks" / "reference"
    for i, lm in enumerate(("0.31.2", "0.31.3")):
        write_release(results, "m1", "0.32.4", i + 1, dlogit=(0.5, 0.5 + i), tree=1.0, rope=0.0, kld=0.0,
                      commit="abcdabcd")
        f = results / "m1" / "abcdabcd-env-0.32.4.json"
        f.rename(results / "m1" / f"abcdabcd-env-{lm}.json")
        p = results / "m1" / f"abcdabcd-env-{lm}.json"
        doc = json.loads(p.read_text())
        doc["requirements"]["mlx-lm"], doc["env_name"] = lm, f"env-{lm}"
        p.write_text(json.dumps(doc))
    plant(results, "mlx-lm-v0.31.2..v0.31.3-on-mlx0.32.4", {
        "answer.json": answer(GOOD, BAD, FIRST, BEFORE),
        f"answer-{MID[:12]}..v0.31.3.json": answer(MID, BAD, "7" * 40, "8" * 40, pr=None, subject="No PR here",
                                                   values=(5.0, 4.0), skipped=(SKIP,)),
    })
    (results / "bisect" / "asv-mlx-lm-on-mlx0.32.4" / "vm").mkdir(parents=True)  # asv's results: no answer
    return results


def test_a_planted_bisection_names_its_commit_subject_pr_and_values_on_the_page(lm_tree, tmp_path):
    out = tmp_path / "pages"
    write_changelog([lm_tree], out, predict=False, root=tmp_path)
    page = (out / "0.32.4+lm0.31.2..0.32.4+lm0.31.3.md").read_text()
    section = page.split("## Which commit changed it\n\n")[1].split("\n## ")[0]
    first, second = [line for line in section.splitlines() if line.startswith("- ")]
    assert first.startswith("- **mlx-lm v0.31.2..v0.31.3**, run with mlx 0.32.4 (`TierState.track_state_bugs`; "
                            "20 commits, 4 measured, none skipped)")
    assert (f"the first commit that changes it is [{FIRST[:12]}](https://github.com/ml-explore/mlx-lm/commit/{FIRST}) "
            '"Planted cache fix (#4242)", pull request [#4242](https://github.com/ml-explore/mlx-lm/pull/4242)') in first
    assert f'after [{BEFORE[:12]}](https://github.com/ml-explore/mlx-lm/commit/{BEFORE}) "The commit before (#4241)"' \
        in first
    assert ": `TierState.track_state_bugs` 7 → 5." in first and "track_cases" not in first  # only what moved
    assert "Stored: `benchmarks/reference/bisect/mlx-lm-v0.31.2..v0.31.3-on-mlx0.32.4/answer.json`" in first
    # The second answer: its good end is a commit inside the range (named by its digits), its bad end the tag that
    # answer.json gives that commit; one skipped commit left beside the first that differs.
    assert second.startswith(f"- **mlx-lm {MID[:12]}..v0.31.3 (inside v0.31.2..v0.31.3)**")
    assert f"the change is at one of the skipped commits [{SKIP[:12]}](https://github.com/ml-explore/mlx-lm/commit/" \
           f"{SKIP}) or at [{'7' * 12}]" in second
    assert "no pull request named" in second and "5 → 4" in second and "1 skipped" in second
    assert "not bisected" not in section  # the pair's one range is covered
    html = (out / "0.32.4+lm0.31.2..0.32.4+lm0.31.3.html").read_text()
    assert f'<a href="https://github.com/ml-explore/mlx-lm/commit/{FIRST}">{FIRST[:12]}</a>' in html
    assert '<a href="https://github.com/ml-explore/mlx-lm/pull/4242">#4242</a>' in html


def test_the_index_and_the_timeline_mark_the_bisected_pair(lm_tree, tmp_path, monkeypatch):
    import gemmdrift.view.timeline as vt

    drawn = {}
    real = vt.save_timeline
    monkeypatch.setattr(vt, "save_timeline", lambda cols, rows, path: drawn.update(rows=rows) or real(cols, rows, path))
    out = tmp_path / "pages"
    write_changelog([lm_tree], out, predict=False, root=tmp_path)
    index = (out / "index.md").read_text()
    row = next(line for line in index.splitlines() if line.startswith("| 0.32.4+lm0.31.3 |"))
    assert ("[0.32.4+lm0.31.2](0.32.4+lm0.31.2..0.32.4+lm0.31.3.md) († bisected: "
            f"[mlx-lm #4242](https://github.com/ml-explore/mlx-lm/pull/4242), [mlx-lm {'7' * 12}](https://github.com/ml-explore/"
            f"mlx-lm/commit/{'7' * 40}))") in row
    assert "† **Bisected to a commit**: see the page." in index
    (r,) = [r for r in drawn["rows"] if (r["from"], r["release"]) == ("0.32.4+lm0.31.2", "0.32.4+lm0.31.3")]
    assert r["cells"]["m1 (cpu)"]["cls"] != "BIT-FOR-BIT" and r["cells"]["m1 (cpu)"]["bisected"]
    others = [r for r in drawn["rows"] if r["from"] != "0.32.4+lm0.31.2"]  # the mlx pairs: another range
    assert others and not any(r.get("bisected") or any(c.get("bisected") for c in r["cells"].values()) for r in others)


def test_a_page_with_no_bisection_says_not_bisected_yet(tmp_path):
    results = tmp_path / "results"
    write_release(results, "m1", "0.29.4", 1, dlogit=(8.25, 0.5), tree=1.0, rope=1.0, kld=0.0)
    write_release(results, "m1", "0.30.6", 2, dlogit=(0.5, 0.5), tree=1.0, rope=0.0, kld=0.0, commit="bbbbbbbb")
    out = tmp_path / "pages"
    write_changelog([results], out, predict=False)
    page = (out / "0.29.4..0.30.6.md").read_text()
    assert "## Which commit changed it\n\nNot bisected yet: mlx 0.29.4 → 0.30.6.\n" in page
    assert "bisected" not in (out / "index.md").read_text()  # nothing marked, no footnote


def test_a_bit_for_bit_pair_has_nothing_to_bisect(tmp_path):
    """Not "not bisected yet": a pair whose figures are all equal moved nothing that a bisection could find."""
    results = tmp_path / "results"
    write_release(results, "m1", "0.30.5", 1, dlogit=(0.5, 0.5), tree=1.0, rope=0.0, kld=0.0)
    write_release(results, "m1", "0.30.6", 2, dlogit=(0.5, 0.5), tree=1.0, rope=0.0, kld=0.0)
    out = tmp_path / "pages"
    write_changelog([results], out, predict=False)
    page = (out / "0.30.5..0.30.6.md").read_text()
    assert "**Class: BIT-FOR-BIT**" in page
    assert ("## Which commit changed it\n\nNothing to bisect in mlx 0.30.5 → 0.30.6 (BIT-FOR-BIT on every machine "
            "measured).\n") in page
    assert "not bisected yet" not in page.lower()


def test_an_mlx_bisection_and_the_history_we_have(tmp_path):
    """mlx's range and mlx-lm's are each their own; what lies past the last tag of a history is outside it."""
    d = plant(tmp_path, "mlx-v0.29.4..v0.30.0-with-lm0.30.2", {"answer.json": answer(GOOD, BAD, FIRST, BEFORE,
                                                                                     project="mlx", pr=2772)})
    (mlx,) = B.read_bisections([tmp_path / "bisect"])
    assert (mlx.project, mlx.good, mlx.bad, mlx.ran_with) == ("mlx", "v0.29.4", "v0.30.0", "mlx-lm 0.30.2")
    assert mlx.commit_link(FIRST) == f"https://github.com/ml-explore/mlx/commit/{FIRST}" and mlx.where == \
        str(d / "answer.json")
    b = B.for_pair([mlx], "0.29.4", "0.30.6", [{"mlx_lm": ["0.30.2", "0.31.2"]}])
    assert b.answers == [mlx] and b.open == [("mlx", "0.30.0", "0.30.6"), ("mlx-lm", "0.30.2", "0.31.2")]
    assert B.for_pair([mlx], "0.29.3", "0.29.4").answers == []  # outside the page's range
    assert B.for_pair([mlx], "0.32.4+lm0.29.1", "0.32.4+lm0.31.3").answers == []  # another package's range
    lm = B.for_pair([], "0.32.4+lm0.31.3", "0.32.4+lm0.32.2")
    assert lm.open == [] and lm.outside == [("mlx-lm", "0.31.3", "0.32.2")]
    both = B.for_pair([], "0.31.2", "0.32.4")
    assert both.open == [("mlx", "0.31.2", B.HISTORY_END["mlx"])] and both.outside == [("mlx", "0.32.1", "0.32.4")]


def test_the_shipped_pages_name_the_shipped_bisections():
    if not (SHIPPED / "index.md").is_file():
        pytest.skip("no shipped pages yet")
    outside = (SHIPPED / "0.32.4+lm0.31.3..0.32.4+lm0.32.2.md").read_text()
    assert ("Outside the history we have, so not bisected and no commit guessed: mlx-lm 0.31.3 → 0.32.2 (mlx-lm's "
            "history here ends at tag v0.31.3).") in outside
    both = (SHIPPED / "0.32.4+lm0.30.2..0.32.4+lm0.31.3.md").read_text()
    for sha, pr, moved in (("7a86c1289ef0ae299414d5e3b886507f4350783f", 743, "44 → 48"),
                           ("25a4c8369e3c5a856a0491844eb98c3234a4cd84", 843, "48 → 46"),
                           ("a40173094136fbcbfb41966889a22530c83bd86e", 1165, "45 → 42")):
        assert f"[{sha[:12]}](https://github.com/ml-explore/mlx-lm/commit/{sha})" in both
        assert f"pull request [#{pr}](https://github.com/ml-explore/mlx-lm/pull/{pr})" in both
        assert f"`TierState.track_state_bugs` {moved}" in both
    index = (SHIPPED / "index.md").read_text()
    row = next(line for line in index.splitlines() if "(0.32.4+lm0.30.2..0.32.4+lm0.30.7.md)" in line)
    assert "(† bisected: [mlx-lm #743](https://github.com/ml-explore/mlx-lm/pull/743), [mlx-lm #843]" in row


def test_a_bisection_that_cannot_be_read_is_one_line_before_any_page(lm_tree, tmp_path, monkeypatch, capsys):
    from test_cli import gd_here

    out = tmp_path / "pages"
    plant(lm_tree, "my-bisection", {"answer.json": answer(GOOD, BAD, FIRST, BEFORE)})
    with pytest.raises(GemmdriftError, match="my-bisection: the directory's name does not say its range"):
        write_changelog([lm_tree], out, predict=False)
    (lm_tree / "bisect" / "my-bisection" / "answer.json").unlink()
    (lm_tree / "bisect" / "mlx-lm-v0.31.2..v0.31.3-on-mlx0.32.4" / "answer.json").write_text('{"good": 1}')
    r = gd_here(monkeypatch, capsys, "changelog", "--results", str(lm_tree), "--out", str(out), "--no-predict",
                load=False)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "answer.json: KeyError" in r.stderr and not out.exists()


def test_an_answer_over_many_figures_names_the_first_few_and_says_no_change():
    from gemmdrift.changelog.pages import answer_line

    figs = tuple(f"TierDivergence.track_{i}" for i in range(9))
    a = B.Answer(project="mlx-lm", range=("v0.28.0", "v0.28.4"), good="v0.28.0", bad="v0.28.4", ran_with="mlx 0.32.4",
                 figures=figs, changed=False, commits=12, measured=2, skipped=(), values={f: 1.0 for f in figs},
                 where="x/answer.json")
    line = answer_line(a)
    assert "(`TierDivergence.track_0`, " in line and "`TierDivergence.track_5` and 3 more; 12 commits, 2 measured" in line
    assert ": no change in this range (`TierDivergence.track_0` 1, " in line and "1 and 3 more at both ends)" in line


def test_an_answer_with_tags_as_ends_is_its_own_range_on_the_release_line(tmp_path):
    """answer-v0.30.2..v0.30.5.json inside mlx-lm-v0.30.2..v0.30.7's directory lies at mlx-lm 0.30.2 -> 0.30.5: the
    page of that step names it and has no gap; one with a commit as an end stays the directory's range."""
    plant(tmp_path, "mlx-lm-v0.30.2..v0.30.7-on-mlx0.32.4", {
        "answer.json": answer(GOOD, BAD, FIRST, BEFORE),
        "answer-v0.30.2..v0.30.5.json": answer(GOOD, MID, FIRST, BEFORE),
        f"answer-{MID[:12]}..v0.30.7.json": answer(MID, BAD, "7" * 40, "8" * 40),
        "answer-v0.30.2..v0.30.5.CacheList-trim.json": answer(GOOD, MID, "9" * 40, FIRST),  # another figure's
    })
    step, other, whole, late = B.read_bisections([tmp_path / "bisect"])  # by range; the count's before another's
    assert (other.range, other.first["commit"]) == (("v0.30.2", "v0.30.5"), "9" * 40)
    assert (step.good, step.bad, step.range) == ("v0.30.2", "v0.30.5", ("v0.30.2", "v0.30.5"))
    assert whole.range == late.range == ("v0.30.2", "v0.30.7") and late.good == "v0.30.5"  # MID named by the tag
    page = B.for_pair([whole, step, other, late], "0.30.1", "0.30.3", [{"mlx_lm": ["0.30.2", "0.30.5"]}])
    assert page.answers == [step, other] and page.open == [("mlx", "0.30.1", "0.30.3")]  # mlx-lm's step covered
    assert B.for_pair([whole, step, late], "0.30.3", "0.30.4", [{"mlx_lm": ["0.30.5", "0.30.7"]}]).open[1:] == \
        [("mlx-lm", "0.30.5", "0.30.7")]
