"""Which op (gemmdrift.attribution.attribute, issue 29): the main job's pair, decode vs verify:2 past the sliding window on
the embedded Gemma, attributed to op classes.

Per op class: its local drift (log2(1 + max ULP) over layers and positions, each op fed the reference's input)
and what is left of the logit envelope when that class is made invariant (the counterfactual). On this CPU the
attention core carries the drift past the window, no projection; a release that changes a kernel moves its
class's series. ``OpTapsOverhead`` tracks the cost of the taps against a plain stack run of the same pair.
"""

from . import common

PAIR = common.ATTRIBUTE_PAIR  # computed by common.Probes (its "attribute" part), pinned there
CLASSES = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
           "self_attn.k_norm", "self_attn.rope", "sdpa", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
           "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
           "residual", "norm", "lm_head"]
# Pinned here, not read from gemmdrift.attribution.attribute.PART_SIZES (which `gemmdrift run` may retune).
OVERHEAD_SIZES = dict(tokens=96, split=64)


class Attribution(common.Probes):
    """One attribution of the main job's pair (common.sizes(): 560 tokens, positions 500..559 on the CPU) serves
    every track_. It is a part of the shared setup (common.Probes), side by side with the other probes: alone it
    ran its 21 tapped runs in one process while the second core idled."""

    params = (CLASSES,)
    param_names = ["op_class"]

    def track_local_bits(self, f, op_class):
        """log2(1 + max ULP) of the class's local drift (0: bit-identical on its own input)."""
        return common.figure(f["attribute"], "attr_local_bits", " vs ".join(PAIR), op_class)

    track_local_bits.unit = "bits"
    track_local_bits.version = "1"
    track_local_bits.direction = "lower"

    def track_left_max_dlogit(self, f, op_class):
        """max|dlogit| left with the class made invariant."""
        return common.figure(f["attribute"], "attr_left_max_abs_dlogit", " vs ".join(PAIR), "each", op_class)

    track_left_max_dlogit.unit = "logits"
    track_left_max_dlogit.version = "1"
    track_left_max_dlogit.direction = "lower"

    def track_left_flips(self, f, op_class):
        """argmax flips left with the class made invariant."""
        return common.figure(f["attribute"], "attr_left_flips", " vs ".join(PAIR), "each", op_class)

    track_left_flips.unit = "argmax flips"
    track_left_flips.version = "1"
    track_left_flips.direction = "lower"


class OpTapsOverhead:
    """attribute without a counterfactual (3 tapped runs) against stack of the same pair (3 runs); budget 1.3."""

    timeout = 3600

    def setup_cache(self):
        if not common.full_benchmarks():
            return common.skipped_full()
        from gemmdrift import suite
        from gemmdrift.attribution.attribute import taps_overhead

        lm = common.model()
        return taps_overhead(lm, suite.stream(lm, OVERHEAD_SIZES["tokens"]),
                             ["prefill:64,decode", "prefill:64,verify:2"], OVERHEAD_SIZES["split"])

    setup_cache.timeout = 3600

    def setup(self, f):
        common.skip_unless_full(f, "OpTapsOverhead")

    def track_taps_overhead(self, f):
        return f["ratio"]

    track_taps_overhead.unit = "ratio"
    track_taps_overhead.version = "1"
    track_taps_overhead.direction = "lower"
