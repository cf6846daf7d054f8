"""One class per pair of releases, as climate models label every change: BIT-FOR-BIT, ROUNDOFF, ANSWER-CHANGING.

:func:`classify` reads two mappings of figure name -> value (one per release; NaN = not measured) and says:

* **BIT-FOR-BIT**: every figure measured on both sides is identical (bit for bit: ``==``).
* **ROUNDOFF**: figures moved, the precision ladder says rounding, and no answer figure changed.
* **ANSWER-CHANGING**: an answer figure changed (:func:`is_answer_figure`: argmax flips, the divergence point,
  a divergence or cache-state verdict count, same top-1, the draft acceptance), or the ladder says semantics,
  or figures moved with no ladder verdict to call them rounding.

``ladder`` is the precision ladder's word on the pair (:func:`pair_ladder` reads it from the figures):
``"rounding"``, ``"semantics"`` or ``None``. **None means the ladder gives no verdict**: it was not measured
(no float32 rung in these results), or it found no drift to judge, or its verdict was unclear or unreliable
(TF32). Then moved figures are *not shown* to be roundoff, and the pair is ANSWER-CHANGING, the reason saying
why (conservative: ``upgrade --allow ROUNDOFF`` never lets an unproven change through). A caller whose figures
can only move by rounding by construction (the replay, which reorders the same adds) passes ``"rounding"``.

A figure measured on one side only is not compared: it cannot make a pair BIT-FOR-BIT by being absent, and it
does not decide the class either (a benchmark added between two gemmdrift commits is not an mlx change); it is
listed in :attr:`PairClass.one_sided` and counted in the reason. Timing and memory figures
(:func:`is_timing_figure`) are not numerics and are left out. Nothing measured on both sides raises.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable, Mapping

from ..errors import GemmdriftError

BIT_FOR_BIT, ROUNDOFF, ANSWER_CHANGING = "BIT-FOR-BIT", "ROUNDOFF", "ANSWER-CHANGING"
CLASSES = (BIT_FOR_BIT, ROUNDOFF, ANSWER_CHANGING)  # in order of severity
LADDERS = ("rounding", "semantics", None)

# The answer figures, by the stem of their name (asv's ``track_<stem>`` or a Result's figure name), with the
# words the reason uses. Order: the first kind found names the reason.
ANSWER_KINDS = (
    ("state verdicts", ("state_bugs", "non_exact")),
    ("argmax flips", ("flips", "same_top1")),
    ("the divergence point", ("first_divergence", "diverged", "divergences")),
    ("divergence verdicts", ("outside_envelope", "outside", "near_ties")),
    ("draft acceptance", ("acceptance",)),
)
# Not numerics: seconds, throughput, bytes (asv's time_/mem_/peakmem_ benchmarks and these track_ figures).
TIMING_STEMS = ("tokens_per_s", "speedup", "speed_ratio", "overhead", "ratio_to_numpy_matmul", "extra_bytes")
# The precision ladder's figures: the bf16 rung is the accumulated rel_l2 at the logits of decode vs verify,
# the float32 rung its float32 twin (bench_stack.DecodeVsVerify.track_logits_rel_l2_float32[pair]).
LADDER_HIGH = re.compile(r"DecodeVsVerify\.track_logits_rel_l2_float32\[(?P<pair>[^\]]+)\]$")
LADDER_LOW = "bench_stack.DecodeVsVerifyLayers.track_rel_l2[{pair}, accumulated, logits]"


def _stem_re(stems) -> re.Pattern:
    return re.compile(r"(^|[._/\[ ])(" + "|".join(re.escape(s) for s in stems) + r")($|[._/\[\], ])")


_ANSWER = [(words, [_stem_re([s]) for s in stems]) for words, stems in ANSWER_KINDS]
_TIMING = _stem_re(TIMING_STEMS)


def _metric(name: str) -> str:
    """The part of a figure name that names what it measures: asv's method after ``track_`` (the class and
    parameters dropped: a tap named ``layer 3`` or a cache named ``.../batch`` is not a stem), else the name."""
    head = name.partition("[")[0]
    if "track_" in head:
        return head.rpartition("track_")[2]
    return name


def _answer_rank(name: str) -> tuple[int, int] | None:
    """(kind, stem) indices of an answer figure in ANSWER_KINDS, or None: the first decides the reason."""
    m = _metric(name)
    for i, (_, patterns) in enumerate(_ANSWER):
        for j, pattern in enumerate(patterns):
            if pattern.search(m):
                return i, j
    return None


def answer_kind(name: str) -> str | None:
    """The words for the kind of answer figure ``name`` is ("argmax flips", ...), or None."""
    r = _answer_rank(name)
    return None if r is None else ANSWER_KINDS[r[0]][0]


def is_answer_figure(name: str) -> bool:
    """A figure that counts answers, not sizes of drift: argmax flips and same top-1, the divergence point and
    whether the streams diverged, the divergence verdict counts (outside the envelope, near-ties), the
    cache-state verdict counts (STATE BUG, non-exact cases), the draft acceptance."""
    return answer_kind(name) is not None


def is_timing_figure(name: str) -> bool:
    """Seconds, throughput or bytes: not numerics (asv's time_/mem_/peakmem_ and the speed track_ figures)."""
    head = name.partition("[")[0].rpartition(".")[2]
    return head.startswith(("time_", "mem_", "peakmem_")) or bool(_TIMING.search(_metric(name)))


@dataclass(frozen=True)
class PairClass:
    """The class of a pair of releases and the one line that says why."""

    cls: str  # one of CLASSES
    reason: str  # one line, naming the figure(s) that decided it
    compared: int = 0  # figures measured on both sides
    changed: tuple[str, ...] = ()  # figures that differ, sorted
    answers: tuple[str, ...] = ()  # the answer figures among them
    one_sided: tuple[str, ...] = ()  # figures measured on one side only (not compared)

    def __post_init__(self):
        if self.cls not in CLASSES:
            raise GemmdriftError(f"class {self.cls!r}: not one of {', '.join(CLASSES)}")

    def at_most(self, allow: str) -> bool:
        """Is this class no more severe than ``allow`` (one of CLASSES)?"""
        if allow not in CLASSES:
            raise GemmdriftError(f"class {allow!r}: not one of {', '.join(CLASSES)}")
        return CLASSES.index(self.cls) <= CLASSES.index(allow)


def _num(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def _fmt(v: float) -> str:
    return f"{int(v)}" if float(v).is_integer() and abs(v) < 1e15 else f"{v:.4g}"


def classify(old: Mapping[str, float], new: Mapping[str, float], *, ladder: str | None = None,
             answer: Callable[[str], bool] = is_answer_figure) -> PairClass:
    """The class of the pair (old, new) from their figures (see the module's docstring)."""
    if ladder not in LADDERS:
        raise GemmdriftError(f"ladder {ladder!r}: not one of 'rounding', 'semantics' or None")
    names = sorted(n for n in set(old) | set(new) if not is_timing_figure(n))
    a = {n: _num(old.get(n)) for n in names}
    b = {n: _num(new.get(n)) for n in names}
    both = [n for n in names if not math.isnan(a[n]) and not math.isnan(b[n])]
    one_sided = tuple(n for n in names if math.isnan(a[n]) != math.isnan(b[n]))
    if not both:
        raise GemmdriftError("no figure measured on both sides: nothing to classify"
                             + (f" ({len(one_sided)} on one side only)" if one_sided else ""))
    changed = tuple(n for n in both if a[n] != b[n])
    answers = tuple(n for n in changed if answer(n))
    tail = f"; {len(one_sided)} figure(s) measured on one side only, not compared" if one_sided else ""

    def out(cls: str, reason: str) -> PairClass:
        return PairClass(cls, reason + tail, len(both), changed, answers, one_sided)

    if answers:
        first = min(answers, key=lambda n: (_answer_rank(n) or (len(ANSWER_KINDS), 0), answers.index(n)))
        words = answer_kind(first) or "an answer figure"
        more = f"; {len(answers)} answer figures changed in all" if len(answers) > 1 else ""
        return out(ANSWER_CHANGING, f"{words} changed: {first} {_fmt(a[first])} → {_fmt(b[first])}{more}")
    if ladder == "semantics":
        what = f"{len(changed)} of {len(both)} figures moved" if changed else "no figure moved"
        return out(ANSWER_CHANGING, f"the precision ladder says semantics ({what})")
    if not changed:
        return out(BIT_FOR_BIT, f"all {len(both)} figures measured on both sides identical")
    first = changed[0]
    moved = f"{len(changed)} of {len(both)} figures moved (first {first} {_fmt(a[first])} → {_fmt(b[first])})"
    if ladder == "rounding":
        return out(ROUNDOFF, f"{moved}, no answer figure changed, the precision ladder says rounding")
    return out(ANSWER_CHANGING, f"{moved}, no answer figure changed, but no precision ladder verdict to call it "
                                "rounding")


def ladder_of(figures: Mapping[str, float]) -> str | None:
    """The precision ladder's verdict on one release's figures (asv series names): for every decode vs verify
    pair with both rungs (the float32 rung ``bench_stack.DecodeVsVerify.track_logits_rel_l2_float32[pair]``,
    the model's dtype ``bench_stack.DecodeVsVerifyLayers.track_rel_l2[pair, accumulated, logits]``),
    :func:`gemmdrift.measure.stack.ladder_verdict`: ``"semantics"`` if any pair is semantic, ``"rounding"`` if
    every pair with drift is rounding, else None (no rung, no drift, or unclear)."""
    from ..measure.stack import ladder_verdict

    verdicts = []
    for name, high in figures.items():
        m = LADDER_HIGH.search(name)
        if not m:
            continue
        low = _num(figures.get(LADDER_LOW.format(pair=m.group("pair"))))
        high = _num(high)
        if math.isnan(low) or math.isnan(high):
            continue
        verdicts.append(ladder_verdict(low, high)[1])
    if "semantic" in verdicts:
        return "semantics"
    if "unclear" in verdicts or "unreliable" in verdicts:
        return None
    return "rounding" if "rounding" in verdicts else None


def figures_of(df, release: str, machine: str | None = None, backend: str | None = None) -> dict[str, float]:
    """One release's tracked figures in asv's results (:func:`gemmdrift.measure.history.read_results`), by series
    name (``bench.Class.track_x[params]``), the latest per series: on one machine and backend when given (a
    class compares one machine with itself). The emulated negative controls are left out, as the gate leaves
    them out (not mlx kernels)."""
    from ..measure import history

    t = history.latest_per_version(history.tracked(df))
    t = t[(t["release"] == release) & ~t["params"].str.contains("emulated:", regex=False)]
    if machine is not None:
        t = t[t["machine"] == machine]
    if backend is not None:
        t = t[t["backend"] == backend]
    return {history.series_name(b, p): float(v) for b, p, v in zip(t["benchmark"], t["params"], t["value"])}


def pair_ladder(old: Mapping[str, float], new: Mapping[str, float]) -> str | None:
    """The ladder's word on a pair: ``"semantics"`` if either release's ladder says so, ``"rounding"`` if the
    new release's says rounding, else None."""
    lo, hi = ladder_of(old), ladder_of(new)
    if "semantics" in (lo, hi):
        return "semantics"
    return hi


__all__ = ["BIT_FOR_BIT", "ROUNDOFF", "ANSWER_CHANGING", "CLASSES", "PairClass", "classify", "is_answer_figure",
           "is_timing_figure", "answer_kind", "ladder_of", "pair_ladder", "figures_of"]
