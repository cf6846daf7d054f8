"""Calibration (issue 31 item 3): a chip's measured variant, written by ``replay check`` on the chip, used by
``--kernels replay:<chip>``, ``replay check --calibration`` and the main job's prediction.

No Mac here: a *planted device* stands in for one (its "real" kernels are the replay of a chip under a chosen
variant, run through the same check code as mlx's kernels would be). The calibration must find that variant,
and every command given the file must replay it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gemmdrift import cli
from gemmdrift.errors import GemmdriftError
from gemmdrift.replay import calib as RC

RECORDS = json.loads((Path(__file__).parent / "data" / "env_records.json").read_text())
CHIP, MLX = "M3 Max", "0.32.4"
ENV = {**RECORDS["M3 Max"], "mlx": MLX}
PLANTED = "mma=H2"  # the default is H1


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    """The check against the planted device on layer 0's k_proj and gate_proj, and the file it writes."""
    from gemmdrift import kernels
    from gemmdrift.replay.check import check_replay, planted_device
    from gemmdrift.model import load_model

    lm = load_model("embedded", dtype="bfloat16")
    projs = kernels.projections(lm, layers=[0], names=["k_proj", "gate_proj"])
    # Rows whose magnitudes span 2**-10..2**10: on 4 captured rows of the embedded Gemma every variant of every
    # axis gave the same bits (bf16 products are short, the float32 sums mostly exact), so the planted variant
    # could not be told apart there. A real check on such rows says "the data cannot tell them apart".
    rng = np.random.default_rng(31)
    inputs = {p.key: rng.standard_normal((6, p.in_dims)) * 2.0 ** rng.integers(-10, 11, (6, p.in_dims))
              for p in projs}
    result = check_replay(lm, inputs, projs, ["dense:bfloat16", "quant:affine-q4-g64"], (1, 2, 16), env=ENV,
                          mlx_version=MLX, device=planted_device(CHIP, PLANTED, MLX))
    out = tmp_path_factory.mktemp("cal")
    path, record = RC.write(result, out)
    return result, path, record


def test_the_calibration_finds_the_planted_variant(calibrated):
    result, path, record = calibrated
    assert not result.inputs["prediction"]
    assert record["device"] == {"chip": CHIP, "architecture": "applegpu_g15s", "generation": 15, "size_class": "s",
                                "macos": ENV["macos"], "mlx": MLX}
    # Every axis the rows could tell apart is the planted device's (mma=H2, every other axis at its default).
    planted = {"mma": "H2", "dot4": "sequential", "simd_sum": "xor16", "contrib": "fma", "contract": "fma"}
    measured = RC.load(path).variant
    assert measured["mma"] == "H2" and measured.items() <= planted.items()
    # bf16 outputs hide most order differences: the axes these rows cannot tell apart are said, not guessed.
    wide = record["kernels"]["gemv_wide"]["axes"]["dot4"]
    assert wide["measured"] is None and "cannot tell them apart" in wide["why"]
    # Per kernel: the kernels M3 Max dispatches here, each axis's value identical in every cell, with counts.
    assert set(record["kernels"]) == {"gemv", "gemv_wide", "steel_gemm", "steel_gemm_splitk", "qmv", "qmv_wide",
                                      "qmm_t_splitk"}
    mma = {k: (r["cells"], r["axes"]["mma"]) for k, r in record["kernels"].items() if "mma" in r["axes"]}
    assert {ax["measured"] for _, ax in mma.values()} <= {"H2", None}
    assert all(ax["identical_cells"]["H2"] == cells for cells, ax in mma.values())  # planted: H2 everywhere
    assert any(ax["identical_cells"]["H1"] < cells for cells, ax in mma.values())  # told apart, not blind
    # No prompt, path or user data in the file.
    text = path.read_text()
    assert "France" not in text and str(path.parent) not in text and "embedded" not in text


def test_every_command_given_the_file_replays_the_measured_variant(calibrated, tiny, capsys):
    from gemmdrift.replay.model import KernelsOption
    from gemmdrift.replay.predict import PredictSizes, predict_drift

    _, path, record = calibrated
    text = RC.resolve(CHIP, MLX, [path], registry=False).text
    assert "mma=H2" in text.split(",")
    k = KernelsOption("replay:M3-Max", calibration=[str(path)])
    assert k.variant == text and k.text == f"replay:M3-Max@{text}"
    assert k.calibrated_by == f"calibrated by {path}"
    # The prediction (the main job's predict part) on tiny, whose dense bf16 calls at T = 3, 4 are gemv_wide:
    # a file that measured dot4 (as a chip's check on more telling rows would) fixes it.
    dot4 = path.parent / "dot4.json"
    dot4.write_text(json.dumps({**record, "variant": {"dot4": "pairwise"}}))
    r = predict_drift(tiny, PredictSizes(tokens=5, split=1, chips=(CHIP,)), env=ENV, calibration=[str(dot4)],
                      tokens=[1, 2, 3, 4, 5])
    assert r.inputs["variants"][CHIP] == ["dot4=pairwise"]  # tiny's dense bf16 calls: gemv and gemv_wide
    assert r.inputs["calibration"][CHIP] == f"calibrated by {dot4}"
    assert f"calibrated by {dot4}" in capsys.readouterr().err
    uncalibrated = predict_drift(tiny, PredictSizes(tokens=5, split=1, chips=(CHIP,)), env=ENV, tokens=[1, 2, 3, 4, 5])
    assert uncalibrated.inputs["variants"][CHIP] == ["dot4=sequential", "dot4=pairwise"]


def test_the_registry_is_read_and_disagreeing_files_are_refused(calibrated, tmp_path, monkeypatch):
    from gemmdrift.replay.model import KernelsOption

    _, path, record = calibrated
    reg = tmp_path / "registry"
    reg.mkdir()
    (reg / "m3max.json").write_text(path.read_text())
    monkeypatch.setattr(RC, "REGISTRY", reg)
    assert "mma=H2" in KernelsOption("replay:M3-Max").variant.split(",")  # no flag: the registry's file applies
    assert KernelsOption("replay:M1").variant is None  # another chip: not for it
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**record, "variant": {**record["variant"], "mma": "H1"}}))
    with pytest.raises(GemmdriftError, match="calibrations disagree on mma.*refusing to pick"):
        KernelsOption("replay:M3-Max", calibration=[str(other)])


def _bad(tmp_path, record, name, change):
    p = tmp_path / name
    p.write_text(change(record) if callable(change) else change)
    return p


@pytest.mark.parametrize("name, change, needle", [
    ("corrupt.json", '{"format": "gemmdrift-calibration", "vers', "not a readable JSON file"),
    ("notone.json", json.dumps({"hello": 1}), "not a gemmdrift calibration file"),
    ("release.json", lambda r: json.dumps({**r, "device": {**r["device"], "mlx": "0.32.2"}}),
     "measured with mlx 0.32.2, this replays mlx"),
    ("chip.json", lambda r: json.dumps({**r, "device": {**r["device"], "architecture": "applegpu_g13g"}}),
     "not M3 Max (applegpu_g15s)"),
    ("variant.json", lambda r: json.dumps({**r, "variant": {"mma": "H9"}}), "unknown mma variant 'H9'"),
])
def test_a_bad_calibration_file_is_one_line_exit_2_naming_it(calibrated, tmp_path, capsys, monkeypatch, name,
                                                             change, needle):
    import gemmdrift.replay.paths as rp

    monkeypatch.setattr(rp, "installed_mlx", lambda: MLX)  # the file's release is this replay's, except above
    _, _, record = calibrated
    bad = _bad(tmp_path, record, name, change)
    for argv in (["kernels", "--kernels", "replay:M3-Max", "--calibration", str(bad), "--out", str(tmp_path / "o")],
                 ["replay", "check", "--calibration", str(bad), "--out", str(tmp_path / "c")]):
        if argv[0] == "replay" and name in ("release.json", "chip.json"):
            continue  # replay check matches the file to the device only after it knows it: tested below
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and str(bad) in err and needle in err, err


def test_run_refuses_a_bad_calibration_before_loading(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    assert cli.main(["run", "--calibration", str(bad), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(bad) in err
    assert not (tmp_path / "run" / "env.json").exists()


def test_calibration_is_not_written_for_a_prediction_or_this_cpu(calibrated):
    import dataclasses

    result, _, _ = calibrated
    with pytest.raises(GemmdriftError, match="a prediction"):
        RC.build(dataclasses.replace(result, inputs={**result.inputs, "prediction": True}))
    with pytest.raises(GemmdriftError, match="not a GPU architecture this release reads"):
        RC.build(dataclasses.replace(result, env={"backend": "gpu", "architecture": "x"}))  # paravirtual: calibrated
    with pytest.raises(GemmdriftError, match="every variant"):
        RC.build(dataclasses.replace(result, inputs={**result.inputs, "variants": "mma=H1"}))


def test_the_shipped_registry_is_empty_and_documented():
    assert RC.registry_files() == []
    assert (RC.REGISTRY / "README.md").is_file()


def test_the_check_says_per_path_which_variants_exist_and_takes_the_fp_modes(calibrated):
    from gemmdrift.replay.check import check_paths, check_text

    result, _, _ = calibrated
    text = check_text(result)
    assert "variants on dense:bfloat16: gemv (no open axis); gemv_wide dot4=sequential|pairwise" in text
    assert "qmv simd_sum=xor16|xor1|sequential contrib=fma|fma-bias|mul-add" in text
    assert "qmm_t_splitk mma=H1|H2|H3|H4" in text  # split-K and qmm_t are covered (dequant: one value, fixed)
    # The fp modes have recipes now (replay.fpquant; tests/test_replay_fpquant.py checks them with a planted
    # device); an fp quantization mlx's quantize refuses is one line.
    specs = check_paths(["quant:mxfp4-q4-g32", "quant:nvfp4-q4-g16", "quant:mxfp8-q8-g32"])
    assert [(s.quant.mode, s.quant.bits, s.quant.group_size) for s in specs] == [
        ("mxfp4", 4, 32), ("nvfp4", 4, 16), ("mxfp8", 8, 32)]
    with pytest.raises(GemmdriftError):
        check_paths(["quant:nvfp4-q4-g32"])
