"""What a measuring process fixes before its first matmul, and what its resume keys must know.

Two things decide a figure besides the model and its inputs, and neither can be
changed once mlx has computed in a process:

* ``MLX_ENABLE_TF32``: float32 matmul-family ops are TF32 on CUDA and on NAX
  (M5-class) Metal GPUs unless it is 0, and mlx reads it once per process
  (see :mod:`gemmdrift.machine.envinfo`). Every measuring command sets it to 0 before
  anything computes, unless the user keeps it (``--tf32 keep``).
* the device: ``GEMMDRIFT_DEVICE`` (cpu or gpu) is the default of ``--device``,
  so a test suite (or a user) pins every command it starts.

:func:`compute_record` is the part of every resume key and checkpoint record
that names where a run computed: backend, device, architecture, macOS version
and every ``MLX_*`` variable. A run resumed elsewhere, or under another
setting, recomputes instead of reusing another machine's numbers.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from ..errors import GemmdriftError
from .platforminfo import macos_version  # decides NAX on M5-class GPUs

DEVICE_VAR = "GEMMDRIFT_DEVICE"

# The commands that compute with mlx; env, report, history and gate only read or describe.
MEASURING = ("stack", "kernels", "diverge", "triage", "state", "run", "fingerprint", "batch", "server", "logits",
             "compare", "replay check", "attribute", "upgrade")

TF32_HELP = ("off (default): set MLX_ENABLE_TF32=0 before the first matmul, so float32 is true float32 on CUDA "
             "and M5-class GPUs; keep: leave MLX_ENABLE_TF32 as it is (recorded)")


def add_flags(sub) -> None:
    """``--tf32`` on every measuring command of the CLI's subparsers ``sub``, and ``--device`` on ``env``."""
    for name, p in _parsers(sub):
        if name in MEASURING:
            p.add_argument("--tf32", choices=["off", "keep"], default="off", help=TF32_HELP)
            p.set_defaults(measuring=True)
    if "env" in sub.choices:
        sub.choices["env"].add_argument("--device", choices=["cpu", "gpu"],
                                        help=f"describe this mlx device (default: ${DEVICE_VAR}, else mlx's choice)")


def _parsers(sub, prefix: str = ""):
    """(name, parser) of every command and nested subcommand ("replay check") of the subparsers ``sub``."""
    for name, p in sub.choices.items():
        yield prefix + name, p
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                yield from _parsers(action, f"{prefix}{name} ")


def env_device() -> str | None:
    """The device ``GEMMDRIFT_DEVICE`` names (None when unset or empty); another value is a user error."""
    value = os.environ.get(DEVICE_VAR, "").strip().lower()
    if value in ("", "default"):
        return None
    if value not in ("cpu", "gpu"):
        raise GemmdriftError(f"{DEVICE_VAR}={os.environ[DEVICE_VAR]!r}: expected cpu or gpu")
    return value


def prepare(args) -> None:
    """What the CLI does for a command before its handler runs (before any model loads or mlx computes).

    ``--device`` defaults to ``GEMMDRIFT_DEVICE``; a measuring command forces
    true float32 unless ``--tf32 keep``, and the choice goes into every
    environment record (``envinfo.TF32_POLICY``, with the variable itself).
    """
    from . import envinfo

    if hasattr(args, "device") and args.device is None:
        args.device = env_device()
    if getattr(args, "measuring", False):
        if args.tf32 != "keep":
            envinfo.force_true_float32()  # before mlx's first matmul: mlx reads MLX_ENABLE_TF32 once
        envinfo.TF32_POLICY = args.tf32
    if getattr(args, "measuring", False) or getattr(args, "command", None) == "env":
        from .backends import require_mlx

        require_mlx()  # mlx-cuda without a driver: one line, before any work (issue 53, item 8)
    if getattr(args, "device", None) is not None:
        envinfo.select_device(args.device)  # a GPU this mlx cannot see fails here, before any model loads


def compute_record() -> dict[str, Any]:
    """Where and how this process computes, for resume keys and checkpoint records: the backend, device and
    architecture of mlx's default device (:func:`gemmdrift.machine.envinfo.device_record`), the macOS version and
    every ``MLX_*`` environment variable."""
    from .envinfo import device_record

    rec = device_record()
    return {"backend": rec.get("backend"), "device": rec.get("device"), "architecture": rec.get("architecture"),
            "macos": macos_version(),
            "mlx_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("MLX_")}}


def rung_true_float32() -> dict[str, Any]:
    """The fp32 probe for a float32 rung (:func:`gemmdrift.machine.envinfo.probe_fp32_matmul` on the default device):
    ``{"rel_err", "true_float32", "shape"}``. A rung that is not true float32 cannot tell rounding from a
    bug: bf16 to TF32 gains 3 mantissa bits, so rounding shrinks ~8x, not the 100x a verdict needs."""
    from .envinfo import probe_fp32_matmul

    return probe_fp32_matmul()


def unreliable_reason(probe: dict[str, Any] | None = None) -> str:
    """One phrase for a verdict that a rung which is not true float32 made unreliable."""
    err = f", probe GEMM relative error {probe['rel_err']:.2g}" if probe and "rel_err" in probe else ""
    return (f"the float32 rung is not true float32 (TF32{err}; rerun in a new process with MLX_ENABLE_TF32=0): "
            "unreliable")
