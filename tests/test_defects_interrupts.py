"""Issue 33 D11c: Ctrl-C on `fingerprint` with its worker processes prints no worker traceback."""

import os
import signal
import subprocess
import sys
import time


def test_a_group_ctrl_c_on_fingerprint_leaves_no_worker_traceback(tmp_path):
    # The matmul path finishes in seconds and its worker goes idle; the quantized one is still probing when the
    # terminal's SIGINT reaches the whole group. The idle worker used to die with
    # "Process SpawnProcess-N: Traceback ... KeyboardInterrupt" on stderr.
    out = tmp_path / "fp"
    p = subprocess.Popen([sys.executable, "-m", "gemmdrift", "fingerprint", "--paths", "matmul:bfloat16,quant:affine-q4-g64",
                          "--k", "1024", "--ts", "1,2,3,4", "--out", str(out)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True)
    err = ""
    try:
        t0 = time.monotonic()
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(p.stderr, selectors.EVENT_READ)
        while "matmul:bfloat16 K=1024 T=4" not in err and time.monotonic() - t0 < 240 and p.poll() is None:
            if sel.select(timeout=1.0):
                err += p.stderr.readline()
        assert "matmul:bfloat16 K=1024 T=4" in err and "quant:affine-q4-g64 K=1024 T=4" not in err, err
        time.sleep(1.0)
        os.killpg(p.pid, signal.SIGINT)
        err += p.communicate(timeout=240)[1]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert "gemmdrift fingerprint: interrupted:" in err.strip().splitlines()[-1]


def test_state_interrupted_with_finished_cells_says_they_are_kept(tmp_path):
    # D11a: three rollback cells on disk, no half of the sweep: the message said "nothing had finished".
    from argparse import Namespace

    from gemmdrift.checkpoint import Interrupted
    from gemmdrift.interrupts import on_interrupt

    msg = on_interrupt(Namespace(command="state", out=str(tmp_path)), Interrupted(None, 0, 2, "3 finished rollback cells"))
    assert "nothing had finished" not in msg and "3 finished rollback cells are kept" in msg
    assert "no partial result is written" in msg and str(tmp_path / ".checkpoints") in msg

