"""Golden logits and two-run statistics (issue 23): known answers, the base file, and the two commands."""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest

from gemmdrift.measure import golden, twostats
from gemmdrift.errors import GemmdriftError


def views(la, lb, targets, k=None):
    """Views of two full logit arrays: both full (k None), or a top-k base and the other run kept as compare
    keeps it (its own top-k plus its logits at the base's top-k)."""
    n = la.shape[0]
    pos = np.arange(n)
    if k is None:
        return (twostats.view_from_logits(la, pos, targets, 4, full=True),
                twostats.view_from_logits(lb, pos, targets, 4, full=True))
    base = twostats.view_from_logits(la, pos, targets, k)
    return base, twostats.view_from_logits(lb, pos, targets, k, extra_ids=base.ids)


def random_logits(n=12, v=50, seed=0, scale=3.0):
    rng = np.random.default_rng(seed)
    la = (rng.standard_normal((n, v)) * scale).astype(np.float32)
    lb = (la + rng.standard_normal((n, v)).astype(np.float32) * 0.3).astype(np.float32)
    return la, lb, rng.integers(0, v, n)


def np_logsoftmax(x):
    x = x.astype(np.float64)
    m = x.max(axis=1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))


def test_own_base_gives_kld_exactly_zero_and_full_top1():
    la, _, t = random_logits()
    for k in (None, 5):
        base, other = views(la, la, t, k)
        st = twostats.two_run_stats(base, other)
        assert np.all(st["positions"]["kld"] == 0.0)
        s = st["summary"]
        assert s["kld_mean"] == 0.0 and s["kld_max"] == 0.0 and s["dp_rms"] == 0.0 and s["ppl_ratio"] == 1.0
        assert s["same_top1"] == len(t) and s["same_top1_share"] == 1.0 and s["flips"] == 0.0


def test_full_logits_statistics_equal_an_independent_numpy_computation():
    la, lb, t = random_logits(n=20, v=40, seed=3)
    base, other = views(la, lb, t)
    st = twostats.two_run_stats(base, other)
    s, per = st["summary"], st["positions"]
    assert st["kld_exact"] is True
    lp, lq = np_logsoftmax(la), np_logsoftmax(lb)
    kl = (np.exp(lp) * (lp - lq)).sum(axis=1)
    np.testing.assert_allclose(per["kld"], kl, rtol=1e-12, atol=1e-15)
    assert s["kld_mean"] == pytest.approx(kl.mean(), rel=1e-12)
    assert s["kld_se"] == pytest.approx(kl.std(ddof=1) / math.sqrt(len(kl)), rel=1e-10)
    assert s["kld_p99.9"] == pytest.approx(np.percentile(kl, 99.9), rel=1e-10)
    assert s["kld_p1"] == pytest.approx(np.percentile(kl, 1), rel=1e-10)
    rows = np.arange(len(t))
    dp = np.exp(lq[rows, t]) - np.exp(lp[rows, t])
    assert s["dp_mean"] == pytest.approx(dp.mean(), rel=1e-10, abs=1e-15)
    assert s["dp_rms"] == pytest.approx(np.sqrt((dp ** 2).mean()), rel=1e-10)
    assert s["dp_p90"] == pytest.approx(np.percentile(dp, 90), rel=1e-9, abs=1e-15)
    ppl_a, ppl_b = np.exp(-lp[rows, t].mean()), np.exp(-lq[rows, t].mean())
    assert s["ppl_base"] == pytest.approx(ppl_a, rel=1e-10) and s["ppl_ratio"] == pytest.approx(ppl_b / ppl_a, rel=1e-10)
    same = la.argmax(axis=1) == lb.argmax(axis=1)
    assert s["same_top1"] == same.sum() and s["flips"] == (~same).sum()
    order = np.argsort(-la, axis=1, kind="stable")
    t1, t2 = order[:, 0], order[:, 1]
    dgap = (la[rows, t1] - la[rows, t2]).astype(np.float64) - (lb[rows, t1].astype(np.float64) - lb[rows, t2])
    np.testing.assert_allclose(per["dgap"], dgap, rtol=0, atol=1e-12)
    assert s["max_abs_dlogit"] == pytest.approx(np.abs(la.astype(np.float64) - lb).max())


def test_topk_bound_is_never_above_the_exact_kld_and_tight_at_full_k():
    for seed in range(6):
        la, lb, t = random_logits(n=30, v=60, seed=seed, scale=1.0 + seed)
        exact = twostats.two_run_stats(*views(la, lb, t))["positions"]["kld"]
        for k in (1, 2, 8, 32):
            st = twostats.two_run_stats(*views(la, lb, t, k))
            assert st["kld_exact"] is False
            bound = st["positions"]["kld"]
            assert np.all(bound <= exact + 1e-12), (seed, k, (bound - exact).max())
            assert np.all(bound >= -1e-15)
        full_k = twostats.two_run_stats(*views(la, lb, t, 60))["positions"]["kld"]
        np.testing.assert_allclose(full_k, exact, rtol=1e-9, atol=1e-14)


def test_two_topk_files_also_give_a_bound():
    la, lb, t = random_logits(n=25, v=80, seed=9)
    pos = np.arange(len(t))
    exact = twostats.two_run_stats(*views(la, lb, t))["positions"]["kld"]
    base = twostats.view_from_logits(la, pos, t, 10)
    other = twostats.view_from_logits(lb, pos, t, 10)  # top-k only: it does not know all of the base's ids
    st = twostats.two_run_stats(base, other)
    assert np.all(st["positions"]["kld"] <= exact + 1e-12)
    # A full base against a top-k file (the other's ids, listed twice as a live run may): a bound as well.
    full_base = twostats.view_from_logits(la, pos, t, 10, full=True)
    twice = twostats.view_from_logits(lb, pos, t, 10, extra_ids=other.ids)
    bound = twostats.two_run_stats(full_base, twice)["positions"]["kld"]
    assert np.all(bound <= exact + 1e-12) and np.all(bound > 0)


def test_a_planted_shift_at_one_position_shows_there_only():
    la, _, t = random_logits(n=16, v=30, seed=5)
    lb = la.copy()
    lb[7, 3] += 2.5  # one logit of one position
    for k in (None, 30):
        st = twostats.two_run_stats(*views(la, lb, t, k))
        per = st["positions"]
        for name in ("kld", "dp", "max_abs_dlogit"):
            moved = np.flatnonzero(np.abs(per[name]) > 0)
            assert moved.tolist() == [7], (name, moved)
        assert per["max_abs_dlogit"][7] == pytest.approx(2.5, abs=1e-6)


def test_flips_are_judged_against_the_envelope():
    v, n = 20, 10
    la = np.zeros((n, v), np.float32)
    la[:, 0], la[:, 1] = 3.0, 1.0  # top-2 gap 2 everywhere
    lb = la.copy()
    lb[:, 1] += np.linspace(0.0, 0.1, n, dtype=np.float32)  # small Δgap where nothing flips: envelope 0.1
    la[2, 1] = 2.95  # a near-tie (gap 0.05) that flips: within the envelope
    lb[2, 1] = 3.05
    lb[5, 7] = 9.0  # a flip to a third token where the base's gap is 2: outside the envelope
    t = np.zeros(n, np.int64)
    st = twostats.two_run_stats(*views(la, lb, t, 4))
    per = st["positions"]
    assert [(int(p), str(per["verdict"][p])) for p in np.flatnonzero(~per["same_top1"])] == \
        [(2, "NEAR-TIE"), (5, "OUTSIDE ENVELOPE")]
    assert st["summary"]["envelope"] == pytest.approx(0.1, abs=1e-6)
    assert st["summary"]["flips_outside"] == 1 and st["summary"]["flips_near_tie"] == 1
    assert twostats.two_run_stats(*views(la, lb, t, 4), envelope=5.0)["summary"]["flips_outside"] == 0


def test_wilson_interval_matches_a_hand_computed_case():
    # 8 of 10 at 95%: centre (0.8 + 1.9208/10) / 1.38415, half 1.96/1.38415 * sqrt(0.016 + 0.0096)
    lo, hi = twostats.wilson(8, 10)
    assert lo == pytest.approx(0.4902, abs=1e-4) and hi == pytest.approx(0.9433, abs=1e-4)
    lo, hi = twostats.wilson(10, 10)
    assert hi == pytest.approx(1.0, abs=1e-12) and lo == pytest.approx(10 / (10 + 1.959964 ** 2), abs=1e-6)
    assert twostats.wilson(0, 10)[0] == 0.0


def test_one_position_and_no_position():
    la, lb, t = random_logits(n=1, v=10)
    s = twostats.two_run_stats(*views(la, lb, t))["summary"]
    assert "kld_se" not in s and s["positions"] == 1
    with pytest.raises(ValueError, match="no positions"):
        twostats.two_run_stats(*(v.select(np.arange(0)) for v in views(la, lb, t)))


def test_statistics_of_1024_gemma_sized_positions_take_under_5_s():
    """The sizes of a live compare on the real vocabulary: a top-64 base, the other with 128 known ids."""
    rng = np.random.default_rng(0)
    n, v, k = 1024, 262144, 64
    ids = np.stack([rng.choice(v, 2 * k, replace=False) for _ in range(n)])
    vals = -np.sort(-rng.standard_normal((n, 2 * k)), axis=1).astype(np.float32) + 10
    lse = np.full(n, 12.0)
    pos = np.arange(n)
    tg = ids[:, 0]
    base = twostats.LogitView(pos, tg, vals[:, :k], ids[:, :k], k, lse, vals[:, 0], np.zeros(n, np.int64), v)
    other = twostats.LogitView(pos, tg, np.concatenate([vals[:, :k], vals[:, :k]], axis=1),
                               np.concatenate([ids[:, :k], ids[:, :k]], axis=1), k, lse, vals[:, 0],
                               np.zeros(n, np.int64), v)
    t0 = time.perf_counter()
    s = twostats.two_run_stats(base, other)["summary"]
    elapsed = time.perf_counter() - t0
    assert s["kld_max"] == 0.0
    assert elapsed < 5.0, elapsed


# ------------------------------------------------------------------ the base file


@pytest.fixture
def base_file(tiny, tmp_path):
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, tiny.vocab_size, 24).tolist()
    lf = golden.base_from_run(tiny, tokens, "decode", split=None, top_k=8)
    path = tmp_path / "base.npz"
    size = golden.write_logits(path, lf)
    assert size == path.stat().st_size > 0
    return tiny, tokens, lf, path


def test_base_file_round_trips_and_a_run_against_it_is_exact(base_file):
    lm, tokens, lf, path = base_file
    back = golden.read_logits(path)
    assert back.header["token_digest"] == golden.token_digest(tokens)
    np.testing.assert_array_equal(back.view.ids, lf.view.ids[:, :8])
    np.testing.assert_array_equal(back.view.values, lf.view.values[:, :8])
    np.testing.assert_array_equal(back.view.lse, lf.view.lse)
    view, _ = golden.run_view(lm, tokens, "decode", split=None, top_k=8, extra_ids=back.view.ids)
    other = golden.LogitFile(header=lf.header, tokens=back.tokens, view=view)
    r = golden.compare_result(back, other)
    assert r.figures["kld_max"] == 0.0 and r.figures["same_top1_share"] == 1.0 and r.figures["kld_exact"] == 0.0
    assert "lower bound" in r.details["kld"]


def test_full_base_file_gives_the_exact_kld(tiny, tmp_path):
    tokens = list(range(3, 19))
    lf = golden.base_from_run(tiny, tokens, "decode", split=None, top_k=4, full=True)
    golden.write_logits(tmp_path / "full.npz", lf)
    back = golden.read_logits(tmp_path / "full.npz")
    assert back.view.full and back.view.values.shape == (15, tiny.vocab_size)
    view, _ = golden.run_view(tiny, tokens, "verify:2", split=None, top_k=4, full=True)
    r = golden.compare_result(back, golden.LogitFile(header=lf.header, tokens=back.tokens, view=view))
    assert r.figures["kld_exact"] == 1.0 and "exact" in r.details["kld"]


@pytest.mark.parametrize("damage,needle", [
    ("missing", "no such base file"),
    ("truncated", "truncated or not a gemmdrift logits file"),
    ("foreign", "not a gemmdrift logits file"),
    ("digest", "do not match its token digest"),
])
def test_a_damaged_base_file_is_refused_in_one_line(base_file, tmp_path, damage, needle):
    _, _, _, path = base_file
    bad = tmp_path / "bad.npz"
    if damage == "truncated":
        bad.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif damage == "foreign":
        np.savez(bad, x=np.zeros(3))
    elif damage == "digest":
        with np.load(path) as z:
            arrays = {k: z[k] for k in z.files}
        arrays["tokens"] = arrays["tokens"].copy()
        arrays["tokens"][3] += 1
        np.savez(bad, **arrays)
    with pytest.raises(GemmdriftError, match=needle):
        golden.read_logits(bad)


def test_foreign_streams_models_and_tokenizers_are_refused(base_file):
    _, _, lf, _ = base_file
    h = lf.header
    with pytest.raises(GemmdriftError, match="token stream differs"):
        golden.check_pair(h, {**h, "token_digest": "0" * 64})
    with pytest.raises(GemmdriftError, match="another tokenizer"):
        golden.check_pair(h, {**h, "vocab_size": h["vocab_size"] + 1})
    with pytest.raises(GemmdriftError, match="another tokenizer"):
        golden.check_pair({**h, "tokenizer_digest": "a"}, {**h, "tokenizer_digest": "b"})
    q4 = {**h, "model": {**h["model"], "quantization": {"bits": 4, "group_size": 64}}}
    with pytest.raises(GemmdriftError, match="--allow-other-model"):
        golden.check_pair(h, q4)
    golden.check_pair(h, q4, allow_other_model=True)
    golden.check_pair(h, {**h, "dtype": "float32"})  # another compute dtype: a comparison of runs, allowed


# ------------------------------------------------------------------ the commands, on the tiny model saved as a checkpoint


from test_cli import assert_user_error, gd, gd_here  # noqa: E402  (the CLI helpers every command test uses)


@pytest.fixture
def tiny_dir(tiny, tmp_path):
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from conftest import TINY_CONFIG

    d = tmp_path / "tiny"
    d.mkdir()
    mx.save_safetensors(str(d / "model.safetensors"), dict(tree_flatten(tiny.model.parameters())))
    (d / "config.json").write_text(json.dumps(TINY_CONFIG))
    ids = tmp_path / "ids.txt"
    ids.write_text(" ".join(str(i) for i in np.random.default_rng(2).integers(0, 97, 30)))
    return d, ids


def test_logits_then_compare_on_the_command_line(tiny_dir, tmp_path, monkeypatch, capsys):
    # In this process (test_cli.gd_here: stdout as the command prints it, exit status, stderr); each command in a
    # process of its own cost 1-2 s of imports and a model load (test_compare_golden_on_the_command_line runs one).
    def gd(*args):
        return gd_here(monkeypatch, capsys, *args)

    d, ids = tiny_dir
    base = tmp_path / "b.npz"
    r = gd("logits", "--model", str(d), "--prompt-ids", str(ids), "--schedule", "decode", "--top-k", "5",
           "--out", str(base))
    assert r.returncode == 0, r.stderr
    assert f"{base.stat().st_size:,} bytes" in r.stdout and "29 positions" in r.stdout
    out = tmp_path / "cmp"
    r = gd("compare", "--base", str(base), "--model", str(d), "--schedule", "verify:2", "--out", str(out), "--json",
           "--save", str(tmp_path / "other.npz"))
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["figures"]["positions"] == 29 and "base" in s and "other" in s
    from gemmdrift.store import read_result

    res = read_result(out)
    assert res.kind == "compare" and len(res.tables["positions"]) == 29
    r = gd("compare", "--base", str(base), "--other", str(tmp_path / "other.npz"), "--out", str(tmp_path / "c2"))
    assert r.returncode == 0, r.stderr
    said = [line for line in r.stdout.splitlines() if line.startswith(("KLD", "Δp", "perplexity", "same top-1",
                                                                       "argmax flips", "max|Δlogit|"))]
    assert len(said) == 6 and all("base" in line and "other" in line for line in said), said
    assert "lower bound" in r.stdout
    from gemmdrift.report import build_report

    page = build_report(tmp_path / "c2")["markdown"].read_text()
    assert "Two runs compared" in page and "compare.png" in page and "KLD(base ‖ other)" in page
    # The base against itself: exactly zero.
    r = gd("compare", "--base", str(base), "--other", str(base), "--out", str(tmp_path / "c3"), "--json")
    f = json.loads(r.stdout)["figures"]
    assert f["kld_max"] == 0.0 and f["same_top1_share"] == 1.0


def test_bad_input_of_logits_and_compare(tiny_dir, tmp_path, monkeypatch, capsys):
    # In this process (test_cli.gd_here): each refusal in a process of its own cost 1-2 s of imports.
    def gd(*args):
        return gd_here(monkeypatch, capsys, *args)

    d, ids = tiny_dir
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert_user_error(gd("logits", "--model", str(d), "--prompt-ids", str(ids), "--top-k", "0"), "--top-k")
    assert_user_error(gd("logits", "--model", str(d), "--prompt-ids", str(ids), "--top-k", "98",
                         "--out", str(tmp_path / "x.npz")), "vocabulary size 97")
    assert_user_error(gd("logits", "--model", str(d), "--prompt-ids", str(empty)), "no token ids")
    assert_user_error(gd("compare", "--base", str(tmp_path / "none.npz")), "no such base file")
    trunc = tmp_path / "t.npz"
    trunc.write_bytes(b"PK\x03\x04 not really")
    assert_user_error(gd("compare", "--base", str(trunc)), "truncated")
    assert_user_error(gd("compare"), "give one of --base FILE and --golden NAME")
    assert_user_error(gd("compare", "--golden", "no-such-machine"), "no shipped base set")
    base = tmp_path / "b.npz"
    assert gd("logits", "--model", str(d), "--prompt-ids", str(ids), "--schedule", "decode", "--top-k", "4",
              "--out", str(base)).returncode == 0
    other_ids = tmp_path / "ids2.txt"
    other_ids.write_text("1 2 3 4 5 6 7 8")
    assert_user_error(gd("compare", "--base", str(base), "--model", str(d), "--prompt-ids", str(other_ids),
                         "--out", str(tmp_path / "c")), "token stream differs")


@pytest.mark.slow
def test_this_machine_against_the_shipped_linux_cpu_base(embedded):
    """The shipped base was computed here (mlx 0.32.4, Linux CPU): a prefix of it reproduces bit for bit."""
    base = golden.prefix(golden.read_logits(golden.resolve_golden("linux-cpu")), 12)  # 11 positions: ~0.3 s each
    lm = embedded  # the session's load_model("embedded") (bfloat16, load_model's default): one load less
    here = golden.header_for(lm, base.tokens.tolist(), base.header["schedule"], None, 64, False, "", 0.0, None)
    golden.check_pair(base.header, here)
    view, _ = golden.run_view(lm, base.tokens.tolist(), base.header["schedule"], split=None, top_k=64,
                              extra_ids=base.view.ids)
    r = golden.compare_result(base, golden.LogitFile(header=here, tokens=base.tokens, view=view))
    if r.env.get("mlx") == base.header["env"]["mlx"] and r.env.get("backend") == base.header["env"].get("backend"):
        assert r.figures["kld_max"] == 0.0 and r.figures["same_top1_share"] == 1.0
    assert r.figures["positions"] == 11


def test_stack_gets_the_two_run_figures_from_the_same_function():
    """stack's logit comparison adds KLD, same top-1, Δp and the perplexity ratio; its own figures stay."""
    from conftest import make_tiny

    from gemmdrift.measure.stack import ENVELOPE_FIGURES, measure_stack

    lm = make_tiny("float32")
    tokens = [int(t) for t in np.random.default_rng(4).integers(0, 97, 24)]
    taps = {}
    r = measure_stack(lm, tokens, ["prefill:4,decode", "prefill:4,verify:2"], split=4, keep_taps=taps, local=False)
    pair = "prefill:4,decode vs prefill:4,verify:2"
    for k in ENVELOPE_FIGURES[:3]:
        assert f"{k}/{pair}" in r.figures
    ref = taps[("prefill:4,decode", "reference", "float32")] if ("prefill:4,decode", "reference", "float32") in taps \
        else taps[("prefill:4,decode", "accumulated", "float32")]
    other = taps[("prefill:4,verify:2", "accumulated", "float32")]
    keep = other.logit_positions + 1 < len(tokens)
    la = ref.logits[ref.logit_rows(other.logit_positions)][keep]
    lb = other.logits[keep]
    t = np.asarray(tokens)[other.logit_positions[keep] + 1]
    lp, lq = np_logsoftmax(la), np_logsoftmax(lb)
    kl = (np.exp(lp) * (lp - lq)).sum(axis=1)
    assert kl.max() > 0  # past the window the schedules differ
    assert r.figures[f"kld_mean/{pair}"] == pytest.approx(kl.mean(), rel=1e-9)
    assert r.figures[f"kld_p99.9/{pair}"] == pytest.approx(np.percentile(kl, 99.9), rel=1e-9)
    assert r.figures[f"same_top1_share/{pair}"] == pytest.approx(np.mean(la.argmax(1) == lb.argmax(1)))
    rows = np.arange(len(t))
    assert r.figures[f"ppl_ratio/{pair}"] == pytest.approx(np.exp(lp[rows, t].mean() - lq[rows, t].mean()), rel=1e-9)


def test_a_long_block_is_reduced_in_chunks_to_the_same_view(monkeypatch):
    la, _, t = random_logits(n=10, v=30, seed=8)
    whole = twostats.view_from_logits(la, np.arange(10), t, 5, extra_ids=np.tile(np.arange(3), (10, 1)))
    monkeypatch.setattr(twostats, "VIEW_CHUNK", 3)
    chunked = twostats.view_from_logits(la, np.arange(10), t, 5, extra_ids=np.tile(np.arange(3), (10, 1)))
    for name in ("positions", "targets", "values", "ids", "lse", "target_logit", "target_rank"):
        np.testing.assert_array_equal(getattr(chunked, name), getattr(whole, name))


@pytest.mark.slow
def test_compare_golden_on_the_command_line(tmp_path):
    r = gd("compare", "--golden", "linux-cpu", "--tokens", "8", "--json", "--out", str(tmp_path / "c"))
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["figures"]["positions"] == 7 and s["base"]["schedule"] == "decode"
    assert s["other"]["path"] == "(this run)" and s["base"]["path"].endswith("linux-cpu/decode.npz")


def test_a_prefill_block_handed_to_the_sink_in_slices_gives_the_same_view(tiny, monkeypatch):
    from gemmdrift.model import taps

    tokens = [int(t) for t in np.random.default_rng(6).integers(0, 97, 20)]
    whole, _ = golden.run_view(tiny, tokens, "prefill:16", split=None, top_k=6)
    monkeypatch.setattr(taps, "SINK_ROWS", 5)
    sliced, _ = golden.run_view(tiny, tokens, "prefill:16", split=None, top_k=6)
    for name in ("positions", "targets", "values", "ids", "lse", "target_logit", "target_rank"):
        np.testing.assert_array_equal(getattr(sliced, name), getattr(whole, name))


def test_kernels_replay_cpu_logits_equal_this_machines_and_say_so(tiny_dir, tmp_path, monkeypatch, capsys):
    """`--kernels replay:cpu` (this CPU's own orders, replayed) gives the native base bit for bit, labelled as
    replayed; a compare of it against the native base is exact; bad or meaningless --kernels is refused."""
    def gd(*args):  # in this process, as test_logits_then_compare_on_the_command_line
        return gd_here(monkeypatch, capsys, *args)

    d, ids = tiny_dir
    native, replayed = tmp_path / "native.npz", tmp_path / "replayed.npz"
    for out, extra in ((native, []), (replayed, ["--kernels", "replay:cpu"])):
        r = gd("logits", "--model", str(d), "--prompt-ids", str(ids), "--schedule", "decode", "--top-k", "8",
               "--out", str(out), *extra)
        assert r.returncode == 0, r.stderr
    a, b = golden.read_logits(native), golden.read_logits(replayed)
    assert a.header["kernels"] == "native" and b.header["kernels"] == "replay:cpu" and "replay" in b.header
    assert np.array_equal(a.view.ids, b.view.ids) and np.array_equal(a.view.values, b.view.values)
    assert np.array_equal(a.view.lse, b.view.lse)
    r = gd("compare", "--base", str(native), "--model", str(d), "--kernels", "replay:cpu", "--json",
           "--out", str(tmp_path / "c"))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["figures"]["kld_mean"] == 0
    assert_user_error(gd("compare", "--base", str(native), "--other", str(replayed), "--kernels", "replay:cpu"),
                      "--kernels")
    assert_user_error(gd("logits", "--model", str(d), "--kernels", "replay:M99", "--out", str(tmp_path / "x.npz")),
                      "M99")
