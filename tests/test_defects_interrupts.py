"""Issue 33 D11c: Ctrl-C on `fingerprint` with its worker processes prints no worker traceback."""

import os
import signal
import subprocess
import sys
import time

import pytest


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


def test_state_interrupted_after_rollback_cells_writes_them_as_a_partial_result(tiny, tmp_path, monkeypatch):
    # D11a: Ctrl-C after some rollback cells (setup x position) and no half of the sweep kept the cells on disk
    # but wrote no partial Result. Now the cells' rows are the partial Result, written atomically beside the
    # checkpoints, and the message says exactly that.
    from argparse import Namespace

    import pandas as pd

    from gemmdrift import state, store
    from gemmdrift.checkpoint import Interrupted
    from gemmdrift.interrupts import on_interrupt

    said = []

    def progress(msg):
        said.append(msg)
        if msg.startswith("rollback ") and sum(m.startswith("rollback ") for m in said) == 3:
            raise KeyboardInterrupt  # three cells done and saved, the fourth not started

    monkeypatch.setattr(state, "_progress", progress)
    kw = dict(operations=("rollback", "trim"), where=("below", "past"), ks=(1,), ladder=False,
              caches=("KVCache", "RotatingKVCache"), workers=1)
    with pytest.raises(Interrupted) as e:
        state.measure_state(tiny, checkpoint=tmp_path, **kw)
    part = e.value.result
    assert part is not None and e.value.done == 0
    assert part.inputs["partial"]["cells"] == {"done": 3, "total": 4}
    cells = part.tables["state"]
    assert set(cells["operation"]) == {"rollback"}
    msg = on_interrupt(Namespace(command="state", out=str(tmp_path)), e.value)
    assert ("0 of 2 halves of the sweep and 3 of 4 rollback cells" in msg and "written to" in msg
            and "partial result" in msg and str(tmp_path / ".checkpoints") in msg), msg
    back = store.read_result(tmp_path)
    assert back.inputs["partial"]["cells"]["done"] == 3
    from gemmdrift.report import build_report

    md = build_report(tmp_path)["markdown"].read_text()
    assert "**partial**" in md and "3 of 4 rollback cells" in md
    assert not list(tmp_path.glob(".*.tmp*")) and not list(tmp_path.glob("*.tmp"))  # atomic: no leftovers
    monkeypatch.setattr(state, "_progress", lambda m: None)
    whole = state.measure_state(tiny, **{**kw, "workers": 1})
    w = whole.tables["state"]
    w = w[w["operation"] == "rollback"]
    got = back.tables["state"]
    assert len(got) == len(cells) > 0
    # the three cells' rows are the uninterrupted sweep's (no ladder here, so the verdicts are final)
    key = ["cache", "where", "params"]
    merged = pd.merge(got[key + ["verdict"]], w[key + ["verdict"]], on=key, suffixes=("", "_whole"))
    assert len(merged) == len(got) and (merged["verdict"] == merged["verdict_whole"]).all()
    assert got.groupby(["cache", "where"]).ngroups == 3


def test_state_interrupted_before_anything_finished_does_not_promise_checkpoints(tmp_path):
    # item 3: "kept in OUT/.checkpoints" was said when that directory did not exist
    from argparse import Namespace

    from gemmdrift.checkpoint import Interrupted
    from gemmdrift.interrupts import on_interrupt

    for exc in (Interrupted(None, 0, 2), KeyboardInterrupt()):
        msg = on_interrupt(Namespace(command="state", out=str(tmp_path / "o")), exc)
        assert ".checkpoints" not in msg and "nothing is kept" in msg, msg
    assert not (tmp_path / "o").exists()
    # an earlier run's finished half on disk: an interrupt before the sweep says it is kept
    d = tmp_path / "o" / ".checkpoints" / "state"
    d.mkdir(parents=True)
    (d / "rollback-abc.json").write_text("{}")
    msg = on_interrupt(Namespace(command="state", out=str(tmp_path / "o")), KeyboardInterrupt())
    assert str(tmp_path / "o" / ".checkpoints") in msg and "nothing is kept" not in msg
