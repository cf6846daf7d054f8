"""Model copies against the device's memory: `gemmdrift server` and explicit --workers (planted sizes; no backend
is faked: the decisions are pure functions of the numbers mlx reports)."""

from __future__ import annotations

import pytest

from gemmdrift.machine import memory
from gemmdrift.errors import GemmdriftError

GB = 10**9


def test_the_budget_is_read_from_the_right_key_per_backend():
    metal = {"architecture": "applegpu_g15s", "memory_size": 64 * GB, "max_recommended_working_set_size": 48 * GB}
    assert memory.budget_from_info("metal", metal, 1) == (48 * GB, "Metal's recommended working set")
    cuda = {"device_name": "NVIDIA H100", "architecture": "sm_90", "total_memory": 80 * GB}
    assert memory.budget_from_info("cuda", cuda, 1) == (80 * GB, "the CUDA device memory")
    assert memory.budget_from_info("cpu", {"device_name": "Xeon"}, 23 * GB) == (23 * GB, "the physical memory")
    assert memory.budget_from_info("cuda", {}, 1)[0] is None  # unknown: no refusal on a guess


def test_this_device_has_a_budget():
    budget, what = memory.device_budget()
    assert what == "the physical memory" and budget > GB  # this CPU machine


def test_the_server_keeps_frees_or_refuses():
    # The README's example: gemma-4-31b-it-8bit (~33 GB) with a 4-bit e2b draft (~3 GB) on a 64 GB Mac (48 GB
    # recommended working set): two copies plus the draft (69 GB) do not fit, the server's own (36 GB) do.
    assert memory.server_plan(33 * GB, 3 * GB, 48 * GB) == "free"
    assert memory.server_plan(33 * GB, 3 * GB, 128 * GB) == "keep"
    assert memory.server_plan(1 * GB, 0, 23 * GB) == "keep"  # the embedded Gemma here
    assert memory.server_plan(33 * GB, 3 * GB, None) == "keep"  # nothing known: as before
    assert memory.server_plan(20 * GB, 0, 40 * GB) == "keep"  # exactly two copies fit
    with pytest.raises(GemmdriftError) as e:
        memory.server_plan(33 * GB, 3 * GB, 24 * GB, "Metal's recommended working set")
    msg = str(e.value)
    assert "\n" not in msg and "36.0 GB" in msg and "24.0 GB" in msg and "Metal's recommended working set" in msg


def test_the_default_draft_is_estimated_as_a_4_bit_copy():
    assert memory.quantized_bytes(16 * GB, 16) == 4.5 * GB  # 4 bits + a bf16 scale and bias per 64 weights
    assert memory.quantized_bytes(32 * GB, 32) == 5 * GB  # float32 scales and biases: 4 + 64/64 bits


def test_explicit_workers_that_do_not_fit_are_refused():
    memory.check_copies(3, 10 * GB, 48 * GB, "Metal's recommended working set", "--workers 2")
    memory.check_copies(3, 10 * GB, None, "the CUDA device memory", "--workers 2")
    with pytest.raises(GemmdriftError, match=r"--workers 2: 3 copies of the model \(60.0 GB\) do not fit the CUDA "
                                             r"device memory \(48.0 GB\)"):
        memory.check_copies(3, 20 * GB, 48 * GB, "the CUDA device memory", "--workers 2")


def test_workers_get_the_device_type_and_index():
    import mlx.core as mx

    from gemmdrift import workers

    assert workers._device_name() == ("cpu", 0)
    workers._set_device(("cpu", 0))
    assert mx.default_device() == mx.Device(mx.cpu, 0)
    workers._set_device("cpu")  # the older form still works
    assert mx.default_device() == mx.cpu


@pytest.mark.slow
def test_the_server_refuses_before_loading_when_its_copies_do_not_fit(monkeypatch, capsys):
    from gemmdrift import cli, model as models
    from gemmdrift.measure import server

    monkeypatch.setattr(memory, "device_budget", lambda: (10**6, "Metal's recommended working set"))
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the model loaded before the check"))
    assert cli.main(["server", "--n", "2", "--cases", "draft"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "more than Metal's recommended working set (0.0 GB)" in err[0], err
    target = memory.checkpoint_bytes(server.checkpoint_dir("embedded"))
    assert target > 10**8  # the embedded Gemma's converted checkpoint


@pytest.mark.slow
def test_the_server_frees_its_copy_while_the_servers_run_and_reloads_it(monkeypatch):
    import numpy as np

    from gemmdrift.measure import server

    target = memory.checkpoint_bytes(server.checkpoint_dir("embedded"))
    # Room for one copy and a bit, not two: gemmdrift's copy must go while the servers run.
    monkeypatch.setattr(memory, "device_budget", lambda: (int(1.5 * target), "the physical memory"))
    seen = {}

    def fake_run_cases(lm, model_dir, prompt, n, *, reload=None, **kw):
        seen["during"] = lm.model
        assert lm.tokenizer is not None  # requests are still encoded
        reload()
        seen["after"] = lm.model
        return []

    monkeypatch.setattr(server, "run_cases", fake_run_cases)
    r = server.measure_server("embedded", "The capital of France is", 2, cases=["concurrent"],
                              companions=["x"])
    assert seen["during"] is None and seen["after"] is not None
    assert r.details["inprocess"]["tokens"]  # the in-process reference ran before the copy was freed
    # The reloaded model computes what the first did.
    from gemmdrift.measure.diverge import generate_plain
    from gemmdrift.model import load_model

    ids = server.request_ids(load_model(str(server.checkpoint_dir("embedded")), dtype="float32"),
                             "The capital of France is")
    again = generate_plain(seen["after"], ids, 2, prefill_step=server.PREFILL_STEP)
    assert np.array_equal(again.tokens, r.details["inprocess"]["tokens"])


# test_a_freed_copy_is_reloaded_for_the_triage_through_the_real_server: in tests/test_server.py, where it shares
# one real server run (freed_run) with the lone-stream test.
