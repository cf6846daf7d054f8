"""Divergence: greedy generation under two schedules, and teacher-forced triage (:mod:`gemmdrift.measure.triage`).

The two streams come from mlx-lm itself, so what gemmdrift reports is what
users see:

* **plain**: ``mlx_lm.generate.generate_step`` (T=1 decoding after a prefill
  in chunks of ``prefill_step``, 2048 by default),
* **speculative**: ``mlx_lm.generate.speculative_generate_step`` (what
  ``mlx_lm.generate --draft-model`` runs: verification in blocks of K+1,
  cache trimming after rejections, prefill chunks of 512 by default). Without
  a separate draft model the target drafts for itself, with its own cache:
  its proposals are plain T=1 decoding, and verification re-computes them in
  blocks of K+1, so every rejection is a numeric disagreement.

**Triage** finds the first divergence, teacher-forces the shared prefix under
both schedules, and reads the logits there. A divergence is a NEAR-TIE when
the two competing tokens are closer than the envelope (the largest change of a
top-2 gap that switching schedules made on the same prefix); otherwise it is
OUTSIDE ENVELOPE and a state bug (cache rollback, offsets, masks) is the
suspect. If the teacher-forced schedules are bit-identical there, the
divergence is not numeric at all.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Sequence

from .. import defaults
from ..model import native as native_kernels
from ..errors import GemmdriftError
from ..result import Verdict
from ..prompts import read_stream  # noqa: F401  (read before the model loads; kept here for callers)
from ..model.taps import Prefix, common_prefix, copy_cache, shared_blocks
from .speculative import (  # noqa: F401  (the stream primitives and the exact rollback, re-exported)
    Generation, check_prompt, generate_speculative_exact, plain_schedule, speculative_exact_step, speculative_schedule,
)
from .triage import (  # noqa: F401  (triage's names, re-exported: callers import them from here)
    ENVELOPE_POSITIONS, MIN_ENVELOPE_POSITIONS, NEAR_TIE, OUTSIDE, Triage, check_stream, first_divergence, measure_triage,
    token_text, triage, triage_result,
)


def generate_plain(model, prompt: Sequence[int], n: int, prefill_step: int = defaults.PREFILL_PLAIN,
                   prompt_cache=None) -> Generation:
    """Greedy tokens from mlx-lm's own ``generate_step``."""
    import time

    import mlx.core as mx
    from mlx_lm.generate import generate_step

    check_prompt(prompt, n)
    t0 = time.perf_counter()
    out = []
    gen = generate_step(mx.array(list(prompt), dtype=mx.uint32), model, max_tokens=n,
                        prefill_step_size=prefill_step, prompt_cache=prompt_cache)
    for tok, _ in gen:
        out.append(int(tok))
    return Generation(out, "plain", plain_schedule(prefill_step), time.perf_counter() - t0)


def generate_speculative(model, prompt: Sequence[int], n: int, k: int = defaults.DIVERGE_K, draft=None,
                         prefill_step: int = defaults.PREFILL_SPECULATIVE,
                         prompt_cache=None) -> Generation:
    """Greedy tokens from mlx-lm's own ``speculative_generate_step``.

    Args:
        draft: the draft model; None drafts with the target itself (own cache).
        prompt_cache: target caches followed by draft caches, as mlx-lm takes them
            (tests pass deliberately broken caches here).
    """
    import time

    import mlx.core as mx
    from mlx_lm.generate import speculative_generate_step

    check_prompt(prompt, n)
    if k <= 0:
        raise GemmdriftError(f"the number of draft tokens K must be positive, got {k}")
    t0 = time.perf_counter()
    out, accepted = [], 0
    gen = speculative_generate_step(mx.array(list(prompt), dtype=mx.uint32), model, draft if draft is not None else model,
                                    num_draft_tokens=k, max_tokens=n, prefill_step_size=prefill_step,
                                    prompt_cache=prompt_cache)
    for tok, _, from_draft in gen:
        out.append(int(tok))
        accepted += bool(from_draft)
    stats = {"draft": "self" if draft is None else "separate", "k": k, "accepted_drafts": accepted,
             "acceptance": accepted / len(out) if out else 0.0}
    return Generation(out, "speculative", speculative_schedule(prefill_step, k), time.perf_counter() - t0, stats)


def diverge(lm, prompt: Sequence[int], n: int, *, k: int = defaults.DIVERGE_K, draft=None,
            prefill_a: int = defaults.PREFILL_PLAIN, prefill_b: int = defaults.PREFILL_SPECULATIVE,
            plain_vs: str = "speculative", do_triage: bool = True, envelope: float | None = None,
            rollback: str = "mlx-lm", workers: int | None = None, cache_impl: str | None = None) -> dict[str, Any]:
    """Greedy generation of ``n`` tokens under two schedules, first divergence, and its triage.

    Args:
        plain_vs: 'speculative' (plain generate vs speculative generate, mlx-lm's defaults)
            or 'prefill' (plain generate with prefill_a vs plain generate with prefill_b).
        rollback: 'mlx-lm' (speculative_generate_step itself), 'exact' (the same loop with an
            exact cache rollback, :func:`generate_speculative_exact`) or ``module:function``
            (speculative_generate_step with that function as its rewind step, :mod:`gemmdrift.caches.plugins`).
        cache_impl: ``module:factory`` making the speculative stream's target and draft caches
            (:mod:`gemmdrift.state.bench`); the plain stream keeps mlx-lm's own caches (the reference).
        workers: processes for the two streams and the triage's two teacher-forced runs
            (:mod:`gemmdrift.workers`; default 2 on a multi-core CPU, one elsewhere). When both streams
            prefill the prompt in the same chunks and the draft is the target itself, the prefill is computed
            once here and every stream -- the speculative one's target and draft caches, and the triage's
            teacher-forced runs -- starts from a copy of its cache (the state mlx-lm's own prefill would
            leave; a copy sent to another process keeps its buffers). Each stream is the same computation
            either way.
    """
    if rollback not in ("mlx-lm", "exact") and ":" not in rollback:
        raise GemmdriftError(f"unknown rollback {rollback!r} (mlx-lm, exact or module:function)")
    if plain_vs not in ("speculative", "prefill"):
        raise GemmdriftError(f"unknown comparison {plain_vs!r} (speculative or prefill)")
    from ..workers import check_workers, pool, run_jobs

    prompt = [int(t) for t in prompt]
    check_prompt(prompt, n)
    jobs = [dict(kind="plain", prompt=prompt, n=n, prefill=prefill_a),
            dict(kind=plain_vs, prompt=prompt, n=n, prefill=prefill_b, k=k, rollback=rollback,
                 **({"cache_impl": cache_impl} if cache_impl else {}))]
    schedules = [plain_schedule(prefill_a), speculative_schedule(prefill_b, k) if plain_vs == "speculative"
                 else plain_schedule(prefill_b)]
    workers = native_kernels.check_in_process(lm.model, workers, "diverge")
    n_workers = check_workers(lm, workers, 2) if draft is None else 1  # a separate draft lives here only
    # A plug-in's caches start empty in its own stream (the shared prefill is mlx-lm's caches).
    shareable = draft is None and cache_impl is None and ":" not in rollback and _prefills_alike(prompt, schedules)
    prefix = None
    with contextlib.ExitStack() as stack:
        # The other process starts (and loads the model) while this one prefills.
        submit = stack.enter_context(pool(lm, 1)) if shareable and n_workers > 1 else None
        if shareable:
            prefix = _prompt_prefix(lm, prompt, schedules)
            if submit is not None:
                future = submit(_stream_job, **jobs[0], prefix=prefix)
                b = _stream_job(lm, **jobs[1], prefix=prefix)
                a = future.result()
            else:
                a, b = _stream_job(lm, **jobs[0], prefix=prefix), _stream_job(lm, **jobs[1], prefix=prefix)
        elif draft is None:
            a, b = run_jobs(lm, _stream_job, jobs, n_workers)
        else:
            a, b = _stream_job(lm, **jobs[0]), _stream_job(lm, **jobs[1], draft=draft)
        out = _streams_record(lm, prompt, n, a, b, prefix)
        if do_triage:  # even without a divergence: each stream is checked against its own schedule
            out["triage"] = triage(lm, prompt, a.tokens, b.tokens, a.schedule, b.schedule, envelope=envelope,
                                   prefix=prefix, submit=submit).as_dict()
    return out


def _streams_record(lm, prompt: list[int], n: int, a: Generation, b: Generation, prefix: Prefix | None):
    """The record of :func:`diverge`'s two streams (before the triage)."""
    print(f"  plain       {a.schedule:28s} {n} tokens  {a.seconds:6.1f} s", file=sys.stderr, flush=True)
    print(f"  {b.label:11s} {b.schedule:28s} {n} tokens  {b.seconds:6.1f} s", file=sys.stderr, flush=True)
    d = first_divergence(a.tokens, b.tokens)
    out: dict[str, Any] = {
        "prompt_tokens": len(prompt),
        "n": n,
        "stream_a": {"label": a.label, "schedule": a.schedule, "tokens": a.tokens, "seconds": a.seconds},
        "stream_b": {"label": b.label, "schedule": b.schedule, "tokens": b.tokens, "seconds": b.seconds, **b.stats},
        "first_divergence": d,
        # The prompt's prefill both streams started from (their seconds exclude it), or None: each its own.
        "shared_prefill": None if prefix is None else {"tokens": prefix.length, "seconds": prefix.seconds},
        "text_a": token_text(lm.tokenizer, a.tokens),
        "text_b": token_text(lm.tokenizer, b.tokens),
    }
    return out


def _prefills_alike(prompt: list[int], schedules: Sequence[str]) -> bool:
    """Every schedule prefills ``prompt[:-1]`` in the same chunks (else each stream prefills its own)."""
    split = len(prompt) - 1
    blocks = shared_blocks(len(prompt), schedules, split, split) if split >= 1 else []
    return bool(blocks) and blocks[-1][1] == split


def _prompt_prefix(lm, prompt: list[int], schedules: Sequence[str]) -> Prefix | None:
    """The caches after ``prompt[:-1]`` when every schedule prefills it in the same chunks, else None."""
    if not _prefills_alike(prompt, schedules):
        return None
    with native_kernels.shared_prefix(lm.model) as replay:  # replayed kernels: the prompt's prefill natively
        prefix = common_prefix(lm.model, prompt, schedules, len(prompt) - 1, len(prompt) - 1)
    native_kernels.say_prefix(replay, prefix, "both streams")
    print(f"  prompt prefill (shared) {prefix.length} tokens in {len(prefix.blocks)} passes  {prefix.seconds:6.1f} s",
          file=sys.stderr, flush=True)
    return prefix


def _stream_job(lm, *, kind: str, prompt: list[int], n: int, prefill: int, k: int = 0, rollback: str = "mlx-lm",
                draft=None, prefix: Prefix | None = None, cache_impl: str | None = None):
    """One greedy stream of :func:`diverge` (module level: the two streams may run in two processes).

    ``prefix``: the caches after ``prompt[:-1]``, prefilled in the chunks this stream's generator uses (the
    target's own when it drafts for itself); the generator gets a copy and the last prompt token, and
    prefills nothing -- mlx-lm's generate_step and speculative_generate_step prefill ``prompt[:-1]`` and
    start from the last token, so the computation is the same."""
    from mlx_lm.models.cache import can_trim_prompt_cache

    cache = None
    if prefix is not None and kind == "speculative" and rollback == "mlx-lm" and not can_trim_prompt_cache(prefix.cache):
        # mlx-lm's speculative generator refuses a cache it cannot trim, but checks only before its own
        # prefill (which may fill a sliding window): let it prefill, as it would.
        prefix = None
    if prefix is not None:
        if draft is not None:
            raise GemmdriftError("a shared prompt prefill needs the target as its own draft")
        cache, prompt = copy_cache(prefix.cache), prompt[-1:]
    if kind == "plain" or kind == "prefill":
        return generate_plain(lm.model, prompt, n, prefill_step=prefill, prompt_cache=cache)
    speculative = generate_speculative_exact if rollback == "exact" else generate_speculative
    if cache_impl is not None or ":" in rollback:  # a plug-in under test (loaded here: this may be a worker)
        from ..caches.plugins import load_cache_impl, load_rollback, make_caches, refused_on_raise, rollback_installed

        if cache_impl is not None:
            impl = load_cache_impl(cache_impl)
            cache = make_caches(impl, lm.model) + make_caches(impl, draft if draft is not None else lm.model)
        with refused_on_raise(("--cache-impl", cache_impl), ("--rollback", rollback if ":" in rollback else None)), \
                rollback_installed(load_rollback(rollback).obj if ":" in rollback else None):
            return speculative(lm.model, prompt, n, k=k, draft=draft, prefill_step=prefill, prompt_cache=cache)
    return speculative(lm.model, prompt, n, k=k, draft=draft, prefill_step=prefill,
                       prompt_cache=None if cache is None else cache + copy_cache(prefix.cache))


def divergence_stats(lm, prompts: Sequence[Sequence[int]], n: int, *, checkpoint=None, labels=None,
                     **kwargs) -> "pd.DataFrame":
    """First divergence of every prompt, with its triage; one row per prompt.

    Rates: ``divergences_per_1k`` = diverged prompts per 1,000 generated tokens
    compared (tokens up to and including the first divergence, or all ``n``),
    an estimate of the per-token chance that the two schedules part ways.

    Args:
        checkpoint: a directory; finished prompts are saved there one JSON file
            each and skipped when the run is repeated (resume after interrupt).
        labels: a label per prompt (default: its index).
        **kwargs: passed to :func:`diverge` (k, draft, prefill_a, prefill_b, plain_vs, envelope).
    """
    import json
    from pathlib import Path

    import pandas as pd

    from ..files import write_json
    from ..model import resume_key

    rows = []
    replayed = native_kernels.calls(lm.model) is not None  # a resumed prompt's replayed calls are counted again
    for i, prompt in enumerate(prompts):
        label = labels[i] if labels else str(i)
        # The draft is a model object: key it by whether there is one, not by its repr.
        opts = sorted((k, str(v) if k != "draft" else ("self" if v is None else "separate")) for k, v in kwargs.items())
        # The model and its dtype too: a resume with another --dtype must not reuse these rows.
        key = resume_key(lm.description, list(map(int, prompt)), n, opts)
        path = Path(checkpoint) / f"prompt-{i:03d}-{key}.json" if checkpoint else None
        if path is not None and path.exists():
            from ..files import discard_checkpoint

            try:
                row = json.loads(path.read_text())
                if not isinstance(row, dict) or not {"prompt", "first_divergence", "verdict"} <= row.keys():
                    raise ValueError("not a prompt row")
                if replayed and not isinstance(row.get("replay_calls"), list):
                    raise ValueError("its replayed calls were not kept")
            except (OSError, UnicodeDecodeError, ValueError) as e:
                discard_checkpoint(path, str(e)[:80])
            else:
                if replayed:
                    native_kernels.add_calls(lm.model, row.pop("replay_calls"))
                rows.append(row)
                print(f"  prompt {i}: done before (resumed)", file=sys.stderr)
                continue
        print(f"gemmdrift diverge: prompt {i + 1}/{len(prompts)} ({len(prompt)} tokens)", file=sys.stderr, flush=True)
        before = native_kernels.calls(lm.model)
        r = diverge(lm, prompt, n, **kwargs)
        t = r.get("triage") or {}
        d = r["first_divergence"]
        row = {
            "prompt": label, "prompt_tokens": len(prompt), "n": n, "first_divergence": d,
            "compared": n if d is None else d + 1, "verdict": t.get("verdict", Verdict.IDENTICAL),
            "margin": t.get("margin"), "gap_a": t.get("gap_a"), "dgap": t.get("dgap"), "envelope": t.get("envelope"),
            "first_layer_differ": t.get("first_layer_differ"), "acceptance": r["stream_b"].get("acceptance"),
            "divergence_verdict": t.get("divergence_verdict"),
            "b_first_outside": (t.get("stream_b_check") or {}).get("first_outside"),
            "schedule_a": r["stream_a"]["schedule"], "schedule_b": r["stream_b"]["schedule"],
        }
        if path is not None:
            write_json(path, {**row, **({"replay_calls": native_kernels.calls_since(lm.model, before)} if replayed
                                        else {})})
        rows.append(row)
    return pd.DataFrame(rows)


# ------------------------------------------------------------------ Results


def diverge_figures(r: dict[str, Any]) -> dict[str, float]:
    """The tracked figures of one divergence probe (:func:`diverge`'s record).

    * ``n``: tokens generated per stream;
    * ``diverged``: 1 when the streams part within ``n`` tokens, 0 when they never do;
    * ``first_divergence``: generated tokens before the streams part, or ``n`` when they never do
      (read it together with ``diverged``: "never in n" and "at n" are told apart there);
    * ``outside_envelope``: 1 when the triage judged a state bug, 0 otherwise (only when triage ran);
    * ``self_draft_acceptance``: fraction of draft tokens accepted (only for speculative streams).
    """
    d = r.get("first_divergence")
    out = {"n": float(r["n"]), "diverged": 0.0 if d is None else 1.0,
           "first_divergence": float(r["n"]) if d is None else float(d)}
    t = r.get("triage")
    if t:
        out["outside_envelope"] = 1.0 if t.get("verdict") == OUTSIDE else 0.0
    acc = (r.get("stream_b") or {}).get("acceptance")
    if acc is not None:
        out["self_draft_acceptance"] = float(acc)
    return out


def diverge_result(r: dict[str, Any], inputs: dict[str, Any], env: dict[str, Any]):
    """The ``diverge`` Result of :func:`diverge`'s record; ``inputs`` carries the prompt as ``tokens``."""
    from ..result import Result, env_labels, tidy

    figures = diverge_figures(r)
    model = inputs.get("model") or {}
    frame = tidy([{"metric": k, "value": v} for k, v in figures.items()], **env_labels(env),
                 model=model.get("source", ""), dtype=model.get("dtype", ""),
                 pair=f"{r['stream_a']['schedule']} vs {r['stream_b']['schedule']}", mode="generate")
    return Result(kind="diverge", inputs=inputs, env=env, frame=frame, figures=figures, details=r)


def measure_diverge(lm, prompt: Sequence[int], n: int, *, record: dict[str, Any] | None = None,
                    env: dict[str, Any] | None = None, **kw):
    """:func:`diverge` as a Result. ``record``: more inputs to record (the prompt's label, the draft's name)."""
    from ..machine.envinfo import environment
    from ..model import weights_record

    env = {**(env if env is not None else environment()), **weights_record(lm.description)}
    r = diverge(lm, prompt, n, **kw)
    opts = {k: v for k, v in kw.items() if k != "draft"}
    inputs = {"model": lm.info, "n": n, **opts, **(record or {}), "tokens": [int(t) for t in prompt]}
    return diverge_result(r, inputs, env)


def divergence_result(df, inputs: dict[str, Any], env: dict[str, Any]):
    """The ``divergence`` Result (first divergences over a prompt set) of :func:`divergence_stats`' table."""
    import pandas as pd

    from ..result import Result, env_labels, tidy

    div = df[df["first_divergence"].notna()] if len(df) else df
    compared = int(df["compared"].sum()) if len(df) else 0
    figures = {"prompts": float(len(df)), "diverged": float(len(div)), "tokens_compared": float(compared)}
    if compared:
        figures["divergences_per_1k"] = 1000.0 * len(div) / compared
    if len(div):
        figures["near_ties"] = float((div["verdict"] == NEAR_TIE).sum())
        figures["outside_envelope"] = float((div["verdict"] == OUTSIDE).sum())
    model = inputs.get("model") or {}
    rows = [{"pair": r.get("schedule_a", "") + " vs " + r.get("schedule_b", ""), "tap": f"prompt {r['prompt']}",
             "metric": m, "value": r.get(m)} for r in df.to_dict(orient="records")
            for m in ("first_divergence", "margin", "envelope", "acceptance")]
    frame = tidy(rows if rows else pd.DataFrame(columns=["metric", "value"]), **env_labels(env),
                 model=model.get("source", ""), dtype=model.get("dtype", ""), mode="generate")
    return Result(kind="divergence", inputs=inputs, env=env, frame=frame, figures=figures,
                  tables={"divergence": df})


def measure_divergence_stats(lm, prompts: Sequence[Sequence[int]], n: int, *, record: dict[str, Any] | None = None,
                             env: dict[str, Any] | None = None, **kw):
    """:func:`divergence_stats` as a Result."""
    from ..machine.envinfo import environment
    from ..model import weights_record

    env = {**(env if env is not None else environment()), **weights_record(lm.description)}
    df = divergence_stats(lm, prompts, n, **kw)
    opts = {k: v for k, v in kw.items() if k not in ("draft", "checkpoint", "labels")}
    return divergence_result(df, {"model": lm.info, "n": n, **opts, **(record or {})}, env)


# ---------------------------------------------------------------- exact rollback (gemmdrift state, item 2)


def rollback_comparison(lm, prompts: Sequence[Sequence[int]], n: int, *, k: int = 2, checkpoint=None,
                        labels=None) -> "pd.DataFrame":
    """Plain vs mlx-lm speculative and plain vs exact-rollback speculative, side by side, per prompt.

    The plain stream is generated once per prompt; each speculative stream (self-draft, K=k)
    is triaged against it (:func:`triage`). One row per prompt and rollback, with the columns
    of :func:`divergence_stats` plus ``rollback`` and ``restores``; finished prompts are kept
    in ``checkpoint`` (one JSON file each) and skipped when the run is repeated.
    """
    import hashlib
    import json
    from pathlib import Path

    import pandas as pd

    from ..files import write_json
    from ..machine.runenv import compute_record

    rows = []
    for i, prompt in enumerate(prompts):
        label = labels[i] if labels else str(i)
        key = hashlib.sha256(json.dumps([list(map(int, prompt)), n, k, "rollback", compute_record()],
                                        sort_keys=True).encode()).hexdigest()[:16]  # another device: recompute
        path = Path(checkpoint) / f"rollback-{i:03d}-{key}.json" if checkpoint else None
        if path is not None and path.exists():
            rows += json.loads(path.read_text())
            print(f"  prompt {i}: done before (resumed)", file=sys.stderr)
            continue
        print(f"gemmdrift rollback comparison: prompt {i + 1}/{len(prompts)} ({len(prompt)} tokens)", file=sys.stderr,
              flush=True)
        prompt = [int(t) for t in prompt]
        check_prompt(prompt, n)
        plain, spec = plain_schedule(defaults.PREFILL_PLAIN), speculative_schedule(defaults.PREFILL_SPECULATIVE, k)
        # One prefill for every stream that chunks the prompt alike (the target drafts for itself).
        shared = _prompt_prefix(lm, prompt, [plain, spec])
        own = shared or _prompt_prefix(lm, prompt, [spec])
        a = _stream_job(lm, kind="plain", prompt=prompt, n=n, prefill=defaults.PREFILL_PLAIN, prefix=shared)
        out = []
        for rollback in ("mlx-lm", "exact"):
            b = _stream_job(lm, kind="speculative", prompt=prompt, n=n, prefill=defaults.PREFILL_SPECULATIVE, k=k,
                            rollback=rollback, prefix=own)
            t = triage(lm, prompt, a.tokens, b.tokens, a.schedule, b.schedule, prefix=shared).as_dict()
            d = first_divergence(a.tokens, b.tokens)
            print(f"  {b.label:18s} first divergence {d}, {t['verdict']}, {b.seconds:.0f} s", file=sys.stderr,
                  flush=True)
            out.append({
                "prompt": label, "rollback": b.stats.get("rollback", "mlx-lm"), "prompt_tokens": len(prompt), "n": n,
                "first_divergence": d, "compared": n if d is None else d + 1, "verdict": t["verdict"],
                "divergence_verdict": t.get("divergence_verdict"), "margin": t.get("margin"),
                "envelope": t.get("envelope"), "acceptance": b.stats.get("acceptance"),
                "restores": b.stats.get("restores", 0),
                "b_first_outside": (t.get("stream_b_check") or {}).get("first_outside"),
                "b_mismatches": (t.get("stream_b_check") or {}).get("mismatches"),
                "seconds_plain": a.seconds, "seconds_speculative": b.seconds,
            })
        if path is not None:
            write_json(path, out)
        rows += out
    return pd.DataFrame(rows)
