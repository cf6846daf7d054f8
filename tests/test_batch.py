"""Batch as a schedule axis (issue 14, item 1): row j of mlx-lm's BatchGenerator vs the same prompt alone."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import make_tiny
from gemmdrift.measure import batch
from gemmdrift import metrics
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
    from gemmdrift import store
    from gemmdrift.view import summaries

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
    from gemmdrift.measure.server import stream_files

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


# ----------------------------------------------------------------------------- per-layer drift through the batch


def test_layer_drift_known_answer():
    """rel L2, max |Δ| and the fraction of differing elements per tap, against numpy by hand."""
    a = np.zeros((3, 2, 4), np.float32)
    a[:] = [[1, 2, 2, 0], [0, 0, 3, 4]]
    b = a.copy()
    b[1, 0, 0] = 1.5  # layer 1: one element of 8 off by 0.5
    b[2] *= 2  # the norm tap: everything doubled, rel L2 exactly 1
    rows = batch.layer_drift(a, b, "float32")
    assert [r["tap"] for r in rows] == ["layer 0", "layer 1", "norm"]
    assert rows[0]["rel_l2"] == 0 and rows[0]["frac_differ"] == 0
    assert rows[1]["rel_l2"] == pytest.approx(0.5 / np.sqrt(9 + 25)) and rows[1]["max_abs"] == 0.5
    assert rows[1]["frac_differ"] == pytest.approx(1 / 8)
    assert rows[2]["rel_l2"] == pytest.approx(1.0) and rows[2]["positions"] == 2


@pytest.mark.linux_cpu_reference
@pytest.mark.parametrize("B,j,step", [(1, 0, 2048), (4, 0, 2048), (4, 3, 2048), (4, 3, 4)])
def test_the_followed_row_is_the_row_and_matches_alone_at_every_layer(tiny, B, j, step):
    """The taps follow row j through mlx-lm's generation batch. With a prefill step of 4 the 6-token target
    starts decoding alone, and the long companions join the generation batch later behind it, so the row's
    index moves from its prompt position 3 to 0 (followed by uid). Its final-norm states through the LM head
    give exactly the row's own log-probs (so it is this row, not a companion), and on this row-invariant
    CPU backend every layer is bit-identical to the same stream alone."""
    import mlx.core as mx

    from gemmdrift import state

    n = 8
    prompts = batch.layout(TARGET, LONG, B, j)
    run = batch.generate_batch(tiny.model, prompts, n, keep=[j], follow=j, prefill_step=step)
    assert run.hidden.shape == (tiny.n_layers + 1, n, 64)
    assert len(run.followed_rows) == n and (run.followed_rows[0] == 0 if step == 4 else set(run.followed_rows) == {j})
    logits = mx.array(state.head(tiny.model, [mx.array(run.hidden[-1])[None].astype(mx.bfloat16)]))
    logits = logits.astype(mx.bfloat16)  # exact: the head's bf16 output, read back as float32
    lp = np.asarray((logits - mx.logsumexp(logits, axis=-1, keepdims=True)).astype(mx.float32))  # as mlx-lm does
    assert [int(i) for i in lp.argmax(-1)] == run.tokens[j]
    assert np.array_equal(lp, run.logprobs[j])
    alone = batch.generate_alone(tiny.model, TARGET, n, prefill_step=step)
    ref = batch.alone_layers(tiny, TARGET, alone.tokens[0], n, prefill_step=step)
    rows = batch.layer_drift(ref.hidden, run.hidden, ref.dtype)
    assert len(rows) == tiny.n_layers + 1 and all(r["frac_differ"] == 0 for r in rows), rows


def test_a_planted_mask_shift_shows_from_the_first_layer(tiny):
    n = 6
    prompts = batch.layout(TARGET, SHORT, 4, 3)
    run = batch.generate_batch(tiny.model, prompts, n, keep=[3], follow=3, plant=lambda c: batch.shift_row_mask(c, 3))
    alone = batch.generate_alone(tiny.model, TARGET, n)
    ref = batch.alone_layers(tiny, TARGET, alone.tokens[0], n)
    c = batch.compare_row(alone, run, 3, None)
    k = n if c["first_divergence"] is None else c["first_divergence"] + 1
    rows = batch.layer_drift(ref.hidden[:, :k], run.hidden[:, :k], ref.dtype)
    assert rows[0]["frac_differ"] > 0 and rows[-1]["rel_l2"] > 1e-3, rows[:2]


@pytest.mark.linux_cpu_reference
def test_measure_batch_with_layers_tables_figure_and_text(tiny, tmp_path):
    from gemmdrift.view import plots, summaries
    from gemmdrift import store

    r = batch.measure_batch(tiny, {"t": TARGET}, {"short": SHORT}, 5, batch_sizes=(1, 2), reference=False,
                            layers=True)
    lt = r.tables["batch_layers"]
    assert len(lt) == 2 * 2 * (tiny.n_layers + 1) - (tiny.n_layers + 1)  # B=1: one row; B=2: rows 0 and 1
    assert (lt["frac_differ"] == 0).all() and r.figures["batch_layer_norm_rel_l2"] == 0.0
    assert r.figures["batch_layers_differ"] == 0.0
    bad = batch.measure_batch(tiny, {"t": TARGET}, {"short": SHORT}, 5, batch_sizes=(2,), rows="all",
                              reference=False, layers=True, plant=batch.shift_row_mask)
    blt = bad.tables["batch_layers"]
    per_row = blt.groupby("row")["frac_differ"].apply(lambda f: int((f > 0).sum()))
    assert bad.figures["batch_layers_differ"] == float(per_row.max()) == tiny.n_layers + 1  # every tap
    assert bad.figures["batch_layer_norm_rel_l2"] == float(blt[blt["tap"] == "norm"]["rel_l2"].max()) > 1e-3
    assert "batch_layers.png" in plots.DRAW["batch"](r)
    assert "first layer that differs: none" in summaries.text(r)
    store.write_result(r, tmp_path / "b")
    back = store.read_result(tmp_path / "b")
    assert len(back.tables["batch_layers"]) == len(lt)
    streams = sorted(p.name for p in (tmp_path / "b" / "streams").glob("*.json"))  # for `gemmdrift triage`
    assert len(streams) == 2 * len(r.tables["batch"]) and streams[0].endswith("_a.json")


def test_ladder_counts_count_every_verdict_of_the_rows_the_ladder_judged():
    import pandas as pd

    from gemmdrift.measure.batch import ladder_counts
    from types import SimpleNamespace

    from gemmdrift.view.batch import BATCH_COLUMNS, batch_text

    assert ladder_counts(pd.DataFrame({"ladder": ["", ""]})) == {}  # no ladder ran: no figures
    assert ladder_counts(pd.DataFrame({"verdict": ["IDENTICAL"]})) == {}
    t = pd.DataFrame({"ladder": ["rounding", "", "unreliable", "semantic", "unreliable", "unclear", "rounding"]})
    counts = ladder_counts(t)
    assert counts == {"batch_outside_rounding": 2.0, "batch_outside_semantic": 1.0, "batch_outside_unclear": 1.0,
                      "batch_outside_unreliable": 2.0, "batch_outside_identical": 0.0}
    assert sum(counts.values()) == (t["ladder"] != "").sum()
    figures = {"batch_rows": 7.0, "batch_identical": 1.0, "batch_flips": 6.0, "batch_outside": 6.0,
               "batch_envelope": 0.5, **counts}
    table = pd.DataFrame({c: [1] for c in BATCH_COLUMNS}).assign(ladder="rounding", ladder_envelope=0.1)
    text = batch_text(SimpleNamespace(tables={"batch": table}, figures=figures))
    assert "2 rounding, 1 semantic, 1 unclear, 2 unreliable, 0 identical" in text
