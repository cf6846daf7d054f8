"""Batch as a schedule axis (issue 14, item 1): row j of mlx-lm's BatchGenerator vs the same prompt alone."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import make_tiny
from gemmdrift import batch, metrics
from gemmdrift.errors import GemmdriftError

RNG = np.random.default_rng(0)
TARGET = [int(x) for x in RNG.integers(5, 97, 6)]
SHORT = [[int(x) for x in RNG.integers(5, 97, k)] for k in (3, 5, 4, 2, 6, 3, 4)]
LONG = [[int(x) for x in RNG.integers(5, 97, k)] for k in (20, 25, 18, 30, 22, 19, 21)]  # window 8


@pytest.fixture(scope="module")
def tiny():
    return make_tiny("bfloat16")


def test_identical_prompts_give_identical_rows(tiny):
    run = batch.generate_batch(tiny.model, [TARGET] * 4, 10, keep=[0, 1, 2, 3])
    for j in range(1, 4):
        assert run.tokens[j] == run.tokens[0]
        assert np.array_equal(run.logprobs[j], run.logprobs[0])
    assert len(run.tokens[0]) == 10 and run.logprobs[0].shape == (10, 97)


def test_batch_row_is_the_greedy_argmax_of_its_own_logprobs(tiny):
    run = batch.generate_batch(tiny.model, batch.layout(TARGET, LONG, 4, 2), 8, keep=[2])
    assert run.tokens[2] == [int(i) for i in run.logprobs[2].argmax(-1)]


def _rounding_envelope():
    """An honest numeric envelope for the tiny model: max |Δgap| between bfloat16 and float32 weights,
    far larger than any schedule change (which is 0 on this CPU backend)."""
    lb, lf = make_tiny("bfloat16"), make_tiny("float32")
    a = batch.generate_alone(lb.model, TARGET, 10)
    b = batch.generate_alone(lf.model, TARGET, 10)
    d = batch.compare_row(a, b, 0, None)
    common = d["first_divergence"] if d["first_divergence"] is not None else 10
    drift = metrics.logit_drift(a.logprobs[0][:common].astype(np.float64), b.logprobs[0][:common].astype(np.float64))
    return float(np.max(np.abs(drift["dgap"])))


def test_planted_padding_bug_is_outside_the_envelope(tiny):
    """Regression guard: one row's mask shifted by one (its first real token hidden) is caught, for short and
    long (> sliding window) companions, while the honest batch is not."""
    env = _rounding_envelope()
    assert env > 0
    alone = batch.generate_alone(tiny.model, TARGET, 10)
    for comps in (SHORT, LONG):
        for B, j in ((2, 0), (4, 3)):
            prompts = batch.layout(TARGET, comps, B, j)
            honest = batch.compare_row(alone, batch.generate_batch(tiny.model, prompts, 10, keep=[j]), j, env)
            assert honest["verdict"] in (batch.IDENTICAL, batch.NEAR_TIE), honest
            bad_run = batch.generate_batch(tiny.model, prompts, 10, keep=[j],
                                           plant=lambda c, j=j: batch.shift_row_mask(c, j))
            bad = batch.compare_row(alone, bad_run, j, env)
            assert bad["verdict"] == batch.OUTSIDE, bad
            assert bad["envelope_batch"] > env or (bad["margin"] or 0) > env


def test_compare_row_known_answers():
    """Envelope, divergence and margin against numbers computed by hand."""
    la = np.array([[0.0, -1.0, -3.0], [0.0, -0.5, -2.0], [0.0, -0.1, -4.0]], dtype=np.float32)
    lb = la.copy()
    lb[0] = [0.0, -1.25, -3.0]  # gap 1 -> 1.25: |Δgap| 0.25
    lb[2] = [-0.1, 0.0, -4.0]  # parts: token 1 instead of 0
    alone = batch.Run([[0, 0, 0]], {0: la}, 0.0)
    row = batch.Run([[0, 0, 1]], {0: lb}, 0.0)
    c = batch.compare_row(alone, row, 0, 0.3)
    assert c["first_divergence"] == 2
    assert c["envelope_batch"] == pytest.approx(0.25)
    assert c["margin"] == pytest.approx(0.1)  # min(|0 - -0.1|, |-0.1 - 0|)
    assert c["verdict"] == batch.NEAR_TIE
    assert batch.compare_row(alone, row, 0, 0.2)["verdict"] == batch.OUTSIDE  # 0.25 > 0.2
    same = batch.compare_row(alone, batch.Run([[0, 0, 0]], {0: la.copy()}, 0.0), 0, 0.0)
    assert same["verdict"] == batch.IDENTICAL and same["bit_identical"]


def test_measure_batch_result_and_store_round_trip(tiny, tmp_path):
    from gemmdrift import store, summaries

    r = batch.measure_batch(tiny, {"t": TARGET}, {"short": SHORT, "long": LONG}, 6, batch_sizes=(1, 2, 4))
    t = r.tables["batch"]
    assert len(t) == 2 * (1 + 2 + 2) and r.figure("batch_rows") == len(t)
    assert r.figure("batch_flips") == t["first_divergence"].notna().sum()
    assert r.figure("batch_speedup") > 0
    assert set(t["verdict"]) <= {batch.IDENTICAL, batch.NEAR_TIE, batch.OUTSIDE}
    store.write_result(r, tmp_path / "b")
    back = store.read_result(tmp_path / "b")
    assert back.kind == "batch" and dict(back.figures) == dict(r.figures)
    assert "batch" in summaries.text(r)
    from gemmdrift.server import stream_files

    files = stream_files(r)
    assert len(files) == 2 * len(t) and all("prompt" in f and "tokens" in f for f in files.values())


def test_layout_and_bad_inputs():
    assert batch.layout([1], [[2], [3], [4]], 4, 2) == [[2], [3], [1], [4]]
    with pytest.raises(GemmdriftError, match="companion"):
        batch.layout([1], [[2]], 4, 0)
    with pytest.raises(GemmdriftError, match="outside"):
        batch.layout([1], [[2]], 2, 2)


def test_bench_batch_tracks_have_units_versions_and_skip_unmeasured():
    import math
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from benchmarks import bench_batch

    found = 0
    for cls in (bench_batch.Batch, bench_batch.Server):
        for name in dir(cls):
            if name.startswith("track_"):
                fn = getattr(cls, name)
                assert fn.unit and fn.version == "1", name
                assert math.isnan(fn(cls(), {}))  # not measured: NaN, never 0
                found += 1
    assert found >= 8
    assert bench_batch.Batch().track_batch_flips({"batch_flips": 2.0}) == 2.0


@pytest.mark.parametrize("argv", [["batch", "--batch-sizes", "0"], ["batch", "--companions", "x"],
                                  ["batch", "--n", "0"], ["server", "--cases", "x"],
                                  ["server", "--model", "shape:gemma3-270m"], ["server", "--draft", "/nonexistent"]])
def test_cli_rejects_bad_input_before_loading(argv, capsys):
    from gemmdrift.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("gemmdrift: error:") and err.count("\n") == 1


def test_ladder_calls_a_planted_mask_shift_semantic(tiny):
    """A padding bug keeps its size at float32 (semantic); rounding would shrink by orders of magnitude."""
    rows = batch.sweep(tiny, TARGET, {"long": LONG}, 8, batch_sizes=(2,), rows="ends", reference=True,
                       plant=batch.shift_row_mask, ladder_lm=make_tiny("float32"))
    assert rows and all(r.verdict == batch.OUTSIDE for r in rows)
    assert all(r.ladder == "semantic" and r.ladder_envelope > 0.05 for r in rows), [(r.ladder, r.ladder_envelope) for r in rows]
