"""The state sweep: every operation over every setup and position, its workers, checkpoints and Result."""

from __future__ import annotations

import math
import sys
import time
from dataclasses import asdict
from typing import Any, Callable, Sequence

import pandas as pd

from ..errors import GemmdriftError
from ..result import Result, Verdict, env_labels, tidy
from .reading import Diff, KNOWN_CLASSES, Absent, cache_class, cache_classes, judge, mlx_lm_version
from .common import (
    COMPUTE_LIMIT_EXTRA,
    CONTINUATION,
    DEFAULT_KS,
    DEFAULT_OPERATIONS,
    DEFAULT_WHERE,
    KS,
    OPERATIONS,
    OPTIONAL_SETUPS,
    Setup,
    WHERE,
    other_token,
    material,
    token_stream,
    window_of,
    compute_prefix,
    model_setups,
    prefix_lengths,
)
from .rollback import rollback_side, rollback_cases
from .trim import class_factories, trim_case
from .saveload import save_load_case
from .server_reuse import lru_prompt_cache_class, server_case
from .batch import batch_vs_alone


def _row(cache: str, operation: str, where: str, prefix: int | None, window: int | None, params: str,
         verdict: Verdict, reason: str, diff: Diff | None = None, shrink: float = math.nan, **extra) -> dict[str, Any]:
    d = diff or Diff()
    return {"cache": cache, "operation": operation, "where": where, "prefix": prefix,
            "rel_window": (prefix - window) if (prefix is not None and window) else None, "params": params,
            "verdict": str(verdict), "reason": reason, "max_abs": d.max_abs, "rel_l2": d.rel_l2,
            "max_abs_dlogit": d.max_abs_dlogit, "shrink": shrink,
            "layers_differ": ",".join(map(str, d.layers)), "mlx_lm_function": OPERATIONS[operation],
            "mlx_lm_version": mlx_lm_version(), **extra}


class _Float32:
    """The model at float32 for the duration of a block (the precision ladder); bf16 values upcast exactly."""

    def __init__(self, lm):
        self.lm = lm

    def __enter__(self):
        from ..model import cast_model
        from ..machine.runenv import rung_true_float32

        self.old = self.lm.description.dtype
        cast_model(self.lm.model, "float32")
        self.probe = rung_true_float32()  # TF32 (CUDA, M5-class GPUs) cannot tell rounding from a bug
        return self

    def __exit__(self, *exc):
        from ..model import cast_model

        cast_model(self.lm.model, self.old)
        return False


def _raised(s: Setup) -> Verdict:
    """The verdict of a case that raised: a plug-in refused it; mlx-lm's own classes keep today's STATE BUG."""
    return Verdict.REFUSED if s.plugin else Verdict.STATE_BUG


def _progress(msg: str) -> None:
    print(f"gemmdrift state: {msg}", file=sys.stderr, flush=True)


def _say(msg: str) -> None:
    """Progress through the package's `_progress` (gemmdrift.state._progress), the name callers swap."""
    sys.modules[__package__]._progress(msg)


def _sweep(lm, operations: Sequence[str], where: Sequence[str] | None, ks: Sequence[int] | None,
           setups: Sequence[Setup] | None, ladder: bool, envelope: float | None, compute_limit: int | None,
           caches: Sequence[str] | None, checkpoint=None) -> dict[str, Any]:
    """The cases of ``operations`` (arguments as :func:`measure_state`, validated): the table's rows in order,
    and what the prefix cost. ``checkpoint`` (:class:`gemmdrift.checkpoint.Checkpoints`): each rollback cell
    (setup x prefix position, the sweep's longest part) is saved before the ladder and loaded on a rerun."""
    where_for = (lambda name: DEFAULT_WHERE.get(name, WHERE)) if where is None else (lambda name, w=tuple(where): w)
    where = tuple(WHERE) if where is None else tuple(where)
    ks_for = (lambda name: DEFAULT_KS.get(name, KS)) if ks is None else (lambda name, ks=tuple(ks): ks)
    ks = tuple(KS) if ks is None else tuple(ks)
    window = window_of(lm)
    lengths = {w: p for w, p in prefix_lengths(window, max(max(ks), max(KS))).items() if w in where}
    setups_given = setups
    setups = list(setups) if setups is not None else model_setups(lm)
    if caches is not None:
        setups = [s for s in setups if s.name in caches]
    elif setups_given is None:
        # ConcatenateKVCache is mlx-lm's mock cache (no model makes it for generation): model cases only when
        # asked for by name; the model-free trim cases always cover it.
        setups = [s for s in setups if s.name not in OPTIONAL_SETUPS]
    longest = max(lengths.values()) + 8 + max(KS) + CONTINUATION
    limit = compute_limit if compute_limit is not None else (min(lengths.values()) + COMPUTE_LIMIT_EXTRA)
    computed = min(max(lengths.values()), max(limit, 1))
    tokens = token_stream(lm, max(longest, computed + 16))
    need_model = any(o in operations for o in ("rollback", "save_load", "server_reuse", "batch"))
    prefix = None
    if need_model:
        _say(f"prefill of {computed} tokens (every layer a KVCache) for the prefix states")
        prefix = compute_prefix(lm, tokens, computed)
        _say(f"  {prefix.seconds:.1f} s")
    rows: list[dict[str, Any]] = []
    ladder_jobs: list[tuple[int, Callable[[], Diff], Diff]] = []
    fp32_probe = None  # the float32 rung's probe, when the ladder ran
    vocab = lm.vocab_size

    def add(row, diff: Diff | None, refused: bool = False, rerun: Callable[[], Diff] | None = None):
        rows.append(row)
        if diff is not None and not refused and not diff.identical and diff.structure and ladder and rerun:
            ladder_jobs.append((len(rows) - 1, rerun, diff))

    def cells(op: str):
        """(setup, where, prefix) of every case of ``op``; a 'not applicable' row for a setup the model lacks."""
        for s in setups:
            if s.make is None:
                rows.append(_row(s.name, op, "", None, window, "", Verdict.NOT_APPLICABLE, s.note))
                continue
            for w, p in lengths.items():
                if w in where_for(s.name):
                    yield s, w, p

    # a. speculative rollback
    if "rollback" in operations:
        for s, w, p in cells("rollback"):
            t0 = time.perf_counter()
            saved = checkpoint.load("rollback-cell", s.name, w, p, check=lambda u: "cases" in u) if checkpoint else None
            if saved is not None:  # the rows as judged before the ladder, and what the ladder needs to rerun them
                mat = material(prefix.tokens, p, 2 + max(KS) + CONTINUATION)
                for c in saved["cases"]:
                    add(c["row"], Diff(**c["diff"]), c["refused"], (lambda s=s, p=p, k=c["k"], r=c["r"], mat=mat:
                                                                    rollback_side(lm, s, prefix, p, mat, k, r,
                                                                                   dtype=_f32())[0]))
                _say(f"rollback {s.name} {w} (prefix {p}): done before (resumed)")
                continue
            cell = []
            try:
                found = rollback_cases(lm, s, prefix, p, ks_for(s.name))
            except Exception as e:  # the cache could not even take the prefix or the block
                found = [{"k": k, "r": r, "raised": f"raised {type(e).__name__}: {str(e)[:120]}"}
                         for k in ks_for(s.name) for r in range(k + 1)]
            for c in found:
                if "raised" in c:  # refused: kept like the others, without a ladder rerun
                    row = _row(s.name, "rollback", w, p, window, f"k={c['k']} r={c['r']}", _raised(s), c["raised"],
                               k=c["k"], r=c["r"], note=s.note)
                    add(row, None, True)
                    cell.append({"row": row, "diff": asdict(Diff()), "refused": True, "k": c["k"], "r": c["r"]})
                    continue
                refused = c["r"] > 0 and c["trimmed"] < c["r"]
                v, why, _ = judge(c["diff"], refused=refused,
                                  envelope=envelope)
                row = _row(s.name, "rollback", w, p, window, f"k={c['k']} r={c['r']}", v, why, c["diff"],
                           k=c["k"], r=c["r"], trimmed=c["trimmed"], note=s.note)
                add(row, c["diff"], refused, (lambda s=s, p=p, c=c: rollback_side(
                    lm, s, prefix, p, c["mat"], c["k"], c["r"], dtype=_f32())[0]))
                cell.append({"row": row, "diff": asdict(c["diff"]), "refused": refused, "k": c["k"], "r": c["r"]})
            if checkpoint:
                checkpoint.save("rollback-cell", {"cases": cell}, s.name, w, p)
            _say(f"rollback {s.name} {w} (prefix {p}): {time.perf_counter() - t0:.1f} s")

    # b. trim, directly and through trim_prompt_cache (no model: synthetic keys, window 16)
    if any(o in operations for o in ("trim", "trim_prompt_cache", "draft_trim")):
        syn_window = 16
        syn = prefix_lengths(syn_window, 2)
        facts = class_factories(syn_window)
        plug = {n: f for s in setups for n, f in (s.trim_makers or {}).items()}
        if plug:  # a plug-in is judged on its own classes, at their own window
            facts = plug
        wanted = [name for name in facts if plug or caches is None or name.split("(")[0] in caches]
        for name in wanted:
            make = facts[name]
            syn_window = getattr(make, "window", None) or 16
            syn = prefix_lengths(syn_window, 2)
            for via in ("trim", "trim_prompt_cache", "draft_trim"):
                if via not in operations:
                    continue
                if make == "absent":
                    rows.append(_row(name, via, "", None, None, "", Verdict.NOT_APPLICABLE,
                                     f"mlx-lm {mlx_lm_version()} has no {name.split('(')[0]}"))
                    continue
                if make is None:
                    rows.append(_row(name, via, "", None, None, "", Verdict.NOT_APPLICABLE,
                                     "no trim: a recurrent state (is_trimmable() is False); speculative_generate_step "
                                     "refuses such caches up front", note="model-free, synthetic keys"))
                    continue
                for w, p in syn.items():
                    if w not in where:
                        continue
                    # draft_trim: k = 3 drafting steps of one token, the draft's rewind of k - n - 1, then T=1
                    # (a rejection) or T=2 (all accepted: the last draft and the correction).
                    shapes = (((1, CONTINUATION), (2, CONTINUATION), (1, 1), (2, 1)) if via != "draft_trim"
                              else ((1, 1), (2, 1), (1, 2), (2, 2)))
                    for n, m in shapes:
                        params = (f"block=3 trim={n} then T={m}" if via != "draft_trim"
                                  else f"3 x T=1 trim={n} then T={m}")
                        try:
                            c = trim_case(make, p, 3, n, "trim_prompt_cache" if via == "draft_trim" else via,
                                          continuation=(m,), single=via == "draft_trim")
                        except Exception as e:  # a class that cannot even run the case is reported, not fatal
                            rows.append(_row(name, via, w, p, syn_window, params,
                                             Verdict.REFUSED if name in plug else Verdict.STATE_BUG,
                                             f"raised {type(e).__name__}: {e}", note="model-free, synthetic keys"))
                            continue
                        refused = c["trimmed"] < n
                        v, why, _ = judge(c["diff"], refused=refused and not c["diff"].identical)
                        if v == Verdict.STATE_BUG and not refused and c["diff"].structure:
                            why = c["diff"].why + " (no model here: moving data cannot round)"
                        if refused and c["diff"].identical:
                            why = f"trimmed {c['trimmed']} of {n}, yet the state matches"
                        why = (f"can_trim={c['can_trim']}, trimmed {c['trimmed']} of {n}; " + why)
                        rows.append(_row(name, via, w, p, syn_window, params, v, why, c["diff"],
                                         trimmed=c["trimmed"], note=f"model-free, synthetic keys, window {syn_window}"))
        _say("trim: done")

    # c. save / load round trip
    if "save_load" in operations:
        for s, w, p in cells("save_load"):
            for block in (1, CONTINUATION):
                try:
                    d, _ = save_load_case(lm, s, prefix, p, block)
                except Exception as e:
                    rows.append(_row(s.name, "save_load", w, p, window, f"continue T={block}", _raised(s),
                                     f"raised {type(e).__name__}: {e}", note=s.note))
                    continue
                v, why, _ = judge(d, envelope=envelope)
                add(_row(s.name, "save_load", w, p, window, f"continue T={block}", v, why, d, note=s.note), d,
                    rerun=lambda s=s, p=p, block=block: save_load_case(lm, s, prefix, p, block, dtype=_f32())[0])
        _say("save/load: done")

    # d. server prompt reuse
    if "server_reuse" in operations:
        lru = lru_prompt_cache_class()
        fetch = getattr(lru, "fetch_nearest_cache", None)
        for s in setups:
            if fetch is None:
                rows.append(_row(s.name, "server_reuse", "", None, window, "", Verdict.NOT_APPLICABLE,
                                 f"mlx-lm {mlx_lm_version()} has no LRUPromptCache.fetch_nearest_cache"))
                continue
            if s.make is None:
                rows.append(_row(s.name, "server_reuse", "", None, window, "", Verdict.NOT_APPLICABLE, s.note))
                continue
            for w, p in lengths.items():
                if w not in where_for(s.name):
                    continue
                for kind in ("longer", "shorter", "branch"):
                    params = f"{kind}"
                    try:
                        r = server_case(lm, s, prefix, p, kind)
                    except Exception as e:
                        rows.append(_row(s.name, "server_reuse", w, p, window, params, _raised(s),
                                         f"continuing from the fetched cache raised {type(e).__name__}: {str(e)[:120]}",
                                         note=s.note))
                        continue
                    if r["diff"] is None:
                        rows.append(_row(s.name, "server_reuse", w, p, window, params, Verdict.NOT_APPLICABLE,
                                         "the server did not reuse the stored cache (can_trim_prompt_cache is False): "
                                         "it recomputes the request from scratch" if r["reused"] == 0 else
                                         "nothing left to compute", reused=r["reused"], note=s.note))
                        continue
                    v, why, _ = judge(r["diff"], envelope=envelope)
                    add(_row(s.name, "server_reuse", w, p, window, params, v,
                             f"reused {r['reused']} tokens, computed {r['rest']}; {why}", r["diff"],
                             reused=r["reused"], note=s.note), r["diff"],
                        rerun=lambda s=s, p=p, kind=kind: server_case(lm, s, prefix, p, kind, dtype=_f32())["diff"])
        _say("server reuse: done")

    # e. batch caches
    if "batch" in operations:
        for s in setups:
            if s.plugin:
                rows.append(_row(s.name, "batch", "", None, window, "", Verdict.NOT_APPLICABLE,
                                 "the batch case checks mlx-lm's Batch* classes (a plug-in's merge hands over to them)"))
                continue
            if s.name not in ("KVCache", "RotatingKVCache"):
                continue
            bname = "BatchKVCache" if s.name == "KVCache" else "BatchRotatingKVCache"
            if s.make is None or cache_class(bname) is Absent or not hasattr(cache_class(s.name), "merge"):
                rows.append(_row(bname, "batch", "", None, window, "", Verdict.NOT_APPLICABLE,
                                 s.note if s.make is None else f"mlx-lm {mlx_lm_version()} cannot batch {s.name}"))
                continue
            for w, p in lengths.items():
                q = max(1, p // 2 + 1)
                for op in ("extend", "filter"):
                    def run(dtype=None, s=s, p=p, q=q, op=op):
                        seq_cache = s.build(lm, prefix, p, dtype)
                        oth_cache = s.build(lm, prefix, q, dtype)
                        seq = material(prefix.tokens, p, 1)
                        oth = [other_token(t, vocab) for t in material(prefix.tokens, q, 1)]
                        return batch_vs_alone(lm, seq, oth, op=op, caches=(seq_cache, oth_cache),
                                              cache_factory=s.make)["diff"]
                    try:
                        d = run()
                    except Exception as e:
                        rows.append(_row(bname, "batch", w, p, window, op, Verdict.STATE_BUG,
                                         f"raised {type(e).__name__}: {e}", note=s.note))
                        continue
                    v, why, _ = judge(d, envelope=envelope)
                    add(_row(bname, "batch", w, p, window, f"{op} (other sequence {q} tokens)", v, why, d,
                             note=f"from the {s.name} setup: {s.note}"), d,
                        rerun=lambda run=run: run(_f32()))
        _say("batch: done")

    # The precision ladder for cases that differ with the same structure.
    if ladder_jobs:
        _say(f"precision ladder: {len(ladder_jobs)} cases at float32")
        with _Float32(lm) as rung:
            fp32_probe = rung.probe
            for i, rerun, diff in ladder_jobs:
                f32 = rerun()
                v, why, shrink = judge(diff, f32, envelope=envelope, true_float32=rung.probe["true_float32"])
                rows[i].update(verdict=str(v), reason=why, shrink=shrink, f32_rel_l2=f32.rel_l2,
                               f32_max_abs_dlogit=f32.max_abs_dlogit)
    return {"rows": rows, "lengths": lengths, "setups": {s.name: s.note for s in setups}, "fp32_probe": fp32_probe,
            "computed_prefix": prefix.computed if prefix else 0, "prefix_seconds": prefix.seconds if prefix else 0.0}


def measure_state(lm, *, operations: Sequence[str] = DEFAULT_OPERATIONS, where: Sequence[str] | None = None,
                  ks: Sequence[int] | None = None, setups: Sequence[Setup] | None = None, ladder: bool = True,
                  envelope: float | None = None, compute_limit: int | None = None,
                  caches: Sequence[str] | None = None, workers: int | None = None, checkpoint=None,
                  implementations: dict[str, Any] | None = None) -> Result:
    """Check every cache operation of ``operations`` on the model's caches; one row per case.

    Args:
        lm: the loaded model (:func:`gemmdrift.model.load_model`).
        operations: any of :data:`OPERATIONS`.
        where: prefix lengths relative to the sliding window (:func:`prefix_lengths`). Default: all
            four, except below and past for the QuantizedKVCache; given explicitly, for every cache.
        ks: draft counts for the rollback (every r = 0..k is run). Default: 1..4, except
            k = 2 alone for the QuantizedKVCache (its CPU attention is slow, and its cache
            mechanics do not depend on the window); given explicitly, it applies to every cache.
        setups: cache setups (default :func:`model_setups`; tests pass planted ones).
        ladder: rerun cases that differ (with the same structure) at float32.
        envelope: largest max|Δlogit| still called rounding (None: the ladder decides).
        compute_limit: really compute at most this many prefix positions (default: the
            shortest prefix + 16); longer prefixes repeat the computed keys and values.
        caches: only these cache setups / classes (names as in the table).
        implementations: recorded in the Result's inputs (a --cache-impl's spec, file and sha256).
        workers: processes sharing the sweep (the rollback in one, the other operations in another),
            each loading the model again. Default: 2 on a CPU device with at least 2 cores when the
            sweep has model work on both sides and the model can be loaded again; else 1 (on a GPU the
            processes would only queue on the one device). The table is the same either way.
        checkpoint: an output directory: each finished half of the sweep (:data:`WORKER_GROUPS`) is saved
            under it (:mod:`gemmdrift.checkpoint`) and a rerun loads it; Ctrl-C raises
            :class:`gemmdrift.checkpoint.Interrupted` with the partial Result (planted ``setups``: no checkpoints).
    """
    from ..checkpoint import Checkpoints, Interrupted, partial_inputs
    from ..machine.envinfo import environment

    unknown_ops = [o for o in operations if o not in OPERATIONS]
    if unknown_ops:
        raise GemmdriftError(f"unknown operation {unknown_ops[0]!r} (choose from {', '.join(OPERATIONS)})")
    bad_where = [w for w in (where or ()) if w not in WHERE]
    if bad_where:
        raise GemmdriftError(f"unknown prefix position {bad_where[0]!r} (choose from {', '.join(WHERE)})")
    if ks is not None and (not ks or min(ks) < 1):
        raise GemmdriftError("draft counts k must be positive")
    if lm.description.synthetic and lm.description.kind == "shape":
        raise GemmdriftError("gemmdrift state needs real weights or a small model (a shape: model is too big to run)")
    t_start = time.perf_counter()
    env = environment()
    impl_extra = {"implementations": implementations} if implementations else {}
    args = dict(where=where, ks=ks, ladder=ladder, envelope=envelope, compute_limit=compute_limit, caches=caches)
    groups = [tuple(o for o in g if o in operations) for g in WORKER_GROUPS]
    groups = [g for g in groups if g]
    n = _workers(lm, workers, groups, setups)
    # One checkpoint per half of the sweep; its rows are the same whichever process ran it.
    ck = Checkpoints(checkpoint if setups is None else None, "state", lm.description, args)
    if ck.dir is None and n == 1:
        groups = [tuple(operations)]  # nothing to keep: the one sweep, one prefix
    saved = {g: ck.load("-".join(g), list(g), check=lambda u: "rows" in u) for g in groups}
    todo = [g for g in groups if saved[g] is None]
    for g in groups:
        if saved[g] is not None:
            _say(f"{', '.join(g)}: done before (resumed)")
    try:
        if n > 1 and len(todo) > 1:
            from ..workers import run_jobs

            _say(f"{len(todo)} processes share the sweep: " + "; ".join(", ".join(g) for g in todo))
            jobs = [dict(args, operations=g, checkpoint=ck.spec()) for g in todo]
            saved.update(zip(todo, run_jobs(lm, _sweep_job, jobs, n)))  # each also saved its own checkpoint
        else:
            for g in todo:
                saved[g] = _sweep(lm, g, setups=setups, checkpoint=ck if ck.dir else None, **args)
                ck.save("-".join(g), saved[g], list(g))
    except KeyboardInterrupt:
        done = {g: saved[g] or ck.load("-".join(g), list(g)) for g in groups}
        parts = [p for p in done.values() if p is not None]
        halves = len(parts)
        partial = partial_inputs(halves, len(groups), "half of the sweep")
        what = f"{halves} of {len(groups)} {'half' if len(groups) == 1 else 'halves'} of the sweep"
        unfinished = next((g for g in groups if "rollback" in g and done[g] is None), None)
        if unfinished is not None and ck.dir is not None:  # the finished cells of the rollback still running
            cells, n_cells, total_cells = _finished_cells(lm, ck, where, ks, caches)
            if n_cells:
                parts.append(cells)
                what += f" and {n_cells} of {total_cells} rollback cells (judged before the float32 ladder)"
                partial["partial"].update(unit=f"half of the sweep, and {n_cells} of {total_cells} rollback cells "
                                               f"of the unfinished one (judged before the float32 ladder)",
                                          cells={"done": n_cells, "total": total_cells})
        result = _state_result(lm, operations, where, ks, ladder, envelope, parts, n, env, t_start,
                               {**partial, **impl_extra}) if parts else None
        raise Interrupted(result, halves, len(groups), what=what) from None
    return _state_result(lm, operations, where, ks, ladder, envelope, [saved[g] for g in groups], n, env, t_start,
                         dict(impl_extra))


def _finished_cells(lm, ck, where, ks, caches) -> tuple[dict[str, Any], int, int]:
    """The rollback cells (setup x prefix position) :func:`_sweep` saved under ``ck`` before the interrupt, as a
    sweep part (their rows as judged before the ladder), with how many finished of how many; the cells are the
    ones :func:`_sweep` runs for these arguments (the model's own setups)."""
    where_for = (lambda name: DEFAULT_WHERE.get(name, WHERE)) if where is None else (lambda name, w=tuple(where): w)
    wanted = tuple(WHERE) if where is None else tuple(where)
    k_max = max(max(ks or KS), max(KS))
    lengths = {w: p for w, p in prefix_lengths(window_of(lm), k_max).items() if w in wanted}
    setups = [s for s in model_setups(lm)
              if (s.name in caches if caches is not None else s.name not in OPTIONAL_SETUPS)]
    keys = [(s, w, p) for s in setups if s.make is not None for w, p in lengths.items() if w in where_for(s.name)]
    rows: list[dict[str, Any]] = []
    finished = 0
    for s, w, p in keys:
        saved = ck.load("rollback-cell", s.name, w, p, check=lambda u: "cases" in u)
        if saved is not None:
            finished += 1
            rows += [c["row"] for c in saved["cases"]]
    part = {"rows": rows, "lengths": lengths, "setups": {s.name: s.note for s in setups}, "fp32_probe": None,
            "computed_prefix": 0, "prefix_seconds": 0.0}
    return part, finished, len(keys)


def _state_result(lm, operations, where, ks, ladder, envelope, parts, n, env, t_start, extra) -> Result:
    """The Result of :func:`measure_state` from its finished sweep parts."""
    rows = [row for part in parts for row in part["rows"]]
    lengths = parts[0]["lengths"]
    model_part = next((p for p in parts if p["computed_prefix"]), parts[0])
    window = window_of(lm)

    # Classes of a newer mlx-lm that this module does not know.
    for name in cache_classes():
        if name not in KNOWN_CLASSES:
            for op in operations:
                rows.append(_row(name, op, "", None, window, "", Verdict.NOT_CHECKED,
                                 f"{name} is a cache class of mlx-lm {mlx_lm_version()} that gemmdrift does not know"))
    seconds = time.perf_counter() - t_start
    table = pd.DataFrame(rows)
    return _result(lm, env, table, {"operations": list(operations), "where": list(where or WHERE),
                                    "prefixes": lengths, "ks": list(ks or KS), "ladder": ladder, "envelope": envelope,
                                    "computed_prefix": model_part["computed_prefix"],
                                    "prefix_seconds": model_part["prefix_seconds"],
                                    "window": window, "setups": {k: v for p in parts for k, v in p["setups"].items()},
                                    "ladder_float32": next((p["fp32_probe"] for p in parts if p.get("fp32_probe")),
                                                           None),
                                    "workers": n, **extra}, seconds)


# The sweep's two halves when it runs in two processes (about equal time on the embedded Gemma).
WORKER_GROUPS = (("rollback",), ("trim", "trim_prompt_cache", "draft_trim", "save_load", "server_reuse", "batch"))
_MODEL_OPERATIONS = ("rollback", "save_load", "server_reuse", "batch")


def _workers(lm, workers: int | None, groups: list[tuple[str, ...]], setups) -> int:
    """How many processes run the sweep (see :func:`measure_state`): only the model's own cache setups can be
    rebuilt in another process, and a half without model work is not worth a model load."""
    from ..workers import check_workers

    if workers is None and (setups is not None or sum(any(o in _MODEL_OPERATIONS for o in g) for g in groups) < 2):
        return 1
    if workers is not None and workers > 1 and setups is not None:
        raise GemmdriftError("a sweep in several processes needs the default cache setups (they are rebuilt there)")
    return check_workers(lm, workers, len(groups))


def _sweep_job(lm, **kwargs) -> dict[str, Any]:
    """One half of the sweep in a worker process; saved to its checkpoint there (the parent reads it back)."""
    from ..checkpoint import Checkpoints

    ck = Checkpoints.from_spec(kwargs.pop("checkpoint", None))
    ops = kwargs.pop("operations")
    part = _sweep(lm, ops, setups=None, checkpoint=ck if ck.dir else None, **kwargs)
    ck.save("-".join(ops), part, list(ops))
    return part


def _f32():
    import mlx.core as mx

    return mx.float32


NON_EXACT = (str(Verdict.ROUNDING), str(Verdict.STATE_BUG), str(Verdict.REFUSED))


def figure_name(cache: str, operation: str) -> str:
    """The tracked figure counting the non-exact cases of one cache class and operation."""
    return f"non_exact.{cache}.{operation}"


def _result(lm, env, table: pd.DataFrame, inputs: dict[str, Any], seconds: float) -> Result:
    labels = env_labels(env)
    frame_rows = []
    figures: dict[str, float] = {}
    for _, r in table.iterrows():
        for metric in ("max_abs", "rel_l2", "max_abs_dlogit", "shrink"):
            val = r.get(metric)
            if val is None or (isinstance(val, float) and math.isnan(val)):
                continue
            frame_rows.append({"pair": r["cache"], "mode": r["operation"], "tap": r["params"],
                               "key_length": r["prefix"], "metric": metric, "value": float(val),
                               "where": r["where"], "verdict": r["verdict"]})
    for (cache, op), g in table.groupby(["cache", "operation"], sort=True):
        checked = g[g["verdict"].isin([str(Verdict.EXACT), *NON_EXACT])]
        if len(checked):
            figures[figure_name(cache, op)] = float(g["verdict"].isin(NON_EXACT).sum())
            figures[f"cases.{cache}.{op}"] = float(len(checked))
    figures["state_bugs"] = float((table["verdict"] == str(Verdict.STATE_BUG)).sum()) if len(table) else 0.0
    figures["seconds"] = float(seconds)
    frame = tidy(frame_rows, model=lm.description.source, dtype=lm.description.dtype, **labels)
    return Result(kind="state", inputs={"model": dict(lm.info), **inputs}, env=env, frame=frame, figures=figures,
                  tables={"state": table}, details={"mlx_lm": mlx_lm_version(), "seconds": seconds})


# The short sweep of `gemmdrift run` (suite.main_job), per size.
SHORT = {
    "cpu": dict(operations=("rollback", "trim", "trim_prompt_cache"), where=("below", "past"), ks=(2,),
                caches=("KVCache", "RotatingKVCache")),
    "gpu": dict(operations=("rollback", "trim", "trim_prompt_cache", "save_load"), where=WHERE, ks=(1, 2, 3),
                caches=("KVCache", "RotatingKVCache")),
    "quick": dict(operations=("rollback", "trim_prompt_cache"), where=("below",), ks=(1,), caches=("KVCache",),
                  compute_limit=32),
}


def short_sweep(lm, size: str = "cpu") -> Result:
    """The short version of the sweep that `gemmdrift run` includes (see :data:`SHORT`)."""
    if size not in SHORT:
        raise GemmdriftError(f"unknown size {size!r} (choose {', '.join(SHORT)})")
    return measure_state(lm, **SHORT[size])
