"""The whole model under replay (issue 22, item 4): the prefix the schedules share computed once natively,
and ``--kernels`` on ``kernels``, ``diverge`` and ``triage`` (tiny seeded model)."""

from __future__ import annotations

import numpy as np
import pytest

TOKS = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79]
SCHEDS = ["prefill:8,decode", "prefill:8,verify:3"]


def _state_bits(cache) -> list[np.ndarray]:
    import mlx.core as mx

    return [np.array(a.astype(mx.float32)).view(np.uint32) for c in cache for a in c.state
            if isinstance(a, mx.array)]  # a rotating cache's state carries its offsets as ints too


def _spy(monkeypatch):
    """Record every prefix stack makes and the prefix each run starts from."""
    from gemmdrift import stack

    made, used = [], []
    real_prefix, real_run = stack.common_prefix, stack.run_schedule

    def prefix(*a, **k):
        p = real_prefix(*a, **k)
        made.append(p)
        return p

    def run(model, tokens, schedule, **k):
        used.append((str(schedule), k.get("prefix")))
        return real_run(model, tokens, schedule, **k)

    monkeypatch.setattr(stack, "common_prefix", prefix)
    monkeypatch.setattr(stack, "run_schedule", run)
    return made, used


def test_stack_under_replay_shares_one_native_prefix(monkeypatch):
    from conftest import make_tiny
    from gemmdrift.kernels.replay_model import KernelsOption, replayed
    from gemmdrift.stack import measure_stack
    from gemmdrift.taps import common_prefix

    tiny = make_tiny(seed=1, hidden_size=256, intermediate_size=512)  # wide enough for M3's order to show

    native = common_prefix(tiny.model, TOKS, SCHEDS, 8, 8)
    with replayed(tiny, "M3"):
        replayed_prefix = common_prefix(tiny.model, TOKS, SCHEDS, 8, 8)
    # Not vacuous: M3's prefill recipe gives other bits than this machine's kernels on this prefix.
    assert any(not np.array_equal(a, b) for a, b in zip(_state_bits(native.cache), _state_bits(replayed_prefix.cache)))
    made, used = _spy(monkeypatch)
    opt = KernelsOption("replay:M3")
    with opt.installed(tiny):
        r = opt.label(measure_stack(tiny, TOKS, SCHEDS, split=8, local=False, workers=opt.workers))
    assert len(made) == 1 and made[0] is not None
    assert [s for s, _ in used] == SCHEDS and all(p is made[0] for _, p in used)  # one state, both schedules
    for a, b in zip(_state_bits(made[0].cache), _state_bits(native.cache)):
        assert np.array_equal(a, b)  # computed with this machine's kernels
    rec = r.details["replay"]
    assert rec["prefix"].startswith("native, shared by every schedule (8 tokens")
    assert all(c["T"] in (1, 4) for c in rec["calls"])  # no T=8 prefill call was replayed
    # --replay-prefix: the old way, the shared prefix replayed (once) too.
    made.clear()
    opt = KernelsOption("replay:M3", replay_prefix=True)
    assert opt.checkpoint != KernelsOption("replay:M3").checkpoint
    with opt.installed(tiny):
        r2 = opt.label(measure_stack(tiny, TOKS, SCHEDS, split=8, local=False, workers=opt.workers))
    assert r2.details["replay"]["prefix"].startswith("replayed, shared")
    for a, b in zip(_state_bits(made[0].cache), _state_bits(replayed_prefix.cache)):
        assert np.array_equal(a, b)
    assert {c["T"] for c in r2.details["replay"]["calls"]} >= {8}


def test_stack_under_replay_cpu_with_native_prefix_equals_the_measured_run(tiny):
    from gemmdrift.kernels.replay_model import KernelsOption
    from gemmdrift.stack import measure_stack

    plain = measure_stack(tiny, TOKS, SCHEDS, split=8, local=True, workers=1)
    opt = KernelsOption("replay:cpu")
    with opt.installed(tiny):
        r = opt.label(measure_stack(tiny, TOKS, SCHEDS, split=8, local=True, workers=opt.workers))
    assert r.figures == plain.figures and r.details["replay"]["prefix"].startswith("native")
    assert r.tables["stack"].equals(plain.tables["stack"])


def test_measure_stack_under_replay_refuses_workers_and_the_ladder(tiny):
    from gemmdrift.errors import GemmdriftError
    from gemmdrift.kernels.replay_model import replayed
    from gemmdrift.stack import measure_stack

    with replayed(tiny, "M3"):
        with pytest.raises(GemmdriftError, match="one process"):
            measure_stack(tiny, TOKS, SCHEDS, split=8, local=False, workers=2)
        with pytest.raises(GemmdriftError, match="ladder"):
            measure_stack(tiny, TOKS, SCHEDS, split=8, local=False, ladder=True, workers=1)
