"""The numerics changelog (issue 30): a planted release pair built by hand covers every section, an empty change
and a changed tree; bad input is one line, exit 2; the shipped pages are what the command writes."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gemmdrift import changelog as cl
from gemmdrift.changelog import pages as view
from gemmdrift.measure import history
from gemmdrift.cli.changelog import write_changelog
from gemmdrift.changelog.predicted import Predictor
from gemmdrift.errors import GemmdriftError
from test_history import COLUMNS, entry  # asv 0.6's result columns and one result entry, as history reads them

ROOT = Path(__file__).resolve().parent.parent


def write_release(root, machine, mlx, date, *, dlogit, tree, rope, kld, layer=0.01, commit="aaaaaaaa"):
    """One asv result file of a release with a drift figure, a layer figure, a summation tree, an op probe row,
    a golden-logit KLD and an emulated control."""
    d = root / machine
    d.mkdir(parents=True, exist_ok=True)
    (d / "machine.json").write_text(json.dumps({"machine": machine, "version": 1}))
    results = {
        "bench_env.track_mlx_version": entry(history.encode_version(mlx)),
        "bench_env.track_backend": entry(0.0),
        "bench_stack.DecodeVsVerify.track_max_abs_dlogit": entry(list(dlogit), [["'verify2'", "'verify3'"]]),
        "bench_stack.DecodeVsVerifyLayers.track_rel_l2": entry([0.0, layer], [["'verify2'"], ["'layer 0'", "'layer 1'"]]),
        "bench_fingerprint.Fingerprint.track_tree_id_t1": entry([tree, 77.0],
                                                                [["'matmul:bfloat16'", "'matmul:float32'"]]),
        "bench_kernels.OpsDrift.track_bits_lost": entry([rope, 0.0], [["'rope'", "'sdpa'"]]),
        "bench_golden.GoldenLogits.track_kld_mean": entry([kld], [["'decode'"]]),
        "bench_kernels.KernelDrift.track_bits_lost": entry([5.0, 3.0 + date], [["'emulated:splitk4'"], ["1", "2"]]),
    }
    doc = {"commit_hash": commit * 5, "env_name": f"env-{mlx}", "date": date, "params": {"machine": machine},
           "python": "3.11", "requirements": {"mlx": mlx, "mlx-lm": "0.31.3"}, "env_vars": {},
           "result_columns": COLUMNS, "results": results, "durations": {}, "version": 2}
    (d / f"{commit}-env-{mlx}.json").write_text(json.dumps(doc))


@pytest.fixture
def planted(tmp_path):
    """0.29.4 -> 0.30.6: the envelope falls, a tree changes, RoPE's probe row goes to 0 bits, the golden KLD falls;
    0.30.6 -> 0.31.2: nothing changes."""
    root = tmp_path / "results"
    write_release(root, "m1", "0.29.4", 1, dlogit=(8.25, 0.5), tree=4660.0, rope=15.0, kld=0.02, layer=0.04)
    write_release(root, "m1", "0.30.6", 2, dlogit=(0.4375, 0.5), tree=4661.0, rope=0.0, kld=0.005, commit="bbbbbbbb")
    write_release(root, "m1", "0.31.2", 3, dlogit=(0.4375, 0.5), tree=4661.0, rope=0.0, kld=0.005, commit="cccccccc")
    return root


def test_measured_section_lists_every_change_with_its_ratio_and_counts_the_rest(planted):
    df = history.read_results(planted)
    m = cl.measured(df, "0.29.4", "0.30.6")
    (e,) = m.machines
    # 2 dlogit + 2 layers + 2 trees + 2 probe rows + 1 golden; the emulated control is not an mlx kernel
    assert e["compared"] == 9
    changed = {(r["benchmark"].rpartition(".")[2], r["params"]): (r["old"], r["new"], r["ratio"]) for r in e["changed"]}
    assert changed == {("track_max_abs_dlogit", "verify2"): (8.25, 0.4375, 0.4375 / 8.25),
                       ("track_rel_l2", "verify2, layer 1"): (0.04, 0.01, 0.01 / 0.04)}
    assert e["trees"] == [{"path": "matmul:bfloat16", "T": "T=1", "old": f"{4660:x}", "new": f"{4661:x}"}]
    assert [(r["params"], r["old"], r["new"]) for r in e["probe"]] == [("rope", 15.0, 0.0)]
    assert [(r["old"], r["new"]) for r in e["golden"]] == [(0.02, 0.005)]
    assert e["identical"] == 9 - 2 - 1 - 1 - 1
    text = view.markdown(view.measured_blocks(m))
    assert "4 of 9 drift figures identical, 5 changed" in text
    assert "| 8.25 | 0.4375 | ×0.053 |" in text  # 0.4375 / 8.25 = 0.0530...
    assert "`matmul:bfloat16` | T=1 | `1234` | `1235`" in text
    assert "`bench_kernels.OpsDrift.track_bits_lost[rope]` | 15 | 0 |" in text


def test_an_empty_change_is_stated_and_counted(planted):
    m = cl.measured(history.read_results(planted), "0.30.6", "0.31.2")
    text = view.markdown(view.measured_blocks(m) + view.ops_blocks(m, []))
    assert "No drift figure changed: 9 of 9 drift figures identical" in text
    assert "Nothing to attribute: no drift figure changed." in text
    assert "| figure |" not in text.split("Golden")[0]  # nothing listed, only counted


def test_default_pairs_and_release_names(planted):
    df = history.read_results(planted)
    pairs = cl.default_pairs(df)
    assert ("0.29.4", "0.30.6") in pairs and ("0.30.6", "0.31.2") in pairs
    assert ("0.32.0", "0.32.1") in pairs  # dispatch read, no results: predictions only
    # a release known only by its dispatch sits between its measured neighbours, and the measured pair stays
    assert ("0.29.4", "0.30.5") in pairs and ("0.30.5", "0.30.6") in pairs and ("0.30.5", "0.31.2") not in pairs
    with pytest.raises(GemmdriftError, match=r"unknown release 0\.99\.0: no results \(the nearest releases with "
                                             r"results: 0\.31\.2 \(before\)\).* \(known: 0\.29\.4, .*0\.31\.2"):
        cl.resolve("0.99.0", df, "--to")
    with pytest.raises(GemmdriftError, match=r"0\.29\.4 \(before\) and 0\.30\.6 \(after\)"):
        cl.resolve("0.30.3", df, "--from")


def test_every_page_opens_with_its_class_and_one_line_reason(planted, tmp_path):
    out = tmp_path / "pages"
    write_changelog([planted], out, predict=False)
    first = lambda name: (out / name).read_text().split("\n\n")[1]
    # the planted 0.29.4 -> 0.30.6 moves drift figures but flips no argmax and has no precision ladder: not
    # shown to be roundoff, so answer-changing, saying why
    moved = first("0.29.4..0.30.6.md")
    assert moved.startswith("**Class: ANSWER-CHANGING**, mlx 0.29.4 → 0.30.6, measured on m1 (cpu): ")
    assert "no precision ladder verdict" in moved and "\n" not in moved
    assert first("0.30.6..0.31.2.md").startswith("**Class: BIT-FOR-BIT**, mlx 0.30.6 → 0.31.2, measured on m1 (cpu): "
                                                 "all 9 figures measured on both sides identical")
    assert first("0.29.4..0.30.5.md").startswith("**Class: none**")  # neither measured nor predicted (--no-predict)
    # the two commits are named where a pair was measured at two
    assert "Measured at two gemmdrift commits (0.29.4: aaaaaaaa, 0.30.6: bbbbbbbb)" in (out / "0.29.4..0.30.6.md").read_text()


def test_the_page_names_the_op_from_the_release_comparison(planted, tmp_path):
    ops = tmp_path / "ops"
    ops.mkdir()
    (ops / "x.json").write_text(json.dumps({
        "from": {"mlx": "0.29.4", "mlx_lm": "0.30.2"}, "to": {"mlx": "0.30.6", "mlx_lm": "0.30.2"}, "compared": 40,
        "positions": "297-300", "machine": "m1",
        "changed": [{"op": "self_attn.rope", "layer": 0, "frac_differ": 0.25, "max_ulp": 3.0},
                    {"op": "self_attn.rope", "layer": 1, "frac_differ": 0.5, "max_ulp": 2.0},
                    {"op": "sdpa", "layer": 1, "frac_differ": 0.1, "max_ulp": 1.0}]}))
    (ops / "other.json").write_text(json.dumps({"from": {"mlx": "0.31.2"}, "to": {"mlx": "0.32.4"}, "compared": 1,
                                                "changed": []}))
    out = tmp_path / "pages"
    write_changelog([planted], out, pair=("0.29.4", "0.30.6"), ops_dirs=[ops], predict=False)
    text = (out / "0.29.4..0.30.6.md").read_text()
    assert "in forward order: `self_attn.rope`, `sdpa`." in text
    assert "| 0 | `self_attn.rope` | 0-1 | 0.5 | 3 |" in text
    assert "No counterfactual ran" in text
    html = (out / "0.29.4..0.30.6.html").read_text()
    assert "<code>self_attn.rope</code>" in html and '<a href="index.html">' in html


def test_predicted_section_names_gemv_wide_on_m3_m4_and_says_prediction(tmp_path):
    cache = tmp_path / "replayed.json"
    p = Predictor(cache=cache)
    rows = p.differences("0.32.0", "0.32.1")
    # The known answer (issue 30): the embedded Gemma's dense q_proj (K=640, N=1024) on M3 / M4 class chips.
    dense = [r for r in rows if r["model"] == "gemma3-270m" and r["weights"] == "bf16" and "q_proj" in r["ops"]
             and "M3" in r["chips"]]
    ts = sorted(t for r in dense for t in r["T"])
    assert ts == list(range(2, 16))
    assert all(r["old"] == "steel GEMM" and r["new"].startswith("gemv_wide") for r in dense)
    assert {"M3", "M4", "M3 Max", "M4 Max"} <= set(dense[0]["chips"]) and "M1" not in dense[0]["chips"]
    assert not p.differences("0.31.2", "0.31.2")
    # Envelopes come from the cache, keyed by the chip's plan signature: a planted entry is shown, labelled.
    for rel, dl in (("0.32.0", 0.375), ("0.32.1", 0.0625)):
        p._cache[f"M3|{p.signature('M3', rel)}"] = {"verify:2": {"max_abs_dlogit": dl, "max_abs_dgap": 0.0,
                                                                 "flips": 0.0}, "verify:3": {
            "max_abs_dlogit": dl, "max_abs_dgap": 0.0, "flips": 0.0}}
    assert p.signature("M3", "0.32.0") != p.signature("M3", "0.32.1")
    assert p.signature("M1", "0.32.0") == p.signature("M1", "0.32.1")  # M1 dispatches alike: one replay serves both
    text = view.markdown(p.blocks("0.32.0", "0.32.1"))
    assert "| M3 | verify:2 | 0.375 / 0 / 0 | 0.0625 / 0 / 0 |" in text
    for para in text.split("\n\n")[1:]:
        if not para.startswith("|"):
            assert "prediction" in para.lower(), para
    # Each row names the mlx commit whose rule moved it, with links (issue 54).
    assert all(r["rules"] == ["gemv_wide"] for r in dense)
    assert ("| [0ebcee8db](https://github.com/ml-explore/mlx/commit/0ebcee8db) metal: add gemv_wide for fp16/bf16 "
            "matmuls of a few rows ([#3888](https://github.com/ml-explore/mlx/pull/3888)) |") in text
    qmv = [r for r in p.differences("0.31.2", "0.32.0") if r["new"] == "qmv_wide"]
    assert qmv and all(r["rules"] == ["qmv_wide"] and not {"M1", "M2"} & set(r["chips"]) for r in qmv)
    assert any("M3" in r["chips"] for r in qmv)
    assert "[#3764](https://github.com/ml-explore/mlx/pull/3764)" in view.markdown(p.blocks("0.31.2", "0.32.0"))
    # The predicted class per chip: the replay reorders the same adds, so a move is ROUNDOFF; a replayed argmax
    # flip that changes is ANSWER-CHANGING; a chip whose kernels do not change is BIT-FOR-BIT.
    from gemmdrift.changelog.predicted import chip_class

    assert chip_class(p, "M3", "0.32.0", "0.32.1")["cls"] == "ROUNDOFF"
    assert "[#3888](https://github.com/ml-explore/mlx/pull/3888)" in chip_class(p, "M3", "0.32.0", "0.32.1")["reason"]
    assert chip_class(p, "M3", "0.32.0", "0.32.1")["cell"].startswith(  # the timeline's cell names the PRs too
        "ROUNDOFF ([#3888](https://github.com/ml-explore/mlx/pull/3888)")
    assert "rounding by construction" in chip_class(p, "M3", "0.32.0", "0.32.1")["reason"]
    p._cache[f"M3|{p.signature('M3', '0.32.1')}"]["verify:2"]["flips"] = 2.0
    flip = chip_class(p, "M3", "0.32.0", "0.32.1")
    assert flip["cls"] == "ANSWER-CHANGING" and flip["reason"].startswith("replayed: argmax flips changed: verify:2/flips 0 → 2")
    assert chip_class(p, "sm90", "0.32.0", "0.32.1")["cls"] == "BIT-FOR-BIT"  # no dispatch row, no replay needed
    assert chip_class(p, "M5", "0.32.0", "0.32.1")["cell"] == "not replayed"  # kernels change, nothing cached
    # A release older than the first tag read is "not read", never "not knowable" (issue 54).
    old = chip_class(p, "M3", "0.26.3", "0.26.5")
    assert old["cell"] == "not read" and "older than the first tag read (0.26.5)" in old["reason"]
    assert chip_class(p, "M3", "0.32.4+lm0.30.2", "0.32.4+lm0.31.3")["cell"] == "-"  # mlx-lm's change


def _cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "gemmdrift", "changelog", *args], capture_output=True, text=True,
                          cwd=cwd)


def test_bad_input_is_one_line_exit_2(planted, tmp_path, monkeypatch, capsys):
    from test_cli import gd_here

    def _cli(*args):  # in this process: a refusal needs no process of its own (each cost about 0.7 s)
        return gd_here(monkeypatch, capsys, "changelog", *args, load=False)

    out = str(tmp_path / "o")
    r = _cli("--results", str(planted), "--from", "0.29.4", "--to", "0.77.1", "--out", out, "--no-predict")
    assert r.returncode == 2 and "known: 0.29.4" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "the nearest releases with results: 0.31.2 (before)" in r.stderr
    r = gd_here(monkeypatch, capsys, "gate", "--results", str(planted), "--candidate", "0.30.0", load=False)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "no results for 0.30.0 (the nearest releases with results: 0.29.4 (before) and 0.30.6 (after)" in r.stderr
    write_release(planted, "m2", "0.33.0", 4, dlogit=(1, 1), tree=1.0, rope=0, kld=0, commit="dddddddd")
    r = _cli("--results", str(planted), "--from", "0.31.2", "--to", "0.33.0", "--out", out, "--no-predict")
    assert r.returncode == 2 and "no machine in common" in r.stderr and "m1 (cpu)" in r.stderr and "m2 (cpu)" in r.stderr
    bad = planted / "m1" / "eeeeeeee-env-x.json"
    bad.write_text("{not json")
    r = _cli("--results", str(planted), "--out", out, "--no-predict")
    assert r.returncode == 2 and "eeeeeeee-env-x.json" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    bad.unlink()
    twice = planted / "m1" / "ffffffff-env-0.30.6.json"  # 0.30.6 measured again at another gemmdrift commit
    twice.write_text((planted / "m1" / "bbbbbbbb-env-0.30.6.json").read_text().replace("bbbbbbbb", "ffffffff"))
    for args in (("changelog", "--results", str(planted), "--out", out, "--no-predict"),
                 ("gate", "--results", str(planted))):
        r = gd_here(monkeypatch, capsys, *args, load=False)
        assert r.returncode == 2 and "mix gemmdrift commits bbbbbbbb and ffffffff for release 0.30.6" in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
    twice.unlink()
    r = _cli("--results", str(tmp_path / "missing"), "--out", out, "--no-predict")
    assert r.returncode == 2 and "missing" in r.stderr
    ops = tmp_path / "ops"
    ops.mkdir()
    (ops / "broken.json").write_text("[1]")
    r = _cli("--results", str(planted), "--ops", str(ops), "--out", out, "--no-predict")
    assert r.returncode == 2 and "broken.json" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not Path(out).exists()  # nothing written before every input was read


def test_the_index_is_a_timeline_of_classes_with_its_figure(planted, tmp_path):
    out = tmp_path / "pages"
    write_changelog([planted], out, predict=False)
    index = (out / "index.md").read_text()
    assert "| release | from | m1 (cpu) |" in index
    assert "| 0.31.2 | [0.30.6](0.30.6..0.31.2.md) | BIT-FOR-BIT |" in index
    assert "| 0.30.6 | [0.29.4](0.29.4..0.30.6.md) | ANSWER-CHANGING |" in index
    assert "| 0.30.6 | [0.30.5](0.30.5..0.30.6.md) | not measured |" in index  # 0.30.5: dispatch read, no results
    assert "| 0.29.4 | - | first |" in index
    assert index.index("| 0.31.2 |") < index.index("| 0.29.4 |")  # newest first
    assert "![the timeline of classes](timeline.png)" in index
    png = (out / "timeline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert '<img src="timeline.png"' in (out / "index.html").read_text()
    for link in re.findall(r"\]\(([^)]+\.md)\)", index):
        assert (out / link).is_file() and (out / (link[:-3] + ".html")).is_file()


def test_shipped_pages_are_what_the_command_writes(tmp_path):
    shipped = ROOT / "docs" / "changelog"
    if not (shipped / "index.md").is_file():
        pytest.skip("no shipped pages yet")
    out = tmp_path / "pages"
    write_changelog([ROOT / "benchmarks" / "reference"], out, ops_dirs=[ROOT / cl.OPS_DIR], root=ROOT,
                    cache=shipped / "replayed.json")
    made = sorted(p.name for p in out.iterdir())
    have = sorted(p.name for p in shipped.iterdir() if p.suffix in (".md", ".html", ".png"))
    assert made == have, "`make changelog` writes other pages than docs/changelog/ holds"
    for name in made:
        assert (out / name).read_bytes() == (shipped / name).read_bytes(), f"docs/changelog/{name} is stale: make changelog"


def test_shipped_reference_pages_state_the_known_answers():
    shipped = ROOT / "docs" / "changelog"
    if not (shipped / "index.md").is_file():
        pytest.skip("no shipped pages yet")
    text = (shipped / "0.29.4..0.30.6.md").read_text()
    assert "`bench_stack.DecodeVsVerify.track_max_abs_dlogit[verify2]` | 8.281 | 0.4375 |" in text
    for pair in ("0.30.6..0.31.2", "0.31.2..0.32.4+lm0.32.2"):
        assert "No drift figure changed: 263 of 263 drift figures identical" in (shipped / f"{pair}.md").read_text()
    assert "in forward order: `self_attn.rope`." in text  # the release comparison of ops (mlx fast.cpp's RoPE)
    assert text.split("\n\n")[1].startswith("**Class: ANSWER-CHANGING**, mlx 0.29.4 → 0.30.6, measured on "
                                            "reference-linux-cpu (cpu) and reference-linux-cpu-tier (cpu), the same "
                                            "class on each: on reference-linux-cpu (cpu) (and there mlx-lm 0.30.2 → "
                                            "0.31.2): argmax flips changed")
    assert "The op that moved: `self_attn.rope`" in text.split("\n\n")[1]
    for pair in ("0.30.6..0.31.2", "0.31.2..0.32.4+lm0.32.2"):
        # BIT-FOR-BIT on the reference machine; the tracking tier's state sweep (more cache operations) sees the
        # mlx-lm release that changes with these pairs too (0.31.2 -> 0.31.3, 0.31.3 -> 0.32.2): no one class for
        # the pair, a class per machine, the line says they disagree and names the state figure that decided it
        paras = (shipped / f"{pair}.md").read_text().split("\n\n")
        assert "reference-linux-cpu (cpu): BIT-FOR-BIT;" in paras[2]
        assert paras[1].startswith("**Class per machine: ANSWER-CHANGING on reference-linux-cpu-tier (cpu), "
                                   "BIT-FOR-BIT on reference-linux-cpu (cpu)** (the machines disagree), mlx ")
        assert "on reference-linux-cpu-tier (cpu) (and there mlx-lm " in paras[1]
        assert "state verdicts changed: bench_tier.TierState.track_state_bugs" in paras[1]
    # the tier paired 0.30.6 with mlx-lm 0.31.2 and 0.31.2 with 0.31.3: the bare labels hide it, the page says it
    tier = (shipped / "0.30.6..0.31.2.md").read_text()
    assert "(and there mlx-lm 0.31.2 → 0.31.3)" in tier.split("\n\n")[1]
    assert "On this machine the pair changes mlx-lm too (mlx-lm 0.31.2 → 0.31.3)" in tier
    lm = (shipped / "0.32.4+lm0.30.2..0.32.4+lm0.31.3.md").read_text().split("\n\n")[1]
    assert lm.startswith("**Class: ANSWER-CHANGING**, for mlx-lm's change (mlx-lm 0.30.2 → 0.31.3, mlx 0.32.4 on both "
                         "sides), measured on reference-linux-cpu (cpu) and reference-linux-cpu-tier (cpu), the same "
                         "class on each: on reference-linux-cpu (cpu): state verdicts changed: ") and "170 → 166" in lm
    index = (shipped / "index.md").read_text()
    bisected = r"(?: \(† bisected: [^|]+\))?"  # a pair bisected to its commits names them (issue 55)
    # the tier's cell split at its bridge (mlx 0.30.6 with mlx-lm 0.30.2, issue 55): both changes moved figures
    assert re.search(r"\| 0\.30\.6 \| \[0\.29\.4\]\(0\.29\.4\.\.0\.30\.6\.md\)" + bisected + r" \| ANSWER-CHANGING "
                     r"\(mlx-lm 0\.30\.2 → 0\.31\.2 too\) \| ANSWER-CHANGING \(both changes moved figures: mlx 0\.29\.4 → "
                     r"0\.30\.6 ANSWER-CHANGING, mlx-lm 0\.30\.2 → 0\.31\.2 ANSWER-CHANGING\) \|", index)
    assert re.search(r"\| 0\.30\.0 \| \[0\.29\.4\]\(0\.29\.4\.\.0\.30\.0\.md\)" + bisected
                     + r" \| not measured \| ANSWER-CHANGING \|", index)  # mlx's own
    pred = (shipped / "0.32.0..0.32.1.md").read_text()
    assert re.search(r"\| M3, M3 Max, M3 Ultra, M4, M4 Max \| the embedded Gemma \| bf16 \| `q_proj`.* \| 2-5 \| "
                     r"steel GEMM \| gemv_wide", pred)
    assert "| M3 | verify:2 | 0.375 / 0.125 / 0 | 0.0625 / 0 / 0 |" in pred  # the replayed envelope under each


def test_gate_points_at_the_page_of_the_pair_it_judges():
    r = subprocess.run([sys.executable, "-m", "gemmdrift", "gate", "--results", str(ROOT / "benchmarks" / "reference"),
                        "--candidate", "0.30.6"], capture_output=True, text=True, cwd=ROOT)
    # the default baseline is the newest release before the candidate with results (the tier measured 0.30.5)
    assert "than mlx 0.30.5" in r.stdout and "0.30.5..0.30.6" in r.stdout, r.stdout[-500:]
    r = subprocess.run([sys.executable, "-m", "gemmdrift", "gate", "--results", str(ROOT / "benchmarks" / "reference"),
                        "--candidate", "0.30.6", "--baseline", "0.29.4"], capture_output=True, text=True, cwd=ROOT)
    assert "0.29.4..0.30.6" in r.stdout or "--from 0.29.4 --to 0.30.6" in r.stdout, r.stdout[-500:]


def test_the_timeline_takes_any_set_of_releases(tmp_path):
    """Every release measured (one dispatch-read release among them), a second machine that lacks one, an mlx-lm
    axis: the pairs are the consecutive ones only, each machine's cell is its own class or "not measured"."""
    root = tmp_path / "results"
    for i, mlx in enumerate(("0.30.5", "0.30.6", "0.31.2")):
        write_release(root, "m1", mlx, i + 1, dlogit=(0.5, 0.5), tree=1.0, rope=0.0, kld=0.0, commit="aaaaaaaa")
    write_release(root, "m2", "0.30.6", 1, dlogit=(0.5, 0.5), tree=1.0, rope=0.0, kld=0.0, commit="aaaaaaaa")
    write_release(root, "m2", "0.31.2", 2, dlogit=(0.5, 0.5), tree=2.0, rope=0.0, kld=0.0, commit="aaaaaaaa")
    df = history.read_results(root)
    pairs = cl.default_pairs(df)
    read_only = [p for p in pairs if not set(p) <= {"0.30.5", "0.30.6", "0.31.2"}]
    assert ("0.30.5", "0.30.6") in pairs and ("0.30.6", "0.31.2") in pairs and ("0.30.5", "0.31.2") not in pairs
    assert all(p[0] in ("0.31.2", "0.32.0", "0.32.1") for p in read_only)  # the dispatch-read releases after
    out = tmp_path / "pages"
    write_changelog([root], out, predict=False)
    index = (out / "index.md").read_text()
    assert "| release | from | m1 (cpu) | m2 (cpu) |" in index
    # m2's tree moved, no ladder here: the machines disagree, and the row says so
    assert "| 0.31.2 | [0.30.6](0.30.6..0.31.2.md) (machines disagree) | BIT-FOR-BIT | ANSWER-CHANGING |" in index
    assert "| 0.30.6 | [0.30.5](0.30.5..0.30.6.md) | BIT-FOR-BIT | not measured |" in index
    assert "| 0.30.5 | - | first | not measured |" in index


def test_two_machines_that_paired_one_mlx_with_other_mlx_lm_releases(tmp_path):
    """m2 ran every mlx with mlx-lm 0.30.2, m1 with 0.31.3: no mlx-lm pair across the machines (it would compare
    two machines), each machine keeps its own line of pairs, and the default pages are written without a refusal."""
    root = tmp_path / "results"
    for i, mlx in enumerate(("0.30.6", "0.31.2")):
        write_release(root, "m1", mlx, i + 1, dlogit=(0.5, 0.5), tree=1.0, rope=0.0, kld=0.0)
        write_release(root, "m2", mlx, i + 1, dlogit=(0.5, 0.5), tree=1.0, rope=0.0, kld=0.0)
        f = root / "m2" / f"aaaaaaaa-env-{mlx}.json"
        f.write_text(f.read_text().replace('"mlx-lm": "0.31.3"', '"mlx-lm": "0.30.2"'))
    df = history.read_results(root)
    pairs = cl.default_pairs(df)
    assert ("0.30.6+lm0.30.2", "0.31.2+lm0.30.2") in pairs and ("0.30.6+lm0.31.3", "0.31.2+lm0.31.3") in pairs
    assert ("0.30.6+lm0.30.2", "0.30.6+lm0.31.3") not in pairs
    out = tmp_path / "pages"
    write_changelog([root], out, predict=False)
    index = (out / "index.md").read_text()
    assert "| 0.31.2+lm0.30.2 | [0.30.6+lm0.30.2](0.30.6+lm0.30.2..0.31.2+lm0.30.2.md) | not measured | BIT-FOR-BIT |" \
        in index
    assert "| 0.30.6+lm0.30.2 | - | not measured | first |" in index


def test_a_page_says_when_its_machine_changed_mlx_lm_too(tmp_path):
    """Bare labels (one mlx-lm per mlx in these results) hide that m1 ran 0.30.6 with mlx-lm 0.31.2 and 0.31.2 with
    0.31.3: the page's class line and the machine's section say so; a pair with one mlx-lm says nothing of it."""
    root = tmp_path / "results"
    for i, mlx in enumerate(("0.30.5", "0.30.6", "0.31.2")):
        write_release(root, "m1", mlx, i + 1, dlogit=(0.5, 0.5 + (mlx == "0.31.2")), tree=1.0, rope=0.0, kld=0.0)
    f = root / "m1" / "aaaaaaaa-env-0.30.6.json"
    f.write_text(f.read_text().replace('"mlx-lm": "0.31.3"', '"mlx-lm": "0.31.2"'))
    f = root / "m1" / "aaaaaaaa-env-0.30.5.json"
    f.write_text(f.read_text().replace('"mlx-lm": "0.31.3"', '"mlx-lm": "0.31.2"'))
    df = history.read_results(root)
    (e,) = cl.measured(df, "0.30.6", "0.31.2").machines
    assert e["mlx_lm"] == ["0.31.2", "0.31.3"]
    out = tmp_path / "pages"
    write_changelog([root], out, predict=False)
    page = (out / "0.30.6..0.31.2.md").read_text()
    assert "mlx 0.30.6 → 0.31.2 (and there mlx-lm 0.31.2 → 0.31.3), measured on m1 (cpu)" in page.split("\n\n")[1]
    assert "On this machine the pair changes mlx-lm too (mlx-lm 0.31.2 → 0.31.3)" in page
    quiet = (out / "0.30.5..0.30.6.md").read_text()
    assert "mlx-lm too" not in quiet and "and there" not in quiet
    index = (out / "index.md").read_text()  # the timeline's cell says it too; the quiet pair's does not
    assert "| 0.31.2 | [0.30.6](0.30.6..0.31.2.md) | ANSWER-CHANGING (mlx-lm 0.31.2 → 0.31.3 too) |" in index
    assert "| 0.30.6 | [0.30.5](0.30.5..0.30.6.md) | BIT-FOR-BIT |" in index


def test_the_shipped_history_changes_answers_once_for_mlx_and_names_mlx_lm_for_the_rest():
    """The whole history on the Linux CPU (the tier, every release): of the consecutive mlx releases that ran with the
    same mlx-lm, only 0.29.4 -> 0.30.0 (RoPE positions in float32) changes the answers; every other mlx-only pair is
    BIT-FOR-BIT. Every ANSWER-CHANGING page on the main line where mlx-lm changed too says so in its first line."""
    shipped = ROOT / "docs" / "changelog"
    status = ROOT / "benchmarks" / "reference" / "reference-linux-cpu-tier.status.json"
    if not status.is_file() or not (shipped / "index.md").is_file():
        pytest.skip("no tier history shipped")
    envs = json.loads(status.read_text())["envs"].values()
    lm_of = {e["mlx"]: e["mlx_lm"] for e in envs if e["mlx"] != "0.32.4" or e["mlx_lm"] == "0.32.2"}
    rows = [line.split(" | ") for line in (shipped / "index.md").read_text().splitlines()
            if line.startswith("| 0.") and "+lm" not in line.split(" | ")[1].split("](")[0]]
    col = (shipped / "index.md").read_text().split("| release | from | ")[1].split(" |\n")[0].split(" | ")
    tier = col.index("reference-linux-cpu-tier (cpu)") + 2
    mlx_only = answer = 0
    for r in rows:
        new = r[0].strip("| ").split("+lm")[0]
        old = r[1].split("](")[0].lstrip("[").split("+lm")[0]
        if old == "-" or old not in lm_of or new not in lm_of:
            continue
        cls = r[tier].strip()
        page = (shipped / r[1].split("](")[1].split(")")[0]).read_text().split("\n\n")[1]
        if lm_of[old] == lm_of[new]:
            mlx_only += 1
            assert cls == ("ANSWER-CHANGING" if (old, new) == ("0.29.4", "0.30.0") else "BIT-FOR-BIT"), (old, new, cls)
        elif cls.startswith("ANSWER-CHANGING"):
            answer += 1
            # "(mlx-lm X → Y too)", or split at its bridge: whose change it was, each step's class (issue 55)
            assert cls in (f"ANSWER-CHANGING (mlx-lm {lm_of[old]} → {lm_of[new]} too)",) or (
                cls.startswith("ANSWER-CHANGING (") and f"mlx {old} → {new} " in cls
                and f", mlx-lm {lm_of[old]} → {lm_of[new]} " in cls), (old, new, cls)
            assert f"(and there mlx-lm {lm_of[old]} → {lm_of[new]})" in page, (old, new, page[:300])
    assert mlx_only == 14 and answer >= 6, (mlx_only, answer)  # every mlx-only pair of the 22 releases


def test_the_count_past_the_gate_is_the_count_of_marked_rows(planted, tmp_path):
    """Regression (issue 53, item 27): a page said "25 grew past the gate's threshold" over 23 marked rows: a figure
    that grew from exactly 0 failed the gate but its row said only "from 0". Count and marks are one flag now, on
    every shipped page and on a planted from-0 growth and a higher-is-better fall."""
    shipped = ROOT / "docs" / "changelog"
    sections = 0
    for page in sorted(shipped.glob("*.md")):
        for sec in page.read_text().split("\n### ")[1:]:
            m = re.search(r"; (\d+|none) worse than the gate's threshold allows", sec)
            if m:
                sections += 1
                said = 0 if m.group(1) == "none" else int(m.group(1))
                marks = len(re.findall(r"\((grew|fell) past the gate\)", sec))
                assert said == marks, f"{page.name}, {sec.splitlines()[0]}: says {said}, marks {marks}"
    assert sections >= 15
    assert "; 25 worse than the gate's threshold allows" in (shipped / "0.29.4..0.30.6.md").read_text()
    root = tmp_path / "r"
    write_release(root, "m1", "0.30.6", 1, dlogit=(0.0, 0.5), tree=1.0, rope=0.0, kld=0.005)
    write_release(root, "m1", "0.31.2", 2, dlogit=(0.25, 0.5), tree=1.0, rope=0.0, kld=0.005, commit="bbbbbbbb")
    for d in (root / "m1").glob("*.json"):  # a higher-is-better figure that falls by half
        doc = json.loads(d.read_text())
        if "results" in doc:
            doc["results"]["bench_golden.GoldenLogits.track_same_top1"] = entry([1.0 if "0.30.6" in d.name else 0.5],
                                                                                [["'decode'"]])
            d.write_text(json.dumps(doc))
    text = view.markdown(view.measured_blocks(cl.measured(history.read_results(root), "0.30.6", "0.31.2")))
    assert "| 0 | 0.25 | from 0 (grew past the gate) |" in text
    assert "| 1 | 0.5 | ×0.5 (fell past the gate) |" in text
    assert "; 2 worse than the gate's threshold allows" in text
