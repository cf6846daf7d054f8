"""The whole model under replay (the library half of ``--kernels replay:<chip>[@variant]``).

:func:`replayed` swaps every projection of every decoder layer and the LM head for a proxy (the one proxy
mechanism, :func:`gemmdrift.model.taps.swapped`) that computes the call with the chip's recipe, picked per call
from the call's T (rows = batch x sequence, as mlx folds a broadcast weight into M), and records which
kernels and variants ran. Attention, norms, RoPE and the cache stay on this machine's kernels. A replayed
result is a prediction for that chip, not a measurement on it; :class:`ReplayLog` says so and what ran.

:class:`KernelsOption` is the ``--kernels`` flag of ``stack``, ``logits``, ``compare``, ``kernels``, ``diverge`` and
``triage``. While the proxies are in, :func:`gemmdrift.model.native.native` makes them call the modules they
stand in for: ``stack`` and ``diverge`` compute the prefix every schedule shares that way, once, on this
machine's kernels (``ReplayLog.prefix`` says so). ``kernels`` replays its per-projection operators through the
same proxy (:mod:`.units`).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np

from ..errors import GemmdriftError
from ..kernels.paths import PathSpec, Operator, quant_of
from ..model.projections import LM_HEAD, Projection, projections
from ..model.taps import swapped, to_numpy
from . import unused_axes, variant_name
from .core import min_nonzero
from .paths import installed_mlx, parse_chip, plan_for, run_plan


@dataclass
class ReplayLog:
    """What a replayed run computed: chip, release, variant, and (op, kernel, variant, T) call counts."""

    chip: str
    mlx_version: str
    variant: str
    calls: Counter = field(default_factory=Counter)
    paused: bool = False  # under native_kernels.native: the proxies call the modules they stand in for
    prefix: str | None = None  # how the prefix the schedules share was computed (stack, diverge, triage)
    prefix_native: bool = True  # that prefix on this machine's kernels (False: replayed, --replay-prefix)
    skipped: list = field(default_factory=list)  # what a replayed kernels sweep could not replay, and why
    extra: dict = field(default_factory=dict)  # more to say in the record (e.g. where the input rows came from)

    def record(self) -> dict[str, Any]:
        unused = unused_axes(self.variant, {k for (_, k, _, _) in self.calls}) if self.calls else []
        return {"prediction": True, "chip": self.chip, "mlx_version": self.mlx_version,
                "variant": self.variant or "default",
                **({"variant_unused": unused} if unused else {}),
                "replayed": "every projection of every decoder layer and the LM head",
                "not_replayed": "attention, norms, RoPE, embeddings lookup and the cache",  # on this machine's kernels
                **({"prefix": self.prefix} if self.prefix else {}),
                **({"skipped": list(self.skipped)} if self.skipped else {}), **self.extra,
                "calls": [{"projection": p, "kernel": k, "variant": v, "T": t, "count": n}
                          for (p, k, v, t), n in sorted(self.calls.items())]}


class _Replay:
    """Stands in for one linear (or the tied embedding's ``as_linear``): the chip's recipe for every call."""

    def __init__(self, module, name: str, chip, variant, version: str, log: ReplayLog, dtype: str):
        import mlx.nn as nn

        self._module = module
        self._name, self._chip, self._variant, self._version, self._log = name, chip, variant, version, log
        self._dtype = dtype
        quantized = isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding))
        if quantized and getattr(module, "mode", "affine") != "affine":
            raise GemmdriftError(f"{name}: the model replay runs affine quantized modules only, not {module.mode} "
                                 "(the fp modes' recipes run in replay check and replay_quantized)")
        if quantized:
            self._quant = (np.array(module["weight"]), to_numpy(module["scales"]), to_numpy(module["biases"]),
                           module.bits, module.group_size)
            self._w = None
            self._n = module["scales"].shape[0]
        else:
            self._quant = None
            self._w = to_numpy(module["weight"])
            self._n = self._w.shape[0]
        # The weight's smallest magnitude decides FTZ together with x's: computed once, not per call.
        self._w_min = None if self._w is None else min_nonzero(self._w)
        self._b = to_numpy(module["bias"]) if "bias" in module else None

    def __getattr__(self, name):
        return getattr(self._module, name)

    def _replay(self, x):
        import mlx.core as mx

        from ..model.taps import storage_dtype_name

        shape = x.shape
        rows = to_numpy(x).reshape(-1, shape[-1])
        T, K = rows.shape
        dtype = storage_dtype_name(x.dtype)
        op = "matmul" if self._quant is None else "quantized_matmul"
        q = {} if self._quant is None else {"bits": self._quant[3], "group_size": self._quant[4]}
        plan = plan_for(self._chip, op, T=T, K=K, N=self._n, dtype=dtype, mlx_version=self._version,
                        variant=self._variant, **q)
        y = run_plan(plan, rows, dtype=dtype, w=self._w, bias=self._b, quant=self._quant, w_min=self._w_min).y
        self._log.calls[(self._name, plan.recipe.kernel, variant_name(plan.variant), T)] += 1
        return mx.array(y.reshape(*shape[:-1], self._n)).astype(x.dtype)  # exact: y holds values of the dtype

    def __call__(self, x, *args, **kwargs):
        return self._module(x, *args, **kwargs) if self._log.paused else self._replay(x)


class _ReplayHead(_Replay):
    """The tied embedding: lookups stay the embedding's, ``as_linear`` is replayed."""

    def __call__(self, x, *args, **kwargs):
        return self._module(x, *args, **kwargs)

    def as_linear(self, x):
        return self._module.as_linear(x) if self._log.paused else self._replay(x)


@contextlib.contextmanager
def replayed(lm, chip: str, variant: str | None = None, mlx_version: str | None = None) -> Iterator[ReplayLog]:
    """Every projection and the LM head of ``lm`` computed with ``chip``'s recipes, for the duration.

    Yields the :class:`ReplayLog` of the calls. The model is restored afterwards, even on error.
    """
    import mlx.nn as nn

    c = parse_chip(chip)
    version = mlx_version or installed_mlx()
    log = ReplayLog(c.name, version, variant or "")
    dtype = lm.description.dtype
    slots = []
    for p in projections(lm):
        if p.name == LM_HEAD:
            owner, key = _head_slot(lm, p.module)
            proxy = _ReplayHead(p.module, p.name, c, variant, version, log, dtype) if isinstance(
                p.module, (nn.Embedding, nn.QuantizedEmbedding)) else _Replay(p.module, p.name, c, variant, version,
                                                                               log, dtype)
            slots.append((owner, key, proxy))
        else:
            slots.append((p.parent, p.attr, _Replay(p.module, f"{p.layer}:{p.name}", c, variant, version, log, dtype)))
    from ..model import native as native_kernels

    if native_kernels.active(lm.model) is not None:
        raise GemmdriftError("this model's kernels are replayed already")
    with swapped(slots):
        native_kernels.register(lm.model, log)
        try:
            yield log
        finally:
            native_kernels.unregister(lm.model)


class KernelsOption:
    """``--kernels replay:<chip>[@variant]`` of a measuring command (or nothing: this machine's kernels).

    Parsed and checked before any model loads; :meth:`installed` swaps the recipes in for the run,
    ``workers`` keeps the run in this process (the proxies live here), ``checkpoint`` keeps a replayed
    run's checkpoint apart from a measured one, and :meth:`label` puts the :class:`ReplayLog` into the
    result (``details["replay"]``, ``inputs["kernels"]``): a prediction for that chip, not a measurement.
    ``replay_prefix`` (``stack --replay-prefix``): the shared prefix is replayed in every schedule too, not
    computed once natively.
    """

    # A flag given together with --kernels that cannot work with it: refused before the model loads.
    REFUSED = {
        "ladder": "--ladder with --kernels: the float32 rung runs another model copy, not replayed",
        "ops": "--ops with --kernels: sdpa, rms_norm, rope and softmax have no replay recipe (run --ops without it)",
        "draft": "--draft with --kernels: a separate draft model is not replayed (the target drafts for itself)",
    }

    def __init__(self, text: str | None, *, replay_prefix: bool = False, calibration: Sequence[str] = (),
                 **given: Any):
        self.text = (text or "").strip()
        self.chip = self.variant = None
        self.calibrated_by = ""
        self.log: ReplayLog | None = None
        self.replay_prefix = bool(replay_prefix)
        if not self.text or self.text == "native":
            self.text = ""
            if replay_prefix:
                raise GemmdriftError("--replay-prefix needs --kernels replay:<chip>[@<variant>]")
            if calibration:
                raise GemmdriftError("--calibration needs --kernels replay:<chip>")
            return
        kind, _, rest = self.text.partition(":")
        if kind != "replay" or not rest:
            raise GemmdriftError(f"--kernels {text!r}: expected replay:<chip>[@<variant>] (chips: cpu, M1, M3, M5, "
                                 "sm90 or any chip name) or native")
        from . import check_variant_text

        chip, at, variant = rest.partition("@")
        if at and not variant.strip():
            raise GemmdriftError(f"--kernels {text!r}: nothing after '@' (give a variant such as "
                                 f"replay:{chip}@mma=H2, or drop the '@')")
        parse_chip(chip)
        check_variant_text(variant)
        for flag, value in given.items():
            if value:
                raise GemmdriftError(self.REFUSED[flag])
        self.chip, self.variant = chip, variant or None
        from .calib import resolve

        if variant and calibration:
            raise GemmdriftError(f"--kernels {text!r} names a variant and --calibration measures one: give one")
        if not variant:  # the measured variant of this chip and release (given files, then the registry)
            res = resolve(chip, installed_mlx(), calibration)
            if res.variant:
                self.variant, self.calibrated_by = res.text, res.note
                self.text = f"replay:{chip}@{res.text}"

    @property
    def workers(self) -> int | None:
        return 1 if self.text else None

    @property
    def checkpoint(self) -> str:
        return self.dirname("checkpoint")

    def dirname(self, base: str) -> str:
        """``base`` for this machine's kernels, ``base-replay_<chip>...`` for a replayed run (never mixed)."""
        import re

        if not self.text:
            return base
        return f"{base}-" + re.sub(r"[^A-Za-z0-9_.-]+", "_", self.text) + ("-replayed-prefix" if self.replay_prefix
                                                                            else "")

    @contextlib.contextmanager
    def installed(self, lm) -> Iterator[ReplayLog | None]:
        if not self.text:
            yield None
            return
        if self.calibrated_by:
            import sys

            print(f"  {self.text}: {self.calibrated_by}", file=sys.stderr, flush=True)
        with replayed(lm, self.chip, self.variant) as log:
            self.log = log
            log.prefix_native = not self.replay_prefix
            yield log

    def check_calls(self, shapes, ts, dtype: str) -> None:
        """Refuse now, before any computing, a run whose chip has no recipe for one of its calls.

        ``shapes``: (name, K, N, quant) of every projection and the LM head, ``quant`` None or (bits, group
        size); ``ts``: the row counts the replayed part of the run feeds them (:func:`replayed_ts`). The
        message is the one the call itself would raise minutes later (e.g. every CUDA T >= 2 is cuBLASLt).
        """
        if not self.text:
            return
        chip, version = parse_chip(self.chip), installed_mlx()
        for T in sorted(set(ts)):
            for _, K, N, quant in shapes:
                op = "matmul" if quant is None else "quantized_matmul"
                q = {} if quant is None else {"bits": quant[0], "group_size": quant[1]}
                plan_for(chip, op, T=T, K=K, N=N, dtype=dtype, mlx_version=version, variant=self.variant, **q)

    def check_run(self, shapes, schedules, n: int | None, split: int | None, dtype: str) -> None:
        """:meth:`check_calls` for a run of ``schedules`` over ``n`` tokens (split: the stack's default when
        None); nothing when the shapes or the length are not known yet (then it is asked again after the load)."""
        if not self.text or shapes is None or n is None or n < 2:
            return
        from ..ranges import default_split

        split = split if split is not None else default_split(n)
        ts = replayed_ts(schedules, n, split, replay_prefix=self.replay_prefix)
        self.check_calls(shapes, ts, dtype)
        if self.variant and not self.calibrated_by:  # a calibrated variant names every measured axis: kept
            self.check_variant_used(shapes, ts, n, dtype)

    def check_variant_used(self, shapes, ts, upto: int, dtype: str) -> None:
        """Refuse a variant axis that no call of the run could use: no recipe the chip plans for these shapes at
        any row count the run can replay (``ts``, every T up to 64, the powers of two and ``upto``, the longest
        block) has it (``replay:M1@dot4=pairwise``: M1 never runs gemv_wide). A superset of the run's calls, so
        the refusal is never a false one."""
        from . import RECIPES

        chip, version = parse_chip(self.chip), installed_mlx()
        probe = set(ts) | set(range(1, min(upto, 64) + 1)) | {1 << i for i in range(upto.bit_length())} | {upto}
        kernels = set()
        for T in sorted(t for t in probe if 1 <= t <= max([upto, *ts])):
            for _, K, N, quant in shapes:
                op = "matmul" if quant is None else "quantized_matmul"
                q = {} if quant is None else {"bits": quant[0], "group_size": quant[1]}
                try:
                    kernels.add(plan_for(chip, op, T=T, K=K, N=N, dtype=dtype, mlx_version=version, **q).recipe.kernel)
                except GemmdriftError:
                    continue
        unused = unused_axes(self.variant, kernels)
        if unused:
            owners = sorted({r.kernel for r in RECIPES.values() for a in unused if a in r.axes})
            raise GemmdriftError(f"--kernels {self.text}: no call of this run can use {', '.join(unused)} "
                                 f"({', '.join(owners)} only); {chip.name} at mlx {version} runs "
                                 f"{', '.join(sorted(kernels)) or 'no replayed kernel'} here: drop it")

    def units_log(self) -> ReplayLog:
        """A new log for a replayed ``kernels`` sweep (its operators are replayed, not the model)."""
        self.log = ReplayLog(parse_chip(self.chip).name, installed_mlx(), self.variant or "")
        return self.log

    def unit_hooks(self):
        """(:func:`plan_unit`, :func:`replay_operator`) for a replayed ``kernels`` sweep: the kernels wing calls
        the replay through these, so it never imports the replay (the replay imports the kernels)."""
        return plan_unit, replay_operator

    def label(self, result):
        """The result with what was replayed (unchanged without --kernels)."""
        if not self.text or self.log is None:
            return result
        import dataclasses

        cal = {"calibration": self.calibrated_by} if self.calibrated_by else {}
        return dataclasses.replace(result, inputs={**result.inputs, "kernels": self.text, **cal},
                                   details={**result.details, "replay": {**self.log.record(), **cal}})


def replayed_ts(schedules, n: int, split: int | None, *, replay_prefix: bool = False) -> set[int]:
    """The row counts a replayed run over ``n`` tokens feeds the projections: every block of every schedule but
    the leading blocks they all share (computed once natively, unless ``replay_prefix``). A subset of what the
    run replays when it shares fewer (a smaller limit), so a refusal from it is never a false one."""
    from ..schedules import parse_schedule
    from ..model.taps import shared_blocks

    shared = set() if replay_prefix else set(shared_blocks(n, schedules, split, n))
    return {b - a for s in schedules for a, b in parse_schedule(s).blocks(n, split) if (a, b) not in shared}


def triage_ts(schedules, prompt_len: int, stream_lens) -> set[int]:
    """The row counts a replayed ``triage`` surely feeds the projections: every block of each stream's
    teacher-forced run from the last prompt token on (its continuation; only blocks before it can be shared and
    computed natively). A subset of what the run replays, so a refusal from it is never a false one."""
    from ..schedules import parse_schedule

    split = prompt_len - 1
    if split < 1:
        return set()  # a one-token prompt: the schedule loses its prefill phase; asked again after the load
    return {b - a for s, m in zip(schedules, stream_lens) if m > 0
            for a, b in parse_schedule(s).blocks(split + m, split) if a >= split}


def config_shapes(config: dict, quant: tuple[int, int] | None = None) -> list[tuple]:
    """(name, K, N, quant) of one decoder layer's projections and the LM head, from a Gemma-3-like config (no
    weights); None for a config whose layers differ from one another (Gemma 4's global head dim) or that is
    quantized already: the load tells those."""
    c = config.get("text_config", config)
    if "global_head_dim" in c or config.get("quantization") or c.get("quantization"):
        return None
    h, heads, kv = int(c["hidden_size"]), int(c["num_attention_heads"]), int(c["num_key_value_heads"])
    d = int(c.get("head_dim") or h // heads)
    inter, vocab = int(c["intermediate_size"]), int(c["vocab_size"])
    return [(name, k, n, quant) for name, k, n in (
        ("q_proj", h, heads * d), ("k_proj", h, kv * d), ("v_proj", h, kv * d), ("o_proj", heads * d, h),
        ("gate_proj", h, inter), ("up_proj", h, inter), ("down_proj", inter, h), ("lm_head", h, vocab))]


def model_shapes(source: str, quant: tuple[int, int] | None = None) -> list[tuple] | None:
    """:func:`config_shapes` of ``--model`` read without loading it: the embedded Gemma (its architecture's
    shapes), ``shape:NAME``, an mlx-lm directory's config.json; None when only the load can tell (a GGUF)."""
    import json
    from pathlib import Path

    from ..model import SHAPES

    try:
        if source in (None, "", "embedded"):
            return config_shapes(SHAPES["gemma3-270m"], quant)
        if str(source).startswith("shape:"):
            return config_shapes(SHAPES[str(source).split(":", 1)[1]], quant)
        cfg = Path(source).expanduser() / "config.json"
        return config_shapes(json.loads(cfg.read_text()), quant) if cfg.is_file() else None
    except (KeyError, ValueError, TypeError, OSError):
        return None  # the load will say what is wrong with the model


def lm_shapes(lm) -> list[tuple]:
    """(name, K, N, quant) of every projection and the LM head of a loaded model."""
    out = []
    for p in projections(lm):
        bits, group = getattr(p.module, "bits", None), getattr(p.module, "group_size", None)
        out.append((p.name, p.in_dims, p.out_dims, (bits, group) if bits is not None else None))
    return out


def _head_slot(lm, head) -> tuple[Any, str]:
    """(container, key) holding the LM head module: an ``lm_head`` linear or the tied ``embed_tokens``."""
    for _, mod in lm.model.named_modules():
        if isinstance(mod, dict):
            for key, value in mod.items():
                if value is head:
                    return mod, key
    raise GemmdriftError("cannot find the module holding the LM head")


# The units of a replayed ``kernels`` sweep.
#
# ``gemmdrift kernels --kernels replay:<chip>[@variant]``, the GEMV-vs-GEMM table predicted
# for a chip on the real captured rows.
#
# Each (projection, path) unit of the sweep runs its operator through the replay proxy of
# this module (the same ``_Replay`` that stands in for a projection in a replayed model): T=1 with
# the chip's T=1 recipe, each block with the recipe the chip dispatches at that T. What the chip would compute
# cannot be replayed everywhere, and nothing is then computed natively in its place:
#
# * ``emulated:splitk<P>`` is a negative control, not a kernel: its units are skipped;
# * a quantization mode or dtype without a recipe: the unit is skipped;
# * a block size whose kernel has no known order (NAX on M5 at T >= 16, cuBLASLt on sm90 at T > 1): that T
#   is skipped, the others are measured.
#
# :func:`plan_unit` decides this before any unit runs (in the main process, so the record is whole even when
# units run in worker processes, each building its own proxy with :func:`replay_operator`); every skip is
# kept with its reason in ``details["replay"]["skipped"]``. The input rows are the ones captured with this
# machine's kernels (the same rows for every chip).


def _unit_kind(lm, proj: Projection, spec: PathSpec) -> tuple[str, dict[str, Any], str]:
    """(op, quantization kwargs, dtype) the path computes on ``proj``; a GemmdriftError when it has none."""
    compute = lm.description.dtype
    if spec.kind == "emulated":
        raise GemmdriftError("emulated split-K is a negative control, not a kernel: no chip runs it")
    if spec.kind == "dense":
        return "matmul", {}, spec.dtype
    q = spec.quant if spec.kind == "quant" else quant_of(proj.module)
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


def replay_operator(lm, op: Operator, proj: Projection, text: str) -> Operator:
    """``op`` with its T=1 and block kernels replaced by the replay proxy of ``text`` (replay:<chip>[@v])."""
    k = KernelsOption(text)
    module = getattr(op.run, "__self__", op.run)  # the tied head's run is the embedding's bound as_linear
    log = ReplayLog(k.chip, installed_mlx(), k.variant or "")  # this unit's own; plan_unit keeps the record
    proxy = _Replay(module, f"{proj.layer}:{proj.name}", parse_chip(k.chip), k.variant, log.mlx_version, log,
                    op.out_dtype)
    op.run = op.run_block = proxy._replay
    return op


__all__ = ["ReplayLog", "unused_axes", "replayed", "KernelsOption", "replayed_ts", "triage_ts", "config_shapes", "model_shapes", "lm_shapes",
           "plan_unit", "replay_operator"]
