"""Greedy divergence and teacher-forced triage on tiny mlx-lm models."""

import json

import numpy as np
import pytest

from conftest import make_tiny
from gemmdrift import diverge as dv
from gemmdrift.errors import GemmdriftError


def near_tie_model(eps=1e-7, seed=1):
    """Tokens 5 and 6 get almost the same LM-head row: their logits stay within ~eps of each other."""
    import mlx.core as mx

    lm = make_tiny("float32", seed=seed)
    w = np.array(lm.model.lm_head.weight.astype(mx.float32))
    w[5] = w[5] * 8  # make the pair win often
    w[6] = w[5] + eps * np.random.default_rng(1).standard_normal(w.shape[1]).astype(np.float32)
    lm.model.lm_head.weight = mx.array(w)
    mx.eval(lm.model.parameters())
    return lm


def stale_cache_stream(lm, prompt, n):
    """Plain greedy generation from a cache holding one token that was never rolled back."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(lm.model)
    lm.model(mx.array([[42]]), cache=cache)
    return dv.generate_plain(lm.model, prompt, n, prompt_cache=cache).tokens


def test_rounding_divergence_is_a_near_tie():
    lm = near_tie_model()
    prompt = list(range(10, 22))  # longer than the window of 8: cache layouts differ
    r = dv.diverge(lm, prompt, 24, k=2)
    t = r["triage"]
    assert r["first_divergence"] is not None
    assert t["verdict"] == dv.NEAR_TIE
    assert {t["token_a"], t["token_b"]} == {5, 6}
    assert t["margin"] <= t["envelope"] and not t["bit_identical"]
    # At a tie this close, which token the real speculative run picked depends on
    # its block alignment after rejections, so only stream A must be reproduced.
    assert t["reproduces_a"]


def test_planted_state_bug_is_outside_the_envelope():
    lm = make_tiny("float32", seed=3)
    prompt = list(range(10, 30))
    a = dv.generate_plain(lm.model, prompt, 24).tokens
    b = stale_cache_stream(lm, prompt, 24)
    t = dv.triage(lm, prompt, a, b, "prefill:2048,decode", "prefill:512,verify:2")
    assert t.verdict == dv.OUTSIDE
    assert t.margin > 100 * t.envelope > 0
    assert t.reproduces_a and not t.reproduces_b


def test_divergence_between_bit_identical_schedules_is_not_numeric():
    lm = make_tiny("float32", seed=3)
    prompt = list(range(10, 16))  # below the window: the two schedules agree bit for bit
    a = dv.generate_plain(lm.model, prompt, 12).tokens
    b = stale_cache_stream(lm, prompt, 12)
    t = dv.triage(lm, prompt, a, b, "prefill:2048,decode", "prefill:512,verify:2")
    assert t.bit_identical and t.verdict == dv.OUTSIDE and t.envelope == 0
    assert "not numeric" in t.reason


def test_identical_streams_and_first_divergence():
    lm = make_tiny("float32")
    assert dv.first_divergence([1, 2, 3], [1, 2, 4]) == 2
    assert dv.first_divergence([1, 2], [1, 2, 3]) is None
    t = dv.triage(lm, [1, 2, 3], [4, 5], [4, 5], "prefill:2048,decode", "prefill:512,verify:2")
    assert t.verdict == "IDENTICAL"


def test_given_envelope_is_used():
    lm = make_tiny("float32", seed=3)
    prompt = list(range(10, 30))
    a = dv.generate_plain(lm.model, prompt, 24).tokens
    b = stale_cache_stream(lm, prompt, 24)
    t = dv.triage(lm, prompt, a, b, "prefill:2048,decode", "prefill:512,verify:2", envelope=1e9)
    assert t.verdict == dv.NEAR_TIE and t.envelope_source == "given"


def test_triage_input_errors():
    lm = make_tiny("float32")
    with pytest.raises(GemmdriftError):
        dv.triage(lm, [], [1], [2], "prefill:2048,decode", "prefill:512,verify:2")
    with pytest.raises(GemmdriftError):
        dv.triage(lm, [1, 2], [1, 200], [1, 2], "prefill:2048,decode", "prefill:512,verify:2")
    with pytest.raises(GemmdriftError):
        dv.triage(lm, [1, 2], [1, 3], [1, 2], "prefill:2048,decode", "verify:0")
    with pytest.raises(GemmdriftError):
        dv.generate_plain(lm.model, [1, 2], 0)
    with pytest.raises(GemmdriftError):
        dv.generate_speculative(lm.model, [1, 2], 4, k=0)


@pytest.mark.parametrize("content", ["", "[1, 'x']", "{bad json", '{"prompt": [1]}', "1 2 three", "[1.5]", "[true]"])
def test_bad_stream_files(tmp_path, content):
    p = tmp_path / "s.json"
    p.write_text(content)
    with pytest.raises(GemmdriftError):
        dv.read_stream(str(p))


def test_stream_file_formats(tmp_path):
    p = tmp_path / "a.json"
    p.write_text(json.dumps({"prompt": [2, 3], "tokens": [4, 5]}))
    assert dv.read_stream(str(p)) == ([2, 3], [4, 5])
    p.write_text("4 5\n6")
    assert dv.read_stream(str(p)) == (None, [4, 5, 6])
    with pytest.raises(GemmdriftError):
        dv.read_stream(str(tmp_path / "missing.json"))


def test_divergence_stats_resume_from_checkpoint(tmp_path, monkeypatch):
    lm = near_tie_model()
    prompts = [list(range(10, 22)), list(range(30, 36))]
    df = dv.divergence_stats(lm, prompts, 16, checkpoint=tmp_path, k=2)
    s = dv.stats_summary(df)
    assert s["prompts"] == 2 and s["diverged"] == int(df["first_divergence"].notna().sum())
    assert s["tokens_compared"] == int(df["compared"].sum())
    assert s["divergences_per_1k"] == pytest.approx(1000 * s["diverged"] / s["tokens_compared"])

    def fail(*a, **k):
        raise AssertionError("finished prompts must not run again")

    monkeypatch.setattr(dv, "diverge", fail)
    again = dv.divergence_stats(lm, prompts, 16, checkpoint=tmp_path, k=2)
    assert again.equals(df)
