"""The changelog's pair line per machine, where one pair's page goes, its refusals and its mlx-lm pages (issue 53,
items 6, 10, 24, 25), on planted asv results."""

import json
from pathlib import Path

from gemmdrift.cli.changelog import PAIR_OUT, write_changelog
from test_changelog import write_release
from test_cli import gd_here

ROOT = Path(__file__).resolve().parent.parent


def two_machines(root):
    """m1 and m2 ran 0.30.6 and 0.31.2: m1 saw nothing change, m2's summation tree moved (no ladder: ANSWER-CHANGING)."""
    for i, mlx in enumerate(("0.30.6", "0.31.2")):
        write_release(root, "m1", mlx, i + 1, dlogit=(0.5, 0.5), tree=1.0, rope=0.0, kld=0.0)
        write_release(root, "m2", mlx, i + 1, dlogit=(0.5, 0.5), tree=1.0 + i, rope=0.0, kld=0.0)
    return root


def test_machines_that_disagree_give_a_class_each_and_the_pair_line_says_so(tmp_path):
    """Item 6: the page opened with the worst machine's class as the pair's (ANSWER-CHANGING) while another machine
    measured BIT-FOR-BIT; now the first line gives a class per machine and says they disagree, as does the index."""
    out = tmp_path / "pages"
    write_changelog([two_machines(tmp_path / "results")], out, predict=False)
    first = (out / "0.30.6..0.31.2.md").read_text().split("\n\n")[1]
    assert first.startswith("**Class per machine: ANSWER-CHANGING on m2 (cpu), BIT-FOR-BIT on m1 (cpu)** (the machines "
                            "disagree), mlx 0.30.6 → 0.31.2: on m2 (cpu): "), first
    assert "; on m1 (cpu): all 9 figures measured on both sides identical." in first
    assert not first.startswith("**Class: ")
    index = (out / "index.md").read_text()
    assert "| 0.31.2 | [0.30.6](0.30.6..0.31.2.md) (machines disagree) | BIT-FOR-BIT | ANSWER-CHANGING |" in index


def test_machines_that_agree_give_one_class_and_name_each_machine(tmp_path):
    root = tmp_path / "results"
    for i, mlx in enumerate(("0.30.6", "0.31.2")):
        for m in ("m1", "m2"):
            write_release(root, m, mlx, i + 1, dlogit=(0.5, 0.5), tree=1.0, rope=0.0, kld=0.0)
    out = tmp_path / "pages"
    write_changelog([root], out, pair=("0.30.6", "0.31.2"), predict=False)
    first = (out / "0.30.6..0.31.2.md").read_text().split("\n\n")[1]
    assert first.startswith("**Class: BIT-FOR-BIT**, mlx 0.30.6 → 0.31.2, measured on m1 (cpu) and m2 (cpu), the same "
                            "class on each: on m1 (cpu): all 9 figures"), first


def test_one_pairs_page_goes_to_results_changelog_not_into_the_shipped_pages(tmp_path, monkeypatch, capsys):
    """Item 10: `changelog --from A --to B` wrote its page into the checkout's docs/changelog/, which the index does
    not link (and the shipped-pages test then failed): by default it goes to results/changelog/ of the current
    directory; the whole changelog still defaults to docs/changelog/."""
    planted = two_machines(tmp_path / "results")
    monkeypatch.chdir(tmp_path)
    before = sorted(p.name for p in (ROOT / "docs" / "changelog").iterdir())
    r = gd_here(monkeypatch, capsys, "changelog", "--results", str(planted), "--from", "0.30.6", "--to", "0.31.2",
                "--no-predict", load=False)
    assert r.returncode == 0, r.stderr
    assert PAIR_OUT == "results/changelog"
    assert (tmp_path / "results" / "changelog" / "0.30.6..0.31.2.md").is_file()
    assert (tmp_path / "results" / "changelog" / "0.30.6..0.31.2.html").is_file()
    assert sorted(p.name for p in (ROOT / "docs" / "changelog").iterdir()) == before
    assert "results/changelog/0.30.6..0.31.2.md" in r.stdout


def test_a_refusal_is_one_line_with_the_default_results(tmp_path, monkeypatch, capsys):
    """Item 24: with the default results, a refusal printed "no asv results in .asv/results: the committed reference
    results ..." first, then the error: the refusal is its one line alone."""
    monkeypatch.chdir(tmp_path)
    r = gd_here(monkeypatch, capsys, "changelog", "--from", "0.29.4", "--to", "0.77.1", "--no-predict", load=False)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown release 0.77.1" in lines[0], r.stderr
    assert not (tmp_path / "results").exists()


def test_an_mlx_lm_page_speaks_of_mlx_lm(tmp_path):
    """Item 25: pages of pairs where only mlx-lm changed said "may be mlx-lm's as well as mlx's" and "mlx 0.32.4,
    0.32.4 is newer than the source read", as if mlx had changed."""
    root = tmp_path / "results"
    for i, lm in enumerate(("0.31.2", "0.31.3")):
        write_release(root, "m1", "0.32.4", i + 1, dlogit=(0.5, 0.5), tree=1.0 + i, rope=0.0, kld=0.0,
                      commit="aaaaaaaa")
        f = root / "m1" / "aaaaaaaa-env-0.32.4.json"
        doc = json.loads(f.read_text())
        doc["requirements"]["mlx-lm"] = lm
        doc["env_name"] = f"env-0.32.4-lm{lm}"
        f.unlink()
        (root / "m1" / f"aaaaaaaa-env-0.32.4-lm{lm}.json").write_text(json.dumps(doc))
    out = tmp_path / "pages"
    write_changelog([root], out, pair=("0.32.4+lm0.31.2", "0.32.4+lm0.31.3"), cache=tmp_path / "replayed.json")
    page = (out / "0.32.4+lm0.31.2..0.32.4+lm0.31.3.md").read_text()
    assert page.startswith("# mlx-lm 0.31.2 → 0.31.3 with mlx 0.32.4: what changed in the bits")
    assert "The pair changes mlx-lm alone (mlx-lm 0.31.2 → 0.31.3, mlx 0.32.4 on both sides)" in page
    assert "as well as mlx's" not in page and "mlx 0.32.4, 0.32.4" not in page and "between mlx 0.32.4 and 0.32.4" \
        not in page
    assert "Nothing to predict: mlx 0.32.4 on both sides" in page


def test_history_and_gate_refusals_are_one_line_with_the_default_results(tmp_path, monkeypatch, capsys):
    """Item 24, its twin in `gate` and `history`: with the default results, "gemmdrift gate: no asv results in
    .asv/results: the committed reference results ..." came first, then the error."""
    monkeypatch.chdir(tmp_path)
    for args in (("gate", "--candidate", "0.77.1"), ("history", "--include", "no such figure", "--out",
                                                      str(tmp_path / "h"))):
        r = gd_here(monkeypatch, capsys, *args, load=False)
        assert r.returncode == 2, (args, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "committed reference results" not in lines[0], (args, r.stderr)
    r = gd_here(monkeypatch, capsys, "gate", "--candidate", "0.30.0", "--baseline", "0.29.4", load=False)
    assert r.returncode == 0 and "committed reference results" in r.stderr  # said, once the work is done
