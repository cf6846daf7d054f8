"""The probe's defects (issue 25, items 1-4): bounds before compute, --out probed, one rule per flag.

Most are pre-model checks run in process with the model loader replaced by one that fails the test: a
refusal that reaches it came too late. The subprocess test sends a real SIGINT.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from conftest import make_tiny
from gemmdrift import cli
from gemmdrift.errors import GemmdriftError

REPO = Path(__file__).resolve().parent.parent


class Loaded(Exception):
    """The model loader was reached (the check under test did not refuse before it)."""


@pytest.fixture
def no_model(monkeypatch):
    from gemmdrift import model as models

    def refuse(*a, **k):
        raise Loaded()

    monkeypatch.setattr(cli, "load", refuse)
    monkeypatch.setattr(models, "load_model", refuse)


def refused(argv, needle, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if "error:" in x]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def files(tmp_path):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "corrupt.json").write_text('{"prompt": [1, 2')
    (tmp_path / "obj.json").write_text('{"prompt": [1, 2]}')
    (tmp_path / "noids.txt").write_text("")
    (tmp_path / "a.json").write_text(json.dumps({"prompt": [2, 5, 6], "tokens": [7, 8], "schedule": "prefill:4,decode"}))
    (tmp_path / "b.json").write_text(json.dumps({"prompt": [2, 5, 6], "tokens": [7, 9],
                                                 "schedule": "batch:B4,row3,prefill:2048,decode"}))
    return tmp_path


@pytest.mark.parametrize("argv,needle", [
    (["state", "--where", ""], "--where: give at least one of below, at, past, far"),
    (["state", "--where", ","], "--where: give at least one of"),
    (["state", "--ops", ""], "--ops: give at least one of rollback"),
    (["state", "--ops", " , "], "--ops: give at least one of"),
    (["state", "--envelope", "inf"], "--envelope must be a finite non-negative number"),
    (["state", "--envelope", "-1"], "--envelope must be a finite non-negative number"),
    (["batch", "--tokens", "0"], "--tokens must be at least 2, got 0"),
    (["batch", "--tokens", "-3"], "--tokens must be at least 2, got -3"),
    (["batch", "--prompt", ""], "--prompt is empty"),
    (["server", "--prompt", " ", "--cases", "concurrent"], "--prompt is empty"),
    (["server", "--companions", "100000", "--cases", "concurrent", "--prompt", "hi"], "--companions must be between 1 and 63"),
    (["server", "--companions", "0", "--cases", "concurrent", "--prompt", "hi"], "--companions must be between 1 and 63"),
    (["fingerprint", "--paths", "matmul:float32", "--k", "100000000", "--ts", "1"], "about 1 GiB"),
    (["fingerprint", "--paths", "matmul:float32", "--k", "8", "--ts", "1", "--n", "100000000"], "lower --k or --n"),
    (["fingerprint", "--paths", "matmul:float32", "--k", "8", "--ts", "1", "--draw-k", "100000000"], "--draw-k 100,000,000"),
    (["fingerprint", "--paths", "matmul:float32", "--k", "8", "--ts", "1", "--draw-k", "1"], "--draw-k must be 0 (skip) or at least 2"),
    (["gate", "--results", str(REPO / "benchmarks" / "reference"), "--threshold", "inf"], "--threshold must be a finite"),
])
def test_refused_before_the_model(argv, needle, capsys, no_model, tmp_path):
    refused([*argv, "--out", str(tmp_path / "o")], needle, capsys)


@pytest.mark.parametrize("argv,needle", [
    (["batch", "--prompt-file", "{d}/nope.txt"], "no such file"),
    (["batch", "--prompt-ids", "{d}/nope.json"], "no such file"),
    (["batch", "--prompt", "hi", "--prompt-file", "{d}/afile"], "give only one of"),
    (["batch", "--prompt-ids", "{d}/corrupt.json"], "not valid JSON"),
    (["batch", "--prompt-ids", "{d}/obj.json"], "expected a JSON list of integers, got a dict"),
    (["batch", "--prompt-ids", "{d}/noids.txt"], "no token ids"),
    (["batch", "--prompt-file", "{d}/empty.txt"], "is empty"),
    (["server", "--prompt-file", "{d}/empty.txt", "--cases", "concurrent"], "is empty"),
    (["triage", "--stream-a", "{d}/a.json", "--stream-b", "{d}/b.json", "--envelope", "inf"], "--envelope must be"),
    (["triage", "--stream-a", "{d}/a.json", "--stream-b", "{d}/b.json", "--out", "/proc/gd"], "--out /proc/gd: cannot write"),
    (["state", "--out", "/proc/gd"], "--out /proc/gd: cannot write"),
    (["batch", "--out", "/proc/gd/sub"], "cannot write"),
])
def test_file_checks_before_the_model(argv, needle, capsys, no_model, files):
    argv = [a.format(d=files) for a in argv]
    if "--out" not in argv:
        argv += ["--out", str(files / "o")]
    refused(argv, needle, capsys)


def test_envelope_zero_is_accepted_by_state_and_triage(no_model, files):
    """One rule (checks.check_envelope, the README's): 0 passes the checks in both (the loader is reached)."""
    with pytest.raises(Loaded):
        cli.main(["state", "--envelope", "0", "--out", str(files / "s")])
    with pytest.raises(Loaded):
        cli.main(["triage", "--stream-a", str(files / "a.json"), "--stream-b", str(files / "b.json"),
                  "--envelope", "0", "--out", str(files / "t")])


def test_out_is_probed_by_writing(tmp_path):
    from gemmdrift.checks import check_out_dir

    assert check_out_dir(tmp_path / "new" / "dir") == tmp_path / "new" / "dir"
    assert not (tmp_path / "new").exists()  # made, written, and removed again: a later refusal leaves nothing
    (tmp_path / "old").mkdir()
    check_out_dir(tmp_path / "old")
    assert (tmp_path / "old").is_dir() and not list((tmp_path / "old").iterdir())
    with pytest.raises(GemmdriftError, match="cannot write"):
        check_out_dir("/proc/gemmdrift-probe")  # os.access says yes to root here; a write does not


def test_a_failed_write_loses_nothing(tmp_path):
    """The result goes to a temporary directory instead, and the one line says where."""
    from gemmdrift import fingerprint, store

    r = fingerprint.measure(["numpy:float32"], K=8, ts=[1], draw_k=0, workers=1)
    out = tmp_path / "o"
    out.mkdir()
    (out / "result.csv").mkdir()  # renaming a file onto a directory fails (as a full disk or lost mount would)
    with pytest.raises(GemmdriftError, match="it was saved to ") as e:
        store.write_result(r, out, draw=False)
    spare = Path(str(e.value).split("saved to ")[1].split("/ instead")[0])
    try:
        assert (store.read_result(spare).tables["fingerprints"].to_csv(index=False)
                == r.tables["fingerprints"].to_csv(index=False))
    finally:
        import shutil

        shutil.rmtree(spare)


def test_batch_and_server_refuse_n_above_positions(monkeypatch, capsys, tmp_path):
    """Refused after the model loads (its positions are in its config) and before any generation."""
    from gemmdrift.measure import batch, server
    from gemmdrift import model as models

    from test_interrupts import _Tok

    lm = make_tiny("float32", max_position_embeddings=32)
    lm = models.LoadedModel(lm.model, _Tok(), {**lm.info, "max_positions": 32})
    monkeypatch.setattr(cli, "load", lambda args: lm)
    monkeypatch.setattr(batch, "sweep", lambda *a, **k: pytest.fail("generated"))
    refused(["batch", "--prompt", "hi", "--n", "100", "--batch-sizes", "1", "--out", str(tmp_path / "b")],
            "more than the model's 32 positions", capsys)
    monkeypatch.setattr(server, "checkpoint_dir", lambda source: tmp_path)
    monkeypatch.setattr(server, "stored_dtype", lambda d: "float32")
    monkeypatch.setattr(models, "load_model", lambda *a, **k: lm)
    monkeypatch.setattr(server, "MlxLmServer", lambda *a, **k: pytest.fail("server started"))
    refused(["server", "--prompt", "hi", "--n", "100", "--cases", "concurrent", "--companions", "1",
             "--out", str(tmp_path / "s")], "more than the model's 32 positions", capsys)


def test_triage_reads_the_schedule_in_the_stream_file(files):
    from gemmdrift.prompts import stream_schedule

    assert stream_schedule(None, files / "a.json", "prefill:512,verify:2", "--schedule-a") == (
        "prefill:4,decode", "written in its file")
    s, why = stream_schedule(None, files / "b.json", "prefill:512,verify:2", "--schedule-b")
    assert s == "prefill:2048,decode" and "batch row" in why and "--schedule-b" in why
    s, why = stream_schedule("prefill:8,verify:3", files / "a.json", "x", "--schedule-a")
    assert s == "prefill:8,verify:3" and why == "--schedule-a (the file says prefill:4,decode)"
    (files / "ids.txt").write_text("1 2 3")
    assert stream_schedule(None, files / "ids.txt", "prefill:512,verify:2", "--schedule-b")[0] == "prefill:512,verify:2"
    (files / "bad.json").write_text(json.dumps({"tokens": [1], "schedule": "warp:9"}))
    with pytest.raises(GemmdriftError, match="is not a schedule"):
        stream_schedule(None, files / "bad.json", "x", "--schedule-b")


def test_gate_refuses_a_baseline_newer_than_the_candidate(capsys):
    ref = str(REPO / "benchmarks" / "reference")
    assert cli.main(["gate", "--results", ref, "--candidate", "0.29.4", "--baseline", "0.32.4"]) == 2
    err = capsys.readouterr().err
    assert "--baseline 0.32.4 is newer than --candidate 0.29.4" in err and len(err.strip().splitlines()) == 1
    cli.main(["gate", "--results", ref, "--candidate", "0.32.4", "--baseline", "0.31.2"])
    assert "newer" not in capsys.readouterr().err


def test_history_closes_its_figures(tmp_path, monkeypatch):
    """Each figure is drawn when written and closed before the next: at most one open at a time (the default
    selection draws 371, and matplotlib warned after 20)."""
    import matplotlib.pyplot as plt

    from gemmdrift.measure import history
    from gemmdrift.view import history as history_view, plots
    from gemmdrift import store

    plt.close("all")
    r = history.history_result(history.read_results([str(REPO / "benchmarks" / "reference")]),
                               include="Divergence")
    open_at_draw = []
    real = history_view.plot_history

    def counting(*a, **k):
        open_at_draw.append(len(plt.get_fignums()))
        return real(*a, **k)

    monkeypatch.setattr(history_view, "plot_history", counting)
    figs = plots.draw(r)
    assert len(figs) >= 3 and open_at_draw == []  # nothing drawn until read
    store.write_result(r, tmp_path)
    assert len(open_at_draw) == len(figs) and max(open_at_draw) == 0 and plt.get_fignums() == []
    assert len(list((tmp_path / "figures").glob("*.png"))) == len(figs)


def test_report_names_every_kind_and_a_missing_meta(tmp_path, capsys):
    from gemmdrift import fingerprint, store

    help_text = cli.build_parser()._subparsers._group_actions[0].choices["report"].format_help()
    for kind in ("run", "stack", "kernels", "diverge", "triage", "history", "state", "batch", "server",
                 "fingerprint"):
        assert kind in help_text
    (tmp_path / "empty").mkdir()
    line = refused(["report", str(tmp_path / "empty")], "no gemmdrift results", capsys)
    assert "state, batch, server or fingerprint" in line
    store.write_result(fingerprint.measure(["numpy:float32"], K=8, ts=[1], draw_k=0, workers=1), tmp_path / "f",
                       draw=False)
    (tmp_path / "f" / "meta.json").unlink()
    refused(["report", str(tmp_path / "f")], "meta.json is missing", capsys)


def test_report_marks_a_partial_result(tmp_path):
    from gemmdrift import fingerprint, report, store
    from gemmdrift.checkpoint import partial_inputs

    r = fingerprint.measure(["numpy:float32"], K=8, ts=[1], draw_k=0, workers=1)
    r = dataclasses.replace(r, inputs={**r.inputs, **partial_inputs(1, 3, "path x T")})
    store.write_result(r, tmp_path / "p", draw=False)
    md = report.to_markdown(report.report_blocks(tmp_path / "p"))
    assert "is **partial**: interrupted after 1 of 3 path x T" in md
    assert (tmp_path / "p" / "result.json").is_file()


def test_interrupt_messages_are_per_command(tmp_path):
    from gemmdrift.checkpoint import Interrupted
    from gemmdrift.interrupts import on_interrupt

    msg = on_interrupt(Namespace(command="triage", out=str(tmp_path)), KeyboardInterrupt())
    assert "nothing was written" in msg and "does not checkpoint" in msg and "resume" not in msg
    msg = on_interrupt(Namespace(command="batch", out=str(tmp_path)), Interrupted(None, 0, 4))
    assert "nothing had finished" in msg and "finished rows are kept" in msg
    assert "finished parts are kept" in on_interrupt(Namespace(command="run", out="x"), KeyboardInterrupt())


def test_sigint_keeps_and_resumes_a_fingerprint(tmp_path):
    """A real Ctrl-C (SIGINT to the process) after two path x T: exit 130, a partial result written and
    marked, then the rerun resumes them and its table equals an uninterrupted run's."""
    from gemmdrift import fingerprint, store

    out = tmp_path / "fp"
    argv = [sys.executable, "-m", "gemmdrift", "fingerprint", "--paths", "matmul:float32,sum:float32", "--k", "256",
            "--ts", "1-6", "--n", "16", "--draw-k", "0", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    # SIGINT back to its default in the child: a runner started in the background ignores it, and Python then
    # installs no KeyboardInterrupt handler
    p = subprocess.Popen(argv, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    done = 0
    for line in p.stderr:
        done += "tree(s)" in line
        if done == 2:
            p.send_signal(signal.SIGINT)
            break
    rest = p.stderr.read()
    assert p.wait(timeout=120) == 130, rest
    assert "interrupted:" in rest and "written to" in rest and "rerun the same command to resume" in rest, rest
    part = store.read_result(out)
    assert part.inputs["partial"]["done"] >= 2 and part.inputs["partial"]["total"] == 12
    r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stderr.count("done before (resumed)") == part.inputs["partial"]["done"]
    again = store.read_result(out)
    assert "partial" not in again.inputs and not (out / ".checkpoints").exists()
    whole = fingerprint.measure(["matmul:float32", "sum:float32"], K=256, ts=range(1, 7), N=16, draw_k=0, workers=1)
    cols = [c for c in whole.tables["fingerprints"].columns if c != "seconds"]
    assert again.tables["fingerprints"][cols].to_csv(index=False) == whole.tables["fingerprints"][cols].to_csv(index=False)
