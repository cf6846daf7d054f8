"""Calibration of the replay: which variant of each open axis a real chip computes, measured once by
``gemmdrift replay check --device gpu`` on it, kept in a small file, and used by every replay of that chip.

A calibration file (JSON, ``format: gemmdrift-calibration``, version 1) holds the device as it reported
itself (chip name, architecture string, generation, size class, macOS, mlx version) and, per kernel and
open axis, how many checked cells (projection, path, T) each value of the axis was bit-identical in. No
prompt, path or user data is written. An axis is *measured* when exactly one of its values was identical in
every cell the kernel was checked in; the file's ``variant`` is those measured values, merged over kernels
(a disagreement between kernels of one file leaves the axis unmeasured, and says so). With the check's order
rows (:mod:`.orderrows`), an axis also records ``order_rows`` (the values identical on them and the one they
decide), and a value they decide among those the captured cells left identical is measured ("decided by the
order rows"); a kernel only the order rows reached is measured by them alone.

:func:`resolve` is what the commands call (``replay check --calibration``, ``--kernels replay:<chip>``, the
main job's prediction): the files given, plus every file in the shipped registry (:data:`REGISTRY`, empty
in a release; a user's own file goes there or is given with ``--calibration``) that is for the same chip
(architecture) and mlx release as the replay. Several files that disagree on an axis: refused, naming them.
A file that is corrupt, from another chip or release than it is applied to, or that names a variant no
recipe has: one line naming the file and what is wrong.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from ..errors import GemmdriftError

FORMAT = "gemmdrift-calibration"
VERSION = 1
REGISTRY = Path(__file__).resolve().parent.parent / "data" / "calibrations"
FILENAME = "calibration.json"
_DEVICE_KEYS = ("chip", "architecture", "generation", "size_class", "macos", "mlx")


@dataclass(frozen=True)
class Calibration:
    """One file: the device it was measured on, per-kernel counts, and the measured variant."""

    path: str
    device: Mapping[str, Any]
    kernels: Mapping[str, Any]
    variant: Mapping[str, str] = field(default_factory=dict)

    @property
    def architecture(self) -> str:
        return str(self.device.get("architecture") or "")

    @property
    def mlx(self) -> str:
        return str(self.device.get("mlx") or "")

    def fits(self, chip: Any) -> bool:
        """Measured on ``chip``: the same architecture name, and the same device when either is not an Apple chip
        model (a paravirtual GPU run under MLX_METAL_GPU_ARCH=applegpu_g13g never calibrates a real M1)."""
        return (self.architecture == getattr(chip, "arch", "")
                and str(self.device.get("device") or "") == str(getattr(chip, "device", "") or ""))


def build(result) -> dict[str, Any]:
    """The calibration record of a ``replay_check`` Result run on the device itself (``variants="all"``).

    Raises a one-line GemmdriftError when the result cannot calibrate: a prediction (another chip's recipes),
    a device that is not a chip, one variant only, or no GPU kernel checked.
    """
    from ..dispatch import chip_from_env, not_a_chip

    env, inp = result.env, result.inputs
    chip = chip_from_env(env, inp.get("mlx_version"))
    if chip is None:
        raise GemmdriftError("no calibration written: " + (not_a_chip(env, inp.get("mlx_version")) or "this device is not a chip"))
    if inp.get("prediction"):
        raise GemmdriftError("no calibration written: the check replayed another chip's recipes (a prediction)")
    if inp.get("variants") != "all":
        raise GemmdriftError("no calibration written: it needs every variant checked (--variant all)")
    if chip.backend == "cpu":
        raise GemmdriftError("no calibration written: this machine's CPU recipes have no open axis to calibrate")
    from . import RECIPES

    table = result.tables["replay_check"]
    order: dict[str, dict[str, list[dict]]] = {}  # kernel -> axis -> the order rows' records
    for r in result.details.get("order_records") or []:
        order.setdefault(r["kernel"], {}).setdefault(r["axis"], []).append(r)
    kernels: dict[str, Any] = {}
    checked = table[table["kernel"] != ""] if len(table) else table
    groups = dict(list(checked.groupby("kernel", sort=True))) if len(checked) else {}
    for kernel in sorted(set(groups) | set(order)):
        g = groups.get(kernel, checked.iloc[:0])
        # Open axes only: a one-value axis (qmm_t's dequant at a release) was fixed by the source, not measured.
        axes = {a: v for a, v in (RECIPES[kernel].axes if kernel in RECIPES else {}).items() if len(v) > 1}
        cells = g.groupby(["layer", "projection", "path", "T"], sort=True) if len(g) else []
        rec: dict[str, Any] = {"cells": int(cells.ngroups) if len(g) else 0, "variants": {}, "axes": {}}
        for variant, vg in (g.groupby("variant", sort=True) if len(g) else []):
            rec["variants"][variant] = int(vg["identical"].astype(bool).sum())
        for axis, values in axes.items():
            counts = {v: 0 for v in values}
            for _, cell in cells:
                same = [_split(v) for v in cell.loc[cell["identical"].astype(bool), "variant"]]
                for v in values:
                    counts[v] += int(any(s.get(axis) == v for s in same))
            full = [v for v, n in counts.items() if n == rec["cells"]] if rec["cells"] else []
            a = {"identical_cells": counts, "measured": full[0] if len(full) == 1 else None,
                 "why": "" if len(full) == 1 else ("every value identical: the data cannot tell them apart"
                                                    if len(full) > 1 else "no value identical in every cell"
                                                    if rec["cells"] else "no captured cell")}
            if axis in order.get(kernel, {}):
                a.update(_with_order_rows(values, full, rec["cells"], order[kernel][axis]))
            rec["axes"][axis] = a
        kernels[kernel] = rec
    if not any(k in RECIPES and (RECIPES[k].apple or RECIPES[k].axes) for k in kernels):
        raise GemmdriftError("no calibration written: no GPU recipe was checked")
    variant, notes = _merge({k: {a: r["measured"] for a, r in rec["axes"].items()} for k, rec in kernels.items()})
    device = {"chip": chip.name, "architecture": chip.arch, "generation": chip.gen, "size_class": chip.size,
              "macos": env.get("macos"), "mlx": inp.get("mlx_version") or env.get("mlx")}
    if chip.device:  # not an Apple chip model (a paravirtual GPU, a name set by MLX_METAL_GPU_ARCH): said
        device.update(device=chip.device, reading=chip.note)
    return {"format": FORMAT, "version": VERSION, "device": device, "kernels": kernels, "variant": variant,
            "notes": notes, "dtypes": sorted({str(d) for d in (table["dtype"] if "dtype" in table else [])}
                                               | {str(r["dtype"]) for r in result.details.get("order_records") or []}),
            "paths": list(inp.get("paths", [])), "ts": list(inp.get("ts", []))}


def _with_order_rows(values, full: list[str], cells: int, recs: list[dict]) -> dict[str, Any]:
    """An axis measured with the order rows: the values identical on every order case, intersected with the
    captured rows' (when there were captured cells); ``order_rows`` records what the order rows alone found."""
    ordered = [v for v in values if all(v in r["values"] for r in recs)]
    info = {"cases": len(recs), "identical": ordered, "decided": ordered[0] if len(ordered) == 1 else None}
    both = [v for v in ordered if v in full] if cells else ordered
    if len(both) == 1:
        why = "" if len(full) == 1 else ("decided by the order rows (captured rows: "
                                         + (f"{len(full)} values identical)" if cells else "none)"))
        return {"measured": both[0], "why": why, "order_rows": info}
    why = ("the order rows cannot tell them apart" if len(both) > 1 else
           "no value identical on the order rows" if not ordered else
           "the order rows and the captured rows find different values identical")
    return {"measured": None, "why": why, "order_rows": info}


def _split(text: str) -> dict[str, str]:
    return dict(p.split("=", 1) for p in str(text).split(",") if "=" in p)


def _merge(per_kernel: Mapping[str, Mapping[str, str | None]]) -> tuple[dict[str, str], list[str]]:
    """Per axis, the one value every kernel that measured it found; an axis two kernels disagree on is left out."""
    found: dict[str, dict[str, list[str]]] = {}
    for kernel, axes in per_kernel.items():
        for axis, value in axes.items():
            if value is not None:
                found.setdefault(axis, {}).setdefault(value, []).append(kernel)
    variant, notes = {}, []
    for axis, values in sorted(found.items()):
        if len(values) == 1:
            variant[axis] = next(iter(values))
        else:
            notes.append(f"{axis}: kernels disagree (" + "; ".join(f"{v} by {', '.join(k)}" for v, k in
                                                                    sorted(values.items())) + "): not measured")
    return variant, notes


def write(result, out_dir: str | Path) -> tuple[Path, dict[str, Any]]:
    """Build and write ``<out_dir>/calibration.json`` (atomic); the path and the record."""
    from .. import files

    record = build(result)
    return files.write_json(Path(out_dir) / FILENAME, record), record


def load(path: str | Path) -> Calibration:
    """A calibration file, validated: one-line errors naming the file."""
    from . import RECIPES

    p = Path(path)
    where = f"calibration {p}"
    try:
        obj = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise GemmdriftError(f"{where}: no such file") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise GemmdriftError(f"{where}: not a readable JSON file ({str(e)[:80]})") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT:
        raise GemmdriftError(f"{where}: not a gemmdrift calibration file (no \"format\": \"{FORMAT}\")")
    if obj.get("version") != VERSION:
        raise GemmdriftError(f"{where}: calibration format version {obj.get('version')!r}, this release reads "
                             f"{VERSION}")
    device, kernels, variant = obj.get("device"), obj.get("kernels"), obj.get("variant")
    lacks = [k for k in _DEVICE_KEYS if not isinstance(device, dict) or k not in device]
    if lacks:
        raise GemmdriftError(f"{where}: its device record lacks {', '.join(lacks)}")
    if not isinstance(kernels, dict) or not isinstance(variant, dict):
        raise GemmdriftError(f"{where}: \"kernels\" and \"variant\" must be objects")
    known: dict[str, set[str]] = {}
    for r in RECIPES.values():
        for a, v in r.axes.items():
            known.setdefault(a, set()).update(v)
    for axis, value in variant.items():
        if axis not in known:
            raise GemmdriftError(f"{where}: unknown variant axis {axis!r} (known: {', '.join(sorted(known))})")
        if value not in known[axis]:
            raise GemmdriftError(f"{where}: unknown {axis} variant {value!r} (known: {', '.join(sorted(known[axis]))})")
    for kernel in kernels:
        if kernel not in RECIPES:
            raise GemmdriftError(f"{where}: unknown kernel {kernel!r} (recipes: {', '.join(RECIPES)})")
    return Calibration(str(p), dict(device), dict(kernels), {str(k): str(v) for k, v in variant.items()})


def registry_files(registry: str | Path | None = None) -> list[Path]:
    d = Path(registry) if registry is not None else REGISTRY
    return sorted(d.glob("*.json")) if d.is_dir() else []


@dataclass(frozen=True)
class Resolved:
    """The calibrated variant of one chip and release (empty when no file applies) and the files it came from."""

    variant: Mapping[str, str]
    files: tuple[str, ...]

    @property
    def text(self) -> str:
        return ",".join(f"{k}={v}" for k, v in sorted(self.variant.items()))

    @property
    def note(self) -> str:
        return f"calibrated by {', '.join(self.files)}" if self.files else ""


def resolve(chip: Any, mlx_version: str, files: Sequence[str | Path] = (), *,
            registry: str | Path | None | bool = None, others: str = "refuse") -> Resolved:
    """The measured variant for ``chip`` at ``mlx_version`` from ``files`` and the registry.

    A given file for another chip (architecture) or release, or files that disagree on an axis: one-line
    GemmdriftError. Registry files for other chips or releases are not for this replay and are skipped
    (``registry``: another directory, or False for none). ``others="skip"``: a given file for another chip is
    skipped too, as a registry file is (the main job replays several chips; :func:`check_run` checked the
    files before it started).
    """
    from ..dispatch import parse_version
    from .paths import parse_chip

    c = parse_chip(chip) if isinstance(chip, str) else chip
    want = parse_version(mlx_version)
    chosen: list[Calibration] = []
    for f in files:
        cal = load(f)
        if not cal.fits(c) and others == "skip":
            continue
        if not cal.fits(c):
            raise GemmdriftError(f"calibration {cal.path}: measured on {cal.device.get('chip')} ({cal.architecture}), "
                                 f"not {c.name}" + (f" ({c.arch})" if c.arch else ""))
        if _version(cal, f) != want:
            raise GemmdriftError(f"calibration {cal.path}: measured with mlx {cal.mlx}, this replays mlx {mlx_version}")
        chosen.append(cal)
    given = {str(Path(f).resolve()) for f in files}
    for f in ([] if registry is False else registry_files(registry)):  # type: ignore[arg-type]
        if str(f.resolve()) in given:
            continue
        cal = load(f)
        if cal.fits(c) and _version(cal, f) == want:
            chosen.append(cal)
    merged: dict[str, tuple[str, str]] = {}
    for cal in chosen:
        for axis, value in cal.variant.items():
            if axis in merged and merged[axis][0] != value:
                raise GemmdriftError(f"calibrations disagree on {axis} for {c.name} at mlx {mlx_version}: "
                                     f"{merged[axis][0]} in {merged[axis][1]}, {value} in {cal.path}; "
                                     "refusing to pick (remove one)")
            merged.setdefault(axis, (value, cal.path))
    return Resolved({a: v for a, (v, _) in merged.items()}, tuple(c_.path for c_ in chosen))


def _version(cal: Calibration, f) -> tuple[int, ...]:
    from ..dispatch import parse_version

    try:
        return parse_version(cal.mlx)
    except GemmdriftError:
        raise GemmdriftError(f"calibration {f}: its mlx version {cal.mlx!r} is not a release number") from None


def check_run(files: Sequence[str | Path], mlx_version: str) -> None:
    """The main job's files, before it starts: each readable, measured with the mlx the prediction replays, and
    the files (with the registry's) of each chip agreeing. A file for a chip the job does not replay is
    skipped there, as a registry file is."""
    from types import SimpleNamespace

    by_arch: dict[tuple[str, str], list[str]] = {}
    for f in files:
        cal = load(f)
        by_arch.setdefault((cal.architecture, str(cal.device.get("device") or "")), []).append(str(f))
    for (arch, device), fs in by_arch.items():
        resolve(SimpleNamespace(arch=arch, device=device, name=load(fs[0]).device.get("chip") or arch), mlx_version,
                fs)


def check_files(files: Iterable[str | Path]) -> list[str]:
    """Load every given file now (before any model loads): the one-line errors early."""
    out = []
    for f in files:
        load(f)
        out.append(str(f))
    return out


def summary(record: Mapping[str, Any]) -> str:
    """Lines for the terminal: the device and each kernel's axes."""
    d = record["device"]
    lines = [f"calibration: {d['chip']} ({d['architecture']}), macOS {d.get('macos') or '?'}, mlx {d['mlx']}"]
    for kernel, rec in record["kernels"].items():
        for axis, a in rec["axes"].items():
            counts = ", ".join(f"{v} {n}/{rec['cells']}" for v, n in a["identical_cells"].items())
            o = a.get("order_rows")
            orows = "" if not o else f"; order rows: {o['decided'] or ('|'.join(o['identical']) or 'none')}"
            lines.append(f"  {kernel:18s} {axis:9s} {a['measured'] or 'not measured'} ({counts}{orows})"
                         + (f": {a['why']}" if a["why"] else ""))
    lines += [f"  {n}" for n in record.get("notes", [])]
    lines.append(f"  variant: {','.join(f'{k}={v}' for k, v in record['variant'].items()) or '(none measured)'}")
    return "\n".join(lines)


__all__ = ["FORMAT", "VERSION", "REGISTRY", "FILENAME", "Calibration", "build", "write", "load", "registry_files",
           "Resolved", "resolve", "check_run", "check_files", "summary"]
