"""The replay against published hardware measurements (issue 31 item 1): writes the table of
docs/replay-vs-hardware.md between its ``<!-- table -->`` markers.

The measurements are lablup/mlxcel's block-vs-chain statistic (``tests/metal_block_vs_chain_op_parity.rs``,
PR #1182 / #1189 / issue #1186, measured 2026-08-16 at mlxcel ``main`` 115f6089, whose vendored mlx is
ml-explore/mlx b7c3dd6d: v0.32.0 plus 5 commits, ``mlx/version.h`` 0.32.1-dev): per position t of one
T-row call, how many bytes of the float16 output differ from the t-th of T single-row calls. Their inputs
are ``mx.random.normal`` float16 draws (x, then the dense weight, then ``quantize`` affine 4-bit group 64);
a byte count is a statistic of the draws, so the replay draws the same distributions with numpy (float16 of
standard normals; this machine's ``mx.quantize``), over several seeds, and compares fractions with their
spread. The same statistic is ``gemmdrift.metrics.differing_bytes``.

The dense rows are ``x @ W`` with W (K, N) not transposed, as mlxcel multiplies (``matmul(&x_f16, &w_f16)``):
``gemv_t`` at T=1 (:func:`gemmdrift.replay.paths.plan_for` with ``b_transposed=False``), steel at T=3.

The fp rows (mlxcel issue #1186, M5 Max: mxfp4 group 32, nvfp4 group 16) are replayed with the fp recipes
(:mod:`gemmdrift.replay.fpquant`: ``fp_qmv(_fast)`` at T=1 against ``fp_qmv_wide`` for T=2..4), on float16
normal draws quantized by this machine's ``mx.quantize(w, mode=...)``.

The M5 Max q4 rows are set against each candidate the reading of mlxcel's test gives (:func:`m5_candidates`):
the inputs drawn as mlxcel draws them (``mx.random.normal`` float16), every variant axis of both arms, and an
x-sum error of any size in the T=1 arm (:func:`scaled_xsum`, fitted to the measured mean by :func:`lam_for`).

Usage: ``python scripts/replay_vs_hardware.py [--seeds 3] [--write docs/replay-vs-hardware.md]`` (about four
minutes here, measured under load).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import numpy as np

RELEASES = ("0.32.0", "0.32.4")  # b7c3dd6d's recipes are 0.32.0's (quantized.h load_vector sums in T); 0.32.4 float
MEASURED = [  # (chip, K, N, mode, T, measured bytes per position, bytes per position, where)
    ("M5 Max", 5120, 17408, "affine-q4-g64", 3, (621, 1834, 1447), 34816, "mlxcel #1182"),
    ("M5 Max", 5120, 5120, "affine-q4-g64", 3, (167, 501, 387), 10240, "mlxcel #1182"),
    ("M1 Ultra", 5120, 17408, "affine-q4-g64", 3, (0, 0, 0), 34816, "mlxcel #1182"),
]
# Dense float16 x @ W with W (5120, 5120) not transposed (the test's ``matmul(&x_f16, &w_f16)``, both mx.random
# normal draws): (chip, K, N, T, measured as published, where). The M5 Max counts are "203, 204, ..." in mlxcel
# #1190's description (about 2 % of 10240); the M1 Ultra comment (#1182) says only that the dense matmul differs.
DENSE_MEASURED = [
    ("M5 Max", 5120, 5120, 3, "about 200 of 10240 (203, 204, ...; mlxcel #1190)"),
    ("M1 Ultra", 5120, 5120, 3, "differs, no count published (mlxcel #1182)"),
]


def operands(seed: int, K: int, N: int, T: int):
    """x (T, K) and the q4 g64 weight of a float16 standard-normal draw (numpy), as float32 values."""
    import mlx.core as mx

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, K)).astype(np.float16).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(np.float16)
    wq, sc, bi = mx.quantize(mx.array(w), group_size=64, bits=4)
    return x, (np.array(wq), np.array(sc.astype(mx.float32)), np.array(bi.astype(mx.float32)), 4, 64)


def block_vs_chain(chip: str, K: int, N: int, T: int, version: str, x, quant) -> tuple[np.ndarray, str, str]:
    """Differing bytes per position between the chip's T-row call and T one-row calls, replayed at a release."""
    from gemmdrift.replay.paths import plan_for, run_plan
    from gemmdrift.metrics import differing_bytes

    kw = dict(K=K, N=N, dtype="float16", mlx_version=version, bits=4, group_size=64)
    one, blk = (plan_for(chip, "quantized_matmul", T=t, **kw) for t in (1, T))
    block = run_plan(blk, x, dtype="float16", quant=quant).y
    chain = np.concatenate([run_plan(one, x[t:t + 1], dtype="float16", quant=quant).y for t in range(T)])
    return differing_bytes(block.astype(np.float16), chain.astype(np.float16), axis=0), one.recipe.kernel, \
        blk.recipe.kernel


# The fp-mode rows (M5 Max, float16): (chip, K, N, mode, the Ts compared, measured bytes per position (lowest,
# highest), as published). T=1 compares a call with itself: not replayed. For mxfp4 the later harness (mlxcel
# tests/metal_block_vs_chain_op_parity.rs at 0c21aed2, the doc comment of ``operand_seed``, T=3, x and W
# mx.random.normal float16) says: "M5 Max, 2026-08-17: the mxfp4 row read `equal` on one harness and
# `DIVERGES` at 1 to 9 bytes on four seeds of this one".
FP_MEASURED = [
    ("M5 Max", 5120, 5120, "mxfp4", (2, 3, 4), (1, 9),
     "equal at T=1..4 on one harness (#1186); 1 to 9 bytes per position at T=3 on four seeds (mlxcel "
     "tests/metal_block_vs_chain_op_parity.rs @0c21aed2)"),
    ("M5 Max", 5376, 5376, "nvfp4", (4,), (1, 1), "1 of 10752 at T=4 (#1186)"),
]


def fp_operands(seed: int, K: int, N: int, T: int, mode: str):
    """x (T, K) and the fp-mode weight (packed, uint8 scales) of float16 standard-normal draws (numpy; this
    machine's ``mx.quantize``, which gemmdrift.replay.fpquant.quantize reproduces bit for bit)."""
    import mlx.core as mx

    from gemmdrift.replay.fpquant import FP_MODES

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, K)).astype(np.float16).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(np.float16)
    wq, sc = mx.quantize(mx.array(w), mode=mode)[:2]
    bits, g = FP_MODES[mode]
    return x, (np.array(wq), np.array(sc), None, bits, g)


def fp_block_vs_chain(chip: str, K: int, N: int, Ts, version: str, mode: str, x, quant):
    """Per T in ``Ts``: differing bytes per position between the T-row call (rows 0..T-1 of x) and the one-row
    calls of the same rows (computed once: the T=1 plan does not depend on T)."""
    from gemmdrift.replay.paths import plan_for, run_plan
    from gemmdrift.metrics import differing_bytes

    kw = dict(K=K, N=N, dtype="float16", mlx_version=version, mode=mode)
    one = plan_for(chip, "quantized_matmul", T=1, **kw)
    chain = np.concatenate([run_plan(one, x[t:t + 1], dtype="float16", quant=quant).y for t in range(max(Ts))])
    out, kernels = {}, {}
    for T in Ts:
        blk = plan_for(chip, "quantized_matmul", T=T, **kw)
        block = run_plan(blk, x[:T], dtype="float16", quant=quant).y
        out[T] = differing_bytes(block.astype(np.float16), chain[:T].astype(np.float16), axis=0)
        kernels[T] = (one.recipe.kernel, blk.recipe.kernel)
    return out, kernels


def _plan_key(chip: str, K: int, N: int, Ts, version: str, mode: str) -> tuple:
    """What decides the bits of one release's arms: each T's recipe, order parameters and variant (the batch
    limit only decides which kernel runs, already in the recipe's name)."""
    from gemmdrift.replay.paths import plan_for

    key = []
    for T in (1,) + tuple(Ts):
        p = plan_for(chip, "quantized_matmul", T=T, K=K, N=N, dtype="float16", mlx_version=version, mode=mode)
        key.append((T, p.recipe.kernel, tuple(sorted((k, v) for k, v in p.params.items() if k != "batch_limit")),
                    tuple(sorted(p.variant.items())), tuple(sorted(p.recipe.axes.items()))))
    return tuple(key)


def fp_rows(seeds: int) -> list[str]:
    """The fp-mode rows, replayed with the fp recipes (replay.fpquant) at each candidate release (a release
    whose plans are another's, recipe, parameters and variant, reuses its numbers: the same adds)."""
    rows = []
    for chip, K, N, mode, Ts, (lo, hi), published in FP_MEASURED:
        per = 2 * N
        cells, counts, kernels, done = [], {}, {}, {}
        for v in RELEASES:
            key = _plan_key(chip, K, N, Ts, v, mode)
            if key not in done:
                cs = []
                for s in range(seeds):
                    x, quant = fp_operands(4000 + s, K, N, max(Ts), mode)
                    d, kernels = fp_block_vs_chain(chip, K, N, Ts, v, mode, x, quant)
                    cs += [int(c) for T in Ts for c in d[T]]
                fr = np.asarray(cs) / per
                done[key] = (cs, f"{100 * np.mean(fr):.3f} % ({100 * np.min(fr):.3f}-{100 * np.max(fr):.3f}; "
                                 f"{np.mean(cs):.1f} of {per} per position)")
            counts[v], cell = done[key]
            cells.append(cell)
        pair = "; ".join(sorted({f"{a} vs {b}" for a, b in kernels.values()}))
        mean = float(np.mean(counts[RELEASES[0]]))
        why = ("float32 sums of float16 x e2m1 products round in both kernels, in different orders (the e8m0 "
               "scale is exact)" if mode.startswith("mx") else "float32 sums of float16 x e2m1 products, and "
               "the e4m3 scale's product (fma(s, acc, r) in qmv_wide, RN(r + RN(s*acc)) in qmv), round in "
               "different orders")
        same = "the same orders from v0.32.0 to the 0.32.4 wheel"
        measured = f"{lo}" if lo == hi else f"{lo}-{hi}"
        if lo <= mean <= hi:
            verdict = f"agrees (replayed {mean:.1f} bytes per position, measured {measured})"
            cause = (f"{pair}: {why}; {same}" + ("; the 'equal' came from another harness (#1186): at a few "
                                                  "bytes, whether any differs is draw-dependent (mlxcel)"
                                                  if mode == "mxfp4" else ""))
        elif mean <= 10 * hi and mean >= lo / 10:
            verdict = f"agrees in kind (a few bytes; replayed {mean:.1f}, measured {measured})"
            cause = f"{pair}: {why}; {same}; the measurement is one draw"
        else:
            verdict = "differs (cause open)"
            cause = f"{pair}: {why}; {same}: not the version; cause open"
        T_text = "1..4" if len(Ts) > 1 else str(Ts[0])
        frac = f"{100 * lo / per:.3f}" + ("" if lo == hi else f"-{100 * hi / per:.3f}") + " %"
        rows.append(f"| {chip} | {K} -> {N} | {mode} g{32 if mode != 'nvfp4' else 16} float16 | {T_text} | "
                    f"{published} | {frac} | " + " | ".join(cells) + f" | {verdict} | {cause} |")
    return rows


def dense_operands(seed: int, K: int, N: int, T: int) -> tuple[np.ndarray, np.ndarray]:
    """x (T, K) and W (K, N) of float16 standard-normal draws (numpy; x first, as mlxcel draws), as float32."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, K)).astype(np.float16).astype(np.float32)
    w = rng.standard_normal((K, N)).astype(np.float16).astype(np.float32)
    return x, w


def dense_block_vs_chain(chip: str, K: int, N: int, T: int, version: str, x, w) -> tuple[np.ndarray, str, str]:
    """As :func:`block_vs_chain` for ``x @ W`` with W (K, N) not transposed (gemv_t at T=1); the T-row plan is
    refused (GemmdriftError) where its kernel has no recipe (NAX on M5)."""
    from gemmdrift.replay.paths import plan_for, run_plan
    from gemmdrift.metrics import differing_bytes

    kw = dict(K=K, N=N, dtype="float16", mlx_version=version, b_transposed=False)
    one, blk = (plan_for(chip, "matmul", T=t, **kw) for t in (1, T))
    wt = np.ascontiguousarray(w.T)  # the replay takes the weight as (N, K); the products are the same numbers
    block = run_plan(blk, x, dtype="float16", w=wt).y
    chain = np.concatenate([run_plan(one, x[t:t + 1], dtype="float16", w=wt).y for t in range(T)])
    return differing_bytes(block.astype(np.float16), chain.astype(np.float16), axis=0), one.recipe.kernel, \
        blk.recipe.kernel


def dense_rows(seeds: int) -> list[str]:
    """The dense x @ W rows: replayed where both arms have a recipe, else the kernel that has none, said."""
    from gemmdrift.dispatch import chip_named, choose
    from gemmdrift.errors import GemmdriftError

    rows = []
    for chip, K, N, T, meas in DENSE_MEASURED:
        per = 2 * N
        kernels = {v: [choose(chip_named(chip), "matmul", T=t, K=K, N=N, dtype="float16", mlx_version=v,
                              b_transposed=False).kernel for t in (1, T)] for v in RELEASES}
        cells = []
        for v in RELEASES:
            fr = []
            try:
                for s in range(seeds):
                    x, w = dense_operands(2000 + s, K, N, T)
                    d, _, _ = dense_block_vs_chain(chip, K, N, T, v, x, w)
                    fr += list(d / per)
            except GemmdriftError:
                cells.append("-")
                continue
            cells.append(f"{100 * np.mean(fr):.2f} % ({100 * np.min(fr):.2f}-{100 * np.max(fr):.2f})")
        k1, kT = kernels[RELEASES[0]]
        same = all(kernels[v] == [k1, kT] for v in RELEASES)
        pair = f"{k1} vs {kT}" + ("" if same else " (per release: " + "; ".join(
            f"{v}: {' vs '.join(kernels[v])}" for v in RELEASES) + ")")
        if all(c == "-" for c in cells):
            verdict = "not replayed (T=3 arm)"
            cause = (f"{pair}: the T=1 arm (gemv_t, x @ W) is replayed; the T=3 arm is NAX steel (M5, float16: "
                     "Case 1 split-K is for non-NAX chips), whose order inside matmul2d is not in the source")
            frac = "about 2 %"
        else:
            p1 = choose(chip_named(chip), "matmul", T=1, K=K, N=N, dtype="float16", mlx_version=RELEASES[0],
                        b_transposed=False).params
            pT = choose(chip_named(chip), "matmul", T=T, K=K, N=N, dtype="float16", mlx_version=RELEASES[0],
                        b_transposed=False).params
            verdict = "agrees (differs; no count published)"
            cause = (f"{pair}: gemv_t's {p1['sm']} K-threads of {p1['tm']} rows and a shuffle ladder against "
                     f"split-K's {pT.get('partitions')} partitions of {pT.get('partition_size')} (MMA8 chains, H1), the "
                     "order split-K has for x @ W.T too (tiles from M, N, K; the transposition is strides); gemv_t "
                     "is the same from v0.30.5 on")
            frac = ""
        rows.append(f"| {chip} | {K} -> {N} | dense float16 (x @ W) | {T} | {meas} | {frac} | "
                    + " | ".join(cells) + f" | {verdict} | {cause} |")
    return rows


def boundaries() -> list[str]:
    """The deterministic rows: where the dispatch switches kernels (tested in tests/test_replay_vs_hardware.py)."""
    from gemmdrift.dispatch import chip_named, choose, qmv_batch_limit, parse_version

    out = []
    for chip, K, N in (("M1 Ultra", 5120, 17408), ("M5 Max", 5120, 17408), ("M5 Max", 5376, 5376)):
        c = chip_named(chip)
        for v in ("0.32.0", "0.32.1"):
            ks = {t: choose(c, "quantized_matmul", T=t, K=K, N=N, dtype="float16", mlx_version=v, bits=4,
                            group_size=64).kernel for t in range(1, 34)}
            runs, start = [], 1
            for t in range(2, 35):
                if t == 34 or ks[t] != ks[start]:
                    runs.append(f"{ks[start]} T={start}" + (f"..{t - 1}" if t - 1 > start else ""))
                    start = t
            out.append(f"| {chip} | {K} -> {N} | {v} | {qmv_batch_limit(K, N, c, parse_version(v))} | "
                       f"{'; '.join(runs)} |")
    return out


def mlx_operands(seed: int, K: int, N: int, T: int):
    """x (T, K) and the q4 g64 weight drawn as mlxcel's test draws them: ``mx.random.normal`` in float16
    (mlx/random.cpp ``normal`` at b7c3dd6d: a float32 uniform on (-1, 1), ``erfinv`` in float32, cast to half,
    times ``half(sqrt 2)`` in half), x first, then the dense weight, then ``quantize``; on this machine's CPU
    stream (Metal's erfinv differs in the last bits, mlx #3568: the same distribution, other draws)."""
    import mlx.core as mx

    kx, kw = mx.random.split(mx.random.key(seed))
    x = np.array(mx.random.normal((T, K), dtype=mx.float16, key=kx, stream=mx.cpu)).astype(np.float32)
    w = mx.random.normal((N, K), dtype=mx.float16, key=kw, stream=mx.cpu)
    wq, sc, bi = mx.quantize(w, group_size=64, bits=4, stream=mx.cpu)
    return x, (np.array(wq), np.array(sc.astype(mx.float32)), np.array(bi.astype(mx.float32)), 4, 64)


def accumulators(chip: str, K: int, N: int, T: int, x, quant) -> dict[str, np.ndarray]:
    """The float32 results (T, N), before the float16 store, of the T=1 arm with 0.32.0's half-quad x sums
    (``half``) and 0.32.4's float sums (``float``), and of the T-row arm (``wide``); qmv's rows are computed
    independently (its one-row call is row t of a T-row call), so one call gives the T single-row calls."""
    from gemmdrift.replay import quant as rq
    from gemmdrift.replay.jitquant import quant_acc
    from gemmdrift.replay.paths import plan_for

    wq, sc, bi, bits, g = quant
    out = {}
    for name, version, t in (("half", "0.32.0", 1), ("float", "0.32.4", 1), ("wide", "0.32.0", T)):
        plan = plan_for(chip, "quantized_matmul", T=t, K=K, N=N, dtype="float16", mlx_version=version, bits=bits,
                        group_size=g)
        prm = {"bits": bits, "group_size": g, **plan.params}
        acc = quant_acc(plan.recipe.fn, x, wq, sc, bi, prm, plan.variant, "float16", False)
        if acc is None:  # not compiled here: the numpy recipe
            acc = plan.recipe.fn(x, rq.unpack(wq, bits, K), sc, bi, prm, plan.variant, "float16", False)
        out[name] = np.asarray(acc, dtype=np.float32)
    return out


def scaled_xsum(acc: dict[str, np.ndarray], lam: float) -> np.ndarray:
    """Differing bytes per position of the T-row arm against a T=1 arm whose x-sum error is ``lam`` times the
    half-quad one: ``float + lam * (half - float)`` in float64, then float16 (``lam`` 0: 0.32.4's recipe; 1:
    0.32.0's, exactly, since float32 differences and sums are exact in float64)."""
    from gemmdrift.metrics import differing_bytes

    f, h = acc["float"].astype(np.float64), acc["half"].astype(np.float64)
    one = (f + lam * (h - f)).astype(np.float16)
    return differing_bytes(acc["wide"].astype(np.float16), one, axis=0)


def lam_for(acc: dict[str, np.ndarray], target: float, per: int, steps: int = 18) -> float:
    """The ``lam`` whose mean fraction of differing bytes is ``target`` (bisection on [0, 1]; the fraction
    grows with lam)."""
    lo, hi = 0.0, 1.0
    for _ in range(steps):
        mid = (lo + hi) / 2
        if np.mean(scaled_xsum(acc, mid)) / per < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def variant_grid(chip: str, K: int, N: int, T: int, version: str, x, quant, per: int) -> tuple[float, float]:
    """(min, max) over every variant of both arms (qmv_fast: simd_sum x contrib; qmv_wide: contract) of the
    mean fraction of differing bytes."""
    from gemmdrift.replay import RECIPES
    from gemmdrift.replay.paths import plan_for, run_plan
    from gemmdrift.metrics import differing_bytes

    kw = dict(K=K, N=N, dtype="float16", mlx_version=version, bits=4, group_size=64)
    fr = []
    for v1 in RECIPES["qmv_fast"].variants():
        one = plan_for(chip, "quantized_matmul", T=1, variant=v1, **kw)
        chain = np.concatenate([run_plan(one, x[t:t + 1], dtype="float16", quant=quant).y for t in range(T)])
        for vT in RECIPES["qmv_wide"].variants():
            blk = plan_for(chip, "quantized_matmul", T=T, variant=vT, **kw)
            block = run_plan(blk, x, dtype="float16", quant=quant).y
            fr.append(np.mean(differing_bytes(block.astype(np.float16), chain.astype(np.float16), axis=0)) / per)
    return min(fr), max(fr)


def pct(fr) -> str:
    return f"{100 * np.mean(fr):.2f} % ({100 * np.min(fr):.2f}-{100 * np.max(fr):.2f})"


def m5_candidates(seeds: int) -> list[str]:
    """The M5 Max q4 rows against each candidate the reading of mlxcel's test and its mlx gives (see the
    docs page): the inputs as mlxcel draws them, every variant axis, and an x-sum error of any size."""
    m5 = [m for m in MEASURED if m[0] == "M5 Max"]
    rows = ["| candidate | " + " | ".join(f"{K} -> {N} (measured {', '.join(f'{100 * c / per:.2f}' for c in meas)} %)"
                                        for _, K, N, _, _, meas, per, _ in m5) + " |", "|---" * (1 + len(m5)) + "|"]
    cells: dict[str, list[str]] = {}
    for chip, K, N, mode, T, meas, per, where in m5:
        target = np.mean(meas) / per
        mlx_fr = {v: [] for v in RELEASES}
        lams, spread, at = [], [], []
        for s in range(seeds):
            x, quant = mlx_operands(3000 + s, K, N, T)
            for v in RELEASES:
                d, _, _ = block_vs_chain(chip, K, N, T, v, x, quant)
                mlx_fr[v] += list(d / per)
            acc = accumulators(chip, K, N, T, x, quant)
            lam = lam_for(acc, target, per)
            d = scaled_xsum(acc, lam) / per
            lams.append(lam)
            at += list(d)
            spread.append(d.max() / max(d.min(), 1e-12))
        x, quant = operands(1000, K, N, T)
        grid = {v: variant_grid(chip, K, N, T, v, x, quant, per) for v in RELEASES}
        cells.setdefault("mlx", []).append(f"0.32.0: {pct(mlx_fr['0.32.0'])}; 0.32.4: {pct(mlx_fr['0.32.4'])}")
        cells.setdefault("grid", []).append("; ".join(f"{v}: {100 * grid[v][0]:.2f}-{100 * grid[v][1]:.2f} %"
                                                      for v in RELEASES))
        cells.setdefault("lam", []).append(f"lam {min(lams):.3f}-{max(lams):.3f}: {pct(at)}; per-position max/min "
                                           f"{min(spread):.2f}-{max(spread):.2f} (measured "
                                           f"{max(meas) / min(meas):.2f})")
    names = {
        "mlx": "inputs drawn as mlxcel draws them (mx.random.normal float16, then quantize), both releases",
        "grid": "every variant of both arms (qmv_fast simd_sum x contrib, qmv_wide contract; numpy draws, one seed)",
        "lam": "the T=1 arm's x-sum error scaled to lam x the half-quad one, lam fitted to the measured mean",
    }
    for k, label in names.items():
        rows.append(f"| {label} | " + " | ".join(cells[k]) + " |")
    return rows


def table(seeds: int) -> str:
    rows = ["| chip | shape | mode | T | measured (of bytes per position) | measured fraction | "
            + " | ".join(f"replayed {v}" for v in RELEASES) + " | verdict | cause |",
            "|---" * (8 + len(RELEASES)) + "|"]
    for chip, K, N, mode, T, meas, per, where in MEASURED:
        frac = [m / per for m in meas]
        cells, kernels = [], ""
        for v in RELEASES:
            fr = []
            for s in range(seeds):
                x, quant = operands(1000 + s, K, N, T)
                d, k1, kT = block_vs_chain(chip, K, N, T, v, x, quant)
                fr += list(d / per)
                kernels = f"{k1} vs {kT}"
            cells.append(f"{100 * np.mean(fr):.2f} % ({100 * np.min(fr):.2f}-{100 * np.max(fr):.2f})")
        if max(meas) == 0:
            verdict = "agrees" if all(c.startswith("0.00 %") for c in cells) else "differs"
            cause = f"{kernels}: T=1..11 all qmv, row-invariant (batch limit 12)"
        else:
            verdict = "differs (cause open)"
            cause = (f"{kernels} (nv 3, kl 8), read at b7c3dd6d. 0.32.0's qmv sums x in half quads "
                     "(load_vector), 0.32.4's in float; the measurement lies between, 10x from each. Neither "
                     "mlxcel's draws nor any variant moves a release's figure; an x-sum error of 1/60 of the "
                     "half-quad one fits the mean but not the per-position ratios (1.2 here, 3.0 measured, "
                     "repeated on both shapes): cause open (candidates below)")
        rows.append(f"| {chip} | {K} -> {N} | {mode} float16 | {T} | {', '.join(map(str, meas))} of {per} "
                    f"({where}) | {100 * min(frac):.1f}-{100 * max(frac):.1f} % | " + " | ".join(cells)
                    + f" | {verdict} | {cause} |")
    rows += dense_rows(seeds)
    rows += fp_rows(seeds)
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--write", help="the docs page whose <!-- table --> ... <!-- /table --> part is replaced")
    args = ap.parse_args(argv)
    if args.seeds < 1:
        print("error: --seeds must be at least 1", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    text = (table(args.seeds) + "\n\nDispatch boundaries (deterministic; affine q4 g64 float16):\n\n"
            "| chip | shape | mlx | batch limit | kernels by T (1..33) |\n|---|---|---|---|---|\n"
            + "\n".join(boundaries()))
    text += ("\n\nThe M5 Max q4 rows against the candidates of the reading (mean fraction of bytes, range over "
             "seeds and positions):\n\n" + "\n".join(m5_candidates(args.seeds)))
    text += f"\n\n_{args.seeds} seeds per row; {time.perf_counter() - t0:.0f} s here (measured under load)._"
    if args.write:
        p = Path(args.write)
        page = p.read_text()
        new, n = re.subn(r"<!-- table -->.*?<!-- /table -->", f"<!-- table -->\n{text}\n<!-- /table -->", page,
                         flags=re.S)
        if n != 1:
            print(f"error: {p} has no <!-- table --> ... <!-- /table --> part", file=sys.stderr)
            return 2
        from gemmdrift.files import write_text

        write_text(p, new)  # atomically: a temporary file renamed over the page
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
