"""The `gemmdrift` command: a thin layer over the library.

Every subcommand parses flags, calls one library function, writes its tables
and figures, and prints a summary. User errors (:class:`GemmdriftError`, bad
flags) print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .errors import GemmdriftError

DEFAULT_SCHEDULES = ["prefill:512,decode", "prefill:512,verify:2", "prefill:512,verify:3"]


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr and exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# ------------------------------------------------------------------ shared options


def _add_model(p):
    g = p.add_argument_group("model")
    g.add_argument("--model", default="embedded",
                   help="'embedded' (Gemma 3 270M, default), 'shape:NAME', a Gemma 3 .gguf file, or an mlx-lm directory")
    g.add_argument("--dtype", default="bfloat16", help="compute dtype: bfloat16 (default), float16, float32")
    g.add_argument("--quantize", type=int, metavar="BITS", help="re-quantize a dense model (mlx affine: 2,3,4,5,6,8 bits)")
    g.add_argument("--group-size", type=int, help="quantization group size: 32, 64 (default), 128")
    g.add_argument("--quant-mode", default="affine", help="quantization mode (affine; mxfp4/mxfp8/nvfp4 where mlx has them)")
    g.add_argument("--device", choices=["cpu", "gpu"], help="mlx device (default: mlx's own choice, recorded in every result)")


def _add_prompt(p):
    g = p.add_argument_group("prompt")
    g.add_argument("--prompt", help="prompt text")
    g.add_argument("--prompt-file", help="file with the prompt text")
    g.add_argument("--prompt-ids", help="file of token ids (JSON list or whitespace-separated), used verbatim")
    g.add_argument("--tokens", type=int, help="use only the first N tokens of the prompt")


def _add_output(p, default: str):
    p.add_argument("--out", default=default, help=f"output directory (default {default})")
    p.add_argument("--json", action="store_true", help="print a JSON summary on stdout (progress goes to stderr)")


def _load(args):
    from .envinfo import select_device
    from .models import load_model, parse_quantization

    select_device(getattr(args, "device", None))

    q = parse_quantization(args.quantize, args.group_size, args.quant_mode) if args.quantize is not None else None
    if args.quantize is None and args.group_size is not None:
        raise GemmdriftError("--group-size needs --quantize")
    return load_model(args.model, dtype=args.dtype, quantize=q)


def _tokens(args, lm):
    from .prompts import prompt_tokens

    ids, label = prompt_tokens(lm, args.prompt, args.prompt_file, args.prompt_ids)
    if args.tokens is not None:
        if args.tokens < 2:
            raise GemmdriftError(f"--tokens must be at least 2, got {args.tokens}")
        if args.tokens > len(ids):
            raise GemmdriftError(f"--tokens {args.tokens}: the prompt has only {len(ids)} tokens")
        ids = ids[: args.tokens]
    return ids, label


def parse_range(text: str | None, n: int, name: str):
    """'A:B' (B exclusive, either side optional), 'A', or 'none' -> array of positions."""
    import numpy as np

    if text is None:
        return None
    if text == "none":
        return np.zeros(0, dtype=np.int64)
    try:
        if ":" in text:
            a, b = text.split(":", 1)
            lo = int(a) if a else 0
            hi = int(b) if b else n
        else:
            lo = int(text)
            hi = lo + 1
    except ValueError:
        raise GemmdriftError(f"{name}: expected A:B, got {text!r}") from None
    if lo < 0:
        lo += n
    if hi < 0:
        hi += n
    if not 0 <= lo < hi <= n:
        raise GemmdriftError(f"{name} {text} out of range: the stream has {n} tokens (0..{n - 1})")
    return np.arange(lo, hi)


def default_split(n: int) -> int:
    """Compare the last 128 positions by default (half the stream if it is shorter)."""
    return n - 128 if n > 256 else max(1, n // 2)


def _emit(args, summary: dict, text: str) -> None:
    from .files import to_json

    if args.json:
        print(to_json(summary))
    else:
        print(text)


# -------------------------------------------------------------------- subcommands


def cmd_env(args) -> int:
    from .envinfo import describe, environment

    rec = environment()
    print(json.dumps(rec, indent=2) if args.json else describe(rec))
    return 0


def cmd_stack(args) -> int:
    from .envinfo import environment
    from .models import describe
    from .report import print_stack, stack_summary, write_stack
    from .schedules import parse_schedule
    from .stack import measure_stack

    for text in args.schedules:
        parse_schedule(text)  # a bad schedule fails before the model loads
    if len(args.schedules) < 2:
        raise GemmdriftError("give at least two schedules: a reference and one to compare")
    lm = _load(args)
    ids, label = _tokens(args, lm)
    n = len(ids)
    split = args.split if args.split is not None else default_split(n)
    positions = parse_range(args.positions, n, "--positions")
    logit_positions = parse_range(args.logit_positions, n, "--logit-positions")
    print(f"gemmdrift stack: {describe(lm.info)}; {n} tokens ({label}); split {split}", file=sys.stderr)
    result = measure_stack(lm, ids, args.schedules, split=split, positions=positions,
                           logit_positions=logit_positions, local=not args.no_local, ladder=args.ladder,
                           checkpoint=Path(args.out) / "checkpoint")
    result.inputs["prompt"] = label
    written = write_stack(result, args.out, environment())
    _emit(args, stack_summary(result), print_stack(result) + f"\n\nwritten to {Path(args.out)}/ "
          f"({', '.join(p.name for p in written.values())})")
    return 0


def parse_ints(text: str | None, name: str) -> list[int] | None:
    """'1-17,24,32' -> [1, ..., 17, 24, 32]; 'all' or None -> None."""
    if text is None or text == "all":
        return None
    out = []
    try:
        for part in text.split(","):
            if "-" in part.strip("-"):
                a, b = part.split("-", 1)
                out += list(range(int(a), int(b) + 1))
            else:
                out.append(int(part))
    except ValueError:
        raise GemmdriftError(f"{name}: expected numbers like 1-17,24,32, got {text!r}") from None
    if not out:
        raise GemmdriftError(f"{name}: empty list")
    return out


def cmd_kernels(args) -> int:
    import pandas as pd

    from . import kernels
    from .envinfo import environment
    from .models import describe

    ts = parse_ints(args.ts, "--ts") or list(kernels.DEFAULT_TS)
    if min(ts) < 1:
        raise GemmdriftError(f"--ts: block sizes must be positive, got {min(ts)}")
    for flag, value in (("--rows", args.rows), ("--max-t", args.max_t)):
        if value < 1:
            raise GemmdriftError(f"{flag} must be positive, got {value}")
    layers = parse_ints(args.layers, "--layers")
    names = args.projections.split(",") if args.projections else None
    paths = args.paths.split(",")
    for p in paths:
        kernels.parse_path(p)  # a bad path fails before the model loads
    lm = _load(args)
    projs = kernels.projections(lm, layers=layers, names=names)
    print(f"gemmdrift kernels: {describe(lm.info)}; {len(projs)} projections x {len(paths)} paths", file=sys.stderr)
    if lm.synthetic:
        ids, label = [], "synthetic rows"
    else:
        ids, label = _tokens(args, lm)
    inputs = kernels.capture_inputs(lm, ids, projs, max_rows=args.rows)
    out = Path(args.out)
    df = kernels.sweep(lm, inputs, projs, paths, ts, max_t=args.max_t, checkpoint=out / "checkpoint")
    if args.ops:
        df = pd.concat([df, kernels.ops_sweep(lm)], ignore_index=True)
    inputs_record = {"model": lm.info, "prompt": label, "tokens": ids, "paths": paths, "ts": ts,
                     "rows": inputs.describe() if hasattr(inputs, "describe") else None}
    kernels.write_kernels(df, out, environment(), inputs_record)
    _emit(args, kernels.kernels_summary(df), kernels.print_kernels(df) + f"\n\nwritten to {out}/")
    return 0


def _load_draft(args):
    from .models import load_model, parse_quantization

    if args.draft is None:
        if args.draft_quantize is not None:
            raise GemmdriftError("--draft-quantize needs --draft (e.g. --draft embedded --draft-quantize 4)")
        return None
    q = parse_quantization(args.draft_quantize, None, "affine") if args.draft_quantize is not None else None
    return load_model(args.draft, dtype=args.draft_dtype or args.dtype, quantize=q).model


def _triage_lines(t: dict) -> list[str]:
    from .report import triage_items

    return [("  " if i else "") + x.replace("`", "").replace("**", "") for i, x in enumerate(triage_items(t))]


def cmd_diverge(args) -> int:
    from . import files, plots
    from .diverge import divergence_stats, diverge, stats_summary, write_divergence
    from .envinfo import environment
    from .models import describe
    from .prompts import builtin_prompts, builtin_text, read_prompts

    for flag, value in (("--n", args.n), ("--k", args.k), ("--prefill-a", args.prefill_a),
                        ("--prefill-b", args.prefill_b)):
        if value <= 0:
            raise GemmdriftError(f"{flag} must be positive, got {value}")
    lm = _load(args)
    draft = _load_draft(args)
    opts = dict(k=args.k, draft=draft, prefill_a=args.prefill_a, prefill_b=args.prefill_b, plain_vs=args.compare,
                envelope=args.envelope)
    record = {**opts, "draft": args.draft or "self", "draft_quantize": args.draft_quantize}
    out = Path(args.out)
    env = environment()
    print(f"gemmdrift diverge: {describe(lm.info)}", file=sys.stderr)
    if args.prompts is not None:
        texts = builtin_prompts() if args.prompts == "builtin" else read_prompts(args.prompts)
        if lm.tokenizer is None:
            raise GemmdriftError("--prompts needs a model with a tokenizer")
        prefix = "" if args.context is None else builtin_text(args.context) + "\n\n"
        ids = [lm.tokenizer.encode(prefix + t) for t in texts]
        df = divergence_stats(lm, ids, args.n, checkpoint=out / "prompts", labels=[str(i) for i in range(len(ids))],
                              do_triage=not args.no_triage, **opts)
        summary = stats_summary(df)
        files.write_csv(out / "divergence.csv", df)
        files.write_json(out / "meta.json", {"env": env, "inputs": {"model": lm.info, "prompts": texts, "n": args.n,
                                                                   "context": args.context, **record}})
        files.write_json(out / "summary.json", summary)
        files.save_figure(out / "divergence.png", plots.divergence(df))
        from .report import text_table

        text = text_table(df[["prompt", "prompt_tokens", "first_divergence", "verdict", "margin", "envelope",
                              "acceptance"]])
        text += (f"\n\n{summary['diverged']} of {summary['prompts']} prompts diverged; "
                 f"{summary['divergences_per_1k']:.3g} divergences per 1,000 tokens; "
                 f"{summary['near_ties']} near-ties, {summary['outside_envelope']} outside the envelope"
                 f"\nwritten to {out}/")
        _emit(args, summary, text)
        return 0
    ids, label = _tokens(args, lm)
    r = diverge(lm, ids, args.n, do_triage=not args.no_triage, **opts)
    write_divergence(r, out, env, ids, {"model": lm.info, "prompt": label, "n": args.n, **record})
    lines = [f"A ({r['stream_a']['label']}, {r['stream_a']['schedule']}): {r['text_a']!r}",
             f"B ({r['stream_b']['label']}, {r['stream_b']['schedule']}): {r['text_b']!r}"]
    if r["first_divergence"] is None:
        lines.append(f"no divergence in {args.n} tokens")
    elif "triage" not in r:
        lines.append(f"first divergence at generated token {r['first_divergence']}")
    if "triage" in r:
        lines += _triage_lines(r["triage"])
    lines.append(f"written to {out}/ (stream_a.json and stream_b.json feed `gemmdrift triage`)")
    _emit(args, r, "\n".join(lines))
    return 0


def cmd_triage(args) -> int:
    from . import files, plots
    from .diverge import read_stream, triage
    from .envinfo import environment

    lm = _load(args)
    pa, sa = read_stream(args.stream_a)
    pb, sb = read_stream(args.stream_b)
    if pa is not None and pb is not None and pa != pb:
        raise GemmdriftError("the two stream files have unequal prompts")
    given = any(x is not None for x in (args.prompt, args.prompt_file, args.prompt_ids))
    if given:
        prompt, _ = _tokens(args, lm)
        if (pa is not None and pa != prompt) or (pb is not None and pb != prompt):
            raise GemmdriftError("the prompt given does not match the prompt stored in the stream files")
    else:
        prompt = pa if pa is not None else pb
        if prompt is None:
            raise GemmdriftError("the stream files carry no prompt: give --prompt, --prompt-file or --prompt-ids")
    t = triage(lm, prompt, sa, sb, args.schedule_a, args.schedule_b, envelope=args.envelope).as_dict()
    files.save_figure(Path(args.out) / "triage.png", plots.triage(t))
    files.write_json(Path(args.out) / "triage.json", {"env": environment(), "triage": t})
    _emit(args, t, "\n".join(_triage_lines(t)))
    return 0


def cmd_run(args) -> int:
    from .envinfo import select_device
    from .suite import main_job

    select_device(args.device)
    paths = main_job(args.out, sizes=args.sizes, model=args.model, dtype=args.dtype)
    print(paths["markdown"].read_text())
    print(f"report: {paths['html']} (and {paths['markdown'].name} beside it)")
    return 0


def cmd_report(args) -> int:
    from .report import build_report, screenshot

    paths = build_report(args.dir)
    if args.screenshot:
        paths["screenshot"] = screenshot(paths["html"], Path(args.dir) / "report_page.png")
    _emit(args, {k: str(v) for k, v in paths.items()}, "\n".join(f"{k}: {v}" for k, v in paths.items()))
    return 0


def cmd_history(args) -> int:
    from . import files
    from .history import (history_table, latest_per_version, layer_profiles, plot_history, plot_layer_profile,
                          read_results, tracked)
    from .report import text_table

    df = read_results(args.results)
    out = Path(args.out)
    t = latest_per_version(tracked(df))
    if args.include:
        t = t[t["benchmark"].str.contains(args.include, regex=False)]
    if t.empty:
        raise GemmdriftError("no tracked figures match")
    files.write_csv(out / "history.csv", t)
    wide = history_table(t)
    files.write_csv(out / "history_wide.csv", wide)
    figures = []
    for (bench, params), _ in t.groupby(["benchmark", "params"], sort=True):
        name = (bench + ("_" + params if params else "")).replace("/", "_").replace(" ", "").replace(",", "_")
        figures.append(files.save_figure(out / "figures" / f"{name[:150]}.png", plot_history(t, bench, params)))
    for (machine, backend, bench, rest), profile in layer_profiles(t).items():
        name = f"layers_{bench}_{rest}_{machine}_{backend}".replace(" ", "").replace(",", "_").replace("/", "_")
        title = f"{bench} [{rest}] on {machine} ({backend}): drift per layer by mlx version"
        figures.append(files.save_figure(out / "figures" / f"{name[:150]}.png", plot_layer_profile(profile, title)))
    summary = {"series": int(len(wide)), "versions": sorted(set(t["mlx"])), "machines": sorted(set(t["machine"])),
               "figures": [str(f) for f in figures]}
    _emit(args, {**summary, "table": wide.to_dict(orient="records")},
          text_table(wide) + f"\n\n{len(figures)} figures in {out / 'figures'}/")
    return 0


def cmd_gate(args) -> int:
    from . import files
    from .history import gate, read_results
    from .report import text_table

    if not args.threshold >= 0:
        raise GemmdriftError(f"--threshold must be a non-negative fraction, got {args.threshold}")
    df = read_results(args.results)
    g = gate(df, candidate=args.candidate, baseline=args.baseline, threshold=args.threshold, include=args.include)
    bad = g[g["regression"]]
    if args.out:
        files.write_csv(Path(args.out) / "gate.csv", g)
    verdict = (f"FAIL: {len(bad)} of {len(g)} tracked figures of mlx {g['candidate'].iloc[0]} exceed mlx "
               f"{g['baseline'].iloc[0]} by more than {args.threshold:.0%}" if len(bad) else
               f"PASS: no tracked figure of mlx {g['candidate'].iloc[0]} exceeds mlx {g['baseline'].iloc[0]} "
               f"by more than {args.threshold:.0%} ({len(g)} compared)")
    shown = bad if len(bad) else g.head(0)
    _emit(args, {"pass": not len(bad), "compared": int(len(g)), "regressions": bad.to_dict(orient="records")},
          (text_table(shown[["machine", "backend", "benchmark", "params", "old", "new", "ratio"]]) + "\n" if len(bad)
           else "") + verdict)
    return 1 if len(bad) else 0


# ------------------------------------------------------------------------- parser


# ---- batch and server (issue 14)


def _batch_companions(lm, names, exclude: str, long_tokens: int, count: int) -> dict:
    from .prompts import builtin_prompts, builtin_text

    texts = [t for t in builtin_prompts() if t != exclude]
    texts = (texts * (count // max(len(texts), 1) + 1))[:count]
    out = {}
    for name in names:
        if name == "short":
            out["short"] = [lm.tokenizer.encode(t) for t in texts]
        else:  # longer than the sliding window: a prompt, then the essay, cut to long_tokens
            out["long"] = [lm.tokenizer.encode(t + "\n\n" + builtin_text("essay"))[:long_tokens] for t in texts]
    return out


def cmd_batch(args) -> int:
    from . import store, summaries
    from .batch import measure_batch
    from .files import to_json
    from .models import describe
    from .prompts import builtin_prompts

    sizes = parse_ints(args.batch_sizes, "--batch-sizes")
    if not sizes or min(sizes) < 1 or max(sizes) > 64:
        raise GemmdriftError("--batch-sizes: give sizes from 1 to 64, e.g. 1,2,4,8")
    names = [c.strip() for c in args.companions.split(",") if c.strip()]
    if not names or set(names) - {"short", "long"}:
        raise GemmdriftError(f"--companions: short, long or short,long (got {args.companions!r})")
    if args.n <= 0:
        raise GemmdriftError(f"--n must be positive, got {args.n}")
    if args.long_tokens is not None and args.long_tokens < 2:
        raise GemmdriftError("--long-tokens must be at least 2")
    if args.prompts is not None and args.prompts != "builtin":
        raise GemmdriftError("--prompts: only 'builtin' (each built-in prompt as the target in turn)")
    store.check_out_dir(args.out)
    lm = _load(args)
    if lm.tokenizer is None:
        raise GemmdriftError("gemmdrift batch builds its companion prompts from text: the model needs a tokenizer")
    window = int(lm.info.get("sliding_window") or 512)
    long_tokens = args.long_tokens or window + 64
    print(f"gemmdrift batch: {describe(lm.info)}", file=sys.stderr)
    if args.prompts == "builtin":
        targets = {f"p{i}": lm.tokenizer.encode(t) for i, t in enumerate(builtin_prompts())}
        exclude = ""
    else:
        ids, label = _tokens(args, lm) if any(x is not None for x in (args.prompt, args.prompt_file, args.prompt_ids)) \
            else (lm.tokenizer.encode(builtin_prompts()[0]), "built-in prompt 0")
        targets, exclude = {"target": ids}, (args.prompt or builtin_prompts()[0])
    comps = _batch_companions(lm, names, exclude, long_tokens, max(sizes) - 1)
    ladder_lm = None
    if args.ladder:
        from .models import load_model

        ladder_lm = load_model(args.model, dtype="float32")
    r = measure_batch(lm, targets, comps, args.n, batch_sizes=sizes, rows=args.rows, ladder_lm=ladder_lm,
                      reference=not args.no_reference, progress=lambda m: print("  " + m, file=sys.stderr, flush=True),
                      inputs={"long_tokens": long_tokens})
    out = Path(args.out)
    store.write_result(r, out)
    from .files import write_json
    from .server import stream_files

    for name, obj in stream_files(r).items():
        write_json(out / "streams" / name, obj)
    text = summaries.text(r) + f"\nwritten to {out}/ (streams/*.json feed `gemmdrift triage`)"
    print(to_json(summaries.summary(r)) if args.json else text)
    return 0


def cmd_server(args) -> int:
    from . import store, summaries
    from .files import to_json, write_json
    from .prompts import builtin_prompts, builtin_text
    from .server import measure_server, port_in_use, stream_files

    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if not cases or set(cases) - {"draft", "concurrent", "conversation"}:
        raise GemmdriftError(f"--cases: draft, concurrent, conversation (got {args.cases!r})")
    if args.n <= 0 or args.num_draft <= 0 or args.companions < 1:
        raise GemmdriftError("--n, --num-draft and --companions must be positive")
    if args.model.startswith("shape:"):
        raise GemmdriftError("the server needs a real checkpoint: 'embedded', a Gemma 3 .gguf or an mlx-lm directory")
    if args.draft is not None and not Path(args.draft).expanduser().is_dir():
        raise GemmdriftError(f"--draft {args.draft}: not an mlx-lm directory")
    if args.prompt is not None and args.prompt_file is not None:
        raise GemmdriftError("give only one of --prompt and --prompt-file")
    if args.prompt_file is not None:
        try:
            prompt = Path(args.prompt_file).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise GemmdriftError(f"cannot read prompt file {args.prompt_file}: {e}") from None
    else:
        prompt = args.prompt if args.prompt is not None else builtin_text("essay")
    store.check_out_dir(args.out)
    companions = (builtin_prompts() * args.companions)[: args.companions]
    r = measure_server(args.model, prompt, args.n, cases=cases, draft=args.draft, num_draft=args.num_draft,
                       companions=companions, triage=not args.no_triage,
                       progress=lambda m: print("  " + m, file=sys.stderr, flush=True))
    out = Path(args.out)
    store.write_result(r, out)
    for name, obj in stream_files(r).items():
        write_json(out / "streams" / name, obj)
    text = summaries.text(r) + f"\nwritten to {out}/ (streams/*.json feed `gemmdrift triage`)"
    print(to_json(summaries.summary(r)) if args.json else text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="gemmdrift", description="Floating-point drift in MLX: kernels, schedules, divergences.")
    sub = p.add_subparsers(dest="command", parser_class=_Parser, metavar="COMMAND")

    s = sub.add_parser("env", help="mlx/mlx-lm versions, backend, device and kernel env vars")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_env)

    s = sub.add_parser("stack", help="layer-by-layer drift between execution schedules, and the logit envelope")
    _add_model(s)
    _add_prompt(s)
    s.add_argument("--schedules", nargs="+", default=DEFAULT_SCHEDULES, metavar="SCHEDULE",
                   help="reference first; e.g. prefill:512,decode prefill:512,verify:2 (default: decode vs verify:2, verify:3)")
    s.add_argument("--split", type=int, help="prompt/continuation boundary (default: compare the last 128 tokens)")
    s.add_argument("--positions", help="positions compared, A:B (default split:end)")
    s.add_argument("--logit-positions", help="positions whose logits are compared, A:B or none (default: --positions)")
    s.add_argument("--no-local", action="store_true", help="skip local drift (saves one run per schedule)")
    s.add_argument("--ladder", action="store_true", help="rerun at float32: rounding shrinks, semantic differences do not")
    _add_output(s, "results/stack")
    s.set_defaults(func=cmd_stack)

    s = sub.add_parser("kernels", help="GEMV (T=1) vs GEMM (T>1) per projection of every layer, on captured rows")
    _add_model(s)
    _add_prompt(s)
    s.add_argument("--layers", help="decoder layers, e.g. 0-5,17 (default all; the LM head is layer N)")
    s.add_argument("--projections", help="comma-separated names, e.g. q_proj,mlp.down_proj,lm_head (default all)")
    s.add_argument("--paths", default="model,quant:affine-q4-g64,emulated:splitk4",
                   help="comma-separated: model, dense:<dtype>, quant:<mode>-q<bits>-g<group>, emulated:splitk<P>")
    s.add_argument("--ts", help="block sizes, e.g. 1-17,24,32,33,64,128,512,2048 (the default)")
    s.add_argument("--max-t", type=int, default=2048, help="largest block size (default 2048; a FLOP budget caps big projections)")
    s.add_argument("--rows", type=int, default=64, help="distinct captured rows per projection (default 64)")
    s.add_argument("--ops", action="store_true", help="also sdpa, rms_norm, rope and softmax with the model's geometry")
    _add_output(s, "results/kernels")
    s.set_defaults(func=cmd_kernels)

    s = sub.add_parser("diverge", help="greedy generation under two schedules (mlx-lm generate vs speculative), first divergence, triage")
    _add_model(s)
    _add_prompt(s)
    s.add_argument("--n", type=int, default=64, help="tokens to generate (default 64)")
    s.add_argument("--k", type=int, default=2, help="draft tokens per verification (default 2: blocks of 3)")
    s.add_argument("--compare", choices=["speculative", "prefill"], default="speculative",
                   help="plain vs speculative generate (default), or plain generate with two prefill chunk sizes")
    s.add_argument("--prefill-a", type=int, default=2048, help="prefill chunk of stream A (mlx-lm generate: 2048)")
    s.add_argument("--prefill-b", type=int, default=512, help="prefill chunk of stream B (speculative generate: 512)")
    s.add_argument("--draft", help="draft model (same sources as --model); default: the target drafts for itself")
    s.add_argument("--draft-quantize", type=int, metavar="BITS", help="re-quantize the draft (e.g. 4)")
    s.add_argument("--draft-dtype", help="draft compute dtype (default: --dtype)")
    s.add_argument("--prompts", help="divergence statistics over a prompt set: a file (one per line) or 'builtin'")
    s.add_argument("--context", help="prefix every prompt of --prompts with a built-in text (e.g. essay) to cross the sliding window")
    s.add_argument("--no-triage", action="store_true", help="only report the divergence")
    s.add_argument("--envelope", type=float, help="use this envelope (max |Δgap|, logits) instead of measuring it")
    _add_output(s, "results/diverge")
    s.set_defaults(func=cmd_diverge)

    s = sub.add_parser("triage", help="judge a divergence between two token streams: near-tie or state bug")
    _add_model(s)
    _add_prompt(s)
    s.add_argument("--stream-a", required=True, help="stream file (from `diverge`, or a JSON list / whitespace-separated ids)")
    s.add_argument("--stream-b", required=True, help="the other stream file")
    s.add_argument("--schedule-a", default="prefill:2048,decode", help="how stream A was computed (default: mlx-lm generate)")
    s.add_argument("--schedule-b", default="prefill:512,verify:2", help="how stream B was computed (default: speculative, K=2)")
    s.add_argument("--envelope", type=float, help="use this envelope instead of measuring it on the shared prefix")
    _add_output(s, "results/triage")
    s.set_defaults(func=cmd_triage)

    s = sub.add_parser("run", help="the main job: kernels, schedules, prefill chunks and a divergence on the embedded Gemma")
    s.add_argument("--out", default="results/run", help="output directory (default results/run); reruns resume")
    s.add_argument("--sizes", choices=["cpu", "gpu", "quick"], help="default: gpu on Metal/CUDA, cpu otherwise")
    s.add_argument("--model", default="embedded", help="a model source (default: the embedded Gemma 3 270M)")
    s.add_argument("--dtype", default="bfloat16", help="compute dtype (default bfloat16)")
    s.add_argument("--device", choices=["cpu", "gpu"], help="mlx device (default: mlx's own choice)")
    s.set_defaults(func=cmd_run)

    s = sub.add_parser("report", help="one page (HTML and markdown) from a results directory: tables, figures, reading")
    s.add_argument("dir", help="a results directory: the output of run, stack, kernels, diverge, triage or history")
    s.add_argument("--screenshot", action="store_true",
                   help="also render the page in headless Chromium to report_page.png (checks that it displays)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_report)

    s = sub.add_parser("history", help="tracked figures against the mlx version, from asv's results")
    s.add_argument("--results", default=".asv/results", help="asv results directory (default .asv/results)")
    s.add_argument("--include", default="", help="only benchmarks whose name contains this text")
    _add_output(s, "results/history")
    s.set_defaults(func=cmd_history)

    s = sub.add_parser("gate", help="exit 1 if a tracked drift figure of an mlx release grew past the previous one")
    s.add_argument("--results", default=".asv/results", help="asv results directory (default .asv/results)")
    s.add_argument("--candidate", help="mlx version to judge (default: the newest with results)")
    s.add_argument("--baseline", help="mlx version to compare with (default: the release before the candidate)")
    s.add_argument("--threshold", type=float, default=0.10, help="allowed relative growth (default 0.10)")
    s.add_argument("--include", default="", help="only benchmarks whose name contains this text")
    s.add_argument("--out", help="also write gate.csv here")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_gate)

    # ---- batch and server (issue 14)
    s = sub.add_parser("batch", help="a stream as row j of mlx-lm's BatchGenerator vs the same prompt alone, over B and row")
    _add_model(s)
    _add_prompt(s)
    s.add_argument("--n", type=int, default=16, help="tokens to generate (default 16)")
    s.add_argument("--batch-sizes", default="1,2,4,8", help="batch sizes B (default 1,2,4,8)")
    s.add_argument("--rows", choices=["ends", "all"], default="ends", help="the target's row: first and last (default) or every row")
    s.add_argument("--companions", default="short,long",
                   help="companion prompts: short (built-in prompts), long (longer than the sliding window), or both (default)")
    s.add_argument("--long-tokens", type=int, help="length of the long companions (default: sliding window + 64)")
    s.add_argument("--prompts", help="'builtin': every built-in prompt as the target in turn (divergence statistics)")
    s.add_argument("--no-reference", action="store_true", help="skip the single-sequence reference envelope")
    s.add_argument("--ladder", action="store_true",
                   help="rerun rows outside the envelope at float32: rounding shrinks, a padding/state bug does not")
    _add_output(s, "results/batch")
    s.set_defaults(func=cmd_batch)

    s = sub.add_parser("server", help="the real mlx_lm.server: draft model, concurrent requests, prompt-cache reuse")
    s.add_argument("--model", default="embedded", help="'embedded' (default), a Gemma 3 .gguf or an mlx-lm directory")
    s.add_argument("--prompt", help="prompt text (default: the built-in essay, longer than the 512 window)")
    s.add_argument("--prompt-file", help="file with the prompt text")
    s.add_argument("--n", type=int, default=64, help="tokens per request (default 64)")
    s.add_argument("--cases", default="draft,concurrent,conversation", help="which comparisons (default all three)")
    s.add_argument("--draft", help="--draft-model directory (default: a 4-bit re-quantized copy of the target, cached)")
    s.add_argument("--num-draft", type=int, default=2, help="--num-draft-tokens (default 2)")
    s.add_argument("--companions", type=int, default=3, help="concurrent companion requests (default 3)")
    s.add_argument("--no-triage", action="store_true", help="only report the divergences")
    _add_output(s, "results/server")
    s.set_defaults(func=cmd_server)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except GemmdriftError as e:
        print(f"gemmdrift: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("gemmdrift: interrupted (finished results are kept; rerun to resume)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
