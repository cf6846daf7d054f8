"""Accumulation-order fingerprints: the summation tree of one output element, recovered black-box.

Method (FPRev, Xie et al., USENIX ATC '25). For a reduction of ``n`` terms, a
*probe* ``(i, j)`` sets term ``i`` to ``+M``, term ``j`` to ``-M`` and the
others to a unit ``u``, with ``M`` so big that ``M + (any partial sum of
units) == M`` in the accumulator. Inside the smallest subtree holding both
``i`` and ``j`` every unit is absorbed by ``+M`` or ``-M`` before they cancel
to an exact 0; every unit outside it is summed exactly. So the output is
``u * (n - L(i, j))`` with ``L(i, j)`` the number of leaves under
``LCA(i, j)``, and the tree follows from the ``L`` values.

Recovery (FPRev's efficient variant): fix the smallest leaf ``p`` of a set
known to be one subtree; probe ``(p, j)`` for every other ``j``; the distinct
``L`` values are the sizes of the nodes on ``p``'s path to the top, the
``j`` with equal ``L`` hang off the same node, and each such group is a forest
that is recovered the same way. That is O(n * depth) probes (n - 1 for a
sequential sum, about n log n for a pairwise one). Probes are evaluated
breadth first, all pending groups of all row positions at once, so the number
of rounds is the nesting depth of the tree, not the number of groups.

Exactness. Every value is exact in the input dtype, every count is exact in
the output dtype, and ``M`` absorbs a whole window of units in a float32
accumulator (``M / u >= 2**25 * window``). A count above what the output dtype
holds exactly (256 in bfloat16; in float16 the unit is 2**-20, a subnormal,
and counts stay below 1024) is never read: units then cover only one
*window* of positions per probe (zeros elsewhere; a zero changes no sum), and
``L = 2 + sum over windows of (units in the window - count)``; a pair costs
``ceil((n - 2) / window)`` probes. A count that is not an integer in range,
``L`` values that do not nest, or a tree that does not cover every leaf stop
the recovery of that row with the reason ("not recovered"); nothing is
guessed. An all-unit sum (the *accumulator check*) says whether the
accumulator holds the counts the output dtype could show: the CPU quantized
matmul with bfloat16 activations sums 510 ones to 256 (``T sum = 0`` in
``_qmm_t``, ``mlx/backend/cpu/quantized.cpp``).

Limits (documented, not hidden):

* A fused multiply-add or a k-operand addition shows as one node with k
  children; the order inside a node is not observable (``a + b`` and
  ``b + a`` round alike). Two trees that differ only by that are the same
  fingerprint.
* The accumulator's width is not in the tree: "float32 partials" is an
  assumption of the construction, checked only as far as the accumulator
  check and the consistency checks go (an accumulator wider than float32
  would fail to absorb and be reported as not recovered).
* An exact multi-operand sum (a node that adds M, 1 and -M without rounding
  in between) does not absorb its units: the L values then do not nest and
  the row is reported not recovered.
* Orders that depend on the data (none of mlx's kernels, as read) would be
  mis-recovered.
* The T-row block is T identical rows (all ones for the matmuls, the probe
  for quantized matmul and ``mx.sum``), so one call measures every position.
* Quantized matmul: an affine group cannot hold both a unit and a value big
  enough to absorb it exactly (``M = bias + scale * q`` and ``1 = bias +
  scale * q'`` need a scale with as many significant bits as ``M / u``), so
  the probes go into the activations and the quantized weights dequantize to
  exactly 1 (checked with ``mx.dequantize``); one probe per call.
* ``rms_norm`` (a sum of squares) and ``softmax`` (a sum of exponentials) sum
  only non-negative terms: nothing can cancel, so the tree is not recoverable
  by this method, and the result says so. ``sdpa`` is recoverable through its
  P @ V sum: with q = 0 every key weighs exactly 1/K (K a power of two) and the
  probes ride in the value columns.

What the source says the Linux CPU backend does (ml-explore/mlx at 846d176):
``mlx/backend/cpu/gemms/simd_gemm.h`` (fp16/bf16) walks K in blocks of 16
but adds ``simd::sum`` of ``simd_size`` products into one float32 accumulator,
and ``simd::max_size`` is 1 on x86 (``mlx/backend/cpu/simd/base_simd.h``;
the Accelerate/NEON versions are for arm64), so it is one sequential sum;
float32 goes to ``cblas_sgemm`` (the reference BLAS in the wheel: a sequential
loop over K); ``_qmm_t`` in ``mlx/backend/cpu/quantized.cpp`` is a sequential
loop accumulating in the activation dtype; ``contiguous_reduce`` in
``mlx/backend/cpu/reduce.cpp`` is sequential; on the CPU ``sdpa`` falls back
to matmul, softmax, matmul (``mlx/backend/no_gpu/primitives.cpp``). The
measurements agree with all of it except one: at 0.32.4 ``mx.sum`` of 510
bfloat16 ones is 510, so its accumulator is wider than bfloat16.

The code is generic over a :class:`Reducer` (``reduce(codes) -> counts``), so
numpy, a Python loop, a hand-built blocked sum and the emulated split-K path
(:func:`gemmdrift.kernels.split_k`) plug in exactly as mlx's kernels do."""

from __future__ import annotations

import math
import sys
import time
from typing import Any, Callable, Iterable, Sequence

from ..errors import GemmdriftError

# The public names of the submodules, re-exported: `from gemmdrift.fingerprint import X` keeps working.
from .probes import (  # noqa: F401
    ZERO,
    UNIT,
    PLUS,
    MINUS,
    MAX_WINDOWS,
    DTYPES,
    NOT_RECOVERABLE,
    PATH_HELP,
    Encoding,
    encoding_for,
    Reducer,
    numpy_reducer,
    matmul_reducer,
    splitk_reducer,
    QUANT_RE,
    quantized_ones,
    quant_reducer,
    sum_reducer,
    sdpa_reducer,
    PathSpec,
    parse_path,
    check_path,
    make_reducer,
    accumulator_check,
    FP16_FLUSHED,
    fp16_subnormals_kept,
)
from .recovery import (  # noqa: F401
    Recovery,
    recover,
    deep_recursion,
    tree_leaves,
    to_text,
    from_text,
    fingerprint,
    tree_id,
    chain,
    pairwise,
    canonical,
    depth,
)
from .describe import (  # noqa: F401
    max_fan,
    describe,
)



def _predict(spec: PathSpec, env: dict[str, Any], K: int, N: int, T: int) -> tuple[str, str]:
    """(predicted kernel, origin) from gemmdrift.dispatch; Metal's rules labelled as reference on the CPU."""
    from ..dispatch import kernel_for
    from ..kernels import reference_backend

    if not spec.dispatch_op:
        return "", ""
    target, version, chip, origin = reference_backend(env, None)
    if chip is None:  # a GPU whose architecture the record does not name: no prediction, not a default chip
        return "", origin
    shape: dict[str, Any]
    if spec.op == "sdpa":
        shape = {"k_len": K, "head_dim": N, "n_heads": 1, "n_kv_heads": 1}
    elif spec.op == "quant":
        shape = {"K": K, "N": N, "mode": spec.mode, "bits": spec.bits, "group_size": spec.group_size}
    else:
        shape = {"K": K, "N": N, "dtype": spec.dtype}
    try:
        return kernel_for(target, spec.dispatch_op, T, mlx_version=version, chip=chip, **shape), origin
    except GemmdriftError:
        return "", origin


def measure(paths: Sequence[str], *, K: int = 1024, ts: Iterable[int] = (1, 2, 3, 4, 8, 16, 33), N: int = 64,
            window: int | None = None, draw_k: int = 16, env: dict[str, Any] | None = None,
            progress: Callable[[str], None] | None = None, workers: int | None = None, checkpoint=None):
    """Fingerprints of every path at every T and row position; a Result of kind "fingerprint".

    Args:
        paths: path texts (see :data:`PATH_HELP`).
        K: terms of the reduction (matmul inner dimension, keys for sdpa).
        ts: block sizes T; the probed row is at every position 0..T-1.
        N: output columns per call (head dim for sdpa), fixed for a fingerprint.
        window: cap the units per probe (default: what the output dtype counts exactly).
        draw_k: also recover every path at this small K and T=1, for the tree plots (0: skip).
        workers: processes for the paths (default 2 on a CPU device with 2 cores or more; each path is the
            same computation in any process; in other processes ``progress`` lines go to stderr).
        checkpoint: an output directory: every finished path x T is saved under it (:mod:`gemmdrift.checkpoint`)
            and a rerun loads it; Ctrl-C raises :class:`gemmdrift.checkpoint.Interrupted` with the partial Result.
    """
    from ..checkpoint import Checkpoints, Interrupted, partial_inputs
    from ..machine.envinfo import environment

    specs = [parse_path(p) for p in paths]
    ts = sorted(set(int(t) for t in ts))
    if not ts or ts[0] < 1:
        raise GemmdriftError("block sizes T must be positive")
    for s in specs:
        check_path(s, K, N, window)
    env = dict(env or environment())
    from ..workers import run_tasks

    n_workers = _fp_workers(workers, len(specs))
    ck = Checkpoints(checkpoint, "fingerprint", None, K, N, window)
    jobs = [dict(path=s.text, K=K, ts=ts, N=N, window=window, draw_k=draw_k, env=env,
                 progress=progress is not None if n_workers > 1 else progress, checkpoint=ck.spec()) for s in specs]
    try:
        parts = run_tasks(_measure_path, jobs, n_workers)
    except KeyboardInterrupt:
        # What finished is on disk (written by whichever process measured it): the partial Result is read back.
        parts = [_measure_path(**dict(job, progress=None), only_saved=True) for job in jobs]
        done = sum(p["done"] for p in parts)
        total = sum(len(ts) if s.op != "numpy" else 1 for s in specs if s.recoverable)
        result = _fingerprint_result(specs, parts, paths, K, ts, N, window, draw_k, env,
                                     partial_inputs(done, total, "path x T")) if done else None
        raise Interrupted(result, done, total) from None
    return _fingerprint_result(specs, parts, paths, K, ts, N, window, draw_k, env, {})


def _fingerprint_result(specs, parts, paths, K, ts, N, window, draw_k, env, extra: dict[str, Any]):
    """The Result of :func:`measure` from the per-path parts of :func:`_measure_path`."""
    import pandas as pd

    from ..result import Result, env_labels, tidy
    rows: list[dict[str, Any]] = [r for p in parts for r in p["rows"]]
    trees: dict[str, str] = {k: v for p in parts for k, v in p["trees"].items()}
    accum: list[dict[str, Any]] = [a for p in parts for a in p["accum"]]
    small: dict[str, Any] = {k: v for p in parts for k, v in p["small"].items()}
    origin = next((p["origin"] for p in parts if p["origin"]), "")
    figures: dict[str, float] = {}
    table = pd.DataFrame(rows)
    for s in specs:
        sub = table[(table["path"] == s.text) & (table["status"] == "recovered")]
        if not s.recoverable or not len(table[table["path"] == s.text]) or (
                table[table["path"] == s.text]["status"] == FP16_FLUSHED).any():  # no figure, not "unrecovered"
            continue
        figures[f"{s.text}.unrecovered"] = float((table[table["path"] == s.text]["status"] != "recovered").sum())
        if len(sub):
            figures[f"{s.text}.distinct_trees"] = float(sub["fingerprint"].nunique())
            first = sub[sub["T"] == sub["T"].min()].iloc[0]
            last = sub[sub["T"] == sub["T"].max()].iloc[0]
            figures[f"{s.text}.tree_id_t{int(first['T'])}"] = float(first["tree_id"])
            figures[f"{s.text}.tree_id_tmax"] = float(last["tree_id"])
    tid = [{"pair": r["path"], "dtype": r["dtype"], "T": r["T"], "position": r["position"], "metric": "tree_id",
            "value": r["tree_id"]} for r in rows if r["status"] == "recovered"]
    frame = tidy(tid or [{"metric": "tree_id", "value": math.nan}], **env_labels(env))
    inputs = {"paths": list(paths), "K": K, "ts": ts, "N": N, "window": window, "draw_k": draw_k,
              "method": "FPRev cancellation probes (+M, -M, units), Xie et al., USENIX ATC '25", **extra}
    details = {"trees": trees, "small_trees": small, "prediction_origin": origin,
               "encodings": {s.text: vars(encoding_for(s.dtype, K, window=window,
                                                       divisor=K if s.op == "sdpa" else 1))
                             for s in specs if s.recoverable}}
    return Result(kind="fingerprint", inputs=inputs, env=env, frame=frame, figures=figures,
                  tables={"fingerprints": table.drop(columns=[]),
                          "accumulator": pd.DataFrame(accum, columns=["path", "T", "units", "sum", "exact"])},
                  details=details)

def _fp_workers(workers: int | None, parts: int) -> int:
    """Processes for the paths of :func:`measure`: as given, else 2 on a CPU device with 2 cores or more (1 inside
    a worker process)."""
    import os

    import mlx.core as mx

    from ..workers import in_worker

    if workers is not None:
        if workers < 1:
            raise GemmdriftError(f"workers must be at least 1, got {workers}")
        return max(1, min(workers, parts))
    if in_worker():
        return 1
    return 2 if parts > 1 and mx.default_device() == mx.cpu and (os.cpu_count() or 1) >= 2 else 1


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _measure_path(*, path: str, K: int, ts: list[int], N: int, window: int | None, draw_k: int,
                  env: dict[str, Any], progress, checkpoint: dict[str, Any] | None = None,
                  only_saved: bool = False) -> dict[str, Any]:
    """Every T of one path for :func:`measure` (module level: paths may run in separate processes, where
    ``progress=True`` prints to stderr). Each finished T is saved to ``checkpoint`` (a Checkpoints spec) and
    loaded from there on a rerun; ``only_saved``: load what was saved, compute nothing (``done`` counts it)."""
    from ..checkpoint import Checkpoints

    ck = Checkpoints.from_spec(checkpoint)
    done = 0
    progress = _stderr if progress is True else (progress or None)
    s = parse_path(path)
    rows: list[dict[str, Any]] = []
    trees: dict[str, str] = {}
    accum: list[dict[str, Any]] = []
    small: dict[str, Any] = {}
    origin = ""
    if not s.recoverable:
        rows.append({"path": s.text, "op": s.op, "dtype": s.dtype, "K": K, "N": N, "T": math.nan,
                     "position": math.nan, "status": "not recoverable", "fingerprint": "", "tree_id": math.nan,
                     "description": NOT_RECOVERABLE[s.op], "depth": math.nan, "probes": 0, "calls": 0,
                     "seconds": 0.0, "predicted_kernel": ""})
        return {"rows": rows, "trees": trees, "accum": accum, "small": small, "origin": origin, "done": 0}
    for T in (ts if s.op != "numpy" else [1]):
        unit = (f"{s.text}_T{T}", s.text, T, ts[0])
        saved = ck.load(*unit, check=lambda u: {"rows", "trees", "accum"} <= set(u))
        if saved is not None:
            rows += saved["rows"]
            trees.update(saved["trees"])
            accum += saved["accum"]
            origin = origin or saved.get("origin", "")
            done += 1
            if progress:
                progress(f"{s.text} K={K} T={T}: done before (resumed)")
            continue
        if only_saved:
            continue
        red = make_reducer(s, K, T, N, window)
        if T == ts[0] and not fp16_subnormals_kept(red):  # say so, not "not recovered" at every T
            rows.append({"path": s.text, "op": s.op, "dtype": s.dtype, "K": K, "N": N, "T": math.nan,
                         "position": math.nan, "status": FP16_FLUSHED, "fingerprint": "", "tree_id": math.nan,
                         "description": FP16_FLUSHED, "depth": math.nan, "probes": 0, "calls": red.calls,
                         "seconds": 0.0, "predicted_kernel": ""})
            return {"rows": rows, "trees": trees, "accum": accum, "small": small, "origin": origin, "done": done}
        n_rows, n_accum, old_trees = len(rows), len(accum), set(trees)
        if T == ts[0]:
            acc = accumulator_check(red)
            accum.append({"path": s.text, "T": T, **acc})
        t0 = time.perf_counter()
        recs, stats = recover(red, progress=progress)
        secs = time.perf_counter() - t0
        pred, o = _predict(s, env, K, N, T)
        meta = getattr(red, "meta", None) or {}
        if s.op == "replay" and meta.get("kernel"):  # the recipe replayed is the prediction (D17)
            pred = meta["kernel"] + (f" {meta['variant']}" if meta.get("variant") else "")
            o = "the replay recipe's kernel (a prediction for that chip)"
        origin = origin or o
        for pos, rec in enumerate(recs):
            fp = fingerprint(rec.tree) if rec.ok else ""
            if rec.ok and fp not in trees:
                trees[fp] = to_text(rec.tree)
                trees[fp + ":description"] = describe(rec.tree)
            rows.append({"path": s.text, "op": s.op, "dtype": s.dtype, "K": K, "N": N, "T": T, "position": pos,
                         "status": "recovered" if rec.ok else "not recovered", "fingerprint": fp,
                         "tree_id": tree_id(fp) if rec.ok else math.nan,
                         "description": trees[fp + ":description"] if rec.ok else rec.problem,
                         "depth": depth(rec.tree) if rec.ok else math.nan, "probes": stats["probes"],
                         "calls": stats["calls"], "seconds": secs, "predicted_kernel": pred})
        ck.save(unit[0], {"rows": rows[n_rows:], "accum": accum[n_accum:], "origin": o,
                          "trees": {k: v for k, v in trees.items() if k not in old_trees}}, *unit[1:])
        done += 1
        if progress:
            progress(f"{s.text} K={K} T={T}: {len({r['fingerprint'] for r in rows[-T:]})} tree(s), "
                     f"{stats['probes']} probes in {stats['calls']} calls, {secs:.1f} s")
    if draw_k and not only_saved:
        k_small = max(draw_k, s.group_size) if s.op == "quant" else draw_k
        try:
            red = make_reducer(s, k_small, 1, N, window)
            rec = recover(red)[0][0]
            small[s.text] = {"K": k_small, "tree": to_text(rec.tree) if rec.ok else "",
                             "fingerprint": fingerprint(rec.tree) if rec.ok else "",
                             "description": describe(rec.tree) if rec.ok else rec.problem}
        except GemmdriftError as e:
            small[s.text] = {"K": k_small, "tree": "", "fingerprint": "", "description": str(e)}
    return {"rows": rows, "trees": trees, "accum": accum, "small": small, "origin": origin, "done": done}
