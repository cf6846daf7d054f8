"""Attribution under a replay (issue 46): the head never replaced by all-but-one (held, issue 53), local drift
that is the op's own (the attention core reads the reference's keys and values), causes only where the drift
starts at or before the flip, drift at every position computed, the block that diverged explained, and nothing
run for nothing. A planted kernel difference that fires in T > 1 blocks only (:func:`in_blocks`) stands in for a replayed
chip's projection: T = 1 (gemv) and T > 1 (GEMM) differ, as on every Mac."""

import numpy as np
import pandas as pd
import pytest

from conftest import make_tiny
from gemmdrift.model import optaps
from gemmdrift.attribution.attribute import attribute, explain_flip
from test_optaps import one_ulp_up

TOKENS = np.random.default_rng(0).integers(0, 97, 128).tolist()
DECODE, VERIFY = "prefill:2,decode", "prefill:2,verify:2"


def in_blocks(f):
    """``f`` applied where the op computes more than one row (a verify block), as a replayed chip's GEMM differs
    from its T=1 gemv; a decode step is left as it is."""
    return lambda out, args: f(out, args) if out.shape[-2] > 1 else out


def every_layer(lm, op, f):
    return {(i, op): in_blocks(f) for i in range(lm.n_layers)}


def gross(out, args):
    return out * -3


def counting_runs(monkeypatch):
    """The ``replace`` set of every run attribute makes (monkeypatched optaps.run_ops)."""
    calls = []
    real = optaps.run_ops

    def counting(*a, **k):
        calls.append(tuple(k.get("replace") or ()))
        return real(*a, **k)

    monkeypatch.setattr(optaps, "run_ops", counting)
    return calls


@pytest.mark.parametrize("op", ["self_attn.v_proj", "self_attn.q_proj"])
def test_a_planted_replay_of_one_projection_class_names_that_class_alone(tiny, op):
    r = attribute(tiny, TOKENS[:14], [DECODE, VERIFY], split=2, counterfactual=["each"],
                  perturb=every_layer(tiny, op, gross))
    hit = r.tables["ops"][r.tables["ops"]["positions_differ"] > 0]
    assert set(hit["class"]) == {op}  # v_proj's values in B's cache are not the attention core's drift
    base = r.tables["envelope"].iloc[0]
    assert base["flips"] > 0
    cf = r.tables["counterfactual"]
    assert list(cf[cf["cause"]]["class"]) == [op]
    short = optaps.short_class(op)
    v = r.details["verdict"]
    assert f"when {short} is made invariant" in v and "sdpa" not in v.split("flip")[1]


def test_all_but_one_never_replaces_the_head(tiny, monkeypatch):
    plant = {**every_layer(tiny, "self_attn.q_proj", gross), (tiny.n_layers, "lm_head"): in_blocks(one_ulp_up)}
    calls = counting_runs(monkeypatch)
    r = attribute(tiny, TOKENS[:14], [DECODE, VERIFY], split=2, counterfactual=["each", "all-but-one"],
                  ops=["q_proj", "lm_head", "sdpa"], perturb=plant)
    drifting = set(r.tables["ops"]["class"][r.tables["ops"]["positions_differ"] > 0])
    assert drifting == {"self_attn.q_proj", "lm_head"}
    assert calls and not any({"lm_head", "norm"} & set(c) for c in calls if len(c) != 1 or c[0] not in (
        "lm_head", "norm"))  # only "each lm_head" replaces the head
    cf = r.tables["counterfactual"]
    abo = cf[cf["direction"] == "all-but-one"].set_index("class")
    assert abo.loc["self_attn.q_proj", "max_abs_dlogit"] > 0  # q_proj's own effect is not 0 by construction
    assert abo.loc["self_attn.q_proj", "flips"] > 0
    assert "lm_head" not in list(cf[cf["cause"]]["class"])
    assert "lm_head" not in r.details["verdict"].split("flip")[1].split(";")[0]


def test_below_the_window_under_replay_m1_the_attention_core_carries_no_local_drift():
    lm = make_tiny("bfloat16", seed=12, sliding_window=64)  # its replayed v_proj of layer 3 drifts from 24
    r = attribute(lm, TOKENS[:40], [DECODE, VERIFY], split=2, counterfactual=[], kernels="replay:M1")
    hit = r.tables["ops"][r.tables["ops"]["positions_differ"] > 0]
    assert ((hit["layer"] == 3) & (hit["class"] == "self_attn.v_proj")).any()
    assert set(hit["kind"]) <= {"linear", "head"}, hit[["layer", "op", "first_position"]]


def test_a_cause_drifts_locally_at_or_before_the_flip_and_is_no_carrier():
    from gemmdrift.attribution.verdict import causes_of

    summary = pd.DataFrame([
        {"layer": 1, "op": "self_attn.v_proj", "class": "self_attn.v_proj", "kind": "linear", "positions_differ": 3,
         "first_position": 45},
        {"layer": 2, "op": "self_attn.q_proj", "class": "self_attn.q_proj", "kind": "linear", "positions_differ": 5,
         "first_position": 33},
        {"layer": 4, "op": "lm_head", "class": "lm_head", "kind": "head", "positions_differ": 9, "first_position": 32},
        {"layer": 1, "op": "input_layernorm", "class": "input_layernorm", "kind": "norm", "positions_differ": 0,
         "first_position": -1}])
    each = pd.DataFrame([{"class": c, "direction": "each", "flips": 0.0, "flip_positions": []}
                         for c in ("self_attn.v_proj", "self_attn.q_proj", "lm_head", "input_layernorm")])
    assert causes_of(38, each, summary) == ["self_attn.q_proj"]
    assert causes_of(50, each, summary) == ["self_attn.v_proj", "self_attn.q_proj"]
    each.loc[1, "flip_positions"] = [38]  # q_proj made invariant leaves the flip at 38
    assert causes_of(38, each, summary) == []


def test_drift_in_the_blocks_before_the_compared_position_is_attributed():
    """Report A D5: position 11 is computed alone (T=1) under verify:2 from 2, its logits differ through the cache
    written by the T=3 blocks before it; that drift is q_proj's, not nobody's."""
    lm = make_tiny("float32", sliding_window=64)  # below the window: no attention drift of its own
    r = attribute(lm, TOKENS[:12], [DECODE, VERIFY], split=2, positions=[11], counterfactual=["each"],
                  ops=["q_proj", "self_attn.rope", "sdpa"], perturb=every_layer(lm, "self_attn.q_proj", one_ulp_up))
    assert r.tables["envelope"]["max_abs_dlogit"].iloc[0] > 0
    hit = r.tables["ops"][r.tables["ops"]["positions_differ"] > 0]
    assert set(hit["class"]) == {"self_attn.q_proj"} and hit["first_position"].min() == 2
    v = r.details["verdict"]
    assert "no op drifts" not in v and "q_proj" in v and "rope" not in v and "unattributed" not in v


def test_drift_outside_every_tapped_op_is_reported_unattributed_and_named(monkeypatch):
    import mlx.nn as nn

    lm = make_tiny("float32", sliding_window=64)
    real = nn.gelu_approx
    monkeypatch.setattr(nn, "gelu_approx", lambda x: in_blocks(lambda o, a: o * 1.001)(real(x), ()))
    r = attribute(lm, TOKENS[:10], [DECODE, VERIFY], split=2, counterfactual=[])
    assert r.tables["envelope"]["max_abs_dlogit"].iloc[0] > 0
    assert not (r.tables["ops"]["positions_differ"] > 0).any()  # every tapped op is bit-identical on its input
    v = r.details["verdict"]
    assert "unattributed: the MLP activation" in v and "no op drifts on its own input" not in v
    un = r.details["unattributed"]
    assert un and {u["before"] for u in un} == {"mlp.down_proj"} and min(u["first_position"] for u in un) == 2


def test_nothing_drifting_skips_the_counterfactual_and_says_why(tiny, monkeypatch):
    calls = counting_runs(monkeypatch)
    r = attribute(tiny, TOKENS[:8], [DECODE, VERIFY], split=2, counterfactual=["each", "all-but-one"])
    assert [c for c in calls if c] == []  # no counterfactual run
    cf = r.tables["counterfactual"]  # the rows are the base envelope, 0 by construction: no run made them
    assert set(cf["direction"]) == {"each"} and len(cf) == len(set(cf["class"])) > 0
    assert (cf["max_abs_dlogit"] == 0).all() and (cf["flips"] == 0).all() and not cf["cause"].any()
    assert "skipped" in r.details["counterfactual_skipped"]
    assert "counterfactual" in r.details["verdict"] and "0 by construction" in r.details["verdict"]


def _diverging_triage(lm, plant, block_start: bool):
    """A triage record at a flip of the planted pair, at the first position of a verify block (or its last)."""
    from gemmdrift.measure.diverge import triage_result

    r = attribute(lm, TOKENS[:16], [DECODE, VERIFY], split=2, counterfactual=[], perturb=plant)
    flips = [p for p in r.tables["envelope"]["flip_positions"].iloc[0] if ((p - 2) % 3 == 0) == block_start]
    assert flips
    pos = flips[0]
    prompt, stream = TOKENS[:3], TOKENS[3:16]  # split 2: the logits at 2 + i predict generated token i
    t = {"verdict": "NEAR-TIE", "reason": "within the envelope", "index": pos - 2, "position": pos,
         "schedule_a": DECODE, "schedule_b": VERIFY, "bit_identical": False}
    return pos, triage_result(t, {"model": lm.info, "stream_a": stream}, {}), prompt


def test_explain_attributes_the_block_that_diverged(tiny, monkeypatch):
    from gemmdrift.cli.attribute import explain_divergence
    import gemmdrift.attribution.attribute as attribution

    plant = {(2, "mlp.down_proj"): in_blocks(gross)}
    pos, before, prompt = _diverging_triage(tiny, plant, block_start=True)
    seen = []
    real = attribution.attribute
    monkeypatch.setattr(attribution, "attribute", lambda lm, tokens, *a, **k: seen.append(len(tokens)) or real(
        lm, tokens, *a, **k))
    e = explain_divergence(tiny, before, prompt, perturb=plant).details["triage"]["explanation"]
    assert seen == [pos + 3]  # the verify block [pos, pos + 3) whole, as the teacher-forced run computed it
    assert e["flipped"] and e["causes"] == ["mlp.down_proj"]


def test_explain_says_when_there_is_nothing_to_explain(tiny, monkeypatch):
    from gemmdrift.cli.attribute import explain_divergence
    from gemmdrift.measure.diverge import triage_result
    from gemmdrift.view.summaries import text

    calls = counting_runs(monkeypatch)
    agree = triage_result({"verdict": "IDENTICAL", "reason": "the streams agree", "index": None, "position": None,
                           "schedule_a": DECODE, "schedule_b": VERIFY, "bit_identical": True},
                          {"model": tiny.info, "stream_a": TOKENS[3:8]}, {})
    e = explain_divergence(tiny, agree, TOKENS[:3]).details["triage"]["explanation"]
    assert "nothing to explain" in e["said"] and "do not diverge" in e["said"] and not calls
    assert "which op (--explain): nothing to explain" in text(explain_divergence(tiny, agree, TOKENS[:3]))
    same = triage_result({"verdict": "OUTSIDE ENVELOPE", "reason": "not numeric", "index": 2, "position": 4,
                          "schedule_a": DECODE, "schedule_b": VERIFY, "bit_identical": True},
                         {"model": tiny.info, "stream_a": TOKENS[3:8]}, {})
    e = explain_divergence(tiny, same, TOKENS[:3]).details["triage"]["explanation"]
    assert "nothing to explain" in e["said"] and "bit-identical" in e["said"] and not calls
    # A numeric divergence whose position does not flip teacher-forced: no counterfactual is run for it.
    near = triage_result({"verdict": "NEAR-TIE", "reason": "", "index": 2, "position": 4, "schedule_a": DECODE,
                          "schedule_b": VERIFY, "bit_identical": False},
                         {"model": tiny.info, "stream_a": TOKENS[3:8]}, {})
    e = explain_divergence(tiny, near, TOKENS[:3], perturb={(1, "mlp.down_proj"): in_blocks(one_ulp_up)}).details[
        "triage"]["explanation"]
    assert not e["flipped"] and "do not flip" in e["said"] and [c for c in calls if c] == []


def test_a_report_with_nothing_drifting_says_why_and_carries_its_command(tiny):
    from gemmdrift.view.attribute import report_part

    r = attribute(tiny, TOKENS[:8], [DECODE, VERIFY], split=2, counterfactual=["each"])
    blocks, reading = report_part(r)
    text = " ".join(str(b[1]) for b in blocks)
    assert "counterfactual runs were skipped" in text and "Recompute: `gemmdrift attribute --model" in text


def test_under_a_replay_the_tapped_runs_compute_what_the_untapped_run_does():
    """Report A D5's other suspect: the base run (no op taps) differing from the tapped ones. Under the replayed
    M1, B's run with op taps gives the plain run's logits bit for bit."""
    from gemmdrift.model.taps import run_schedule
    from gemmdrift.replay.model import KernelsOption

    lm = make_tiny("bfloat16", seed=12, sliding_window=64)
    toks, pos = TOKENS[:20], np.arange(2, 20)
    kopt = KernelsOption("replay:M1")
    site_list = optaps.sites(lm.model)
    with kopt.installed(lm):
        plain = run_schedule(lm.model, toks, VERIFY, split=2, positions=pos, logit_positions=pos)
        tapped, _ = optaps.run_ops(lm.model, toks, VERIFY, split=2, positions=pos, logit_positions=pos,
                                   site_list=site_list)
        decode = run_schedule(lm.model, toks, DECODE, split=2, positions=pos, logit_positions=pos)
    assert np.array_equal(plain.logits, tapped.logits) and np.array_equal(plain.hidden, tapped.hidden)
    assert not np.array_equal(plain.logits, decode.logits)  # the replay does make the schedules differ


def _alone(lm, toks, plant):
    """The pair's envelope with ``plant`` the only difference (no counterfactual)."""
    return attribute(lm, toks, [DECODE, VERIFY], split=2, counterfactual=[], perturb=plant).tables["envelope"].iloc[0]


def test_all_but_one_keeps_the_class_and_what_it_carries_and_holds_every_other():
    """PROBE-DEFECTS-4 item 1: keeping one class replaced every other drifting class by the reference's outputs, so
    an op downstream of the kept one (o_proj after q_proj, down_proj after up_proj) wiped its drift, and every
    "all but" row read the head's own drift. Known answer: with every projection planted (a T>1-only change, as
    a replayed chip's GEMM differs from its gemv), "all but X" is X planted alone, bit for bit."""
    lm = make_tiny("bfloat16")
    toks = TOKENS[:8]
    plants = {"self_attn.q_proj": every_layer(lm, "self_attn.q_proj", gross),
              "mlp.up_proj": every_layer(lm, "mlp.up_proj", gross),
              "self_attn.o_proj": every_layer(lm, "self_attn.o_proj", one_ulp_up),
              "mlp.down_proj": every_layer(lm, "mlp.down_proj", one_ulp_up),
              "lm_head": {(lm.n_layers, "lm_head"): in_blocks(one_ulp_up)}}
    r = attribute(lm, toks, [DECODE, VERIFY], split=2, counterfactual=["each", "all-but-one"],
                  perturb={k: v for p in plants.values() for k, v in p.items()})
    cf = r.tables["counterfactual"]
    abo = cf[cf["direction"] == "all-but-one"].set_index("class")
    assert set(abo.index) == set(cf[cf["direction"] == "each"]["class"])  # a row for every class
    for cls in ("self_attn.q_proj", "mlp.up_proj", "lm_head"):
        alone = _alone(lm, toks, plants[cls])
        assert alone["max_abs_dlogit"] > 0
        for k in ("max_abs_dlogit", "max_abs_dgap", "flips", "kld_mean", "same_top1_share"):
            assert abo.loc[cls, k] == alone[k], (cls, k)
    assert abo.loc["self_attn.q_proj", "max_abs_dlogit"] != abo.loc["mlp.up_proj", "max_abs_dlogit"]
    quiet = [c for c in abo.index if c not in plants]  # no drift of its own: every drifting class held
    assert quiet and (abo.loc[quiet, "max_abs_dlogit"] == 0).all() and (abo.loc[quiet, "flips"] == 0).all()
    assert r.details["all_but_one_unheld"] == []


def test_all_but_one_with_one_drifting_class_is_its_envelope_and_0_elsewhere(tiny):
    """PROBE-DEFECTS-4 item 1, the planted known answer: exactly one drifting class gives the pair's envelope in its
    all-but-one row and exactly 0 in every other class's."""
    r = attribute(tiny, TOKENS[:8], [DECODE, VERIFY], split=2, counterfactual=["all-but-one"],
                  perturb=every_layer(tiny, "mlp.up_proj", gross))
    base = r.tables["envelope"].iloc[0]
    abo = r.tables["counterfactual"].set_index("class")
    assert base["max_abs_dlogit"] > 0 and abo.loc["mlp.up_proj", "max_abs_dlogit"] == base["max_abs_dlogit"]
    assert abo.loc["mlp.up_proj", "flips"] == base["flips"]
    others = abo.drop(index="mlp.up_proj")
    assert len(others) and (others["max_abs_dlogit"] == 0).all() and (others["flips"] == 0).all()
    assert (others["kld_mean"] == 0).all() and (others["same_top1_share"] == 1).all()


def test_under_a_replayed_m1_with_every_class_all_but_one_rows_differ_and_every_class_held_leaves_nothing():
    """PROBE-DEFECTS-4 item 1 on the default op set (not a narrow --ops, where the carriers were not in the set):
    under replay:M1 the rows of the drifting classes differ where their each-rows do, and holding every drifting
    class (the row of a class with no drift of its own) leaves exactly nothing: holding is exact under the replay."""
    lm = make_tiny("bfloat16", sliding_window=64)
    r = attribute(lm, TOKENS[:24], [DECODE, VERIFY], split=2, counterfactual=["each", "all-but-one"],
                  kernels="replay:M1")
    cf = r.tables["counterfactual"]
    each = cf[cf["direction"] == "each"].set_index("class")
    abo = cf[cf["direction"] == "all-but-one"].set_index("class")
    drifting = sorted(set(r.tables["ops"]["class"][r.tables["ops"]["positions_differ"] > 0]))
    assert len(drifting) >= 2 and r.tables["envelope"]["max_abs_dlogit"].iloc[0] > 0
    pairs = [(x, y) for x in drifting for y in drifting if x < y
             and each.loc[x, "max_abs_dlogit"] != each.loc[y, "max_abs_dlogit"]]
    assert pairs and all(abo.loc[x, "max_abs_dlogit"] != abo.loc[y, "max_abs_dlogit"] for x, y in pairs)
    quiet = [c for c in abo.index if c not in drifting]
    assert quiet and (abo.loc[quiet, "max_abs_dlogit"] == 0).all() and (abo.loc[quiet, "kld_mean"] == 0).all()


def test_holding_is_exact_for_rope_the_residual_adds_and_the_norms():
    """Issue 53: a held op is recomputed in the reference's blocks on this run's input; RoPE at the reference
    block's offset, the residual add with both its inputs, the norms: with each planted (T>1 only, verify:3),
    "all but X" is X planted alone, bit for bit."""
    lm = make_tiny("bfloat16")
    toks, pair = TOKENS[:8], [DECODE, "prefill:2,verify:3"]
    plants = {"self_attn.q_proj": every_layer(lm, "self_attn.q_proj", gross),
              "self_attn.rope": every_layer(lm, "self_attn.rope", one_ulp_up),
              "residual": every_layer(lm, "residual", one_ulp_up),
              "self_attn.k_norm": every_layer(lm, "self_attn.k_norm", one_ulp_up),
              "norm": {(lm.n_layers, "norm"): in_blocks(one_ulp_up)}}
    r = attribute(lm, toks, pair, split=2, counterfactual=["all-but-one"],
                  perturb={k: v for p in plants.values() for k, v in p.items()})
    abo = r.tables["counterfactual"].set_index("class")
    assert set(r.tables["ops"]["class"][r.tables["ops"]["positions_differ"] > 0]) == set(plants)
    for cls, plant in plants.items():
        alone = attribute(lm, toks, pair, split=2, counterfactual=[], perturb=plant).tables["envelope"].iloc[0]
        assert alone["max_abs_dlogit"] > 0, cls
        for k in ("max_abs_dlogit", "max_abs_dgap", "flips", "kld_mean", "same_top1_share"):
            assert abo.loc[cls, k] == alone[k], (cls, k)
    assert (abo.drop(index=list(plants))["max_abs_dlogit"] == 0).all()
