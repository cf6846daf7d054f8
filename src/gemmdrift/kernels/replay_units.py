"""Replay, part 7: ``gemmdrift kernels --kernels replay:<chip>[@variant]``, the GEMV-vs-GEMM table predicted
for a chip on the real captured rows.

Each (projection, path) unit of the sweep runs its operator through the replay proxy of
:mod:`.replay_model` (the same ``_Replay`` that stands in for a projection in a replayed model): T=1 with
the chip's T=1 recipe, each block with the recipe the chip dispatches at that T. What the chip would compute
cannot be replayed everywhere, and nothing is then computed natively in its place:

* ``emulated:splitk<P>`` is a negative control, not a kernel: its units are skipped;
* a quantization mode or dtype without a recipe: the unit is skipped;
* a block size whose kernel has no known order (NAX on M5 at T >= 16, cuBLASLt on sm90 at T > 1): that T
  is skipped, the others are measured.

:func:`plan_unit` decides this before any unit runs (in the main process, so the record is whole even when
units run in worker processes, each building its own proxy with :func:`replay_operator`); every skip is
kept with its reason in ``details["replay"]["skipped"]``. The input rows are the ones captured with this
machine's kernels (the same rows for every chip).
"""

from __future__ import annotations

from typing import Any, Sequence

from ..errors import GemmdriftError
from .capture import Projection
from .paths import PathSpec, _Operator, _quant_of
from .replay import variant_name
from .replay_model import ReplayLog, _Replay
from .replay_paths import installed_mlx, parse_chip, plan_for


def _unit_kind(lm, proj: Projection, spec: PathSpec) -> tuple[str, dict[str, Any], str]:
    """(op, quantization kwargs, dtype) the path computes on ``proj``; a GemmdriftError when it has none."""
    compute = lm.description.dtype
    if spec.kind == "emulated":
        raise GemmdriftError("emulated split-K is a negative control, not a kernel: no chip runs it")
    if spec.kind == "dense":
        return "matmul", {}, spec.dtype
    q = spec.quant if spec.kind == "quant" else _quant_of(proj.module)
    if q is None:
        return "matmul", {}, compute
    if q.mode != "affine":
        raise GemmdriftError(f"quantization mode {q.mode}: replay has affine recipes only")
    return "quantized_matmul", {"bits": q.bits, "group_size": q.group_size}, compute


def plan_unit(log: ReplayLog, lm, proj: Projection, spec: PathSpec, plan: Sequence[int], n_rows: int,
              repeat_t1: bool) -> list[int] | None:
    """The block sizes of ``plan`` the chip's recipes can replay on this unit (None: not even T=1, the
    unit is skipped). Records each skip with its reason and every call the unit will make in ``log``."""
    label = f"{proj.layer}:{proj.name}"
    where = {"layer": proj.layer, "projection": proj.name, "path": spec.text}
    chip = parse_chip(log.chip)
    try:
        op, q, dtype = _unit_kind(lm, proj, spec)
    except GemmdriftError as e:
        log.skipped.append({**where, "T": "all", "reason": str(e)})
        return None
    kernels = {}
    for t in [1, *plan]:
        try:
            p = plan_for(chip, op, T=t, K=proj.in_dims, N=proj.out_dims, dtype=dtype, mlx_version=log.mlx_version,
                         variant=log.variant or None, **q)
        except GemmdriftError as e:
            log.skipped.append({**where, "T": "all" if t == 1 else t, "reason": str(e)})
            if t == 1:
                return None
            continue
        kernels[t] = (p.recipe.kernel, variant_name(p.variant))
    kept = [t for t in plan if t in kernels]
    used = min(n_rows, max(kept)) if kept else n_rows  # as measure_unit: one GEMV per distinct row used
    log.calls[(label, *kernels[1], 1)] += used + (1 if repeat_t1 else 0)
    for t in kept:
        log.calls[(label, *kernels[t], t)] += 1
    return kept


def replay_operator(lm, op: _Operator, proj: Projection, text: str) -> _Operator:
    """``op`` with its T=1 and block kernels replaced by the replay proxy of ``text`` (replay:<chip>[@v])."""
    from .replay_model import KernelsOption

    k = KernelsOption(text)
    module = getattr(op.run, "__self__", op.run)  # the tied head's run is the embedding's bound as_linear
    log = ReplayLog(k.chip, installed_mlx(), k.variant or "")  # this unit's own; plan_unit keeps the record
    proxy = _Replay(module, f"{proj.layer}:{proj.name}", parse_chip(k.chip), k.variant, log.mlx_version, log,
                    op.out_dtype)
    op.run = op.run_block = proxy._replay
    return op


__all__ = ["plan_unit", "replay_operator"]
