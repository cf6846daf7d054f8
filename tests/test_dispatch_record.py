"""A run record decides its own prediction (issue 53, items 4 and 22): `dispatch --env` and the replay use every
setting the record holds (MLX_ENABLE_TF32, MLX_METAL_GPU_ARCH, the macOS version) and say which decided a kernel;
float32 on NAX is said to be truncated, as TF32 on CUDA is.

Expected kernels are worked out by hand from mlx's source: matmul.cpp's
``use_nax = is_nax_available() && !complex && (env::enable_tf32() || dtype != float32)`` (v0.30.0 on),
CUDA's ``CUBLAS_COMPUTE_32F_FAST_TF32`` unless MLX_ENABLE_TF32=0, and ``env::metal_gpu_arch()`` in
Device::Device from v0.31.0 (#3176). For x (2, 640) @ W.T with W (2048, 640): tm * tn = 1 * 128 <= 1024 but
K = 640 < max(M, N) = 2048, so no SIMD split-K; the fused steel GEMM, NAX or not.
"""

from __future__ import annotations

import json

import pytest

from gemmdrift import cli
from gemmdrift.dispatch import chip_from_env, choose

M5_TF32_OFF = {"backend": "metal", "architecture": "applegpu_g17g", "macos": "26.2", "mlx": "0.32.1",
               "env": {"MLX_ENABLE_TF32": "0"}}
H100_TF32_OFF = {"backend": "cuda", "architecture": "sm_90", "compute_capability_major": 9,
                 "compute_capability_minor": 0, "mlx": "0.32.1", "env": {"MLX_ENABLE_TF32": "0"}}
M3_AS_M5 = {"backend": "metal", "architecture": "applegpu_g15g", "macos": "26.2", "mlx": "0.31.2",
            "env": {"MLX_METAL_GPU_ARCH": "applegpu_g17g"}}
SHAPE = ["--K", "640", "--N", "2048"]


def _env_json(tmp_path, capsys, record, *flags) -> list[dict]:
    path = tmp_path / "env.json"
    path.write_text(json.dumps(record))
    assert cli.main(["dispatch", "--env", str(path), *SHAPE, "--ts", "1-3", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_m5_record_with_tf32_off_runs_float32_on_steel_gemm(tmp_path, capsys):
    """Bug: an M5 record with MLX_ENABLE_TF32=0 was predicted steel_gemm_nax for float32 at T=2."""
    recs = {r["T"]: r for r in _env_json(tmp_path, capsys, M5_TF32_OFF, "--dtype", "float32")}
    assert [recs[t]["kernel"] for t in (1, 2, 3)] == ["gemv", "steel_gemm", "steel_gemm"]
    assert "MLX_ENABLE_TF32=0 decided: steel_gemm, not steel_gemm_nax" in recs[2]["note"]
    assert "TF32" not in recs[2]["note"].replace("MLX_ENABLE_TF32", "")  # no truncation claimed
    # bfloat16 goes to NAX whatever the variable says (T=16: past gemv_wide's 14 rows): not named there.
    c = choose(chip_from_env(M5_TF32_OFF), "matmul", T=16, K=640, N=2048, dtype="bfloat16", mlx_version="0.32.1")
    assert c.kernel == "steel_gemm_nax" and "MLX_ENABLE_TF32" not in c.note


def test_h100_record_with_tf32_off_computes_true_float32(tmp_path, capsys):
    """Bug: an H100 record with MLX_ENABLE_TF32=0 was predicted TF32 compute for float32."""
    recs = {r["T"]: r for r in _env_json(tmp_path, capsys, H100_TF32_OFF, "--dtype", "float32")}
    assert recs[2]["kernel"] == "cublaslt" and recs[2]["params"] == {"compute": "32F"}
    assert "MLX_ENABLE_TF32=0 decided: compute=32F, not compute=32F_FAST_TF32" in recs[2]["note"]
    assert "computed as TF32" not in recs[2]["note"]
    on = {**H100_TF32_OFF, "env": {"MLX_ENABLE_TF32": None}}  # unset: mlx's default 1
    recs = {r["T"]: r for r in _env_json(tmp_path, capsys, on, "--dtype", "float32")}
    assert recs[2]["params"] == {"compute": "32F_FAST_TF32"} and "computed as TF32" in recs[2]["note"]


def test_recorded_gpu_arch_override_decides_the_chip_and_says_so(tmp_path, capsys):
    """MLX_METAL_GPU_ARCH in a record (mlx >= 0.31.0) is the chip mlx dispatched for, named where it decided."""
    recs = {r["T"]: r for r in _env_json(tmp_path, capsys, M3_AS_M5)}
    assert recs[1]["chip"] == "M5" and recs[2]["kernel"] == "steel_gemm_nax"
    assert "MLX_METAL_GPU_ARCH=applegpu_g17g decided: steel_gemm_nax, not steel_gemm" in recs[2]["note"]
    assert cli.main(["dispatch", "--env", str(tmp_path / "env.json"), *SHAPE, "--ts", "2"]) == 0
    assert "settings: macOS 26.2 (NAX from 26.2), MLX_METAL_GPU_ARCH=applegpu_g17g" in capsys.readouterr().out
    # mlx 0.30.6 has no env::metal_gpu_arch(): the device's own architecture, and the override said ignored.
    old = chip_from_env({**M3_AS_M5, "mlx": "0.30.6"})
    assert old.name == "M3" and not old.settings and "MLX_METAL_GPU_ARCH=applegpu_g17g ignored" in old.note
    assert chip_from_env({**M3_AS_M5, "mlx": "0.31.0"}).name == "M5"


def test_the_macos_version_is_named_where_it_decided():
    """A record's macOS version decides NAX (26.2 on): named where NAX changed the kernel."""
    kw = dict(op="matmul", T=16, K=640, N=2048, dtype="bfloat16", mlx_version="0.32.1")
    on = choose(chip_from_env({**M5_TF32_OFF, "env": {}}), **kw)
    assert on.kernel == "steel_gemm_nax" and "macOS 26.2 (NAX from 26.2) decided: steel_gemm_nax, not steel_gemm" \
        in on.note
    off = choose(chip_from_env({**M5_TF32_OFF, "macos": "26.1", "env": {}}), **kw)
    assert off.kernel == "steel_gemm" and "macOS 26.1 (NAX from 26.2) decided: steel_gemm, not steel_gemm_nax" \
        in off.note


def test_replay_plans_with_the_records_tf32():
    """The replay's plan for a record's chip follows its MLX_ENABLE_TF32: float32 at T=2 on an M5 with the variable
    0 is steel_gemm (no float32 recipe: said as such), not the NAX kernel whose order is unknown."""
    from gemmdrift.errors import GemmdriftError
    from gemmdrift.replay.paths import plan_for

    with pytest.raises(GemmdriftError, match="steel_gemm has no float32 recipe"):
        plan_for(chip_from_env(M5_TF32_OFF), "matmul", T=2, K=640, N=2048, dtype="float32", mlx_version="0.32.1")
    with pytest.raises(GemmdriftError, match="dispatches steel_gemm_nax"):
        plan_for(chip_from_env({**M5_TF32_OFF, "env": {}}), "matmul", T=2, K=640, N=2048, dtype="float32",
                 mlx_version="0.32.1")


@pytest.mark.parametrize("version, nax", [("0.29.4", False), ("0.30.0", True), ("0.30.5", True), ("0.31.0", True)])
def test_nax_float32_truncation_starts_with_the_nax_kernels(version, nax):
    """Item 22: float32 goes to NAX (relaxed-precision matmul2d) from v0.30.0, the first release with NAX (#2772),
    not from 0.31.0; the rules are modelled from 0.30.5, so 0.30.5 is the first release predicted, and truncation
    is said wherever float32 runs on NAX."""
    chip = chip_from_env({**M5_TF32_OFF, "mlx": version, "env": {}})
    assert chip.nax is nax
    if version >= "0.30.5":
        c = choose(chip, "matmul", T=2, K=640, N=2048, dtype="float32", mlx_version=version)
        assert c.kernel == "steel_gemm_nax" and "float32 computed as TF32 on NAX" in c.note
        q = choose(chip, "quantized_matmul", T=64, K=640, N=2048, dtype="float32", mlx_version=version)
        assert q.kernel == "qmm_t_nax" and "float32 computed as TF32 on NAX" in q.note
        b = choose(chip, "matmul", T=2, K=640, N=2048, dtype="bfloat16", mlx_version=version)
        assert "TF32" not in b.note


def test_no_tf32_flag_is_named_too(capsys):
    assert cli.main(["dispatch", "--chip", "M5", *SHAPE, "--dtype", "float32", "--ts", "2", "--mlx", "0.32.1",
                     "--no-tf32"]) == 0
    out = capsys.readouterr().out
    assert "steel_gemm " in out and "MLX_ENABLE_TF32=0 (--no-tf32) decided: steel_gemm, not steel_gemm_nax" in out
    assert cli.main(["dispatch", "--chip", "M5", *SHAPE, "--dtype", "float32", "--ts", "2", "--mlx", "0.32.1"]) == 0
    assert "float32 computed as TF32 on NAX" in capsys.readouterr().out


@pytest.mark.parametrize("record, mode", [
    ({"backend": "metal", "architecture": "applegpu_g17g", "macos": "26.1", "mlx": "0.32.4", "env": {}}, "float32"),
    ({"backend": "metal", "architecture": "applegpu_g17g", "macos": "26.2", "mlx": "0.32.4", "env": {}}, "tf32"),
    ({**M3_AS_M5, "env": {"MLX_METAL_GPU_ARCH": "applegpu_g17g"}}, "tf32"),  # mlx 0.31.2 reads the override
    ({**M3_AS_M5, "mlx": "0.30.6"}, "float32"),  # mlx 0.30.6 does not: the device's M3
    (M5_TF32_OFF, "float32"),
])
def test_the_float32_rung_reads_the_same_settings(record, mode):
    """The ladder's float32 rung (fp32_matmul_mode) reads the record's macOS and MLX_METAL_GPU_ARCH, as dispatch
    does: it claimed TF32 on an M5 with macOS 26.1 and true float32 on an M3 dispatching as an M5."""
    from gemmdrift.machine.envinfo import fp32_matmul_mode

    assert fp32_matmul_mode(record) == mode
