"""Kernel isolation: GEMV (T=1) against batched GEMM (T>1), per projection of every layer.

Decoding feeds one token per step, so every linear is a matrix-vector product;
speculative verification and chunked prefill feed T tokens, a matrix-matrix
product. This module measures, for every linear of every decoder layer and
for the LM head, whether the same input row gives the same output bits both
ways, on the model's real weights and on real activations:

1. :func:`projections` lists the linears (``layer``, ``name``).
2. :func:`capture_inputs` records real input rows of each one during one
   forward pass of the model over a real prompt.
3. :func:`sweep` computes every distinct row alone (T=1, the GEMV) and then,
   for each T, one GEMM over a block of T rows made by cycling the captured
   rows, and compares each block row with its T=1 result, bit for bit. It also
   scores every path against a float64 numpy reference computed from the same
   stored operands.
4. :func:`ops_sweep` does the same for the other ops whose shape changes
   between decode and verification: attention, RMSNorm, RoPE and softmax.

Paths (how a projection is computed):

* ``model``: the module as loaded (nn.Linear in the compute dtype, or the
  checkpoint's own QuantizedLinear).
* ``dense:<dtype>``: the dense weights cast to bfloat16/float16/float32, the
  input cast alike, computed by nn.Linear.
* ``quant:<mode>-q<bits>-g<group>``: the dense weights quantized by
  ``nn.QuantizedLinear.from_linear``, as ``mlx_lm.convert -q`` does.
* ``emulated:splitk<P>``: a NEGATIVE CONTROL, not a real kernel. T=1 runs the
  real dense kernel; T>=2 splits K into P partitions whose float32 partial
  products are summed in order, as a split-K GEMM would. It proves the sweep
  can see a reduction-order change; its rows carry ``emulated=True`` and are
  never mixed into real results.

On the Linux CPU backend every real path is row-invariant (see
:mod:`gemmdrift.dispatch`), so an honest sweep reports exact zeros there.

Tidy output columns: layer, projection, path, dtype, quant, emulated,
synthetic, inputs, K, N, key_length (ops only), T, metric, value. Drift
metrics (those of :func:`metrics.compare`, plus ``rows_differ`` and
``worst_position``) exist for every GEMM block size T>=2 and, when T=1 is
asked for, for a second T=1 call on the first row (run-to-run determinism);
error metrics (``err_*``, see :func:`metrics.error_vs_exact`) exist for T=1
(every distinct row used) and for every block.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import sys
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import pandas as pd

from . import files, metrics
from .errors import GemmdriftError
from .models import Quantization, available_quant_modes, parse_dtype, parse_quantization
from .taps import StopForward, find_final_norm, storage_dtype_name, to_numpy

# T=1 is the reference (always computed). 2..17, 24, 32 and 33 bracket the
# small-M kernel switches of dispatch.py (gemv_wide up to 15 rows, qmv batch
# limits 6..33, 32-row qmm tiles); 512 and 2048 are the prefill chunk sizes of
# mlx-lm's speculative and plain generation.
DEFAULT_TS = (*range(1, 18), 24, 32, 33, 64, 128, 512, 2048)
DEFAULT_MAX_T = 2048
# FLOPs allowed per (projection, path): T=1 rows plus every GEMM block. 2e9 is
# about 0.3 s in bf16, 1.5 s in fp32 and 7 s quantized on the reference CPU
# (7, 1.4 and 0.3 GFLOP/s); for Gemma 3 270M it reaches T=128 (MLP), 512
# (attention q/o) and 2048 (k/v).
DEFAULT_FLOP_BUDGET = 2e9
# Block sizes up to this are measured whatever the budget: they cover the
# first small-M kernel switches (gemv_wide and qmv_wide from T=2, gemv_wide's
# second pass from T=6 in dispatch.py), and keep a vocabulary-sized LM head
# (335 MFLOP per row for Gemma 3 270M) from being cut to nothing.
DEFAULT_ALWAYS_T = 4
DEFAULT_MAX_ROWS = 64
DEFAULT_PATHS = ("model", "quant:affine-q4-g64", "emulated:splitk4")
LM_HEAD = "lm_head"
INPUT_SEED = 20260901
# Rows are picked from this many evenly spaced positions per distinct row wanted.
CANDIDATES_PER_ROW = 4
# Float64 reference weights are built in slices of at most this many bytes.
EXACT_CHUNK_BYTES = 64 << 20
OP_NAMES = ("sdpa", "rms_norm", "rope", "softmax")
DEFAULT_QUERY_LENGTHS = tuple(range(1, 17))
# Around the Metal SDPA boundaries (mlx/backend/metal/scaled_dot_product_attention.cpp,
# eval_gpu): the vector kernel goes 2-pass from 1024 keys on Max/Ultra and from
# 4096 with GQA; 256 is mlx-lm's KV-cache step and the cuDNN decode minimum
# (mlx/backend/cuda/scaled_dot_product_attention.cpp, use_cudnn_for_decoding).
DEFAULT_KEY_LENGTHS = (256, 1023, 1024, 1025, 2048, 4096)
TABLE_COLUMNS = ["layer", "projection", "path", "dtype", "quant", "emulated", "synthetic", "inputs", "K", "N",
                 "key_length", "T", "metric", "value", "heads", "kv_heads"]  # heads: sdpa rows only


# ---------------------------------------------------------------------- projections


@dataclass(frozen=True)
class Projection:
    """One linear of the model: decoder layer ``layer`` (n_layers for the LM head) and its name."""

    layer: int
    name: str
    in_dims: int  # K
    out_dims: int  # N
    module: Any = field(repr=False, compare=False)
    parent: Any = field(repr=False, compare=False)  # module holding it (None for the LM head)
    attr: str | None = None

    @property
    def key(self) -> tuple[int, str]:
        return self.layer, self.name

    @property
    def is_head(self) -> bool:
        return self.name == LM_HEAD

    @property
    def flops_per_row(self) -> float:
        return 2.0 * self.in_dims * self.out_dims


def _linear_types():
    import mlx.nn as nn

    return nn.Linear, nn.QuantizedLinear


def _dims(module) -> tuple[int, int]:
    """(K, N) of a Linear, QuantizedLinear, Embedding or QuantizedEmbedding used as a linear."""
    import mlx.nn as nn

    if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        return module["scales"].shape[-1] * module.group_size, module["scales"].shape[0]
    n, k = module["weight"].shape
    return k, n


def _head(model):
    """The LM head module: an untied ``lm_head`` linear, or the tied input embedding."""
    import mlx.nn as nn

    tied = getattr(model, "tie_word_embeddings", None)
    if not tied and "lm_head" in model and isinstance(model["lm_head"], _linear_types()):
        return model["lm_head"]
    owner, _ = find_final_norm(model)
    embed = owner.get("embed_tokens") if hasattr(owner, "get") else None
    if isinstance(embed, (nn.Embedding, nn.QuantizedEmbedding)):
        return embed
    raise GemmdriftError("unsupported architecture: no lm_head linear and no embed_tokens to tie the head to")


def projections(lm, layers: Iterable[int] | None = None, names: Iterable[str] | None = None) -> list[Projection]:
    """Every linear of every decoder layer, then the LM head as layer ``n_layers``.

    Args:
        lm: a :class:`gemmdrift.models.LoadedModel`.
        layers: decoder layer indices to keep (``n_layers`` selects the LM head).
        names: projection names to keep, e.g. ``"self_attn.q_proj"``, ``"q_proj"``
            (the last component suffices) or ``"lm_head"``.

    Raises:
        GemmdriftError: an unknown layer index or projection name.
    """
    linear = _linear_types()
    n_layers = lm.n_layers
    everything: list[Projection] = []
    for i, layer in enumerate(lm.layers):
        for name, mod in layer.named_modules():
            if isinstance(mod, linear) and name:
                parent_name, _, attr = name.rpartition(".")
                parent = layer
                for part in parent_name.split(".") if parent_name else []:
                    parent = parent[part]
                k, n = _dims(mod)
                everything.append(Projection(i, name, k, n, mod, parent, attr))
    head = _head(lm.model)
    k, n = _dims(head)
    everything.append(Projection(n_layers, LM_HEAD, k, n, head, None, None))
    everything.sort(key=lambda p: (p.layer, p.name))
    valid = sorted({p.name for p in everything})

    if layers is not None:
        layers = [int(i) for i in layers]
        bad = [i for i in layers if not 0 <= i <= n_layers]
        if bad:
            raise GemmdriftError(f"unknown layer {bad[0]}: valid are 0..{n_layers - 1} and {n_layers} (the LM head)")
        everything = [p for p in everything if p.layer in set(layers)]
    if names is not None:
        wanted = list(names)
        for w in wanted:
            if not any(v == w or v.rsplit(".", 1)[-1] == w for v in valid):
                raise GemmdriftError(f"unknown projection {w!r} (valid: {', '.join(valid)})")
        everything = [p for p in everything if p.name in wanted or p.name.rsplit(".", 1)[-1] in wanted]
    if not everything:
        raise GemmdriftError("no projection matches both the layers and the names given")
    return everything


# ------------------------------------------------------------------------ inputs


class CapturedInputs(dict):
    """``(layer, name) -> rows`` (float32, exact values of ``dtype``), plus where they came from."""

    def __init__(self, rows: Mapping[tuple[int, str], np.ndarray], *, dtype: str, synthetic: bool, source: str,
                 positions: Mapping[tuple[int, str], list[int]] | None = None):
        super().__init__(rows)
        self.dtype = dtype
        self.synthetic = synthetic
        self.source = source
        self.positions = dict(positions or {})

    def describe(self) -> dict[str, Any]:
        """JSON-ready record for meta.json."""
        return {
            "source": self.source,
            "synthetic": self.synthetic,
            "dtype": self.dtype,
            "rows": {f"{k[0]}:{k[1]}": int(v.shape[0]) for k, v in self.items()},
            "positions": {f"{k[0]}:{k[1]}": v for k, v in self.positions.items()},
            "digest": inputs_digest(self),
        }


def inputs_digest(inputs: Mapping[tuple[int, str], np.ndarray]) -> str:
    """sha256 over every key and the bytes of its rows (identifies a capture)."""
    h = hashlib.sha256()
    for key in sorted(inputs):
        h.update(f"{key[0]}:{key[1]}".encode())
        h.update(np.ascontiguousarray(inputs[key], dtype=np.float32).tobytes())
    return h.hexdigest()


def distinct_rows(rows: np.ndarray, max_rows: int) -> np.ndarray:
    """Indices of up to ``max_rows`` bitwise-distinct rows, evenly spread, in their original order."""
    bits = np.ascontiguousarray(rows, dtype=np.float32).view(np.uint32)
    _, first = np.unique(bits, axis=0, return_index=True)
    keep = np.sort(first)
    if len(keep) > max_rows:
        keep = keep[np.unique(np.linspace(0, len(keep) - 1, max_rows).round().astype(int))]
    return keep


def synthetic_rows(key: tuple[int, str], k: int, n: int, dtype: str, seed: int = INPUT_SEED) -> np.ndarray:
    """``n`` seeded rows of unit RMS, rounded to ``dtype`` (the same for a key on every machine)."""
    rng = np.random.default_rng([seed, key[0], zlib.crc32(key[1].encode())])
    x = rng.standard_normal((n, k))
    x /= np.sqrt(np.mean(x * x, axis=1, keepdims=True))
    # Stored activations are values of the compute dtype: round once, to nearest even.
    return metrics.round_to(x, dtype).astype(np.float32)


class _InputTap:
    """Stands in for a linear during the capture pass: records candidate input rows, then delegates."""

    def __init__(self, module, wanted: int):
        self._module = module
        self._wanted = wanted
        self._offset = 0  # positions seen in earlier calls
        self.seen: list = []

    def __getattr__(self, name):
        return getattr(self._module, name)

    def record(self, x) -> None:
        import mlx.core as mx

        flat = x.reshape(-1, x.shape[-1])
        n = flat.shape[0]
        idx = np.unique(np.linspace(0, n - 1, min(n, self._wanted)).round().astype(np.int64))
        self.seen.append((flat[mx.array(idx)], idx + self._offset))
        self._offset += n

    def __call__(self, x, *args, **kwargs):
        self.record(x)
        return self._module(x, *args, **kwargs)


class _HeadTap(_InputTap):
    """Stands in for the final norm: records its output (the LM head's input), then ends the pass.

    Nothing after the final norm is needed, so the full-vocabulary logits are
    never computed. Ending the pass also avoids handing the head zero rows,
    which crashes mlx 0.32.4's CPU quantized_matmul (integer division by
    M=0 in mlx/backend/cpu/quantized.cpp).
    """

    def __init__(self, norm, wanted: int, record: bool):
        super().__init__(norm, wanted)
        self._record = record

    def __call__(self, x, *args, **kwargs):
        y = self._module(x, *args, **kwargs)
        if self._record:
            self.record(y)
        raise StopForward


def capture_inputs(lm, tokens: Sequence[int], projs: Sequence[Projection], max_rows: int = DEFAULT_MAX_ROWS, *,
                   synthetic: bool | None = None, seed: int = INPUT_SEED) -> CapturedInputs:
    """Real input rows of every projection, from one forward pass over ``tokens``.

    Each linear is replaced in its parent by a recording proxy (the final norm
    too, for the LM head) for the length of one ``lm.model(tokens[None])``
    call with ``make_prompt_cache``; the model is restored in ``finally``.
    Up to ``max_rows`` bitwise-distinct rows per projection are kept, evenly
    spread over the prompt.

    Args:
        lm: the loaded model.
        tokens: the prompt's token ids.
        projs: from :func:`projections`.
        max_rows: distinct rows kept per projection.
        synthetic: use seeded unit-RMS rows instead of running the model
            (default: when the model's weights are synthetic, so that shapes
            as large as Gemma 4 31B never run a forward pass).
        seed: seed of the synthetic rows.
    """
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    if max_rows < 1:
        raise GemmdriftError(f"max_rows must be at least 1, got {max_rows}")
    projs = list(projs)
    dtype = lm.info.get("dtype", "bfloat16")
    if lm.synthetic if synthetic is None else synthetic:
        rows = {p.key: synthetic_rows(p.key, p.in_dims, max_rows, dtype, seed) for p in projs}
        return CapturedInputs(rows, dtype=dtype, synthetic=True, source=f"seeded unit-RMS rows (seed {seed})")
    tokens = np.asarray(tokens, dtype=np.uint32)
    if tokens.ndim != 1 or tokens.size < 1:
        raise GemmdriftError("capture needs a non-empty 1-D list of token ids")
    wanted = CANDIDATES_PER_ROW * max_rows
    owner, norm_name = find_final_norm(lm.model)
    norm = owner[norm_name]
    head_tap = _HeadTap(norm, wanted, record=any(p.is_head for p in projs))
    taps: dict[tuple[int, str], _InputTap] = {}
    try:
        for p in projs:
            if not p.is_head:
                taps[p.key] = p.parent[p.attr] = _InputTap(p.module, wanted)
        owner[norm_name] = head_tap
        for p in projs:
            if p.is_head:
                taps[p.key] = head_tap
        try:
            lm.model(mx.array(tokens)[None], cache=make_prompt_cache(lm.model))
        except StopForward:
            pass
        else:
            raise GemmdriftError("unsupported architecture: the forward pass never reached the final norm")
        mx.eval([[s[0] for s in t.seen] for t in taps.values()])
    finally:
        # Restore even when the forward pass raised, so the model stays usable.
        owner[norm_name] = norm
        for p in projs:
            if not p.is_head:
                p.parent[p.attr] = p.module
    rows, positions, dtypes = {}, {}, set()
    for key, tap in taps.items():
        if not tap.seen:
            raise GemmdriftError(f"layer {key[0]} {key[1]} was never called during the forward pass")
        dtypes.add(storage_dtype_name(tap.seen[0][0].dtype))
        cand = np.concatenate([to_numpy(s[0]) for s in tap.seen])
        pos = np.concatenate([s[1] for s in tap.seen])
        keep = distinct_rows(cand, max_rows)
        rows[key], positions[key] = cand[keep], [int(i) for i in pos[keep]]
    return CapturedInputs(rows, dtype=dtypes.pop() if len(dtypes) == 1 else dtype, synthetic=False,
                          source=f"captured from one forward pass over {tokens.size} tokens", positions=positions)


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


_QUANT_RE = re.compile(r"^([a-z0-9]+)-q(\d+)-g(\d+)$")


def parse_path(text: str) -> PathSpec:
    """Validate a path string (an unavailable quantization mode is a GemmdriftError)."""
    kind, _, arg = str(text).strip().partition(":")
    if kind == "model" and not arg:
        return PathSpec("model", "model")
    if kind == "dense" and arg:
        dtype = parse_dtype(arg)
        return PathSpec(f"dense:{dtype}", "dense", dtype=dtype)
    if kind == "quant":
        m = _QUANT_RE.match(arg)
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


def _quant_of(module) -> Quantization | None:
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

    from .models import SYNTHETIC_SEED, mx_dtype

    key = mx.random.key(zlib.crc32(f"{SYNTHETIC_SEED}:{proj.layer}:{proj.name}".encode()))
    k, n = proj.in_dims, proj.out_dims
    scale = math.sqrt(1.0 / k)
    # Drawn directly in the compute dtype: no float32 copy of a vocabulary-sized matrix.
    dt = mx_dtype(dtype)
    if isinstance(proj.module, (nn.Embedding, nn.QuantizedEmbedding)):
        return mx.random.normal((n, k), dtype=dt, scale=scale, key=key), None  # nn.Embedding's init
    return mx.random.uniform(-scale, scale, (n, k), dtype=dt, key=key), None  # nn.Linear's init


def dense_weights(lm, proj: Projection, dtype: str):
    """(W (N, K), bias or None) of a projection in the compute dtype.

    A quantized module's dense weights are its dequantization (in the dtype of
    its scales, which is the compute dtype).
    """
    import mlx.core as mx

    if lm.info.get("kind") == "shape":
        return _synthetic_dense(proj, dtype)
    mod = proj.module
    bias = mod["bias"] if isinstance(mod, _linear_types()) and "bias" in mod else None
    q = _quant_of(mod)
    if q is None:
        return mod["weight"], bias
    w = mx.dequantize(mod["weight"], mod["scales"], mod.get("biases"), **_quant_kwargs(q))
    return w, bias


class _Operator:
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


def build_operator(lm, proj: Projection, path: PathSpec) -> _Operator:
    """The operands and kernels of ``path`` on ``proj`` (one projection's copies alive at a time)."""
    import mlx.core as mx
    import mlx.nn as nn

    from .models import mx_dtype

    compute = lm.info.get("dtype", "bfloat16")
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
        return _Operator(lin, lin, path.dtype, path.dtype, "", _dense_rows(lin.weight), lin.get("bias"), n, k,
                         _arrays(lin))
    if path.kind == "emulated":
        lin = linear(w, bias)
        out_dt = mx_dtype(compute)
        wf = w.astype(mx.float32)  # exact upcast, made once per projection
        return _Operator(lin, lambda x: split_k(x, wf, bias, path.partitions, out_dt), compute, compute, "",
                         _dense_rows(w), bias, n, k, _arrays(lin) + [wf])
    if path.kind == "quant":
        q = path.quant
        qlin = nn.QuantizedLinear.from_linear(linear(w, bias), **_quant_kwargs(q))
        return _Operator(qlin, qlin, compute, compute, q.label,
                         _quant_rows(qlin["weight"], qlin["scales"], qlin.get("biases"), q), bias, n, k, _arrays(qlin))
    # "model": the module as loaded (a shape model's lazy module is rebuilt from seeded weights).
    mod, q = proj.module, _quant_of(proj.module)
    if lm.info.get("kind") == "shape":
        mod = linear(w, bias) if q is None else nn.QuantizedLinear.from_linear(linear(w, bias), **_quant_kwargs(q))
    run = mod.as_linear if isinstance(mod, (nn.Embedding, nn.QuantizedEmbedding)) else mod
    if q is None:
        return _Operator(run, run, compute, compute, "", _dense_rows(mod["weight"]), bias, n, k, _arrays(mod))
    return _Operator(run, run, compute, compute, q.label,
                     _quant_rows(mod["weight"], mod["scales"], mod.get("biases"), q), bias, n, k, _arrays(mod))


# -------------------------------------------------------------------------- sweep


def _check_ts(ts: Iterable[int]) -> list[int]:
    ts = sorted({int(t) for t in ts})
    if not ts or ts[0] < 1:
        raise GemmdriftError(f"block sizes T must be positive integers, got {ts[:3] if ts else 'none'}")
    return ts


def plan_ts(ts: Iterable[int], flops_per_row: float, n_rows: int, flop_budget: float = DEFAULT_FLOP_BUDGET,
            max_t: int = DEFAULT_MAX_T, always_t: int = DEFAULT_ALWAYS_T) -> list[int]:
    """GEMM block sizes (T >= 2, ascending) that fit the FLOP budget of one projection and path.

    The cost of a plan is one GEMV per distinct row used plus every block;
    sizes are added smallest first until the next one would exceed the
    budget. Sizes up to ``always_t``, and the smallest size, are kept
    whatever the budget. T=1 is the reference and always measured, so it is
    not part of the plan.

    Raises:
        GemmdriftError: a T below 1, or no rows.
    """
    ts = _check_ts(ts)
    if n_rows < 1:
        raise GemmdriftError("no input rows to build blocks from")
    if max_t < 1:
        raise GemmdriftError(f"max_t must be at least 1, got {max_t}")
    plan: list[int] = []
    for t in (t for t in ts if 2 <= t <= max_t):
        cost = flops_per_row * (sum(plan) + t + min(n_rows, t))
        if plan and t > always_t and cost > flop_budget:
            break
        plan.append(t)
    return plan


def _label(proj: Projection, path: PathSpec, op: _Operator, synthetic: bool, inputs: str) -> dict[str, Any]:
    return {"layer": proj.layer, "projection": proj.name, "path": path.text, "dtype": op.out_dtype,
            "quant": op.quant, "emulated": path.emulated, "synthetic": synthetic, "inputs": inputs,
            "K": proj.in_dims, "N": proj.out_dims, "key_length": math.nan}


def block_drift(single: np.ndarray, block: np.ndarray, dtype: str) -> dict[str, float]:
    """Compare a block's rows with the same rows computed alone (metrics.compare plus row counts).

    ``rows_differ`` counts rows that are not bit-identical; ``worst_position``
    is the block index of the row with the largest ULP distance, -1 when
    every row is bit-identical.
    """
    m = metrics.compare(single, block, dtype)
    per_row = metrics.ulp_distance(single, block, dtype).reshape(block.shape[0], -1).max(axis=1)
    m["rows_differ"] = float(np.count_nonzero(per_row))
    m["worst_position"] = float(np.argmax(per_row)) if per_row.max() > 0 else -1.0
    return m


def measure_unit(op: _Operator, rows: np.ndarray, plan: Sequence[int],
                 repeat_t1: bool = True) -> list[tuple[int, dict[str, float]]]:
    """(T, metrics) for T=1 and each GEMM block size of ``plan``.

    One GEMV per distinct row used, then one GEMM per T on rows cycled to T;
    every result is evaluated before it is compared. ``repeat_t1`` adds a
    second GEMV of the first row, compared with the first (determinism).
    """
    import mlx.core as mx

    from .models import mx_dtype

    used = min(len(rows), max(plan)) if plan else len(rows)
    # Captured rows are exact values of the compute dtype; a dense path of another dtype rounds them here.
    x = mx.array(np.asarray(rows[:used], dtype=np.float32)).astype(mx_dtype(op.in_dtype))
    singles = [op.run(x[i:i + 1][None]) for i in range(used)]
    mx.eval(singles)
    y1 = np.concatenate([to_numpy(s[0]) for s in singles])
    exact = op.exact(to_numpy(x))
    first = metrics.error_vs_exact(y1, exact, op.out_dtype)
    if repeat_t1:
        again = op.run(x[:1][None])
        mx.eval(again)
        first = {**block_drift(y1[:1], to_numpy(again[0]), op.out_dtype), **first}
    out = [(1, first)]
    for t in plan:
        idx = np.arange(t) % used
        block = op.run_block(x[mx.array(idx)][None])
        mx.eval(block)
        yb = to_numpy(block[0])
        m = block_drift(y1[idx], yb, op.out_dtype)
        m.update(metrics.error_vs_exact(yb, exact[idx], op.out_dtype))
        out.append((t, m))
    return out


def _unit_file(checkpoint: Path, proj: Projection, path: PathSpec) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{proj.layer:04d}__{proj.name}__{path.text}")
    return checkpoint / "units" / f"{safe}.csv"


def _read_unit(path: Path) -> pd.DataFrame | None:
    """A finished unit from the checkpoint; None (after a warning) when the file is corrupt."""
    try:
        saved = pd.read_csv(path, dtype={"quant": str, "path": str, "projection": str})
        missing = [c for c in ("layer", "projection", "path", "T", "metric", "value") if c not in saved.columns]
        if missing or saved.empty or not pd.api.types.is_numeric_dtype(saved["value"]):
            raise ValueError(f"missing columns {missing}" if missing else "no numeric rows")
    except (OSError, UnicodeDecodeError, ValueError) as e:
        files.discard_checkpoint(path, str(e)[:80])
        return None
    return saved.assign(quant=saved["quant"].fillna("") if "quant" in saved else "")


def _open_checkpoint(checkpoint: Path, config: dict[str, Any]) -> None:
    """Create the checkpoint record, or check that an existing one belongs to the same sweep."""
    record = checkpoint / "sweep.json"
    if record.exists():
        try:
            saved = json.loads(record.read_text())
            if not isinstance(saved, dict):
                raise ValueError(f"a {type(saved).__name__}, not an object")
        except (OSError, UnicodeDecodeError, ValueError) as e:
            # Without its record nobody can tell which sweep the units belong to: start afresh.
            files.discard_checkpoint(checkpoint / "units", f"its record {record.name} is unreadable: {e}")
            files.write_json(record, config)
            return
        if saved != json.loads(files.to_json(config)):  # compared as written: tuples become lists
            now = json.loads(files.to_json(config))
            diff = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
            raise GemmdriftError(f"checkpoint {checkpoint} belongs to another sweep (differs in {', '.join(diff)}); "
                                 "use a new directory")
        return
    files.write_json(record, config)


def sweep(lm, inputs: Mapping[tuple[int, str], np.ndarray], projs: Sequence[Projection],
          paths: Sequence[str] = DEFAULT_PATHS, ts: Iterable[int] = DEFAULT_TS, *, max_t: int = DEFAULT_MAX_T,
          flop_budget: float = DEFAULT_FLOP_BUDGET, always_t: int = DEFAULT_ALWAYS_T,
          checkpoint: str | Path | None = None) -> pd.DataFrame:
    """GEMV against GEMM for every projection and path, as a tidy table.

    Args:
        lm: the loaded model.
        inputs: rows per projection key, from :func:`capture_inputs`.
        projs: from :func:`projections`.
        paths: path strings (see the module docstring).
        ts: block sizes; T=1 is always measured as the reference (its error
            metrics); listing 1 adds the T=1 determinism check.
        max_t: largest block size.
        flop_budget: FLOPs per (projection, path); see :func:`plan_ts`.
        always_t: block sizes measured whatever the budget; see :func:`plan_ts`.
        checkpoint: a directory where each finished (layer, projection, path)
            is saved; units found there are loaded instead of recomputed, so
            an interrupted sweep resumes.

    Returns:
        :data:`TABLE_COLUMNS`: layer, projection, path, dtype, quant,
        emulated, synthetic, inputs ('captured', 'synthetic' or 'given'), K,
        N, key_length (NaN here), T, metric, value.
    """
    import mlx.core as mx
    from tqdm.auto import tqdm

    specs = [parse_path(p) for p in paths]
    ts = _check_ts(ts)
    for p in projs:
        if p.key not in inputs or len(inputs[p.key]) == 0:
            raise GemmdriftError(f"no input rows for layer {p.layer} {p.name}")
        if inputs[p.key].shape[-1] != p.in_dims:
            raise GemmdriftError(f"input rows of layer {p.layer} {p.name} have {inputs[p.key].shape[-1]} columns, "
                                 f"the projection takes {p.in_dims}")
    synthetic = bool(lm.synthetic or getattr(inputs, "synthetic", False))
    kind = {True: "synthetic", False: "captured", None: "given"}[getattr(inputs, "synthetic", None)]
    ckpt = Path(checkpoint) if checkpoint is not None else None
    if ckpt is not None:
        _open_checkpoint(ckpt, {"model": lm.info.get("source"), "dtype": lm.info.get("dtype"),
                                "quantization": lm.info.get("quantization"), "ts": ts, "max_t": max_t,
                                "flop_budget": flop_budget, "always_t": always_t, "inputs": inputs_digest(inputs)})
    frames: list[pd.DataFrame] = []
    units = [(p, s) for p in projs for s in specs]
    bar = tqdm(units, desc="kernels", unit="unit", file=sys.stderr, disable=None, mininterval=1.0, leave=False)
    try:
        for proj, spec in bar:
            bar.set_postfix_str(f"{proj.layer}:{proj.name} {spec.text}", refresh=False)
            unit_file = _unit_file(ckpt, proj, spec) if ckpt is not None else None
            if unit_file is not None and unit_file.exists():
                saved = _read_unit(unit_file)
                if saved is not None:
                    frames.append(saved)
                    continue
            rows = inputs[proj.key]
            plan = plan_ts(ts, proj.flops_per_row, len(rows), flop_budget, max_t, always_t)
            op = build_operator(lm, proj, spec)
            labels = _label(proj, spec, op, synthetic, kind)
            measured = measure_unit(op, rows, plan, repeat_t1=1 in ts)
            del op  # one projection's weights and quantized copies alive at a time
            mx.clear_cache()
            frame = pd.DataFrame([{**labels, "T": t, "metric": k, "value": float(v)}
                                  for t, m in measured for k, v in m.items()])
            if unit_file is not None:
                files.write_csv(unit_file, frame)
            frames.append(frame)
    finally:
        bar.close()
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=TABLE_COLUMNS)


# ---------------------------------------------------------------------- other ops


def _attention_geometries(lm) -> list[tuple[int, Any]]:
    """(layer index, attention module) for the first layer of each distinct geometry."""
    seen, out = set(), []
    for i, layer in enumerate(lm.layers):
        attn = layer.get("self_attn") if hasattr(layer, "get") else None
        if attn is None or not all(hasattr(attn, a) for a in ("n_heads", "n_kv_heads", "head_dim", "scale", "rope")):
            continue
        rope = attn.rope
        geom = (attn.n_heads, attn.n_kv_heads, attn.head_dim, float(attn.scale), type(rope).__name__,
                json.dumps({k: v for k, v in vars(rope).items() if isinstance(v, (int, float, bool, str))},
                           sort_keys=True))
        if geom not in seen:
            seen.add(geom)
            out.append((i, attn))
    if not out:
        raise GemmdriftError("cannot read the attention geometry (n_heads, n_kv_heads, head_dim, scale, rope) "
                             "of this architecture")
    return out


def _seeded(shape: tuple[int, ...], dtype: str, seed: int, salt: str) -> np.ndarray:
    rng = np.random.default_rng([seed, zlib.crc32(salt.encode())])
    # Stored activations are values of the compute dtype: round once, to nearest even.
    return metrics.round_to(rng.standard_normal(shape), dtype).astype(np.float32)


def _alone_and_blocks(alone: Callable[[int], Any], block: Callable[[int], Any], lmax: int, qls: Sequence[int],
                      rows_of: Callable[[np.ndarray], np.ndarray]):
    """Yield (L, rows computed alone, the same rows from one block of L) for every query length L.

    ``alone(j)`` computes query j of the largest block by itself, ``block(L)``
    the last L queries together; ``rows_of`` puts the query axis first.
    """
    import mlx.core as mx

    singles = [alone(j) for j in range(lmax)]
    mx.eval(singles)
    single = np.stack([rows_of(to_numpy(a))[0] for a in singles])
    for ql in (q for q in qls if q <= lmax):
        out = block(ql)
        mx.eval(out)
        yield ql, single[lmax - ql:], rows_of(to_numpy(out))


def ops_sweep(lm, *, ops: Sequence[str] = OP_NAMES, query_lengths: Iterable[int] = DEFAULT_QUERY_LENGTHS,
              key_lengths: Iterable[int] = DEFAULT_KEY_LENGTHS, seed: int = INPUT_SEED) -> pd.DataFrame:
    """Row invariance of the non-matmul ops whose shape changes between decode and verification.

    For each query length L and key length kL, a block of L queries at
    positions kL-L .. kL-1 (one forward pass of verification) is compared
    row by row with each query computed alone, as decoding computes it:

    * ``sdpa``: mx.fast.scaled_dot_product_attention with the model's heads,
      KV heads, head dim and scale; alone: keys 0..p, no mask (what mlx-lm's
      KVCache gives at T=1); block: all kL keys with the mask mlx-lm's
      ``create_attention_mask`` makes (``mask=causal``: the string,
      ``mask=array``: the boolean array). Sliding windows are not applied:
      this isolates the op, not the cache layout.
    * ``softmax``: mx.softmax(precise=True) as the unfused attention applies
      it: a row of p+1 scores alone, zero-padded to kL, vs the same row
      inside the block with the later scores masked (their probabilities
      must come out exactly 0).
    * ``rope``: the layer's own RoPE at offset p alone vs inside a block
      starting at kL-L.
    * ``rms_norm``: the layer's input RMSNorm on one row vs a block.

    Inputs are seeded (``inputs='synthetic'``); ``layer`` is the first layer
    of each distinct attention geometry, ``key_length`` is kL, ``K`` the
    length of the rows compared (head dim, kL for softmax, hidden size).

    Args:
        lm: the loaded model (only its attention geometry, RoPE and norms are used).
        ops: a subset of :data:`OP_NAMES`.
        query_lengths: block sizes L (T in the table).
        key_lengths: key lengths kL.
        seed: seed of the inputs.
    """
    import mlx.core as mx
    from mlx_lm.models.cache import create_attention_mask

    from .models import mx_dtype

    bad = [o for o in ops if o not in OP_NAMES]
    if bad:
        raise GemmdriftError(f"unknown op {bad[0]!r} (choose from {', '.join(OP_NAMES)})")
    qls = sorted({int(q) for q in query_lengths})
    kls = sorted({int(k) for k in key_lengths})
    if not qls or qls[0] < 1 or not kls or kls[0] < 1:
        raise GemmdriftError("query and key lengths must be positive integers")
    dtype = lm.info.get("dtype", "bfloat16")
    dt = mx_dtype(dtype)
    rows: list[dict] = []
    heads_first = lambda a: a[0].transpose(1, 0, 2)  # noqa: E731  (1, H, L, D) -> (L, H, D)

    def seeded(shape, salt):
        return mx.array(_seeded(shape, dtype, seed, salt)).astype(dt)

    def add(layer, op, variant, width, k_len, results, heads=(math.nan, math.nan)):
        labels = {"layer": layer, "projection": op, "path": variant, "dtype": dtype, "quant": "",
                  "emulated": False, "synthetic": True, "inputs": "synthetic", "K": width, "N": math.nan,
                  "key_length": k_len, "heads": heads[0], "kv_heads": heads[1]}
        for ql, single, block in results:
            rows.extend({**labels, "T": ql, "metric": k, "value": float(v)}
                        for k, v in block_drift(single, block, dtype).items())

    for li, attn in _attention_geometries(lm):
        h, hkv, d, scale = attn.n_heads, attn.n_kv_heads, attn.head_dim, attn.scale
        for k_len in kls:
            lmax = min(max(qls), k_len)
            p0 = k_len - lmax  # position of the first query of the largest block
            salt = f"{li}:{k_len}"
            if "sdpa" in ops:
                q, k, v = seeded((1, h, lmax, d), "q" + salt), *(seeded((1, hkv, k_len, d), c + salt) for c in "kv")
                for variant, as_array in (("mask=causal", False), ("mask=array", True)):
                    add(li, "sdpa", variant, d, k_len, heads=(h, hkv), results=_alone_and_blocks(
                        lambda j: mx.fast.scaled_dot_product_attention(
                            q[:, :, j:j + 1], k[:, :, :p0 + j + 1], v[:, :, :p0 + j + 1], scale=scale, mask=None),
                        lambda L, a=as_array: mx.fast.scaled_dot_product_attention(
                            q[:, :, lmax - L:], k, v, scale=scale,
                            mask=create_attention_mask(L, k_len - L, return_array=a, window_size=None)),
                        lmax, qls, heads_first))
            if "softmax" in ops:
                scores = seeded((1, h, lmax, k_len), "s" + salt)

                def masked_softmax(L):
                    mask = create_attention_mask(L, k_len - L, return_array=True, window_size=None)
                    blk = scores[:, :, lmax - L:]
                    # As the unfused attention masks: the dtype's lowest finite value (mlx/fast.cpp).
                    return mx.softmax(blk if mask is None else mx.where(mask, blk, mx.finfo(dt).min), axis=-1,
                                      precise=True)

                add(li, "softmax", "masked", k_len, k_len, _alone_and_blocks(
                    lambda j: mx.pad(mx.softmax(scores[:, :, j:j + 1, :p0 + j + 1], axis=-1, precise=True),
                                     [(0, 0), (0, 0), (0, 0), (0, lmax - 1 - j)]),
                    masked_softmax, lmax, qls, heads_first))
            if "rope" in ops:
                x = seeded((1, h, lmax, d), "r" + salt)
                add(li, "rope", "offset", d, k_len, _alone_and_blocks(
                    lambda j: attn.rope(x[:, :, j:j + 1], offset=p0 + j),
                    lambda L: attn.rope(x[:, :, lmax - L:], offset=k_len - L), lmax, qls, heads_first))
        norm = lm.layers[li].get("input_layernorm")
        if "rms_norm" in ops and norm is not None:
            hidden, lmax = int(norm["weight"].shape[-1]), max(qls)
            x = seeded((1, lmax, hidden), f"n{li}")
            add(li, "rms_norm", "input_layernorm", hidden, math.nan, _alone_and_blocks(
                lambda j: norm(x[:, j:j + 1]), lambda L: norm(x[:, lmax - L:]), lmax, qls, lambda a: a[0]))
    return pd.DataFrame(rows, columns=TABLE_COLUMNS)


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

    from .models import mx_dtype

    if t < 1:
        raise GemmdriftError(f"block size must be at least 1, got {t}")
    spec = parse_path(path)
    op = build_operator(lm, proj, spec)
    if rows is None:
        rows = synthetic_rows(proj.key, proj.in_dims, min(t, DEFAULT_MAX_ROWS), lm.info.get("dtype", "bfloat16"))
    x = mx.array(np.asarray(rows, np.float32)[np.arange(t) % len(rows)][None]).astype(mx_dtype(op.in_dtype))
    run = op.run if t == 1 else op.run_block
    mx.eval(x, op.arrays)

    def body() -> None:
        mx.eval(run(x))

    return body


# ----------------------------------------------------------------------- results


def worst_over_t(df: pd.DataFrame, metric: str = "max_ulp") -> pd.DataFrame:
    """Per path, layer and projection: the worst value of ``metric`` over T (and the first T where it is > 0)."""
    t = df[(df["metric"] == metric)]
    if t.empty:
        return pd.DataFrame(columns=["path", "emulated", "layer", "projection", "worst", "first_T"])
    keys = ["path", "emulated", "layer", "projection"]
    worst = t.groupby(keys, sort=False)["value"].max().rename("worst")
    first = t[t["value"] > 0].groupby(keys, sort=False)["T"].min().rename("first_T").astype(float)
    return worst.to_frame().join(first).reset_index()


def is_op(df: pd.DataFrame) -> pd.Series:
    return df["projection"].isin(OP_NAMES)


def normalize(df: pd.DataFrame) -> pd.DataFrame:
    """The table as :func:`sweep` makes it, also after a CSV round trip (where "" became NaN)."""
    return df.assign(quant=df["quant"].astype(object).fillna("").astype(str), emulated=df["emulated"].astype(bool),
                     synthetic=df["synthetic"].astype(bool))


def plot_thresholds(df: pd.DataFrame, env: Mapping[str, Any],
                    chip: str | None = None) -> tuple[dict[str, list[tuple[int, str, str]]], str]:
    """Dispatch switches per projection name for the backend and mlx version of ``env``, and their origin.

    On the CPU (row-invariant, no thresholds) Metal's are returned instead,
    labelled "Metal (reference)". Emulated paths get none: they are no kernel.

    Returns:
        ``{projection: [(T, kernel, op), ...]}`` (T >= 2) and a description
        such as "Metal (reference), M3 Max, mlx 0.32.4".
    """
    from .dispatch import thresholds

    target, version, chip, origin = _reference_backend(env, chip)
    df = normalize(df)
    proj = df[~is_op(df) & ~df["emulated"]]
    out: dict[str, list[tuple[int, str, str]]] = {}
    for name, s in proj.groupby("projection", sort=False):
        k, n, max_t = int(s["K"].iloc[0]), int(s["N"].iloc[0]), int(s["T"].max())
        marks: set[tuple[int, str, str]] = set()
        for _, row in s.drop_duplicates(["path"]).iterrows():
            if row["quant"]:
                mode, bits, group = _QUANT_RE.match(row["quant"]).groups()
                op, shape = "quantized_matmul", {"mode": mode, "bits": int(bits), "group_size": int(group)}
            else:
                op, shape = "matmul", {"dtype": row["dtype"]}
            found = thresholds(target, version, op, chip=chip, max_t=max_t, K=k, N=n, **shape)
            marks |= {(th.T, th.label, op) for th in found if th.T > 1}
        out[name] = sorted(marks)
    return out, origin


def _reference_backend(env: Mapping[str, Any], chip: str | None) -> tuple[str, str, str, str]:
    """(backend whose dispatch rules apply, mlx version, chip, description) for the recorded ``env``:
    its own on Metal and CUDA; Metal's, labelled "Metal (reference)", on the CPU (which never switches)."""
    from .dispatch import DEFAULT_CHIP

    backend = env.get("backend") or "cpu"
    version = env.get("mlx") or "0"
    target = backend if backend in ("metal", "cuda") else "metal"
    chip = chip or DEFAULT_CHIP[target]
    origin = {"metal": "Metal", "cuda": "CUDA"}[target] if target == backend else "Metal (reference)"
    return target, version, chip, f"{origin}, {chip}, mlx {version}"


def ops_thresholds(df: pd.DataFrame, env: Mapping[str, Any],
                   chip: str | None = None) -> tuple[dict[str, list[tuple[int, str, str]]], str]:
    """Like :func:`plot_thresholds`, for the ops table: where the sdpa kernel changes with the query length.

    One set of switches per attention geometry (head dim, heads, KV heads) and
    key length in the table; only sdpa has a dispatch that depends on T.
    """
    from .dispatch import thresholds

    target, version, chip, origin = _reference_backend(env, chip)
    ops = df[is_op(df)]
    sdpa = ops[ops["projection"] == "sdpa"] if "heads" in ops.columns else ops.iloc[:0]
    marks: set[tuple[int, str, str]] = set()
    for (d, h, hkv, k_len), s in sdpa.groupby(["K", "heads", "kv_heads", "key_length"]):
        found = thresholds(target, version, "sdpa", chip=chip, max_t=int(s["T"].max()), k_len=int(k_len),
                           head_dim=int(d), n_heads=int(h), n_kv_heads=int(hkv))
        marks |= {(th.T, th.label, "sdpa") for th in found if th.T > 1}
    return ({"sdpa": sorted(marks)} if marks else {}), origin


# ------------------------------------------------------------------ the Result


def kernel_figures(df: pd.DataFrame) -> dict[str, float]:
    """The tracked figures of a kernel table.

    Per path and T (the worst over the probed projections): ``bits_lost/<path>/<T>``
    (log2(1 + max ULP) between a row inside a T-row block and the same row alone),
    ``rows_differ/<path>/<T>`` (summed over projections) and ``err_rel_l2/<path>/<T>``
    (against float64). Per op: ``ops_bits_lost/<op>`` over every query and key length.
    """
    from .result import figure_name

    df = normalize(df)
    out: dict[str, float] = {}
    proj = df[~is_op(df)]
    for (path, t), s in proj.groupby(["path", "T"]):
        m = {k: g["value"] for k, g in s.groupby("metric")}
        if "max_ulp" in m:
            out[figure_name("bits_lost", path, int(t))] = metrics.bits_lost(float(m["max_ulp"].max()))
        if "rows_differ" in m:
            out[figure_name("rows_differ", path, int(t))] = float(m["rows_differ"].sum())
        if "err_rel_l2" in m:
            out[figure_name("err_rel_l2", path, int(t))] = float(m["err_rel_l2"].max())
    ops = df[is_op(df)]
    for op, s in ops[ops["metric"] == "max_ulp"].groupby("projection"):
        out[figure_name("ops_bits_lost", op)] = metrics.bits_lost(float(s["value"].max()))
    return {k: v for k, v in out.items() if math.isfinite(v)}


def kernels_result(df: pd.DataFrame, inputs: Mapping[str, Any], env: Mapping[str, Any]):
    """The ``kernels`` Result of a table from :func:`sweep` (and :func:`ops_sweep`), as measured or read back."""
    from .result import Result, env_labels, tidy

    df = normalize(df) if len(df) else pd.DataFrame(columns=TABLE_COLUMNS)
    model = inputs.get("model") or {}
    frame = tidy(df.rename(columns={"path": "pair", "projection": "tap", "key_length": "key_length"})
                 .assign(mode=df["path"].map(lambda p: "emulated" if str(p).startswith("emulated") else "real")
                         if len(df) else []),
                 **env_labels(env), model=model.get("source", "") if isinstance(model, dict) else str(model))
    return Result(kind="kernels", inputs=dict(inputs), env=dict(env), frame=frame, figures=kernel_figures(df),
                  tables={"kernels": df})


def measure_kernels(lm, inputs: Mapping[tuple[int, str], np.ndarray], projs: Sequence[Projection],
                    paths: Sequence[str] = DEFAULT_PATHS, ts: Iterable[int] = DEFAULT_TS, *, ops: bool = False,
                    record: Mapping[str, Any] | None = None, env: Mapping[str, Any] | None = None, **kw):
    """The kernel measurement as a Result: :func:`sweep` (and with ``ops``, :func:`ops_sweep`).

    Args:
        record: more inputs to record beside the model, paths and T (prompt, tokens, ...).
        env: the environment record (default: taken now).
        **kw: passed to :func:`sweep` (max_t, flop_budget, always_t, checkpoint).
    """
    from .envinfo import environment

    env = dict(env) if env is not None else environment()
    ts = list(ts)
    df = sweep(lm, inputs, projs, paths, ts, **kw)
    if ops:
        df = pd.concat([df, ops_sweep(lm)], ignore_index=True)
    rec = {"model": lm.info, "paths": list(paths), "ts": ts, **(record or {})}
    if hasattr(inputs, "describe") and "rows" not in rec:
        rec["rows"] = inputs.describe()
    return kernels_result(df, rec, env)


def measure_ops(lm, *, env: Mapping[str, Any] | None = None, **kw):
    """:func:`ops_sweep` alone as a ``kernels`` Result (``**kw`` passed on: ops, query_lengths, key_lengths)."""
    from .envinfo import environment

    env = dict(env) if env is not None else environment()
    rec = {"model": lm.info, **{k: list(v) for k, v in kw.items()}}
    return kernels_result(ops_sweep(lm, **kw), rec, env)
