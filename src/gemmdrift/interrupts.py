"""What Ctrl-C keeps, per command: the partial Result written, and a message that says exactly what resumes.

Commands that checkpoint per unit raise :class:`gemmdrift.checkpoint.Interrupted`
carrying the partial Result of the finished units; it is written to ``--out``
(without figures: the user asked to stop) and `report` marks it partial. The
message names what was kept and whether a rerun resumes, per command, never a
blanket promise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .checkpoint import Interrupted

# What a rerun with the same --out resumes (commands not listed keep nothing: they are short or read only).
RESUMES = {
    "run": "finished parts are kept (done.json); rerun with the same --out to resume",
    "attribute": "finished parts (local drift, each counterfactual) are kept in {out}/checkpoint; rerun the same "
                 "command to resume",
    "stack": "finished schedule runs are kept in {out}/checkpoint; rerun the same command to resume",
    "kernels": "finished units are kept in {out}/checkpoint; rerun the same command to resume",
    "state": ("finished rollback cells and halves of the sweep are kept in {out}/.checkpoints; rerun the same "
              "command to resume"),
    "batch": "finished rows are kept in {out}/.checkpoints; rerun the same command to resume",
    "server": "finished cases are kept in {out}/.checkpoints; rerun the same command to resume",
    "fingerprint": "finished paths x T are kept in {out}/.checkpoints; rerun the same command to resume",
    "upgrade": ("finished units (the op capture, each release's ops and runs, the speed) are kept in "
                "{out}/.checkpoints/upgrade; rerun the same command to resume"),
    "bisect": ("every commit measured (and every part of one) is kept in its results directory, one JSON per "
               "commit, and every built environment in the cache; rerun the same command to resume"),
    "replay": "finished (projection, path) units are kept in {out}/checkpoint; rerun the same command to resume",
}
DIVERGE_SET = "finished prompts are kept in {out}/prompts; rerun the same command to resume"


def on_interrupt(args: Any, exc: KeyboardInterrupt) -> str:
    """Write the partial Result ``exc`` carries (if any) and return the one-line message for ``args.command``."""
    command = getattr(args, "command", None) or "gemmdrift"
    out = getattr(args, "out", None)
    if command == "diverge" and getattr(args, "prompts", None) is not None:
        how = DIVERGE_SET
    else:
        how = RESUMES.get(command)
    if how is None:
        return f"gemmdrift {command}: interrupted: nothing was written (this command does not checkpoint; rerun it)"
    said = how.format(out=out)
    if command == "attribute":
        kept = _attribute_kept(args, out)
        if kept is not None:
            return f"gemmdrift attribute: interrupted: {kept}"
    if command == "upgrade":
        return f"gemmdrift upgrade: interrupted: {_upgrade_kept(out)}"
    if command == "state" and not _state_kept(exc, out):  # say "kept in OUT/.checkpoints" only when true
        return "gemmdrift state: interrupted: nothing had finished, so nothing is kept; rerun the same command"
    if isinstance(exc, Interrupted) and exc.result is not None and out is not None:
        from . import store

        try:
            store.write_result(exc.result, out, draw=False)
            said = (f"{exc.what or f'{exc.done} of {exc.total}'} finished, written to {Path(out)}/ as a partial "
                    f"result (`gemmdrift report` marks it); " + said)
        except Exception as e:  # a second failure must not hide the checkpoints, which are already on disk
            said = f"the partial result could not be written ({e.__class__.__name__}: {e}); " + said
    elif isinstance(exc, Interrupted) and exc.kept:  # say what is there, not "nothing" (issue 33 D11a)
        said = f"{exc.kept} are kept, but no part of the result had finished (so no partial result is written); " + said
    elif isinstance(exc, Interrupted):
        said = "nothing had finished; " + said
    return f"gemmdrift {command}: interrupted: {said}"


def _state_kept(exc: KeyboardInterrupt, out: Any) -> bool:
    """Whether an interrupted ``state`` left anything in OUT/.checkpoints: its Interrupted knows (a half of the
    sweep or a rollback cell finished, now or in an earlier run); an interrupt before the sweep looks there."""
    if isinstance(exc, Interrupted):
        return exc.result is not None or exc.done > 0 or bool(exc.kept)
    from .checkpoint import DIR

    d = Path(out) / DIR / "state" if out is not None else None
    return d is not None and d.is_dir() and any(d.iterdir())


# upgrade's units (gemmdrift.upgrade.measure), by the name each file begins with: what a rerun reads back.
UPGRADE_UNITS = (("capture-", "the op capture"), ("runs-from-", "from's runs"), ("runs-to-", "to's runs"),
                 ("ops-from-", "from's recomputed ops"), ("ops-to-", "to's recomputed ops"),
                 ("ladder-from-", "from's float32 rung"), ("ladder-to-", "to's float32 rung"),
                 ("speed-", "the speed rounds"))


def _upgrade_kept(out: Any) -> str:
    """What an interrupted ``upgrade`` left in OUT/.checkpoints/upgrade: the units finished (their .json is written
    last), never a list of every unit whether it was reached or not."""
    d = Path(out) / ".checkpoints" / "upgrade" if out is not None else None
    names = [p.name for p in d.glob("*.json")] if d is not None and d.is_dir() else []
    kept = [what for head, what in UPGRADE_UNITS if any(n.startswith(head) for n in names)]
    if not kept:
        return "nothing had finished, so nothing is kept; rerun the same command"
    return f"finished units ({', '.join(kept)}) are kept in {d}; rerun the same command to resume"


def _attribute_kept(args: Any, out: Any) -> str | None:
    """``attribute``'s own message when it is not the schedule mode's promise: the release mode keeps only a
    finished capture (a rerun reuses it); the schedule mode says "nothing had finished" when no checkpoint is
    there. None: the checkpoints are there, the standard message holds."""
    base = Path(out) if out is not None else None
    if getattr(args, "python", None):
        capture = (Path(args.release_capture) if getattr(args, "release_capture", None) else
                   base / "release_ops" / "capture.json" if base is not None else None)
        if capture is not None and capture.with_suffix(".json").is_file() and capture.with_suffix(".npz").is_file():
            return (f"the capture had finished and is kept in {capture}; rerun the same command: it is reused "
                    "(nothing else is kept)")
        return "nothing had finished (the capture had not), so nothing is kept; rerun the same command"
    if getattr(args, "primitives", False):
        return "nothing is kept (the gate takes seconds); rerun the same command"
    if base is not None and any(p.is_file() for d in base.glob("checkpoint*") for p in d.rglob("*")):
        return None
    return "nothing had finished, so nothing is kept; rerun the same command"
