"""The whole-model measurements: the layer stack, divergence and triage, batch, the real server, golden logits and
their two-run statistics, and the tracked history across mlx releases."""
