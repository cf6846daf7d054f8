"""Writing and reading any Result: the one door results leave the library by.

A Result directory holds::

    meta.json      {"format", "kind", "env", "inputs"}
    result.csv     the tidy frame (gemmdrift.result.TIDY_COLUMNS first)
    figures.json   the tracked figures {name: value}
    details.json   JSON-able extras (when there are any)
    <table>.csv    the kind's own tables (stack.csv, positions.csv, ...)
    summary.json   gemmdrift.summaries.summary(result)
    *.png          gemmdrift.plots.draw(result)
    result.json    {"format", "kind", "files"}: written last, it marks the directory complete

Every file is written atomically (:mod:`gemmdrift.files`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

from . import files
from .checks import check_out_dir  # noqa: F401  (store.check_out_dir: checks run before pandas loads)
from .errors import GemmdriftError
from .result import FORMAT, Result, tidy

MARKER = "result.json"


def write_result(result: Result, out: str | Path, *, draw: bool = True) -> dict[str, Path]:
    """Write ``result`` to the directory ``out``; returns the paths written, by role."""
    from . import summaries

    out = Path(out)
    written: dict[str, Path] = {}
    for name, table in result.tables.items():
        written[name] = files.write_csv(out / f"{name}.csv", table)
    written["frame"] = files.write_csv(out / "result.csv", result.frame)
    written["figures"] = files.write_json(out / "figures.json", dict(result.figures))
    if result.details:
        written["details"] = files.write_json(out / "details.json", dict(result.details))
    written["meta"] = files.write_json(out / "meta.json", {"format": FORMAT, "kind": result.kind,
                                                           "env": dict(result.env), "inputs": dict(result.inputs)})
    written["summary"] = files.write_json(out / "summary.json", summaries.summary(result))
    if draw:
        from . import plots

        for name, fig in plots.draw(result).items():
            written[f"fig_{Path(name).stem}"] = files.save_figure(out / name, fig)
    written["marker"] = files.write_json(out / MARKER, {"format": FORMAT, "kind": result.kind,
                                                        "files": sorted(p.name for p in written.values())})
    return written


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise GemmdriftError(f"{path}: unreadable ({e.__class__.__name__}: {e})") from None


def _read_csv(path: Path) -> pd.DataFrame:
    try:
        return pd.read_csv(path)
    except (OSError, ValueError, pd.errors.ParserError) as e:
        raise GemmdriftError(f"{path}: unreadable table ({e.__class__.__name__})") from None


def is_result_dir(d: str | Path) -> bool:
    return (Path(d) / MARKER).is_file()


def read_result(d: str | Path) -> Result:
    """The Result written to ``d`` by :func:`write_result`."""
    d = Path(d)
    marker = d / MARKER
    if not marker.is_file():
        raise GemmdriftError(f"{d}: not a gemmdrift result directory (no {MARKER})")
    mark = _read_json(marker)
    if not isinstance(mark, dict) or mark.get("format") != FORMAT or not isinstance(mark.get("kind"), str):
        raise GemmdriftError(f"{marker}: not a format-{FORMAT} result marker")
    meta = _read_json(d / "meta.json")
    if not isinstance(meta, dict) or meta.get("kind") != mark["kind"]:
        raise GemmdriftError(f"{d / 'meta.json'}: does not describe a {mark['kind']} result")
    figures = _read_json(d / "figures.json")
    if not isinstance(figures, dict):
        raise GemmdriftError(f"{d / 'figures.json'}: expected an object of figures")
    details = _read_json(d / "details.json") if (d / "details.json").is_file() else {}
    reserved = {"result.csv"}
    tables = {Path(n).stem: _read_csv(d / n) for n in mark.get("files", [])
              if n.endswith(".csv") and n not in reserved}
    return Result(kind=mark["kind"], inputs=meta.get("inputs") or {}, env=meta.get("env") or {},
                  frame=tidy(_read_csv(d / "result.csv")), figures=figures, tables=tables, details=details)
