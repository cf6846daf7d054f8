"""The standard measurements: what `gemmdrift run`, the notebooks and asv compute.

One definition of the headline figures, sized per backend: the Linux CPU
backend runs the reference BLAS (~7 GFLOP/s in bf16), so its sizes are the
smallest that still cross the embedded Gemma's 512-token sliding window;
Metal and CUDA get the sizes users run (prefill chunks of 512 and 2048 both
used in full).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from . import defaults, files
from .errors import GemmdriftError

# mlx-lm's generate_step prefills in chunks of 2048, speculative_generate_step in 512.
DECODE_FAMILY = defaults.STACK_SCHEDULES
PREFILL_FAMILY = ("prefill:2048", "prefill:512")


@dataclass(frozen=True)
class Sizes:
    """How big each part of the main job is."""

    tokens: int  # teacher-forced stream length (the built-in essay, repeated if needed)
    split: int  # prompt/continuation boundary; positions split..tokens are compared
    ladder: bool  # rerun the decode family at float32
    kernel_layers: tuple[int, ...]  # decoder layers probed (plus the LM head)
    kernel_ts: tuple[int, ...]
    kernel_paths: tuple[str, ...]
    kernel_rows: int  # distinct captured rows per projection
    diverge_prompt: int  # prompt tokens of the divergence probe
    diverge_n: int  # tokens generated
    # FLOPs per (projection, path) of the kernel probe (kernels.plan_ts). The CPU's 2e9 (the reference BLAS
    # at ~7 GFLOP/s in bf16) would stop a GPU's sweep at T=128 for the MLP and T=4 for the LM head.
    flop_budget: float = 2e9


SIZES = {
    # Crosses the 512 window with 60 compared positions; a few minutes on 2 CPU cores.
    "cpu": Sizes(tokens=560, split=500, ladder=True, kernel_layers=(0, 5), kernel_ts=(1, 2, 3, 4, 8, 16, 33),
                 kernel_paths=("model", "quant:affine-q4-g64", "emulated:splitk4"), kernel_rows=16,
                 diverge_prompt=500, diverge_n=32),
    # Metal / CUDA: both prefill chunk sizes in full, longer continuation, full T sweep.
    "gpu": Sizes(tokens=2600, split=2300, ladder=True, kernel_layers=tuple(range(18)),
                 kernel_ts=(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 24, 32, 33, 64, 128, 512),
                 kernel_paths=("model", "dense:float16", "dense:float32", "quant:affine-q4-g64",
                               "quant:affine-q8-g64", "emulated:splitk4"),
                 kernel_rows=64, diverge_prompt=1000, diverge_n=128, flop_budget=1e12),
    # For tests and smoke runs: no sliding-window crossing, seconds.
    "quick": Sizes(tokens=40, split=32, ladder=False, kernel_layers=(0,), kernel_ts=(1, 2, 3),
                   kernel_paths=("model", "emulated:splitk4"), kernel_rows=4, diverge_prompt=16, diverge_n=4),
}


def default_sizes() -> str:
    """'gpu' on Metal/CUDA, 'cpu' otherwise."""
    import mlx.core as mx

    return "gpu" if mx.default_device().type == mx.gpu else "cpu"


def stream(lm, n: int) -> list[int]:
    """The first ``n`` tokens of the built-in essay (:func:`gemmdrift.prompts.builtin_stream`)."""
    from .prompts import builtin_stream

    return builtin_stream(lm, n)


def decode_family(lm, sizes: Sizes, checkpoint: Path | None = None, env: dict[str, Any] | None = None,
                  prefix_store: Path | None = None):
    """Decode (T=1) vs verify:2 and verify:3 after the same prefill, with local drift and the ladder (a Result).
    ``prefix_store``: where the run's parts share their prefixes (the which-op part reads this one's)."""
    from .measure.stack import measure_stack

    tokens = stream(lm, sizes.tokens)
    return measure_stack(lm, tokens, DECODE_FAMILY, split=sizes.split, ladder=sizes.ladder, checkpoint=checkpoint,
                         env=env, prefix_store=prefix_store)


def prefill_family(lm, sizes: Sizes, checkpoint: Path | None = None, env: dict[str, Any] | None = None):
    """The whole stream prefilled in chunks of 2048 (one chunk here) vs 512."""
    import numpy as np

    from .measure.stack import measure_stack

    tokens = stream(lm, sizes.tokens)
    # No local drift here: it would cost a third full prefill for a pair that is
    # bit-identical on the CPU backend.
    return measure_stack(lm, tokens, PREFILL_FAMILY, positions=np.arange(sizes.split, sizes.tokens), local=False,
                         checkpoint=checkpoint, env=env)


def kernel_probe(lm, sizes: Sizes, checkpoint: Path | None = None, env: dict[str, Any] | None = None):
    """GEMV vs GEMM rows for every projection of a few layers and the LM head, on captured rows (a Result)."""
    from . import kernels

    projs = kernels.projections(lm, layers=list(sizes.kernel_layers) + [lm.n_layers])
    inputs = kernels.capture_inputs(lm, stream(lm, min(sizes.tokens, 128)), projs, max_rows=sizes.kernel_rows)
    return kernels.measure_kernels(lm, inputs, projs, list(sizes.kernel_paths), sizes.kernel_ts,
                                   checkpoint=checkpoint, env=env, record={"sizes": asdict(sizes)},
                                   flop_budget=sizes.flop_budget)


def divergence_probe(lm, sizes: Sizes, env: dict[str, Any] | None = None):
    """mlx-lm plain vs speculative (self-draft, K=2) greedy generation past the window, with triage (a Result)."""
    from .measure.diverge import measure_diverge

    prompt = stream(lm, sizes.diverge_prompt)
    return measure_diverge(lm, prompt, sizes.diverge_n, k=2, env=env,
                           record={"prompt": "the built-in essay", "draft": "self"})


def side_by_side(lm, parts: dict[str, tuple[Any, dict[str, Any]]], workers: int | None = None,
                 done: Callable[[str, Any, float], None] | None = None) -> dict[str, Any]:
    """Whole measurements side by side: ``{name: fn(lm, **kwargs)}`` for ``parts = {name: (fn, kwargs)}``.

    Each part runs whole in a process started for it (:func:`gemmdrift.workers.run_jobs` with ``fresh``),
    ``workers`` at a time (default 2 on a multi-core CPU, 1 on a GPU), in the order given -- put the longest
    first -- and starts no processes of its own there: it computes exactly what it computes alone. What
    this gains is the cores the measurements leave idle one after another: the divergence probe prefills
    its prompt and runs its speculative stream on one core while the other waits, the ops probe runs in one
    process, each measurement's processes load the model before they work. ``fn`` is a module-level
    function (it is sent to the worker by name); its result must pickle. ``done(name, result, seconds)`` is
    called as each part finishes (``seconds``: its own time in its process), so the caller can keep it at once.
    """
    from .workers import check_workers, run_jobs

    names = list(parts)
    n = check_workers(lm, workers, len(names))
    print(f"gemmdrift: {len(names)} measurements, {n} at a time: {', '.join(names)}", file=sys.stderr, flush=True)

    def finished(i: int, timed: tuple[Any, float]) -> None:
        if done is not None:
            done(names[i], *timed)

    out = run_jobs(lm, _whole, [dict(name=k, measure=parts[k][0], kwargs=parts[k][1]) for k in names], n,
                   done=finished, fresh=True)
    return {k: result for k, (result, _) in zip(names, out)}


def _whole(lm, *, name: str, measure, kwargs: dict[str, Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    result = measure(lm, **kwargs)
    seconds = time.perf_counter() - t0
    print(f"gemmdrift: {name} done in {seconds:.1f} s", file=sys.stderr, flush=True)
    return result, seconds


def fingerprint_part(lm, **kwargs):
    """:func:`gemmdrift.fingerprint.measure` as a part of :func:`side_by_side` (it needs no model)."""
    from .fingerprint import measure

    return measure(**kwargs)


def attribute_stream(lm, n_tokens: int, schedules: list[str], split: int, ops=None):
    """:func:`gemmdrift.attribution.attribute.attribute` of two schedules on the first ``n_tokens`` of the built-in
    essay, each op class's counterfactual (``ops``: the classes, None: every class), as a part of
    :func:`side_by_side` (the stream is read where the part runs)."""
    from .attribution.attribute import attribute

    return attribute(lm, stream(lm, n_tokens), schedules, split=split, counterfactual=("each",), ops=ops)


def golden_part(lm, name: str, n_tokens: int | None = None):
    """:func:`gemmdrift.measure.golden.compare_golden` as a part of :func:`side_by_side`: the comparison's Result."""
    from .measure.golden import compare_golden

    return compare_golden(lm, name, n_tokens)[0]


def cache_impl_part(lm, spec: str, **grid):
    """The state grid on a cache implementation ``spec`` (``module:function``) as a part of :func:`side_by_side`
    (:func:`gemmdrift.state.bench.measure_state_impl`, one process)."""
    from .state.bench import measure_state_impl
    from .caches.plugins import load_cache_impl

    return measure_state_impl(lm, load_cache_impl(spec), **grid)


def _key(part: str, lm, sizes: Sizes, *more: Any) -> str:
    """What a finished part depends on: its sizes, the model, and the mlx/mlx-lm versions."""
    from .model import resume_key

    return resume_key(lm.description, part, asdict(sizes), *more)


def predict_part(lm, name: str, checkpoint: Path | None = None, env: dict[str, Any] | None = None,
                 calibration: tuple[str, ...] = ()):
    """Decode vs verify:2 / verify:3 predicted for M1, M3 and the CUDA gemv (:mod:`gemmdrift.replay.predict`)."""
    from .replay.predict import SIZES as PREDICT_SIZES, predict_drift

    return predict_drift(lm, PREDICT_SIZES[name], checkpoint=checkpoint, env=env, calibration=calibration)


def _done(out: Path, key: str) -> bool:
    marker = out / "done.json"
    if not marker.exists():
        return False
    try:
        saved = json.loads(marker.read_text())
        if not isinstance(saved, dict):
            raise ValueError(f"a {type(saved).__name__}, not an object")
    except (OSError, UnicodeDecodeError, ValueError) as e:
        files.discard_checkpoint(marker, str(e)[:80])
        return False
    return saved.get("key") == key


RUN_RECORD = "run.json"
# On a CPU with two cores every part runs whole in a process of its own, two at a time (side_by_side), longest
# first (beside one another on this 2-core VM, 2026-12-03: the decode family's two rungs 294-305 s, the prefill
# chunks' two runs 95-108 s, the attribution's six tapped runs 126-128 s with the shared prefix (168 s without),
# the divergence probe's two streams 98-106 s, the kernel probe 79 s, the prediction 63-68 s, the state sweep 30 s):
# the two cores stay busy to the end, where the job's phases one after another left one idle for a part's slowest
# half (the float32 rung ran on alone for ~40 s). The which-op part starts third: by then the decode family has
# saved the 500-token prefix both compute (PREFIX_STORE), which it reads instead of computing it again.
BESIDE = ("stack-decode", "stack-prefill", "attribute", "diverge", "kernels", "predict", "state")
PREFIX_STORE = ".prefix"  # in the run directory: the shared prefixes' caches (model/taps.py prefix_file)


def check_resume(out: str | Path, inputs: dict[str, Any]) -> None:
    """Refuse to resume into a run directory made with other inputs (model, dtype, sizes, mlx, mlx-lm).

    Parts finished under other inputs would otherwise sit beside new ones under
    one label. Runs before the record existed are accepted as they are.
    """
    record = Path(out) / RUN_RECORD
    if not record.is_file():
        return
    try:
        saved = json.loads(record.read_text())
        if not isinstance(saved, dict):
            raise ValueError("not an object")
    except (OSError, UnicodeDecodeError, ValueError):
        raise GemmdriftError(f"{record} is corrupt: cannot tell what this run directory holds; use another --out "
                             "or delete the directory") from None
    diff = [f"{k} {saved.get(k)!r} (now {v!r})" for k, v in inputs.items() if saved.get(k) != v]
    if diff:
        raise GemmdriftError(f"{out} was made with other inputs: {'; '.join(diff)}; resuming would mix them "
                             "under one label: use another --out")


def _mark(out: Path, key: str, seconds: float) -> None:
    files.write_json(out / "done.json", {"key": key, "seconds": seconds})


def main_job(out: str | Path = "results/run", sizes: str | None = None, model: str = "embedded",
             dtype: str = "bfloat16", calibration: tuple[str, ...] | list[str] = ()) -> dict[str, Path]:
    """Run every part, write tables, figures and the report; resume finished parts.

    ``calibration``: calibration files the prediction part applies (:mod:`gemmdrift.replay.calib`).

    Each part writes its own directory and a ``done.json`` marker last; a part
    whose marker matches the current inputs is not run again.

    Returns:
        The report's paths, ``{"markdown": ..., "html": ...}``.
    """
    from .machine import envinfo
    from . import report, state, store
    from .machine.envinfo import environment
    from .model import describe, load_model
    from .machine.runenv import compute_record

    if envinfo.TF32_POLICY != "keep":  # the CLI's --tf32 keep opts out
        envinfo.force_true_float32()  # float32 paths and the ladder rung: before mlx's first matmul
    name = sizes or default_sizes()
    if name not in SIZES:
        raise GemmdriftError(f"unknown size {name!r} (choose {', '.join(SIZES)})")
    s = SIZES[name]
    out = Path(out)
    from .machine.envinfo import dist_version
    from .model import parse_dtype

    run_inputs = {"model": model, "dtype": parse_dtype(dtype), "sizes": name, "mlx": dist_version("mlx"),
                  "mlx_lm": dist_version("mlx-lm"), "compute": compute_record()}  # another device or MLX_* setting: refused
    check_resume(out, run_inputs)  # before the model loads
    env = environment()
    lm = load_model(model, dtype=dtype)
    print(f"gemmdrift run: {describe(lm.description)}; sizes '{name}' on {env['backend']}", file=sys.stderr, flush=True)
    files.write_json(out / "env.json", env)
    files.write_json(out / RUN_RECORD, run_inputs)

    from .attribution.attribute import PART_SIZES as ATTRIBUTE_SIZES, attribute_part
    from .replay.predict import SIZES as PREDICT_SIZES

    calibration = tuple(str(c) for c in calibration)
    # The decode family's 500-token bfloat16 prefix is the which-op part's too: computed once, shared through here.
    prefix_store = out / PREFIX_STORE

    def ck(part: str) -> Path:
        return out / part / "checkpoint"

    # (part, title, function, arguments): each part is function(lm, **arguments), here or in a process of its own.
    parts = [
        ("stack-decode", "decode vs verify:2 / verify:3", decode_family,
         dict(sizes=s, checkpoint=ck("stack-decode"), env=env, prefix_store=prefix_store)),
        ("stack-prefill", "prefill 2048 vs 512", prefill_family,
         dict(sizes=s, checkpoint=ck("stack-prefill"), env=env)),
        ("kernels", "GEMV vs GEMM per projection", kernel_probe, dict(sizes=s, checkpoint=ck("kernels"), env=env)),
        ("diverge", "mlx-lm generate vs speculative generate", divergence_probe, dict(sizes=s, env=env)),
        ("state", "cache state exactness (short sweep)", state.short_sweep, dict(size=name)),
        ("predict", "predicted GPU drift (replay: M1, M3, CUDA gemv)", predict_part,
         dict(name=name, checkpoint=ck("predict"), env=env, calibration=calibration)),
        ("attribute", "which op: local drift per op, the counterfactual per op class", attribute_part,
         dict(name=name, checkpoint=ck("attribute"), env=env, prefix_store=prefix_store)),
    ]
    from .replay.calib import registry_files

    # its own sizes, beside the job's; a calibration (given or in the registry) changes what it replays
    cal_key = [Path(f).read_text(encoding="utf-8") for f in [*calibration, *map(str, registry_files())]]
    more = {"predict": [asdict(PREDICT_SIZES[name]), *([cal_key] if cal_key else [])],
            "attribute": [ATTRIBUTE_SIZES[name]]}  # its own sizes
    keys = {part: _key(part, lm, s, *more.get(part, [])) for part, *_ in parts}
    heads = {part: f"[{i}/{len(parts)}] {title}" for i, (part, title, *_) in enumerate(parts, 1)}
    beside = [p for p in BESIDE if not _done(out / p, keys[p])]
    from .workers import default_workers

    if len(beside) < 2 or default_workers(lm, 2) < 2:
        beside = []  # one at a time, in order (a GPU, one core, a model that cannot be loaded again)
    for part, _, measure, kwargs in parts:
        d = out / part
        if part in beside:
            continue  # computed side by side below
        if _done(d, keys[part]):
            print(f"gemmdrift run: {heads[part]}: done before (resumed)", file=sys.stderr, flush=True)
            continue
        print(f"gemmdrift run: {heads[part]}", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        store.write_result(measure(lm, **kwargs), d)
        _mark(d, keys[part], time.perf_counter() - t0)
    if beside:
        # Each part computes on one core: side by side (a process each, as they finish each is kept) no core idles.
        jobs = {part: (measure, kwargs) for part, _, measure, kwargs in parts}
        print(f"gemmdrift run: {', '.join(heads[p] for p in beside)}: side by side, a process each",
              file=sys.stderr, flush=True)

        def keep(part: str, result, seconds: float) -> None:
            store.write_result(result, out / part)
            _mark(out / part, keys[part], seconds)

        side_by_side(lm, {p: jobs[p] for p in beside}, done=keep)
    # Every part is done: the prefixes were kept for a resume only (27 MB on the cpu sizes)
    import shutil

    shutil.rmtree(prefix_store, ignore_errors=True)
    return report.build_report(out)
