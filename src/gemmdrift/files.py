"""Atomic file output and the cache directory.

Every result file is written to a temporary sibling and renamed into place, so
an interrupted run never leaves a half-written table behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator


def cache_dir() -> Path:
    """Where converted weights live: ``$GEMMDRIFT_CACHE`` or the user's cache dir."""
    env = os.environ.get("GEMMDRIFT_CACHE")
    if env:
        return Path(env).expanduser()
    if sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "gemmdrift"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; rename it onto ``path`` on success."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=path.suffix, dir=path.parent)
    os.close(fd)
    tmp = Path(tmp)
    os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; results get the usual permissions
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def discard_checkpoint(path: str | os.PathLike, reason: str) -> None:
    """A corrupt checkpoint (a part of a resumable run): say so by name, delete it, recompute that part.

    Checkpoints are written atomically, so a corrupt one was damaged from outside
    (a full disk, a copy, an edit); it is never worth a traceback.
    """
    import shutil

    path = Path(path)
    print(f"gemmdrift: warning: checkpoint {path} is corrupt ({reason}): discarded, recomputing that part",
          file=sys.stderr, flush=True)
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def write_text(path: str | os.PathLike, text: str) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(path)


def json_default(o: Any) -> Any:
    """For json.dumps(default=...): numpy scalars and arrays as lists, Paths as strings."""
    # numpy scalars and arrays, Paths: the only non-JSON types results carry.
    if hasattr(o, "tolist"):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serializable: {type(o).__name__}")


def _finite(obj: Any) -> Any:
    """NaN and infinities become null: JSON has no spelling for them."""
    if isinstance(obj, float):
        return obj if obj == obj and obj not in (float("inf"), float("-inf")) else None
    if isinstance(obj, dict):
        return {str(k): _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    if hasattr(obj, "tolist") and not isinstance(obj, (str, bytes)):
        return _finite(obj.tolist())
    return obj


def to_json(obj: Any, indent: int | None = 2) -> str:
    return json.dumps(_finite(obj), indent=indent, default=json_default, allow_nan=False)


def write_json(path: str | os.PathLike, obj: Any) -> Path:
    return write_text(path, to_json(obj) + "\n")


def write_csv(path: str | os.PathLike, frame) -> Path:
    with atomic_path(path) as tmp:
        frame.to_csv(tmp, index=False)
    return Path(path)


def save_figure(path: str | os.PathLike, fig) -> Path:
    import matplotlib.pyplot as plt

    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=120, bbox_inches="tight", format=Path(path).suffix.lstrip(".") or "png")
    plt.close(fig)
    return Path(path)


def read_object(path: str | Path, need: tuple[str, ...] = ()) -> dict[str, Any]:
    """A JSON object a command wrote, with the keys ``need``; a corrupt or incomplete one is refused by name
    (a page of "None" would look like a result)."""
    import json

    from .errors import GemmdriftError

    path = Path(path)
    if not path.exists():
        raise GemmdriftError(f"{path} is missing: rerun the command that wrote it")
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise GemmdriftError(f"{path} is corrupt ({e.__class__.__name__}: {e}): rerun the command that wrote it") \
            from None
    missing = [k for k in need if not isinstance(obj, dict) or k not in obj]
    if not isinstance(obj, dict) or missing:
        what = f"lacks {', '.join(missing)}" if isinstance(obj, dict) else f"holds a {type(obj).__name__}"
        raise GemmdriftError(f"{path} is corrupt (it {what}): rerun the command that wrote it")
    return obj
