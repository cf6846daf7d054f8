"""The one-second gate (issue 29, item 6): per op, a T-row call against T single-row calls, byte for byte.

Known answers: the differing-bytes statistic against a byte loop on planted arrays; a planted op that moves one
element by one ULP; a planted "device" (the replay of an M1's kernels, whose T=1 and T>1 calls add in different
orders) that must show differing bytes; this CPU's real result (every op bit-identical across T, dense and
quantized); and bad input, which is one line before any work.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
import pytest

from gemmdrift import metrics
from gemmdrift.attribution import primitives
from gemmdrift.errors import GemmdriftError
from gemmdrift.attribution.primitives_operands import model_ops, quant_for, seeded
from gemmdrift.attribution.primitives_ops import Probe, parity

SMALL = "shape:gemma3-270m"  # the embedded Gemma's shapes (K=640), no GGUF needed


def _byte_loop(a: np.ndarray, b: np.ndarray) -> list[int]:
    """Differing bytes per row (axis 0), by a plain loop over Python bytes: the independent count."""
    return [sum(x != y for x, y in zip(ra.tobytes(), rb.tobytes())) for ra, rb in zip(a, b)]


# ------------------------------------------------------------------------------------------------ the statistic


def test_differing_bytes_counts_a_one_ulp_move_as_one_or_two_bytes_of_a_bf16():
    rng = np.random.default_rng(0)
    chain = rng.integers(0x3F00, 0x4000, size=(4, 16), dtype=np.uint16)  # bf16 words
    chain[2, 5] = 0x3F12  # +1 ULP stays in the low byte: 1 byte differs
    chain[3, 7] = 0x3FFF  # +1 ULP carries into the high byte (0x3FFF -> 0x4000): 2 bytes differ
    block = chain.copy()
    block[2, 5] += 1
    block[3, 7] += 1
    got = metrics.differing_bytes(block, chain)
    assert got.tolist() == _byte_loop(block, chain) == [0, 0, 1, 2]
    # The same arrays as float32 values of bf16: the bytes of the bf16 storage, the same counts.
    as_f32 = lambda u: (u.astype(np.uint32) << 16).view(np.float32)  # noqa: E731
    assert metrics.differing_bytes(as_f32(block), as_f32(chain), dtype="bfloat16").tolist() == [0, 0, 1, 2]
    assert primitives.differing_bytes is metrics.differing_bytes


def test_differing_bytes_along_another_axis_and_its_refusals():
    chain = np.zeros((1, 3, 5, 2), dtype=np.float32)
    block = chain.copy()
    block[0, 1, 2, 0] = np.nextafter(np.float32(0), np.float32(1))  # the smallest subnormal: one byte of four
    assert metrics.differing_bytes(block, chain, axis=2).tolist() == [0, 0, 1, 0, 0]
    assert metrics.position_bytes(block, axis=2).shape == (5, 3 * 2 * 4)
    with pytest.raises(ValueError):
        metrics.differing_bytes(block, chain[:, :2])
    with pytest.raises(ValueError):
        metrics.differing_bytes(block, chain.astype(np.float64))


def test_a_planted_op_that_moves_one_element_by_one_ulp_is_seen_at_that_position_only():
    import mlx.core as mx

    x = seeded((6, 32), "bfloat16", "planted")
    xm = mx.array(x).astype(mx.bfloat16)[None]

    def block(T):
        y = xm[:, :T] * 2
        if T > 1:  # the T-row call moves position 1, element 3, by one ULP (bits + 1)
            bits = np.array(y.view(mx.uint16))
            bits[0, 1, 3] += 1
            y = mx.array(bits).view(mx.bfloat16)
        return y

    rows = parity(Probe(lambda t: xm[:, t:t + 1] * 2, block, axis=1), [1, 2, 4, 6])
    expect_bits = np.array((xm * 2).view(mx.uint16))[0]
    moved = expect_bits.copy()
    moved[1, 3] += 1
    n = _byte_loop(moved[1:2], expect_bits[1:2])[0]
    assert n in (1, 2)
    assert [r["equal"] for r in rows] == [True, False, False, False]
    assert rows[0]["differing_bytes"] == [0]
    for r in rows[1:]:
        assert r["differing_bytes"] == [0, n] + [0] * (r["T"] - 2)
        assert r["bytes_per_position"] == 32 * 2


def test_seeded_operands_are_portable_draws_rounded_on_the_host():
    a = seeded((3, 7), "bfloat16", "salt", std=0.5)
    b = seeded((3, 7), "bfloat16", "salt", std=0.5)
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))  # the same bits, whatever was drawn before
    raw = np.random.default_rng([primitives.SEED, zlib.crc32(b"salt")]).standard_normal((3, 7), dtype=np.float32)
    raw *= np.float32(0.5)
    assert np.array_equal(a, metrics.round_to(raw, "bfloat16").astype(np.float32))  # ties to even, as metrics does
    assert not np.array_equal(a, seeded((3, 7), "bfloat16", "other", std=0.5))


# ------------------------------------------------------------------------------------------------ the model's ops


def test_the_ops_are_read_from_the_config_at_the_models_own_shapes():
    m = model_ops(SMALL)
    by = {(o.name, o.kind): o for o in m.ops}
    assert m.architecture == "gemma3_text" and m.dtype == "bfloat16" and m.n_layers == 18
    assert by[("self_attn.q_proj", "linear")].shape == {"K": 640, "N": 1024, "N_full": 1024}
    assert by[("mlp.down_proj", "linear")].shape == {"K": 2048, "N": 640, "N_full": 640}
    assert by[("lm_head", "linear")].shape == {"K": 640, "N": 4096, "N_full": 262144}
    # A per-head norm in both layouts an attention may call it in (Gemma 4's (B,T,H,D), Gemma 3's (B,H,T,D)).
    assert sorted(o.shape["layout"] for o in m.ops if o.name == "self_attn.q_norm") == ["HTD", "THD"]
    assert {o.shape["heads"] for o in m.ops if o.name == "self_attn.q_norm"} == {4}
    assert by[("sdpa", "sdpa")].shape == {"heads": 4, "kv_heads": 1, "D": 256, "keys": 64}
    # RoPE: the sliding layers' base 10000 and the global layers' (every sixth) 1e6, two ops.
    ropes = sorted((o.layers, o.params["base"]) for o in m.ops if o.kind == "rope")
    assert ropes == [((0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 13, 14, 15, 16), 10000.0), ((5, 11, 17), 1e6)]
    big = model_ops("shape:gemma4-31b", max_rows=8)
    heads = {(o.kind, o.shape.get("D")) for o in big.ops if o.kind in ("rope", "sdpa")}
    assert heads == {("rope", 256), ("rope", 512), ("sdpa", 256), ("sdpa", 512)}  # sliding and global geometry
    assert all(o.shape["N"] <= 8 for o in big.ops if o.kind == "linear")


def test_quantization_as_it_ships_per_module():
    block = {"group_size": 64, "bits": 4, "mode": "affine",
             "model.layers.0.mlp.down_proj": {"group_size": 64, "bits": 8}, "model.layers.1.mlp.down_proj": False}
    assert quant_for(block, "model.layers.0.mlp.down_proj", 2048) == {"bits": 8, "group_size": 64, "mode": "affine"}
    assert quant_for(block, "model.layers.1.mlp.down_proj", 2048) is None
    assert quant_for(block, "model.layers.2.mlp.down_proj", 2048) == {"bits": 4, "group_size": 64, "mode": "affine"}
    assert quant_for(block, "model.layers.2.mlp.down_proj", 100) is None  # not a multiple of the group: dense
    assert quant_for(None, "model.layers.2.mlp.down_proj", 2048) is None


@pytest.fixture
def quantized_dir(tmp_path):
    from gemmdrift.model import SHAPES

    config = {**SHAPES["gemma3-270m"], "torch_dtype": "bfloat16",
              "quantization": {"group_size": 64, "bits": 4, "mode": "affine",
                               "model.layers.0.mlp.down_proj": {"group_size": 64, "bits": 8}}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


# ------------------------------------------------------------------------------------------------ real results


@pytest.mark.linux_cpu_reference
def test_on_this_cpu_every_op_is_bit_identical_across_t_dense():
    g = primitives.gate(SMALL, ts=range(1, 9), fail_closed=False)
    t = g.table
    assert g.error is None and len(t) == 20 * 8  # 20 distinct ops (q/k_norm in two layouts), T = 1..8
    assert t["equal"].all() and (t["max_differing_bytes"] == 0).all()
    assert all(n == [0] * T for n, T in zip(t["differing_bytes"], t["T"]))
    assert g.ok and g.exact(7) and g.exact_width == 7 and not g.exact(8)  # T=9 was not measured: no
    assert g.device["backend"] == "cpu" and g.device["device"].startswith("Device(cpu")
    q = t[t["op"] == "self_attn.q_proj"]
    assert set(q["bytes_per_position"]) == {1024 * 2} and set(q["shape"]) == {"K=640 N=1024"}


@pytest.mark.linux_cpu_reference
def test_on_this_cpu_quantized_matmuls_are_bit_identical_across_t(quantized_dir):
    g = primitives.gate(str(quantized_dir), ts=[1, 2, 5], ops=["linear"], max_rows=256, lm_head_rows=256,
                        fail_closed=False)
    t = g.table
    down = t[t["op"] == "mlp.down_proj"]
    assert set(zip(down["layers"], down["quant"])) == {("0", "affine-q8-g64"), ("1-17", "affine-q4-g64")}
    assert set(t["quant"]) == {"affine-q4-g64", "affine-q8-g64"}
    assert t["equal"].all() and (t["max_differing_bytes"] == 0).all()
    assert g.exact(1) and not g.ok  # T=3 and 4 were not measured: width 4 is not certified


def test_a_planted_device_with_another_reduction_order_for_t_above_1_shows_differing_bytes():
    """replay:M1 computes each call as an M1 would: gemv at T=1, steel GEMM above (other adds, other bits).

    The float32 sums differ in their last bits; after rounding to bf16 only a byte or two of q_proj's 2048 per
    position moves (whether any does is draw-dependent, as lablup/mlxcel notes): the full N=1024 is needed to see it.
    """
    from gemmdrift.replay.paths import plan_for, run_plan
    from gemmdrift.attribution.primitives_ops import _linear_operands

    g = primitives.gate(SMALL, ts=[1, 2, 4], ops=["q_proj"], kernels="replay:M1", fail_closed=False)
    t = g.table.set_index("T")
    assert t.loc[1, "equal"] and t.loc[1, "differing_bytes"] == [0]
    assert not t.loc[2, "equal"] and not t.loc[4, "equal"]
    assert set(t["kernels"]) == {"replay:M1 (prediction)"} and not g.ok and g.exact_width == 0
    # The counts, computed independently from the recipes' outputs: a byte loop over the bf16 words.
    op = next(o for o in model_ops(SMALL).ops if o.name == "self_attn.q_proj")
    x, w, _ = _linear_operands(op, "bfloat16", 4, primitives.SEED)
    run = lambda xs: run_plan(plan_for("M1", "matmul", T=len(xs), K=640, N=1024, dtype="bfloat16"), xs,  # noqa: E731
                              dtype="bfloat16", w=w).y
    singles = np.concatenate([run(x[i:i + 1]) for i in range(4)])
    words = lambda y: (np.ascontiguousarray(y).view(np.uint32) >> 16).astype(np.uint16)  # noqa: E731
    assert t.loc[4, "differing_bytes"] == _byte_loop(words(run(x)), words(singles))
    assert sum(t.loc[2, "differing_bytes"]) > 0 and sum(t.loc[4, "differing_bytes"]) > 0


def test_the_replay_of_this_cpu_is_this_cpus_bits():
    """replay:cpu is the reference recipe of this machine's kernel: the same operands give mlx's very bits."""
    g = primitives.gate(SMALL, ts=[1, 3], ops=["k_proj"], kernels="replay:cpu", max_rows=32, fail_closed=False)
    assert g.table["equal"].all()


def test_the_31b_shapes_dispatch_free_ops_and_a_slice():
    g = primitives.gate("shape:gemma4-31b", ts=[1, 2, 3], ops=["norm", "rope", "sdpa", "q_proj"], max_rows=8,
                        fail_closed=False)
    t = g.table
    assert set(t["kind"]) == {"norm", "rope", "sdpa", "linear"}
    assert "K=5376 N=8 (first 8 of 8192)" in set(t["shape"])
    assert t["equal"].all() and g.error is None


# ------------------------------------------------------------------------------------------------ bad input, fail closed


@pytest.mark.parametrize("kw, needle", [
    ({"ops": ["nonesuch"]}, "unknown op 'nonesuch'"),
    ({"ts": [0, 1]}, "block width 0 is out of range"),
    ({"ts": range(1, 10_000)}, "out of range"),
    ({"ts": []}, "no block width"),
    ({"kernels": "replay:Z80"}, "unknown replay chip"),
    ({"kernels": "bogus"}, "expected replay:"),
])
def test_bad_input_is_one_line_and_the_gate_fails_closed(kw, needle):
    with pytest.raises(GemmdriftError, match=needle):
        primitives.plan(SMALL, **{"ts": range(1, 3), **kw})
    g = primitives.gate(SMALL, **{"ts": range(1, 3), **kw})
    assert g.error and needle.split("'")[0] in g.error and not g.ok and not g.exact(0) and g.exact_width is None


def test_a_directory_without_config_and_an_unknown_architecture(tmp_path):
    with pytest.raises(GemmdriftError, match="no config.json"):
        primitives.plan(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "nonesuch", "hidden_size": 8}))
    with pytest.raises(GemmdriftError, match="unknown architecture 'nonesuch'"):
        primitives.plan(str(tmp_path))
    assert primitives.speculative_exact(str(tmp_path), 2) is False
    assert primitives.speculative_exact(SMALL, -1) is False


def test_exact_needs_every_width_up_to_k_plus_1_measured_and_equal():
    import pandas as pd

    def gate_of(rows):
        return primitives.Gate(pd.DataFrame(rows, columns=primitives.COLUMNS), sorted({r["T"] for r in rows}), {}, {})

    row = dict.fromkeys(primitives.COLUMNS, "")
    ok = [{**row, "op": "a", "T": T, "equal": True} for T in (1, 2, 3)]
    assert gate_of(ok).exact(2) and not gate_of(ok).exact(3)
    assert not gate_of([r for r in ok if r["T"] != 2]).exact(2)  # T=2 not measured: not exact
    bad = ok + [{**row, "op": "b", "T": 1, "equal": True}, {**row, "op": "b", "T": 2, "equal": True},
                {**row, "op": "b", "T": 3, "equal": False}]
    g = gate_of(bad)
    assert g.exact(1) and not g.exact(2) and g.exact_width == 1
    assert g.first_unequal()[["op", "T"]].values.tolist() == [["b", 3]]


# ------------------------------------------------------------------------------------------------ cross-check


def _local_drift_below_the_window(lm, k: int) -> dict[int, float]:
    """frac_differ of each layer's local drift, decode vs verify:k, over positions below the sliding window
    (stack's local mode: every layer fed the reference's own input)."""
    from gemmdrift.measure.stack import measure_stack

    from test_taps_stack import TOKENS

    n = lm.description.sliding_window  # 8 tokens: every position below the window
    r = measure_stack(lm, TOKENS[:n], ["prefill:2,decode", f"prefill:2,verify:{k}"], split=2, local=True)
    t = r.tables["stack"]
    t = t[(t["mode"] == "local") & (t["metric"] == "frac_differ") & t["tap"].str.startswith("layer ")]
    return {int(tap.split()[1]): float(v) for tap, v in zip(t["tap"], t["value"])}


@pytest.mark.linux_cpu_reference
def test_an_op_the_gate_calls_equal_carries_no_local_drift_below_the_window():
    """The issue's cross-check, against stack's local mode per layer: every op of every layer the gate calls
    bit-equal for T = 1..k+1 ⇒ each layer's local drift under decode vs verify:k is exactly 0 below the window.
    A planted row-dependent norm (one ULP on multi-row calls) must turn both: the gate sees it, and so does
    the local drift, at every layer (all layers carry that norm)."""
    from mlx_lm.models import gemma3_text

    from conftest import TINY_CONFIG, make_tiny

    k = 2
    g = primitives.gate(dict(TINY_CONFIG), ts=range(1, k + 2), fail_closed=False)
    assert g.exact(k)
    local = _local_drift_below_the_window(make_tiny(), k)
    assert len(local) == TINY_CONFIG["num_hidden_layers"] and all(v == 0 for v in local.values()), local

    import mlx.core as mx

    plain = gemma3_text.RMSNorm.__call__

    def one_ulp_on_blocks(self, x):
        y = plain(self, x)
        rows = x.shape[2] if x.ndim == 4 else x.shape[1]  # (B, H, L, D), as gemma3_text calls q/k_norm, or (B, L, D)
        if rows > 1 and y.dtype == mx.bfloat16:  # a multi-row call: every output's last bit flipped
            y = (y.view(mx.uint16) ^ 1).view(mx.bfloat16)
        return y

    gemma3_text.RMSNorm.__call__ = one_ulp_on_blocks
    try:
        planted = primitives.gate(dict(TINY_CONFIG), ts=range(1, k + 2), ops=["norm"], fail_closed=False)
        drift = _local_drift_below_the_window(make_tiny(), k)
    finally:
        gemma3_text.RMSNorm.__call__ = plain
    unequal = planted.first_unequal()
    assert not planted.exact(k) and set(unequal["T"]) == {2}
    assert all(v > 0 for v in drift.values()), drift


# ------------------------------------------------------------------------------------------------ the CLI


def _cli(argv, capsys):
    """`gemmdrift attribute --primitives ...` as the CLI runs it: (exit status, stdout, stderr); the output
    directory is a fresh temporary one unless ``--out`` is given (attribute's default is results/attribute)."""
    import tempfile

    from gemmdrift.cli import main

    if "--out" not in argv:
        argv = [*argv, "--out", str(Path(tempfile.mkdtemp()) / "o")]
    code = main(["attribute", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_the_flags_reuse_a_parsers_own_and_run_is_none_without_primitives():
    import argparse

    from gemmdrift.cli import primitives as primitives_cli

    p = argparse.ArgumentParser()
    p.add_argument("--model", default="elsewhere")
    p.add_argument("--out", default="results/x")
    primitives_cli.add_arguments(p)  # --model and --out are the parser's own: not added twice
    args = p.parse_args([])
    assert args.model == "elsewhere" and args.ts == "1-8" and not args.primitives
    assert primitives_cli.run(args) is None


@pytest.mark.parametrize("argv, needle", [
    (["--ops", "nonesuch"], "unknown op 'nonesuch'"),
    (["--ts", "0-3"], "block width 0 is out of range"),
    (["--ts", "1-9999"], "out of range (1..512)"),
    (["--ts", "8-1"], "the range is reversed"),
    (["--ts", "a"], "expected numbers"),
    (["--kernels", "replay:Z80"], "unknown replay chip"),
    (["--lm-head-rows", "-3"], "--lm-head-rows"),
    (["--operand-seed", "x"], "--operand-seed"),
])
def test_bad_input_on_the_command_line_is_one_line_and_exit_2(argv, needle, capsys, monkeypatch, tmp_path):
    from gemmdrift.attribution import primitives_ops

    monkeypatch.setattr(primitives_ops, "parity", lambda *a, **k: pytest.fail("computed despite bad input"))
    code, out, err = _cli(["--primitives", "--model", SMALL, *argv, "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and out == "" and needle in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o").exists()  # refused before anything was written


def test_no_config_and_unknown_architecture_on_the_command_line(tmp_path, capsys):
    code, out, err = _cli(["--primitives", "--model", str(tmp_path)], capsys)
    assert code == 2 and "no config.json" in err and len(err.strip().splitlines()) == 1
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "nonesuch"}))
    code, out, err = _cli(["--primitives", "--model", str(tmp_path)], capsys)
    assert code == 2 and "unknown architecture 'nonesuch'" in err and out == ""


@pytest.mark.linux_cpu_reference
def test_the_command_prints_the_table_writes_json_and_csv(tmp_path, capsys):
    code, out, err = _cli(["--primitives", "--model", SMALL, "--ops", "q_proj,sdpa", "--ts", "1-3",
                           "--out", str(tmp_path / "o")], capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("primitives gate: shape:gemma3-270m (gemma3_text, 18 layers, bfloat16)")
    q = next(line for line in lines if line.startswith("self_attn.q_proj"))
    assert q.split()[-3:] == ["=", "=", "="] and "K=640 N=1024" in q and " 2048 " in q
    # --ops: the verdict is of the ops checked, not of speculative decoding (PROBE-DEFECTS-3 D14)
    assert "the 2 ops checked (2 of 17: self_attn.q_proj, sdpa) bit-equal for T=1..3" in lines[-1]
    assert "speculative decoding" not in lines[-1]
    rec = json.loads((tmp_path / "o" / "primitives.json").read_text())
    assert rec["ok"] and rec["exact_width"] == 2 and rec["device"]["backend"] == "cpu"
    row = rec["rows"][0]
    assert row["differing_bytes"] == [0] and row["command"].startswith(
        "gemmdrift attribute --primitives --model shape:gemma3-270m --ops self_attn.q_proj --ts 1")
    csv = (tmp_path / "o" / "primitives.csv").read_text().splitlines()
    assert len(csv) == 1 + 2 * 3  # two ops, three widths
    code, out, _ = _cli(["--primitives", "--model", SMALL, "--ops", "k_proj", "--ts", "1-2", "--json"], capsys)
    assert code == 0 and json.loads(out)["rows"][1]["differing_bytes"] == [0, 0]


def test_a_differing_op_in_the_text_and_fail_unless_exact(capsys):
    code, out, err = _cli(["--primitives", "--model", SMALL, "--ops", "q_proj", "--ts", "1,2,4",
                           "--kernels", "replay:M1", "--fail-unless-exact"], capsys)
    assert code == 1, err
    q = next(line for line in out.splitlines() if line.startswith("self_attn.q_proj"))
    assert q.split()[-3] == "=" and q.split()[-2].endswith("B") and q.split()[-1].endswith("B")
    assert "first difference: self_attn.q_proj (layers 0-17) at T=2" in out


@pytest.mark.linux_cpu_reference
def test_the_gate_benchmark_tracks_the_verdict():
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parent.parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    from benchmarks import bench_primitives

    b = bench_primitives.PrimitivesGate()
    b.setup()
    assert b.track_primitives_exact_width() == 7.0  # every op bit-equal for T = 1..8 on this CPU
    assert b.track_primitives_rows_unequal() == 0.0
    for fn in (b.track_primitives_exact_width, b.track_primitives_rows_unequal):
        assert fn.unit and fn.version == "1"


def test_several_seeds_each_checked_and_equal_only_if_equal_on_all(monkeypatch):
    """An op is equal only if it is on every seed's draws: a planted op that differs on one seed's draws only
    (as a one-byte difference can) makes the whole row unequal, and the gate not exact."""
    from gemmdrift.attribution import primitives_ops

    real = primitives_ops.parity

    def differs_on_seed_7(probe, ts):
        rows = real(probe, ts)
        return [{**r, "equal": False, "differing_bytes": [1] * r["T"]} if r["T"] > 1 and _seed[0] == 7 else r
                for r in rows]

    _seed = [None]
    real_probe = primitives_ops.probe_for

    def probe_for(op, dtype, width, *, kernels=None, seed=1165):
        _seed[0] = seed
        return real_probe(op, dtype, width, kernels=kernels, seed=seed)

    monkeypatch.setattr(primitives, "parity", differs_on_seed_7)
    monkeypatch.setattr(primitives, "probe_for", probe_for)
    g = primitives.gate(SMALL, ts=[1, 2], ops=["k_norm"], seed=[1165, 7], fail_closed=False)
    assert sorted(set(g.table["seed"])) == [7, 1165] and len(g.table) == 2 * 2 * 2  # layouts x seeds x T
    assert not g.exact(1) and g.exact(0)
    from gemmdrift.view.primitives import text

    line = next(x for x in text(g).splitlines() if x.startswith("self_attn.k_norm"))
    assert line.split()[-2:] == ["=", "1B"]
    assert primitives.gate(SMALL, ts=[1, 2], ops=["k_norm"], seed=[1165], fail_closed=False).exact(1)  # seed 7 not asked


def test_a_multimodal_config_nests_its_text_model_and_its_quantization_paths():
    from gemmdrift.model import SHAPES

    cfg = {"model_type": "gemma3", "text_config": dict(SHAPES["gemma3-270m"]), "vision_config": {},
           "torch_dtype": "float16", "quantization": {"group_size": 64, "bits": 4,
                                                      "language_model.model.layers.3.mlp.down_proj": {"bits": 8}}}
    m = model_ops(cfg)
    assert (m.architecture, m.dtype, m.n_layers) == ("gemma3", "float16", 18)
    down = {o.layers: o.quant_label for o in m.ops if o.name == "mlp.down_proj"}
    assert down == {(3,): "affine-q8-g64", tuple(i for i in range(18) if i != 3): "affine-q4-g64"}


def test_the_command_computes_in_the_configs_dtype_unless_told(tmp_path, capsys):
    from gemmdrift.model import SHAPES

    (tmp_path / "config.json").write_text(json.dumps({**SHAPES["gemma3-270m"], "torch_dtype": "float16"}))
    code, out, err = _cli(["--primitives", "--model", str(tmp_path), "--ops", "k_norm", "--ts", "1-2", "--json"],
                          capsys)
    assert code == 0, err
    assert {r["dtype"] for r in json.loads(out)["rows"]} == {"float16"}
    code, out, err = _cli(["--primitives", "--model", str(tmp_path), "--ops", "k_norm", "--ts", "1-2", "--json",
                           "--dtype", "bfloat16"], capsys)
    assert {r["dtype"] for r in json.loads(out)["rows"]} == {"bfloat16"}


def _gate_verdicts(g) -> dict[tuple[str, int], bool]:
    """(op, layer) -> equal at every T of the gate (layer -1: the model's head), from the gate's table."""
    out: dict[tuple[str, int], bool] = {}
    for (op, layers), rows in g.table.groupby(["op", "layers"]):
        ids = [-1] if layers == "head" else [i for part in layers.split(",") for i in (
            range(int(part.split("-")[0]), int(part.split("-")[-1]) + 1))]
        for i in ids:
            out[(op, i)] = out.get((op, i), True) and bool(rows["equal"].all())
    return out


def _attribution_ops(lm, k: int):
    from gemmdrift.attribution.attribute import attribute

    from test_taps_stack import TOKENS

    n = lm.description.sliding_window  # every position below the window
    r = attribute(lm, TOKENS[:n], ["prefill:2,decode", f"prefill:2,verify:{k}"], split=2, counterfactual=[])
    return r.tables["ops"]


def _matched(ops, verdicts, n_layers):
    """attribute's (layer, op) rows with the gate's verdict for the same op and layer: its rope calls
    (self_attn.rope, #1 for the keys) are the gate's rope, its head (lm_head, norm) the gate's head rows; the
    residual adds are not a gate op."""
    out = []
    for _, r in ops.iterrows():
        name = "rope" if r["op"].startswith("self_attn.rope") else r["op"]
        layer = -1 if name in ("lm_head", "norm") or int(r["layer"]) >= n_layers else int(r["layer"])
        if (name, layer) in verdicts:
            out.append((name, layer, verdicts[(name, layer)], int(r["positions_differ"]), float(r["frac_differ"])))
        else:
            assert name.startswith("residual"), f"attribute's op {r['op']} (layer {r['layer']}) has no gate row"
    return out


@pytest.mark.linux_cpu_reference
def test_an_op_the_gate_calls_equal_carries_no_local_drift_in_the_whole_model_attribution():
    """The issue's cross-check against the whole-model attribution (gemmdrift.attribution.attribute, local drift per op
    and layer): below the window, every (layer, op) the gate calls bit-equal for T = 1..k+1 carries exactly 0
    local drift under decode vs verify:k. A planted row-dependent norm (one ULP on multi-row calls) turns both
    at once: the gate calls exactly the norms unequal, and the attribution finds drift in exactly those."""
    import mlx.core as mx
    from mlx_lm.models import gemma3_text

    from conftest import TINY_CONFIG, make_tiny

    k, L = 2, TINY_CONFIG["num_hidden_layers"]
    g = primitives.gate(dict(TINY_CONFIG), ts=range(1, k + 2), fail_closed=False)
    rows = _matched(_attribution_ops(make_tiny(), k), _gate_verdicts(g), L)
    assert len({(n, i) for n, i, *_ in rows}) >= 15 * L  # every projection, norm, rope and sdpa of every layer
    assert all(equal and differ == 0 and frac == 0 for _, _, equal, differ, frac in rows)

    plain = gemma3_text.RMSNorm.__call__

    def one_ulp_on_blocks(self, x):
        y = plain(self, x)
        rows = x.shape[2] if x.ndim == 4 else x.shape[1]  # (B, H, L, D), as gemma3_text calls q/k_norm, or (B, L, D)
        if rows > 1 and y.dtype == mx.bfloat16:  # a multi-row call: the last bit flipped
            y = (y.view(mx.uint16) ^ 1).view(mx.bfloat16)
        return y

    gemma3_text.RMSNorm.__call__ = one_ulp_on_blocks
    try:
        g = primitives.gate(dict(TINY_CONFIG), ts=range(1, k + 2), fail_closed=False)
        rows = _matched(_attribution_ops(make_tiny(), k), _gate_verdicts(g), L)
    finally:
        gemma3_text.RMSNorm.__call__ = plain
    unequal = {(n, i) for n, i, equal, *_ in rows if not equal}
    drifting = {(n, i) for n, i, _, differ, _ in rows if differ > 0}
    assert unequal and unequal == drifting
    assert {n for n, _ in unequal} == {"input_layernorm", "self_attn.q_norm", "self_attn.k_norm",
                                       "post_attention_layernorm", "pre_feedforward_layernorm",
                                       "post_feedforward_layernorm", "norm"}


@pytest.mark.linux_cpu_reference
def test_the_gate_names_speculative_decoding_only_for_every_op_and_says_the_cache_is_outside_it():
    """PROBE-DEFECTS-4 item 7: the gate ended "speculative decoding with up to 3 drafted tokens is exact on this
    device" though the cache, which makes decode and verification differ past the window, is outside what it
    sees; and with --ops it still gave a verdict on speculative decoding (exact up to k drafted tokens)."""
    from gemmdrift.attribution.primitives import gate
    from gemmdrift.view.primitives import CACHE_SCOPE, text

    last = lambda **kw: text(gate(SMALL, [1, 2], **kw)).splitlines()[-1]  # noqa: E731
    every = last()
    assert every.startswith("verdict: every op of the model's layer and head (17 ops) bit-equal for T=1..2 at the "
                            "shapes in the table: speculative decoding with up to 1 drafted token is exact on this "
                            "device as far as these ops go; ") and every.endswith(CACHE_SCOPE)
    assert "the KV cache is outside this gate's scope" in CACHE_SCOPE
    names = list(dict.fromkeys(gate(SMALL, [1]).table["op"]))
    for kw in (dict(ops=names), dict(ops=["sdpa"]), dict(ops=["q_proj"], kernels="replay:M1")):
        line = last(**kw)  # --ops, even naming every op: the ops checked, never speculative decoding
        assert "speculative" not in line and "drafted" not in line, (kw, line)
        assert line.startswith(f"verdict: the {len(kw['ops']) if kw['ops'] is names else 1} op"), line
    assert "first difference: self_attn.q_proj (layers 0-17) at T=2" in last(ops=["q_proj"], kernels="replay:M1")
    replayed = last(kernels="replay:M1")  # every op, but one differs: the ops, not a speculative width
    assert "first difference" in replayed and "speculative" not in replayed and "drafted" not in replayed
    from gemmdrift.attribution import primitives

    assert primitives.speculative_exact(SMALL, 1) is True  # every op at its shapes, bit-equal on this CPU
    assert primitives.speculative_exact(SMALL, 1, ops=["sdpa"]) is False  # some ops only: no yes
    assert primitives.speculative_exact(SMALL, 1, max_rows=8) is False
