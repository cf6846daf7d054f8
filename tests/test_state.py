"""Cache state exactness (gemmdrift state): known answers, planted bugs, and mlx-lm's real caches.

Every test runs on the tiny gemma3_text of conftest (sliding window 8), in seconds.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from conftest import make_tiny
from gemmdrift import state
from gemmdrift.result import Verdict


def _table(r):
    return r.tables["state"]


def _kv_setup(cls, name):
    from mlx_lm.models.cache import KVCache  # noqa: F401  (the planted classes subclass it)

    return state.Setup(name, lambda m: [cls() for _ in m.layers], f"every layer a {name}")


def _planted():
    from mlx_lm.models.cache import KVCache

    class TrimOffByOne(KVCache):
        """Planted: trims one token fewer than asked, and says it trimmed them all."""

        def trim(self, n):
            m = min(self.offset, n)
            self.offset -= max(m - 1, 0)
            return m

    class TrimNothing(KVCache):
        """Planted: a trim that silently does nothing (returns n, keeps every entry)."""

        def trim(self, n):
            return min(self.offset, n)

    class TrimRounds(KVCache):
        """Planted: an honest trim that also re-rounds the kept keys (x * 3 / 3 in the cache dtype):
        a rounding-level change, which the float32 ladder must call rounding."""

        def trim(self, n):
            import mlx.core as mx

            m = super().trim(n)
            if m and self.keys is not None:
                three = mx.array(3.0, dtype=self.keys.dtype)
                self.keys = (self.keys * three) / three
            return m

    return TrimOffByOne, TrimNothing, TrimRounds


# ----------------------------------------------------------------------------- comparison known answers


def test_compare_readings_finds_one_changed_entry_and_an_offset_mismatch():
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    k, v = state._synthetic_kv(10, dim=8)
    a, b = KVCache(), KVCache()
    a.update_and_fetch(k, v)
    b.update_and_fetch(k, v)
    assert state.compare_readings([state.read_cache(a)], [state.read_cache(b)]).identical
    # One value of entry 4 changed by a known amount: the reading must report exactly it.
    kk = np.array(k.astype(mx.float32))
    kk[0, 0, 4, 3] += 0.5
    c = KVCache()
    c.update_and_fetch(mx.array(kk).astype(mx.bfloat16), v)
    d = state.compare_readings([state.read_cache(c)], [state.read_cache(a)])
    expect = abs(float(mx.array(kk).astype(mx.bfloat16)[0, 0, 4, 3].item()) - float(kk[0, 0, 4, 3] - 0.5))
    assert not d.identical and d.structure and d.layers == [0]
    assert d.max_abs == pytest.approx(expect)
    a.trim(1)
    d = state.compare_readings([state.read_cache(a)], [state.read_cache(b)])
    assert not d.structure and "offset 9 vs 10" in d.why


def test_rotating_reading_is_temporal_order_of_the_live_window():
    """A ring-buffer cache (T=1 writes) and a concatenated one hold the same live entries in temporal order."""
    from mlx_lm.models.cache import RotatingKVCache

    k, v = state._synthetic_kv(23, dim=8)
    ring, cat = RotatingKVCache(max_size=8), RotatingKVCache(max_size=8)
    for i in range(23):
        ring.update_and_fetch(k[..., i:i + 1, :], v[..., i:i + 1, :])
    cat.update_and_fetch(k[..., :20, :], v[..., :20, :])
    cat.update_and_fetch(k[..., 20:, :], v[..., 20:, :])
    a, b = state.read_cache(ring), state.read_cache(cat)
    assert a["offset"] == b["offset"] == 23 and a["arrays"][0].shape[2] == 7
    assert np.array_equal(state.to_numpy(a["arrays"][0]), state.to_numpy(k[..., 16:23, :]))
    assert state.compare_readings([a], [b]).identical


def test_judge_rounding_needs_the_ladder_to_shrink():
    bf = state.Diff(True, False, 1e-2, 1e-3, 0.2, why="entries differ")
    v, _, shrink = state.judge(bf, state.Diff(True, False, 1e-7, 1e-8, 1e-6))
    assert v == Verdict.ROUNDING and shrink == pytest.approx(1e5)
    v, _, shrink = state.judge(bf, state.Diff(True, False, 1e-3, 2e-4, 0.05))
    assert v == Verdict.STATE_BUG and shrink == pytest.approx(4.0)
    assert state.judge(bf, state.Diff(True, False, 1e-7, 1e-8, 1e-6), envelope=0.1)[0] == Verdict.STATE_BUG
    assert state.judge(state.Diff(), refused=True)[0] == Verdict.STATE_BUG
    assert state.judge(state.Diff())[0] == Verdict.EXACT
    assert state.judge(state.Diff(False, False, why="offset 3 vs 2"))[0] == Verdict.STATE_BUG


# ----------------------------------------------------------------------------- item 3: known answers on a model


@pytest.mark.linux_cpu_reference
def test_kvcache_is_exact_everywhere():
    lm = make_tiny()
    r = state.measure_state(lm, operations=("rollback", "trim", "trim_prompt_cache", "save_load", "server_reuse"),
                            caches=["KVCache"])
    t = _table(r)
    assert set(t["operation"]) == {"rollback", "trim", "trim_prompt_cache", "save_load", "server_reuse"}
    assert len(t[t["operation"] == "rollback"]) == 4 * 14  # 4 prefixes x (k, r) with k = 1..4, r = 0..k
    assert set(t["verdict"]) == {"EXACT"}, t[t["verdict"] != "EXACT"][["operation", "where", "params", "reason"]]
    assert r.figure("non_exact.KVCache.rollback") == 0.0 and r.figure("cases.KVCache.rollback") == 56.0
    assert set(t["mlx_lm_version"]) == {state.mlx_lm_version()} and t["mlx_lm_function"].str.len().min() > 10


def test_planted_trims_are_state_bugs_exactly_where_drafts_are_rejected():
    off_by_one, nothing, _ = _planted()
    lm = make_tiny()
    r = state.measure_state(lm, operations=("rollback",), where=("below", "far"), ks=(1, 3), ladder=False,
                            setups=[_kv_setup(off_by_one, "TrimOffByOne"), _kv_setup(nothing, "TrimNothing")])
    t = _table(r)
    for name in ("TrimOffByOne", "TrimNothing"):
        g = t[t["cache"] == name]
        assert len(g) == 2 * (2 + 4)
        bug = g["verdict"] == "STATE BUG"
        assert (bug == (g["r"] > 0)).all(), g[["where", "params", "verdict"]]
        assert (g[g["r"] == 0]["verdict"] == "EXACT").all()
        assert g[bug]["reason"].str.contains("offset").all()
        assert r.figure(f"non_exact.{name}.rollback") == float(bug.sum())
    # Off by one keeps exactly one rejected token: offset one above the reference.
    row = t[(t["cache"] == "TrimOffByOne") & (t["where"] == "below") & (t["params"] == "k=3 r=2")].iloc[0]
    p = row["prefix"]
    assert f"offset {p + 1 + 1 + 1} vs {p + 1 + 1}" in row["reason"]


def test_planted_trims_are_caught_by_the_direct_trim_case():
    off_by_one, nothing, _ = _planted()
    from mlx_lm.models.cache import KVCache

    for cls, bad in ((KVCache, False), (off_by_one, True), (nothing, True)):
        c = state.trim_case(cls, 8, 3, 2, "trim")
        assert c["diff"].identical is not bad and c["trimmed"] == 2


def test_rounding_is_told_apart_by_the_precision_ladder():
    _, _, rounds = _planted()
    lm = make_tiny()
    r = state.measure_state(lm, operations=("rollback",), where=("below",), ks=(2,),
                            setups=[_kv_setup(rounds, "TrimRounds")])
    t = _table(r)
    assert (t[t["r"] == 0]["verdict"] == "EXACT").all()
    rej = t[t["r"] > 0]
    assert (rej["verdict"] == "rounding").all(), rej[["params", "verdict", "reason"]]
    assert (rej["shrink"] >= 100).all() and (rej["max_abs"] > 0).all()
    # Without the ladder nobody may call it rounding.
    t2 = _table(state.measure_state(lm, operations=("rollback",), where=("below",), ks=(2,), ladder=False,
                                    setups=[_kv_setup(rounds, "TrimRounds")]))
    assert set(t2[t2["r"] > 0]["verdict"]) == {"STATE BUG"}


def test_real_rotating_cache_past_its_window_as_it_behaves():
    """Measured, not assumed: whenever the installed RotatingKVCache refuses to trim a full window,
    the rollback is a state bug; wherever it trims, it is exact."""
    from mlx_lm.models.cache import RotatingKVCache

    lm = make_tiny()
    window = lm.info["sliding_window"]
    r = state.measure_state(lm, operations=("rollback",), caches=["RotatingKVCache"])
    t = _table(r)
    assert len(t) == 4 * 14
    for _, row in t.iterrows():
        probe = RotatingKVCache(max_size=window)
        k, v = state._synthetic_kv(int(row["prefix"]) + int(row["k"]) + 1, dim=8)
        probe.update_and_fetch(k, v)  # the cache right after the verification block
        refuses = not probe.is_trimmable()
        expect = "STATE BUG" if (refuses and row["r"] > 0) else "EXACT"
        assert row["verdict"] == expect, row.to_dict()
        if expect == "STATE BUG":
            assert row["trimmed"] == 0 and "refused" in row["reason"]
    # mlx-lm 0.32.2: the block crosses the window in every case but 'below'.
    assert set(t[t["verdict"] == "STATE BUG"]["where"]) <= {"at", "past", "far"}


def test_rotating_trim_method_itself_is_exact_only_before_a_block():
    """RotatingKVCache.trim past the window (called directly, as trim_prompt_cache refuses to) restores
    the state when the next update is a block, but not when it is one token (ring write)."""
    from mlx_lm.models.cache import RotatingKVCache

    make = lambda: RotatingKVCache(max_size=16)  # noqa: E731
    assert state.trim_case(make, 19, 3, 2, "trim", continuation=(3,))["diff"].identical
    assert not state.trim_case(make, 19, 3, 2, "trim", continuation=(1,))["diff"].identical
    # trim_prompt_cache refuses past the window and trims nothing.
    c = state.trim_case(make, 19, 3, 2, "trim_prompt_cache", continuation=(3,))
    assert c["trimmed"] == 0 and not c["can_trim"] and not c["diff"].structure


# ----------------------------------------------------------------------------- item 5: n/a and unknown classes


def test_not_applicable_and_not_checked_rows(monkeypatch):
    from mlx_lm.models import cache as C

    class FancyCache(C._BaseCache):
        pass

    FancyCache.__module__ = C.__name__
    monkeypatch.setattr(C, "FancyCache", FancyCache, raising=False)
    lm = make_tiny(sliding_window_pattern=1)  # every layer global: make_prompt_cache gives KVCaches only
    r = state.measure_state(lm, operations=("rollback", "trim"), where=("below",), ks=(1,),
                            caches=["RotatingKVCache", "ArraysCache"])
    t = _table(r)
    rot = t[(t["cache"] == "RotatingKVCache") & (t["operation"] == "rollback")]
    assert list(rot["verdict"]) == ["not applicable"] and "no sliding window" in rot["reason"].iloc[0]
    assert set(t[t["cache"] == "ArraysCache"]["verdict"]) == {"not applicable"}
    fancy = t[t["cache"] == "FancyCache"]
    assert set(fancy["verdict"]) == {"not checked"} and set(fancy["operation"]) == {"rollback", "trim"}
    assert "FancyCache" in state.cache_classes()


# ----------------------------------------------------------------------------- d, e


def test_server_reuse_trims_to_the_common_prefix_and_is_exact_for_kvcache():
    lm = make_tiny()
    setup = state.model_setups(lm)[0]
    prefix = state.compute_prefix(lm, state.token_stream(lm, 64), 24)
    for kind, reused in (("longer", 10), ("shorter", 5), ("branch", 6)):
        r = state.server_case(lm, setup, prefix, 6, kind)
        assert r["reused"] == reused and r["diff"].identical, (kind, r)


@pytest.mark.linux_cpu_reference
def test_batch_vs_alone_is_reusable_and_catches_a_planted_filter(monkeypatch):
    from mlx_lm.models import cache as C

    lm = make_tiny()
    seq = state.token_stream(lm, 14, seed=1)
    other = state.token_stream(lm, 9, seed=2)
    for op in ("extend", "filter"):
        r = state.batch_vs_alone(lm, seq, other, op=op)
        assert r["diff"].identical, (op, r["diff"].why)
    real = C.BatchKVCache.filter
    monkeypatch.setattr(C.BatchKVCache, "filter", lambda self, idx: real(self, [1]))  # keeps the wrong sequence
    d = state.batch_vs_alone(lm, seq, other, op="filter", cache_factory=lambda m: [C.KVCache() for _ in m.layers])["diff"]
    assert not d.identical and not d.structure
    c = state.batch_check(lm, seq, other, op="filter", cache_factory=lambda m: [C.KVCache() for _ in m.layers])
    assert c["verdict"] == Verdict.STATE_BUG and c["f32"] is None and "offset" in c["reason"]
    monkeypatch.undo()
    assert state.batch_check(lm, seq, other, op="extend")["verdict"] == Verdict.EXACT


# ----------------------------------------------------------------------------- Result, store, CLI


def test_result_round_trips_through_the_store_with_a_grid(tmp_path):
    from gemmdrift import store
    from gemmdrift.view import summaries

    lm = make_tiny()
    r = state.measure_state(lm, operations=("rollback", "trim_prompt_cache"), where=("below", "past"), ks=(1,),
                            caches=["KVCache", "RotatingKVCache"])
    written = store.write_result(r, tmp_path / "s")
    assert (tmp_path / "s" / "state_grid.png").is_file() and "state" in written
    back = store.read_result(tmp_path / "s")
    assert back.kind == "state" and dict(back.figures) == dict(r.figures)
    s = summaries.summary(back)
    assert s["verdicts"]["STATE BUG"] == int((_table(r)["verdict"] == "STATE BUG").sum()) > 0
    text = summaries.text(back)
    assert "RotatingKVCache" in text and "refused" in text
    from gemmdrift.report import build_report

    page = build_report(tmp_path / "s")["markdown"].read_text()
    assert "Cache state exactness" in page and "state_grid.png" in page


def test_cli_state_on_a_tiny_directory(tmp_path):
    from test_cli import gd
    from test_models import save_tiny

    save_tiny(tmp_path / "m")
    r = gd("state", "--model", str(tmp_path / "m"), "--ops", "rollback", "--where", "below,past", "--k", "1",
           "--out", str(tmp_path / "out"), "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["kind"] == "state" and s["cases"] == 3 * 2 * 2  # 3 cache setups x 2 prefixes x (k=1: r=0,1)
    bugs = [(b["cache"], b["operation"], b["where"], b["params"]) for b in s["state_bugs"]]
    assert bugs == [("RotatingKVCache", "rollback", "past", "k=1 r=1")]  # the one refused trim


@pytest.mark.parametrize("args,needle", [
    (["--ops", "rewind"], "unknown operation"),
    (["--where", "inside"], "unknown prefix position"),
    (["--k", "0"], "draft counts"),
    (["--caches", "MagicCache"], "unknown cache class"),
    (["--envelope", "-1"], "must be a finite non-negative"),  # checks.check_envelope, as triage (issue 25)
    (["--envelope", "inf"], "must be a finite non-negative"),
    (["--workers", "0"], "--workers must be at least 1"),
])
def test_cli_state_bad_input_is_one_line_before_loading(args, needle):
    from test_cli import assert_user_error, gd

    assert_user_error(gd("state", "--model", "/no/such/model", *args), needle)


# ----------------------------------------------------------------------------- item 2: the exact-rollback decoder


def test_exact_rollback_decoder_is_mlx_lm_where_mlx_lm_can_trim():
    """All-global caches (KVCache only): mlx-lm's trim works, so both decoders give the same stream."""
    from gemmdrift.measure import diverge as dv

    lm = make_tiny("float32", seed=3, sliding_window_pattern=1)
    draft = make_tiny("float32", seed=7, sliding_window_pattern=1).model
    prompt = list(range(10, 22))
    b = dv.generate_speculative(lm.model, prompt, 20, k=2, draft=draft)
    c = dv.generate_speculative_exact(lm.model, prompt, 20, k=2, draft=draft)
    assert c.tokens == b.tokens and c.stats["restores"] == 0 and c.stats["acceptance"] == b.stats["acceptance"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_exact_rollback_decoder_fixes_the_sliding_window_state_bug(dtype):
    """Sliding window 8, a draft that is mostly rejected: mlx-lm's stream is generated from a cache that kept
    rejected drafts (OUTSIDE the envelope); the exact rollback restores snapshots and reproduces plain greedy."""
    from gemmdrift.measure import diverge as dv

    lm = make_tiny(dtype, seed=3)
    draft = make_tiny(dtype, seed=7).model
    prompt = list(range(10, 22))
    a = dv.generate_plain(lm.model, prompt, 24)
    b = dv.generate_speculative(lm.model, prompt, 24, k=2, draft=draft)
    c = dv.generate_speculative_exact(lm.model, prompt, 24, k=2, draft=draft)
    tb = dv.triage(lm, prompt, a.tokens, b.tokens, a.schedule, b.schedule)
    tc = dv.triage(lm, prompt, a.tokens, c.tokens, a.schedule, c.schedule)
    assert tb.verdict == dv.OUTSIDE and tb.stream_b_check["first_outside"] is not None
    assert c.stats["restores"] > 0
    assert tc.verdict in ("IDENTICAL", dv.NEAR_TIE) and tc.stream_b_check["first_outside"] is None
    # Self-drafting (drafts mostly accepted) past the window: the exact decoder is plain greedy here too.
    s = dv.generate_speculative_exact(lm.model, prompt, 24, k=3)
    ts = dv.triage(lm, prompt, a.tokens, s.tokens, a.schedule, s.schedule)
    assert s.stats["acceptance"] > 0.5 and ts.verdict in ("IDENTICAL", dv.NEAR_TIE)


def test_state_benchmark_tracks_counts_and_nan_for_missing_cases(monkeypatch):
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from benchmarks import bench_state, common

    tiny = make_tiny()
    monkeypatch.setattr(common, "model", lambda dtype="bfloat16": tiny)
    monkeypatch.setattr(common, "STATE_OPERATIONS", ("rollback", "trim_prompt_cache"))
    monkeypatch.setattr(common, "STATE_WHERE", ("below", "past"))
    monkeypatch.setattr(common, "STATE_KS", (1,))
    # The shared setup (common.Probes) computes only the state sweep when asked to.
    monkeypatch.setenv("GEMMDRIFT_BENCH_PARTS", "state")
    b = bench_state.StateExactness()
    f = b.setup_cache()
    assert set(f) == set(common.PROBE_PARTS) and f["decode"] == {} and f["state"]
    for fn in (b.track_non_exact, b.track_state_bugs):
        assert fn.unit and fn.version == "1"
    assert b.track_non_exact(f, "KVCache/rollback") == 0.0
    assert b.track_non_exact(f, "RotatingKVCache/rollback") == 1.0  # past the window, k=1 r=1: refused
    assert b.track_non_exact(f, "RotatingKVCache/trim_prompt_cache") == 4.0  # past: 2 trims x 2 continuations
    assert math.isnan(b.track_non_exact(f, "QuantizedKVCache/save_load"))  # not measured: NaN, never 0
    assert set(bench_state.STATE_CASES) >= {"RotatingKVCache/rollback", "BatchRotatingKVCache/batch"}


def test_rollback_comparison_puts_both_rollbacks_side_by_side(tmp_path):
    from gemmdrift.measure import diverge as dv

    lm = make_tiny("float32", seed=3)
    prompts = [list(range(10, 22)), list(range(30, 41))]
    df = dv.rollback_comparison(lm, prompts, 10, k=2, checkpoint=tmp_path)
    assert list(df["rollback"]) == ["mlx-lm", "exact"] * 2 and list(df["prompt"]) == ["0", "0", "1", "1"]
    exact = df[df["rollback"] == "exact"]
    assert exact["b_first_outside"].isna().all() and set(exact["verdict"]) <= {"IDENTICAL", "NEAR-TIE"}
    again = dv.rollback_comparison(lm, prompts, 10, k=2, checkpoint=tmp_path)  # resumed from the checkpoint
    assert again.equals(df)


def test_cli_diverge_rollback_exact(tmp_path):
    from test_cli import assert_user_error, gd
    from test_models import save_tiny

    save_tiny(tmp_path / "m")
    (tmp_path / "ids.txt").write_text(" ".join(str(i) for i in range(10, 22)))
    r = gd("diverge", "--model", str(tmp_path / "m"), "--prompt-ids", str(tmp_path / "ids.txt"), "--n", "12",
           "--rollback", "exact", "--out", str(tmp_path / "out"), "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["stream_b"]["label"] == "speculative-exact" and s["stream_b"]["rollback"] == "exact"
    assert s["triage"]["stream_b_check"]["first_outside"] is None
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["inputs"]["rollback"] == "exact"
    assert_user_error(gd("diverge", "--model", str(tmp_path / "m"), "--rollback", "undo"), "mlx-lm, exact or module:function")


def test_exact_rollback_benchmark_summarises_both_rollbacks(monkeypatch):
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    import pandas as pd

    from benchmarks import bench_state
    from gemmdrift.measure import diverge as dv

    calls = {}

    def fake(lm, ids, n, k):  # the measurement itself is tested in test_rollback_comparison_...
        calls["args"] = (len(ids), n, k)
        return pd.DataFrame([
            {"rollback": "mlx-lm", "first_divergence": 5, "verdict": "OUTSIDE ENVELOPE"},
            {"rollback": "mlx-lm", "first_divergence": None, "verdict": "IDENTICAL"},
            {"rollback": "exact", "first_divergence": 9, "verdict": "NEAR-TIE"},
            {"rollback": "exact", "first_divergence": None, "verdict": "IDENTICAL"}])

    class FakeTok:
        def encode(self, text):
            return [1, 2, 3]

    class FakeLM:
        tokenizer = FakeTok()

    monkeypatch.setattr(dv, "rollback_comparison", fake)
    monkeypatch.setattr(bench_state.common, "model", lambda dtype="bfloat16": FakeLM())
    monkeypatch.setenv("GEMMDRIFT_BENCH_LONG", "1")  # a long benchmark: opt-in on the CPU
    b = bench_state.ExactRollbackDivergence()
    f = b.setup_cache()
    assert calls["args"] == (10, 32, 2)
    assert b.track_outside_envelope(f, "mlx-lm") == 1.0 and b.track_outside_envelope(f, "exact") == 0.0
    assert b.track_near_ties(f, "exact") == 1.0 and b.track_diverged(f, "mlx-lm") == 1.0
    for fn in (b.track_outside_envelope, b.track_near_ties, b.track_diverged):
        assert fn.unit == "prompts" and fn.version == "1"


def test_sweep_in_two_processes_gives_the_same_table(tmp_path):
    """The sweep split over two processes (rollback | the rest), each loading the model again, gives the
    table one process gives, row for row; the record says how many processes ran it."""
    from gemmdrift.model import load_model
    from test_models import save_tiny

    save_tiny(tmp_path / "m")
    lm = load_model(str(tmp_path / "m"), dtype="float32")
    kw = dict(operations=("rollback", "trim_prompt_cache", "save_load"), where=("below", "past"), ks=(1,),
              caches=("KVCache", "RotatingKVCache"))
    one = state.measure_state(lm, workers=1, **kw)
    two = state.measure_state(lm, workers=2, **kw)
    assert one.inputs["workers"] == 1 and two.inputs["workers"] == 2
    a, b = _table(one), _table(two)
    assert len(a) > 20 and a.equals(b)
    assert set(a["operation"]) == {"rollback", "trim_prompt_cache", "save_load"}


def test_workers_default_to_one_where_the_model_cannot_be_loaded_again():
    lm = make_tiny()
    assert lm.recipe is None
    r = state.measure_state(lm, operations=("rollback", "save_load"), where=("below",), ks=(1,), ladder=False)
    assert r.inputs["workers"] == 1
    with pytest.raises(state.GemmdriftError, match="load again"):
        state.measure_state(lm, operations=("rollback", "save_load"), where=("below",), ks=(1,), workers=2)
