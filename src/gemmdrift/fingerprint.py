"""Accumulation-order fingerprints: the summation tree of one output element, recovered black-box.

Method (FPRev, Xie et al., USENIX ATC '25). For a reduction of ``n`` terms, a
*probe* ``(i, j)`` sets term ``i`` to ``+M``, term ``j`` to ``-M`` and the
others to a unit ``u``, with ``M`` so big that ``M + (any partial sum of
units) == M`` in the accumulator. Inside the smallest subtree holding both
``i`` and ``j`` every unit is absorbed by ``+M`` or ``-M`` before they cancel
to an exact 0; every unit outside it is summed exactly. So the output is
``u * (n - L(i, j))`` with ``L(i, j)`` the number of leaves under
``LCA(i, j)``, and the tree follows from the ``L`` values.

Recovery (FPRev's efficient variant): fix the smallest leaf ``p`` of a set
known to be one subtree; probe ``(p, j)`` for every other ``j``; the distinct
``L`` values are the sizes of the nodes on ``p``'s path to the top, the
``j`` with equal ``L`` hang off the same node, and each such group is a forest
that is recovered the same way. That is O(n * depth) probes (n - 1 for a
sequential sum, about n log n for a pairwise one). Probes are evaluated
breadth first, all pending groups of all row positions at once, so the number
of rounds is the nesting depth of the tree, not the number of groups.

Exactness. Every value is exact in the input dtype, every count is exact in
the output dtype, and ``M`` absorbs a whole window of units in a float32
accumulator (``M / u >= 2**25 * window``). A count above what the output dtype
holds exactly (256 in bfloat16; in float16 the unit is 2**-20, a subnormal,
and counts stay below 1024) is never read: units then cover only one
*window* of positions per probe (zeros elsewhere; a zero changes no sum), and
``L = 2 + sum over windows of (units in the window - count)``; a pair costs
``ceil((n - 2) / window)`` probes. A count that is not an integer in range,
``L`` values that do not nest, or a tree that does not cover every leaf stop
the recovery of that row with the reason ("not recovered"); nothing is
guessed. An all-unit sum (the *accumulator check*) says whether the
accumulator holds the counts the output dtype could show: the CPU quantized
matmul with bfloat16 activations sums 510 ones to 256 (``T sum = 0`` in
``_qmm_t``, ``mlx/backend/cpu/quantized.cpp``).

Limits (documented, not hidden):

* A fused multiply-add or a k-operand addition shows as one node with k
  children; the order inside a node is not observable (``a + b`` and
  ``b + a`` round alike). Two trees that differ only by that are the same
  fingerprint.
* The accumulator's width is not in the tree: "float32 partials" is an
  assumption of the construction, checked only as far as the accumulator
  check and the consistency checks go (an accumulator wider than float32
  would fail to absorb and be reported as not recovered).
* An exact multi-operand sum (a node that adds M, 1 and -M without rounding
  in between) does not absorb its units: the L values then do not nest and
  the row is reported not recovered.
* Orders that depend on the data (none of mlx's kernels, as read) would be
  mis-recovered.
* The T-row block is T identical rows (all ones for the matmuls, the probe
  for quantized matmul and ``mx.sum``), so one call measures every position.
* Quantized matmul: an affine group cannot hold both a unit and a value big
  enough to absorb it exactly (``M = bias + scale * q`` and ``1 = bias +
  scale * q'`` need a scale with as many significant bits as ``M / u``), so
  the probes go into the activations and the quantized weights dequantize to
  exactly 1 (checked with ``mx.dequantize``); one probe per call.
* ``rms_norm`` (a sum of squares) and ``softmax`` (a sum of exponentials) sum
  only non-negative terms: nothing can cancel, so the tree is not recoverable
  by this method, and the result says so. ``sdpa`` is recoverable through its
  P @ V sum: with q = 0 every key weighs exactly 1/K (K a power of two) and the
  probes ride in the value columns.

What the source says the Linux CPU backend does (ml-explore/mlx at 846d176):
``mlx/backend/cpu/gemms/simd_gemm.h`` (fp16/bf16) walks K in blocks of 16
but adds ``simd::sum`` of ``simd_size`` products into one float32 accumulator,
and ``simd::max_size`` is 1 on x86 (``mlx/backend/cpu/simd/base_simd.h``;
the Accelerate/NEON versions are for arm64), so it is one sequential sum;
float32 goes to ``cblas_sgemm`` (the reference BLAS in the wheel: a sequential
loop over K); ``_qmm_t`` in ``mlx/backend/cpu/quantized.cpp`` is a sequential
loop accumulating in the activation dtype; ``contiguous_reduce`` in
``mlx/backend/cpu/reduce.cpp`` is sequential; on the CPU ``sdpa`` falls back
to matmul, softmax, matmul (``mlx/backend/no_gpu/primitives.cpp``). The
measurements agree with all of it except one: at 0.32.4 ``mx.sum`` of 510
bfloat16 ones is 510, so its accumulator is wider than bfloat16.

The code is generic over a :class:`Reducer` (``reduce(codes) -> counts``), so
numpy, a Python loop, a hand-built blocked sum and the emulated split-K path
(:func:`gemmdrift.kernels.split_k`) plug in exactly as mlx's kernels do.
"""

from __future__ import annotations

import hashlib
import math
import re
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from .errors import GemmdriftError

# Probe codes, one per term.
ZERO, UNIT, PLUS, MINUS = 0, 1, 2, 3

MAX_WINDOWS = 64  # probes per pair at most; beyond that K is "too large for an exact construction"
DTYPES = ("float32", "float16", "bfloat16")
# Counts exactly representable in the output dtype (integers up to 2**precision).
_COUNT_LIMIT = {"float32": 2 ** 24, "bfloat16": 256, "float16": 1024}
NOT_RECOVERABLE = {
    "rms_norm": "a sum of squares has no negative terms, so +M and -M cannot cancel; and the sum is seen "
                "only through rsqrt: not recoverable by cancellation probes",
    "softmax": "a sum of exponentials has no negative terms, so +M and -M cannot cancel; and the sum is seen "
               "only through a division: not recoverable by cancellation probes",
}
PATH_HELP = ("matmul:<dtype>, quant:affine-q<bits>-g<group>[:<dtype>], sum:<dtype>, sdpa:<dtype>, "
             "emulated:splitk<P>[:<dtype>], numpy:float32, rms_norm:<dtype>, softmax:<dtype> "
             "(dtype float32, float16, bfloat16), replay:<chip>[@<variant>]:matmul:<dtype>, "
             "replay:<chip>[@<variant>]:quant:affine-q<4|8>-g64[:<dtype>]")


# --------------------------------------------------------------------------- construction


@dataclass(frozen=True)
class Encoding:
    """The values a probe uses in one dtype, and how many units a probe may count."""

    dtype: str
    big: float
    unit: float
    window: int  # units per probe at most (exact in the output and a float32 accumulator)
    n: int

    @property
    def windows(self) -> list[np.ndarray]:
        """Position windows: one (all positions) when n - 2 counts fit, else contiguous chunks."""
        if self.n - 2 <= self.window:
            return [np.arange(self.n)]
        return [np.arange(a, min(a + self.window, self.n)) for a in range(0, self.n, self.window)]

    def values(self, codes: np.ndarray) -> np.ndarray:
        table = np.array([0.0, self.unit, self.big, -self.big])
        return table[codes]


def encoding_for(dtype: str, n: int, *, out_dtype: str | None = None, window: int | None = None,
                 divisor: int = 1) -> Encoding:
    """Probe values for ``n`` terms in ``dtype`` (output in ``out_dtype``), or a one-line error.

    ``divisor``: the output is the count divided by this power of two (sdpa: K).
    """
    out_dtype = out_dtype or dtype
    if dtype not in DTYPES or out_dtype not in DTYPES:
        raise GemmdriftError(f"unsupported dtype {dtype!r} (known: {', '.join(DTYPES)})")
    if n < 2:
        raise GemmdriftError(f"a reduction needs at least 2 terms, got K={n}")
    limit = min(_COUNT_LIMIT[out_dtype], _COUNT_LIMIT["float32"])
    if window is not None:
        if window < 1:
            raise GemmdriftError(f"--window must be positive, got {window}")
        limit = min(limit, window)
    if dtype == "float16":
        big, unit = 2.0 ** 15, 2.0 ** -20  # the unit is an fp16 subnormal; M/u = 2**35 >= 2**25 * 1024
        if divisor > 1:
            raise GemmdriftError("float16 cannot hold the sdpa construction (units / K underflow); "
                                 "use bfloat16 or float32")
    elif dtype == "bfloat16":
        big, unit = 2.0 ** 40, 1.0
    else:
        big, unit = 2.0 ** (26 + math.ceil(math.log2(max(limit, n) + 1))), 1.0
    if big / unit < 2.0 ** 25 * limit:
        raise GemmdriftError(f"K={n} in {dtype}: no exact construction")
    enc = Encoding(dtype, big, unit, limit, n)
    need = len(enc.windows)
    if need > MAX_WINDOWS:
        raise GemmdriftError(
            f"K={n} is too large for an exact construction in {out_dtype}: counts above {limit} are not exact, "
            f"and windows of {limit} would need {need} probes per pair (at most {MAX_WINDOWS}, so K <= "
            f"{limit * MAX_WINDOWS})")
    return enc


# --------------------------------------------------------------------------- reducers


@dataclass
class Reducer:
    """A reduction under test: ``fn(values (P, n) float64) -> outputs (P, rows)`` for at most ``batch`` probes.

    ``rows`` is the number of row positions one call measures (T for a matmul
    with the probed row at every position); ``calls`` counts evaluations.
    """

    name: str
    n: int
    encoding: Encoding
    fn: Callable[[np.ndarray], np.ndarray]
    rows: int = 1
    batch: int = 1 << 30
    divisor: int = 1  # outputs are count * unit / divisor
    calls: int = 0
    meta: dict[str, Any] = field(default_factory=dict)

    def counts(self, codes: np.ndarray) -> np.ndarray:
        """Counts (P, rows) of the probes ``codes`` (P, n), in as few calls as ``batch`` allows."""
        out = []
        for lo in range(0, len(codes), self.batch):
            vals = self.encoding.values(codes[lo:lo + self.batch])
            y = np.asarray(self.fn(vals), dtype=np.float64).reshape(len(vals), self.rows)
            self.calls += 1
            out.append(y * self.divisor / self.encoding.unit)
        return np.concatenate(out) if out else np.zeros((0, self.rows))


def numpy_reducer(n: int, dtype: str = "float32") -> Reducer:
    """numpy's own ``np.sum`` over float32 rows (pairwise, 8-way unrolled, blocks of 128)."""
    enc = encoding_for(dtype, n)
    return Reducer("numpy:float32", n, enc, lambda v: np.sum(v.astype(np.float32), axis=-1)[:, None])


def _mx_dtype(name: str):
    import mlx.core as mx

    return getattr(mx, name)


def _to_np(a) -> np.ndarray:
    import mlx.core as mx

    return np.array(a.astype(mx.float32))


def matmul_reducer(dtype: str, K: int, T: int, N: int, window: int | None = None) -> Reducer:
    """Dense ``X @ W.T`` (nn.Linear) with X (T, K) all ones and one probe per column of W (N, K).

    Every row of X is the probed row, so one call measures every position of
    the T-row block; N is fixed per fingerprint (kernel choice depends on it).
    """
    import mlx.core as mx

    enc = encoding_for(dtype, K, window=window)
    dt = _mx_dtype(dtype)
    x = mx.ones((T, K), dtype=dt)

    def fn(vals: np.ndarray) -> np.ndarray:
        w = np.full((N, K), 0.0)
        w[: len(vals)] = vals
        y = x @ mx.array(w.astype(np.float32)).astype(dt).T  # (T, N)
        return _to_np(y)[:, : len(vals)].T

    return Reducer(f"matmul:{dtype}", K, enc, fn, rows=T, batch=N, meta={"N": N})


def splitk_reducer(parts: int, dtype: str, K: int, T: int, N: int, window: int | None = None) -> Reducer:
    """The emulated split-K GEMM of :func:`gemmdrift.kernels.split_k` (float32 partials): a negative control."""
    import mlx.core as mx

    from .kernels import split_k

    enc = encoding_for(dtype, K, window=window)
    dt = _mx_dtype(dtype)
    x = mx.ones((T, K), dtype=dt)

    def fn(vals: np.ndarray) -> np.ndarray:
        w = np.zeros((N, K), dtype=np.float32)
        w[: len(vals)] = vals
        wf = mx.array(w).astype(dt).astype(mx.float32)  # the float32 upcast of the stored weights
        return _to_np(split_k(x, wf, None, parts, dt))[:, : len(vals)].T

    return Reducer(f"emulated:splitk{parts}:{dtype}", K, enc, fn, rows=T, batch=N, meta={"N": N})


QUANT_RE = re.compile(r"^(affine)-q(\d+)-g(\d+)$")


def quantized_ones(N: int, K: int, bits: int, group_size: int, dtype: str):
    """Affine-quantized weights (N, K) that dequantize to exactly 1: q = 0, scale 1, bias 1 (checked)."""
    import mlx.core as mx

    dt = _mx_dtype(dtype)
    wq = mx.zeros((N, K * bits // 32), dtype=mx.uint32)
    scales = mx.ones((N, K // group_size), dtype=dt)
    biases = mx.ones((N, K // group_size), dtype=dt)
    deq = np.array(mx.dequantize(wq, scales, biases, group_size=group_size, bits=bits).astype(mx.float32))
    if deq.shape != (N, K) or not np.all(deq == 1.0):
        raise GemmdriftError(f"affine q{bits} g{group_size}: the all-ones weights do not dequantize to exactly 1")
    return wq, scales, biases


def quant_reducer(mode: str, bits: int, group_size: int, dtype: str, K: int, T: int, N: int,
                  window: int | None = None) -> Reducer:
    """``quantized_matmul(X, W, transpose=True)`` with the probe in every row of X and W dequantizing to 1.

    One probe per call (all N columns give the same sum); see the module
    docstring for why the probes cannot ride in the quantized weights.
    """
    import mlx.core as mx

    if mode != "affine":
        raise GemmdriftError(f"quantization mode {mode!r}: only affine has an exact construction here")
    if bits not in (2, 3, 4, 5, 6, 8) or group_size not in (32, 64, 128):
        raise GemmdriftError(f"affine q{bits} g{group_size}: bits must be 2,3,4,5,6,8 and the group 32, 64 or 128")
    if K % group_size or (K * bits) % 32:
        raise GemmdriftError(f"K={K} must be a multiple of the group size {group_size}")
    enc = encoding_for(dtype, K, window=window)
    dt = _mx_dtype(dtype)
    wq, scales, biases = quantized_ones(N, K, bits, group_size, dtype)

    def fn(vals: np.ndarray) -> np.ndarray:
        out = []
        for v in vals:
            x = mx.broadcast_to(mx.array(v.astype(np.float32)).astype(dt), (T, K))
            y = mx.quantized_matmul(mx.contiguous(x), wq, scales, biases, transpose=True, group_size=group_size,
                                    bits=bits)
            out.append(_to_np(y)[:, 0])  # every column is the same probe
        return np.stack(out)

    return Reducer(f"quant:{mode}-q{bits}-g{group_size}:{dtype}", K, enc, fn, rows=T, batch=1,
                   meta={"N": N, "bits": bits, "group_size": group_size, "mode": mode})


def sum_reducer(dtype: str, K: int, T: int, window: int | None = None) -> Reducer:
    """``mx.sum(x, axis=-1)`` over x (T, K) with the probe in every row: one probe per call, T positions."""
    import mlx.core as mx

    enc = encoding_for(dtype, K, window=window)
    dt = _mx_dtype(dtype)

    def fn(vals: np.ndarray) -> np.ndarray:
        out = []
        for v in vals:
            x = mx.contiguous(mx.broadcast_to(mx.array(v.astype(np.float32)).astype(dt), (T, K)))
            out.append(_to_np(mx.sum(x, axis=-1)))
        return np.stack(out)

    return Reducer(f"sum:{dtype}", K, enc, fn, rows=T, batch=1)


def sdpa_reducer(dtype: str, K: int, T: int, N: int, window: int | None = None) -> Reducer:
    """``mx.fast.scaled_dot_product_attention`` with q = k = 0: every weight is 1/K, so out = (P @ V) sums V.

    K keys (a power of two, so 1/K is exact), T queries, head dim N = one
    probe per value column.
    """
    import mlx.core as mx

    if K & (K - 1):
        raise GemmdriftError(f"sdpa needs K (keys) a power of two so 1/K is exact, got {K}")
    enc = encoding_for(dtype, K, window=window, divisor=K)
    dt = _mx_dtype(dtype)
    q = mx.zeros((1, 1, T, N), dtype=dt)
    k = mx.zeros((1, 1, K, N), dtype=dt)

    def fn(vals: np.ndarray) -> np.ndarray:
        v = np.zeros((N, K), dtype=np.float32)
        v[: len(vals)] = vals
        vv = mx.array(v.T[None, None]).astype(dt)
        o = mx.fast.scaled_dot_product_attention(q, k, vv, scale=1.0)
        return _to_np(o)[0, 0][:, : len(vals)].T

    return Reducer(f"sdpa:{dtype}", K, enc, fn, rows=T, batch=N, divisor=K, meta={"N": N})


# --------------------------------------------------------------------------- recovery


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
        tree = _canonical(_deep(_resolve)(roots[r]))
        if _leaves(tree) != list(range(n)):
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


def _deep(fn):
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


@_deep
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


@_deep
def _min_leaf(t) -> int:
    return _canon(t)[1]


@_deep
def _leaves(t) -> list[int]:
    out: list[int] = []

    def walk(x):
        if isinstance(x, int):
            out.append(x)
        else:
            for c in x:
                walk(c)
    walk(t)
    return sorted(out)


@_deep
def to_text(t) -> str:
    """The canonical text of a tree: ``(0 1 (2 3))``."""
    def text(x) -> str:
        return str(x) if isinstance(x, int) else "(" + " ".join(text(c) for c in x) + ")"
    return text(t)


@_deep
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


# ----------------------------------------------------------------------------- known trees


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


# ----------------------------------------------------------------------------- description


@_deep
def depth(t) -> int:
    def d(x) -> int:
        return 0 if isinstance(x, int) else 1 + max(d(c) for c in x)
    return d(t)


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


@_deep
def describe(t) -> str:
    """A readable description of a canonical tree, derived from its structure.

    Recognises sequential chains (and their stride), runs of terms added one
    by one at the end, blocks of contiguous terms, interleaved accumulators
    (k chains of stride k), pairwise combination and multi-operand nodes.
    """
    n = len(_leaves(t))
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
        sizes = Counter(len(_leaves(b)) for b in blocks)
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
    lens = Counter(l for l, _ in kinds)
    size = lens.most_common(1)[0][0]
    top = _shape(core, is_chain)
    irregular = "" if len(lens) == 1 else f" (lengths {dict(sorted(lens.items()))})"
    return f"sequential in {len(chains)} blocks of {size}{irregular}, blocks combined {top}"


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
    lv = _leaves(x)
    return lv[-1] - lv[0] + 1 == len(lv)


# ----------------------------------------------------------------------------- paths


@dataclass(frozen=True)
class PathSpec:
    """One kernel path: ``op`` in matmul, quant, sum, sdpa, emulated, numpy, rms_norm, softmax."""

    text: str
    op: str
    dtype: str
    mode: str = ""
    bits: int = 0
    group_size: int = 0
    parts: int = 0

    @property
    def recoverable(self) -> bool:
        return self.op not in NOT_RECOVERABLE

    @property
    def dispatch_op(self) -> str:
        """The op whose kernel choice :mod:`gemmdrift.dispatch` models ("" for none)."""
        return {"matmul": "matmul", "quant": "quantized_matmul", "sdpa": "sdpa"}.get(self.op, "")


def parse_path(text: str) -> PathSpec:
    """'matmul:bfloat16', 'quant:affine-q4-g64[:float32]', 'emulated:splitk4[:bfloat16]', ... (see PATH_HELP)."""
    parts = text.strip().split(":")
    op = parts[0]
    bad = GemmdriftError(f"unsupported path {text!r} (known: {PATH_HELP})")
    if op == "replay":  # a replayed kernel recipe (gemmdrift.kernels.replay_paths)
        from .kernels.replay_paths import parse_replay_path

        r = parse_replay_path(text)
        return PathSpec(text.strip(), "replay", r.dtype, r.mode, r.bits, r.group_size)
    if op in ("matmul", "sum", "sdpa", "rms_norm", "softmax", "numpy") and len(parts) == 2:
        if parts[1] not in DTYPES or (op == "numpy" and parts[1] != "float32"):
            raise bad
        return PathSpec(text, op, parts[1])
    if op == "quant" and len(parts) in (2, 3):
        m = QUANT_RE.match(parts[1])
        dtype = parts[2] if len(parts) == 3 else "bfloat16"
        if not m or dtype not in DTYPES:
            raise bad
        return PathSpec(text, op, dtype, m.group(1), int(m.group(2)), int(m.group(3)))
    if op == "emulated" and len(parts) in (2, 3):
        m = re.match(r"^splitk(\d+)$", parts[1])
        dtype = parts[2] if len(parts) == 3 else "bfloat16"
        if not m or int(m.group(1)) < 2 or dtype not in DTYPES:
            raise bad
        return PathSpec(text, op, dtype, parts=int(m.group(1)))
    raise bad


def check_path(spec: PathSpec, K: int, N: int, window: int | None = None) -> None:
    """Every input error of one path at one shape, before anything is computed (no mlx needed)."""
    if N < 1:
        raise GemmdriftError(f"--n must be positive, got {N}")
    if not spec.recoverable:
        return
    if spec.op == "quant":
        if spec.bits not in (2, 3, 4, 5, 6, 8) or spec.group_size not in (32, 64, 128):
            raise GemmdriftError(f"{spec.text}: bits must be 2,3,4,5,6,8 and the group size 32, 64 or 128")
        if K % spec.group_size:
            raise GemmdriftError(f"{spec.text}: K={K} must be a multiple of the group size {spec.group_size}")
    if spec.op == "sdpa" and K & (K - 1):
        raise GemmdriftError(f"{spec.text}: K (keys) must be a power of two so 1/K is exact, got {K}")
    if spec.op == "emulated" and spec.parts > K:
        raise GemmdriftError(f"{spec.text}: {spec.parts} partitions need K >= {spec.parts}")
    encoding_for(spec.dtype, K, window=window, divisor=K if spec.op == "sdpa" else 1)


def make_reducer(spec: PathSpec, K: int, T: int, N: int, window: int | None = None) -> Reducer:
    check_path(spec, K, N, window)
    if spec.op == "matmul":
        return matmul_reducer(spec.dtype, K, T, N, window)
    if spec.op == "quant":
        return quant_reducer(spec.mode, spec.bits, spec.group_size, spec.dtype, K, T, N, window)
    if spec.op == "sum":
        return sum_reducer(spec.dtype, K, T, window)
    if spec.op == "sdpa":
        return sdpa_reducer(spec.dtype, K, T, N, window)
    if spec.op == "emulated":
        return splitk_reducer(spec.parts, spec.dtype, K, T, N, window)
    if spec.op == "numpy":
        return numpy_reducer(K)
    if spec.op == "replay":
        from .kernels.replay_paths import replay_probe

        fn, batch, meta = replay_probe(spec.text, K, T, N)
        return Reducer(spec.text, K, encoding_for(spec.dtype, K, window=window), fn, rows=T, batch=batch, meta=meta)
    raise GemmdriftError(f"{spec.text}: {NOT_RECOVERABLE.get(spec.op, 'unsupported')}")


def accumulator_check(reducer: Reducer) -> dict[str, Any]:
    """Sum ``c`` units (no big terms) where ``c`` is the largest even count the output dtype shows exactly.

    A result below ``c`` means the accumulator is narrower than the output
    could show (bfloat16 partials: 510 ones sum to 256 sequentially).
    """
    limit = reducer.encoding.window
    c = min(reducer.n, 2 * limit - 2 if limit < 2 ** 24 else reducer.n)
    codes = np.zeros((1, reducer.n), dtype=np.int8)
    codes[0, :c] = UNIT
    got = reducer.counts(codes)[0]
    worst = float(got[np.argmax(np.abs(got - c))])
    return {"units": int(c), "sum": worst, "exact": bool(np.all(got == c))}


FP16_FLUSHED = "fp16 subnormals flushed on this device"


def fp16_subnormals_kept(reducer: Reducer) -> bool:
    """Whether this device keeps the fp16 subnormals a float16 probe counts with (its unit, 2**-20, is one).

    A path that flushes them would read every count as 0 and look unrecoverable. Checked on the device: 2**-20
    round-trips through ``astype``, and the path's own reduction of units alone (one unit, and a full window
    of them: a 1 x K matmul of units for matmul paths) counts them exactly. True for other dtypes.
    """
    import mlx.core as mx

    unit = reducer.encoding.unit
    if reducer.encoding.dtype != "float16" or unit >= 2.0 ** -14:  # 2**-14: fp16's smallest normal
        return True
    back = mx.array(unit, dtype=mx.float32).astype(mx.float16).astype(mx.float32).item()
    m = min(reducer.n, reducer.encoding.window)
    codes = np.zeros((2, reducer.n), dtype=np.int8)
    codes[0, 0], codes[1, :m] = UNIT, UNIT
    got = reducer.counts(codes)
    return back == unit and bool(np.all(got[0] == 1)) and bool(np.all(got[1] == m))


def _predict(spec: PathSpec, env: dict[str, Any], K: int, N: int, T: int) -> tuple[str, str]:
    """(predicted kernel, origin) from gemmdrift.dispatch; Metal's rules labelled as reference on the CPU."""
    from .dispatch import kernel_for
    from .kernels import _reference_backend

    if not spec.dispatch_op:
        return "", ""
    target, version, chip, origin = _reference_backend(env, None)
    if chip is None:  # a GPU whose architecture the record does not name: no prediction, not a default chip
        return "", origin
    shape: dict[str, Any]
    if spec.op == "sdpa":
        shape = {"k_len": K, "head_dim": N, "n_heads": 1, "n_kv_heads": 1}
    elif spec.op == "quant":
        shape = {"K": K, "N": N, "mode": spec.mode, "bits": spec.bits, "group_size": spec.group_size}
    else:
        shape = {"K": K, "N": N, "dtype": spec.dtype}
    try:
        return kernel_for(target, spec.dispatch_op, T, mlx_version=version, chip=chip, **shape), origin
    except GemmdriftError:
        return "", origin


def measure(paths: Sequence[str], *, K: int = 1024, ts: Iterable[int] = (1, 2, 3, 4, 8, 16, 33), N: int = 64,
            window: int | None = None, draw_k: int = 16, env: dict[str, Any] | None = None,
            progress: Callable[[str], None] | None = None, workers: int | None = None, checkpoint=None):
    """Fingerprints of every path at every T and row position; a Result of kind "fingerprint".

    Args:
        paths: path texts (see :data:`PATH_HELP`).
        K: terms of the reduction (matmul inner dimension, keys for sdpa).
        ts: block sizes T; the probed row is at every position 0..T-1.
        N: output columns per call (head dim for sdpa), fixed for a fingerprint.
        window: cap the units per probe (default: what the output dtype counts exactly).
        draw_k: also recover every path at this small K and T=1, for the tree plots (0: skip).
        workers: processes for the paths (default 2 on a CPU device with 2 cores or more; each path is the
            same computation in any process; in other processes ``progress`` lines go to stderr).
        checkpoint: an output directory: every finished path x T is saved under it (:mod:`gemmdrift.checkpoint`)
            and a rerun loads it; Ctrl-C raises :class:`gemmdrift.checkpoint.Interrupted` with the partial Result.
    """
    from .checkpoint import Checkpoints, Interrupted, partial_inputs
    from .envinfo import environment

    specs = [parse_path(p) for p in paths]
    ts = sorted(set(int(t) for t in ts))
    if not ts or ts[0] < 1:
        raise GemmdriftError("block sizes T must be positive")
    for s in specs:
        check_path(s, K, N, window)
    env = dict(env or environment())
    from .workers import run_tasks

    n_workers = _fp_workers(workers, len(specs))
    ck = Checkpoints(checkpoint, "fingerprint", None, K, N, window)
    jobs = [dict(path=s.text, K=K, ts=ts, N=N, window=window, draw_k=draw_k, env=env,
                 progress=progress is not None if n_workers > 1 else progress, checkpoint=ck.spec()) for s in specs]
    try:
        parts = run_tasks(_measure_path, jobs, n_workers)
    except KeyboardInterrupt:
        # What finished is on disk (written by whichever process measured it): the partial Result is read back.
        parts = [_measure_path(**dict(job, progress=None), only_saved=True) for job in jobs]
        done = sum(p["done"] for p in parts)
        total = sum(len(ts) if s.op != "numpy" else 1 for s in specs if s.recoverable)
        result = _fingerprint_result(specs, parts, paths, K, ts, N, window, draw_k, env,
                                     partial_inputs(done, total, "path x T")) if done else None
        raise Interrupted(result, done, total) from None
    return _fingerprint_result(specs, parts, paths, K, ts, N, window, draw_k, env, {})


def _fingerprint_result(specs, parts, paths, K, ts, N, window, draw_k, env, extra: dict[str, Any]):
    """The Result of :func:`measure` from the per-path parts of :func:`_measure_path`."""
    import pandas as pd

    from .result import Result, env_labels, tidy
    rows: list[dict[str, Any]] = [r for p in parts for r in p["rows"]]
    trees: dict[str, str] = {k: v for p in parts for k, v in p["trees"].items()}
    accum: list[dict[str, Any]] = [a for p in parts for a in p["accum"]]
    small: dict[str, Any] = {k: v for p in parts for k, v in p["small"].items()}
    origin = next((p["origin"] for p in parts if p["origin"]), "")
    figures: dict[str, float] = {}
    table = pd.DataFrame(rows)
    for s in specs:
        sub = table[(table["path"] == s.text) & (table["status"] == "recovered")]
        if not s.recoverable or not len(table[table["path"] == s.text]) or (
                table[table["path"] == s.text]["status"] == FP16_FLUSHED).any():  # no figure, not "unrecovered"
            continue
        figures[f"{s.text}.unrecovered"] = float((table[table["path"] == s.text]["status"] != "recovered").sum())
        if len(sub):
            figures[f"{s.text}.distinct_trees"] = float(sub["fingerprint"].nunique())
            first = sub[sub["T"] == sub["T"].min()].iloc[0]
            last = sub[sub["T"] == sub["T"].max()].iloc[0]
            figures[f"{s.text}.tree_id_t{int(first['T'])}"] = float(first["tree_id"])
            figures[f"{s.text}.tree_id_tmax"] = float(last["tree_id"])
    tid = [{"pair": r["path"], "dtype": r["dtype"], "T": r["T"], "position": r["position"], "metric": "tree_id",
            "value": r["tree_id"]} for r in rows if r["status"] == "recovered"]
    frame = tidy(tid or [{"metric": "tree_id", "value": math.nan}], **env_labels(env))
    inputs = {"paths": list(paths), "K": K, "ts": ts, "N": N, "window": window, "draw_k": draw_k,
              "method": "FPRev cancellation probes (+M, -M, units), Xie et al., USENIX ATC '25", **extra}
    details = {"trees": trees, "small_trees": small, "prediction_origin": origin,
               "encodings": {s.text: vars(encoding_for(s.dtype, K, window=window,
                                                       divisor=K if s.op == "sdpa" else 1))
                             for s in specs if s.recoverable}}
    return Result(kind="fingerprint", inputs=inputs, env=env, frame=frame, figures=figures,
                  tables={"fingerprints": table.drop(columns=[]),
                          "accumulator": pd.DataFrame(accum, columns=["path", "T", "units", "sum", "exact"])},
                  details=details)

def _fp_workers(workers: int | None, parts: int) -> int:
    """Processes for the paths of :func:`measure`: as given, else 2 on a CPU device with 2 cores or more (1 inside
    a worker process)."""
    import os

    import mlx.core as mx

    from .workers import in_worker

    if workers is not None:
        if workers < 1:
            raise GemmdriftError(f"workers must be at least 1, got {workers}")
        return max(1, min(workers, parts))
    if in_worker():
        return 1
    return 2 if parts > 1 and mx.default_device() == mx.cpu and (os.cpu_count() or 1) >= 2 else 1


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _measure_path(*, path: str, K: int, ts: list[int], N: int, window: int | None, draw_k: int,
                  env: dict[str, Any], progress, checkpoint: dict[str, Any] | None = None,
                  only_saved: bool = False) -> dict[str, Any]:
    """Every T of one path for :func:`measure` (module level: paths may run in separate processes, where
    ``progress=True`` prints to stderr). Each finished T is saved to ``checkpoint`` (a Checkpoints spec) and
    loaded from there on a rerun; ``only_saved``: load what was saved, compute nothing (``done`` counts it)."""
    from .checkpoint import Checkpoints

    ck = Checkpoints.from_spec(checkpoint)
    done = 0
    progress = _stderr if progress is True else (progress or None)
    s = parse_path(path)
    rows: list[dict[str, Any]] = []
    trees: dict[str, str] = {}
    accum: list[dict[str, Any]] = []
    small: dict[str, Any] = {}
    origin = ""
    if not s.recoverable:
        rows.append({"path": s.text, "op": s.op, "dtype": s.dtype, "K": K, "N": N, "T": math.nan,
                     "position": math.nan, "status": "not recoverable", "fingerprint": "", "tree_id": math.nan,
                     "description": NOT_RECOVERABLE[s.op], "depth": math.nan, "probes": 0, "calls": 0,
                     "seconds": 0.0, "predicted_kernel": ""})
        return {"rows": rows, "trees": trees, "accum": accum, "small": small, "origin": origin, "done": 0}
    for T in (ts if s.op != "numpy" else [1]):
        unit = (f"{s.text}_T{T}", s.text, T, ts[0])
        saved = ck.load(*unit, check=lambda u: {"rows", "trees", "accum"} <= set(u))
        if saved is not None:
            rows += saved["rows"]
            trees.update(saved["trees"])
            accum += saved["accum"]
            origin = origin or saved.get("origin", "")
            done += 1
            if progress:
                progress(f"{s.text} K={K} T={T}: done before (resumed)")
            continue
        if only_saved:
            continue
        red = make_reducer(s, K, T, N, window)
        if T == ts[0] and not fp16_subnormals_kept(red):  # say so, not "not recovered" at every T
            rows.append({"path": s.text, "op": s.op, "dtype": s.dtype, "K": K, "N": N, "T": math.nan,
                         "position": math.nan, "status": FP16_FLUSHED, "fingerprint": "", "tree_id": math.nan,
                         "description": FP16_FLUSHED, "depth": math.nan, "probes": 0, "calls": red.calls,
                         "seconds": 0.0, "predicted_kernel": ""})
            return {"rows": rows, "trees": trees, "accum": accum, "small": small, "origin": origin, "done": done}
        n_rows, n_accum, old_trees = len(rows), len(accum), set(trees)
        if T == ts[0]:
            acc = accumulator_check(red)
            accum.append({"path": s.text, "T": T, **acc})
        t0 = time.perf_counter()
        recs, stats = recover(red, progress=progress)
        secs = time.perf_counter() - t0
        pred, o = _predict(s, env, K, N, T)
        origin = origin or o
        for pos, rec in enumerate(recs):
            fp = fingerprint(rec.tree) if rec.ok else ""
            if rec.ok and fp not in trees:
                trees[fp] = to_text(rec.tree)
                trees[fp + ":description"] = describe(rec.tree)
            rows.append({"path": s.text, "op": s.op, "dtype": s.dtype, "K": K, "N": N, "T": T, "position": pos,
                         "status": "recovered" if rec.ok else "not recovered", "fingerprint": fp,
                         "tree_id": tree_id(fp) if rec.ok else math.nan,
                         "description": trees[fp + ":description"] if rec.ok else rec.problem,
                         "depth": depth(rec.tree) if rec.ok else math.nan, "probes": stats["probes"],
                         "calls": stats["calls"], "seconds": secs, "predicted_kernel": pred})
        ck.save(unit[0], {"rows": rows[n_rows:], "accum": accum[n_accum:], "origin": o,
                          "trees": {k: v for k, v in trees.items() if k not in old_trees}}, *unit[1:])
        done += 1
        if progress:
            progress(f"{s.text} K={K} T={T}: {len({r['fingerprint'] for r in rows[-T:]})} tree(s), "
                     f"{stats['probes']} probes in {stats['calls']} calls, {secs:.1f} s")
    if draw_k and not only_saved:
        k_small = max(draw_k, s.group_size) if s.op == "quant" else draw_k
        try:
            red = make_reducer(s, k_small, 1, N, window)
            rec = recover(red)[0][0]
            small[s.text] = {"K": k_small, "tree": to_text(rec.tree) if rec.ok else "",
                             "fingerprint": fingerprint(rec.tree) if rec.ok else "",
                             "description": describe(rec.tree) if rec.ok else rec.problem}
        except GemmdriftError as e:
            small[s.text] = {"K": k_small, "tree": "", "fingerprint": "", "description": str(e)}
    return {"rows": rows, "trees": trees, "accum": accum, "small": small, "origin": origin, "done": done}
