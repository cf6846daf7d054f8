"""Issue 33 D10: a base file computed with replayed kernels stays labelled a prediction when compared later."""

import json

import pytest

from gemmdrift import cli


def _replayed_copy(tmp_path):
    from gemmdrift.measure.golden import read_logits, resolve_golden, write_logits

    lf = read_logits(resolve_golden("linux-cpu"))
    lf.header["kernels"] = "replay:M1@mma=H2"  # as `logits --kernels replay:M1@mma=H2` writes it
    path = tmp_path / "rep.npz"
    write_logits(path, lf)
    return path


def test_comparing_a_replayed_file_says_prediction(tmp_path, capsys):
    from gemmdrift.measure.golden import resolve_golden
    from gemmdrift.report import build_report

    rep, out = _replayed_copy(tmp_path), tmp_path / "cx"
    assert cli.main(["compare", "--base", str(rep), "--other", str(resolve_golden("linux-cpu")),
                     "--out", str(out)]) == 0
    text = capsys.readouterr().out
    head, base_line, other_line = text.splitlines()[:3]
    assert "PREDICTION" in head and "base (replay:M1@mma=H2)" in head and "other" not in head.split("PREDICTION")[1]
    assert "replay:M1@mma=H2 replayed on cpu" in base_line and "PREDICTION" in base_line
    assert other_line.endswith(f"[{resolve_golden('linux-cpu')}]") and "(cpu)" in other_line
    summary = json.loads((out / "summary.json").read_text())
    assert summary["base"]["kernels"] == "replay:M1@mma=H2" and summary["base"]["prediction"] is True
    assert summary["other"]["kernels"] == "native" and summary["other"]["prediction"] is False
    md = build_report(out)["markdown"].read_text()
    assert "replay:M1@mma=H2 replayed on cpu: a PREDICTION" in md


@pytest.mark.slow
def test_a_live_replayed_compare_labels_its_other_side(tmp_path, capsys):
    assert cli.main(["compare", "--golden", "linux-cpu", "--tokens", "3", "--kernels", "replay:M3",
                     "--out", str(tmp_path / "o"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["other"]["kernels"] == "replay:M3" and doc["other"]["prediction"]
    assert "replayed on cpu: a PREDICTION" in doc["other"]["label"] and not doc["other"]["label"].endswith("(cpu)")
    assert doc["base"]["kernels"] == "native"
