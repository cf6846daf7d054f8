"""Greedy divergence of mlx-lm generate vs speculative generate (self-draft, K=2) past the window.

The setup (common.Probes, shared with four other probes) returns the figures of the probe's Result; each
track_ looks up one named figure (gemmdrift.measure.diverge.diverge_figures), NaN when it was not measured.
"""

from . import common


class Divergence(common.Probes):
    """The divergence probe (gemmdrift.suite.divergence_probe); its setup is shared (common.Probes)."""

    def track_first_divergence(self, f):
        """Generated tokens before the streams part; the number generated (n) when they never do.
        `track_diverged` tells "never diverged in n tokens" (0) from "diverged at n" (1)."""
        return common.figure(f["diverge"], "first_divergence")

    track_first_divergence.unit = "tokens"
    track_first_divergence.version = "1"
    track_first_divergence.direction = "higher"

    def track_diverged(self, f):
        """1 when the streams part within the tokens generated, 0 when they never do."""
        return common.figure(f["diverge"], "diverged")

    track_diverged.unit = "divergences"
    track_diverged.version = "1"
    track_diverged.direction = "lower"

    def track_outside_envelope(self, f):
        """1 when the divergence is judged a state bug rather than a near-tie (NaN when no triage ran)."""
        return common.figure(f["diverge"], "outside_envelope")

    track_outside_envelope.unit = "divergences"
    track_outside_envelope.version = "1"
    track_outside_envelope.direction = "lower"

    def track_self_draft_acceptance(self, f):
        """Fraction of tokens accepted from the self-draft: below K/(K+1) only through numeric rejections."""
        return common.figure(f["diverge"], "self_draft_acceptance")

    track_self_draft_acceptance.unit = "fraction"
    track_self_draft_acceptance.version = "1"
    track_self_draft_acceptance.direction = "higher"
