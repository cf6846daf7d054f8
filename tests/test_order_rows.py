"""Order rows (issue 31): seeded operands on which every two values of an open axis give different bits, so a
check on a chip decides the axes that its captured rows (bf16 outputs) leave open.

No GPU here: the planted device (the replay of a chip under a chosen variant, labelled so) stands in for one. Each
test fails if the order rows do not separate the values (the check would find several identical) or if the check
or the calibration picks anything but the planted value.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from gemmdrift.replay import RECIPES, version_axes
from gemmdrift.replay import calib as RC
from gemmdrift.replay.check import check_replay, check_text, planted_device
from gemmdrift.replay.orderrows import PATHS as ORDER_PATHS, make_operands, order_case, order_cases, order_units

RECORDS = json.loads((Path(__file__).parent / "data" / "env_records.json").read_text())
CHIP, MLX = "M3 Max", "0.32.4"
ENV = {**RECORDS["M3 Max"], "mlx": MLX}
PATHS = ["dense:bfloat16", "quant:affine-q4-g64"]
# The (kernel, axis) pairs M3 Max dispatches on the order rows' calls: every open axis of its recipes, in bf16
# and in float16 alike.
CASES = {("gemv_wide", "dot4"), ("steel_gemm_splitk", "mma"), ("steel_gemm", "mma"), ("qmv", "simd_sum"),
         ("qmv", "contrib"), ("qmv_fast", "simd_sum"), ("qmv_fast", "contrib"), ("qmv_wide", "contract"),
         ("qmm_t_splitk", "mma"), ("qmm_t", "mma")}
AXES = {"dot4": RECIPES["gemv_wide"].axes["dot4"], "mma": RECIPES["steel_gemm"].axes["mma"],
        "simd_sum": RECIPES["qmv"].axes["simd_sum"], "contrib": RECIPES["qmv"].axes["contrib"],
        "contract": RECIPES["qmv_wide"].axes["contract"]}


@pytest.fixture(scope="module")
def cases():
    return order_cases(CHIP, mlx_version=MLX)  # every path: dense and q4, bf16 and float16


def test_every_pair_of_every_axis_is_separated_by_the_replays_own_variants(cases):
    assert set(ORDER_PATHS) == {"dense:bfloat16", "dense:float16", "quant:affine-q4-g64",
                                "quant:affine-q4-g64:float16"}
    half = {"dense:float16", "quant:affine-q4-g64:float16"}
    assert {(c.kernel, c.axis) for c in cases if c.path not in half} == CASES
    assert {(c.kernel, c.axis) for c in cases if c.path in half} == CASES
    for c in cases:
        assert c.complete, c.describe()
        assert c.dtype == ("float16" if c.path in half else "bfloat16")
        assert len(c.separated) == len(c.values) * (len(c.values) - 1) // 2
        assert c.T <= 16 and c.K <= 512 and c.N <= 512  # small: seconds on a GPU
    # The non-split qmm_t: K = 64 (one group), so the split-K rule of mlx 0.32.4 leaves one partition.
    qmm = [c for c in cases if c.kernel == "qmm_t"]
    assert {(c.path, c.T, c.K, c.N) for c in qmm} == {("quant:affine-q4-g64", 16, 64, 64),
                                                      ("quant:affine-q4-g64:float16", 16, 64, 64)}
    # Seeded on the host: the same bits again, rounded to bf16 (every value a bf16) or to float16.
    c = cases[0]
    x, ops = make_operands(c.path, c.T, c.K, c.N, seed=c.seed, style=c.style)
    assert np.array_equal(x.view(np.uint32), c.x.view(np.uint32)) and np.array_equal(ops.w, c.ops.w)
    assert not np.any(x.view(np.uint32) & 0xFFFF)
    for c in cases:
        if c.path in half:
            vals = [c.x] + ([c.ops.w] if c.ops.w is not None else list(c.ops.quant[1:3]))
            assert all(np.array_equal(v, v.astype(np.float16).astype(np.float32)) for v in vals), c.describe()


def test_float16_operands_never_overflow_an_output():
    # float16 tops out at 65504: every style's every seed on the quantized float16 path gives finite outputs
    # under every variant (an overflowed output is inf under each, and separates nothing).
    import warnings

    from gemmdrift.replay.orderrows import STYLES, case_plan, replay_all

    for T, K, N in ((1, 512, 64), (16, 64, 64)):
        plan = case_plan(CHIP, "quant:affine-q4-g64:float16", T, K, N, MLX)
        for seed in range(3):
            for style in STYLES:
                x, ops = make_operands("quant:affine-q4-g64:float16", T, K, N, seed=seed, style=style)
                with warnings.catch_warnings():
                    warnings.simplefilter("error")  # numpy's overflow in the cast to float16
                    outs = replay_all(plan, x, ops)
                assert all(np.isfinite(y.view(np.float32)).all() for y in outs.values()), (T, K, seed, style)


def test_the_quantized_matmul_is_reached_on_every_chip_whose_dispatch_has_it():
    # At mlx 0.32.4 the qmv batch limit is 13-14 on M1-M4 (the first qmm_t call is T=16), 32 on an Ultra and
    # 33 on M5 (T=33); M5's non-split qmm is NAX (no recipe: no case).
    def kernels(chip):
        return {(u.kernel, u.T, u.K) for u in order_units(chip, mlx_version=MLX, paths=["quant:affine-q4-g64"])
                if u.kernel.startswith("qmm")}

    assert kernels("M1") == kernels("M4") == {("qmm_t_splitk", 16, 256), ("qmm_t", 16, 64)}
    assert kernels("M1 Ultra") == kernels("M3 Ultra") == {("qmm_t_splitk", 33, 256), ("qmm_t", 33, 64)}
    assert kernels("M5") == kernels("M5 Max") == {("qmm_t_splitk", 33, 256)}


def test_a_pair_the_rows_cannot_separate_is_said():
    # Plain spread-out rows with one seed and no cancellation: qmv_wide's fma and none round to the same bf16.
    c = order_case(CHIP, "quant:affine-q4-g64", 2, 256, 64, "contract", mlx_version=MLX, tries=1, styles=["spread"])
    assert not c.complete and c.unseparated == [("fma", "none")] and "not separated: fma/none" in c.describe()


# An M1 Ultra as it would report itself (applegpu_g13d): its qmv batch limit is 32, its qmm calls T=33.
ULTRA = {**ENV, "device_name": "Apple M1 Ultra", "architecture": "applegpu_g13d"}


def _order_only(variant, dtype="bfloat16", *, env=ENV, chip=CHIP, checkpoint=None, device=None):
    # No captured projection: only the order rows are checked (the planted device replays `chip` under
    # `variant`), the quantized path in the model's dtype (as --dtype sets it), the dense one in the same dtype.
    import types

    lm = types.SimpleNamespace(description=types.SimpleNamespace(dtype=dtype))
    return check_replay(lm, {}, [], [f"dense:{dtype}", "quant:affine-q4-g64"], (1,), env=env, mlx_version=MLX,
                        order_rows=True, device=device or planted_device(chip, variant, MLX), checkpoint=checkpoint)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("axis, value", [(a, v) for a, vs in AXES.items() for v in vs])
def test_the_order_rows_find_the_planted_value_and_only_it(axis, value, dtype):
    result = _order_only(f"{axis}={value}", dtype)
    recs = [r for r in result.details["order_records"] if r["axis"] == axis]
    # Every kernel with the axis has its case (mma: both steel GEMMs, qmm_t_splitk and qmm_t), in the dtype.
    assert {r["kernel"] for r in recs} == {k for k, a in CASES if a == axis}
    assert {r["dtype"] for r in result.details["order_records"]} == {dtype}
    assert {r["path"] for r in recs if r["kernel"].startswith("q")} <= {
        "quant:affine-q4-g64" if dtype == "bfloat16" else "quant:affine-q4-g64:float16"}
    for r in recs:
        # Only variants with the planted value are identical, and the planted one (others at default) is.
        axes = version_axes(RECIPES[r["kernel"]], MLX).axes  # the release's one-value axes (qmm_t's partials)
        planted = ",".join(f"{a}={value if a == axis else v[0]}" for a, v in axes.items())
        assert planted in r["identical"] and r["values"] == [value] and r["decided"] == value, r
    record = RC.build(result)
    assert record["variant"][axis] == value
    for kernel, rec in record["kernels"].items():
        if axis in rec["axes"]:
            assert rec["axes"][axis]["measured"] == value and rec["axes"][axis]["order_rows"]["decided"] == value
    assert f"decides {axis}={value}" in check_text(result)


@pytest.mark.parametrize("value", AXES["mma"])
def test_an_ultras_qmm_order_rows_find_the_planted_mma(value):
    # M1 Ultra reaches the quantized matmul only at T=33: its qmm_t (K=64) and qmm_t_splitk cases find the value.
    result = _order_only(f"mma={value}", "float16", env=ULTRA, chip="M1 Ultra")
    recs = {r["kernel"]: r for r in result.details["order_records"] if r["kernel"].startswith("qmm")}
    assert set(recs) == {"qmm_t", "qmm_t_splitk"} and {r["T"] for r in recs.values()} == {33}
    assert all(r["decided"] == value and r["values"] == [value] for r in recs.values()), recs
    assert RC.build(result)["kernels"]["qmm_t"]["axes"]["mma"]["measured"] == value


def _without_seconds(result):
    return (result.tables["order_rows"].drop(columns="seconds").to_dict("records"),
            result.details["order_records"])


def test_an_interrupted_check_resumes_its_order_rows_without_recomputing_them(tmp_path, monkeypatch, capsys):
    # The order rows are checkpointed one case at a time (JSON, atomic): a check interrupted after three cases
    # reruns only the others and gives the result an uninterrupted check gives.
    from gemmdrift.replay import orderrows

    planted = "mma=H2,dot4=pairwise,simd_sum=xor1,contrib=mul-add,contract=none"
    whole = _order_only(planted, "float16")
    n = len(whole.details["order_records"])
    assert n == len(CASES)
    device, calls = planted_device(CHIP, planted, MLX), []

    def cut(ops, x):
        if len(calls) == 3:
            raise KeyboardInterrupt
        calls.append(x.shape)
        return device(ops, x)

    ckpt = tmp_path / "ckpt"
    with pytest.raises(KeyboardInterrupt):
        _order_only(planted, "float16", checkpoint=ckpt, device=cut)
    kept = sorted((ckpt / "order").glob("*.json"))
    assert len(kept) == 3 and not list((ckpt / "order").glob(".*"))  # three finished, no temporary left
    searched = []
    search = orderrows.order_case
    monkeypatch.setattr(orderrows, "order_case", lambda *a, **k: searched.append(a[1:]) or search(*a, **k))
    calls.clear()
    again = _order_only(planted, "float16", checkpoint=ckpt, device=lambda ops, x: calls.append(1) or device(ops, x))
    assert len(searched) == len(calls) == n - 3  # the three kept cases were neither searched nor run
    assert _without_seconds(again) == _without_seconds(whole)
    assert RC.build(again)["variant"] == RC.build(whole)["variant"] == dict(p.split("=") for p in planted.split(","))
    # A damaged unit is said, removed and recomputed; a unit of another search setting is not read.
    kept[0].write_text("{not json")
    stale = json.loads(kept[1].read_text())
    stale["key"]["tries"] += 1
    kept[1].write_text(json.dumps(stale))
    searched.clear()
    capsys.readouterr()
    third = _order_only(planted, "float16", checkpoint=ckpt)
    assert len(searched) == 2 and _without_seconds(third) == _without_seconds(whole)
    err = capsys.readouterr().err
    assert err.count("is corrupt") == 2 and "another order case or search" in err


def test_captured_rows_leave_axes_open_that_the_order_rows_decide(embedded):
    from gemmdrift import kernels
    from gemmdrift.prompts import builtin_text

    # Every axis away from its default: a captured row that cannot tell a value from the default shows it.
    planted = "mma=H3,dot4=pairwise,simd_sum=xor1,contrib=mul-add,contract=none"
    projs = kernels.projections(embedded, layers=[0], names=["k_proj", "gate_proj"])
    ids = embedded.tokenizer.encode(builtin_text("essay"))[:16]
    inputs = kernels.capture_inputs(embedded, ids, projs, max_rows=16)
    result = check_replay(embedded, inputs, projs, PATHS, (1, 2, 16), env=ENV, mlx_version=MLX, order_rows=True,
                          device=planted_device(CHIP, planted, MLX))
    captured = RC.build(dataclasses.replace(result, details={k: v for k, v in result.details.items()
                                                             if k != "order_records"}))
    open_axes = {(k, a) for k, r in captured["kernels"].items() for a, x in r["axes"].items()
                 if x["measured"] is None and "cannot tell them apart" in x["why"]}
    # Today's gap, on 16 captured rows: of the nine (kernel, axis) pairs checked only steel_gemm's mma is measured;
    # six more are open because several values are identical in every cell (qmv_fast is not dispatched here).
    assert open_axes == {("gemv_wide", "dot4"), ("qmv_wide", "contract"), ("qmv", "simd_sum"), ("qmv", "contrib"),
                         ("steel_gemm_splitk", "mma"), ("qmm_t_splitk", "mma")}, captured
    assert captured["variant"] == {"mma": "H3"}
    want = dict(p.split("=") for p in planted.split(","))
    record = RC.build(result)
    assert record["variant"] == want  # with the order rows: every axis, the planted value
    for k, a in open_axes:
        x = record["kernels"][k]["axes"][a]
        assert x["measured"] == want[a] and x["why"].startswith("decided by the order rows"), x
    assert "order rows" in RC.summary(record)


def test_replay_check_runs_the_order_rows_on_this_device_and_the_flag_skips_them(tmp_path, capsys):
    # mlx's own kernels here (the CPU) against M3's recipes: a prediction; the order rows run through
    # OrderOperands.real (mx.matmul and mx.quantized_matmul) and are reported apart.
    from gemmdrift import cli

    small = ["--chip", "M3", "--layers", "0", "--projections", "q_proj", "--paths",
             "dense:bfloat16,quant:affine-q4-g64", "--ts", "1", "--rows", "2", "--tokens", "8"]
    assert cli.main(["replay", "check", *small, "--json", "--out", str(tmp_path / "a")]) == 0
    got = json.loads(capsys.readouterr().out)
    assert {(r["kernel"], r["axis"]) for r in got["order_records"]} >= {("gemv_wide", "dot4"), ("qmv", "contrib")}
    assert all(r["T"] <= 16 and r["K"] <= 512 for r in got["order_records"])
    assert cli.main(["replay", "check", *small, "--no-order-rows", "--out", str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "order rows" not in out and ("identical" in out or "nearest" in out)
    # --dtype float16 (mlxcel's measurements are float16 q4 g64): the quantized order rows run in float16 too.
    assert cli.main(["replay", "check", *small[:6], "--paths", "quant:affine-q4-g64", "--ts", "1", "--rows", "2",
                     "--tokens", "8", "--dtype", "float16", "--json", "--out", str(tmp_path / "c")]) == 0
    got = json.loads(capsys.readouterr().out)
    assert {(r["kernel"], r["path"], r["dtype"]) for r in got["order_records"]} >= {
        ("qmv", "quant:affine-q4-g64:float16", "float16"), ("qmm_t", "quant:affine-q4-g64:float16", "float16")}
    assert {r["path"] for r in got["order_records"]} == {"quant:affine-q4-g64:float16"}
