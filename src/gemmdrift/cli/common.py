"""What every command of the command line shares: the parser whose bad flag is one line and exit 2, the model,
prompt and output flag groups, the checks before a model loads, loading it, the prompt's tokens, and the
ending (the Result written, its summary printed). :mod:`gemmdrift.cli` names them all; the command families
(golden.py, attribute.py, history.py, batch.py) reach them through the cli module handed to them."""

from __future__ import annotations

import argparse
from pathlib import Path

from .. import defaults as D
from ..errors import GemmdriftError


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr and exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        """Unrecognized arguments are named with the subcommand whose help lists its flags (D17)."""
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            prog = " ".join([self.prog] + [str(v) for v in (getattr(ns, "command", None),
                                                             getattr(ns, "replay_command", None)) if v])
            self.exit(2, f"{prog}: error: unrecognized arguments: {' '.join(extras)} (see {prog} --help)\n")
        return ns


def add_model(p):
    g = p.add_argument_group("model")
    g.add_argument("--model", default=D.MODEL,
                   help="'embedded' (Gemma 3 270M, default), 'shape:NAME', a Gemma 3 .gguf file, or an mlx-lm directory")
    g.add_argument("--dtype", default=D.DTYPE, help=f"compute dtype: bfloat16, float16, float32 (default {D.DTYPE})")
    g.add_argument("--quantize", type=int, metavar="BITS", help="re-quantize a dense model (mlx affine: 2,3,4,5,6,8 bits)")
    g.add_argument("--group-size", type=int, help="quantization group size: 32, 64 (default), 128")
    g.add_argument("--quant-mode", default=D.QUANT_MODE, help="quantization mode (affine; mxfp4/mxfp8/nvfp4 where mlx has them)")
    g.add_argument("--device", choices=["cpu", "gpu"], help="mlx device (default: mlx's own choice, recorded in every result)")


def add_prompt(p):
    g = p.add_argument_group("prompt")
    g.add_argument("--prompt", help="prompt text")
    g.add_argument("--prompt-file", help="file with the prompt text")
    g.add_argument("--prompt-ids", help="file of token ids (JSON list or whitespace-separated), used verbatim")
    g.add_argument("--tokens", type=int, help="use only the first N tokens of the prompt")


def add_output(p, default: str):
    p.add_argument("--out", default=default, help=f"output directory (default {default})")
    p.add_argument("--json", action="store_true", help="print a JSON summary on stdout (progress goes to stderr)")


def precheck(args) -> None:
    """The checks every model command runs before loading a model (see gemmdrift.checks)."""
    from .. import checks

    checks.check_out_dir(args.out)
    if hasattr(args, "prompt"):
        checks.check_prompt_args(args.prompt, args.prompt_file, args.prompt_ids)
        checks.check_tokens(args.tokens)
        if args.prompt_ids is not None:  # syntax and emptiness now; the vocabulary once the model says it
            from ..prompts import read_token_ids

            read_token_ids(args.prompt_ids)
    if getattr(args, "envelope", None) is not None:
        checks.check_envelope(args.envelope)


def load(args):
    from ..machine.envinfo import select_device
    from ..model import load_model, parse_quantization

    select_device(getattr(args, "device", None))

    q = parse_quantization(args.quantize, args.group_size, args.quant_mode) if args.quantize is not None else None
    if args.quantize is None and args.group_size is not None:
        raise GemmdriftError("--group-size needs --quantize")
    return load_model(args.model, dtype=args.dtype, quantize=q)


def tokens(args, lm):
    from ..prompts import prompt_tokens

    ids, label = prompt_tokens(lm, args.prompt, args.prompt_file, args.prompt_ids)
    if args.tokens is not None:
        if args.tokens < 2:
            raise GemmdriftError(f"--tokens must be at least 2, got {args.tokens}")
        if args.tokens > len(ids):
            raise GemmdriftError(f"--tokens {args.tokens}: the prompt has only {len(ids)} tokens")
        ids = ids[: args.tokens]
    from ..checks import check_length

    check_length(lm.description, len(ids), "the prompt")
    return ids, label


def replay_shapes(args):
    """The projection shapes of ``--model`` from its config, for ``--kernels`` checks before the load (D8)."""
    if not getattr(args, "kernels", None) or (args.quantize is not None and args.quant_mode != "affine"):
        return None
    from ..replay.model import model_shapes

    quant = None if args.quantize is None else (args.quantize, args.group_size or 64)
    return model_shapes(args.model, quant)


def write_and_print(args, result, out, note: str = "") -> None:
    """The one way a measuring command ends: the Result to ``out``, then its summary (or --json) printed."""
    from .. import store
    from ..view import summaries

    written = store.write_result(result, out)
    files = [p.relative_to(out).as_posix() if p.is_relative_to(Path(out)) else p.name  # streams/x.json, not x.json
             for k, p in written.items()]  # every file, result.json and result.csv included
    names = ", ".join(files if len(files) <= 16 else files[:14] + [f"and {len(files) - 14} more"])
    emit(args, summaries.summary(result), summaries.text(result) + f"\n\nwritten to {Path(out)}/ ({names})"
          + (f"\n{note}" if note else ""))


def emit(args, summary: dict, text: str) -> None:
    from ..files import to_json

    if args.json:
        print(to_json(summary))
    else:
        print(text)
