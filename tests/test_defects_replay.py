"""Issue 33's replay check defects (PROBE-DEFECTS-2 D11b, D13, D17): a finished check drops its checkpoint,
Ctrl-C says what was kept, the report names the chip and says prediction, the help says what --json prints."""

import json
from argparse import Namespace

import pytest

from gemmdrift import cli

SMALL = ["--layers", "0", "--projections", "q_proj", "--paths", "dense:bfloat16", "--ts", "1-2", "--rows", "4",
         "--tokens", "16"]


@pytest.mark.slow
def test_a_finished_check_drops_its_checkpoint_and_a_second_chip_runs(tmp_path, capsys):
    from gemmdrift.report import build_report
    from gemmdrift.store import read_result

    out = tmp_path / "rc"
    assert cli.main(["replay", "check", "--chip", "M3", *SMALL, "--out", str(out)]) == 0
    capsys.readouterr()
    assert not (out / "checkpoint").exists()  # the Result holds every unit: no stale checkpoint blocks the dir
    first = read_result(out)
    assert first.inputs["chip"].startswith("M3") and first.inputs["prediction"]
    md = build_report(out)["markdown"].read_text()
    assert "M3" in md and "PREDICTION" in md and "(none)" not in md  # D17: the report names the chip
    # the same --out with another chip: no "belongs to another replay check" refusal
    assert cli.main(["replay", "check", "--chip", "sm80", *SMALL, "--out", str(out), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)  # --json: one object with a records list
    assert got["chip"].startswith("sm80") and got["prediction"] and got["records"]
    assert read_result(out).inputs["chip"].startswith("sm80") and not (out / "checkpoint").exists()


def test_an_interrupted_check_says_its_units_are_kept(tmp_path):
    from gemmdrift.interrupts import on_interrupt

    msg = on_interrupt(Namespace(command="replay", out=str(tmp_path / "rc")), KeyboardInterrupt())
    assert "kept in" in msg and str(tmp_path / "rc" / "checkpoint") in msg and "nothing was written" not in msg


def test_replay_check_help_says_what_json_prints(capsys):
    with pytest.raises(SystemExit):
        cli.main(["replay", "check", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "one JSON object" in text and "records list" in text and "exact" in text


def test_replay_check_refuses_an_unmodelled_release_before_the_load(tmp_path, capsys, monkeypatch):
    import gemmdrift.model as models

    def boom(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(models, "load_model", boom)
    assert cli.main(["replay", "check", "--chip", "M3", "--mlx-version", "0.26.3", *SMALL,
                     "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()  # older than the first tag read (0.26.5, issue 54)
    assert len(err.splitlines()) == 1 and "0.26.3" in err and "older than the first tag read" in err
    assert not (tmp_path / "o").exists()


def test_stack_replay_sm90_is_refused_before_the_load_when_the_length_is_known(tmp_path, capsys, monkeypatch):
    # D8: every CUDA T >= 2 is cuBLASLt (no recipe); the verify blocks of the schedules are known from
    # --tokens and --split, the shapes from the embedded model's config: refused before the model loads.
    import gemmdrift.model as models

    def boom(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(models, "load_model", boom)
    for chip in ("sm90", "sm80"):
        assert cli.main(["stack", "--kernels", f"replay:{chip}", "--tokens", "12", "--split", "8", "--schedules",
                         "prefill:8,decode", "prefill:8,verify:2", "--no-local", "--out", str(tmp_path / chip)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "T=3" in err and "cublaslt" in err and "no replay recipe" in err
    # decode alone past the prefix (T=1: cuda_gemv has a recipe) is not refused: the run goes on to load the model
    with pytest.raises(AssertionError, match="the model was loaded"):
        cli.main(["stack", "--kernels", "replay:sm90", "--tokens", "12", "--split", "8", "--schedules",
                  "prefill:8,decode", "prefill:8@8,decode", "--no-local", "--out", str(tmp_path / "ok")])


def test_replayed_ts_are_the_blocks_past_the_shared_prefix():
    from gemmdrift.replay.model import config_shapes, replayed_ts
    from gemmdrift.model import SHAPES

    assert replayed_ts(["prefill:512,decode", "prefill:512,verify:2"], 40, 32) == {1, 3, 2}  # 8 = 3 + 3 + 2
    assert replayed_ts(["prefill:32,decode", "prefill:32,verify:3"], 40, 32) == {1, 4}
    assert replayed_ts(["prefill:32,decode", "prefill:32,verify:3"], 40, 32, replay_prefix=True) == {32, 1, 4}
    shapes = {name: (k, n) for name, k, n, _ in config_shapes(SHAPES["gemma3-270m"])}
    assert shapes["q_proj"] == (640, 1024) and shapes["k_proj"] == (640, 256) and shapes["down_proj"] == (2048, 640)
    assert shapes["lm_head"] == (640, 262144)


@pytest.mark.slow
def test_stack_replay_sm90_is_refused_before_computing_when_the_length_needs_the_tokenizer(tmp_path, capsys,
                                                                                           monkeypatch):
    import gemmdrift.measure.stack as stack

    def boom(*a, **k):
        raise AssertionError("the run was computed")

    monkeypatch.setattr(stack, "measure_stack", boom)
    assert cli.main(["stack", "--kernels", "replay:sm90", "--prompt", "The quick brown fox jumps over the lazy dog "
                     "and runs far away into the woods", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "cublaslt" in err[-1] and "no replay recipe" in err[-1]


def _no_load(monkeypatch):
    import gemmdrift.model as models

    def boom(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(models, "load_model", boom)


def test_triage_replay_sm90_is_refused_before_the_load(tmp_path, capsys, monkeypatch):
    # D8: triage's streams carry the prompt, so the continuation's blocks (stream B under verify: T >= 2, every
    # CUDA T >= 2 is cuBLASLt) are known before the load: one line, exit 2, nothing printed before it
    _no_load(monkeypatch)
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps({"prompt": list(range(2, 14)), "tokens": [5, 6, 7, 8]}))
    b.write_text(json.dumps({"prompt": list(range(2, 14)), "tokens": [5, 6, 9, 8]}))
    for chip in ("sm90", "sm80"):
        assert cli.main(["triage", "--kernels", f"replay:{chip}", "--stream-a", str(a), "--stream-b", str(b),
                         "--schedule-a", "prefill:2048,decode", "--schedule-b", "prefill:2048,verify:2",
                         "--out", str(tmp_path / chip)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "cublaslt" in err and "no replay recipe" in err, err
        assert not (tmp_path / chip).exists()
    # both under decode past the prompt (T=1: cuda_gemv has a recipe): not refused, the run goes on to the load
    with pytest.raises(AssertionError, match="the model was loaded"):
        cli.main(["triage", "--kernels", "replay:sm90", "--stream-a", str(a), "--stream-b", str(b),
                  "--schedule-a", "prefill:2048,decode", "--schedule-b", "prefill:2048,decode",
                  "--out", str(tmp_path / "ok")])


def test_triage_ts_are_the_continuation_blocks():
    from gemmdrift.replay.model import triage_ts

    # prompt of 12: split 11, positions 11.. teacher-forced; stream A of 4 under decode -> T=1 (11, 12, 13, 14);
    # stream B of 5 under verify:2 (blocks of 3) -> 11..13, 14..15: T=3 and 2
    assert triage_ts(["prefill:2048,decode", "prefill:2048,verify:2"], 12, [4, 5]) == {1, 3, 2}
    assert triage_ts(["prefill:2048,decode", "prefill:2048,verify:3"], 12, [4, 2]) == {1, 2}
    assert triage_ts(["prefill:2048,decode", "prefill:2048,verify:3"], 1, [4, 4]) == set()


def test_diverge_replay_sm90_is_refused_before_the_load(tmp_path, capsys, monkeypatch):
    # D8: the speculative stream's first verify feeds min(n, k) + 1 >= 2 rows: refused before the load
    _no_load(monkeypatch)
    for extra in ([], ["--k", "1"], ["--n", "1"]):
        assert cli.main(["diverge", "--kernels", "replay:sm90", "--prompt", "hi", "--n", "4", *extra,
                         "--out", str(tmp_path / "d")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "cublaslt" in err and "no replay recipe" in err, err
    with pytest.raises(AssertionError, match="the model was loaded"):  # plain vs plain: T=1 only past the prompt
        cli.main(["diverge", "--kernels", "replay:sm90", "--prompt", "hi", "--n", "4", "--compare", "prefill",
                  "--out", str(tmp_path / "ok")])
