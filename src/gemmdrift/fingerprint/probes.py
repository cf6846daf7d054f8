"""Probe construction: exact encodings, the reducers that run a kernel path on them, and path specs."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..errors import GemmdriftError


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

    from ..kernels import split_k

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
    if op == "replay":  # a replayed kernel recipe (gemmdrift.replay.paths)
        from ..replay.paths import parse_replay_path

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
        from ..replay.paths import replay_probe

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
