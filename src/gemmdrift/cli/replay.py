"""``gemmdrift replay check``: does this device's kernel bits equal a replay recipe, and which variant?

On the device it runs on, the real kernels (``mx.matmul``, ``mx.quantized_matmul``) and every variant of
the device's recipes run on the same rows captured from one forward pass of the model; per path and T the
command says which variant is bit-identical, or how many ULPs the nearest is off. On a Mac this tells its
user whether the predictions hold for their chip; on this Linux CPU it must find ``replay:cpu`` identical
everywhere. ``--chip`` replays another chip's recipes against this device (a prediction, expected to
differ). Every input error is a one-line message and exit 2 before the model loads.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from ..errors import GemmdriftError

DEFAULT_TOKENS = 96


def add_parser(sub) -> None:
    """Register ``replay`` (with its ``check`` subcommand) on the CLI's subparsers."""
    p = sub.add_parser("replay", help="replay mlx's GPU/CPU reduction orders in float32; `replay check` tests them "
                                      "against this device's kernels bit for bit")
    rsub = p.add_subparsers(dest="replay_command", parser_class=type(p), metavar="SUBCOMMAND")
    s = rsub.add_parser("check", help="real kernels vs every variant of the device's recipes on captured rows")
    g = s.add_argument_group("model")
    g.add_argument("--model", default="embedded", help="'embedded' (default), a Gemma 3 .gguf or an mlx-lm directory")
    g.add_argument("--dtype", default="bfloat16", help="compute dtype (default bfloat16)")
    g.add_argument("--device", choices=["cpu", "gpu"], help="mlx device (default: mlx's own choice)")
    s.add_argument("--tokens", type=int, default=DEFAULT_TOKENS,
                   help=f"tokens of the built-in essay prompt for the capture pass (default {DEFAULT_TOKENS})")
    s.add_argument("--layers", help="decoder layers, e.g. 0-3,17 (default all; the LM head is layer N)")
    s.add_argument("--projections", help="comma-separated names, e.g. q_proj,lm_head (default all)")
    s.add_argument("--paths", default="dense:bfloat16,dense:float32,quant:affine-q4-g64,quant:affine-q8-g64",
                   help="dense:<dtype>, quant:affine-q{4,8}-g64, and the fp modes quant:mxfp4-q4-g32, "
                        "quant:nvfp4-q4-g16, quant:mxfp8-q8-g32 (default: the four affine and dense ones)")
    s.add_argument("--ts", default="1,2,3,4,8,16,33", help="block sizes, e.g. 1-4,8 (default 1,2,3,4,8,16,33)")
    s.add_argument("--rows", type=int, default=33, help="distinct captured rows per projection (default 33)")
    s.add_argument("--chip", help="whose recipes (default: this device's; e.g. M3, M1, sm90, cpu)")
    s.add_argument("--variant", default="all", help="'all' (default) or one variant, e.g. mma=H2,dot4=pairwise ('default' or 'exact': each "
                        "recipe's default, the name printed where a recipe leaves no order open)")
    s.add_argument("--head-rows", type=int, help="check only the first rows of the LM head (default: all of it)")
    s.add_argument("--mlx-version", help="the release whose recipes are replayed (default: the installed one)")
    s.add_argument("--calibration", action="append", default=[], metavar="FILE",
                   help="check only the variant a calibration file measured for this chip and release (repeatable; "
                        "see docs/calibration.md). Without it, every variant is checked and, on a GPU chip, the "
                        "result is written as <out>/calibration.json")
    s.add_argument("--no-order-rows", dest="order_rows", action="store_false",
                   help="skip the order rows (default: checked beside the captured rows, reported apart: per kernel "
                        "and open axis the chip dispatches on --paths, one small seeded call built so every two "
                        "values of the axis give different bits, quantized paths in --dtype; the calibration takes "
                        "the value they decide where the captured rows cannot tell the values apart; kept in the "
                        "checkpoint like the captured rows; docs/replay.md)")
    s.add_argument("--out", default="results/replay-check",
                   help="output directory (default results/replay-check; an interrupted run resumes from its checkpoint)")
    s.add_argument("--json", action="store_true",
                   help="print one JSON object on stdout: chip, device_chip, mlx_version, prediction and a records list, "
                        "one per (path, T, variant) (progress goes to stderr)")
    s.set_defaults(func=cmd_replay_check)
    p.set_defaults(func=lambda args: _no_subcommand(p))


def _no_subcommand(p) -> int:
    p.print_help()
    return 2


def _ints(text: str, flag: str) -> list[int]:
    """The CLI's one list parser (ranges such as 1-4 or 0-5,17, bounded before they are built)."""
    from ..ranges import parse_ints

    out = parse_ints(str(text), flag)
    if out is None:
        raise GemmdriftError(f"{flag}: expected numbers like 1-4,8,16, got {text!r}")
    return out


def cmd_replay_check(args) -> int:
    from .. import checks
    from ..dispatch import parse_version
    from ..replay import check_variant_text
    from ..replay.check import check_paths
    from ..replay.paths import parse_chip

    # Everything that needs no model, first.
    ts = _ints(args.ts, "--ts")
    if min(ts) < 1:
        raise GemmdriftError(f"--ts: block sizes must be positive, got {min(ts)}")
    layers = _ints(args.layers, "--layers") if args.layers else None
    checks.check_positive(rows=args.rows, tokens=args.tokens, head_rows=args.head_rows)
    paths = check_paths([p.strip() for p in args.paths.split(",") if p.strip()])
    chip = parse_chip(args.chip) if args.chip else None
    if args.variant != "all":
        check_variant_text(args.variant)
    if args.mlx_version:
        from ..dispatch import VERIFIED_FROM

        if parse_version(args.mlx_version) < VERIFIED_FROM:  # as `dispatch --mlx` refuses it: before the load (D8)
            raise GemmdriftError(f"--mlx-version {args.mlx_version}: older than the first tag read (v"
                                 f"{'.'.join(map(str, VERIFIED_FROM))}); older releases are not modelled")
    checks.check_out_dir(args.out)
    from ..replay import calib as replay_calib

    replay_calib.check_files(args.calibration)  # a bad file: one line, before the model loads
    if args.calibration and args.variant != "all":
        raise GemmdriftError("--calibration and --variant both choose the variant: give one")

    from .. import kernels, store
    from ..machine.envinfo import environment, select_device
    from ..replay.check import check_replay
    from ..model import load_model
    from ..prompts import builtin_text

    select_device(args.device)
    env = environment()
    variants, note = args.variant, ""
    if args.calibration:
        from ..dispatch import chip_from_env, not_a_chip
        from ..replay.paths import installed_mlx

        target = chip or chip_from_env(env, args.mlx_version)
        if target is None:
            raise GemmdriftError(not_a_chip(env, args.mlx_version) or "this device is not a chip: give --chip")
        res = replay_calib.resolve(target, args.mlx_version or installed_mlx(), args.calibration,
                                    registry=False)  # the check measures: the registry never narrows it
        variants, note = res.text or "default", res.note
        print(f"  replay check: {target.name}: {note}", file=sys.stderr, flush=True)
    lm = load_model(args.model, dtype=args.dtype)
    names = args.projections.split(",") if args.projections else None
    projs = kernels.projections(lm, layers=layers, names=names)
    if lm.tokenizer is None:
        raise GemmdriftError("replay check captures rows from the built-in prompt: the model needs a tokenizer")
    ids = lm.tokenizer.encode(builtin_text("essay"))[: args.tokens]
    inputs = kernels.capture_inputs(lm, ids, projs, max_rows=args.rows)
    progress = (lambda m: print("  " + m, file=sys.stderr, flush=True))
    result = check_replay(lm, inputs, projs, [p.text for p in paths], ts, chip=chip, variants=variants,
                          head_rows=args.head_rows, env=env, mlx_version=args.mlx_version,
                          progress=progress, checkpoint=Path(args.out) / "checkpoint", order_rows=args.order_rows)
    if note:
        result = dataclasses.replace(result, inputs={**result.inputs, "calibration": note})
    store.write_result(result, args.out, draw=False)
    calibration = _write_calibration(result, args.out) if not args.calibration else None
    import shutil

    shutil.rmtree(Path(args.out) / "checkpoint", ignore_errors=True)  # the Result holds every unit now (D13)
    records = result.details["records"]
    if args.json:
        from ..files import to_json

        print(to_json({"chip": result.inputs["chip"], "device_chip": result.inputs["device_chip"],
                       "mlx_version": result.inputs["mlx_version"], "prediction": result.inputs["prediction"],
                       "records": records, "order_records": result.details.get("order_records", [])}))
    else:
        print(text(result) + (f"\n\n{replay_calib.summary(calibration)}" if calibration else "")
              + f"\n\nwritten to {Path(args.out)}/")
    return 0


def _write_calibration(result, out: str):
    """``<out>/calibration.json`` when the check can calibrate (this device's own GPU recipes, every variant);
    otherwise one line on stderr saying why not (silent on this machine's own CPU, which has nothing open)."""
    from ..replay import calib as replay_calib

    try:
        path, record = replay_calib.write(result, out)
    except GemmdriftError as e:
        if result.env.get("backend") != "cpu":
            print(f"  replay check: {e}", file=sys.stderr, flush=True)
        return None
    print(f"  replay check: calibration written to {path} (see docs/calibration.md)", file=sys.stderr, flush=True)
    return record


def text(result) -> str:
    """Per path and T: the identical variants, else the nearest and its ULP distance."""
    from ..replay.check import check_text

    return check_text(result)


__all__ = ["add_parser", "cmd_replay_check", "text"]
