"""Issue 33, the crash and hang defects (PROBE-DEFECTS-2: the triage/batch refusals, D1-D6): each test fails on the
code before its fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def gd(*args, cwd=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "gemmdrift", *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ}, timeout=timeout)


def gd_here(capsys, *args):
    """`gemmdrift ARGS` in this process (a refusal needs no process of its own): (exit status, stdout, stderr)."""
    from gemmdrift.cli import main

    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, out, err)


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
def test_triage_refuses_before_printing_its_schedules(tmp_path, capsys, extra, needle):
    # Regression: "stream A under prefill:2048,decode (...)" was printed, then the error.
    s = tmp_path / "s.json"
    s.write_text("[1, 2, 3]")
    args = ["triage", "--stream-a", str(s), "--stream-b", str(s), "--out", str(tmp_path / "o"), *extra]
    assert_refused_first(gd_here(capsys, *args), needle)


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
    from gemmdrift.model import gguf_gemma

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
    from gemmdrift.model import gguf_gemma

    d = gguf_gemma.converted_dir(gguf_gemma.embedded_gguf(), progress=False)
    r = gd("batch", "--model", str(d), "--prompt", "hi", "--n", "100000", "--batch-sizes", "1",
           "--out", str(tmp_path / "o"))
    assert_refused_first(r, "more than the model's 32,768 positions")


# ------------------------------------------------------------------ D4: mlx-lm's [INFO] line off stdout


def test_quantize_keeps_stdout_clean(capsys):
    # Regression: mlx-lm's quantize_model printed "[INFO] Quantized model with 4.5 bits per weight." on stdout,
    # before a --json summary, which then did not parse. load_model quantizes through models._quantize.
    from conftest import TINY_CONFIG, make_tiny
    from gemmdrift.model import Quantization, _quantize

    lm = make_tiny()
    capsys.readouterr()
    q = _quantize(lm.model, dict(TINY_CONFIG), Quantization(bits=4, group_size=32, mode="affine"))
    out, err = capsys.readouterr()
    assert out == "", out
    assert "Quantized model" in err  # still said, on stderr
    assert q["bits"] == 4 and q["group_size"] == 32


def test_server_default_draft_conversion_keeps_stdout_clean(tmp_path, monkeypatch, capsys):
    # The same fault in `server`'s default draft: mlx_lm.convert prints "[INFO] Loading" / "[INFO] Quantizing" on
    # stdout (planted here: the real conversion takes a minute).
    import importlib

    from gemmdrift.measure import server

    module = importlib.import_module("mlx_lm.convert")  # the module (the package's attribute is the function)

    def convert(hf_path, mlx_path, **kw):
        print("[INFO] Quantizing")
        Path(mlx_path).mkdir(parents=True)
        Path(mlx_path, "config.json").write_text("{}")

    monkeypatch.setenv("GEMMDRIFT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(module, "convert", convert)
    (tmp_path / "m").mkdir()
    d = server.requantized_draft(tmp_path / "m")
    out, err = capsys.readouterr()
    assert (d / "config.json").exists() and out == "" and "[INFO] Quantizing" in err


# ------------------------------------------------------------------ D1: stack --ladder on bit-identical schedules


def _ladder_rows(value: float):
    # The columns stack's ladder table has (gemmdrift.measure.stack: pair, tap, layer, rel_l2_<base>, rel_l2_float32, ...)
    import pandas as pd

    pair = "prefill:8,decode vs prefill:8,verify:2"
    return pd.DataFrame([{"pair": pair, "tap": tap, "layer": i, "rel_l2_bfloat16": value, "rel_l2_float32": value,
                          "shrink": float("nan"), "verdict": "identical"}
                         for i, tap in enumerate(["layer 0", "layer 1", "norm", "logits"])])


@pytest.mark.parametrize("value", [0.0, 1e-3])
def test_ladder_figure_saves_for_bit_identical_and_drifting_schedules(tmp_path, value):
    # Regression: all-zero drift raised "Data cannot be log-scaled because all values are <= 0" when saved.
    import matplotlib.pyplot as plt

    from gemmdrift import files
    from gemmdrift.view import plots

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

    from gemmdrift.view import plots
    from gemmdrift import store
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


# ------------------------------------------------------------------ D3: compare --save checked up front


@pytest.fixture
def base_copy(tmp_path):
    import shutil

    from gemmdrift.measure.golden import resolve_golden

    b = tmp_path / "g" / "base.npz"
    b.parent.mkdir()
    shutil.copy(resolve_golden("linux-cpu"), b)
    return b


@pytest.mark.parametrize("save,needle", [
    ("{dir}", "--save {dir} is a directory"),  # was IsADirectoryError after the whole live run
    ("/proc/zz.npz", "--save /proc/zz.npz"),  # was "--out /proc: cannot write there"
    ("{base}", "is the base file itself"),  # was: the base silently overwritten
    ("{dir}/../g/./base.npz", "is the base file itself"),  # the same file, spelled otherwise
])
def test_compare_save_is_refused_before_the_model_loads(tmp_path, capsys, base_copy, save, needle):
    before = base_copy.read_bytes()
    save = save.format(dir=base_copy.parent, base=base_copy)
    r = gd_here(capsys, "compare", "--base", str(base_copy), "--tokens", "4", "--save", save, "--out",
                str(tmp_path / "o"))
    assert_refused_first(r, needle.format(dir=base_copy.parent))
    assert base_copy.read_bytes() == before and not (tmp_path / "o").exists()


# ------------------------------------------------------------------ D5: a plug-in that raises mid-run


PLUG = '''
from mlx_lm.models.cache import KVCache


def rollback(cache, n):
    raise RuntimeError("boom from rollback")


class Upd(KVCache):
    def update_and_fetch(self, k, v):
        raise RuntimeError("update exploded")


def upd(model):
    return [Upd() for _ in model.layers]
'''


@pytest.fixture
def plug(tmp_path):
    p = tmp_path / "plug.py"
    p.write_text(PLUG)
    return p


def test_diverge_rollback_that_raises_is_refused_in_one_line(tiny, plug):
    # Regression: RuntimeError from the plug-in as a traceback (four chained ones from a worker), exit 1.
    from gemmdrift.measure.diverge import diverge
    from gemmdrift.errors import GemmdriftError

    with pytest.raises(GemmdriftError) as e:
        diverge(tiny, [1, 2, 3, 4, 5], 4, k=2, prefill_b=4, do_triage=False, rollback=f"{plug}:rollback", workers=1)
    msg = str(e.value)
    assert msg.startswith("refused:") and f"--rollback {plug}:rollback" in msg
    assert msg.endswith("raised RuntimeError: boom from rollback")


def test_diverge_cache_impl_that_raises_is_refused_in_one_line(tiny, plug):
    from gemmdrift.measure.diverge import diverge
    from gemmdrift.errors import GemmdriftError

    with pytest.raises(GemmdriftError, match=r"refused: .*--cache-impl .*:upd\) raised RuntimeError: update exploded"):
        diverge(tiny, [1, 2, 3, 4, 5], 4, k=2, prefill_b=4, do_triage=False, cache_impl=f"{plug}:upd", workers=1)


def test_stack_cache_impl_that_raises_is_refused_in_one_line(tiny, plug):
    # Regression: `stack --cache-impl plug:upd` ended in a traceback `RuntimeError: update exploded`.
    from gemmdrift.state import bench as cachebench
    from gemmdrift.errors import GemmdriftError
    from gemmdrift.caches.plugins import load_cache_impl
    from gemmdrift.measure.stack import measure_stack

    impl = load_cache_impl(f"{plug}:upd")
    with pytest.raises(GemmdriftError, match=r"refused: .*--cache-impl .*:upd\) raised RuntimeError: update exploded"):
        with cachebench.stack_caches(impl, tiny):
            measure_stack(tiny, list(range(1, 13)), ["prefill:8,decode", "prefill:8,verify:2"], split=8, local=False,
                          workers=1)


def test_diverge_plugin_that_raises_in_a_worker_is_one_line_end_to_end(tmp_path, plug):
    # The speculative stream runs in a spawned worker here (2 streams, 2 workers): the refusal crosses the process
    # boundary as the same one line, exit 2, no traceback.
    r = gd("diverge", "--prompt", "Hello there", "--n", "3", "--no-triage", "--prefill-b", "8",
           "--rollback", f"{plug}:rollback", "--out", str(tmp_path / "o"))
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("gemmdrift: error: refused:") and "RuntimeError: boom from rollback" in last, r.stderr


# ------------------------------------------------------------------ D6: server --cache-impl checked before the servers


def test_server_cache_impl_is_checked_on_the_loaded_model_before_any_server(tmp_path, monkeypatch):
    # Regression: a factory returning 3 caches for 18 layers was found only inside the draft server, 40 s later,
    # as "request failed (Remote end closed connection without response); server log: ------".
    from gemmdrift.measure import server
    from gemmdrift.errors import GemmdriftError

    p = tmp_path / "few.py"
    p.write_text("from mlx_lm.models.cache import make_prompt_cache\n\n\n"
                 "def few(model):\n    return make_prompt_cache(model)[:3]\n")

    def no_server(self):
        raise AssertionError("a server started before the plug-in was checked")

    def no_compute(*a, **k):
        raise AssertionError("the in-process reference ran before the plug-in was checked")

    monkeypatch.setattr(server.MlxLmServer, "start", no_server)
    monkeypatch.setattr("gemmdrift.measure.diverge.generate_plain", no_compute)
    with pytest.raises(GemmdriftError, match=r"--cache-impl: .*few\.py:few\(model\) returned 3 caches for 18 layers"):
        server.measure_server("embedded", "Hello", 2, cases=["draft"], triage=False,
                              plugins={"cache_impl": f"{p}:few", "rollback": None})


def test_server_error_shows_the_cause_from_its_log(tmp_path):
    # Regression: a request whose handler raised is logged by the HTTP server as a traceback between two rules of
    # dashes; the error showed the rule ("server log: ----------------------------------------").
    from gemmdrift.measure import serving

    log = tmp_path / "server.log"
    log.write_text("----------------------------------------\n"
                   "Exception occurred during processing of request from ('127.0.0.1', 5555)\n"
                   "Traceback (most recent call last):\n"
                   '  File "/x/mlx_lm/server.py", line 10, in handle\n'
                   "    cache = make_prompt_cache(model)\n"
                   "gemmdrift.errors.GemmdriftError: --cache-impl: p.py:few(model) returned 3 caches for 18 layers\n"
                   "----------------------------------------\n")
    assert serving._last_line(log) == ("gemmdrift.errors.GemmdriftError: --cache-impl: p.py:few(model) returned 3 "
                                      "caches for 18 layers")


# ------------------------------------------------------------------ D2: Ctrl-C with worker processes

# Two planted workers (gemmdrift.workers.run_tasks, the same pool exit as run_jobs/pool): each writes its pid and
# then sleeps two minutes; "stubborn" ones ignore SIGINT and SIGTERM (as a worker a group SIGINT left stuck in a
# lock would). The main process must obey a SIGINT promptly, stop the workers with a bounded wait, and exit.
SCRIPT = '''
import os, signal, sys, time
from pathlib import Path

def job(d, stubborn):
    if stubborn:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    Path(d, f"{os.getpid()}.pid").write_text("")
    time.sleep(120)
    return 1

if __name__ == "__main__":
    from gemmdrift import workers
    workers.STOP_SECONDS = 2.0
    try:
        workers.run_tasks(job, [dict(d=sys.argv[1], stubborn=sys.argv[2] == "1")] * 2, 2)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(130)
    sys.exit(0)
'''


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) is gone too
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False



@pytest.mark.parametrize("stubborn,group", [(False, False), (True, True)],
                         ids=["SIGINT-to-the-main-alone", "group-SIGINT-stuck-workers"])
def test_interrupt_stops_the_workers_promptly(tmp_path, stubborn, group):
    # Regression (D2): a SIGINT to the main alone waited for the workers' whole jobs; after a group SIGINT a stuck
    # worker kept the main waiting forever.
    import signal
    import time

    script = tmp_path / "planted.py"
    script.write_text(SCRIPT)
    # SIGINT back to its default in the child (as test_probe's): a runner started in the background ignores it,
    # the child inherits that, and Python then installs no KeyboardInterrupt handler (the main would sleep on)
    p = subprocess.Popen([sys.executable, str(script), str(tmp_path), "1" if stubborn else "0"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 120  # two spawned workers start (imports under load)
        while len(pids) < 2 and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.2)
            pids = [int(f.stem) for f in tmp_path.glob("*.pid")]
        assert len(pids) == 2, p.stderr.read() if p.poll() is not None else "workers did not start"
        time.sleep(0.5)
        t0 = time.monotonic()
        if group:
            os.killpg(p.pid, signal.SIGINT)
        else:
            os.kill(p.pid, signal.SIGINT)
        out, err = p.communicate(timeout=40)
        seconds = time.monotonic() - t0
        assert p.returncode == 130 and "interrupted" in out, (p.returncode, out, err)
        assert seconds < 20, f"exited {seconds:.1f} s after the SIGINT"
        assert not any(_alive(pid) for pid in pids), "a worker outlived the interrupted main"
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
