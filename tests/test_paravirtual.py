"""Paravirtual and unknown GPUs (issue 31 item 4, issue 54 point 4): a device whose architecture is not
``applegpu_gNN<size>`` (a hosted macOS runner's "Apple Paravirtual device", air64_v26; a future name) is no
Apple chip model, but mlx reads its name as it reads any (device.cpp): generation from the last three
characters, size class from the last. Its dispatch is therefore knowable, and is mlx's own for that reading,
under the device's own label (never "M1"); MLX_METAL_GPU_ARCH replaces the name from mlx 0.31.0 on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gemmdrift import cli
from gemmdrift.dispatch import chip_from_env, chip_named, choose, not_a_chip
from gemmdrift.dispatch.archname import nax_available, read_arch
from gemmdrift.machine.envinfo import metal_generation

RECORDS = json.loads((Path(__file__).parent / "data" / "env_records.json").read_text())
PARAVIRTUAL = RECORDS["Apple Paravirtual device"]

# Every release tag from 0.26.5 in the mirror (device.cpp's parse changed once, at v0.31.0, d7a553c #3176).
TAGS = ["0.26.5", "0.27.1", "0.28.0", "0.29.0", "0.29.4", "0.30.0", "0.30.1", "0.30.3", "0.30.4", "0.30.5",
        "0.30.6", "0.31.0", "0.31.1", "0.31.2", "0.32.0", "0.32.1"]


def _v(text: str) -> tuple[int, int, int]:
    return tuple(int(x) for x in text.split("."))  # type: ignore[return-value]


def _c_gen(name: str, clamped: bool) -> int:
    """The generation device.cpp computes, written independently: C char arithmetic on the last 3 characters."""
    tens, ones = ord(name[-3]) - ord("0"), ord(name[-2]) - ord("0")
    if clamped:
        tens, ones = (tens if 0 <= tens <= 9 else 0), (ones if 0 <= ones <= 9 else 0)
    return tens * 10 + ones


@pytest.mark.parametrize("tag", TAGS)
@pytest.mark.parametrize("arch", ["air64_v26", "air64_v27"])
def test_every_release_reads_the_paravirtual_name_as_device_cpp_does(tag, arch):
    # Before v0.31.0 the digits are not checked: ('v' - '0') * 10 + ('2' - '0') = 702. From v0.31.0 a
    # character outside 0..9 counts 0: generation 2. The size class is the last character ('6' or '7'),
    # which device.cpp's switch sends to its default ("medium"), at every tag.
    r = read_arch(arch, _v(tag))
    assert r.gen == _c_gen(arch, clamped=_v(tag) >= (0, 31, 0))
    assert r.gen == (702 if _v(tag) < (0, 31, 0) else 2)
    assert r.size == arch[-1] and r.size_class.startswith("medium")
    # NAX (is_nax_available): none before 0.30.0; 0.30.0 build-only (no run-time check): unknown from a
    # record; 0.30.1..0.30.6 generation 702 >= 17, so NAX on macOS 26.2 or later; from 0.31.0 generation 2: never.
    for macos, want in (((15, 7), False), ((26, 2), True)):
        nax, why = nax_available(r, macos)
        if _v(tag) < (0, 30, 0):
            assert nax is False and "no NAX kernels" in why
        elif _v(tag) == (0, 30, 0):
            assert nax is None and "no run-time check" in why
        elif _v(tag) < (0, 31, 0):
            assert nax is want, (tag, macos, why)
        else:
            assert nax is False and "generation 2 < 17" in why


def test_the_override_is_read_from_0_31_0_and_ignored_before():
    assert read_arch("air64_v26", (0, 31, 0), "applegpu_g13g").gen == 13
    assert read_arch("air64_v26", (0, 31, 0), "applegpu_g13g").override_used
    before = read_arch("air64_v26", (0, 30, 6), "applegpu_g13g")
    assert before.gen == 702 and not before.override_used and "does not read it" in before.text()
    # Short names: 0 from v0.31.0 (size() >= 3 check); undefined (an out-of-range read) before.
    assert read_arch("g1", (0, 31, 0)).gen == 0 and read_arch("g1", (0, 30, 5)).gen is None


def test_a_paravirtual_device_is_read_as_mlx_reads_it_and_never_labelled_a_chip_model():
    chip = chip_from_env(PARAVIRTUAL)  # mlx 0.32.4, macOS 15.7
    assert chip is not None and (chip.gen, chip.size, chip.nax) == (2, "6", False)
    assert chip.name == "Apple Paravirtual device (air64_v26)" and chip.device == "Apple Paravirtual device"
    assert "M1" not in chip.name and metal_generation(PARAVIRTUAL["architecture"]) is None  # no "M<n>" label
    line = not_a_chip(PARAVIRTUAL)
    assert "paravirtual GPU" in line and "'Apple Paravirtual device'" in line and "'air64_v26'" in line
    assert "mlx 0.32.4 reads 'air64_v26' as generation 2, size '6'" in line and "\n" not in line
    old = chip_from_env({**PARAVIRTUAL, "architecture": "air64_v27"}, "0.30.5")
    assert (old.gen, old.size) == (702, "7") and "mlx 0.30.5 reads 'air64_v27' as generation 702" in old.note


def test_a_name_mlx_reads_as_generation_0_is_a_prediction_not_an_error():
    rec = RECORDS["unknown Metal architecture"]  # 'applegpu_x1': '_' and 'x' are no digits: generation 0
    chip = chip_from_env(rec)
    assert chip is not None and chip.gen == 0 and chip.size == "1" and "paravirtual" not in not_a_chip(rec)
    assert "reads 'applegpu_x1' as generation 0, size '1'" in not_a_chip(rec)
    assert choose(chip, "matmul", T=2, K=640, N=2048, dtype="bfloat16", mlx_version="0.32.1").kernel == "steel_gemm"


@pytest.mark.parametrize("name", ["M1", "M4", "M5", "sm90", "cpu Linux x86_64", "cpu Linux aarch64"])
def test_chips_and_cpus_are_not_flagged(name):
    assert not_a_chip(RECORDS[name]) is None


def test_the_mlx_architecture_override_decides_as_in_mlx_and_is_said():
    # MLX_METAL_GPU_ARCH replaces the name (Device::Device, from 0.31.0): a paravirtual device told it is an M1
    # dispatches as one, labelled as itself; the same variable in an mlx 0.30.5 record does nothing.
    rec = {**PARAVIRTUAL, "architecture": "applegpu_g13g", "env": {"MLX_METAL_GPU_ARCH": "applegpu_g13g"}}
    chip = chip_from_env(rec)
    assert (chip.gen, chip.size, chip.arch) == (13, "g", "applegpu_g13g")
    assert chip.name == "Apple Paravirtual device as applegpu_g13g" and "MLX_METAL_GPU_ARCH=applegpu_g13g" in chip.note
    m1 = chip_named("M1")
    for T in (1, 2, 5, 16, 33):
        for op, kw in (("matmul", {}), ("quantized_matmul", {"bits": 4, "group_size": 64})):
            a = choose(chip, op, T=T, K=640, N=2048, dtype="bfloat16", mlx_version="0.32.1", **kw)
            b = choose(m1, op, T=T, K=640, N=2048, dtype="bfloat16", mlx_version="0.32.1", **kw)
            assert (a.kernel, dict(a.params)) == (b.kernel, dict(b.params))
    ignored = chip_from_env({**RECORDS["M4"], "mlx": "0.30.5", "env": {"MLX_METAL_GPU_ARCH": "applegpu_g13g"}})
    assert ignored.name == "M4" and "does not read it" in ignored.note


def _dispatch(tmp_path, capsys, rec, *extra):
    (tmp_path / "rec.json").write_text(json.dumps(rec))
    rc = cli.main(["dispatch", "--env", str(tmp_path / "rec.json"), "--K", "640", "--N", "2048", "--ts", "1-3",
                   *extra])
    return rc, capsys.readouterr()


def test_dispatch_from_a_paravirtual_record_predicts_as_mlx_reads_it(tmp_path, capsys):
    # Was: one line and exit 2 ("never as a chip"). mlx's reading is knowable, so the prediction is given.
    rc, out = _dispatch(tmp_path, capsys, PARAVIRTUAL)
    assert rc == 0 and out.err == ""
    head = out.out.splitlines()[0]
    assert head.startswith("Apple Paravirtual device (air64_v26): mlx 0.32.4 reads 'air64_v26' as generation 2, "
                           "size '6'")
    assert "T=   2  steel_gemm" in out.out and "bk=16" in out.out  # the medium device's default tiles
    rc, out = _dispatch(tmp_path, capsys, PARAVIRTUAL, "--mlx", "0.30.5")
    assert rc == 0 and "mlx 0.30.5 reads 'air64_v26' as generation 702" in out.out
    rc, out = _dispatch(tmp_path, capsys, {**PARAVIRTUAL, "env": {"MLX_METAL_GPU_ARCH": "applegpu_g15s"}})
    assert rc == 0 and "MLX_METAL_GPU_ARCH=applegpu_g15s is used" in out.out and "generation 15, size 's'" in out.out


def test_replay_check_and_calibration_on_a_paravirtual_device(embedded):
    # The check runs this device's own reading (no --chip needed, no "prediction"), and the calibration it writes
    # names the device: a file measured under MLX_METAL_GPU_ARCH=applegpu_g13g never calibrates a real M1.
    from gemmdrift import kernels
    from gemmdrift.replay import calib as RC
    from gemmdrift.replay.check import check_replay, planted_device

    projs = kernels.projections(embedded, layers=[0], names=["k_proj"])
    inputs = kernels.capture_inputs(embedded, list(range(2, 8)), projs, max_rows=4)
    for rec, arch in ((PARAVIRTUAL, "air64_v26"),
                      ({**PARAVIRTUAL, "env": {"MLX_METAL_GPU_ARCH": "applegpu_g13g"}}, "applegpu_g13g")):
        own = chip_from_env(rec, "0.32.1")
        result = check_replay(embedded, inputs, projs, ["dense:bfloat16"], (1, 2), env=rec, mlx_version="0.32.1",
                              device=planted_device(own, "default", "0.32.1"), order_rows=False)
        assert not result.inputs["prediction"] and "reads" in result.inputs["device_note"]
        assert all(r["identical"] for r in result.details["records"] if r["variant"] == "default")
        record = RC.build(result)
        assert record["device"]["architecture"] == arch and record["device"]["device"] == "Apple Paravirtual device"
        assert "reads" in record["device"]["reading"]
    cal = RC.Calibration("f", record["device"], record["kernels"], record["variant"])
    assert cal.fits(own) and not cal.fits(chip_named("M1"))
