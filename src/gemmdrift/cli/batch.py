"""`gemmdrift batch` and `gemmdrift server`: a stream as a row of mlx-lm's BatchGenerator, and as a request to
the real mlx_lm.server, against the same stream alone (issue 14).

Argparse setup and handlers only; the work is in :mod:`gemmdrift.measure.batch` and
:mod:`gemmdrift.measure.server`. ``cli`` is the :mod:`gemmdrift.cli` module, handed in (it sits above this one,
so it is never imported here).
"""

from __future__ import annotations

import sys

from .. import defaults as D
from ..errors import GemmdriftError
from ..ranges import parse_ints
from ..state import bench as cachebench


def _batch_companions(lm, names, exclude: str, long_tokens: int, count: int) -> dict:
    from ..prompts import builtin_prompts, builtin_text

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
    from .. import store
    from ..measure.batch import measure_batch
    from ..model import describe
    from ..prompts import builtin_prompts

    from ..checks import check_batch_args, check_length

    sizes = parse_ints(args.batch_sizes, "--batch-sizes")
    names = check_batch_args(sizes, args.companions, args.n, args.long_tokens, args.prompts, args.tokens)
    args.cli.precheck(args)  # out, prompt sources, --tokens, token files: before the model loads
    if args.model in (None, "", "embedded"):  # its position bound is known without loading it
        check_length({"max_positions": D.EMBEDDED_MAX_POSITIONS}, args.n + 1, f"--n {args.n} after any prompt")
    lm = args.cli.load(args)
    if lm.tokenizer is None:
        raise GemmdriftError("gemmdrift batch builds its companion prompts from text: the model needs a tokenizer")
    window = lm.description.sliding_window or 512  # no sliding window: long companions still outgrow most prompts
    long_tokens = args.long_tokens or window + 64
    if args.prompts == "builtin":
        targets = {f"p{i}": lm.tokenizer.encode(t) for i, t in enumerate(builtin_prompts())}
        exclude = ""
    else:
        given = any(x is not None for x in (args.prompt, args.prompt_file, args.prompt_ids))
        ids, label = (args.cli.tokens(args, lm) if given
                      else (lm.tokenizer.encode(builtin_prompts()[0]), "built-in prompt 0"))
        if not given and args.tokens is not None:  # --tokens cuts the built-in prompt too: never ignored
            if args.tokens > len(ids):
                raise GemmdriftError(f"--tokens {args.tokens}: the built-in prompt has only {len(ids)} tokens")
            ids = ids[: args.tokens]
        targets, exclude = {"target": ids}, (args.prompt or builtin_prompts()[0])
    for tl, ids in targets.items():
        check_length(lm.description, len(ids) + args.n, f"the prompt {tl!r} with --n {args.n}")
    print(f"gemmdrift batch: {describe(lm.description)}", file=sys.stderr)  # after the refusals the model allows
    comps = _batch_companions(lm, names, exclude, long_tokens, max(sizes) - 1)
    ladder_lm = None
    if args.ladder:
        from ..model import load_model

        ladder_lm = load_model(args.model, dtype="float32")
    r = measure_batch(lm, targets, comps, args.n, batch_sizes=sizes, rows=args.rows, ladder_lm=ladder_lm,
                      reference=not args.no_reference, progress=lambda m: print("  " + m, file=sys.stderr, flush=True),
                      inputs={"long_tokens": long_tokens}, layers=args.layers,
                      checkpoint=args.out)
    args.cli.write_and_print(args, r, args.out, note="(streams/*.json feed `gemmdrift triage`)")
    return 0


def cmd_server(args) -> int:
    from .. import store
    from ..prompts import builtin_prompts, builtin_text
    from ..measure.server import measure_server

    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if not cases or set(cases) - {"draft", "concurrent", "conversation"}:
        raise GemmdriftError(f"--cases: draft, concurrent, conversation (got {args.cases!r})")
    if args.n <= 0 or args.num_draft <= 0:
        raise GemmdriftError("--n and --num-draft must be positive")
    from ..checks import check_companions, read_prompt_text

    check_companions(args.companions)
    if args.model.startswith("shape:"):
        raise GemmdriftError("the server needs a real checkpoint: 'embedded', a Gemma 3 .gguf or an mlx-lm directory")
    impl, rb = cachebench.precheck(args)  # --cache-impl, --rollback and --draft self:N, before any server
    prompt = read_prompt_text(args.prompt, args.prompt_file)
    prompt = builtin_text("essay") if prompt is None else prompt
    store.check_out_dir(args.out)
    companions = (builtin_prompts() * args.companions)[: args.companions]
    r = measure_server(args.model, prompt, args.n, cases=cases, draft=args.draft, num_draft=args.num_draft,
                       companions=companions, triage=not args.no_triage,
                       progress=lambda m: print("  " + m, file=sys.stderr, flush=True), checkpoint=args.out,
                       plugins={"cache_impl": args.cache_impl, "rollback": args.rollback}, records=cachebench.records(impl, rb))
    args.cli.write_and_print(args, r, args.out, note="(streams/*.json feed `gemmdrift triage`)")
    return 0


def add_parser(sub, cli) -> None:
    """Register ``batch`` and ``server`` on the CLI's subparsers."""
    s = sub.add_parser("batch", help="a stream as row j of mlx-lm's BatchGenerator vs the same prompt alone, over B and row")
    cli.add_model(s)
    cli.add_prompt(s)
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
    s.add_argument("--layers", action="store_true",
                   help="follow the row through the padded batch at every layer (per-layer drift vs alone)")
    cli.add_output(s, "results/batch")
    s.set_defaults(func=cmd_batch, cli=cli)

    s = sub.add_parser("server", help="the real mlx_lm.server: draft model, concurrent requests, prompt-cache reuse")
    s.add_argument("--model", default="embedded", help="'embedded' (default), a Gemma 3 .gguf or an mlx-lm directory")
    s.add_argument("--prompt", help="prompt text (default: the built-in essay, longer than the 512 window)")
    s.add_argument("--prompt-file", help="file with the prompt text")
    s.add_argument("--n", type=int, default=64, help="tokens per request (default 64)")
    s.add_argument("--cases", default="draft,concurrent,conversation", help="which comparisons (default all three)")
    s.add_argument("--draft", help="--draft-model directory or self:N, the target's first N layers (default: a 4-bit "
                                   "re-quantized copy of the target, cached)")
    s.add_argument("--num-draft", type=int, default=2, help="--num-draft-tokens (default 2)")
    s.add_argument("--companions", type=int, default=3, help="concurrent companion requests (default 3)")
    s.add_argument("--no-triage", action="store_true", help="only report the divergences")
    cachebench.add_arguments(s, rollback=True)
    cli.add_output(s, "results/server")
    s.set_defaults(func=cmd_server, cli=cli)
