"""Which models run with replayed kernels right now, and a way to run a stretch of them on this machine's own.

:func:`gemmdrift.replay.model.replayed` registers its :class:`~gemmdrift.replay.model.ReplayLog`
here for the model it swapped proxies into; the measurements below the kernels package (``stack``,
``diverge``) ask :func:`active` whether a model is replayed and compute the prefix every schedule shares under
:func:`native`: the proxies then call the modules they stand in for. Both schedules start from the same
state there, as they would on the replayed GPU, and the replayed run says so (``ReplayLog.prefix``).

No mlx import, and of gemmdrift only its errors: the measurements and the replay import this, never the other way.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

_ACTIVE: dict[int, Any] = {}  # id(model) -> its ReplayLog, while the proxies are in


def register(model, log) -> None:
    _ACTIVE[id(model)] = log


def unregister(model) -> None:
    _ACTIVE.pop(id(model), None)


def active(model):
    """The ReplayLog of ``model`` while its projections are replayed, else None."""
    return _ACTIVE.get(id(model))


@contextlib.contextmanager
def native(model) -> Iterator[Any]:
    """For the duration, a replayed ``model``'s proxies compute with this machine's kernels (yields its log,
    or None when the model is not replayed: then nothing changes)."""
    log = active(model)
    if log is None:
        yield None
        return
    before = log.paused
    log.paused = True
    try:
        yield log
    finally:
        log.paused = before


@contextlib.contextmanager
def shared_prefix(model) -> Iterator[Any]:
    """Where a measurement computes the prefix its schedules share: this machine's kernels for a replayed
    ``model`` (unless its log says the prefix is replayed too, ``--replay-prefix``); yields the log or None."""
    log = active(model)
    if log is None or not log.prefix_native:
        yield log
        return
    with native(model):
        yield log


def say_prefix(log, prefix, shared_by: str = "both schedules") -> None:
    """Record in a replayed run's log how the prefix its runs share was computed (``prefix``: a
    :class:`gemmdrift.model.taps.Prefix`, or None when they share none); each distinct sentence once."""
    if log is None:
        return
    how = "native" if log.prefix_native else "replayed"
    said = (f"{how}, shared by {shared_by} ({prefix.length} tokens in {len(prefix.blocks)} passes)"
            if prefix is not None else f"none shared by {shared_by}: each replayed its own")
    if said not in (log.prefix or "").split("; "):
        log.prefix = f"{log.prefix}; {said}" if log.prefix else said


def key_tag(model) -> str:
    """What a resumable run's key adds for a replayed ``model`` whose shared prefix is computed natively ("" when
    it is not replayed, or its prefix is replayed too: those keys are the ones made before the prefix was native)."""
    log = active(model)
    return "native-prefix-" if log is not None and log.prefix_native else ""


def calls(model) -> dict | None:
    """A copy of the replayed calls ``model`` has made so far ((projection, kernel, variant, T) -> count); None when
    it is not replayed. With :func:`calls_since` and :func:`add_calls`, a resumable run keeps the calls of a part
    it saved, so a resumed run records what the uninterrupted one would have (issue 53, item 11)."""
    log = active(model)
    return None if log is None else dict(log.calls)


def calls_since(model, before: dict) -> list[list]:
    """The calls ``model`` made since :func:`calls` gave ``before``, as JSON-able [projection, kernel, variant, T,
    count] rows."""
    log = active(model)
    return [[*k, n - before.get(k, 0)] for k, n in sorted(log.calls.items()) if n > before.get(k, 0)]


def add_calls(model, rows: list[list]) -> None:
    """Count again in ``model``'s log the calls a saved part made (rows of :func:`calls_since`)."""
    log = active(model)
    for *k, n in rows:
        log.calls[tuple(k)] += int(n)


def check_in_process(model, workers: int | None, what: str) -> int | None:
    """``workers`` for a measurement of ``model``: 1 when it is replayed (the proxies live in this process; a
    worker would load the model afresh and compute natively), refused when more were asked for."""
    if active(model) is None:
        return workers
    if workers is not None and workers > 1:
        from ..errors import GemmdriftError

        raise GemmdriftError(f"{what} with replayed kernels runs in one process (the proxies live here), "
                             f"not {workers} workers")
    return 1


__all__ = ["register", "unregister", "active", "native", "shared_prefix", "say_prefix", "key_tag", "calls", "calls_since",
           "add_calls", "check_in_process"]
