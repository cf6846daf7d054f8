"""The projections of a model and real input rows captured for each (one recording proxy per
linear during a forward pass). See :mod:`gemmdrift.kernels`."""

from __future__ import annotations

import hashlib
import zlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from .. import defaults, metrics
from ..errors import GemmdriftError
from .taps import StopForward, find_final_norm, storage_dtype_name, swapped, to_numpy

LM_HEAD = "lm_head"
INPUT_SEED = 20260901
# Rows are picked from this many evenly spaced positions per distinct row wanted.
CANDIDATES_PER_ROW = 4
DEFAULT_MAX_ROWS = defaults.KERNEL_MAX_ROWS


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


def linear_types():
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
    if not tied and "lm_head" in model and isinstance(model["lm_head"], linear_types()):
        return model["lm_head"]
    owner, _ = find_final_norm(model)
    embed = owner.get("embed_tokens") if hasattr(owner, "get") else None
    if isinstance(embed, (nn.Embedding, nn.QuantizedEmbedding)):
        return embed
    raise GemmdriftError("unsupported architecture: no lm_head linear and no embed_tokens to tie the head to")


def projections(lm, layers: Iterable[int] | None = None, names: Iterable[str] | None = None) -> list[Projection]:
    """Every linear of every decoder layer, then the LM head as layer ``n_layers``.

    Args:
        lm: a :class:`gemmdrift.model.LoadedModel`.
        layers: decoder layer indices to keep (``n_layers`` selects the LM head).
        names: projection names to keep, e.g. ``"self_attn.q_proj"``, ``"q_proj"``
            (the last component suffices) or ``"lm_head"``.

    Raises:
        GemmdriftError: an unknown layer index or projection name.
    """
    linear = linear_types()
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
    dtype = lm.description.dtype
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
    taps: dict[tuple[int, str], _InputTap] = {p.key: head_tap if p.is_head else _InputTap(p.module, wanted)
                                              for p in projs}
    slots = [(p.parent, p.attr, taps[p.key]) for p in projs if not p.is_head] + [(owner, norm_name, head_tap)]
    with swapped(slots):  # the same install/restore as the layer taps
        try:
            lm.model(mx.array(tokens)[None], cache=make_prompt_cache(lm.model))
        except StopForward:
            pass
        else:
            raise GemmdriftError("unsupported architecture: the forward pass never reached the final norm")
        mx.eval([[s[0] for s in t.seen] for t in taps.values()])
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

__all__ = ["LM_HEAD", "INPUT_SEED", "CANDIDATES_PER_ROW", "DEFAULT_MAX_ROWS", "Projection", "projections", "CapturedInputs", "inputs_digest", "distinct_rows", "synthetic_rows", "capture_inputs"]
