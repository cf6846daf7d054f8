"""Results written before the Result record (no result.json) still load, summarise, render and track.

tests/data/legacy holds one directory per kind written by gemmdrift 893ad2f's own writers
(report.write_stack, kernels.write_kernels, diverge.write_divergence, the triage and prompt-set
writers of its cli) on the tiny test model; only their PNGs were left out.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from gemmdrift import files, report, store
from gemmdrift.view import summaries
from gemmdrift.errors import GemmdriftError

LEGACY = Path(__file__).resolve().parent / "data" / "legacy"
KINDS = {"stack": "stack", "kernels": "kernels", "diverge": "diverge", "triage": "triage",
         "divergence": "divergence"}


@pytest.mark.parametrize("name", sorted(KINDS))
def test_old_layout_loads_as_a_result_of_its_kind(name):
    d = LEGACY / name
    assert not (d / "result.json").exists()
    r = store.read_result(d)
    assert r.kind == KINDS[name] and store.result_kind(d) == KINDS[name]
    assert r.env["backend"] == "cpu"
    # The summary the new code computes from the old tables is the summary the old code wrote.
    if (d / "summary.json").is_file():
        now = json.loads(files.to_json(summaries.summary(r)))
        for p in now.get("pairs", []):  # added later (issue 12): unknown (None) for a ladder run before it
            assert p.pop("ladder_true_float32", None) is None
        for p in now.get("paths", []):  # added later (issue 53 item 16): the Ts measured, read from the old tables
            ts = sorted(int(t) for t in r.tables["kernels"].loc[r.tables["kernels"]["path"] == p["path"], "T"].unique())
            assert p.pop("Ts") == ts and set(p.pop("lm_head_Ts")) <= set(ts)
        assert now == json.loads((d / "summary.json").read_text())
    assert summaries.text(r)


def test_old_stack_figures_are_what_the_benchmarks_read():
    r = store.read_result(LEGACY / "stack")
    pair = "prefill:4,decode vs prefill:4,verify:2"
    env = r.tables["envelope"]
    row = env[(env["dtype"] == "bfloat16") & (env["mode"] == "accumulated")].iloc[0]
    assert r.figure(f"max_abs_dlogit/{pair}") == row["max_abs_dlogit"]
    assert r.figure(f"flips/{pair}") == row["flips"]
    lad = r.tables["ladder"]
    assert r.figure(f"ladder_rel_l2_float32/{pair}/logits") == lad[lad["tap"] == "logits"]["rel_l2_float32"].iloc[0]
    t = r.tables["stack"]
    local = t[(t["mode"] == "local") & (t["tap"] == "layer 1") & (t["metric"] == "rel_l2") & (t["dtype"] == "bfloat16")]
    assert r.figure(f"rel_l2/{pair}/local/layer 1") == local["value"].iloc[0]


def test_old_layout_renders_and_rewrites_in_the_new_layout(tmp_path):
    d = tmp_path / "old"
    shutil.copytree(LEGACY, d)
    blocks = report.report_blocks(d)
    titles = [b[1] for b in blocks if b[0] == "h2"]
    for name, kind in KINDS.items():
        title = report.PART_TITLES.get(name) or report.KIND_TITLES[kind]
        assert any(t.endswith(title) for t in titles), (kind, titles)
    paths = report.build_report(d)
    assert "None" not in paths["markdown"].read_text()
    for name in KINDS:
        old = store.read_result(d / name)
        store.write_result(old, tmp_path / "new" / name)
        new = store.read_result(tmp_path / "new" / name)
        assert new.kind == old.kind and dict(new.figures) == dict(old.figures)
        assert json.loads(files.to_json(summaries.summary(new))) == json.loads(files.to_json(summaries.summary(old)))
    # The files other tools read keep their names and contents.
    for name in ("stream_a.json", "stream_b.json", "diverge.json"):
        assert json.loads((tmp_path / "new" / "diverge" / name).read_text()) == \
            json.loads((LEGACY / "diverge" / name).read_text())
    assert json.loads((tmp_path / "new" / "triage" / "triage.json").read_text()) == \
        json.loads((LEGACY / "triage" / "triage.json").read_text())
    assert (tmp_path / "new" / "stack" / "stack_drift.png").stat().st_size > 0
    report.build_report(tmp_path / "new")


def test_a_corrupt_old_file_is_named(tmp_path):
    d = tmp_path / "stack"
    shutil.copytree(LEGACY / "stack", d)
    (d / "meta.json").write_text("{not json")
    with pytest.raises(GemmdriftError, match="meta.json"):
        store.read_result(d)
