"""The tracking tier: every effect the history tracks, at sizes chosen for tracking (issue 47).

``asv run`` runs these by default (benchmarks/bench_tier.py); the main job's sizes (benchmarks/common.Probes) are
opt-in. Each part is a whole measurement of the library (the same functions `gemmdrift run` calls), with inputs
small enough for every mlx release to run in a few minutes on 2 CPU cores, and read only where an effect is:

* ``decode``: decode vs verify:2 after a 504-token prompt, hidden states at every position 504..519 and the
  262,144-row LM head only at positions 508..516 around the 512-token window's edge; with the float32 rung (the
  precision ladder). Bit-identical through position 512, drifting from 513; the ladder says rounding.
* ``prefill``: the first 300 tokens prefilled in one chunk vs chunks of 128, logits at positions 248..279 (RoPE
  positions are exact in bfloat16 through 256; mlx 0.29.x computed them in the input dtype).
* ``state``: the cache-state sweep (every operation) past the window with k = 2.
* ``diverge``: the divergence probe (500-token prompt, self-draft K=2), 26 tokens: where the streams part and the
  triage (the first divergence NEAR-TIE, the stream OUTSIDE ENVELOPE).
* ``kernels``: the kernel probe on every projection of layers 0 and 5 (no LM head), T = 1, 2, 3, 4, 8, 16.
* ``fingerprint``: the summation trees (the main suite's inputs, under a second of work).
* ``ops``: the op probe (sdpa, rms_norm, rope, softmax).
* ``golden``: the shipped verify-2 base's first 272 tokens (past 256): KLD, same top-1.

Every part returns a Result whose figures include the tier's own (:func:`tier_figures`); ``side_by_side`` runs them.
"""

from __future__ import annotations

import math
import sys
from dataclasses import replace
from typing import Any

import numpy as np

from .. import suite
from ..result import Verdict

WINDOW_EDGE = 512  # the embedded Gemma's sliding window: positions 0..511 fill it
ROPE_EDGE = 256  # the last integer position bfloat16 holds exactly past 128 (8 significant bits)
TIER = dict(
    decode_tokens=520, decode_split=504, decode_logits=tuple(range(508, 517)),
    decode_schedules=("prefill:512,decode", "prefill:512,verify:2"),
    prefill_tokens=300, prefill_positions=(240, 300), prefill_logits=tuple(range(248, 280)),
    prefill_schedules=("prefill:2048", "prefill:128"),
    state_operations=("rollback", "trim", "trim_prompt_cache", "save_load", "server_reuse", "batch"),
    state_where=("past",), state_ks=(2,),
    diverge_prompt=500, diverge_n=26,
    kernel_layers=(0, 5), kernel_ts=(1, 2, 3, 4, 8, 16), kernel_paths=("model", "quant:affine-q4-g64",
                                                                       "emulated:splitk4"), kernel_rows=8,
    fp_paths=("matmul:bfloat16", "matmul:float16", "matmul:float32", "quant:affine-q4-g64:bfloat16",
              "sum:float32", "sdpa:bfloat16", "emulated:splitk4:bfloat16"), fp_k=512, fp_ts=(1, 2, 3, 4, 8, 16, 33),
    fp_n=64,
    ops={},  # measure_ops' defaults: every op, the model's geometry
    golden="linux-cpu/verify-2", golden_tokens=272,
)
# The parts, longest first (the order side_by_side starts them in: two at a time, the longest first packs them
# best). Their own seconds on the idle 2-core machine, two at a time (mlx 0.32.4): decode 90, diverge 61, state 50,
# golden 44, prefill 34, fingerprint 24, ops 9, kernels 7 -- about 160 s of wall time at best.
PARTS = ("decode", "diverge", "state", "golden", "prefill", "fingerprint", "ops", "kernels")


def _with(result, figures: dict[str, float]):
    """The Result with more figures; one that is not finite is left out (not measured: NaN in asv, never 0)."""
    more = {k: float(v) for k, v in figures.items() if v is not None and math.isfinite(float(v))}
    return replace(result, figures={**result.figures, **more})


def edge_figures(per_pos, edge: int) -> dict[str, float]:
    """From a stack's per-position logit table (one pair, one dtype): the last position through which the logits
    are bit-identical from the first compared one (``identical_through``; one before the first compared position
    when that one already differs), the first that differs (``first_drift``; NaN when none does), the largest
    max|Δlogit| at positions up to ``edge`` and past it, and the argmax flips up to and past it."""
    pos = np.asarray(per_pos["position"], dtype=np.int64)
    d = np.asarray(per_pos["max_abs_dlogit"], dtype=np.float64)
    flip = np.asarray(per_pos["flip"], dtype=bool)
    order = np.argsort(pos)
    pos, d, flip = pos[order], d[order], flip[order]
    drifting = np.flatnonzero(d > 0)
    first = float(pos[drifting[0]]) if drifting.size else math.nan
    through = float(pos[drifting[0]] - 1) if drifting.size else float(pos[-1])
    upto, past = pos <= edge, pos > edge
    return {"identical_through": through, "first_drift": first,
            "max_abs_dlogit_upto_edge": float(d[upto].max()) if upto.any() else math.nan,
            "max_abs_dlogit_past_edge": float(d[past].max()) if past.any() else math.nan,
            "flips_upto_edge": float(flip[upto].sum()) if upto.any() else math.nan,
            "flips_past_edge": float(flip[past].sum()) if past.any() else math.nan}


def _per_pos(result, dtype: str):
    t = result.tables["positions"]
    return t[(t["dtype"] == dtype) & (t["mode"] == "accumulated")]


LADDER_CODES = {Verdict.NO_DRIFT.value: 0.0, Verdict.ROUNDING.value: 1.0, Verdict.UNCLEAR.value: 2.0,
                Verdict.SEMANTIC.value: 3.0, Verdict.UNRELIABLE.value: 4.0}


def decode_part(lm, tier: dict[str, Any] | None = None):
    """Decode vs verify:2 across the window's edge, with the ladder (see the module docstring)."""
    from ..measure.stack import measure_stack, pair_verdict

    t = {**TIER, **(tier or {})}
    tokens = suite.stream(lm, t["decode_tokens"])
    r = measure_stack(lm, tokens, list(t["decode_schedules"]), split=t["decode_split"], local=False, ladder=True,
                      logit_positions=list(t["decode_logits"]))
    figs = edge_figures(_per_pos(r, lm.description.dtype), WINDOW_EDGE)
    lad = r.tables.get("ladder")
    pair = " vs ".join(t["decode_schedules"])
    if lad is not None and len(lad):
        figs["ladder_verdict"] = LADDER_CODES.get(str(pair_verdict(lad, pair).value), math.nan)
    return _with(r, figs)


def prefill_part(lm, tier: dict[str, Any] | None = None):
    """One chunk vs chunks of 128 across the RoPE edge (see the module docstring)."""
    from ..measure.stack import measure_stack

    t = {**TIER, **(tier or {})}
    tokens = suite.stream(lm, t["prefill_tokens"])
    lo, hi = t["prefill_positions"]
    r = measure_stack(lm, tokens, list(t["prefill_schedules"]), positions=np.arange(lo, hi), local=False,
                      logit_positions=list(t["prefill_logits"]))
    return _with(r, edge_figures(_per_pos(r, lm.description.dtype), ROPE_EDGE))


def state_part(lm, tier: dict[str, Any] | None = None):
    """The cache-state sweep, every operation, past the window, k = 2; plus the cases that cannot run (not applicable
    or not checked: an operation or class this mlx-lm lacks) and all cases."""
    from ..state import measure_state

    t = {**TIER, **(tier or {})}
    r = measure_state(lm, operations=t["state_operations"], where=t["state_where"], ks=t["state_ks"])
    table = r.tables["state"]
    verdicts = table["verdict"].astype(str) if len(table) else []
    # Cases this mlx-lm cannot run (an operation or class it lacks) or this gemmdrift cannot judge.
    cannot = float(sum(1 for v in verdicts if v in (str(Verdict.NOT_APPLICABLE), str(Verdict.NOT_CHECKED))))
    return _with(r, {"cannot_run": cannot, "cases": float(len(table))})


def diverge_part(lm, tier: dict[str, Any] | None = None):
    """The divergence probe: where the streams part, the first divergence's verdict and the stream's."""
    from ..measure.diverge import measure_diverge

    t = {**TIER, **(tier or {})}
    r = measure_diverge(lm, suite.stream(lm, t["diverge_prompt"]), t["diverge_n"], k=2,
                        record={"prompt": "the built-in essay", "draft": "self"})
    tri = (r.details or {}).get("triage") or {}
    figs: dict[str, float] = {}
    if tri:
        first = tri.get("divergence_verdict")
        figs["first_near_tie"] = 1.0 if first == Verdict.NEAR_TIE.value else 0.0 if first else math.nan
        b = tri.get("stream_b_check") or {}
        fo = b.get("first_outside")
        figs["stream_first_outside"] = float(fo) if fo is not None else math.nan
    return _with(r, figs)


def kernels_part(lm, tier: dict[str, Any] | None = None):
    """GEMV vs GEMM rows on every projection of two decoder layers (the LM head's T sweep is the main suite's)."""
    from .. import kernels

    t = {**TIER, **(tier or {})}
    projs = kernels.projections(lm, layers=list(t["kernel_layers"]))
    inputs = kernels.capture_inputs(lm, suite.stream(lm, 128), projs, max_rows=t["kernel_rows"])
    return kernels.measure_kernels(lm, inputs, projs, list(t["kernel_paths"]), t["kernel_ts"],
                                   record={"tier": "tracking"})


def fingerprint_part(lm, tier: dict[str, Any] | None = None):
    t = {**TIER, **(tier or {})}
    return suite.fingerprint_part(lm, paths=list(t["fp_paths"]), K=t["fp_k"], ts=t["fp_ts"], N=t["fp_n"], draw_k=0)


def ops_part(lm, tier: dict[str, Any] | None = None):
    from ..kernels import measure_ops

    t = {**TIER, **(tier or {})}
    return measure_ops(lm, **t["ops"])


def golden_part(lm, tier: dict[str, Any] | None = None):
    t = {**TIER, **(tier or {})}
    return suite.golden_part(lm, name=t["golden"], n_tokens=t["golden_tokens"])


FUNCTIONS = {"decode": decode_part, "prefill": prefill_part, "state": state_part, "diverge": diverge_part,
             "kernels": kernels_part, "fingerprint": fingerprint_part, "ops": ops_part, "golden": golden_part}


def run_part(lm, part: str, tier: dict[str, Any] | None = None):
    """One part, as :func:`gemmdrift.suite.side_by_side` runs it: its Result, or ``{"cannot_run": reason}`` when this
    mlx or mlx-lm cannot run it (the part's figures are then NaN, skipped, never 0; the other parts go on)."""
    try:
        return FUNCTIONS[part](lm, tier)
    except Exception as e:  # noqa: BLE001  (any failure of a release is recorded, not raised: the run goes on)
        reason = f"{e.__class__.__name__}: {e}".splitlines()[0][:300]
        print(f"gemmdrift tier: part {part} cannot run here: {reason}", file=sys.stderr, flush=True)
        return {"cannot_run": reason}


def parts(only: Any = (), tier: dict[str, Any] | None = None) -> dict[str, tuple[Any, dict[str, Any]]]:
    """``{part: (run_part, kwargs)}`` for :func:`gemmdrift.suite.side_by_side`, longest first; ``only``: a subset;
    ``tier``: sizes replacing :data:`TIER`'s (tests)."""
    unknown = [p for p in only if p not in FUNCTIONS]
    if unknown:
        from ..errors import GemmdriftError

        raise GemmdriftError(f"unknown tier part {unknown[0]!r} (choose from {', '.join(PARTS)})")
    return {p: (run_part, dict(part=p, tier=tier)) for p in PARTS if not only or p in only}


def measure_tier(lm, only: Any = (), workers: int | None = None,
                 tier: dict[str, Any] | None = None) -> dict[str, dict[str, float]]:
    """Every part side by side (each whole, in a process of its own): ``{part: figures}``; a part not run, or one
    that cannot run on this release (:func:`run_part`): {} (its benchmarks are skipped)."""
    results = suite.side_by_side(lm, parts(only, tier), workers=workers)
    return {p: dict(results[p].figures) if hasattr(results.get(p), "figures") else {} for p in PARTS}
