"""Issue 55 point 4, "No starred cell left": an mlx pair a machine ran with two mlx-lm releases is split at a bridge
(mlx B with the older pair's mlx-lm), each step classed on its own; where no single mlx-lm installs with both mlx
releases, the page says so and why."""

import json
import re
from pathlib import Path

import pytest

from gemmdrift.cli.changelog import write_changelog
from test_changelog import ROOT, write_release


def _release(root, mlx, lm, date, **figures):
    write_release(root, "m1", mlx, date, **figures)
    f = root / "m1" / f"aaaaaaaa-env-{mlx}.json"
    f.write_text(f.read_text().replace('"mlx-lm": "0.31.3"', f'"mlx-lm": "{lm}"'))


SAME = dict(dlogit=(0.5, 0.5), tree=1.0, rope=0.0, kld=0.0)


@pytest.fixture
def history(tmp_path):
    """The main line: 0.30.1 with mlx-lm 0.30.2, 0.30.3 with 0.30.5, 0.30.4 with 0.31.2 (every pair changes mlx-lm
    too). mlx-lm 0.30.5 moves the envelope; mlx 0.30.4 moves a summation tree."""
    root = tmp_path / "results"
    _release(root, "0.30.1", "0.30.2", 1, **SAME)
    _release(root, "0.30.3", "0.30.5", 2, **{**SAME, "dlogit": (0.5, 0.75)})
    _release(root, "0.30.4", "0.31.2", 3, **{**SAME, "dlogit": (0.5, 0.75), "tree": 2.0})
    return root


def test_a_bridge_splits_the_pair_into_mlxs_change_and_mlx_lms(history, tmp_path):
    """With the bridges 0.30.3+lm0.30.2 (the figures of 0.30.1: mlx moved nothing) and 0.30.4+lm0.30.5 (the tree
    moved, the envelope as 0.30.3's: mlx moved the tree, mlx-lm nothing), each page names whose change it was, with
    each step's class, and the index cell says it instead of "(mlx-lm X → Y too)"."""
    bridges = history / "bridges"
    _release(bridges, "0.30.3", "0.30.2", 4, **SAME)
    _release(bridges, "0.30.4", "0.30.5", 5, **{**SAME, "dlogit": (0.5, 0.75), "tree": 2.0})
    out = tmp_path / "pages"
    write_changelog([history], out, predict=False)
    lm = (out / "0.30.1..0.30.3.md").read_text()
    assert "## Whose change moved the figures" in lm
    assert "the bridge is mlx 0.30.3 with mlx-lm 0.30.2 (`bridges/`, all at gemmdrift aaaaaaaa)" in lm
    assert "- mlx 0.30.1 → 0.30.3 with mlx-lm 0.30.2: **BIT-FOR-BIT** (" in lm
    steps = re.findall(r"^- (.*)$", lm.split("## Whose change")[1].split("\n## ")[0], re.M)
    assert steps[1].startswith("mlx-lm 0.30.2 → 0.30.5 with mlx 0.30.3: **ANSWER-CHANGING** (")
    assert steps[1].endswith("; it moved `bench_stack.DecodeVsVerify.track_max_abs_dlogit[verify3]` 0.5 → 0.75)")
    assert "The bridge splits it: see \"Whose change moved the figures\"." in lm
    assert "So on m1 (cpu): **mlx-lm's change** (ANSWER-CHANGING for the pair)." in lm
    # the bridge settles mlx's range: nothing to bisect there, mlx-lm's is still to bisect
    assert ("## Which commit changed it\n\nNothing to bisect in mlx 0.30.1 → 0.30.3 (BIT-FOR-BIT with mlx-lm 0.30.2 "
            "on both sides (the bridge)); not bisected yet: mlx-lm 0.30.2 → 0.30.5.\n") in lm
    mlx = (out / "0.30.3..0.30.4.md").read_text()
    assert "- mlx 0.30.3 → 0.30.4 with mlx-lm 0.30.5: **ANSWER-CHANGING** (" in mlx
    assert "- mlx-lm 0.30.5 → 0.31.2 with mlx 0.30.4: **BIT-FOR-BIT** (" in mlx
    assert "So on m1 (cpu): **mlx's change** (ANSWER-CHANGING for the pair)." in mlx
    assert ("Nothing to bisect in mlx-lm 0.30.5 → 0.31.2 (BIT-FOR-BIT with mlx 0.30.4 on both sides (the bridge)); "
            "not bisected yet: mlx 0.30.3 → 0.30.4.") in mlx
    index = (out / "index.md").read_text()
    assert ("| 0.30.3 | [0.30.1](0.30.1..0.30.3.md) | ANSWER-CHANGING (mlx-lm's change: mlx 0.30.1 → 0.30.3 "
            "BIT-FOR-BIT, mlx-lm 0.30.2 → 0.30.5 ANSWER-CHANGING) |") in index
    assert ("| 0.30.4 | [0.30.3](0.30.3..0.30.4.md) | ANSWER-CHANGING (mlx's change: mlx 0.30.3 → 0.30.4 "
            "ANSWER-CHANGING, mlx-lm 0.30.5 → 0.31.2 BIT-FOR-BIT) |") in index
    assert " too)" not in index
    # the bridges stay apart: the history's labels and pages are the same as without them
    assert not (out / "0.30.3+lm0.30.2..0.30.3+lm0.30.5.md").exists() and "+lm" not in index


def test_without_a_bridge_the_page_says_why(history, tmp_path):
    """The bridge 0.30.3+lm0.30.2 did not install (the status file's reason), and mlx-lm 0.30.5 asks for mlx >= 0.30.3
    (its wheel's requirement), so it cannot run 0.30.1: no single mlx-lm installs with both, and the page says both
    reasons. A bridge that was never run says so too; the index keeps "(mlx-lm X → Y too)"."""
    bridges = history / "bridges"
    bridges.mkdir()
    status = {"commit": "a" * 40, "machine": "m1", "envs": {"mlx0.30.3-lm0.30.2": {
        "mlx": "0.30.3", "mlx_lm": "0.30.2", "state": "not installable", "reason": "planted: no wheel for this"}}}
    (bridges / "m1.status.json").write_text(json.dumps(status))
    out = tmp_path / "pages"
    write_changelog([history], out, predict=False)
    page = (out / "0.30.1..0.30.3.md").read_text()
    assert ("On m1 (cpu) the pair changes mlx 0.30.1 → 0.30.3 and mlx-lm 0.30.2 → 0.30.5 at once, and is not split: "
            "no single mlx-lm installs with both mlx 0.30.1 and mlx 0.30.3: mlx 0.30.3 with mlx-lm 0.30.2 not "
            "installable: planted: no wheel for this; mlx-lm 0.30.5 cannot run mlx 0.30.1: mlx-lm 0.30.5 needs "
            "mlx >= 0.30.3.") in page
    other = (out / "0.30.3..0.30.4.md").read_text()
    assert "is not split: the bridge, mlx 0.30.4 with mlx-lm 0.30.5, was not measured on this machine." in other
    index = (out / "index.md").read_text()
    assert "| 0.30.3 | [0.30.1](0.30.1..0.30.3.md) | ANSWER-CHANGING (mlx-lm 0.30.2 → 0.30.5 too) |" in index


def test_a_pair_with_one_mlx_lm_has_no_such_section(tmp_path):
    root = tmp_path / "results"
    _release(root, "0.30.5", "0.31.2", 1, **SAME)
    _release(root, "0.30.6", "0.31.2", 2, **{**SAME, "tree": 2.0})
    out = tmp_path / "pages"
    write_changelog([root], out, predict=False)
    assert "Whose change" not in (out / "0.30.5..0.30.6.md").read_text()


def test_the_mlx_lm_axis_is_a_bridge_too(tmp_path):
    """mlx 0.32.4 with mlx-lm 0.31.3 (the mlx-lm axis, in the history's own results) bridges 0.31.2 (with 0.31.3) →
    0.32.4 (with 0.32.2): the page splits the pair with it, saying where it is."""
    root = tmp_path / "results"
    _release(root, "0.31.2", "0.31.3", 1, **SAME)
    _release(root, "0.32.4", "0.31.3", 2, **SAME)
    f = root / "m1" / "aaaaaaaa-env-0.32.4.json"
    f.rename(root / "m1" / "aaaaaaaa-env-0.32.4-lm0.31.3.json")
    _release(root, "0.32.4", "0.32.2", 3, **{**SAME, "rope": 1.0})
    out = tmp_path / "pages"
    write_changelog([root], out, predict=False)
    page = (out / "0.31.2..0.32.4+lm0.32.2.md").read_text()
    assert "the bridge is mlx 0.32.4 with mlx-lm 0.31.3 (the history's results, all at gemmdrift aaaaaaaa)" in page
    assert "- mlx 0.31.2 → 0.32.4 with mlx-lm 0.31.3: **BIT-FOR-BIT** (" in page
    assert "- mlx-lm 0.31.3 → 0.32.2 with mlx 0.32.4: **ANSWER-CHANGING** (" in page
    assert "So on m1 (cpu): **mlx-lm's change**" in page


# Each bridge of the matrix (mlx B with the older pair's mlx-lm X) and the shipped pages it splits.
SHIPPED_BRIDGES = {
    ("0.29.0", "0.26.4"): ["0.28.0..0.29.0"], ("0.29.1", "0.27.1"): ["0.29.0..0.29.1"],
    ("0.29.2", "0.28.0"): ["0.29.1..0.29.2"], ("0.30.3", "0.30.2"): ["0.30.1..0.30.3"],
    ("0.30.4", "0.30.5"): ["0.30.3..0.30.4"], ("0.30.6", "0.30.2"): ["0.29.4..0.30.6"],
    ("0.31.2", "0.31.2"): ["0.31.1..0.31.2", "0.30.6..0.31.2"], ("0.32.2", "0.31.3"): ["0.32.1..0.32.2"],
    ("0.32.4", "0.31.3"): ["0.31.2..0.32.4+lm0.32.2"],  # the mlx-lm axis, in the history's own results
}
TIER = "reference-linux-cpu-tier"


def _tier_figures(where, mlx, lm):
    from gemmdrift.measure.history import read_results

    df = read_results(where)
    t = df[(df["machine"] == TIER) & (df["mlx"] == mlx) & (df["mlx_lm"] == lm) & df["benchmark"].str.startswith("bench_tier.")]
    return {(r.benchmark, r.params): r.value for r in t.itertuples()}


def test_the_shipped_pages_name_whose_change_it_was():
    """Every starred pair of the shipped history whose bridge was measured (benchmarks/reference/bridges, or the
    mlx-lm axis) names whose change moved its figures on the tier's machine, in its page and its index cell; each step
    the page calls BIT-FOR-BIT has every tier figure of its two releases equal in the raw results (and a step it
    calls anything else has one that differs), read here without the changelog. A bridge not measured yet is said."""
    import math
    import gemmdrift.matrix as matrix

    shipped, ref = ROOT / "docs" / "changelog", ROOT / "benchmarks" / "reference"
    status = ref / "bridges" / f"{TIER}.status.json"
    if not status.is_file():
        pytest.skip("no bridges shipped")
    conf = matrix.read_conf(ROOT)
    assert {(r["mlx"], r["mlx-lm"]) for _, r in matrix.bridges(conf)} == set(SHIPPED_BRIDGES) - {("0.32.4", "0.31.3")}
    measured = {(e["mlx"], e["mlx_lm"]) for e in json.loads(status.read_text())["envs"].values()
                if e["state"] == "measured"} | {("0.32.4", "0.31.3")}
    index = (shipped / "index.md").read_text()
    col = index.split("| release | from | ")[1].split(" |\n")[0].split(" | ").index(f"{TIER} (cpu)") + 2
    split = 0
    for (mlx, lm), pages in SHIPPED_BRIDGES.items():
        for name in pages:
            text = (shipped / f"{name}.md").read_text()
            section = text.split("## Whose change moved the figures\n")[1].split("\n## ")[0]
            mine = section.split(f"On {TIER} (cpu)")[1].split("\nOn ")[0]
            row = next(line.split(" | ") for line in index.splitlines() if f"]({name}.md)" in line)
            if (mlx, lm) not in measured:
                assert f"the bridge, mlx {mlx} with mlx-lm {lm}, was not measured on this machine" in mine, name
                assert row[col].strip(" |").endswith(" too)"), (name, row[col])
                continue
            split += 1
            assert f"the bridge is mlx {mlx} with mlx-lm {lm}" in mine and f"So on {TIER} (cpu): **" in mine, name
            assert " too)" not in row[col] and re.search(r"'s change|changes? moved", row[col]), (name, row[col])
            for step in re.findall(r"^- (mlx(?:-lm)? \S+ → \S+ with mlx(?:-lm)? \S+): \*\*([A-Z-]+)\*\*", mine, re.M):
                words, cls = step[0].split(), step[1]
                if words[0] == "mlx":  # mlx P → Q with mlx-lm L
                    sides = [(words[1], words[-1]), (words[3], words[-1])]
                else:  # mlx-lm P → Q with mlx M
                    sides = [(words[-1], words[1]), (words[-1], words[3])]
                figs = []
                for m_, l_ in sides:
                    where = ref / "bridges" if (m_, l_) == (mlx, lm) and (mlx, lm) != ("0.32.4", "0.31.3") else ref
                    figs.append(_tier_figures(where, m_, l_))
                both = set(figs[0]) & set(figs[1])
                differ = [k for k in both if not (figs[0][k] == figs[1][k]
                                                  or (math.isnan(figs[0][k]) and math.isnan(figs[1][k])))]
                assert both and (cls == "BIT-FOR-BIT") == (not differ), (name, step, differ[:5])
    assert split >= 2
