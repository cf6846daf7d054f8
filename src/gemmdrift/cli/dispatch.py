"""`gemmdrift dispatch`: which kernel mlx runs for each T on a given chip, read from the mlx source.

Pure lookup (:func:`gemmdrift.dispatch.choose`): no mlx import, no model, so
it answers for any chip from any machine. Example::

    gemmdrift dispatch --chip M3 --op matmul --dtype bfloat16 --K 640 --N 2048 --ts 1-33 --mlx 0.31.2
    gemmdrift dispatch --env results/kernels --K 640 --N 2048     # the chip, mlx and settings of that record
    gemmdrift dispatch --chip M3 --K 640 --N 2048 --mlx 0.32.1 --vs 0.32.0   # what changed, and which mlx commit

Releases: from v0.26.5, the first tag read, to the mirror's HEAD (846d176, mlx 0.32.2); an older ``--mlx`` or
``--vs`` is refused (one line: older than the first tag read); a newer one takes the mirror's rules, and a
``note:`` line says so. With ``--vs OLD``, each T where OLD's kernel or parameters differ names the mlx commit(s)
and pull request(s) whose rule moved it (:func:`gemmdrift.dispatch.changed_by`).

Shapes: ``matmul`` is ``x (T, K) @ W.T`` with W (N, K) (nn.Linear, no bias);
``quantized_matmul`` the same with W quantized (``--bits``, ``--group-size``,
``--mode``; default mlx's for the mode, affine: 4 bits, group 64); ``sdpa`` is
mx.fast.scaled_dot_product_attention with T queries against ``--kv-len`` keys,
``--head-dim``, ``--heads`` and ``--kv-heads`` (default Gemma 3 270M: 256, 4, 1,
and 1024 keys), causal unless ``--no-causal``.
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import GemmdriftError

DTYPES = ("bfloat16", "float16", "float32")


def add_parser(sub) -> None:
    """Register ``dispatch`` on the CLI's subparsers (its handler is :func:`cmd_dispatch`)."""
    from ..dispatch import CHIPS, OPS

    s = sub.add_parser("dispatch", help="which kernel mlx dispatches per T on a chip (read from the mlx source)")
    who = s.add_mutually_exclusive_group(required=True)
    who.add_argument("--chip", help=f"{', '.join(CHIPS)}, or an architecture such as applegpu_g15s or sm_86")
    who.add_argument("--env", metavar="PATH",
                     help="the chip, mlx release and settings (MLX_ENABLE_TF32, MLX_METAL_GPU_ARCH, the macOS "
                          "version) of a recorded environment: a results directory, its meta.json, or the output "
                          "of `gemmdrift env --json`")
    s.add_argument("--op", default="matmul", choices=OPS, help="default matmul")
    s.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="default bfloat16")
    s.add_argument("--K", type=int, help="inner dimension (matmul, quantized_matmul)")
    s.add_argument("--N", type=int, help="output columns: rows of W (matmul, quantized_matmul)")
    s.add_argument("--ts", default="1-33",
                   help="row counts T (query length for sdpa), e.g. 1-33 or 1,2,16 (default 1-33)")
    s.add_argument("--mlx", help="mlx release whose source decides (default: the installed mlx)")
    s.add_argument("--vs", metavar="OLD", help="a second mlx release: where its kernel differs, name the mlx "
                                               "commit(s) whose rule changed it")
    g = s.add_argument_group("quantized_matmul")
    g.add_argument("--bits", type=int, help="bits per weight (default mlx's for the mode: affine 4)")
    g.add_argument("--group-size", type=int, help="group size (default mlx's for the mode: affine 64)")
    g.add_argument("--mode", default="affine", help="affine (default), mxfp4, mxfp8, nvfp4")
    g = s.add_argument_group("sdpa")
    g.add_argument("--head-dim", type=int, default=256, help="query/key head dim (default 256)")
    g.add_argument("--v-head-dim", type=int, help="value head dim (default: the head dim)")
    g.add_argument("--kv-len", type=int, default=1024, help="key/value length (default 1024)")
    g.add_argument("--heads", type=int, default=4, help="query heads (default 4)")
    g.add_argument("--kv-heads", type=int, default=1, help="key/value heads (default 1)")
    g.add_argument("--no-causal", action="store_true", help="no causal mask")
    g = s.add_argument_group("device settings")
    g.add_argument("--no-nax", action="store_true",
                   help="a NAX chip (M5) without NAX: macOS before 26.2 or a wheel built without it")
    g.add_argument("--no-tf32", action="store_true", help="MLX_ENABLE_TF32=0 (float32 stays off NAX/TF32)")
    s.add_argument("--json", action="store_true", help="a JSON list, one record per T")
    s.set_defaults(func=cmd_dispatch)


def installed_mlx() -> str:
    """The installed mlx's version, from its distribution metadata (mlx is not imported)."""
    import importlib.metadata as md

    try:
        return md.version("mlx")
    except md.PackageNotFoundError:
        raise GemmdriftError("mlx is not installed here: give the release with --mlx (e.g. --mlx 0.31.2)") from None


def parse_ts(text: str) -> list[int]:
    """'1-33' or '1,2,8-16' -> the list of T (each >= 1; at most 100000, counted before any is built)."""
    from ..ranges import parse_ints

    out = parse_ints(str(text), "--ts")
    if out is None or min(out) < 1:
        raise GemmdriftError("--ts: T must be at least 1")
    return out


def chip_of_record(path: str, mlx: str | None = None):
    """(Chip, mlx version or None) of the environment recorded at ``path`` (see ``--env``); one-line errors.

    ``mlx`` is the release whose reading of the device is wanted (``--mlx``; default the record's): a device
    that is not an Apple chip model (a hosted runner's "Apple Paravirtual device", a name set with
    ``MLX_METAL_GPU_ARCH``) is read as that release reads its architecture name, and said so."""
    from pathlib import Path

    from ..dispatch import chip_from_env, not_a_chip
    from ..files import read_object

    p = Path(path)
    if p.is_dir():  # a command's results directory (meta.json) or `gemmdrift run`'s (env.json)
        found = [p / n for n in ("meta.json", "env.json") if (p / n).is_file()]
        if not found:
            raise GemmdriftError(f"--env {path}: the directory has no meta.json or env.json (give a results "
                                 "directory, its meta.json, or a file written by `gemmdrift env --json`)")
        p = found[0]
    if not p.is_file():
        raise GemmdriftError(f"--env {path}: no such file (give a results directory, its meta.json, or a file "
                             "written by `gemmdrift env --json`)")
    try:
        obj = read_object(p)
    except GemmdriftError as e:  # name the flag the file came from
        raise GemmdriftError(f"--env {path}: {e}") from None
    env = obj.get("env") if isinstance(obj.get("env"), dict) and "backend" not in obj else obj
    if "backend" not in env:
        raise GemmdriftError(f"--env {p}: no environment record in it (no 'backend')")
    if mlx:
        from ..dispatch import parse_version

        parse_version(mlx)
    chip = chip_from_env(env, mlx)
    if chip is None:
        why = not_a_chip(env, mlx) or f"{env.get('backend')} architecture {env.get('architecture')!r} is not readable"
        raise GemmdriftError(f"--env {p}: {why}")
    if not chip.device:  # a device that is no chip model is read as mlx reads it, whatever the generation
        check_known_chip(chip, f"--env {p}")
    return chip, env.get("mlx")


# The chips the dispatch rules were read for: Metal generations 13..17 (M1..M5) with mlx's size letters, and
# CUDA compute capabilities 7.0..12.x. A well-formed name outside them (applegpu_g99x, sm999) is refused, not
# answered with another chip's rules (README: an unknown chip is one line and exit status 2).
METAL_GENS = range(13, 18)
CUDA_MAJORS = range(7, 13)


def check_known_chip(chip, flag: str) -> None:
    """One line and exit 2 for a chip no mlx release runs on as far as the source read here says."""
    from ..dispatch import SIZE_LABEL

    if chip.backend == "metal" and (chip.gen not in METAL_GENS or chip.size not in SIZE_LABEL):
        raise GemmdriftError(f"{flag}: unknown chip {chip.arch} (Metal generations {METAL_GENS[0]}..{METAL_GENS[-1]}, "
                             f"M1..M5, with a size letter of {', '.join(SIZE_LABEL)})")
    if chip.backend == "cuda" and chip.gen not in CUDA_MAJORS:
        raise GemmdriftError(f"{flag}: unknown chip {chip.arch} (CUDA compute capability "
                             f"{CUDA_MAJORS[0]}.x..{CUDA_MAJORS[-1]}.x)")


# What mlx's quantize accepts (mlx/ops.cpp at 846d176: affine_quantize allows group sizes 32, 64, 128 and
# bits 2..8 but 7; fp_quantize fixes nvfp4 at group 16, mxfp4/mxfp8 at 32, bits 4 (8 for mxfp8); quantize
# wants the last dimension, K, divisible by the group size). A configuration mlx refuses is refused here.
AFFINE_BITS = (2, 3, 4, 5, 6, 8)
AFFINE_GROUPS = (32, 64, 128)


def check_quantization(mode: str, bits: int | None, group_size: int | None, K: int) -> tuple[int, int]:
    """(bits, group size) of ``--mode``/``--bits``/``--group-size`` (mlx's defaults when absent), or one line."""
    from ..dispatch import QUANT_DEFAULTS

    if mode not in QUANT_DEFAULTS:
        raise GemmdriftError(f"--mode {mode!r}: unknown quantization mode (known: {', '.join(QUANT_DEFAULTS)})")
    d_bits, d_group = QUANT_DEFAULTS[mode]
    bits = d_bits if bits is None else bits
    group = d_group if group_size is None else group_size
    if mode == "affine":
        if bits not in AFFINE_BITS:
            raise GemmdriftError(f"--bits {bits}: mlx's affine quantization supports "
                                 f"{', '.join(map(str, AFFINE_BITS))}")
        if group not in AFFINE_GROUPS:
            raise GemmdriftError(f"--group-size {group}: mlx's affine quantization supports "
                                 f"{', '.join(map(str, AFFINE_GROUPS))}")
    else:
        if bits != d_bits:
            raise GemmdriftError(f"--bits {bits}: {mode} quantization has {d_bits} bits")
        if group != d_group:
            raise GemmdriftError(f"--group-size {group}: {mode} quantization has group size {d_group}")
    if K % group:
        raise GemmdriftError(f"--K {K} is not divisible by the group size {group} (mlx's quantize refuses it)")
    return bits, group


def check_op_flags(args) -> None:
    """One line for a flag of another ``--op`` (``--op matmul --bits 7`` answered for a dense matmul, silently)."""
    given = {"--bits": args.bits is not None, "--group-size": args.group_size is not None,
             "--mode": args.mode != "affine", "--v-head-dim": args.v_head_dim is not None,
             "--K": args.K is not None, "--N": args.N is not None}
    for flag, ops in (("--bits", ("quantized_matmul",)), ("--group-size", ("quantized_matmul",)),
                      ("--mode", ("quantized_matmul",)), ("--v-head-dim", ("sdpa",)),
                      ("--K", ("matmul", "quantized_matmul")), ("--N", ("matmul", "quantized_matmul"))):
        if given[flag] and args.op not in ops:
            raise GemmdriftError(f"{flag} is a flag of --op {' and '.join(ops)}, not of --op {args.op}")


def records(args) -> tuple[list[dict[str, Any]], str]:
    """One record per T (T, kernel, label, params, source, note, chip, mlx), and a header line."""
    from dataclasses import replace

    from ..dispatch import changed_by, chip_named, choose, describe_chip, label

    recorded_mlx = None
    if args.env:
        chip, recorded_mlx = chip_of_record(args.env, args.mlx)
    else:
        chip = chip_named(args.chip)
        check_known_chip(chip, f"--chip {args.chip}")
    if args.no_nax:
        chip = replace(chip, nax=False, note="NAX off (--no-nax)", settings=tuple(
            (w, replace(c, nax=False)) for w, c in chip.settings if not w.startswith("macOS")))
    if args.no_tf32 and chip.tf32:
        chip = replace(chip, tf32=False, settings=tuple((w, replace(c, tf32=False)) for w, c in chip.settings)
                       + (("MLX_ENABLE_TF32=0 (--no-tf32)", replace(chip, settings=())),))
    ts = parse_ts(args.ts)
    check_op_flags(args)
    version = args.mlx or recorded_mlx or installed_mlx()
    mlx_flag = "--mlx" if args.mlx else (f"--env {args.env} (its mlx)" if recorded_mlx else "the installed mlx")
    for flag, v in ((mlx_flag, version), ("--vs", args.vs)):
        if v is not None:
            check_release(flag, v)
    shape: dict[str, Any]
    if args.op == "sdpa":
        for flag, v in (("--head-dim", args.head_dim), ("--kv-len", args.kv_len), ("--heads", args.heads),
                        ("--kv-heads", args.kv_heads), ("--v-head-dim", args.v_head_dim)):
            if v is None:
                continue
            if v < 1:
                raise GemmdriftError(f"{flag} must be positive, got {v}")
        shape = {"K": args.kv_len, "N": args.head_dim, "n_heads": args.heads, "n_kv_heads": args.kv_heads,
                 "v_head_dim": args.v_head_dim, "causal": not args.no_causal}
        what = (f"sdpa {args.dtype} head_dim={args.head_dim} kv_len={args.kv_len} heads={args.heads}/"
                f"{args.kv_heads}{'' if args.no_causal else ' causal'}")
    else:
        for flag, v in (("--K", args.K), ("--N", args.N)):
            if v is None:
                raise GemmdriftError(f"--op {args.op} needs {flag}")
            if v < 1:
                raise GemmdriftError(f"{flag} must be positive, got {v}")
        shape = {"K": args.K, "N": args.N}
        what = f"{args.op} {args.dtype} K={args.K} N={args.N}"
        if args.op == "quantized_matmul":
            bits, group = check_quantization(args.mode, args.bits, args.group_size, args.K)
            shape.update(bits=bits, group_size=group, mode=args.mode)
            what += f" {args.mode} bits={bits} group_size={group}"
    from ..replay import FP_KERNELS

    def named(c) -> tuple[str, str]:
        kernel = c.kernel
        if shape.get("mode", "affine") != "affine" and kernel in FP_KERNELS:  # fp_quantized.h's names, as replay's
            kernel = FP_KERNELS[kernel]
        said = label(c)
        return kernel, kernel + said[len(c.kernel):] if said.startswith(c.kernel) else said

    out = []
    for t in ts:
        kw = dict(T=t, dtype=args.dtype, **shape)
        c = choose(chip, args.op, mlx_version=version, **kw)
        kernel, said = named(c)
        rec = {"T": t, "kernel": kernel, "label": said, "params": dict(c.params), "source": c.source,
               "note": c.note, "chip": chip.name, "mlx": version}
        if args.vs:
            o = choose(chip, args.op, mlx_version=args.vs, **kw)
            rec["vs"] = {"mlx": args.vs, "kernel": named(o)[0], "label": named(o)[1], "params": dict(o.params)}
            rec["changed_by"] = [{"rule": r.name, "first_tag": r.first_tag, "what": r.what,
                                  "commits": [{"hash": m.hash, "subject": m.subject, "pr": m.pr,
                                               "commit_url": m.commit_url, "pr_url": m.pr_url} for m in r.commits]}
                                 for r in changed_by(chip, args.op, args.vs, version, **kw)]
        out.append(rec)
    vs = f" (against mlx {args.vs})" if args.vs else ""
    settings = ", ".join(w for w, _ in chip.settings)
    ignored = f" ({chip.note})" if "ignored" in chip.note else ""  # a record's setting its mlx does not read
    return out, (f"{describe_chip(chip)}{ignored}; {what}; mlx {version}{vs}"
                 + (f"; settings: {settings}" if settings else ""))


def check_release(flag: str, text: str) -> None:
    """One line for a release the rules cannot answer for: older than the first tag read."""
    from ..dispatch import VERIFIED_FROM, parse_version

    v = parse_version(text)
    if v < VERIFIED_FROM:
        first = ".".join(map(str, VERIFIED_FROM))
        raise GemmdriftError(f"{flag} {text}: older than the first tag read (v{first}); dispatch was read from "
                             f"v{first} on, older releases are not modelled")


def cmd_dispatch(args) -> int:
    recs, header = records(args)
    if args.json:
        print(json.dumps(recs, indent=2))
        return 0
    print(header)
    # Notes every T shares (the release window, NAX unknown) are printed once.
    common = set.intersection(*(set(filter(None, r["note"].split("; "))) for r in recs)) if recs else set()
    for n in sorted(common):
        print(f"note: {n}")
    for r in recs:
        r["note"] = "; ".join(n for n in r["note"].split("; ") if n and n not in common)
        params = " ".join(f"{k}={v}" for k, v in r["params"].items()
                          if k not in ("bits", "group_size", "mode", "head_dim", "v_head_dim", "k_len"))
        note = f"  [{r['note']}]" if r["note"] else ""
        print(f"T={r['T']:>4}  {r['kernel']:<22} {params:<48} {r['source']}{note}")
        if "vs" in r and (r["vs"]["kernel"], r["vs"]["params"]) != (r["kernel"], r["params"]):
            why = "; ".join(f"{c['hash']} {c['subject']} (#{c['pr']}, first in {x['first_tag']})"
                            for x in r["changed_by"] for c in x["commits"])
            print(f"        mlx {r['vs']['mlx']}: {r['vs']['label']}; changed by: {why or 'no single rule (several together)'}")
    return 0
