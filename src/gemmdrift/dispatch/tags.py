"""Every mlx release tag against the sources the dispatch rules were read from (issues 47 and 54).

The rules of :mod:`gemmdrift.dispatch` were read for every tag from :data:`READ_FROM` of each backend and op to the
mirror's HEAD (Metal and CUDA matmul, quantized matmul and sdpa from v0.26.5, through every commit that touched
their files: :mod:`.commits`; the CPU from v0.30.5). A release in that window follows its own rules. A part older than its first tag read is "not read" (never "not knowable": that
label is kept for orders chosen at run time or hidden in hardware), unless ``data/dispatch_tags.json`` (written
by ``scripts/read_dispatch_tags.py`` from a clone of ml-explore/mlx: the git blob of every file in
:data:`SOURCES` at every tag from v0.26.5) shows its files byte-identical to a release read: then that release's
rules are its rules ("as 0.30.5", naming the files compared). Standard library only.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

from .base import (CPU_CBLAS, CPU_MATMUL, CPU_QUANTIZED, CPU_SIMD_GEMM, CUDA_GEMV, CUDA_MATMUL, CUDA_QMM,
                   CUDA_QUANTIZED, CUDA_SDPA, CUDA_SDPA_VECTOR, FAST_SDPA, METAL_DEVICE, METAL_MATMUL,
                   METAL_QUANTIZED, METAL_SDPA, VERIFIED_FROM, Version, parse_version)

DATA = Path(__file__).resolve().parent.parent / "data" / "dispatch_tags.json"
_K = "mlx/backend/metal/kernels/"
# The files that decide (backend, op): the dispatch code and the kernels whose order the replay's recipes read.
SOURCES: dict[tuple[str, str], tuple[str, ...]] = {
    ("metal", "matmul"): (METAL_MATMUL, METAL_DEVICE, _K + "gemv.h", _K + "gemv.metal", _K + "steel/gemm/mma.h",
                          _K + "steel/gemm/kernels/steel_gemm_fused.h", _K + "steel/gemm/kernels/steel_gemm_splitk.h"),
    ("metal", "quantized_matmul"): (METAL_QUANTIZED, METAL_DEVICE, _K + "quantized.h", _K + "fp_quantized.h"),
    ("metal", "sdpa"): (METAL_SDPA, METAL_DEVICE),
    ("cuda", "matmul"): (CUDA_MATMUL, CUDA_GEMV),
    ("cuda", "quantized_matmul"): (CUDA_QUANTIZED, CUDA_QMM),
    ("cuda", "sdpa"): (CUDA_SDPA, CUDA_SDPA_VECTOR),
    ("cpu", "matmul"): (CPU_MATMUL, CPU_SIMD_GEMM, CPU_CBLAS),
    ("cpu", "quantized_matmul"): (CPU_QUANTIZED,),
    ("cpu", "sdpa"): (FAST_SDPA,),
}


# The first tag whose rules were read, per (backend, op).
READ_FROM: dict[tuple[str, str], Version] = {
    **{("metal", op): VERIFIED_FROM for op in ("matmul", "quantized_matmul", "sdpa")},
    **{("cuda", op): VERIFIED_FROM for op in ("matmul", "quantized_matmul", "sdpa")},
    **{("cpu", op): (0, 30, 5) for op in ("matmul", "quantized_matmul", "sdpa")},
}
NOT_READ = "not read"


class Rules(NamedTuple):
    """Whose rules a release's (backend, op) dispatch follows: ``version`` (None: not read) and why."""

    version: str | None
    why: str  # "" when the rules were read for this release itself


@lru_cache(maxsize=1)
def record() -> dict:
    """The recorded blobs ({"mirror", "mirror_version", "files", "tags": {version: {file: blob or None}}})."""
    try:
        return json.loads(DATA.read_text())
    except (OSError, ValueError):
        return {"tags": {}, "files": []}


def _v(text: str) -> Version:
    return parse_version(text)


def read_releases(backend: str | None = None, op: str | None = None) -> list[str]:
    """The recorded releases whose rules were read (for ``backend`` and ``op``: from READ_FROM; else from
    VERIFIED_FROM) up to the mirror's HEAD, oldest first."""
    first = READ_FROM[(backend, op)] if backend else VERIFIED_FROM
    return sorted((t for t in record()["tags"] if _v(t) >= first), key=_v)


def _short(files) -> str:
    return ", ".join(f.replace("mlx/backend/", "") for f in files)


def rules_for(version: str | Version, backend: str, op: str) -> Rules:
    """Whose rules ``version``'s ``op`` on ``backend`` follows: its own from READ_FROM on (a release newer than the
    mirror: the mirror's, said to be assumed); for an older tag, the oldest read release whose files of (backend,
    op) are byte-identical ("as X.Y.Z (files compared: ...)"); else None: "not read", saying why."""
    v = version if isinstance(version, tuple) else _v(version)
    text = ".".join(map(str, v))
    newest = record().get("mirror_version")
    if newest and v > _v(newest):
        return Rules(newest, f"assumed as {newest} (newer than the source read, {record().get('mirror')}: "
                             "its files were not compared)")
    first = READ_FROM[(backend, op)]
    if v >= first:
        return Rules(text, "")
    oldest = ".".join(map(str, VERIFIED_FROM))
    if v < VERIFIED_FROM:
        return Rules(None, f"{NOT_READ}: mlx {text} is older than the first tag read ({oldest})")
    files = SOURCES[(backend, op)]
    tags = record()["tags"]
    mine = tags.get(text)
    start = ".".join(map(str, first))
    if mine is None:
        return Rules(None, f"{NOT_READ}: mlx {text} is not a recorded release tag (its {backend} {op} rules were "
                           f"read from {start} on)")
    for read in read_releases(backend, op):
        theirs = tags[read]
        if all(mine.get(f) == theirs.get(f) for f in files) and any(mine.get(f) for f in files):
            return Rules(read, f"as {read} (files compared: {_short(files)})")
    ref = tags.get(start, {})
    differ = [f for f in files if mine.get(f) != ref.get(f)]
    return Rules(None, f"{NOT_READ}: the {backend} {op} rules were read from {start} on, and {_short(differ)} at "
                       f"v{text} {'differs' if len(differ) == 1 else 'differ'} from every release read")


def same_sources(a: str, b: str, backend: str, op: str) -> bool | None:
    """Are the files of (backend, op) byte-identical at releases ``a`` and ``b`` (None: one was not recorded)?"""
    tags = record()["tags"]
    ta, tb = tags.get(".".join(map(str, _v(a)))), tags.get(".".join(map(str, _v(b))))
    if ta is None or tb is None:
        return None
    return all(ta.get(f) == tb.get(f) for f in SOURCES[(backend, op)])


__all__ = ["SOURCES", "READ_FROM", "NOT_READ", "Rules", "rules_for", "same_sources", "read_releases", "record", "DATA"]
