"""Results directories written before the Result record (no ``result.json``): read as Results.

Each kind is known by the file its command wrote last (the same keys the
report used): ``stack.csv``, ``kernels.csv``, ``diverge.json``,
``divergence.csv``, ``triage.json``, ``history_wide.csv``. The tables are
read as they are; the tidy frame and the tracked figures are rebuilt from
them by the kind's own functions, so an old directory renders and tracks
exactly like a new one. A corrupt file is an error naming it, never a
silent "None".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd

from .errors import GemmdriftError
from .result import Result, tidy

# (file, kind), first match wins: the order the report always used.
KINDS = (("stack.csv", "stack"), ("kernels.csv", "kernels"), ("diverge.json", "diverge"),
         ("divergence.csv", "divergence"), ("triage.json", "triage"), ("history_wide.csv", "history"))


def kind_of(d: str | Path) -> str | None:
    """The kind of an older results directory, by the files its command wrote."""
    d = Path(d)
    for name, kind in KINDS:
        if (d / name).is_file():
            return kind
    return None


def _csv(path: Path, **kw) -> pd.DataFrame:
    if not path.is_file():
        return pd.DataFrame()
    try:
        return pd.read_csv(path, **kw)
    except pd.errors.EmptyDataError:
        return pd.DataFrame()
    except (OSError, ValueError, pd.errors.ParserError) as e:
        raise GemmdriftError(f"{path} is corrupt (unreadable table, {e.__class__.__name__}): rerun the command "
                             "that wrote it") from None


def _meta(d: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    from .files import read_object

    if not (d / "meta.json").is_file():
        raise GemmdriftError(f"{d / 'meta.json'}: missing (the command that wrote {d} did not finish)")
    meta = read_object(d / "meta.json", need=("inputs",))
    if not isinstance(meta["inputs"], dict):
        raise GemmdriftError(f"{d / 'meta.json'} is corrupt (its inputs are not an object)")
    return meta.get("env") or {}, meta["inputs"]


def _stack(d: Path) -> Result:
    from .measure.stack import stack_result

    env, inputs = _meta(d)
    tables = {"stack": _csv(d / "stack.csv"), "positions": _csv(d / "positions.csv"),
              "envelope": _csv(d / "envelope.csv")}
    if (d / "ladder.csv").is_file():
        tables["ladder"] = _csv(d / "ladder.csv")
    return stack_result(tables, inputs, env)


def _kernels(d: Path) -> Result:
    from .kernels import kernels_result

    env, inputs = _meta(d)
    df = _csv(d / "kernels.csv", dtype={"quant": str, "path": str, "projection": str})
    return kernels_result(df, inputs, env)


def _diverge(d: Path) -> Result:
    from .measure.diverge import diverge_result
    from .files import read_object

    env, inputs = _meta(d)
    r = read_object(d / "diverge.json", need=("n", "stream_a", "stream_b", "first_divergence"))
    return diverge_result(r, inputs, env)


def _divergence(d: Path) -> Result:
    from .measure.diverge import divergence_result

    env, inputs = _meta(d)
    return divergence_result(_csv(d / "divergence.csv"), inputs, env)


def _triage(d: Path) -> Result:
    from .measure.diverge import triage_result

    from .files import read_object

    rec = read_object(d / "triage.json", need=("triage",))
    if not isinstance(rec["triage"], dict):
        raise GemmdriftError(f"{d / 'triage.json'} is corrupt (its triage is not an object)")
    return triage_result(rec["triage"], rec.get("inputs") or {}, rec.get("env") or {})


def _history(d: Path) -> Result:
    wide = _csv(d / "history_wide.csv")
    return Result(kind="history", inputs={}, env={}, frame=tidy([]), tables={"history_wide": wide})


READERS = {"stack": _stack, "kernels": _kernels, "diverge": _diverge, "divergence": _divergence,
           "triage": _triage, "history": _history}


def check_summary(d: Path, result: Result) -> None:
    """A summary.json beside a result must be the summary of that result (at least its keys): a corrupt or
    truncated one means the directory was damaged, and is refused by name."""
    from .view import summaries
    from .files import read_object

    path = Path(d) / "summary.json"
    if path.is_file():
        read_object(path, need=tuple(summaries.summary(result)))


def read(d: str | Path) -> Result:
    """The Result in an older results directory (its summary.json, if any, checked against it)."""
    d = Path(d)
    kind = kind_of(d)
    if kind is None:
        raise GemmdriftError(f"{d}: no gemmdrift results")
    result = READERS[kind](d)
    check_summary(d, result)
    return result
