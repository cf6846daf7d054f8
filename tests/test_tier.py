"""The tracking tier (gemmdrift.history.tier, benchmarks/bench_tier.py) and the history command (gemmdrift.history.releases).

Small on purpose: the edge figures on planted per-position tables (known answers), every tier benchmark reading the
figure its part computes (planted figures, and one run of every part on the tiny model), the opt-in main-job
benchmarks skipped (never 0) unless asked, the matrix (both platforms list the same releases, each mlx-lm compatible),
and the history command's resume and refusals.
"""

import inspect
import json
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import bench_tier, common  # noqa: E402
from gemmdrift.history import releases as history_run, tier as tracking  # noqa: E402
from gemmdrift.errors import GemmdriftError  # noqa: E402


def _pp(drift, flips=(), start=508):
    pos = np.arange(start, start + len(drift))
    return pd.DataFrame({"position": pos, "max_abs_dlogit": drift, "flip": np.isin(pos, flips)})


def test_edge_figures_known_answers():
    # bit-identical through 512, drifting from 513 (the decode pair on the Linux CPU)
    f = tracking.edge_figures(_pp([0, 0, 0, 0, 0, 0.25, 0.5, 0.125, 0.375]), 512)
    assert (f["identical_through"], f["first_drift"]) == (512.0, 513.0)
    assert (f["max_abs_dlogit_upto_edge"], f["max_abs_dlogit_past_edge"]) == (0.0, 0.5)
    assert (f["flips_upto_edge"], f["flips_past_edge"]) == (0.0, 0.0)
    # flips past 256 only (the prefill pair on mlx 0.29.x), rows in any order
    f = tracking.edge_figures(_pp([0, 0, 0, 3.0, 12.0], flips=(259, 260), start=256).iloc[::-1], 256)
    assert (f["identical_through"], f["first_drift"], f["flips_upto_edge"], f["flips_past_edge"]) == (258, 259, 0, 2)
    # never drifting: identical through the last compared position, no first drift (NaN, not 0)
    f = tracking.edge_figures(_pp([0.0] * 9), 512)
    assert f["identical_through"] == 516.0 and math.isnan(f["first_drift"])
    # drifting from the first compared position: identical through the one before it
    assert tracking.edge_figures(_pp([1.0, 0, 0]), 512)["identical_through"] == 507.0


def _tier_tracks():
    """(class, method name, params) of every tier track_."""
    out = []
    for name, cls in vars(bench_tier).items():
        if inspect.isclass(cls) and name.startswith("Tier"):
            for m in dir(cls):
                if m.startswith("track_"):
                    out.append((cls, m))
    return out


def test_the_tier_benchmarks_mirror_the_librarys_tier():
    t = tracking.TIER
    assert bench_tier.KERNEL_PATHS == t["kernel_paths"] and bench_tier.KERNEL_TS == t["kernel_ts"]
    assert bench_tier.FP_PATHS == t["fp_paths"]
    assert bench_tier.DECODE_PAIR == " vs ".join(t["decode_schedules"])
    assert bench_tier.PREFILL_PAIR == " vs ".join(t["prefill_schedules"])
    assert tracking.WINDOW_EDGE in t["decode_logits"] and tracking.WINDOW_EDGE + 1 in t["decode_logits"]
    assert tracking.ROPE_EDGE in t["prefill_logits"] and tracking.ROPE_EDGE + 1 in t["prefill_logits"]
    for cls, m in _tier_tracks():
        fn = getattr(cls, m)
        assert fn.unit and fn.version, f"{cls.__name__}.{m}"


@pytest.mark.slow
def test_every_tier_part_runs_and_every_benchmark_reads_its_figure(embedded, tiny):
    """Every part on the embedded Gemma at tiny sizes: each tier track_ returns the part's figure (planted lookups
    would not catch a misspelt name)."""
    small = dict(decode_tokens=24, decode_split=16, decode_logits=(17, 18, 19), prefill_tokens=24,
                 prefill_positions=(12, 24), prefill_logits=(14, 15, 16, 17), prefill_schedules=("prefill:2048",
                                                                                               "prefill:8"),
                 state_operations=("rollback", "trim"), state_where=("past",), state_ks=(1,), diverge_prompt=12, diverge_n=4, kernel_layers=(0,),
                 kernel_ts=(1, 2), kernel_rows=2, fp_paths=("matmul:float32",), fp_k=16, fp_ts=(1, 2), fp_n=8,
                 ops=dict(ops=["rope"], query_lengths=[1, 2], key_lengths=[8]))
    # in this process, part by part (tracking.measure_tier's side by side is tested with planted parts below); the
    # parts that need no tokenizer on the tiny model (its window is 8: the state sweep's prefixes stay short)
    f = {p: dict(tracking.run_part(tiny if p in ("state", "ops") else embedded, p, small).figures)
         for p in tracking.PARTS if p != "golden"}
    f["golden"] = {}
    assert f["golden"] == {}  # not run: its benchmarks are skipped (NaN)
    assert math.isnan(bench_tier.TierGolden().track_kld_mean(f))
    assert bench_tier.TierDecodeVsVerify().track_ladder_verdict(f) in (0.0, 1.0)
    assert bench_tier.TierDecodeVsVerify().track_identical_through(f) >= 16
    assert bench_tier.TierPrefillChunks().track_flips_upto_256(f) == f["prefill"]["flips_upto_edge"] == 0
    assert math.isnan(bench_tier.TierPrefillChunks().track_flips_past_256(f))  # nothing compared past 256: NaN
    assert bench_tier.TierState().track_state_bugs(f) == f["state"]["state_bugs"]
    assert bench_tier.TierState().track_cases(f) > 0
    assert bench_tier.TierDivergence().track_first_divergence(f) == f["diverge"]["first_divergence"]
    assert bench_tier.TierKernelDrift().track_bits_lost(f, "emulated:splitk4", 2) > 0  # the negative control
    assert bench_tier.TierKernelDrift().track_bits_lost(f, "model", 2) == 0.0  # row-invariant CPU
    assert bench_tier.TierFingerprint().track_distinct_trees(f, "matmul:float32") >= 1
    assert bench_tier.TierOps().track_bits_lost(f, "rope") >= 0


def test_the_main_job_benchmarks_are_opt_in_and_skipped_not_zero(monkeypatch):
    from benchmarks import bench_kernels, bench_stack

    monkeypatch.delenv("GEMMDRIFT_BENCH_FULL", raising=False)
    cache = bench_stack.DecodeVsVerify().setup_cache()  # returns at once: nothing is measured
    assert cache == common.skipped_full()
    with pytest.raises(NotImplementedError):  # asv records NotImplementedError in setup as skipped
        bench_stack.DecodeVsVerify().setup(cache, "verify2")
    with pytest.raises(NotImplementedError):
        bench_kernels.KernelSpeed().setup(bench_kernels.KernelSpeed().setup_cache(), "model", 1)
    monkeypatch.setenv("GEMMDRIFT_BENCH_FULL", "1")
    bench_stack.DecodeVsVerify().setup({"decode": {}}, "verify2")  # asked for: runs


def test_both_platforms_list_the_same_releases_and_each_mlx_lm_fits_its_mlx():
    conf = json.loads((ROOT / "asv.conf.json").read_text())
    linux, darwin = history_run.releases(conf, "linux"), history_run.releases(conf, "darwin")
    assert linux == darwin and len(linux) == len(set(linux))
    mlx = {m for m, _ in linux}
    assert mlx >= {"0.26.5", "0.27.1", "0.28.0", "0.29.0", "0.29.1", "0.29.2", "0.29.3", "0.29.4", "0.30.0",
                   "0.30.1", "0.30.3", "0.30.4", "0.30.5", "0.30.6", "0.31.0", "0.31.1", "0.31.2", "0.32.0",
                   "0.32.1", "0.32.2", "0.32.3", "0.32.4"}
    # the mlx-lm axis: the last patch of each minor with mlx 0.32.4
    assert {lm for m, lm in linux if m == "0.32.4"} >= {"0.26.4", "0.27.1", "0.28.4", "0.29.1", "0.30.7", "0.31.3",
                                                         "0.32.2"}
    # each mlx-lm's own requirement on mlx (its wheel's metadata), read 2026-12-06
    needs = {"0.26.4": "0.26.0", "0.27.1": "0.29.0", "0.28.0": "0.29.1", "0.28.4": "0.29.2", "0.29.1": "0.29.2",
             "0.30.2": "0.29.2", "0.30.5": "0.30.3", "0.30.7": "0.30.4", "0.31.2": "0.30.4", "0.31.3": "0.31.2",
             "0.32.2": "0.32.2"}
    key = history_run_version_key
    for m, lm in linux:
        assert key(m) >= key(needs[lm]), (m, lm)
    for inc in conf["include"]:
        if inc["sys_platform"] == "linux":
            assert inc["req"]["mlx-cpu"] == inc["req"]["mlx"]


def history_run_version_key(v):
    return tuple(int(x) for x in v.split("."))


def _fake_repo(tmp_path, entries):
    conf = {"include": [{"sys_platform": "linux", "req": {"mlx": m, "mlx-cpu": m, "mlx-lm": lm}} for m, lm in entries]}
    (tmp_path / "asv.conf.json").write_text(json.dumps(conf))
    return tmp_path


def test_the_history_run_resumes_records_failures_and_keeps_one_commit(tmp_path, monkeypatch, capsys):
    root = _fake_repo(tmp_path, [("0.29.4", "0.30.2"), ("0.32.4", "0.32.2")])
    results = tmp_path / "results"
    status = results / "m.status.json"
    monkeypatch.setattr(history_run, "_git", lambda r, *a: "c" * 40 if a[0] == "rev-parse" else "")
    monkeypatch.setattr(history_run, "prepare", lambda *a: (tmp_path, tmp_path / "g.whl"))
    monkeypatch.setattr(history_run, "_run", lambda *a, **k: None)
    built = []

    def build(uv, where, req, wheel):
        built.append(req["mlx"])
        if req["mlx"] == "0.29.4":
            raise GemmdriftError("No solution found when resolving dependencies")

    monkeypatch.setattr(history_run, "build_env", build)
    monkeypatch.setattr(history_run.shutil, "which", lambda *a, **k: "/bin/uv")

    def asv_run(cmd, cwd, env, log):
        out = Path(cwd) / ".asv" / "results" / "m"
        out.mkdir(parents=True, exist_ok=True)
        python = str(cmd[cmd.index("--environment") + 1]).split(":", 1)[1]
        (out / f"cccccccc-existing-py{python.replace('/', '_')}.json").write_text("{}")
        (out / "machine.json").write_text("{}")
        (Path(cwd) / ".asv" / "results" / "benchmarks.json").write_text(json.dumps({"bench_tier.X.track_y": {}}))
        Path(log).write_text("")
        return 0

    monkeypatch.setattr(history_run, "run_asv", asv_run)
    monkeypatch.setenv("GEMMDRIFT_CACHE", str(tmp_path / "cache"))
    (results).mkdir()
    (results / "benchmarks.json").write_text(json.dumps({"bench_stack.Old.track_z": {"unit": "x"}}))
    s = history_run.run_history(root, machine="m", results=results)
    assert s["envs"]["mlx0.29.4-lm0.30.2"]["state"] == history_run.NOT_INSTALLABLE
    assert "No solution" in s["envs"]["mlx0.29.4-lm0.30.2"]["reason"]
    assert s["envs"]["mlx0.32.4-lm0.32.2"]["state"] == history_run.DONE  # the run went on
    assert "not installable: No solution" in capsys.readouterr().err
    assert len(list((results / "m").glob("cccccccc-*.json"))) == 1
    assert set(json.loads((results / "benchmarks.json").read_text())) == {"bench_stack.Old.track_z",
                                                                         "bench_tier.X.track_y"}
    built.clear()
    history_run.run_history(root, machine="m", results=results)  # resumed: nothing runs again
    assert built == []
    # another commit for the same history: refused, naming the recorded one
    monkeypatch.setattr(history_run, "_git", lambda r, *a: "d" * 40)
    with pytest.raises(GemmdriftError, match="cccccccc"):
        history_run.run_history(root, machine="m", results=results)
    with pytest.raises(GemmdriftError, match="no such entry"):
        history_run.run_history(root, machine="m", results=results, only=["mlx9.9.9-lm0.1.0"])
    assert json.loads(status.read_text())["commit"] == "c" * 40


def test_a_part_that_cannot_run_on_a_release_is_recorded_not_raised(monkeypatch, capsys):
    """An old mlx or mlx-lm lacking what a part needs: that part's figures are NaN (skipped), the others go on."""
    def lacks(lm, tier):
        raise AttributeError("module 'mlx_lm.models.cache' has no attribute 'BatchKVCache'")

    monkeypatch.setitem(tracking.FUNCTIONS, "state", lacks)
    out = tracking.run_part(None, "state")
    assert out == {"cannot_run": "AttributeError: module 'mlx_lm.models.cache' has no attribute 'BatchKVCache'"}
    assert "part state cannot run here" in capsys.readouterr().err
    monkeypatch.setattr(tracking.suite, "side_by_side", lambda lm, parts, workers=None: {
        p: tracking.run_part(lm, **kw) for p, (fn, kw) in parts.items()})
    monkeypatch.setitem(tracking.FUNCTIONS, "ops", lambda lm, tier: type("R", (), {"figures": {"ops_bits_lost/rope": 0.0}})())
    f = tracking.measure_tier(None, only=("state", "ops"))
    assert f["state"] == {} and f["ops"] == {"ops_bits_lost/rope": 0.0}
    assert math.isnan(bench_tier.TierState().track_state_bugs(f)) and bench_tier.TierOps().track_bits_lost(f, "rope") == 0


def test_the_compat_reducer_carries_bfloat16_arrays_exactly():
    """machine.compat's reducer (installed where an old mlx cannot pickle bfloat16): the same values and dtype back."""
    import pickle

    import mlx.core as mx

    from gemmdrift.machine import compat

    a = mx.array([1.5, -2.0, 3.140625, 65280.0], dtype=mx.bfloat16)
    fn, args = compat._reduce(a)
    b = fn(*args)
    assert b.dtype == mx.bfloat16 and mx.array_equal(a, b).item()
    fn, args = compat._reduce(mx.array([1, 2], dtype=mx.int32))
    assert fn(*args).dtype == mx.int32
    assert compat.install() is False or pickle.loads(pickle.dumps(a)).dtype == mx.bfloat16


TIER_RESULTS = ROOT / "benchmarks" / "reference"


def _tier_values():
    """{(mlx, mlx-lm, benchmark, params): value} of the shipped tier results (machine reference-linux-cpu-tier), the
    bridges' (benchmarks/reference/bridges) among them."""
    from gemmdrift.measure.history import read_results

    out = {}
    for d in (TIER_RESULTS, TIER_RESULTS / history_run.BRIDGES):
        if (d / history_run.MACHINE).is_dir():
            df = read_results(d)
            df = df[df["machine"] == history_run.MACHINE]
            out.update({(r.mlx, r.mlx_lm, r.benchmark, r.params): r.value for r in df.itertuples()})
    return out


def test_the_shipped_tier_results_show_every_known_effect():
    """The known answers, in the history's own results: every release measured so far (the history resumes)."""
    v = _tier_values()
    if not v:
        pytest.skip("no tier results shipped yet")
    releases = {(m, lm) for m, lm, _, _ in v}
    key = history_run_version_key
    for m, lm in releases:
        def get(bench, params=""):
            return v.get((m, lm, f"bench_tier.{bench}", params))

        if get("TierDecodeVsVerify.track_identical_through") is not None:
            if key(m) >= (0, 30, 0):  # bit-identical through the window's edge, drifting from 513
                assert get("TierDecodeVsVerify.track_identical_through") == 512, (m, lm)
                assert get("TierDecodeVsVerify.track_first_drift") == 513, (m, lm)
            else:  # RoPE positions in bf16 (past 256) part decode from verify before the edge (508: 0.29.4)
                assert get("TierDecodeVsVerify.track_first_drift") < 513, (m, lm)
            assert get("TierDecodeVsVerify.track_ladder_verdict") == 1, (m, lm)  # rounding
        flips = get("TierPrefillChunks.track_flips_past_256")
        if flips is not None:
            assert get("TierPrefillChunks.track_flips_upto_256") == 0
            assert (flips > 0) == (key(m) < (0, 30, 0)), (m, lm, flips)  # RoPE positions in bf16 before 0.30.0
        rope = get("TierOps.track_bits_lost", "rope")
        if rope is not None:
            assert (rope > 0) == (key(m) < (0, 30, 0)), (m, lm, rope)
        if (m, lm) == ("0.32.4", "0.32.2") and get("TierGolden.track_kld_mean") is not None:
            assert get("TierGolden.track_kld_mean") == 0 and get("TierGolden.track_same_top1") == 1  # made the base
        if get("TierDivergence.track_diverged") == 1:
            assert get("TierDivergence.track_first_near_tie") in (0, 1)


def test_the_shipped_history_is_every_linux_entry_at_one_commit():
    """The whole history (issue 47): every Linux entry of asv.conf.json measured, none skipped or failed, every
    result file at the status file's one gemmdrift commit, and every part of the tier run on every release."""
    status_path = TIER_RESULTS / f"{history_run.MACHINE}.status.json"
    if not status_path.is_file():
        pytest.skip("no tier history shipped yet")
    status = json.loads(status_path.read_text())
    conf = json.loads((ROOT / "asv.conf.json").read_text())
    bridges = {lab for lab, _ in history_run.bridges(conf, "linux")}  # apart, in bridges/ (the next test)
    labels = [lab for lab, _ in history_run.entries(conf, "linux") if lab not in bridges]
    assert len(labels) == 29 and set(status["envs"]) == set(labels)
    assert all(e["state"] == history_run.DONE and not e.get("parts_not_run") for e in status["envs"].values())
    files = sorted((TIER_RESULTS / history_run.MACHINE).glob("*-existing-*.json"))
    assert len(files) == 29
    assert {json.loads(f.read_text())["commit_hash"] for f in files} == {status["commit"]}


def test_the_compat_attention_mask_is_mlx_lms_rule():
    """machine.compat's mask for mlx-lm releases without cache.create_attention_mask: the same as that function."""
    import mlx.core as mx
    from mlx_lm.models.cache import create_attention_mask

    from gemmdrift.machine import compat

    for n, offset, arr, win in [(1, 5, False, None), (3, 5, False, None), (3, 5, True, None), (2, 9, False, 4),
                                (1, 0, True, None), (4, 0, True, 8)]:
        want, got = create_attention_mask(n, offset, return_array=arr, window_size=win), compat._attention_mask(
            n, offset, arr, win)
        if isinstance(want, mx.array):
            assert isinstance(got, mx.array) and mx.array_equal(want, got).item(), (n, offset, arr, win)
        else:
            assert got == want, (n, offset, arr, win)


def test_the_history_records_the_parts_a_release_cannot_run():
    log = ("[14%] Setting up bench_tier:40\\r\\ngemmdrift: 8 measurements\\n"
           "gemmdrift tier: part ops cannot run here: ImportError: cannot import name 'x'\\n"
           "gemmdrift tier: part state cannot run here: AttributeError: no BatchKVCache\\n")
    assert history_run.parts_not_run(log.encode().decode("unicode_escape")) == {
        "ops": "ImportError: cannot import name 'x'", "state": "AttributeError: no BatchKVCache"}
    assert history_run.parts_not_run("gemmdrift: decode done in 3.0 s") == {}


def test_the_shipped_tier_results_pairwise_known_answers():
    """From the issue's known answers: the CPU's numerics do not move from mlx 0.30.6 through 0.31.2 to 0.32.4 (every
    tier figure but mlx-lm's cache-state ones identical), and mlx-lm 0.30.2 -> 0.31.3 with mlx 0.32.4 changes the
    state verdicts."""
    v = _tier_values()
    have = {(m, lm) for m, lm, _, _ in v}
    line = [("0.30.6", "0.31.2"), ("0.31.2", "0.31.3"), ("0.32.4", "0.32.2")]
    if not set(line) <= have:
        pytest.skip("the shipped tier results do not hold mlx 0.30.6, 0.31.2 and 0.32.4 yet")
    series = {(b, p) for _, _, b, p in v if b.startswith("bench_tier.") and "TierState" not in b}
    for b, p in series:
        vals = {v.get((m, lm, b, p)) for m, lm in line}
        vals = {None if x is None or x != x else x for x in vals}  # NaN (skipped, e.g. no drift) is None
        assert len(vals) == 1, (b, p, vals)
    axis = [("0.32.4", "0.30.2"), ("0.32.4", "0.31.3")]
    if set(axis) <= have:
        bugs = [v[(m, lm, "bench_tier.TierState.track_state_bugs", "")] for m, lm in axis]
        assert bugs[0] != bugs[1]
