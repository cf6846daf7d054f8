"""Metrics against hand-computed answers."""

import math

import numpy as np
import pytest

from gemmdrift import metrics

BF16_ONE_NEXT = 1.0 + 2.0**-7  # next bfloat16 after 1.0 (7 stored mantissa bits)
F16_ONE_NEXT = 1.0 + 2.0**-10


def f32(*xs):
    return np.array(xs, dtype=np.float32)


def test_bf16_ulp_distance_by_hand():
    a = f32(1.0, 1.0, 4.0, 0.0, -1.0)
    b = f32(BF16_ONE_NEXT, 1.0 + 3 * 2.0**-7, 4.0 + 2.0**-5, -0.0, -BF16_ONE_NEXT)
    assert metrics.ulp_distance(a, b, "bfloat16").tolist() == [1, 3, 1, 0, 1]


def test_bf16_ulp_distance_across_zero_counts_both_sides():
    tiny = np.array([1], dtype=np.uint32) << 16  # smallest positive bf16 subnormal
    pos = tiny.view(np.float32)
    neg = (tiny | np.uint32(0x80000000)).view(np.float32)
    assert metrics.ulp_distance(pos, neg, "bfloat16").tolist() == [2]


def test_f16_ulp_is_not_taken_from_float32():
    a, b = f32(1.0, 65504.0), np.array([F16_ONE_NEXT, np.inf], dtype=np.float32)
    assert metrics.ulp_distance(a, b, "float16").tolist() == [1, 1]
    # The same pair is 2**13 float32 ULPs apart.
    assert metrics.ulp_distance(f32(1.0), f32(F16_ONE_NEXT), "float32").tolist() == [2**13]


def test_values_not_in_the_storage_dtype_are_rejected():
    with pytest.raises(ValueError):
        metrics.ulp_distance(f32(1.0 + 2.0**-20), f32(1.0), "bfloat16")
    with pytest.raises(ValueError):
        metrics.ulp_distance(f32(1.0 + 2.0**-20), f32(1.0), "float16")


def test_compare_known_answer():
    a = f32(1, 2, 3, 4)
    b = f32(1, 2, 3, 4 + 2.0**-5)  # one bf16 ULP at 4
    m = metrics.compare(a, b, "bfloat16")
    assert m["n"] == 4
    assert m["frac_differ"] == 0.25
    assert m["max_ulp"] == 1
    assert m["max_abs"] == 2.0**-5
    assert m["rel_l2"] == pytest.approx(2.0**-5 / math.sqrt(30))
    assert m["nmse"] == pytest.approx(2.0**-10 / 30)
    assert m["p50_ulp"] == 0


def test_compare_zero_drift_is_exactly_zero():
    a = np.linspace(-3, 3, 64, dtype=np.float32)
    m = metrics.compare(a, a.copy(), "float32")
    assert {k: v for k, v in m.items() if k != "n"} == {k: 0.0 for k in m if k != "n"}


def test_compare_single_element_and_empty():
    assert metrics.compare(f32(2.0), f32(2.0), "float32")["max_ulp"] == 0
    with pytest.raises(ValueError):
        metrics.compare(f32(), f32(), "float32")


def test_round_to_bf16_ties_to_even_and_never_rounds_twice():
    x = np.array([1 + 2.0**-8, 1 + 3 * 2.0**-8, 1 + 2.0**-8 + 2.0**-30, -(1 + 2.0**-8 + 2.0**-30)])
    # 1+2^-8 + 2^-30 rounds to 1+2^-8 in float32, which would then tie to 1.0: wrong.
    assert metrics.round_to(x, "bfloat16").tolist() == [1.0, 1 + 2.0**-6, BF16_ONE_NEXT, -BF16_ONE_NEXT]


def test_error_vs_exact_counts_ulps_from_the_correctly_rounded_value():
    exact = np.array([1 + 2.0**-8 + 2.0**-30, 2.0])
    y = f32(1.0, 2.0)
    e = metrics.error_vs_exact(y, exact, "bfloat16")
    assert e["err_max_ulp"] == 1
    assert e["err_max_abs"] == pytest.approx(2.0**-8 + 2.0**-30)


def test_logit_drift_and_envelope_known_answer():
    la = np.array([[3.0, 1.0, 2.9], [0.0, 5.0, 1.0]])
    lb = np.array([[2.8, 1.0, 3.0], [0.0, 5.0, 1.0]])
    d = metrics.logit_drift(la, lb)
    assert d["argmax_a"].tolist() == [0, 1] and d["argmax_b"].tolist() == [2, 1]
    assert d["gap_a"] == pytest.approx([0.1, 4.0])
    assert d["dgap"] == pytest.approx([0.3, 0.0])  # (3-2.9) - (2.8-3.0)
    assert d["flip"].tolist() == [True, False]
    # The flip happens where Δgap exceeds the gap.
    assert (d["dgap"] > d["gap_a"]).tolist() == d["flip"].tolist()
    e = metrics.envelope_summary(d)
    assert e["flips"] == 1 and e["flip_gaps"] == pytest.approx([0.1])
    assert e["max_abs_dlogit"] == pytest.approx(0.2) and e["max_abs_dgap"] == pytest.approx(0.3)


def test_envelope_of_identical_logits_is_zero_and_empty_is_an_error():
    la = np.arange(12, dtype=np.float64).reshape(3, 4)
    e = metrics.envelope_summary(metrics.logit_drift(la, la.copy()))
    assert (e["flips"], e["max_abs_dlogit"], e["max_abs_dgap"]) == (0, 0.0, 0.0)
    with pytest.raises(ValueError):
        metrics.envelope_summary(metrics.logit_drift(np.zeros((0, 4)), np.zeros((0, 4))))


def test_bits_lost():
    assert [metrics.bits_lost(u) for u in (0, 1, 3, 255)] == [0.0, 1.0, 2.0, 8.0]
    with pytest.raises(ValueError):
        metrics.bits_lost(-1)
