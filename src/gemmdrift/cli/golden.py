"""`gemmdrift logits` and `gemmdrift compare`: a base file of teacher-forced logits, and two runs compared.

Argparse setup and handlers only; the work is in :mod:`gemmdrift.measure.golden` and :mod:`gemmdrift.measure.twostats`.
Every check that needs no model (flags, the base file, an empty stream) runs before the model loads.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .. import defaults as D
from ..errors import GemmdriftError

DEFAULT_BASE = "results/logits/base.npz"


def _pre_stream(args) -> None:
    """Prompt flags and an empty stream, before any model loads."""
    from ..checks import check_prompt_args

    check_prompt_args(args.prompt, args.prompt_file, args.prompt_ids)
    if args.prompt_ids is not None:
        from ..prompts import read_token_ids

        read_token_ids(args.prompt_ids)  # an empty or malformed id file: refused now
    if args.tokens is not None and args.tokens < 2:
        raise GemmdriftError(f"--tokens must be at least 2 (one position with a next token), got {args.tokens}")


def _stream(args, lm) -> tuple[list[int], str]:
    """The token stream: the prompt flags, else the built-in essay and prompt set; cut to --tokens."""
    from ..checks import check_length
    from ..measure.golden import default_text
    from ..prompts import prompt_tokens

    if any(x is not None for x in (args.prompt, args.prompt_file, args.prompt_ids)):
        ids, label = prompt_tokens(lm, args.prompt, args.prompt_file, args.prompt_ids)
    else:
        ids, _ = prompt_tokens(lm, default_text())
        label = "built-in essay and prompt set"
    if args.tokens is not None:
        if args.tokens > len(ids):
            raise GemmdriftError(f"--tokens {args.tokens}: the stream has only {len(ids)} tokens")
        ids = ids[: args.tokens]
    if len(ids) < 2:
        raise GemmdriftError("the token stream is empty: it needs at least 2 tokens")
    check_length(lm.description, len(ids), "the token stream")
    return ids, label


def _schedule_split(schedule: str, split: int | None, n: int) -> int | None:
    from ..measure.golden import default_split, needs_split

    if not needs_split(schedule):
        return split
    return split if split is not None else default_split(n)


def _progress(total: int, desc: str):
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit="tok", file=sys.stderr, leave=False, mininterval=2.0)
    return bar, bar.update


def cmd_logits(args) -> int:
    from ..checks import check_out_file, check_positive
    from ..schedules import parse_schedule

    parse_schedule(args.schedule)
    _pre_stream(args)
    if args.top_k < 1:
        raise GemmdriftError(f"--top-k must be between 1 and the vocabulary size, got {args.top_k}")
    check_positive(split=args.split)
    out = check_out_file(args.out, "--out")

    kopt = _kernels(args)
    from ..measure.golden import base_from_run, write_logits
    from ..model import describe

    lm = args.cli.load(args)
    if args.top_k > lm.vocab_size:
        raise GemmdriftError(f"--top-k must be between 1 and the vocabulary size {lm.vocab_size}, got {args.top_k}")
    ids, label = _stream(args, lm)
    split = _schedule_split(args.schedule, args.split, len(ids))
    print(f"gemmdrift logits: {describe(lm.description)}; {len(ids)} tokens ({label}); {args.schedule}"
          + (f", split {split}" if split is not None else ""), file=sys.stderr)
    bar, tick = _progress(len(ids), args.schedule)
    try:
        with kopt.installed(lm):
            lf = base_from_run(lm, ids, args.schedule, split=split, top_k=args.top_k, full=args.full, label=label,
                               progress=tick)
    finally:
        bar.close()
    _label_kernels(lf.header, kopt)
    size = write_logits(out, lf)
    kept = "every logit" if args.full else f"top-{lf.header['top_k']}"
    said = (f"wrote {out}: {size:,} bytes ({size / 2**20:.2f} MiB), {len(lf.view)} positions, "
            f"{kept}, {args.schedule}, "
            f"{lf.header['dtype']}, mlx {lf.header['env'].get('mlx')}, {lf.header['seconds']:.1f} s; "
            f"token digest {lf.header['token_digest'][:12]}")
    if args.json:
        from ..files import to_json

        print(to_json({"path": str(out), "bytes": size, "positions": len(lf.view), "top_k": lf.header["top_k"],
                       "full": args.full, "schedule": args.schedule, "seconds": lf.header["seconds"],
                       "token_digest": lf.header["token_digest"]}))
    else:
        print(said)
    return 0


def cmd_compare(args) -> int:
    from ..checks import check_envelope, check_out_dir, check_out_file, check_positive
    from ..measure.golden import check_pair, compare_result, prefix, read_logits, resolve_golden

    if (args.base is None) == (args.golden is None):
        raise GemmdriftError("give one of --base FILE and --golden NAME (e.g. --golden linux-cpu)")
    check_envelope(args.envelope)
    check_positive(split=args.split)
    check_out_dir(args.out)
    base_path = resolve_golden(args.golden) if args.golden is not None else args.base
    if args.save is not None:  # as logits checks its --out, and never onto the base it is compared against
        check_out_file(args.save, "--save", keep=base_path)
    base = read_logits(base_path)  # a missing, truncated or foreign base: refused before the model loads
    given = any(x is not None for x in (args.prompt, args.prompt_file, args.prompt_ids))
    if args.other is not None:
        if given or args.schedule is not None or args.save is not None or args.kernels is not None:
            raise GemmdriftError("--other compares two saved files: give no prompt, --schedule, --kernels or --save "
                                 "with it")
        model_flags = [f for f, v, d in (("--model", args.model, D.MODEL), ("--dtype", args.dtype, D.DTYPE),
                                         ("--quantize", args.quantize, None), ("--group-size", args.group_size, None),
                                         ("--quant-mode", args.quant_mode, D.QUANT_MODE)) if v != d]
        if model_flags:
            raise GemmdriftError(f"--other compares two saved files and runs no model: {', '.join(model_flags)} "
                                 "would change nothing (the files say how they were made)")
        other = read_logits(args.other)
        if args.tokens is not None:
            base, other = prefix(base, args.tokens), prefix(other, args.tokens)
        check_pair(base.header, other.header, allow_other_model=args.allow_other_model, other_name="the other file")
        result = compare_result(base, other, envelope=args.envelope,
                                record={"mode": "two files", "allow_other_model": args.allow_other_model})
        return _finish(args, result)
    _pre_stream(args)
    if args.schedule is not None:
        from ..schedules import parse_schedule

        parse_schedule(args.schedule)
    if args.tokens is not None and not given:
        base = prefix(base, args.tokens)
    kopt = _kernels(args)

    from ..measure.golden import compare_live, write_logits
    from ..model import describe

    lm = args.cli.load(args)
    ids, label = _stream(args, lm) if given else (None, "")
    print(f"gemmdrift compare: base = {base.label()} ({base.path})\n"
          f"                   other = this run: {describe(lm.description)}, {args.schedule or base.header['schedule']}"
          + (f", kernels {kopt.text} (a prediction)" if kopt.text else ""),
          file=sys.stderr)
    bar, tick = _progress(len(ids) if ids is not None else len(base.tokens), "this run")
    try:
        with kopt.installed(lm):
            result, other = compare_live(lm, base, tokens=ids, schedule=args.schedule, split=args.split,
                                         envelope=args.envelope, allow_other_model=args.allow_other_model,
                                         label=label, progress=tick, kernels=kopt.text)
    finally:
        bar.close()
    result = kopt.label(result)
    _label_kernels(other.header, kopt)
    note, failed = "", None
    if args.save is not None:
        try:
            size = write_logits(args.save, other)
            note = f"this run's logits (other): {args.save} ({size:,} bytes)"
        except OSError as e:  # gone unwritable since the check: the comparison is still written
            failed = f"--save {args.save}: cannot write there ({e.strerror or e}); the comparison is in {args.out}/"
    _finish(args, result, note)
    if failed:
        raise GemmdriftError(failed)
    return 0


def _kernels(args):
    """``--kernels replay:<chip>[@variant]`` (or nothing), checked before the model loads."""
    from ..replay.model import KernelsOption

    return KernelsOption(args.kernels)


def _label_kernels(header: dict, kopt) -> None:
    """A base file computed with replayed kernels says so (a prediction for that chip, not a measurement)."""
    header["kernels"] = kopt.text or "native"
    if kopt.log is not None:
        header["replay"] = kopt.log.record()


def _finish(args, result, note: str = "") -> int:
    args.cli.write_and_print(args, result, args.out, note)
    return 0


def add_parser(sub, cli) -> None:
    """Register `logits` and `compare` on the `gemmdrift` subcommand parser ``sub``.

    ``cli`` is the :mod:`gemmdrift.cli` module, handed in (it sits above this one, so it is never imported
    here): its shared flag groups, model loading and result printing are the ones every command uses.
    """

    s = sub.add_parser("logits", help="teacher-forced logits of a token stream under one schedule, as a portable "
                                      "base file (top-k log-probs, log-sum-exp, the correct token)")
    cli.add_model(s)
    cli.add_prompt(s)
    s.add_argument("--schedule", default=D.SCHEDULE_PLAIN,
                   help=f"how the stream is fed (default {D.SCHEDULE_PLAIN}, mlx-lm generate's)")
    s.add_argument("--split", type=int, help="prompt/continuation boundary of a two-phase schedule "
                                             "(default: the last 128 tokens are the continuation)")
    s.add_argument("--top-k", type=int, default=64, help="token ids kept per position (default 64)")
    s.add_argument("--full", action="store_true", help="keep every logit (small runs: 1 MiB per position for Gemma)")
    s.add_argument("--kernels", help="replay:<chip>[@variant]: every projection and the LM head computed with "
                                     "that chip's replayed reduction orders (a prediction; see `gemmdrift replay`)")
    s.add_argument("--out", default=DEFAULT_BASE, help=f"the base file to write (default {DEFAULT_BASE})")
    s.add_argument("--json", action="store_true", help="print a JSON summary on stdout")
    s.set_defaults(func=cmd_logits, cli=cli)

    s = sub.add_parser("compare", help="this run (or --other FILE) against a base file: KLD, Δp, same top-1, "
                                       "perplexity, argmax flips")
    g = s.add_argument_group("base")
    g.add_argument("--base", help="a base file written by `gemmdrift logits`")
    g.add_argument("--golden", help="a shipped base: linux-cpu (decode) or linux-cpu/verify-2")
    g.add_argument("--other", help="compare two saved files: this one against the base (no model runs)")
    cli.add_model(s)
    cli.add_prompt(s)
    s.add_argument("--schedule", help="this run's schedule (default: the base's)")
    s.add_argument("--split", type=int, help="this run's prompt/continuation boundary (default: the base's)")
    s.add_argument("--envelope", type=float, help="largest |Δgap| called a near-tie (default: the largest |Δgap| "
                                                  "where the two runs' top-1 agree)")
    s.add_argument("--allow-other-model", action="store_true",
                   help="compare across models (e.g. a quantized model against its original)")
    s.add_argument("--save", help="also write this run's logits as a base file")
    s.add_argument("--kernels", help="replay:<chip>[@variant]: every projection and the LM head computed with "
                                     "that chip's replayed reduction orders (a prediction; see `gemmdrift replay`)")
    cli.add_output(s, "results/compare")
    s.set_defaults(func=cmd_compare, cli=cli)
