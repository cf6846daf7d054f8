"""Will the model copies fit? The memory a device offers, and the checks made before a second copy loads.

On Apple silicon every process shares one unified memory, and Metal keeps a working set it recommends
not to exceed (``max_recommended_working_set_size``); on CUDA each process's copy lives in the device
memory (``total_memory``); on the CPU it is the physical memory. `gemmdrift server` runs
``mlx_lm.server`` processes that load their own copy (plus the draft) while gemmdrift holds one, and
workers each load one: the decisions below are pure functions over those numbers, so they are tested
with planted sizes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from ..errors import GemmdriftError

GB = 1e9


def budget_from_info(backend: str, info: Mapping[str, Any], physical: int | None) -> tuple[int | None, str]:
    """(bytes, what they are) a device offers to model weights, from ``mx.device_info(device)``.

    Metal: the recommended working set; CUDA: the device memory (mlx's key ``total_memory``; older
    records say ``memory_size``); the CPU: ``physical`` memory. None where nothing is known.
    """
    if backend == "metal":
        v = info.get("max_recommended_working_set_size") or info.get("memory_size")
        return (int(v) if v else None), "Metal's recommended working set"
    if backend == "cuda":
        v = info.get("total_memory") or info.get("memory_size")
        return (int(v) if v else None), "the CUDA device memory"
    return physical, "the physical memory"


def _physical() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def device_budget() -> tuple[int | None, str]:
    """:func:`budget_from_info` for mlx's default device (mlx imported here)."""
    import mlx.core as mx

    dev = mx.default_device()
    backend = "cpu"
    if dev.type == mx.gpu:
        backend = "metal" if mx.metal.is_available() else "cuda" if hasattr(mx, "cuda") and mx.cuda.is_available() else "gpu"
    info: dict[str, Any] = {}
    try:
        # The device asked for explicitly: mlx 0.30.4-0.31.1 bind the default argument at import.
        info = dict(mx.device_info(dev)) if hasattr(mx, "device_info") else dict(mx.metal.device_info())
    except Exception:  # informative only: no budget is then known
        info = {}
    return budget_from_info(backend, info, _physical())


def checkpoint_bytes(model_dir: str | os.PathLike) -> int:
    """The weights of an mlx-lm checkpoint as stored (its safetensors files): what a process loads."""
    return sum(f.stat().st_size for f in Path(model_dir).expanduser().glob("*.safetensors"))


def quantized_bytes(stored: int, stored_bits: int, bits: int = 4, group_size: int = 64) -> int:
    """About what an affine ``bits``-bit re-quantization of ``stored`` bytes of ``stored_bits`` weights weighs:
    ``bits`` per weight plus a scale and a bias (each ``stored_bits``) per group (the default draft's size)."""
    return int(stored * (bits + 2 * stored_bits / group_size) / stored_bits)


def server_plan(target: int, draft: int, budget: int | None, what: str = "the memory") -> str:
    """Whether `gemmdrift server` may keep its own copy of the model while the servers run.

    Args:
        target: bytes of the target's weights (each process holding the model holds that much).
        draft: bytes of the draft's weights when a draft server runs (it holds target and draft), else 0.
        budget: bytes the device offers (:func:`device_budget`); None: unknown, keep as before.
        what: the budget's name, for the message.

    Returns:
        'keep' (gemmdrift's copy plus the largest server fit) or 'free' (only the server's copies fit:
        free gemmdrift's copy while they run, load it again for the triage).

    Raises:
        GemmdriftError: not even the server's own copies fit.
    """
    server = target + draft
    if budget is None or 2 * target + draft <= budget:
        return "keep"
    if server <= budget:
        return "free"
    raise GemmdriftError(f"mlx_lm.server needs {server / GB:.1f} GB of weights (target"
                         + (f" and draft" if draft else "") + f"), more than {what} ({budget / GB:.1f} GB): "
                         "use a smaller or quantized model" + (" or draft" if draft else ""))


def check_copies(copies: int, weights: int, budget: int | None, what: str, flag: str) -> None:
    """Refuse ``copies`` copies of ``weights`` bytes that do not fit ``budget`` (one line naming ``flag``)."""
    if budget is not None and copies * weights > budget:
        raise GemmdriftError(f"{flag}: {copies} copies of the model ({copies * weights / GB:.1f} GB) do not fit "
                             f"{what} ({budget / GB:.1f} GB); use fewer workers")
