"""Which mlx backend wheels are installed, and whether they agree with what mlx sees.

mlx's Linux backends come as separate wheels (``mlx-cpu``, ``mlx-cuda-12``, ``mlx-cuda-13``, and
``mlx-cuda`` for 0.29.x/0.30.0) that all install ``mlx/lib/libmlx.so``: installed side by side in one
environment, the last one installed wins and uninstalling either breaks the other. So the record
lists every backend wheel found (``platforminfo.backend_wheels``), and a mixed or mismatched environment is said
here, not hidden.
"""

from __future__ import annotations

import importlib.metadata as md
import sys
from typing import Callable, Mapping

from ..errors import GemmdriftError

# The distributions that carry mlx's compiled library, in the order a record names them.
BACKEND_PACKAGES = ("mlx-cpu", "mlx-metal", "mlx-cuda-13", "mlx-cuda-12", "mlx-cuda")
CUDA_PACKAGES = ("mlx-cuda-13", "mlx-cuda-12", "mlx-cuda")

# The backend wheels released for each mlx version that gemmdrift's asv matrices pin (`pip index
# versions` on 2026-12-01). mlx-cuda-12/-13 start at 0.30.1; of mlx's releases since, 0.31.0 and 0.31.2
# have none (there is no mlx 0.30.2). Before them mlx-cuda (CUDA 12; 0.29.4: x86_64 only) was the CUDA wheel.
RELEASES = {
    "mlx-cuda-13": ("0.30.1", "0.30.3", "0.30.4", "0.30.5", "0.30.6", "0.31.1", "0.32.0", "0.32.1", "0.32.2",
                    "0.32.3", "0.32.4"),
    "mlx-cuda-12": ("0.30.1", "0.30.3", "0.30.4", "0.30.5", "0.30.6", "0.31.1", "0.32.0", "0.32.1", "0.32.2",
                    "0.32.3", "0.32.4"),
    "mlx-cuda": ("0.27.1", "0.28.0", "0.29.0", "0.29.1", "0.29.2", "0.29.3", "0.29.4", "0.30.0"),
}


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def installed(version: Callable[[str], str | None] = _version) -> dict[str, str]:
    """Every installed backend wheel with its version, e.g. ``{"mlx-cpu": "0.32.4"}``."""
    found = {name: version(name) for name in BACKEND_PACKAGES}
    return {name: v for name, v in found.items() if v}


def problems(packages: Mapping[str, str], backend: str, cuda_available: bool, mlx: str | None = None) -> list[str]:
    """What is wrong with an environment's backend wheels (pure: every input is given).

    Args:
        packages: from :func:`installed`.
        backend: the recorded backend ('cpu', 'metal', 'cuda', 'gpu').
        cuda_available: ``mx.cuda.is_available()``.
        mlx: the mlx version; a backend wheel of another version is reported.

    Returns:
        One sentence per problem; empty when the environment is consistent.
    """
    out = []
    linux = [p for p in packages if p != "mlx-metal"]
    if len(linux) > 1:
        out.append(f"several mlx backend wheels are installed ({', '.join(f'{p} {packages[p]}' for p in linux)}): "
                   "each installs mlx/lib/libmlx.so, so the last one installed is the one that runs; use one "
                   "virtual environment per backend (make BACKEND=...)")
    cuda = [p for p in linux if p in CUDA_PACKAGES]
    if cuda and not cuda_available:
        out.append(f"{cuda[0]} is installed but mlx sees no CUDA device (driver missing or too old for it?)")
    if backend == "cuda" and not cuda:
        out.append("the backend is CUDA but no mlx-cuda wheel is installed")
    if mlx:
        out += [f"{p} {v} does not match mlx {mlx}" for p, v in packages.items() if v != mlx]
    return out


_WARNED: set[str] = set()  # each problem is said once per process, not in every record


def check() -> list[str]:
    """:func:`problems` of this environment (mlx imported here), each also warned once on stderr. The wheels
    themselves are recorded by :func:`gemmdrift.machine.platforminfo.backend_wheels` (``mlx_backend_wheels``)."""
    import mlx.core as mx

    cuda = bool(hasattr(mx, "cuda") and mx.cuda.is_available())
    backend = "cpu" if mx.default_device().type == mx.cpu else ("cuda" if cuda else "gpu")
    found = problems(installed(), backend, cuda, getattr(mx, "__version__", None))
    for p in found:
        if p not in _WARNED:
            _WARNED.add(p)
            print(f"gemmdrift: warning: {p}", file=sys.stderr, flush=True)
    return found


def import_problem(error: ImportError, packages: Mapping[str, str]) -> str:
    """The one line for an mlx that cannot be imported (pure: ``packages`` from :func:`installed`). An mlx-cuda wheel
    on a machine without the NVIDIA driver fails on ``libcuda.so.1`` (issue 53, item 8): said as such."""
    text = (str(error).strip().splitlines() or [type(error).__name__])[0]
    cuda = [f"{p} {v}" for p, v in packages.items() if p in CUDA_PACKAGES]
    if "libcuda" in text:
        return (f"mlx cannot load its CUDA backend ({', '.join(cuda) or 'mlx-cuda'}): this machine has no NVIDIA "
                "driver (libcuda.so.1 does not load); use the cpu backend here (make BACKEND=cpu: .venv)")
    return f"mlx cannot be imported: {text}"


def is_mlx_import(error: ImportError) -> bool:
    """Whether ``error`` is mlx itself failing to import (its module or its compiled library)."""
    return (error.name or "").split(".")[0] == "mlx" or "libcuda" in str(error)


def require_mlx() -> None:
    """Import mlx now: an mlx that cannot load is one line (:func:`import_problem`) before any work, not a
    traceback from the first command that computes."""
    try:
        import mlx.core  # noqa: F401
    except ImportError as e:
        if not is_mlx_import(e):
            raise
        raise GemmdriftError(import_problem(e, installed())) from None
