"""Per-unit checkpoints of the commands that measure one unit at a time.

`state` (a family of cache operations), `batch` (a row), `server` (a request)
and `fingerprint` (a path at one T) save every finished unit as a JSON file
under ``OUT/.checkpoints/<kind>/``, named by the one resume-key scheme
(:func:`gemmdrift.model.resume_key`: model, dtype, quantization, mlx and
mlx-lm versions, and the unit's own inputs). A rerun with the same inputs
loads what finished and computes the rest; a checkpoint made with other
inputs has another name and is never reused. A corrupt one is discarded by
name and recomputed (:func:`gemmdrift.files.discard_checkpoint`).

Ctrl-C inside a measurement raises :class:`Interrupted`, a KeyboardInterrupt
that carries the partial Result built from the finished units; the CLI writes
it (marked ``inputs["partial"]``, which `report` shows) and exits 130.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

from . import files

DIR = ".checkpoints"


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during a checkpointed measurement: ``result`` is the partial Result (None if nothing finished)."""

    def __init__(self, result: Any = None, done: int = 0, total: int = 0, kept: str = "", what: str = "") -> None:
        super().__init__(f"{done} of {total} units finished")
        self.result, self.done, self.total = result, done, total
        self.kept = kept  # smaller units kept though no unit finished (e.g. "3 finished rollback cells")
        self.what = what  # what ``result`` holds, when "done of total" does not say it all (state's cells)


def partial_inputs(done: int, total: int, unit: str) -> dict[str, Any]:
    """What a partial Result adds to its inputs (``inputs["partial"]``; `report` names it)."""
    return {"partial": {"done": int(done), "total": int(total), "unit": unit}}


class Checkpoints:
    """The finished units of one measurement, saved as JSON under ``out/.checkpoints/kind/``.

    ``out`` None keeps nothing (the library called without an output directory).
    ``description``: the model's :class:`~gemmdrift.model.ModelDescription` (None for model-free
    measurements such as fingerprints); ``parts``: the measurement's own inputs (JSON-able).
    """

    def __init__(self, out: str | Path | None, kind: str, description: Any, *parts: Any) -> None:
        self.dir = Path(out) / DIR / kind if out is not None else None
        self.description = description
        self.parts = parts

    def spec(self) -> dict[str, Any] | None:
        """A picklable recipe (for worker processes): ``Checkpoints.from_spec(spec)`` rebuilds it."""
        if self.dir is None:
            return None
        from .model import ModelDescription

        d = self.description
        return {"dir": str(self.dir), "description": d.as_dict() if isinstance(d, ModelDescription) else None,
                "parts": list(self.parts)}

    @classmethod
    def from_spec(cls, spec: dict[str, Any] | None) -> "Checkpoints":
        if spec is None:
            return cls(None, "", None)
        from .model import ModelDescription

        ck = cls(None, "", ModelDescription.from_dict(spec["description"]) if spec["description"] else None,
                 *spec["parts"])
        ck.dir = Path(spec["dir"])
        return ck

    def path(self, unit: str, *unit_parts: Any) -> Path | None:
        """The file of one unit: its name, then the resume key of everything it depends on."""
        if self.dir is None:
            return None
        from .model import resume_key

        key = resume_key(self.description, *self.parts, unit, *unit_parts)
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in unit)[:60]
        return self.dir / f"{safe}-{key}.json"

    def load(self, unit: str, *unit_parts: Any, check: Callable[[Any], bool] | None = None) -> Any | None:
        """The saved unit, or None (not finished, or corrupt: then discarded by name)."""
        p = self.path(unit, *unit_parts)
        if p is None or not p.exists():
            return None
        try:
            obj = json.loads(p.read_text(encoding="utf-8"))
            if not isinstance(obj, dict) or "unit" not in obj or (check is not None and not check(obj["unit"])):
                raise ValueError("not a checkpoint of this unit")
        except (OSError, UnicodeDecodeError, ValueError) as e:
            files.discard_checkpoint(p, str(e)[:80])
            return None
        return obj["unit"]

    def save(self, unit: str, obj: Any, *unit_parts: Any) -> None:
        p = self.path(unit, *unit_parts)
        if p is not None:
            # Python's JSON with NaN and Infinity: a checkpoint is read back only here, and a resumed unit
            # must be the unit computed (inf is not null), where result files keep strict JSON.
            files.write_text(p, json.dumps({"unit": obj}, default=files.json_default, allow_nan=True) + "\n")

    def clear(self) -> None:
        """Drop the checkpoints once the whole Result is written (it holds everything they did)."""
        if self.dir is not None and self.dir.is_dir():
            shutil.rmtree(self.dir, ignore_errors=True)
            try:
                self.dir.parent.rmdir()  # .checkpoints/ itself, when no other kind is in it
            except OSError:
                pass
