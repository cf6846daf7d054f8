"""Op taps and local drift per op (issue 29, items 1-2) on the tiny gemma3_text (sliding window 8)."""

import numpy as np
import pytest

from conftest import make_tiny
from gemmdrift import metrics
from gemmdrift.model import optaps
from gemmdrift.errors import GemmdriftError
from gemmdrift.model.taps import common_prefix, run_schedule

TOKENS = np.random.default_rng(0).integers(0, 97, 128).tolist()
DECODE, VERIFY = "prefill:2,decode", "prefill:2,verify:2"


def one_ulp_up(out, args):
    """Element 0 of every row one ULP further from zero (its storage bits + 1), computed outside mlx."""
    import mlx.core as mx

    a = np.array(out.astype(mx.float32))
    bits = a.view(np.uint32)
    bits[..., 0] += np.uint32(0x10000 if out.dtype == mx.bfloat16 else 1)
    return mx.array(a).astype(out.dtype)


def _runs(lm, tokens, a, b, split, **kw):
    n = len(tokens)
    pre = common_prefix(lm.model, tokens, [a, b], split, split)
    lp = range(split, n)
    ta, ra = optaps.run_ops(lm.model, tokens, a, split=split, prefix=pre, logit_positions=lp, keep_inputs=True)
    tb, rb = optaps.run_ops(lm.model, tokens, b, split=split, prefix=pre, logit_positions=lp, reference=ra,
                            local=True, **kw)
    return pre, (ta, ra), (tb, rb)


def test_exposed_ops_name_every_op_of_a_gemma_layer(tiny):
    ops = optaps.exposed_ops(tiny.model)
    for name in ("input_layernorm", "self_attn.q_proj", "self_attn.k_norm", "self_attn.rope", "sdpa",
                 "mlp.down_proj", "post_feedforward_layernorm", "residual"):
        assert name in ops.names
    assert ops.head == ["norm", "lm_head"]
    assert any("activation" in k for k in ops.part_of)
    assert ops.resolve(["q_proj", "sdpa"]) == ["self_attn.q_proj", "sdpa"]
    with pytest.raises(GemmdriftError, match="unknown op 'qproj'.*self_attn.q_proj"):
        ops.resolve(["qproj"])


def test_op_taps_leave_the_run_unchanged_and_see_the_layers_own_outputs(tiny):
    toks = TOKENS[:12]
    plain = run_schedule(tiny.model, toks, "prefill:4,verify:2", split=4, logit_positions=range(12))
    taps, rec = optaps.run_ops(tiny.model, toks, "prefill:4,verify:2", split=4, logit_positions=range(12))
    assert np.array_equal(plain.logits, taps.logits) and np.array_equal(plain.hidden, taps.hidden)
    n = tiny.n_layers
    for i in range(n):  # a Gemma layer ends with its second residual add: its output is the layer's
        assert np.array_equal(rec.out[(i, "residual#1")][:, 0], taps.hidden[i])
    assert np.array_equal(rec.out[(n, "norm")][:, 0], taps.hidden[n])
    assert np.array_equal(rec.out[(n, "lm_head")][:, 0], taps.logits)
    # Forward order: the attention block's ops, in the order the layer calls them.
    names = [k[1] for k in rec.order if k[0] == 0]
    assert names.index("self_attn.k_norm") < names.index("self_attn.rope#1") < names.index("sdpa") < names.index(
        "self_attn.o_proj") < names.index("mlp.down_proj")
    # The model is restored: its modules and the patched attention function are the originals again.
    from mlx_lm.models import base, gemma3_text

    assert gemma3_text.scaled_dot_product_attention is base.scaled_dot_product_attention
    assert type(tiny.model.layers[0].self_attn.q_proj).__name__ == "Linear"


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_below_the_window_every_op_is_bit_identical(dtype):
    lm = make_tiny(dtype)
    _, _, (tb, rb) = _runs(lm, TOKENS[:8], DECODE, VERIFY, 2)
    _, (ta, ra), _ = _runs(lm, TOKENS[:8], DECODE, VERIFY, 2)
    d = optaps.local_drift(ra, rb)
    assert len(d) == (lm.n_layers * 18 + 2) * 6  # every op at every compared position (the head's at logits)
    assert (d["frac_differ"] == 0).all() and (d["max_ulp"] == 0).all() and (d["rel_l2"] == 0).all()
    assert (optaps.first_differing(d)["layer"] == -1).all()


def test_planted_one_ulp_in_k_norm_of_layer_3_is_found_there_alone(tiny):
    key = (3, "self_attn.k_norm")
    _, (ta, ra), (tb, rb) = _runs(tiny, TOKENS[:8], DECODE, VERIFY, 2, perturb={key: one_ulp_up})
    d = optaps.local_drift(ra, rb)
    hit = d[d["frac_differ"] > 0]
    assert set(zip(hit["layer"], hit["op"])) == {key}
    assert len(hit) == 6 and (hit["max_ulp"] == 1).all()
    assert np.allclose(hit["frac_differ"], 1 / 32)  # one element of each 32-wide head row (1 kv head)
    # rel L2 as metrics.compare computes it on the same rows
    p = int(hit["position"].iloc[0])
    a, b = ra.out[key][ra.rows(key, [p])], rb.out[key][rb.rows(key, [p])]
    assert hit["rel_l2"].iloc[0] == pytest.approx(metrics.compare(a, b, "bfloat16")["rel_l2"], rel=1e-12)
    first = optaps.first_differing(d)
    assert (first["layer"] == 3).all() and (first["op"] == "self_attn.k_norm").all()


def test_copies_of_cache_backed_inputs_survive_the_ring_buffer():
    # Past the window the RotatingKVCache rewrites its buffers in place: a capture that kept a reference
    # instead of a copy would feed the wrong rows back, and a run would differ from itself in local mode.
    lm = make_tiny("float32")
    _, _, (tb, rb) = _runs(lm, TOKENS[:24], "prefill:4,decode", "prefill:4,decode", 4)
    _, (ta, ra), _ = _runs(lm, TOKENS[:24], "prefill:4,decode", "prefill:4,decode", 4)
    d = optaps.local_drift(ra, rb)
    assert d["position"].max() == 23 and (d["frac_differ"] == 0).all()


def test_past_the_window_only_the_attention_core_of_sliding_layers_drifts():
    lm = make_tiny("float32")
    _, (ta, ra), (tb, rb) = _runs(lm, TOKENS[:40], "prefill:4,decode", "prefill:4,verify:2", 4)
    d = optaps.local_drift(ra, rb)
    hit = d[d["frac_differ"] > 0]
    sliding = [i for i, t in enumerate(lm.info["layer_types"]) if "sliding" in t]
    assert len(hit) and set(hit["op"]) == {"sdpa"} and set(hit["layer"]) <= set(sliding)
    assert hit["position"].min() >= 8  # the window
    assert (d[d["position"] < 8]["frac_differ"] == 0).all()


def test_a_counterfactual_class_with_no_member_is_refused(tiny):
    _, (ta, ra), _ = _runs(tiny, TOKENS[:6], DECODE, VERIFY, 2)
    with pytest.raises(GemmdriftError, match="no member"):
        optaps.run_ops(tiny.model, TOKENS[:6], VERIFY, split=2, reference=ra, replace=["no_such_op"])


def test_the_emulated_split_k_control_on_one_projection_is_found_there():
    import mlx.core as mx

    from gemmdrift.kernels.paths import split_k

    lm = make_tiny("float32")
    key = (1, "mlp.down_proj")
    wf = lm.model.layers[1].mlp.down_proj.weight.astype(mx.float32)
    control = {key: lambda out, args: split_k(args[0], wf, None, 4, out.dtype)}
    _, (ta, ra), (tb, rb) = _runs(lm, TOKENS[:8], DECODE, VERIFY, 2, perturb=control)
    d = optaps.local_drift(ra, rb)
    hit = d[d["frac_differ"] > 0]
    assert len(hit) and set(zip(hit["layer"], hit["op"])) == {key}
