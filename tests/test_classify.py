"""The class of a release pair (issue 47): planted pairs of each kind, and the known answers of the shipped results."""

import math
from pathlib import Path

import pytest

from gemmdrift.changelog import classify as c
from gemmdrift.errors import GemmdriftError
from gemmdrift.measure import history

ROOT = Path(__file__).resolve().parent.parent
FLIPS = "bench_stack.DecodeVsVerify.track_flips[verify2]"
DLOGIT = "bench_stack.DecodeVsVerify.track_max_abs_dlogit[verify2]"
TREE = "bench_fingerprint.Fingerprint.track_tree_id_t1[matmul:bfloat16]"
HIGH = "bench_stack.DecodeVsVerify.track_logits_rel_l2_float32[verify2]"
LOW = "bench_stack.DecodeVsVerifyLayers.track_rel_l2[verify2, accumulated, logits]"
BASE = {FLIPS: 0.0, DLOGIT: 0.4375, TREE: 1234.0, LOW: 1e-2, HIGH: 1e-7}


def test_identical_figures_are_bit_for_bit_whatever_the_ladder():
    for ladder in ("rounding", "semantics", None):
        got = c.classify(BASE, dict(BASE), ladder=ladder)
        assert got.cls == (c.ANSWER_CHANGING if ladder == "semantics" else c.BIT_FOR_BIT)
    got = c.classify(BASE, dict(BASE))
    assert got.compared == 5 and got.changed == () and "all 5 figures" in got.reason


def test_moved_figures_with_rounding_ladder_are_roundoff_and_name_the_figure():
    new = {**BASE, DLOGIT: 0.5, TREE: 99.0}
    got = c.classify(BASE, new, ladder="rounding")
    assert got.cls == c.ROUNDOFF
    assert got.changed == (TREE, DLOGIT) and got.answers == ()  # sorted by name
    assert got.reason.startswith(f"2 of 5 figures moved (first {TREE} 1234 → 99)") and "\n" not in got.reason


def test_moved_figures_without_a_ladder_verdict_are_not_called_roundoff():
    got = c.classify(BASE, {**BASE, DLOGIT: 0.5}, ladder=None)
    assert got.cls == c.ANSWER_CHANGING and "no precision ladder" in got.reason


def test_an_answer_figure_changing_is_answer_changing_even_with_a_rounding_ladder():
    got = c.classify(BASE, {**BASE, FLIPS: 3.0, DLOGIT: 8.0}, ladder="rounding")
    assert got.cls == c.ANSWER_CHANGING and got.answers == (FLIPS,)
    assert got.reason.startswith("argmax flips changed: " + FLIPS + " 0 → 3")


def test_the_ladder_saying_semantics_is_answer_changing():
    got = c.classify(BASE, {**BASE, DLOGIT: 0.5}, ladder="semantics")
    assert got.cls == c.ANSWER_CHANGING and "semantics" in got.reason


def test_a_figure_on_one_side_only_is_reported_not_equal_and_not_deciding():
    new = {**BASE, "bench_state.StateExactness.track_state_bugs[KVCache/trim]": 4.0}
    old = {**BASE, "bench_x.X.track_rel_l2[a]": math.nan}
    got = c.classify(old, new, ladder="rounding")
    assert got.cls == c.BIT_FOR_BIT and got.one_sided == ("bench_state.StateExactness.track_state_bugs[KVCache/trim]",)
    assert "1 figure(s) measured on one side only" in got.reason
    with pytest.raises(GemmdriftError, match="no figure measured on both sides"):
        c.classify({FLIPS: 1.0}, {DLOGIT: 1.0})


def test_timing_figures_are_not_numerics():
    t = "bench_batch.Batch.track_server_tokens_per_s[4]"
    assert c.is_timing_figure(t) and c.is_timing_figure("bench_stack.Stack.time_decode")
    assert c.classify({**BASE, t: 10.0}, {**BASE, t: 11.0}).cls == c.BIT_FOR_BIT


def test_answer_figures_by_name():
    yes = [FLIPS, "bench_stack.PrefillChunks.track_flips", "bench_diverge.Divergence.track_first_divergence",
           "bench_diverge.Divergence.track_diverged", "bench_state.StateExactness.track_state_bugs[BatchKVCache/batch]",
           "bench_state.StateExactness.track_non_exact[KVCache/trim]", "bench_batch.B.track_batch_flips[2]",
           "bench_golden.GoldenLogits.track_same_top1[decode]", "bench_state.S.track_near_ties[x]",
           "bench_diverge.Divergence.track_outside_envelope", "flips/verify2", "state_bugs"]
    no = [DLOGIT, TREE, LOW, HIGH, "bench_kernels.OpsDrift.track_bits_lost[rope]",
          "bench_batch.B.track_batch_envelope[batch]", "rel_l2/verify2/local/layer 3", "bench_golden.G.track_kld_mean[x]"]
    assert all(c.is_answer_figure(n) for n in yes), [n for n in yes if not c.is_answer_figure(n)]
    assert not any(c.is_answer_figure(n) for n in no), [n for n in no if c.is_answer_figure(n)]


def test_at_most_orders_the_classes():
    r = c.PairClass(c.ROUNDOFF, "x")
    assert r.at_most(c.ROUNDOFF) and r.at_most(c.ANSWER_CHANGING) and not r.at_most(c.BIT_FOR_BIT)
    with pytest.raises(GemmdriftError):
        r.at_most("roundoff")
    with pytest.raises(GemmdriftError):
        c.PairClass("SOMETHING", "x")
    with pytest.raises(GemmdriftError):
        c.classify(BASE, BASE, ladder="rounded")


def test_the_ladder_is_read_from_the_float32_rung_of_decode_vs_verify():
    assert c.ladder_of(BASE) == "rounding"  # 1e-2 -> 1e-7: shrinks 1e5
    assert c.ladder_of({**BASE, HIGH: 5e-3}) == "semantics"  # shrinks 2x
    assert c.ladder_of({**BASE, HIGH: 5e-4}) is None  # shrinks 20x: unclear
    assert c.ladder_of({LOW: 1e-2}) is None and c.ladder_of({**BASE, HIGH: math.nan}) is None  # no float32 rung
    assert c.ladder_of({LOW: 0.0, HIGH: 0.0}) is None  # no drift to judge
    assert c.pair_ladder({**BASE, HIGH: 5e-3}, BASE) == "semantics"
    assert c.pair_ladder(BASE, {LOW: 1e-2}) is None


@pytest.fixture(scope="module")
def shipped():
    df = history.read_results(ROOT / "benchmarks" / "reference")

    def pair(old, new):
        a, b = (c.figures_of(df, r, "reference-linux-cpu", "cpu") for r in (old, new))
        return c.classify(a, b, ladder=c.pair_ladder(a, b))
    return pair


def test_known_answers_of_the_shipped_results(shipped):
    rope = shipped("0.29.4", "0.30.6")
    assert rope.cls == c.ANSWER_CHANGING and rope.reason.startswith("argmax flips changed")
    assert "bench_kernels.OpsDrift.track_bits_lost[rope]" in rope.changed  # the op probe's rope row moved
    assert not any("[sdpa]" in n or "[rms_norm]" in n for n in rope.changed if "OpsDrift" in n)
    for old, new in (("0.30.6", "0.31.2"), ("0.31.2", "0.32.4+lm0.32.2")):
        got = shipped(old, new)
        assert got.cls == c.BIT_FOR_BIT and got.compared == 263, (old, new, got.reason)
    lm = shipped("0.32.4+lm0.30.2", "0.32.4+lm0.31.3")
    assert lm.cls == c.ANSWER_CHANGING
    assert lm.reason.startswith("state verdicts changed: bench_state.StateExactness.track_state_bugs[") and \
        "170 → 166" in lm.reason
