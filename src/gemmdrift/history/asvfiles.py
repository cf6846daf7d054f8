"""How the history's results are stored: asv's own results directories (``<machine>/machine.json``,
``<machine>/<commit>-<env>.json``, ``benchmarks.json``), written by :mod:`.releases` (the releases and the bridges)
and :mod:`.bisect.asv_json` (the commits); read by :mod:`gemmdrift.measure.history`.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..files import atomic_path

MACHINE = "reference-linux-cpu-tier"  # the machine of the history's tier results (benchmarks/reference/)


def write_machine(src: Path, dst: Path, machine: str) -> None:
    """asv's machine.json of the run into ``dst``, with what asv detects of this machine (cpu, cores, memory, os)
    where the run's file lacks it (asv machine --yes in a fresh clone writes the name alone)."""
    rec = json.loads(src.read_text()) if src.exists() else {}
    try:
        from asv.machine import Machine

        found = Machine.get_defaults()
    except Exception:  # noqa: BLE001  (the record is a label: without asv's detection, the run's file as it is)
        found = {}
    rec = {**{k: v for k, v in found.items() if k != "machine"}, **rec, "machine": machine, "version": 1}
    with atomic_path(dst) as tmp:
        tmp.write_text(json.dumps(rec, indent=4, sort_keys=True) + "\n")


def merge_benchmarks(src: Path, dst: Path) -> None:
    """asv's benchmarks.json of this run into ``dst``'s: new names added, the others kept (their units)."""
    new = json.loads(src.read_text())
    old = json.loads(dst.read_text()) if dst.exists() else {}
    with atomic_path(dst) as tmp:
        tmp.write_text(json.dumps({**old, **new}, indent=4, sort_keys=True) + "\n")
