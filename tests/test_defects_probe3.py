"""PROBE-DEFECTS-3 (issue 46, part 2): each defect of the new-user probes that is not the attribution logic,
by the command that showed it. Refusals run in this process (test_cli's gd_here) and must come before any
model loads (``load=False``: loading is an error)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from test_cli import assert_user_error, gd_here

REPO = Path(__file__).resolve().parents[1]
SCHED = ["--schedules", "prefill:32,decode", "prefill:32,verify:2"]


def refused(monkeypatch, capsys, needle, *args):
    """``gemmdrift ARGS`` is one line, exit 2, before any model loads; returns the error line."""
    r = gd_here(monkeypatch, capsys, *args, load=False)
    assert_user_error(r, needle)
    return r.stderr.strip().splitlines()[-1]


@pytest.fixture
def fast_probe(monkeypatch):
    """``--python PATH`` probed without a subprocess (each real probe imports mlx: seconds)."""
    from gemmdrift.attribution import release_ops

    monkeypatch.setattr(release_ops, "probe_python",
                        lambda path, flag="--python": {"python": "3", "mlx": "0.30.6", "mlx_lm": "0.31.2"})


# ------------------------------------------------------------------ item 6, 7, 14: the release mode's inputs


def test_release_layers_is_a_layer_list_not_a_crash(monkeypatch, capsys, tmp_path, fast_probe):
    from gemmdrift.attribution import release_ops
    from gemmdrift.ranges import parse_ints

    assert release_ops.parse_layers("0-1,5") == [0, 1, 5] == parse_ints("0-1,5", "--release-layers")
    line = refused(monkeypatch, capsys, "reversed", "attribute", "--python", sys.executable, "--release-layers",
                   "5-2", "--out", str(tmp_path / "o"))
    assert "--release-layers" in line
    refused(monkeypatch, capsys, "no layer 18", "attribute", "--python", sys.executable, "--release-layers", "0,18",
            "--out", str(tmp_path / "o"))


@pytest.mark.parametrize("flags, needle", [
    (["--release-tokens", "100000000"], "more than the model's 32,768 positions"),
    (["--release-tokens", "40", "--release-split", "60"], "--release-split 60"),
    (["--release-tokens", "1"], "--release-tokens"),
    (["--release-split", "0"], "--release-split 0"),
])
def test_release_stream_is_checked_before_the_model_loads(monkeypatch, capsys, tmp_path, fast_probe, flags, needle):
    refused(monkeypatch, capsys, needle, "attribute", "--python", sys.executable, *flags, "--out", str(tmp_path / "o"))


# ------------------------------------------------------------------ items 8, 9: outputs, --json


def test_every_out_of_the_release_mode_is_checked_first(monkeypatch, capsys, tmp_path, fast_probe):
    afile = tmp_path / "afile"
    afile.write_text("x")
    refused(monkeypatch, capsys, "is a file", "attribute", "--python", sys.executable, "--out", str(afile))
    refused(monkeypatch, capsys, "--release-out", "attribute", "--python", sys.executable, "--release-out",
            str(afile / "x.json"), "--out", str(tmp_path / "o"))
    refused(monkeypatch, capsys, "--release-out", "attribute", "--python", sys.executable, "--release-out",
            "/proc/x/y.json", "--out", str(tmp_path / "o"))
    assert not (tmp_path / "o").exists()  # nothing left behind by a refusal


def test_primitives_out_is_checked_before_the_gate_computes(monkeypatch, capsys, tmp_path):
    from gemmdrift.attribution import primitives

    afile = tmp_path / "afile"
    afile.write_text("x")
    monkeypatch.setattr(primitives, "gate", lambda *a, **k: (_ for _ in ()).throw(AssertionError("computed")))
    refused(monkeypatch, capsys, "is a file", "attribute", "--primitives", "--ts", "1-2", "--out", str(afile))
    refused(monkeypatch, capsys, "cannot write there", "attribute", "--primitives", "--ts", "1-2", "--out", "/proc/x")


def test_changelog_out_is_checked_first(monkeypatch, capsys, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    ref = str(REPO / "benchmarks" / "reference")
    refused(monkeypatch, capsys, "is a file", "changelog", "--from", "0.29.4", "--to", "0.30.6", "--results", ref,
            "--out", str(afile))
    refused(monkeypatch, capsys, "cannot write there", "changelog", "--from", "0.29.4", "--to", "0.30.6",
            "--results", ref, "--out", "/proc/x")


def _stub_comparison(monkeypatch):
    from gemmdrift.attribution import release_ops

    doc = {"format": 1, "from": {"mlx": "0.32.4"}, "to": {"mlx": "0.30.6"}, "compared": 3,
           "changed": [{"op": "rope", "layer": 0, "seq": 1, "frac_differ": 0.5, "max_ulp": 1.0}], "errors": []}
    monkeypatch.setattr(release_ops, "release_comparison", lambda *a, **k: dict(doc))
    monkeypatch.setattr(release_ops, "_load", lambda path: ({"calls": []}, {}))
    return doc


def test_release_json_is_json_and_written_names_the_file(monkeypatch, capsys, tmp_path, fast_probe):
    _stub_comparison(monkeypatch)
    cap = tmp_path / "cap.json"
    r = gd_here(monkeypatch, capsys, "attribute", "--python", sys.executable, "--release-capture", str(cap),
                "--json", "--out", str(tmp_path / "o"), load=False)
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    assert rec["changed_ops"] == ["rope"] and rec["compared"] == 3 and rec["written"].endswith("release_ops.json")
    r = gd_here(monkeypatch, capsys, "attribute", "--python", sys.executable, "--release-capture", str(cap),
                "--out", str(tmp_path / "o"), load=False)
    assert "outputs differ in (forward order): rope" in r.stdout and "release_ops.json" in r.stdout


# ------------------------------------------------------------------ item 10: a mode's flags


@pytest.mark.parametrize("flags, needle", [
    (["--primitives", "--quantize", "4"], "--quantize"),
    (["--primitives", "--python", sys.executable], "--primitives and --python"),
    (["--primitives", "--counterfactual", "each"], "--counterfactual"),
    (["--primitives", "--tokens", "48"], "--tokens"),
    (["--ts", "1-4"], "--ts"),
    (["--max-rows", "8"], "--max-rows"),
    (["--python", sys.executable, "--kernels", "replay:M1"], "--kernels"),
    (["--python", sys.executable, "--ops", "q_proj"], "--ops"),
    (["--python", sys.executable, "--schedules", "decode", "verify:2"], "--schedules"),
    (["--python", sys.executable, "--ts", "1-2"], "--ts"),
    (["--baseline-python", sys.executable], "--baseline-python"),
    (["--release-tokens", "40"], "--release-tokens"),
])
def test_a_flag_of_another_mode_is_refused(monkeypatch, capsys, tmp_path, fast_probe, flags, needle):
    line = refused(monkeypatch, capsys, needle, "attribute", *flags, "--out", str(tmp_path / "o"))
    assert "Traceback" not in line


def test_diverge_prompts_with_explain_is_refused(monkeypatch, capsys, tmp_path):
    refused(monkeypatch, capsys, "--explain", "diverge", "--prompts", "builtin", "--n", "4", "--explain",
            "--out", str(tmp_path / "o"))


def test_diverge_explain_without_triage_is_refused(monkeypatch, capsys, tmp_path):
    refused(monkeypatch, capsys, "--no-triage", "diverge", "--n", "4", "--explain", "--no-triage",
            "--out", str(tmp_path / "o"))


# ------------------------------------------------------------------ item 14: refusals before the load


@pytest.mark.parametrize("flags, needle", [
    (["--tokens", "40", "--split", "32", *SCHED, "--kernels", "replay:sm90"], "cublaslt"),
    (["--tokens", "48", "--split", "60", *SCHED], "--split 60"),
    (["--tokens", "48", "--positions", "30:100", *SCHED], "out of range"),
])
def test_attribute_refuses_what_it_can_know_before_the_load(monkeypatch, capsys, tmp_path, flags, needle):
    refused(monkeypatch, capsys, needle, "attribute", *flags, "--out", str(tmp_path / "o"))


# ------------------------------------------------------------------ item 20: --counterfactual both


def test_counterfactual_both_is_each_and_all_but_one():
    from gemmdrift.cli.attribute import parse_counterfactual

    assert parse_counterfactual("both") == ["each", "all-but-one"] == parse_counterfactual("each,all-but-one")


# ------------------------------------------------------------------ items 13, 19, 21: the plain mode's words


def _attribute_result(tiny, **record):
    from gemmdrift.attribution.attribute import attribute

    return attribute(tiny, [2, 5, 9, 11, 40, 7, 3, 8], ["decode", "verify:2"], split=2, ops=["q_proj"],
                     counterfactual=["each"], record=record)


def test_recompute_keeps_ops_and_the_prompt(tiny):
    import shlex

    from gemmdrift.view.attribute import attribute_text, command, ops_rows

    r = _attribute_result(tiny, prompt="text", prompt_flag=["--prompt", "The lighthouse keeper"])
    argv = shlex.split(command(r))
    assert argv[argv.index("--ops") + 1] == "self_attn.q_proj"
    assert argv[argv.index("--prompt") + 1] == "The lighthouse keeper"
    assert "--ops" not in shlex.split(command(r, counterfactual="none"))  # refused with none: never written so
    assert f"recompute: {command(r)}" in attribute_text(r)
    for row in ops_rows(r):
        assert "--prompt" in shlex.split(row["recompute"])


def test_the_drifting_ops_table_says_when_it_is_cut(tiny):
    import dataclasses

    import pandas as pd

    from gemmdrift.view.attribute import attribute_text

    r = _attribute_result(tiny)
    ops = pd.DataFrame([{"layer": i, "op": f"op{i}", "class": "self_attn.q_proj", "positions_differ": 1,
                         "max_ulp": 1.0, "rel_l2": 0.1, "first_position": 3, "order": i} for i in range(45)])
    text = attribute_text(dataclasses.replace(r, tables={**r.tables, "ops": ops}))
    assert "first 40 of 45" in text and "ops.csv" in text


def test_envelope_at_one_position_has_kld_and_same_top1():
    """The stream's last position has no next token: KLD and same top-1 need none (Δp and perplexity do)."""
    import numpy as np

    from gemmdrift.measure.stack import two_run

    a = np.array([[0.0, 1.0, 2.0]], dtype=np.float32)
    b = np.array([[0.0, 2.5, 1.0]], dtype=np.float32)
    rec = two_run(a, b, np.array([5]), [0, 0, 0, 0, 0, 2])
    pa, pb = np.exp(a[0] - a[0].max()), np.exp(b[0] - b[0].max())
    pa, pb = pa / pa.sum(), pb / pb.sum()
    assert rec["kld_mean"] == pytest.approx(float(np.sum(pa * np.log(pa / pb))), rel=1e-4)
    assert rec["same_top1_share"] == 0.0 and np.isnan(rec["ppl_ratio"])
    same = two_run(a, a, np.array([5]), [0, 0, 0, 0, 0, 2])
    assert same["kld_mean"] == 0.0 and same["same_top1_share"] == 1.0


def test_a_finished_attribute_leaves_no_empty_checkpoint(monkeypatch, capsys, tmp_path, tiny):
    from gemmdrift import store
    from gemmdrift.cli import common

    monkeypatch.setattr(common, "load", lambda args: tiny)
    write = store.write_result
    monkeypatch.setattr(store, "write_result", lambda *a, **k: write(*a, **{**k, "draw": False}))  # no figure
    ids = tmp_path / "ids.json"
    ids.write_text("[2, 5, 9, 11, 40, 7, 3, 8]")
    out = tmp_path / "o"
    r = gd_here(monkeypatch, capsys, "attribute", "--prompt-ids", str(ids), "--schedules", "decode", "verify:2",
                "--split", "2", "--counterfactual", "none", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert not (out / "checkpoint").exists()
    written = r.stdout.rsplit("written to", 1)[1]
    for name in ("result.json", "result.csv", "details.json", "figures.json", "ops.csv"):
        assert name in written, written


# ------------------------------------------------------------------ item 11: Ctrl-C


def test_ctrl_c_before_anything_finished_says_so(tmp_path):
    import argparse

    from gemmdrift.interrupts import on_interrupt

    args = argparse.Namespace(command="attribute", out=str(tmp_path / "o"), python=None)
    assert "nothing had finished" in on_interrupt(args, KeyboardInterrupt())
    (tmp_path / "o" / "checkpoint" / ".checkpoints" / "attribute").mkdir(parents=True)
    (tmp_path / "o" / "checkpoint" / ".checkpoints" / "attribute" / "local.json").write_text("{}")
    assert "kept in" in on_interrupt(args, KeyboardInterrupt())


def test_ctrl_c_in_the_release_mode_says_what_was_kept(tmp_path):
    import argparse

    from gemmdrift.interrupts import on_interrupt

    args = argparse.Namespace(command="attribute", out=str(tmp_path / "o"), python="/x/python",
                              release_capture=None)
    said = on_interrupt(args, KeyboardInterrupt())
    assert "nothing had finished" in said and "checkpoint" not in said
    work = tmp_path / "o" / "release_ops"
    work.mkdir(parents=True)
    (work / "capture.json").write_text("{}")
    (work / "capture.npz").write_text("")
    said = on_interrupt(args, KeyboardInterrupt())
    assert "capture" in said and "reused" in said and "checkpoint" not in said


def test_a_finished_capture_is_reused_on_rerun(monkeypatch, capsys, tmp_path, fast_probe, tiny):
    """The rerun after Ctrl-C finds the capture of the same model, stream and layers and does not load or
    capture again; another --release-layers captures again."""
    from gemmdrift.attribution import release_ops

    out = tmp_path / "o"
    work = out / "release_ops"
    work.mkdir(parents=True)
    doc = {"format": 1, "captured_under": release_ops.this_python(), "model": "embedded", "dtype": "bfloat16",
           "positions": "300-303", "tokens": [], "layers": list(range(18)), "asked_layers": None,
           "calls": []}
    (work / "capture.json").write_text(json.dumps(doc))
    import numpy as np

    np.savez(work / "capture.npz", x=np.zeros(1))
    seen = {}
    monkeypatch.setattr(release_ops, "release_comparison",
                        lambda cap, *a, **k: seen.setdefault("cap", cap) and {
                            "format": 1, "from": {"mlx": "a"}, "to": {"mlx": "b"}, "compared": 0, "changed": [],
                            "errors": []})
    r = gd_here(monkeypatch, capsys, "attribute", "--python", sys.executable, "--release-tokens", "304",
                "--out", str(out), load=False)
    assert r.returncode == 0, r.stderr
    assert "reusing the capture" in r.stderr and seen["cap"] == work / "capture.json"
    with pytest.raises(AssertionError, match="a model was loaded"):
        gd_here(monkeypatch, capsys, "attribute", "--python", sys.executable, "--release-layers", "0-1",
                "--out", str(out), load=False)


# ------------------------------------------------------------------ item 15: release pairs


def test_changelog_refuses_a_reversed_pair(monkeypatch, capsys, tmp_path):
    ref = str(REPO / "benchmarks" / "reference")
    refused(monkeypatch, capsys, "is newer than --to", "changelog", "--from", "0.30.6", "--to", "0.29.4",
            "--results", ref, "--out", str(tmp_path / "c"))
    assert not (tmp_path / "c").exists()


def test_no_predict_on_a_predict_only_pair_is_refused(monkeypatch, capsys, tmp_path):
    # The shipped main-job results alone (four releases; the tier's history measures every release, so no shipped
    # pair is predict-only there): 0.32.0 and 0.32.1 are known only by their dispatch.
    import shutil

    ref = tmp_path / "results"
    shutil.copytree(REPO / "benchmarks" / "reference" / "reference-linux-cpu", ref / "reference-linux-cpu")
    refused(monkeypatch, capsys, "--no-predict", "changelog", "--from", "0.32.0", "--to", "0.32.1", "--no-predict",
            "--results", str(ref), "--out", str(tmp_path / "c"))


def test_gate_refuses_a_reversed_pair_and_names_an_empty_filter(monkeypatch, capsys):
    ref = str(REPO / "benchmarks" / "reference")
    refused(monkeypatch, capsys, "is newer than --candidate", "gate", "--results", ref, "--candidate", "0.29.4",
            "--baseline", "0.30.6")
    refused(monkeypatch, capsys, "--include zzznomatch", "gate", "--results", ref, "--include", "zzznomatch")


# ------------------------------------------------------------------ items 16, 17: the gate's words, --ops


def test_primitives_ts_empty_is_refused(monkeypatch, capsys):
    refused(monkeypatch, capsys, "--ts", "attribute", "--primitives", "--ts", "")


def _gate_text(**kw):
    from gemmdrift.attribution.primitives import gate
    from gemmdrift.view.primitives import text

    return text(gate("shape:gemma3-270m", [1, 2], **kw))


def test_the_primitives_verdict_claims_only_what_was_checked():
    some = _gate_text(ops=["sdpa"])
    assert "speculative decoding" not in some.splitlines()[-1] or "only the ops checked" in some, some
    assert "1 of" in some.splitlines()[-1]
    sliced = _gate_text(ops=["q_proj"], max_rows=8)
    assert "--max-rows 8" in sliced.splitlines()[-1] and "full shapes" in sliced.splitlines()[-1]


def test_primitives_replay_sm90_knows_t1_is_gemv_and_t2_cublaslt(monkeypatch, capsys):
    line = refused(monkeypatch, capsys, "cuBLASLt", "attribute", "--primitives", "--kernels", "replay:sm90",
                   "--ts", "1-3")
    assert "--ts 1" in line


def test_ops_words_mean_the_same_in_both_modes(tiny):
    from gemmdrift.attribution.primitives import select_ops
    from gemmdrift.attribution.primitives_operands import model_ops
    from gemmdrift.model.optaps import exposed_ops

    mops = model_ops("embedded")
    exposed = exposed_ops(tiny.model)
    # a name beats a kind: 'norm' is the final norm in both modes; kind:norm is every norm in both
    assert [o.name for o in select_ops(mops, ["norm"])] == ["norm"] == exposed.resolve(["norm"])
    prim_norms = {o.name for o in select_ops(mops, ["kind:norm"])}
    attr_norms = set(exposed.resolve(["kind:norm"]))
    assert "input_layernorm" in prim_norms and "input_layernorm" in attr_norms and "norm" in attr_norms
    prim_lin = {o.name for o in select_ops(mops, ["linear"])}
    attr_lin = set(exposed.resolve(["linear"]))
    assert prim_lin == attr_lin  # every projection and the LM head, in both
    assert {o.name for o in select_ops(mops, ["rope"])} == {"rope"}  # sliding and global: two shapes
    assert exposed.resolve(["rope"]) == ["self_attn.rope"]


# ------------------------------------------------------------------ item 5: run --calibration


def _calibration(tmp_path, name, arch="applegpu_g15s", chip="M3 Max", mlx=None, variant=None):
    from gemmdrift.replay.paths import installed_mlx

    p = tmp_path / name
    p.write_text(json.dumps({"format": "gemmdrift-calibration", "version": 1,
                             "device": {"chip": chip, "architecture": arch, "generation": 15, "size_class": "s",
                                        "macos": "15", "mlx": mlx or installed_mlx()},
                             "kernels": {}, "variant": variant or {"mma": "H2"}}))
    return p


def test_a_calibration_file_applies_to_its_own_chip_only(tmp_path):
    from conftest import make_tiny
    from gemmdrift.replay.calib import resolve
    from gemmdrift.replay.paths import installed_mlx
    from gemmdrift.replay.predict import PredictSizes, predict_drift

    f = _calibration(tmp_path, "m3max.json")
    assert resolve("M1", installed_mlx(), [str(f)], others="skip").variant == {}
    assert resolve("M3-Max", installed_mlx(), [str(f)], others="skip").variant == {"mma": "H2"}
    r = predict_drift(make_tiny(), PredictSizes(tokens=5, split=1, chips=("cpu",)), tokens=[1, 2, 3, 4, 5],
                      calibration=[str(f)])
    assert r.inputs["calibration"] == {}


def test_run_refuses_another_mlx_or_disagreeing_files_before_the_job(monkeypatch, capsys, tmp_path):
    old = _calibration(tmp_path, "old.json", mlx="0.31.2")
    refused(monkeypatch, capsys, "measured with mlx 0.31.2", "run", "--calibration", str(old), "--out",
            str(tmp_path / "r"))
    a, b = _calibration(tmp_path, "a.json"), _calibration(tmp_path, "b.json", variant={"mma": "H1"})
    refused(monkeypatch, capsys, "disagree", "run", "--calibration", str(a), "--calibration", str(b), "--out",
            str(tmp_path / "r"))
    assert not (tmp_path / "r").exists()


# ------------------------------------------------------------------ item 21: smaller


def test_report_renders_or_names_the_attribute_modes(tmp_path):
    from gemmdrift.errors import GemmdriftError
    from gemmdrift.report import build_report

    prim = tmp_path / "p"
    prim.mkdir()
    from gemmdrift.attribution.primitives import gate
    from gemmdrift.view.primitives import record
    from gemmdrift import files

    files.write_json(prim / "primitives.json", record(gate("shape:gemma3-270m", [1, 2], ops=["sdpa"])))
    paths = build_report(prim)
    assert "sdpa" in Path(paths["markdown"]).read_text()
    rel = tmp_path / "r"
    rel.mkdir()
    files.write_json(rel / "release_ops.json", {"format": 1, "from": {"mlx": "0.32.4"}, "to": {"mlx": "0.30.6"},
                                                "compared": 3, "changed": [], "errors": [], "ops": ["rope"],
                                                "model": "embedded", "positions": "300-303", "layers": [0]})
    assert "bit-identical" in Path(build_report(rel)["markdown"]).read_text()
    with pytest.raises(GemmdriftError) as e:
        build_report(tmp_path)
    assert "attribute" in str(e.value) and "replay check" in str(e.value)


def _upgrade_probe(path, flag="--python"):
    from gemmdrift.upgrade.envs import probe

    return probe(path, flag=flag)


def _attribute_probe(path, flag="--python"):
    from gemmdrift.attribution.release_ops import probe_python

    return probe_python(path, flag)


@pytest.mark.parametrize("probe_python", [_attribute_probe, _upgrade_probe], ids=["attribute", "upgrade"])
def test_python_paths_are_not_searched_on_path_and_baseline_is_named(tmp_path, monkeypatch, probe_python):
    """attribute --python and upgrade --python ask the interpreter through one function: the same refusals."""
    from gemmdrift.errors import GemmdriftError

    script = tmp_path / "fakepy.sh"
    script.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    script.chmod(0o755)
    monkeypatch.chdir(tmp_path)
    assert probe_python("./fakepy.sh")["mlx"]
    assert probe_python("fakepy.sh")["mlx"]  # the file here, by its absolute path (never searched on PATH)
    d = tmp_path / "adir"
    d.mkdir()
    with pytest.raises(GemmdriftError, match="--python adir: a directory"):
        probe_python("adir")
    with pytest.raises(GemmdriftError, match="^--baseline-python /bin/false"):
        probe_python("/bin/false", "--baseline-python")


def test_calibration_refusal_on_a_cpu_has_no_empty_parentheses(monkeypatch, capsys, tmp_path):
    f = _calibration(tmp_path, "m3max.json")
    r = gd_here(monkeypatch, capsys, "replay", "check", "--calibration", str(f), "--layers", "0", "--paths",
                "dense:bfloat16", "--ts", "1,2", "--out", str(tmp_path / "c"))
    assert r.returncode == 2 and "()" not in r.stderr, r.stderr


def test_fp_kernels_have_one_name(monkeypatch, capsys):
    r = gd_here(monkeypatch, capsys, "dispatch", "--chip", "M3", "--op", "quantized_matmul", "--mode", "mxfp4",
                "--K", "640", "--N", "1024", "--ts", "1-3", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert [(x["kernel"], x["label"].split()[0]) for x in rows] == [("fp_qmv", "fp_qmv")] + [("fp_qmv_wide",) * 2] * 2
    from gemmdrift.replay import RECIPES

    assert {x["kernel"] for x in rows} <= set(RECIPES)  # the names replay check uses


def test_the_registry_readme_agrees_with_calibration_md():
    readme = (REPO / "src" / "gemmdrift" / "data" / "calibrations" / "README.md").read_text()
    assert "replay check` reads only the files given" in readme and "replay check --calibration`, `--kernels" not in readme


def test_dispatch_env_names_the_flag(monkeypatch, capsys, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    refused(monkeypatch, capsys, "--env", "dispatch", "--env", str(afile))


def test_replay_check_says_which_variant_it_ran():
    from types import SimpleNamespace

    from gemmdrift.replay.check import variants_lines

    recs = {"records": [{"path": "dense:bfloat16", "kernel": "steel_gemm"}]}
    one = variants_lines(SimpleNamespace(details=recs, inputs={"variants": "mma=H2"}))
    assert "mma=H1|H2|H3|H4" in one[0] and "this check ran mma=H2 only" in one[-1]
    assert len(variants_lines(SimpleNamespace(details=recs, inputs={"variants": "all"}))) == 1
