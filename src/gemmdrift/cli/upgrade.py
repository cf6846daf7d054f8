"""``gemmdrift upgrade``: should I upgrade mlx? One command, on the user's own model (issue 48).

Flags -> the two interpreters (:mod:`gemmdrift.upgrade.envs`: given with ``--python``/``--from-python``, cached,
or made with uv) -> one library call (:func:`gemmdrift.upgrade.measure.measure_upgrade`) -> ``store.write_result``
-> the summary. Every bad input is one line and exit 2 before any model loads; the exit status is 0 when the
class is at most ``--allow``, 1 when it is worse (as ``gate``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .. import defaults as D
from ..errors import GemmdriftError

OUT = "results/upgrade"


def model_facts(source: str) -> dict:
    """What ``--model`` is, read without loading it: its architecture (what the other mlx-lm must know), and where
    its config says them, its positions and sliding window (a GGUF's are checked once it is loaded)."""
    from ..model import SHAPES, resolve_source

    kind, path = resolve_source(source)
    if kind == "shape":
        raise GemmdriftError(f"--model {source}: upgrade needs a model on disk (an mlx-lm directory, a Gemma 3 GGUF "
                             "or 'embedded'): the other release loads it from there")
    if kind == "embedded":
        c = SHAPES["gemma3-270m"]
        return {"model_type": "gemma3_text", "max_positions": D.EMBEDDED_MAX_POSITIONS,
                "sliding_window": c["sliding_window"]}
    if kind == "gguf":
        return {"model_type": "gemma3_text"}  # gemmdrift converts Gemma 3 GGUFs to an mlx-lm gemma3_text checkpoint
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise GemmdriftError(f"--model {source}: cannot read its config.json ({e})") from None
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    return {"model_type": str(cfg.get("model_type") or "?"), "max_positions": text.get("max_position_embeddings"),
            "sliding_window": text.get("sliding_window")}


def model_type(source: str) -> str:
    return model_facts(source)["model_type"]


def check_generate(gen: int, n: int | None, limit: int | None) -> None:
    """The greedy run holds the prompt before the compared positions and ``gen`` generated tokens: refuse it past
    the model's positions (``n``: the stream's length where known, else the shortest a stream can be)."""
    from ..upgrade.measure import split_of

    if not limit:
        return
    split = split_of(n) if n else 1
    if split + gen > limit:
        raise GemmdriftError(f"--generate {gen}: the greedy run would hold {split + gen:,} positions ({split:,} of "
                             f"the prompt), more than the model's {limit:,}; at most {max(limit - split, 0):,} here")


def plan(args, mtype: str):
    """Both sides' interpreters or releases to build, every check before a model loads."""
    from ..upgrade import envs

    for flag in ("to", "from_", "mlx_lm"):
        v = getattr(args, flag)
        if v is not None:
            envs.check_version(v, "--" + flag.rstrip("_").replace("_", "-"))
    if args.to is None and args.python is None:
        raise GemmdriftError("give the release to judge: --to VERSION (or its interpreter with --python PATH)")
    if args.from_ is not None and args.from_ == args.to and args.python is None and args.from_python is None:
        raise GemmdriftError(f"--from {args.from_} equals --to {args.to}: that is the control (one release on both "
                             f"sides, which must come out BIT-FOR-BIT); ask for it with that release's interpreter: "
                             f"--from {args.from_} --to {args.to} --python PATH")
    new = envs.plan_side("to", args.to, args.mlx_lm, args.python, mtype)
    if args.from_python:
        old = envs.plan_side("from", args.from_, None, args.from_python, mtype)
    elif args.from_ is not None and args.python and args.from_ == new.mlx:  # the control: one interpreter twice
        old = envs.Plan("from", new.mlx, new.mlx_lm, new.python, "--python (the control)", new.info)
    elif args.from_ is not None:
        old = envs.plan_side("from", args.from_, None, None, mtype)
    else:
        old = envs.this_interpreter(mtype)
    return old, new


def cmd_upgrade(args) -> int:
    from .. import checks
    from ..changelog.classify import CLASSES

    if args.allow not in CLASSES:
        raise GemmdriftError(f"--allow {args.allow!r}: one of {', '.join(CLASSES)}")
    args.cli.precheck(args)
    checks.check_out_kind(args.out, "upgrade")
    if args.tokens is not None and args.tokens < 16:
        raise GemmdriftError(f"--tokens {args.tokens}: upgrade needs at least 16 tokens")
    checks.check_positive(speed_rounds=args.speed_rounds, generate=args.generate)
    from ..model.description import parse_dtype

    try:
        parse_dtype(args.dtype)
    except GemmdriftError as e:
        raise GemmdriftError(f"--dtype: {e}") from None
    facts = model_facts(args.model)
    mtype = facts["model_type"]
    n = args.tokens
    if n is None and args.prompt is None and args.prompt_file is None and args.prompt_ids is None:
        from ..upgrade.measure import default_length

        n = default_length(facts)  # the built-in essay's length
    if n is not None:
        checks.check_length(facts, n, "the stream")
    check_generate(args.generate, n, facts.get("max_positions"))
    old_plan, new_plan = plan(args, mtype)

    from ..upgrade import envs

    def say(text: str) -> None:
        print(text, file=sys.stderr)

    old = envs.realise(old_plan, mtype, say)
    new = envs.realise(new_plan, mtype, say)
    old.label, new.label = "from", "to"
    lm = args.cli.load(args)
    ids, label = _stream(args, lm)
    from ..upgrade.measure import measure_upgrade

    result = measure_upgrade(lm, ids, (old, new), args.out, gen=args.generate, speed_rounds=args.speed_rounds,
                             allow=args.allow, prompt_label=label, log=say)
    _write(args, result, Path(args.out))
    return 0 if result.details["pass"] else 1


def _write(args, result, out: Path) -> None:
    """The Result, then its page (report.md, report.html), then the summary or --json."""
    from .. import store
    from ..report import build_report
    from ..view import summaries

    store.write_result(result, out)
    pages = build_report(out)
    summary = {**summaries.summary(result), "out": str(out), "report": {k: str(v) for k, v in pages.items()}}
    args.cli.emit(args, summary, summaries.text(result) + f"\n\nwritten to {out}/ (result.json, report.md, "
                  "report.html and the tables)")


def _stream(args, lm):
    """The prompt's tokens (--prompt/--prompt-file/--prompt-ids, cut to --tokens), or the built-in essay to
    the default length (:func:`gemmdrift.upgrade.measure.default_length`)."""
    from ..checks import check_length
    from ..prompts import builtin_stream
    from ..upgrade.measure import default_length

    if args.prompt is None and args.prompt_file is None and args.prompt_ids is None:
        if lm.tokenizer is None:
            raise GemmdriftError(f"--model {args.model} has no tokenizer: give the prompt as --prompt-ids")
        n = args.tokens or default_length(lm.info)
        ids, label = builtin_stream(lm, n), f"the built-in essay, {n} tokens"
    else:
        ids, label = args.cli.tokens(args, lm)
    check_length(lm.description, len(ids), "the stream")
    check_generate(args.generate, len(ids), lm.description.max_positions)
    return ids, label


def add_parser(sub, cli) -> None:
    """Register ``upgrade`` on the CLI's subparsers; ``cli`` is :mod:`gemmdrift.cli` (handed in, never imported)."""
    from ..changelog.classify import CLASSES

    s = sub.add_parser("upgrade", help="should I upgrade mlx? the class of the change on your model, the first op "
                                       "that moved, the logits, greedy output and speed under both releases")
    g = s.add_argument_group("releases")
    g.add_argument("--to", metavar="VERSION", help="the mlx release to judge (its environment is made with uv and "
                                                   "cached, unless --python gives its interpreter)")
    g.add_argument("--from", dest="from_", metavar="VERSION",
                   help="the release to compare with (default: this interpreter's mlx)")
    g.add_argument("--python", metavar="PATH", help="the interpreter of --to (offline: nothing is built)")
    g.add_argument("--from-python", metavar="PATH", help="the interpreter of --from (offline: nothing is built)")
    g.add_argument("--mlx-lm", metavar="VERSION",
                   help="mlx-lm for --to's environment (default: the one asv.conf.json's matrix pairs with it; a "
                        "release it does not pair needs this flag; one that cannot run --to's mlx is refused)")
    g.add_argument("--allow", default="ROUNDOFF", metavar="CLASS",
                   help=f"exit 0 when the class is at most this, 1 when worse ({', '.join(CLASSES)}; default ROUNDOFF)")
    m = s.add_argument_group("model")
    m.add_argument("--model", default=D.MODEL,
                   help="'embedded' (Gemma 3 270M, default), a Gemma 3 .gguf file, or an mlx-lm directory")
    m.add_argument("--dtype", default=D.DTYPE, help=f"compute dtype (default {D.DTYPE})")
    s.set_defaults(quantize=None, group_size=None, quant_mode=D.QUANT_MODE, device=None)
    cli.add_prompt(s)
    for action in s._actions:
        if action.dest == "tokens":
            action.help = ("the stream's length: the first N tokens of the prompt, or N tokens of the built-in essay "
                           "(default: 64 past position 256 and past the model's sliding window; 577 for Gemma 3)")
    s.add_argument("--generate", type=int, default=32, help="greedy tokens generated under each release (default 32)")
    s.add_argument("--speed-rounds", type=int, default=3,
                   help="speed rounds, alternating the two releases (default 3; medians)")
    cli.add_output(s, OUT)
    s.set_defaults(func=cmd_upgrade, cli=cli)
