"""gemmdrift: floating-point drift in MLX, measured on real Gemma weights."""

__version__ = "0.1.0"
