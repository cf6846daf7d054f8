"""Interrupted runs keep and resume what finished (issue 25, item 1).

Each checkpointed measurement is interrupted mid-run (KeyboardInterrupt raised from a progress callback
or a faked unit after some units finished): the partial Result holds exactly the finished units and is
marked partial; the rerun resumes them (they are not computed again) and its tables equal an
uninterrupted run's (timings aside). All on the tiny model or model-free.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from conftest import make_tiny
from gemmdrift import store
from gemmdrift.checkpoint import Interrupted

RNG = np.random.default_rng(0)
TARGET = [int(x) for x in RNG.integers(5, 97, 6)]
SHORT = [[int(x) for x in RNG.integers(5, 97, k)] for k in (3, 5, 4)]


def _same(a: pd.DataFrame, b: pd.DataFrame, drop=()) -> None:
    """Equal tables, timings aside; compared as written (CSV), where None and NaN are one empty cell."""
    cols = [c for c in a.columns if c not in drop and not c.startswith("seconds")]
    assert list(a.columns) == list(b.columns)
    assert a[cols].to_csv(index=False) == b[cols].to_csv(index=False)


def _interrupt_after(n: int, marker: str, say=None):
    seen = []

    def progress(msg: str) -> None:
        seen.append(msg)
        if say is not None:
            say(msg)
        if sum(marker in m for m in seen) == n:
            raise KeyboardInterrupt

    return progress, seen


@pytest.fixture(scope="module")
def tiny():
    return make_tiny("bfloat16")


def test_fingerprint_resumes_path_x_t(tmp_path):
    from gemmdrift import fingerprint

    kw = dict(K=16, ts=[1, 2, 3], N=8, draw_k=0, workers=1)
    paths = ["matmul:float32", "sum:float32"]
    progress, _ = _interrupt_after(4, "tree(s)")
    with pytest.raises(Interrupted) as e:
        fingerprint.measure(paths, progress=progress, checkpoint=tmp_path, **kw)
    part = e.value.result
    assert (e.value.done, e.value.total) == (4, 6)
    assert part.inputs["partial"] == {"done": 4, "total": 6, "unit": "path x T"}
    t = part.tables["fingerprints"]
    assert sorted(set(zip(t["path"], t["T"]))) == [("matmul:float32", 1), ("matmul:float32", 2),
                                                    ("matmul:float32", 3), ("sum:float32", 1)]
    log = []
    again = fingerprint.measure(paths, progress=log.append, checkpoint=tmp_path, **kw)
    assert sum("done before (resumed)" in m for m in log) == 4 and sum("tree(s)" in m for m in log) == 2
    whole = fingerprint.measure(paths, **kw)
    _same(again.tables["fingerprints"], whole.tables["fingerprints"])
    _same(again.tables["accumulator"], whole.tables["accumulator"])
    assert "partial" not in again.inputs


def test_state_resumes_finished_half(tiny, tmp_path, monkeypatch):
    from gemmdrift import state

    kw = dict(operations=["rollback", "trim"], where=["below"], ks=[1], caches=["KVCache"], workers=1,
              ladder=False)
    orig = state._progress
    said = []

    def boom(msg):
        said.append(msg)
        orig(msg)
        if msg.startswith("trim: done"):  # the second half, before it is saved
            raise KeyboardInterrupt

    monkeypatch.setattr(state, "_progress", boom)
    with pytest.raises(Interrupted) as e:
        state.measure_state(tiny, checkpoint=tmp_path, **kw)
    part = e.value.result
    assert (e.value.done, e.value.total) == (1, 2)
    assert set(part.tables["state"]["operation"]) == {"rollback"}
    monkeypatch.setattr(state, "_progress", lambda m: said.append(m))
    said.clear()
    again = state.measure_state(tiny, checkpoint=tmp_path, **kw)
    assert "rollback: done before (resumed)" in said and not any(m.startswith("rollback KVCache") for m in said)
    whole = state.measure_state(tiny, **kw)
    assert set(whole.tables["state"]["operation"]) == {"rollback", "trim"}
    _same(again.tables["state"], whole.tables["state"])


def test_state_resumes_finished_rollback_cells_with_their_ladder(tiny, tmp_path, monkeypatch):
    """Within the rollback (the sweep's longest part) each setup x position cell is kept before the precision
    ladder; a resumed cell still gets its float32 rerun, so the rows equal an uninterrupted sweep's. (A planted
    cache that rounds on trim gives rows the ladder must judge; the sweep is called with its checkpoints.)"""
    from gemmdrift import state
    from gemmdrift.checkpoint import Checkpoints
    from test_state import _kv_setup, _planted

    _, _, rounds = _planted()
    setups = [_kv_setup(rounds, "TrimRounds")]
    kw = dict(where=("below", "past"), ks=(2,), setups=setups, ladder=True, envelope=None, compute_limit=None,
              caches=None)
    ck = Checkpoints(tmp_path, "state", tiny.description, "test")
    said = []

    def boom(msg):
        said.append(msg)
        if msg.startswith("rollback TrimRounds below"):  # the first of the two cells is done and saved
            raise KeyboardInterrupt

    monkeypatch.setattr(state, "_progress", boom)
    with pytest.raises(KeyboardInterrupt):
        state._sweep(tiny, ("rollback",), checkpoint=ck, **kw)
    said.clear()
    monkeypatch.setattr(state, "_progress", said.append)
    again = state._sweep(tiny, ("rollback",), checkpoint=ck, **kw)
    assert sum("done before (resumed)" in m for m in said) == 1
    whole = state._sweep(tiny, ("rollback",), **kw)
    t, w = pd.DataFrame(again["rows"]), pd.DataFrame(whole["rows"])
    assert (w[w["where"] == "below"]["shrink"] >= 100).any()  # the resumed cell has rows the ladder judged
    _same(t, w)


def test_batch_resumes_finished_rows(tiny, tmp_path, capsys):
    from gemmdrift.measure import batch

    kw = dict(batch_sizes=(1, 2), reference=False)
    progress, _ = _interrupt_after(2, " row ")  # B=1 row 0, then B=2 row 0; B=2 row 1 not yet
    with pytest.raises(Interrupted) as e:
        batch.measure_batch(tiny, {"t": TARGET}, {"short": SHORT}, 4, progress=progress, checkpoint=tmp_path, **kw)
    part = e.value.result
    assert (e.value.done, e.value.total) == (2, 3)
    assert list(zip(part.tables["batch"]["B"], part.tables["batch"]["row"])) == [(1, 0), (2, 0)]
    store.write_result(part, tmp_path, draw=False)  # what the CLI does: the partial Result beside the checkpoints
    assert store.read_result(tmp_path).inputs["partial"]["done"] == 2
    log = []
    again = batch.measure_batch(tiny, {"t": TARGET}, {"short": SHORT}, 4, progress=log.append, checkpoint=tmp_path,
                                **kw)
    assert sum("done before (resumed)" in m for m in log) == 2
    whole = batch.measure_batch(tiny, {"t": TARGET}, {"short": SHORT}, 4, **kw)
    _same(again.tables["batch"], whole.tables["batch"])
    from argparse import Namespace

    from gemmdrift import cli

    cli.write_and_print(Namespace(json=False), again, tmp_path)
    assert not (tmp_path / ".checkpoints").exists()  # the whole Result holds them now
    said = capsys.readouterr().out
    assert "streams/batch_t_short_B1_r0_a.json" in said  # the listing names the streams/ directory
    pair = again.details["pairs"][-1]
    assert pair["schedule_b"] == "batch:B2,row1,prefill:2048,decode"  # what the row really ran


class _Tok:
    """A stand-in tokenizer for the tiny model: one id per character, BOS first."""

    def encode(self, text):
        return [2] + [3 + ord(c) % 90 for c in text][:12]

    def decode(self, ids):
        return "".join(chr(65 + i % 26) for i in ids)


def _fake_server(calls, stop_at):
    from gemmdrift.measure import server

    class Fake:
        """mlx_lm.server faked: greedy-looking deterministic replies, no process (the CLI test runs none)."""

        def __init__(self, *a, **k):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *e):
            return None

        def complete(self, prompt, n, timeout=0):
            calls.append(prompt)
            if len(calls) == stop_at:
                raise KeyboardInterrupt
            ids = _Tok().encode(prompt)
            toks = [(sum(ids) * 7 + 3 * i) % 90 + 5 for i in range(n)]
            return server.Reply(tokens=toks, text=_Tok().decode(toks), prompt_tokens=len(ids), cached_tokens=None,
                                seconds=0.01, finish_reason="length")

        def complete_concurrently(self, prompts, n):
            return [self.complete(p, n) for p in prompts]

    return Fake


def test_server_resumes_finished_cases(tmp_path, monkeypatch):
    from gemmdrift import model as models
    from gemmdrift.measure import server

    lm = make_tiny("float32")
    lm.tokenizer = _Tok()
    monkeypatch.setattr(server, "checkpoint_dir", lambda source: tmp_path / "ckpt")
    monkeypatch.setattr(server, "stored_dtype", lambda d: "float32")
    monkeypatch.setattr(models, "load_model", lambda *a, **k: lm)
    kw = dict(cases=("concurrent", "conversation"), companions=["Once upon"], triage=True)
    calls = []
    # requests: alone, 2 concurrent, the second turn fresh; then the reuse server's first turn: interrupted
    monkeypatch.setattr(server, "MlxLmServer", _fake_server(calls, stop_at=5))
    with pytest.raises(Interrupted) as e:
        server.measure_server("embedded", "Hello", 3, checkpoint=tmp_path / "out", **kw)
    part = e.value.result
    assert (e.value.done, e.value.total) == (1, 2) and list(part.tables["server"]["case"]) == ["concurrent"]
    assert part.inputs["model"]["source"] == "embedded"  # as the user named it, not the checkpoint's path
    calls.clear()
    monkeypatch.setattr(server, "MlxLmServer", _fake_server(calls, stop_at=-1))
    again = server.measure_server("embedded", "Hello", 3, checkpoint=tmp_path / "out", **kw)
    assert len(calls) == 4  # alone and the second turn, then the reuse server's two: concurrent was not resent
    calls.clear()
    whole = server.measure_server("embedded", "Hello", 3, **kw)
    assert len(calls) == 6
    _same(again.tables["server"], whole.tables["server"])
