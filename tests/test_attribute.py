"""attribute(): local drift per op, the counterfactual per op class, the verdict (issue 29, items 2-4)."""

import numpy as np
import pytest

from conftest import make_tiny
from gemmdrift.model import optaps
from gemmdrift.attribution.attribute import attribute, explain_flip
from gemmdrift.errors import GemmdriftError
from test_optaps import one_ulp_up

TOKENS = np.random.default_rng(0).integers(0, 97, 128).tolist()
DECODE, VERIFY = "prefill:2,decode", "prefill:2,verify:2"


def test_a_planted_ulp_is_attributed_to_its_op_and_its_counterfactual_leaves_nothing(tiny):
    key = (3, "self_attn.k_norm")
    r = attribute(tiny, TOKENS[:8], [DECODE, VERIFY], split=2, ops=["k_norm", "q_proj"],
                  counterfactual=["each"], perturb={key: one_ulp_up})
    ops = r.tables["ops"]
    hit = ops[ops["positions_differ"] > 0]
    assert list(zip(hit["layer"], hit["op"])) == [key] and hit["max_ulp"].iloc[0] == 1
    env = r.tables["envelope"].iloc[0]
    assert env["max_abs_dlogit"] > 0  # the ULP reaches the logits
    cf = r.tables["counterfactual"].set_index("class")
    assert cf.loc["self_attn.k_norm", "max_abs_dlogit"] == 0 and cf.loc["self_attn.k_norm", "max_abs_dgap"] == 0
    assert cf.loc["self_attn.k_norm", "kld_mean"] == 0 and cf.loc["self_attn.k_norm", "same_top1_share"] == 1
    assert cf.loc["self_attn.q_proj", "max_abs_dlogit"] == env["max_abs_dlogit"]  # an innocent class changes nothing
    assert (r.tables["first"]["op"] == "self_attn.k_norm").all()
    v = r.details["verdict"]
    assert "k_norm (layer 3)" in v and "gone when k_norm is made invariant" in v and "no projection matters" in v
    assert r.inputs["planted"] == ["3:self_attn.k_norm"]
    assert r.figure("attr_local_bits/prefill:2,decode vs prefill:2,verify:2/self_attn.k_norm") == 1.0


def test_past_the_window_the_sdpa_counterfactual_removes_all_drift_and_no_projection_matters():
    lm = make_tiny("float32")
    r = attribute(lm, TOKENS[:24], ["prefill:4,decode", "prefill:4,verify:2"], split=4,
                  ops=["sdpa", "q_proj", "down_proj"])
    hit = r.tables["ops"][r.tables["ops"]["positions_differ"] > 0]
    sliding = {i for i, t in enumerate(lm.info["layer_types"]) if "sliding" in t}
    assert set(hit["class"]) == {"sdpa"} and set(hit["layer"]) <= sliding and hit["first_position"].min() >= 8
    assert r.tables["envelope"]["max_abs_dlogit"].iloc[0] > 0
    cf = r.tables["counterfactual"]
    each = cf[cf["direction"] == "each"].set_index("class")
    assert each.loc["sdpa", "max_abs_dlogit"] == 0 and each.loc["sdpa", "flips"] == 0
    assert each.loc["self_attn.q_proj", "max_abs_dlogit"] > 0 and each.loc["mlp.down_proj", "max_abs_dlogit"] > 0
    # all but one: sdpa is the only class that drifts, so "all but sdpa" leaves the pair as it is; the attention
    # core reads the cache and cannot be held (issue 53), so the other rows keep its drift too, and say so
    abo = cf[cf["direction"] == "all-but-one"]
    assert list(abo["class"]) == ["sdpa", "self_attn.q_proj", "mlp.down_proj"]
    assert (abo["max_abs_dlogit"] == r.tables["envelope"]["max_abs_dlogit"][0]).all()
    assert r.details["all_but_one_unheld"] == ["sdpa"]
    assert "gone when sdpa is made invariant" in r.details["verdict"]
    assert "no projection matters" in r.details["verdict"]


def test_under_a_replayed_m1_the_projections_carry_the_drift_below_the_window():
    lm = make_tiny("bfloat16", sliding_window=64)  # 40 tokens, all below the window
    r = attribute(lm, TOKENS[:40], [DECODE, VERIFY], split=2, counterfactual=[], kernels="replay:M1")
    hit = r.tables["ops"][r.tables["ops"]["positions_differ"] > 0]
    assert len(hit) and set(hit["kind"]) <= {"linear", "head"}
    assert not (r.tables["local"]["kind"] == "attention").any() or (
        r.tables["local"][r.tables["local"]["kind"] == "attention"]["frac_differ"] == 0).all()
    assert r.inputs["kernels"] == "replay:M1" and r.details["replay"]["chip"] == "M1"
    assert "projections with local drift" in r.details["verdict"]


def test_bad_input_is_one_clear_error(tiny):
    with pytest.raises(GemmdriftError, match="unknown op class 'qkv'.*self_attn.q_proj"):
        attribute(tiny, TOKENS[:8], [DECODE, VERIFY], split=2, ops=["qkv"])
    with pytest.raises(GemmdriftError, match="two schedules"):
        attribute(tiny, TOKENS[:8], [DECODE], split=2)
    with pytest.raises(GemmdriftError, match="unknown counterfactual"):
        attribute(tiny, TOKENS[:8], [DECODE, VERIFY], split=2, counterfactual=["every"])


def test_an_interrupted_attribution_resumes_where_it_stopped(tmp_path, monkeypatch):
    lm = make_tiny("float32")  # past its window of 8 the attention core drifts: a counterfactual to run
    toks, pair = TOKENS[:12], ["prefill:4,decode", "prefill:4,verify:2"]
    calls = []
    real = optaps.run_ops

    def counting(*a, **k):
        calls.append(tuple(k.get("replace") or ()))
        if len(calls) == 4 and not resumed:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(optaps, "run_ops", counting)
    resumed = False
    kw = dict(split=4, ops=["q_proj", "k_proj", "sdpa"], counterfactual=["each"], checkpoint=str(tmp_path))
    with pytest.raises(KeyboardInterrupt):
        attribute(lm, toks, pair, **kw)
    assert calls == [(), (), ("self_attn.q_proj",), ("self_attn.k_proj",)]  # reference, local, two classes
    resumed, calls[:] = True, []
    r = attribute(lm, toks, pair, **kw)
    assert calls == [(), ("self_attn.k_proj",), ("sdpa",)]  # the reference again, then what had not finished
    assert list(r.tables["counterfactual"]["class"]) == ["self_attn.q_proj", "self_attn.k_proj", "sdpa"]
    monkeypatch.setattr(optaps, "run_ops", real)
    assert r.tables["counterfactual"].drop(columns="flip_positions").equals(
        attribute(lm, toks, pair, split=4, ops=kw["ops"],
                  counterfactual=["each"]).tables["counterfactual"].drop(columns="flip_positions"))


def test_explain_flip_names_the_planted_cause_of_a_flip(tiny):
    key = (2, "mlp.down_proj")
    plant = {key: lambda out, args: -4 * out}  # a gross change under schedule B: the argmax moves
    r = attribute(tiny, TOKENS[:8], [DECODE, VERIFY], split=2, counterfactual=[], perturb=plant)
    flips = r.tables["envelope"]["flip_positions"].iloc[0]
    assert flips
    e = explain_flip(tiny, TOKENS[:8], [DECODE, VERIFY], flips[0], split=2, perturb=plant)
    assert e["flipped"] and "mlp.down_proj" in e["removed_by"] and "sdpa" not in e["removed_by"]
    assert e["first_op"] == "layer 2 mlp.down_proj"
    assert e["causes"] == ["mlp.down_proj"]


def test_triage_explain_adds_the_cause_and_leaves_the_verdict(tiny):
    from gemmdrift.cli.attribute import explain_divergence
    from gemmdrift.measure.diverge import triage_result

    plant = {(2, "mlp.down_proj"): lambda out, args: -4 * out}
    r = attribute(tiny, TOKENS[:8], [DECODE, VERIFY], split=2, counterfactual=[], perturb=plant)
    pos = r.tables["envelope"]["flip_positions"].iloc[0][0]
    prompt, stream = TOKENS[:3], TOKENS[3:8]  # split 2: the logits at 2 + i predict generated token i
    t = {"verdict": "NEAR-TIE", "reason": "within the envelope", "index": pos - 2, "position": pos, "schedule_a": DECODE, "schedule_b": VERIFY,
         "bit_identical": False}
    before = triage_result(t, {"model": tiny.info, "stream_a": stream}, {})
    after = explain_divergence(tiny, before, prompt, perturb=plant)
    e = after.details["triage"]["explanation"]
    assert e["causes"] == ["mlp.down_proj"] and "when down_proj is made invariant" in e["said"]
    assert after.details["triage"]["verdict"] == "NEAR-TIE" and after.figures == before.figures
    from gemmdrift.view.summaries import text

    assert "which op (--explain): the flip at position" in text(after)


def test_every_report_row_carries_a_command_that_parses_to_its_cell(tiny):
    import shlex

    from gemmdrift.view.attribute import counterfactual_rows, ops_rows, report_part
    from gemmdrift.cli import build_parser

    key = (3, "self_attn.k_norm")
    r = attribute(tiny, TOKENS[:8], [DECODE, VERIFY], split=2, ops=["k_norm"], counterfactual=["each"],
                  perturb={key: one_ulp_up})
    rows = ops_rows(r) + counterfactual_rows(r)
    assert len(rows) == 2
    for row in rows:
        args = build_parser().parse_args(shlex.split(row["recompute"])[1:])
        assert args.schedules == [DECODE, VERIFY] and args.split == 2 and args.ops == "self_attn.k_norm"
    assert ops_rows(r)[0]["recompute"].count("--positions 2:3") == 1  # the drifting cell's first position
    blocks, reading = report_part(r)
    assert any(b[0] == "table" for b in blocks) and "k_norm" in reading[0]
    assert all("|" not in k for row in rows for k in row)  # markdown table headers stay intact




def test_the_counterfactual_envelope_is_the_stack_comparisons_and_a_run_for_its_logits_keeps_no_ops():
    """The envelope attribute computes for each counterfactual (the logits only) is compare_taps' envelope of the
    same two runs, flips included; a run with record_ops=False gives the same taps and replaces the same classes,
    and keeps no op arrays (the counterfactual runs read their logits only)."""
    from gemmdrift.attribution.attribute import _envelope
    from gemmdrift.measure.stack import compare_taps

    lm = make_tiny("float32")
    toks, a, b = TOKENS[:24], "prefill:4,decode", "prefill:4,verify:2"
    pos = np.arange(4, 24)
    ref_taps, ref = optaps.run_ops(lm.model, toks, a, split=4, logit_positions=pos, keep_inputs=True)
    kw = dict(split=4, positions=pos, logit_positions=pos, reference=ref, replace=["self_attn.q_proj"],
              perturb={(1, "mlp.down_proj"): lambda out, args: out * 0})  # planted: no MLP in layer 1
    taps, rec = optaps.run_ops(lm.model, toks, b, **kw)
    lean_taps, lean = optaps.run_ops(lm.model, toks, b, record_ops=False, **kw)
    assert np.array_equal(lean_taps.logits, taps.logits) and np.array_equal(lean_taps.hidden, taps.hidden)
    assert lean.replaced == rec.replaced == {"self_attn.q_proj"} and lean.order == rec.order
    assert rec.out and not lean.out and not lean.inp
    _, per_pos, env = compare_taps(ref_taps, taps, lm.info["layer_types"], {"pair": "p", "reference": a,
                                   "schedule": b, "mode": "m", "dtype": "float32"}, tokens=toks)
    mine = _envelope(ref_taps, taps, toks)
    assert env["flips"] > 0 and 0 < env["same_top1_share"] < 1  # something to compare
    for k in ("max_abs_dlogit", "max_abs_dgap", "flips", "kld_mean", "same_top1_share"):
        assert mine[k] == float(env[k]), k
    assert mine["flip_positions"] == [int(p) for p in per_pos["position"][per_pos["flip"]]]


def test_the_verdict_says_shrinks_only_where_the_drift_shrank():
    """PROBE-DEFECTS-4 item 5: "max|dlogit| 0.25 shrinks most with q_proj made invariant (to 0.312)" was printed
    though every counterfactual left more than the pair as it is."""
    import pandas as pd

    from gemmdrift.attribution.verdict import verdict_line

    summary = pd.DataFrame([{"layer": 0, "op": op, "class": op, "kind": "linear", "order": i, "positions_differ": 1,
                             "frac_differ": 0.1, "max_ulp": 1.0, "rel_l2": 1e-3, "first_position": 8}
                            for i, op in enumerate(["self_attn.q_proj", "sdpa"])])
    base = {"max_abs_dlogit": 0.25, "flips": 0, "flip_positions": []}

    def line(q, s):
        cf = pd.DataFrame([{"class": c, "direction": "each", "max_abs_dlogit": v, "flips": 0, "flip_positions": []}
                           for c, v in (("self_attn.q_proj", q), ("sdpa", s))])
        return verdict_line("a vs b", base, cf, summary)

    grew = line(0.3125, 0.375)
    assert "shrinks most" not in grew
    none = "no class with local drift made invariant shrinks max|dlogit| 0.25 (the least left is "
    assert none + "0.3125, with q_proj)" in grew  # text.fmt: the figure as it is (one rule everywhere)
    assert none + "0.25, with q_proj)" in line(0.25, 0.5)
    shrank = line(0.3125, 0.125)
    assert "max|dlogit| 0.25 shrinks most with sdpa made invariant (to 0.125)" in shrank
