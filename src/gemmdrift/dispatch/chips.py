"""Which chip a result ran on, from its environment record, or from a name the user gives.

Metal: mlx reads the chip from the architecture string ``applegpu_gNNx``
(``Device::Device`` in mlx/backend/metal/device.cpp at 846d176: ``arch_gen_``
is the two digits before the last character, and the last character is the
size class). NAX (the M5 matrix units) is ``metal::is_nax_available()``
(device.cpp at 846d176, device.h at v0.30.5): gen >= 17 (18 for ``p``) and
``__builtin_available(macOS 26.2)``, in a build without ``MLX_METAL_NO_NAX``
(mlx/backend/metal/kernels/CMakeLists.txt: the NAX kernels need the macOS SDK
26.2). So the architecture plus the macOS version decide it; the build is
assumed to carry NAX (the note says so).

CUDA: the architecture is ``sm_XY`` (mlx/backend/cuda/device_info.cpp), also
recorded as ``compute_capability_major``/``minor``; dispatch reads the major
only (``compute_capability_major()`` in cuda/quantized/qmm/qmm.cu).

CPU: the rules were read for Linux x86_64 (``cpu-linux-x86``); every other
platform is ``cpu-other``, "not read" (macOS uses Accelerate and BNNS,
mlx/backend/cpu/CMakeLists.txt ``MLX_BUILD_ACCELERATE``; Linux aarch64 takes
the NEON simd path).

An architecture this module cannot read gives ``None``: said, never guessed.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any, Mapping

from ..errors import GemmdriftError
from .base import MIRROR_VERSION, Chip, parse_version

# mlx's own comments on the size letter (device.cpp). A third-party record shows an M4 Pro as
# applegpu_g16s, so "s" may cover Pro chips too: the letter, not the marketing name, decides dispatch.
SIZE_LABEL = {"p": "phone", "g": "base/Pro", "s": "Max", "d": "Ultra", "c": "c-class"}
_METAL_ARCH = re.compile(r"^applegpu_g(\d\d)([a-z])$")
_SM_ARCH = re.compile(r"^sm_?(\d+?)(\d)$")
NAX_MACOS = (26, 2)
NAX_MLX = (0, 30, 0)  # is_nax_available and the NAX kernels first appear in v0.30.0 (absent at v0.29.4)
TF32_VAR = "MLX_ENABLE_TF32"

CPU_LINUX_X86 = "cpu-linux-x86"
CPU_OTHER = "cpu-other"


def _metal(gen: int, size: str, *, nax: bool | None = None, arch: str = "", note: str = "") -> Chip:
    m_name = f"M{gen - 12}" if 13 <= gen <= 17 and size != "p" else f"applegpu_g{gen}{size}"
    suffix = {"s": " Max", "d": " Ultra"}.get(size, "")
    if nax is None and not note:
        nax = nax_capable(gen, size)
    return Chip(m_name + suffix, "metal", gen, size, nax, arch or f"applegpu_g{gen}{size}", note=note)


def nax_capable(gen: int, size: str) -> bool:
    """The hardware half of is_nax_available (device.cpp): gen >= 17, or >= 18 for phones."""
    return gen >= (18 if size == "p" else 17)


def _cuda(major: int, minor: int, arch: str = "") -> Chip:
    return Chip(f"sm{major}{minor}", "cuda", major, minor=minor, arch=arch or f"sm_{major}{minor}")


# Named chips for --chip. Names for M-series sizes are the common ones; Pro chips are not named
# because their letter is not settled (see SIZE_LABEL). NAX chips are named with NAX on (macOS >= 26.2).
CHIPS: dict[str, Chip] = {c.name: c for c in (
    _metal(13, "g"), _metal(13, "s"), _metal(13, "d"),
    _metal(14, "g"), _metal(14, "s"), _metal(14, "d"),
    _metal(15, "g"), _metal(15, "s"), _metal(15, "d"),
    _metal(16, "g"), _metal(16, "s"),
    _metal(17, "g"), _metal(17, "s"),
    _cuda(7, 5), _cuda(8, 0), _cuda(8, 6), _cuda(8, 9), _cuda(9, 0), _cuda(10, 0), _cuda(12, 0),
    Chip(CPU_LINUX_X86, "cpu"),
)}
DEFAULT_CHIP = {"metal": "M3 Max", "cuda": "sm90"}  # only to label CPU data with a GPU's rules, as "reference"


def _key(name: str) -> str:
    return re.sub(r"[\s_\-]+", "", name.lower())


def chip_named(name: str) -> Chip:
    """The chip called ``name``: "M1", "M2 Ultra", "M3 Max", "M5", "sm80", "sm_90", "applegpu_g15s", "cpu"...

    An architecture string (``applegpu_gNNx``, ``sm_XY``) gives that chip even
    if it has no name here. Unknown names raise a one-line GemmdriftError.
    """
    text = str(name or "").strip()
    if _key(text) in ("cpu", _key(CPU_LINUX_X86)):
        return CHIPS[CPU_LINUX_X86]
    if _key(text) == _key(CPU_OTHER):
        return Chip(CPU_OTHER, "cpu", note="CPU dispatch not read for this platform")
    for chip in CHIPS.values():
        if _key(chip.name) == _key(text):
            return chip
    m = _METAL_ARCH.match(text.lower())
    if m:
        return _metal(int(m.group(1)), m.group(2))
    m = _SM_ARCH.match(text.lower())
    if m:
        return _cuda(int(m.group(1)), int(m.group(2)))
    known = ", ".join(CHIPS)
    raise GemmdriftError(f"unknown chip {name!r} (known: {known}, or an architecture like applegpu_g15s or sm_86)")


def _macos(env: Mapping[str, Any]) -> tuple[int, int] | None:
    text = env.get("macos") or ""
    m = re.match(r"\s*(\d+)(?:\.(\d+))?", str(text))
    return (int(m.group(1)), int(m.group(2) or 0)) if m else None


def _record_version(text: Any):
    try:
        return parse_version(str(text or ""))
    except GemmdriftError:
        return None


def record_tf32(env: Mapping[str, Any]) -> bool:
    """``MLX_ENABLE_TF32`` of an environment record, read as mlx reads it (``env::get_var``, C's atoi: unset is
    1, ``0``, ``false`` or an empty string is 0)."""
    text = (env.get("env") or {}).get(TF32_VAR)
    if text is None:
        return True
    m = re.match(r"\s*([+-]?\d+)", str(text))
    return (int(m.group(1)) if m else 0) != 0


def chip_from_env(env: Mapping[str, Any], mlx_version: str | None = None) -> Chip | None:
    """The chip of an environment record (:func:`gemmdrift.machine.envinfo.environment`), or None if it cannot be read.

    Reads ``backend``, ``architecture`` (Metal ``applegpu_gNNx``, CUDA ``sm_XY``),
    ``compute_capability_major``/``minor`` (CUDA), ``macos`` (the macOS version,
    for NAX), ``mlx`` (NAX code exists from 0.30.0), and ``os``/``machine`` for the
    CPU. ``mlx_version`` is the release whose reading is wanted (default the record's).

    Metal: an Apple chip (``applegpu_gNN<letter>``) is named as one. Any other name (a hosted runner's
    "Apple Paravirtual device", ``air64_v26``), and any name ``MLX_METAL_GPU_ARCH`` gives in the record's
    ``env`` where the release reads it (from 0.31.0; before, mlx ignores it), is read as mlx reads it
    (:mod:`.archname`): a Chip labelled with the device as it reported itself, never a chip model's name,
    whose note says "mlx X reads 'NAME' as generation G, size 'S'". None only where mlx's own reading is
    undefined (a name shorter than three characters before 0.31.0).
    CPU. From the record's ``env``: ``MLX_ENABLE_TF32`` (``Chip.tf32``: float32 on NAX or TF32 unless 0) and
    ``MLX_METAL_GPU_ARCH``, which overrides the Metal architecture as it does in mlx from v0.31.0
    (``env::metal_gpu_arch()`` in Device::Device, #3176; an older release reads the device's own, and the
    override is then ignored, with a note). Each setting that can decide a kernel goes into ``Chip.settings``
    with the chip as it would be without it, so :func:`~gemmdrift.dispatch.choose` names the one that did.
    """
    backend = env.get("backend")
    arch = str(env.get("architecture") or "").strip()
    tf32 = record_tf32(env)
    if backend == "metal":
        from .archname import ARCH_OVERRIDE_VAR, read_arch

        version = _record_version(mlx_version or env.get("mlx"))
        override = str((env.get("env") or {}).get(ARCH_OVERRIDE_VAR) or "").strip()
        reading = read_arch(arch, version or MIRROR_VERSION, override)
        if reading.override_used and override != arch:
            # The chip mlx dispatched for, and the setting that decided it, with the device's own chip.
            own = chip_from_env({**env, "env": {k: v for k, v in (env.get("env") or {}).items()
                                                if k != ARCH_OVERRIDE_VAR}}, mlx_version)
            chip = _metal_reading(reading, env, tf32, version, apple_device=bool(_METAL_ARCH.match(arch)))
            if chip is None:
                return None
            return replace(chip, settings=chip.settings + ((f"{ARCH_OVERRIDE_VAR}={override}", own if own is None
                                                            else replace(own, settings=())),))
        # An override equal to the recorded architecture: mlx from 0.31.0 reports the override as the architecture,
        # so the device's own is not in the record; it is labelled as the device it reported itself to be.
        chip = _metal_reading(reading, env, tf32, version, apple_device=not reading.override_used)
        if chip is not None and override and not reading.override_used:  # set, but this release does not read it
            chip = replace(chip, note="; ".join(n for n in (chip.note, reading.text()) if n))
        return chip
    if backend == "cuda":
        major, minor = env.get("compute_capability_major"), env.get("compute_capability_minor")
        if major is not None and minor is not None:
            chip = _cuda(int(major), int(minor), arch)
        else:
            m = _SM_ARCH.match(arch.lower())
            if not m:
                return None
            chip = _cuda(int(m.group(1)), int(m.group(2)), arch)
        return chip if tf32 else replace(chip, tf32=False, settings=((f"{TF32_VAR}=0", chip),))
    if backend == "cpu":
        system = str(env.get("os") or "").split(" ")[0]
        machine = str(env.get("machine") or "")
        if system == "Linux" and machine.lower() in ("x86_64", "amd64"):
            return CHIPS[CPU_LINUX_X86]
        where = f"{system or 'unknown system'} {machine or 'unknown machine'}"
        return Chip(CPU_OTHER, "cpu", arch=machine, note=f"{where}: CPU dispatch not read for this platform")
    return None


def _metal_reading(reading, env: Mapping[str, Any], tf32: bool, version, apple_device: bool = True) -> Chip | None:
    """The Metal chip of mlx's reading of a name: an Apple chip (``applegpu_gNN<letter>``, read on an Apple chip)
    by :func:`_metal_record`; any other device (a hosted runner's paravirtual one, or a name given through
    MLX_METAL_GPU_ARCH on such a device) labelled as it reported itself, with mlx's reading in its note."""
    from .archname import nax_available

    if _METAL_ARCH.match(reading.name) and (apple_device or not reading.override_used):
        return _metal_record(reading.name, env, tf32)
    if reading.gen is None:
        return None
    nax, why = nax_available(reading, _macos(env))
    device = str(env.get("device_name") or "unnamed device")
    unread = "" if version else "; mlx version not recorded: read as the newest release read here"
    name = f"{device} as {reading.name}" if reading.override_used else f"{device} ({reading.name})"
    chip = Chip(name, "metal", reading.gen, reading.size, nax, reading.name,
                note=f"{reading.text()}; {why}{unread}", device=device, tf32=tf32)
    return replace(chip, settings=((f"{TF32_VAR}=0", replace(chip, tf32=True)),) if not tf32 else ())


def _metal_record(arch: str, env: Mapping[str, Any], tf32: bool) -> Chip | None:
    """The Metal chip ``arch`` with the record's macOS, mlx and MLX_ENABLE_TF32 (None: not an applegpu_gNNx)."""
    m = _METAL_ARCH.match(arch)
    if not m:
        return None
    gen, size = int(m.group(1)), m.group(2)
    macos_decides = False
    if not nax_capable(gen, size):
        chip = _metal(gen, size, nax=False, arch=arch)
    else:
        try:
            new_enough = parse_version(env.get("mlx") or "") >= NAX_MLX
        except GemmdriftError:
            new_enough = None
        macos = _macos(env)
        if new_enough is False:
            chip = _metal(gen, size, nax=False, arch=arch, note=f"mlx {env.get('mlx')} has no NAX kernels")
        elif macos is None or new_enough is None:
            missing = "macOS version" if macos is None else "mlx version"
            chip = _metal(gen, size, nax=None, arch=arch, note=f"{missing} not recorded: NAX unknown")
        elif macos < NAX_MACOS:
            chip, macos_decides = _metal(gen, size, nax=False, arch=arch,
                                         note=f"macOS {env.get('macos')} < 26.2: no NAX"), True
        else:
            chip = _metal(gen, size, nax=True, arch=arch,
                          note=f"NAX: macOS {env.get('macos')}, assuming a wheel built with the NAX kernels "
                               "(SDK 26.2+)")
            macos_decides = True
    chip = replace(chip, tf32=tf32)
    settings = []
    if macos_decides:
        settings.append((f"macOS {env.get('macos')} (NAX from 26.2)", replace(chip, nax=not chip.nax)))
    if not tf32:
        settings.append((f"{TF32_VAR}=0", replace(chip, tf32=True)))
    return replace(chip, settings=tuple(settings))


# A hosted macOS runner's GPU: "Apple Paravirtual device", architecture air64_v26 / air64_v27 (the Metal AIR
# target, not a chip; VeloxQuant-MLX #395, Mac-MLX #55). It is no Apple chip model, but mlx reads its name as
# it reads any (archname.py), so its dispatch is knowable: mlx's own, for that reading.
_PARAVIRTUAL = re.compile(r"^air\d+_v\d+$")


def not_a_chip(env: Mapping[str, Any], mlx_version: str | None = None) -> str | None:
    """One line saying that an environment record's GPU is not an Apple chip model (or not readable), or None.

    None for an Apple chip (``applegpu_gNN<size>``), a CUDA ``sm_XY`` and a CPU (whose platform
    :func:`chip_from_env` names). For any other Metal device (a paravirtual GPU, a name given by
    ``MLX_METAL_GPU_ARCH``) the line keeps the device as it reports itself and says how mlx reads its
    architecture name: its dispatch, replay and calibration are mlx's for that reading, under the device's
    own label. Where not even mlx's reading is defined, the line says that nothing applies.
    """
    if env.get("backend") == "cpu":
        return None
    chip = chip_from_env(env, mlx_version)
    if chip is not None and not chip.device:
        return None
    backend = str(env.get("backend") or "unknown backend")
    name = str(env.get("device_name") or "unnamed device")
    arch = str(env.get("architecture") or "")
    if _PARAVIRTUAL.match(arch) or "paravirtual" in name.lower():
        kind = "a paravirtual GPU (a virtual machine's, such as a hosted CI runner's), not an Apple GPU chip model"
    elif backend == "metal":
        kind = "not an Apple GPU chip model (applegpu_gNN<size>)"
    else:
        kind = "not a GPU architecture this release reads"
    where = f"this device ({backend}, {name!r}, architecture {arch!r}) is {kind}"
    if chip is not None:
        return f"{where}: {chip.note}; its dispatch is mlx's own for that reading, labelled as the device itself"
    return f"{where}: recorded as it reports itself; no chip's dispatch, replay, prediction or calibration applies to it"


def describe_chip(chip: Chip) -> str:
    """'M5 Max (applegpu_g17s, gen 17, Max, NAX)', 'sm90 (sm_90)', 'cpu-other (Darwin arm64: ...)', and for a
    device that is not a chip model "Apple Paravirtual device (air64_v26): mlx 0.32.4 reads 'air64_v26' as ..."."""
    if chip.device:
        return f"{chip.name}: {chip.note}"
    if chip.backend == "metal":
        nax = {True: "NAX", False: "no NAX", None: "NAX unknown"}[chip.nax]
        ignored = f"; {chip.note}" if "MLX_METAL_GPU_ARCH" in chip.note else ""  # set, not read by that release
        return f"{chip.name} ({chip.arch}, gen {chip.gen}, {SIZE_LABEL.get(chip.size, chip.size)}, {nax}){ignored}"
    if chip.backend == "cuda":
        return f"{chip.name} ({chip.arch})"
    return chip.name + (f" ({chip.note})" if chip.note else "")


__all__ = ["CHIPS", "DEFAULT_CHIP", "SIZE_LABEL", "CPU_LINUX_X86", "CPU_OTHER", "chip_named", "chip_from_env",
           "record_tf32",
           "describe_chip", "nax_capable", "not_a_chip"]
