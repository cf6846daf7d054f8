"""Greedy divergence and teacher-forced triage on tiny mlx-lm models."""

import json

import numpy as np
import pytest

from conftest import make_tiny
from gemmdrift.measure import diverge as dv
from gemmdrift.errors import GemmdriftError


class SplitKHead:
    """An LM head whose T>1 blocks sum K in 4 float32 partials (emulated split-K); T=1 is the real kernel.

    A planted, purely numeric difference between decoding and verification,
    like a GPU switching from GEMV to split-K GEMM.
    """

    def __init__(self, linear):
        import mlx.core as mx

        self.linear = linear
        self.wf = linear.weight.astype(mx.float32)

    def __call__(self, x):
        from gemmdrift.kernels import split_k

        return self.linear(x) if x.shape[1] == 1 else split_k(x, self.wf, None, 4, x.dtype)


def near_tie_model(eps=1e-6, seed=1):
    """All-global caches (no sliding window, so mlx-lm can always rewind them), tokens 5 and 6
    with almost the same LM-head row, and the split-K head: every divergence is numeric."""
    import mlx.core as mx

    lm = make_tiny("float32", seed=seed, sliding_window_pattern=1)
    w = np.array(lm.model.lm_head.weight.astype(mx.float32))
    w[5] = w[5] * 8  # make the pair win often
    w[6] = w[5] + eps * np.random.default_rng(1).standard_normal(w.shape[1]).astype(np.float32)
    lm.model.lm_head.weight = mx.array(w)
    mx.eval(lm.model.parameters())
    lm.model.lm_head = SplitKHead(lm.model.lm_head)
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
    prompt = list(range(10, 22))
    r = dv.diverge(lm, prompt, 24, k=2)
    t = r["triage"]
    assert r["first_divergence"] is not None
    assert t["verdict"] == dv.NEAR_TIE and t["divergence_verdict"] == dv.NEAR_TIE
    assert {t["token_a"], t["token_b"]} == {5, 6}
    assert t["margin"] <= t["envelope"] and not t["bit_identical"]
    assert t["reproduces_a"] and t["reproduces_b"]
    assert t["stream_a_check"]["first_outside"] is None and t["stream_b_check"]["first_outside"] is None


def test_speculative_run_without_rollback_is_outside_the_envelope():
    # Planted: the target's cache is never trimmed after a rejection, so rejected
    # drafts stay in it. The first divergence may still be a near-tie; the
    # speculative stream is not what its own schedule computes.
    from mlx_lm.models.cache import KVCache

    class NoRollback(KVCache):
        def trim(self, n):
            return 0

    lm = near_tie_model()
    draft = make_tiny("float32", seed=7, sliding_window_pattern=1).model  # disagrees often: many rejections
    prompt = list(range(10, 22))
    a = dv.generate_plain(lm.model, prompt, 24)
    caches = [NoRollback() for _ in lm.model.layers] + [KVCache() for _ in draft.layers]
    b = dv.generate_speculative(lm.model, prompt, 24, k=2, draft=draft, prompt_cache=caches)
    assert b.stats["acceptance"] < 0.5
    t = dv.triage(lm, prompt, a.tokens, b.tokens, a.schedule, b.schedule)
    assert t.verdict == dv.OUTSIDE
    assert t.stream_b_check["first_outside"] is not None and t.stream_a_check["first_outside"] is None
    assert "stream B" in t.reason


def test_planted_state_bug_is_outside_the_envelope():
    lm = make_tiny("float32", seed=3)
    prompt = list(range(10, 30))
    a = dv.generate_plain(lm.model, prompt, 24).tokens
    b = stale_cache_stream(lm, prompt, 24)
    t = dv.triage(lm, prompt, a, b, "prefill:2048,decode", "prefill:512,verify:2")
    assert t.verdict == dv.OUTSIDE
    assert t.margin > 100 * t.envelope > 0
    assert t.reproduces_a and not t.reproduces_b


@pytest.mark.linux_cpu_reference
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
    a = dv.generate_plain(lm.model, [1, 2, 3], 6).tokens
    t = dv.triage(lm, [1, 2, 3], a, a, "prefill:2048,decode", "prefill:512,verify:2")
    assert t.verdict == "IDENTICAL" and t.stream_a_check["mismatches"] == 0
    # Tokens the model would never pick greedily are flagged, even when both streams agree.
    t = dv.triage(lm, [1, 2, 3], [4, 5], [4, 5], "prefill:2048,decode", "prefill:512,verify:2")
    assert t.verdict == dv.OUTSIDE and t.stream_a_check["first_outside"] == 0


def test_check_stream_known_answer():
    logits = np.array([[0.0, 1.0, 0.5], [2.0, 1.9, 0.0], [0.0, 0.0, 3.0]])
    c = dv.check_stream(logits, [1, 1, 0], envelope=0.2)
    assert (c["mismatches"], c["first_mismatch"], c["first_outside"]) == (2, 1, 2)
    assert c["margin_outside"] == 3.0 and c["max_margin"] == 3.0
    assert np.allclose(c["margins"], [0.0, 0.1, 3.0])


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
    from gemmdrift.view.summaries import divergence_summary

    s = divergence_summary(df)
    assert s["prompts"] == 2 and s["diverged"] == int(df["first_divergence"].notna().sum())
    assert s["tokens_compared"] == int(df["compared"].sum())
    assert s["divergences_per_1k"] == pytest.approx(1000 * s["diverged"] / s["tokens_compared"])

    def fail(*a, **k):
        raise AssertionError("finished prompts must not run again")

    monkeypatch.setattr(dv, "diverge", fail)
    again = dv.divergence_stats(lm, prompts, 16, checkpoint=tmp_path, k=2)
    assert again.equals(df)


def test_streams_that_never_part_past_the_envelope_window_are_identical():
    # Regression: streams agreeing for more than 64 tokens made triage fail with "position has no
    # logits in this run" (the logits started at the envelope window, not at the first generated token).
    from gemmdrift.report import triage_items
    from gemmdrift.result import Verdict

    lm = make_tiny("float32")
    a = dv.generate_plain(lm.model, [1, 2, 3], 80).tokens
    t = dv.triage(lm, [1, 2, 3], a, a, "prefill:2048,decode", "prefill:512,verify:2")
    assert t.verdict == Verdict.IDENTICAL and t.index is None and t.lengths == [80, 80]
    # Each stream is still checked against its own schedule, at every generated token.
    assert t.stream_a_check["tokens"] == 80 and t.stream_b_check["tokens"] == 80
    assert t.stream_a_check["first_outside"] is None and t.stream_b_check["first_outside"] is None
    # Unequal lengths are said, and the longer one is still checked whole.
    t = dv.triage(lm, [1, 2, 3], a, a[:70], "prefill:2048,decode", "prefill:512,verify:2")
    assert t.verdict == Verdict.IDENTICAL and t.lengths == [80, 70] and "80" in t.reason and "70" in t.reason
    assert t.stream_a_check["tokens"] == 80
    assert any("unequal lengths" in x for x in triage_items(t.as_dict()))
    # A late divergence (past the window too) is judged, not a crash; a token the model never picks is outside.
    b = a[:75] + [(a[75] + 1) % 97] + a[76:]
    t = dv.triage(lm, [1, 2, 3], a, b, "prefill:2048,decode", "prefill:512,verify:2")
    assert t.index == 75 and t.verdict == Verdict.OUTSIDE and t.stream_b_check["first_outside"] == 75
    assert not any("tap None" in x for x in triage_items(t.as_dict()))


def test_a_corrupt_prompt_checkpoint_is_discarded_and_resume_keys_name_the_dtype(tmp_path, monkeypatch, capsys):
    # Regression: a corrupt prompt JSON crashed `diverge --prompts` on resume, and a resume with
    # another --dtype reused rows computed at the first dtype (the key did not name the model or dtype).
    lm = near_tie_model()
    prompts = [list(range(10, 22))]
    first = dv.divergence_stats(lm, prompts, 8, checkpoint=tmp_path, k=2)
    [row] = list(tmp_path.glob("prompt-*.json"))
    row.write_text('{"prompt": "0"')
    capsys.readouterr()
    again = dv.divergence_stats(lm, prompts, 8, checkpoint=tmp_path, k=2)
    assert f"checkpoint {row} is corrupt" in capsys.readouterr().err
    assert again.equals(first)
    other = near_tie_model()
    import dataclasses

    other.description = dataclasses.replace(other.description, dtype="float16")
    calls = []
    real = dv.diverge
    monkeypatch.setattr(dv, "diverge", lambda *a, **k: calls.append(1) or real(*a, **k))
    dv.divergence_stats(other, prompts, 8, checkpoint=tmp_path, k=2)
    assert calls == [1] and len(list(tmp_path.glob("prompt-*.json"))) == 2


@pytest.mark.parametrize("rollback", ["mlx-lm", "exact"])
def test_the_two_streams_in_two_processes_are_the_same_streams(tmp_path, rollback):
    """diverge() runs the plain and the speculative stream side by side in two processes (gemmdrift.workers);
    each is the computation one process does: the same tokens, the same divergence and triage."""
    from gemmdrift.measure.diverge import diverge
    from gemmdrift.model import load_model
    from test_models import save_tiny

    save_tiny(tmp_path / "m")
    lm = load_model(str(tmp_path / "m"), dtype="bfloat16")
    prompt = [int(t) for t in np.random.default_rng(3).integers(5, 97, 14)]  # past the tiny window of 8
    one = diverge(lm, prompt, 12, k=2, prefill_b=4, rollback=rollback, workers=1)
    two = diverge(lm, prompt, 12, k=2, prefill_b=4, rollback=rollback, workers=2)
    for key in ("stream_a", "stream_b"):
        assert one[key]["tokens"] == two[key]["tokens"] and len(one[key]["tokens"]) == 12
    assert one["first_divergence"] == two["first_divergence"]
    assert one["triage"]["verdict"] == two["triage"]["verdict"]


@pytest.mark.parametrize("rollback", ["mlx-lm", "exact"])
@pytest.mark.parametrize("length", [6, 14])
def test_streams_from_the_shared_prompt_prefill_are_the_streams_mlx_lm_prefills_itself(rollback, length):
    """Where both generators chunk the prompt alike, diverge() prefills it once and every stream (the
    speculative one's target and draft caches, and the triage runs) starts from a copy: the same tokens as
    mlx-lm's own prefill. The streams run past the tiny model's window of 8, where mlx-lm's rollback makes a
    stream sensitive to its cache state (an aliased or doubled prefill changes it). A prompt past the window
    leaves a cache mlx-lm's speculative generator would refuse: that stream prefills its own."""
    from mlx_lm.models.cache import can_trim_prompt_cache

    lm = make_tiny("bfloat16", seed=3)
    prompt = [int(t) for t in np.random.default_rng(3).integers(5, 97, length)]
    prefix = dv._prompt_prefix(lm, prompt, [dv.plain_schedule(2048), dv.speculative_schedule(512, 2)])
    assert prefix is not None and prefix.length == length - 1
    assert can_trim_prompt_cache(prefix.cache) == (length < 8)
    for kind in ("plain", "speculative"):
        job = dict(kind=kind, prompt=prompt, n=12, prefill=2048 if kind == "plain" else 512, k=2, rollback=rollback)
        own, shared = dv._stream_job(lm, **job), dv._stream_job(lm, **job, prefix=prefix)
        assert shared.tokens == own.tokens and len(own.tokens) == 12
        assert shared.stats == own.stats
    # Chunks that differ before the prompt's end: nothing shared.
    assert dv._prompt_prefix(lm, prompt, [dv.plain_schedule(2048), dv.speculative_schedule(4, 2)]) is None


def test_diverge_with_the_shared_prefill_in_one_or_two_processes_gives_mlx_lm_s_own_streams(tmp_path):
    """One process (one shared prefill) against two (the prefilled caches pickled to the other process, which
    generates the plain stream and runs its teacher-forced triage run): the same streams, divergence and
    triage, and the streams are the ones mlx-lm's generators give when they prefill themselves."""
    from gemmdrift.model import load_model
    from test_models import save_tiny

    save_tiny(tmp_path / "m")
    lm = load_model(str(tmp_path / "m"), dtype="bfloat16")
    prompt = [int(t) for t in np.random.default_rng(3).integers(5, 97, 7)]  # below the window of 8: trimmable
    one = dv.diverge(lm, prompt, 12, k=2, workers=1)
    two = dv.diverge(lm, prompt, 12, k=2, workers=2)
    assert one["shared_prefill"]["tokens"] == two["shared_prefill"]["tokens"] == 6
    assert two["stream_a"]["tokens"] == dv.generate_plain(lm.model, prompt, 12).tokens
    assert two["stream_b"]["tokens"] == dv.generate_speculative(lm.model, prompt, 12, k=2).tokens
    for key in ("stream_a", "stream_b"):
        assert one[key]["tokens"] == two[key]["tokens"]
    assert one["first_divergence"] == two["first_divergence"]
    for key in ("verdict", "envelope", "margin", "bit_identical", "stream_a_check", "stream_b_check",
                "first_layer_differ", "gap_a", "dgap"):
        assert one["triage"].get(key) == two["triage"].get(key), key
