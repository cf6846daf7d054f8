"""``gemmdrift attribute --primitives``: the one-second gate from the command line (see :mod:`gemmdrift.attribution.primitives`).

:func:`add_arguments` adds the gate's flags to the ``attribute`` parser (the shared ones, ``--model``, ``--ts``,
``--ops``, ``--kernels``, ``--dtype``, ``--device``, ``--json``, ``--out``, only where that parser has none);
:func:`run` returns None unless ``--primitives`` was given, so ``attribute`` can try each of its modes in turn.
Every bad input (an unknown op, widths out of range, a directory without a config, an unknown architecture) is
one line and exit 2, before anything is computed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..errors import GemmdriftError


def _has(parser: argparse.ArgumentParser, flag: str) -> bool:
    return flag in parser._option_string_actions


class _Default(str):
    """A ``--dtype`` default the command's parser set (not one the user typed): the gate then computes in the
    dtype the config ships in. It is the same string for everything else that reads it."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    dtype = parser._option_string_actions.get("--dtype")
    if dtype is not None and isinstance(dtype.default, str) and not isinstance(dtype.default, _Default):
        dtype.default = _Default(dtype.default)
    g = parser.add_argument_group("primitives (the one-second gate: no forward pass)")
    g.add_argument("--primitives", action="store_true",
                   help="per op of a decoder layer, at the model's shapes: is a T-row call bit-equal to T single-row "
                        "calls on this device? (the table, and up to which speculative width that holds)")
    if not _has(parser, "--model"):
        g.add_argument("--model", default="embedded",
                       help="an mlx-lm directory (only its config.json is read), 'embedded', 'shape:NAME' or a .gguf")
    if not _has(parser, "--ts"):
        g.add_argument("--ts", default="1-8", help="block widths T (default 1-8)")
    if not _has(parser, "--ops"):
        g.add_argument("--ops", help="ops to check: names (self_attn.q_proj or q_proj) or kinds (linear, norm, rope, "
                                     "sdpa), comma-separated (default: every op the model exposes)")
    if not _has(parser, "--kernels"):
        g.add_argument("--kernels", help="replay:<chip>[@variant]: the linears as that chip's kernels add them "
                                         "(a prediction); default this machine's kernels")
    if not _has(parser, "--dtype"):
        g.add_argument("--dtype", help="compute dtype (default: the one the config ships in)")
    if not _has(parser, "--device"):
        g.add_argument("--device", choices=["cpu", "gpu"], help="mlx device (default: mlx's own choice)")
    g.add_argument("--lm-head-rows", type=int, default=None,
                   help="the LM head's first rows only (default 4096; 0: all rows)")
    g.add_argument("--max-rows", type=int, default=None,
                   help="cap every linear's output rows (for shapes too large for this machine; changes a GPU's "
                        "dispatch where N decides it)")
    g.add_argument("--operand-seed", default=None,
                   help="the operands' seed, or several (1165,1-4): an op is equal only if it is on every seed's "
                        "draws (default 1165)")
    g.add_argument("--fail-unless-exact", action="store_true",
                   help="exit 1 unless every op is bit-equal at every T given (for scripts)")
    if not _has(parser, "--json"):
        g.add_argument("--json", action="store_true", help="print the gate's JSON record on stdout")
    if not _has(parser, "--out"):
        g.add_argument("--out", help="directory to write primitives.json and primitives.csv into")


def _ops(value) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        names = [str(v) for v in value]
    else:
        names = [s.strip() for s in str(value).split(",")]
    names = [n for n in names if n]
    if not names:
        raise GemmdriftError("--ops: give at least one op name")
    return names


def _ts(value) -> list[int]:
    from ..ranges import parse_ints
    from ..attribution.primitives import check_ts

    if isinstance(value, (list, tuple, range)):
        return check_ts(value)
    ts = parse_ints(str(value), "--ts")
    if ts is None:
        raise GemmdriftError("--ts: give block widths like 1-8")
    return check_ts(ts)


def run(args: argparse.Namespace, cli: Any = None) -> int | None:
    if not getattr(args, "primitives", False):
        return None
    from .. import files
    from ..attribution import primitives
    from ..view import primitives as primitives_view
    from ..ranges import parse_ints
    from ..machine.envinfo import select_device
    from ..attribution.primitives_operands import LM_HEAD_ROWS, SEED

    ts = _ts("1-8" if getattr(args, "ts", None) is None else args.ts)  # --ts '' is refused, not the default
    rows = getattr(args, "lm_head_rows", None)
    lm_head_rows = LM_HEAD_ROWS if rows is None else (None if rows == 0 else rows)
    if rows is not None and rows < 0:
        raise GemmdriftError(f"--lm-head-rows must be 0 (all) or positive, got {rows}")
    dtype = getattr(args, "dtype", None)
    kw = {"ops": _ops(getattr(args, "ops", None)), "dtype": None if isinstance(dtype, _Default) else dtype or None,
          "kernels": getattr(args, "kernels", None) or None, "lm_head_rows": lm_head_rows,
          "max_rows": getattr(args, "max_rows", None)}
    seed = getattr(args, "operand_seed", None)
    seeds = [SEED] if seed is None else seed if isinstance(seed, (int, list)) else parse_ints(str(seed),
                                                                                             "--operand-seed")
    model = getattr(args, "model", None) or "embedded"
    select_device(getattr(args, "device", None))
    out = getattr(args, "out", None)
    if out:
        from ..checks import check_out_dir

        check_out_dir(out)
    mops, chosen, widths, kernels = primitives.plan(model, ts, seed=seeds, **kw)  # every bad input, one line
    _check_replayable(kernels, chosen, widths, mops.dtype)
    g = primitives.gate(model, ts, seed=seeds, **kw)
    rec = primitives_view.record(g)
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        files.write_json(Path(out) / "primitives.json", rec)
        files.write_csv(Path(out) / "primitives.csv", g.table.assign(
            differing_bytes=[",".join(map(str, c)) for c in g.table["differing_bytes"]]))
    if getattr(args, "json", False):
        print(files.to_json(rec))
    else:
        print(primitives_view.text(g))
        if out:
            print(f"written: {Path(out) / 'primitives.json'}, {Path(out) / 'primitives.csv'}", file=sys.stderr)
    if g.error:
        return 1
    if getattr(args, "fail_unless_exact", False) and not g.ok:
        return 1
    return 0


def _check_replayable(kernels: str | None, ops, widths: list[int], dtype: str) -> None:
    """A replayed chip with no recipe for a width asked (sm90's cuBLASLt at T >= 2): refused now, naming the
    widths it can replay, instead of a gate that fails closed after computing."""
    if not kernels:
        return
    from ..replay.model import KernelsOption

    kopt = KernelsOption(kernels)
    shapes = [(o.name, int(o.shape["K"]), int(o.shape["N"]), None) for o in ops
              if o.kind == "linear" and o.quant is None]
    ok, why = [], None
    for T in widths:
        try:
            kopt.check_calls(shapes, [T], dtype)
            ok.append(T)
        except GemmdriftError as e:
            why = why or str(e)
    if why is not None:
        from ..view.primitives import _ts_text

        raise GemmdriftError(f"--kernels {kernels}: {why}; "
                             + (f"replayable here: --ts {_ts_text(ok)}" if ok else "no width asked is replayable"))


__all__ = ["add_arguments", "run"]
