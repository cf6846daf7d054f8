"""The `gemmdrift` command: a thin layer over the library.

Every subcommand parses flags, calls one library function, writes its tables
and figures, and prints a summary. User errors (:class:`GemmdriftError`, bad
flags) print one line and exit with status 2. The steps every command shares
are :mod:`gemmdrift.cli.common` (named here too: the command families find
them on this module, handed to them); the families' parsers and handlers are
golden.py, dispatch.py, replay.py, attribute.py, changelog.py, history.py and
batch.py.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from ..state import bench as cachebench
from .. import defaults as D
from . import attribute as attribute_cli, changelog as changelog_cli, dispatch as dispatch_cli, golden as goldcli, replay as replay_cli
from . import batch as batch_cli, bisect as bisect_cli, history as history_cli, upgrade as upgrade_cli
from ..machine import runenv
from ..errors import GemmdriftError
from ..ranges import default_split, parse_ints, parse_range  # noqa: F401  (moved; callers import them from here)
from .common import (  # noqa: F401  (the shared steps: the command families call them on this module)
    Parser, add_model, add_output, add_prompt, emit, load, precheck, replay_shapes, tokens, write_and_print,
)


# -------------------------------------------------------------------- subcommands


def cmd_env(args) -> int:
    from ..machine.envinfo import describe, environment

    rec = environment()
    print(json.dumps(rec, indent=2) if args.json else describe(rec))
    return 0


def cmd_stack(args) -> int:
    from ..checks import check_positive, check_range_text
    from ..schedules import parse_schedule

    for text in args.schedules:
        parse_schedule(text)  # a bad schedule fails before the model loads
    if len(args.schedules) < 2:
        raise GemmdriftError("give at least two schedules: a reference and one to compare")
    precheck(args)
    check_positive(split=args.split)
    check_range_text(args.positions, "--positions")
    check_range_text(args.logit_positions, "--logit-positions")
    impl, _ = cachebench.precheck(args)
    from ..replay.model import KernelsOption

    # checked before loading
    kopt = KernelsOption(args.kernels, ladder=args.ladder, replay_prefix=args.replay_prefix,
                         calibration=args.calibration)
    kopt.check_run(replay_shapes(args), args.schedules, args.tokens, args.split, args.dtype)  # a call with no recipe

    from ..machine.envinfo import environment
    from ..model import describe
    from ..measure.stack import measure_stack

    lm = load(args)  # the ladder rung is true float32: main() set MLX_ENABLE_TF32=0 (unless --tf32 keep)
    ids, label = tokens(args, lm)
    n = len(ids)
    split = args.split if args.split is not None else default_split(n)
    positions = parse_range(args.positions, n, "--positions")
    logit_positions = parse_range(args.logit_positions, n, "--logit-positions")
    from ..replay.model import lm_shapes

    kopt.check_run(lm_shapes(lm) if kopt.text else None, args.schedules, n, split, lm.description.dtype)
    print(f"gemmdrift stack: {describe(lm.description)}; {n} tokens ({label}); split {split}", file=sys.stderr)
    with kopt.installed(lm), cachebench.stack_caches(impl, lm) as impl_record:
        result = measure_stack(lm, ids, args.schedules, split=split, positions=positions,
                               logit_positions=logit_positions, local=not args.no_local, ladder=args.ladder,
                               checkpoint=Path(args.out) / kopt.checkpoint, env=environment(),
                               record={"prompt": label, **impl_record},
                               workers=1 if impl is not None else kopt.workers)  # the plug-in lives in this process
    write_and_print(args, kopt.label(result), args.out)
    return 0


def cmd_kernels(args) -> int:
    from ..checks import check_max_t

    ts = parse_ints(args.ts, "--ts")
    if ts is not None and min(ts) < 1:
        raise GemmdriftError(f"--ts: block sizes must be positive, got {min(ts)}")
    for flag, value in (("--rows", args.rows), ("--max-t", args.max_t)):
        if value < 1:
            raise GemmdriftError(f"{flag} must be positive, got {value}")
    if args.flop_budget is not None and not (args.flop_budget > 0 and math.isfinite(args.flop_budget)):
        raise GemmdriftError(f"--flop-budget must be a positive number of FLOPs, got {args.flop_budget:g}")
    layers = parse_ints(args.layers, "--layers")
    if ts is not None:
        check_max_t(ts, args.max_t)
    precheck(args)

    from .. import kernels
    from ..machine.envinfo import environment
    from ..model import describe

    ts = ts or list(kernels.DEFAULT_TS)
    check_max_t(ts, args.max_t)
    names = args.projections.split(",") if args.projections else None
    paths = args.paths.split(",")
    for p in paths:
        kernels.parse_path(p)  # a bad path fails before the model loads
    from ..replay.model import KernelsOption

    # replay:<chip>[@variant]: checked before loading
    kopt = KernelsOption(args.kernels, ops=args.ops, calibration=args.calibration)
    lm = load(args)
    projs = kernels.projections(lm, layers=layers, names=names)
    from ..suite import SIZES, default_sizes

    # The CPU's budget (the reference BLAS, ~7 GFLOP/s in bf16) would stop a GPU's sweep at T=128 for the MLP and
    # T=4 for the LM head: the device's own sizes, as `gemmdrift run` picks them.
    budget = args.flop_budget if args.flop_budget is not None else SIZES[default_sizes()].flop_budget
    print(f"gemmdrift kernels: {describe(lm.description)}; {len(projs)} projections x {len(paths)} paths; "
          f"FLOP budget {budget:.3g} per projection and path", file=sys.stderr)
    if lm.synthetic:
        ids, label = [], "synthetic rows"
    else:
        ids, label = tokens(args, lm)
    inputs = kernels.capture_inputs(lm, ids, projs, max_rows=args.rows)
    out = Path(args.out)
    result = kernels.measure_kernels(lm, inputs, projs, paths, ts, ops=args.ops, max_t=args.max_t, kernels=kopt,
                                     flop_budget=budget,
                                     checkpoint=out / kopt.checkpoint, env=environment(),
                                     record={"prompt": label, "tokens": ids, "flop_budget": budget,
                                             "rows": inputs.describe() if hasattr(inputs, "describe") else None})
    write_and_print(args, result, out)
    return 0


def _load_draft(args):
    from ..model import load_model, parse_quantization

    if args.draft is None:
        if args.draft_quantize is not None:
            raise GemmdriftError("--draft-quantize needs --draft (e.g. --draft embedded --draft-quantize 4)")
        return None
    q = parse_quantization(args.draft_quantize, None, "affine") if args.draft_quantize is not None else None
    return load_model(args.draft, dtype=args.draft_dtype or args.dtype, quantize=q).model


def _context_text(name: str) -> str:
    from ..prompts import builtin_text

    try:
        return builtin_text(name)
    except (FileNotFoundError, OSError):
        raise GemmdriftError(f"--context {name!r}: no such built-in text (try essay)") from None


def cmd_diverge(args) -> int:
    from ..checks import check_length
    from ..prompts import builtin_prompts, read_prompts

    for flag, value in (("--n", args.n), ("--k", args.k), ("--prefill-a", args.prefill_a),
                        ("--prefill-b", args.prefill_b)):
        if value <= 0:
            raise GemmdriftError(f"{flag} must be positive, got {value}")
    precheck(args)
    impl, rb = cachebench.precheck(args)
    if args.explain and args.no_triage:
        raise GemmdriftError("--explain explains the triage's verdict: give it without --no-triage")
    texts = None
    if args.prompts is not None:
        if any(x is not None for x in (args.prompt, args.prompt_file, args.prompt_ids)):
            raise GemmdriftError("--prompts is a prompt set: give it without --prompt, --prompt-file or --prompt-ids")
        if args.explain:
            raise GemmdriftError("--explain names the op behind one prompt's divergence: give it without --prompts")
        texts = builtin_prompts() if args.prompts == "builtin" else read_prompts(args.prompts)
        if args.context is not None:
            _context_text(args.context)
    from ..replay.model import KernelsOption, lm_shapes

    # replay:<chip>[@variant]: checked before loading
    kopt = KernelsOption(args.kernels, draft=args.draft, calibration=args.calibration)
    # the speculative stream's first verify feeds min(n, k) + 1 rows: a chip with no recipe for it (every CUDA
    # T >= 2 is cuBLASLt) is refused before the load (D8)
    spec_ts = {min(args.n, args.k) + 1} if args.compare == "speculative" else set()
    kopt.check_calls(replay_shapes(args) or [], spec_ts, args.dtype)
    from ..measure.diverge import measure_divergence_stats, measure_diverge
    from ..machine.envinfo import environment
    from ..model import describe

    lm = load(args)
    draft = _load_draft(args)
    opts = dict(k=args.k, draft=draft, prefill_a=args.prefill_a, prefill_b=args.prefill_b, plain_vs=args.compare,
                envelope=args.envelope)
    if args.rollback != "mlx-lm":  # the default leaves resumable checkpoints of earlier runs valid
        opts["rollback"] = args.rollback
    record = {**opts, "draft": args.draft or "self", "draft_quantize": args.draft_quantize, "rollback": args.rollback}
    cachebench.diverge_options(impl, rb, lm, draft, opts, record)
    if kopt.text:  # the same with the loaded model's shapes (a GGUF, a quantized checkpoint)
        kopt.check_calls(lm_shapes(lm), spec_ts, lm.description.dtype)
    out = Path(args.out)
    env = environment()
    print(f"gemmdrift diverge: {describe(lm.description)}", file=sys.stderr)
    if texts is not None:
        if lm.tokenizer is None:
            raise GemmdriftError("--prompts needs a model with a tokenizer")
        prefix = "" if args.context is None else _context_text(args.context) + "\n\n"
        ids = [lm.tokenizer.encode(prefix + t) for t in texts]
        for i, x in enumerate(ids):
            check_length(lm.description, len(x) + args.n, f"prompt {i} with --n {args.n}")
        with kopt.installed(lm):
            result = measure_divergence_stats(lm, ids, args.n, checkpoint=out / kopt.dirname("prompts"),
                                              labels=[str(i) for i in range(len(ids))], do_triage=not args.no_triage,
                                              record={"prompts": texts, "context": args.context, **record}, env=env,
                                              **opts)
        write_and_print(args, kopt.label(result), out)
        return 0
    ids, label = tokens(args, lm)
    check_length(lm.description, len(ids) + args.n, f"the prompt with --n {args.n}")
    with kopt.installed(lm):
        result = measure_diverge(lm, ids, args.n, do_triage=not args.no_triage, record={"prompt": label, **record},
                                 env=env, **opts)
    if args.explain:
        result = attribute_cli.explain_divergence(lm, result, ids, kopt.text or None)
    write_and_print(args, kopt.label(result), out, "(stream_a.json and stream_b.json feed `gemmdrift triage`)")
    return 0


def cmd_triage(args) -> int:
    from ..checks import check_length
    from ..prompts import read_stream, stream_schedule

    # The stream files, schedules and flags are read and checked before the model loads.
    pa, sa = read_stream(args.stream_a)
    pb, sb = read_stream(args.stream_b)
    if pa is not None and pb is not None and pa != pb:
        raise GemmdriftError("the two stream files have unequal prompts")
    from ..replay.model import KernelsOption

    kopt = KernelsOption(args.kernels, calibration=args.calibration)  # replay:<chip>[@variant]: checked before loading
    args.schedule_a, why_a = stream_schedule(args.schedule_a, args.stream_a, D.SCHEDULE_PLAIN, "--schedule-a")
    args.schedule_b, why_b = stream_schedule(args.schedule_b, args.stream_b, D.SCHEDULE_SPECULATIVE, "--schedule-b")
    precheck(args)  # every check before the first line printed
    from ..replay.model import lm_shapes, triage_ts

    if not any(x is not None for x in (args.prompt, args.prompt_file, args.prompt_ids)) and (pa or pb):
        # a call the chip has no recipe for (every CUDA T >= 2 is cuBLASLt): refused before the load (D8)
        kopt.check_calls(replay_shapes(args) or [], triage_ts((args.schedule_a, args.schedule_b), len(pa or pb),
                                                               (len(sa), len(sb))), args.dtype)
    print(f"gemmdrift triage: stream A under {args.schedule_a} ({why_a}); stream B under {args.schedule_b} "
          f"({why_b})", file=sys.stderr)

    from ..measure.diverge import measure_triage
    from ..machine.envinfo import environment

    lm = load(args)
    given = any(x is not None for x in (args.prompt, args.prompt_file, args.prompt_ids))
    if given:
        prompt, _ = tokens(args, lm)
        if (pa is not None and pa != prompt) or (pb is not None and pb != prompt):
            raise GemmdriftError("the prompt given does not match the prompt stored in the stream files")
    else:
        prompt = pa if pa is not None else pb
        if prompt is None:
            raise GemmdriftError("the stream files carry no prompt: give --prompt, --prompt-file or --prompt-ids")
    check_length(lm.description, len(prompt) + max(len(sa), len(sb)), "the prompt and the longer stream")
    if kopt.text:  # the same with the loaded model's shapes and the prompt given, before any computing
        kopt.check_calls(lm_shapes(lm), triage_ts((args.schedule_a, args.schedule_b), len(prompt),
                                                  (len(sa), len(sb))), lm.description.dtype)
    with kopt.installed(lm):
        result = measure_triage(lm, prompt, sa, sb, args.schedule_a, args.schedule_b, envelope=args.envelope,
                                env=environment())
    if args.explain:  # the op classes whose counterfactual removes the flip (issue 29); the verdict stays
        result = attribute_cli.explain_divergence(lm, result, prompt, kopt.text or None)
    write_and_print(args, kopt.label(result), args.out)
    return 0


def cmd_state(args) -> int:
    from .. import state, store
    from ..view import summaries
    from ..checks import check_choices, check_envelope
    from ..model import describe

    ops = check_choices(args.ops, "--ops", list(state.OPERATIONS), "operation")
    where = check_choices(args.where, "--where", list(state.WHERE), "prefix position")
    ks = parse_ints(args.k, "--k") if args.k is not None else None
    if ks is not None and (min(ks) < 1 or max(ks) > 8):
        raise GemmdriftError("--k: draft counts must be between 1 and 8")
    caches = [c.strip() for c in args.caches.split(",")] if args.caches is not None else None
    known = set(state.KNOWN_CLASSES) | {"QuantizedKVCache"}
    for c in caches or []:
        if c not in known:
            raise GemmdriftError(f"--caches: unknown cache class {c!r} (known: {', '.join(sorted(known))})")
    check_envelope(args.envelope)
    if args.compute_limit is not None and args.compute_limit < 1:
        raise GemmdriftError(f"--compute-limit must be positive, got {args.compute_limit}")
    if args.workers is not None and args.workers < 1:
        raise GemmdriftError(f"--workers must be at least 1, got {args.workers}")
    impl, _ = cachebench.precheck(args)
    out = store.check_out_dir(args.out)
    lm = load(args)
    print(f"gemmdrift state: {describe(lm.description)}", file=sys.stderr)
    r = cachebench.state_measure(impl)(lm, operations=ops, where=where, ks=ks, ladder=not args.no_ladder,
                            envelope=args.envelope, compute_limit=args.compute_limit, caches=caches,
                            workers=args.workers, checkpoint=out)
    written = store.write_result(r, out)
    emit(args, summaries.summary(r), summaries.text(r) + f"\n\nwritten to {out}/ "
          f"({', '.join(sorted(p.name for p in written.values()))})")
    return 0


def cmd_run(args) -> int:
    from ..checks import check_out_dir

    check_out_dir(args.out)
    from ..machine.envinfo import select_device
    from ..replay.calib import check_run
    from ..replay.paths import installed_mlx
    from ..suite import main_job

    check_run(args.calibration, installed_mlx())  # a bad, other-release or disagreeing file: before the load
    select_device(args.device)
    paths = main_job(args.out, sizes=args.sizes, model=args.model, dtype=args.dtype, calibration=args.calibration)
    print(paths["markdown"].read_text())
    print(f"report: {paths['html']} (and {paths['markdown'].name} beside it)")
    return 0


def cmd_report(args) -> int:
    from ..report import build_report, screenshot

    paths = build_report(args.dir)
    if args.screenshot:
        paths["screenshot"] = screenshot(paths["html"], Path(args.dir) / "report_page.png")
    emit(args, {k: str(v) for k, v in paths.items()}, "\n".join(f"{k}: {v}" for k, v in paths.items()))
    return 0


def cmd_fingerprint(args) -> int:
    from .. import fingerprint, store
    from ..view import summaries
    from ..machine.envinfo import environment, select_device

    paths = [p for p in args.paths.split(",") if p]
    if not paths:
        raise GemmdriftError("--paths: give at least one path")
    ts = parse_ints(args.ts, "--ts") or [1]
    if min(ts) < 1:
        raise GemmdriftError(f"--ts: block sizes must be positive, got {min(ts)}")
    from ..checks import check_fingerprint_sizes

    check_fingerprint_sizes(args.k, args.n, ts, args.draw_k)  # memory, before exactness and any allocation
    for text in paths:  # every input error before any computation
        spec = fingerprint.parse_path(text)
        fingerprint.check_path(spec, args.k, args.n, args.window)
        if spec.op == "replay":  # a T the chip runs a kernel with no recipe for (CUDA T >= 2): now, not after T=1
            from ..replay.paths import replay_probe

            for t in ts:
                replay_probe(text, args.k, t, args.n)
    store.check_out_dir(args.out)
    select_device(args.device)
    result = fingerprint.measure(paths, K=args.k, ts=ts, N=args.n, window=args.window, draw_k=args.draw_k,
                                 env=environment(), progress=lambda m: print(m, file=sys.stderr), checkpoint=args.out)
    store.write_result(result, args.out)
    emit(args, summaries.summary(result), summaries.text(result) + f"\n\nwritten to {Path(args.out)}/")
    return 0


# ------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="gemmdrift", description="Floating-point drift in MLX: kernels, schedules, divergences.")
    sub = p.add_subparsers(dest="command", parser_class=Parser, metavar="COMMAND")

    s = sub.add_parser("env", help="mlx/mlx-lm versions, backend, device and kernel env vars")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_env)

    s = sub.add_parser("stack", help="layer-by-layer drift between execution schedules, and the logit envelope")
    add_model(s)
    add_prompt(s)
    s.add_argument("--schedules", nargs="+", default=list(D.STACK_SCHEDULES), metavar="SCHEDULE",
                   help="reference first; e.g. prefill:512,decode prefill:512,verify:2 (default: decode vs verify:2, verify:3)")
    s.add_argument("--split", type=int, help="prompt/continuation boundary (default: compare the last 128 tokens)")
    s.add_argument("--positions", help="positions compared, A:B (default split:end)")
    s.add_argument("--logit-positions", help="positions whose logits are compared, A:B or none (default: --positions)")
    s.add_argument("--no-local", action="store_true", help="skip local drift (saves one run per schedule)")
    s.add_argument("--ladder", action="store_true", help="rerun at float32: rounding shrinks, semantic differences do not")
    s.add_argument("--kernels", help=D.KERNELS_HELP)
    s.add_argument("--calibration", action="append", default=[], metavar="FILE", help=D.CALIBRATION_HELP)
    s.add_argument("--replay-prefix", action="store_true", help="with --kernels: replay the prefix the schedules "
                   "share too (default: computed once with this machine's kernels, both schedules start from it)")
    cachebench.add_arguments(s, rollback=False)
    add_output(s, "results/stack")
    s.set_defaults(func=cmd_stack)

    s = sub.add_parser("kernels", help="GEMV (T=1) vs GEMM (T>1) per projection of every layer, on captured rows")
    add_model(s)
    add_prompt(s)
    s.add_argument("--layers", help="decoder layers, e.g. 0-5,17 (default all; the LM head is layer N)")
    s.add_argument("--projections", help="comma-separated names, e.g. q_proj,mlp.down_proj,lm_head (default all)")
    s.add_argument("--paths", default=",".join(D.KERNEL_PATHS),
                   help="comma-separated: model, dense:<dtype>, quant:<mode>-q<bits>-g<group>, emulated:splitk<P>")
    s.add_argument("--ts", help="block sizes, e.g. 1-17,24,32,33,64,128,512,2048 (the default)")
    s.add_argument("--max-t", type=int, default=D.KERNEL_MAX_T,
                   help=f"largest block size (default {D.KERNEL_MAX_T}; a FLOP budget caps big projections)")
    s.add_argument("--rows", type=int, default=D.KERNEL_MAX_ROWS,
                   help=f"distinct captured rows per projection (default {D.KERNEL_MAX_ROWS})")
    s.add_argument("--flop-budget", type=float, default=None,
                   help="FLOPs per projection and path: block sizes above 4 are added, smallest first, while they fit "
                        "(default: 2e9 on a CPU, 1e12 on a GPU, as `gemmdrift run`'s sizes)")
    s.add_argument("--ops", action="store_true", help="also sdpa, rms_norm, rope and softmax with the model's geometry")
    s.add_argument("--kernels", help=D.KERNELS_HELP)
    s.add_argument("--calibration", action="append", default=[], metavar="FILE", help=D.CALIBRATION_HELP)
    add_output(s, "results/kernels")
    s.set_defaults(func=cmd_kernels)

    s = sub.add_parser("diverge", help="greedy generation under two schedules (mlx-lm generate vs speculative), first divergence, triage")
    add_model(s)
    add_prompt(s)
    s.add_argument("--n", type=int, default=D.DIVERGE_N, help=f"tokens to generate (default {D.DIVERGE_N})")
    s.add_argument("--k", type=int, default=D.DIVERGE_K,
                   help=f"draft tokens per verification (default {D.DIVERGE_K}: blocks of {D.DIVERGE_K + 1})")
    s.add_argument("--compare", choices=["speculative", "prefill"], default="speculative",
                   help="plain vs speculative generate (default), or plain generate with two prefill chunk sizes")
    s.add_argument("--prefill-a", type=int, default=D.PREFILL_PLAIN,
                   help=f"prefill chunk of stream A (mlx-lm generate: {D.PREFILL_PLAIN})")
    s.add_argument("--prefill-b", type=int, default=D.PREFILL_SPECULATIVE,
                   help=f"prefill chunk of stream B (speculative generate: {D.PREFILL_SPECULATIVE})")
    s.add_argument("--draft", help="draft model (same sources as --model); default: the target drafts for itself")
    s.add_argument("--draft-quantize", type=int, metavar="BITS", help="re-quantize the draft (e.g. 4)")
    s.add_argument("--draft-dtype", help="draft compute dtype (default: --dtype)")
    s.add_argument("--prompts", help="divergence statistics over a prompt set: a file (one per line) or 'builtin'")
    s.add_argument("--context", help="prefix every prompt of --prompts with a built-in text (e.g. essay) to cross the sliding window")
    s.add_argument("--no-triage", action="store_true", help="only report the divergence")
    s.add_argument("--envelope", type=float, help="use this envelope (max |Δgap|, logits) instead of measuring it")
    s.add_argument("--rollback", default="mlx-lm", help="speculative stream: mlx-lm's speculative_generate_step "
                   "(default), exact (snapshots restored where trim_prompt_cache refuses) or module:function (its rewind)")
    s.add_argument("--kernels", help=D.KERNELS_HELP)
    s.add_argument("--calibration", action="append", default=[], metavar="FILE", help=D.CALIBRATION_HELP)
    cachebench.add_arguments(s, rollback=False)
    add_output(s, "results/diverge")
    s.add_argument("--explain", action="store_true", help="with one prompt: also name the op classes whose "
                   "counterfactual removes the flip at the first divergence (the verdict stays what it is)")
    s.set_defaults(func=cmd_diverge)

    s = sub.add_parser("triage", help="judge a divergence between two token streams: near-tie or state bug")
    add_model(s)
    add_prompt(s)
    s.add_argument("--stream-a", required=True, help="stream file (from `diverge`, or a JSON list / whitespace-separated ids)")
    s.add_argument("--stream-b", required=True, help="the other stream file")
    s.add_argument("--schedule-a", help="how stream A was computed (default: the schedule its file names, else "
                                        f"mlx-lm generate, {D.SCHEDULE_PLAIN})")
    s.add_argument("--schedule-b", help="how stream B was computed (default: the schedule its file names, else "
                                        f"speculative, {D.SCHEDULE_SPECULATIVE})")
    s.add_argument("--envelope", type=float, help="use this envelope instead of measuring it on the shared prefix")
    s.add_argument("--kernels", help=D.KERNELS_HELP)
    s.add_argument("--calibration", action="append", default=[], metavar="FILE", help=D.CALIBRATION_HELP)
    add_output(s, "results/triage")
    s.add_argument("--explain", action="store_true", help="also name the op classes whose counterfactual removes "
                   "the flip at the first divergence (gemmdrift attribute; the verdict stays what it is)")
    s.set_defaults(func=cmd_triage)

    s = sub.add_parser("state", help="cache state exactness: rollback, trim, save/load, server reuse, batch vs a "
                                     "cache that never did them")
    add_model(s)
    s.add_argument("--ops", default="rollback,trim,trim_prompt_cache,save_load,server_reuse,batch",
                   help="operations: rollback,trim,trim_prompt_cache,save_load,server_reuse,batch (the default), "
                        "and draft_trim (the draft cache's trim after T=1 drafts; only when asked)")
    s.add_argument("--where", help="prefix lengths relative to the sliding window: below,at,past,far "
                                   "(default all; below,past for QuantizedKVCache)")
    s.add_argument("--k", help="draft counts of the rollback, every r = 0..k (default 1-4; 2 for QuantizedKVCache)")
    s.add_argument("--caches", help="only these cache classes, e.g. KVCache,RotatingKVCache (default all)")
    s.add_argument("--no-ladder", action="store_true", help="skip the float32 rerun of cases that differ")
    s.add_argument("--envelope", type=float, help="largest max|Δlogit| still called rounding (default: the ladder decides)")
    s.add_argument("--compute-limit", type=int,
                   help="really prefill at most this many tokens; longer prefixes repeat them (default: shortest prefix + 16)")
    s.add_argument("--workers", type=int,
                   help="processes sharing the sweep, each loading the model (default: 2 on a CPU with 2+ cores, "
                        "else 1; the table is the same)")
    cachebench.add_arguments(s, rollback=False)
    add_output(s, "results/state")
    s.set_defaults(func=cmd_state)

    s = sub.add_parser("run", help="the main job: kernels, schedules, prefill chunks and a divergence on the embedded Gemma")
    s.add_argument("--out", default="results/run", help="output directory (default results/run); reruns resume")
    s.add_argument("--sizes", choices=["cpu", "gpu", "quick"], help="default: gpu on Metal/CUDA, cpu otherwise")
    s.add_argument("--model", default=D.MODEL, help="a model source (default: the embedded Gemma 3 270M)")
    s.add_argument("--dtype", default=D.DTYPE, help=f"compute dtype (default {D.DTYPE})")
    s.add_argument("--device", choices=["cpu", "gpu"], help="mlx device (default: mlx's own choice)")
    s.add_argument("--calibration", action="append", default=[], metavar="FILE",
                   help="the prediction part replays the variant this file measured for its chip (repeatable; the "
                        "shipped registry is read too; docs/calibration.md)")
    s.set_defaults(func=cmd_run)

    s = sub.add_parser("report", help="one page (HTML and markdown) from a results directory: tables, figures, reading")
    s.add_argument("dir", help="a results directory: the output of run, stack, kernels, diverge, triage, attribute "
                               "(its --primitives and --python outputs too), replay check, compare, history, state, "
                               "batch, server or fingerprint")
    s.add_argument("--screenshot", action="store_true",
                   help="also render the page in headless Chromium to report_page.png (checks that it displays)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_report)

    history_cli.add_parser(sub, sys.modules[__name__])  # history, gate

    s = sub.add_parser("fingerprint", help="accumulation-order fingerprints: the summation tree of a kernel path per T")
    s.add_argument("--paths", default="matmul:bfloat16,matmul:float32,emulated:splitk4:bfloat16",
                   help="comma-separated: matmul:<dtype>, quant:affine-q<bits>-g<group>[:<dtype>], sum:<dtype>, "
                        "sdpa:<dtype>, emulated:splitk<P>[:<dtype>], numpy:float32, rms_norm:<dtype>, softmax:<dtype>")
    s.add_argument("--k", type=int, default=1024, help="terms of the reduction: K of the matmul, keys of sdpa (default 1024)")
    s.add_argument("--ts", default="1-4,8,16,33", help="block sizes T; the probed row is at every position (default 1-4,8,16,33)")
    s.add_argument("--n", type=int, default=64, help="output columns per call (sdpa: head dim), fixed per fingerprint (default 64)")
    s.add_argument("--window", type=int, help="units per probe at most (default: what the output dtype counts exactly)")
    s.add_argument("--draw-k", type=int, default=16, help="also recover each path at this small K for the tree plot (0: skip)")
    s.add_argument("--device", choices=["cpu", "gpu"], help="mlx device (default: mlx's own choice)")
    add_output(s, "results/fingerprint")
    s.set_defaults(func=cmd_fingerprint)
    batch_cli.add_parser(sub, sys.modules[__name__])  # batch, server (issue 14)

    dispatch_cli.add_parser(sub)
    changelog_cli.add_parser(sub)  # the numerics changelog per release pair (issue 30)
    goldcli.add_parser(sub, sys.modules[__name__])  # logits, compare (issue 23)
    replay_cli.add_parser(sub)
    attribute_cli.add_parser(sub, sys.modules[__name__])  # which op (issue 29)
    upgrade_cli.add_parser(sub, sys.modules[__name__])  # should I upgrade mlx? (issue 48)
    bisect_cli.add_parser(sub)  # which mlx-lm commit changed a tier figure (issue 55)
    runenv.add_flags(sub)  # --tf32 on every measuring command, --device on env
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        runenv.prepare(args)  # GEMMDRIFT_DEVICE; MLX_ENABLE_TF32=0 before anything computes (--tf32 keep opts out)
        return int(args.func(args) or 0)
    except GemmdriftError as e:
        print(f"gemmdrift: error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:  # mlx that cannot load, met by a command that imports it late
        from ..machine import backends

        if not backends.is_mlx_import(e):
            raise
        print(f"gemmdrift: error: {backends.import_problem(e, backends.installed())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        from ..interrupts import on_interrupt

        print(on_interrupt(args, e), file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
