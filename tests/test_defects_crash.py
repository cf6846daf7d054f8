"""Issue 33, the crash and hang defects (PROBE-DEFECTS-2: the triage/batch refusals, D1-D6): each test fails on the
code before its fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def gd(*args, cwd=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "gemmdrift", *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ}, timeout=timeout)


def assert_refused_first(r, needle):
    """Exit 2, no traceback, and the error is the only line on stderr and nothing on stdout: refused before any
    output."""
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    assert r.stdout == "", r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gemmdrift: error:"), r.stderr
    assert needle in lines[0], lines[0]


# ------------------------------------------------------------------ triage: every check before any print


@pytest.mark.parametrize("extra,needle", [
    (["--envelope", "-1"], "--envelope must be a finite non-negative"),
    (["--envelope", "nan"], "--envelope must be a finite non-negative"),
    (["--out", "/proc/x"], "--out /proc/x"),
])
def test_triage_refuses_before_printing_its_schedules(tmp_path, extra, needle):
    # Regression: "stream A under prefill:2048,decode (...)" was printed, then the error.
    s = tmp_path / "s.json"
    s.write_text("[1, 2, 3]")
    args = ["triage", "--stream-a", str(s), "--stream-b", str(s), "--out", str(tmp_path / "o"), *extra]
    assert_refused_first(gd(*args), needle)


def test_triage_schedule_reason_has_no_nested_parentheses(tmp_path):
    from gemmdrift.prompts import stream_schedule

    s = tmp_path / "s.json"
    s.write_text("[1, 2, 3]")
    sched, why = stream_schedule(None, str(s), "prefill:2048,decode", "--schedule-a")
    assert sched == "prefill:2048,decode"
    line = f"stream A under {sched} ({why})"
    assert "(" not in why and ")" not in why, line  # "(the default (the file names no schedule))" read badly


# ------------------------------------------------------------------ batch --n: refused before the model loads


def test_embedded_position_bound_is_the_gguf_files():
    # The constant batch checks before loading is the embedded file's own context_length.
    from gemmdrift import defaults as D
    from gemmdrift import gguf_gemma

    config = gguf_gemma.gguf_config(gguf_gemma._reader(gguf_gemma.embedded_gguf()))
    assert config["max_position_embeddings"] == D.EMBEDDED_MAX_POSITIONS


def test_batch_huge_n_is_refused_before_the_embedded_model_loads(tmp_path):
    # Regression: the model loaded and "gemmdrift batch: embedded (...)" was printed before the refusal.
    r = gd("batch", "--prompt", "hi", "--n", "100000", "--batch-sizes", "1", "--out", str(tmp_path / "o"))
    assert_refused_first(r, "more than the model's 32,768 positions")
    assert not (tmp_path / "o").exists()


def test_batch_huge_n_on_another_model_is_the_first_line_after_the_load(tmp_path):
    # A model whose bound is known only once loaded (here the embedded model's converted mlx-lm directory, given
    # as a directory): the refusal is the first line after the load, before batch's description line.
    from gemmdrift import gguf_gemma

    d = gguf_gemma.converted_dir(gguf_gemma.embedded_gguf(), progress=False)
    r = gd("batch", "--model", str(d), "--prompt", "hi", "--n", "100000", "--batch-sizes", "1",
           "--out", str(tmp_path / "o"))
    assert_refused_first(r, "more than the model's 32,768 positions")


# ------------------------------------------------------------------ D4: mlx-lm's [INFO] line off stdout


def test_quantize_keeps_stdout_clean(capsys):
    # Regression: mlx-lm's quantize_model printed "[INFO] Quantized model with 4.5 bits per weight." on stdout,
    # before a --json summary, which then did not parse. load_model quantizes through models._quantize.
    from conftest import TINY_CONFIG, make_tiny
    from gemmdrift.models import Quantization, _quantize

    lm = make_tiny()
    capsys.readouterr()
    q = _quantize(lm.model, dict(TINY_CONFIG), Quantization(bits=4, group_size=32, mode="affine"))
    out, err = capsys.readouterr()
    assert out == "", out
    assert "Quantized model" in err  # still said, on stderr
    assert q["bits"] == 4 and q["group_size"] == 32


# ------------------------------------------------------------------ D1: stack --ladder on bit-identical schedules


def _ladder_rows(value: float):
    # The columns stack's ladder table has (gemmdrift.stack: pair, tap, layer, rel_l2_<base>, rel_l2_float32, ...)
    import pandas as pd

    pair = "prefill:8,decode vs prefill:8,verify:2"
    return pd.DataFrame([{"pair": pair, "tap": tap, "layer": i, "rel_l2_bfloat16": value, "rel_l2_float32": value,
                          "shrink": float("nan"), "verdict": "identical"}
                         for i, tap in enumerate(["layer 0", "layer 1", "norm", "logits"])])


@pytest.mark.parametrize("value", [0.0, 1e-3])
def test_ladder_figure_saves_for_bit_identical_and_drifting_schedules(tmp_path, value):
    # Regression: all-zero drift raised "Data cannot be log-scaled because all values are <= 0" when saved.
    import matplotlib.pyplot as plt

    from gemmdrift import files, plots

    fig = plots.ladder(_ladder_rows(value), "bfloat16")
    ax = fig.axes[0]
    files.save_figure(tmp_path / "ladder.png", fig)
    assert (tmp_path / "ladder.png").stat().st_size > 1000
    if value == 0:
        assert ax.get_yscale() == "linear" and "bit-identical" in ax.get_ylabel()
    else:
        assert ax.get_yscale() == "log"
    plt.close("all")


def test_a_figure_that_fails_loses_no_result(tmp_path, monkeypatch, capsys):
    # Regression: a figure's exception ended write_result before result.json (the marker) was written, and the
    # command printed nothing: the measured run was lost. Now: one warning line, every file but that figure.
    import pandas as pd

    from gemmdrift import plots, store
    from gemmdrift.result import Result, tidy

    class Broken:
        def savefig(self, *a, **k):
            raise ValueError("Data cannot be log-scaled because all values are <= 0.")

    good = plots.ladder(_ladder_rows(1e-3), "bfloat16")
    monkeypatch.setitem(plots.DRAW, "demo", lambda r: {"bad.png": Broken(), "good.png": good})
    frame = tidy([{"tap": "logits", "metric": "rel_l2", "value": 0.25, "T": 3}], backend="cpu", mlx="0",
                 model="tiny", dtype="bfloat16")
    r = Result(kind="demo", inputs={"tokens": [1, 2]}, env={"backend": "cpu"}, frame=frame, figures={"flips": 1},
               tables={"extra": pd.DataFrame({"a": [1, 2]})}, details={"note": "x"})
    written = store.write_result(r, tmp_path / "o")
    err = capsys.readouterr().err
    assert "figure bad.png not drawn (ValueError" in err and len(err.strip().splitlines()) == 1, err
    assert store.is_result_dir(tmp_path / "o")
    marker = json.loads((tmp_path / "o" / "result.json").read_text())
    assert "good.png" in marker["files"] and "bad.png" not in marker["files"]
    assert not (tmp_path / "o" / "bad.png").exists() and (tmp_path / "o" / "good.png").exists()
    assert "fig_good" in written
    back = store.read_result(tmp_path / "o")
    assert back.figures["flips"] == 1 and back.tables["extra"]["a"].tolist() == [1, 2]
