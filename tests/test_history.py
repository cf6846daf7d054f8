"""The asv results reader, the by-version history and the gate, on a results tree written here."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from gemmdrift.measure import history
from gemmdrift.errors import GemmdriftError

COLUMNS = ["result", "params", "version", "started_at", "duration", "stats_ci_99_a", "stats_ci_99_b", "stats_q_25",
           "stats_q_75", "stats_number", "stats_repeat", "samples", "profile"]
BENCH_ENV = "bench_env"


def entry(value, params=()):
    """An asv 0.6 result entry: the value list first (one value when unparameterized)."""
    values = value if isinstance(value, list) else [value]
    return [values, [list(p) for p in params], "v1", 0, 0.1] + [None] * 8


def write_result(root, machine, commit, mlx, date, dlogit, layers, accept, pinned=None, extra=None, lm="x"):
    d = root / machine
    d.mkdir(parents=True, exist_ok=True)
    (d / "machine.json").write_text(json.dumps({"machine": machine, "version": 1}))
    results = {
        "bench_env.track_mlx_version": entry(history.encode_version(mlx)),
        "bench_env.track_backend": entry(0.0),
        "bench_stack.DecodeVsVerify.track_max_abs_dlogit": entry([dlogit[0], dlogit[1]], [["'verify2'", "'verify3'"]]),
        "bench_stack.DecodeVsVerifyLayers.track_rel_l2": entry(layers, [["'verify2'"], ["'layer 0'", "'layer 1'"]]),
        "bench_diverge.Divergence.track_self_draft_acceptance": entry(accept),
        "bench_kernels.KernelDrift.track_bits_lost": entry([0.0, float("nan")], [["'model'"], ["1", "2"]]),
        **(extra or {}),
    }
    env = f"env-{mlx}" + (f"-lm{lm}" if lm != "x" else "")
    doc = {"commit_hash": commit * 5, "env_name": env, "date": date,
           "params": {"machine": machine}, "python": "3.11",
           "requirements": {"mlx": pinned or mlx, "mlx-lm": lm}, "env_vars": {},
           "result_columns": COLUMNS, "results": results, "durations": {}, "version": 2}
    (d / f"{commit}-{env}.json").write_text(json.dumps(doc))


@pytest.fixture
def results(tmp_path):
    root = tmp_path / "results"
    write_result(root, "m1", "aaaaaaaa", "0.31.2", 1, (0.5, 0.25), [0.0, 0.01], 0.60)
    write_result(root, "m1", "bbbbbbbb", "0.32.4", 2, (0.52, 0.40), [0.0, 0.01], 0.60)
    (root / "benchmarks.json").write_text(json.dumps({
        "bench_stack.DecodeVsVerify.track_max_abs_dlogit": {"unit": "logits"}, "version": 2}))
    return root


def test_version_code_round_trips():
    assert history.encode_version("0.32.4") == 3204.0
    assert history.decode_version(3204.0) == "0.32.4"
    assert history.decode_version(history.encode_version("1.2.13")) == "1.2.13"


def test_reader_flattens_parameters_and_reads_the_tracked_version(results):
    df = history.read_results(results)
    s = df[df["benchmark"] == "bench_stack.DecodeVsVerify.track_max_abs_dlogit"]
    assert sorted(zip(s["mlx"], s["params"], s["value"])) == [
        ("0.31.2", "verify2", 0.5), ("0.31.2", "verify3", 0.25), ("0.32.4", "verify2", 0.52),
        ("0.32.4", "verify3", 0.4)]
    assert set(s["unit"]) == {"logits"} and set(df["backend"]) == {"cpu"}
    layers = df[df["benchmark"] == "bench_stack.DecodeVsVerifyLayers.track_rel_l2"]
    assert sorted(layers["params"]) == ["verify2, layer 0", "verify2, layer 0", "verify2, layer 1", "verify2, layer 1"]
    nan = df[df["benchmark"] == "bench_kernels.KernelDrift.track_bits_lost"]
    assert nan["value"].isna().sum() == 2  # NaN (skipped) is read as missing, not as a number


def test_tracked_version_wins_over_the_pin(tmp_path):
    root = tmp_path / "r"
    write_result(root, "m1", "cccccccc", "0.30.6", 1, (0.1, 0.1), [0.0, 0.0], 0.6, pinned="")
    assert set(history.read_results(root)["mlx"]) == {"0.30.6"}


def test_history_table_has_a_column_per_version(results):
    wide = history.history_table(history.read_results(results))
    assert list(wide.columns[-2:]) == ["0.31.2", "0.32.4"]
    row = wide[wide["series"] == "bench_stack.DecodeVsVerify.track_max_abs_dlogit[verify3]"].iloc[0]
    assert (row["0.31.2"], row["0.32.4"]) == (0.25, 0.4)


def test_layer_profiles_regroup_per_layer_series(results):
    profiles = history.layer_profiles(history.read_results(results))
    assert list(profiles) == [("m1", "cpu", "bench_stack.DecodeVsVerifyLayers.track_rel_l2", "verify2")]
    p = profiles[("m1", "cpu", "bench_stack.DecodeVsVerifyLayers.track_rel_l2", "verify2")]
    assert sorted(zip(p["release"], p["tap_index"], p["value"])) == [
        ("0.31.2", 0, 0.0), ("0.31.2", 1, 0.01), ("0.32.4", 0, 0.0), ("0.32.4", 1, 0.01)]
    from gemmdrift.view import plots

    plots.plot_layer_profile(p, "t")


def test_gate_flags_growth_past_the_threshold_only(results):
    g = history.gate(history.read_results(results), threshold=0.10)
    assert (g["candidate"].iloc[0], g["baseline"].iloc[0]) == ("0.32.4", "0.31.2")
    bad = g[g["regression"]]
    assert list(zip(bad["benchmark"], bad["params"])) == [("bench_stack.DecodeVsVerify.track_max_abs_dlogit", "verify3")]
    assert bad["ratio"].iloc[0] == pytest.approx(1.6)
    ok = g[g["params"] == "verify2"]  # +4%: within 10%
    assert not ok["regression"].any()


def test_gate_zero_baseline_and_higher_is_better(tmp_path):
    root = tmp_path / "r"
    write_result(root, "m1", "aaaaaaaa", "0.31.2", 1, (0.5, 0.5), [0.0, 0.01], 0.66)
    write_result(root, "m1", "bbbbbbbb", "0.32.4", 2, (0.5, 0.5), [1e-3, 0.01], 0.50)
    g = history.gate(history.read_results(root))
    bad = set(zip(g[g["regression"]]["benchmark"], g[g["regression"]]["params"]))
    assert ("bench_stack.DecodeVsVerifyLayers.track_rel_l2", "verify2, layer 0") in bad  # 0 -> 1e-3
    assert ("bench_diverge.Divergence.track_self_draft_acceptance", "") in bad  # acceptance fell
    assert math.isinf(g[g["params"] == "verify2, layer 0"]["ratio"].iloc[0])


def test_gate_ignores_the_emulated_control(tmp_path):
    root = tmp_path / "r"
    for commit, mlx, date, bits in (("aaaaaaaa", "0.31.2", 1, 1.0), ("bbbbbbbb", "0.32.4", 2, 3.0)):
        bench = {"bench_kernels.KernelDrift.track_rows_differ": entry([0.0, bits],
                                                                      [["'model'", "'emulated:splitk4'"], ["2"]])}
        write_result(root, "m1", commit, mlx, date, (0.5, 0.5), [0.0, 0.01], 0.66, extra=bench)
    g = history.gate(history.read_results(root))
    rows = g[g["benchmark"] == "bench_kernels.KernelDrift.track_rows_differ"]
    assert list(rows["params"]) == ["model, 2"]  # the control is not an mlx kernel: not gated
    assert not g["regression"].any()


def test_gate_errors(results, tmp_path):
    df = history.read_results(results)
    with pytest.raises(GemmdriftError):
        history.gate(df, candidate="0.9.9")
    with pytest.raises(GemmdriftError):
        history.gate(df, candidate="0.31.2")  # nothing older
    with pytest.raises(GemmdriftError):
        history.read_results(tmp_path / "none")
    (tmp_path / "empty").mkdir()
    with pytest.raises(GemmdriftError):
        history.read_results(tmp_path / "empty")


def test_cli_gate_exit_status_and_history_figures(results, tmp_path):
    run = lambda *a: subprocess.run([sys.executable, "-m", "gemmdrift", *a], capture_output=True, text=True)
    r = run("gate", "--results", str(results))
    assert r.returncode == 1 and "FAIL: 1 of" in r.stdout
    r = run("gate", "--results", str(results), "--threshold", "0.7")
    assert r.returncode == 0 and "PASS" in r.stdout
    r = run("history", "--results", str(results), "--out", str(tmp_path / "h"), "--json")
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout)
    assert summary["versions"] == ["0.31.2", "0.32.4"] and summary["figures"]
    assert any("layers_bench_stack.DecodeVsVerifyLayers.track_rel_l2" in f for f in summary["figures"])
    assert all((tmp_path / "h" / "figures").glob("*.png"))
    from gemmdrift import report, store

    assert store.read_result(tmp_path / "h").kind == "history"  # a Result like any other kind: it renders
    assert any(b[0] == "img" for b in report.report_blocks(tmp_path / "h"))
    r = run("gate", "--results", str(tmp_path / "none"))
    assert r.returncode == 2 and "no asv results" in r.stderr


def test_gate_refuses_a_release_against_itself(results):
    # Regression: `gate --candidate X --baseline X` compared a release with itself and passed.
    df = history.read_results(results)
    with pytest.raises(GemmdriftError, match="same release"):
        history.gate(df, candidate="0.32.4", baseline="0.32.4")
    r = subprocess.run([sys.executable, "-m", "gemmdrift", "gate", "--results", str(results), "--candidate", "0.32.4",
                        "--baseline", "0.32.4"], capture_output=True, text=True)
    assert r.returncode == 2 and "same release" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("layout,cli", [
    ({"result_columns": ["params"], "results": {"b.track_x": [[1.0], []]}}, True),  # no "result" column
    ({"result_columns": COLUMNS, "results": ["not", "a", "dict"]}, False),
    ({"result_columns": COLUMNS, "results": {"b.track_x": 3.0}}, False),  # an entry that is not a list
    ({"result_columns": COLUMNS, "results": {"b.track_x": [["abc"], []]}}, False),  # a value that is not a number
    ({"result_columns": 7, "results": {}}, False),
])
def test_asv_results_with_a_wrong_layout_are_one_line_exit_2(results, layout, cli):
    # Regression: valid JSON in another layout crashed history/gate with a traceback and exit 1,
    # the exit status of a gate FAIL.
    (results / "m1" / "cccccccc-env-x.json").write_text(json.dumps(layout))
    with pytest.raises(GemmdriftError, match="cccccccc-env-x.json"):
        history.read_results(results)
    for cmd in ("gate", "history") if cli else ():
        r = subprocess.run([sys.executable, "-m", "gemmdrift", cmd, "--results", str(results), "--out",
                            str(results.parent / "o")], capture_output=True, text=True)
        assert r.returncode == 2 and "Traceback" not in r.stderr and "layout" in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1


def test_without_local_results_history_uses_the_committed_reference_results(tmp_path, monkeypatch):
    # Regression: on a fresh clone (no .asv/results) `history` and `gate` had no data at all.
    (tmp_path / "asv.conf.json").write_text("{}")
    ref = tmp_path / "benchmarks" / "reference"
    write_result(ref, "reference-linux-cpu", "aaaaaaaa", "0.31.2", 1, (0.5, 0.25), [0.0, 0.01], 0.60)
    write_result(ref, "reference-linux-cpu", "bbbbbbbb", "0.32.4", 2, (0.5, 0.25), [0.0, 0.01], 0.60)
    (tmp_path / "notebooks").mkdir()
    monkeypatch.chdir(tmp_path / "notebooks")  # where the notebooks run
    d, why = history.default_results()
    assert d == ref and "reference" in why
    r = subprocess.run([sys.executable, "-m", "gemmdrift", "gate"], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0 and "PASS" in r.stdout and "committed reference results" in r.stderr, r.stderr
    # Your own results win once there are some; both can be read together, one line per machine.
    local = tmp_path / ".asv" / "results"
    write_result(local, "my-mac", "cccccccc", "0.32.4", 3, (0.1, 0.1), [0.0, 0.0], 0.9)
    assert history.default_results()[0] == local
    df = history.read_results([local, ref])
    assert set(df["machine"]) == {"my-mac", "reference-linux-cpu"}
    assert set(history.gate(df)["machine"]) == {"reference-linux-cpu"}  # my-mac has no older release to compare
    # The same machine name in two directories would draw two machines as one: refused.
    write_result(local, "reference-linux-cpu", "dddddddd", "0.32.4", 4, (0.1, 0.1), [0.0, 0.0], 0.9)
    with pytest.raises(GemmdriftError, match="is in both"):
        history.read_results([local, ref])


def test_the_committed_reference_results_read_as_one_cpu_machine():
    # The reference results a fresh clone shows (benchmarks/reference): asv's JSON as asv wrote it.
    from pathlib import Path

    ref = Path(__file__).resolve().parent.parent / history.REFERENCE_RESULTS
    df = history.read_results(ref)
    # two machine names: the main-job-size results (four releases) and the tracking tier's history (issue 47)
    assert set(df["machine"]) == {"reference-linux-cpu", "reference-linux-cpu-tier"} and set(df["backend"]) == {"cpu"}
    tier = df[df["machine"] == "reference-linux-cpu-tier"]
    assert {"0.26.5", "0.27.1", "0.28.0", "0.29.4", "0.30.6", "0.31.2", "0.32.4"} <= set(tier["mlx"])
    df = df[df["machine"] == "reference-linux-cpu"]
    assert (df["mlx"] == df["mlx_pinned"]).all()  # what ran is what the matrix pinned
    assert set(df["mlx"]) == {"0.29.4", "0.30.6", "0.31.2", "0.32.4"}  # the four-release CPU matrix
    # ... and the mlx-lm axis: mlx 0.32.4 with mlx-lm 0.30.2 and 0.31.3 beside its own 0.32.2
    assert set(history.label_releases(df)["release"]) == {"0.29.4", "0.30.6", "0.31.2", "0.32.4+lm0.30.2",
                                                          "0.32.4+lm0.31.3", "0.32.4+lm0.32.2"}
    t = history.tracked(df)
    assert len(t) > 200 * df["mlx"].nunique() and t["value"].notna().all()
    rope = t[(t["benchmark"] == "bench_kernels.OpsDrift.track_bits_lost") & (t["params"] == "rope")]
    # mlx < 0.30 computed CPU RoPE angles in bf16 (mlx/fast.cpp): positions past 256 collide.
    assert all((v > 0) == (m == "0.29.4") for m, v in zip(rope["mlx"], rope["value"]))


def test_gate_compares_tree_ids_for_equality_not_growth(tmp_path):
    # Regression (issue 15): a summation tree's id is a hash; gate judged it by growth, so a new tree
    # with a larger id failed as "drift grew" and one with a smaller id passed silently.
    root = tmp_path / "r"
    name = "bench_fingerprint.Fingerprint.track_tree_id_t1"
    for commit, mlx, date, ids in (("aaaaaaaa", "0.31.2", 1, (5.0, 9.0)), ("bbbbbbbb", "0.32.4", 2, (7.0, 9.0))):
        bench = {name: entry(list(ids), [["'matmul:bfloat16'", "'sum:float32'"]])}
        write_result(root, "m1", commit, mlx, date, (0.5, 0.5), [0.0, 0.01], 0.66, extra=bench)
    g = history.gate(history.read_results(root))
    rows = g[g["benchmark"] == name].set_index("params")
    assert not rows["regression"].any()
    assert bool(rows.loc["matmul:bfloat16", "changed"]) and not bool(rows.loc["sum:float32", "changed"])
    assert not g[g["benchmark"] != name]["changed"].any()


# ----------------------------------------------------------------------------- the mlx-lm axis


@pytest.fixture
def lm_axis(tmp_path):
    """mlx 0.31.2 with mlx-lm 0.31.3; mlx 0.32.4 with mlx-lm 0.31.3 and with 0.32.2 (the tracked mlx-lm
    version of the last one wins over its pin)."""
    root = tmp_path / "results"
    write_result(root, "m1", "aaaaaaaa", "0.31.2", 1, (0.5, 0.25), [0.0, 0.01], 0.60, lm="0.31.3")
    write_result(root, "m1", "aaaaaaaa", "0.32.4", 2, (0.5, 0.25), [0.0, 0.01], 0.60, lm="0.31.3")
    write_result(root, "m1", "aaaaaaaa", "0.32.4", 3, (0.5, 0.90), [0.0, 0.01], 0.60, lm="0.32",
                 extra={history.LM_VERSION_BENCH: entry(history.encode_version("0.32.2"))})
    return root


def test_one_mlx_with_several_mlx_lm_releases_gets_one_column_each(lm_axis):
    df = history.read_results(lm_axis)
    assert set(zip(df["mlx"], df["mlx_lm"], df["release"])) == {
        ("0.31.2", "0.31.3", "0.31.2"), ("0.32.4", "0.31.3", "0.32.4+lm0.31.3"), ("0.32.4", "0.32.2", "0.32.4+lm0.32.2")}
    wide = history.history_table(df)
    assert [c for c in wide.columns if c[0].isdigit()] == ["0.31.2", "0.32.4+lm0.31.3", "0.32.4+lm0.32.2"]
    row = wide[wide["series"] == "bench_stack.DecodeVsVerify.track_max_abs_dlogit[verify3]"].iloc[0]
    assert (row["0.32.4+lm0.31.3"], row["0.32.4+lm0.32.2"]) == (0.25, 0.90)
    assert history.LM_VERSION_BENCH not in set(history.tracked(df)["benchmark"])


def test_gate_compares_two_mlx_lm_releases_of_one_mlx(lm_axis):
    df = history.read_results(lm_axis)
    g = history.gate(df, candidate="0.32.4+lm0.32.2", baseline="0.32.4+lm0.31.3")
    bad = g[g["regression"]]
    assert list(bad["params"]) == ["verify3"] and (bad["old"].iloc[0], bad["new"].iloc[0]) == (0.25, 0.90)
    # Default: the newest release against the newest one of the mlx before it.
    d = history.gate(df)
    assert (d["candidate"].iloc[0], d["baseline"].iloc[0]) == ("0.32.4+lm0.32.2", "0.31.2")
    # A bare mlx version names that mlx with the newest mlx-lm it ran with.
    assert history.gate(df, candidate="0.32.4")["candidate"].iloc[0] == "0.32.4+lm0.32.2"
    with pytest.raises(GemmdriftError, match="no results for 0.30.6"):
        history.gate(df, candidate="0.30.6")
    assert history.gate(df, candidate="0.32.4+lm0.31.3", baseline="0.31.2")["regression"].sum() == 0
    with pytest.raises(GemmdriftError, match="same release"):
        history.gate(df, candidate="0.32.4+lm0.31.3", baseline="0.32.4+lm0.31.3")


def test_release_labels_sort_by_mlx_then_mlx_lm():
    labels = ["0.32.4+lm0.32.2", "0.9.0", "0.32.4+lm0.31.3", "0.31.2"]
    assert sorted(labels, key=history.release_key) == ["0.9.0", "0.31.2", "0.32.4+lm0.31.3", "0.32.4+lm0.32.2"]


def test_history_picks_up_the_predicted_drift_per_chip(tmp_path):
    """bench_predict's series (chip x schedule x stat) are ordinary track_ series: one row per chip and pair,
    one column per mlx release, so a release that changes a recipe shows as a changed prediction."""
    root = tmp_path / "r"
    params = [["'M1'", "'M3'"], ["'verify:2'"], ["'max'"]]
    bench = "bench_predict.PredictedDrift.track_max_dlogit"
    write_result(root, "m1", "aaaaaaaa", "0.32.2", 1, (0.5, 0.25), [0.0, 0.01], 0.6,
                 extra={bench: entry([0.42, 0.25], params)})
    write_result(root, "m1", "bbbbbbbb", "0.32.4", 2, (0.5, 0.25), [0.0, 0.01], 0.6,
                 extra={bench: entry([0.42, 0.5], params)})
    wide = history.history_table(history.read_results(root))
    rows = wide[wide["series"].str.startswith(bench)].set_index("series")
    assert rows.loc[f"{bench}[M1, verify:2, max]", ["0.32.2", "0.32.4"]].tolist() == [0.42, 0.42]
    assert rows.loc[f"{bench}[M3, verify:2, max]", ["0.32.2", "0.32.4"]].tolist() == [0.25, 0.5]


def test_history_draws_every_release_in_order_and_marks_a_skipped_figure_as_skipped(tmp_path):
    from gemmdrift.view.history import plot_history

    root = tmp_path / "results"
    nan = {"bench_state.S.track_state_bugs": entry([float("nan")], [["'KVCache/trim'"]])}
    write_result(root, "m1", "aaaaaaaa", "0.32.4", 3, (0.5, 0.25), [0.0, 0.01], 0.60,
                 extra={"bench_state.S.track_state_bugs": entry([4.0], [["'KVCache/trim'"]])})
    write_result(root, "m1", "aaaaaaaa", "0.26.5", 1, (0.5, 0.25), [0.0, 0.01], 0.60)  # no such benchmark
    write_result(root, "m1", "aaaaaaaa", "0.30.0", 2, (0.5, 0.25), [0.0, 0.01], 0.60, extra=nan)  # NaN: skipped
    r = history.history_result(history.read_results(root))
    sk = r.tables["skipped"]
    got = {(x.release, x.why) for x in sk[sk["benchmark"] == "bench_state.S.track_state_bugs"].itertuples()}
    assert got == {("0.26.5", history.NOT_RUN), ("0.30.0", history.SKIPPED)}
    assert list(r.tables["releases"]["release"]) == ["0.26.5", "0.30.0", "0.32.4"]  # release order, not text order
    fig = plot_history(r.tables["history"], "bench_state.S.track_state_bugs", "KVCache/trim",
                       releases=r.tables["releases"], skipped=sk)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0.26.5", "0.30.0", "0.32.4"]
    ys = ax.lines[0].get_ydata()
    assert np.isnan(ys[0]) and np.isnan(ys[1]) and ys[2] == 4.0  # no 0 where there is no value
    assert sorted(t.get_text() for t in ax.texts) == ["not run", "skipped"]
    # and a series present everywhere has no marks
    fig2 = plot_history(r.tables["history"], "bench_diverge.Divergence.track_self_draft_acceptance", "",
                        releases=r.tables["releases"], skipped=sk)
    assert not fig2.axes[0].texts
    from gemmdrift.view.history import history_text

    line = next(x for x in history_text(r).splitlines() if "track_state_bugs" in x)
    assert line.split()[-4:] == ["not", "run", "skipped", "4"]  # 0.26.5, 0.30.0, 0.32.4 in release order


# ----------------------------------------------------------------------------- directions (issue 53)


def _two_releases(tmp_path, pairs):
    """0.31.2 -> 0.32.4 on one machine, each extra benchmark (unparameterized) going old -> new."""
    root = tmp_path / "dir"
    for commit, mlx, date, i in (("aaaaaaaa", "0.31.2", 1, 0), ("bbbbbbbb", "0.32.4", 2, 1)):
        write_result(root, "m1", commit, mlx, date, (0.5, 0.5), [0.0, 0.01], 0.6,
                     extra={name: entry(v[i]) for name, v in pairs.items()})
    return history.read_results(root)


def test_gate_judges_each_figure_by_its_declared_direction(tmp_path):
    """Regression (issue 53, item 2): only two figures had a direction, so a stream that left its envelope later
    (18 -> 23) and top-1 agreement rising to 1 failed the gate. Improvements pass, a worsening past the threshold
    fails either way round, a change of an either-way figure is news (never a failure)."""
    df = _two_releases(tmp_path, {
        "bench_tier.TierDivergence.track_stream_first_outside": (18.0, 23.0),  # higher is better: better
        "bench_tier.TierGolden.track_same_top1": (0.937, 1.0),  # higher: better
        "bench_tier.TierDecodeVsVerify.track_identical_through": (512.0, 400.0),  # higher, fell 22%: worse
        "bench_tier.TierGolden.track_kld_mean": (0.5, 0.2),  # lower is better: better
        "bench_tier.TierState.track_cases": (94.0, 106.0),  # either: news
        "bench_new.Unknown.track_thing": (1.0, 2.0),  # no direction declared anywhere: news
    })
    g = history.gate(df).set_index("benchmark")
    v = g["verdict"].to_dict()
    assert v["bench_tier.TierDivergence.track_stream_first_outside"] == "better"
    assert v["bench_tier.TierGolden.track_same_top1"] == "better"
    assert v["bench_tier.TierDecodeVsVerify.track_identical_through"] == "worse"
    assert v["bench_tier.TierGolden.track_kld_mean"] == "better"
    assert v["bench_tier.TierState.track_cases"] == "news"
    assert (v["bench_new.Unknown.track_thing"], g.loc["bench_new.Unknown.track_thing", "direction"]) == (
        "news", "undeclared")
    assert set(g.index[g["regression"]]) == {"bench_tier.TierDecodeVsVerify.track_identical_through"}
    # the same judgement, directly: within the threshold the wrong way is 'within', from 0 any growth is worse
    from gemmdrift import directions as D

    assert D.judge(D.HIGHER, 1.0, 0.95, 0.10) == D.WITHIN and D.judge(D.LOWER, 1.0, 1.05, 0.10) == D.WITHIN
    assert D.judge(D.LOWER, 0.0, 1e-3, 0.10) == D.WORSE and D.judge(D.HIGHER, 0.5, 0.5, 0.10) == D.SAME
    assert D.judge(D.EITHER, 5.0, 3.0, 0.10) == D.NEWS and D.judge(None, 5.0, 3.0, 0.10) == D.NEWS


def test_gate_passes_the_shipped_release_whose_figures_improved():
    """The known case of issue 53 on the committed reference results: 0.30.0 against 0.29.4 failed on
    TierDivergence.track_stream_first_outside 18 -> 23; it is an improvement and the gate passes."""
    from pathlib import Path

    ref = Path(__file__).resolve().parent.parent / "benchmarks" / "reference"
    g = history.gate(history.read_results(ref), candidate="0.30.0")
    assert g["baseline"].iloc[0] == "0.29.4" and not g["regression"].any()
    row = g[g["benchmark"] == "bench_tier.TierDivergence.track_stream_first_outside"].iloc[0]
    assert (row["old"], row["new"], row["direction"], row["verdict"]) == (18.0, 23.0, "higher", "better")


def test_gate_csv_and_json_say_changed_for_every_figure_that_changed(tmp_path):
    """Regression (issue 53, item 28): `changed` tracked tree ids only, so gate.csv and --json said changed: false
    on figures that changed; and gate's --json had no help text."""
    import pandas as pd

    df = _two_releases(tmp_path, {"bench_tier.TierGolden.track_same_top1": (0.937, 1.0)})
    out = tmp_path / "gate"
    r = subprocess.run([sys.executable, "-m", "gemmdrift", "gate", "--results", str(tmp_path / "dir"), "--out",
                        str(out), "--json"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr  # an improvement passes
    doc = json.loads(r.stdout)
    assert doc["pass"] and doc["counts"]["better"] == 1 and doc["regressions"] == []
    assert [(x["benchmark"], x["changed"]) for x in doc["better"]] == [("bench_tier.TierGolden.track_same_top1", True)]
    csv = pd.read_csv(out / "gate.csv").set_index("benchmark")
    assert bool(csv.loc["bench_tier.TierGolden.track_same_top1", "changed"])
    assert not csv.drop(index="bench_tier.TierGolden.track_same_top1")["changed"].any()  # the others are equal
    from gemmdrift.cli import build_parser

    sub = next(a for a in build_parser()._actions if hasattr(a, "choices") and a.choices and "gate" in a.choices)
    empty = [x.dest for x in sub.choices["gate"]._actions if x.dest != "help" and not (x.help or "").strip()]
    assert not empty, f"gate flags without help: {empty}"


def test_a_bare_mlx_version_and_a_label_of_that_mlx_are_ordered_once_resolved(lm_axis):
    """Regression (issue 53, item 17): `--candidate 0.32.4 --baseline 0.32.4+lm0.31.3` was refused as "newer than"
    before 0.32.4 was resolved (to mlx-lm 0.32.2), and the suggested reversal was refused the other way. The order is
    decided once both are resolved, and the suggested command runs."""
    import re

    from gemmdrift.checks import check_gate_versions

    df = history.read_results(lm_axis)
    check_gate_versions("0.32.4", "0.32.4+lm0.31.3")  # not ordered before the results say what 0.32.4 is
    g = history.gate(df, candidate="0.32.4", baseline="0.32.4+lm0.31.3")
    assert (g["candidate"].iloc[0], g["baseline"].iloc[0]) == ("0.32.4+lm0.32.2", "0.32.4+lm0.31.3")
    with pytest.raises(GemmdriftError) as e:
        history.gate(df, candidate="0.32.4+lm0.31.3", baseline="0.32.4")
    m = re.search(r"write --candidate (\S+) --baseline (\S+?)\)", str(e.value))
    assert m and "0.32.4 is 0.32.4+lm0.32.2" in str(e.value)
    g = history.gate(df, candidate=m.group(1), baseline=m.group(2))  # the suggestion is not refused in turn
    assert (g["candidate"].iloc[0], g["baseline"].iloc[0]) == ("0.32.4+lm0.32.2", "0.32.4+lm0.31.3")
    # one order everywhere: a label of an mlx sorts after the bare version and before the next mlx
    assert sorted(["0.33.0", "0.32.4+lm0.31.3", "0.32.4", "0.32.10"], key=history.release_key) == [
        "0.32.4", "0.32.4+lm0.31.3", "0.32.10", "0.33.0"]


def test_the_manifest_gives_every_tracked_figure_a_direction():
    """What the gate reads (benchmarks/manifest.json, kept equal to the benchmarks' own declarations by
    tests/test_benchmarks.py): every track_ benchmark with one of the four directions, without asv installed."""
    from pathlib import Path

    from gemmdrift import directions as D

    doc = json.loads((Path(__file__).resolve().parent.parent / history.MANIFEST).read_text())
    tracks = {k: v.get("direction") for k, v in doc.items() if v["type"] == "track"}
    assert len(tracks) >= 90 and all(d in D.DIRECTIONS for d in tracks.values()), \
        [k for k, d in tracks.items() if d not in D.DIRECTIONS]
    assert history.directions_of() == tracks
    assert {k for k, d in tracks.items() if d == D.LABEL} == {history.VERSION_BENCH, history.LM_VERSION_BENCH,
                                                               history.BACKEND_BENCH, history.SIZES_BENCH}
