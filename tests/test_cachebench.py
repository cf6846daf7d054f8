"""The cache test bench (issue 24): plug-in caches and rollbacks judged by the state grid, and the overlay cache.

Tiny gemma3_text of conftest (sliding window 8); every test takes seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import make_tiny
from gemmdrift.state import bench as cachebench
from gemmdrift.caches import plugins
from gemmdrift.errors import GemmdriftError

PLUGINS = str(Path(__file__).resolve().parent / "cache_plugins.py")


def _grid(spec, **kw):
    lm = make_tiny()
    r = cachebench.measure_state_impl(lm, plugins.load_cache_impl(spec), **kw)
    return r, r.tables["state"]


# ----------------------------------------------------------------------------- known answers


def test_mlx_lm_rotating_cache_as_a_plug_in_is_a_state_bug_exactly_where_r_ge_1_past_the_window():
    r, t = _grid(f"{PLUGINS}:mlx_lm_own", operations=("rollback",), ladder=False)
    assert len(t) == 4 * 14
    bug = t["verdict"] == "STATE BUG"
    assert (bug == ((t["where"] != "below") & (t["r"] >= 1))).all(), t[["where", "params", "verdict"]]
    assert (t[~bug]["verdict"] == "EXACT").all()
    assert t[bug]["reason"].str.startswith("refused (trimmed nothing)").all()
    # Recorded: the spec, its file and the sha256 of its source.
    rec = r.inputs["implementations"]["cache_impl"]
    import hashlib

    assert rec["spec"].endswith(":mlx_lm_own") and rec["sha256"] == hashlib.sha256(Path(PLUGINS).read_bytes()).hexdigest()


def test_a_do_nothing_trim_is_a_state_bug_where_drafts_are_rejected_and_the_overlay_is_exact_on_the_same_cells():
    _, bad = _grid(f"{PLUGINS}:trim_nothing", operations=("rollback",), ladder=False)
    _, good = _grid("gemmdrift.caches.exact:make_cache", operations=("rollback",), ladder=False)
    assert list(bad["params"]) == list(good["params"]) and list(bad["where"]) == list(good["where"])
    assert ((bad["verdict"] == "STATE BUG") == (bad["r"] >= 1)).all()
    assert (bad[bad["r"] >= 1]["reason"].str.contains("offset")).all()
    assert set(good["verdict"]) == {"EXACT"}, good[good["verdict"] != "EXACT"][["where", "params", "reason"]]


def test_the_overlay_is_exact_on_the_whole_grid_and_model_free_trims():
    r, t = _grid("gemmdrift.caches.exact:make_cache")
    judged = t[t["verdict"] != "not applicable"]
    assert set(judged["verdict"]) == {"EXACT"}, judged[judged["verdict"] != "EXACT"][["operation", "where", "reason"]]
    ops = set(judged["operation"])
    assert ops == {"rollback", "trim", "trim_prompt_cache", "draft_trim", "save_load", "server_reuse"}
    trims = judged[judged["cache"] == "OverlayRotatingKVCache"]
    assert len(trims) == 3 * 4 * 4 and set(trims["where"]) == {"below", "at", "past", "far"}
    # The same model-free cases catch mlx-lm's ring past the window (T=1 continuations and refusals).
    _, own = _grid(f"{PLUGINS}:mlx_lm_own", operations=("trim",))
    ring = own[own["cache"] == "RotatingKVCache"]
    assert (ring[ring["where"] == "below"]["verdict"] == "EXACT").all()
    assert (ring[ring["where"] != "below"]["verdict"] == "STATE BUG").any()
    assert r.figure("state_bugs") == 0.0


def test_the_drafts_rewind_after_t1_drafting_tells_the_designs_apart():
    """draft_trim: 3 drafting steps of one token, then the draft's rewind. mlx-lm's ring refuses past the window;
    unroll-and-cut (mlx-swift-lm #584, rebuilt) keeps too few rows when it cuts 2 after T=1 writes; the overlay
    is exact."""
    def verdicts(spec):
        _, t = _grid(spec, operations=("draft_trim",), where=("below", "past"))
        t = t[t["cache"] != "KVCache"]
        return {(w, p): v for w, p, v in zip(t["where"], t["params"], t["verdict"])}

    own, cut, ours = (verdicts(s) for s in (f"{PLUGINS}:mlx_lm_own", "gemmdrift.caches.designs:unroll_cut",
                                             "gemmdrift.caches.exact:make_cache"))
    assert set(ours.values()) == {"EXACT"} and len(ours) == 8
    assert {v for (w, _), v in own.items() if w == "past"} == {"STATE BUG"}
    assert {v for (w, _), v in own.items() if w == "below"} == {"EXACT"}
    assert cut[("past", "3 x T=1 trim=2 then T=2")] == "STATE BUG" and cut[("past", "3 x T=1 trim=1 then T=2")] == "EXACT"
    assert cut[("past", "3 x T=1 trim=1 then T=1")] == "refused"  # its next ring write raises


def test_a_trim_that_raises_is_refused_per_case_not_a_traceback():
    r, t = _grid(f"{PLUGINS}:trim_raises", operations=("rollback", "trim"), where=("below", "past"), ks=(1,),
                 ladder=False)
    rb = t[t["operation"] == "rollback"]
    assert len(rb) == 2 * 2 and set(rb["verdict"]) == {"refused"}
    assert rb["reason"].str.contains("RuntimeError: this cache cannot trim").all()
    tr = t[(t["operation"] == "trim") & (t["cache"] == "TrimRaises")]
    assert len(tr) and set(tr["verdict"]) == {"refused"}
    assert r.figure("non_exact.TrimRaises.trim") == float(len(tr))


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("attr,needle", [
    ("too_few", "returned 3 caches for 4 layers"),
    ("not_caches", "is not a cache: it has no update_and_fetch"),
    ("factory_raises", "raised ValueError: no caches today"),
])
def test_a_bad_factory_is_one_line_on_the_loaded_model(attr, needle):
    lm = make_tiny()
    impl = plugins.load_cache_impl(f"{PLUGINS}:{attr}")
    with pytest.raises(GemmdriftError, match=needle):
        plugins.make_caches(impl, lm.model)


@pytest.mark.parametrize("flag,spec,needle", [
    ("--cache-impl", "no_such_module_here:f", "cannot import module"),
    ("--cache-impl", f"{PLUGINS}:absent", "has no attribute 'absent'"),
    ("--cache-impl", f"{PLUGINS}:two_args", "wrong signature"),
    ("--cache-impl", "/no/such/file.py:f", "no such file"),
    ("--cache-impl", "justaname", "expected module:attribute"),
    ("--rollback", f"{PLUGINS}:rollback_three", "wrong signature"),
    ("--rollback", "gemmdrift.caches.exact:make_cache", "wrong signature"),
])
def test_a_bad_spec_is_one_line_before_the_model_loads(flag, spec, needle, monkeypatch, capsys):
    from test_cli import assert_user_error, gd_here  # in this process: a model load is an error there

    cmd = "state" if flag == "--cache-impl" else "diverge"
    assert_user_error(gd_here(monkeypatch, capsys, cmd, "--model", "/no/such/model", flag, spec, load=False), needle)


def test_cli_refuses_a_factory_that_returns_non_caches_before_compute(tmp_path, monkeypatch, capsys):
    from test_cli import assert_user_error, gd_here
    from test_models import save_tiny

    def gd(*args):  # in this process (1-2 s of imports less)
        return gd_here(monkeypatch, capsys, *args)

    save_tiny(tmp_path / "m")
    r = gd("state", "--model", str(tmp_path / "m"), "--cache-impl", f"{PLUGINS}:not_caches", "--out",
           str(tmp_path / "o"))
    assert_user_error(r, "is not a cache")
    assert not (tmp_path / "o" / "meta.json").exists()


def test_cli_state_with_the_overlay_writes_exact_rows_and_records_it(tmp_path):
    from test_cli import gd
    from test_models import save_tiny

    save_tiny(tmp_path / "m")
    r = gd("state", "--model", str(tmp_path / "m"), "--cache-impl", "gemmdrift.caches.exact:make_cache", "--ops",
           "rollback", "--where", "past", "--k", "2", "--out", str(tmp_path / "o"), "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["cases"] == 3 and not s["state_bugs"]
    meta = json.loads((tmp_path / "o" / "meta.json").read_text()) if (tmp_path / "o" / "meta.json").exists() else None
    text = json.dumps(meta) if meta else "".join(p.read_text() for p in (tmp_path / "o").glob("*.json"))
    assert "gemmdrift.caches.exact:make_cache" in text and "sha256" in text


# ----------------------------------------------------------------------------- the overlay itself


def _feed(model, cache, tokens, blocks):
    import mlx.core as mx

    out, at = [], 0
    for b in blocks:
        logits = model(mx.array(tokens[at:at + b], dtype=mx.uint32)[None], cache=cache)
        out.append(np.array(logits[0].astype(mx.float32)))
        at += b
    return np.concatenate(out)


def test_the_overlay_computes_what_mlx_lm_computes_without_rollbacks():
    """Blocks of 3 past the window: mlx-lm's concatenating view, bit for bit. T=1: the same keys in temporal
    order instead of ring order (attention sums in another order), so equal to rounding."""
    from mlx_lm.models.cache import make_prompt_cache

    from gemmdrift.caches.exact import make_cache

    lm = make_tiny("float32", seed=2)
    toks = list(range(5, 5 + 40))
    a = _feed(lm.model, make_prompt_cache(lm.model), toks, [4] + [3] * 12)
    b = _feed(lm.model, make_cache(lm.model), toks, [4] + [3] * 12)
    assert np.array_equal(a, b)
    a1 = _feed(lm.model, make_prompt_cache(lm.model), toks, [4] + [1] * 36)
    b1 = _feed(lm.model, make_cache(lm.model), toks, [4] + [1] * 36)
    assert np.allclose(a1, b1, atol=1e-4, rtol=1e-4) and np.argmax(a1, -1).tolist() == np.argmax(b1, -1).tolist()


def test_the_overlay_keeps_at_most_reserve_rows_apart_and_refuses_deeper_trims_past_the_window():
    import mlx.core as mx

    from gemmdrift.caches.exact import OverlayRotatingKVCache

    c = OverlayRotatingKVCache(8, reserve=4)
    for i in range(20):
        x = mx.full((1, 1, 1, 2), float(i))
        k, v = c.update_and_fetch(x, x)
        assert k.shape[2] == min(i + 1, 8)  # the window: min(offset, max_size - 1) + the new row
        assert np.array(k[0, 0, :, 0]).tolist() == list(range(max(0, i - 7), i + 1))  # temporal order
    assert c.offset == 20 and c._overlay_len() == 4
    assert c.trim(3) == 3 and c.offset == 17
    assert c.trim(3) == 1 and c.offset == 16  # one overlay row left; the ring is full: no deeper trim
    x = mx.full((1, 1, 1, 2), 99.0)
    k, _ = c.update_and_fetch(x, x)
    assert np.array(k[0, 0, :, 0]).tolist() == list(range(9, 16)) + [99]


def test_speculative_decoding_past_the_window_with_the_overlay_is_plain_greedy():
    """mlx-lm's own speculative_generate_step, a draft that is mostly rejected, window 8: with mlx-lm's
    caches the stream leaves the envelope; with the overlay's, it is plain greedy (or parts at a near-tie)."""
    from gemmdrift.measure import diverge as dv
    from gemmdrift.caches.exact import make_cache

    lm = make_tiny("float32", seed=3)
    draft = make_tiny("float32", seed=7).model
    prompt = list(range(10, 22))
    a = dv.generate_plain(lm.model, prompt, 24)
    c = dv.generate_speculative(lm.model, prompt, 24, k=2, draft=draft,
                                prompt_cache=make_cache(lm.model) + make_cache(draft))
    tc = dv.triage(lm, prompt, a.tokens, c.tokens, a.schedule, c.schedule)
    assert c.stats["acceptance"] < 0.9  # rollbacks really happened
    assert tc.verdict in ("IDENTICAL", dv.NEAR_TIE) and tc.stream_b_check["first_outside"] is None


def test_diverge_with_a_plug_in_cache_and_rollback_records_both():
    from gemmdrift.measure import diverge as dv

    lm = make_tiny("float32", seed=3)
    prompt = list(range(10, 22))
    out = dv.diverge(lm, prompt, 12, k=2, cache_impl="gemmdrift.caches.exact:make_cache",
                     rollback="gemmdrift.caches.exact:rollback", workers=1)
    assert out["triage"]["verdict"] in ("IDENTICAL", "NEAR-TIE")
    # A rollback that drops nothing: mlx-lm's loop goes on from caches holding rejected drafts.
    bad = dv.diverge(lm, prompt, 12, k=2, draft=make_tiny("float32", seed=7).model,
                     rollback=f"{PLUGINS}:rollback_none", workers=1)
    assert bad["triage"]["verdict"] == "OUTSIDE ENVELOPE"


def test_factory_installed_gives_every_make_prompt_cache_the_implementation():
    from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

    from gemmdrift.caches.exact import OverlayRotatingKVCache, make_cache

    lm = make_tiny()
    with cachebench.factory_installed(lm.model, make_cache):
        inside = make_prompt_cache(lm.model)
    after = make_prompt_cache(lm.model)
    assert any(type(c) is OverlayRotatingKVCache for c in inside)
    assert any(type(c) is RotatingKVCache for c in after) and not any(type(c) is OverlayRotatingKVCache for c in after)


# ----------------------------------------------------------------------------- the server side


def test_self_draft_is_the_targets_first_layers_with_its_norm_and_head(tmp_path, monkeypatch):
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from gemmdrift import model as models
    from gemmdrift.model.draft_self import parse_self, self_draft
    from test_models import save_tiny

    monkeypatch.setenv("GEMMDRIFT_CACHE", str(tmp_path / "cache"))
    ref = save_tiny(tmp_path / "m")
    d = self_draft(tmp_path / "m", 2)
    assert self_draft(tmp_path / "m", 2) == d  # cached
    lm = models.load_model(str(d), dtype="float32")
    assert lm.n_layers == 2
    x = mx.array([[3, 1, 4, 1, 5]])
    ref.model.model.layers = ref.model.model.layers[:2]  # the target, cut by hand
    want = np.array(ref.model(x, cache=[KVCache(), KVCache()]))
    assert np.array_equal(np.array(lm.model(x)), want)
    assert parse_self("self:3") == 3 and parse_self("/a/dir") is None
    for bad in ("self:0", "self:x"):
        with pytest.raises(GemmdriftError, match="self:N"):
            parse_self(bad)
    with pytest.raises(GemmdriftError, match="has 4 layers"):
        self_draft(tmp_path / "m", 4)
    with pytest.raises(GemmdriftError, match="at least one full-attention layer"):  # tiny: every 2nd is global
        self_draft(tmp_path / "m", 1)


def test_the_launcher_installs_both_in_the_server_process_and_refuses_bad_specs():
    import importlib
    import subprocess
    import sys

    from gemmdrift.caches import serve_launch
    from gemmdrift.measure.server import MlxLmServer

    server, gen = importlib.import_module("mlx_lm.server"), importlib.import_module("mlx_lm.generate")
    old = server.make_prompt_cache, gen.trim_prompt_cache
    try:
        serve_launch.install("gemmdrift.caches.exact:make_cache", "gemmdrift.caches.exact:rollback")
        from gemmdrift.caches.exact import OverlayRotatingKVCache, rollback

        lm = make_tiny()
        assert any(type(c) is OverlayRotatingKVCache for c in server.make_prompt_cache(lm.model))
        assert gen.trim_prompt_cache is rollback
    finally:
        server.make_prompt_cache, gen.trim_prompt_cache = old
    r = subprocess.run([sys.executable, "-m", "gemmdrift.caches.serve_launch", "--cache-impl", "nope_mod:f", "--",
                        "--model", "/no/such"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "cannot import module 'nope_mod'" in r.stderr and "Traceback" not in r.stderr
    cmd = MlxLmServer("/m", plugins={"cache_impl": "a:b", "rollback": None}, port=1).command()
    assert cmd[1:5] == ["-m", "gemmdrift.caches.serve_launch", "--cache-impl=a:b", "--"] and "--model" in cmd


def test_cli_server_refuses_bad_plug_ins_and_drafts_before_any_server_starts(tmp_path, monkeypatch, capsys):
    from test_cli import assert_user_error, gd_here

    def gd(*args):  # in this process, where a model load is an error: each is refused before any model loads
        return gd_here(monkeypatch, capsys, *args, load=False)

    assert_user_error(gd("server", "--cache-impl", "nope_mod:f", "--out", str(tmp_path / "o")), "cannot import")
    assert_user_error(gd("server", "--rollback", f"{PLUGINS}:rollback_three", "--out", str(tmp_path / "o")),
                      "wrong signature")
    assert_user_error(gd("server", "--draft", "self:zero", "--out", str(tmp_path / "o")), "self:N")


def test_cli_stack_runs_every_schedule_on_the_plug_in_and_records_it(tmp_path):
    from test_cli import assert_user_error, gd
    from test_models import save_tiny

    save_tiny(tmp_path / "m")
    (tmp_path / "ids.txt").write_text(" ".join(str(i) for i in range(10, 30)))
    base = ["stack", "--model", str(tmp_path / "m"), "--prompt-ids", str(tmp_path / "ids.txt"), "--split", "12",
            "--schedules", "prefill:4,decode", "prefill:4,verify:2", "--no-local"]
    assert_user_error(gd(*base, "--cache-impl", f"{PLUGINS}:too_few", "--out", str(tmp_path / "bad")),
                      "returned 3 caches for 4 layers")
    r = gd(*base, "--cache-impl", "gemmdrift.caches.exact:make_cache", "--out", str(tmp_path / "o"), "--json")
    assert r.returncode == 0, r.stderr
    meta = json.loads((tmp_path / "o" / "meta.json").read_text())
    assert meta["inputs"]["cache_impl"]["spec"] == "gemmdrift.caches.exact:make_cache"
    assert len(meta["inputs"]["cache_impl"]["sha256"]) == 64


def test_the_candidates_benchmark_counts_each_designs_grid(monkeypatch):
    import sys

    root = Path(__file__).resolve().parent.parent
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from benchmarks import bench_caches, common

    monkeypatch.setattr(common, "model", lambda dtype="bfloat16": make_tiny())
    monkeypatch.setattr(bench_caches, "GRID", dict(operations=("rollback", "draft_trim"), where=("below", "past"),
                                                   ks=(1,)))
    from gemmdrift import suite

    seen, side = [], suite.side_by_side
    monkeypatch.setattr(suite, "side_by_side", lambda lm, parts, workers=None: seen.append(list(parts)) or side(lm, parts))
    b = bench_caches.CacheCandidates()
    f = b.setup_cache()
    assert seen == [list(bench_caches.CANDIDATES)]  # the three grids side by side where the model reloads (issue 33)
    # rollback past the window: mlx-lm refuses r=1 (1 case); the draft's rewind past the window: 4 cases.
    assert b.track_non_exact(f, "mlx-lm") == 5.0 and b.track_state_bugs(f, "mlx-lm") == 5.0
    assert b.track_non_exact(f, "overlay") == 0.0
    assert b.track_non_exact(f, "unroll-cut") == 3.0 and b.track_state_bugs(f, "unroll-cut") == 1.0  # + 2 refused: the draft's rewind
    monkeypatch.setenv("GEMMDRIFT_BENCH_LONG", "0")
    with pytest.raises(NotImplementedError):
        c = bench_caches.CacheDecodeCost()
        c.setup(c.setup_cache(), "overlay")


@pytest.mark.parametrize("keep", [0, 2])
def test_the_overlays_reused_view_is_what_the_ring_and_overlay_give(keep):
    """Random updates (T=1..4) and trims (0..3): each view from the reused last view equals the view rebuilt
    from the ring and the overlay alone, bit for bit, and both equal a numpy model of the window."""
    import mlx.core as mx

    from gemmdrift.caches.exact import OverlayRotatingKVCache

    rng = np.random.default_rng(keep)
    fast, slow = OverlayRotatingKVCache(8, keep=keep, reserve=4), OverlayRotatingKVCache(8, keep=keep, reserve=4)
    rows: list[float] = []  # the logical sequence of kept rows
    nxt = 0.0
    for _ in range(80):
        if rows and rng.random() < 0.4:
            n = int(rng.integers(1, 4))
            a, b = fast.trim(n), slow.trim(n)
            assert a == b
            del rows[len(rows) - a:]
            continue
        t = int(rng.integers(1, 5))
        x = mx.array(np.arange(nxt, nxt + t, dtype=np.float32)).reshape(1, 1, t, 1)
        nxt += t
        slow._tail = None  # rebuilt from the ring and the overlay every time
        kf, _ = fast.update_and_fetch(x, x)
        ks, _ = slow.update_and_fetch(x, x)
        past = list(rows) if len(rows) <= 7 else rows[:keep] + rows[len(rows) - (7 - keep):]
        rows += list(np.arange(nxt - t, nxt))
        want = past + rows[len(rows) - t:]
        assert np.array_equal(np.array(kf), np.array(ks))
        assert np.array(kf[0, 0, :, 0]).tolist() == want
        assert fast.offset == slow.offset == len(rows)


def test_the_cost_measurements_see_a_planted_slow_cache():
    import time as _time

    from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

    class Slow(RotatingKVCache):
        delay = 0.002  # 2 ms per update: far above the ring's own cost

        def update_and_fetch(self, k, v):
            _time.sleep(self.delay)
            return super().update_and_fetch(k, v)

    class Slower(Slow):
        delay = 0.01  # a whole decode step: the other test process's load can swing a step by 2x, not 5x

    u = cachebench.update_cost({"ring": lambda: RotatingKVCache(8), "slow": lambda: Slow(8)}, window_rows=12,
                               steps=8, dim=8, repeats=3)
    ring, slow = u.set_index("cache").loc["ring"], u.set_index("cache").loc["slow"]
    assert slow["seconds_per_update"] >= 0.002 > ring["seconds_per_update"] and slow["ratio"] > 1.5
    lm = make_tiny()

    def slow_caches(model):
        return [Slower(c.max_size, c.keep) if type(c) is RotatingKVCache else c for c in make_prompt_cache(model)]

    d = cachebench.decode_cost(lm, list(range(3, 20)), 6, {"own": make_prompt_cache, "slow": slow_caches,
                                                           "same": make_prompt_cache}, repeats=3)
    d = d.set_index("cache")
    assert d.loc["slow", "ratio"] < 0.9 and d.loc["own", "ratio"] == 1.0
    assert bool(d.loc["same", "tokens_equal"]) and d.loc["same", "extra_bytes_per_layer"] == 0.0
    assert d.loc["own", "peak_cache_bytes"] > 0 and d.loc["slow", "tokens_equal"]


def test_cli_state_and_report_on_a_refusing_implementation(tmp_path):
    from test_cli import gd
    from test_models import save_tiny

    from gemmdrift.report import build_report

    save_tiny(tmp_path / "m")
    r = gd("state", "--model", str(tmp_path / "m"), "--cache-impl", f"{PLUGINS}:trim_raises", "--ops", "rollback,trim",
           "--where", "past", "--k", "1", "--out", str(tmp_path / "o"), "--json")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    s = json.loads(r.stdout)
    assert s["verdicts"]["refused"] == 2 + 4 + 4  # rollback k=1 r=0,1; TrimRaises: 4 trims, 4 draft trims
    assert any(row.get("past", "").startswith("refused") for row in s["grid"])
    page = build_report(tmp_path / "o")["markdown"].read_text()
    assert "refused" in page and "RuntimeError: this cache cannot trim" in page


def test_the_server_checkpoint_key_names_the_plug_ins():
    from gemmdrift.measure.server import plugin_key

    assert plugin_key(None) == "" and plugin_key({"cache_impl": None, "rollback": None}) == ""
    a = plugin_key({"cache_impl": "m:f", "rollback": "m:r"})
    assert a == plugin_key({"rollback": "m:r", "cache_impl": "m:f"}) and "m:f" in a and "m:r" in a
    assert a != plugin_key({"cache_impl": "m:f"})
