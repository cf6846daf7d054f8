"""Issue 53 (PROBE-DEFECTS-4 items 3, 9, 14, 19, 26, 30): ``gemmdrift upgrade``'s mlx <-> mlx-lm pairing comes from
asv.conf.json's matrix (gemmdrift.matrix), a cached environment is taken only for the exact pair, an mlx-lm that
cannot run its mlx is refused before any build, and every bad input is one line and exit 2 before any build.

Nothing here builds or downloads: the builder is replaced by one that fails the test, and the package index by a
list (or by pip's own offline output).
"""

import json
import subprocess
from pathlib import Path

import pytest

from gemmdrift import cli, interrupts, matrix
from gemmdrift.errors import GemmdriftError
from gemmdrift.upgrade import envs

ROOT = Path(__file__).resolve().parent.parent
MLX = ["0.26.5", "0.27.1", "0.28.0", "0.29.0", "0.29.1", "0.29.2", "0.29.3", "0.29.4", "0.30.0", "0.30.1", "0.30.3",
       "0.30.4", "0.30.5", "0.30.6", "0.31.0", "0.31.1", "0.31.2", "0.32.0", "0.32.1", "0.32.2", "0.32.3", "0.32.4",
       "0.33.0"]
LM = ["0.26.4", "0.27.1", "0.28.0", "0.28.4", "0.29.1", "0.30.2", "0.30.5", "0.30.7", "0.31.2", "0.31.3", "0.32.2",
      "0.33.0"]


@pytest.fixture
def planned(monkeypatch, tmp_path):
    """No model load, no build: the plans ``realise`` is handed are recorded, then the command stops (exit 2)."""
    import gemmdrift.model

    def refuse(*a, **k):
        raise AssertionError("a model was loaded or an environment built")

    monkeypatch.setattr(gemmdrift.model, "load_model", refuse)
    monkeypatch.setattr(envs, "build", refuse)
    monkeypatch.setenv("GEMMDRIFT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(envs, "index_versions", lambda pkg: LM if pkg == "mlx-lm" else MLX)
    plans = []

    def realise(plan, model_type, log=print):  # both sides planned (from, then to), then stopped
        plans.append(plan)
        if len(plans) % 2 == 0:
            raise GemmdriftError("stopped before the build (test)")
        return envs.Side(plan.side, "python", plan.mlx, plan.mlx_lm, "test")

    monkeypatch.setattr(envs, "realise", realise)
    return plans


def bad(capsys, *argv) -> str:
    rc = cli.main(["upgrade", *argv])
    out, err = capsys.readouterr()
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_the_pairing_is_asv_matrix_main_line():
    """upgrade paired 0.26.5 and 0.30.0 with mlx-lm 0.32.2 from a stale four-entry dict: the matrix is the source."""
    pairs = matrix.main_line(matrix.read_conf(ROOT), "linux")
    assert pairs["0.26.5"] == "0.26.4" and pairs["0.30.0"] == "0.30.2" and pairs["0.32.4"] == "0.32.2"
    assert pairs["0.29.0"] == "0.27.1" and pairs["0.30.3"] == "0.30.5" and pairs["0.31.2"] == "0.31.3"
    assert len(pairs) == 22 and pairs == matrix.main_line(matrix.read_conf(ROOT), "darwin")
    for m, lm in matrix.releases(matrix.read_conf(ROOT), "linux"):  # every entry of the matrix can run
        matrix.check_pair(m, lm)


def test_each_mlx_lm_needs_what_its_wheel_asks():
    """The requirement table (docs/tracking.md#the-matrix): exact up to 0.32.2, a lower bound past it."""
    assert matrix.needs("0.26.4") == ("0.26.0", True)
    assert matrix.needs("0.28.4") == ("0.29.2", True) and matrix.needs("0.30.2") == ("0.29.2", True)
    assert matrix.needs("0.30.5") == ("0.30.3", True) and matrix.needs("0.31.2") == ("0.30.4", True)
    assert matrix.needs("0.32.2") == ("0.32.2", True) and matrix.needs("0.33.1") == ("0.32.2", False)
    assert matrix.needs("0.20.0") == (None, False)


def test_from_an_old_release_pairs_each_side_as_the_matrix_does(planned, capsys):
    """Known answer: --from 0.26.5 --to 0.30.0 pairs 0.26.5 with mlx-lm 0.26.4 and 0.30.0 with 0.30.2."""
    bad(capsys, "--from", "0.26.5", "--to", "0.30.0")
    assert [(p.side, p.mlx, p.mlx_lm, p.python) for p in planned] == [("from", "0.26.5", "0.26.4", None),
                                                                      ("to", "0.30.0", "0.30.2", None)]


def _cache_env(root: Path, mlx: str, lm: str) -> Path:
    d = envs.env_dir(mlx, lm)
    (d / "bin").mkdir(parents=True)
    (d / "bin" / "python").write_text("")
    (d / "env.json").write_text(json.dumps({"mlx": mlx, "mlx_lm": lm}))
    return d / "bin" / "python"


def test_a_cached_environment_is_found_by_the_exact_pair(planned, monkeypatch, tmp_path):
    """A cached environment of the same mlx with a newer mlx-lm was taken before the paired one (the probe's
    `--to 0.29.4 --mlx-lm 0.31.3` once poisoned every later `--from 0.29.4`; that pair is refused now, below)."""
    paired = _cache_env(tmp_path, "0.32.3", "0.32.2")
    other = _cache_env(tmp_path, "0.32.3", "0.33.0")
    monkeypatch.setattr(envs, "probe", lambda py, mt=None, flag="": {
        "mlx": "0.32.3", "mlx_lm": "0.33.0" if "0.33.0" in str(py) else "0.32.2", "python": "3.11"})
    p = envs.plan_side("from", "0.32.3", None, None, None)
    assert (p.python, p.mlx_lm, p.how) == (str(paired), "0.32.2", "cached")
    p = envs.plan_side("to", "0.32.3", "0.33.0", None, None)
    assert (p.python, p.mlx_lm) == (str(other), "0.33.0")
    assert envs.cached("0.32.3", "0.31.3") is None
    with pytest.raises(GemmdriftError, match="--mlx-lm 0.31.3 cannot run mlx 0.29.4"):
        envs.plan_side("to", "0.29.4", "0.31.3", None, None)


def test_an_mlx_lm_that_cannot_run_its_mlx_is_refused_before_any_build(planned, capsys):
    """mlx-lm 0.32.2 on mlx 0.26.5 was built, then failed to load (no mx.new_thread_local_stream)."""
    err = bad(capsys, "--to", "0.26.5", "--mlx-lm", "0.32.2")
    assert "--mlx-lm 0.32.2 cannot run mlx 0.26.5: mlx-lm 0.32.2 needs mlx >= 0.32.2" in err
    assert "asv.conf.json pairs mlx 0.26.5 with mlx-lm 0.26.4" in err
    err = bad(capsys, "--to", "0.30.0", "--mlx-lm", "0.33.0")
    assert "needs mlx >= 0.32.2 at least" in err
    assert planned == []  # refused before any plan was realised
    bad(capsys, "--from", "0.30.0", "--to", "0.32.4", "--mlx-lm", "0.26.4")  # an old mlx-lm on a new mlx: planned
    assert (planned[-1].side, planned[-1].mlx, planned[-1].mlx_lm) == ("to", "0.32.4", "0.26.4")


def test_a_release_the_matrix_does_not_pair_names_the_nearest_pairing(planned, capsys):
    """Never the newest mlx-lm silently: an mlx the matrix lacks needs --mlx-lm, and the nearest pairs are named."""
    err = bad(capsys, "--to", "0.33.0")
    assert "mlx 0.33.0: asv.conf.json's matrix does not pair it with an mlx-lm" in err
    assert "nearest known pairings: mlx 0.32.4 with mlx-lm 0.32.2" in err and "--mlx-lm VERSION" in err
    p = envs.plan_side("to", "0.33.0", "0.33.0", None, None, versions=lambda pkg: LM if pkg == "mlx-lm" else MLX)
    assert (p.mlx, p.mlx_lm) == ("0.33.0", "0.33.0")
    assert "no such release" in bad(capsys, "--to", "0.30.9")  # a release that does not exist is said first


def test_offline_is_not_no_such_release(monkeypatch):
    """Offline, pip says "No matching distribution" after its connection warnings: that is no network, not none."""
    offline = ("WARNING: Retrying (Retry(total=0, connect=None, read=None, redirect=None, status=None)) after "
               "connection broken by 'NewConnectionError('<HTTPConnection object>: Failed to establish a new "
               "connection: [Errno 111] Connection refused')': /simple/mlx-cpu/\n"
               "ERROR: No matching distribution found for mlx-cpu\n")
    answer = {}
    monkeypatch.setattr(envs.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1, "", answer["e"]))
    answer["e"] = offline
    with pytest.raises(envs.Offline, match="cannot ask the package index"):
        envs.index_versions("mlx-cpu")
    answer["e"] = "ERROR: No matching distribution found for mlx-nope\n"
    assert envs.index_versions("mlx-nope") == []


def test_offline_upgrade_says_it_cannot_ask_the_index(planned, monkeypatch, capsys):
    def offline(pkg):
        raise envs.Offline("cannot ask the package index (Failed to establish a new connection)")

    monkeypatch.setattr(envs, "index_versions", offline)
    err = bad(capsys, "--to", "0.30.5")
    assert "cannot ask the package index" in err and "no such release" not in err


def test_bad_generate_dtype_and_rounds_are_refused_before_any_build(planned, capsys):
    """--generate 40000 past 32,768 positions and --dtype foo were accepted (the environment built first)."""
    err = bad(capsys, "--to", "0.30.0", "--generate", "40000")
    assert "--generate 40000" in err and "32,768" in err
    err = bad(capsys, "--to", "0.30.0", "--dtype", "foo")
    assert "--dtype" in err and "'foo'" in err
    assert "--generate must be positive, got 0" in bad(capsys, "--to", "0.30.0", "--generate", "0")
    assert "--speed-rounds must be positive" in bad(capsys, "--to", "0.30.0", "--speed-rounds", "0")
    assert "----" not in bad(capsys, "--to", "0.30.0", "--speed-rounds", "0")
    assert planned == []


def test_out_holding_another_commands_result_is_refused(planned, tmp_path, capsys):
    """upgrade --out DIR replaced another command's record (result.json became upgrade's)."""
    d = tmp_path / "stack"
    d.mkdir()
    marker = json.dumps({"format": 1, "kind": "stack", "files": []})
    (d / "result.json").write_text(marker)
    err = bad(capsys, "--to", "0.30.0", "--out", str(d))
    assert "holds a stack result" in err and "another --out" in err
    assert (d / "result.json").read_text() == marker and planned == []
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text("{}")
    assert "main job" in bad(capsys, "--to", "0.30.0", "--out", str(run))


def test_the_interrupt_message_names_only_the_units_that_finished(tmp_path):
    """Ctrl-C listed every unit as kept (the op capture, each release's ops and runs, the speed), reached or not."""
    class Args:
        command, out = "upgrade", str(tmp_path)

    msg = interrupts.on_interrupt(Args, KeyboardInterrupt())
    assert "nothing had finished, so nothing is kept" in msg and "speed" not in msg
    ck = tmp_path / ".checkpoints" / "upgrade"
    ck.mkdir(parents=True)
    (ck / "capture-abc.json").write_text("{}")
    (ck / "runs-to-abc.json").write_text("{}")
    (ck / "runs-from-abc.npz").write_text("")  # its .json not written: not finished
    msg = interrupts.on_interrupt(Args, KeyboardInterrupt())
    assert "the op capture, to's runs" in msg and "from's runs" not in msg and "speed" not in msg, msg


def test_an_interpreter_whose_mlx_lm_cannot_run_its_mlx_is_refused(monkeypatch):
    """--python with mlx 0.26.5 and mlx-lm 0.32.2 would fail at the load, after the capture: refused at the probe."""
    monkeypatch.setattr(envs, "probe", lambda py, mt=None, flag="": {"mlx": "0.26.5", "mlx_lm": "0.32.2"})
    with pytest.raises(GemmdriftError, match=r"--python /x/python: mlx-lm 0\.32\.2 cannot run mlx 0\.26\.5"):
        envs.plan_side("to", None, None, "/x/python", None)
    monkeypatch.setattr(envs, "probe", lambda py, mt=None, flag="": {"mlx": "0.32.4", "mlx_lm": "0.26.4"})
    assert envs.plan_side("to", None, None, "/x/python", None).mlx_lm == "0.26.4"  # the mlx-lm axis runs
