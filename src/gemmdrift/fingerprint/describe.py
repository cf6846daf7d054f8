"""Describing a recovered tree in words (describe and its helpers)."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from .recovery import deep_recursion, tree_leaves


def _chain_order(t) -> list[int] | None:
    """The leaves of ``t`` in the order a sequential sum adds them, or None if ``t`` is not one."""
    order: list[int] = []
    while not isinstance(t, int):
        if len(t) != 2:
            return None
        a, b = t
        if isinstance(a, int) and isinstance(b, int):
            lo, hi = min(a, b), max(a, b)
            # the first two terms are unordered: follow the direction of the rest
            order += [hi, lo] if order and order[-1] > hi else [lo, hi]
            break
        if isinstance(b, int):
            order.append(b)
            t = a
        elif isinstance(a, int):
            order.append(a)
            t = b
        else:
            return None
    else:
        order.append(t)
    order.reverse()
    return order


def _progression(order: list[int]) -> int | None:
    """The common step of ``order`` (an arithmetic progression), else None."""
    if len(order) < 2:
        return 1
    d = order[1] - order[0]
    return d if all(b - a == d for a, b in zip(order, order[1:])) else None


def _shape(t, is_token) -> str:
    """How a tree over tokens combines them: sequential, pairwise, or a tree of depth d."""
    token = is_token
    is_token = lambda x: isinstance(x, int) or token(x)  # noqa: E731
    def toks(x):
        return [x] if is_token(x) else [y for c in x for y in toks(c)]

    def d(x):
        return 0 if is_token(x) else 1 + max(d(c) for c in x)

    def seq(x):
        while not is_token(x):
            if len(x) != 2:
                return False
            a, b = x
            if is_token(b):
                x = a
            elif is_token(a):
                x = b
            else:
                return False
        return True

    m = len(toks(t))
    if m == 1:
        return "single"
    fan = max_fan(t, is_token)
    if fan > 2:
        return f"a {fan}-operand node" if d(t) == 1 else f"a tree of depth {d(t)} with nodes of up to {fan} operands"
    if seq(t):
        return "sequential"
    if d(t) == math.ceil(math.log2(m)):
        return "pairwise"
    return f"a tree of depth {d(t)}"


def max_fan(t, is_token) -> int:
    if isinstance(t, int) or is_token(t):
        return 0
    return max([len(t)] + [max_fan(c, is_token) for c in t])


@deep_recursion
def describe(t) -> str:
    """A readable description of a canonical tree, derived from its structure.

    Recognises sequential chains (and their stride), runs of terms added one
    by one at the end, blocks of contiguous terms, interleaved accumulators
    (k chains of stride k), pairwise combination and multi-operand nodes.
    """
    n = len(tree_leaves(t))
    order = _chain_order(t)
    if order is not None:
        step = _progression(order)
        if step == 1:
            return f"sequential, left to right ({n} terms, one accumulator)"
        if step == -1:
            return f"sequential, right to left ({n} terms)"
        return f"sequential in the order {order[:4]}... ({n} terms)"
    # Peel terms added one by one at the end (a remainder loop).
    tail: list[int] = []
    core = t
    while not isinstance(core, int) and len(core) == 2 and (isinstance(core[0], int) or isinstance(core[1], int)):
        leaf, rest = (core[1], core[0]) if isinstance(core[1], int) else (core[0], core[1])
        tail.append(leaf)
        core = rest
    text = _describe_core(core)
    if tail:
        text += f"; then {len(tail)} term{'s' if len(tail) > 1 else ''} added one by one"
    return text


def _maximal_chains(t) -> list[Any]:
    """Top-down: the largest subtrees that are sequential chains (leaves are chains of one)."""
    if _chain_order(t) is not None:
        return [t]
    return [c for x in t for c in _maximal_chains(x)]


def _describe_core(core) -> str:
    chains = _maximal_chains(core)
    ids = {id(c) for c in chains}
    is_chain = lambda x: id(x) in ids  # noqa: E731
    kinds = Counter()
    for c in chains:
        order = _chain_order(c)
        kinds[(len(order), _progression(order))] += 1
    if all(l == 1 for l, _ in kinds):
        return f"{_shape(core, is_chain)} over all {len(chains)} terms"
    # Blocks: the smallest subtrees over a contiguous range that contain an interleaved chain.
    strided = [c for c in chains if (_progression(_chain_order(c)) or 1) > 1]
    if strided:
        blocks = _contiguous_blocks(core, {id(c) for c in strided})
        bids = {id(b) for b in blocks}
        is_block = lambda x: id(x) in bids  # noqa: E731
        sizes = Counter(len(tree_leaves(b)) for b in blocks)
        inner = Counter()
        for b in blocks:
            cs = _maximal_chains(b)
            cids = {id(c) for c in cs}
            lens = Counter((len(_chain_order(c)), _progression(_chain_order(c))) for c in cs)
            inner[(len(cs), tuple(sorted(lens.items())), _shape(b, lambda x: id(x) in cids))] += 1
        (count, lens, how), _ = inner.most_common(1)[0]
        (ln, step), _ = max(lens, key=lambda kv: kv[1])
        lane = f"{count} interleaved accumulators (stride {step}, {ln} terms each) combined {how}"
        size = sizes.most_common(1)[0][0]
        if len(blocks) == 1:
            return lane
        top = _shape(core, is_block)
        return (f"{len(blocks)} blocks of {size} combined {top}" + ("" if len(sizes) == 1 else
                f" (sizes {dict(sorted(sizes.items()))})") + f"; in each block {lane}")
    groups = _lane_groups(core, chains)
    if groups is not None:  # Metal's gemv with K >= 16N: 8 simdgroups, each a shuffle-down, added in order
        return groups
    lanes = _strided_lanes(chains)
    if lanes is not None:  # each lane a chain over runs of w at stride S (Metal's gemv: k = 128i + 4l + j)
        w, stride = lanes
        top = _shape(core, is_chain)
        ladder = _shuffle_down(core, chains) if top == "pairwise" else None
        how = f"{top} (shuffle-down {', '.join(map(str, ladder))})" if ladder else top
        return f"{len(chains)} lanes, each sequential over runs of {w} at stride {stride}, lanes combined {how}"
    lens = Counter(l for l, _ in kinds)
    size = lens.most_common(1)[0][0]
    top = _shape(core, is_chain)
    irregular = "" if len(lens) == 1 else f" (lengths {dict(sorted(lens.items()))})"
    return f"sequential in {len(chains)} blocks of {size}{irregular}, blocks combined {top}"


def _runs(order: list[int]) -> tuple[int, int] | None:
    """(w, S) when ``order`` is runs of ``w`` consecutive terms (w >= 2), each run ``S > w`` after the last
    (two runs at least), else None: one lane of an interleaved, strided sum."""
    w = 1
    while w < len(order) and order[w] == order[w - 1] + 1:
        w += 1
    if w < 2 or w == len(order) or len(order) % w:
        return None
    runs = [order[i:i + w] for i in range(0, len(order), w)]
    if any(r != list(range(r[0], r[0] + w)) for r in runs):
        return None
    stride = _progression([r[0] for r in runs])
    return (w, stride) if stride is not None and stride > w else None


def _strided_lanes(chains: list[Any]) -> tuple[int, int] | None:
    """The common (w, S) of :func:`_runs` when every chain is such a lane (two lanes at least), else None."""
    if len(chains) < 2 or any(isinstance(c, int) for c in chains):
        return None
    kinds = {_runs(_chain_order(c)) for c in chains}
    return kinds.pop() if len(kinds) == 1 and None not in kinds else None


def _shuffle_down(core, chains: list[Any]) -> list[int] | None:
    """The offsets of a shuffle-down ladder, first to last (16, 8, 4, 2, 1 for 32 lanes), when the pairwise
    tree over the lanes is one: lane l adds lane l + off, off halving, and lane 0 holds the sum. Lanes are
    numbered by their first term; at depth d below the root the two sides are lanes X and X + 2^d."""
    lane = {id(c): i for i, c in enumerate(sorted(chains, key=lambda c: min(tree_leaves(c))))}
    n = len(chains)
    if n & (n - 1):
        return None

    def lanes(x, d) -> list[int] | None:
        if id(x) in lane:
            return [lane[id(x)]]
        if len(x) != 2:
            return None
        a, b = (lanes(c, d + 1) for c in x)
        if a is None or b is None:
            return None
        lo, hi = sorted((sorted(a), sorted(b)))
        return lo + hi if hi == [v + 2 ** d for v in lo] else None
    if lanes(core, 0) is None:
        return None
    return [n >> k for k in range(1, n.bit_length())]


def _lane_groups(core, chains: list[Any]) -> str | None:
    """The description when ``core`` adds two or more groups one after another (in the order of their terms),
    each group a shuffle-down ladder over the same number of lanes, every lane contiguous or strided alike."""
    ids = {id(c) for c in chains}

    def under(x) -> list[Any]:
        return [x] if id(x) in ids else [c for y in x for c in under(y)]

    def is_group(x) -> bool:
        return id(x) not in ids and not isinstance(x, int) and len(under(x)) >= 2 and \
            _shuffle_down(x, under(x)) is not None

    found, t = [], core
    while not is_group(t):
        if isinstance(t, int) or id(t) in ids or len(t) != 2:
            return None
        a, b = t
        if is_group(b):
            found.append(b)
            t = a
        elif is_group(a):
            found.append(a)
            t = b
        else:
            return None
    found.append(t)
    found.reverse()  # the first group added first
    sizes = {len(under(g)) for g in found}
    starts = [min(tree_leaves(g)) for g in found]
    if len(found) < 2 or len(sizes) != 1 or starts != sorted(starts):
        return None
    orders = [_chain_order(c) for c in chains]
    w = {len(o) for o in orders}
    if all(_progression(o) == 1 for o in orders) and len(w) == 1:
        lane = f"{w.pop()} contiguous terms"
    else:
        runs = _strided_lanes(chains)
        if runs is None:
            return None
        lane = f"runs of {runs[0]} at stride {runs[1]}"
    n = sizes.pop()
    ladder = ", ".join(str(n >> k) for k in range(1, n.bit_length()))
    return (f"{len(found)} groups of {n} lanes added one after another; in each group, lanes of {lane} "
            f"combined pairwise (shuffle-down {ladder})")


def _contiguous_blocks(t, marked: set[int]) -> list[Any]:
    """Split ``t`` down through contiguous children: the blocks are the first subtrees whose children are
    not all contiguous ranges (interleaved accumulators inside), or the marked chains themselves."""
    def has_mark(x) -> bool:
        return id(x) in marked or (not isinstance(x, int) and any(has_mark(c) for c in x))

    def split(x) -> list[Any]:
        if isinstance(x, int) or id(x) in marked:
            return [x]
        # a node with a bare term among its children is a block with a remainder: keep it whole
        if _contiguous(x) and all(_contiguous(c) and not isinstance(c, int) for c in x):
            return [b for c in x for b in split(c)]
        return [x]
    return [b for b in split(t) if not isinstance(b, int) and has_mark(b)]


def _contiguous(x) -> bool:
    lv = tree_leaves(x)
    return lv[-1] - lv[0] + 1 == len(lv)
