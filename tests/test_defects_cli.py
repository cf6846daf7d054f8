"""Issue 33's refusals (PROBE-DEFECTS-2 D7, D12, D14, D15, D16): one line, exit 2, before any model loads.

Each test runs ``gemmdrift.cli.main`` in this process with the model loader replaced by one that fails the
test, so "refused before the model load" is checked, not assumed; the huge ranges are ones the old parsers
could not even build.
"""

import json
import time
from pathlib import Path

import pytest

from gemmdrift import cli

PLUGINS = Path(__file__).parent / "cache_plugins.py"


class ModelLoaded(Exception):
    """The command got as far as loading a model."""


@pytest.fixture
def no_model(monkeypatch):
    import gemmdrift.model as models
    import gemmdrift.measure.server as server

    def boom(*a, **k):
        raise ModelLoaded()

    monkeypatch.setattr(models, "load_model", boom)
    monkeypatch.setattr(server, "measure_server", boom)
    monkeypatch.setenv("MLX_ENABLE_TF32", "0")


def refused(capsys, *argv) -> str:
    """The one error line of ``gemmdrift argv`` (exit 2, nothing on stdout, no model load)."""
    try:
        rc = cli.main([str(a) for a in argv])
    except SystemExit as e:  # argparse
        rc = e.code
    out, err = capsys.readouterr()
    assert rc == 2, err
    assert out == "", out
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 1 and "error:" in lines[0] and "Traceback" not in err, err
    return lines[0]


# ------------------------------------------------------------------ D7: ranges bounded before expansion


def test_parse_ints_counts_a_range_before_building_it():
    from gemmdrift.ranges import MAX_VALUES, parse_ints

    assert parse_ints("1-5,8, 10 - 11", "--ts") == [1, 2, 3, 4, 5, 8, 10, 11]
    assert parse_ints("-1", "--layers") == [-1]
    assert parse_ints(f"1-{MAX_VALUES}", "--ts")[-1] == MAX_VALUES
    t0 = time.perf_counter()
    for text in ("1-1000000000000000", "1-100000000000000000000000", f"1-{MAX_VALUES},1"):
        with pytest.raises(cli.GemmdriftError, match="values, at most"):
            parse_ints(text, "--ts")
    assert time.perf_counter() - t0 < 0.5  # counted from the ends, never expanded


@pytest.mark.parametrize("argv", [
    ["dispatch", "--chip", "M3", "--K", "640", "--N", "2048", "--ts", "1-1000000000000000"],
    ["kernels", "--layers", "0", "--projections", "q_proj", "--rows", "4", "--tokens", "16",
     "--ts", "1-1000000000000000"],
    ["kernels", "--layers", "0-1000000000000", "--ts", "1"],
    ["fingerprint", "--paths", "matmul:bfloat16", "--ts", "1-1000000000000000"],
    ["replay", "check", "--ts", "1-1000000000000000"],
])
def test_huge_ts_ranges_are_refused_at_once(no_model, capsys, argv, tmp_path):
    t0 = time.perf_counter()
    line = refused(capsys, *argv, "--out", tmp_path / "o") if argv[0] != "dispatch" else refused(capsys, *argv)
    assert "values, at most 100000" in line
    assert time.perf_counter() - t0 < 5


# ------------------------------------------------------------------ D12: replay check takes ranges


def test_replay_check_takes_ranges(no_model, tmp_path):
    from gemmdrift.cli.replay import _ints

    assert _ints("1-4", "--ts") == [1, 2, 3, 4] and _ints("0-3,17", "--layers") == [0, 1, 2, 3, 17]
    with pytest.raises(ModelLoaded):  # accepted: the command goes on to load the model
        cli.main(["replay", "check", "--ts", "1-4", "--layers", "0-3", "--out", str(tmp_path / "o")])


# ------------------------------------------------------------------ D14: empty and conflicting specs


@pytest.mark.parametrize("argv,needle", [
    (["replay", "check", "--variant", "dot4=pairwise,dot4=sequential"], "dot4 given twice"),
    (["replay", "check", "--variant", "mma=H2,,dot4=pairwise"], "an empty axis"),
    (["stack", "--kernels", "replay:M3@dot4=pairwise,dot4=sequential"], "dot4 given twice"),
    (["stack", "--kernels", "replay:M3@"], "nothing after '@'"),
    (["state", "--cache-impl", ""], "--cache-impl is empty"),
    (["diverge", "--rollback", ""], "--rollback"),
    (["server", "--rollback", f"{PLUGINS}:rollback_none", "--cases", "concurrent"], "leaves that case out"),
    (["server", "--cache-impl", f"{PLUGINS}:mlx_lm_own", "--cases", "concurrent,conversation"],
     "leaves that case out"),
])
def test_empty_or_conflicting_specs_are_refused(no_model, capsys, tmp_path, argv, needle):
    assert needle in refused(capsys, *argv, "--out", tmp_path / "o")


def test_exact_is_accepted_as_a_variant_name(no_model, tmp_path):
    from gemmdrift.replay import RECIPES, check_variant_text, parse_variant

    check_variant_text("exact")  # the name printed for a recipe with no open order (T=1's cpu gemv, ...)
    for recipe in RECIPES.values():
        assert parse_variant(recipe, "exact") == recipe.default()
    with pytest.raises(ModelLoaded):
        cli.main(["stack", "--kernels", "replay:M3@exact", "--out", str(tmp_path / "o")])


@pytest.mark.parametrize("flags,needle", [
    (["--quantize", "4"], "--quantize"),
    (["--dtype", "float32"], "--dtype"),
    (["--model", "shape:gemma3-270m"], "--model"),
])
def test_compare_two_files_refuses_model_flags(no_model, capsys, tmp_path, flags, needle):
    from gemmdrift.measure.golden import resolve_golden

    base = resolve_golden("linux-cpu")
    line = refused(capsys, "compare", "--base", base, "--other", base, *flags, "--out", tmp_path / "o")
    assert needle in line and "runs no model" in line


# ------------------------------------------------------------------ D15: configurations that cannot exist


Q = ["dispatch", "--chip", "M3", "--op", "quantized_matmul", "--N", "2048"]


@pytest.mark.parametrize("argv,needle", [
    (Q + ["--K", "640", "--bits", "7"], "--bits 7"),
    (Q + ["--K", "640", "--bits", "-4"], "--bits -4"),
    (Q + ["--K", "640", "--bits", "0"], "--bits 0"),
    (Q + ["--K", "640", "--group-size", "0"], "--group-size 0"),
    (Q + ["--K", "640", "--group-size", "48"], "--group-size 48"),
    (Q + ["--K", "100"], "not divisible by the group size 64"),
    (Q + ["--K", "320", "--group-size", "128"], "not divisible by the group size 128"),
    (Q + ["--K", "640", "--mode", "nvfp4", "--bits", "8"], "nvfp4 quantization has 4 bits"),
    (Q + ["--K", "640", "--mode", "mxfp4", "--group-size", "64"], "mxfp4 quantization has group size 32"),
    (Q + ["--K", "640", "--mode", "mxfp8", "--bits", "4"], "mxfp8 quantization has 8 bits"),
    (["dispatch", "--chip", "M3", "--op", "sdpa", "--v-head-dim", "0"], "--v-head-dim must be positive"),
    (["dispatch", "--chip", "applegpu_g99x", "--K", "640", "--N", "64"], "unknown chip applegpu_g99x"),
    (["dispatch", "--chip", "applegpu_g15q", "--K", "640", "--N", "64"], "unknown chip"),
    (["dispatch", "--chip", "sm999", "--K", "640", "--N", "64"], "unknown chip sm_999"),
    (["dispatch", "--chip", "sm_50", "--K", "640", "--N", "64"], "unknown chip sm_50"),
])
def test_dispatch_refuses_what_mlx_refuses(capsys, argv, needle):
    assert needle in refused(capsys, *argv)


@pytest.mark.parametrize("argv,needle", [
    # a flag of another --op was dropped without a word: a dense matmul's table printed for "--bits 7"
    (["dispatch", "--chip", "M3", "--K", "640", "--N", "2048", "--bits", "7"], "--bits is a flag of --op quantized"),
    (["dispatch", "--chip", "M3", "--K", "640", "--N", "2048", "--group-size", "48"], "--group-size is a flag"),
    (["dispatch", "--chip", "M3", "--K", "640", "--N", "2048", "--mode", "nvfp4"], "--mode is a flag"),
    (["dispatch", "--chip", "M3", "--K", "640", "--N", "2048", "--v-head-dim", "0"], "--v-head-dim is a flag of --op sdpa"),
    (["dispatch", "--chip", "M3", "--op", "sdpa", "--K", "640"], "--K is a flag of --op matmul"),
])
def test_dispatch_refuses_a_flag_of_another_op(capsys, argv, needle):
    assert needle in refused(capsys, *argv)


def test_dispatch_still_answers_what_mlx_accepts(capsys):
    for extra in (["--K", "640"], ["--K", "640", "--bits", "8", "--group-size", "128"],
                  ["--K", "640", "--mode", "nvfp4"], ["--K", "640", "--mode", "mxfp8"]):
        assert cli.main(Q + extra + ["--ts", "1-2", "--json"]) == 0
        recs = json.loads(capsys.readouterr().out)
        assert [r["T"] for r in recs] == [1, 2]
    for chip in ("M1", "M5 Max", "applegpu_g16s", "sm80", "sm_120", "cpu"):
        assert cli.main(["dispatch", "--chip", chip, "--K", "640", "--N", "64", "--ts", "1"]) == 0
    capsys.readouterr()


def _env_record(arch: str) -> dict:
    return {"backend": "metal", "architecture": arch, "mlx": "0.32.4", "macos": "26.2"}


def test_dispatch_env_unknown_chip_and_run_directories(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_env_record("applegpu_g99x")))
    assert "unknown chip applegpu_g99x" in refused(capsys, "dispatch", "--env", bad, "--K", "640", "--N", "64")
    # D16: a `gemmdrift run` directory keeps its environment in env.json
    run = tmp_path / "run"
    run.mkdir()
    (run / "env.json").write_text(json.dumps(_env_record("applegpu_g15g")))
    assert cli.main(["dispatch", "--env", str(run), "--K", "640", "--N", "64", "--ts", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["chip"] == "M3"
    empty = tmp_path / "empty"
    empty.mkdir()
    line = refused(capsys, "dispatch", "--env", empty, "--K", "640", "--N", "64")
    assert "no meta.json or env.json" in line and "no such file" not in line
