"""``gemmdrift upgrade`` (issue 48): the class of a change between two interpreters, the first op that moved, the
greedy parting, and every bad input as one line and exit 2 before a model loads.

The other release is planted, as in test_release_ops: this interpreter behind a wrapper script whose
``sitecustomize`` changes one op. Two plants with answers known by construction:

* RoPE's output times (1 + 2**-7) (one or two bf16 ULPs; the same relative change in float32, so the precision
  ladder cannot call it rounding): ANSWER-CHANGING, first op ``self_attn.rope`` of layer 0;
* the LM head's output bits plus one (one unit in the last place of every logit, in bf16 and in float32): an
  order-preserving change of every logit, so no top-1 and no greedy token can change, and the ladder says
  rounding: ROUNDOFF, first op ``lm_head`` of layer n_layers (4).
"""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from gemmdrift import cli
from gemmdrift.upgrade import envs, judge

ROPE = """import mlx.core as mx
_rope = mx.fast.rope
mx.fast.rope = lambda *a, **k: _rope(*a, **k) * 1.0078125
"""
HEAD = """import mlx.core as mx, mlx.nn as nn
_call = nn.Linear.__call__
_U = {mx.bfloat16: mx.uint16, mx.float16: mx.uint16, mx.float32: mx.uint32}
def call(self, x):
    y = _call(self, x)
    if y.shape[-1] != 97:  # the tiny model's vocabulary: the LM head only
        return y
    u = _U[y.dtype]
    return (y.view(u) + mx.array(1, u)).view(y.dtype)
nn.Linear.__call__ = call
"""
FAST = ["--speed-rounds", "1", "--generate", "12"]


def planted(d: Path, name: str, code: str) -> str:
    site = d / f"site-{name}"
    site.mkdir(parents=True)
    (site / "sitecustomize.py").write_text(code)
    py = d / f"python-{name}"
    py.write_text(f'#!/bin/sh\nPYTHONPATH={site}${{PYTHONPATH:+:$PYTHONPATH}} exec {sys.executable} "$@"\n')
    py.chmod(0o755)
    return str(py)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from test_models import save_tiny

    d = tmp_path_factory.mktemp("upgrade")
    save_tiny(d / "m")
    (d / "ids.json").write_text(json.dumps(list(range(1, 33))))
    return d


def run(capsys, *argv):
    rc = cli.main(["upgrade", *argv, "--json"])
    out, err = capsys.readouterr()
    return rc, (json.loads(out) if rc in (0, 1) else None), err


def model_args(d: Path) -> list[str]:
    return ["--model", str(d / "m"), "--prompt-ids", str(d / "ids.json"), *FAST]


def test_the_same_interpreter_on_both_sides_is_bit_for_bit_and_resumes_after_ctrl_c(tiny_dir, tmp_path, capsys,
                                                                                    monkeypatch):
    from gemmdrift.upgrade import measure

    v = envs.probe(sys.executable)["mlx"]
    args = ["--from", v, "--to", v, "--python", sys.executable, *model_args(tiny_dir), "--out", str(tmp_path / "o")]

    def ctrl_c(*a, **k):  # after every unit: the class is judged last
        raise KeyboardInterrupt

    monkeypatch.setattr(measure, "classify", ctrl_c)
    assert cli.main(["upgrade", *args]) == 130
    err = capsys.readouterr().err
    assert "upgrade: speed" in err and ".checkpoints/upgrade" in err
    monkeypatch.undo()
    rc, s, err = run(capsys, *args)
    assert "upgrade:" not in err and s["seconds"] == {}  # every unit read back, nothing recomputed
    assert rc == 0 and s["class"] == "BIT-FOR-BIT" and s["pass"], (s, err)
    assert s["first_op"] is None and s["ops_changed"] == 0 and s["ops_compared"] > 60
    assert s["logits"]["bit_identical"] and s["logits"]["flips"] == 0 and s["logits"]["kld_mean"] == 0
    assert s["greedy"]["index"] is None and s["greedy"]["verdict"] == "IDENTICAL"
    assert s["speed"]["decode_tok_s"]["ratio"] > 0
    assert (tmp_path / "o" / "result.json").is_file() and (tmp_path / "o" / "report.html").is_file()
    assert "BIT-FOR-BIT" in (tmp_path / "o" / "report.md").read_text()
    # issue 53: one speed round (FAST) is not "medians of 1 alternating rounds"
    assert "one round, the two releases in turn" in (tmp_path / "o" / "report.md").read_text()
    assert "medians of 1 " not in (tmp_path / "o" / "report.md").read_text()
    assert not (tmp_path / "o" / ".checkpoints").exists()  # the whole Result holds what the units did


def test_a_planted_rope_change_is_answer_changing_and_names_rope_of_layer_0(tiny_dir, tmp_path, capsys):
    py = planted(tmp_path, "rope", ROPE)
    args = ["--python", py, *model_args(tiny_dir), "--out", str(tmp_path / "o")]
    rc, s, err = run(capsys, *args)
    assert rc == 1 and s["class"] == "ANSWER-CHANGING" and not s["pass"], (s, err)
    assert (s["first_op"]["op"], s["first_op"]["layer"]) == ("self_attn.rope", 0)
    assert s["first_op"]["max_ulp"] in (1.0, 2.0)
    assert s["ops_changed"] == 8  # q and k in each of the four layers, nothing else of the captured block
    assert s["ladder"]["verdict"] == "semantics"  # the same relative change in float32: not rounding
    assert not s["logits"]["bit_identical"] and s["logits"]["max_abs_dlogit"] > 0
    assert "logits/digest" in [r["figure"] for r in s["by_direction"]["news"]]  # judged by declared directions


def test_a_planted_one_ulp_lm_head_change_is_roundoff(tiny_dir, tmp_path, capsys):
    py = planted(tmp_path, "head", HEAD)
    rc, s, err = run(capsys, "--python", py, *model_args(tiny_dir), "--out", str(tmp_path / "o"))
    assert rc == 0 and s["class"] == "ROUNDOFF", (s, err)
    assert (s["first_op"]["op"], s["first_op"]["layer"], s["first_op"]["max_ulp"]) == ("lm_head", 4, 1.0)
    assert s["ops_changed"] == 1
    assert s["logits"]["flips"] == 0 and s["greedy"]["index"] is None  # order-preserving by construction
    assert s["ladder"]["verdict"] == "rounding" and s["ladder"]["shrink"] > 1000


# ---------------------------------------------------------------- bad input: one line, exit 2, no model loaded


@pytest.fixture
def no_load(monkeypatch, tmp_path):
    import gemmdrift.model

    def refuse(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(gemmdrift.model, "load_model", refuse)
    monkeypatch.setenv("GEMMDRIFT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(envs, "index_versions", lambda pkg: ["0.29.4", "0.30.6", "0.31.2"])


def bad(capsys, *argv) -> str:
    rc = cli.main(["upgrade", *argv])
    out, err = capsys.readouterr()
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_a_release_that_does_not_exist_names_the_nearest(no_load, capsys):
    err = bad(capsys, "--to", "0.30.9")
    assert "no such release" in err and "nearest that exist: 0.30.6, 0.31.2" in err
    assert "not a release number" in bad(capsys, "--to", "latest")


def test_from_equal_to_without_python_is_the_control_and_says_how(no_load, capsys):
    err = bad(capsys, "--from", "0.30.6", "--to", "0.30.6")
    assert "control" in err and "--python PATH" in err


def test_an_interpreter_without_mlx(no_load, tmp_path, capsys):
    assert "mlx does not import" in bad(capsys, "--python", "/usr/bin/python3")
    assert "no such file" in bad(capsys, "--python", str(tmp_path / "nope"))
    nolm = planted(tmp_path, "nolm", "import sys\nsys.modules['mlx_lm'] = None\n")
    assert "no mlx-lm there" in bad(capsys, "--python", nolm)


def test_a_model_the_other_mlx_lm_cannot_load(no_load, tmp_path, capsys):
    from test_models import save_tiny

    save_tiny(tmp_path / "m", model_type="gemma9_text")
    err = bad(capsys, "--python", sys.executable, "--model", str(tmp_path / "m"))
    assert "cannot load the model" in err and "'gemma9_text'" in err and "mlx-lm " in err


def test_no_network_and_no_cached_environment_names_a_python(no_load, tmp_path, monkeypatch, capsys):
    def offline(pkg):
        raise envs.Offline("the package index cannot be reached")

    monkeypatch.setattr(envs, "index_versions", offline)
    monkeypatch.chdir(tmp_path)
    err = bad(capsys, "--to", "0.30.6")
    assert "no cached environment" in err and "--python PATH" in err
    asv = tmp_path / ".asv" / "env" / "abc"
    (asv / "lib" / "python3.11" / "site-packages" / "mlx-0.30.6.dist-info").mkdir(parents=True)
    (asv / "bin").mkdir()
    (asv / "bin" / "python").write_text("")
    err = bad(capsys, "--to", "0.30.6")
    assert f"--python {Path('.asv/env/abc/bin/python')} would do" in err


def test_bad_allow_and_shape_models(no_load, capsys):
    assert "--allow" in bad(capsys, "--to", "0.30.6", "--allow", "MAYBE")
    assert "model on disk" in bad(capsys, "--to", "0.30.6", "--model", "shape:gemma3-270m")


# ---------------------------------------------------------------- the pure parts


def test_parting_is_judged_against_the_envelope_from_each_releases_own_margins():
    rows = np.zeros((2, 8), np.float32)
    old = {"greedy": np.array([5, 3]), "greedy_logits": rows.copy()}
    new = {"greedy": np.array([5, 4]), "greedy_logits": rows.copy()}
    old["greedy_logits"][0, 5] = new["greedy_logits"][0, 5] = 2.0
    old["greedy_logits"][1, [3, 4]] = [1.0, 0.9]  # the old release prefers 3 by 0.1
    new["greedy_logits"][1, [3, 4]] = [0.95, 1.2]  # the new one prefers 4 by 0.25
    p = judge.parting(old, new, envelope=0.2)
    assert p["index"] == 1 and (p["token_old"], p["token_new"]) == (3, 4)
    assert p["margin_old"] == pytest.approx(0.1) and p["margin_new"] == pytest.approx(0.25)
    assert p["verdict"] == "NEAR-TIE"  # min margin 0.1 <= 0.2
    assert judge.parting(old, new, envelope=0.05)["verdict"] == "OUTSIDE ENVELOPE"
    assert judge.parting(old, old, envelope=0.0)["verdict"] == "IDENTICAL"


def test_nearest_releases_and_the_speed_ratio():
    assert envs.nearest("0.30.9", ["0.29.4", "0.31.2", "0.30.6"]) == ["0.30.6", "0.31.2"]
    assert envs.nearest("0.1.0", ["0.29.4"]) == ["0.29.4"]
    s = judge.speed([({"prefill_tok_s": 10, "decode_tok_s": 4}, {"prefill_tok_s": 20, "decode_tok_s": 2})] * 3)
    assert s["prefill_tok_s"]["ratio"] == 2.0 and s["decode_tok_s"]["ratio"] == 0.5


def test_every_class_figure_has_a_direction_and_is_judged_as_the_gate_judges():
    """Issue 53 (item 2, point 3): every figure the upgrade compares declares which way is better (beside the names
    in judge.py); a worse decode vs verify:2 envelope is worse, a smaller one better, another token news."""
    import numpy as np

    from gemmdrift import directions as D
    from gemmdrift.upgrade import judge

    def figs(envelope, dlogit, flips, tokens):
        run = {"envelope": {"envelope": envelope, "max_abs_dlogit": dlogit, "flips": flips}}
        arrays = {"logits": np.eye(3, 5, dtype=np.float32)[:, ::-1] * tokens[0], "positions": np.array([4, 5, 6]),
                  "greedy": np.array(tokens)}
        return judge.class_figures(run, arrays, 0)

    old, new = figs(0.25, 0.5, 1, [1, 2]), figs(0.5, 0.25, 1, [1, 3])
    undeclared = [n for n in old if judge.direction(n) not in D.DIRECTIONS]
    assert not undeclared, f"class figures without a direction: {undeclared}"
    j = judge.by_direction(old, new)
    assert [r["figure"] for r in j["worse"]] == ["decode_verify2/envelope"]
    assert [r["figure"] for r in j["better"]] == ["decode_verify2/max_abs_dlogit"]
    assert [r["figure"] for r in j["news"]] == ["greedy/1"] and j["within"] == []
