"""Issue 21 items 1-3 and the fp16 self-check: true float32 before anything computes, TF32 rungs say
"unreliable", resume keys that know the device and MLX_* settings, and fp16 subnormals checked on the device.

No backend is faked: a TF32 rung is planted as a probe result (numpy's TF32 rounding), a flushing device as
a planted reducer, another device as a planted environment record or MLX_* variable.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import make_tiny
from gemmdrift.machine import envinfo, runenv
from gemmdrift import state
from gemmdrift.result import Verdict


def _tf32_matmul(a, b):
    """numpy: inputs rounded to nearest with 10 mantissa bits, as tensor cores do (a planted TF32 device)."""
    def r(x):
        u = x.view(np.uint32).astype(np.uint64)
        return ((u + 0x1000) & 0xFFFFE000).astype(np.uint32).view(np.float32)
    return r(a).astype(np.float64) @ r(b).astype(np.float64)


@pytest.fixture
def tf32_rung(monkeypatch):
    """Every fp32 probe in this process measures a TF32 GEMM."""
    real = envinfo.probe_fp32_matmul
    planted = real(_tf32_matmul)
    assert not planted["true_float32"]
    monkeypatch.setattr(envinfo, "probe_fp32_matmul", lambda *a, **k: planted)
    return planted


# ------------------------------------------------------------------------- item 1: true float32 first


def test_every_measuring_command_forces_true_float32_before_its_handler(monkeypatch):
    from gemmdrift import cli

    seen = {}

    def handler(args, *_):  # attribute's handler also takes the cli module
        seen["var"], seen["policy"] = os.environ.get("MLX_ENABLE_TF32"), envinfo.TF32_POLICY
        return 0

    from gemmdrift.cli import attribute as attribute_cli, batch as batch_cli, golden as goldcli, replay as replay_cli
    from gemmdrift.cli import upgrade as upgrade_cli

    required = {"triage": ["--stream-a", "a", "--stream-b", "b"]}
    # Commands whose handler lives in their own module.
    handlers = {"logits": (goldcli, "cmd_logits"), "compare": (goldcli, "cmd_compare"),
                "replay check": (replay_cli, "cmd_replay_check"), "attribute": (attribute_cli, "cmd_attribute"),
                "batch": (batch_cli, "cmd_batch"), "server": (batch_cli, "cmd_server"),
                "upgrade": (upgrade_cli, "cmd_upgrade")}
    monkeypatch.setattr(envinfo, "TF32_POLICY", None)
    for name in runenv.MEASURING:
        monkeypatch.delenv("MLX_ENABLE_TF32", raising=False)
        monkeypatch.setattr(envinfo, "TF32_FORCED_OFF", False)
        monkeypatch.setattr(*handlers.get(name, (cli, f"cmd_{name}")), handler)
        argv = [*name.split(), *required.get(name, [])]
        assert cli.main(argv) == 0
        assert seen == {"var": "0", "policy": "off"}, name
        monkeypatch.setenv("MLX_ENABLE_TF32", "1")
        assert cli.main([*argv, "--tf32", "keep"]) == 0
        assert seen == {"var": "1", "policy": "keep"}, name
    for argv in (["report", "x"], ["history"], ["gate"]):  # they read results; they compute nothing
        assert not hasattr(cli.build_parser().parse_args(argv), "tf32")


def test_the_variable_is_set_in_a_fresh_process_and_recorded(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "MLX_ENABLE_TF32"}
    args = ["fingerprint", "--paths", "matmul:float32", "--k", "8", "--ts", "1", "--n", "4", "--draw-k", "0"]
    recs = {}
    for policy in ("off", "keep"):
        out = tmp_path / policy
        r = subprocess.run([sys.executable, "-m", "gemmdrift", *args, "--tf32", policy, "--out", str(out)],
                           capture_output=True, text=True, env=env, timeout=300)
        assert r.returncode == 0, r.stderr
        recs[policy] = json.loads((out / "meta.json").read_text())["env"]
    assert recs["off"]["env"]["MLX_ENABLE_TF32"] == "0" and recs["off"]["tf32_policy"] == "off"
    assert recs["keep"]["env"]["MLX_ENABLE_TF32"] is None and recs["keep"]["tf32_policy"] == "keep"


def test_worker_processes_inherit_true_float32(monkeypatch):
    from gemmdrift.workers import run_tasks

    monkeypatch.setenv("MLX_ENABLE_TF32", "0")
    assert run_tasks(os.getenv, [dict(key="MLX_ENABLE_TF32"), dict(key="MLX_ENABLE_TF32")], 2) == ["0", "0"]


def test_every_asv_environment_runs_true_float32():
    from pathlib import Path

    conf = json.loads((Path(__file__).resolve().parent.parent / "asv.conf.json").read_text())
    assert conf["include"] and all(e.get("env_nobuild") == {"MLX_ENABLE_TF32": "0"} for e in conf["include"])


def test_state_judge_on_a_tf32_rung_says_unreliable_not_state_bug():
    bf = state.Diff(True, False, 1e-2, 1e-3, 0.2, why="entries differ")
    tf32_like = state.Diff(True, False, 1.25e-3, 1.25e-4, 0.025)  # shrinks 8x: bf16 -> TF32 rounding
    assert state.judge(bf, tf32_like)[0] == Verdict.STATE_BUG  # a true float32 rung: does not shrink enough
    v, why, shrink = state.judge(bf, tf32_like, true_float32=False)
    assert v == Verdict.UNRELIABLE and "MLX_ENABLE_TF32=0" in why and shrink == pytest.approx(8.0)
    # What a TF32 rung can still tell: a 10^5 shrink is rounding, a structural difference or a drift outside
    # the envelope is a state bug.
    assert state.judge(bf, state.Diff(True, False, 1e-7, 1e-8, 1e-6), true_float32=False)[0] == Verdict.ROUNDING
    assert state.judge(bf, state.Diff(False, False, why="offset"), true_float32=False)[0] == Verdict.STATE_BUG
    assert state.judge(bf, tf32_like, envelope=0.1, true_float32=False)[0] == Verdict.STATE_BUG


def test_a_state_sweep_on_a_tf32_rung_calls_a_non_shrinking_drift_unreliable(tf32_rung):
    from mlx_lm.models.cache import KVCache

    class TrimScales(KVCache):
        """Planted: a trim that scales the kept keys by 1 + 2**-4 (a drift that does not shrink at float32)."""

        def trim(self, n):
            import mlx.core as mx

            m = super().trim(n)
            if m and self.keys is not None:
                self.keys = self.keys * mx.array(1.0625, dtype=self.keys.dtype)
            return m

    lm = make_tiny()
    setup = [state.Setup("TrimScales", lambda m: [TrimScales() for _ in m.layers], "planted")]
    r = state.measure_state(lm, operations=("rollback",), where=("below",), ks=(1,), setups=setup)
    t = r.tables["state"]
    rej = t[t["r"] > 0]
    assert len(rej) and set(rej["verdict"]) == {"unreliable"}, rej[["verdict", "reason"]]
    assert r.inputs["ladder_float32"] == tf32_rung and r.figure("state_bugs") == 0.0


def test_the_state_ladder_probes_its_rung(tf32_rung):
    lm = make_tiny()
    with state._Float32(lm) as rung:
        assert rung.probe is tf32_rung


def test_batch_ladder_on_a_tf32_rung_says_unreliable(tf32_rung):
    from gemmdrift.measure import batch
    from test_batch import LONG, TARGET

    rows = batch.sweep(make_tiny("bfloat16"), TARGET, {"long": LONG}, 8, batch_sizes=(2,), rows="ends",
                       reference=True, plant=batch.shift_row_mask, ladder_lm=make_tiny("float32"))
    assert rows and all(r.verdict == batch.OUTSIDE for r in rows)
    assert all(r.ladder == "unreliable" for r in rows), [r.ladder for r in rows]  # "semantic" on true float32


def test_stack_does_not_track_a_tf32_figure_under_a_float32_name():
    from gemmdrift.measure.stack import measure_stack, stack_result

    from test_taps_stack import TOKENS

    r = measure_stack(make_tiny("bfloat16"), TOKENS[:24], ["prefill:4,decode", "prefill:4,verify:2"], split=4,
                      ladder=True, local=False)
    assert any(k.startswith("ladder_rel_l2_float32/") for k in r.figures)
    inputs = {**r.inputs, "ladder_float32": {**r.inputs["ladder_float32"], "true_float32": False}}
    tf32 = stack_result(dict(r.tables), inputs, dict(r.env))
    assert not any(k.startswith("ladder_rel_l2_float32/") for k in tf32.figures)  # asv records NaN (skipped)
    assert {k: v for k, v in r.figures.items() if not k.startswith("ladder_")} == dict(tf32.figures)


# ------------------------------------------------------------------------- item 2: the device pin


def test_the_suite_pins_its_device_and_the_cli_honours_it(monkeypatch):
    import mlx.core as mx

    from gemmdrift import cli

    assert os.environ["GEMMDRIFT_DEVICE"] in ("cpu", "gpu")
    assert mx.default_device() == (mx.gpu if os.environ["GEMMDRIFT_DEVICE"] == "gpu" else mx.cpu)
    args = cli.build_parser().parse_args(["stack"])
    monkeypatch.setattr(envinfo, "select_device", lambda name: None)
    runenv.prepare(args)
    assert args.device == os.environ["GEMMDRIFT_DEVICE"]
    args = cli.build_parser().parse_args(["stack", "--device", "cpu"])
    monkeypatch.setenv("GEMMDRIFT_DEVICE", "gpu")
    runenv.prepare(args)
    assert args.device == "cpu"  # the flag wins


def test_a_bad_device_variable_is_a_one_line_error():
    env = {**os.environ, "GEMMDRIFT_DEVICE": "tpu"}
    r = subprocess.run([sys.executable, "-m", "gemmdrift", "env"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines() == ["gemmdrift: error: GEMMDRIFT_DEVICE='tpu': expected cpu or gpu"]


# ------------------------------------------------------------------------- item 3: keys that know the device


def _planted_device(monkeypatch, **fields):
    real = envinfo.device_record

    monkeypatch.setattr(envinfo, "device_record", lambda: {**real(), **fields})


def test_resume_keys_change_with_the_device_and_every_mlx_variable(monkeypatch):
    from gemmdrift.model import resume_key

    d = make_tiny().description
    key = resume_key(d, "part")
    rec = runenv.compute_record()
    assert {"backend", "device", "architecture", "macos", "mlx_env"} <= set(rec)
    assert rec["mlx_env"].get("MLX_ENABLE_TF32") == os.environ.get("MLX_ENABLE_TF32")
    monkeypatch.setenv("MLX_SDPA_BLOCKS", "8")
    assert resume_key(d, "part") != key
    monkeypatch.delenv("MLX_SDPA_BLOCKS")
    assert resume_key(d, "part") == key
    for field, value in (("backend", "metal"), ("device", "Device(gpu, 0)"), ("architecture", "applegpu_g15s")):
        with monkeypatch.context() as m:
            _planted_device(m, **{field: value})
            assert resume_key(d, "part") != key, field
    monkeypatch.setattr("platform.mac_ver", lambda: ("26.2", ("", "", ""), "arm64"))
    assert runenv.compute_record()["macos"] == "26.2" and resume_key(d, "part") != key


def test_a_stack_resumed_on_another_device_recomputes(tmp_path, monkeypatch, capsys):
    from gemmdrift.measure.stack import measure_stack

    from test_taps_stack import TOKENS

    lm = make_tiny("bfloat16")
    kw = dict(split=4, local=False, logit_positions=[], checkpoint=tmp_path / "ck")
    scheds = ["prefill:4,decode", "prefill:4,verify:2"]
    measure_stack(lm, TOKENS[:16], scheds, **kw)
    capsys.readouterr()
    measure_stack(lm, TOKENS[:16], scheds, **kw)
    assert capsys.readouterr().err.count("(resumed)") == 2
    _planted_device(monkeypatch, backend="metal", device="Device(gpu, 0)", architecture="applegpu_g15s")
    measure_stack(lm, TOKENS[:16], scheds, **kw)
    assert "(resumed)" not in capsys.readouterr().err
    monkeypatch.undo()
    monkeypatch.setenv("MLX_ENABLE_TF32", "1")
    measure_stack(lm, TOKENS[:16], scheds, **kw)
    assert "(resumed)" not in capsys.readouterr().err


def test_run_json_and_the_kernel_sweep_record_refuse_another_device(tmp_path, monkeypatch):
    from gemmdrift import suite
    from gemmdrift.errors import GemmdriftError
    from gemmdrift.kernels import runs

    inputs = {"model": "embedded", "compute": runenv.compute_record()}
    suite.check_resume(tmp_path, inputs)
    (tmp_path / suite.RUN_RECORD).write_text(json.dumps(inputs))
    suite.check_resume(tmp_path, inputs)
    monkeypatch.setenv("MLX_ENABLE_TF32", "1")
    with pytest.raises(GemmdriftError, match="compute"):
        suite.check_resume(tmp_path, {"model": "embedded", "compute": runenv.compute_record()})
    monkeypatch.undo()
    ck = tmp_path / "kernels"
    runs._open_checkpoint(ck, {"ts": [1], "compute": runenv.compute_record()})
    _planted_device(monkeypatch, backend="cuda", device="Device(gpu, 0)", architecture="sm_90")
    with pytest.raises(GemmdriftError, match="compute"):
        runs._open_checkpoint(ck, {"ts": [1], "compute": runenv.compute_record()})


# ------------------------------------------------------------------------- item 10: fp16 subnormals


def _flushing(reducer):
    """The same reduction on a device that flushes fp16 subnormals (inputs below 2**-14 read as 0)."""
    real = reducer.fn
    reducer.fn = lambda v: real(np.where(np.abs(v) < 2.0 ** -14, 0.0, v))
    return reducer


def test_fp16_subnormals_are_checked_before_fp16_fingerprints(monkeypatch):
    from gemmdrift import fingerprint as fp

    spec = fp.parse_path("matmul:float16")
    assert fp.fp16_subnormals_kept(fp.make_reducer(spec, 16, 2, 4))  # this device keeps them
    assert not fp.fp16_subnormals_kept(_flushing(fp.make_reducer(spec, 16, 2, 4)))
    assert fp.fp16_subnormals_kept(_flushing(fp.make_reducer(fp.parse_path("matmul:bfloat16"), 16, 2, 4)))
    real = fp.make_reducer
    monkeypatch.setattr(fp, "make_reducer", lambda s, *a, **k: _flushing(real(s, *a, **k)))
    r = fp.measure(["matmul:float16", "matmul:float32"], K=16, ts=[1, 2], N=4, draw_k=0, workers=1)
    t = r.tables["fingerprints"]
    assert list(t[t["path"] == "matmul:float16"]["status"]) == [fp.FP16_FLUSHED]
    assert "matmul:float16.unrecovered" not in r.figures  # not an unrecoverable kernel: no figure at all
    assert r.figure("matmul:float32.unrecovered") == 0.0
    from gemmdrift.view import summaries

    assert summaries.summary(r)["paths"]["matmul:float16"]["status"] == fp.FP16_FLUSHED
    assert "matmul:float16     fp16 subnormals flushed on this device" in summaries.text(r)
