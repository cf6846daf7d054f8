"""Issue 53 (PROBE-DEFECTS-4 items 13, 20, 29): ``python -m gemmdrift.history.releases``'s flags and its Ctrl-C.

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

from gemmdrift.history import releases as history_run


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


def test_the_bridges_run_apart_at_the_historys_commit(tmp_path, monkeypatch, capsys):
    """Issue 55 point 4: a bridge entry (mlx 0.30.6 with the older mlx-lm 0.30.2 of the pair 0.29.4 -> 0.30.6) is
    not part of the history's run (its results would relabel mlx 0.30.6); --bridges runs the bridges alone, into
    <results>/bridges, at the commit the history's status file records (not HEAD)."""
    root = _repo(tmp_path, git=True)
    conf = json.loads((root / "asv.conf.json").read_text())
    conf["include"] += [{"sys_platform": "linux", "req": {"mlx": m, "mlx-cpu": m, "mlx-lm": lm}}
                        for m, lm in [("0.30.6", "0.31.2"), ("0.30.6", "0.30.2"), ("0.32.4", "0.31.3")]]
    (root / "asv.conf.json").write_text(json.dumps(conf))
    from gemmdrift import matrix

    assert [lab for lab, _ in matrix.bridges(conf)] == ["mlx0.30.6-lm0.30.2"]  # 0.32.4's older one is the axis
    ref = root / "benchmarks" / "reference"
    ref.mkdir(parents=True)
    old = "37c30d38588d0a386038d533656798e9bcd4f3b8"
    (ref / f"{history_run.MACHINE}.status.json").write_text(json.dumps({"commit": old, "envs": {}}))
    monkeypatch.setattr(history_run, "resolve_commit", lambda _root, rev: rev)
    rc, err = main(capsys, monkeypatch, root, "--dry-run")
    assert rc == 0 and "4 environments at gemmdrift 37c30d38" in err and "mlx0.30.6-lm0.30.2" not in err, err
    rc, err = main(capsys, monkeypatch, root, "--bridges", "--dry-run")
    assert rc == 0 and "1 environment at gemmdrift 37c30d38" in err and "would run mlx0.30.6-lm0.30.2" in err, err
    rc, err = main(capsys, monkeypatch, root, "--only", "mlx0.30.6-lm0.30.2", "--dry-run")
    assert rc == 2 and err.strip() == "history: --only mlx0.30.6-lm0.30.2: a bridge entry: give --bridges", err
    rc, err = main(capsys, monkeypatch, root, "--bridges", "--only", "mlx0.29.4-lm0.30.2", "--dry-run")
    assert rc == 2 and err.strip() == "history: --only mlx0.29.4-lm0.30.2: not a bridge entry: leave out --bridges"
