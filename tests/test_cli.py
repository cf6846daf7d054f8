"""The command line: one-line errors with exit status 2, and small end-to-end runs."""

import json
import os
import subprocess
import sys

import pytest


def gd(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "gemmdrift", *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ}, timeout=600)


def gd_here(monkeypatch, capsys, *args, load=True):
    """`gemmdrift ARGS` in this process: (exit status, stdout, stderr) as ``gd`` gives them. A refusal needs no
    process of its own (each cost 1-2 s of imports); what the command sets in the environment (--device, the
    float32 policy) is restored afterwards. ``load=False``: a call of load_model is an error (the refusal must
    come before any model loads)."""
    from gemmdrift import model
    from gemmdrift.cli import main
    from gemmdrift.machine import envinfo

    def load_model(*a, **k):
        raise AssertionError(f"gemmdrift {' '.join(args)}: a model was loaded before the refusal")

    if not load:
        monkeypatch.setattr(model, "load_model", load_model)
    monkeypatch.setattr(envinfo, "TF32_POLICY", envinfo.TF32_POLICY)
    for k in ("MLX_ENABLE_TF32", "GEMMDRIFT_DEVICE"):
        monkeypatch.setenv(k, os.environ[k]) if k in os.environ else monkeypatch.delenv(k, raising=False)
    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as e:  # argparse's own refusals
        code = e.code
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(list(args), code, out, err)


def assert_user_error(r, needle):
    """Exit status 2, no traceback, and exactly one error line (progress lines may precede it)."""
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and r.stderr.rstrip().endswith(errors[0]), r.stderr
    assert needle in errors[0], errors[0]


@pytest.mark.linux_cpu_reference
def test_env_json_records_versions_and_device():
    r = gd("env", "--json")
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    assert rec["backend"] == "cpu" and rec["mlx"] and rec["mlx_lm"]
    assert "MLX_ENABLE_TF32" in rec["env"] and "MLX_SDPA_BLOCKS" in rec["env"]
    assert isinstance(rec["rope_bf16_positions_exact"], bool)


@pytest.mark.parametrize("args,needle", [
    (["stack", "--bogus"], "unrecognized arguments"),
    (["stack", "--schedules", "decode", "verify:0"], "must be positive"),
    (["stack", "--schedules", "decode", "fly:2"], "cannot parse schedule"),
    (["stack", "--schedules", "decode"], "at least two schedules"),
    (["stack", "--model", "/no/such/model"], "model not found"),
    (["stack", "--dtype", "float8"], "unknown dtype"),
    (["stack", "--quantize", "7"], "unsupported bits"),
    (["diverge", "--n", "0"], "must be positive"),
    (["diverge", "--k", "-1"], "--k must be positive"),
    (["kernels", "--ts", "0-3"], "must be positive"),
    (["kernels", "--ts", "1,x"], "expected numbers"),
    (["kernels", "--paths", "model,turbo:9"], "path"),
    (["kernels", "--rows", "0"], "--rows must be positive"),
    (["kernels", "--flop-budget", "0"], "--flop-budget must be a positive number"),
    (["kernels", "--flop-budget", "nan"], "--flop-budget must be a positive number"),
    (["triage", "--stream-a", "/nope/a.json", "--stream-b", "/nope/b.json"], "cannot read stream file"),
    (["gate", "--threshold", "-1"], "non-negative"),
    (["report", "/no/such/results"], "no such results directory"),
    (["report", "/"], "no gemmdrift results in /"),
    (["report"], "the following arguments are required: dir"),
    (["run", "--sizes", "huge"], "invalid choice"),
    (["nosuchcommand"], "invalid choice"),
])
def test_bad_input_is_one_line_and_exit_2(args, needle, monkeypatch, capsys):
    assert_user_error(gd_here(monkeypatch, capsys, *args), needle)


def test_a_refusal_is_one_line_and_exit_2_from_a_process_of_its_own():
    # The cases above run in this process; here the real process: its exit status and its whole stderr.
    assert_user_error(gd("nosuchcommand"), "invalid choice")
    assert_user_error(gd("stack", "--dtype", "float8"), "unknown dtype")


def test_asking_for_a_gpu_that_mlx_cannot_see():
    import mlx.core as mx

    if mx.metal.is_available() or (hasattr(mx, "cuda") and mx.cuda.is_available()):
        pytest.skip("this machine has a GPU backend")
    assert_user_error(gd("stack", "--device", "gpu"), "no GPU backend")


@pytest.mark.slow
@pytest.mark.parametrize("content,needle", [('[1, 2, "x"]', "not an integer"), ("[1, 999999]", "outside the vocabulary"),
                                            ("", "no token ids"), ("[1, 2", "not valid JSON"),
                                            ("1 2 x", "not an integer")])
def test_bad_prompt_id_files(tmp_path, content, needle):
    f = tmp_path / "ids.json"
    f.write_text(content)
    assert_user_error(gd("stack", "--prompt-ids", str(f), "--out", str(tmp_path / "o")), needle)


@pytest.mark.slow
def test_stack_positions_and_lengths_are_checked(tmp_path, monkeypatch, capsys):
    def gd(*args):  # in this process (each refusal comes after the model loads: 1-2 s of imports less)
        return gd_here(monkeypatch, capsys, *args)

    assert_user_error(gd("stack", "--prompt", "Hi there", "--positions", "5:50", "--out", str(tmp_path)),
                      "out of range")
    assert_user_error(gd("stack", "--prompt", "Hi", "--tokens", "40", "--out", str(tmp_path)), "only")
    assert_user_error(gd("stack", "--prompt", "Hello there, friend", "--split", "40", "--out", str(tmp_path)),
                      "split")


@pytest.mark.linux_cpu_reference
@pytest.mark.slow
def test_stack_end_to_end_on_the_embedded_gemma(tmp_path):
    out = tmp_path / "stack"
    r = gd("stack", "--tokens", "24", "--split", "16", "--schedules", "prefill:512,decode", "prefill:512,verify:2",
           "--out", str(out), "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["tokens"] == 24 and summary["pairs"][0]["positions"] == 8
    # Far below the 512 window: on this backend the two schedules are bit-identical.
    assert summary["pairs"][0]["max_abs_dlogit"] == 0 and summary["pairs"][0]["first_layer_with_drift"] is None
    for name in ("stack.csv", "positions.csv", "envelope.csv", "meta.json", "summary.json", "stack_drift.png"):
        assert (out / name).exists(), name
    meta = json.loads((out / "meta.json").read_text())
    assert meta["env"]["backend"] == "cpu" and len(meta["inputs"]["tokens"]) == 24
    assert meta["inputs"]["model"]["source"] == "embedded"


@pytest.mark.linux_cpu_reference
@pytest.mark.slow
def test_run_quick_writes_the_report_and_resumes(tmp_path):
    out = tmp_path / "run"
    r = gd("run", "--sizes", "quick", "--out", str(out))
    assert r.returncode == 0, r.stderr
    report = (out / "report.md").read_text()
    for heading in ("## 1. Kernels", "## 2. Layer stack", "## 3. Prefill", "## 4. Greedy divergence"):
        assert heading in report
    assert "EMULATED" in report  # the negative control is labelled as such
    assert "## What this shows" in report and "bit-identical" in report
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == report.count("![") >= 6  # every figure, embedded
    assert f"report: {out / 'report.html'}" in r.stdout
    for name in ("stream_a.json", "stream_b.json", "meta.json", "triage.png"):
        assert (out / "diverge" / name).exists(), name
    parts = ("stack-decode", "stack-prefill", "kernels", "diverge", "state", "predict", "attribute")
    for part in parts:
        assert (out / part / "done.json").exists()
    assert not (out / ".prefix").exists()  # the shared prefixes, kept until every part is done
    assert "## 5. Cache state exactness" in report
    assert "Predicted GPU drift (replay)" in report and "not a measurement" in report
    assert "Which op: local drift per op and layer" in report and "gemmdrift attribute --model embedded" in report
    again = gd("run", "--sizes", "quick", "--out", str(out))
    assert again.returncode == 0 and again.stderr.count("done before (resumed)") == len(parts)


@pytest.mark.parametrize("args,needle", [
    (["stack", "--out", "{file}"], "is a file, not a directory"),
    (["gate", "--out", "{file}/sub"], "is a file, not a directory"),
    (["run", "--out", "{file}"], "is a file, not a directory"),
    (["stack", "--prompt", "", "--out", "{tmp}/o"], "--prompt is empty"),
    (["stack", "--prompt-file", "{tmp}/missing.txt", "--out", "{tmp}/o"], "no such file"),
    (["stack", "--positions", "35:30", "--out", "{tmp}/o"], "reversed"),
    (["stack", "--split", "0", "--out", "{tmp}/o"], "--split must be positive"),
    (["kernels", "--layers", "3-1", "--out", "{tmp}/o"], "reversed"),
    (["kernels", "--ts", "64,128", "--max-t", "32", "--out", "{tmp}/o"], "below every block size"),
    (["diverge", "--envelope", "nan", "--out", "{tmp}/o"], "--envelope must be a finite non-negative"),
    (["diverge", "--envelope", "-0.5", "--out", "{tmp}/o"], "--envelope must be a finite non-negative"),
    (["diverge", "--prompts", "builtin", "--context", "nosuchtext", "--out", "{tmp}/o"], "no such built-in text"),
    (["triage", "--stream-a", "{file}", "--stream-b", "{bad}", "--out", "{tmp}/o"], "not an integer"),
    (["triage", "--stream-a", "{file}", "--stream-b", "{file}", "--envelope", "inf", "--out", "{tmp}/o"],
     "--envelope must be a finite non-negative"),
])
def test_bad_input_is_refused_before_any_model_loads(tmp_path, args, needle, monkeypatch, capsys):
    # Regression: these were accepted and failed (or ran on) only after the model loaded and computed:
    # an --out that is a file raised NotADirectoryError after the run (exit 1, a gate "regression"),
    # --envelope nan gave a matplotlib traceback, a negative one OUTSIDE ENVELOPE on identical streams,
    # reversed ranges and an empty prompt were not named, --max-t below every --ts exited 0 on an empty sweep.
    # gd_here makes a model load an error, so each is refused before any model loads (the test used to time a
    # process of its own against 2 s, which failed on a loaded machine).
    f = tmp_path / "file.txt"
    f.write_text("[1, 2, 3]")
    bad = tmp_path / "bad.txt"
    bad.write_text("1 2 x")
    args = [a.format(file=f, bad=bad, tmp=tmp_path) for a in args]
    assert_user_error(gd_here(monkeypatch, capsys, *args, load=False), needle)
    assert not (tmp_path / "o").exists()


def test_a_stream_longer_than_the_model_is_refused_before_computing(tmp_path):
    # Regression: a 10-million-token id file was accepted and ran silently for minutes.
    ids = tmp_path / "ids.txt"
    ids.write_text(" ".join(["1"] * 40_000))
    r = gd("stack", "--model", "shape:gemma3-270m", "--prompt-ids", str(ids), "--out", str(tmp_path / "o"))
    assert_user_error(r, "more than the model's 32,768 positions")


def test_run_refuses_to_resume_a_directory_made_with_other_inputs(tmp_path):
    # Regression: `run --out d --dtype float16` on a directory run at bfloat16 resumed it, mixing parts
    # of both under one label. A corrupt done.json crashed the resume instead of redoing that part.
    from gemmdrift import suite

    out = tmp_path / "run"
    out.mkdir()
    import importlib.metadata as md

    (out / "run.json").write_text(json.dumps({"model": "embedded", "dtype": "bfloat16", "sizes": "quick",
                                              "mlx": md.version("mlx"), "mlx_lm": md.version("mlx-lm")}))
    for args, needle in ((["--dtype", "float16"], "dtype 'bfloat16' (now 'float16')"),
                         (["--sizes", "cpu"], "sizes 'quick' (now 'cpu')"),
                         (["--model", "shape:gemma3-270m"], "model 'embedded'")):
        r = gd("run", "--sizes", "quick", "--out", str(out), *args)
        assert_user_error(r, needle)
    (out / "run.json").write_text("[")
    assert_user_error(gd("run", "--sizes", "quick", "--out", str(out)), "run.json is corrupt")
    part = tmp_path / "part"
    part.mkdir()
    (part / "done.json").write_text("{")
    assert not suite._done(part, "k") and not (part / "done.json").exists()


def test_kernels_flop_budget_is_the_devices_own_and_can_be_given(tmp_path, monkeypatch, capsys):
    """The kernel probe's FLOP budget: the CPU's 2e9 on a CPU, a GPU's 1e12 where mlx's default device is a GPU (the
    CPU's budget would cut a GPU's sweep short), --flop-budget over both; recorded with the result, and it decides
    which block sizes above 4 run."""
    from test_models import save_tiny

    from gemmdrift import cli, store, suite

    save_tiny(tmp_path / "m")
    (tmp_path / "ids.json").write_text(json.dumps(list(range(1, 17))))
    base = ["kernels", "--model", str(tmp_path / "m"), "--prompt-ids", str(tmp_path / "ids.json"), "--layers", "0",
            "--projections", "q_proj", "--rows", "2", "--paths", "model", "--ts", "1,2,8,16"]

    def run(name, *more):
        assert cli.main([*base, *more, "--out", str(tmp_path / name)]) == 0
        err = capsys.readouterr().err
        r = store.read_result(tmp_path / name)
        return r, err, sorted(set(int(t) for t in r.tables["kernels"]["T"]))

    r, err, ts = run("cpu")
    assert r.inputs["flop_budget"] == 2e9 and "FLOP budget 2e+09" in err and ts == [1, 2, 8, 16]
    r, err, ts = run("small", "--flop-budget", "1")  # only the always-measured sizes (up to 4) fit
    assert r.inputs["flop_budget"] == 1.0 and ts == [1, 2]
    monkeypatch.setattr(suite, "default_sizes", lambda: "gpu")
    r, err, ts = run("gpu")
    assert r.inputs["flop_budget"] == 1e12 and "FLOP budget 1e+12" in err
