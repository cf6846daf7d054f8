"""Kernel paths (how a projection is computed: model, dense:<dtype>, quant:..., emulated:splitk<P>),
the operators that run them, and their float64 references. See :mod:`gemmdrift.kernels`."""

from __future__ import annotations

import math
import re
import zlib
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..errors import GemmdriftError
from ..model import Quantization, available_quant_modes, parse_dtype, parse_quantization
from ..model.taps import to_numpy
from ..model.projections import DEFAULT_MAX_ROWS, Projection, linear_types, synthetic_rows

# Float64 reference weights are built in slices of at most this many bytes.
EXACT_CHUNK_BYTES = 64 << 20


# -------------------------------------------------------------------------- paths


@dataclass(frozen=True)
class PathSpec:
    """A parsed path: ``model``, ``dense:<dtype>``, ``quant:<mode>-q<bits>-g<group>``, ``emulated:splitk<P>``."""

    text: str
    kind: str
    dtype: str | None = None
    quant: Quantization | None = None
    partitions: int = 0

    @property
    def emulated(self) -> bool:
        return self.kind == "emulated"


QUANT_RE = re.compile(r"^([a-z0-9]+)-q(\d+)-g(\d+)$")


def parse_path(text: str) -> PathSpec:
    """Validate a path string (an unavailable quantization mode is a GemmdriftError)."""
    kind, _, arg = str(text).strip().partition(":")
    if kind == "model" and not arg:
        return PathSpec("model", "model")
    if kind == "dense" and arg:
        dtype = parse_dtype(arg)
        return PathSpec(f"dense:{dtype}", "dense", dtype=dtype)
    if kind == "quant":
        m = QUANT_RE.match(arg)
        if not m:
            raise GemmdriftError(f"bad quantized path {text!r} (expected quant:<mode>-q<bits>-g<group>, "
                                 f"e.g. quant:affine-q4-g64; modes here: {', '.join(available_quant_modes())})")
        q = parse_quantization(int(m.group(2)), int(m.group(3)), m.group(1))
        return PathSpec(f"quant:{q.label}", "quant", quant=q)
    if kind == "emulated":
        m = re.match(r"^splitk(\d+)$", arg)
        if not m or int(m.group(1)) < 2:
            raise GemmdriftError(f"bad emulated path {text!r} (expected emulated:splitk<P> with P >= 2)")
        return PathSpec(f"emulated:splitk{int(m.group(1))}", "emulated", partitions=int(m.group(1)))
    raise GemmdriftError(f"unknown path {text!r} (choose model, dense:<dtype>, quant:<mode>-q<bits>-g<group> "
                         f"or emulated:splitk<P>)")


def _quant_kwargs(q: Quantization) -> dict[str, Any]:
    # Older mlx has no `mode` argument; affine is its only mode.
    return {"group_size": q.group_size, "bits": q.bits, **({} if q.mode == "affine" else {"mode": q.mode})}


def quant_of(module) -> Quantization | None:
    import mlx.nn as nn

    if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        return Quantization(bits=module.bits, group_size=module.group_size, mode=getattr(module, "mode", "affine"))
    return None


def _synthetic_dense(proj: Projection, dtype: str):
    """Seeded weights with the module's shape and init distribution, drawn without touching the module.

    A shape model's own parameters are lazy; evaluating them would keep every
    projection resident in the model (tens of GB for Gemma 4 31B). Drawing a
    fresh copy per projection keeps one alive at a time.
    """
    import mlx.core as mx
    import mlx.nn as nn

    from ..model import SYNTHETIC_SEED, mx_dtype

    # numpy's Generator (PCG64), seeded per projection: the same weights on every platform and chip. Until issue 31
    # they were mx.random.normal / uniform with this key; the normal's erfinv differs between Metal chips (mlx
    # #3568) and a CPU's may differ between arm64 and x86 (compiler contraction), so shape:NAME's embeddings were
    # not the same bits everywhere.
    rng = np.random.default_rng(zlib.crc32(f"{SYNTHETIC_SEED}:{proj.layer}:{proj.name}".encode()))
    k, n = proj.in_dims, proj.out_dims
    scale = np.float32(math.sqrt(1.0 / k))
    embedding = isinstance(proj.module, (nn.Embedding, nn.QuantizedEmbedding))
    dt = mx_dtype(dtype)
    # float32 on the host a slice of rows at a time, each cast to the compute dtype at once: no float32 copy of a
    # vocabulary-sized matrix (262144 x 5376 for Gemma 4 31B). The slices continue one stream, so the values do
    # not depend on the slice size.
    step = max(1, EXACT_CHUNK_BYTES // (4 * k))
    parts = []
    for r0 in range(0, n, step):
        rows = min(step, n - r0)
        if embedding:  # nn.Embedding's init: normal(0, scale)
            x = rng.standard_normal((rows, k), dtype=np.float32)
            np.multiply(x, scale, out=x)
        else:  # nn.Linear's init: uniform(-scale, scale), as lo + (hi - lo) * u with u in [0, 1)
            x = rng.random((rows, k), dtype=np.float32)
            np.multiply(x, np.float32(2) * scale, out=x)
            np.add(x, -scale, out=x)
        part = mx.array(x).astype(dt)
        mx.eval(part)
        parts.append(part)
        del x
    w = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=0)
    mx.eval(w)
    return w, None


def dense_weights(lm, proj: Projection, dtype: str):
    """(W (N, K), bias or None) of a projection in the compute dtype.

    A quantized module's dense weights are its dequantization (in the dtype of
    its scales, which is the compute dtype).
    """
    import mlx.core as mx

    if lm.description.kind == "shape":
        return _synthetic_dense(proj, dtype)
    mod = proj.module
    bias = mod["bias"] if isinstance(mod, linear_types()) and "bias" in mod else None
    q = quant_of(mod)
    if q is None:
        return mod["weight"], bias
    w = mx.dequantize(mod["weight"], mod["scales"], mod.get("biases"), **_quant_kwargs(q))
    return w, bias


class Operator:
    """One path on one projection: a callable x (1, T, K) -> (1, T, N) and its exact reference."""

    def __init__(self, run: Callable, run_block: Callable, in_dtype: str, out_dtype: str, quant: str,
                 weight_rows: Callable[[int, int], np.ndarray], bias, n: int, k: int, arrays: list):
        self.run = run  # T=1 (and the real kernel at any T)
        self.run_block = run_block  # the kernel under test for T >= 2
        self.arrays = arrays  # the operands it holds, to evaluate outside a timed body
        self.in_dtype = in_dtype
        self.out_dtype = out_dtype
        self.quant = quant
        self._weight_rows = weight_rows
        self._bias = bias
        self.n, self.k = n, k

    def exact(self, x: np.ndarray) -> np.ndarray:
        """float64 ``x @ W.T (+ bias)`` from the stored operands, W built a slice of rows at a time."""
        x64 = np.asarray(x, dtype=np.float64)
        step = max(1, EXACT_CHUNK_BYTES // (8 * self.k))
        out = np.empty((x64.shape[0], self.n), dtype=np.float64)
        for lo in range(0, self.n, step):
            hi = min(self.n, lo + step)
            out[:, lo:hi] = x64 @ self._weight_rows(lo, hi).T
        if self._bias is not None:
            out += to_numpy(self._bias).astype(np.float64)
        return out


def _dense_rows(w) -> Callable[[int, int], np.ndarray]:
    import mlx.core as mx

    # bf16/fp16/fp32 -> float32 -> float64 is exact.
    return lambda lo, hi: np.asarray(w[lo:hi].astype(mx.float32), dtype=np.float64)


def _quant_rows(wq, scales, biases, q: Quantization) -> Callable[[int, int], np.ndarray]:
    """Exact float64 dequantization of packed weights, a slice of rows at a time."""
    import mlx.core as mx

    def rows(lo: int, hi: int) -> np.ndarray:
        s = scales[lo:hi]
        if q.mode == "affine":
            # Unit scales and zero biases make dequantize return the integer codes, exactly.
            codes = mx.dequantize(wq[lo:hi], mx.ones(s.shape, mx.float32), mx.zeros(s.shape, mx.float32),
                                  **_quant_kwargs(q))
            c = np.asarray(codes, dtype=np.float64).reshape(hi - lo, -1, q.group_size)
            s64 = to_numpy(s).astype(np.float64)[..., None]
            b64 = to_numpy(biases[lo:hi]).astype(np.float64)[..., None]
            return (c * s64 + b64).reshape(hi - lo, -1)
        # mx/nv fp formats: power-of-two or fp8 scales times fp4/fp8 codes are exact in float32.
        w = mx.dequantize(wq[lo:hi], s, None, dtype=mx.float32, **_quant_kwargs(q))
        return np.asarray(w, dtype=np.float64)

    return rows


def _partitions(k: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous K ranges of near-equal size (the first ones one longer)."""
    if parts > k:
        raise GemmdriftError(f"split-K with {parts} partitions needs K >= {parts}, got K={k}")
    edges = np.cumsum([0] + [k // parts + (i < k % parts) for i in range(parts)])
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:])]


def split_k(x, wf, bias, parts: int, out_dtype):
    """The emulated split-K GEMM: x (..., K) @ wf (N, K).T in ``parts`` float32 partials summed in order.

    This is an emulation, not an mlx kernel; it stands in for a GPU split-K
    reduction order as a negative control. ``wf`` is the float32 upcast of
    the weights.
    """
    import mlx.core as mx

    # Upcasting bf16/fp16 operands to float32 is exact; each partial rounds in float32.
    xf = x.astype(mx.float32)
    acc = None
    for lo, hi in _partitions(x.shape[-1], parts):
        part = xf[..., lo:hi] @ wf[:, lo:hi].T
        acc = part if acc is None else acc + part  # sequential float32 sum of the partials
    if bias is not None:
        acc = acc + bias.astype(mx.float32)
    return acc.astype(out_dtype)  # one rounding to the path's dtype


def _arrays(module) -> list:
    from mlx.utils import tree_flatten

    return [v for _, v in tree_flatten(module.parameters())]


def build_operator(lm, proj: Projection, path: PathSpec) -> Operator:
    """The operands and kernels of ``path`` on ``proj`` (one projection's copies alive at a time)."""
    import mlx.core as mx
    import mlx.nn as nn

    from ..model import mx_dtype

    compute = lm.description.dtype
    k, n = proj.in_dims, proj.out_dims
    w, bias = dense_weights(lm, proj, compute)

    def linear(weight, b):
        lin = nn.Linear(k, n, bias=b is not None)
        lin.weight = weight
        if b is not None:
            lin.bias = b
        return lin

    if path.kind == "dense":
        dt = mx_dtype(path.dtype)
        lin = linear(w.astype(dt), None if bias is None else bias.astype(dt))
        return Operator(lin, lin, path.dtype, path.dtype, "", _dense_rows(lin.weight), lin.get("bias"), n, k,
                         _arrays(lin))
    if path.kind == "emulated":
        lin = linear(w, bias)
        out_dt = mx_dtype(compute)
        wf = w.astype(mx.float32)  # exact upcast, made once per projection
        return Operator(lin, lambda x: split_k(x, wf, bias, path.partitions, out_dt), compute, compute, "",
                         _dense_rows(w), bias, n, k, _arrays(lin) + [wf])
    if path.kind == "quant":
        q = path.quant
        qlin = nn.QuantizedLinear.from_linear(linear(w, bias), **_quant_kwargs(q))
        return Operator(qlin, qlin, compute, compute, q.label,
                         _quant_rows(qlin["weight"], qlin["scales"], qlin.get("biases"), q), bias, n, k, _arrays(qlin))
    # "model": the module as loaded (a shape model's lazy module is rebuilt from seeded weights).
    mod, q = proj.module, quant_of(proj.module)
    if lm.description.kind == "shape":
        mod = linear(w, bias) if q is None else nn.QuantizedLinear.from_linear(linear(w, bias), **_quant_kwargs(q))
    run = mod.as_linear if isinstance(mod, (nn.Embedding, nn.QuantizedEmbedding)) else mod
    if q is None:
        return Operator(run, run, compute, compute, "", _dense_rows(mod["weight"]), bias, n, k, _arrays(mod))
    return Operator(run, run, compute, compute, q.label,
                     _quant_rows(mod["weight"], mod["scales"], mod.get("biases"), q), bias, n, k, _arrays(mod))


# ------------------------------------------------------------------------ timing


def time_projection(lm, proj: Projection, path: str, t: int, rows: np.ndarray | None = None) -> Callable[[], None]:
    """A zero-argument callable running one path at block size ``t`` on one projection (for asv ``time_``).

    Operands are built and evaluated here, outside the timed body; the body
    runs the kernel (the real one at t=1, the path's block kernel above) and
    evaluates it.

    Args:
        lm: the loaded model.
        proj: from :func:`projections`.
        path: a path string (see :func:`parse_path`).
        t: block size.
        rows: input rows, cycled to ``t`` (default: seeded unit-RMS rows).
    """
    import mlx.core as mx

    from ..model import mx_dtype

    if t < 1:
        raise GemmdriftError(f"block size must be at least 1, got {t}")
    spec = parse_path(path)
    op = build_operator(lm, proj, spec)
    if rows is None:
        rows = synthetic_rows(proj.key, proj.in_dims, min(t, DEFAULT_MAX_ROWS), lm.description.dtype)
    x = mx.array(np.asarray(rows, np.float32)[np.arange(t) % len(rows)][None]).astype(mx_dtype(op.in_dtype))
    run = op.run if t == 1 else op.run_block
    mx.eval(x, op.arrays)

    def body() -> None:
        mx.eval(run(x))

    return body


@dataclass
class Operand:
    """One projection's module detached from its model: class, shape, quantization and stored arrays as
    numpy (exact: bf16/fp16 values as float32, packed weights as integers). It pickles, so a process that
    only times one projection (asv's time_ benchmarks, one process per case) rebuilds the same module
    without loading the model or importing mlx-lm."""

    layer: int
    name: str
    in_dims: int
    out_dims: int
    dtype: str  # the model's compute dtype
    cls: str  # Linear | QuantizedLinear | Embedding | QuantizedEmbedding
    quant: Quantization | None
    arrays: dict[str, tuple[np.ndarray, str]]  # parameter name -> (values, mlx dtype name)


def detach(lm, proj: Projection) -> Operand:
    """The :class:`Operand` of ``proj`` as loaded (not for ``shape:`` models, whose modules are lazy)."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    mod = proj.module
    classes = (nn.QuantizedLinear, nn.QuantizedEmbedding, nn.Linear, nn.Embedding)
    if lm.description.kind == "shape" or not isinstance(mod, classes):
        raise GemmdriftError(f"cannot detach layer {proj.layer} {proj.name} of {lm.description.source}")
    arrays = {}
    for name, v in tree_flatten(mod.parameters()):
        kind = str(v.dtype).rsplit(".", 1)[-1]
        arrays[name] = (to_numpy(v) if v.dtype in _float_dtypes() else np.array(v, copy=True), kind)
    cls = next(c for c in classes if isinstance(mod, c)).__name__
    return Operand(proj.layer, proj.name, proj.in_dims, proj.out_dims, lm.description.dtype, cls, quant_of(mod),
                   arrays)


def _float_dtypes():
    import mlx.core as mx

    return (mx.bfloat16, mx.float16, mx.float32)


def attach(op: Operand) -> tuple[Any, Projection]:
    """A stand-in model and the :class:`Projection` of a rebuilt module, for :func:`time_projection`."""
    import types

    import mlx.core as mx
    import mlx.nn as nn

    q = {} if op.quant is None else _quant_kwargs(op.quant)
    k, n = op.in_dims, op.out_dims
    mod = {"Linear": lambda: nn.Linear(k, n, bias="bias" in op.arrays),
           "QuantizedLinear": lambda: nn.QuantizedLinear(k, n, bias="bias" in op.arrays, **q),
           "Embedding": lambda: nn.Embedding(n, k),
           "QuantizedEmbedding": lambda: nn.QuantizedEmbedding(n, k, **q)}[op.cls]()
    mod.load_weights([(name, mx.array(v).astype(getattr(mx, kind))) for name, (v, kind) in op.arrays.items()])
    lm = types.SimpleNamespace(description=types.SimpleNamespace(dtype=op.dtype, kind="detached",
                                                                 source="detached"))
    return lm, Projection(op.layer, op.name, k, n, mod, None, None)

__all__ = ["EXACT_CHUNK_BYTES", "PathSpec", "parse_path", "dense_weights", "split_k", "build_operator", "time_projection",
           "Operand", "detach", "attach"]
