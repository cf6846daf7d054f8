"""Accumulation-order fingerprints: known trees recovered exactly, planted faults reported, bad input rejected."""

from __future__ import annotations

import numpy as np
import pytest

from gemmdrift.errors import GemmdriftError

from gemmdrift import fingerprint as fp
from gemmdrift.cli import main


def _reducer(name, n, fn, dtype="float32", **kw):
    return fp.Reducer(name, n, fp.encoding_for(dtype, n, **kw), fn)


def _recover_one(red):
    recs, stats = fp.recover(red)
    assert len(recs) == 1
    assert recs[0].ok, recs[0].problem
    return recs[0].tree, stats


# ---- known trees, built here from the algorithms' own definitions (not from the recovery code)


def numpy_pairwise_tree(lo: int, n: int):
    """numpy's float32 add reduction (numpy/_core/src/umath/loops_utils.h.src, pairwise_sum): below 8 terms a
    sequential loop; up to 128 eight accumulators r[0..7] over stride 8, combined ((r0+r1)+(r2+r3))+((r4+r5)+(r6+r7)),
    then the remainder added one by one; above 128 split at n/2 rounded down to a multiple of 8."""
    idx = list(range(lo, lo + n))
    if n < 8:
        t = idx[0]
        for i in idx[1:]:
            t = (t, i)
        return t
    if n <= 128:
        r = []
        for k in range(8):
            t = lo + k
            for i in range(lo + 8 + k, lo + n - n % 8, 8):
                t = (t, i)
            r.append(t)
        t = ((r[0], r[1]), (r[2], r[3])), ((r[4], r[5]), (r[6], r[7]))
        for i in range(lo + n - n % 8, lo + n):
            t = (t, i)
        return t
    n2 = n // 2
    n2 -= n2 % 8
    return (numpy_pairwise_tree(lo, n2), numpy_pairwise_tree(lo + n2, n - n2))


def seq_tree(idx):
    t = idx[0]
    for i in idx[1:]:
        t = (t, i)
    return t


@pytest.mark.parametrize("n", [5, 100, 128, 300, 1000])
def test_numpy_sum_recovered_exactly(n):
    red = fp.numpy_reducer(n)
    tree, _ = _recover_one(red)
    assert fp.to_text(tree) == fp.to_text(fp.canonical(numpy_pairwise_tree(0, n)))


def test_numpy_sum_description_names_its_structure():
    tree, _ = _recover_one(fp.numpy_reducer(1024))
    d = fp.describe(tree)
    assert d.startswith("8 blocks of 128 combined pairwise"), d
    assert "8 interleaved accumulators (stride 8, 16 terms each) combined pairwise" in d, d


def test_python_loop_recovered_as_sequential():
    n = 150

    def loop(vals):
        out = np.zeros((len(vals), 1))
        for p, v in enumerate(vals.astype(np.float32)):
            s = np.float32(0)
            for x in v:
                s = np.float32(s + x)
            out[p, 0] = s
        return out

    tree, stats = _recover_one(_reducer("loop", n, loop))
    assert fp.to_text(tree) == fp.to_text(seq_tree(list(range(n))))
    assert fp.describe(tree) == f"sequential, left to right ({n} terms, one accumulator)"
    assert stats["probes"] == n - 1  # O(n) for a chain: one pivot


def test_reverse_loop_recovered_and_named():
    n = 40
    tree, _ = _recover_one(_reducer("rev", n, lambda v: np.cumsum(v[:, ::-1].astype(np.float32), axis=1)[:, -1:]))
    assert fp.to_text(tree) == fp.to_text(fp.canonical(seq_tree(list(range(n))[::-1])))
    assert fp.describe(tree).startswith("sequential, right to left")


def blocked(vals, block):
    """Hand-built: each block summed sequentially in float32, block sums combined pairwise."""
    v = vals.astype(np.float32)
    sums = [np.cumsum(v[:, a:a + block], axis=1, dtype=np.float32)[:, -1] for a in range(0, v.shape[1], block)]

    def pw(xs):
        if len(xs) == 1:
            return xs[0]
        h = len(xs) // 2
        return (pw(xs[:h]) + pw(xs[h:])).astype(np.float32)
    return pw(sums)[:, None]


def test_blocked_reduction_recovered_exactly():
    n, b = 256, 32
    tree, _ = _recover_one(_reducer("blocked", n, lambda v: blocked(v, b)))
    expect = fp.pairwise([seq_tree(list(range(a, a + b))) for a in range(0, n, b)])
    assert fp.to_text(tree) == fp.to_text(fp.canonical(expect))
    assert fp.describe(tree) == "sequential in 8 blocks of 32, blocks combined pairwise"


def test_bfloat16_output_needs_windows_and_still_recovers():
    # Counts above 256 are not exact in bfloat16: the probes split the units into windows of 256.
    n = 600

    def seq_bf16_out(v):
        s = np.cumsum(v.astype(np.float32), axis=1)[:, -1:]
        import mlx.core as mx
        return np.array(mx.array(s).astype(mx.bfloat16).astype(mx.float32))

    red = _reducer("seq-bf16", n, seq_bf16_out, dtype="bfloat16")
    assert red.encoding.window == 256 and len(red.encoding.windows) == 3
    tree, stats = _recover_one(red)
    assert fp.to_text(tree) == fp.to_text(seq_tree(list(range(n))))
    assert stats["probes"] > n  # several windows per pair


def test_unwindowed_bfloat16_counts_are_reported_not_guessed():
    # Planted fault: a window wider than bfloat16 can count makes inexact counts; recovery must refuse.
    n = 600

    def seq_bf16_out(v):
        import mlx.core as mx
        s = np.cumsum(v.astype(np.float32), axis=1)[:, -1:]
        return np.array(mx.array(s).astype(mx.bfloat16).astype(mx.float32))

    enc = fp.Encoding("bfloat16", 2.0 ** 40, 1.0, 1000, n)
    recs, _ = fp.recover(fp.Reducer("bad", n, enc, seq_bf16_out))
    assert not recs[0].ok
    assert "not an integer count" in recs[0].problem or "inconsistent" in recs[0].problem


def test_no_absorption_is_detected():
    # Planted fault: M too small to absorb the units (float64 accumulator) -> counts do not nest.
    n = 64
    enc = fp.Encoding("float32", 2.0 ** 30, 1.0, n, n)
    red = fp.Reducer("f64", n, enc, lambda v: np.sum(v, axis=1, dtype=np.float64)[:, None])
    recs, _ = fp.recover(red)
    assert not recs[0].ok


def test_fingerprint_is_stable_and_tree_id_exact():
    t1 = fp.canonical(((2, 3), (1, 0)))
    t2 = fp.canonical(((0, 1), (3, 2)))
    assert fp.to_text(t1) == "((0 1) (2 3))" and fp.fingerprint(t1) == fp.fingerprint(t2)
    assert fp.fingerprint(fp.canonical((((0, 1), 2), 3))) != fp.fingerprint(t1)
    tid = fp.tree_id(fp.fingerprint(t1))
    assert tid == int(fp.fingerprint(t1), 16) and tid < 2 ** 48 and float(int(tid)) == tid
    assert fp.from_text(fp.to_text(t1)) == t1


# ---- mlx paths (this CPU: measured facts, and the negative control)


@pytest.mark.linux_cpu_reference
def test_mlx_matmul_paths_and_splitk_control():
    K, T = 64, 3
    got = {}
    for red in (fp.matmul_reducer("bfloat16", K, T, 16), fp.matmul_reducer("float32", K, T, 16),
                fp.splitk_reducer(4, "bfloat16", K, T, 16)):
        recs, _ = fp.recover(red)
        assert all(r.ok for r in recs), [r.problem for r in recs]
        fps = {fp.fingerprint(r.tree) for r in recs}
        assert len(fps) == 1  # every position of the block gives a tree
        got[red.name] = recs[0].tree
    split = fp.canonical(seq_tree([seq_tree(list(range(a, a + 16))) for a in range(0, K, 16)]))
    assert fp.to_text(got["emulated:splitk4:bfloat16"]) == fp.to_text(split)
    assert fp.fingerprint(got["emulated:splitk4:bfloat16"]) != fp.fingerprint(got["matmul:bfloat16"])
    import mlx.core as mx
    if mx.default_device() == mx.cpu:
        # simd_gemm with simd max_size 1 on x86 and reference cblas_sgemm: one sequential accumulator.
        assert fp.to_text(got["matmul:bfloat16"]) == fp.to_text(seq_tree(list(range(K))))
        assert fp.to_text(got["matmul:float32"]) == fp.to_text(seq_tree(list(range(K))))


def test_quantized_weights_dequantize_to_one_and_recover():
    red = fp.quant_reducer("affine", 4, 64, "float32", 64, 2, 8)
    recs, _ = fp.recover(red)
    assert all(r.ok for r in recs)


def test_cpu_quantized_bf16_accumulator_is_narrow():
    import mlx.core as mx
    if mx.default_device() != mx.cpu:
        pytest.skip("the bfloat16 accumulator is the CPU _qmm_t's")
    red = fp.quant_reducer("affine", 4, 64, "bfloat16", 512, 1, 8)
    acc = fp.accumulator_check(red)
    assert acc["units"] == 510 and acc["sum"] == 256.0 and not acc["exact"]
    dense = fp.accumulator_check(fp.matmul_reducer("bfloat16", 512, 1, 8))
    assert dense["exact"] and dense["sum"] == 510.0


@pytest.mark.linux_cpu_reference
def test_measure_result_and_not_recoverable_paths():
    r = fp.measure(["matmul:float32", "emulated:splitk2:float32", "softmax:float32"], K=32, ts=[1, 2], N=8,
                   draw_k=8)
    assert r.kind == "fingerprint"
    t = r.tables["fingerprints"]
    assert set(t[t["path"] == "softmax:float32"]["status"]) == {"not recoverable"}
    assert r.figure("matmul:float32.distinct_trees") == 1.0
    assert r.figure("matmul:float32.tree_id_t1") != r.figure("emulated:splitk2:float32.tree_id_t1")
    assert "softmax:float32.distinct_trees" not in r.figures
    assert r.details["small_trees"]["matmul:float32"]["K"] == 8


def test_paths_in_two_processes_give_what_one_gives():
    """measure() runs its paths in two processes by default on a multi-core CPU: the same tables, trees and
    figures as one process."""
    paths = ["matmul:float32", "emulated:splitk2:float32", "softmax:float32"]
    one = fp.measure(paths, K=32, ts=[1, 2], N=8, draw_k=8, workers=1)
    two = fp.measure(paths, K=32, ts=[1, 2], N=8, draw_k=8, workers=2)
    cols = [c for c in one.tables["fingerprints"].columns if c != "seconds"]
    assert one.tables["fingerprints"][cols].equals(two.tables["fingerprints"][cols])
    assert one.tables["accumulator"].equals(two.tables["accumulator"])
    assert one.figures == two.figures and one.details == two.details
    with pytest.raises(GemmdriftError, match="workers must be at least 1"):
        fp.measure(paths, K=32, ts=[1, 2], N=8, workers=0)


# ---- bad input: one line, exit 2, before any computation


@pytest.mark.parametrize("argv, words", [
    (["--paths", "matmul:bfloat16", "--k", "20000"], "too large for an exact construction"),
    (["--paths", "conv:float32"], "unsupported path"),
    (["--paths", "sdpa:bfloat16", "--k", "100"], "power of two"),
    (["--paths", "quant:affine-q4-g64", "--k", "100"], "multiple of the group size"),
    (["--paths", "matmul:float32", "--ts", "0"], "positive"),
])
def test_bad_input_exit_2(tmp_path, capsys, argv, words):
    code = main(["fingerprint", *argv, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


@pytest.mark.linux_cpu_reference
def test_cli_writes_result(tmp_path, capsys):
    out = tmp_path / "fp"
    code = main(["fingerprint", "--paths", "matmul:float32,emulated:splitk2:float32", "--k", "32", "--ts", "1,2",
                 "--n", "8", "--draw-k", "8", "--out", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "sequential" in text and "emulated:splitk2:float32" in text
    from gemmdrift import store
    r = store.read_result(out)
    assert r.kind == "fingerprint" and (out / "fingerprints.csv").is_file()
    assert (out / "fingerprint_vs_t.png").is_file() and (out / "trees_small_k.png").is_file()


@pytest.mark.linux_cpu_reference
def test_report_page_shows_fingerprints(tmp_path):
    from gemmdrift import report, store

    r = fp.measure(["matmul:float32", "emulated:splitk2:float32", "rms_norm:float32"], K=16, ts=[1, 2], N=8, draw_k=8)
    store.write_result(r, tmp_path)
    md = report.to_markdown(report.report_blocks(tmp_path))
    assert "Accumulation-order fingerprints" in md and "fingerprint_vs_t.png" in md
    assert "`emulated:splitk2:float32` (K=16): 1 distinct summation tree(s)" in md
    assert "sequential in 2 blocks of 8, blocks combined sequential" in md
    assert "`rms_norm:float32`: a sum of squares has no negative terms" in md and "not recoverable" in md


@pytest.mark.linux_cpu_reference
def test_asv_benchmark_tracks_the_measured_figures(monkeypatch):
    import math
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    monkeypatch.syspath_prepend(str(root))
    from benchmarks import bench_fingerprint as b

    monkeypatch.setattr(b, "FP_PATHS", ("matmul:float32", "emulated:splitk4:float32"))
    monkeypatch.setattr(b, "FP_K", 32)
    monkeypatch.setattr(b, "FP_TS", (1, 2))
    bench = b.Fingerprint()
    # The part of the shared setup (common.Probes; tests/test_benchmarks.py runs it whole) that is this benchmark's.
    figs = {"fingerprint": dict(fp.measure(list(b.FP_PATHS), K=b.FP_K, ts=b.FP_TS, N=b.FP_N,
                                           draw_k=0).figures)}
    for name in ("track_distinct_trees", "track_tree_id_t1", "track_tree_id_tmax", "track_unrecovered"):
        fn = getattr(b.Fingerprint, name)
        assert fn.unit and fn.version == "1"
    assert bench.track_distinct_trees(figs, "matmul:float32") == 1.0
    assert bench.track_unrecovered(figs, "matmul:float32") == 0.0
    a, s = bench.track_tree_id_t1(figs, "matmul:float32"), bench.track_tree_id_t1(figs, "emulated:splitk4:float32")
    assert a != s and a == float(int(a)) and a < 2 ** 48
    assert math.isnan(bench.track_distinct_trees(figs, "sum:bfloat16"))  # not measured: skipped, never 0
    assert "bench_fingerprint" in sys.modules["benchmarks.bench_fingerprint"].__name__
