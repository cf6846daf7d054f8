"""The report page: one results directory (or a `gemmdrift run` directory of them) as HTML and markdown.

The page reads Results only (:func:`gemmdrift.store.read_result`, which also
reads directories written before the Result record). Each kind has a part
function in :data:`PARTS` (``(directory, env) -> (blocks, reading)``), a title
in :data:`KIND_TITLES` and its figures in :data:`FIGURES`; a new kind adds one
entry to each, at the end.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pandas as pd

from . import files, store
from .errors import GemmdriftError
from .result import Verdict
from .page import (  # noqa: F401  (the page's form, kept importable from here)
    CHROMIUM_FLAGS, MAC_BROWSERS, Block, find_chromium, screenshot, to_html, to_markdown,
)
from .text import fmt, logits, span, text_table  # noqa: F401  (text_table: kept importable from here)
from .view import answer
from .view.summaries import replay_note, stack_summary, triage_items


def _stack_rows(summary: dict[str, Any]) -> list[dict[str, Any]]:
    keys = ("pair", "first_layer_with_drift", "max_abs_dlogit", "max_abs_dgap", "p99_abs_dgap", "flips",
            "max_gap_at_flip", "ladder_verdict")
    return [{k: p.get(k) for k in keys if k in p or k == "ladder_verdict"} for p in summary["pairs"]]


# ------------------------------------------------------------------ the report page (its blocks: gemmdrift.page)


# The parts of `gemmdrift run`, in the order shown, with their headings.
PART_TITLES = {
    "kernels": "Kernels: the same row as a GEMV (T=1) and inside a GEMM block (T>1)",
    "stack-decode": "Layer stack: decode (T=1) vs speculative verification (T=3, T=4)",
    "stack-prefill": "Prefill chunk sizes: 2048 vs 512",
    "diverge": "Greedy divergence: mlx-lm generate vs speculative generate",
}
KIND_TITLES = {
    "kernels": "Kernels: GEMV (T=1) vs GEMM (T>1)",
    "stack": "Layer stack",
    "diverge": "Greedy divergence",
    "triage": "Divergence triage",
    "divergence": "Divergence statistics over prompts",
    "history": "Tracked figures across mlx releases",
    "batch": "Batch composition: a row of mlx-lm's BatchGenerator vs the same prompt alone",
    "server": "mlx_lm.server: draft model, concurrent requests, prompt-cache reuse",
}
FIGURES = {
    "kernels": [("kernels_heatmap.png", "worst drift per layer and projection"),
                ("kernels_vs_t.png", "drift against T, with the kernel dispatch switches"),
                ("ops_vs_t.png", "sdpa, rms_norm, rope and softmax against the query length")],
    "stack": [("stack_drift.png", "drift per layer"), ("dgap.png", "the logit envelope: Δgap against the top-2 gap"),
              ("ladder.png", "precision ladder")],
    "diverge": [("triage.png", "each stream teacher-forced under its own schedule")],
    "triage": [("triage.png", "each stream teacher-forced under its own schedule")],
    "divergence": [("divergence.png", "first divergences and the gap at each")],
    "batch": [("batch.png", "batch envelope and first divergence against B, by companion set and row position")],
    "server": [("server.png", "first divergence per server case")],
}
HOW_TO_READ = [
    "A *near-tie* flips the argmax where Δgap exceeds the top-2 gap; that is rounding, expected wherever kernels "
    "or cache layouts differ. A divergence far outside the envelope (the largest |Δgap| the two schedules showed "
    "where they agreed) is a state bug.",
    "The precision ladder reruns at float32 with the same weights: rounding drift shrinks by orders of magnitude, "
    "a semantic difference (other keys, offsets, cache state) does not.",
    "Drift that starts exactly past a sliding window points at the cache layout, not a kernel: mlx-lm's "
    "RotatingKVCache writes T=1 decode steps into a ring buffer in place but concatenates longer blocks in "
    "temporal order, so past the window attention sums the same keys in another order.",
    "Kernel drift is counted in ULPs of the storage dtype and drawn as bits lost, log2(1 + ULPs): 0 means the row "
    "computed inside a T-row block is bit-identical to the same row computed alone. *Emulated* paths are negative "
    "controls (a split-K summation order written in mlx ops), never an mlx kernel.",
]


def result_kind(d: Path) -> str | None:
    """What a gemmdrift output directory holds: the kind in its ``result.json``, or (older directories)
    the kind its files say."""
    return store.result_kind(d)


_READ: dict[tuple[str, float], Any] = {}


def _result(d: Path):
    """The Result in ``d`` (read once per page)."""
    key = (str(Path(d).resolve()), max((p.stat().st_mtime for p in Path(d).iterdir() if p.is_file()), default=0.0))
    if key not in _READ:
        _READ.clear()
        _READ[key] = store.read_result(d)
    return _READ[key]


def find_parts(d: Path) -> list[tuple[Path, str]]:
    """The result directories in ``d``: itself, or its subdirectories (a `gemmdrift run` directory)."""
    own = result_kind(d)
    if own:
        return [(d, own)]
    subs = [(p, result_kind(p)) for p in sorted(d.iterdir()) if p.is_dir()]
    order = list(PART_TITLES)
    subs.sort(key=lambda x: (order.index(x[0].name) if x[0].name in order else len(order), x[0].name))
    return [(p, k) for p, k in subs if k]


def _json(path: Path, need: tuple[str, ...] = ()) -> dict[str, Any] | None:
    """A JSON object a command wrote beside its Result; None if absent, a corrupt one refused by name.
    (Parts read Results through :func:`_result`; this is for the few files that are no Result.)"""
    return files.read_object(path, need) if Path(path).is_file() else None


def _figures(d: Path, root: Path, kind: str) -> list[Block]:
    if kind == "history":
        found = [(p, p.stem.replace("_", " ")) for p in sorted((d / "figures").glob("*.png")) if _headline(p.stem)]
    else:
        found = [(d / name, caption) for name, caption in FIGURES.get(kind, []) if (d / name).is_file()]
    return [("img", str(p.relative_to(root)), caption) for p, caption in found]


def _headline(figure: str) -> bool:
    """History figures shown on the page: per-layer profiles and whole-model figures. The single
    series per layer and per kernel path and T stay in figures/ (the profiles draw them together)."""
    return figure.startswith("layers_") or not any(k in figure for k in ("Layers.track", "KernelDrift.track"))


def _kernels_part(d: Path, env: dict[str, Any]) -> tuple[list[Block], list[str]]:
    from .view.summaries import kernels_summary, measured_ts, print_kernels

    df = _result(d).tables["kernels"]
    s = kernels_summary(df)
    blocks: list[Block] = [
        ("p", "Real input rows captured from a forward pass; every projection of the probed layers and the LM head. "
              "`max_ulp` is the worst distance of a row computed inside a T-row block from the same row computed "
              "alone; `err_rel_l2` is the distance from a float64 reference on the same operands."),
        ("pre", print_kernels(df)),
    ]
    real = [p for p in s["paths"] if not p["emulated"]]
    emulated = [p for p in s["paths"] if p["emulated"]]
    where = f"{env.get('backend', '?')} backend" + (" (synthetic weights)" if s.get("synthetic") else "")
    reading = []
    clean = [p["path"] for p in real if p["max_ulp"] == 0]
    if real and len(clean) == len(real):
        reading.append(f"{where}: every real path ({', '.join(clean)}) gives bit-identical rows at every T measured "
                       f"({measured_ts(real)}), in all {max(p['units'] for p in real)} projections probed.")
    else:
        for p in real:
            if p["max_ulp"] > 0:
                w = p.get("worst") or {}
                reading.append(f"{where}, {p['path']}: {p['units_with_drift']} of {p['units']} projections change "
                               f"with T from T={p['first_T_with_drift']}; worst {fmt(p['max_ulp'])} ULP "
                               f"({p['bits_lost']:.1f} bits) at layer {w.get('layer')} {w.get('projection')}, "
                               f"T={w.get('T')}.")
        if clean:
            reading.append(f"{where}: bit-identical across T: {', '.join(clean)}.")
    for p in emulated:
        reading.append(f"The emulated control {p['path']} is detected (up to {fmt(p['max_ulp'])} ULP): the sweep does "
                       "see a summation order that changes with T." if p["max_ulp"] > 0 else
                       f"The emulated control {p['path']} shows no drift at these sizes: this sweep could not have "
                       "seen a T-dependent summation order, so its zeros prove little.")
    ops = s.get("ops", [])
    for op in ops:
        if op["max_ulp"] > 0:
            reading.append(f"Op {op['op']} ({op['variant']}) changes with the query length from "
                           f"T={op['first_T_with_drift']} (up to {fmt(op['max_ulp'])} ULP).")
    if ops and all(op["max_ulp"] == 0 for op in ops):
        reading.append(f"Ops {', '.join(dict.fromkeys(op['op'] for op in ops))}: bit-identical rows at every query "
                       "length probed.")
    from .kernels import describe_skipped

    skipped = describe_skipped(_result(d).tables.get("skipped"))
    if skipped:
        blocks.append(("p", skipped))  # a sweep cut by its budget says where
    return blocks, reading


def _stack_part(d: Path, env: dict[str, Any]) -> tuple[list[Block], list[str]]:
    r = _result(d)
    summ = stack_summary(r)
    model = r.inputs.get("model") or {}
    window = model.get("sliding_window")
    positions = r.tables.get("positions", pd.DataFrame())
    ladder = r.tables.get("ladder", pd.DataFrame())
    split = summ.get("split")
    blocks: list[Block] = [
        ("p", f"The same {summ.get('tokens')} tokens under each schedule, compared with `{summ.get('reference')}`"
              + (f" at positions {span(split, summ.get('tokens') - 1)}" if split is not None and summ.get("tokens")
                 else "")
              + ". Drift at every layer is in stack.csv; the logit envelope:"),
        ("table", _stack_rows({"pairs": summ.get("pairs", [])})),
    ]
    reading = []
    for p in summ.get("pairs", []):
        pair, layer = p["pair"], p.get("first_layer_with_drift")
        if layer is None and not p.get("max_abs_dlogit"):
            reading.append(f"`{pair}`: bit-identical at every layer and at the logits "
                           f"({p.get('positions', 0)} positions).")
            continue
        text = f"`{pair}`: " + (f"hidden states differ from layer {layer} on" if layer is not None else
                                "hidden states agree; the logits differ")
        if len(positions):
            moved = positions[(positions["pair"] == pair) & (positions["mode"] == "accumulated")
                              & (positions["dtype"] == summ.get("dtype")) & (positions["max_abs_dlogit"] > 0)]
            if len(moved):
                first = int(moved["position"].min())
                text += f"; the logits first move at position {first}"
                if window and first >= window:
                    text += f", past the {window}-token sliding window"
        text += (f"; max|Δlogit| {fmt(p.get('max_abs_dlogit'))}, max|Δgap| {fmt(p.get('max_abs_dgap'))}, "
                 f"{p.get('flips', 0)} argmax flips")
        if p.get("flips"):
            text += f" (largest gap flipped: {logits(p.get('max_gap_at_flip'))})"
        verdict = p.get("ladder_verdict")
        if verdict == Verdict.ROUNDING:
            sh = ladder[(ladder["pair"] == pair) & (ladder["shrink"] > 0)]["shrink"] if len(ladder) else []
            least = float(min(sh)) if len(sh) else math.nan
            text += (". **Rounding-level** by the precision ladder" +
                     (f": at float32 the drift shrinks at least {least:,.0f}×" if math.isfinite(least) else ""))
        elif verdict == Verdict.SEMANTIC:
            text += (". **Not rounding**: at float32 the drift does not shrink, so the schedules compute different "
                     "things (keys, offsets, cache state)")
        elif verdict == Verdict.UNCLEAR:
            text += ". The precision ladder is inconclusive (the drift shrinks, but less than rounding would)"
        elif verdict == Verdict.UNRELIABLE:
            text += (". The precision ladder is **unreliable** here: its float32 rung ran TF32 matmuls "
                     "(rerun with MLX_ENABLE_TF32=0), so drift that does not shrink proves nothing")
        reading.append(text + ".")
    return blocks, reading


def _triage_blocks(t: dict[str, Any], n: int | None = None) -> tuple[list[Block], list[str]]:
    if t.get("index") is None and t["verdict"] != "OUTSIDE ENVELOPE":
        reading = [f"Greedy generation: the two streams agree{f' over {n} tokens' if n else ''}, and each is what "
                   "its own schedule computes."]
    else:
        reading = [f"Greedy divergence: **{t['verdict']}** — {t['reason']}."]
    return [("ul", triage_items(t, n))], reading


def _diverge_part(d: Path, env: dict[str, Any]) -> tuple[list[Block], list[str]]:
    r = dict(_result(d).details)
    a, b = r.get("stream_a", {}), r.get("stream_b", {})
    blocks: list[Block] = [("p", f"Stream A: {a.get('label')} (`{a.get('schedule')}`); stream B: {b.get('label')} "
                                 f"(`{b.get('schedule')}`); {r.get('n')} tokens after a {r.get('prompt_tokens')}-token "
                                 "prompt.")]
    reading: list[str] = []
    if r.get("triage"):
        more, reading = _triage_blocks(r["triage"], r.get("n"))
        blocks += more
    elif r.get("first_divergence") is None:
        reading = [f"Greedy generation: the two streams agree over {r.get('n')} tokens."]
    else:
        reading = [f"Greedy generation: the streams part at token {r['first_divergence']} (not triaged)."]
    blocks += [("p", f"A: {r.get('text_a')!r}"), ("p", f"B: {r.get('text_b')!r}")]
    return blocks, reading


def _triage_part(d: Path, env: dict[str, Any]) -> tuple[list[Block], list[str]]:
    t = dict(_result(d).details.get("triage") or {})
    return _triage_blocks(t) if t else ([], [])


def _divergence_part(d: Path, env: dict[str, Any]) -> tuple[list[Block], list[str]]:
    from .view.summaries import divergence_summary

    df = _result(d).tables["divergence"]
    s = divergence_summary(df)
    cols = [c for c in ("prompt", "prompt_tokens", "first_divergence", "verdict", "margin", "envelope", "acceptance")
            if c in df.columns]
    reading = [f"{s.get('diverged')} of {s.get('prompts')} prompts diverged "
               f"({fmt(float(s.get('divergences_per_1k') or 0.0))} per 1,000 tokens): {s.get('near_ties')} near-ties, "
               f"{s.get('outside_envelope')} outside the envelope."]
    return [("table", df[cols].to_dict(orient="records"))], reading


def _history_part(d: Path, env: dict[str, Any]) -> tuple[list[Block], list[str]]:
    wide = _result(d).tables["history_wide"]
    versions = [c for c in wide.columns if c[:1].isdigit()]
    figures = sorted((d / "figures").glob("*.png"))
    shown = sum(_headline(p.stem) for p in figures)
    return ([("p", f"{len(wide)} tracked series over mlx {', '.join(versions)}; the full table is history_wide.csv. "
                   f"Shown: the per-layer profiles and the whole-model figures ({shown}); the other "
                   f"{len(figures) - shown} (one per layer, kernel path and T) are in figures/.")],
            [f"asv history: {len(wide)} tracked series over mlx {', '.join(versions)}."])


def _generic_part(d: Path, env: dict[str, Any]) -> tuple[list[Block], list[str]]:
    """A kind without its own part: its printed summary."""
    from .view.summaries import text

    return [("pre", text(_result(d)))], []


def _fingerprint_part(d: Path, env: dict[str, Any]) -> tuple[list[Block], list[str]]:
    from .store import read_result
    from .view.fingerprint import fingerprint_summary

    s = fingerprint_summary(read_result(d))
    reading = []
    for path, e in s["paths"].items():
        if e["status"] in ("not recoverable", "fp16 subnormals flushed on this device"):  # fingerprint.FP16_FLUSHED
            reading.append(f"`{path}`: {e.get('reason', e['status'])}.")
            continue
        line = (f"`{path}` (K={s['K']}): {e['distinct_trees']} distinct summation tree(s) over T {e.get('ts', s['ts'])}"
                + (f", {e['not_recovered']} row positions not recovered" if e["not_recovered"] else "")
                + (f"; {e['description']}" if e.get("description") else ""))
        a = e.get("accumulator_check")
        if a and not a["exact"]:
            line += f"; an all-unit sum of {a['units']} gave {a['sum']:g} (the accumulator is narrower than the output)"
        reading.append(line + ".")
    blocks: list[Block] = [("p", f"Summation trees recovered black-box (FPRev probes: +M, -M and units), K={s['K']}, "
                                 f"N={s['N']} columns per call, the probed row at every position of each T-row block. "
                                 f"Predicted kernel: {s['prediction_origin'] or 'none'}."),
                           ("table", [{k: (v[:120] if isinstance(v, str) else v) for k, v in r.items()}
                                      for r in s["runs"]])]
    return blocks, reading


STATE_LEGEND = {  # every verdict a state cell can show (view.state.state_cells), in its order of severity
    "STATE BUG": "different entries or offsets, or an operation refused while the generator carried on",
    "refused": "a cache under test (--cache-impl) raised or broke the cache protocol in this case",
    "unreliable": "a difference that did not shrink enough where the float32 rung was not true float32 (TF32 "
                  "matmuls), so rounding and a bug cannot be told apart",
    "rounding": "differs but shrinks at float32",
    "EXACT": "bit-identical",
    "not applicable": "the model has no cache the operation applies to",
    "not checked": "a cache class gemmdrift does not know",
}


def _state_part(d: Path, env: dict[str, Any]) -> tuple[list[Block], list[Any]]:
    from .store import read_result
    from .view.state import state_findings, state_summary

    r = read_result(d)
    s = state_summary(r)
    pre = ", ".join(f"{w} {p}" for w, p in s["prefixes"].items())
    blocks: list[Block] = [
        ("p", f"Each case runs a cache operation of mlx-lm {s['mlx_lm']} and a reference that never did it, from the "
              f"same state and with the same blocks, and compares the cache contents in temporal order and the next "
              f"position's logits. Prefix lengths: {pre} (sliding window {s['window']}). The verdict per cache, "
              "operation and prefix position is the table under *What this shows*; "
              + "; ".join(f"{v}: {what}" for v, what in STATE_LEGEND.items()) + ". The full table is state.csv."),
    ]
    # The findings: one table (cache x operation x where -> verdict), not one line each.
    reading: list[Any] = [f"Cache state ({s['cases']} cases; {', '.join(f'{n} {v}' for v, n in s['verdicts'].items())}"
                          f"): the worst verdict per cache, operation and prefix position, with the first case that "
                          "is not exact:", ("table", state_findings(r.tables["state"]))]
    return blocks, reading


PARTS = {"kernels": _kernels_part, "stack": _stack_part, "diverge": _diverge_part, "triage": _triage_part,
         "divergence": _divergence_part, "history": _history_part}
PARTS["fingerprint"] = _fingerprint_part
KIND_TITLES["fingerprint"] = "Accumulation-order fingerprints: the summation tree per kernel path and T"
FIGURES["fingerprint"] = [("fingerprint_vs_t.png", "the tree per T and row position, with the predicted kernel switches"),
                          ("trees_small_k.png", "the recovered trees at small K")]
PARTS["state"] = _state_part
KIND_TITLES["state"] = "Cache state exactness: every way mlx-lm rewinds, reuses or reshapes a cache"
PART_TITLES["state"] = "Cache state exactness (short sweep): rollback and trim against a cache that never did them"
FIGURES["state"] = [("state_grid.png", "worst verdict per cache class, operation and prefix position")]


def _batch_part(d: Path, env: dict[str, Any]) -> tuple[list[Block], list[str]]:
    r = _result(d)
    t, f = r.tables["batch"], r.figures
    cols = [c for c in ("target", "companions", "B", "row", "verdict", "first_divergence", "envelope_batch",
                        "margin", "ladder", "seconds_batch", "seconds_alone_all") if c in t.columns]
    said = (f"Batch: {int(f.get('batch_rows', len(t)))} rows of mlx-lm's BatchGenerator against the same prompt "
            f"alone: {int(f.get('batch_identical', 0))} bit-identical, {int(f.get('batch_flips', 0))} parted, "
            f"{int(f.get('batch_outside', 0))} outside the envelope; largest batch envelope "
            f"{fmt(float(f.get('batch_envelope', 0.0)))}"
            + (f"; the largest batch ran {fmt(float(f['batch_speedup']))}x faster than its streams one by one."
               if "batch_speedup" in f else "."))
    return ([("p", "Logits only: the per-layer taps cannot yet follow a row through the padded batch."),
             ("table", t[cols].to_dict(orient="records"))], [said])


def _server_part(d: Path, env: dict[str, Any]) -> tuple[list[Block], list[str]]:
    r = _result(d)
    t, f = r.tables["server"], r.figures
    cols = [c for c in ("case", "a", "b", "prompt_tokens", "first_divergence", "verdict", "margin", "envelope",
                        "seconds_a", "seconds_b") if c in t.columns]
    said = f"mlx_lm.server: {int(f.get('server_divergences', 0))} of {len(t)} stream pairs diverged"
    if "server_tokens_per_s" in f:
        said += (f"; {fmt(float(f['server_tokens_per_s']))} tokens/s through the server vs "
                 f"{fmt(float(f['inprocess_tokens_per_s']))} in process")
    return [("table", t[cols].to_dict(orient="records"))], [said + "."]


PARTS["batch"] = _batch_part
PARTS["server"] = _server_part
# Every kind a page renders, for `report --help` and its errors (a gemmdrift run directory holds several).
KINDS_READ = ("run, stack, kernels, diverge, triage, attribute (its --primitives and --python outputs too), replay "
              "check, compare, history, state, batch, server or fingerprint")


def _mode_blocks(d: Path) -> list[Block] | None:
    """The outputs of ``attribute --primitives`` (primitives.json) and ``attribute --python`` (release_ops.json),
    which carry no Result record: their JSON is the record. None when ``d`` holds neither."""
    import json

    import pandas as pd

    if (d / "primitives.json").is_file():
        from .attribution.primitives import Gate
        from .view.primitives import text

        rec = json.loads((d / "primitives.json").read_text())
        g = Gate(pd.DataFrame(rec.get("rows") or []), list(rec.get("ts") or [1]), rec.get("model") or {},
                 rec.get("device") or {}, rec.get("kernels") or "native", float(rec.get("seconds") or 0),
                 rec.get("error"), rec.get("settings") or {})
        body = text(g)
        title, said = "attribute --primitives: is a T-row call bit-equal to T single-row calls?", body.splitlines()[-1]
        blocks: list[Block] = [("pre", body), ("p", "Each row's recomputing command is in `primitives.json`.")]
    elif (d / "release_ops.json").is_file():
        rec = json.loads((d / "release_ops.json").read_text())
        changed = rec.get("changed") or []
        names = list(dict.fromkeys(c["op"] for c in changed))
        title = "attribute --python: which op's bits moved between two mlx releases"
        said = (f"mlx {(rec.get('from') or {}).get('mlx')} vs mlx {(rec.get('to') or {}).get('mlx')}: "
                f"{rec.get('compared')} op calls compared, " + (f"outputs differ in (forward order): {', '.join(names)}"
                                                               if names else "every output bit-identical")
                + (f"; {len(rec.get('errors') or [])} could not run" if rec.get("errors") else ""))
        blocks = [("p", f"Model {rec.get('model')}, positions {rec.get('positions')}, layers "
                        f"{', '.join(map(str, rec.get('layers') or []))}.")]
        if changed:
            blocks.append(("table", [{k: c.get(k) for k in ("op", "layer", "frac_differ", "max_ulp")} for c in changed]))
    else:
        return None
    return [("h1", f"gemmdrift report: {d.name}"), ("h2", "What this shows"), ("ul", [said]), ("h2", title), *blocks]


def _compare_part(d: Path, env: dict[str, Any]) -> tuple[list[Block], list[str]]:
    from .view.compare import compare_part

    return compare_part(_result(d))


PARTS["compare"] = _compare_part  # issue 23
KIND_TITLES["compare"] = "Two runs compared: KLD, Δp, same top-1 against a base file"
FIGURES["compare"] = [("compare.png", "KLD(base ‖ other) and Δp of the correct token per position")]


def _predict_part(d: Path, env: dict[str, Any]) -> tuple[list[Block], list[str]]:
    from .view.predict import report_part

    return report_part(_result(d))


def _replay_check_part(d: Path, env: dict[str, Any]) -> tuple[list[Block], list[str]]:
    from .replay.check import report_part

    return report_part(_result(d))  # names the chip and says whether it is a prediction (issue 33 D17)


PARTS["replay_check"] = _replay_check_part
KIND_TITLES["replay_check"] = "Replay check: a chip's recipes against this device's kernels, bit for bit"
PARTS["predict"] = _predict_part  # issue 22
PART_TITLES["predict"] = KIND_TITLES["predict"] = "Predicted GPU drift (replay)"
FIGURES["predict"] = [("predict_drift.png", "per-layer drift predicted per chip (band: min..max over the variants) "
                                            "beside this machine's measured line; predictions, not measurements")]


def _attribute_part(d: Path, env: dict[str, Any]) -> tuple[list[Block], list[str]]:
    from .view.attribute import report_part

    return report_part(_result(d))


PARTS["attribute"] = _attribute_part  # issue 29
PART_TITLES["attribute"] = KIND_TITLES["attribute"] = "Which op: local drift per op and layer, and the counterfactual"
FIGURES["attribute"] = [("attribute.png", "local drift per op and layer; the envelope left per counterfactual class")]


def _upgrade_part(d: Path, env: dict[str, Any]) -> tuple[list[Block], list[str]]:
    from .view.upgrade import upgrade_part

    return upgrade_part(_result(d))


PARTS["upgrade"] = _upgrade_part  # issue 48
KIND_TITLES["upgrade"] = "Should I upgrade mlx? The class of the change on this model, and why"


def _environment(d: Path, parts: list[tuple[Path, str]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The environment record and the model description found in a results directory."""
    env = _json(d / "env.json") or {}
    model: dict[str, Any] = {}
    for p, _ in parts:
        r = _result(p)
        env = env or dict(r.env)
        m = r.inputs.get("model")
        if isinstance(m, dict) and not model:
            model = m
    return env, model


def _environments(parts: list[tuple[Path, str]]) -> str:
    """What the page's environment line says where its results record no one environment: the machines and
    releases they come from (the asv history), else that none was recorded."""
    for p, _ in parts:
        r = _result(p)
        t = r.tables.get("history")
        if t is not None and len(t) and {"machine", "backend", "release"} <= set(t.columns):
            machines = sorted({f"{m} ({b})" for m, b in zip(t["machine"], t["backend"])})
            n = len(set(t["release"]))
            return (f"environments: one per machine and release, {len(machines)} machine"
                    f"{'s' if len(machines) > 1 else ''} ({', '.join(machines)}) × {n} release{'s' if n > 1 else ''}"
                    f", from asv's results ({', '.join(map(str, r.inputs.get('results') or [])) or '?'})")
    return "environment: not recorded in these results"


def report_blocks(d: str | Path) -> list[Block]:
    """The report page of a results directory (one command's output, or a `gemmdrift run` directory)."""
    from .model import describe

    d = Path(d)
    if d.is_file():
        raise GemmdriftError(f"{d} is a file, not a results directory")
    if not d.is_dir():
        raise GemmdriftError(f"no such results directory: {d}")
    parts = find_parts(d)
    if not parts and _mode_blocks(d) is not None:
        return _mode_blocks(d)
    if not parts:
        raise GemmdriftError(f"no gemmdrift results in {d} (expected the output of {KINDS_READ})")
    env, model = _environment(d, parts)
    head = []
    if model:
        head.append(f"model: {describe(model)}")
    if env:
        head.append(f"mlx {env.get('mlx')}, mlx-lm {env.get('mlx_lm')}, backend **{env.get('backend')}** "
                    f"({env.get('device_name')}, {env.get('architecture')}), {env.get('os')}, "
                    f"python {env.get('python')}; recorded {env.get('time_utc')}")
    if not head:  # no one environment (the asv history: one per machine and release)
        head.append(_environments(parts))
    sections: list[Block] = []
    reading: list[Any] = []  # lines, and a table where findings are one (the cache state)
    read = []  # the parts as the answer reads them
    for i, (p, kind) in enumerate(parts, 1):
        blocks, said = PARTS.get(kind, _generic_part)(p, env)
        title = PART_TITLES.get(p.name) or KIND_TITLES.get(kind, kind)
        sections += [("h2", f"{i}. {title}" if len(parts) > 1 else title)]
        if p != d:
            sections.append(("p", f"From `{p.name}/`."))
        part = _result(p).inputs.get("partial") if (p / store.MARKER).is_file() else None
        if isinstance(part, dict):  # an interrupted command's finished units (gemmdrift.checkpoint)
            note = (f"`{p.name}/` is **partial**: interrupted after {part.get('done')} of {part.get('total')} "
                    f"{part.get('unit', 'units')}; rerun the same command with the same `--out` to resume it.")
            sections.append(("p", note))
            reading.append(note)
        predicted = replay_note(_result(p)) if (p / store.MARKER).is_file() else None
        if predicted:  # replayed kernels (--kernels replay:<chip>): a prediction, said before any number
            sections.append(("p", predicted))
            reading.append(predicted)
        sections += blocks + _figures(p, d, kind)
        reading += said
        read.append(answer.Part(p.name, kind, i, _result(p)))
    run = (d / "env.json").is_file()  # a `gemmdrift run` directory: say which parts are still missing
    missing = [name for name in PART_TITLES if run and not (d / name / "done.json").is_file()]
    reading += [f"`{name}/` has not finished: rerun `gemmdrift run` with the same `--out` to resume it."
                for name in missing]
    shows: list[Block] = []
    for item in reading:  # consecutive lines as one list, a table as itself
        if isinstance(item, tuple):
            shows.append(item)
        elif shows and shows[-1][0] == "ul":
            shows[-1][1].append(item)
        else:
            shows.append(("ul", [item]))
    shows = shows or [("ul", [])]
    if run or parts[0][0] != d:  # the first screen: the answer to the question, from the parts below
        first = [("h2", answer.QUESTION), ("ul", [c.line() for c in answer.answer(read, missing)]),
                 ("p", " · ".join(head))]
    else:
        first = [("ul", head)]
    return ([("h1", f"gemmdrift report: {d.name}")] + first + [("h2", "What this shows")] + shows
            + sections + [("h2", "How to read this"), ("ul", HOW_TO_READ)])


def build_report(d: str | Path) -> dict[str, Path]:
    """Write ``report.md`` and ``report.html`` (self-contained) into a results directory."""
    d = Path(d)
    blocks = report_blocks(d)
    return {"markdown": files.write_text(d / "report.md", to_markdown(blocks)),
            "html": files.write_text(d / "report.html", to_html(blocks, d))}


