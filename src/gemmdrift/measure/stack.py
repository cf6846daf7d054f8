"""Layer-stack drift: schedules against a reference, layer by layer, to the logits.

For each schedule compared with the reference schedule:

* **accumulated** drift: each schedule feeds itself; the difference at layer i
  is everything introduced at or below i.
* **local** drift: layer i gets the reference's own inputs (see
  :mod:`taps`), so the difference is what layer i alone introduces.
* at the logits: max|Δlogit|, Δgap per position, and argmax flips.
* the **precision ladder** reruns both schedules with the same weights at
  float32: rounding drift shrinks by orders of magnitude, a semantic
  difference (other keys, a wrong offset, a stale cache) does not.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from .. import files, metrics
from ..model import native as native_kernels
from ..checks import check_positions
from ..errors import GemmdriftError
from ..result import Result, Verdict, env_labels, figure_name, tidy
from ..schedules import parse_schedule
from ..model.taps import Taps, common_prefix, load_checkpoint, run_schedule, save_taps, shared_blocks

# Ladder verdicts: rounding drift shrinks by ~u_low/u_high (2**16 from bf16 to
# f32); a semantic difference keeps its size. Between the two: unclear.
LADDER_ROUNDING_SHRINK = 100.0
LADDER_SEMANTIC_SHRINK = 10.0


def tap_names(n_layers: int) -> list[str]:
    return [f"layer {i}" for i in range(n_layers)] + ["norm", "logits"]


def _progress(desc: str, total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="tok", leave=False, file=sys.stderr, disable=None, mininterval=1.0)


def _run(model, tokens, schedule, *, checkpoint: Path | None = None, key: str = "", **kw) -> Taps:
    """One tapped run, with a progress bar and a log line; loaded from ``checkpoint`` if it was saved there."""
    mode = "local" if kw.get("reference") is not None else "run"
    path = checkpoint / f"{key}.npz" if checkpoint is not None else None
    before = native_kernels.calls(model)  # None: this machine's kernels
    # A replayed run's calls are saved beside its taps and counted again when it is resumed.
    calls_path = path.with_name(f"{key}.calls.json") if path is not None and before is not None else None
    taps = load_checkpoint(path)
    if taps is not None and calls_path is not None:
        saved = _saved_calls(calls_path)
        if saved is None:  # taps without their calls (or from before they were kept): made again
            print(f"  {mode:5s} {schedule:28s} saved without its replayed calls: computed again", file=sys.stderr,
                  flush=True)
            taps = None
        else:
            native_kernels.add_calls(model, saved)
    if taps is not None:
        print(f"  {mode:5s} {schedule:28s} done before (resumed)", file=sys.stderr, flush=True)
        return taps
    bar = _progress(f"{schedule}{' (local)' if mode == 'local' else ''}", len(tokens))
    try:
        taps = run_schedule(model, tokens, schedule, progress=bar.update, **kw)
    finally:
        bar.close()
    print(f"  {mode:5s} {schedule:28s} {taps.blocks:5d} passes  {taps.seconds:7.1f} s", file=sys.stderr, flush=True)
    if path is not None:
        if calls_path is not None:  # first: the taps are the mark that the run finished
            files.write_text(calls_path, json.dumps(native_kernels.calls_since(model, before)) + "\n")
        save_taps(path, taps)
    return taps


def _saved_calls(path: Path) -> list | None:
    """The replayed calls saved beside a run's taps; None when there are none (or they are unreadable)."""
    if not path.is_file():
        return None
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(rows, list) or not all(isinstance(r, list) and len(r) == 5 for r in rows):
            raise ValueError("not a list of replayed calls")
    except (OSError, UnicodeDecodeError, ValueError) as e:
        files.discard_checkpoint(path, str(e)[:80])
        return None
    return rows


def run_key(lm, tokens, schedule: str, mode: str, dtype: str, split, positions, logit_positions) -> str:
    """What a run's taps depend on, for resuming: model, versions, inputs, schedule, mode, dtype."""
    from ..model import resume_key

    tag = native_kernels.key_tag(lm.model)  # "" for this machine's kernels: older checkpoints still resume
    return f"{mode}-{dtype}-{tag}" + resume_key(lm.description, [int(t) for t in tokens], schedule, mode, dtype, split,
                                                [int(p) for p in positions], [int(p) for p in logit_positions])


def compare_taps(ref: Taps, other: Taps, layer_kinds: Sequence[str], labels: dict[str, Any],
                 tokens: Sequence[int] | None = None) -> tuple[list[dict], pd.DataFrame | None, dict | None]:
    """Tidy metric rows for every tap, plus per-position and envelope logit figures.

    With ``tokens`` (the stream), the logits also get the two-run statistics of
    :func:`gemmdrift.measure.twostats.two_run_stats` (:data:`TWO_RUN_FIGURES`, reference as the base) over the logit
    positions that have a next token."""
    rows = []
    positions = other.positions
    ref_rows = ref.rows(positions)
    names = tap_names(other.n_layers)
    for i in range(other.n_layers + 1):
        kind = layer_kinds[i] if i < len(layer_kinds) else "norm"
        m = metrics.compare(ref.hidden[i, ref_rows], other.hidden[i], other.dtype)
        rows += [{**labels, "tap": names[i], "layer": i, "layer_type": kind, "metric": k, "value": v} for k, v in m.items()]
    per_pos = envelope = None
    if other.logits is not None and ref.logits is not None:
        lr = ref.logit_rows(other.logit_positions)
        la, lb = ref.logits[lr], other.logits
        m = metrics.compare(la, lb, other.logits_dtype)
        d = metrics.logit_drift(la, lb)
        envelope = metrics.envelope_summary(d)
        m.update({k: v for k, v in envelope.items() if k not in ("flip_gaps", "positions")})
        if tokens is not None:
            two = two_run(la, lb, other.logit_positions, tokens)
            envelope.update(two)
            m.update(two)
        li = other.n_layers + 1
        rows += [{**labels, "tap": "logits", "layer": li, "layer_type": "logits", "metric": k, "value": float(v)}
                 for k, v in m.items()]
        per_pos = pd.DataFrame({**{k: labels[k] for k in ("pair", "reference", "schedule", "mode", "dtype")},
                                "position": other.logit_positions, **d})
    return rows, per_pos, envelope


TWO_RUN_FIGURES = ("kld_mean", "kld_max", "kld_p99.9", "same_top1_share", "dp_rms", "ppl_ratio")


def two_run(la: np.ndarray, lb: np.ndarray, logit_positions: np.ndarray, tokens: Sequence[int]) -> dict[str, float]:
    """KLD(reference ‖ schedule), same top-1, Δp and perplexity ratio at the logit positions with a next token."""
    from .twostats import two_run_stats, view_from_logits

    keep = np.flatnonzero(logit_positions + 1 < len(tokens))
    if keep.size == 0:  # no next token (the stream's last position): KLD and top-1 need none, Δp and ppl do
        pos = np.asarray(logit_positions)
        views = [view_from_logits(x, pos, np.argmax(la, axis=-1), 2, full=True) for x in (la, lb)]
        s = two_run_stats(*views)["summary"]
        return {k: float(s[k]) if k in ("kld_mean", "kld_max", "kld_p99.9", "same_top1_share") else float("nan")
                for k in TWO_RUN_FIGURES}
    pos = logit_positions[keep]
    targets = np.asarray(tokens, dtype=np.int64)[pos + 1]
    views = [view_from_logits(x[keep], pos, targets, 2, full=True) for x in (la, lb)]
    s = two_run_stats(*views)["summary"]
    return {k: float(s[k]) for k in TWO_RUN_FIGURES}


def ladder_verdict(low: float, high: float, low_dtype: str = "bfloat16",
                   true_float32: bool = True) -> tuple[float, str]:
    """(shrink factor, verdict) for a drift measured at low and at high precision.

    Rounding drift shrinks by orders of magnitude when the precision rises; a
    semantic difference keeps its size. A drift that is zero at low precision
    but not at high precision was rounded away by the low dtype: rounding, as
    long as it stays below the low dtype's unit roundoff.

    When the float32 rung was not true float32 (TF32 matmuls, see
    :func:`float32_rung`), drift that did not shrink proves nothing: bf16 to
    TF32 gains 3 mantissa bits, not 16. Such verdicts are ``unreliable``; a
    shrink by orders of magnitude is still rounding.
    """
    shrink, verdict = _ladder_verdict(low, high, low_dtype)
    if not true_float32 and verdict in (Verdict.SEMANTIC, Verdict.UNCLEAR):
        return shrink, Verdict.UNRELIABLE.value
    return shrink, verdict


def float32_rung(env: dict[str, Any], probe: dict[str, Any] | None = None, forced: bool = False) -> dict[str, Any]:
    """Was the ladder's float32 rung true float32? The record kept with the ladder.

    Args:
        env: an environment record (backend, architecture, mlx, env vars), see
            :func:`gemmdrift.machine.envinfo.fp32_matmul_mode`.
        probe: :func:`gemmdrift.machine.envinfo.probe_fp32_matmul` measured at the rung;
            it decides when given (mlx reads MLX_ENABLE_TF32 once per process,
            so only a measurement says what this process does).
        forced: gemmdrift set MLX_ENABLE_TF32=0 for this process.
    """
    from ..machine.envinfo import TF32_VAR, fp32_matmul_mode

    mode = fp32_matmul_mode(env)
    true32 = bool(probe["true_float32"]) if probe is not None else mode == "float32"
    if true32:
        why = (f"float32 matmuls measured true float32 (probe GEMM relative error {probe['rel_err']:.2g})"
               if probe is not None else f"{env.get('backend')}: no TF32 path")
    else:
        why = (f"float32 matmuls are not true float32 here ({mode}"
               + (f", measured relative error {probe['rel_err']:.2g}" if probe is not None else "")
               + f"): rerun in a new process with {TF32_VAR}=0; semantic/unclear ladder verdicts are unreliable")
    return {"mode": mode, "forced": bool(forced), "probe": probe, "true_float32": true32, "why": why,
            TF32_VAR: (env.get("env") or {}).get(TF32_VAR)}


def _ladder_verdict(low: float, high: float, low_dtype: str) -> tuple[float, Verdict]:
    if low == 0 and high == 0:
        return math.nan, Verdict.NO_DRIFT
    if high == 0:
        return math.inf, Verdict.ROUNDING
    if low == 0:
        return 0.0, Verdict.ROUNDING if high < metrics.UNIT_ROUNDOFF[low_dtype] else Verdict.UNCLEAR
    shrink = low / high
    if shrink >= LADDER_ROUNDING_SHRINK:
        return shrink, Verdict.ROUNDING
    if shrink < LADDER_SEMANTIC_SHRINK:
        return shrink, Verdict.SEMANTIC
    return shrink, Verdict.UNCLEAR


def ladder_table(table: pd.DataFrame, base: str, high: str = "float32", true_float32: bool = True) -> pd.DataFrame:
    """Per pair and tap: rel_l2 drift at the base dtype and at ``high``, shrink, verdict."""
    t = table[(table["mode"] == "accumulated") & (table["metric"] == "rel_l2")]
    lo = t[t["dtype"] == base].set_index(["pair", "tap"])["value"]
    hi = t[t["dtype"] == high].set_index(["pair", "tap"])["value"]
    out = []
    for key in lo.index:
        if key not in hi.index:
            continue
        shrink, verdict = ladder_verdict(float(lo[key]), float(hi[key]), base, true_float32)
        layer = t[(t["pair"] == key[0]) & (t["tap"] == key[1])]["layer"].iloc[0]
        out.append({"pair": key[0], "tap": key[1], "layer": int(layer), f"rel_l2_{base}": float(lo[key]),
                    f"rel_l2_{high}": float(hi[key]), "shrink": shrink, "verdict": verdict})
    return pd.DataFrame(out)


def pair_verdict(ladder: pd.DataFrame, pair: str) -> Verdict:
    """'semantic' if any tap failed to shrink, 'rounding' if all drift shrank, 'identical' if none
    ('unreliable' where the float32 rung was TF32 and something did not shrink)."""
    v = set(ladder[ladder["pair"] == pair]["verdict"])
    for verdict in (Verdict.SEMANTIC, Verdict.UNRELIABLE, Verdict.UNCLEAR, Verdict.ROUNDING):
        if verdict in v:
            return verdict
    return Verdict.NO_DRIFT


def _taps_job(lm, *, tokens: list[int], schedule: str, mode: str, split, positions, logit_positions,
              checkpoint: str | None) -> Taps:
    """One accumulated run at the model's dtype, as :func:`_rung_runs` would run it (the same checkpoint key);
    module level: the runs of a rung that share nothing may run in separate processes."""
    key = run_key(lm, tokens, schedule, mode, lm.description.dtype, split, positions, logit_positions)
    return _run(lm.model, tokens, schedule, split=split, positions=positions, logit_positions=logit_positions,
                checkpoint=Path(checkpoint) if checkpoint is not None else None, key=key)


def _rung_runs(lm, *, dtype: str, tokens: list[int], schedules: list[str], split, positions, logit_positions,
               local: bool, share_prefix: bool, checkpoint: str | None, keep: bool,
               runs: dict[str, Taps] | None = None, prefix_store: str | None = None) -> dict[str, Any]:
    """Every run of one rung of :func:`measure_stack` (the model's dtype, or float32 for the ladder) and their
    comparisons; the model is back in its dtype afterwards. A module-level function: the rungs may run in
    separate processes (:mod:`gemmdrift.workers`). ``runs``: accumulated runs already made (by
    :func:`_taps_job`), by schedule."""
    import mlx.core as mx

    from ..model import cast_model

    parsed = [parse_schedule(x) for x in schedules]
    n = len(tokens)
    base = lm.description.dtype
    kinds = list(lm.description.layer_types)
    ref_text = parsed[0].text
    rows: list[dict] = []
    per_pos: list[pd.DataFrame] = []
    env_rows: list[dict] = []
    kept: dict[tuple[str, str, str], Taps] = {}
    rung = None
    ckpt = Path(checkpoint) if checkpoint is not None else None
    try:
        if dtype != lm.description.dtype:
            # Same weights, higher precision: bf16/fp16 values upcast exactly.
            cast_model(lm.model, dtype)
            rung = _measure_rung()
        print(f"gemmdrift stack: {dtype}, {n} tokens, reference {ref_text}", file=sys.stderr, flush=True)
        # Blocks every schedule shares before the first compared position run once.
        limit = int(min(positions[0], logit_positions[0] if logit_positions.size else positions[0]))
        with native_kernels.shared_prefix(lm.model) as replay:  # replayed kernels: the prefix natively, once
            # a prefix replayed too (--replay-prefix) is not this machine's: never stored nor read
            native = replay is None or replay.prefix_native
            store = (prefix_store, lm.description, dtype) if prefix_store is not None and native else None
            prefix = (common_prefix(lm.model, tokens, [s.text for s in parsed], split, limit, store=store)
                      if share_prefix else None)
        native_kernels.say_prefix(replay, prefix, "every schedule")
        if prefix is not None:
            how = "read from the run's store" if prefix.loaded else f"{prefix.seconds:7.1f} s"
            print(f"  shared prefix: {prefix.length} tokens in {len(prefix.blocks)} passes  {how}",
                  file=sys.stderr, flush=True)
        ref_positions = np.arange(prefix.length if prefix else 0, n) if (local and dtype == base) else positions
        runs = runs or {}
        ref = runs.get(ref_text) or _run(
            lm.model, tokens, ref_text, split=split, positions=ref_positions, logit_positions=logit_positions,
            prefix=prefix, checkpoint=ckpt,
            key=run_key(lm, tokens, ref_text, "reference", dtype, split, ref_positions, logit_positions))
        if keep:
            kept[(ref_text, "accumulated", dtype)] = ref
        for sched in parsed[1:]:
            modes = ["accumulated"] + (["local"] if local and dtype == base else [])
            for mode in modes:
                other = (runs.get(sched.text) if mode == "accumulated" else None) or _run(
                    lm.model, tokens, sched.text, split=split, positions=positions, logit_positions=logit_positions,
                    reference=ref if mode == "local" else None, prefix=prefix, checkpoint=ckpt,
                    key=run_key(lm, tokens, sched.text, mode, dtype, split, positions, logit_positions))
                if keep:
                    kept[(sched.text, mode, dtype)] = other
                labels = {"pair": f"{ref_text} vs {sched.text}", "reference": ref_text, "schedule": sched.text,
                          "mode": mode, "dtype": dtype}
                r, pp, env = compare_taps(ref, other, kinds, labels, tokens=tokens)
                rows += r
                if pp is not None:
                    per_pos.append(pp)
                if env is not None:
                    env_rows.append({**labels, **{k: v for k, v in env.items() if k != "flip_gaps"},
                                     "flip_gaps": env["flip_gaps"]})
                del other
        del ref, prefix
        mx.clear_cache()
    finally:
        if dtype != base:
            cast_model(lm.model, base)  # bf16/fp16 values survived the f32 detour exactly
    return {"rows": rows, "per_pos": per_pos, "env_rows": env_rows, "kept": kept, "rung": rung}


def measure_stack(
    lm,
    tokens: Sequence[int],
    schedules: Sequence[str],
    *,
    split: int | None = None,
    positions: Sequence[int] | None = None,
    logit_positions: Sequence[int] | None = None,
    local: bool = True,
    ladder: bool = False,
    keep_taps: dict | None = None,
    share_prefix: bool = True,
    checkpoint: str | Path | None = None,
    env: dict[str, Any] | None = None,
    record: dict[str, Any] | None = None,
    workers: int | None = None,
    prefix_store: str | Path | None = None,
) -> Result:
    """Compare every schedule with the first one over the same tokens.

    Args:
        lm: a :class:`gemmdrift.model.LoadedModel`.
        tokens: the token stream (teacher forced).
        schedules: reference first, e.g. ``["prefill:512,decode", "prefill:512,verify:2"]``.
        split: prompt/continuation boundary for two-phase schedules.
        positions: positions whose hidden states are compared (default
            ``split..end``, or every position without a split).
        logit_positions: positions whose logits are compared (default: ``positions``).
        local: also measure local drift (one more run per schedule).
        ladder: rerun the accumulated comparison at float32.
        keep_taps: a dict that receives the raw taps, keyed (schedule, mode, dtype) (for tests).
        share_prefix: compute the leading blocks all schedules share once
            (they are identical by construction) and start every run from a copy.
        checkpoint: a directory where every finished run's taps are saved; a
            repeated call loads them instead of running again (resume).
        env: the environment record (default: :func:`gemmdrift.machine.envinfo.environment`).
        record: more inputs to record (e.g. the prompt's label).
        prefix_store: a directory where measurements of one run share their prefixes (the shared blocks'
            caches, keyed by model, dtype, tokens and versions: :func:`gemmdrift.model.taps.prefix_file`): read
            from it when there, saved to it when computed. The figures are the same either way.
        workers: processes for the rungs of the ladder (the model's dtype and float32 run side by side, each
            in its own process; :mod:`gemmdrift.workers`), or, without the ladder and local drift, for the runs
            when the schedules share no leading block. Default: 2 on a multi-core CPU.

    Returns:
        A ``stack`` :class:`Result`: tables ``stack`` (pair x mode x dtype x tap x metric),
        ``positions`` (per logit position), ``envelope`` (per pair, dtype and mode) and ``ladder``
        (with ``ladder=True``); tracked figures as in :func:`stack_figures`.
    """
    from ..machine.envinfo import environment

    if len(schedules) < 2:
        raise GemmdriftError("give at least two schedules: a reference and one to compare")
    from ..model import weights_record

    # (`env` below is each pair's envelope)
    env_record = {**(env if env is not None else environment()), **weights_record(lm.description)}
    parsed = [parse_schedule(s) for s in schedules]
    n = len(tokens)
    if n < 2:
        raise GemmdriftError(f"the token stream is too short ({n} tokens)")
    for s in parsed:
        s.blocks(n, split)  # validates the schedule against the stream before any work
    if positions is None:
        positions = np.arange(split if split is not None else 0, n)
    positions = np.unique(np.asarray(positions, dtype=np.int64))
    if positions.size == 0:
        raise GemmdriftError("no positions to compare")
    check_positions(int(positions[0]), int(positions[-1]), n, "positions")
    logit_positions = positions if logit_positions is None else np.unique(np.asarray(logit_positions, dtype=np.int64))
    if logit_positions.size:
        check_positions(int(logit_positions[0]), int(logit_positions[-1]), n, "logit positions")
    base = lm.description.dtype
    if ladder and base == "float32":
        raise GemmdriftError("the precision ladder needs a base dtype below float32 (bfloat16 or float16)")
    ref_text = parsed[0].text
    dtypes = [base] + (["float32"] if ladder else [])
    from ..workers import check_workers, run_jobs

    workers = native_kernels.check_in_process(lm.model, workers, "stack")
    if ladder and native_kernels.active(lm.model) is not None:
        raise GemmdriftError("the ladder with replayed kernels: the float32 rung runs another model copy, not replayed")
    jobs = [dict(dtype=d, tokens=[int(t) for t in tokens], schedules=[p.text for p in parsed], split=split,
                 positions=positions, logit_positions=logit_positions, local=local, share_prefix=share_prefix,
                 checkpoint=str(checkpoint) if checkpoint is not None else None, keep=keep_taps is not None,
                 prefix_store=str(prefix_store) if prefix_store is not None else None)
            for d in dtypes]
    limit = int(min(positions[0], logit_positions[0] if logit_positions.size else positions[0]))
    if len(jobs) == 1 and not local and not (share_prefix and shared_blocks(n, jobs[0]["schedules"], split, limit)):
        # One rung of runs that share nothing and need nothing from each other: the runs are the parts.
        n_workers = check_workers(lm, workers, len(parsed))
        if n_workers > 1:
            taps = run_jobs(lm, _taps_job, [dict(tokens=jobs[0]["tokens"], schedule=p.text, split=split,
                                                 mode="reference" if i == 0 else "accumulated", positions=positions,
                                                 logit_positions=logit_positions, checkpoint=jobs[0]["checkpoint"])
                                            for i, p in enumerate(parsed)], n_workers)
            jobs[0]["runs"] = {p.text: t for p, t in zip(parsed, taps)}
    parts = run_jobs(lm, _rung_runs, jobs, check_workers(lm, workers, len(jobs)))
    rows = [r for p in parts for r in p["rows"]]
    per_pos = [x for p in parts for x in p["per_pos"]]
    env_rows = [x for p in parts for x in p["env_rows"]]
    kept = {k: v for p in parts for k, v in p["kept"].items()}
    rung = next((p["rung"] for p in parts if p["rung"] is not None), None)
    table = pd.DataFrame(rows)
    ladder_df = ladder_table(table, base, true_float32=rung["true_float32"]) if ladder else None
    inputs = {
        "model": lm.info,
        "tokens": [int(t) for t in tokens],
        "schedules": [s.text for s in parsed],
        "reference": ref_text,
        "split": split,
        "positions": [int(p) for p in positions],
        "logit_positions": [int(p) for p in logit_positions],
        "local": local,
        "ladder": ladder,
        **(record or {}),
    }
    if rung is not None:
        inputs["ladder_float32"] = rung
    if keep_taps is not None:
        keep_taps.update(kept)
    tables = {"stack": table, "positions": pd.concat(per_pos, ignore_index=True) if per_pos else pd.DataFrame(),
              "envelope": pd.DataFrame(env_rows)}
    if ladder_df is not None and len(ladder_df):
        tables["ladder"] = ladder_df
    return stack_result(tables, inputs, env_record)


ENVELOPE_FIGURES = ("max_abs_dlogit", "max_abs_dgap", "p99_abs_dgap", "flips", "max_gap_at_flip")


def stack_figures(tables: dict[str, pd.DataFrame], base: str, true_float32: bool = True) -> dict[str, float]:
    """The tracked figures of a stack measurement, at the base dtype.

    * ``<envelope metric>/<pair>``: the accumulated logit envelope (:data:`ENVELOPE_FIGURES`);
    * ``rel_l2/<pair>/<mode>/<tap>`` and ``bits_p99/<pair>/<mode>/<tap>`` (log2(1 + p99 ULP));
    * ``ladder_rel_l2_float32/<pair>/<tap>``: the same pair at float32 (only with the ladder, and only when
      the rung was true float32: a TF32 figure is not tracked under a float32 name; asv records it as NaN).

    A figure that is not finite (e.g. the gap at a flip when nothing flipped) is left out.
    """
    out: dict[str, float] = {}
    env = tables.get("envelope", pd.DataFrame())
    if len(env):
        for _, row in env[(env["dtype"] == base) & (env["mode"] == "accumulated")].iterrows():
            for k in ENVELOPE_FIGURES:
                out[figure_name(k, row["pair"])] = float(row[k])
            for k in TWO_RUN_FIGURES:  # stacks measured before issue 23 have none
                if k in row and pd.notna(row[k]):
                    out[figure_name(k, row["pair"])] = float(row[k])
    t = tables["stack"]
    t = t[t["dtype"] == base] if len(t) else t
    for (pair, mode, tap), s in (t.groupby(["pair", "mode", "tap"]) if len(t) else []):
        m = dict(zip(s["metric"], s["value"]))
        if "rel_l2" in m:
            out[figure_name("rel_l2", pair, mode, tap)] = float(m["rel_l2"])
        if "p99_ulp" in m:
            out[figure_name("bits_p99", pair, mode, tap)] = metrics.bits_lost(float(m["p99_ulp"]))
    lad = tables.get("ladder")
    if lad is not None and len(lad) and "rel_l2_float32" in lad.columns and true_float32:
        for _, row in lad.iterrows():
            out[figure_name("ladder_rel_l2_float32", row["pair"], row["tap"])] = float(row["rel_l2_float32"])
    return {k: v for k, v in out.items() if math.isfinite(v)}


def gaps(v: Any) -> list[float]:
    """The flip_gaps cell of an envelope row: a list, or its text after a CSV round trip."""
    if isinstance(v, str):
        return [float(x) for x in json.loads(v)] if v.strip() else []
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return []
    return [float(x) for x in v]


def stack_result(tables: dict[str, pd.DataFrame], inputs: dict[str, Any], env: dict[str, Any]) -> Result:
    """The ``stack`` Result from its tables (as measured, or as read back from an older results directory)."""
    base = inputs["model"]["dtype"]
    env_df = tables.get("envelope", pd.DataFrame())
    if len(env_df) and "flip_gaps" in env_df.columns:
        env_df = env_df.assign(flip_gaps=[gaps(v) for v in env_df["flip_gaps"]])
        tables = {**tables, "envelope": env_df}
    t = tables["stack"]
    cols = [c for c in t.columns if c != "schedule"]  # the pair says it
    frame = tidy(t[cols] if len(t) else pd.DataFrame(columns=["metric", "value"]), **env_labels(env),
                 model=inputs["model"].get("source", ""))
    true32 = (inputs.get("ladder_float32") or {}).get("true_float32", True)  # older results carry no probe: as measured then
    return Result(kind="stack", inputs=inputs, env=env, frame=frame, figures=stack_figures(tables, base, true32),
                  tables=tables)


def _measure_rung() -> dict[str, Any]:
    """float32_rung for this process: its device, mlx version and MLX_ENABLE_TF32, and a probe GEMM."""
    import os

    import mlx.core as mx

    from ..machine import envinfo

    env = {**envinfo.device_record(), "mlx": getattr(mx, "__version__", None),
           "env": {envinfo.TF32_VAR: os.environ.get(envinfo.TF32_VAR)}}
    return float32_rung(env, envinfo.probe_fp32_matmul(), forced=envinfo.TF32_FORCED_OFF)
