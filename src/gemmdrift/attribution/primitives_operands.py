"""The one-second gate's operands: a model's decoder-layer ops at its own shapes, read from its config alone, and the
portable seeded operands they are called on (see :mod:`gemmdrift.attribution.primitives`).

The config comes from an mlx-lm checkpoint directory (``config.json``; the weights are never read), the embedded
Gemma (its GGUF's metadata, or the converted cache's config), a ``shape:NAME`` preset (:data:`gemmdrift.model.SHAPES`)
or a config mapping an engine already holds. The architecture is mlx-lm's own class for the config's
``model_type``, instantiated with lazy (never evaluated) parameters, so the ops are the modules a loaded model
has, named by their module path (``self_attn.q_proj``, ``mlp.down_proj``, ``input_layernorm``, ...): nothing about
an architecture is written out here. Quantization is the config's ``quantization`` block as mlx-lm's loader reads
it (``mlx_lm/utils.py``, ``load_model``: a per-path entry overrides the defaults, ``false`` leaves a module dense);
a module whose input size is not a multiple of the group size stays dense, as ``quantize_model`` leaves it.

Operands are drawn with numpy's ``Generator`` (PCG64), seeded per op and shape (never by call order), rounded to
the compute dtype on the host, so every machine computes on the same bits; quantized weights are quantized on the
CPU stream for the same reason. ``mx.random`` is never used for operands: its values differ across chips.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from ..errors import GemmdriftError

SEED = 1165  # the operands' seed (lablup/mlxcel's default seed for the same question)
PREFIX = 64  # keys already in the cache before the block: a small cache, below any sliding window
LM_HEAD_ROWS = 4096  # the LM head is sliced to its first rows by default (262,144 rows cost seconds on a CPU)
KINDS = ("linear", "norm", "rope", "sdpa")


@dataclass(frozen=True)
class Op:
    """One op of a decoder layer at one shape: what the gate calls as a T-row block and as T single rows.

    ``name`` is the module path inside a layer (``self_attn.q_proj``), or ``lm_head`` / ``norm`` (the final
    norm), ``rope`` and ``sdpa`` (the attention core); ``layers`` are the decoder layers with this very op and
    shape (-1: the model's head). ``quant`` is None (dense) or {bits, group_size, mode}.
    """

    name: str
    kind: str  # linear | norm | rope | sdpa
    layers: tuple[int, ...]
    shape: Mapping[str, Any]  # K, N (linear); D, heads (norm); heads, D (rope); heads, kv_heads, D, keys (sdpa)
    quant: Mapping[str, Any] | None = None
    module: Any = field(default=None, compare=False, repr=False)  # the norm / rope module (its own forward)
    params: Mapping[str, Any] = field(default_factory=dict)  # bias, scale, eps, rope settings, rows sliced

    @property
    def quant_label(self) -> str:
        q = self.quant
        return "" if not q else f"{q['mode']}-q{q['bits']}-g{q['group_size']}"

    @property
    def shape_label(self) -> str:
        s = self.shape
        if self.kind == "linear":
            sliced = f" (first {s['N']} of {s['N_full']})" if s["N"] != s["N_full"] else ""
            return f"K={s['K']} N={s['N']}{sliced}"
        if self.kind == "norm":
            if not s.get("heads"):
                return f"D={s['D']}"
            return f"D={s['D']} x{s['heads']} heads " + ("(B,T,H,D)" if s["layout"] == "THD" else "(B,H,T,D)")
        if self.kind == "rope":
            base = self.params.get("base")
            return f"heads={s['heads']} D={s['D']} offset={s['offset']}" + (f" base={base:g}" if base else "")
        return f"heads={s['heads']} kv_heads={s['kv_heads']} D={s['D']} cache={s['keys']}"


@dataclass(frozen=True)
class ModelOps:
    """A model's ops (distinct per shape and quantization), its compute dtype and where the config came from."""

    source: str
    architecture: str
    dtype: str
    n_layers: int
    ops: tuple[Op, ...]
    config_origin: str
    quantization: Mapping[str, Any] | None

    def names(self) -> list[str]:
        """The op names this model exposes (the ``--ops`` vocabulary)."""
        return sorted({o.name for o in self.ops})


# ------------------------------------------------------------------------------------------------ config


def read_config(source: Any) -> tuple[dict[str, Any], str]:
    """(config, where it came from) for a model directory, ``embedded``, ``shape:NAME``, a Gemma 3 ``.gguf``
    or a config mapping. Never reads weights. A missing or unreadable config is a one-line error."""
    if isinstance(source, Mapping):
        return dict(source), "config given"
    text = "embedded" if source in (None, "") else str(source)
    if text == "embedded":
        from ..model import gguf_gemma

        return gguf_gemma.config_of(gguf_gemma.embedded_gguf()), "the embedded Gemma 3 270M (GGUF metadata)"
    if text.startswith("shape:"):
        from ..model import SHAPES

        name = text.split(":", 1)[1]
        if name not in SHAPES:
            raise GemmdriftError(f"unknown shape model {name!r} (known: {', '.join(sorted(SHAPES))})")
        return dict(SHAPES[name]), f"shape:{name} (gemmdrift.model.SHAPES)"
    path = Path(text).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        from ..model import gguf_gemma

        return gguf_gemma.config_of(path), f"{path} (GGUF metadata)"
    if path.is_dir():
        cfg = path / "config.json"
        if not cfg.is_file():
            raise GemmdriftError(f"not an mlx-lm model directory (no config.json): {path}")
        try:
            config = json.loads(cfg.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise GemmdriftError(f"cannot read {cfg}: {e}") from None
        if not isinstance(config, dict):
            raise GemmdriftError(f"{cfg} is not a JSON object")
        return config, str(cfg)
    raise GemmdriftError(f"model not found: {text} (expected 'embedded', 'shape:NAME', a .gguf file or an mlx-lm "
                         "directory with a config.json)")


def config_dtype(config: Mapping[str, Any]) -> str:
    """The dense compute dtype a checkpoint ships in (``torch_dtype`` / ``dtype``; bfloat16 when it says none)."""
    from ..model import DTYPE_ALIASES

    text = config.get("text_config") if isinstance(config.get("text_config"), Mapping) else {}
    for c in (config, text):
        for key in ("torch_dtype", "dtype"):
            canon = DTYPE_ALIASES.get(str(c.get(key, "")).lower())
            if canon:
                return canon
    return "bfloat16"


def quant_block(config: Mapping[str, Any]) -> dict[str, Any] | None:
    """The config's quantization block as mlx-lm's loader reads it (``quantization``, else ``quantization_config``
    when that carries bits and a group size)."""
    for key in ("quantization", "quantization_config"):
        q = config.get(key)
        if isinstance(q, Mapping) and "bits" in q and "group_size" in q:
            return dict(q)
    return None


def quant_for(block: Mapping[str, Any] | None, path: str, K: int) -> dict[str, Any] | None:
    """How the module at ``path`` ships: None (dense) or {bits, group_size, mode}."""
    if not block:
        return None
    over = block.get(path)
    if over is None:  # a prefix the config wrote differently (language_model.model.layers... vs model.layers...)
        over = next((v for k, v in block.items() if isinstance(k, str) and (k.endswith("." + path) or
                                                                              path.endswith("." + k))), None)
    if over is False:
        return None
    q = {"bits": block["bits"], "group_size": block["group_size"], "mode": block.get("mode", "affine")}
    if isinstance(over, Mapping):
        q.update({k: over[k] for k in ("bits", "group_size", "mode") if k in over})
    q = {"bits": int(q["bits"]), "group_size": int(q["group_size"]), "mode": str(q["mode"])}
    return None if K % q["group_size"] else q


def instantiate(config: Mapping[str, Any]):
    """mlx-lm's model for ``config`` with lazy parameters (nothing evaluated, nothing loaded)."""
    from mlx_lm.utils import _get_classes

    arch = config.get("model_type")
    if not arch:
        raise GemmdriftError("the config has no model_type: cannot tell the architecture")
    try:
        model_cls, args_cls = _get_classes(dict(config))
    except ValueError:
        raise GemmdriftError(f"unknown architecture {arch!r}: the installed mlx-lm has no such model") from None
    try:
        # The parameters are drawn lazily from mx.random (never evaluated); mlx-lm's own load draws them the
        # same way before it reads the weights, so an engine's random state moves as it does at load.
        model = model_cls(args_cls.from_dict(dict(config)))
    except Exception as e:  # a config the architecture cannot be built from (missing or wrong fields)
        raise GemmdriftError(f"cannot build architecture {arch!r} from its config: "
                             f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    if not getattr(model, "layers", None):
        raise GemmdriftError(f"architecture {arch!r} exposes no decoder layers (model.layers)")
    return model


# ------------------------------------------------------------------------------------------------ ops


def _is_linear(mod) -> bool:
    import mlx.nn as nn

    return isinstance(mod, (nn.Linear, nn.QuantizedLinear))


def _is_norm(mod) -> bool:
    return "norm" in type(mod).__name__.lower() and callable(mod)


def _heads(attn, leaf: str) -> int | None:
    n, kv = getattr(attn, "n_heads", None), getattr(attn, "n_kv_heads", None)
    return n if leaf.startswith("q") else kv


def model_ops(source: Any = "embedded", *, dtype: str | None = None, lm_head_rows: int | None = LM_HEAD_ROWS,
              max_rows: int | None = None, prefix: int = PREFIX) -> ModelOps:
    """Every distinct op of ``source``'s decoder layers (and its final norm and LM head), at its shapes.

    Args:
        source: see :func:`read_config`.
        dtype: the compute dtype (default: the one the config ships in).
        lm_head_rows: compute the LM head's first rows only (None: all of them).
        max_rows: cap every linear's output rows (None: the model's own; for shapes too large to draw here).
        prefix: keys in the cache before the block (sdpa) and the block's first position (RoPE).
    """
    from ..model import parse_dtype

    config, origin = read_config(source)
    dtype = parse_dtype(dtype) if dtype else config_dtype(config)
    for name, v in (("lm_head_rows", lm_head_rows), ("max_rows", max_rows)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise GemmdriftError(f"{name} must be a positive integer or None, got {v!r}")
    if isinstance(prefix, bool) or not isinstance(prefix, int) or prefix < 0:
        raise GemmdriftError(f"prefix must be a non-negative integer, got {prefix!r}")
    model = instantiate(config)
    qblock = quant_block(config)
    paths = {id(m): p for p, m in model.named_modules()}
    layers = list(model.layers)
    found: dict[tuple, Op] = {}

    def add(op: Op) -> None:
        key = (op.name, op.kind, json.dumps(dict(op.shape), sort_keys=True), json.dumps(op.quant, sort_keys=True),
               json.dumps({k: v for k, v in op.params.items()}, sort_keys=True, default=str))
        if key in found:
            old = found[key]
            found[key] = Op(old.name, old.kind, old.layers + op.layers, old.shape, old.quant, old.module, old.params)
        else:
            found[key] = op

    def linear(name, mod, path, layer, cap):
        N_full, K = (int(s) for s in mod.weight.shape)
        if hasattr(mod, "bits"):  # a QuantizedLinear: its weight is packed in uint32 words
            K = K * 32 // int(mod.bits)
        N = min(N_full, cap) if cap else N_full
        add(Op(name, "linear", (layer,), {"K": K, "N": N, "N_full": N_full}, quant_for(qblock, path, K),
               params={"bias": "bias" in mod}))

    hidden = None
    for i, layer in enumerate(layers):
        base = paths.get(id(layer), f"layers.{i}")
        for leaf, mod in layer.named_modules():
            if not leaf:
                continue
            parent = layer
            for part in leaf.split(".")[:-1]:
                parent = parent[part] if isinstance(parent, dict) else getattr(parent, part)
            if _is_linear(mod):
                linear(leaf, mod, f"{base}.{leaf}", i, max_rows)
            elif _is_norm(mod):
                w = getattr(mod, "weight", None) if "weight" in mod else None
                in_attn = all(hasattr(parent, a) for a in ("n_heads", "n_kv_heads", "head_dim"))
                D = int(w.shape[-1]) if w is not None else (int(parent.head_dim) if in_attn else None)
                if D is None:
                    D = hidden or int(config.get("hidden_size") or config.get("text_config", {}).get("hidden_size"))
                heads = _heads(parent, leaf.rsplit(".", 1)[-1]) if in_attn else None
                if not in_attn:
                    hidden = hidden or D
                common = {"class": type(mod).__name__, "eps": float(getattr(mod, "eps", 0.0) or 0.0),
                          "weight": w is not None}
                # A per-head norm sees (B, L, heads, D) in one architecture (Gemma 4) and the transposed
                # (B, heads, L, D) in another (Gemma 3); which is in the model's forward, which the gate does not
                # read: both layouts are checked.
                for layout in (("THD", "HTD") if heads else ("TD",)):
                    add(Op(leaf, "norm", (i,), {"D": D, **({"heads": int(heads), "layout": layout} if heads else {})},
                           module=mod, params=common))
        attn = layer.get("self_attn") if hasattr(layer, "get") else getattr(layer, "self_attn", None)
        if attn is not None and all(hasattr(attn, a) for a in ("n_heads", "n_kv_heads", "head_dim", "scale")):
            h, kv, d = int(attn.n_heads), int(attn.n_kv_heads), int(attn.head_dim)
            rope = getattr(attn, "rope", None)
            if rope is not None and callable(rope):
                settings = {k: v for k, v in vars(rope).items()
                            if isinstance(v, (int, float, bool, str)) and not k.startswith("_")}
                add(Op("rope", "rope", (i,), {"heads": h, "D": d, "offset": prefix}, module=rope,
                       params={"class": type(rope).__name__, **settings}))
            add(Op("sdpa", "sdpa", (i,), {"heads": h, "kv_heads": kv, "D": d, "keys": prefix},
                   params={"scale": float(attn.scale)}))
    # The model's head: its final norm and the LM head (an lm_head linear, or the tied embedding as a linear).
    parent_path = paths.get(id(layers[0]), "layers.0").rsplit(".layers.", 1)[0] if layers else ""
    by_path = dict(model.named_modules())
    norm = by_path.get(f"{parent_path}.norm") or by_path.get("norm")
    if norm is not None and _is_norm(norm) and "weight" in norm:
        add(Op("norm", "norm", (-1,), {"D": int(norm.weight.shape[-1])}, module=norm,
               params={"class": type(norm).__name__, "eps": float(getattr(norm, "eps", 0.0) or 0.0), "weight": True}))
    head = next(((p, m) for p, m in by_path.items() if p.rsplit(".", 1)[-1] == "lm_head" and _is_linear(m)), None)
    if head is None:
        emb = by_path.get(f"{parent_path}.embed_tokens") or next(
            (m for p, m in by_path.items() if p.endswith("embed_tokens")), None)
        if emb is not None and "weight" in emb:
            N_full, K = (int(s) for s in emb.weight.shape)
            N = min(N_full, lm_head_rows or N_full, max_rows or N_full)
            add(Op("lm_head", "linear", (-1,), {"K": K, "N": N, "N_full": N_full},
                   quant_for(qblock, paths[id(emb)], K), params={"bias": False, "tied": True}))
    else:
        linear("lm_head", head[1], head[0], -1, min(lm_head_rows or 1 << 62, max_rows or 1 << 62))
    ops = tuple(sorted(found.values(), key=forward_order))
    if not ops:
        raise GemmdriftError(f"architecture {config.get('model_type')!r}: its layers expose no op the gate knows "
                             "(no linear, norm or attention with n_heads/n_kv_heads/head_dim/scale)")
    label = source if isinstance(source, str) else "config"
    return ModelOps(label or "embedded", str(config.get("model_type")), dtype, len(layers), ops, origin, qblock)


# Forward order inside a decoder layer (the order an engine's layer calls them); unknown names after, by name.
FORWARD = ("input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.q_norm",
           "self_attn.k_norm", "self_attn.v_norm", "rope", "sdpa", "self_attn.o_proj", "post_attention_layernorm",
           "pre_feedforward_layernorm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "post_feedforward_layernorm")


def forward_order(op: Op) -> tuple:
    """Sort key: the model's head last, decoder layers by their first layer, then the order of a layer's forward."""
    head = op.layers[0] < 0
    rank = FORWARD.index(op.name) if op.name in FORWARD else len(FORWARD)
    return (head, op.name == "lm_head", min(op.layers) if not head else 0, rank, op.name)


# ------------------------------------------------------------------------------------------------ operands


def _bf16_rne(x: np.ndarray) -> np.ndarray:
    """float32 -> the nearest bfloat16 (ties to even), returned as float32: integer ops on the bits, no NaNs here."""
    b = np.array(x, dtype=np.float32).view(np.uint32)  # a copy, rounded in place
    lsb = b >> np.uint32(16)
    lsb &= np.uint32(1)
    lsb += np.uint32(0x7FFF)
    b += lsb
    b &= np.uint32(0xFFFF0000)
    return b.view(np.float32)


def seeded(shape: tuple[int, ...], dtype: str, salt: str, *, std: float = 1.0, seed: int = SEED) -> np.ndarray:
    """Normal draws (numpy PCG64, seeded by ``seed`` and ``salt``), times ``std``, rounded to ``dtype``, as float32.

    The same (shape, salt, seed) gives the same bits on every machine, whatever else was drawn before.
    """
    rng = np.random.default_rng([seed, zlib.crc32(salt.encode())])
    x = rng.standard_normal(shape, dtype=np.float32)
    if std != 1.0:
        x *= np.float32(std)
    if dtype == "bfloat16":
        return _bf16_rne(x)
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float32)
    return x


def to_mx(x: np.ndarray, dtype: str):
    """A float32 array holding values of ``dtype`` as an mlx array of ``dtype`` (exact: no rounding happens)."""
    import mlx.core as mx

    return mx.array(np.ascontiguousarray(x, dtype=np.float32)).astype(getattr(mx, dtype))


def weight_std(K: int) -> float:
    """Weights ~ N(0, 1/K): outputs of the order of the inputs, as a trained layer keeps them."""
    return 1.0 / math.sqrt(K)


__all__ = ["SEED", "PREFIX", "LM_HEAD_ROWS", "KINDS", "Op", "ModelOps", "read_config", "config_dtype", "quant_block",
           "quant_for", "instantiate", "model_ops", "seeded", "to_mx", "weight_std"]
