"""The vocabulary of :mod:`gemmdrift.dispatch`: a device (:class:`Chip`), a kernel choice (:class:`Choice`),
the mlx source files the rules were read from, and version parsing. Standard library only.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from ..errors import GemmdriftError

# The mlx checkout every rule was read from (ml-explore/mlx), and the release tags compared with it.
MIRROR_REVISION = "846d176 (mlx 0.32.2)"
MIRROR_VERSION = (0, 32, 2)
# The oldest tag read (issue 54: every commit that touched the files of dispatch.tags.SOURCES from v0.26.5 on was
# read, and each rule change is a named rule of dispatch.commits); dispatch.tags.READ_FROM gives it per backend and op.
VERIFIED_FROM = (0, 26, 5)
# The tags whose dispatch sources were read as whole trees (the changelog lists them as releases of their own); the
# others from VERIFIED_FROM were read through every commit between consecutive tags.
TAGS_READ = ("v0.30.5", "v0.31.2", "v0.32.0", "v0.32.1", "846d176")

METAL_MATMUL = "mlx/backend/metal/matmul.cpp"
METAL_QUANTIZED = "mlx/backend/metal/quantized.cpp"
METAL_SDPA = "mlx/backend/metal/scaled_dot_product_attention.cpp"
METAL_DEVICE = "mlx/backend/metal/device.cpp"
CUDA_MATMUL = "mlx/backend/cuda/matmul.cpp"
CUDA_GEMV = "mlx/backend/cuda/gemms/gemv.cu"
CUDA_QUANTIZED = "mlx/backend/cuda/quantized/quantized.cpp"
CUDA_QMM = "mlx/backend/cuda/quantized/qmm/qmm.cu"
CUDA_SDPA = "mlx/backend/cuda/scaled_dot_product_attention.cpp"
CUDA_SDPA_VECTOR = "mlx/backend/cuda/scaled_dot_product_attention.cu"
CPU_MATMUL = "mlx/backend/cpu/matmul.cpp"
CPU_SIMD_GEMM = "mlx/backend/cpu/gemms/simd_gemm.h"
CPU_CBLAS = "mlx/backend/cpu/gemms/cblas.cpp"
CPU_QUANTIZED = "mlx/backend/cpu/quantized.cpp"
FAST_SDPA = "mlx/fast.cpp"

BACKENDS = ("metal", "cuda", "cpu")
OPS = ("matmul", "quantized_matmul", "sdpa")

Version = tuple[int, int, int]


@dataclass(frozen=True)
class Chip:
    """A device as mlx's dispatch code sees it.

    Metal: ``gen`` is the architecture generation of ``applegpu_gNNx`` (13 = M1
    ... 17 = M5; ``Device::Device`` in mlx/backend/metal/device.cpp reads the two
    digits before the last letter) and ``size`` that last letter (mlx's comments:
    ``p`` phone, ``g`` "base, pro", ``s`` "max", ``d`` "ultra"). ``nax`` says
    whether ``metal::is_nax_available()`` holds: gen >= 17 (18 for ``p``), macOS
    26.2 or later and a wheel built with the NAX kernels; ``None`` when the
    record cannot tell (the macOS version was not recorded).

    CUDA: ``gen`` is the compute-capability major, ``minor`` its minor.

    A device that is not an Apple chip model (``device`` set) has mlx's own reading of its architecture
    name as ``gen`` and ``size`` (:mod:`gemmdrift.dispatch.archname`): ``air64_v26`` is generation 2, size
    ``6`` from mlx 0.31.0 (702 before), and the rules dispatch on that reading as mlx does.

    CPU: ``name`` is ``cpu-linux-x86`` (the platform the CPU rules were read
    for) or ``cpu-other`` (any other platform: not read), ``gen`` 0.

    ``tf32`` is ``MLX_ENABLE_TF32`` (mlx's default 1: float32 may take NAX on Metal and TF32 on CUDA);
    :func:`~gemmdrift.dispatch.chips.chip_from_env` sets it from the record. ``settings`` are the record's
    settings that can decide a kernel, each with the chip as it would be without it (``MLX_ENABLE_TF32=0``,
    ``MLX_METAL_GPU_ARCH=...``, the macOS version): :func:`~gemmdrift.dispatch.choose` names the one that
    changed a kernel ("MLX_ENABLE_TF32=0 decided: steel_gemm, not steel_gemm_nax").
    """

    name: str
    backend: str
    gen: int = 0
    size: str = "g"
    nax: bool | None = False
    arch: str = ""  # the recorded architecture string, when built from a record
    minor: int = 0
    note: str = ""  # what the record left open (e.g. "macOS version not recorded: NAX unknown")
    # Set when the device is not an Apple chip model (a hosted runner's "Apple Paravirtual device", or any
    # name under MLX_METAL_GPU_ARCH): the device as it reported itself; gen and size are then mlx's own
    # reading of the architecture name (dispatch/archname.py) and ``note`` says it.
    device: str = ""
    tf32: bool = True  # MLX_ENABLE_TF32 (mlx's default 1)
    settings: tuple = ()  # ((what, the chip without it), ...): the settings that may decide a kernel


@dataclass(frozen=True)
class Choice:
    """The kernel mlx dispatches for one call, in mlx's own spelling, with what decides its reduction order.

    Attributes:
        kernel: e.g. ``gemv``, ``gemv_wide``, ``steel_gemm``, ``steel_gemm_splitk``,
            ``steel_gemm_nax``, ``steel_gemm_splitk_nax``, ``dot_product``, ``qmv``,
            ``qmv_fast``, ``qmv_quad``, ``qmv_wide``, ``qmm_t``, ``qmm_t_splitk``,
            ``qmm_t_nax``, ``sdpa_vector``, ``sdpa_vector_2pass``, ``sdpa_full``,
            ``sdpa_full_nax``, ``sdpa_unfused``, ``cuda_gemv``, ``cublaslt``,
            ``cuda_qmv``, ``cuda_fp_qmv``, ``cuda_qmm`` (params ``variant``: sm90, sm80,
            naive), ``cudnn_sdpa``, ``cuda_sdpa_vector``, ``cpu_simd_gemm``,
            ``cpu_cblas_sgemm``, ``cpu_qmm``, ``cpu_not_read``, ``unsupported``.
        params: the tile/partition parameters that decide the order (see each rule).
        source: the repo-relative mlx file and function the rule was read from.
        note: what the source does not settle (e.g. "cuBLASLt: algorithm not knowable from source").
    """

    kernel: str
    params: Mapping[str, Any] = field(default_factory=dict)
    source: str = ""
    note: str = ""

    def __post_init__(self):
        object.__setattr__(self, "params", MappingProxyType(dict(self.params)))

    def __hash__(self) -> int:  # params is a read-only mapping: hash its items (all ints, strs and bools)
        return hash((self.kernel, tuple(sorted(self.params.items())), self.source, self.note))

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``params`` as a plain dict)."""
        return {"kernel": self.kernel, "params": dict(self.params), "source": self.source, "note": self.note}


def parse_version(text: str) -> Version:
    """'0.32.4' (or '0.32.4.dev20260801+abc') -> (0, 32, 4)."""
    m = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", str(text))
    if not m:
        raise GemmdriftError(f"cannot read mlx version {text!r} (expected e.g. 0.31.2)")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def next_power_of_2(n: int) -> int:
    """mlx/utils.h next_power_of_2: n itself if a power of two, else 2**ceil(log2 n) (1 for n <= 1)."""
    return 1 if n <= 1 else 2 ** math.ceil(math.log2(n))


def cdiv(a: int, b: int) -> int:
    """C++'s (a + b - 1) / b for positive ints."""
    return -(-a // b)


def pack_factor(bits: int, wsize: int = 8) -> int:
    """get_pack_factor(bits, wsize) of mlx/backend/common/quantized.h (3 and 5 bits: 8, 6 bits: 4)."""
    return 8 if bits in (3, 5) else (4 if bits == 6 else wsize // bits)


__all__ = ["Chip", "Choice", "parse_version", "next_power_of_2", "cdiv", "pack_factor", "MIRROR_REVISION",
           "MIRROR_VERSION", "VERIFIED_FROM", "TAGS_READ", "BACKENDS", "OPS", "Version"]
