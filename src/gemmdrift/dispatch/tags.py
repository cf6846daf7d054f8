"""Every mlx release tag against the sources the dispatch rules were read from (issue 47, item 3).

The rules of :mod:`gemmdrift.dispatch` were read from mlx v0.30.5 on (``VERIFIED_FROM``; every tag from there to
the mirror's HEAD is modelled, a changed condition naming its first tag). For an older tag,
``data/dispatch_tags.json`` (written by ``scripts/read_dispatch_tags.py`` from a clone of ml-explore/mlx: the git
blob of every file in :data:`SOURCES` at every tag from v0.26.5) says whether the files one backend and op are
decided by are byte-identical to a release whose rules were read: then that release's rules are its rules
("as 0.30.5", naming the files compared); else its dispatch is not knowable, naming the files that differ.
Standard library only.
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


class Rules(NamedTuple):
    """Whose rules a release's (backend, op) dispatch follows: ``version`` (None: not knowable) and why."""

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


def read_releases() -> list[str]:
    """The recorded releases whose rules were read (VERIFIED_FROM up to the mirror's HEAD), oldest first."""
    return sorted((t for t in record()["tags"] if _v(t) >= VERIFIED_FROM), key=_v)


def _short(files) -> str:
    return ", ".join(f.replace("mlx/backend/", "") for f in files)


def rules_for(version: str | Version, backend: str, op: str) -> Rules:
    """Whose rules ``version``'s ``op`` on ``backend`` follows: its own from VERIFIED_FROM on (a release newer
    than the mirror: the mirror's, said to be assumed); for an older tag,
    the oldest read release whose files of (backend, op) are byte-identical ("as X.Y.Z (files compared: ...)");
    else None, naming the files that differ from the oldest read release (or saying the tag was not recorded)."""
    v = version if isinstance(version, tuple) else _v(version)
    text = ".".join(map(str, v))
    newest = record().get("mirror_version")
    if newest and v > _v(newest):
        return Rules(newest, f"assumed as {newest} (newer than the source read, {record().get('mirror')}: "
                             "its files were not compared)")
    if v >= VERIFIED_FROM:
        return Rules(text, "")
    files = SOURCES[(backend, op)]
    tags = record()["tags"]
    mine = tags.get(text)
    first = ".".join(map(str, VERIFIED_FROM))
    if mine is None:
        return Rules(None, f"mlx {text}'s source was not compared (not a recorded release tag): not knowable")
    for read in read_releases():
        theirs = tags[read]
        if all(mine.get(f) == theirs.get(f) for f in files) and any(mine.get(f) for f in files):
            return Rules(read, f"as {read} (files compared: {_short(files)})")
    ref = tags.get(first, {})
    differ = [f for f in files if mine.get(f) != ref.get(f)]
    return Rules(None, f"not knowable: {_short(differ)} at v{text} {'differs' if len(differ) == 1 else 'differ'} "
                       f"from every release read ({first} on)")


def same_sources(a: str, b: str, backend: str, op: str) -> bool | None:
    """Are the files of (backend, op) byte-identical at releases ``a`` and ``b`` (None: one was not recorded)?"""
    tags = record()["tags"]
    ta, tb = tags.get(".".join(map(str, _v(a)))), tags.get(".".join(map(str, _v(b))))
    if ta is None or tb is None:
        return None
    return all(ta.get(f) == tb.get(f) for f in SOURCES[(backend, op)])


__all__ = ["SOURCES", "Rules", "rules_for", "same_sources", "read_releases", "record", "DATA"]
