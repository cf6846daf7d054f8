"""The sweep (GEMV vs GEMM per projection and path, with its checkpoints) and the measurement
functions that return a ``kernels`` Result. See :mod:`gemmdrift.kernels`."""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import pandas as pd

from .. import defaults, files, metrics
from ..errors import GemmdriftError
from ..model.taps import to_numpy
from ..model.projections import Projection, inputs_digest
from .ops import ops_sweep
from .paths import PathSpec, Operator, build_operator, parse_path
from .table import TABLE_COLUMNS, block_drift, kernels_result

# T=1 is the reference (always computed). 2..17, 24, 32 and 33 bracket the
# small-M kernel switches of dispatch.py (gemv_wide up to 15 rows, qmv batch
# limits 6..33, 32-row qmm tiles); 512 and 2048 are the prefill chunk sizes of
# mlx-lm's speculative and plain generation.
DEFAULT_TS = (*range(1, 18), 24, 32, 33, 64, 128, 512, 2048)
DEFAULT_MAX_T = defaults.KERNEL_MAX_T
# FLOPs allowed per (projection, path): T=1 rows plus every GEMM block. 2e9 is
# about 0.3 s in bf16, 1.5 s in fp32 and 7 s quantized on the reference CPU
# (7, 1.4 and 0.3 GFLOP/s); for Gemma 3 270M it reaches T=128 (MLP), 512
# (attention q/o) and 2048 (k/v).
DEFAULT_FLOP_BUDGET = 2e9
# Block sizes up to this are measured whatever the budget: they cover the
# first small-M kernel switches (gemv_wide and qmv_wide from T=2, gemv_wide's
# second pass from T=6 in dispatch.py), and keep a vocabulary-sized LM head
# (335 MFLOP per row for Gemma 3 270M) from being cut to nothing.
DEFAULT_ALWAYS_T = 4
DEFAULT_PATHS = defaults.KERNEL_PATHS


# -------------------------------------------------------------------------- sweep


def _check_ts(ts: Iterable[int]) -> list[int]:
    ts = sorted({int(t) for t in ts})
    if not ts or ts[0] < 1:
        raise GemmdriftError(f"block sizes T must be positive integers, got {ts[:3] if ts else 'none'}")
    return ts


def plan_ts(ts: Iterable[int], flops_per_row: float, n_rows: int, flop_budget: float = DEFAULT_FLOP_BUDGET,
            max_t: int = DEFAULT_MAX_T, always_t: int = DEFAULT_ALWAYS_T) -> list[int]:
    """GEMM block sizes (T >= 2, ascending) that fit the FLOP budget of one projection and path.

    The cost of a plan is one GEMV per distinct row used plus every block;
    sizes are added smallest first until the next one would exceed the
    budget. Sizes up to ``always_t``, and the smallest size, are kept
    whatever the budget. T=1 is the reference and always measured, so it is
    not part of the plan.

    Raises:
        GemmdriftError: a T below 1, or no rows.
    """
    ts = _check_ts(ts)
    if n_rows < 1:
        raise GemmdriftError("no input rows to build blocks from")
    if max_t < 1:
        raise GemmdriftError(f"max_t must be at least 1, got {max_t}")
    plan: list[int] = []
    for t in (t for t in ts if 2 <= t <= max_t):
        cost = flops_per_row * (sum(plan) + t + min(n_rows, t))
        if plan and t > always_t and cost > flop_budget:
            break
        plan.append(t)
    return plan


def _label(proj: Projection, path: PathSpec, op: Operator, synthetic: bool, inputs: str) -> dict[str, Any]:
    return {"layer": proj.layer, "projection": proj.name, "path": path.text, "dtype": op.out_dtype,
            "quant": op.quant, "emulated": path.emulated, "synthetic": synthetic, "inputs": inputs,
            "K": proj.in_dims, "N": proj.out_dims, "key_length": math.nan}


def measure_unit(op: Operator, rows: np.ndarray, plan: Sequence[int],
                 repeat_t1: bool = True) -> list[tuple[int, dict[str, float]]]:
    """(T, metrics) for T=1 and each GEMM block size of ``plan``.

    One GEMV per distinct row used, then one GEMM per T on rows cycled to T;
    every result is evaluated before it is compared. ``repeat_t1`` adds a
    second GEMV of the first row, compared with the first (determinism).
    """
    import mlx.core as mx

    from ..model import mx_dtype

    used = min(len(rows), max(plan)) if plan else len(rows)
    # Captured rows are exact values of the compute dtype; a dense path of another dtype rounds them here.
    x = mx.array(np.asarray(rows[:used], dtype=np.float32)).astype(mx_dtype(op.in_dtype))
    singles = [op.run(x[i:i + 1][None]) for i in range(used)]
    mx.eval(singles)
    y1 = np.concatenate([to_numpy(s[0]) for s in singles])
    exact = op.exact(to_numpy(x))
    first = metrics.error_vs_exact(y1, exact, op.out_dtype)
    if repeat_t1:
        again = op.run(x[:1][None])
        mx.eval(again)
        first = {**block_drift(y1[:1], to_numpy(again[0]), op.out_dtype), **first}
    out = [(1, first)]
    for t in plan:
        idx = np.arange(t) % used
        block = op.run_block(x[mx.array(idx)][None])
        mx.eval(block)
        yb = to_numpy(block[0])
        m = block_drift(y1[idx], yb, op.out_dtype)
        m.update(metrics.error_vs_exact(yb, exact[idx], op.out_dtype))
        out.append((t, m))
    return out


def _unit_file(checkpoint: Path, proj: Projection, path: PathSpec) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{proj.layer:04d}__{proj.name}__{path.text}")
    return checkpoint / "units" / f"{safe}.csv"


def _read_unit(path: Path) -> pd.DataFrame | None:
    """A finished unit from the checkpoint; None (after a warning) when the file is corrupt."""
    try:
        saved = pd.read_csv(path, dtype={"quant": str, "path": str, "projection": str})
        missing = [c for c in ("layer", "projection", "path", "T", "metric", "value") if c not in saved.columns]
        if missing or saved.empty or not pd.api.types.is_numeric_dtype(saved["value"]):
            raise ValueError(f"missing columns {missing}" if missing else "no numeric rows")
    except (OSError, UnicodeDecodeError, ValueError) as e:
        files.discard_checkpoint(path, str(e)[:80])
        return None
    return saved.assign(quant=saved["quant"].fillna("") if "quant" in saved else "")


def _open_checkpoint(checkpoint: Path, config: dict[str, Any]) -> None:
    """Create the checkpoint record, or check that an existing one belongs to the same sweep."""
    record = checkpoint / "sweep.json"
    if record.exists():
        try:
            saved = json.loads(record.read_text())
            if not isinstance(saved, dict):
                raise ValueError(f"a {type(saved).__name__}, not an object")
        except (OSError, UnicodeDecodeError, ValueError) as e:
            # Without its record nobody can tell which sweep the units belong to: start afresh.
            files.discard_checkpoint(checkpoint / "units", f"its record {record.name} is unreadable: {e}")
            files.write_json(record, config)
            return
        if saved != json.loads(files.to_json(config)):  # compared as written: tuples become lists
            now = json.loads(files.to_json(config))
            diff = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
            raise GemmdriftError(f"checkpoint {checkpoint} belongs to another sweep (differs in {', '.join(diff)}); "
                                 "use a new directory")
        return
    files.write_json(record, config)


def sweep(lm, inputs: Mapping[tuple[int, str], np.ndarray], projs: Sequence[Projection],
          paths: Sequence[str] = DEFAULT_PATHS, ts: Iterable[int] = DEFAULT_TS, *, max_t: int = DEFAULT_MAX_T,
          flop_budget: float = DEFAULT_FLOP_BUDGET, always_t: int = DEFAULT_ALWAYS_T,
          checkpoint: str | Path | None = None, workers: int | None = None, kernels=None) -> pd.DataFrame:
    """GEMV against GEMM for every projection and path, as a tidy table.

    Args:
        lm: the loaded model.
        inputs: rows per projection key, from :func:`capture_inputs`.
        projs: from :func:`projections`.
        paths: path strings (see the module docstring).
        ts: block sizes; T=1 is always measured as the reference (its error
            metrics); listing 1 adds the T=1 determinism check.
        max_t: largest block size.
        flop_budget: FLOPs per (projection, path); see :func:`plan_ts`.
        always_t: block sizes measured whatever the budget; see :func:`plan_ts`.
        checkpoint: a directory where each finished (layer, projection, path)
            is saved; units found there are loaded instead of recomputed, so
            an interrupted sweep resumes.
        workers: processes for the units (:mod:`gemmdrift.workers`; default 2 on a multi-core CPU). Every
            unit computes the same in any process; the longest start first.
        kernels: a :class:`gemmdrift.replay.model.KernelsOption` (``replay:<chip>[@variant]``): every unit's operator
            replays that chip's recipes, what cannot be replayed is skipped (:func:`gemmdrift.replay.model.plan_unit`); its
            ``log`` gets the record.

    Returns:
        :data:`TABLE_COLUMNS`: layer, projection, path, dtype, quant,
        emulated, synthetic, inputs ('captured', 'synthetic' or 'given'), K,
        N, key_length (NaN here), T, metric, value.
    """
    from tqdm.auto import tqdm

    from ..machine.runenv import compute_record
    from ..workers import check_workers, run_jobs

    specs = [parse_path(p) for p in paths]
    ts = _check_ts(ts)
    for p in projs:
        if p.key not in inputs or len(inputs[p.key]) == 0:
            raise GemmdriftError(f"no input rows for layer {p.layer} {p.name}")
        if inputs[p.key].shape[-1] != p.in_dims:
            raise GemmdriftError(f"input rows of layer {p.layer} {p.name} have {inputs[p.key].shape[-1]} columns, "
                                 f"the projection takes {p.in_dims}")
    synthetic = bool(lm.synthetic or getattr(inputs, "synthetic", False))
    kind = {True: "synthetic", False: "captured", None: "given"}[getattr(inputs, "synthetic", None)]
    ckpt = Path(checkpoint) if checkpoint is not None else None
    replay = kernels if kernels is not None and kernels.text else None
    log = replay.units_log() if replay is not None else None
    plan_unit = wrap = None
    if replay is not None:  # the replay engine is imported only by a replayed sweep
        plan_unit, wrap = replay.unit_hooks()
    if ckpt is not None:
        _open_checkpoint(ckpt, {"model": lm.description.source, "dtype": lm.description.dtype,
                                "quantization": lm.info["quantization"], "ts": ts, "max_t": max_t,
                                "flop_budget": flop_budget, "always_t": always_t, "inputs": inputs_digest(inputs),
                                "compute": compute_record(),  # another device or MLX_* setting: not these units
                                **({"kernels": replay.text} if replay is not None else {})})
    units = [(p, s) for p in projs for s in specs]
    frames: list[pd.DataFrame | None] = [None] * len(units)
    jobs, where = [], []
    for i, (proj, spec) in enumerate(units):
        rows = inputs[proj.key]
        plan = plan_ts(ts, proj.flops_per_row, len(rows), flop_budget, max_t, always_t)
        if log is not None:  # what the chip's recipes cannot replay is skipped (and said), never run natively
            plan = plan_unit(log, lm, proj, spec, plan, len(rows), 1 in ts)
            if plan is None:
                continue
        unit_file = _unit_file(ckpt, proj, spec) if ckpt is not None else None
        if unit_file is not None and unit_file.exists():
            frames[i] = _read_unit(unit_file)
            if frames[i] is not None:
                continue
        jobs.append(dict(layer=proj.layer, name=proj.name, path=spec.text, rows=rows, plan=plan, repeat_t1=1 in ts,
                         synthetic=synthetic, kind=kind, unit_file=unit_file,
                         **({"kernels": replay.text, "wrap": wrap} if replay is not None else {})))
        # Longest first (quantized matmuls are ~20x slower on the reference CPU), so two processes end together.
        where.append((i, proj.flops_per_row * (len(rows) + sum(plan)) * (20 if spec.quant is not None else 1)))
    order = sorted(range(len(jobs)), key=lambda j: -where[j][1])
    bar = tqdm(total=len(jobs), desc="kernels", unit="unit", file=sys.stderr, disable=None, mininterval=1.0,
               leave=False)
    try:
        done = run_jobs(lm, _unit_job, [jobs[j] for j in order], check_workers(lm, workers, len(jobs)),
                        done=lambda *_: bar.update())
    finally:
        bar.close()
    for j, frame in zip(order, done):
        frames[where[j][0]] = frame
    frames = [f for f in frames if f is not None]  # units a replay skipped have none
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=TABLE_COLUMNS)


def _unit_job(lm, *, layer: int, name: str, path: str, rows: np.ndarray, plan: Sequence[int], repeat_t1: bool,
              synthetic: bool, kind: str, unit_file: Path | None, kernels: str | None = None,
              wrap=None) -> pd.DataFrame:
    """One (projection, path) unit of :func:`sweep`, saved to ``unit_file`` when given (module level: units
    may run in other processes, each with its own model). ``kernels``: replay:<chip>[@variant], the
    operator replayed by ``wrap`` (:func:`gemmdrift.replay.model.replay_operator`, given by the sweep)."""
    import mlx.core as mx

    from ..model.projections import projections

    spec = parse_path(path)
    proj = projections(lm, layers=[layer], names=[name])[0]
    op = build_operator(lm, proj, spec)
    if kernels:
        op = wrap(lm, op, proj, kernels)
    labels = _label(proj, spec, op, synthetic, kind)
    measured = measure_unit(op, rows, plan, repeat_t1=repeat_t1)
    del op  # one projection's weights and quantized copies alive at a time
    mx.clear_cache()
    frame = pd.DataFrame([{**labels, "T": t, "metric": k, "value": float(v)}
                          for t, m in measured for k, v in m.items()])
    if unit_file is not None:
        files.write_csv(unit_file, frame)
    return frame


def measure_kernels(lm, inputs: Mapping[tuple[int, str], np.ndarray], projs: Sequence[Projection],
                    paths: Sequence[str] = DEFAULT_PATHS, ts: Iterable[int] = DEFAULT_TS, *, ops: bool = False,
                    record: Mapping[str, Any] | None = None, env: Mapping[str, Any] | None = None, **kw):
    """The kernel measurement as a Result: :func:`sweep` (and with ``ops``, :func:`ops_sweep`).

    Args:
        record: more inputs to record beside the model, paths and T (prompt, tokens, ...).
        env: the environment record (default: taken now).
        **kw: passed to :func:`sweep` (max_t, flop_budget, always_t, checkpoint).
    """
    from ..machine.envinfo import environment
    from ..model import weights_record

    env = {**(env if env is not None else environment()), **weights_record(lm.description)}
    ts = list(ts)
    kernels = kw.get("kernels")
    if ops and kernels is not None and kernels.text:
        raise GemmdriftError("--ops with --kernels: sdpa, rms_norm, rope and softmax have no replay recipe")
    df = sweep(lm, inputs, projs, paths, ts, **kw)
    if ops:
        df = pd.concat([df, ops_sweep(lm)], ignore_index=True)
    rec = {"model": lm.info, "paths": list(paths), "ts": ts, **(record or {})}
    if hasattr(inputs, "describe") and "rows" not in rec:
        rec["rows"] = inputs.describe()
    result = kernels_result(df, rec, env)
    if kernels is None or not kernels.text:
        return result
    kernels.log.extra.update(replayed="every unit's T=1 and block kernels, on paths model, dense and quant",
                             not_replayed="the input rows, captured here (the same rows for every chip); the "
                                          "float64 reference")
    skipped = result.tables.get("skipped")
    said = {(s["layer"], s["projection"], s["path"], s["T"]) for s in kernels.log.skipped if s["T"] != "all"}
    if skipped is not None and said:  # those block sizes were not replayable, not over the budget: said there
        import dataclasses

        keep = [(r.layer, r.projection, r.path, r.T) not in said for r in skipped.itertuples()]
        tables = {**result.tables, "skipped": skipped[keep].reset_index(drop=True)}
        result = dataclasses.replace(result, tables={k: v for k, v in tables.items() if k != "skipped" or len(v)})
    return kernels.label(result)


def measure_ops(lm, *, env: Mapping[str, Any] | None = None, **kw):
    """:func:`ops_sweep` alone as a ``kernels`` Result (``**kw`` passed on: ops, query_lengths, key_lengths)."""
    from ..machine.envinfo import environment
    from ..model import weights_record

    env = {**(env if env is not None else environment()), **weights_record(lm.description)}
    rec = {"model": lm.info, **{k: list(v) for k, v in kw.items()}}
    return kernels_result(ops_sweep(lm, **kw), rec, env)

__all__ = ["DEFAULT_TS", "DEFAULT_MAX_T", "DEFAULT_FLOP_BUDGET", "DEFAULT_ALWAYS_T", "DEFAULT_PATHS", "plan_ts", "measure_unit", "sweep", "measure_kernels", "measure_ops"]
