"""Which way is better, for every tracked figure: one judgement that the gate, the changelog and upgrade share.

Each tracked figure has a *direction*, declared once beside the figure: an asv benchmark carries it as an
attribute beside its ``unit`` and ``version`` (``track_flips.direction = "lower"``; recorded with them in
benchmarks/manifest.json, which tests/test_benchmarks.py keeps equal to the code), an upgrade figure in
:data:`gemmdrift.upgrade.judge.DIRECTIONS` beside the figures it names.

* ``higher``: higher is better (a divergence point, top-1 agreement, draft acceptance, tokens per second);
* ``lower``: lower is better (drift, flips, bugs, cost);
* ``either``: a change either way is news, not judged by size (a summation tree's id, a count of cases, a code);
* ``label``: not a figure but a label of the run (the mlx version, the backend): never compared.

:func:`judge` says what a change of one figure is: ``worse`` (the wrong way by more than the tolerance: the gate
fails), ``better`` (the right way), ``within`` (the wrong way, within the tolerance), ``news`` (an ``either``
figure that changed, or a figure whose direction is not declared: reported, never a failure), ``same``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Mapping

from .errors import GemmdriftError

HIGHER, LOWER, EITHER, LABEL = "higher", "lower", "either", "label"
DIRECTIONS = (HIGHER, LOWER, EITHER, LABEL)
WORSE, BETTER, WITHIN, NEWS, SAME = "worse", "better", "within", "news", "same"
UNDECLARED = "undeclared"  # a figure whose direction nobody declared (e.g. a benchmark this checkout lacks)
ABS_TOL = 1e-12  # a move by less than this is not worse (growth from exactly 0 included)


def judge(direction: str | None, old: float, new: float, threshold: float, abs_tol: float = ABS_TOL) -> str:
    """What the change old -> new of a figure with this direction is (see the module docstring).
    ``threshold``: the relative move the wrong way that is still tolerated (0.10 = 10%); from exactly 0, any
    growth of a lower-is-better figure beyond ``abs_tol`` is worse."""
    if old == new or (isinstance(old, float) and isinstance(new, float) and math.isnan(old) and math.isnan(new)):
        return SAME
    if direction == LOWER:
        if new < old:
            return BETTER
        return WORSE if (new > old * (1 + threshold) and new - old > abs_tol) else WITHIN
    if direction == HIGHER:
        if new > old:
            return BETTER
        return WORSE if (new < old * (1 - threshold) and old - new > abs_tol) else WITHIN
    if direction == LABEL:
        return SAME
    return NEWS  # EITHER, or no direction declared: reported, never judged by size


def check(directions: Mapping[str, str], where: str) -> dict[str, str]:
    """Every value one of DIRECTIONS, else one clear error naming the figure."""
    for name, d in directions.items():
        if d not in DIRECTIONS:
            raise GemmdriftError(f"{where}: {name} has direction {d!r}, not one of {', '.join(DIRECTIONS)}")
    return dict(directions)


def read_manifest(path: str | Path) -> dict[str, str]:
    """``{asv benchmark name: direction}`` from benchmarks/manifest.json (each benchmark's ``direction``, as its
    track_ function declares it); {} when the file is not there (an installed package without its checkout:
    every figure is then undeclared, news)."""
    p = Path(path)
    if not p.is_file():
        return {}
    try:
        doc = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise GemmdriftError(f"cannot read {p}: {e}") from None
    return check({k: v["direction"] for k, v in doc.items() if isinstance(v, dict) and v.get("direction")}, str(p))


__all__ = ["HIGHER", "LOWER", "EITHER", "LABEL", "DIRECTIONS", "WORSE", "BETTER", "WITHIN", "NEWS", "SAME",
           "UNDECLARED", "judge", "check", "read_manifest"]
