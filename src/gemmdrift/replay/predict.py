"""Predicted GPU drift: decode vs verify:2 and verify:3 below the sliding window, replayed per chip and variant.

On this machine every real kernel is row-invariant, so decode (T=1) and verification (T=3, T=4) give exactly
the same bits below the window. The replay (:mod:`gemmdrift.replay.model`) computes what a chip's
kernels would: this part runs :func:`gemmdrift.measure.stack.measure_stack` under ``replay:<chip>@<variant>`` (the
same :func:`~gemmdrift.replay.model.replayed` the ``--kernels`` flag installs) for every variant of
the recipes the chip dispatches for the part's calls, and beside it the same measurement on this machine's
kernels (the measured CPU line). Per chip it gives per-layer drift (rel_l2, max_abs) and the logit envelope
(max |Δlogit|, max |Δgap|, flips, same top-1) for the default variant and the min/max over the variants.

CUDA (``sm90``): mlx's own gemv runs at T=1 only; T>1 is cuBLASLt, whose order is not knowable from source.
Its decode-vs-verify pairs are refused with that reason, never guessed; what is knowable is shown instead:
the replayed CUDA gemv decode against this machine's decode of the same stream.

Every figure is a prediction for that chip (mlx version, variant), not a measurement on it.
"""

from __future__ import annotations

import itertools
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from ..errors import GemmdriftError
from ..result import Result, figure_name, tidy

CHIPS = ("M1", "M3", "sm90")
CUDA_CHIPS = ("sm90",)
METRICS = ("rel_l2", "max_abs", "frac_differ")  # per layer, as stack's tables
ENVELOPE = ("max_abs_dlogit", "max_abs_dgap", "flips", "same_top1_share")
STATS = ("default", "min", "max")
CUDA_PAIR = "decode-vs-cpu"  # the knowable CUDA line: its replayed gemv decode against this machine's decode


@dataclass(frozen=True)
class PredictSizes:
    """How big the prediction part is."""

    tokens: int  # stream length (the built-in essay)
    split: int  # the prompt, prefilled in one block; positions split..tokens-1 compared (logits at all of them)
    chips: tuple[str, ...] = CHIPS
    variants: str = "all"  # "all": every variant of the recipes the chip runs here; "default": its default only


# A one-token prompt: its one block runs T=1 (Metal gemv on every Apple chip), so the decode reference is the
# same computation for every Metal chip and variant and runs once (see _share_reference); four compared
# positions hold one verify:2 block (T=3, then T=1) and one verify:3 block (T=4).
SIZES = {
    "cpu": PredictSizes(tokens=5, split=1),
    "gpu": PredictSizes(tokens=5, split=1),  # the replay runs on the CPU (numba): the same cost on any machine
    "quick": PredictSizes(tokens=5, split=1, chips=("M3", "sm90"), variants="default"),
}


def schedules(sizes: PredictSizes) -> tuple[str, str, str]:
    s = sizes.split
    return (f"prefill:{s},decode", f"prefill:{s},verify:2", f"prefill:{s},verify:3")


def short(schedule: str) -> str:
    """'prefill:1,verify:2' -> 'verify:2' (the name figures and benchmarks use)."""
    return schedule.rpartition(",")[2]


def check_sizes(sizes: PredictSizes) -> None:
    """Impossible sizes, unknown chips or variant modes: one-line errors, before any model loads."""
    from .paths import parse_chip

    if sizes.split < 1 or sizes.tokens < sizes.split + 4:
        raise GemmdriftError(f"predict: need split >= 1 and at least 4 compared positions (tokens {sizes.tokens}, "
                             f"split {sizes.split})")
    if sizes.variants not in ("all", "default"):
        raise GemmdriftError(f"predict: variants must be 'all' or 'default', not {sizes.variants!r}")
    for c in sizes.chips:
        parse_chip(c)


def _shapes(lm) -> list[tuple[str, dict[str, Any]]]:
    """(op, shape kwargs) of every projection and the LM head, as the replay proxies see them."""
    import mlx.nn as nn

    from ..model.projections import projections

    out = {}
    for p in projections(lm):
        m = p.module
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            n, groups = m["scales"].shape
            key = ("quantized_matmul", n, groups * m.group_size, m.bits, m.group_size)
            out[key] = ("quantized_matmul", {"N": n, "K": groups * m.group_size, "bits": m.bits,
                                             "group_size": m.group_size})
        else:
            n, k = m["weight"].shape
            out[("matmul", n, k)] = ("matmul", {"N": n, "K": k})
    return list(out.values())


def block_ts(schedule: str, n: int, split: int) -> list[int]:
    """The T of every call a schedule makes over ``n`` tokens (its block lengths, prefix included)."""
    from ..schedules import parse_schedule

    return sorted({b - a for a, b in parse_schedule(schedule).blocks(n, split)})


def _plans(lm, chip: str, ts: Sequence[int], variant: str | None, version: str | None = None):
    """Every plan the chip runs for these T values (a GemmdriftError when one has no known order)."""
    from .paths import plan_for

    dtype = lm.description.dtype
    return [plan_for(chip, op, T=t, dtype=dtype, variant=variant, mlx_version=version, **kw) for t in ts
            for op, kw in _shapes(lm)]


def refusal(lm, chip: str, ts: Sequence[int], version: str | None = None) -> str | None:
    """Why a chip's run over these T values cannot be replayed (its kernel's order is not knowable), or None."""
    try:
        _plans(lm, chip, ts, None, version)
    except GemmdriftError as e:
        return str(e)
    return None


def chip_variants(lm, chip: str, ts: Sequence[int], which: str = "all", version: str | None = None) -> list[str]:
    """Variant texts (``"mma=H2"``, ...) of the recipes the chip runs for ``ts``: every combination, the default
    first (``""`` when no recipe has an axis); only the default with ``which="default"``."""
    axes: dict[str, tuple[str, ...]] = {}
    for plan in _plans(lm, chip, ts, None, version):
        for axis, values in plan.recipe.axes.items():
            axes.setdefault(axis, tuple(values))
    if not axes or which == "default":
        return [",".join(f"{a}={v[0]}" for a, v in axes.items())]
    keys = list(axes)
    return [",".join(f"{k}={v}" for k, v in zip(keys, combo)) for combo in itertools.product(*(axes[k] for k in keys))]


def calibrated_variants(variants: Sequence[str], measured: dict[str, str]) -> list[str]:
    """The variant texts consistent with a calibration's measured axes (its order kept: the one with the other
    axes at their defaults first); axes the chip's recipes here do not have are ignored."""
    def split(text: str) -> dict[str, str]:
        return dict(p.split("=", 1) for p in text.split(",") if "=" in p)

    return [v for v in variants if all(split(v).get(a, m) == m for a, m in measured.items())]


def _signature(lm, chip: str, ts: Sequence[int], variant: str, version: str | None = None) -> tuple:
    """What a run's every call computes: (kernel, params, variant) per projection shape and T."""
    return tuple((p.recipe.kernel, tuple(sorted(p.params.items())), tuple(sorted(p.variant.items())))
                 for p in _plans(lm, chip, ts, variant or None, version))


def _share_reference(lm, tokens, sizes: PredictSizes, ref: str, src: Path, dst: Path) -> bool:
    """Put the decode reference computed under one (chip, variant) into another's checkpoint, where measure_stack
    loads it instead of running it again. Only called when every call of that run (its prefix block and every
    decode step) has the same plan under both, so the taps are the same by construction."""
    import shutil

    from ..files import atomic_path
    from ..measure.stack import run_key

    positions = np.arange(sizes.split, sizes.tokens)
    try:
        name = run_key(lm, tokens, ref, "reference", lm.description.dtype, sizes.split, positions, positions)
    except TypeError:  # stack's run key changed shape: recompute the reference rather than guess its file
        _say("the decode reference is not shared (stack's run key changed): computed again")
        return False
    # The taps and the replayed calls saved beside them (measure_stack counts those on a resumed run; taps without
    # them are computed again): the calls first, as measure_stack writes them, the taps being the mark of a run.
    names = [name + ".calls.json", name + ".npz"]
    if not all((src / n).is_file() for n in names):
        return False
    dst.mkdir(parents=True, exist_ok=True)
    for n in names:
        if not (dst / n).is_file():
            with atomic_path(dst / n) as tmp:
                shutil.copyfile(src / n, tmp)
    return True


def _layer_rows(table: pd.DataFrame, labels: dict[str, Any]) -> list[dict]:
    t = table[(table["mode"] == "accumulated") & table["metric"].isin(METRICS)]
    wide = t.pivot_table(index=["pair", "schedule", "tap", "layer", "layer_type"], columns="metric",
                         values="value", aggfunc="first").reset_index().sort_values(["schedule", "layer"])
    return [{**labels, **{k: r[k] for k in ("pair", "schedule", "tap", "layer", "layer_type")},
             **{m: float(r[m]) for m in METRICS if m in r}} for _, r in wide.iterrows()]


def _envelope_rows(env: pd.DataFrame, labels: dict[str, Any]) -> list[dict]:
    env = env[env["mode"] == "accumulated"]
    return [{**labels, "pair": r["pair"], "schedule": r["schedule"], "positions": int(r["positions"]),
             **{k: float(r[k]) for k in ENVELOPE if k in r and pd.notna(r[k])}} for _, r in env.iterrows()]


def _say(text: str) -> None:
    print(f"  predict: {text}", file=sys.stderr, flush=True)


def predict_drift(lm, sizes: PredictSizes, *, checkpoint: str | Path | None = None,
                  env: dict[str, Any] | None = None, tokens: Sequence[int] | None = None,
                  mlx_version: str | None = None, calibration: Sequence[str] = ()) -> Result:
    """Decode vs verify:2 / verify:3 predicted per chip and variant, beside the same pairs measured here.

    Args:
        lm: a :class:`gemmdrift.model.LoadedModel`.
        sizes: the stream, the prompt split, the chips and which variants.
        checkpoint: a directory for every run's taps (resume: finished runs are loaded, not rerun).
        env: the environment record (default :func:`gemmdrift.machine.envinfo.environment`).
        tokens: the stream (default: the built-in essay's first ``sizes.tokens`` tokens).
        mlx_version: whose recipes the replay follows (default the installed mlx; the changelog replays each
            release's).
        calibration: calibration files; with the registry's (:mod:`gemmdrift.replay.calib`), a chip
            they calibrate at this release runs its measured variant (only the unmeasured axes still vary).

    Returns:
        A ``predict`` Result: tables ``layers`` and ``envelope`` (one row per chip, variant, pair and tap;
        ``source`` "measured" for this machine's kernels, "prediction" for a replay), ``spread_layers`` and
        ``spread_envelope`` (default, min and max over each chip's variants) and ``refused`` (pairs whose
        kernels have no knowable order, with the reason); figures ``<metric>/<chip>/<schedule>/<stat>``.
    """
    from ..machine.envinfo import environment
    from .model import replayed
    from .paths import installed_mlx
    from ..prompts import builtin_stream
    from ..measure.stack import compare_taps, measure_stack
    from ..model.taps import load_checkpoint, run_schedule, save_taps

    from ..dispatch import not_a_chip

    check_sizes(sizes)
    env = env if env is not None else environment()
    device_note = not_a_chip(env)
    if device_note:  # the measured line is this device as it reports itself, never a chip's
        _say(device_note)
    ck = Path(checkpoint) if checkpoint is not None else None
    tokens = [int(t) for t in (builtin_stream(lm, sizes.tokens) if tokens is None else tokens)]
    if len(tokens) != sizes.tokens:
        raise GemmdriftError(f"predict: {len(tokens)} tokens given for sizes of {sizes.tokens}")
    scheds = schedules(sizes)
    n, split = len(tokens), sizes.split
    positions = np.arange(split, n)
    version = mlx_version or installed_mlx()
    if calibration:  # another release or disagreeing files: refused before anything is measured
        from .calib import check_run

        check_run(calibration, version)
    ts = {s: block_ts(s, n, split) for s in scheds}
    common = dict(split=split, local=False, env=env, workers=1)  # in-process: the replay proxies live here
    layers: list[dict] = []
    envs: list[dict] = []
    refused: list[dict] = []
    logs: list[dict] = []
    seconds: dict[str, float] = {}
    kept: dict = {}

    t0 = time.perf_counter()
    r = measure_stack(lm, tokens, list(scheds), checkpoint=ck / "native" if ck else None, keep_taps=kept, **common)
    # The measured line is this machine's own kernels, named by its backend (a GPU's rows are not "cpu").
    backend = str(env.get("backend") or "unknown backend")
    seconds[f"{backend} (measured)"] = time.perf_counter() - t0
    here = {"chip": backend, "variant": "measured", "default": True, "source": "measured"}
    layers += _layer_rows(r.tables["stack"], here)
    envs += _envelope_rows(r.tables["envelope"], here)
    native_ref = kept[(scheds[0], "accumulated", lm.description.dtype)]
    _say(f"this machine's kernels: {seconds[f'{backend} (measured)']:.1f} s")

    from .calib import resolve

    calibrated: dict[str, str] = {}  # chip -> "calibrated by <file>"
    shared: dict[tuple, Path] = {}  # decode reference signature -> the checkpoint that holds it
    variants_run: dict[str, list[str]] = {}
    for chip in sizes.chips:
        reasons = {s: refusal(lm, chip, ts[s], version) for s in scheds[1:]}  # each asked once
        knowable = [s for s in scheds[1:] if reasons[s] is None]
        refused += [{"chip": chip, "pair": f"{scheds[0]} vs {s}", "schedule": s, "reason": reasons[s]}
                    for s in scheds[1:] if reasons[s] is not None]
        if knowable:
            run = [scheds[0], *knowable]
            variants = chip_variants(lm, chip, sorted({t for s in run for t in ts[s]}), sizes.variants, version)
            cal = resolve(chip, version, calibration, others="skip")  # a file calibrates its own chip only
            if cal.variant:
                variants = calibrated_variants(variants, cal.variant)
                calibrated[chip] = cal.note
                _say(f"{chip}: {cal.note} ({cal.text})")
            variants_run[chip] = variants
            for i, v in enumerate(variants):
                label = f"{chip}@{v}" if v else chip
                d = ck / ("replay-" + label.replace("=", "-").replace(",", "+")) if ck else None
                sig = _signature(lm, chip, ts[scheds[0]], v, version)
                t0 = time.perf_counter()
                with replayed(lm, chip, v or None, version) as log:
                    if d is not None and sig in shared:  # under the replay: its run key is the replayed one
                        _share_reference(lm, tokens, sizes, scheds[0], shared[sig], d)
                    r = measure_stack(lm, tokens, run, checkpoint=d, **common)
                seconds[label] = time.perf_counter() - t0
                _say(f"replay:{label}: {seconds[label]:.1f} s")
                if d is not None:
                    shared.setdefault(sig, d)
                labels = {"chip": chip, "variant": v or "exact", "default": i == 0, "source": "prediction"}
                layers += _layer_rows(r.tables["stack"], labels)
                envs += _envelope_rows(r.tables["envelope"], labels)
                logs.append({"label": label, **log.record(), "planned": _planned(lm, chip, ts, run, v, version)})
        if chip in CUDA_CHIPS or not knowable:
            # What is knowable: the chip's T=1 kernels decoding the same stream, against this machine's decode.
            why = refusal(lm, chip, ts[scheds[0]], version)
            if why is not None:
                refused.append({"chip": chip, "pair": CUDA_PAIR, "schedule": scheds[0], "reason": why})
                continue
            path = ck / f"replay-{chip}-decode.npz" if ck else None
            t0 = time.perf_counter()
            with replayed(lm, chip, None, version) as log:
                other = load_checkpoint(path)
                if other is None:
                    other = run_schedule(lm.model, tokens, scheds[0], split=split, positions=positions,
                                         logit_positions=positions)
                    if path is not None:
                        save_taps(path, other)
            seconds[f"{chip} decode"] = time.perf_counter() - t0
            _say(f"replay:{chip} decode vs this machine's decode: {seconds[f'{chip} decode']:.1f} s")
            pair = f"{scheds[0]} (this machine) vs {scheds[0]} ({chip})"
            rows, _, envelope = compare_taps(native_ref, other, list(lm.description.layer_types),
                                             {"pair": pair, "reference": scheds[0], "schedule": CUDA_PAIR,
                                              "mode": "accumulated", "dtype": lm.description.dtype}, tokens=tokens)
            labels = {"chip": chip, "variant": "exact", "default": True, "source": "prediction"}
            layers += _layer_rows(pd.DataFrame(rows), labels)
            envs += _envelope_rows(pd.DataFrame([{"pair": pair, "schedule": CUDA_PAIR, "mode": "accumulated",
                                                  **envelope}]), labels)
            variants_run.setdefault(chip, ["exact"])
            logs.append({"label": f"{chip} decode", **log.record(), "planned": _planned(lm, chip, ts, scheds[:1], "", version)})

    tables = {"layers": pd.DataFrame(layers), "envelope": pd.DataFrame(envs)}
    tables["spread_layers"], tables["spread_envelope"] = spread(tables["layers"], tables["envelope"])
    tables["refused"] = pd.DataFrame(refused, columns=["chip", "pair", "schedule", "reason"])
    inputs = {"model": lm.info, "sizes": asdict(sizes), "tokens": tokens, "schedules": list(scheds),
              "positions": [int(p) for p in positions], "mlx_replayed": version, "variants": variants_run,
              "device_note": device_note or "", "calibration": calibrated,
              "prediction": "every replayed figure is a prediction for that chip (mlx version, variant), "
                            "not a measurement on it"}
    frame = tidy(_tidy(tables["layers"]), backend=str(env.get("backend") or ""), mlx=str(env.get("mlx") or ""),
                 model=lm.info.get("source", ""), dtype=lm.description.dtype)
    return Result(kind="predict", inputs=inputs, env=env, frame=frame, figures=predict_figures(tables),
                  tables=tables, details={"replay": logs, "seconds": seconds})


def _planned(lm, chip: str, ts: dict[str, list[int]], run: Sequence[str], variant: str,
             version: str | None = None) -> list[dict[str, Any]]:
    """Which kernel and variant every call of these schedules plans, by T: the record of a run even when its
    taps were resumed from a checkpoint (the replay log counts only the calls made in this process)."""
    out = set()
    for t in sorted({t for s in run for t in ts[s]}):
        for p in _plans(lm, chip, [t], variant or None, version):
            out.add((t, p.recipe.kernel, ",".join(f"{k}={v}" for k, v in p.variant.items()) or "exact"))
    return [{"T": t, "kernel": k, "variant": v} for t, k, v in sorted(out)]


def spread(layers: pd.DataFrame, envelope: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per (chip, schedule, tap): the default variant's value and the min / max over the chip's variants' own
    results; per (chip, schedule): the same for the envelope figures."""
    def one(df: pd.DataFrame, keys: list[str], cols: Sequence[str]) -> pd.DataFrame:
        if not len(df):
            return pd.DataFrame()
        out = []
        for key, g in df.groupby(keys, sort=False):
            row = dict(zip(keys, key))
            row["variants"] = int(len(g))
            d = g[g["default"].astype(bool)]
            for c in cols:
                if c not in g:
                    continue
                row[f"{c}_default"] = float(d[c].iloc[0]) if len(d) else np.nan
                row[f"{c}_min"], row[f"{c}_max"] = float(g[c].min()), float(g[c].max())
            out.append(row)
        return pd.DataFrame(out)

    return (one(layers, ["chip", "source", "schedule", "tap", "layer"], METRICS),
            one(envelope, ["chip", "source", "schedule"], ENVELOPE))


def predict_figures(tables: dict[str, pd.DataFrame]) -> dict[str, float]:
    """``<envelope metric>/<chip>/<schedule>/<stat>`` and ``last_layer_rel_l2/<chip>/<schedule>/<stat>`` for
    every predicted chip (stat: default, min, max over the variants); finite values only."""
    out: dict[str, float] = {}
    env = tables.get("spread_envelope", pd.DataFrame())
    for _, r in (env[env["source"] == "prediction"].iterrows() if len(env) else []):
        for m in ENVELOPE:
            for st in STATS:
                if f"{m}_{st}" in r:
                    out[figure_name(m, r["chip"], short(r["schedule"]), st)] = float(r[f"{m}_{st}"])
    lay = tables.get("spread_layers", pd.DataFrame())
    if len(lay):
        lay = lay[(lay["source"] == "prediction") & lay["tap"].astype(str).str.startswith("layer ")]
        for (chip, sched), g in lay.groupby(["chip", "schedule"]):
            last = g.loc[g["layer"].idxmax()]
            for st in STATS:
                out[figure_name("last_layer_rel_l2", chip, short(sched), st)] = float(last[f"rel_l2_{st}"])
    return {k: v for k, v in out.items() if np.isfinite(v)}


def _tidy(layers: pd.DataFrame) -> pd.DataFrame:
    if not len(layers):
        return pd.DataFrame(columns=["metric", "value"])
    long = layers.melt(id_vars=["chip", "variant", "source", "pair", "tap", "layer"], value_vars=list(METRICS),
                       var_name="metric", value_name="value")
    long["pair"] = long["chip"] + "@" + long["variant"] + ": " + long["pair"]
    long["mode"] = "accumulated"
    return long[["pair", "mode", "tap", "layer", "metric", "value"]]


__all__ = ["PredictSizes", "SIZES", "CHIPS", "predict_drift", "spread", "predict_figures", "chip_variants",
           "calibrated_variants",
           "refusal", "block_ts", "schedules", "check_sizes"]
