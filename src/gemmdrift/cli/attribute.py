"""``gemmdrift attribute``: which op made the drift between two schedules (issue 29).

Flags as ``stack``'s (model, prompt, ``--schedules`` A B, ``--split``, ``--positions``, ``--kernels``), plus
``--ops`` (the op classes of the counterfactual) and ``--counterfactual`` (``each``, ``all-but-one``, both, or
``none``). Every input error that can be known before the model loads is one line and exit 2 before it loads;
an unknown op name is refused right after (the model says which ops it exposes), before anything is computed.
Finished parts are checkpointed under ``--out``: a rerun after Ctrl-C resumes.

Other modes of the command plug in through :data:`MODES`: a list of ``(add_arguments(parser), run(args, cli))``
pairs. ``add_arguments`` adds the mode's flags; ``run`` returns None when its flags were not given (the next mode
is asked, and the plain attribution runs when none answers), else the exit code. A mode module appends itself
at the bottom of this file, e.g. ``MODES.append((primitives_cli.add_arguments, primitives_cli.run))``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

from .. import defaults as D
from ..errors import GemmdriftError

MODES: list[tuple[Callable[[Any], None], Callable[[Any, Any], int | None]]] = []
DEFAULT_SCHEDULES = ("prefill:512,decode", "prefill:512,verify:2")


def parse_counterfactual(text: str) -> list[str]:
    """``each``, ``all-but-one``, ``both`` (= ``each,all-but-one``) or ``none`` -> the directions to run."""
    from ..attribution.attribute import DIRECTIONS

    if text.strip() == "none":
        return []
    if text.strip() == "both":
        return list(DIRECTIONS)
    out = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in out if t not in DIRECTIONS]
    if bad or not out:
        raise GemmdriftError(f"--counterfactual {text!r}: expected each, all-but-one, both "
                              "(each,all-but-one) or none")
    return out


def parse_ops(text: str | None) -> list[str] | None:
    if text is None:
        return None
    out = [t.strip() for t in text.split(",") if t.strip()]
    if not out:
        raise GemmdriftError("--ops: give op names, e.g. q_proj,sdpa,k_norm")
    return out


def add_parser(sub, cli) -> None:
    """Register ``attribute`` on the CLI's subparsers; ``cli`` is :mod:`gemmdrift.cli` (handed in, never imported)."""
    s = sub.add_parser("attribute", help="which op made the drift: local drift per op and layer, and the "
                                         "counterfactual per op class at the logits")
    cli.add_model(s)
    cli.add_prompt(s)
    s.add_argument("--schedules", nargs="+", default=list(DEFAULT_SCHEDULES), metavar="SCHEDULE",
                   help="the reference, then the schedule compared (default prefill:512,decode prefill:512,verify:2)")
    s.add_argument("--split", type=int, help="prompt/continuation boundary (default: compare the last 128 tokens)")
    s.add_argument("--positions", help="positions compared, A:B (default split:end)")
    s.add_argument("--ops", help="op classes of the counterfactual, e.g. q_proj,sdpa,k_norm (default: every class "
                                 "the model exposes; an unknown name lists them)")
    s.add_argument("--counterfactual", default="each,all-but-one",
                   help="each (one class made invariant), all-but-one (one class kept, every other drifting class "
                        "held: its own drift removed, what it carries kept), "
                        "both (default each,all-but-one) or none")
    s.add_argument("--kernels", help=D.KERNELS_HELP)
    cli.add_output(s, "results/attribute")
    for add, _ in MODES:  # after --out and --json: a mode adds only the flags the command lacks
        add(s)
    for action in s._actions:  # a default is marked: a flag the user typed is told from one left alone
        if action.dest in _MARKED and action.default is not None:
            action.default = _mark(action.default)
    s.set_defaults(func=lambda args: cmd_attribute(args, cli))


# Flags one mode of ``attribute`` takes and the others do not: given to another mode, refused in one line.
_SCHEDULE_ONLY = ("schedules", "split", "positions", "counterfactual", "prompt", "prompt_file", "prompt_ids",
                  "tokens")
_PRIMITIVES_ONLY = ("ts", "lm_head_rows", "max_rows", "operand_seed", "fail_unless_exact")
_RELEASE_ONLY = ("baseline_python", "release_tokens", "release_split", "release_layers", "release_out",
                 "release_capture")
_MARKED = ("schedules", "counterfactual", "ts", "release_tokens", "release_split")  # defaults that are not None


class _Marked:
    """A default the parser set (not a value the user typed)."""


def _mark(value):
    for base in (str, int, list):
        if isinstance(value, base) and not isinstance(value, bool):
            return type(f"Default{base.__name__}", (_Marked, base), {})(value)
    return value


def given(args, dest: str) -> bool:
    """Whether the user gave ``--dest`` (a marked default, None or False is not given)."""
    v = getattr(args, dest, None)
    return not (v is None or v is False or isinstance(v, _Marked))


def check_mode_flags(args) -> str:
    """Which mode ``args`` asks for (``primitives``, ``release`` or ``schedules``); a flag of another mode: a
    one-line GemmdriftError naming it and the mode it belongs to (before anything loads)."""
    flag = lambda d: "--" + d.replace("_", "-")  # noqa: E731
    if given(args, "primitives") and given(args, "python"):
        raise GemmdriftError("--primitives and --python are two modes of attribute (the gate, the release "
                             "comparison): give one")
    mode = "primitives" if given(args, "primitives") else "release" if given(args, "python") else "schedules"
    name = {"primitives": "attribute --primitives (the gate)", "release": "attribute --python (the release "
            "comparison)", "schedules": "attribute between two schedules"}[mode]
    owner = {**{d: "the schedule attribution" for d in _SCHEDULE_ONLY},
             **{d: "--primitives" for d in _PRIMITIVES_ONLY}, **{d: "--python" for d in _RELEASE_ONLY}}
    refuse = {"primitives": _SCHEDULE_ONLY + _RELEASE_ONLY + ("quantize", "group_size"),
              "release": _SCHEDULE_ONLY + _PRIMITIVES_ONLY + ("ops", "kernels", "quantize", "group_size"),
              "schedules": _PRIMITIVES_ONLY + _RELEASE_ONLY}[mode]
    for d in refuse:
        if given(args, d):
            whose = owner.get(d)
            raise GemmdriftError(f"{flag(d)}: {name} does not take it" + (f" (a flag of {whose})" if whose else
                                                                             " (it measures the model as it ships)"
                                                                             if mode == "primitives" else ""))
    return mode


def precheck_lengths(args, kopt, cli) -> None:
    """What ``--tokens`` bounds before the model loads: ``--split`` and ``--positions`` inside the stream, and a
    replayed chip with no recipe for a call the run makes (as ``stack`` refuses it)."""
    n = args.tokens
    if n is not None and args.split is not None and args.split >= n:
        raise GemmdriftError(f"--split {args.split}: the stream has {n} tokens (--tokens {n}); the split must lie "
                             f"in 1..{n - 1}")
    if n is not None and args.positions not in (None, "none"):
        from ..ranges import parse_range

        parse_range(args.positions, n, "--positions")
    kopt.check_run(cli.replay_shapes(args), args.schedules, n, args.split, args.dtype)


def cmd_attribute(args, cli) -> int:
    check_mode_flags(args)
    for _, run in MODES:
        rc = run(args, cli)
        if rc is not None:
            return int(rc)
    from ..checks import check_positive, check_range_text
    from ..replay.model import KernelsOption
    from ..schedules import parse_schedule

    if len(args.schedules) != 2:
        raise GemmdriftError(f"--schedules: give two (the reference and the one compared), got {len(args.schedules)}")
    for text in args.schedules:
        parse_schedule(text)
    cli.precheck(args)
    check_positive(split=args.split)
    check_range_text(args.positions, "--positions")
    directions = parse_counterfactual(args.counterfactual)
    ops = parse_ops(args.ops)
    if ops is not None and not directions:
        raise GemmdriftError("--ops names the classes of the counterfactual: it needs --counterfactual other than none")
    kopt = KernelsOption(args.kernels)
    precheck_lengths(args, kopt, cli)
    from ..attribution.attribute import attribute
    from ..ranges import default_split, parse_range
    from ..machine.envinfo import environment
    from ..model import describe
    from ..model.optaps import exposed_ops

    lm = cli.load(args)
    exposed = exposed_ops(lm.model)  # a model whose layers expose no op, or an unknown op name: exit 2 here
    if ops is not None:
        exposed.resolve(ops, "op class")
    ids, label = cli.tokens(args, lm)
    n = len(ids)
    split = args.split if args.split is not None else default_split(n)
    positions = parse_range(args.positions, n, "--positions")
    from ..replay.model import lm_shapes

    kopt.check_run(lm_shapes(lm) if kopt.text else None, args.schedules, n, split, lm.description.dtype)
    print(f"gemmdrift attribute: {describe(lm.description)}; {n} tokens ({label}); split {split}", file=sys.stderr)
    prompt_flag = (["--prompt", args.prompt] if args.prompt is not None else
                   ["--prompt-file", args.prompt_file] if args.prompt_file is not None else
                   ["--prompt-ids", args.prompt_ids] if args.prompt_ids is not None else None)
    checkpoint = Path(args.out) / kopt.dirname("checkpoint")
    result = attribute(lm, ids, args.schedules, split=split, positions=positions, ops=ops,
                       counterfactual=directions, kernels=kopt.text or None,
                       checkpoint=str(checkpoint), env=environment(),
                       record={"prompt": label, **({"prompt_ids_file": args.prompt_ids} if args.prompt_ids else {}),
                               "prompt_flag": prompt_flag, "ops_given": ops})
    try:
        checkpoint.rmdir()  # the checkpoints are dropped once the Result is whole: no empty directory left
    except OSError:
        pass
    cli.write_and_print(args, result, args.out)
    return 0


def explain_divergence(lm, result, prompt, kernels: str | None = None, perturb=None):
    """``triage`` / ``diverge`` ``--explain``: at the first divergence of ``result`` (a triage Result, or a diverge
    Result carrying one), the op classes whose counterfactual removes the flip there
    (:func:`gemmdrift.attribution.attribute.explain_flip`) added to its triage record as ``explanation``. The verdict is left
    as it is: this explains it. The computation explained is the one that diverged: the triage's teacher-forced
    tokens up to the end of the blocks (of either schedule) that hold the diverging position, so that position is
    computed in the same block as there. Nothing to explain (no divergence, or not a numeric one) is said in
    ``explanation`` too. ``perturb``: a planted change under schedule B (tests)."""
    import dataclasses

    details = dict(result.details)
    t = details.get("triage")
    if not t:
        return result
    if t.get("index") is None:
        e = {"flipped": False, "said": "nothing to explain: the two streams do not diverge"}
    elif t.get("bit_identical"):
        e = {"position": t.get("position"), "flipped": False,
             "said": "nothing to explain: the teacher-forced schedules are bit-identical where the streams part, so "
                     "no op drifts (the divergence is not numeric)"}
    else:
        e = _explain(lm, result, t, prompt, kernels, perturb)
    details["triage"] = {**t, "explanation": e}
    return dataclasses.replace(result, details=details)


def _explain(lm, result, t, prompt, kernels, perturb) -> dict:
    """:func:`explain_divergence` where the streams part numerically: the explanation record with ``said``."""
    from ..attribution import attribute as attribution
    from ..model.optaps import short_class
    from ..schedules import parse_schedule

    split = len(prompt) - 1
    streams = [(result.inputs.get(k) if result.kind == "triage" else (result.details.get(k) or {}).get("tokens"))
               or [] for k in ("stream_a", "stream_b")]
    # What the triage teacher-forced: the prompt and a stream but its last token. Both streams agree up to the
    # divergence, and a position's logits depend on the tokens after it only through the blocks' lengths: stream
    # A's tokens, then stream B's where it is longer, cut at the end of the blocks that hold the position.
    longer = max(streams, key=len)
    tokens = [int(x) for x in list(prompt) + list(streams[0]) + list(longer)[len(streams[0]):]][
        :len(prompt) + len(longer) - 1]
    position = int(t["position"])
    schedules = [parse_schedule(t["schedule_a"]), parse_schedule(t["schedule_b"])]
    if split < 1:  # a one-token prompt has no prefill: the whole sequence is the continuation (as triage runs it)
        schedules = [type(s)(s.phases[1:]) if len(s.phases) == 2 else s for s in schedules]
    split_arg = split if split >= 1 else None
    end = max(stop for s in schedules for start, stop in s.blocks(len(tokens), split_arg) if start <= position < stop)
    e = attribution.explain_flip(lm, tokens[:end], [s.text for s in schedules], position, split=split_arg,
                                 kernels=kernels, perturb=perturb)
    if not e["flipped"]:
        e["said"] = (f"teacher-forced over the shared tokens, the two schedules do not flip at position {position}: "
                     "no op class to name (no counterfactual run)")
    elif e["causes"]:
        names = [short_class(c) for c in e["causes"]]
        e["said"] = (f"the flip at position {position} disappears when {' or '.join(names)} "
                     f"{'is' if len(names) == 1 else 'are each'} made invariant"
                     + (f" (first op whose bits differ: {e['first_op']})" if e["first_op"] else ""))
    else:
        e["said"] = (f"the flip at position {position} survives every op class made invariant on its own"
                     if not e["removed_by"] else
                     f"the flip at position {position} disappears only when a class with no local drift at or before "
                     f"it is replaced ({', '.join(short_class(c) for c in e['removed_by'][:4])})")
    if e.get("unattributed"):
        e["said"] += "; unattributed: " + ", ".join(u["what"] for u in e["unattributed"])
    return e


# The release axis (issue 29 item 4): --python PATH recomputes every op from captured inputs under another mlx.
from ..attribution import release_ops as _release_ops  # noqa: E402

MODES.append((_release_ops.add_arguments, _release_ops.run))

from . import primitives as primitives_cli  # noqa: E402  (a mode registers itself once MODES exists)

MODES.append((primitives_cli.add_arguments, primitives_cli.run))  # --primitives: the one-second gate (item 6)
