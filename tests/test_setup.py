"""Setup on every backend: the Makefile's Python discovery and venv per backend, the asv CUDA matrices, the
record of installed backend wheels. Nothing here needs a GPU: the logic is run with planted inputs."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAKE = shutil.which("make")
needs_make = pytest.mark.skipif(MAKE is None, reason="no make on PATH")


def _clean_env() -> dict[str, str]:
    """This environment without what an outer `make BACKEND=... test` exports (command-line variables, MAKEFLAGS)."""
    return {k: v for k, v in os.environ.items()
            if k not in ("PYTHON", "PYTHONS", "BACKEND", "VENV", "INSTALLER", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")}


def _make(args, path_dir, tmp_path):
    """`make -n ...` with only ``path_dir`` (planted interpreters) and the system tools on PATH."""
    env = _clean_env()
    env["PATH"] = f"{path_dir}:/usr/bin:/bin"
    return subprocess.run([MAKE, "-C", str(ROOT), *args, f"VENV={tmp_path / 'venv'}"], env=env,
                          capture_output=True, text=True, timeout=60)


def _plant(d: Path, name: str, real: bool) -> None:
    """An interpreter ``name`` in ``d``: this Python (3.10+) when ``real``, else one that fails like a pyenv shim
    of an inactive version (or a 3.9 refusing the check)."""
    p = d / name
    p.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n' if real else "#!/bin/sh\nexit 1\n")
    p.chmod(0o755)


@needs_make
def test_the_makefile_takes_the_newest_working_python(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _plant(bin_dir, "python3.13", real=False)  # a shim of an inactive version: skipped
    _plant(bin_dir, "python3.12", real=True)
    _plant(bin_dir, "python3.11", real=True)
    _plant(bin_dir, "python3", real=True)
    r = _make(["-n", "env"], bin_dir, tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"python3.12 -m venv {tmp_path / 'venv'}" in r.stdout
    assert "python3.11 -m venv" not in r.stdout


@needs_make
def test_the_makefile_says_so_in_one_line_when_no_python_fits(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("python3.13", "python3.12", "python3.11", "python3.10", "python3"):
        _plant(bin_dir, name, real=False)
    r = _make(["env"], bin_dir, tmp_path)  # for real: the check runs before anything is created
    assert r.returncode == 2
    line = [ln for ln in r.stderr.splitlines() if ln.startswith("make: no Python")]
    assert line and "python3.13 python3.12 python3.11 python3.10 python3" in line[0], r.stderr
    assert not (tmp_path / "venv").exists()


def _driver_loads() -> bool:
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@needs_make
@pytest.mark.parametrize("backend", ["cuda13", "cuda", "cuda12"])
def test_a_cuda_backend_without_a_driver_is_refused_before_anything_is_built(tmp_path, backend):
    """Issue 53, item 8: `make BACKEND=cuda13 run` without an NVIDIA driver downloaded about 2.8 GB of wheels, then
    `gemmdrift run` ended in `ImportError: libcuda.so.1`. The driver is checked first: one line, exit 2."""
    if sys.platform != "linux" or _driver_loads():
        pytest.skip("needs a Linux machine without an NVIDIA driver (where one is, the snippet's test checks this)")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _plant(bin_dir, "python3", real=True)
    r = _make(["run", f"BACKEND={backend}"], bin_dir, tmp_path)  # for real: the check runs before anything
    assert r.returncode == 2
    ours = [ln for ln in r.stderr.splitlines() if not ln.startswith("make: ***")]  # make's own trailer aside
    name = "cuda13" if backend == "cuda" else backend
    assert ours == [f"make: BACKEND={name} needs an NVIDIA driver and this machine has none (libcuda.so.1 does not "
                    "load): use BACKEND=cpu here"], r.stderr
    assert not (tmp_path / "venv").exists() and "venv" not in r.stdout


def _makefile_snippet(name: str) -> str:
    m = re.search(rf"^{name} := (.*)$", (ROOT / "Makefile").read_text(), re.M)
    assert m, name
    return m.group(1)


@pytest.mark.parametrize("platform_, machine, version, ok", [
    ("linux", "x86_64", (3, 11), True), ("linux", "aarch64", (3, 10), True), ("linux", "x86_64", (3, 9), False),
    ("darwin", "arm64", (3, 12), True), ("darwin", "x86_64", (3, 12), False), ("darwin", "arm64", (3, 9), False),
])
def test_the_interpreter_check_wants_310_and_arm64_on_macos(monkeypatch, platform_, machine, version, ok):
    import platform

    code = _makefile_snippet("PY_OK")
    monkeypatch.setattr(sys, "platform", platform_)
    monkeypatch.setattr(sys, "version_info", version)
    monkeypatch.setattr(platform, "machine", lambda: machine)
    with pytest.raises(SystemExit) as e:
        exec(code, {})
    assert (not e.value.code) == ok


@pytest.mark.parametrize("platform_, mac, ok", [("darwin", "14.6", True), ("darwin", "26.2", True),
                                                 ("darwin", "13.7", False), ("linux", "", True)])
def test_the_macos_check_wants_14(monkeypatch, platform_, mac, ok):
    import platform

    monkeypatch.setattr(sys, "platform", platform_)
    monkeypatch.setattr(platform, "mac_ver", lambda: (mac, ("", "", ""), ""))
    with pytest.raises(SystemExit) as e:
        exec(_makefile_snippet("MAC_OK"), {})
    assert (not e.value.code) == ok


@pytest.mark.parametrize("loads", [True, False])
def test_the_driver_check_loads_libcuda(monkeypatch, loads):
    import ctypes

    def cdll(name):
        assert name == "libcuda.so.1"  # what mlx-cuda's libmlx.so needs
        if not loads:
            raise OSError(f"{name}: cannot open shared object file: No such file or directory")

    monkeypatch.setattr(ctypes, "CDLL", cdll)
    if loads:
        exec(_makefile_snippet("CUDA_OK"), {})
    else:
        with pytest.raises(OSError):
            exec(_makefile_snippet("CUDA_OK"), {})


@needs_make
@pytest.mark.parametrize("backend, venv_extra, config", [
    (None, "cpu", "asv.conf.json"), ("cpu", "cpu", "asv.conf.json"), ("cuda", "cuda13", "asv.cuda.conf.json"),
    ("cuda13", "cuda13", "asv.cuda.conf.json"), ("cuda12", "cuda12", "asv.cuda12.conf.json")])
def test_each_backend_has_its_venv_extra_and_asv_config(backend, venv_extra, config):
    if sys.platform != "linux":
        pytest.skip("the backend extras are Linux's")
    env = _clean_env()
    args = [MAKE, "-C", str(ROOT), "-n", "-B", "bench"] + ([f"BACKEND={backend}"] if backend else [])
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60).stdout
    venv = ".venv" if venv_extra == "cpu" else f".venv-{venv_extra}"
    assert f'{venv}/bin/python -m pip install --quiet -e ".[{venv_extra},test,bench]"' in out
    assert f"{venv}/bin/asv run --config {config} --show-stderr" in out


@needs_make
@pytest.mark.parametrize("installer", [None, "uv", "pip"])
def test_the_environment_installs_with_uv_unless_told_and_pip_where_uv_fails(installer):
    args = [MAKE, "-C", str(ROOT), "-n", "-B", "env"] + ([f"INSTALLER={installer}"] if installer else [])
    out = subprocess.run(args, env=_clean_env(), capture_output=True, text=True, timeout=60).stdout
    recipe = next(line for line in out.splitlines() if line.startswith("if ["))
    chosen = installer or "uv"
    assert f'if [ "{chosen}" = uv ]' in recipe, out
    uv_install = '.venv/bin/uv pip install --python .venv/bin/python --quiet -e ".[cpu,test,bench]"'
    pip_install = '.venv/bin/python -m pip install --quiet -e ".[cpu,test,bench]"'
    if sys.platform == "linux":  # the fallback and the pip branch are the same pip install
        assert uv_install in out and out.count(pip_install) == 2, out


@needs_make
def test_an_unknown_installer_is_refused_in_one_line():
    r = subprocess.run([MAKE, "-C", str(ROOT), "-n", "env", "INSTALLER=conda"], env=_clean_env(),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "INSTALLER=conda is not an installer: use uv or pip" in r.stderr


@needs_make
def test_the_commands_make_runs_write_bytecode_where_the_machine_forbids_it():
    # uv compiles no bytecode; with PYTHONDONTWRITEBYTECODE set every process would compile its imports again.
    env = {**_clean_env(), "PYTHONDONTWRITEBYTECODE": "1"}
    r = subprocess.run([MAKE, "-C", str(ROOT), "--no-print-directory", "--eval",
                        'probe-env: ; @echo "[$$PYTHONDONTWRITEBYTECODE]"', "probe-env"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr)


@needs_make
def test_an_unknown_backend_is_refused_in_one_line():
    r = subprocess.run([MAKE, "-C", str(ROOT), "-n", "test", "BACKEND=rocm"], env=_clean_env(), capture_output=True,
                       text=True, timeout=60)
    assert r.returncode != 0 and "BACKEND=rocm is not a backend" in r.stderr


@needs_make
@pytest.mark.parametrize("workers, tail", [(None, "-m pytest -n 2 --dist loadfile --no-loadscope-reorder"),
                                           ("3", "-m pytest -n 3 --dist loadfile --no-loadscope-reorder"),
                                           ("0", "-m pytest")])
def test_make_test_runs_two_test_processes_unless_told(workers, tail):
    # Issue 25, item 7: one pytest process left the second core idle; each test file runs whole in one worker,
    # so module and session fixtures are shared as in one process.
    env = {k: v for k, v in _clean_env().items() if k != "TEST_WORKERS"}
    args = [MAKE, "-C", str(ROOT), "-n", "test"] + ([f"TEST_WORKERS={workers}"] if workers else [])
    out = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60).stdout
    runs = [line.rstrip() for line in out.splitlines() if "-m pytest" in line]
    assert runs and runs[-1].endswith(tail), out


# ------------------------------------------------------------------ asv CUDA matrices


def _conf(name):
    return json.loads((ROOT / name).read_text())


@pytest.mark.parametrize("name, package", [("asv.cuda.conf.json", "mlx-cuda-13"), ("asv.cuda12.conf.json", "mlx-cuda-12")])
def test_the_cuda_matrices_pin_released_wheels_with_tf32_off(name, package):
    from gemmdrift.machine.backends import RELEASES

    cpu, cuda = _conf("asv.conf.json"), _conf(name)
    # Everything but the matrix is the CPU config's: the same benchmarks, build, install and results; the CUDA
    # matrices (from mlx 0.29.4, within gemmdrift's own requirements) keep the `pip check` the CPU history drops for
    # its releases before mlx 0.29 (docs/tracking.md)
    rest = ("include", "install_command")
    assert {k: v for k, v in cuda.items() if k not in rest} == {k: v for k, v in cpu.items() if k not in rest}
    assert cuda["install_command"] == [*cpu["install_command"], "in-dir={env_dir} python -m pip check"]
    cpu_reqs = [e["req"] for e in cpu["include"] if e["sys_platform"] == "linux"]
    pairs = set()
    for e in cuda["include"]:
        assert e["sys_platform"] == "linux" and e["python"] in cuda["pythons"]
        assert e["env_nobuild"] == {"MLX_ENABLE_TF32": "0"}  # true float32 under float32 names
        req = dict(e["req"])
        mlx = req.pop("mlx")
        wheel = [p for p in req if p.startswith("mlx-cuda")]
        assert len(wheel) == 1 and req.pop(wheel[0]) == mlx, e  # one backend wheel, of mlx's version
        assert wheel[0] == (package if mlx in RELEASES[package] else "mlx-cuda")
        assert mlx in RELEASES[wheel[0]], f"{wheel[0]} {mlx} was never released"
        assert "mlx-cpu" not in req
        # The rest as in the CPU matrix (numpy, gguf and the weights pinned alike).
        same = [{k: v for k, v in r.items() if k not in ("mlx", "mlx-cpu")} for r in cpu_reqs]
        assert req in same, req
        pairs.add((mlx, req["mlx-lm"]))
    # The main line (each release with its mlx-lm) and the mlx-lm axis at the newest mlx, as on the CPU;
    # 0.31.2 has no CUDA wheel, so the 0.31 point is 0.31.1.
    assert pairs == {("0.29.4", "0.30.2"), ("0.30.6", "0.31.2"), ("0.31.1", "0.31.2"), ("0.32.4", "0.32.2"),
                     ("0.32.4", "0.30.2"), ("0.32.4", "0.31.3")}


def test_the_cuda_page_names_the_cuda_releases():
    section = (ROOT / "docs" / "cuda.md").read_text(encoding="utf-8")
    for text in ("0.30.1", "0.31.1", "0.31.2", "0.29.4", "mlx-cuda-13", "mlx-cuda-12", "asv.cuda.conf.json",
                 "MLX_ENABLE_TF32=0", "sm80"):
        assert text in section, text


# ------------------------------------------------------------------ backend wheels in the record


def test_installed_backend_wheels_are_listed_from_the_metadata():
    from gemmdrift.machine.backends import installed

    planted = {"mlx-cpu": "0.32.4", "mlx-cuda-13": "0.32.4"}
    assert installed(planted.get) == planted  # both: the record lists every one, not the first


def test_backend_wheel_problems():
    from gemmdrift.machine.backends import problems

    assert problems({"mlx-cpu": "0.32.4"}, "cpu", False, "0.32.4") == []
    assert problems({"mlx-cuda-13": "0.32.4"}, "cuda", True, "0.32.4") == []
    assert problems({"mlx-metal": "0.32.4"}, "metal", False, "0.32.4") == []
    both = problems({"mlx-cpu": "0.32.4", "mlx-cuda-13": "0.32.4"}, "cuda", True, "0.32.4")
    assert len(both) == 1 and "several mlx backend wheels" in both[0] and "libmlx.so" in both[0]
    assert "sees no CUDA device" in problems({"mlx-cuda-12": "0.31.1"}, "cpu", False, "0.31.1")[0]
    assert "no mlx-cuda wheel" in problems({"mlx-cpu": "0.32.4"}, "cuda", True, "0.32.4")[0]
    assert problems({"mlx-cpu": "0.31.2"}, "cpu", False, "0.32.4") == ["mlx-cpu 0.31.2 does not match mlx 0.32.4"]


def test_this_environment_has_one_consistent_backend_wheel():
    from gemmdrift.machine.backends import check, installed
    from gemmdrift.machine.envinfo import environment

    assert check() == []  # this venv: mlx-cpu of mlx's version only
    env = environment()
    assert env["mlx_backend_problems"] == []
    assert set(env["mlx_backend_wheels"]) == set(installed())  # the record's list is what the check read
    if sys.platform == "linux":
        assert installed(), "a Linux mlx needs a backend wheel"


def test_a_mixed_environment_is_said_in_the_record(monkeypatch, capsys):
    from gemmdrift.machine import backends

    monkeypatch.setattr(backends, "installed", lambda: {"mlx-cpu": "0.32.4", "mlx-cuda-13": "0.32.4"})
    monkeypatch.setattr(backends, "_WARNED", set())
    found = backends.check()
    assert any("several mlx backend wheels" in p for p in found)
    assert any("sees no CUDA device" in p for p in found)  # this machine has none
    assert capsys.readouterr().err.count("gemmdrift: warning:") == len(found)
    backends.check()
    assert capsys.readouterr().err == ""  # said once per process


# ------------------------------------------------------------------ an mlx that cannot load

LIBCUDA = "libcuda.so.1: cannot open shared object file: No such file or directory"  # what mlx-cuda raises


def test_an_mlx_cuda_without_a_driver_is_said_in_one_line():
    from gemmdrift.machine.backends import import_problem, is_mlx_import

    e = ImportError(LIBCUDA, name="mlx.core")
    assert is_mlx_import(e) and not is_mlx_import(ImportError("no module named foo", name="foo"))
    line = import_problem(e, {"mlx-cuda-13": "0.32.4"})
    assert line == ("mlx cannot load its CUDA backend (mlx-cuda-13 0.32.4): this machine has no NVIDIA driver "
                    "(libcuda.so.1 does not load); use the cpu backend here (make BACKEND=cpu: .venv)")
    assert import_problem(ImportError("boom\nmore", name="mlx.core"), {}) == "mlx cannot be imported: boom"


@pytest.mark.parametrize("argv", [["env"], ["run", "--out", "{out}"], ["stack", "--out", "{out}"]])
def test_commands_refuse_an_mlx_that_cannot_load_in_one_line(tmp_path, argv):
    """Issue 53, item 8: with mlx-cuda and no NVIDIA driver, `gemmdrift run`, `env` and `stack` ended in a
    traceback (`ImportError: libcuda.so.1`). Simulated: an mlx whose core raises what mlx-cuda raises there."""
    fake = tmp_path / "fake"
    (fake / "mlx").mkdir(parents=True)
    (fake / "mlx" / "__init__.py").write_text("")
    (fake / "mlx" / "core.py").write_text(f"raise ImportError({LIBCUDA!r}, name='mlx.core')\n")
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake), str(ROOT / "src")])}
    r = subprocess.run([sys.executable, "-m", "gemmdrift", *[a.format(out=out) for a in argv]], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == [
        "gemmdrift: error: mlx cannot load its CUDA backend (mlx-cuda): this machine has no NVIDIA driver "
        "(libcuda.so.1 does not load); use the cpu backend here (make BACKEND=cpu: .venv)"], r.stderr
    assert not out.exists()  # before any work


def test_an_mlx_import_error_met_late_is_one_line_too(monkeypatch, capsys):
    from gemmdrift import cli

    def handler(args):
        raise ImportError(LIBCUDA, name="mlx.core")

    monkeypatch.setattr(cli, "cmd_report", handler)
    assert cli.main(["report", "nowhere"]) == 2
    assert capsys.readouterr().err.startswith("gemmdrift: error: mlx cannot load its CUDA backend")
