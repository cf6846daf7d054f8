"""Layer-stack drift and the logit envelope of the main schedule pairs (gemmdrift.suite).

The setup (common.Probes, shared with the other probes) returns the figures of each measurement's Result;
each track_ looks up one named figure (gemmdrift.measure.stack.stack_figures), NaN when it was not measured.
"""

from . import common

PAIRS = {
    "verify2": "prefill:512,decode vs prefill:512,verify:2",
    "verify3": "prefill:512,decode vs prefill:512,verify:3",
}
PREFILL_PAIR = "prefill:2048 vs prefill:512"
TAPS = [f"layer {i}" for i in range(18)] + ["norm", "logits"]


class _Decode(common.Probes):
    """suite.decode_family: its setup is shared with the other probes (common.Probes)."""


class _Prefill(common.Probes):
    """suite.prefill_family: its setup is shared with the other probes (common.Probes)."""


class DecodeVsVerify(_Decode):
    """decode (T=1) against verify:2 and verify:3 after the same prefill, past the sliding window."""

    params = (list(PAIRS),)
    param_names = ["pair"]

    def track_max_abs_dlogit(self, f, pair):
        return common.figure(f["decode"], "max_abs_dlogit", PAIRS[pair])

    track_max_abs_dlogit.unit = "logits"
    track_max_abs_dlogit.version = "1"
    track_max_abs_dlogit.direction = "lower"

    def track_max_abs_dgap(self, f, pair):
        return common.figure(f["decode"], "max_abs_dgap", PAIRS[pair])

    track_max_abs_dgap.unit = "logits"
    track_max_abs_dgap.version = "1"
    track_max_abs_dgap.direction = "lower"

    def track_p99_abs_dgap(self, f, pair):
        return common.figure(f["decode"], "p99_abs_dgap", PAIRS[pair])

    track_p99_abs_dgap.unit = "logits"
    track_p99_abs_dgap.version = "1"
    track_p99_abs_dgap.direction = "lower"

    def track_flips(self, f, pair):
        return common.figure(f["decode"], "flips", PAIRS[pair])

    track_flips.unit = "argmax flips"
    track_flips.version = "1"
    track_flips.direction = "lower"

    def track_logits_rel_l2_float32(self, f, pair):
        """The same pair at float32 (precision ladder): rounding drift shrinks by orders of magnitude.
        NaN (skipped) when the sizes ran no ladder."""
        return common.figure(f["decode"], "ladder_rel_l2_float32", PAIRS[pair], "logits")

    track_logits_rel_l2_float32.unit = "relative L2"
    track_logits_rel_l2_float32.version = "1"
    track_logits_rel_l2_float32.direction = "lower"


class DecodeVsVerifyLayers(_Decode):
    """Drift at every layer: accumulated (each schedule feeds itself) and local (identical inputs)."""

    params = (list(PAIRS), ["accumulated", "local"], TAPS)
    param_names = ["pair", "mode", "tap"]

    def track_rel_l2(self, f, pair, mode, tap):
        return common.figure(f["decode"], "rel_l2", PAIRS[pair], mode, tap)

    track_rel_l2.unit = "relative L2"
    track_rel_l2.version = "1"
    track_rel_l2.direction = "lower"

    def track_bits_p99(self, f, pair, mode, tap):
        """log2(1 + p99 ULP distance): 0 when bit-identical."""
        return common.figure(f["decode"], "bits_p99", PAIRS[pair], mode, tap)

    track_bits_p99.unit = "bits"
    track_bits_p99.version = "1"
    track_bits_p99.direction = "lower"


class PrefillChunks(_Prefill):
    """The stream prefilled in one chunk (2048) against chunks of 512: the logit envelope."""

    def track_max_abs_dlogit(self, f):
        return common.figure(f["prefill"], "max_abs_dlogit", PREFILL_PAIR)

    track_max_abs_dlogit.unit = "logits"
    track_max_abs_dlogit.version = "1"
    track_max_abs_dlogit.direction = "lower"

    def track_max_abs_dgap(self, f):
        return common.figure(f["prefill"], "max_abs_dgap", PREFILL_PAIR)

    track_max_abs_dgap.unit = "logits"
    track_max_abs_dgap.version = "1"
    track_max_abs_dgap.direction = "lower"

    def track_flips(self, f):
        return common.figure(f["prefill"], "flips", PREFILL_PAIR)

    track_flips.unit = "argmax flips"
    track_flips.version = "1"
    track_flips.direction = "lower"


class PrefillChunksLayers(_Prefill):
    """Accumulated drift at every layer between the two chunkings."""

    params = (TAPS,)
    param_names = ["tap"]

    def track_rel_l2(self, f, tap):
        return common.figure(f["prefill"], "rel_l2", PREFILL_PAIR, "accumulated", tap)

    track_rel_l2.unit = "relative L2"
    track_rel_l2.version = "1"
    track_rel_l2.direction = "lower"
