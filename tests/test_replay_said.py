"""What the replay says it did (issue 53, items 18, 21 and 31): a predicted cell whose envelope table says "not
knowable" (M5's NAX) is not knowable, not "not replayed"; a replay variant that nothing uses is refused before
the model loads (or said unused after the run); `replay check` counts only the cells it replayed."""

from __future__ import annotations

import math

import pytest

from gemmdrift.errors import GemmdriftError


def test_m5_cell_is_not_knowable_where_its_verification_is_nax(tmp_path):
    """Bug: the M5 cell of 0.32.0 -> 0.32.1 said "not replayed" while the page's envelope table said "not
    knowable: NAX", and `--replay` could not fill it (0.32.0 verifies on NAX; only its T=1 decode replays)."""
    from gemmdrift.changelog.predicted import Predictor, chip_class

    p = Predictor(cache=tmp_path / "replayed.json")
    fig = {"max_abs_dlogit": 0.0625, "max_abs_dgap": 0.0, "flips": 0.0}
    nax = "M5 matmul bfloat16 T=2 K=640 N=1024: mlx 0.32.0 dispatches steel_gemm_nax, which has no replay recipe"
    p._cache[f"M5|{p.signature('M5', '0.32.0')}"] = {"decode-vs-cpu": fig,
                                                     "refused": {"verify:2": nax, "verify:3": nax}}
    p._cache[f"M5|{p.signature('M5', '0.32.1')}"] = {"verify:2": fig, "verify:3": fig}
    got = chip_class(p, "M5", "0.32.0", "0.32.1")
    assert got["cell"] == "not knowable" and got["cls"] is None
    assert "the order inside NAX's matmul2d is in the hardware" in got["reason"]
    # Nothing cached for a side: that one is "not replayed" (`--replay` computes it).
    q = Predictor(cache=tmp_path / "empty.json")
    assert chip_class(q, "M5", "0.32.0", "0.32.1")["cell"] == "not replayed"


def _kopt(text):
    from gemmdrift.replay.model import KernelsOption, config_shapes
    from gemmdrift.model import SHAPES

    return KernelsOption(text), config_shapes(SHAPES["gemma3-270m"])


def test_a_variant_no_call_uses_is_refused_before_the_load():
    """Bug: `replay:M1@dot4=pairwise` was accepted and printed as applied, though M1 never runs gemv_wide (gen 15+),
    the only dense kernel with a dot4 axis."""
    k, shapes = _kopt("replay:M1@dot4=pairwise")
    with pytest.raises(GemmdriftError, match=r"no call of this run can use dot4 \(fp_qmv_wide, gemv_wide only\)"):
        k.check_run(shapes, ["prefill:8,decode", "prefill:8,verify:3"], 12, 8, "bfloat16")
    k, _ = _kopt("replay:M3@dot4=pairwise")  # M3 runs gemv_wide at T=2..14: used, accepted
    k.check_run(shapes, ["prefill:8,decode", "prefill:8,verify:3"], 12, 8, "bfloat16")
    k, _ = _kopt("replay:M1@mma=H2")  # M1's steel GEMM has mma: accepted
    k.check_run(shapes, ["prefill:8,decode", "prefill:8,verify:3"], 12, 8, "bfloat16")


def test_the_cli_refuses_an_unused_variant_in_one_line(capsys, tmp_path):
    from gemmdrift import cli

    out = tmp_path / "stack"
    assert cli.main(["stack", "--kernels", "replay:M1@dot4=pairwise", "--tokens", "12", "--out", str(out)]) == 2
    assert not out.exists()  # refused before any work
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no call of this run can use dot4" in err


def test_an_unused_axis_is_said_after_the_run():
    """Where the calls are only known after the run, the record and the headline say the axis went unused."""
    from collections import Counter

    from gemmdrift.replay.model import ReplayLog, unused_axes
    from gemmdrift.view.summaries import replay_note

    assert unused_axes("dot4=pairwise,mma=H2", {"steel_gemm", "gemv"}) == ["dot4"]
    assert unused_axes("dot4=pairwise", {"gemv_wide"}) == [] and unused_axes(None, {"gemv"}) == []
    log = ReplayLog("M1", "0.32.4", "dot4=pairwise", Counter({("0:q_proj", "gemv", "exact", 1): 3}))
    rec = log.record()
    assert rec["variant_unused"] == ["dot4"]

    class R:
        details = {"replay": rec}

    assert "variant dot4=pairwise (unused: no replayed call ran a kernel with dot4)" in replay_note(R)


def test_replay_check_counts_only_replayed_cells():
    """Bug: `replay check --chip M3` counted its two unreplayed float32 cells (Metal has no float32 recipe) among
    its 8 (path, T) cells, as if checked and not identical."""
    from gemmdrift.replay.check import cells_line

    records = []
    for path in ("dense:bfloat16", "quant:affine-q4-g64", "quant:affine-q8-g64"):
        for T in (1, 2):
            records.append({"path": path, "T": T, "variant": "exact", "kernel": "gemv", "identical": T == 1,
                            "max_ulp": 0.0 if T == 1 else 1.0, "note": ""})
    for T, ulp in ((1, math.nan), (2, None)):  # NaN in memory, None once the result is written and read back
        records.append({"path": "dense:float32", "T": T, "variant": "", "kernel": "", "identical": False,
                        "max_ulp": ulp, "note": "gemv has no float32 recipe (it has: bfloat16, float16)"})

    class R:
        details = {"records": records}

    assert cells_line(R) == ("3 of 6 replayed (path, T) cells have a bit-identical variant; 2 not replayed, no recipe "
                             "(dense:float32 T=1, 2: each line above says why)")


def test_metal_has_no_float32_recipe():
    """docs/replay.md says so: a Metal float32 call is not replayed (one line saying why)."""
    from gemmdrift.replay import RECIPES
    from gemmdrift.replay.paths import plan_for

    assert all("float32" not in r.dtypes for r in RECIPES.values() if r.apple)
    with pytest.raises(GemmdriftError, match="gemv has no float32 recipe"):
        plan_for("M3", "matmul", T=1, K=640, N=1024, dtype="float32", mlx_version="0.32.4")


def test_replay_check_says_a_variant_axis_it_did_not_use():
    """`replay check --chip M1 --variant dot4=pairwise` checks no kernel with dot4: said beside the variants."""
    from gemmdrift.replay.check import variants_lines

    class R:
        details = {"records": [{"path": "dense:bfloat16", "T": 2, "kernel": "steel_gemm"}]}
        inputs = {"variants": "dot4=pairwise"}

    lines = variants_lines(R)
    assert lines[-1] == ("  (the variants each kernel has; this check ran dot4=pairwise only; dot4 unused: no kernel "
                         "checked has it)")
