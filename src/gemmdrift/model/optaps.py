"""Op taps: the ops inside every decoder layer, tapped by the one proxy mechanism (:func:`gemmdrift.model.taps.swapped`).

The layer taps (:mod:`gemmdrift.model.taps`) see what a decoder layer returns; these see the ops it is made of, without
forking the model's forward. For the length of a run:

* every ``nn.Linear`` / ``nn.QuantizedLinear`` of a layer (named by its module path, ``self_attn.q_proj``,
  ``mlp.down_proj``, ...), every norm module (``input_layernorm``, ``self_attn.q_norm``, ...) and the RoPE module
  (``self_attn.rope``) are replaced by a proxy that delegates;
* the attention core is the function the model's module calls by name (mlx-lm's ``scaled_dot_product_attention``,
  imported into e.g. ``mlx_lm.models.gemma3_text``): that name is patched in the model's module namespace, and
  so is ``clip_residual`` (Gemma 3's residual add) where the module has one;
* the final norm and the LM head (``lm_head``, or the tied embedding's ``as_linear``) are layer ``n_layers``.

An op called more than once per layer (RoPE on queries then keys, the two residual adds) is named ``name``,
``name#1``, ...; its *class* (what a counterfactual makes invariant) is the name without the suffix. What has no
observable boundary (the MLP activation and gate product, a residual ``+`` written inline) is reported as part of
its neighbour by :func:`exposed_ops`.

Three modes of one run, as :class:`OpRecorder` is built:

* **record**: keep each op's output (and, with ``keep_inputs``, its per-row inputs) at the tapped positions;
* **local**: every op is fed the reference run's per-row input at the same positions, and what it hands on (to
  the next op, and into the KV cache) is the reference run's output: the attention core gets the reference's
  queries, and its cache holds the reference's keys and values at every position (in this run's own layout:
  a ``RotatingKVCache`` orders them as this schedule writes them). Whatever differs at an op's output is that
  op's own; a value projection's drift never reaches the attention core through the cache. Per row, the share
  of the input this run computed that differs from the reference's is kept (``OpRecord.input_differ``): a
  difference there comes from the computation between two tapped ops (the MLP activation, an inline add);
* **replace**: the ops of the chosen classes return the reference run's output (the counterfactual: the class
  made invariant, everything else left as is).

Rows are taken along axis -2 of every tensor (``(1, L, D)`` and ``(1, heads, L, D)`` alike) and copied at once
(a ``take`` is a new array: a ``RotatingKVCache`` that rewrites its buffers in place cannot change a capture).
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import pandas as pd

from .. import metrics
from ..errors import GemmdriftError
from .taps import Prefix, Taps, find_final_norm, run_schedule, storage_dtype_name, swapped

LM_HEAD = "lm_head"
FINAL_NORM = "norm"
SDPA = "sdpa"
RESIDUAL = "residual"
# Functions a model module calls by name, patched in its namespace: (attribute, op name, kind, per-row args).
FUNCTIONS = (("scaled_dot_product_attention", SDPA, "attention", (0,)),
             ("clip_residual", RESIDUAL, "residual", (0, 1)))
# What has no boundary of its own, and the op it is reported with.
PART_OF = {
    "mlp activation (gelu/silu of gate_proj times up_proj)": "mlp.down_proj (its input)",
    "residual add written inline": "the norm before it (post_attention_layernorm / post_feedforward_layernorm)",
    "embedding lookup and scale": "layer 0's input_layernorm (its input)",
}


def op_class(name: str) -> str:
    """The class of an op name: ``self_attn.rope#1`` -> ``self_attn.rope``."""
    return name.split("#", 1)[0]


def short_class(name: str) -> str:
    """The class as users say it: ``self_attn.q_proj`` -> ``q_proj`` (unique within a Gemma layer)."""
    return op_class(name).rsplit(".", 1)[-1]


@dataclass(frozen=True)
class Site:
    """One tappable op of the model: a module slot, or a patched function name (``container`` a module)."""

    layer: int  # n_layers for the final norm and the LM head
    name: str
    kind: str  # linear | norm | rope | attention | residual | head
    container: Any = field(repr=False, compare=False)
    key: Any = field(compare=False)
    rows: tuple = (0,)  # positional arguments holding per-row inputs


def _is_norm(mod) -> bool:
    import mlx.nn as nn

    return isinstance(mod, (nn.RMSNorm, nn.LayerNorm)) or "norm" in type(mod).__name__.lower()


def _is_linear(mod) -> bool:
    import mlx.nn as nn

    return isinstance(mod, (nn.Linear, nn.QuantizedLinear))


def _head_site(model, n_layers: int) -> Site:
    import mlx.nn as nn

    if not getattr(model, "tie_word_embeddings", False) and "lm_head" in model:
        return Site(n_layers, LM_HEAD, "head", model, "lm_head")
    owner, _ = find_final_norm(model)
    if isinstance(owner.get("embed_tokens"), (nn.Embedding, nn.QuantizedEmbedding)):
        return Site(n_layers, LM_HEAD, "head", owner, "embed_tokens")
    raise GemmdriftError("unsupported architecture: no lm_head linear and no embed_tokens to tie the head to")


def sites(model) -> list[Site]:
    """Every tappable op of ``model``: module slots per layer (in module order), the patched functions (one site
    per module namespace, layer -1: they serve every layer), then the final norm and the LM head."""
    layers = model.layers
    n = len(layers)
    out: list[Site] = []
    namespaces = {}
    for i, layer in enumerate(layers):
        for name, mod in layer.named_modules():
            if not name:
                continue
            parent_name, _, attr = name.rpartition(".")
            parent = layer
            for part in parent_name.split(".") if parent_name else []:
                parent = parent[part]
            kind = ("linear" if _is_linear(mod) else "rope" if attr == "rope" else "norm" if _is_norm(mod) else None)
            if kind is not None:
                out.append(Site(i, name, kind, parent, attr))
        for _, mod in layer.named_modules():
            ns = sys.modules.get(type(mod).__module__)
            if ns is not None and ns.__name__.startswith("mlx_lm.models.") and ns.__name__ not in namespaces:
                namespaces[ns.__name__] = ns
    for ns in namespaces.values():
        for attr, name, kind, rows in FUNCTIONS:
            if callable(getattr(ns, attr, None)):
                out.append(Site(-1, name, kind, ns, attr, rows))
    owner, norm_name = find_final_norm(model)
    out.append(Site(n, FINAL_NORM, "norm", owner, norm_name))
    out.append(_head_site(model, n))
    return out


KIND_WORDS = ("linear", "norm", "rope", "sdpa")  # the kinds --ops takes, as attribute --primitives names them


@dataclass
class ExposedOps:
    """Which ops a model exposes: names per layer (module order), their classes and kinds, and what is not
    observable (reported as part of a neighbour)."""

    names: list[str]  # layer op names, e.g. input_layernorm, self_attn.q_proj, ..., sdpa, residual
    kinds: dict[str, str]
    head: list[str]  # norm, lm_head
    part_of: dict[str, str]

    @property
    def classes(self) -> list[str]:
        return list(dict.fromkeys(op_class(n) for n in self.names + self.head))

    def class_kind(self, cls: str) -> str:
        """The kind word of a class as ``--ops`` takes it in both attribute modes (linear, norm, rope, sdpa)."""
        kinds = [self.kinds.get(n) for n in self.names + self.head if op_class(n) == cls]
        k = next((k for k in kinds if k), "")
        return {"head": "linear", "attention": "sdpa"}.get(k, k)

    def resolve(self, wanted: Sequence[str], what: str = "op") -> list[str]:
        """Classes named by ``wanted``: a full class name or its last component (``q_proj``), as in
        ``attribute --primitives`` a name before a kind (``norm`` is the final norm), then a kind (``linear``:
        every projection and the LM head) or ``kind:K`` (``kind:norm``: every norm). An unknown name raises
        with the list of the ones this model exposes."""
        out = []
        for w in wanted:
            kind = w[5:] if w.startswith("kind:") else None
            hit = [] if kind else [c for c in self.classes if c == w or short_class(c) == w]
            if not hit and (kind or w) in KIND_WORDS:
                hit = [c for c in self.classes if self.class_kind(c) == (kind or w)]
            if not hit:
                raise GemmdriftError(f"unknown {what} {w!r}: this model exposes {', '.join(self.classes)} (or a "
                                     f"kind: {', '.join(KIND_WORDS)}, kind:norm for every norm)")
            out += [c for c in hit if c not in out]
        return out


def exposed_ops(model) -> ExposedOps:
    """The ops :func:`sites` taps in one decoder layer (layer 0's modules, the patched functions), and the head.

    Raises:
        GemmdriftError: the model's layers expose no op (no linear, norm, RoPE or known attention function).
    """
    all_sites = sites(model)
    layer_sites = [s for s in all_sites if s.layer == 0 or s.layer == -1]
    if not layer_sites:
        raise GemmdriftError(f"{type(model).__module__}: its decoder layers expose no op (no nn.Linear, norm, "
                             f"rope module or {', '.join(f[0] for f in FUNCTIONS)} in the model's module)")
    names = [s.name for s in reversed(layer_sites) if s.layer == 0] + [s.name for s in layer_sites if s.layer == -1]
    kinds = {s.name: s.kind for s in all_sites}
    part_of = dict(PART_OF)
    if not any(s.kind == "attention" for s in layer_sites):
        part_of["attention core (softmax(QK^T)V)"] = "self_attn.o_proj (its input)"
    if not any(s.kind == "residual" for s in layer_sites):
        part_of.pop("residual add written inline", None)
        part_of["residual adds"] = "the layer's output (the layer taps)"
    else:
        part_of.pop("residual add written inline")
    return ExposedOps(names, kinds, [FINAL_NORM, LM_HEAD], part_of)


# ------------------------------------------------------------------------------------------------- recording


@dataclass
class OpRecord:
    """One run's op taps: per (layer, op name) the positions kept, outputs and per-row inputs (float32, exact
    values of ``dtype[key]``), rows shaped ``(positions, *row)`` with the row axis moved to the front."""

    schedule: str
    mode: str  # record | local | replace:<classes>
    order: list[tuple[int, str]]  # forward order of first calls
    kinds: dict[tuple[int, str], str]
    positions: dict[tuple[int, str], np.ndarray]
    out: dict[tuple[int, str], np.ndarray]
    inp: dict[tuple[int, str], list[np.ndarray]]
    dtype: dict[tuple[int, str], str]
    replaced: set = field(default_factory=set)  # classes whose outputs were replaced
    # local mode: per (layer, op) and position kept, the share of its per-row input elements that differ from the
    # reference's input it was fed instead (the largest over its row arguments)
    input_differ: dict[tuple[int, str], np.ndarray] = field(default_factory=dict)

    def rows(self, key, positions: np.ndarray) -> np.ndarray:
        have = self.positions.get(key)
        if have is None:
            raise GemmdriftError(f"op {key[1]} of layer {key[0]} was not tapped in the reference run")
        idx = np.searchsorted(have, positions)
        if np.any(idx >= len(have)) or np.any(have[np.minimum(idx, len(have) - 1)] != positions):
            raise GemmdriftError(f"op {key[1]} of layer {key[0]}: position not tapped in the reference run")
        return idx

    def classes(self) -> list[str]:
        return list(dict.fromkeys(op_class(k[1]) for k in self.order))


def _take_rows(x, rows: np.ndarray):
    """Rows of ``x`` along axis -2, moved to the front: a new array object (never the object a cache rebinds when
    it writes its buffer in place, as ``RotatingKVCache`` does)."""
    import mlx.core as mx

    if len(rows) == x.shape[-2] and rows[-1] == len(rows) - 1:  # every row (a decode step): no gather needed
        return mx.moveaxis(x, -2, 0)
    return mx.moveaxis(mx.take(x, mx.array(rows.astype(np.int32)), axis=-2), -2, 0)


def _row_share_differ(given: Sequence, fed: Sequence):
    """Per row (axis -2): the share of elements whose values differ between the inputs a run computed and the
    reference's it was fed instead, the largest over the arguments; shaped ``(rows, 1)`` (rows along axis -2)."""
    import mlx.core as mx

    shares = []
    for g, f in zip(given, fed):
        axes = [i for i in range(g.ndim) if i != g.ndim - 2]
        shares.append(mx.mean(mx.not_equal(g, f.astype(g.dtype)).astype(mx.float32), axis=axes))
    return mx.expand_dims(mx.max(mx.stack(shares), axis=0), -1)


def _inject(rows: np.ndarray, like):
    """Reference rows (positions first) back into the layout and dtype of ``like``."""
    import mlx.core as mx

    x = mx.moveaxis(mx.array(rows), 0, -2).astype(like.dtype)
    if tuple(x.shape) != tuple(like.shape):
        raise GemmdriftError(f"reference rows {tuple(x.shape)} do not fit the op's tensor {tuple(like.shape)}")
    return x


class OpRecorder:
    """The state of one tapped run: which block and layer are running, what to feed, replace and keep."""

    def __init__(self, n_layers: int, positions: Sequence[int], logit_positions: Sequence[int], *, start: int = 0,
                 reference: OpRecord | None = None, local: bool = False, replace: Sequence[str] = (),
                 perturb: Mapping[tuple[int, str], Callable] | None = None, keep_inputs: bool = False,
                 schedule: str = "", record_ops: bool = True, hold: Mapping[str, Callable] | None = None):
        if (local or replace or hold) and reference is None:
            raise GemmdriftError("local and replace modes need a reference run")
        self.n_layers = n_layers
        self.positions = np.unique(np.asarray(positions, dtype=np.int64))
        self.logit_positions = np.unique(np.asarray(logit_positions, dtype=np.int64))
        self.next, self.block = start, (start, 0)
        self.layer = n_layers
        self.counts: dict[tuple[int, str], int] = {}
        self.reference, self.local, self.replace, self.hold = reference, local, set(replace), dict(hold or {})
        self.perturb = dict(perturb or {})
        self.keep_inputs = keep_inputs
        self.record_ops = record_ops
        mode = "local" if local else ("replace:" + "+".join(sorted(self.replace))) if self.replace else "record"
        self.record = OpRecord(schedule, mode, [], {}, {}, {}, {}, {})
        self.pending: list[tuple[tuple[int, str], np.ndarray, int, Any]] = []

    # -- where we are
    def enter_layer(self, index: int, x) -> None:
        if index == 0:  # a new block starts with layer 0
            L = int(x.shape[-2])
            self.block = (self.next, L)
            self.next += L
            self.counts = {}
        self.layer = index

    def leave_layer(self) -> None:
        self.layer = self.n_layers

    def _block_positions(self, head: bool) -> np.ndarray:
        start, L = self.block
        if head:
            lp = self.logit_positions
            return lp[(lp >= start) & (lp < start + L)]
        return np.arange(start, start + L)

    # -- one op call
    def call(self, base: str, kind: str, fn, args, kwargs, row_args: Sequence[int], head: bool = False):
        layer = self.n_layers if head else self.layer
        k = self.counts.get((layer, base), 0)
        self.counts[(layer, base)] = k + 1
        name = base if k == 0 else f"{base}#{k}"
        key = (layer, name)
        rec = self.record
        if key not in rec.kinds:
            rec.order.append(key)
            rec.kinds[key] = kind
        pos = self._block_positions(head and base == LM_HEAD)
        args = list(args)
        for j in row_args:
            if int(args[j].shape[-2]) != len(pos):
                raise GemmdriftError(f"op {name} of layer {layer}: {args[j].shape[-2]} rows along axis -2, "
                                     f"expected {len(pos)} (this block's positions)")
        ref = self.reference
        differ = None
        if self.local:
            ri = ref.rows(key, pos)
            given = [args[j] for j in row_args]  # what the run computed as this op's input
            for n_arg, j in enumerate(row_args):
                args[j] = _inject(ref.inp[key][n_arg][ri], args[j])
            if self.record_ops:
                differ = _row_share_differ(given, [args[j] for j in row_args])
        out = fn(*args, **kwargs)
        if key in self.perturb:
            out = self.perturb[key](out, tuple(args))
        cls = op_class(name)
        passed = out
        if cls in self.replace:
            passed = out = _inject(ref.out[key][ref.rows(key, pos)], out)
            rec.replaced.add(cls)
        elif cls in self.hold:  # its own drift removed, what it carries kept (all-but-one)
            passed = out = self.hold[cls](key, fn, args, kwargs, row_args, pos)
            rec.replaced.add(cls)
        elif self.local:  # the op's own output is kept; what flows on (into the next op, the cache) is the reference's
            passed = _inject(ref.out[key][ri], out)
        if self.record_ops:
            self._capture(key, pos, out, [args[j] for j in row_args] if self.keep_inputs else [], differ)
        return passed

    def _capture(self, key, pos: np.ndarray, out, inputs: list, differ=None) -> None:
        import mlx.core as mx

        keep = np.isin(pos, self.positions)
        if not keep.any():
            return
        rows = np.flatnonzero(keep)
        rec = self.record
        if key not in rec.positions:
            head_lm = key[1] == LM_HEAD
            rec.positions[key] = np.intersect1d(self.positions, self.logit_positions) if head_lm else self.positions
        slots = np.searchsorted(rec.positions[key], pos[rows])
        for j, arr in enumerate([out] + inputs):
            sel = _take_rows(arr, rows)
            if len(rows) >= 64:
                mx.async_eval(sel)
            self.pending.append((key, slots, j, sel))
        if differ is not None:
            self.pending.append((key, slots, -1, _take_rows(differ, rows)))

    def flush(self) -> None:
        """Evaluate and keep this block's captures (called once per block, after the block's eval)."""
        import mlx.core as mx

        if not self.pending:
            return
        # One eval for the whole block's captures, upcast to float32 (exact for bf16/fp16), then plain copies.
        upcast = [p[3].astype(mx.float32) for p in self.pending]
        mx.eval(upcast)
        rec = self.record
        for (key, slots, j, arr), f32 in zip(self.pending, upcast):
            a = np.array(f32, copy=True)
            n = len(rec.positions[key])
            if j == -1:
                rec.input_differ.setdefault(key, np.zeros(n))[slots] = a[:, 0]
            elif j == 0:
                if key not in rec.out:
                    rec.out[key] = np.zeros((n, *a.shape[1:]), np.float32)
                    rec.dtype[key] = storage_dtype_name(arr.dtype)
                rec.out[key][slots] = a
            else:
                ins = rec.inp.setdefault(key, [])
                while len(ins) < j:
                    ins.append(None)
                if ins[j - 1] is None:
                    ins[j - 1] = np.zeros((n, *a.shape[1:]), np.float32)
                ins[j - 1][slots] = a
        self.pending = []


class _ModuleOp:
    """Stands in for one module of a layer (or the final norm, or an untied LM head): delegates through the
    recorder."""

    def __init__(self, module, site: Site, rec: OpRecorder):
        self._module, self._site, self._rec = module, site, rec

    def __getattr__(self, name):
        return getattr(self._module, name)

    def __call__(self, *args, **kwargs):
        s = self._site
        return self._rec.call(s.name, s.kind, self._module, args, kwargs, s.rows, head=s.layer == self._rec.n_layers)


class _TiedHeadOp(_ModuleOp):
    """The tied embedding: lookups pass through, ``as_linear`` (the LM head) is tapped."""

    def __call__(self, *args, **kwargs):
        return self._module(*args, **kwargs)

    def as_linear(self, x):
        return self._rec.call(LM_HEAD, "head", self._module.as_linear, (x,), {}, (0,), head=True)


class _LayerMarker:
    """Stands in for one decoder layer: tells the recorder which layer (and, at layer 0, which block) runs."""

    def __init__(self, layer, index: int, rec: OpRecorder):
        self._layer, self._index, self._rec = layer, index, rec

    def __getattr__(self, name):
        return getattr(self._layer, name)

    def __call__(self, x, *args, **kwargs):
        self._rec.enter_layer(self._index, x)
        try:
            return self._layer(x, *args, **kwargs)
        finally:
            self._rec.leave_layer()


class _Namespace:
    """A module namespace as a container for :func:`gemmdrift.model.taps.swapped` (``ns[name] = f``)."""

    def __init__(self, module):
        self.module = module

    def __getitem__(self, key):
        return getattr(self.module, key)

    def __setitem__(self, key, value):
        setattr(self.module, key, value)


def _function_op(fn, site: Site, rec: OpRecorder):
    def tapped(*args, **kwargs):
        return rec.call(site.name, site.kind, fn, args, kwargs, site.rows)

    return tapped


@contextlib.contextmanager
def installed(model, rec: OpRecorder, site_list: Sequence[Site] | None = None) -> Iterator[OpRecorder]:
    """Op proxies (and layer markers) in for the duration; the model always restored. Whatever is in a slot
    now is wrapped (a replayed projection's proxy stays under the tap). ``site_list``: :func:`sites` of the
    model taken before other proxies went in (a proxy is no module: ``named_modules`` does not see it)."""
    slots = [(model.layers, i, _LayerMarker(layer, i, rec)) for i, layer in enumerate(list(model.layers))]
    for s in site_list if site_list is not None else sites(model):
        if s.layer == -1:
            ns = _Namespace(s.container)
            slots.append((ns, s.key, _function_op(ns[s.key], s, rec)))
            continue
        current = s.container[s.key]
        if s.kind == "head" and s.key == "embed_tokens":
            slots.append((s.container, s.key, _TiedHeadOp(current, s, rec)))
        else:
            slots.append((s.container, s.key, _ModuleOp(current, s, rec)))
    with swapped(slots):
        yield rec


def run_ops(model, tokens: Sequence[int], schedule: str, *, split: int | None = None,
            positions: Sequence[int] | None = None, logit_positions: Sequence[int] | None = None,
            prefix: Prefix | None = None, reference: OpRecord | None = None, local: bool = False,
            replace: Sequence[str] = (), perturb: Mapping[tuple[int, str], Callable] | None = None,
            keep_inputs: bool = False, site_list: Sequence[Site] | None = None,
            record_ops: bool = True, hold: Mapping[str, Callable] | None = None) -> tuple[Taps, OpRecord]:
    """One run of ``schedule`` with op taps (and the layer taps of :func:`gemmdrift.model.taps.run_schedule`).

    Args:
        positions: positions whose ops are kept (default: every position the run computes).
        logit_positions: positions whose logits are computed (the LM head runs on those rows only).
        prefix: the caches of the blocks the schedules share (computed once, :func:`gemmdrift.model.taps.common_prefix`).
        reference: a record run (``keep_inputs=True``) tapped at every position this run computes.
        local: feed every op the reference's per-row inputs (local drift per op).
        replace: op classes whose outputs are the reference's (the counterfactual).
        hold: op class -> ``f(key, fn, args, kwargs, row_args, positions) -> output``: what the class's ops hand on
            instead of their own output (the all-but-one counterfactual: the op as the reference computes it, on
            this run's input; :mod:`gemmdrift.attribution.hold`).
        perturb: ``(layer, op name) -> f(output, args) -> output``, applied to this run's op output (a planted
            change, or an emulated kernel from the call's arguments: known-answer tests and controls).
        keep_inputs: keep each op's per-row inputs too (a reference for local mode).
        site_list: the model's :func:`sites`, taken before other proxies (a replay) went in.
        record_ops: keep the ops' outputs in the record (False: a run read for its layer taps and logits only, as a
            counterfactual is; the record then holds the forward order and the replaced classes, no arrays).
    """
    n = len(tokens)
    start = prefix.length if prefix is not None else 0
    positions = np.arange(start, n) if positions is None else np.asarray(positions, dtype=np.int64)
    logit_positions = np.zeros(0, np.int64) if logit_positions is None else np.asarray(logit_positions, np.int64)
    rec = OpRecorder(len(model.layers), positions, logit_positions, start=start, reference=reference, local=local,
                     replace=replace, perturb=perturb, keep_inputs=keep_inputs, schedule=str(schedule),
                     record_ops=record_ops, hold=hold)
    with installed(model, rec, site_list):
        taps = run_schedule(model, tokens, schedule, split=split, positions=positions,
                            logit_positions=logit_positions, prefix=prefix, progress=lambda _: rec.flush())
    rec.flush()
    missing = (set(rec.replace) | set(rec.hold)) - rec.record.replaced
    if missing:
        raise GemmdriftError(f"counterfactual class {sorted(missing)[0]!r} has no member that ran")
    rec.record.schedule = taps.schedule
    return taps, rec.record


# ------------------------------------------------------------------------------------------------ local drift


def local_drift(ref: OpRecord, other: OpRecord, positions: Sequence[int] | None = None) -> pd.DataFrame:
    """Per (layer, op, position): share of elements whose bits differ, max ULP, rel L2 (reference first), and
    ``input_differ``: in a local run, the share of the op's per-row input elements that differ from the
    reference's input it was fed instead (every tapped op hands on the reference's output, so a difference there
    was made between two tapped ops), else 0.

    Rows follow the reference's forward order (``order``: the op's index in it). ULPs are counted in the op's
    storage dtype (:func:`gemmdrift.metrics.storage_bits`, :func:`gemmdrift.metrics.ordered_int`)."""
    want = None if positions is None else np.unique(np.asarray(positions, dtype=np.int64))
    rows = []
    for order, key in enumerate(ref.order):
        if key not in other.out or key not in ref.out:
            continue
        pos = other.positions[key]
        if want is not None:
            pos = pos[np.isin(pos, want)]
        if pos.size == 0:
            continue
        a = ref.out[key][ref.rows(key, pos)].reshape(len(pos), -1)
        b = other.out[key][other.rows(key, pos)].reshape(len(pos), -1)
        dtype = other.dtype[key]
        ba, w = metrics.storage_bits(a, dtype)
        bb, _ = metrics.storage_bits(b, dtype)
        ulp = np.abs(metrics.ordered_int(ba, w) - metrics.ordered_int(bb, w))
        d = a.astype(np.float64) - b.astype(np.float64)
        sq_a = np.sum(a.astype(np.float64) ** 2, axis=1)
        sq_d = np.sum(d * d, axis=1)
        rel = np.where(sq_a > 0, np.sqrt(sq_d / np.where(sq_a > 0, sq_a, 1)), np.where(sq_d == 0, 0.0, np.inf))
        inp = (other.input_differ[key][other.rows(key, pos)] if key in other.input_differ
               else np.zeros(len(pos)))
        layer, name = key
        for j, p in enumerate(pos):
            rows.append({"layer": layer, "op": name, "class": op_class(name), "kind": ref.kinds[key],
                         "order": order, "position": int(p), "frac_differ": float(np.mean(ba[j] != bb[j])),
                         "max_ulp": float(ulp[j].max()), "rel_l2": float(rel[j]), "input_differ": float(inp[j])})
    return pd.DataFrame(rows, columns=["layer", "op", "class", "kind", "order", "position", "frac_differ",
                                       "max_ulp", "rel_l2", "input_differ"])


def first_differing(drift: pd.DataFrame) -> pd.DataFrame:
    """Per position: the first op in forward order whose output bits differ (none: layer -1, op "")."""
    out = []
    for p, g in drift.groupby("position", sort=True):
        d = g[g["frac_differ"] > 0].sort_values("order")
        if len(d):
            r = d.iloc[0]
            out.append({"position": int(p), "layer": int(r["layer"]), "op": r["op"], "class": r["class"]})
        else:
            out.append({"position": int(p), "layer": -1, "op": "", "class": ""})
    return pd.DataFrame(out, columns=["position", "layer", "op", "class"])


__all__ = ["Site", "sites", "ExposedOps", "exposed_ops", "OpRecord", "OpRecorder", "installed", "run_ops",
           "local_drift", "first_differing", "op_class", "short_class", "LM_HEAD", "FINAL_NORM", "SDPA"]
