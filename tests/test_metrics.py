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


def test_top2_is_the_first_two_of_a_stable_descending_sort():
    # Ties (first index wins), +-inf, -0.0, rows whose runner-up is -inf, all -inf, and NaN (sorted last).
    rows = np.array([[1.0, 3.0, 3.0, 2.0], [-np.inf, 5.0, -np.inf, -np.inf], [-np.inf] * 4,
                     [0.0, -0.0, -1.0, 0.0], [np.inf, 1.0, np.inf, 0.0], [1.0, np.nan, 2.0, 2.0]], dtype=np.float32)
    t1, t2 = metrics.top2(rows)
    assert t1.tolist() == [1, 1, 0, 0, 0, 2] and t2.tolist() == [2, 0, 1, 1, 2, 3]
    rng = np.random.default_rng(3)
    for _ in range(200):
        x = rng.integers(-2, 3, (rng.integers(1, 5), rng.integers(2, 9))).astype(np.float32)
        m = rng.random(x.shape)
        x[m < 0.2], x[m > 0.9] = -np.inf, np.inf
        order = np.argsort(-x, axis=-1, kind="stable")
        got = metrics.top2(x)
        assert got[0].tolist() == order[:, 0].tolist() and got[1].tolist() == order[:, 1].tolist(), x


def test_ordered_int_is_the_sign_magnitude_order():
    bits = np.array([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=np.uint16)
    assert metrics.ordered_int(bits, 16).tolist() == [0, 1, 0x7FFF, 0, -1, -0x7FFF]
    bits = np.array([0x80000000, 0x80000002, 0x7F800000], dtype=np.uint32)
    assert metrics.ordered_int(bits, 32).tolist() == [0, -2, 0x7F800000]


def test_compare_percentiles_are_numpy_percentiles_of_the_ulps():
    a = np.arange(1, 1001, dtype=np.float32)
    b = a.copy()
    b[-20:] = np.nextafter(b[-20:], np.float32(np.inf))  # 20 elements one float32 ULP up
    b[-1] = np.nextafter(b[-1], np.float32(np.inf))  # the last one two
    ulps = np.r_[np.zeros(980), np.ones(19), 2.0]
    m = metrics.compare(a, b, "float32")
    assert (m["p50_ulp"], m["p99_ulp"], m["p99.9_ulp"]) == tuple(np.percentile(ulps, q) for q in (50, 99, 99.9))
    assert m["p99.9_ulp"] == pytest.approx(1.001) and m["max_ulp"] == 2


def test_importing_gemmdrift_turns_off_numpys_huge_page_advice_unless_the_user_chose():
    import subprocess
    import sys

    # numpy imported first, then gemmdrift: the advice is off (the setter returns the previous state)
    # and the variable set for spawned workers.
    code = ("import numpy, gemmdrift, os; print(numpy._core.multiarray._set_madvise_hugepage(False), "
            "os.environ['NUMPY_MADVISE_HUGEPAGE'])")
    env = {k: v for k, v in __import__("os").environ.items() if k != "NUMPY_MADVISE_HUGEPAGE"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "0"]
    out = subprocess.run([sys.executable, "-c", code], env={**env, "NUMPY_MADVISE_HUGEPAGE": "1"},
                         capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "1"]
