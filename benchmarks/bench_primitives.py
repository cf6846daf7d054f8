"""The one-second gate (gemmdrift.attribution.primitives.gate, issue 29 item 6): every op of a decoder layer at the embedded
Gemma's shapes (``shape:gemma3-270m``: K=640, the same shapes without its GGUF), T = 1..8, on the default device.

``time_gate`` is what an engine pays at load; the tracked figures are its verdict: the widest speculative width
exact here (drafted tokens; 7 = every op bit-equal up to T=8) and the number of (op, T) rows whose block differs
(0 on a row-invariant backend, a count, never NaN). See docs/attribution.md, "The one-second gate".
"""

from . import common

PRIMITIVES_MODEL = "shape:gemma3-270m"
PRIMITIVES_TS = tuple(range(1, 9))


class PrimitivesGate:
    """One gate per setup; the timed body is one more gate, the tracked figures come from setup's."""

    timeout = 600
    rounds = 1
    repeat = (2, 5, 10.0)
    warmup_time = 0.0

    def setup(self):
        common.skip_unless_full(None, "PrimitivesGate")
        from gemmdrift.attribution import primitives

        self._gate = primitives.gate
        self.result = primitives.gate(PRIMITIVES_MODEL, PRIMITIVES_TS, fail_closed=False)

    def time_gate(self):
        self._gate(PRIMITIVES_MODEL, PRIMITIVES_TS, fail_closed=False)

    # The hash asv gave this series from its source before the modules moved into wing folders (their
    # import lines changed, the measurement did not): pinned, so its history continues.
    time_gate.version = "d54485edd6b739986566dc51763126ea72eef569088c2cc0c26da79210bc521d"

    def track_primitives_exact_width(self):
        """The most drafted tokens k with every op bit-equal at T = 1..k+1 (-1: not even T=1)."""
        k = self.result.exact_width
        return float(-1 if k is None else k)

    track_primitives_exact_width.unit = "tokens"
    track_primitives_exact_width.version = "1"
    track_primitives_exact_width.direction = "higher"

    def track_primitives_rows_unequal(self):
        """(op, T) rows whose T-row call is not bit-equal to T single-row calls."""
        return float((~self.result.table["equal"].astype(bool)).sum())

    track_primitives_rows_unequal.unit = "rows"
    track_primitives_rows_unequal.version = "1"
    track_primitives_rows_unequal.direction = "lower"
