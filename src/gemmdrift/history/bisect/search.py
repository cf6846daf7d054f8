"""The search: the first commit of an ordered range whose value differs from the range's first commit's.

Pure logic, no git and no measuring: ``measure(i)`` is called with an index into the range and returns the
commit's value (any comparable object: a dict of figures) or :data:`SKIP` when the commit cannot be measured (it
does not install or build). A skipped commit is never decided: the search measures another commit between the
two it has bracketed, as ``git bisect skip`` does, and when only skipped commits are left the answer names them
all (the first change is one of them or the commit after).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable


class _Skip:
    def __repr__(self) -> str:
        return "SKIP"


SKIP = _Skip()  # a commit that does not install or build: skipped and marked, the search goes on


def same(a: Any, b: Any) -> bool:
    """Bit for bit: floats equal (NaN equals NaN: not measured on both sides), dicts key by key."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


@dataclass
class Outcome:
    """What the search found. ``changed`` False: the two ends agree ("no change in this range"). Else ``first``
    is the index of the first commit that differs and ``before`` the last that agrees, with their values;
    ``skipped`` the indices between them that could not be measured (then the change is at one of those or at
    ``first``); ``measured`` every index measured, in order."""

    changed: bool
    first: int | None = None
    before: int | None = None
    values: dict[int, Any] = field(default_factory=dict)
    skipped: list[int] = field(default_factory=list)
    measured: list[int] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return self.changed and not self.skipped


class EndSkipped(Exception):
    """An end of the range cannot be measured (then nothing can be said about the range)."""

    def __init__(self, index: int):
        super().__init__(index)
        self.index = index


def first_change(n: int, measure: Callable[[int], Any], equal: Callable[[Any, Any], bool] = same) -> Outcome:
    """Bisect ``n`` ordered commits (index 0 the good end, n-1 the bad end; see the module docstring)."""
    if n < 2:
        raise ValueError("a range needs at least two commits")
    values: dict[int, Any] = {}
    order: list[int] = []

    def val(i: int) -> Any:
        if i not in values:
            values[i] = measure(i)
            order.append(i)
        return values[i]

    for end in (0, n - 1):
        if val(end) is SKIP:
            raise EndSkipped(end)
    a = values[0]
    if equal(a, values[n - 1]):
        return Outcome(False, values=values, measured=order)
    lo, hi = 0, n - 1  # values[lo] agrees with a, values[hi] differs
    while hi - lo > 1:
        left = [i for i in range(lo + 1, hi) if values.get(i) is not SKIP]
        if not left:
            break
        mid = (lo + hi) // 2
        i = min(left, key=lambda j: (abs(j - mid), j))
        v = val(i)
        if v is SKIP:
            continue
        if equal(v, a):
            lo = i
        else:
            hi = i
    skipped = [i for i in range(lo + 1, hi) if values.get(i) is SKIP]
    return Outcome(True, first=hi, before=lo, values=values, skipped=skipped, measured=order)

