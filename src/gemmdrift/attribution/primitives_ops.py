"""The one-second gate's calls: each op as a T-row block call and as single-row calls, on seeded operands, and the
byte comparison of the two (see :mod:`gemmdrift.attribution.primitives`).

What is called, per kind of op (the calls mlx-lm's layers make):

* ``linear``: ``x @ W.T`` (``mx.addmm`` with a bias), or ``mx.quantized_matmul(x, Wq, scales, biases,
  transpose=True, ...)`` for a quantized one: mlx's ``nn.Linear`` / ``nn.QuantizedLinear`` ``__call__``
  (``python/mlx/nn/layers/linear.py``, ``quantized.py``), on a (1, T, K) input.
* ``norm``: the model's own norm module (its ``mx.fast.rms_norm`` call, Gemma's ``1 + weight`` included) with a
  seeded weight, on (1, T, D) rows, per head (1, T, heads, D) for the attention's q/k/v norms.
* ``rope``: the layer's own RoPE module (``mx.fast.rope``), (1, heads, T, D) at offset ``prefix``; position t
  alone at offset ``prefix + t``.
* ``sdpa``: ``mx.fast.scaled_dot_product_attention`` with the layer's heads, KV heads, head dim and scale, over a
  small cache of ``prefix`` keys: the block with ``mask="causal"`` (what mlx-lm's ``create_attention_mask`` gives a
  multi-token step below the window), position t alone over keys 0..prefix+t with no mask (a decode step).

``kernels="replay:<chip>[@variant]"`` computes the linears with that chip's recipe instead (a prediction:
:mod:`gemmdrift.replay.paths`, T chosen per call as the chip's dispatch would), the other ops natively.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import GemmdriftError
from ..metrics import differing_bytes, storage_bits
from .primitives_operands import SEED, Op, seeded, to_mx, weight_std

_UINT = {2: "uint16", 4: "uint32", 1: "uint8", 8: "uint64"}


@dataclass(frozen=True)
class Probe:
    """``single(t)``: position t computed alone; ``block(T)``: positions 0..T-1 in one call; both with the
    positions along ``axis``. Outputs are mlx arrays, or numpy arrays of storage bits (a replayed linear)."""

    single: Callable[[int], Any]
    block: Callable[[int], Any]
    axis: int
    kernels: str = "native"


def storage(a: Any) -> np.ndarray:
    """An output's storage bits as numpy (the bytes the device wrote): mlx arrays are viewed as unsigned words of
    their own width, numpy arrays are taken as they are."""
    if isinstance(a, np.ndarray):
        return a
    import mlx.core as mx

    return np.array(a.view(getattr(mx, _UINT[a.itemsize])), copy=True)


# ------------------------------------------------------------------------------------------------ probes


def _linear_operands(op: Op, dtype: str, width: int, seed: int):
    K, N = op.shape["K"], op.shape["N"]
    x = seeded((width, K), dtype, f"x:{op.name}:{K}", seed=seed)
    w = seeded((N, K), dtype, f"w:{op.name}:{K}x{N}", std=weight_std(K), seed=seed)
    b = seeded((N,), dtype, f"b:{op.name}:{N}", seed=seed) if op.params.get("bias") else None
    return x, w, b


def _quantize(w, q):
    """mx.quantize on the CPU stream: the same packed weight, scales and biases whichever device computes."""
    import mlx.core as mx

    with mx.stream(mx.cpu):
        kw = {} if q["mode"] == "affine" else {"mode": q["mode"]}
        out = mx.quantize(w, group_size=q["group_size"], bits=q["bits"], **kw)
        mx.eval(out)
    wq, scales = out[0], out[1]
    biases = out[2] if len(out) > 2 else None
    return wq, scales, biases


def linear_probe(op: Op, dtype: str, width: int, seed: int = SEED) -> Probe:
    import mlx.core as mx

    x_np, w_np, b_np = _linear_operands(op, dtype, width, seed)
    x = to_mx(x_np, dtype)[None]  # (1, width, K)
    w = to_mx(w_np, dtype)
    bias = None if b_np is None else to_mx(b_np, dtype)
    q = op.quant
    if q:
        wq, scales, biases = _quantize(w, q)
        kw = {} if q["mode"] == "affine" else {"mode": q["mode"]}

        def fn(xs):
            y = mx.quantized_matmul(xs, wq, scales=scales, biases=biases, transpose=True, group_size=q["group_size"],
                                    bits=q["bits"], **kw)
            return y if bias is None else y + bias
    else:
        def fn(xs):
            return xs @ w.T if bias is None else mx.addmm(bias, xs, w.T)

    return Probe(lambda t: fn(x[:, t:t + 1]), lambda T: fn(x[:, :T]), axis=1)


def replay_linear_probe(op: Op, dtype: str, width: int, kernels: str, seed: int = SEED) -> Probe:
    """The linear as ``kernels`` (``replay:<chip>[@variant]``) computes it: the recipe the chip dispatches at each
    call's T, on the same operands (a prediction for that chip, not a measurement)."""
    import mlx.core as mx

    from ..replay.paths import parse_chip, plan_for, run_plan

    chip, _, variant = kernels.partition(":")[2].partition("@")
    parse_chip(chip)
    x_np, w_np, b_np = _linear_operands(op, dtype, width, seed)
    K, N = op.shape["K"], op.shape["N"]
    q = op.quant
    kw: dict[str, Any] = {"w": w_np, "bias": b_np}
    if q:
        if q["mode"] != "affine" or b_np is not None:
            raise GemmdriftError(f"{op.name}: replay has recipes for affine quantized linears without a bias only")
        wq, scales, biases = _quantize(to_mx(w_np, dtype), q)
        as32 = lambda a: np.array(a.astype(mx.float32))  # noqa: E731  (scales and biases are values of the dtype)
        kw = {"quant": (np.array(wq), as32(scales), as32(biases), q["bits"], q["group_size"])}

    def call(xs: np.ndarray) -> np.ndarray:
        T = xs.shape[0]
        plan = plan_for(chip, "quantized_matmul" if q else "matmul", T=T, K=K, N=N, dtype=dtype,
                        bits=q["bits"] if q else None, group_size=q["group_size"] if q else None,
                        variant=variant or None)
        y = run_plan(plan, xs, dtype=dtype, **kw).y
        return storage_bits(y, dtype)[0][None]  # (1, T, N) storage words

    return Probe(lambda t: call(x_np[t:t + 1]), lambda T: call(x_np[:T]), axis=1, kernels=f"{kernels} (prediction)")


def norm_probe(op: Op, dtype: str, width: int, seed: int = SEED) -> Probe:
    D, heads = op.shape["D"], op.shape.get("heads")
    shape = (1, width, heads, D) if heads else (1, width, D)
    x = to_mx(seeded(shape, dtype, f"x:{op.name}:{D}:{heads}", seed=seed), dtype)
    mod = op.module
    if op.params.get("weight"):
        # The module is the gate's own (an instantiated, never loaded model): a seeded weight replaces its initial one.
        mod.weight = to_mx(seeded((D,), dtype, f"w:{op.name}:{D}", seed=seed), dtype)
    if op.shape.get("layout") == "HTD":  # (1, T, H, D) transposed to (1, H, T, D), as Gemma 3's attention calls it
        return Probe(lambda t: mod(x[:, t:t + 1].transpose(0, 2, 1, 3)),
                     lambda T: mod(x[:, :T].transpose(0, 2, 1, 3)), axis=2)
    return Probe(lambda t: mod(x[:, t:t + 1]), lambda T: mod(x[:, :T]), axis=1)


def rope_probe(op: Op, dtype: str, width: int, seed: int = SEED) -> Probe:
    h, d, p0 = op.shape["heads"], op.shape["D"], op.shape["offset"]
    x = to_mx(seeded((1, h, width, d), dtype, f"x:rope:{h}:{d}", seed=seed), dtype)
    rope = op.module
    return Probe(lambda t: rope(x[:, :, t:t + 1], offset=p0 + t), lambda T: rope(x[:, :, :T], offset=p0), axis=2)


def sdpa_probe(op: Op, dtype: str, width: int, seed: int = SEED) -> Probe:
    import mlx.core as mx

    h, kv, d, p0 = op.shape["heads"], op.shape["kv_heads"], op.shape["D"], op.shape["keys"]
    scale = float(op.params["scale"])
    salt = f"{h}:{kv}:{d}:{p0}"
    # Queries scaled so that the scores (scale * q.k) have unit variance: a softmax neither flat nor one-hot.
    q = to_mx(seeded((1, h, width, d), dtype, "q:" + salt, std=1.0 / (scale * math.sqrt(d)), seed=seed), dtype)
    k, v = (to_mx(seeded((1, kv, p0 + width, d), dtype, c + ":" + salt, seed=seed), dtype) for c in "kv")
    sdpa = mx.fast.scaled_dot_product_attention

    def single(t):
        n = p0 + t + 1
        return sdpa(q[:, :, t:t + 1], k[:, :, :n], v[:, :, :n], scale=scale, mask=None)

    def block(T):
        n = p0 + T
        return sdpa(q[:, :, :T], k[:, :, :n], v[:, :, :n], scale=scale, mask="causal" if T > 1 else None)

    return Probe(single, block, axis=2)


def probe_for(op: Op, dtype: str, width: int, *, kernels: str | None = None, seed: int = SEED) -> Probe:
    if op.kind == "linear":
        if kernels:
            return replay_linear_probe(op, dtype, width, kernels, seed)
        return linear_probe(op, dtype, width, seed)
    return {"norm": norm_probe, "rope": rope_probe, "sdpa": sdpa_probe}[op.kind](op, dtype, width, seed)


# ------------------------------------------------------------------------------------------------ comparing


def _eval(outs: list) -> None:
    import mlx.core as mx

    live = [o for o in outs if not isinstance(o, np.ndarray)]
    if live:
        mx.eval(live)


def parity(probe: Probe, ts: Sequence[int]) -> list[dict[str, Any]]:
    """Per T: the block of T rows against the first T single calls, byte for byte.

    Returns one dict per T: ``T``, ``equal``, ``differing_bytes`` (a list, one count per position),
    ``bytes_per_position``, ``out_dtype``.
    """
    width = max(ts)
    singles = [probe.single(t) for t in range(width)]
    _eval(singles)
    chain = np.concatenate([storage(s) for s in singles], axis=probe.axis)
    rows = []
    for T in ts:
        blk = probe.block(T)
        _eval([blk])
        dtype = str(getattr(blk, "dtype", "")).replace("mlx.core.", "") if not isinstance(blk, np.ndarray) else ""
        b = storage(blk)
        c = np.take(chain, np.arange(T), axis=probe.axis)
        if b.shape != c.shape:
            raise GemmdriftError(f"the block of T={T} has shape {b.shape}, the single calls {c.shape}")
        counts = differing_bytes(b, c, axis=probe.axis)
        rows.append({"T": int(T), "equal": bool(not counts.any()), "differing_bytes": [int(n) for n in counts],
                     "bytes_per_position": int(b.nbytes // T), "out_dtype": dtype})
    return rows


__all__ = ["Probe", "storage", "linear_probe", "replay_linear_probe", "norm_probe", "rope_probe", "sdpa_probe",
           "probe_for", "parity"]
