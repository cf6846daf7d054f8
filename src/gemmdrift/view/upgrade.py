"""How an ``upgrade`` Result reads: its summary (``--json``), its printed text and its report section.

*from* is the release compared with (the old one), *to* the release judged. Registered in
:mod:`gemmdrift.view.summaries` and :mod:`gemmdrift.report` like every kind.
"""

from __future__ import annotations

from typing import Any

from ..result import Result
from ..text import fmt, nth_generated


def _side(s: dict[str, Any]) -> str:
    return f"mlx {s.get('mlx')} with mlx-lm {s.get('mlx_lm')} ({s.get('how')}: {s.get('python')})"


def _line(text: str) -> str:
    """A generated text on one line (its newlines shown as \\n)."""
    return str(text).replace("\r", "\\r").replace("\n", "\\n")


def upgrade_summary(result: Result) -> dict[str, Any]:
    d, i = result.details, result.inputs
    first = d.get("first_op")
    part = d.get("parting", {})
    return {"kind": "upgrade", "class": d["class"], "reason": d["reason"], "allow": d["allow"], "pass": d["pass"],
            "from": dict(i["from"]), "to": dict(i["to"]), "model": i["model"], "dtype": i["dtype"],
            "tokens": i["tokens"], "compared_positions": i["compared_positions"],
            "first_op": None if first is None else {k: first[k] for k in ("layer", "op", "frac_differ", "max_ulp")},
            "ops_changed": d["ops"]["changed"], "ops_compared": d["ops"]["compared"],
            "logits": {k: d["logits"][k] for k in ("kld_mean", "kld_p99.9", "same_top1", "same_top1_share", "flips",
                                                   "max_abs_dlogit", "positions", "bit_identical")},
            "greedy": {k: part.get(k) for k in ("generated", "index", "token_old", "token_new", "verdict", "reason",
                                                "margin", "envelope", "text_old", "text_new")},
            "speed": d["speed"], "ladder": {k: v for k, v in d["ladder"].items() if k != "rung"},
            "decode_vs_verify2": d["envelopes"], "by_direction": d.get("by_direction"),
            "seconds": d.get("seconds", {})}


def _by_direction(judged: dict[str, list[dict[str, Any]]]) -> str:
    """'the class figures by direction (as the gate judges them): 1 worse (decode_verify2/envelope 0.25 → 0.5),
    0 better, 0 within, 70 news (changed either way: top-1s, greedy tokens, the logits' bits, ops)'."""
    def named(rows):
        shown = ", ".join(f"{r['figure']} {fmt(r['old'])} → {fmt(r['new'])}" for r in rows[:3])
        return f" ({shown}{', …' if len(rows) > 3 else ''})" if rows else ""

    return ("the class figures by direction (as the gate judges them): "
            + ", ".join(f"{len(judged.get(v, []))} {v}" + (named(judged.get(v, [])) if v != "news" else "")
                        for v in ("worse", "better", "within", "news"))
            + " (changed either way: top-1s, greedy tokens, the logits' bits, ops)")


def reading(result: Result) -> list[str]:
    """The answer in words, one line each."""
    d, i = result.details, result.inputs
    lg, part, sp, first = d["logits"], d["parting"], d["speed"], d.get("first_op")
    lines = [f"**{d['class']}** ({'PASS' if d['pass'] else 'FAIL'}: --allow {d['allow']}): {d['reason']}",
             f"from: {_side(i['from'])}", f"to:   {_side(i['to'])}",
             f"model {i['model']} ({i['dtype']}), {i['tokens']} tokens ({i['prompt']}); logits compared at positions "
             f"{i['compared_positions']}, ops captured at {i['capture_positions']}"]
    if first is None:
        lines.append(f"first op that moved: none of {d['ops']['compared']} captured op calls computes other bits")
    else:
        lines.append(f"first op that moved (forward order): {first['op']} of layer {first['layer']}, "
                     f"{100 * first['frac_differ']:.1f}% of its elements, max {fmt(first['max_ulp'])} ULP "
                     f"({d['ops']['changed']} of {d['ops']['compared']} op calls moved: "
                     f"{', '.join(d['ops']['ops_changed'][:8])})")
    if d["ops"]["errors"]:
        lines.append(f"{len(d['ops']['errors'])} captured op calls could not run under one release "
                     f"(first: {d['ops']['errors'][0]['op']}: {d['ops']['errors'][0]['error']})")
    lines.append("logits: bit-identical at every compared position" if lg["bit_identical"] else
                 f"logits: KLD(from ‖ to) mean {fmt(lg['kld_mean'])}, 99.9% {fmt(lg['kld_p99.9'])}; same top-1 "
                 f"{lg['same_top1']}/{lg['positions']}; {lg['flips']} flips; max |Δlogit| {fmt(lg['max_abs_dlogit'])}")
    if part["index"] is None:
        lines.append(f"greedy: the {part['generated']} tokens agree")
    else:
        lines.append(f"greedy: the streams part at {nth_generated(part['index'])} ({part['token_old']} under from, "
                     f"{part['token_new']} under to): {part['verdict']}: {part['reason']}")
    lad = d["ladder"]
    lines.append(f"precision ladder: {lad.get('why')}")
    if d.get("by_direction") is not None:  # Results written before directions have none
        lines.append(_by_direction(d["by_direction"]))
    rounds = ("one round, the two releases in turn" if sp["rounds"] == 1 else
              f"medians of {sp['rounds']} alternating rounds")
    lines.append(f"speed (to / from, {rounds}; a shared machine): prefill "
                 f"{fmt(sp['prefill_tok_s']['old'])} -> {fmt(sp['prefill_tok_s']['new'])} tok/s "
                 f"(x{sp['prefill_tok_s']['ratio']:.3f}), decode {fmt(sp['decode_tok_s']['old'])} -> "
                 f"{fmt(sp['decode_tok_s']['new'])} tok/s (x{sp['decode_tok_s']['ratio']:.3f})")
    for label, e in d["envelopes"].items():
        lines.append(f"decode vs verify:2 under {label} (mlx {i[label]['mlx']}): "
                     + ("bit-identical" if e["bit_identical"] else
                        f"envelope (max |Δgap|) {fmt(e['envelope'])}, max |Δlogit| {fmt(e['max_abs_dlogit'])}, "
                        f"{e['flips']} flips") + f" over {e['positions']} positions")
    return lines


def upgrade_text(result: Result) -> str:
    d = result.details
    lines = [f"== upgrade: mlx {result.inputs['from']['mlx']} -> {result.inputs['to']['mlx']}"]
    lines += [x.replace("**", "") for x in reading(result)]
    part = d["parting"]
    if part["index"] is not None:
        lines += ["", f"greedy under from: {part['text_old']!r}", f"greedy under to:   {part['text_new']!r}"]
    return "\n".join(lines)


def upgrade_part(result: Result) -> tuple[list[tuple], list[str]]:
    """The report section: the reading, the ops that moved, the greedy streams and the speed rounds."""
    d = result.details
    blocks: list[tuple] = [("ul", reading(result))]
    ops = result.tables.get("ops")
    if ops is not None and len(ops):
        blocks += [("p", "Ops whose output bits differ, in forward order (the first 30):"),
                   ("table", ops.head(30).to_dict(orient="records"))]
    part = d["parting"]
    blocks += [("p", "Greedy output from the same prompt (…" + repr(part.get("prompt_tail", ""))[1:-1] + "):"),
               ("pre", f"from: {_line(part['text_old'])}\nto:   {_line(part['text_new'])}")]
    sp = result.tables.get("speed")
    if sp is not None and len(sp):
        blocks += [("p", "Speed rounds, alternating the two releases (tokens per second; the machine may be shared):"),
                   ("table", sp.to_dict(orient="records"))]
    said = (f"upgrade mlx {result.inputs['from']['mlx']} -> {result.inputs['to']['mlx']}: **{d['class']}** "
            f"({d['reason']}).")
    return blocks, [said]
