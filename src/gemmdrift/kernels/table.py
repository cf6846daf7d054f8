"""The tidy kernel table (columns, normalisation after a CSV round trip, worst over T), the
dispatch switches drawn beside it, and the ``kernels`` Result with its tracked figures. See :mod:`gemmdrift.kernels`."""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np
import pandas as pd

from .. import metrics
from .paths import QUANT_RE

TABLE_COLUMNS = ["layer", "projection", "path", "dtype", "quant", "emulated", "synthetic", "inputs", "K", "N",
                 "key_length", "T", "metric", "value", "heads", "kv_heads"]  # heads: sdpa rows only
OP_NAMES = ("sdpa", "rms_norm", "rope", "softmax")


# ----------------------------------------------------------------------- results


def block_drift(single: np.ndarray, block: np.ndarray, dtype: str) -> dict[str, float]:
    """Compare a block's rows with the same rows computed alone (metrics.compare plus row counts).

    ``rows_differ`` counts rows that are not bit-identical; ``worst_position``
    is the block index of the row with the largest ULP distance, -1 when
    every row is bit-identical.
    """
    m = metrics.compare(single, block, dtype)
    per_row = metrics.ulp_distance(single, block, dtype).reshape(block.shape[0], -1).max(axis=1)
    m["rows_differ"] = float(np.count_nonzero(per_row))
    m["worst_position"] = float(np.argmax(per_row)) if per_row.max() > 0 else -1.0
    return m


def worst_over_t(df: pd.DataFrame, metric: str = "max_ulp") -> pd.DataFrame:
    """Per path, layer and projection: the worst value of ``metric`` over T (and the first T where it is > 0)."""
    t = df[(df["metric"] == metric)]
    if t.empty:
        return pd.DataFrame(columns=["path", "emulated", "layer", "projection", "worst", "first_T"])
    keys = ["path", "emulated", "layer", "projection"]
    worst = t.groupby(keys, sort=False)["value"].max().rename("worst")
    first = t[t["value"] > 0].groupby(keys, sort=False)["T"].min().rename("first_T").astype(float)
    return worst.to_frame().join(first).reset_index()


def is_op(df: pd.DataFrame) -> pd.Series:
    return df["projection"].isin(OP_NAMES)


def normalize(df: pd.DataFrame) -> pd.DataFrame:
    """The table as :func:`sweep` makes it, also after a CSV round trip (where "" became NaN)."""
    return df.assign(quant=df["quant"].astype(object).fillna("").astype(str), emulated=df["emulated"].astype(bool),
                     synthetic=df["synthetic"].astype(bool))


def plot_thresholds(df: pd.DataFrame, env: Mapping[str, Any],
                    chip: Any = None) -> tuple[dict[str, list[tuple[int, str, str]]], str]:
    """Dispatch switches per projection name for the backend and mlx version of ``env``, and their origin.

    On the CPU (row-invariant, no thresholds) Metal's are returned instead,
    labelled "Metal (reference)". Emulated paths get none: they are no kernel.

    Returns:
        ``{projection: [(T, kernel, op), ...]}`` (T >= 2) and a description
        such as "Metal (reference), M3 Max, mlx 0.32.4".
    """
    from ..dispatch import thresholds

    target, version, chip, origin = reference_backend(env, chip)
    if chip is None:
        return {}, origin
    df = normalize(df)
    proj = df[~is_op(df) & ~df["emulated"]]
    out: dict[str, list[tuple[int, str, str]]] = {}
    for name, s in proj.groupby("projection", sort=False):
        k, n, max_t = int(s["K"].iloc[0]), int(s["N"].iloc[0]), int(s["T"].max())
        marks: set[tuple[int, str, str]] = set()
        for _, row in s.drop_duplicates(["path"]).iterrows():
            if row["quant"]:
                mode, bits, group = QUANT_RE.match(row["quant"]).groups()
                op, shape = "quantized_matmul", {"mode": mode, "bits": int(bits), "group_size": int(group)}
            else:
                op, shape = "matmul", {"dtype": row["dtype"]}
            found = thresholds(target, version, op, chip=chip, max_t=max_t, K=k, N=n, **shape)
            marks |= {(th.T, th.label, op) for th in found if th.T > 1}
        out[name] = sorted(marks)
    return out, origin


def reference_backend(env: Mapping[str, Any], chip: Any = None) -> tuple[str, str, Any, str]:
    """(backend whose dispatch rules apply, mlx version, :class:`~gemmdrift.dispatch.Chip` or None, description).

    Metal and CUDA results use their own chip, read from the record's
    architecture (and macOS version, for NAX) by ``dispatch.chip_from_env``; an
    architecture it cannot read gives chip None ("no prediction"), never a
    default chip. CPU results (which never switch kernels on Linux x86) get
    Metal's rules for the reference chip, labelled "Metal (reference)", and say
    when the CPU is not the platform whose rule was read. ``chip`` (a name or
    Chip) overrides the record.
    """
    from ..dispatch import CPU_LINUX_X86, DEFAULT_CHIP, Chip, chip_from_env, chip_named

    backend = env.get("backend") or "cpu"
    version = env.get("mlx") or "0"
    names = {"metal": "Metal", "cuda": "CUDA", "cpu": "CPU"}
    if chip is not None:
        c = chip if isinstance(chip, Chip) else chip_named(chip)
        return c.backend, version, c, f"{names[c.backend]}, {c.name}, mlx {version}"
    if backend in ("metal", "cuda"):
        c = chip_from_env(env)
        if c is None:
            return backend, version, None, (f"{names[backend]}, unknown architecture {env.get('architecture')!r}: "
                                            f"no prediction, mlx {version}")
        return backend, version, c, f"{names[backend]}, {c.name}" + (f" ({c.note})" if c.note else "") + \
            f", mlx {version}"
    if backend != "cpu":
        return backend, version, None, f"backend {backend!r}: no prediction, mlx {version}"
    cpu = chip_from_env(env)
    ref = chip_named(DEFAULT_CHIP["metal"])
    caveat = "" if cpu is not None and cpu.name == CPU_LINUX_X86 else \
        f"; this CPU ({cpu.note if cpu else 'platform not recorded'}) is not known to be row-invariant"
    return "metal", version, ref, f"Metal (reference), {ref.name}, mlx {version}{caveat}"


def ops_thresholds(df: pd.DataFrame, env: Mapping[str, Any],
                   chip: Any = None) -> tuple[dict[str, list[tuple[int, str, str]]], str]:
    """Like :func:`plot_thresholds`, for the ops table: where the sdpa kernel changes with the query length.

    One set of switches per attention geometry (head dim, heads, KV heads) and
    key length in the table; only sdpa has a dispatch that depends on T.
    """
    from ..dispatch import thresholds

    target, version, chip, origin = reference_backend(env, chip)
    if chip is None:
        return {}, origin
    ops = df[is_op(df)]
    sdpa = ops[ops["projection"] == "sdpa"] if "heads" in ops.columns else ops.iloc[:0]
    marks: set[tuple[int, str, str]] = set()
    for (d, h, hkv, k_len), s in sdpa.groupby(["K", "heads", "kv_heads", "key_length"]):
        found = thresholds(target, version, "sdpa", chip=chip, max_t=int(s["T"].max()), k_len=int(k_len),
                           head_dim=int(d), n_heads=int(h), n_kv_heads=int(hkv))
        marks |= {(th.T, th.label, "sdpa") for th in found if th.T > 1}
    return ({"sdpa": sorted(marks)} if marks else {}), origin


# ------------------------------------------------------------------ T values not measured

SKIPPED_COLUMNS = ["layer", "projection", "path", "K", "N", "T"]


def skipped_table(df: pd.DataFrame, ts) -> pd.DataFrame:
    """The requested block sizes a projection and path did not measure (over the FLOP budget or max_t):
    one row per (layer, projection, path, T); empty when every unit measured every T."""
    df = normalize(df) if len(df) else df
    proj = df[~is_op(df)] if len(df) else df
    want = sorted({int(t) for t in ts})
    rows = []
    for (layer, name, path), s in proj.groupby(["layer", "projection", "path"], sort=False):
        have = set(s["T"].astype(int))
        rows += [{"layer": int(layer), "projection": name, "path": path, "K": int(s["K"].iloc[0]),
                  "N": int(s["N"].iloc[0]), "T": t} for t in want if t not in have]
    return pd.DataFrame(rows, columns=SKIPPED_COLUMNS)


def describe_skipped(skipped: pd.DataFrame | None) -> str | None:
    """One sentence naming the T values not measured per projection (and the paths, when not all of them)."""
    if skipped is None or not len(skipped):
        return None
    paths = sorted(set(skipped["path"]))
    parts = []
    for name, s in skipped.groupby("projection", sort=False):
        by_ts: dict[tuple[int, ...], set[str]] = {}
        for path, g in s.groupby("path", sort=False):
            by_ts.setdefault(tuple(sorted(set(g["T"].astype(int)))), set()).add(path)
        for ts, ps in by_ts.items():
            where = "" if ps == set(paths) else f" ({', '.join(sorted(ps))})"
            parts.append(f"{name} T={','.join(map(str, ts))}{where}")
    return ("Not measured (over the FLOP budget per projection and path, or above max T): " + "; ".join(parts)
            + ".")


# ------------------------------------------------------------------ the Result


def kernel_figures(df: pd.DataFrame) -> dict[str, float]:
    """The tracked figures of a kernel table.

    Per path and T (the worst over the probed projections): ``bits_lost/<path>/<T>``
    (log2(1 + max ULP) between a row inside a T-row block and the same row alone),
    ``rows_differ/<path>/<T>`` (summed over projections) and ``err_rel_l2/<path>/<T>``
    (against float64). Per op: ``ops_bits_lost/<op>`` over every query and key length.
    """
    from ..result import figure_name

    df = normalize(df)
    out: dict[str, float] = {}
    proj = df[~is_op(df)]
    for (path, t), s in proj.groupby(["path", "T"]):
        m = {k: g["value"] for k, g in s.groupby("metric")}
        if "max_ulp" in m:
            out[figure_name("bits_lost", path, int(t))] = metrics.bits_lost(float(m["max_ulp"].max()))
        if "rows_differ" in m:
            out[figure_name("rows_differ", path, int(t))] = float(m["rows_differ"].sum())
        if "err_rel_l2" in m:
            out[figure_name("err_rel_l2", path, int(t))] = float(m["err_rel_l2"].max())
    ops = df[is_op(df)]
    for op, s in ops[ops["metric"] == "max_ulp"].groupby("projection"):
        out[figure_name("ops_bits_lost", op)] = metrics.bits_lost(float(s["value"].max()))
    return {k: v for k, v in out.items() if math.isfinite(v)}


def kernels_result(df: pd.DataFrame, inputs: Mapping[str, Any], env: Mapping[str, Any]):
    """The ``kernels`` Result of a table from :func:`sweep` (and :func:`ops_sweep`), as measured or read back."""
    from ..result import Result, env_labels, tidy

    df = normalize(df) if len(df) else pd.DataFrame(columns=TABLE_COLUMNS)
    model = inputs.get("model") or {}
    frame = tidy(df.rename(columns={"path": "pair", "projection": "tap", "key_length": "key_length"})
                 .assign(mode=df["path"].map(lambda p: "emulated" if str(p).startswith("emulated") else "real")
                         if len(df) else []),
                 **env_labels(env), model=model.get("source", "") if isinstance(model, dict) else str(model))
    tables = {"kernels": df}
    skipped = skipped_table(df, inputs["ts"]) if inputs.get("ts") else None
    if skipped is not None and len(skipped):
        tables["skipped"] = skipped  # the requested T values the FLOP budget or max T left out
    return Result(kind="kernels", inputs=dict(inputs), env=dict(env), frame=frame, figures=kernel_figures(df),
                  tables=tables)

__all__ = ["skipped_table", "describe_skipped", "SKIPPED_COLUMNS", "block_drift", "TABLE_COLUMNS", "OP_NAMES", "worst_over_t", "is_op", "normalize", "plot_thresholds", "ops_thresholds", "kernel_figures", "kernels_result"]
