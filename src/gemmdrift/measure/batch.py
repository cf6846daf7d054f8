"""Batch as a schedule axis: one stream computed as row j of a batch vs the same stream alone.

The batch is mlx-lm's own continuous batching, ``BatchGenerator`` in
``mlx_lm/generate.py`` (0.32.2), what ``batch_generate`` and ``mlx_lm.server``
run: every prompt gets its own cache, the caches are merged into
``BatchKVCache`` / ``BatchRotatingKVCache`` (``mlx_lm/models/cache.py``), the
prompts are prefilled together (right-padded, then ``finalize`` turns it into
left padding and the mask hides the pad), and each decode step is one forward
pass over B rows: every projection is a GEMM with M=B instead of a GEMV. The
row's stream and its per-step log-probabilities come straight from
``GenerationBatch`` responses; "alone" is ``mlx_lm.generate.generate_step`` on
the same prompt.

What is compared, at every generated position both streams share (the
positions read anyway, so no extra vocabulary-wide logits are computed):

* the **batch envelope**: max |Δgap| (top-2 gap of the alone logits minus the
  same two tokens' gap in the row's logits, :func:`gemmdrift.metrics.logit_drift`)
  and max |Δ log-prob|;
* **greedy divergence**: the first generated token where the row differs, and
  the margin there (how far apart the two competing tokens are, the smaller
  of the two computations' readings);
* a **reference envelope** per prompt: max |Δgap| between two single-sequence
  schedules of the same stream (``prefill:2048,decode`` vs
  ``prefill:2048,verify:2``, teacher forced by :func:`gemmdrift.measure.diverge.triage`):
  what changing a kernel's M from 1 to 3 does without any batch.

Verdict per row: IDENTICAL (same tokens, bit-identical log-probs); NEAR-TIE
(the row parts at a margin within the reference envelope, or drifts without
parting, within it); OUTSIDE ENVELOPE (the row's log-probs move by more than
the reference envelope where the streams agree, or it parts at a margin
larger than it: suspect padding, masks or cache state, as a planted one-row
mask shift does). A batch that is honestly noisier than the single-sequence
schedules also lands OUTSIDE: the verdict says "more than any single-sequence
schedule", not "a bug" by itself. With ``ladder_lm`` (``gemmdrift batch
--ladder``) each such row is rerun at float32: rounding shrinks by orders of
magnitude, a padding or state bug keeps its size. The ladder compares the
top-2 gap through the first divergence (:func:`parting_size`), not the
envelope alone: a bug that flips the first token it touches has no agreeing
position after it.

**Per-layer drift** (``layers=True``, ``gemmdrift batch --layers``): the
taps' layer proxies (:mod:`gemmdrift.model.taps`) are installed while mlx-lm's
``GenerationBatch`` decodes, and at every decode step they keep the followed
row of each layer's output (the row index comes from the generation batch's
own uids, so it follows the sequence when others join or leave). The
reference is the same stream alone, tapped by :func:`gemmdrift.model.taps.run_schedule`
under ``prefill:2048,decode`` split where ``generate_step`` splits it (the
prompt minus its last token, then T=1). Compared per layer at every generated
position whose input both share (up to and including the first divergence);
the prefill's effect enters through the cache.

The batch-cache operations themselves (extend, filter, merge vs alone) are
checked by the state-exactness work (issue 13); this module compares whole
generations (run by :mod:`gemmdrift.measure.batchgen`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from .. import metrics
from ..errors import GemmdriftError
from ..text import nth_generated
from ..prompts import BATCH_SCHEDULE  # a batch row's schedule in its stream file (`gemmdrift triage` reads it)
from ..result import Verdict
from .batchgen import Run, generate_alone, generate_batch, shift_row_mask  # noqa: F401  (callers use them from here)

PLAIN = "prefill:2048,decode"
REFERENCE = "prefill:2048,verify:2"
IDENTICAL, NEAR_TIE, OUTSIDE = "IDENTICAL", "NEAR-TIE", "OUTSIDE ENVELOPE"


@dataclass
class RowComparison:
    """Row j of a batch against the same prompt alone."""

    B: int
    row: int
    companions: str
    prompt_tokens: int
    companion_tokens: list[int]
    first_divergence: int | None
    envelope_batch: float  # max |Δgap| where the streams agree
    max_dlogprob: float
    bit_identical: bool
    margin: float | None  # at the divergence
    reference_envelope: float | None
    verdict: str
    reason: str
    tokens_alone: list[int] = field(default_factory=list)
    tokens_row: list[int] = field(default_factory=list)
    seconds_batch: float = 0.0
    seconds_alone_all: float = 0.0  # the B prompts one by one
    ladder_envelope: float | None = None  # parting_size of the same row rerun at float32
    ladder_shrink: float | None = None
    ladder: str = ""  # rounding | semantic | unclear | unreliable (stack.ladder_verdict), rows outside the envelope
    layers: list[dict[str, Any]] = field(default_factory=list)  # per-layer drift (layers=True), see layer_drift

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def parting_size(alone: Run, row: Run, j: int) -> float:
    """max |dgap| of row ``j`` against ``alone`` over the positions with the same prefix, the first divergence
    included: what the precision ladder compares at both precisions.

    The envelope (``compare_row``) stops before the divergence, where the streams still agree. A bug that flips
    the very first token it touches leaves no agreeing position after it, so its envelope is rounding-sized at
    both precisions and the ladder would call it rounding; its top-2 gap at the divergence keeps its size.
    """
    from .diverge import first_divergence

    ta, tb = alone.tokens[0], row.tokens[j]
    d = first_divergence(ta, tb)
    upto = min(len(ta), len(tb)) if d is None else d + 1
    if not upto:
        return 0.0
    la, lb = alone.logprobs[0][:upto], row.logprobs[j][:upto]
    return float(np.max(np.abs(metrics.logit_drift(la.astype(np.float64), lb.astype(np.float64))["dgap"])))


def compare_row(alone: Run, row: Run, j: int, reference_envelope: float | None) -> dict[str, Any]:
    """Envelope, divergence, margin and verdict of row ``j`` of ``row`` against ``alone``.

    Known answers (tests): identical log-probs give IDENTICAL; a planted mask
    shift gives OUTSIDE ENVELOPE against any honest reference envelope.
    """
    from .diverge import first_divergence

    ta, tb = alone.tokens[0], row.tokens[j]
    la, lb = alone.logprobs[0], row.logprobs[j]
    d = first_divergence(ta, tb)
    common = d if d is not None else min(len(ta), len(tb))
    agree = slice(0, common)  # positions predicting the same token from the same prefix
    upto = slice(0, common + (1 if d is not None else 0))  # and the divergence itself: same prefix
    bit = bool(d is None and np.array_equal(la[upto], lb[upto]))
    if common:
        drift = metrics.logit_drift(la[agree].astype(np.float64), lb[agree].astype(np.float64))
        env_b = float(np.max(np.abs(drift["dgap"])))
    else:
        env_b = 0.0
    max_dlp = float(np.max(np.abs(la[upto].astype(np.float64) - lb[upto].astype(np.float64)))) if common or d == 0 else 0.0
    margin = None
    if d is not None:
        xa, xb = la[d].astype(np.float64), lb[d].astype(np.float64)
        margin = float(min(abs(xa[ta[d]] - xa[tb[d]]), abs(xb[ta[d]] - xb[tb[d]])))
    ref = reference_envelope
    if bit:
        verdict, reason = IDENTICAL, "same tokens, bit-identical log-probs at every position"
    elif ref is None:
        verdict = NEAR_TIE if d is None else OUTSIDE
        reason = "no reference envelope measured"
    elif env_b > ref:
        verdict = OUTSIDE
        reason = (f"where the streams agree the batch moves a top-2 gap by {env_b:.4g}, more than the "
                  f"{ref:.4g} any single-sequence schedule change does: suspect padding, mask or cache state")
    elif d is not None and margin > ref:
        verdict = OUTSIDE
        reason = f"the row parts at {nth_generated(d)} where the competing tokens are {margin:.4g} apart, outside the {ref:.4g} envelope"
    elif d is not None:
        verdict = NEAR_TIE
        reason = f"the row parts at {nth_generated(d)}, a near-tie ({margin:.4g} within the {ref:.4g} envelope)"
    else:
        verdict = NEAR_TIE
        reason = f"same tokens; the log-probs drift by at most {env_b:.4g} in top-2 gap, within the {ref:.4g} envelope"
    return {"first_divergence": d, "envelope_batch": env_b, "max_dlogprob": max_dlp, "bit_identical": bit,
            "margin": margin, "verdict": verdict, "reason": reason}


def reference_envelope(lm, prompt: Sequence[int], stream: Sequence[int]) -> float:
    """max |Δgap| between two single-sequence schedules (``prefill:2048,decode`` vs
    ``prefill:2048,verify:2``) teacher-forced on ``stream`` (:func:`gemmdrift.measure.diverge.triage`)."""
    from .diverge import triage

    return float(triage(lm, list(prompt), list(stream), list(stream), PLAIN, REFERENCE).envelope)


def alone_layers(lm, target: Sequence[int], stream: Sequence[int], n: int, prefill_step: int = 2048):
    """The target alone, tapped at every layer at the positions predicting generated tokens 0..n-1 (the blocks
    ``generate_step`` runs: the prompt minus its last token in chunks, then T=1), teacher forced on ``stream``."""
    from ..model.taps import run_schedule

    if len(target) < 2:
        raise GemmdriftError("per-layer drift through the batch needs a prompt of at least 2 tokens")
    L = len(target)
    seq = [int(t) for t in target] + [int(t) for t in stream[: n - 1]]
    return run_schedule(lm.model, seq, f"prefill:{prefill_step},decode", split=L - 1,
                        positions=np.arange(L - 1, len(seq)))


def layer_drift(alone: np.ndarray, row: np.ndarray, dtype: str) -> list[dict[str, Any]]:
    """Per tap (decoder layers, then the final norm): the row's hidden states against the alone run's at the
    same positions, (taps, positions, hidden) each: rel L2, max |Δ|, fraction of elements not bit-identical."""
    from .stack import tap_names

    if alone.shape != row.shape:
        raise GemmdriftError(f"per-layer drift: alone {alone.shape} vs row {row.shape}")
    if alone.shape[1] == 0:
        return []
    names = tap_names(alone.shape[0] - 1)[:-1]  # layer 0..n-1, norm
    out = []
    for i, name in enumerate(names):
        m = metrics.compare(alone[i], row[i], dtype)
        out.append({"tap": name, "layer": i, "positions": int(alone.shape[1]), "rel_l2": m["rel_l2"],
                    "max_abs": m["max_abs"], "frac_differ": m["frac_differ"], "max_ulp": m["max_ulp"]})
    return out


def layout(target: Sequence[int], companions: Sequence[Sequence[int]], B: int, row: int) -> list[list[int]]:
    """B prompts: the target at ``row``, the first B-1 companions around it."""
    if not 0 <= row < B:
        raise GemmdriftError(f"row {row} is outside a batch of {B}")
    if len(companions) < B - 1:
        raise GemmdriftError(f"a batch of {B} needs {B - 1} companion prompts, got {len(companions)}")
    others = [list(c) for c in companions[: B - 1]]
    return others[:row] + [list(target)] + others[row:]


def sweep(lm, target: Sequence[int], companion_sets: dict[str, Sequence[Sequence[int]]], n: int, *,
          batch_sizes: Sequence[int] = (1, 2, 4, 8), rows: str = "ends", prefill_step: int = 2048,
          reference: bool = True, plant: Callable | None = None, ladder_lm=None,
          progress=None, layers: bool = False, checkpoint=None, sink: list | None = None) -> list[RowComparison]:
    """Row j of a batch of B vs the target alone, over B, row positions and companion sets.

    ``ladder_lm``: the same model at float32; every row outside the envelope is
    rerun with it, and the precision ladder says whether its drift is rounding
    (shrinks by orders of magnitude) or semantic (keeps its size), as
    :func:`gemmdrift.measure.stack.ladder_verdict` does for schedules.

    Args:
        companion_sets: {label: companion prompts (token ids)}; e.g. 'short' and
            'long' (longer than the sliding window).
        rows: 'ends' (first and last row) or 'all'.
        plant: a bug planted into every batch (tests): ``plant(caches, row)``.
        layers: follow the row through the batch at every layer (``RowComparison.layers``).
        checkpoint: a :class:`gemmdrift.checkpoint.Checkpoints`; every finished row is saved there and a
            row saved before (same inputs) is loaded instead of rerun.
        sink: finished rows are appended here as they finish (what an interrupted run keeps).
    """
    say = progress or (lambda msg: None)
    for B in batch_sizes:
        if B < 1:
            raise GemmdriftError(f"batch sizes must be positive, got {B}")
    if rows not in ("ends", "all"):
        raise GemmdriftError(f"rows must be 'ends' or 'all', got {rows!r}")
    # Warm-up, untimed: the lazy weights load on the first pass, and on a GPU every kernel is built on first use;
    # two tokens, so the decode step is built too.
    generate_alone(lm.model, target, 2, prefill_step)
    alone = generate_alone(lm.model, target, n, prefill_step)
    say(f"alone: {n} tokens in {alone.seconds:.1f} s")
    ref = reference_envelope(lm, target, alone.tokens[0]) if reference else None
    if ref is not None:
        say(f"reference envelope (single-sequence {PLAIN} vs {REFERENCE}): {ref:.4g}")
    taps_alone = alone_layers(lm, target, alone.tokens[0], n, prefill_step) if layers else None
    alone_seconds: dict[tuple, float] = {}

    def seconds_alone(p) -> float:  # the B prompts one by one, for the cost ratio
        key = tuple(p)
        if key not in alone_seconds:
            alone_seconds[key] = alone.seconds if key == tuple(target) else generate_alone(
                lm.model, p, n, prefill_step).seconds
        return alone_seconds[key]

    out: list[RowComparison] = []
    high_alone = rung = None
    for label, comps in companion_sets.items():
        for B in batch_sizes:
            positions = range(B) if rows == "all" else sorted({0, B - 1})
            # Each batch size's kernels (prefill and decode with M=B) built once, untimed, before its timed runs.
            generate_batch(lm.model, layout(target, comps, B, positions[0]), 2, prefill_step=prefill_step)
            for j in positions:
                unit = (f"{label}_B{B}_r{j}", [int(t) for t in target], [list(map(int, p)) for p in comps], n, B, j,
                        prefill_step, reference, ladder_lm is not None, layers, plant is not None)
                saved = checkpoint.load(*unit, check=lambda d: "verdict" in d) if checkpoint is not None else None
                if saved is not None:
                    out.append(RowComparison(**saved))
                    if sink is not None:
                        sink.append(out[-1])
                    say(f"{label:6s} B={B} row {j}: done before (resumed)")
                    continue
                prompts = layout(target, comps, B, j)
                run = generate_batch(lm.model, prompts, n, keep=[j], prefill_step=prefill_step,
                                     plant=None if plant is None else (lambda caches, j=j: plant(caches, j)),
                                     follow=j if layers else None)
                c = compare_row(alone, run, j, ref)
                if layers:  # the positions whose input both share: up to and including the first divergence
                    d = c["first_divergence"]
                    k = min(run.hidden.shape[1], taps_alone.hidden.shape[1], n if d is None else d + 1)
                    c["layers"] = layer_drift(taps_alone.hidden[:, :k], run.hidden[:, :k], taps_alone.dtype)
                one_by_one = sum(seconds_alone(p) for p in prompts)
                lad = {}
                if ladder_lm is not None and c["verdict"] == OUTSIDE:
                    from .stack import ladder_verdict

                    if high_alone is None:
                        from ..machine.runenv import rung_true_float32

                        rung = rung_true_float32()  # a TF32 rung says unreliable, not semantic
                        high_alone = generate_alone(ladder_lm.model, target, n, prefill_step)
                    high_run = generate_batch(ladder_lm.model, prompts, n, keep=[j], prefill_step=prefill_step,
                                              plant=None if plant is None else (lambda caches, j=j: plant(caches, j)))
                    low_size, high_size = parting_size(alone, run, j), parting_size(high_alone, high_run, j)
                    shrink, verdict = ladder_verdict(low_size, high_size, lm.description.dtype, rung["true_float32"])
                    lad = {"ladder_envelope": high_size, "ladder": verdict,
                           "ladder_shrink": None if shrink != shrink or shrink == float("inf") else shrink}
                    say(f"  float32 rerun: envelope {high_size:.3g} (through the first divergence): {verdict}")
                out.append(RowComparison(B=B, row=j, companions=label, prompt_tokens=len(target),
                                         companion_tokens=[len(p) for i, p in enumerate(prompts) if i != j],
                                         reference_envelope=ref, tokens_alone=alone.tokens[0], tokens_row=run.tokens[j],
                                         seconds_batch=run.seconds, seconds_alone_all=one_by_one, **c, **lad))
                if checkpoint is not None:
                    checkpoint.save(unit[0], out[-1].as_dict(), *unit[1:])
                if sink is not None:
                    sink.append(out[-1])
                say(f"{label:6s} B={B} row {j}: {c['verdict']}  first divergence {c['first_divergence']}  "
                    f"envelope {c['envelope_batch']:.3g}  batch {run.seconds:.1f} s vs {one_by_one:.1f} s one by one")
    return out


# ------------------------------------------------------------------ the measurement


def measure_batch(lm, targets: dict[str, Sequence[int]], companion_sets: dict[str, Sequence[Sequence[int]]], n: int,
                  *, batch_sizes: Sequence[int] = (1, 2, 4, 8), rows: str = "ends", prefill_step: int = 2048,
                  reference: bool = True, plant: Callable | None = None, ladder_lm=None, progress=None,
                  inputs=None, layers: bool = False, checkpoint=None):
    """:func:`sweep` for every target prompt: a Result of kind ``batch``.

    Args:
        targets: {label: prompt ids}; each is run alone and as a row of every batch.
        companion_sets: {label: companion prompt ids}.
        layers: per-layer drift of every row (table ``batch_layers``, figure ``batch_layers.png``).
        checkpoint: an output directory; every finished row is saved under it (:mod:`gemmdrift.checkpoint`)
            and a rerun loads it. Ctrl-C raises :class:`gemmdrift.checkpoint.Interrupted` carrying the
            partial Result of the finished rows.
    """
    from ..checkpoint import Checkpoints

    say = progress or (lambda msg: None)
    checkpoint = Checkpoints(checkpoint, "batch", lm.description) if checkpoint is not None else None
    if not targets:
        raise GemmdriftError("no target prompt")
    if max(batch_sizes) > 1:
        for label, comps in companion_sets.items():
            if len(comps) < max(batch_sizes) - 1:
                raise GemmdriftError(f"companion set {label!r} has {len(comps)} prompts; a batch of "
                                     f"{max(batch_sizes)} needs {max(batch_sizes) - 1}")
    finished: list[tuple[str, RowComparison]] = []
    info = dict(n=n, batch_sizes=batch_sizes, rows=rows, prefill_step=prefill_step, plant=plant, inputs=inputs,
                layers=layers)
    try:
        for tlabel, target in targets.items():
            say(f"target {tlabel!r} ({len(target)} tokens)")
            sink: list[RowComparison] = []
            try:
                sweep(lm, target, companion_sets, n, batch_sizes=batch_sizes, rows=rows, prefill_step=prefill_step,
                      reference=reference, plant=plant, ladder_lm=ladder_lm, progress=say, layers=layers,
                      checkpoint=checkpoint, sink=sink)
            finally:
                finished += [(tlabel, c) for c in sink]
    except KeyboardInterrupt:
        from ..checkpoint import Interrupted, partial_inputs

        per_target = sum(len(range(B)) if rows == "all" else len({0, B - 1}) for B in batch_sizes) * len(companion_sets)
        total = per_target * len(targets)
        partial = _batch_result(lm, targets, companion_sets, finished, **dict(
            info, inputs={**(inputs or {}), **partial_inputs(len(finished), total, "row")})) if finished else None
        raise Interrupted(partial, len(finished), total) from None
    return _batch_result(lm, targets, companion_sets, finished, **info)


LADDER_VERDICTS = tuple(v.value for v in (Verdict.ROUNDING, Verdict.SEMANTIC, Verdict.UNCLEAR, Verdict.UNRELIABLE,
                                          Verdict.NO_DRIFT))


def ladder_counts(table: pd.DataFrame) -> dict[str, float]:
    """The precision ladder's verdicts of the rows outside the envelope, counted (nothing without a ladder).

    Every verdict the ladder can give is counted, so the counts add up to the rows the ladder judged.
    """
    if "ladder" not in table.columns or not (table["ladder"].fillna("") != "").any():
        return {}
    return {f"batch_outside_{v}": float((table["ladder"] == v).sum()) for v in LADDER_VERDICTS}

def _batch_result(lm, targets, companion_sets, finished, *, n, batch_sizes, rows, prefill_step, plant, inputs,
                  layers):
    """The Result of the rows ``finished`` ((target label, RowComparison) in sweep order)."""
    import pandas as pd

    from ..machine.envinfo import environment
    from ..result import Result, env_labels, tidy

    rows_out, pairs, layer_rows = [], [], []
    for tlabel, c in finished:
        target = targets[tlabel]
        d = c.as_dict()
        rows_out.append({"target": tlabel, **{k: v for k, v in d.items() if k not in ("tokens_alone", "tokens_row",
                                                                                     "companion_tokens", "reason",
                                                                                     "layers")},
                         "companion_tokens": " ".join(map(str, c.companion_tokens)), "reason": c.reason})
        layer_rows += [{"target": tlabel, "companions": c.companions, "B": c.B, "row": c.row, **x}
                       for x in c.layers]
        tag = f"{tlabel}_{c.companions}_B{c.B}_r{c.row}"
        pairs.append({"case": "batch", "label_a": "alone", "label_b": f"row {c.row} of {c.B} ({c.companions})",
                      "prompt": [int(t) for t in target], "tokens_a": c.tokens_alone, "tokens_b": c.tokens_row,
                      # what really ran: the target alone, and row j of a B-row BatchGenerator batch
                      "schedule_a": f"prefill:{prefill_step},decode",
                      "schedule_b": f"{BATCH_SCHEDULE}B{c.B},row{c.row},prefill:{prefill_step},decode",
                      "first_divergence": c.first_divergence,
                      "verdict": c.verdict, "notes": {"row": tag}})
    table = pd.DataFrame(rows_out)
    frame_rows = []
    for r in rows_out:
        for metric in ("envelope_batch", "max_dlogprob", "first_divergence", "margin", "seconds_batch",
                       "seconds_alone_all"):
            if r[metric] is not None:
                frame_rows.append({"pair": f"alone vs row {r['row']} of {r['B']}", "mode": r["companions"],
                                   "metric": metric, "value": float(r[metric]), "B": r["B"], "row": r["row"],
                                   "target": r["target"]})
        frame_rows.append({"pair": f"alone vs row {r['row']} of {r['B']}", "mode": r["companions"],
                           "metric": "diverged", "value": float(r["first_divergence"] is not None), "B": r["B"],
                           "row": r["row"], "target": r["target"]})
    for r in layer_rows:
        for metric in ("rel_l2", "max_abs", "frac_differ"):
            frame_rows.append({"pair": f"alone vs row {r['row']} of {r['B']}", "mode": r["companions"],
                               "tap": r["tap"], "layer": r["layer"], "metric": metric, "value": float(r[metric]),
                               "B": r["B"], "row": r["row"], "target": r["target"]})
    env = environment()
    figures: dict[str, float] = {
        "batch_rows": float(len(table)),
        "batch_envelope": float(table["envelope_batch"].max()),
        "batch_flips": float(table["first_divergence"].notna().sum()),
        "batch_outside": float((table["verdict"] == OUTSIDE).sum()),
        "batch_identical": float((table["verdict"] == IDENTICAL).sum()),
    }
    figures.update(ladder_counts(table))
    refs = table["reference_envelope"].dropna()
    if len(refs):
        figures["reference_envelope"] = float(refs.max())
    for B, g in table.groupby("B"):
        figures[f"batch_envelope_b{int(B)}"] = float(g["envelope_batch"].max())
        figures[f"batch_flips_b{int(B)}"] = float(g["first_divergence"].notna().sum())
    layer_table = pd.DataFrame(layer_rows)
    if len(layer_table):
        norm = layer_table[layer_table["tap"] == "norm"]
        figures["batch_layer_norm_rel_l2"] = float(norm["rel_l2"].max())  # the last hidden state before the head
        figures["batch_layers_differ"] = float((layer_table.groupby(["target", "companions", "B", "row"])["frac_differ"]
                                                .apply(lambda f: (f > 0).sum())).max())
    big = table[table["B"] == table["B"].max()]
    if len(big) and big["seconds_batch"].sum() > 0 and table["B"].max() > 1:
        figures["batch_speedup"] = float(big["seconds_alone_all"].sum() / big["seconds_batch"].sum())
    return Result(kind="batch", inputs={"model": lm.info, "targets": {k: list(map(int, v)) for k, v in targets.items()},
                                        "companions": {k: [len(p) for p in v] for k, v in companion_sets.items()},
                                        "n": n, "batch_sizes": list(batch_sizes), "rows": rows,
                                        "prefill_step": prefill_step, "planted": plant is not None, "layers": layers,
                                        **(inputs or {})},
                  env=env, frame=tidy(frame_rows, model=lm.description.source, dtype=lm.description.dtype,
                                      **env_labels(env)),
                  figures=figures,
                  tables={"batch": table, **({"batch_layers": layer_table} if len(layer_table) else {})},
                  details={"pairs": pairs})
