"""Recovering a reduction tree from a reducer, and the tree helpers (text form, fingerprint, tree_id, chain, pairwise)."""

from __future__ import annotations

import hashlib
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from .probes import MINUS, PLUS, Reducer, UNIT


class _Task:
    """A set of leaves forming one or more child subtrees of a node of ``parent`` leaves (None: the root)."""

    __slots__ = ("leaves", "parent", "items")

    def __init__(self, leaves: list[int], parent: int | None):
        self.leaves, self.parent, self.items = leaves, parent, None


class _Node:
    __slots__ = ("children",)

    def __init__(self, children: list):
        self.children = children


class _Failed(Exception):
    pass


@dataclass
class Recovery:
    """The recovered tree of one row position, or why there is none."""

    tree: Any  # canonical nested tuples (leaf = int), None if not recovered
    problem: str = ""

    @property
    def ok(self) -> bool:
        return self.tree is not None


def recover(reducer: Reducer, *, progress: Callable[[str], None] | None = None) -> tuple[list[Recovery], dict]:
    """Recover the summation tree of every row position of ``reducer``.

    Returns one :class:`Recovery` per row and stats (probes, calls, rounds).
    """
    n, rows = reducer.n, reducer.rows
    windows = reducer.encoding.windows
    cache: dict[tuple[int, int], np.ndarray] = {}
    roots = [_Task(list(range(n)), None) for _ in range(rows)]
    pending: list[list[_Task]] = [[t] for t in roots]
    failed: list[str] = [""] * rows
    probes = 0
    rounds = 0

    def measure(pairs: list[tuple[int, int]]) -> None:
        nonlocal probes
        index = []
        for p, j in pairs:
            for win in windows:
                win = win[(win != p) & (win != j)]
                if len(win) == 0 and len(windows) > 1:
                    continue
                index.append((p, j, win))
        if not index:
            return
        step = min(reducer.batch, 4096)
        counts = []
        for lo in range(0, len(index), step):  # codes are built one batch at a time (K x probes can be large)
            chunk = index[lo:lo + step]
            codes = np.zeros((len(chunk), n), dtype=np.int8)
            for row, (p, j, win) in enumerate(chunk):
                codes[row, win] = UNIT
                codes[row, p], codes[row, j] = PLUS, MINUS
            counts.append(reducer.counts(codes))
        counts = np.concatenate(counts)
        probes += len(index)
        sizes: dict[tuple[int, int], np.ndarray] = {}
        for (p, j, win), c in zip(index, counts):
            units = len(win)
            bad = (c != np.round(c)) | (c < 0) | (c > units) | ~np.isfinite(c)
            inside = np.where(bad, np.nan, units - c)
            sizes[(p, j)] = sizes.get((p, j), 2.0) + inside
        cache.update(sizes)

    while any(pending):
        rounds += 1
        need = sorted({(t.leaves[0], j) for r in range(rows) if not failed[r] for t in pending[r]
                       for j in t.leaves[1:] if (t.leaves[0], j) not in cache})
        if progress:
            progress(f"{reducer.name}: round {rounds}, {len(need)} pairs")
        measure(need)
        for r in range(rows):
            if failed[r]:
                pending[r] = []
                continue
            nxt: list[_Task] = []
            try:
                for t in pending[r]:
                    nxt += _expand(t, cache, r)
            except _Failed as e:
                failed[r], nxt = str(e), []
            pending[r] = nxt
    out = []
    for r in range(rows):
        if failed[r]:
            out.append(Recovery(None, failed[r]))
            continue
        tree = _canonical(deep_recursion(_resolve)(roots[r]))
        if tree_leaves(tree) != list(range(n)):
            out.append(Recovery(None, "the recovered tree does not cover every term exactly once"))
        else:
            out.append(Recovery(tree))
    return out, {"probes": probes, "calls": reducer.calls, "rounds": rounds, "windows": len(windows)}


def _expand(task: _Task, cache: dict, r: int) -> list[_Task]:
    p, others = task.leaves[0], task.leaves[1:]
    if not others:
        task.items = [p]
        return []
    L = {}
    for j in others:
        v = cache[(p, j)][r]
        if not np.isfinite(v):
            raise _Failed(f"probe ({p}, {j}): the output is not an integer count in range (inexact construction: "
                          "narrow accumulator, flushed subnormals, or no absorption)")
        L[j] = int(v)
    parent = task.parent
    if parent is None:
        inside, rest = others, []
    else:
        inside = [j for j in others if L[j] < parent]
        rest = [j for j in others if L[j] >= parent]
        if any(L[j] != parent for j in rest):
            raise _Failed(f"inconsistent L values under a node of {parent} terms (pivot {p})")
    size = 1 + len(inside)
    if inside and max(L[j] for j in inside) != size:
        raise _Failed(f"inconsistent L values: pivot {p} meets {len(inside)} terms but the largest L is "
                      f"{max(L[j] for j in inside)}")
    new: list[_Task] = []
    cur: Any = p
    total = 1
    groups: dict[int, list[int]] = {}
    for j in inside:
        groups.setdefault(L[j], []).append(j)
    for level in sorted(groups):
        group = groups[level]
        total += len(group)
        if total != level:
            raise _Failed(f"inconsistent L values: pivot {p}, node of {level} terms holds {total}")
        if len(group) == 1:
            kids = [group[0]]
        else:
            sub = _Task(group, level)
            new.append(sub)
            kids = [sub]
        cur = _Node([cur] + kids)
    task.items = [cur]
    if rest:
        more = _Task(rest, parent)
        new.append(more)
        task.items.append(more)
    return new


def deep_recursion(fn):
    def wrapper(*a, **k):
        old = sys.getrecursionlimit()
        sys.setrecursionlimit(max(old, 200000))
        try:
            return fn(*a, **k)
        finally:
            sys.setrecursionlimit(old)
    return wrapper


def _resolve(x) -> Any:
    """_Task / _Node placeholders -> nested lists (leaf = int)."""
    if isinstance(x, int):
        return x
    if isinstance(x, _Task):
        items = []
        for it in x.items:
            items += _resolve(it) if isinstance(it, _Task) else [_resolve(it)]
        return items if x.parent is not None else items[0]
    kids = []
    for c in x.children:
        if isinstance(c, _Task):
            kids += _resolve(c)
        else:
            kids.append(_resolve(c))
    return kids


@deep_recursion
def _canonical(t) -> Any:
    """Children sorted by their smallest leaf (the order inside a node is not observable)."""
    return _canon(t)[0]


def _canon(t) -> tuple[Any, int]:
    if isinstance(t, int):
        return t, t
    if isinstance(t, _Task):
        t = _resolve(t)
    kids = sorted((_canon(c) for c in t), key=lambda km: km[1])
    if len(kids) == 1:
        return kids[0]
    return tuple(k for k, _ in kids), kids[0][1]


@deep_recursion
def _min_leaf(t) -> int:
    return _canon(t)[1]


@deep_recursion
def tree_leaves(t) -> list[int]:
    out: list[int] = []

    def walk(x):
        if isinstance(x, int):
            out.append(x)
        else:
            for c in x:
                walk(c)
    walk(t)
    return sorted(out)


@deep_recursion
def to_text(t) -> str:
    """The canonical text of a tree: ``(0 1 (2 3))``."""
    def text(x) -> str:
        return str(x) if isinstance(x, int) else "(" + " ".join(text(c) for c in x) + ")"
    return text(t)


@deep_recursion
def from_text(text: str) -> Any:
    """Inverse of :func:`to_text`."""
    tokens = re.findall(r"\(|\)|\d+", text)
    pos = 0

    def parse():
        nonlocal pos
        tok = tokens[pos]
        pos += 1
        if tok != "(":
            return int(tok)
        kids = []
        while tokens[pos] != ")":
            kids.append(parse())
        pos += 1
        return tuple(kids)
    return parse()


def fingerprint(t) -> str:
    """sha256 of the canonical text; the first 12 hex digits name the tree."""
    return hashlib.sha256(to_text(t).encode()).hexdigest()[:12]


def tree_id(fp: str) -> float:
    """A fingerprint as a float asv can track: its 48 bits as an integer (exact in float64, < 2**53)."""
    return float(int(fp[:12], 16))


def chain(leaves: Sequence) -> Any:
    """Sequential sum of ``leaves`` (ints or subtrees) in the given order."""
    t = leaves[0]
    for x in leaves[1:]:
        t = (t, x)
    return t


def pairwise(items: Sequence) -> Any:
    """Balanced binary tree, halves split at len // 2."""
    if len(items) == 1:
        return items[0]
    h = len(items) // 2
    return (pairwise(items[:h]), pairwise(items[h:]))


def canonical(t) -> Any:
    return _canonical(t)


@deep_recursion
def depth(t) -> int:
    def d(x) -> int:
        return 0 if isinstance(x, int) else 1 + max(d(c) for c in x)
    return d(t)
