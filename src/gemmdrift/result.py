"""The one record every measurement returns.

The flow through the package is one way::

    measure (stack, kernels, diverge, state, fingerprint, ...)  ->  Result
    Result  ->  store (write / read)  ->  summaries (dict, text)  ->  plots  ->  report page
    Result  ->  asv track_ benchmarks (``result.figure(name)``)

A :class:`Result` is frozen and validated when it is made. It carries:

* ``kind``: what was measured ("stack", "kernels", "state", ...);
* ``inputs``: the exact inputs (model description, tokens, sizes, ...), JSON-able;
* ``env``: the environment record (:func:`gemmdrift.machine.envinfo.environment`);
* ``frame``: one long tidy frame with the same columns for every kind
  (:data:`TIDY_COLUMNS`, plus any extra label columns a kind needs);
* ``figures``: the named figures that are tracked (asv ``track_`` benchmarks
  and ``gemmdrift history`` read these), finite floats only: a figure that was
  not measured is absent, never 0 or NaN;
* ``tables``: the kind's own wide tables, written as ``<name>.csv`` (the
  layout results on disk already have, e.g. ``stack.csv``, ``positions.csv``);
* ``details``: JSON-able extras that are not numbers in a table (streams,
  a triage record, a decoded text).

Measurement functions return a Result and write nothing and draw nothing;
:mod:`gemmdrift.store` writes and reads them.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Iterable, Mapping

import pandas as pd

from .errors import GemmdriftError

FORMAT = 1  # the on-disk format of a Result directory (see gemmdrift.store); bump on incompatible change

# The columns every kind's tidy frame has, in this order. Labels that do not
# apply to a kind are empty ("" for text, NaN for numbers), never invented.
TIDY_COLUMNS = ("backend", "mlx", "model", "dtype", "pair", "mode", "tap", "layer", "T", "key_length", "metric",
                "value")
_TEXT_COLUMNS = ("backend", "mlx", "model", "dtype", "pair", "mode", "tap", "metric")
_NUMBER_COLUMNS = ("layer", "T", "key_length", "value")

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_TABLE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class Verdict(str, enum.Enum):
    """Every verdict the library gives, with the exact strings results on disk already use.

    A ``str`` enum: ``Verdict.NEAR_TIE == "NEAR-TIE"``, and it serialises as its value.
    """

    # Two streams (triage)
    IDENTICAL = "IDENTICAL"  # the streams agree and each is what its own schedule computes
    NEAR_TIE = "NEAR-TIE"  # they part where the top two logits are within the envelope: numeric
    OUTSIDE = "OUTSIDE ENVELOPE"  # they part (or a stream is wrong) by more than the envelope: suspect state
    # Precision ladder (the same pair at a higher precision)
    ROUNDING = "rounding"  # shrinks by orders of magnitude: rounding
    SEMANTIC = "semantic"  # does not shrink: the computations differ
    UNCLEAR = "unclear"  # shrinks, but less than rounding would
    NO_DRIFT = "identical"  # no drift at either precision (the ladder's pair is bit-identical)
    UNRELIABLE = "unreliable"  # the higher rung could not be made true float32 (e.g. TF32 matmuls)
    # Cache state operations (gemmdrift state)
    EXACT = "EXACT"  # bit-identical to the computation that never did the operation
    STATE_BUG = "STATE BUG"  # outside the envelope, or refused and carried on
    NOT_APPLICABLE = "not applicable"  # the model has no cache the operation applies to
    NOT_CHECKED = "not checked"  # a cache class this gemmdrift does not know
    REFUSED = "refused"  # a plug-in cache under test raised, or broke the cache protocol, in this case

    def __str__(self) -> str:  # f"{verdict}" gives the value, as files and tables show it
        return self.value


def _finite_float(name: str, value: Any) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise GemmdriftError(f"figure {name!r}: not a number ({value!r})") from None
    if not math.isfinite(v):
        raise GemmdriftError(f"figure {name!r} is {v}: a figure that was not measured is left out, never NaN")
    return v


def tidy(rows: Iterable[Mapping[str, Any]] | pd.DataFrame, **labels: Any) -> pd.DataFrame:
    """A tidy frame with :data:`TIDY_COLUMNS` first, from rows (dicts) or a frame.

    Args:
        rows: one dict (or frame row) per measurement, with at least ``metric`` and ``value``.
        **labels: values for columns the rows do not set (e.g. ``backend=``, ``mlx=``, ``model=``).
    """
    df = rows.copy() if isinstance(rows, pd.DataFrame) else pd.DataFrame(list(rows))
    for col, val in labels.items():
        if col not in df.columns:
            df[col] = val
        else:
            df[col] = df[col].where(df[col].notna(), val)
    for col in TIDY_COLUMNS:
        if col not in df.columns:
            df[col] = "" if col in _TEXT_COLUMNS else math.nan
    for col in _TEXT_COLUMNS:
        df[col] = df[col].astype(object).where(df[col].notna(), "").astype(str)
    for col in _NUMBER_COLUMNS:
        df[col] = pd.to_numeric(df[col], errors="coerce").astype(float)
    extra = [c for c in df.columns if c not in TIDY_COLUMNS]
    return df[list(TIDY_COLUMNS) + extra].reset_index(drop=True)


def figure_name(*parts: Any) -> str:
    """The name of a tracked figure from its parts: ``figure_name("rel_l2", pair, "local", "layer 3")``
    gives ``"rel_l2/<pair>/local/layer 3"``. One scheme for every kind, so benchmarks and history
    build the same names the measurement did."""
    out = []
    for p in parts:
        text = str(int(p)) if isinstance(p, (int, float)) and not isinstance(p, bool) and float(p).is_integer() else str(p)
        if not text or "/" in text:
            raise GemmdriftError(f"figure name part {p!r}: empty or contains '/'")
        out.append(text)
    return "/".join(out)


def env_labels(env: Mapping[str, Any]) -> dict[str, str]:
    """The tidy labels an environment record gives: backend and mlx version."""
    return {"backend": str(env.get("backend") or ""), "mlx": str(env.get("mlx") or "")}


@dataclass(frozen=True)
class Result:
    """One measurement: what it was, on what, where, and its numbers. See the module docstring."""

    kind: str
    inputs: Mapping[str, Any]
    env: Mapping[str, Any]
    frame: pd.DataFrame
    figures: Mapping[str, float] = field(default_factory=dict)
    tables: Mapping[str, pd.DataFrame] = field(default_factory=dict)
    details: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or not _NAME.match(self.kind):
            raise GemmdriftError(f"result kind must be a lower-case name, got {self.kind!r}")
        if not isinstance(self.frame, pd.DataFrame):
            raise GemmdriftError(f"{self.kind}: the frame must be a pandas DataFrame")
        missing = [c for c in TIDY_COLUMNS if c not in self.frame.columns]
        if missing:
            raise GemmdriftError(f"{self.kind}: the tidy frame lacks columns {missing} (build it with result.tidy)")
        for name, table in self.tables.items():
            if not _TABLE.match(name) or name in ("result", "meta", "summary", "figures", "details"):
                raise GemmdriftError(f"{self.kind}: bad table name {name!r}")
            if not isinstance(table, pd.DataFrame):
                raise GemmdriftError(f"{self.kind}: table {name!r} is not a DataFrame")
        figures = {}
        for name, value in self.figures.items():
            if not isinstance(name, str) or not name:
                raise GemmdriftError(f"{self.kind}: figure names are non-empty strings, got {name!r}")
            figures[name] = _finite_float(name, value)
        # Read-only views: a Result is a record, not a workspace.
        object.__setattr__(self, "figures", MappingProxyType(figures))
        object.__setattr__(self, "tables", MappingProxyType(dict(self.tables)))
        object.__setattr__(self, "inputs", MappingProxyType(dict(self.inputs)))
        object.__setattr__(self, "env", MappingProxyType(dict(self.env)))
        object.__setattr__(self, "details", MappingProxyType(dict(self.details)))

    def __reduce__(self):  # picklable (asv's setup_cache pickles what it returns); read-only views are not
        return (Result, (self.kind, dict(self.inputs), dict(self.env), self.frame, dict(self.figures),
                         dict(self.tables), dict(self.details)))

    def figure_or_nan(self, name: str) -> float:
        """A tracked figure, or NaN when this result did not measure it (asv records NaN as skipped)."""
        return self.figures.get(name, math.nan)

    def figure(self, name: str) -> float:
        """A tracked figure by name; a clear error when this result did not measure it."""
        try:
            return self.figures[name]
        except KeyError:
            known = ", ".join(sorted(self.figures)[:8])
            raise KeyError(f"{self.kind} result has no figure {name!r} (it has: {known}"
                           f"{', ...' if len(self.figures) > 8 else ''})") from None

    def select(self, **labels: Any) -> pd.DataFrame:
        """Rows of the tidy frame whose columns equal the given values (``metric="rel_l2", tap="logits"``)."""
        df = self.frame
        for col, val in labels.items():
            if col not in df.columns:
                raise KeyError(f"{self.kind} result has no column {col!r}")
            df = df[df[col] == val]
        return df
