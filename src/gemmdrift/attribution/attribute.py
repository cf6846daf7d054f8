"""Which op: every drift, flip and divergence attributed to the op and layer that made it (issue 29).

:func:`attribute` is the one library function every axis goes through: two schedules on this machine, a
replayed chip (``kernels="replay:<chip>"``), a planted change (``perturb``), and the first divergence of
``triage`` / ``diverge`` (:func:`explain_flip`). For a pair (reference A, schedule B) over the same tokens:

1. **local drift per op** (:mod:`gemmdrift.model.optaps`): B run with every op fed A's input to it and handing
   A's output on (so the KV cache holds A's keys and values), at every position B computes up to the last
   compared one; per (layer, op, position) the share of differing bits, max ULP and rel L2, the first op in
   forward order whose output bits differ at each position, and what differs between two tapped ops
   (``unattributed``);
2. **the counterfactual** per op class: ``each``, B rerun with that class's outputs replaced by A's (the class
   made invariant, everything else as it is), and ``all-but-one``, B rerun keeping one drifting class as it is
   and every other drifting class *held* (:mod:`gemmdrift.attribution.hold`: its own drift removed, what it
   carries from upstream kept; the final norm and the LM head too, so the head's own drift is its own row and no
   floor under the others), measured at the logits: max|Δlogit|, max|Δgap|, flips, KLD, same top-1. A cause
   of a flip drifts locally at or before it and its replacement removes it, said in one line
   (:mod:`gemmdrift.attribution.verdict`). Nothing drifting: the counterfactual is skipped.

The prefix both schedules share is computed once (natively under a replay, as ``stack`` does); the LM head runs
only at the compared positions. Runs: A (record), B as it is (layer taps only), B (local), one per
counterfactual.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import pandas as pd

from ..model import native as native_kernels, optaps
from ..checkpoint import Checkpoints
from ..errors import GemmdriftError
from ..result import Result, env_labels, figure_name, tidy
from ..schedules import parse_schedule
from ..text import fmt
from .. import metrics
from ..measure.stack import two_run
from ..model.taps import common_prefix, run_schedule
from .hold import holdable, holder
from .verdict import causes_of, mark_causes, ops_summary, unattributed, verdict_line

DIRECTIONS = ("each", "all-but-one")
ENVELOPE = ("max_abs_dlogit", "max_abs_dgap", "flips", "kld_mean", "same_top1_share")
# What a checkpoint's parts mean (in its key: a part saved by other code is not resumed): 2 since issue 46,
# every computed position, the reference's outputs handed on, the inputs checked; 3 since issue 53, all-but-one
# holds the other classes (their own drift removed, what they carry kept) instead of replacing them.
LOCAL_MODE = 3


def _envelope(ref_taps, taps, tokens) -> dict[str, Any]:
    """The logit envelope of ``taps`` against the reference and the positions that flip: the logit figures of
    :func:`gemmdrift.measure.stack.compare_taps` (:func:`gemmdrift.metrics.logit_drift`, its envelope and the
    two-run statistics), without the per-layer rows and the bit counts over the vocabulary nobody reads here."""
    la, lb = ref_taps.logits[ref_taps.logit_rows(taps.logit_positions)], taps.logits
    d = metrics.logit_drift(la, lb)
    env = {**metrics.envelope_summary(d), **two_run(la, lb, taps.logit_positions, tokens)}
    flips = [int(p) for p in np.asarray(taps.logit_positions)[np.asarray(d["flip"], bool)]]
    return {**{k: float(env[k]) if k in env else float("nan") for k in ENVELOPE}, "flip_positions": flips}


def _say(text: str) -> None:
    print(f"  {text}", file=sys.stderr, flush=True)


def attribute(lm, tokens: Sequence[int], schedules: Sequence[str], *, split: int | None = None,
              positions: Sequence[int] | None = None, ops: Sequence[str] | None = None,
              counterfactual: Sequence[str] = DIRECTIONS, kernels: str | None = None,
              perturb: Mapping[tuple[int, str], Callable] | None = None, checkpoint: str | None = None,
              env: dict[str, Any] | None = None, record: dict[str, Any] | None = None,
              prefix_store: str | None = None, needs_flip: bool = False) -> Result:
    """Attribute the drift between two schedules to ops, layers and op classes.

    Args:
        lm: a :class:`gemmdrift.model.LoadedModel`.
        tokens: the token stream (teacher forced).
        schedules: (reference A, schedule B), e.g. ``["prefill:512,decode", "prefill:512,verify:2"]``.
        split: prompt/continuation boundary for two-phase schedules.
        positions: compared positions (hidden states, ops and logits; default ``split..end``).
        ops: op classes for the counterfactual (``q_proj``, ``sdpa``, ...; default every class the model exposes).
        counterfactual: directions to run: ``each`` (one class made invariant), ``all-but-one``; empty: none.
        kernels: ``replay:<chip>[@variant]``: both schedules under that chip's replayed projections.
        perturb: ``(layer, op) -> f(output, args) -> output`` under schedule B only (planted changes, controls);
            such a run is not checkpointed.
        checkpoint: a directory: every finished part is saved there and a repeated call resumes from it.
        prefix_store: a directory where measurements of one run share their prefixes (as ``stack``'s:
            :func:`gemmdrift.measure.stack.measure_stack`).
        needs_flip: run the counterfactual only where a compared position flips (:func:`explain_flip`).

    The counterfactual runs are skipped (``details["counterfactual_skipped"]`` says why) when nothing drifts:
    the logits bit-identical, no op with local drift, nothing unattributed.

    Returns:
        An ``attribute`` :class:`Result`: tables ``local`` (layer x op x position), ``ops`` (per layer and op),
        ``first`` (first differing op per position), ``counterfactual`` (class x direction: the envelope left),
        ``envelope`` (the pair as it is); ``details["verdict"]`` the one-line verdict.
    """
    from ..machine.envinfo import environment
    from ..replay.model import KernelsOption
    from ..model import weights_record

    if len(schedules) != 2:
        raise GemmdriftError(f"attribute compares two schedules (a reference and one other), got {len(schedules)}")
    bad = [d for d in counterfactual if d not in DIRECTIONS]
    if bad:
        raise GemmdriftError(f"unknown counterfactual {bad[0]!r} (expected {', '.join(DIRECTIONS)} or none)")
    a, b = (parse_schedule(s).text for s in schedules)
    n = len(tokens)
    if n < 2:
        raise GemmdriftError(f"the token stream is too short ({n} tokens)")
    for s in (a, b):
        parse_schedule(s).blocks(n, split)
    positions = np.unique(np.asarray(positions if positions is not None else
                                     np.arange(split if split is not None else 0, n), dtype=np.int64))
    if positions.size == 0 or positions[0] < 0 or positions[-1] >= n:
        raise GemmdriftError(f"compared positions must lie in 0..{n - 1}")
    exposed = optaps.exposed_ops(lm.model)
    classes = exposed.resolve(ops, "op class") if ops else exposed.classes
    site_list = optaps.sites(lm.model)  # before a replay's proxies go in
    kopt = KernelsOption(kernels)
    pair = f"{a} vs {b}"
    toks = [int(t) for t in tokens]
    ck = Checkpoints(checkpoint if perturb is None else None, "attribute", lm.description, toks, a, b, split,
                     [int(p) for p in positions], kopt.text, LOCAL_MODE)
    runs: dict[str, Any] = {}
    with kopt.installed(lm):
        with native_kernels.shared_prefix(lm.model) as log:
            native = log is None or log.prefix_native  # a replayed prefix is never stored nor read
            store = ((prefix_store, lm.description, lm.description.dtype) if prefix_store is not None and native
                     else None)
            prefix = common_prefix(lm.model, toks, [a, b], split, int(positions[0]), store=store)
        native_kernels.say_prefix(log, prefix, "both schedules")
        if prefix is not None and prefix.loaded:
            _say(f"shared prefix: {prefix.length} tokens, read from the run's store")

        def reference():
            if "ref" not in runs:
                runs["ref"] = optaps.run_ops(lm.model, toks, a, split=split, prefix=prefix, logit_positions=positions,
                                             keep_inputs=True, site_list=site_list)
                _say(f"reference {a}: {runs['ref'][0].seconds:.1f} s")
            return runs["ref"]

        def run_b(positions=positions, **kw):
            ref_taps, ref = reference()
            taps, rec = optaps.run_ops(lm.model, toks, b, split=split, prefix=prefix, positions=positions,
                                       logit_positions=compared, perturb=perturb, site_list=site_list,
                                       reference=ref if kw else None, **kw)
            return ref_taps, ref, taps, rec

        compared = positions
        part = ck.load("local")
        if part is None:
            ref_taps, ref = reference()
            # B as it is needs its logits only: the layer taps' run without op taps (a planted change under B
            # lives in the op taps, so then B runs with them)
            acc_taps = (run_b(record_ops=False)[2] if perturb else
                        run_schedule(lm.model, toks, b, split=split, positions=positions, logit_positions=positions,
                                     prefix=prefix))
            base = _envelope(ref_taps, acc_taps, toks)
            # Local drift at every position B computes up to the last compared one: the blocks before a compared
            # position reach its logits through the cache (Report A D5), so their drift is measured too.
            computed = np.arange(prefix.length if prefix is not None else 0, int(positions[-1]) + 1)
            _, _, _, loc = run_b(positions=computed, local=True)
            local = optaps.local_drift(ref, loc)
            first = optaps.first_differing(local)
            part = {"base": base, "local": local.to_dict("records"), "first": first.to_dict("records")}
            ck.save("local", part)
            _say(f"local drift: {int((local['frac_differ'] > 0).sum())} of {len(local)} (layer, op, position) differ")
        base, local, first = part["base"], pd.DataFrame(part["local"]), pd.DataFrame(part["first"])
        loose = unattributed(local)
        # Classes that carry local drift: "all but one" holds every other one of them (:mod:`.hold`: its own drift
        # removed, what it carries kept; an op that drifts nowhere on its own is left as it is: it only carries),
        # the final norm and the LM head included. The attention core cannot be held (it reads the cache): its
        # own drift stays in every all-but-one row, and the result says so.
        drifting = [c for c in exposed.classes if c in set(local["class"][local["frac_differ"] > 0])]
        unheld = [c for c in drifting if not holdable(exposed.kinds, c)]
        skipped = None
        if counterfactual and base["max_abs_dlogit"] == 0 and not drifting and not loose:
            skipped = ("the counterfactual runs were skipped: nothing drifts, so each would leave 0 by "
                       "construction")
        elif counterfactual and needs_flip and not base["flip_positions"]:
            skipped = "the counterfactual runs were skipped: no compared position flips, so none has a flip to remove"
        if skipped:
            _say(skipped)
        cf_rows = []
        if skipped and not drifting and not loose and base["max_abs_dlogit"] == 0 and "each" in counterfactual:
            # Nothing drifts: making a class invariant replaces B's outputs by equal ones, so each row is the base
            # envelope (all 0) without a run; the tracked figures keep their meaning (0 left, never "not measured").
            cf_rows = [{"class": cls, "direction": "each", **base} for cls in classes]
        all_held: dict[str, Any] = {}  # all-but-one of a class with no drift of its own: every drifting one held
        for direction in counterfactual if skipped is None else ():
            for cls in classes:
                replace = [cls] if direction == "each" else []
                held = ([] if direction == "each" else
                        [c for c in drifting if c != cls and c not in unheld])
                row = ck.load("cf", direction, cls)
                if row is None and not replace and not held:  # nothing else to hold: the pair as it is
                    row = {"class": cls, "direction": direction, **base}
                if row is None and direction != "each" and cls not in drifting and all_held:
                    row = {**all_held, "class": cls}
                    ck.save("cf", row, direction, cls)
                if row is None:
                    hold = None
                    if held:
                        hold = dict.fromkeys(held, holder(reference()[1], parse_schedule(a).blocks(n, split),
                                                          positions))
                    ref_taps, _, taps, _ = run_b(replace=replace, hold=hold, record_ops=False)  # its logits are read
                    row = {"class": cls, "direction": direction, **_envelope(ref_taps, taps, toks)}
                    ck.save("cf", row, direction, cls)
                    _say(f"{direction:11s} {cls:28s} flips {row['flips']:.0f}  max|dlogit| {fmt(row['max_abs_dlogit'])}")
                if direction != "each" and cls not in drifting:
                    all_held = row
                cf_rows.append(row)
    summary = ops_summary(local)
    cf = mark_causes(pd.DataFrame(cf_rows, columns=["class", "direction", *ENVELOPE, "flip_positions"]), base,
                     summary)
    verdict = verdict_line(pair, base, cf, summary, loose, skipped)
    env_record = {**(env if env is not None else environment()), **weights_record(lm.description)}
    inputs = {"model": lm.info, "tokens": toks, "schedules": [a, b], "reference": a, "split": split,
              "positions": [int(p) for p in positions], "ops": list(classes), "counterfactual": list(counterfactual),
              "kernels": kopt.text or None, "planted": sorted(f"{k[0]}:{k[1]}" for k in (perturb or {})),
              **(record or {})}
    tables = {"local": local, "ops": summary, "first": first, "counterfactual": cf,
              "envelope": pd.DataFrame([{"pair": pair, **{k: v for k, v in base.items() if k != "flip_positions"},
                                         "flip_positions": list(base["flip_positions"])}])}
    result = attribute_result(tables, inputs, env_record, {
        "verdict": verdict, "unattributed": loose, "counterfactual_skipped": skipped,
        "all_but_one_unheld": unheld if "all-but-one" in counterfactual and skipped is None else [],
        "exposed": {"layer_ops": exposed.names, "head": exposed.head, "part_of": exposed.part_of}})
    ck.clear()
    return kopt.label(result)


def attribute_figures(tables: Mapping[str, pd.DataFrame], pair: str) -> dict[str, float]:
    """Tracked figures: ``attr_local_bits/<pair>/<class>`` (log2(1 + max ULP) of the class's local drift over
    layers and positions) and ``attr_left_<metric>/<pair>/<direction>/<class>`` (the envelope left)."""
    from ..metrics import bits_lost

    out: dict[str, float] = {}
    s = tables.get("ops", pd.DataFrame())
    for cls, g in (s.groupby("class", sort=False) if len(s) else []):
        out[figure_name("attr_local_bits", pair, cls)] = bits_lost(float(g["max_ulp"].max()))
    cf = tables.get("counterfactual", pd.DataFrame())
    for _, r in cf.iterrows() if len(cf) else []:
        for k in ("max_abs_dlogit", "flips"):
            out[figure_name(f"attr_left_{k}", pair, r["direction"], r["class"])] = float(r[k])
    return {k: v for k, v in out.items() if np.isfinite(v)}


def attribute_result(tables: Mapping[str, pd.DataFrame], inputs: Mapping[str, Any], env: Mapping[str, Any],
                     details: Mapping[str, Any]) -> Result:
    pair = f"{inputs['schedules'][0]} vs {inputs['schedules'][1]}"
    s = tables["ops"]
    rows = ([{"pair": pair, "layer": int(r["layer"]), "op": r["op"], "metric": m, "value": float(r[m])}
             for _, r in s.iterrows() for m in ("frac_differ", "max_ulp", "rel_l2")] if len(s) else [])
    cf = tables["counterfactual"]
    rows += ([{"pair": pair, "layer": -1, "op": f"{r['direction']}:{r['class']}", "metric": f"left_{m}",
               "value": float(r[m])} for _, r in cf.iterrows() for m in ENVELOPE] if len(cf) else [])
    frame = tidy(pd.DataFrame(rows, columns=["pair", "layer", "op", "metric", "value"]), **env_labels(env),
                 model=inputs["model"].get("source", ""))
    return Result(kind="attribute", inputs=inputs, env=env, frame=frame, figures=attribute_figures(tables, pair),
                  tables=dict(tables), details=details)


def explain_flip(lm, tokens: Sequence[int], schedules: Sequence[str], position: int, *, split: int | None = None,
                 kernels: str | None = None, perturb: Mapping[tuple[int, str], Callable] | None = None) -> dict[str, Any]:
    """At one position (the first divergence of ``triage`` / ``diverge``): the op classes whose counterfactual
    removes the flip there (``removed_by``; ``causes``: those whose own local drift starts at or before it,
    :func:`gemmdrift.attribution.verdict.causes_of`), and the first op whose local output bits differ there.
    ``tokens`` must reach the end of the blocks that hold ``position`` (the computation that diverged); the
    counterfactual runs only when the position flips. It explains a verdict; it decides none."""
    r = attribute(lm, tokens, schedules, split=split, positions=[position], counterfactual=("each",), kernels=kernels,
                  perturb=perturb, needs_flip=True)
    cf = r.tables["counterfactual"]
    first = r.tables["first"]
    flipped = position in list(r.tables["envelope"]["flip_positions"].iloc[0])
    removes = [c for c, f in zip(cf["class"], cf["flip_positions"]) if position not in f] if flipped and len(cf) else []
    row = first[first["position"] == position]
    return {"position": int(position), "flipped": bool(flipped), "removed_by": removes,
            "causes": causes_of(position, cf, r.tables["ops"]) if flipped and len(cf) else [],
            "first_op": (f"layer {int(row['layer'].iloc[0])} {row['op'].iloc[0]}"
                         if len(row) and int(row["layer"].iloc[0]) >= 0 else None),
            "unattributed": r.details["unattributed"], "verdict": r.details["verdict"]}


# The `attribute` part of `gemmdrift run`: the main job's pair (decode vs verify:2 past the sliding window on
# the CPU sizes), the counterfactual for the attention core and two projections (the local drift of every op is
# measured whatever the classes). Six runs over the 60 compared positions: within the 60 s the part may add.
PART_OPS = ("sdpa", "q_proj", "down_proj")
PART_SIZES = {"cpu": dict(tokens=560, split=500, ops=PART_OPS), "gpu": dict(tokens=2600, split=2300, ops=None),
              "quick": dict(tokens=40, split=32, ops=("sdpa", "q_proj"))}


def attribute_part(lm, name: str, checkpoint=None, env: dict[str, Any] | None = None,
                   prefix_store: str | None = None) -> Result:
    """The ``attribute`` part of the main job at sizes ``name`` (cpu, gpu, quick): decode vs verify:2."""
    from .. import defaults
    from ..prompts import builtin_stream

    s = PART_SIZES[name]
    return attribute(lm, builtin_stream(lm, s["tokens"]), list(defaults.STACK_SCHEDULES[:2]), split=s["split"],
                     ops=s["ops"], counterfactual=("each",), checkpoint=str(checkpoint) if checkpoint else None,
                     env=env, record={"prompt": "built-in text 'essay'", "sizes": name},
                     prefix_store=str(prefix_store) if prefix_store is not None else None)


def taps_overhead(lm, tokens: Sequence[int], schedules: Sequence[str], split: int) -> dict[str, float]:
    """Seconds of the op taps (attribute without a counterfactual: reference, B accumulated, B local) against a
    plain ``stack`` of the same pair (reference, accumulated, local), and their ratio (the budget is 1.3)."""
    import time

    from ..measure.stack import measure_stack

    t0 = time.perf_counter()
    measure_stack(lm, tokens, list(schedules), split=split, workers=1)
    plain = time.perf_counter() - t0
    t0 = time.perf_counter()
    attribute(lm, tokens, list(schedules), split=split, counterfactual=())
    tapped = time.perf_counter() - t0
    return {"stack_seconds": plain, "attribute_seconds": tapped, "ratio": tapped / plain}


__all__ = ["attribute_part", "taps_overhead", "PART_SIZES", "attribute", "attribute_result", "attribute_figures",
           "verdict_line", "ops_summary", "explain_flip", "DIRECTIONS"]
