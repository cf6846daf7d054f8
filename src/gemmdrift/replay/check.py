"""The replay check: on the device it runs on, compute the real kernels and every variant of a chip's
recipes on the same captured rows, per projection, path and T, and say which variant is bit-identical (or
the ULP distance of the nearest).

Paths checked: ``dense:<dtype>`` (nn.Linear in that dtype: ``mx.matmul`` of ``x @ W.T``),
``quant:affine-q<bits>-g64`` and the fp modes ``quant:mxfp4-q4-g32``, ``quant:nvfp4-q4-g16``,
``quant:mxfp8-q8-g32`` (``mx.quantized_matmul`` of the weights quantized by
``nn.QuantizedLinear.from_linear``, in the model's compute dtype; the fp modes on the captured rows only, no
order rows yet). The T-row block cycles the captured rows,
as :func:`gemmdrift.kernels.sweep` does. On this machine's own backend the recipe is the CPU's and must be
identical everywhere; with ``chip`` set to another device the same check is a prediction compared with
this device's kernels (expected to differ: a negative control).
"""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .. import files, metrics
from ..errors import GemmdriftError
from ..model.projections import Projection
from ..kernels.paths import dense_weights, parse_path
from . import variant_name
from .fpquant import FP_MODES
from .paths import installed_mlx, plan_for, run_plan

DEFAULT_TS = (1, 2, 3, 4, 8, 16, 33)
DEFAULT_PATHS = ("dense:bfloat16", "dense:float32", "quant:affine-q4-g64", "quant:affine-q8-g64")


def check_paths(paths: Sequence[str]) -> list[Any]:
    """Parsed ``dense:``, ``quant:affine-q{4,8}-g64`` and fp-mode paths (``quant:mxfp4-q4-g32``,
    ``quant:nvfp4-q4-g16``, ``quant:mxfp8-q8-g32``) (one-line error otherwise, no model needed)."""
    out = []
    for p in paths:
        spec = parse_path(p)
        if spec.kind == "dense":
            out.append(spec)
        elif spec.kind == "quant" and spec.quant.mode == "affine" and spec.quant.bits in (4, 8) \
                and spec.quant.group_size == 64:
            out.append(spec)
        elif spec.kind == "quant" and FP_MODES.get(spec.quant.mode) == (spec.quant.bits, spec.quant.group_size):
            out.append(spec)  # the fp recipes (replay.fpquant): captured rows only, no order rows
        elif spec.kind == "quant" and spec.quant.mode != "affine":
            raise GemmdriftError(f"replay check: no recipe for path {p!r} ({spec.quant.mode} is "
                                 f"{FP_MODES.get(spec.quant.mode, ('?', '?'))[0]} bits in groups of "
                                 f"{FP_MODES.get(spec.quant.mode, ('?', '?'))[1]})")
        else:
            raise GemmdriftError(f"replay check: no recipe for path {p!r} (replayed: dense:<dtype>, "
                                 "quant:affine-q4-g64, quant:affine-q8-g64)")
    return out


class _Operands:
    """One projection under one path: the real kernel (mlx) and the numpy operands the recipes read."""

    def __init__(self, lm, proj: Projection, spec, head_rows: int | None):
        import mlx.core as mx
        import mlx.nn as nn

        from ..model import mx_dtype
        from ..model.taps import to_numpy

        compute = lm.description.dtype
        w, bias = dense_weights(lm, proj, compute)
        n = proj.out_dims if head_rows is None or not proj.is_head else min(head_rows, proj.out_dims)
        w = w[:n]
        bias = None if bias is None else bias[:n]
        self.n, self.k = n, proj.in_dims
        self.mode = "affine"
        if spec.kind == "dense":
            self.dtype = spec.dtype
            dt = mx_dtype(spec.dtype)
            self.w_mx = w.astype(dt)
            self.b_mx = None if bias is None else bias.astype(dt)
            self.w = to_numpy(self.w_mx)  # exact values of the dtype, as float32
            self.b = None if bias is None else to_numpy(self.b_mx)
            self.quant = None
            mx.eval(self.w_mx)
        else:
            q = spec.quant
            self.dtype = compute
            lin = nn.Linear(self.k, n, bias=bias is not None)
            lin.weight = w
            if bias is not None:
                lin.bias = bias
            mode_kw = {} if q.mode == "affine" else {"mode": q.mode}  # an older mlx has no mode argument
            self.qlin = nn.QuantizedLinear.from_linear(lin, group_size=q.group_size, bits=q.bits, **mode_kw)
            mx.eval(self.qlin.parameters())
            self.mode = q.mode
            if q.mode == "affine":
                self.quant = (np.array(self.qlin["weight"]), to_numpy(self.qlin["scales"]),
                              to_numpy(self.qlin["biases"]), q.bits, q.group_size)
            else:  # the uint8 scale codes as they are (the recipes decode them)
                self.quant = (np.array(self.qlin["weight"]), np.array(self.qlin["scales"]), None, q.bits,
                              q.group_size)
            self.b = None if bias is None else to_numpy(bias)
            self.w = None

    def real(self, x: np.ndarray) -> np.ndarray:
        import mlx.core as mx

        from ..model import mx_dtype
        from ..model.taps import to_numpy

        xm = mx.array(x).astype(mx_dtype(self.dtype))
        if self.quant is None:
            y = xm @ self.w_mx.T if self.b_mx is None else mx.addmm(self.b_mx, xm, self.w_mx.T)
        else:
            y = self.qlin(xm)
        return to_numpy(y)


def check_replay(lm, inputs: Mapping[tuple[int, str], np.ndarray], projs: Sequence[Projection],
                 paths: Sequence[str] = DEFAULT_PATHS, ts: Sequence[int] = DEFAULT_TS, *, chip: Any = None,
                 variants: str = "all", head_rows: int | None = None, env: Mapping[str, Any] | None = None,
                 mlx_version: str | None = None, progress: Callable[[str], None] | None = None,
                 checkpoint: str | Path | None = None, device: Callable[[Any, np.ndarray], np.ndarray] | None = None,
                 order_rows: bool = False):
    """The replay check as a Result of kind ``replay_check``.

    Args:
        lm: the loaded model.
        inputs: captured rows per projection (:func:`gemmdrift.kernels.capture_inputs`).
        projs: the projections (:func:`gemmdrift.kernels.projections`).
        paths: ``dense:<dtype>``, ``quant:affine-q{4,8}-g64`` and fp-mode paths (see :func:`check_paths`).
        ts: block sizes.
        chip: whose recipes to replay (default: this device, from its environment record).
        variants: ``all`` (every variant of each recipe) or one variant text.
        head_rows: check only the first rows of the LM head (default: all of it).
        mlx_version: the release whose recipes are replayed (default: the installed one).
        checkpoint: a directory where each finished (projection, path) unit and each finished order case is
            kept, so an interrupted run resumes (a directory of another configuration is refused).
        device: the "real" kernels, ``fn(operands, x) -> y`` (default: mlx's, ``operands.real``); a planted
            device (:func:`planted_device`) tests the check and the calibration here.
        order_rows: also check the order rows (:mod:`gemmdrift.replay.orderrows`: one seeded case per kernel and
            open axis the chip dispatches on ``paths``, on which every two values of the axis give different
            bits; quantized paths in the model's dtype), reported apart from the captured rows (table
            ``order_rows``, ``details["order_records"]``).
    """
    import pandas as pd

    from ..dispatch import chip_from_env, describe_chip, not_a_chip
    from ..machine.envinfo import environment
    from ..result import Result, env_labels, tidy

    specs = check_paths(paths)
    ts = sorted({int(t) for t in ts})
    if not ts or ts[0] < 1:
        raise GemmdriftError("block sizes T must be positive")
    env = dict(env or environment())
    own = chip_from_env(env, mlx_version)  # a device that is no chip model: as the replayed release reads it
    device_note = not_a_chip(env, mlx_version) or ""
    if chip is None:
        if own is None:
            raise GemmdriftError((device_note or f"this device ({env.get('backend')}, {env.get('architecture')}) "
                                  "is not a chip the dispatch can read") + "; give --chip to replay a chip's "
                                 "recipes against it (a prediction)")
        chip = own
    version = mlx_version or installed_mlx()
    rows: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    ckpt = None
    if checkpoint is not None:
        from ..model.projections import inputs_digest

        ckpt = Path(checkpoint)
        _open_checkpoint(ckpt, {"ts": ts, "chip": describe_chip(chip), "mlx_version": version, "variants": variants,
                                "head_rows": head_rows, "inputs": inputs_digest(inputs),
                                "model": str(getattr(lm.description, "source", ""))})
    for proj in projs:
        captured = np.asarray(inputs[proj.key], dtype=np.float32)
        for spec in specs:
            unit = None if ckpt is None else ckpt / "units" / (re.sub(r"[^A-Za-z0-9_.-]+", "_",
                                                                      f"{proj.layer:04d}__{proj.name}__{spec.text}")
                                                               + ".csv")
            done = _read_unit(unit) if unit is not None and unit.exists() else None
            if done is not None:
                rows += done
                continue
            first = len(rows)
            ops = _Operands(lm, proj, spec, head_rows)
            for T in ts:
                x = metrics.round_to(captured[np.arange(T) % len(captured)], ops.dtype).astype(np.float32)
                op = "matmul" if spec.kind == "dense" else "quantized_matmul"
                q = {} if ops.quant is None else {"bits": ops.quant[3], "group_size": ops.quant[4], "mode": ops.mode}
                base = {"layer": proj.layer, "projection": proj.name, "path": spec.text, "T": T, "K": ops.k,
                        "N": ops.n, "dtype": ops.dtype}
                try:
                    plan = plan_for(chip, op, T=T, K=ops.k, N=ops.n, dtype=ops.dtype, mlx_version=version,
                                    variant=None if variants == "all" else variants, **q)
                except GemmdriftError as e:
                    rows.append({**base, "kernel": "", "variant": "", "identical": False, "max_ulp": math.nan,
                                 "frac_differ": math.nan, "seconds": 0.0, "note": str(e)})
                    continue
                real = ops.real(x) if device is None else device(ops, x)
                recipe = plan.recipe
                var_list = recipe.variants() if variants == "all" else [plan.variant]
                for var in var_list:
                    bound = type(plan)(recipe, plan.params, var, plan.source, plan.note)
                    t0 = time.perf_counter()
                    got = run_plan(bound, x, dtype=ops.dtype, w=ops.w, bias=ops.b, quant=ops.quant)
                    secs = time.perf_counter() - t0
                    ulp = metrics.ulp_distance(real.astype(np.float64), got.y.astype(np.float64), ops.dtype)
                    same = bool(np.array_equal(real.view(np.uint32), got.y.view(np.uint32)))
                    rows.append({**base, "kernel": recipe.kernel, "variant": variant_name(var), "identical": same,
                                 "max_ulp": float(np.max(ulp)) if ulp.size else 0.0,
                                 "frac_differ": float(np.mean(ulp > 0)) if ulp.size else 0.0, "seconds": secs,
                                 "note": plan.note})
                if progress:
                    best = min(r["max_ulp"] for r in rows[-len(var_list):])
                    progress(f"layer {proj.layer} {proj.name} {spec.text} T={T}: {recipe.kernel}, "
                             f"{len(var_list)} variant(s), nearest {best:g} ulp")
            if unit is not None:
                files.write_csv(unit, pd.DataFrame(rows[first:]))
    compute = str(getattr(lm.description, "dtype", None) or "bfloat16")  # the quantized paths' dtype
    order_table, order_records = (_check_order_rows(chip, version, specs, compute, variants, device, progress,
                                                    None if ckpt is None else ckpt / "order")
                                  if order_rows else (None, []))
    table = pd.DataFrame(rows)
    records = summarize(table)
    tidy_rows = [{"pair": r["path"], "T": r["T"], "layer": r["layer"], "metric": "max_ulp", "value": r["max_ulp"],
                  "mode": r["variant"], "tap": r["projection"]} for r in rows if not math.isnan(r["max_ulp"])]
    frame = tidy(tidy_rows or [{"metric": "max_ulp", "value": math.nan}], **env_labels(env))
    figures = {}
    for r in records:
        if not math.isnan(r["max_ulp"]):
            figures[f"max_ulp/{r['path']}/T{r['T']}/{r['variant']}"] = float(r["max_ulp"])
    checked = sum(1 for r in rows if not math.isnan(r["max_ulp"]))
    inputs_rec = {"paths": [s.text for s in specs], "ts": ts, "chip": describe_chip(chip), "mlx_version": version,
                  "device_chip": describe_chip(own) if own else "", "device_note": device_note,
                  "variants": variants, "head_rows": head_rows,
                  "projections": [f"{p.layer}:{p.name}" for p in projs],
                  "model": dict(lm.description.__dict__) if hasattr(lm.description, "__dict__") else {},
                  "prediction": bool(own is None or chip != own), "order_rows": bool(order_rows)}
    details = {"records": records, "seconds": time.perf_counter() - t_start, "comparisons": checked}
    tables = {"replay_check": table}
    if order_table is not None:
        tables["order_rows"] = order_table
        details["order_records"] = order_records
    return Result(kind="replay_check", inputs=_jsonable(inputs_rec), env=env, frame=frame, figures=figures,
                  tables=tables, details=_jsonable(details))


def _check_order_rows(chip: Any, version: str, specs, compute: str, variants: str, device, progress,
                      ckpt: Path | None = None):
    """The order rows' table (one row per case and variant) and records (one per case: the identical variants
    and the axis value they decide, or None). Quantized paths run in ``compute`` (the model's dtype, as the
    captured rows do). With ``ckpt``, each finished case is kept there (one JSON file, written atomically) and
    a rerun reads it instead of searching and running the case again."""
    import pandas as pd

    from .orderrows import DEFAULT_TRIES, STYLES, order_path, order_units

    rows, records = [], []
    affine = [s for s in specs if s.kind == "dense" or s.quant.mode == "affine"]  # no fp order rows yet
    for unit in order_units(chip, mlx_version=version, paths=[order_path(s, compute) for s in affine]):
        key = {**{k: getattr(unit, k) for k in ("kernel", "axis", "path", "T", "K", "N")}, "tries": DEFAULT_TRIES,
               "styles": list(STYLES), "variants": variants}
        path = None if ckpt is None else ckpt / f"{unit.name}.json"
        done = _read_order_unit(path, key) if path is not None and path.exists() else None
        if done is None:
            done = _order_unit(chip, version, unit, variants, device)
            # The rows as a rerun reads them back (JSON), so a resumed check gives the same result.
            done = json.loads(files.to_json({"key": key, **done}))
            if path is not None:
                files.write_json(path, done)
        elif progress:
            progress(f"order rows {unit.kernel} {unit.axis} ({unit.path}): read from the checkpoint")
        rows += done["rows"]
        records.append(done["record"])
        if progress and "resumed" not in done:
            r = done["record"]
            progress(f"order rows {r['kernel']} {r['axis']} ({r['path']} T={r['T']} K={r['K']} N={r['N']}): "
                     + (f"{r['axis']}={r['values'][0]}" if len(r["values"]) == 1 else
                        f"{len(r['values'])} values identical" if r["values"] else "no variant identical"))
    return pd.DataFrame(rows), records


def _order_unit(chip: Any, version: str, unit, variants: str, device) -> dict[str, Any]:
    """One order unit searched and run on the device: its table rows and its record."""
    from .orderrows import case_plan, order_case

    case = order_case(chip, unit.path, unit.T, unit.K, unit.N, unit.axis, mlx_version=version)
    ops = case.ops
    plan = case_plan(chip, case.path, case.T, case.K, case.N, version,
                     variant=None if variants == "all" else variants)
    real = ops.real(case.x) if device is None else device(ops, case.x)
    recipe = plan.recipe
    var_list = recipe.variants() if variants == "all" else [plan.variant]
    base = {"kernel": recipe.kernel, "axis": case.axis, "path": case.path, "T": case.T, "K": case.K,
            "N": case.N, "dtype": ops.dtype, "seed": case.seed, "style": case.style}
    rows, same = [], []
    for var in var_list:
        bound = type(plan)(recipe, plan.params, var, plan.source, plan.note)
        t0 = time.perf_counter()
        got = run_plan(bound, case.x, dtype=ops.dtype, w=ops.w, bias=ops.b, quant=ops.quant)
        secs = time.perf_counter() - t0
        ulp = metrics.ulp_distance(real.astype(np.float64), got.y.astype(np.float64), ops.dtype)
        ident = bool(np.array_equal(np.asarray(real, np.float32).view(np.uint32), got.y.view(np.uint32)))
        if ident:
            same.append(var)
        rows.append({**base, "variant": variant_name(var), "identical": ident, "max_ulp": float(np.max(ulp)),
                     "frac_differ": float(np.mean(ulp > 0)), "seconds": secs})
    values = sorted({v[case.axis] for v in same}, key=case.values.index)
    record = {**base, "identical": [variant_name(v) for v in same], "values": values,
              "decided": values[0] if len(values) == 1 else None,
              "unseparated": [f"{a}/{b}" for a, b in case.unseparated]}
    return {"rows": rows, "record": record}


def _read_order_unit(path: Path, key: Mapping[str, Any]) -> dict[str, Any] | None:
    """A finished order unit (its rows and record, marked ``resumed``); None (after a warning, the file removed)
    when it is corrupt or is not this unit's (another search or variant setting)."""
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(saved, dict) or not isinstance(saved.get("rows"), list) or not isinstance(
                saved.get("record"), dict) or not saved["rows"]:
            raise ValueError("missing rows or record")
        if saved.get("key") != json.loads(files.to_json(key)):
            raise ValueError("another order case or search")
    except (OSError, UnicodeDecodeError, ValueError) as e:
        files.discard_checkpoint(path, str(e)[:80])
        return None
    return {**saved, "resumed": True}


def planted_device(chip: Any, variant: str, mlx_version: str) -> Callable[[Any, np.ndarray], np.ndarray]:
    """A device whose kernels are ``chip``'s recipes under ``variant``: for :func:`check_replay`'s ``device``.

    Each call replays the plan ``chip`` dispatches for the operands' shape and T (the same :func:`plan_for` and
    :func:`run_plan` the check's candidates use), so a check against it must find ``variant`` identical.
    """
    def real(ops, x: np.ndarray) -> np.ndarray:
        op = "matmul" if ops.quant is None else "quantized_matmul"
        q = {} if ops.quant is None else {"bits": ops.quant[3], "group_size": ops.quant[4], "mode": ops.mode}
        plan = plan_for(chip, op, T=x.shape[0], K=ops.k, N=ops.n, dtype=ops.dtype, mlx_version=mlx_version,
                        variant=variant, **q)
        return run_plan(plan, x, dtype=ops.dtype, w=ops.w, bias=ops.b, quant=ops.quant).y

    return real


def _open_checkpoint(ckpt: Path, config: dict[str, Any]) -> None:
    """Create the checkpoint's record, or check that an existing one is this configuration's."""
    record = ckpt / "check.json"
    now = json.loads(files.to_json(config))
    if record.exists():
        try:
            saved = json.loads(record.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as e:
            files.discard_checkpoint(ckpt / "units", f"its record {record.name} is unreadable: {e}")
            saved = None
        if saved is not None and saved != now:
            diff = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
            raise GemmdriftError(f"checkpoint {ckpt} belongs to another replay check (differs in {', '.join(diff)}); "
                                 "use a new directory")
        if saved is not None:
            return
    files.write_json(record, config)


def _read_unit(path: Path) -> list[dict[str, Any]] | None:
    """A finished unit's rows; None (after a warning, the file removed) when it is corrupt."""
    import pandas as pd

    try:
        saved = pd.read_csv(path, dtype={"variant": str, "kernel": str, "note": str, "path": str})
        if saved.empty or "max_ulp" not in saved or "identical" not in saved:
            raise ValueError("missing columns")
    except (OSError, UnicodeDecodeError, ValueError) as e:
        files.discard_checkpoint(path, str(e)[:80])
        return None
    saved = saved.assign(variant=saved["variant"].fillna(""), kernel=saved["kernel"].fillna(""),
                         note=saved["note"].fillna(""), identical=saved["identical"].astype(bool))
    return saved.to_dict("records")


def summarize(table) -> list[dict[str, Any]]:
    """One record per (path, T, variant): identical on every projection, and the worst ULP distance."""
    out = []
    if not len(table):
        return out
    for (path, T, variant), g in table.groupby(["path", "T", "variant"], sort=True):
        ulps = g["max_ulp"].dropna()
        out.append({"path": path, "T": int(T), "variant": variant, "kernel": ",".join(sorted(set(g["kernel"]) - {""})),
                    "identical": bool(len(ulps) == len(g) and g["identical"].all()),
                    "max_ulp": float(ulps.max()) if len(ulps) else math.nan, "projections": int(len(g)),
                    "note": "; ".join(sorted(set(g["note"]) - {""}))})
    return out


def seeded_q4_weight(rng: np.random.Generator, N: int, K: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A seeded affine 4-bit group-64 weight (N, K): packed codes, bf16 scales and biases (``rng``'s next draws)."""
    from .core import round_to

    codes = rng.integers(0, 16, size=(N, K)).astype(np.uint32)
    wq = np.zeros((N, K // 8), dtype=np.uint32)
    for i in range(8):
        wq |= codes[:, i::8] << np.uint32(4 * i)
    sc = round_to(rng.random((N, K // 64)).astype(np.float32) * 0.01, "bfloat16")
    bi = round_to(-rng.random((N, K // 64)).astype(np.float32) * 0.05, "bfloat16")
    return wq, sc, bi


def speed_ratio(kernel: str, T: int, K: int, N: int, *, reps: int = 5, params: Mapping[str, Any] | None = None,
                seed: int = 0, engine: str | None = None) -> dict[str, float]:
    """Seconds of one replayed projection and of a numpy float32 matmul of the same shape, interleaved in one
    run, on seeded bf16 operands; ``ratio`` compares the fastest of each (shared cores are noisy).

    Quantized kernels are timed on 4-bit group-64 weights of the same shape, twice per round: a first call on
    an emptied tile cache (``first_*``: the weight's tiles prepared in the call) and the call after it
    (``replay_s``, ``ratio``: the tiles served from the cache, as for every call after the first of a fixed
    weight in a model run). ``engine``: the replay engine (default:
    :func:`gemmdrift.replay.replay_engine`'s choice, the compiled one).
    """
    from . import RECIPES, replay_engine, replay_matmul, replay_quantized
    from .core import round_to

    if kernel not in RECIPES:
        raise GemmdriftError(f"no recipe {kernel!r} (known: {', '.join(RECIPES)})")
    rec = RECIPES[kernel]
    rng = np.random.default_rng(seed)
    x = round_to(rng.standard_normal((T, K)).astype(np.float32), "bfloat16")
    w = round_to((rng.standard_normal((N, K)) * 0.05).astype(np.float32), "bfloat16")
    wt = np.ascontiguousarray(w.T)
    prm = dict(params or {"k_lanes": 32, "partitions": 4, "partition_size": K // 4, "bk": 16, "split_k": 1,
                          "fast": K % 512 == 0})
    dtype = "float32" if "float32" in rec.dtypes and "bfloat16" not in rec.dtypes else "bfloat16"
    if rec.op == "matmul":
        def run():
            return replay_matmul(rec, x, w, dtype=dtype, params=prm, engine=engine)
    else:
        wq, sc, bi = seeded_q4_weight(rng, N, K)

        def run():
            return replay_quantized(rec, x, wq, sc, bi, bits=4, group_size=64, dtype="bfloat16", params=prm,
                                    engine=engine)
    cached = rec.op != "matmul" and replay_engine(engine) == "compiled"  # only the compiled quantized path caches
    t_np, t_rp, t_first = [], [], []
    for _ in range(max(1, reps)):
        t0 = time.perf_counter()
        np.matmul(x, wt)  # the baseline: numpy's float32 matmul (its own order, not replayed)
        t_np.append(time.perf_counter() - t0)
        if cached:
            from .jitcache import clear

            clear()
            t0 = time.perf_counter()
            run()
            t_first.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        run()
        t_rp.append(time.perf_counter() - t0)
    t_first = t_first or t_rp  # dense: nothing is cached, every call is a first call
    # The figure is the ratio of the fastest runs: numpy's multithreaded BLAS swings 30x on shared cores
    # (0.8 to 23 ms for 33 x 640 x 2048 here), so a median compares against a contended numpy.
    lo_np, lo_rp = float(np.min(t_np)), float(np.min(t_rp))
    med_np, med_rp = float(np.median(t_np)), float(np.median(t_rp))
    lo_first = float(np.min(t_first))
    return {"replay_s": lo_rp, "numpy_s": lo_np, "ratio": lo_rp / lo_np if lo_np > 0 else math.inf,
            "first_replay_s": lo_first, "first_ratio": lo_first / lo_np if lo_np > 0 else math.inf,
            "median_replay_s": med_rp, "median_numpy_s": med_np,
            "median_ratio": med_rp / med_np if med_np > 0 else math.inf}


def check_text(result) -> str:
    """The printed summary of a replay check: per path and T, the identical variants, else the nearest and its
    ULP distance, under a head naming whose recipes ran and whether that is a prediction."""
    records = result.details["records"]
    lines = [headline(result)]
    by: dict[tuple[str, int], list[dict]] = {}
    for r in records:
        by.setdefault((r["path"], r["T"]), []).append(r)
    for (path, T), rs in sorted(by.items()):
        same = [r["variant"] for r in rs if r["identical"]]
        kernel = rs[0]["kernel"] or "-"
        if same:
            lines.append(f"{path:22s} T={T:<4d} {kernel:18s} identical: {', '.join(same)}")
        else:
            done = [r for r in rs if r["max_ulp"] is not None and not _nan(r["max_ulp"])]
            if not done:
                lines.append(f"{path:22s} T={T:<4d} {kernel:18s} not replayed: {rs[0]['note']}")
                continue
            best = min(done, key=lambda r: r["max_ulp"])
            lines.append(f"{path:22s} T={T:<4d} {kernel:18s} none identical; nearest {best['variant']} at "
                         f"{best['max_ulp']:g} ulp")
    lines += order_lines(result)
    lines += variants_lines(result)
    lines.append(cells_line(result))
    return "\n".join(lines)


def order_lines(result) -> list[str]:
    """The order rows' part of the summary: per kernel and axis, the value they decide (or why not)."""
    recs = result.details.get("order_records") or []
    out = ["order rows (seeded, built so every two values of an axis give different bits):"] if recs else []
    for r in recs:
        what = (f"decides {r['axis']}={r['decided']}" if r["decided"] else
                f"{len(r['values'])} {r['axis']} values identical: not decided" if r["values"] else
                "no variant identical")
        if r.get("unseparated"):
            what += f" (pairs the rows do not separate: {', '.join(r['unseparated'])})"
        out.append(f"  {r['kernel']:18s} {r['axis']:9s} {r['path']} T={r['T']} K={r['K']} N={r['N']}: {what}")
    return out


def variants_lines(result) -> list[str]:
    """Per path, the kernels the check ran and the variants each has (its open axes and their values)."""
    from . import RECIPES

    kernels: dict[str, list[str]] = {}
    for r in result.details["records"]:
        if r["kernel"]:
            for k in str(r["kernel"]).split(","):
                kernels.setdefault(r["path"], [])
                if k not in kernels[r["path"]]:
                    kernels[r["path"]].append(k)
    out = []
    for path, ks in sorted(kernels.items()):
        parts = []
        for k in ks:
            axes = {a: v for a, v in (RECIPES[k].axes if k in RECIPES else {}).items() if len(v) > 1}
            parts.append(k + (" " + " ".join(f"{a}={'|'.join(v)}" for a, v in axes.items()) if axes
                              else " (no open axis)"))
        out.append(f"variants on {path}: " + "; ".join(parts))
    checked = (result.inputs or {}).get("variants")
    if out and checked not in (None, "all"):  # the list is of what exists; say what this check ran
        from . import unused_axes

        unused = unused_axes(checked, {k for ks in kernels.values() for k in ks})
        out.append(f"  (the variants each kernel has; this check ran {checked or 'the default'} only"
                   + (f"; {', '.join(unused)} unused: no kernel checked has it" if unused else "") + ")")
    return out


def _nan(x) -> bool:
    return isinstance(x, float) and math.isnan(x)


def headline(result) -> str:
    inp = result.inputs
    return (f"== replay check: recipes of {inp['chip']} (mlx {inp['mlx_version']}) against this device "
            f"({inp['device_chip'] or 'not a chip'})" + (" -- a prediction, not this device's own recipes"
                                                          if inp["prediction"] else "")
            + (f"\n{inp['device_note']}" if inp.get("device_note") else "")
            + (f"\n{inp['calibration']}" if inp.get("calibration") else ""))


def cells_line(result) -> str:
    """How many replayed (path, T) cells have a bit-identical variant; cells with no recipe (a Metal float32 call,
    a NAX kernel, ...) are not counted among them but said apart, the lines above giving each one's reason."""
    by: dict[tuple[str, int], bool] = {}
    recs = result.details["records"]
    for r in recs:  # max_ulp: NaN in memory, null once written
        if r["kernel"] or not (r["max_ulp"] is None or _nan(r["max_ulp"])):
            by[(r["path"], r["T"])] = by.get((r["path"], r["T"]), False) or bool(r["identical"])
    skipped = sorted({(r["path"], r["T"]) for r in recs if (r["path"], r["T"]) not in by})
    paths = dict.fromkeys(p for p, _ in skipped)
    where = "; ".join(f"{p} T={', '.join(str(t) for q, t in skipped if q == p)}" for p in paths)
    return (f"{sum(by.values())} of {len(by)} replayed (path, T) cells have a bit-identical variant"
            + (f"; {len(skipped)} not replayed, no recipe ({where}: each line above says why)" if skipped else ""))


def report_part(result) -> tuple[list, list[str]]:
    """(blocks, reading) of a replay check's section of `gemmdrift report`: whose recipes, prediction or not."""
    inp = result.inputs
    what = (f"Recipes of **{inp['chip']}** (mlx {inp['mlx_version']}) replayed against this device's kernels "
            f"({inp['device_chip'] or 'unknown chip'}) on the same captured rows: "
            + ("a PREDICTION for that chip compared with this device (expected to differ), not a measurement on "
               "it." if inp["prediction"] else "this device's own recipes (each cell must be bit-identical)."))
    return [("p", what), ("pre", check_text(result))], [what, cells_line(result) + "."]


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating, float)):
        return None if math.isnan(float(x)) else float(x)
    if isinstance(x, (str, int, bool)) or x is None:
        return x
    return str(x)


__all__ = ["DEFAULT_TS", "DEFAULT_PATHS", "check_paths", "check_replay", "planted_device", "check_text",
           "order_lines", "variants_lines", "headline",
           "cells_line", "report_part", "summarize", "seeded_q4_weight", "speed_ratio"]
