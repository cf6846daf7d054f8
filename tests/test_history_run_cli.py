"""Issue 53 (PROBE-DEFECTS-4 items 13, 20, 29): ``python -m gemmdrift.history_run``'s flags and its Ctrl-C.

An empty ``--only`` selected all 29 environments, an unknown ``--commit`` printed git's usage line, a dry run said
"1 environments" and then counted every environment of the status file, and Ctrl-C left asv's benchmark server
(in a process group of its own) running.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import _thread
from pathlib import Path

import pytest

from gemmdrift import history_run


def _repo(tmp_path: Path, git: bool = False) -> Path:
    conf = {"include": [{"sys_platform": "linux", "req": {"mlx": m, "mlx-cpu": m, "mlx-lm": lm}}
                        for m, lm in [("0.29.4", "0.30.2"), ("0.32.4", "0.32.2")]]}
    (tmp_path / "asv.conf.json").write_text(json.dumps(conf))
    if git:
        for cmd in (["init", "-q"], ["add", "asv.conf.json"],
                    ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "x"]):
            subprocess.run(["git", "-C", str(tmp_path), *cmd], check=True, capture_output=True)
    return tmp_path


def main(capsys, monkeypatch, root: Path, *argv: str) -> tuple[int, str]:
    monkeypatch.chdir(root)
    rc = history_run.main(list(argv))
    return rc, capsys.readouterr().err


def test_an_empty_only_is_refused_not_every_entry(tmp_path, monkeypatch, capsys):
    """--only '' and --only , selected all 29 environments (a 90-minute run)."""
    root = _repo(tmp_path, git=True)
    for only in ("", ",", " , "):
        rc, err = main(capsys, monkeypatch, root, "--only", only, "--dry-run", "--results", str(tmp_path / "r"))
        assert rc == 2 and len(err.strip().splitlines()) == 1 and "give at least one entry label" in err, err


def test_an_unknown_commit_is_one_line(tmp_path, monkeypatch, capsys):
    """--commit deadbeef printed git's usage line ("git <command> [<revision>...] -- [<file>...]")."""
    root = _repo(tmp_path, git=True)
    rc, err = main(capsys, monkeypatch, root, "--commit", "deadbeef", "--dry-run", "--results", str(tmp_path / "r"))
    assert rc == 2 and err.strip() == f"history: --commit deadbeef: no such commit in {root.resolve()}", err
    rc, err = main(capsys, monkeypatch, root, "--commit", "HEAD", "--dry-run", "--results", str(tmp_path / "r"))
    assert rc == 0 and "2 environments at gemmdrift" in err


def test_the_counts_are_of_the_entries_asked_for(tmp_path, monkeypatch, capsys):
    """--only X --dry-run said "1 environments", and a run with --only counted every environment of the status."""
    root = _repo(tmp_path, git=True)
    results = tmp_path / "r"
    results.mkdir()
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    envs = {lab: {"state": history_run.DONE, "build_s": 1, "run_s": 60}
            for lab in ("mlx0.29.4-lm0.30.2", "mlx0.32.4-lm0.32.2")}
    (results / f"{history_run.MACHINE}.status.json").write_text(json.dumps({"commit": head, "envs": envs}))
    rc, err = main(capsys, monkeypatch, root, "--only", "mlx0.29.4-lm0.30.2", "--dry-run", "--results", str(results))
    assert rc == 0 and "1 environment at gemmdrift" in err and "environments" not in err and "measured" not in err
    rc, err = main(capsys, monkeypatch, root, "--only", "mlx0.29.4-lm0.30.2", "--results", str(results))
    assert rc == 0 and "1 measured, 0 not installable, 0 failed" in err, err


CHILD = """
import subprocess, sys, time
server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"], start_new_session=True)
open(sys.argv[1], "w").write(str(server.pid))
time.sleep(300)
"""


@pytest.mark.skipif(sys.platform == "win32", reason="process groups")
def test_ctrl_c_stops_asv_and_the_server_it_started_in_its_own_group(tmp_path):
    """Ctrl-C on history_run left asv's `benchmark.py run_server` running (its own process group): planted here as
    a grandchild in a session of its own, which must be gone after the interrupt."""
    pid_file = tmp_path / "server.pid"
    cmd = [sys.executable, "-c", CHILD, pid_file]

    def interrupt_once_started():
        end = time.monotonic() + 60
        while not (pid_file.is_file() and pid_file.read_text()) and time.monotonic() < end:
            time.sleep(0.05)
        _thread.interrupt_main()  # what the terminal's Ctrl-C does to this process (asv's group never sees it)

    threading.Thread(target=interrupt_once_started, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        history_run.run_asv(cmd, tmp_path, dict(os.environ), tmp_path / "asv.log")
    server = int(pid_file.read_text())
    end = time.monotonic() + 10
    while history_run._alive(server) and time.monotonic() < end:
        time.sleep(0.1)
    alive = history_run._alive(server)
    if alive:
        os.kill(server, signal.SIGKILL)
    assert not alive, "the planted benchmark server outlived the interrupt"
