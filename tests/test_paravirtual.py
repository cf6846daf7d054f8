"""Paravirtual and unknown GPUs (issue 31 item 4): a device whose architecture is not ``applegpu_gNN<size>``
(a hosted macOS runner's "Apple Paravirtual device", air64_v26; a future name) is recorded as it reports
itself and never labelled as a chip; dispatch, replay check, predict and calibration say so in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gemmdrift import cli
from gemmdrift.dispatch import chip_from_env, not_a_chip
from gemmdrift.machine.envinfo import metal_generation
from gemmdrift.errors import GemmdriftError

RECORDS = json.loads((Path(__file__).parent / "data" / "env_records.json").read_text())
PARAVIRTUAL = RECORDS["Apple Paravirtual device"]


def test_a_paravirtual_device_is_kept_as_it_reports_itself_and_is_no_chip():
    assert chip_from_env(PARAVIRTUAL) is None
    assert metal_generation(PARAVIRTUAL["architecture"]) is None  # no "M<n>" label either
    line = not_a_chip(PARAVIRTUAL)
    assert "paravirtual GPU" in line and "'Apple Paravirtual device'" in line and "'air64_v26'" in line
    assert "never as a chip" in line and "\n" not in line
    for arch in ("air64_v27",):  # the other architecture hosted runners report
        assert "paravirtual" in not_a_chip({**PARAVIRTUAL, "architecture": arch})


def test_a_future_architecture_is_said_unreadable_not_guessed():
    line = not_a_chip(RECORDS["unknown Metal architecture"])
    assert "not an Apple GPU architecture this release reads" in line and "'applegpu_x1'" in line
    assert "paravirtual" not in line


@pytest.mark.parametrize("name", ["M1", "M4", "M5", "sm90", "cpu Linux x86_64", "cpu Linux aarch64"])
def test_chips_and_cpus_are_not_flagged(name):
    assert not_a_chip(RECORDS[name]) is None


def test_the_mlx_architecture_override_decides_as_in_mlx():
    # MLX_METAL_GPU_ARCH replaces the detected architecture (Device::Device): a paravirtual device told it is an
    # M3 Max dispatches as one, and an override to a non-chip name is itself reported.
    assert not_a_chip({**PARAVIRTUAL, "env": {"MLX_METAL_GPU_ARCH": "applegpu_g15s"}}) is None
    assert "'air64_v27'" in not_a_chip({**RECORDS["M4"], "env": {"MLX_METAL_GPU_ARCH": "air64_v27"}})


def test_dispatch_from_a_paravirtual_record_is_one_line_exit_2(tmp_path, capsys):
    (tmp_path / "pv.json").write_text(json.dumps(PARAVIRTUAL))
    assert cli.main(["dispatch", "--env", str(tmp_path / "pv.json"), "--K", "640", "--N", "2048"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "paravirtual GPU" in err and "pv.json" in err


def test_replay_check_on_a_paravirtual_device_says_so_before_any_model():
    from gemmdrift.replay.check import check_replay

    with pytest.raises(GemmdriftError, match="paravirtual GPU.*give --chip"):
        check_replay(None, {}, [], env=PARAVIRTUAL)
