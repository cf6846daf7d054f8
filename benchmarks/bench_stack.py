"""Layer-stack drift and the logit envelope of the main schedule pairs (gemmdrift.suite)."""

from . import common

PAIRS = {
    "verify2": "prefill:512,decode vs prefill:512,verify:2",
    "verify3": "prefill:512,decode vs prefill:512,verify:3",
}
PREFILL_PAIR = "prefill:2048 vs prefill:512"
TAPS = [f"layer {i}" for i in range(18)] + ["norm", "logits"]


def _figures(result):
    """Plain numbers from a StackResult: envelope per pair, rel_l2 per pair/mode/tap, ladder drift."""
    from gemmdrift import metrics

    base = result.inputs["model"]["dtype"]
    t = result.table[result.table["dtype"] == base]
    out = {"envelope": {}, "rel_l2": {}, "bits": {}, "ladder": {}}
    for _, row in result.envelope[result.envelope["dtype"] == base].iterrows():
        if row["mode"] == "accumulated":
            out["envelope"][row["pair"]] = {k: float(row[k]) for k in ("max_abs_dlogit", "max_abs_dgap", "p99_abs_dgap",
                                                                        "flips", "max_gap_at_flip")}
    for (pair, mode, tap), s in t.groupby(["pair", "mode", "tap"]):
        m = dict(zip(s["metric"], s["value"]))
        out["rel_l2"][(pair, mode, tap)] = float(m["rel_l2"])
        out["bits"][(pair, mode, tap)] = metrics.bits_lost(float(m["p99_ulp"]))
    if result.ladder is not None:
        for _, row in result.ladder.iterrows():
            out["ladder"][(row["pair"], row["tap"])] = float(row["rel_l2_float32"])
    return out


class _Decode:
    """One measurement (suite.decode_family) shared by the classes below: asv runs a
    setup_cache once per source location, so subclasses do not repeat it."""

    timeout = 7200

    def setup_cache(self):
        from gemmdrift import suite

        return _figures(suite.decode_family(common.model(), common.sizes()))

    setup_cache.timeout = 7200


class _Prefill:
    """suite.prefill_family, shared the same way."""

    timeout = 7200

    def setup_cache(self):
        from gemmdrift import suite

        return _figures(suite.prefill_family(common.model(), common.sizes()))

    setup_cache.timeout = 7200


class DecodeVsVerify(_Decode):
    """decode (T=1) against verify:2 and verify:3 after the same prefill, past the sliding window."""

    params = (list(PAIRS),)
    param_names = ["pair"]

    def track_max_abs_dlogit(self, f, pair):
        return f["envelope"][PAIRS[pair]]["max_abs_dlogit"]

    track_max_abs_dlogit.unit = "logits"
    track_max_abs_dlogit.version = "1"

    def track_max_abs_dgap(self, f, pair):
        return f["envelope"][PAIRS[pair]]["max_abs_dgap"]

    track_max_abs_dgap.unit = "logits"
    track_max_abs_dgap.version = "1"

    def track_p99_abs_dgap(self, f, pair):
        return f["envelope"][PAIRS[pair]]["p99_abs_dgap"]

    track_p99_abs_dgap.unit = "logits"
    track_p99_abs_dgap.version = "1"

    def track_flips(self, f, pair):
        return f["envelope"][PAIRS[pair]]["flips"]

    track_flips.unit = "argmax flips"
    track_flips.version = "1"

    def track_logits_rel_l2_float32(self, f, pair):
        """The same pair at float32 (precision ladder): rounding drift shrinks by orders of magnitude."""
        return f["ladder"].get((PAIRS[pair], "logits"), 0.0)

    track_logits_rel_l2_float32.unit = "relative L2"
    track_logits_rel_l2_float32.version = "1"


class DecodeVsVerifyLayers(_Decode):
    """Drift at every layer: accumulated (each schedule feeds itself) and local (identical inputs)."""

    params = (list(PAIRS), ["accumulated", "local"], TAPS)
    param_names = ["pair", "mode", "tap"]

    def track_rel_l2(self, f, pair, mode, tap):
        return f["rel_l2"][(PAIRS[pair], mode, tap)]

    track_rel_l2.unit = "relative L2"
    track_rel_l2.version = "1"

    def track_bits_p99(self, f, pair, mode, tap):
        """log2(1 + p99 ULP distance): 0 when bit-identical."""
        return f["bits"][(PAIRS[pair], mode, tap)]

    track_bits_p99.unit = "bits"
    track_bits_p99.version = "1"


class PrefillChunks(_Prefill):
    """The stream prefilled in one chunk (2048) against chunks of 512: the logit envelope."""

    def track_max_abs_dlogit(self, f):
        return f["envelope"][PREFILL_PAIR]["max_abs_dlogit"]

    track_max_abs_dlogit.unit = "logits"
    track_max_abs_dlogit.version = "1"

    def track_max_abs_dgap(self, f):
        return f["envelope"][PREFILL_PAIR]["max_abs_dgap"]

    track_max_abs_dgap.unit = "logits"
    track_max_abs_dgap.version = "1"

    def track_flips(self, f):
        return f["envelope"][PREFILL_PAIR]["flips"]

    track_flips.unit = "argmax flips"
    track_flips.version = "1"


class PrefillChunksLayers(_Prefill):
    """Accumulated drift at every layer between the two chunkings."""

    params = (TAPS,)
    param_names = ["tap"]

    def track_rel_l2(self, f, tap):
        return f["rel_l2"][(PREFILL_PAIR, "accumulated", tap)]

    track_rel_l2.unit = "relative L2"
    track_rel_l2.version = "1"
