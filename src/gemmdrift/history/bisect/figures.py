"""What is measured: the tracking tier's figures (benchmarks/bench_tier.py), each read from one tier part.

The names are asv's: ``TierState.track_state_bugs``, a parameterised one with its parameters in brackets
(``TierStateCases.track_non_exact[KVCache/rollback]``, ``TierDecodeLayers.track_rel_l2[layer 5]``); the
``bench_tier.`` prefix may be given or not. Which part and which key of its figures a benchmark reads is found by
calling every ``track_`` method once with a recorder in place of the part figures (each one is a lookup by name),
so the mapping cannot drift from the benchmarks. ``any`` is every answer figure
(:func:`gemmdrift.changelog.classify.is_answer_figure`: flips, the divergence point and verdicts, the state verdicts).
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import math
import sys
from functools import lru_cache
from pathlib import Path

from ...errors import GemmdriftError

ROOT = Path(__file__).resolve().parents[4]  # the checkout: src/gemmdrift/history/bisect -> the repository root
ANY = "any"


class _Part(dict):
    def __init__(self, seen: list, part: str):
        super().__init__()
        self.seen, self.part = seen, part

    def get(self, key, default=None):
        self.seen.append((self.part, key))
        return math.nan


class _Parts(dict):
    def __init__(self):
        super().__init__()
        self.seen: list = []

    def get(self, part, default=None):
        return _Part(self.seen, part)


def tier_module(root: Path = ROOT):
    """benchmarks/bench_tier.py of the checkout ``root``, imported."""
    if not (root / "benchmarks" / "bench_tier.py").is_file():
        raise GemmdriftError(f"bisect needs a gemmdrift checkout (no benchmarks/bench_tier.py under {root})")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module("benchmarks.bench_tier")


def tier_benchmarks(root: Path = ROOT):
    """``(asv name without the module, bound track_ method, its parameter lists)`` for every tier benchmark."""
    mod = tier_module(root)
    for cname, cls in inspect.getmembers(mod, inspect.isclass):
        if not cname.startswith("Tier") or cls.__module__ != mod.__name__:
            continue
        params = getattr(cls, "params", None) or []
        if params and not isinstance(params[0], (list, tuple)):
            params = [params]
        for mname in sorted(m for m in dir(cls) if m.startswith("track_")):
            yield f"{cname}.{mname}", getattr(cls(), mname), [list(p) for p in params]


@lru_cache(maxsize=None)
def tier_figures(root: Path = ROOT) -> dict[str, tuple[str, str]]:
    """``{figure name: (tier part, key of the part's figures)}`` for every tracking-tier benchmark."""
    out: dict[str, tuple[str, str]] = {}
    for name, method, params in tier_benchmarks(root):
        for combo in itertools.product(*params):
            rec = _Parts()
            method(rec, *combo)
            if len(rec.seen) == 1:
                out[name + (f"[{', '.join(str(c) for c in combo)}]" if combo else "")] = rec.seen[0]
    return out


def wanted(figure: str, root: Path = ROOT) -> dict[str, tuple[str, str]]:
    """The figures ``figure`` names (one, or every answer figure for ``any``); a one-line error listing the
    tracked figures when the tier does not track it."""
    from ...changelog.classify import is_answer_figure

    known = tier_figures(root)
    if figure == ANY:
        return {k: v for k, v in known.items() if is_answer_figure(k)}
    name = figure.removeprefix("bench_tier.")
    if name not in known:
        plain = sorted({k.partition("[")[0] for k in known})
        raise GemmdriftError(f"--figure {figure}: the tracking tier does not track it (it tracks: {', '.join(plain)}; "
                             f"parameterised ones take [params], e.g. TierStateCases.track_non_exact[KVCache/rollback]; "
                             f"or '{ANY}' for every answer figure)")
    return {name: known[name]}


def parts_of(figs: dict[str, tuple[str, str]]) -> list[str]:
    """The tier parts those figures need, in the tier's order (any other part after: the tests' planted ones)."""
    from ..tier import PARTS

    need = {p for p, _ in figs.values()}
    return [p for p in PARTS if p in need] + sorted(need - set(PARTS))


def read(figs: dict[str, tuple[str, str]], parts: dict[str, dict[str, float]]) -> dict[str, float]:
    """The figures' values from the parts' figures (NaN where not measured)."""
    out = {}
    for name, (p, key) in figs.items():
        v = (parts.get(p) or {}).get(key)
        out[name] = math.nan if v is None else float(v)  # null in JSON: not measured
    return out
