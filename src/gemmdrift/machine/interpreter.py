"""Another Python interpreter, asked what it has (``attribute --python``, ``upgrade --python``, the upgrade's
environments): one function runs a probe script there and reads the JSON object on its last line, with the same
one-line refusals for every caller; and uv, which makes those environments (the upgrade's, the history's)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

from ..errors import GemmdriftError


def probe(path: str, script: str, args: Sequence[str] = (), *, flag: str = "--python", timeout: float = 180,
          no_lm: str = "install mlx-lm in it") -> dict[str, Any]:
    """Run ``script`` (``-c``) with ``args`` under the interpreter at ``path``; the JSON object its last line prints.

    The script prints ``{"error": ...}`` when mlx does not import, else at least ``mlx`` and ``mlx_lm`` (None when
    mlx-lm is missing). A one-line GemmdriftError naming ``flag`` when the path is missing, a directory, cannot run,
    prints no JSON (not a Python), cannot import mlx, or has no mlx-lm (``no_lm``: what the message advises).
    A relative path is the file there (run by its absolute path, never searched on PATH).
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise GemmdriftError(f"{flag} {path}: no such file")
    if p.is_dir():
        raise GemmdriftError(f"{flag} {path}: a directory, not an interpreter (give its bin/python)")
    try:
        r = subprocess.run([str(p.absolute()), "-c", script, *args], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as e:
        raise GemmdriftError(f"{flag} {path}: cannot run it ({e.__class__.__name__}: {e})") from None
    try:
        info = json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise GemmdriftError(f"{flag} {path}: not a Python interpreter (it printed no version)") from None
    if not isinstance(info, dict):
        raise GemmdriftError(f"{flag} {path}: not a Python interpreter (it printed no version)")
    if "error" in info:
        raise GemmdriftError(f"{flag} {path}: mlx does not import there ({info['error']})")
    if not info.get("mlx_lm"):
        raise GemmdriftError(f"{flag} {path}: mlx {info.get('mlx')} but no mlx-lm there ({no_lm})")
    return info


def uv_path() -> str | None:
    """uv beside this interpreter (``make env`` installs it in .venv), else on PATH; None when there is none."""
    return shutil.which("uv", path=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
