"""The one-second gate (issue 29, item 6): is a T-row call of each op of a model's decoder layer bit-equal to T
single-row calls, for T up to a width, on this machine's default device, without a forward pass?

Speculative verification computes k+1 positions in one call where decoding computes one at a time; the two agree
token for token only if every op gives each position the same bits either way. :func:`gate` answers that per op,
at the model's own shapes (read from its config: :mod:`.primitives_operands`), quantization as it ships, on portable
seeded operands, for each T of ``ts``; :func:`speculative_exact` is the yes/no an engine asks at load (as
lablup/mlxcel gates its MTP on a measured probe), and fails closed: any error, any op or T not measured, is "no".

The statistic per position is lablup/mlxcel's (``tests/metal_block_vs_chain_op_parity.rs``): the bytes of the
output that differ between the block's position t and the t-th single call, :func:`differing_bytes`.

Example::

    from gemmdrift import primitives
    g = primitives.gate("path/to/mlx-model", ts=range(1, 9))
    g.table          # op, shape, dtype, quant, T, equal, differing bytes per position
    g.exact(3)       # every op bit-equal in blocks of 1..4 (3 drafted tokens); the cache is outside the gate
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import pandas as pd

from ..errors import GemmdriftError
from ..metrics import differing_bytes, position_bytes
from .primitives_operands import KINDS, LM_HEAD_ROWS, PREFIX, SEED, ModelOps, Op, model_ops
from .primitives_ops import parity, probe_for

MAX_T = 512  # the widest block the gate compares (a verification block, not a prefill chunk)
COLUMNS = ["op", "kind", "layers", "n_layers", "shape", "dtype", "quant", "kernels", "seed", "T", "equal",
           "differing_bytes", "max_differing_bytes", "positions_differ", "bytes_per_position", "error"]


def check_ts(ts: Iterable[int]) -> list[int]:
    """The block widths, sorted and distinct; each an integer in 1..MAX_T (a one-line error otherwise)."""
    try:
        out = sorted({int(t) for t in ts})
    except (TypeError, ValueError):
        raise GemmdriftError(f"--ts: expected block widths like 1-8, got {ts!r}") from None
    if not out:
        raise GemmdriftError("--ts: no block width given")
    if out[0] < 1 or out[-1] > MAX_T:
        bad = out[0] if out[0] < 1 else out[-1]
        raise GemmdriftError(f"--ts: block width {bad} is out of range (1..{MAX_T})")
    return out


def select_ops(mops: ModelOps, names: Sequence[str] | None) -> list[Op]:
    """The ops asked for, by name (``self_attn.q_proj``), short name (``q_proj``), then kind (``linear``, ``rope``,
    ``sdpa``) or ``kind:K``: a name before a kind, as in the attribution (``norm`` is the final norm,
    ``kind:norm`` every norm); an unknown name is a one-line error listing what the model exposes."""
    if not names:
        return list(mops.ops)
    out: list[Op] = []
    for n in names:
        kind = n[5:] if n.startswith("kind:") else None
        hit = [] if kind else [o for o in mops.ops if n in (o.name, o.name.rsplit(".", 1)[-1])]
        hit = hit or [o for o in mops.ops if o.kind == (kind or n)]
        if not hit:
            raise GemmdriftError(f"unknown op {n!r} for {mops.architecture} (it exposes: {', '.join(mops.names())}; "
                                 f"or a kind: {', '.join(KINDS)}; kind:norm for every norm)")
        out += [o for o in hit if o not in out]
    return sorted(out, key=lambda o: mops.ops.index(o))


def _layers_label(layers: Sequence[int]) -> str:
    if list(layers) == [-1]:
        return "head"
    xs, runs = sorted(layers), []
    for x in xs:
        if runs and x == runs[-1][1] + 1:
            runs[-1][1] = x
        else:
            runs.append([x, x])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


@dataclass
class Gate:
    """The gate's table and what it was measured on. ``error`` set: the gate failed (closed: nothing is exact)."""

    table: pd.DataFrame
    ts: list[int]
    model: dict[str, Any]
    device: dict[str, Any]
    kernels: str = "native"
    seconds: float = 0.0
    error: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)

    def exact(self, k: int) -> bool:
        """Every op in the table was measured at every T in 1..k+1 (the verify block of ``k`` drafted tokens and
        every shorter one) and was bit-equal, and nothing failed: speculative decoding with ``k`` drafted tokens is
        exact here as far as these ops go (the cache is outside the gate)."""
        if self.error is not None or self.table.empty or k < 0:
            return False
        need = set(range(1, k + 2))
        for _, rows in self.table.groupby(["op", "layers", "shape", "quant"], sort=False):
            if not need <= set(rows["T"]) or rows["error"].astype(bool).any():
                return False
            if not rows[rows["T"].isin(need)]["equal"].all():
                return False
        return True

    @property
    def exact_width(self) -> int | None:
        """The largest k with :meth:`exact` (0: plain decoding only), None when not even T=1 holds."""
        k = None
        for cand in range(0, max(self.ts)):
            if not self.exact(cand):
                break
            k = cand
        return k

    @property
    def ok(self) -> bool:
        """Exact at the widest block measured (k = max(ts) - 1)."""
        return self.exact(max(self.ts) - 1)

    def first_unequal(self) -> pd.DataFrame:
        """Per op: the smallest T whose block differs (ops that never differ are left out)."""
        t = self.table[~self.table["equal"].astype(bool)]
        return t.sort_values("T").drop_duplicates(["op", "layers", "shape", "quant"])

    def record(self) -> dict[str, Any]:
        """JSON-able: the table as records, the verdict, the model, device and settings."""
        return {"gate": "primitives", "ts": list(self.ts), "ok": self.ok, "exact_width": self.exact_width,
                "error": self.error, "kernels": self.kernels, "seconds": self.seconds, "model": self.model,
                "device": self.device, "settings": self.settings, "rows": self.table.to_dict(orient="records")}


def _device() -> dict[str, Any]:
    import mlx.core as mx

    from ..machine.envinfo import device_record

    rec = device_record()
    try:
        info = dict(mx.device_info(mx.default_device())) if hasattr(mx, "device_info") else {}
    except Exception:  # informative only
        info = {}
    rec["device_info"] = {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in info.items()}
    rec["mlx"] = mx.__version__
    return rec


def check_seeds(seed: Any) -> list[int]:
    """One seed or several, as a list of distinct non-negative integers (a one-line error otherwise)."""
    seeds = [seed] if isinstance(seed, int) else list(seed) if isinstance(seed, (list, tuple, range)) else None
    if not seeds or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in seeds):
        raise GemmdriftError(f"--operand-seed: expected non-negative integers, got {seed!r}")
    return list(dict.fromkeys(seeds))


def check_kernels(kernels: str | None) -> str | None:
    """``None``/``native`` or ``replay:<chip>[@variant]`` (checked before any work)."""
    if kernels in (None, "", "native"):
        return None
    kind, _, rest = str(kernels).partition(":")
    if kind != "replay" or not rest:
        raise GemmdriftError(f"--kernels {kernels!r}: expected replay:<chip>[@<variant>] or native")
    from ..replay import check_variant_text
    from ..replay.paths import parse_chip

    chip, _, variant = rest.partition("@")
    parse_chip(chip)
    check_variant_text(variant)
    return str(kernels)


def plan(source: Any = "embedded", ts: Iterable[int] = range(1, 9), *, ops: Sequence[str] | None = None,
         dtype: str | None = None, kernels: str | None = None, lm_head_rows: int | None = LM_HEAD_ROWS,
         max_rows: int | None = None, prefix: int = PREFIX, seed: Any = SEED) -> tuple[ModelOps, list[Op], list[int], str | None]:
    """Everything :func:`gate` checks before it computes: the config, the ops, the widths, the kernels (a one-line
    :class:`GemmdriftError` for each bad input: no config, unknown architecture, unknown op, widths out of range)."""
    widths = check_ts(ts)
    check_seeds(seed)
    kernels = check_kernels(kernels)
    mops = model_ops(source, dtype=dtype, lm_head_rows=lm_head_rows, max_rows=max_rows, prefix=prefix)
    return mops, select_ops(mops, ops), widths, kernels


def gate(source: Any = "embedded", ts: Iterable[int] = range(1, 9), *, ops: Sequence[str] | None = None,
         dtype: str | None = None, kernels: str | None = None, seed: int | Sequence[int] = SEED,
         lm_head_rows: int | None = LM_HEAD_ROWS, max_rows: int | None = None, prefix: int = PREFIX,
         fail_closed: bool = True) -> Gate:
    """Per op and T: is the T-row call bit-equal to T single-row calls, on the current default device?

    Args:
        source: an mlx-lm model directory (its ``config.json``), ``embedded``, ``shape:NAME``, a Gemma 3 ``.gguf``
            or a config mapping (weights are never read).
        ts: block widths T.
        ops: op names, short names or kinds (default: every op the model exposes).
        dtype: compute dtype (default: the config's own).
        kernels: ``replay:<chip>[@variant]``: the linears as that chip's kernels add (a prediction).
        seed: the operands' seed, or several: each op is checked on each seed's draws, and is equal only if it is
            on all of them (where one or two bytes of thousands differ, whether any does is draw-dependent).
        lm_head_rows, max_rows, prefix: see :func:`.primitives_operands.model_ops`.
        fail_closed: any error gives a :class:`Gate` with ``error`` set (nothing exact) instead of raising.
    """
    t0 = time.perf_counter()
    try:
        ts = list(ts)  # a generator is read once: by the checks, and again for a failed gate's record
    except TypeError:
        pass
    settings = {"seed": seed, "lm_head_rows": lm_head_rows, "max_rows": max_rows, "prefix": prefix,
                "ops": list(ops) if ops else None}
    model: dict[str, Any] = {"source": source if isinstance(source, str) else "config"}
    rows: list[dict[str, Any]] = []
    try:
        seeds = check_seeds(seed)
        device = _device()
        mops, chosen, widths, kernels = plan(source, ts, ops=ops, dtype=dtype, kernels=kernels,
                                             lm_head_rows=lm_head_rows, max_rows=max_rows, prefix=prefix)
        settings["n_ops"] = len(set(mops.names()))  # what the verdict's scope is measured against (--ops)
        model = {"source": mops.source, "architecture": mops.architecture, "dtype": mops.dtype,
                 "n_layers": mops.n_layers, "config": mops.config_origin, "quantization": mops.quantization}
        for op, sd in ((o, sd) for o in chosen for sd in seeds):
            probe = probe_for(op, mops.dtype, max(widths), kernels=kernels, seed=sd)
            label = {"op": op.name, "kind": op.kind, "layers": _layers_label(op.layers), "n_layers": len(op.layers),
                     "shape": op.shape_label, "dtype": mops.dtype, "quant": op.quant_label,
                     "kernels": probe.kernels, "seed": sd}
            for r in parity(probe, widths):
                counts = r["differing_bytes"]
                rows.append({**label, "T": r["T"], "equal": r["equal"], "differing_bytes": counts,
                             "max_differing_bytes": max(counts), "positions_differ": sum(1 for n in counts if n),
                             "bytes_per_position": r["bytes_per_position"], "error": ""})
    except Exception as e:  # fail closed: an engine asking "is it exact?" gets "no" and the reason
        if not fail_closed:
            raise
        msg = str(e).splitlines()[0] if str(e) else ""
        asked = sorted({int(t) for t in ts if isinstance(t, int) and t > 0}) if isinstance(ts, list) else []
        return Gate(pd.DataFrame(rows, columns=COLUMNS), asked or [1],
                    model, locals().get("device") or {}, str(kernels or "native"), time.perf_counter() - t0,
                    f"{type(e).__name__}: {msg}" if not isinstance(e, GemmdriftError) else msg, settings)
    return Gate(pd.DataFrame(rows, columns=COLUMNS), widths, model, device, kernels or "native",
                time.perf_counter() - t0, None, settings)


def speculative_exact(source: Any, k: int, **kw: Any) -> bool:
    """True only if speculative decoding with ``k`` drafted tokens is exact on this device as far as the ops go:
    every op of the model at its shapes (the gate at T = 1..k+1); False on any difference, any error, or some ops
    only (``ops``, ``max_rows``: not every op at its shapes), fail closed. The KV cache is outside the gate's
    scope (past the sliding window the cache's layout makes decode and verification differ: ``stack``)."""
    try:
        if isinstance(k, bool) or not isinstance(k, int) or k < 0 or kw.get("ops") or kw.get("max_rows"):
            return False
        return gate(source, range(1, k + 2), **kw).exact(k)
    except Exception:  # fail closed, whatever went wrong
        return False


__all__ = ["MAX_T", "COLUMNS", "Gate", "gate", "plan", "speculative_exact", "check_ts", "check_seeds", "check_kernels", "select_ops",
           "differing_bytes", "position_bytes"]
