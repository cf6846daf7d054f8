"""Facts of the machine that decide which kernel mlx runs, read without mlx: the macOS version (NAX needs
26.2), the mlx backend wheels installed (version and wheel tag), and the CUDA driver where it is readable.

Standard library only; every probe is guarded and returns None (or leaves a key
out) rather than fail: the record is informative, a missing fact is said as None.
"""

from __future__ import annotations

import importlib.metadata as md
import platform
import re
import shutil
import subprocess
from typing import Any, Mapping

BACKEND_WHEELS = ("mlx-metal", "mlx-cuda-13", "mlx-cuda-12", "mlx-cuda", "mlx-cpu")


def macos_version() -> str | None:
    """'26.2' on macOS (``platform.mac_ver()``), None elsewhere. The Darwin kernel release is not the macOS version."""
    version = platform.mac_ver()[0]
    return version or None


def backend_wheels() -> dict[str, dict[str, str | None]]:
    """Every installed mlx backend wheel, e.g.
    ``{"mlx-metal": {"version": "0.32.4", "tag": "cp311-cp311-macosx_26_0_arm64"}}``.

    All of them, because mlx-cpu and an mlx-cuda wheel can share one
    environment (both own mlx/lib/libmlx.so: the last installed wins).
    """
    out: dict[str, dict[str, str | None]] = {}
    for name in BACKEND_WHEELS:
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        tags = [line.split(":", 1)[1].strip() for line in (dist.read_text("WHEEL") or "").splitlines()
                if line.startswith("Tag:")]
        out[name] = {"version": dist.version, "tag": ",".join(tags) or None}
    return out


def device_memory(info: Mapping[str, Any], backend: str) -> int | None:
    """The device memory in bytes from ``mx.device_info()``: ``memory_size`` on Metal, ``total_memory`` on CUDA
    (mlx/backend/metal/device_info.cpp, mlx/backend/cuda/device_info.cpp); None on the CPU or if absent."""
    key = {"metal": "memory_size", "cuda": "total_memory"}.get(backend)
    value = info.get(key) if key else None
    return int(value) if value is not None else None


def parse_nvidia_smi(text: str) -> dict[str, str]:
    """The first GPU's line of ``nvidia-smi --query-gpu=driver_version,compute_cap --format=csv,noheader``."""
    line = next((ln for ln in text.splitlines() if ln.strip()), "")
    parts = [p.strip() for p in line.split(",")]
    if len(parts) < 2 or not re.fullmatch(r"[\d.]+", parts[0]):
        return {}
    out = {"cuda_driver": parts[0]}
    if re.fullmatch(r"\d+\.\d+", parts[1]):
        out["compute_capability"] = parts[1]
    return out


def _nvml_driver() -> dict[str, str]:
    import ctypes

    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        if lib.nvmlInit_v2() != 0:
            return {}
        out: dict[str, str] = {}
        buf = ctypes.create_string_buffer(96)
        if lib.nvmlSystemGetDriverVersion(buf, ctypes.c_uint(96)) == 0:
            out["cuda_driver"] = buf.value.decode()
        v = ctypes.c_int()
        if lib.nvmlSystemGetCudaDriverVersion_v2(ctypes.byref(v)) == 0:
            out["cuda_driver_api"] = f"{v.value // 1000}.{v.value % 1000 // 10}"  # e.g. 13000 -> 13.0
        lib.nvmlShutdown()
        return out
    except (OSError, AttributeError):
        return {}


def cuda_driver() -> dict[str, str]:
    """The NVIDIA driver version (and the CUDA version it supports, and the compute capability) if readable.

    NVML first (``libnvidia-ml.so.1``, the library mlx itself opens in
    cuda/device_info.cpp), then ``nvidia-smi``; ``{}`` when neither answers.
    """
    out = _nvml_driver()
    smi = shutil.which("nvidia-smi")
    if smi and ("cuda_driver" not in out or "compute_capability" not in out):
        try:
            text = subprocess.run([smi, "--query-gpu=driver_version,compute_cap", "--format=csv,noheader"],
                                  capture_output=True, text=True, timeout=10).stdout
            out = {**parse_nvidia_smi(text), **out}
        except (OSError, subprocess.SubprocessError):
            pass
    return out


__all__ = ["macos_version", "backend_wheels", "device_memory", "parse_nvidia_smi", "cuda_driver"]
