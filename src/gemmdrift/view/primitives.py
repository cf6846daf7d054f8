"""How the one-second gate reads: its table as text (one line per op, one cell per T) and as a JSON record whose every
row carries the command that recomputes just that row (see :mod:`gemmdrift.attribution.primitives`)."""

from __future__ import annotations

import shlex
from typing import Any

from ..attribution.primitives import Gate


def _ts_text(ts: list[int]) -> str:
    """[1, 2, 3, 5] -> '1-3,5'."""
    runs: list[list[int]] = []
    for t in sorted(ts):
        if runs and t == runs[-1][1] + 1:
            runs[-1][1] = t
        else:
            runs.append([t, t])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def row_command(g: Gate, op: str, T: int | None = None) -> str:
    """The one command that recomputes one row (one op, one T) of ``g``, or one op at every T."""
    src = g.model.get("source") or "embedded"
    parts = ["gemmdrift", "attribute", "--primitives", "--model", str(src), "--ops", op,
             "--ts", str(T) if T is not None else _ts_text(g.ts)]
    s = g.settings
    if g.model.get("dtype"):
        parts += ["--dtype", str(g.model["dtype"])]
    if g.kernels and g.kernels != "native":
        parts += ["--kernels", g.kernels]
    if s.get("max_rows"):
        parts += ["--max-rows", str(s["max_rows"])]
    if op == "lm_head" and s.get("lm_head_rows") is not None:
        parts += ["--lm-head-rows", str(s["lm_head_rows"])]
    return " ".join(shlex.quote(p) for p in parts)


def record(g: Gate) -> dict[str, Any]:
    """:meth:`Gate.record`, each row with the command that recomputes it."""
    out = g.record()
    for r in out["rows"]:
        r["command"] = row_command(g, r["op"], int(r["T"]))
    return out


# What the gate never sees, said wherever its verdict names speculative decoding.
CACHE_SCOPE = ("the KV cache is outside this gate's scope (past the sliding window mlx-lm's RotatingKVCache "
               "orders the keys by schedule: `gemmdrift stack` measures the model)")


def _cell(equal: bool, counts: list[int]) -> str:
    return "=" if equal else f"{max(counts)}B"


def text(g: Gate) -> str:
    """The table for a terminal: '=' where the block is bit-equal to the single calls, else the most bytes that
    differ at one position ('2B'), and the verdict."""
    dev = g.device or {}
    m = g.model
    head = (f"primitives gate: {m.get('source')} ({m.get('architecture')}, {m.get('n_layers')} layers, "
            f"{m.get('dtype')}) on {dev.get('device')} ({dev.get('device_name')}), mlx {dev.get('mlx')}, "
            f"T={_ts_text(g.ts)}, kernels {g.kernels}, {g.seconds:.1f} s")
    lines = [head]
    t = g.table
    if not t.empty:
        ts = sorted(set(int(x) for x in t["T"]))
        cols = [f"T={x}" for x in ts]
        w_op = max(len("op"), *(len(s) for s in t["op"]))
        w_l = max(len("layers"), *(len(s) for s in t["layers"]))
        w_s = max(len("shape"), *(len(s) for s in t["shape"]))
        quant = lambda r: r["quant"] or ("dense" if r["kind"] == "linear" else "-")  # noqa: E731
        w_q = max(len("quant"), *(len(quant(r)) for _, r in t.iterrows()))
        lines.append(f"{'op':<{w_op}}  {'layers':<{w_l}}  {'shape':<{w_s}}  {'quant':<{w_q}}  {'bytes/pos':>9}  "
                     + " ".join(f"{c:>5}" for c in cols))
        for _, rows in t.groupby(["op", "layers", "shape", "quant"], sort=False):
            r0 = rows.iloc[0]
            cells = {}  # per T, over every seed: '=' only if equal on all of them, else the most bytes on any
            for T, at in rows.groupby("T"):
                cells[int(T)] = _cell(bool(at["equal"].all()), [n for c in at["differing_bytes"] for n in c])
            lines.append(f"{r0['op']:<{w_op}}  {r0['layers']:<{w_l}}  {r0['shape']:<{w_s}}  "
                         f"{quant(r0):<{w_q}}  {int(r0['bytes_per_position']):>9}  "
                         + " ".join(f"{cells.get(x, '-'):>5}" for x in ts))
    if g.error:
        lines.append(f"gate FAILED (closed: nothing is exact): {g.error}")
    k = g.exact_width
    s = g.settings or {}
    checked = list(dict.fromkeys(t["op"])) if not t.empty else []
    given = bool(s.get("ops"))  # --ops: a verdict of the ops checked, never a word on speculative decoding
    part = given and s.get("n_ops") is not None and len(checked) < int(s["n_ops"])
    cut = bool(s.get("max_rows")) and not t.empty and (t["kind"] == "linear").any()
    sliced = (f" (linears cut to --max-rows {s['max_rows']}: not the full shapes, which an engine should gate on)"
              if cut else "")
    what = (f"the {len(checked)} op{'' if len(checked) == 1 else 's'} checked ({len(checked)} of "
            f"{s.get('n_ops', len(checked))}: {', '.join(checked[:6])}{', ...' if len(checked) > 6 else ''})"
            if given else f"every op of the model's layer and head ({len(checked)} ops)")
    upto = "" if k is None else "T=1" if k == 0 else f"T=1..{k + 1}"
    if k is None:
        verdict = "verdict: not exact at any width here"
    elif k == max(g.ts) - 1 and (given or cut or g.error):
        verdict = (f"verdict: {what} bit-equal for {upto} at the shapes in the table"
                   + ("; the others were not checked (drop --ops for the model's verdict)" if part else ""))
    elif k == max(g.ts) - 1:
        # Every op at the model's shapes: the only place speculative decoding is named, and the cache with it
        # (PROBE-DEFECTS-4 item 7: past the sliding window the cache makes decode and verification differ).
        verdict = (f"verdict: {what} bit-equal for {upto} at the shapes in the table: speculative decoding "
                   f"with up to {k} drafted token{'' if k == 1 else 's'} is exact on this device as far as these "
                   f"ops go; {CACHE_SCOPE}")
    else:
        first = g.first_unequal()
        who = ", ".join(f"{r['op']} (layers {r['layers']}) at T={int(r['T'])}" for _, r in first.head(4).iterrows())
        verdict = f"verdict: {what} bit-equal for {upto} at the shapes in the table; first difference: {who}"
    lines.append(verdict + sliced)
    return "\n".join(lines)


__all__ = ["record", "text", "row_command"]
