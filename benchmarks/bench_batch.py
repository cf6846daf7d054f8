"""Batch composition and the real mlx_lm.server (issue 14).

Batch: the built-in prompt 0 as row j (first and last) of mlx-lm's
BatchGenerator with B in {1, 2, 4, 8} short companions, and B=2 with a
companion longer than the sliding window, against the same prompt alone.
Server: the long run (the built-in essay, longer than the 512 window, 64
tokens): no draft vs a 4-bit re-quantized draft with 2 draft tokens, alone vs
among 3 concurrent requests, a continued conversation vs sent fresh.

A figure that was not measured returns NaN, so asv records it as skipped.
"""

import math

from . import common

BATCH_N = 16
BATCH_SIZES = (1, 2, 4, 8)
BATCH_LONG_SIZES = (2,)
SERVER_N = 64
SERVER_COMPANIONS = 3


def _get(f, name):
    return float(f.get(name, math.nan))


class Batch:
    timeout = 7200

    def setup_cache(self):
        if not common.long_benchmarks():
            return common.skipped_long()
        from gemmdrift.measure.batch import measure_batch
        from gemmdrift.prompts import builtin_prompts, builtin_text

        lm = common.model()
        tok = lm.tokenizer
        texts = builtin_prompts()
        target = {"p0": tok.encode(texts[0])}
        short = [tok.encode(t) for t in texts[1:8]]
        long = [tok.encode(t + "\n\n" + builtin_text("essay"))[: int(lm.info["sliding_window"]) + 64]
                for t in texts[1:2]]
        r = measure_batch(lm, target, {"short": short}, BATCH_N, batch_sizes=BATCH_SIZES)
        r_long = measure_batch(lm, target, {"long": long}, BATCH_N, batch_sizes=BATCH_LONG_SIZES)
        f = dict(r.figures)
        f.update({f"long_{k}": v for k, v in r_long.figures.items()})
        return f

    setup_cache.timeout = 7200

    def setup(self, f, *params):
        common.skip_unless_long(f, "Batch")

    def track_batch_envelope(self, f):
        """Largest |Δgap| between a batch row and the same prompt alone (short companions, any B)."""
        return _get(f, "batch_envelope")

    track_batch_envelope.unit = "logits"
    track_batch_envelope.version = "1"
    track_batch_envelope.direction = "lower"

    def track_batch_envelope_long(self, f):
        """The same with a companion longer than the sliding window (B=2)."""
        return _get(f, "long_batch_envelope")

    track_batch_envelope_long.unit = "logits"
    track_batch_envelope_long.version = "1"
    track_batch_envelope_long.direction = "lower"

    def track_batch_flips(self, f):
        """Rows whose greedy stream parts from the lone stream (short companions)."""
        return _get(f, "batch_flips")

    track_batch_flips.unit = "rows"
    track_batch_flips.version = "1"
    track_batch_flips.direction = "lower"

    def track_batch_outside(self, f):
        """Rows outside the single-sequence envelope (a padding or state suspect)."""
        return _get(f, "batch_outside") + _get(f, "long_batch_outside")

    track_batch_outside.unit = "rows"
    track_batch_outside.version = "1"
    track_batch_outside.direction = "lower"

    def track_batch_speedup(self, f):
        """The B=8 batch against the same 8 streams one by one (wall time ratio)."""
        return _get(f, "batch_speedup")

    track_batch_speedup.unit = "ratio"
    track_batch_speedup.version = "1"
    track_batch_speedup.direction = "higher"


class Server:
    timeout = 7200

    def setup_cache(self):
        if not common.long_benchmarks():
            return common.skipped_long()
        from gemmdrift.prompts import builtin_prompts, builtin_text
        from gemmdrift.measure.server import measure_server

        r = measure_server("embedded", builtin_text("essay"), SERVER_N,
                           companions=builtin_prompts()[:SERVER_COMPANIONS])
        return dict(r.figures)

    setup_cache.timeout = 7200

    def setup(self, f, *params):
        common.skip_unless_long(f, "Server")

    def track_server_divergences(self, f):
        """Stream pairs (draft, concurrent, conversation) that diverged through mlx_lm.server."""
        return _get(f, "server_divergences")

    track_server_divergences.unit = "pairs"
    track_server_divergences.version = "1"
    track_server_divergences.direction = "lower"

    def track_server_draft_first_divergence(self, f):
        """First divergent token, no draft vs --draft-model (NaN: no divergence)."""
        return _get(f, "server_draft_first_divergence")

    track_server_draft_first_divergence.unit = "tokens"
    track_server_draft_first_divergence.version = "1"
    track_server_draft_first_divergence.direction = "higher"

    def track_server_tokens_per_s(self, f):
        """Greedy tokens/s through the server (request wall time, prompt included)."""
        return _get(f, "server_tokens_per_s")

    track_server_tokens_per_s.unit = "tokens/s"
    track_server_tokens_per_s.version = "1"
    track_server_tokens_per_s.direction = "higher"

    def track_inprocess_tokens_per_s(self, f):
        """The same prompt with mlx-lm generate in process."""
        return _get(f, "inprocess_tokens_per_s")

    track_inprocess_tokens_per_s.unit = "tokens/s"
    track_inprocess_tokens_per_s.version = "1"
    track_inprocess_tokens_per_s.direction = "higher"
