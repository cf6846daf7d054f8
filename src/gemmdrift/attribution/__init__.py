"""Which op: the op and layer each drift comes from (op taps, counterfactuals), the ops a release changed, and the
one-second gate of primitives."""
