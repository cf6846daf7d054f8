"""The steps of the GPU check that have no CLI command of their own, through gemmdrift's library.

    python scripts/gpu_check/measure.py repeat  --model M --device gpu --tokens 600 --split 512 --json FILE
    python scripts/gpu_check/measure.py predict --model M --device gpu --sizes gpu --out DIR --json FILE
    python scripts/gpu_check/measure.py kernels --model M --device gpu --sizes gpu --layers 0,5,17 --out DIR --json F

``repeat``: run-to-run repeatability. The same schedule run twice (``gemmdrift.model.taps.run_schedule``, the
layer stack's runs), hidden states of every layer and the logits compared bit for bit; then one projection
(layer 0's ``mlp.down_proj`` and the LM head, ``gemmdrift.kernels.projections``) applied twice to the same
block of T rows (``gemmdrift.kernels.synthetic_rows``), for each T. Repeatable means every pair identical.

``predict``: the main job's prediction part (``gemmdrift.suite.predict_part``: decode vs verify:2/verify:3
replayed for M1, M3, and the replayed CUDA gemv decode against this machine's decode), written with
``gemmdrift.store.write_result``. On a CUDA machine "this machine's decode" is the real sm90 gemv, so the
``decode-vs-cpu`` pair of chip sm90 is the replay's prediction against the measurement.

``kernels``: the main job's kernel probe (``gemmdrift.suite.kernel_probe``) at the sizes' T values, paths, rows
and FLOP budget, on the layers given and the LM head.

Each writes one JSON object to ``--json``; bad input is one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _start(device: str):
    from gemmdrift.machine import envinfo

    envinfo.select_device(device)
    envinfo.force_true_float32()  # as the CLI's --tf32 off: before the first matmul


def _bits_equal(a, b) -> dict:
    import numpy as np

    a, b = np.asarray(a), np.asarray(b)
    same = a.shape == b.shape and a.tobytes() == b.tobytes()
    out = {"identical": bool(same)}
    if not same and a.shape == b.shape:
        diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
        out.update(elements_differ=int(np.count_nonzero(diff)), max_abs_diff=float(np.nanmax(diff)))
    return out


def repeat(args) -> dict:
    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np

    _start(args.device)
    from gemmdrift import kernels
    from gemmdrift.model import load_model
    from gemmdrift.model.taps import run_schedule
    from gemmdrift.prompts import prompt_tokens
    from gemmdrift.suite import stream

    lm = load_model(args.model, dtype=args.dtype)
    # the built-in essay; a shape model (no tokenizer) takes prompt_tokens' seeded ids
    tokens = stream(lm, args.tokens) if lm.tokenizer is not None else prompt_tokens(lm)[0][:args.tokens]
    if len(tokens) <= args.split:
        raise ValueError(f"{len(tokens)} tokens, not more than --split {args.split}")
    positions = np.arange(args.split, len(tokens))
    runs = []
    for schedule in args.schedules:
        taps = [run_schedule(lm.model, tokens, schedule, split=args.split, positions=positions,
                             logit_positions=positions) for _ in range(2)]
        layers = [_bits_equal(taps[0].hidden[i], taps[1].hidden[i]) for i in range(taps[0].hidden.shape[0])]
        first = next((i for i, r in enumerate(layers) if not r["identical"]), None)
        runs.append({"schedule": schedule, "hidden_identical": first is None, "first_layer_differing": first,
                     "logits": _bits_equal(taps[0].logits, taps[1].logits),
                     "seconds": [round(t.seconds, 3) for t in taps]})
    projs = kernels.projections(lm, layers=[0, lm.n_layers], names=[args.projection, "lm_head"])
    calls = []
    for proj in projs:
        rows = kernels.synthetic_rows(proj.key, proj.in_dims, max(args.ts), args.dtype)
        # a tied head is the embedding's as_linear, as the model and the kernels probe call it
        run = proj.module.as_linear if isinstance(proj.module, (nn.Embedding, nn.QuantizedEmbedding)) else proj.module
        for t in args.ts:
            x = mx.array(rows[:t]).astype(getattr(mx, args.dtype))
            y = [np.array(run(x).astype(mx.float32)) for _ in range(2)]
            calls.append({"layer": proj.layer, "projection": proj.name, "K": proj.in_dims, "N": proj.out_dims,
                          "T": t, **_bits_equal(*y)})
    repeatable = all(r["hidden_identical"] and r["logits"]["identical"] for r in runs) and all(
        c["identical"] for c in calls)
    return {"repeatable": repeatable, "model": args.model, "dtype": args.dtype, "device": args.device,
            "tokens": len(tokens), "split": args.split, "runs": runs, "projection_calls": calls}


def predict(args) -> dict:
    _start(args.device)
    from gemmdrift import store
    from gemmdrift.machine.envinfo import environment
    from gemmdrift.model import load_model
    from gemmdrift.suite import predict_part

    env = environment()
    lm = load_model(args.model, dtype=args.dtype)
    out = Path(args.out)
    result = predict_part(lm, args.sizes, checkpoint=out / "checkpoint", env=env,
                          calibration=tuple(c for c in args.calibration if Path(c).is_file()))
    store.write_result(result, out, draw=False)
    return {"out": str(out), "figures": {k: v for k, v in result.figures.items()}, "backend": env.get("backend"),
            "calibration": [c for c in args.calibration if Path(c).is_file()]}


def kernels(args) -> dict:
    """The main job's kernel probe (``gemmdrift.suite.kernel_probe``) at ``--sizes``, on ``--layers`` and the LM
    head: its FLOP budget is the sizes' (1e12 for gpu), where the ``kernels`` command's 2e9 would stop the LM
    head at T=4 on a GPU."""
    from dataclasses import replace

    _start(args.device)
    from gemmdrift import store
    from gemmdrift.machine.envinfo import environment
    from gemmdrift.model import load_model
    from gemmdrift.suite import SIZES, kernel_probe
    from gemmdrift.view.summaries import summary

    sizes = SIZES[args.sizes]
    if args.layers:
        sizes = replace(sizes, kernel_layers=tuple(int(x) for x in args.layers.split(",")))
    env = environment()
    lm = load_model(args.model, dtype=args.dtype)
    out = Path(args.out)
    result = kernel_probe(lm, sizes, checkpoint=out / "checkpoint", env=env)
    store.write_result(result, out, draw=False)
    return {"out": str(out), "sizes": args.sizes, "layers": list(sizes.kernel_layers), **summary(result)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    for name in ("repeat", "predict", "kernels"):
        s = sub.add_parser(name)
        s.add_argument("--model", default="embedded")
        s.add_argument("--dtype", default="bfloat16")
        s.add_argument("--device", choices=["cpu", "gpu"], required=True)
        s.add_argument("--json", required=True, help="where the JSON result goes")
    r = sub.choices["repeat"]
    r.add_argument("--tokens", type=int, default=600)
    r.add_argument("--split", type=int, default=512)
    r.add_argument("--schedules", nargs="+", default=["prefill:512,decode", "prefill:512,verify:4"])
    r.add_argument("--projection", default="mlp.down_proj")
    r.add_argument("--ts", default="1,2,3,4,8,33")
    q = sub.choices["predict"]
    q.add_argument("--sizes", default="gpu")
    q.add_argument("--out", required=True)
    q.add_argument("--calibration", action="append", default=[])
    k = sub.choices["kernels"]
    k.add_argument("--sizes", default="gpu")
    k.add_argument("--layers", help="decoder layers probed beside the LM head (default: the sizes')")
    k.add_argument("--out", required=True)
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    try:
        if args.what == "repeat":
            args.ts = [int(t) for t in args.ts.split(",")]
            if not 0 < args.split < args.tokens:
                raise ValueError(f"--split {args.split} must lie inside --tokens {args.tokens}")
        record = {"repeat": repeat, "predict": predict, "kernels": kernels}[args.what](args)
    except Exception as e:  # one line, never a traceback (GemmdriftError, a CUDA error, bad input)
        print(f"measure {args.what}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", file=sys.stderr)
        return 2
    record["seconds"] = round(time.perf_counter() - t0, 2)
    Path(args.json).write_text(json.dumps(record, indent=1, default=str))
    print(json.dumps({k: v for k, v in record.items() if k not in ("runs", "projection_calls", "figures")},
                     default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
