"""Greedy divergence of mlx-lm generate vs speculative generate (self-draft, K=2) past the window."""

from . import common


class Divergence:
    timeout = 7200

    def setup_cache(self):
        from gemmdrift import suite

        r = suite.divergence_probe(common.model(), common.sizes())
        t = r.get("triage") or {}
        return {
            "n": float(r["n"]),
            "first": float(r["first_divergence"]) if r["first_divergence"] is not None else float(r["n"]),
            "outside": 1.0 if t.get("verdict") == "OUTSIDE ENVELOPE" else 0.0,
            "acceptance": float(r["stream_b"].get("acceptance") or 0.0),
        }

    setup_cache.timeout = 7200

    def track_first_divergence(self, f):
        """Generated tokens before the streams part (the number generated when they never do)."""
        return f["first"]

    track_first_divergence.unit = "tokens"
    track_first_divergence.version = "1"

    def track_outside_envelope(self, f):
        """1 when the divergence is judged a state bug rather than a near-tie."""
        return f["outside"]

    track_outside_envelope.unit = "divergences"
    track_outside_envelope.version = "1"

    def track_self_draft_acceptance(self, f):
        """Fraction of tokens accepted from the self-draft: below K/(K+1) only through numeric rejections."""
        return f["acceptance"]

    track_self_draft_acceptance.unit = "fraction"
    track_self_draft_acceptance.version = "1"
