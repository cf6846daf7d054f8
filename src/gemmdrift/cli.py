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
    from .models import load_model, parse_quantization

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
    from .stack import measure_stack

    lm = _load(args)
    ids, label = _tokens(args, lm)
    n = len(ids)
    split = args.split if args.split is not None else default_split(n)
    positions = parse_range(args.positions, n, "--positions")
    logit_positions = parse_range(args.logit_positions, n, "--logit-positions")
    print(f"gemmdrift stack: {describe(lm.info)}; {n} tokens ({label}); split {split}", file=sys.stderr)
    result = measure_stack(lm, ids, args.schedules, split=split, positions=positions,
                           logit_positions=logit_positions, local=not args.no_local, ladder=args.ladder)
    result.inputs["prompt"] = label
    written = write_stack(result, args.out, environment())
    _emit(args, stack_summary(result), print_stack(result) + f"\n\nwritten to {Path(args.out)}/ "
          f"({', '.join(p.name for p in written.values())})")
    return 0


# ------------------------------------------------------------------------- parser


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
