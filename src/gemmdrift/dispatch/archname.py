"""How each mlx release reads a Metal architecture name: generation, size class, NAX, and MLX_METAL_GPU_ARCH.

mlx never refuses an architecture name. ``Device::Device`` (mlx/backend/metal/device.cpp) takes the last
three characters of whatever the Metal driver reports (or, from v0.31.0, ``MLX_METAL_GPU_ARCH``): the
generation is ``(name[-3] - '0') * 10 + (name[-2] - '0')`` and the size class is the last character. A
hosted macOS runner's "Apple Paravirtual device" reports ``air64_v26`` (or ``air64_v27``), and every release
reads it too, as something. Read from the mirror of ml-explore/mlx at every tag from v0.26.5 to v0.32.1 and
846d176 (``git log v0.26.5..846d176 -- mlx/backend/metal/device.cpp``: 27 commits; the parse changed in one):

* v0.26.5 .. v0.30.6: ``arch_gen_ = ag_tens * 10 + ag_ones`` with no check, so ``air64_v26`` reads
  ``('v' - '0') * 10 + ('2' - '0') = 70 * 10 + 2 = 702`` (a name shorter than three characters is
  undefined behaviour: an out-of-range read).
* v0.31.0 on (d7a553c, "Enable passing in a GPU architecture string via env var", #3176): the name is
  ``env::metal_gpu_arch()`` (``MLX_METAL_GPU_ARCH``, read once, empty means unset) or the driver's; a digit
  outside 0..9 counts as 0 and a name shorter than three characters gives 0, so ``air64_v26`` reads
  ``0 * 10 + 2 = 2``. Before v0.31.0 the variable does nothing.
* The size class is ``arch_.back()`` at every tag; the switch (``p`` phone, ``g`` "base, pro", ``s`` "max",
  ``d`` "ultra", anything else "default to medium") is byte-identical from v0.26.5 to 846d176, and the
  dispatch rules read the same letter (``devc`` in matmul.cpp and scaled_dot_product_attention.cpp), so
  ``6`` and ``7`` take every rule's default branch.
* ``is_nax_available()``: no NAX code before v0.30.0; v0.30.0 ``gen >= 17`` in a build with
  ``MLX_ENABLE_NAX`` (Metal 4 and the macOS 26.2 SDK, no run-time check; 54f1cc6, #2772); from v0.30.1 also
  ``__builtin_available(macOS 26.2)`` at run time (0dbc7e5, #2811); from v0.30.3 ``MLX_METAL_NO_NAX`` builds
  say no (8654b82, #2982); from v0.30.5 phones (``p``) need ``gen >= 18`` (cc6e4ee, #3083). So from v0.30.1
  to v0.30.6 a paravirtual device (generation 702) on macOS 26.2 or later is sent to the NAX kernels, and
  from v0.31.0 (generation 2) never.

Standard library only, like the rest of :mod:`gemmdrift.dispatch`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Version

ARCH_OVERRIDE_VAR = "MLX_METAL_GPU_ARCH"
ARCH_OVERRIDE_FROM: Version = (0, 31, 0)  # d7a553c (#3176): the variable, and digits clamped to 0..9
ARCH_OVERRIDE_COMMIT = "d7a553c (#3176)"
FIRST_READ: Version = (0, 26, 5)
SIZE_CLASS = {"p": "phone", "g": "base/Pro", "s": "Max", "d": "Ultra"}  # device.cpp's switch; else medium
NAX_FROM: Version = (0, 30, 0)  # 54f1cc6 (#2772)
NAX_RUNTIME_CHECK_FROM: Version = (0, 30, 1)  # 0dbc7e5 (#2811): __builtin_available(macOS 26.2)
NAX_PHONE_FROM: Version = (0, 30, 5)  # cc6e4ee (#3083): gen >= 18 for 'p'
NAX_MACOS = (26, 2)


@dataclass(frozen=True)
class ArchReading:
    """What one mlx release makes of one architecture name.

    ``name`` is the name mlx read (the override's, when it applies), ``gen`` its generation (None: undefined,
    a name shorter than three characters before v0.31.0), ``size`` the last character and ``size_class``
    device.cpp's word for it. ``override`` is ``MLX_METAL_GPU_ARCH`` when set; ``override_used`` whether
    this release reads it.
    """

    name: str
    gen: int | None
    size: str
    size_class: str
    version: Version
    override: str = ""
    override_used: bool = False
    device_arch: str = ""  # the architecture the device reported (may be the override's, see chips.py)

    def text(self) -> str:
        """"mlx 0.31.2 reads 'air64_v26' as generation 2, size '6' (medium: mlx's default)"."""
        v = ".".join(map(str, self.version))
        gen = "an undefined generation (a name shorter than 3 characters)" if self.gen is None else \
            f"generation {self.gen}"
        size = f"size {self.size!r} ({self.size_class})" if self.size else "no size character"
        out = f"mlx {v} reads {self.name!r} as {gen}, {size}"
        if self.override and self.override_used:
            out = f"{ARCH_OVERRIDE_VAR}={self.override} is used: " + out
        elif self.override:
            out += (f"; {ARCH_OVERRIDE_VAR}={self.override} ignored: it is set but mlx {v} does not read it "
                    f"(from 0.31.0, {ARCH_OVERRIDE_COMMIT})")
        return out


def read_arch(device_arch: str, version: Version, override: str | None = None) -> ArchReading:
    """The generation and size class mlx ``version`` reads from ``device_arch`` (or the override)."""
    override = str(override or "")
    used = bool(override) and version >= ARCH_OVERRIDE_FROM
    name = override if used else str(device_arch or "")
    size = name[-1:] if name else ""
    size_class = SIZE_CLASS.get(size, "medium: mlx's default" if size else "")
    if version >= ARCH_OVERRIDE_FROM:
        if len(name) >= 3:
            digits = [ord(c) - ord("0") for c in name[-3:-1]]
            tens, ones = (d if 0 <= d < 10 else 0 for d in digits)
            gen: int | None = tens * 10 + ones
        else:
            gen = 0
    else:
        gen = (ord(name[-3]) - 48) * 10 + (ord(name[-2]) - 48) if len(name) >= 3 else None
    return ArchReading(name, gen, size, size_class, version, override, used, str(device_arch or ""))


def nax_available(reading: ArchReading, macos: tuple[int, int] | None) -> tuple[bool | None, str]:
    """``metal::is_nax_available()`` at ``reading.version`` for that reading on macOS ``macos``: (answer, why).

    None when the answer rests on what the record does not hold (the macOS version; at v0.30.0 the build).
    A wheel is assumed to carry the NAX kernels from v0.30.1 (a ``MLX_METAL_NO_NAX`` build says no).
    """
    v, gen = reading.version, reading.gen
    if v < NAX_FROM:
        return False, f"mlx {'.'.join(map(str, v))} has no NAX kernels"
    need = 18 if reading.size == "p" and v >= NAX_PHONE_FROM else 17
    if gen is None or gen < need:
        return False, f"generation {gen} < {need}: no NAX"
    if v < NAX_RUNTIME_CHECK_FROM:
        return None, f"generation {gen} >= {need}: NAX in a build with the macOS 26.2 SDK (no run-time check)"
    if macos is None:
        return None, f"generation {gen} >= {need}; macOS version not recorded: NAX unknown"
    if macos < NAX_MACOS:
        return False, f"generation {gen} >= {need}, but macOS {macos[0]}.{macos[1]} < 26.2: no NAX"
    return True, f"generation {gen} >= {need} and macOS {macos[0]}.{macos[1]} >= 26.2: NAX"


__all__ = ["ArchReading", "read_arch", "nax_available", "ARCH_OVERRIDE_VAR", "ARCH_OVERRIDE_FROM", "FIRST_READ",
           "SIZE_CLASS"]
