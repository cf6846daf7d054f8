"""matplotlib for every figure of the house: pyplot on the Agg backend outside a notebook, and a tight layout
without matplotlib's warning."""

from __future__ import annotations


def tight(fig, **kw) -> None:
    """``fig.tight_layout``, without matplotlib's "Tight layout not applied" warning on stderr when a grid of
    many cases cannot be tightened (the figure is saved with bbox_inches="tight" anyway; issue 33 D17)."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Tight layout not applied")
        fig.tight_layout(**kw)


def pyplot():
    import sys

    import matplotlib

    if "ipykernel" not in sys.modules:  # a notebook keeps its inline backend, so figures show
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
