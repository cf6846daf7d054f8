"""Dispatch per chip: the chip of an environment record, and `gemmdrift dispatch` against the mlx source.

The expected kernels below were worked out by hand from the conditions in the
mlx source (ml-explore/mlx, tags v0.31.1 (CUDA only), v0.31.2 = 68cf2fddd8de, v0.32.0 = 7a1d4f5c12ac,
v0.32.1 = 3a6219917e45, v0.30.5 = adcbb91a9e23):
mlx/backend/metal/matmul.cpp (Matmul::eval_gpu, gemv_wide_config,
steel_matmul_axpby, steel_gemm_splitk_axpby), mlx/backend/metal/quantized.cpp
(get_qmv_batch_limit, dispatch_qmv, qmv, qmm_splitk, qmm),
mlx/backend/metal/scaled_dot_product_attention.cpp (use_fallback, eval_gpu),
mlx/backend/cuda/gemms/gemv.cu (can_use_gemv) and
mlx/backend/cuda/quantized/quantized.cpp with qmm/qmm.cu (supports_*). They
are written as literal runs of T, not computed by gemmdrift.dispatch, and each
block's comment gives the arithmetic. The environment records are constructed
in envinfo's format (tests/data/env_records.json says how): pure functions
over records, no backend is faked.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gemmdrift import cli, dispatch
from gemmdrift.machine import platforminfo
from gemmdrift.dispatch import chip_from_env, chip_named, choose
from gemmdrift.machine.envinfo import metal_generation
from gemmdrift.kernels import reference_backend, plot_thresholds

RECORDS = json.loads((Path(__file__).parent / "data" / "env_records.json").read_text())
CHIP_RECORDS = ("M1", "M2 Ultra", "M3 Max", "M4", "M5", "sm80", "sm90")


def runs(*spec):
    """runs((1, 1, "gemv"), (2, 33, "steel_gemm")) -> {1: "gemv", 2: "steel_gemm", ...}."""
    return {t: k for a, b, k in spec for t in range(a, b + 1)}


# (chip record, mlx, case) -> expected kernel per T = 1..33 (kernel names as mlx spells them).
DENSE_640_2048 = ("matmul", ("--dtype", "bfloat16", "--K", "640", "--N", "2048"))
DENSE_2048_1024 = ("matmul", ("--dtype", "bfloat16", "--K", "2048", "--N", "1024"))
Q4_640_2048 = ("quantized_matmul", ("--K", "640", "--N", "2048", "--bits", "4", "--group-size", "64"))
Q4_5376_21504 = ("quantized_matmul", ("--K", "5376", "--N", "21504", "--bits", "4", "--group-size", "64"))
Q8_768_2048 = ("quantized_matmul", ("--K", "768", "--N", "2048", "--bits", "8", "--group-size", "64"))
SDPA_256 = ("sdpa", ("--head-dim", "256", "--heads", "4", "--kv-heads", "1", "--kv-len", "1024"))
SDPA_128 = ("sdpa", ("--head-dim", "128", "--heads", "8", "--kv-heads", "2", "--kv-len", "4096"))

# Dense K=640 < N=2048: never split-K (needs K >= max(M, N)); NAX split-K needs K >= 3 max or max <= 1024.
# gemv_wide (v0.32.1): gen >= 15, passes = (T+4)/5 <= 3; k_lanes 32 for one pass (T <= 5), else 16 (N > 64).
GEN15_640 = runs((1, 1, "gemv"), (2, 15, "gemv_wide"), (16, 33, "steel_gemm"))
# Dense K=2048, N=1024: SIMD split-K (K >= max(M, N), ceil(T/16)*64 tiles <= 1024, K/16 >= 8);
# partitions min(max(2, next_pow2(128 / (ceil(T/32) * 32))), 32): 4 for T <= 32, 2 for T = 33.
SPLITK_2048 = runs((1, 1, "gemv"), (2, 33, "steel_gemm_splitk"))
GEN15_2048 = runs((1, 1, "gemv"), (2, 15, "gemv_wide"), (16, 33, "steel_gemm_splitk"))
# Quantized 4-bit gs64 K=640, N=2048 (D, O <= 2048). qmv_fast needs K % 512: no. qmm_splitk: 512 / (64 N-tiles
# * ceil(T/32)) = 8 (T <= 32) or 4, capped at K/64 = 10, lowered until K % (split * 64) == 0: 5, or 2 at T = 33.
EXPECTED = {
    ("M1", "0.32.1", DENSE_640_2048): runs((1, 1, "gemv"), (2, 33, "steel_gemm")),  # gen 13: no gemv_wide
    ("M2 Ultra", "0.32.1", DENSE_640_2048): runs((1, 1, "gemv"), (2, 33, "steel_gemm")),
    ("M3 Max", "0.32.1", DENSE_640_2048): GEN15_640,
    ("M4", "0.32.1", DENSE_640_2048): GEN15_640,
    ("M5", "0.32.1", DENSE_640_2048): runs((1, 1, "gemv"), (2, 15, "gemv_wide"), (16, 33, "steel_gemm_nax")),
    ("M3 Max", "0.31.2", DENSE_640_2048): runs((1, 1, "gemv"), (2, 33, "steel_gemm")),  # gemv_wide from v0.32.1
    ("M5", "0.31.2", DENSE_640_2048): runs((1, 1, "gemv"), (2, 33, "steel_gemm_nax")),
    ("M1", "0.32.1", DENSE_2048_1024): SPLITK_2048,
    ("M2 Ultra", "0.32.1", DENSE_2048_1024): SPLITK_2048,
    ("M3 Max", "0.32.1", DENSE_2048_1024): GEN15_2048,
    ("M4", "0.32.1", DENSE_2048_1024): GEN15_2048,
    # NAX: Case 1 excluded (!use_nax, v0.31.2+); Case 2 needs K >= 3*1024 or K > 2*1024: no -> fused NAX.
    ("M5", "0.32.1", DENSE_2048_1024): runs((1, 1, "gemv"), (2, 15, "gemv_wide"), (16, 33, "steel_gemm_nax")),
    ("M3 Max", "0.31.2", DENSE_2048_1024): SPLITK_2048,
    # get_qmv_batch_limit v0.32.1: M1 14, M2 Ultra 32, M3 Max/M4 13, M5 33; qmv_wide (affine) needs gen >= 15.
    ("M1", "0.32.1", Q4_640_2048): runs((1, 13, "qmv"), (14, 33, "qmm_t_splitk")),
    ("M2 Ultra", "0.32.1", Q4_640_2048): runs((1, 31, "qmv"), (32, 33, "qmm_t_splitk")),
    ("M3 Max", "0.32.1", Q4_640_2048): runs((1, 1, "qmv"), (2, 12, "qmv_wide"), (13, 33, "qmm_t_splitk")),
    ("M4", "0.32.1", Q4_640_2048): runs((1, 1, "qmv"), (2, 12, "qmv_wide"), (13, 33, "qmm_t_splitk")),
    ("M5", "0.32.1", Q4_640_2048): runs((1, 1, "qmv"), (2, 32, "qmv_wide"), (33, 33, "qmm_t_splitk")),
    # v0.32.0: limits 14 (gen 13/14), 32 ('d'), 18 (others); qmv_wide exists. v0.31.2: no qmv_wide.
    ("M3 Max", "0.32.0", Q4_640_2048): runs((1, 1, "qmv"), (2, 17, "qmv_wide"), (18, 33, "qmm_t_splitk")),
    ("M3 Max", "0.31.2", Q4_640_2048): runs((1, 17, "qmv"), (18, 33, "qmm_t_splitk")),
    ("M5", "0.31.2", Q4_640_2048): runs((1, 17, "qmv"), (18, 33, "qmm_t_splitk")),
    ("M1", "0.31.2", Q4_640_2048): runs((1, 13, "qmv"), (14, 33, "qmm_t_splitk")),
    # v0.30.5: no qmm_splitk, so qmm_t past the limit (18 on M3 Max).
    ("M3 Max", "0.30.5", Q4_640_2048): runs((1, 17, "qmv"), (18, 33, "qmm_t")),
    # Gemma 4 31B 4-bit, K=5376, N=21504 (larger than 4096): limits M1 6, M2 Ultra 12, M3/M4/M5 13 (v0.32.1);
    # split = 512 / 672 tiles -> 1, so qmm; qmm_nax on NAX with K % 64 == 0. v0.32.0: M5 limit 10.
    ("M1", "0.32.1", Q4_5376_21504): runs((1, 5, "qmv"), (6, 33, "qmm_t")),
    ("M2 Ultra", "0.32.1", Q4_5376_21504): runs((1, 11, "qmv"), (12, 33, "qmm_t")),
    ("M3 Max", "0.32.1", Q4_5376_21504): runs((1, 1, "qmv"), (2, 12, "qmv_wide"), (13, 33, "qmm_t")),
    ("M4", "0.32.1", Q4_5376_21504): runs((1, 1, "qmv"), (2, 12, "qmv_wide"), (13, 33, "qmm_t")),
    ("M5", "0.32.1", Q4_5376_21504): runs((1, 1, "qmv"), (2, 12, "qmv_wide"), (13, 33, "qmm_t_nax")),
    ("M5", "0.32.0", Q4_5376_21504): runs((1, 1, "qmv"), (2, 9, "qmv_wide"), (10, 33, "qmm_t_nax")),
    # 8-bit K=768: qmv_fast_k_alignment(8) = 4 * 2 * 32 = 256 from v0.32.1; K % 512 before.
    ("M1", "0.32.1", Q8_768_2048): runs((1, 13, "qmv_fast"), (14, 33, "qmm_t_splitk")),
    ("M1", "0.32.0", Q8_768_2048): runs((1, 13, "qmv"), (14, 33, "qmm_t_splitk")),
    # sdpa, head dim 256, 4 heads / 1 KV head, 1024 keys, causal: vector kernel for T <= 8 (T * gqa <= 32),
    # 2-pass on 's'/'d' from 1024 keys; head dim 256 beyond 8 queries is unfused (NAX split needs T >= 1024).
    ("M1", "0.32.1", SDPA_256): runs((1, 8, "sdpa_vector"), (9, 33, "sdpa_unfused")),
    ("M2 Ultra", "0.32.1", SDPA_256): runs((1, 8, "sdpa_vector_2pass"), (9, 33, "sdpa_unfused")),
    ("M3 Max", "0.32.1", SDPA_256): runs((1, 8, "sdpa_vector_2pass"), (9, 33, "sdpa_unfused")),
    ("M4", "0.32.1", SDPA_256): runs((1, 8, "sdpa_vector"), (9, 33, "sdpa_unfused")),
    ("M5", "0.32.1", SDPA_256): runs((1, 8, "sdpa_vector"), (9, 33, "sdpa_unfused")),
    # head dim 128, GQA 4, 4096 keys: 2-pass everywhere (GQA and >= 4096 keys); full kernel past 8 queries,
    # the NAX one on M5 (v0.32.1: not head dim 72/80).
    ("M1", "0.32.1", SDPA_128): runs((1, 8, "sdpa_vector_2pass"), (9, 33, "sdpa_full")),
    ("M3 Max", "0.32.1", SDPA_128): runs((1, 8, "sdpa_vector_2pass"), (9, 33, "sdpa_full")),
    ("M5", "0.32.1", SDPA_128): runs((1, 8, "sdpa_vector_2pass"), (9, 33, "sdpa_full_nax")),
    # CUDA: gemv for M == 1 with b transposed, else cuBLASLt. Quantized K=640, N=2048 4-bit gs64: qmm_sm90
    # needs group_size >= K (no); qmm_sm80 (N % 128, K % 64, bf16, 4 bits) with qmv below 8 rows.
    ("sm80", "0.32.1", DENSE_640_2048): runs((1, 1, "cuda_gemv"), (2, 33, "cublaslt")),
    ("sm90", "0.32.1", DENSE_640_2048): runs((1, 1, "cuda_gemv"), (2, 33, "cublaslt")),
    ("sm80", "0.32.1", Q4_640_2048): runs((1, 7, "cuda_qmv"), (8, 33, "cuda_qmm")),
    ("sm90", "0.32.1", Q4_640_2048): runs((1, 7, "cuda_qmv"), (8, 33, "cuda_qmm")),
    ("sm90", "0.30.5", Q4_640_2048): runs((1, 33, "unsupported")),  # "QMM NYI" for affine before v0.31.1
    ("sm80", "0.31.1", Q4_640_2048): runs((1, 33, "cuda_qmv")),  # v0.31.1: only qmm_sm90 or qmv, any M
}


def _dispatch_json(capsys, chip: str, mlx: str, op: str, flags, ts: str = "1-33") -> list[dict]:
    assert cli.main(["dispatch", "--chip", chip, "--op", op, *flags, "--ts", ts, "--mlx", mlx, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("key", list(EXPECTED), ids=lambda k: f"{k[0]}-{k[1]}-{k[2][0]}-{'x'.join(k[2][1][1::2][:3])}")
def test_dispatch_command_agrees_with_the_mlx_source(key, capsys):
    name, mlx, (op, flags) = key
    arch = RECORDS[name]["architecture"]  # the record's architecture string is what the user would pass
    got = {r["T"]: r["kernel"] for r in _dispatch_json(capsys, arch, mlx, op, flags)}
    assert got == EXPECTED[key]


def test_dispatch_parameters_match_worked_examples(capsys):
    # ../shared/METAL-ORDERS.md §1 (read independently from matmul.cpp at 846d176): N=1024, K=2048 split-K
    # P=4 (partition 512) for T=16..32 and P=2 (1024) at T=33; N=1024, K=5376: T=16 P=16 (336), T=33 P=8 (672).
    recs = {r["T"]: r["params"] for r in _dispatch_json(capsys, "M3 Max", "0.32.1", *DENSE_2048_1024, ts="16,32,33")}
    assert [(recs[t]["partitions"], recs[t]["partition_size"]) for t in (16, 32, 33)] == [(4, 512), (4, 512), (2, 1024)]
    recs = {r["T"]: r["params"] for r in _dispatch_json(capsys, "M3 Max", "0.32.1", "matmul",
                                                       ["--K", "5376", "--N", "1024"], ts="16,33")}
    assert [(recs[t]["partitions"], recs[t]["partition_size"]) for t in (16, 33)] == [(16, 336), (8, 672)]
    # gemv_wide: 32 K-lanes for one pass (T <= 5), 16 beyond; gemv bm 8 from N = 4096.
    recs = {r["T"]: r for r in _dispatch_json(capsys, "M4", "0.32.1", "matmul", ["--K", "640", "--N", "262144"],
                                              ts="1,5,6,15")}
    assert recs[1]["params"]["bm"] == 8 and recs[1]["source"].startswith("mlx/backend/metal/matmul.cpp")
    assert [recs[t]["params"]["k_lanes"] for t in (5, 6, 15)] == [32, 16, 16]
    assert recs[6]["label"] == "gemv_wide k_lanes=16"
    # qmm_splitk at K=640, N=2048: split 5 (partition 128) up to 32 rows, 2 at 33.
    recs = {r["T"]: r["params"] for r in _dispatch_json(capsys, "M1", "0.32.1", *Q4_640_2048, ts="14,33")}
    assert [(recs[t]["split_k"], recs[t]["partition_size"]) for t in (14, 33)] == [(5, 128), (2, 320)]
    # sdpa_vector_2pass on 's': 64 blocks, 128 once gqa * q_len > 4 with more than 1024 keys (Gemma 3: gqa 4),
    # so decode (T=1) and a 2-token verify split the keys differently.
    recs = {r["T"]: r["params"] for r in _dispatch_json(capsys, "M3 Max", "0.32.1", "sdpa",
                                                       ("--head-dim", "256", "--kv-len", "2048"), ts="1,2")}
    assert [recs[t]["blocks"] for t in (1, 2)] == [64, 128]


EXPECTED_CHIPS = {  # record -> (name, backend, gen, size, nax)
    "M1": ("M1", "metal", 13, "g", False), "M2 Ultra": ("M2 Ultra", "metal", 14, "d", False),
    "M3 Max": ("M3 Max", "metal", 15, "s", False), "M4": ("M4", "metal", 16, "g", False),
    "M5": ("M5", "metal", 17, "g", True), "M5 macOS 26.1": ("M5", "metal", 17, "g", False),
    "M5 Max, no macOS recorded": ("M5 Max", "metal", 17, "s", None),
    "sm80": ("sm80", "cuda", 8, "g", False), "sm90": ("sm90", "cuda", 9, "g", False),
    "cpu Linux x86_64": ("cpu-linux-x86", "cpu", 0, "g", False),
    "cpu on a Mac, mlx 0.30.6 (GPU name recorded by the device_info default-argument bug)":
        ("cpu-other", "cpu", 0, "g", False),
    "cpu Linux aarch64": ("cpu-other", "cpu", 0, "g", False),
}


@pytest.mark.parametrize("name", list(EXPECTED_CHIPS))
def test_chip_from_recorded_environment(name):
    chip = chip_from_env(RECORDS[name])
    assert (chip.name, chip.backend, chip.gen, chip.size, chip.nax) == EXPECTED_CHIPS[name]
    if name in CHIP_RECORDS:  # the record and the chip's name dispatch alike
        named = chip_named(name)
        assert (named.gen, named.size, named.nax) == (chip.gen, chip.size, chip.nax)


def test_unknown_architecture_is_read_as_mlx_reads_it_not_guessed():
    # A Metal name that is no chip model is read as mlx's device.cpp reads any name (issue 54: generation 0 here),
    # labelled as the device reported itself; unreadable CUDA or other backends stay "no prediction".
    rec = RECORDS["unknown Metal architecture"]
    assert (chip_from_env(rec).gen, chip_from_env(rec).name) == (0, "Apple M9 (applegpu_x1)")
    assert chip_from_env({"backend": "cuda", "architecture": ""}) is None
    assert chip_from_env({"backend": "gpu", "architecture": "x"}) is None
    target, _, chip, origin = reference_backend(rec)
    assert chip.gen == 0 and "mlx 0.32.1 reads 'applegpu_x1' as generation 0" in origin
    import pandas as pd

    df = pd.DataFrame([{"layer": 0, "projection": "mlp.up_proj", "path": "model", "dtype": "bfloat16", "quant": "",
                        "emulated": False, "synthetic": True, "inputs": "synthetic", "K": 640, "N": 2048,
                        "T": t, "metric": "max_ulp", "value": 0.0} for t in (1, 2, 16)])
    assert plot_thresholds(df, rec)[0] == {"mlp.up_proj": [(2, "steel GEMM", "matmul")]}  # mlx's reading, not M3 Max's
    marks, origin = plot_thresholds(df, RECORDS["M1"])  # M1: steel from T=2, never gemv_wide
    assert origin.startswith("Metal, M1") and marks["mlp.up_proj"] == [(2, "steel GEMM", "matmul")]
    marks, origin = plot_thresholds(df, RECORDS["M4"])
    assert (2, "gemv_wide k_lanes=32", "matmul") in marks["mlp.up_proj"]


def test_nax_needs_macos_26_2_and_is_unknown_without_it():
    m5 = chip_from_env(RECORDS["M5"])
    old_os = chip_from_env(RECORDS["M5 macOS 26.1"])
    unknown = chip_from_env(RECORDS["M5 Max, no macOS recorded"])
    kw = dict(op="matmul", T=16, K=640, N=2048, dtype="bfloat16", mlx_version="0.32.1")
    assert choose(m5, **kw).kernel == "steel_gemm_nax" and choose(old_os, **kw).kernel == "steel_gemm"
    c = choose(unknown, **kw)  # the non-NAX kernel, with the NAX alternative named
    assert c.kernel == "steel_gemm" and "NAX unknown" in c.note and "steel_gemm_nax" in c.note
    assert chip_from_env({**RECORDS["M5"], "mlx": "0.29.4"}).nax is False  # no NAX kernels before 0.30.0
    # float32 stays off NAX with MLX_ENABLE_TF32=0 (use_nax needs enable_tf32() for float32).
    assert choose(m5, **{**kw, "dtype": "float32"}).kernel == "steel_gemm_nax"
    assert choose(m5, **{**kw, "dtype": "float32"}, tf32=False).kernel == "steel_gemm"


def test_cpu_rule_is_labelled_by_its_platform():
    kw = dict(op="matmul", T=4, K=640, N=2048, dtype="bfloat16", mlx_version="0.32.4")
    assert choose(chip_from_env(RECORDS["cpu Linux x86_64"]), **kw).kernel == "cpu_simd_gemm"
    assert choose(chip_from_env(RECORDS["cpu Linux x86_64"]), **{**kw, "dtype": "float32"}).kernel == "cpu_cblas_sgemm"
    mac = RECORDS["cpu on a Mac, mlx 0.30.6 (GPU name recorded by the device_info default-argument bug)"]
    c = choose(chip_from_env(mac), **kw)
    assert c.kernel == "cpu_not_read" and "Darwin arm64" in c.note
    assert dispatch.kernel_for("cpu", "matmul", 4, mlx_version="0.32.4", chip=chip_from_env(mac), K=640,
                               N=2048) == "cpu (not read)"
    _, _, _, origin = reference_backend(mac)
    assert origin.startswith("Metal (reference)") and "not known to be row-invariant" in origin
    _, _, _, origin = reference_backend(RECORDS["cpu Linux x86_64"])
    assert "not known" not in origin


@pytest.mark.parametrize("argv,words", [
    (["--chip", "M9", "--K", "640", "--N", "2048"], "unknown chip 'M9'"),
    (["--chip", "M1"], "needs --K"),
    (["--chip", "M1", "--K", "640", "--N", "2048", "--ts", "5-2"], "reversed"),
    (["--chip", "M1", "--K", "640", "--N", "2048", "--ts", "0"], "at least 1"),
    (["--chip", "M1", "--K", "640", "--N", "2048", "--mlx", "0.26.3"], "--mlx 0.26.3: older than the first tag read"),
    (["--chip", "M1", "--K", "640", "--N", "2048", "--mlx", "0.32.1", "--vs", "0.25.0"],
     "--vs 0.25.0: older than the first tag read (v0.26.5)"),
    (["--chip", "M1", "--K", "640", "--N", "2048", "--mlx", "latest"], "cannot read mlx version"),
    (["--chip", "M1", "--op", "quantized_matmul", "--K", "640", "--N", "2048", "--mode", "int3"],
     "unknown quantization mode"),
])
def test_dispatch_bad_input_is_one_line_exit_2(argv, words, capsys):
    assert cli.main(["dispatch", *argv, "--mlx", "0.32.1"] if "--mlx" not in argv else ["dispatch", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and len(err.splitlines()) == 1


def test_dispatch_unknown_op_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["dispatch", "--chip", "M1", "--op", "conv", "--K", "1", "--N", "1"])
    assert e.value.code == 2 and len(capsys.readouterr().err.strip().splitlines()) == 1


def test_dispatch_text_names_the_source_per_t(capsys):
    assert cli.main(["dispatch", "--chip", "M3", "--K", "640", "--N", "2048", "--ts", "1-3", "--mlx", "0.31.2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("M3 (applegpu_g15g, gen 15, base/Pro, no NAX)")
    body = [ln for ln in lines if ln.startswith("T=")]
    assert len(body) == 3 and "gemv" in body[0] and "mlx/backend/metal/matmul.cpp" in body[0]
    assert "steel_gemm " in body[1]  # no gemv_wide before v0.32.1


def test_environment_record_helpers():
    assert platforminfo.device_memory({"memory_size": 8, "total_memory": 9}, "metal") == 8
    assert platforminfo.device_memory({"memory_size": 8, "total_memory": 9}, "cuda") == 9
    assert platforminfo.device_memory({"total_memory": 9}, "cpu") is None
    assert platforminfo.parse_nvidia_smi("580.65.06, 9.0\n580.65.06, 9.0\n") == {
        "cuda_driver": "580.65.06", "compute_capability": "9.0"}
    assert platforminfo.parse_nvidia_smi("NVIDIA-SMI has failed") == {}
    assert metal_generation("applegpu_g15g") == "M3 (base/Pro)" and metal_generation("applegpu_g14d") == "M2 (Ultra)"
    wheels = platforminfo.backend_wheels()  # this machine: the mlx-cpu wheel, with its tag
    assert all(set(w) == {"version", "tag"} for w in wheels.values())


def test_device_record_asks_device_info_for_the_device_in_use(monkeypatch):
    # mlx 0.30.4-0.31.1 bind device_info's default argument at import: the record must pass the device.
    import mlx.core as mx

    from gemmdrift.machine import envinfo

    real, calls = mx.device_info, []
    monkeypatch.setattr(mx, "device_info", lambda *a, **k: calls.append(a) or real(*a, **k))  # a spy on the real call
    rec = envinfo.device_record()
    assert calls == [(mx.default_device(),)]
    # memory from the backend's own key (None on the CPU, which reports none)
    assert rec["memory_bytes"] == platforminfo.device_memory(dict(real(mx.default_device())), rec["backend"])


def test_choices_compare_and_hash_by_value():
    m1 = chip_named("M1")
    kw = dict(op="matmul", K=2048, N=1024, dtype="bfloat16", mlx_version="0.32.1")
    same = {choose(m1, T=t, **kw) for t in range(2, 33)}  # one split-K configuration (P=4) for T = 2..32
    assert len(same) == 1 and choose(m1, T=33, **kw) not in same
    with pytest.raises(TypeError):
        next(iter(same)).params["partitions"] = 2  # read-only


def test_dispatch_from_a_recorded_environment(tmp_path, capsys):
    # A results directory (meta.json with "env") and a bare record both name the chip and the mlx release.
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "meta.json").write_text(json.dumps({"format": 1, "kind": "kernels", "env": RECORDS["M5"],
                                                            "inputs": {}}))
    (tmp_path / "m1.json").write_text(json.dumps(RECORDS["M1"]))  # mlx 0.31.2 recorded
    recs = _dispatch_json_env(capsys, str(tmp_path / "run"), *DENSE_640_2048)
    assert {r["T"]: r["kernel"] for r in recs} == EXPECTED[("M5", "0.32.1", DENSE_640_2048)]
    assert recs[0]["chip"] == "M5" and recs[0]["mlx"] == "0.32.1"
    recs = _dispatch_json_env(capsys, str(tmp_path / "m1.json"), *Q4_640_2048)
    assert {r["T"]: r["kernel"] for r in recs} == EXPECTED[("M1", "0.31.2", Q4_640_2048)]
    (tmp_path / "odd.json").write_text(json.dumps({**RECORDS["unknown Metal architecture"], "mlx": "0.30.5",
                                                   "architecture": "g1"}))  # undefined in mlx before 0.31.0
    for path, words in ((tmp_path / "odd.json", "recorded as it reports itself"),
                        (tmp_path / "missing", "no such file"), (tmp_path, "no meta.json or env.json")):
        assert cli.main(["dispatch", "--env", str(path), "--K", "640", "--N", "2048"]) == 2
        err = capsys.readouterr().err.strip()
        assert words in err and len(err.splitlines()) == 1


def _dispatch_json_env(capsys, path: str, op: str, flags) -> list[dict]:
    assert cli.main(["dispatch", "--env", path, "--op", op, *flags, "--ts", "1-33", "--json"]) == 0
    return json.loads(capsys.readouterr().out)
