"""gemmdrift.workers: a worker process that dies is one line, never a wait for good.

multiprocessing's Pool (the fresh-process path of run_jobs, which suite.side_by_side takes) replaces a dead worker
without a word and loses its job, so a plain ``get()`` waited forever; ProcessPoolExecutor raises
BrokenProcessPool, which reached the user as a traceback. Each case runs in a subprocess with a time limit, so
that a regression fails here instead of hanging the suite.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gemmdrift.workers import died

HERE = Path(__file__).resolve().parent
LIMIT = 240  # seconds: two spawned workers load a tiny model; a hang never ends


def _die(lm, *, how: str):
    """A job that ends its own process: ``kill`` as the out-of-memory killer does, ``exit`` as a crash would."""
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(3)


def _rows(lm, *, n: int):
    return n * 2


def _after(lm, *, flag: str, n: int | None = None):
    """A job that finishes only once the parent has reported another one (the parent writes ``flag``);
    ``n`` None: it then raises instead of returning."""
    import time

    start = time.monotonic()
    while not os.path.exists(flag):
        if time.monotonic() - start > 60:
            raise RuntimeError("the other part was never reported while this one ran")
        time.sleep(0.05)
    if n is None:
        raise ValueError("planted failure")
    return n * 2


def _run(tmp_path, body: str) -> subprocess.CompletedProcess:
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(HERE)!r})
        from gemmdrift.errors import GemmdriftError
        from gemmdrift.model import load_model
        from gemmdrift import suite, workers
        from test_models import save_tiny
        import test_workers as T

        from pathlib import Path
        save_tiny(Path({str(tmp_path / "m")!r}))
        lm = load_model({str(tmp_path / "m")!r}, dtype="bfloat16")
        try:
    """) + textwrap.indent(textwrap.dedent(body), "    ") + textwrap.dedent("""
        except GemmdriftError as e:
            print("ERROR:", e)
            sys.exit(2)
    """)
    try:
        return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=LIMIT,
                              cwd=tmp_path)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still waiting after {LIMIT} s: a dead worker was waited for")


def test_a_part_whose_process_is_killed_is_one_line_in_side_by_side(tmp_path):
    r = _run(tmp_path, """
        out = suite.side_by_side(lm, {"dies": (T._die, dict(how="kill")), "lives": (T._rows, dict(n=3))}, workers=2)
        print("RESULT", out)
    """)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "ERROR: a worker process died before finishing its part (killed by SIGKILL (out of memory?))" in r.stdout
    assert "Traceback" not in r.stderr


def test_a_part_that_exits_is_one_line_with_one_worker_too(tmp_path):
    r = _run(tmp_path, """
        out = suite.side_by_side(lm, {"lives": (T._rows, dict(n=3)), "dies": (T._die, dict(how="exit"))}, workers=1)
        print("RESULT", out)
    """)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "ERROR: a worker process died before finishing its part (exit code 3)" in r.stdout


def test_a_worker_that_cannot_load_the_model_is_one_line(tmp_path):
    """The model directory gone after the load: every fresh worker's load fails (the Pool would respawn them
    without end)."""
    r = _run(tmp_path, """
        import shutil
        shutil.rmtree(lm.recipe["source"])
        out = suite.side_by_side(lm, {"a": (T._rows, dict(n=1)), "b": (T._rows, dict(n=2))}, workers=2)
        print("RESULT", out)
    """)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "ERROR: a worker process died before finishing its part (exit code 1)" in r.stdout


def test_a_pool_worker_killed_is_one_line(tmp_path):
    """run_jobs without ``fresh``: ProcessPoolExecutor's BrokenProcessPool becomes the same line."""
    r = _run(tmp_path, """
        out = workers.run_jobs(lm, T._die, [dict(how="kill"), dict(how="kill")], 2)
        print("RESULT", out)
    """)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "ERROR: a worker process died before finishing its part" in r.stdout


def test_the_parts_that_live_give_their_results(tmp_path):
    r = _run(tmp_path, """
        print("RESULT", suite.side_by_side(lm, {"a": (T._rows, dict(n=1)), "b": (T._rows, dict(n=5))}, workers=2))
    """)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "RESULT {'a': 2, 'b': 10}" in r.stdout


def test_each_part_is_reported_as_it_finishes_not_in_the_order_given(tmp_path):
    """side_by_side's ``done`` comes as each part finishes: the main job keeps every finished part at once.
    Here the first part can only finish after the second was reported (waiting in the order given deadlocks
    until the first part's 60 s limit)."""
    r = _run(tmp_path, """
        said = []
        def done(name, result, seconds):
            said.append((name, result, seconds >= 0))
            Path("flag").touch()
        out = suite.side_by_side(lm, {"slow": (T._after, dict(flag="flag", n=3)), "fast": (T._rows, dict(n=1))},
                                 workers=2, done=done)
        print("SAID", said, "OUT", out)
    """)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "SAID [('fast', 2, True), ('slow', 6, True)] OUT {'slow': 6, 'fast': 2}" in r.stdout


def test_a_part_that_fails_after_another_finished_leaves_that_one_reported(tmp_path):
    r = _run(tmp_path, """
        said = []
        def done(name, result, seconds):
            said.append(name)
            Path("flag").touch()
        try:
            suite.side_by_side(lm, {"fails": (T._after, dict(flag="flag")), "fast": (T._rows, dict(n=1))},
                               workers=2, done=done)
        except ValueError as e:
            print("RAISED", e, "SAID", said)
    """)
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "RAISED planted failure SAID ['fast']" in r.stdout


def test_the_line_names_the_signal():
    assert died(-9) == ("a worker process died before finishing its part (killed by SIGKILL (out of memory?)); run "
                        "the command again to resume from what was checkpointed, or with --workers 1 (where it has "
                        "that flag) to compute in this process")
    assert "(killed by SIGTERM)" in died(-15) and "(exit code 1)" in died(1) and "(exit code -999)" in died(-999)
