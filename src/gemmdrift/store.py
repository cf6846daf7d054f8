"""Writing and reading any Result: the one door results leave the library by.

A Result directory holds::

    meta.json      {"format", "kind", "env", "inputs"}
    result.csv     the tidy frame (gemmdrift.result.TIDY_COLUMNS first)
    figures.json   the tracked figures {name: value}
    details.json   JSON-able extras (when there are any)
    <table>.csv    the kind's own tables (stack.csv, positions.csv, ...)
    <doc>.json     the kind's own documents (DOCUMENTS[kind]: diverge.json, stream_a.json, triage.json,
                   streams/*.json, ...)
    summary.json   gemmdrift.view.summaries.summary(result)
    *.png          gemmdrift.view.plots.draw(result)
    result.json    {"format", "kind", "files"}: written last, it marks the directory complete

Every file is written atomically (:mod:`gemmdrift.files`).

Directories written before the Result record (no ``result.json``) still load:
:func:`read_result` falls back to :mod:`gemmdrift.legacy`, which knows each
kind by the files its command wrote (``stack.csv``, ``kernels.csv``, ...).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pandas as pd

from . import files
from .checks import check_out_dir  # noqa: F401  (store.check_out_dir: checks run before pandas loads)
from .errors import GemmdriftError
from .result import FORMAT, Result, tidy

MARKER = "result.json"

# Per kind: Result -> {"file.json": JSON-able object}, documents written beside the tables (the files
# older tools and other commands read, e.g. `gemmdrift triage --stream-a stream_a.json`).
DOCUMENTS: dict[str, Callable[[Result], dict[str, Any]]] = {}
RESERVED = ("result.json", "meta.json", "summary.json", "figures.json", "details.json")


def write_result(result: Result, out: str | Path, *, draw: bool = True) -> dict[str, Path]:
    """Write ``result`` to the directory ``out``; returns the paths written, by role.

    A write that fails (a full disk, a directory gone read-only since the check) loses nothing: the
    Result goes to a fresh temporary directory instead, and the one-line error says where.
    """
    try:
        return _write_result(result, out, draw)
    except OSError as e:
        import tempfile

        try:
            spare = tempfile.mkdtemp(prefix=f"gemmdrift-{result.kind}-")
            _write_result(result, spare, False)
        except OSError:
            raise GemmdriftError(f"cannot write the result to {out} ({e}), nor to a temporary directory") from None
        raise GemmdriftError(f"cannot write the result to {out} ({e.strerror or e}): it was saved to {spare}/ "
                             "instead") from None


def _write_result(result: Result, out: str | Path, draw: bool) -> dict[str, Path]:
    from .view import summaries

    out = Path(out)
    written: dict[str, Path] = {}
    # meta.json first: a directory interrupted while writing still says what it holds.
    written["meta"] = files.write_json(out / "meta.json", {"format": FORMAT, "kind": result.kind,
                                                           "env": dict(result.env), "inputs": dict(result.inputs)})
    for name, table in result.tables.items():
        written[name] = files.write_csv(out / f"{name}.csv", table)
    written["frame"] = files.write_csv(out / "result.csv", result.frame)
    written["figures"] = files.write_json(out / "figures.json", dict(result.figures))
    if result.details:
        written["details"] = files.write_json(out / "details.json", dict(result.details))
    for name, doc in DOCUMENTS.get(result.kind, lambda r: {})(result).items():
        if name in RESERVED or not name.endswith(".json"):
            raise GemmdriftError(f"{result.kind}: bad document name {name!r}")
        written[f"doc_{Path(name).stem}"] = files.write_json(out / name, doc)
    written["summary"] = files.write_json(out / "summary.json", summaries.summary(result))

    def mark():
        return files.write_json(out / MARKER, {"format": FORMAT, "kind": result.kind,
                                               "files": sorted(p.name for p in written.values())})

    # The marker before the figures: the Result is whole without them, and a figure that fails (or a Ctrl-C
    # while drawing) loses nothing measured; written again with the figures' names once they are saved.
    written["marker"] = mark()
    if draw:
        figures = _draw_figures(result, out)
        if figures:
            written.update(figures)
            written["marker"] = mark()
    if not result.inputs.get("partial"):  # the whole Result now holds what the per-unit checkpoints did
        from .checkpoint import Checkpoints

        Checkpoints(out, result.kind, None).clear()
    return written


def _draw_figures(result: Result, out: Path) -> dict[str, Path]:
    """The Result's figures saved in ``out``; one that cannot be drawn is one warning line on stderr, never the
    end of the write (the tables, the figures' data, are already written: `gemmdrift report` redraws)."""
    import sys

    from .view import plots

    def warn(name, e):
        print(f"gemmdrift: warning: {result.kind}: figure {name} not drawn ({type(e).__name__}: "
              f"{str(e).splitlines()[0] if str(e) else ''}); the result is complete without it", file=sys.stderr)

    saved: dict[str, Path] = {}
    try:
        figs = plots.draw(result)
        names = list(figs)
    except Exception as e:  # noqa: BLE001  (matplotlib raises ValueError, RuntimeError, ...)
        warn("(all)", e)
        return saved
    for name in names:
        try:
            saved[f"fig_{Path(name).stem}"] = files.save_figure(out / name, figs[name])
        except OSError:
            raise  # a full disk or a read-only directory: write_result's spare directory
        except Exception as e:  # noqa: BLE001
            import matplotlib.pyplot as plt

            plt.close("all")
            warn(name, e)
    return saved


def _read_json(path: Path) -> Any:
    return files.read_object(path)


read_object = files.read_object


# Text columns whose values can look like numbers: a tree digest such as '8041e123...' reads back as inf.
TEXT_COLUMNS = {"fingerprints": ("fingerprint",)}


def _read_csv(path: Path) -> pd.DataFrame:
    try:
        text = TEXT_COLUMNS.get(path.stem, ())
        if text:
            head = pd.read_csv(path, nrows=0).columns
            return pd.read_csv(path, converters={c: str for c in text if c in head})
        return pd.read_csv(path)
    except pd.errors.EmptyDataError:
        return pd.DataFrame()  # an empty table is written as an empty file
    except FileNotFoundError:  # named by result.json but not there: missing, not corrupt
        raise GemmdriftError(f"{path} is missing (result.json names it): rerun the command that wrote it") from None
    except (OSError, ValueError, pd.errors.ParserError) as e:
        raise GemmdriftError(f"{path} is corrupt (unreadable table, {e.__class__.__name__}): rerun the command "
                             "that wrote it") from None


def is_result_dir(d: str | Path) -> bool:
    return (Path(d) / MARKER).is_file()


def result_kind(d: str | Path) -> str | None:
    """What a results directory holds: the kind in its marker, or (older layout) the kind its files say."""
    from . import legacy

    d = Path(d)
    if (d / MARKER).is_file():
        mark = _read_json(d / MARKER)
        return mark.get("kind") if isinstance(mark, dict) else None
    return legacy.kind_of(d)


def read_result(d: str | Path) -> Result:
    """The Result written to ``d`` by :func:`write_result`, or by an older gemmdrift (see :mod:`legacy`)."""
    from . import legacy

    d = Path(d)
    marker = d / MARKER
    if not marker.is_file():
        if legacy.kind_of(d) is not None:
            return legacy.read(d)
        raise GemmdriftError(f"{d}: not a gemmdrift result directory (no {MARKER})")
    mark = read_object(marker, need=("format", "kind"))
    if mark.get("format") != FORMAT or not isinstance(mark.get("kind"), str):
        raise GemmdriftError(f"{marker}: not a format-{FORMAT} result marker")
    meta = read_object(d / "meta.json", need=("kind", "env", "inputs"))
    if meta.get("kind") != mark["kind"]:
        raise GemmdriftError(f"{d / 'meta.json'} is corrupt (it does not describe a {mark['kind']} result)")
    figures = read_object(d / "figures.json")
    details = read_object(d / "details.json") if (d / "details.json").is_file() else {}
    reserved = {"result.csv"}
    tables = {Path(n).stem: _read_csv(d / n) for n in mark.get("files", [])
              if n.endswith(".csv") and n not in reserved}
    result = Result(kind=mark["kind"], inputs=meta.get("inputs") or {}, env=meta.get("env") or {},
                    frame=tidy(_read_csv(d / "result.csv")), figures=figures, tables=tables, details=details)
    legacy.check_summary(d, result)
    return result


# ---- diverge: stream_a.json / stream_b.json (inputs of `gemmdrift triage`) and diverge.json


def _diverge_documents(result: Result) -> dict[str, Any]:
    prompt = [int(t) for t in result.inputs.get("tokens", [])]
    r = dict(result.details)
    docs = {f"{key}.json": {"prompt": prompt, **r[key]} for key in ("stream_a", "stream_b")}
    docs["diverge.json"] = r
    return docs


DOCUMENTS["diverge"] = _diverge_documents

# ---- triage: triage.json

DOCUMENTS["triage"] = lambda r: {"triage.json": {"env": dict(r.env), "triage": dict(r.details["triage"])}}


# ---- batch and server: streams/<case>_a.json / _b.json for every compared pair (inputs of `gemmdrift triage`)


def _stream_documents(result: Result) -> dict[str, Any]:
    from .measure.server import stream_files

    return {f"streams/{name}": obj for name, obj in stream_files(result).items()}


DOCUMENTS["batch"] = DOCUMENTS["server"] = _stream_documents
