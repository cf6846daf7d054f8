"""The changelog's pages: one page per release pair (Markdown and HTML) and an index.

A page is a list of blocks (``("h", level, text)``, ``("p", text)``, ``("list", items)``,
``("table", headers, rows)``), written once and rendered twice: :func:`markdown` and :func:`html`.
Inline text uses Markdown's backticks and ``[text](target.md)`` links; the HTML rendering turns them into
``<code>`` and ``<a href="target.html">``.
"""

from __future__ import annotations

import html as _html
import math
import re
from typing import Any, Mapping, Sequence

from ..checks import split_release
from . import Measured, page_name
from .bisected import HISTORY_END, Answer, PageBisections

Block = tuple


def num(v: float) -> str:
    """A figure as the page prints it: 4 significant digits, integers as integers."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float) and math.isinf(v):
        return "∞" if v > 0 else "-∞"
    if float(v).is_integer() and abs(v) < 1e15:
        return str(int(v))
    return f"{v:.4g}"


def past_gate(r: dict[str, Any]) -> str:
    """The mark of a figure the gate fails (its verdict, by the figure's direction: lower-is-better figures grow past
    it, higher-is-better ones fall past it), else ''. The section's count is of the same flag
    (:func:`gemmdrift.changelog.measured`)."""
    if not r.get("regression"):
        return ""
    return " (fell past the gate)" if r.get("direction") == "higher" else " (grew past the gate)"


def ratio(r: dict[str, Any]) -> str:
    return ("from 0" if math.isinf(r["ratio"]) else f"×{r['ratio']:.3g}") + past_gate(r)


def figure(r: dict[str, Any]) -> str:
    return f"`{r['benchmark']}" + (f"[{r['params']}]" if r["params"] else "") + "`"


def measured_blocks(m: Measured) -> list[Block]:
    """The "Measured here" section."""
    out: list[Block] = [("h", 2, "Measured here")]
    if m.note:
        have = "; ".join(f"{r}: {', '.join(ms)}" for r, ms in m.only.items())
        return out + [("p", m.note + "." + (f" Results exist for {have}." if have else ""))]
    for e in m.machines:
        out.append(("h", 3, f"{e['machine']} ({e['backend']})"))
        lm = lm_also(e)
        if lm and split_release(m.old)[0] == split_release(m.new)[0]:  # an mlx-lm pair: mlx did not change
            out.append(("p", f"The pair changes mlx-lm alone ({lm}, mlx {split_release(m.new)[0]} on both sides): "
                             "a changed figure is mlx-lm's change (its model code, its cache-state verdicts), "
                             "not mlx's."))
        elif lm:
            split = (" The bridge splits it: see \"Whose change moved the figures\"." if e.get("split", {}).get("steps")
                     else "")
            out.append(("p", f"On this machine the pair changes mlx-lm too ({lm}): a changed figure may be "
                             "mlx-lm's (its cache-state verdicts are mlx-lm's code) as well as mlx's." + split))
        n_changed = e["compared"] - e["identical"]
        if not n_changed:
            out.append(("p", f"No drift figure changed: {e['identical']} of {e['compared']} drift figures identical "
                             "(the summation trees and op probe rows among them)."))
        else:
            gate = (f"; {e['regressions']} worse than the gate's threshold allows" if e["regressions"] else
                    "; none worse than the gate's threshold allows")
            out.append(("p", f"{e['identical']} of {e['compared']} drift figures identical, {n_changed} changed"
                             f"{gate}."))
        if e["changed"]:
            out.append(("table", ["figure", "before", "after", "ratio"],
                        [[figure(r), num(r["old"]), num(r["new"]), ratio(r)] for r in e["changed"]]))
        if n_changed:
            out.append(("p", "**Summation trees.** " + ("None changed." if not e["trees"] else
                                                         f"{len(e['trees'])} changed:")))
            if e["trees"]:
                out.append(("table", ["path", "T", "tree before", "tree after"],
                            [[f"`{t['path']}`", t["T"], f"`{t['old']}`", f"`{t['new']}`"] for t in e["trees"]]))
            out.append(("p", "**Op probe rows.** " + ("None changed bits." if not e["probe"] else
                                                        f"{len(e['probe'])} changed:")))
            if e["probe"]:
                out.append(("table", ["probe row", "before", "after", "ratio"],
                            [[figure(r), num(r["old"]), num(r["new"]), ratio(r)] for r in e["probe"]]))
        golden = e["golden"]
        if golden:
            out.append(("p", "**Golden logits** (KLD of each release against the shipped base):"))
            out.append(("table", ["figure", "before", "after", "ratio"],
                        [[figure(r), num(r["old"]), num(r["new"]), ratio(r) if r["old"] != r["new"] else "="]
                         for r in golden]))
        else:
            out.append(("p", "**Golden logits.** Not measured for both releases in these results."))
    return out


def _range(a: Answer) -> str:
    """An answer's range: its two ends, and the directory's tags where an end is a commit inside them."""
    ends = f"{a.good}..{a.bad}"
    whole = f"{a.range[0]}..{a.range[1]}"
    return f"{a.project} {ends}" + ("" if ends == whole else f" (inside {whole})")


def _commit(a: Answer, c: Mapping[str, Any]) -> str:
    sha = str(c.get("commit", ""))
    return f"[{sha[:12]}]({a.commit_link(sha)}) \"{c.get('subject', '?')}\""


def answer_line(a: Answer) -> str:
    """One bisection's answer: the first commit (linked hash, subject, pull request link), the commit before it,
    the figures that moved (before → after), and where the answer and the commits' JSON are stored."""
    n_skip = f"{len(a.skipped)} skipped" if a.skipped else "none skipped"
    head = (f"**{_range(a)}**, run with {a.ran_with} ({_first_few(f'`{f}`' for f in a.figures)}; {a.commits} "
            f"commits, {a.measured} measured, {n_skip})")
    stored = f"Stored: `{a.where}`, each measured commit's JSON beside it."
    if not a.changed:
        vals = _first_few(f"`{k}` {num(v)}" for k, v in a.values.items())
        return f"{head}: no change in this range ({vals} at both ends). {stored}"
    pr = a.first.get("pr")
    first = _commit(a, a.first) + (f", pull request [#{pr}]({a.pr_link(pr)})" if pr else ", no pull request named")
    others = [c for c in a.candidates if c != a.first.get("commit")]
    at = ("the change is at one of the skipped commits " + ", ".join(f"[{c[:12]}]({a.commit_link(c)})" for c in others)
          + " or at " if others else "the first commit that changes it is ")
    moved = "; ".join(f"`{k}` {num(x)} → {num(y)}" for k, x, y in a.moved()) or "no figure differs"
    return f"{head}: {at}{first}, after {_commit(a, a.before)}: {moved}. {stored}"


def _first_few(items, n: int = 6) -> str:
    """The first ``n`` items, and how many more (an answer over ``any`` figure has dozens)."""
    items = list(items)
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


def _span(project: str, a: str, b: str) -> str:
    return f"{project} {a} → {b}"


def nothing_moved(m: Measured | None, package: str) -> str:
    """Why ``package``'s range of the pair needs no bisection, or "" when a machine saw it move: the pair is
    BIT-FOR-BIT on every machine measured, or, where it is not, its step of that package is (the bridge: the other
    package held fixed, :mod:`gemmdrift.changelog.bridged`)."""
    if m is None or not m.machines:
        return ""
    moved = [e for e in m.machines if e["class"].cls != "BIT-FOR-BIT"]
    if not moved:
        return "BIT-FOR-BIT on every machine measured"
    for e in moved:
        steps = [(s, p, q) for pkg, s, p, q in (e.get("split") or {}).get("steps", []) if pkg == package]
        if not steps or any(s["class"].cls != "BIT-FOR-BIT" for s, _, _ in steps):
            return ""
    (_, p, q), other = steps[0], "mlx-lm" if package == "mlx" else "mlx"
    held = p[1] if package == "mlx" else p[0]
    return f"BIT-FOR-BIT with {other} {held} on both sides (the bridge)"


def bisect_blocks(b: PageBisections, m: Measured | None = None) -> list[Block]:
    """The "Which commit changed it" section: each bisection inside the pair's ranges
    (:func:`gemmdrift.changelog.bisected.for_pair`), then the parts no bisection covers, in one line: nothing to
    bisect (the range moved no figure: :func:`nothing_moved`), not bisected yet, or outside the history we have
    (never guessed)."""
    out: list[Block] = [("h", 2, "Which commit changed it")]
    if b.answers:
        out.append(("p", "Bisected (`gemmdrift bisect`, `docs/bisect.md`): the first commit of each range at "
                         "which the figures differ from the good end's, measured, not read from a commit message."))
        out.append(("list", [answer_line(a) for a in b.answers]))
    why = {g: nothing_moved(m, g[0]) for g in [*b.open, *b.outside]}
    still, outside = [g for g in b.open if not why[g]], [g for g in b.outside if not why[g]]
    rest = []
    if any(why.values()):
        rest.append("nothing to bisect in " + ", ".join(f"{_span(*g)} ({w})" for g, w in why.items() if w))
    if still:
        rest.append(("not bisected yet: " if not b.answers else "the rest is not bisected yet: ")
                    + ", ".join(_span(*g) for g in still))
    if outside:
        rest.append("outside the history we have, so not bisected and no commit guessed: " + ", ".join(
            f"{_span(*g)} ({g[0]}'s history here ends at tag v{HISTORY_END[g[0]]})" for g in outside))
    if rest:
        line = "; ".join(rest) + "."
        out.append(("p", line[0].upper() + line[1:]))
    return out


def ops_blocks(m: Measured, ops: Sequence[dict[str, Any]]) -> list[Block]:
    """The "Which op moved" section, from the release comparisons of ops (:func:`gemmdrift.changelog.read_ops`)."""
    out: list[Block] = [("h", 2, "Which op moved")]
    moved = any(e["compared"] > e["identical"] for e in m.machines)
    if not ops:
        if m.machines and not moved:
            return out + [("p", "Nothing to attribute: no drift figure changed.")]
        return out + [("p", "No release comparison of ops for this pair (`gemmdrift attribute --python PATH` "
                            "recomputes every op from captured inputs under another release).")]
    for doc in ops:
        a, b = doc["from"], doc["to"]
        head = (f"Ops recomputed from inputs captured on {doc.get('machine', 'this machine')} "
                f"({_MODEL.get(doc.get('model'), doc.get('model', '?'))}, positions {doc.get('positions', '?')}), "
                f"mlx {a['mlx']} against mlx {b['mlx']} ({doc['compared']} op calls compared; "
                f"`{doc['file']}`).")
        out.append(("p", head))
        if not doc["changed"]:
            out.append(("p", "No op's output bits changed."))
        else:
            names = list(dict.fromkeys(c["op"] for c in doc["changed"]))
            out.append(("p", "The ops whose output bits changed, in forward order: "
                             + ", ".join(f"`{n}`" for n in names) + "."))
            out.append(("table", ["first layer", "op", "layers", "largest share of elements differing", "max ULP"],
                        [[str(c.get("first_layer", c.get("layer", "-"))), f"`{c['op']}`", str(c.get("layers", "-")),
                          num(c.get("frac_differ", math.nan)), num(c.get("max_ulp", math.nan))]
                         for c in _by_op(doc["changed"])]))
        if doc.get("counterfactual"):
            out.append(("p", "Counterfactual: " + str(doc["counterfactual"])))
        elif doc["changed"]:
            out.append(("p", "No counterfactual ran for this pair (the ops were recomputed from captured inputs; "
                             "the whole model did not run under both releases with one op class swapped)."))
    return out


_MODEL = {"embedded": "the embedded Gemma", None: "the embedded Gemma"}


def _by_op(changed: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per op name (forward order of first appearance): its layers, largest share and ULP."""
    rows: dict[str, dict[str, Any]] = {}
    for c in changed:
        r = rows.setdefault(c["op"], {"op": c["op"], "first_layer": c.get("layer", "-"), "layer_list": [],
                                      "frac_differ": 0.0, "max_ulp": 0.0})
        if c.get("layer") is not None:
            r["layer_list"].append(c["layer"])
        r["frac_differ"] = max(r["frac_differ"], float(c.get("frac_differ", 0.0)))
        r["max_ulp"] = max(r["max_ulp"], float(c.get("max_ulp", 0.0)))
    for r in rows.values():
        r["layers"] = compact_ranges(sorted(set(r.pop("layer_list")))) or "-"
    return list(rows.values())


def compact_ranges(xs: Sequence[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7'."""
    out, start, prev = [], None, None
    for x in list(xs) + [None]:
        if start is None:
            start = prev = x
        elif x is not None and x == prev + 1:
            prev = x
        else:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = x
    return ", ".join(out)


def summary(m: Measured, ops: Sequence[dict[str, Any]]) -> str:
    """The page's one-line answer, for the index."""
    if m.note:
        return "not measured here"
    parts = []
    for e in m.machines:
        n = e["compared"] - e["identical"]
        parts.append(f"{e['machine']}: " + (f"no drift figure changed ({e['compared']} series)" if not n else
                                             f"{n} of {e['compared']} drift figures changed"))
    names = list(dict.fromkeys(c["op"] for d in ops for c in d["changed"]))
    if names:
        parts.append("op moved: " + ", ".join(f"`{n}`" for n in names))
    return "; ".join(parts)


def machine_name(e: Mapping[str, Any]) -> str:
    """A measured entry's machine as pages and the index name it: ``reference-linux-cpu (cpu)``."""
    return f"{e['machine']} ({e['backend']})"


def disagree(m: Measured) -> bool:
    """Do the machines that measured the pair give it different classes?"""
    return len({e["class"].cls for e in m.machines if "class" in e}) > 1


def lm_also(e: Mapping[str, Any]) -> str:
    """``mlx-lm 0.31.2 → 0.31.3`` when a machine's entry ran the pair with two mlx-lm releases, else ''."""
    a, b = (list(e.get("mlx_lm") or []) + ["", ""])[:2]
    return f"mlx-lm {a} → {b}" if a and b and a != b else ""


def _what_changed(old: str, new: str) -> str:
    """Which package the pair changes: mlx, or mlx-lm alone (one mlx on both sides)."""
    (mo, lo), (mn, ln) = split_release(old), split_release(new)
    if mo == mn:
        return f"for mlx-lm's change (mlx-lm {lo or '?'} → {ln or '?'}, mlx {mn} on both sides)"
    return f"mlx {mo} → {mn}" + (f" (mlx-lm {lo} → {ln})" if lo and ln and lo != ln else "")


def opening(m: Measured, pred: Mapping[str, Mapping[str, Any]] | None = None,
            ops: Sequence[dict[str, Any]] = ()) -> list[Block]:
    """The page's first lines: its class and the one-line reason, always naming the machine a class is from. One
    machine measured: its class. Several that agree: that class, each machine's reason. Several that disagree: no
    class for the pair, a class per machine (most severe first), and the line says the machines disagree. With
    nothing measured, the most severe predicted class (said to be a prediction); with neither, no class."""
    from .classify import CLASSES

    pred = pred or {}
    entries = sorted((e for e in m.machines if "class" in e), key=lambda e: -CLASSES.index(e["class"].cls))
    measured = [(machine_name(e), e["class"]) for e in entries]
    predicted = [(chip, p) for chip, p in pred.items() if p.get("cls") in CLASSES]
    what = _what_changed(m.old, m.new)
    lm_pair = "mlx-lm" in what
    if len(entries) == 1:
        (who, pc), lm = measured[0], lm_also(entries[0])
        if lm and not lm_pair:  # a bare label hides the machine's mlx-lm
            what += f" (and there {lm})"
        line = f"**Class: {pc.cls}**, {what}, measured on {who}: {pc.reason}."
    elif entries:
        each = "; ".join(f"on {who}" + (f" (and there {lm_also(e)})" if lm_also(e) and not lm_pair else "")
                         + f": {pc.reason}" for (who, pc), e in zip(measured, entries))
        if len({pc.cls for _, pc in measured}) == 1:
            line = (f"**Class: {measured[0][1].cls}**, {what}, measured on "
                    f"{' and '.join(who for who, _ in measured)}, the same class on each: {each}.")
        else:
            per = ", ".join(f"{pc.cls} on {who}" for who, pc in measured)
            line = f"**Class per machine: {per}** (the machines disagree), {what}: {each}."
    elif predicted:
        chip, p = max(predicted, key=lambda x: CLASSES.index(x[1]["cls"]))
        line = f"**Class: {p['cls']}, predicted**, {what}, not measured here ({chip}): {p['reason']}."
    else:
        line = f"**Class: none**, {what}: not measured here, and no chip's dispatch predicts it."
    names = list(dict.fromkeys(c["op"] for d in ops for c in d["changed"]))
    if names:
        line += " The op that moved: " + ", ".join(f"`{n}`" for n in names) + " (the release comparison of ops below)."
    out: list[Block] = [("p", line)]
    every = [f"{who}: {pc.cls}" for who, pc in sorted(measured, key=lambda x: x[0])]
    every += [f"{chip} (predicted): {p.get('cell', '-')}" for chip, p in pred.items() if p.get("cell", "-") != "-"]
    if len(every) > 1:
        out.append(("p", "Per machine and chip: " + "; ".join(every) + "."))
    mixed = [r for r in (m.old, m.new) if len(m.commits.get(r, [])) > 1]
    if m.machines and not mixed and m.commits.get(m.old) and m.commits.get(m.new) \
            and m.commits[m.old] != m.commits[m.new]:
        out.append(("p", f"Measured at two gemmdrift commits ({m.old}: {m.commits[m.old][0]}, {m.new}: "
                         f"{m.commits[m.new][0]}): a difference could be gemmdrift's as well as the release's."))
    return out


def page(m: Measured, ops: Sequence[dict[str, Any]], predicted: Sequence[Block], inputs: str,
         pred: Mapping[str, Mapping[str, Any]] | None = None, bisected: PageBisections | None = None,
         whose: Sequence[Block] = ()) -> list[Block]:
    """All blocks of one pair's page: the class first (see :func:`opening`), which commit changed it (the
    bisections, :func:`bisect_blocks`), whose change moved the figures (``whose``, the bridges' section:
    :func:`gemmdrift.changelog.bridged.blocks`), then the three sections."""
    (mo, lo), (mn, ln) = split_release(m.old), split_release(m.new)
    title = (f"mlx-lm {lo or '?'} → {ln or '?'} with mlx {mn}: what changed in the bits" if mo == mn else
             f"mlx {m.old} → {m.new}: what changed in the bits")
    cmd = f"gemmdrift changelog --from {m.old} --to {m.new}"
    return ([("h", 1, title)] + opening(m, pred, ops)
            + [("p", f"Written by `{cmd}` from {inputs}. Back to the [index](index.md).")]
            + (bisect_blocks(bisected, m) if bisected is not None else []) + list(whose) + measured_blocks(m)
            + ops_blocks(m, ops) + list(predicted))


def index(rows: Sequence[tuple[str, str, str]], inputs: str) -> list[Block]:
    """The index: one line per pair (old, new, summary), newest first."""
    items = [f"[{old} → {new}]({page_name(old, new)}.md): {s}" for old, new, s in rows]
    return [("h", 1, "The numerics changelog of mlx"),
            ("p", "Per pair of releases: what changed in the bits on the machines measured here, which op moved, "
                  "and what each chip's dispatch predicts (predictions, never measurements). Written by "
                  f"`gemmdrift changelog` from {inputs}; `make changelog` writes these pages again."),
            ("list", items)]


# ------------------------------------------------------------------ rendering


def markdown(blocks: Sequence[Block]) -> str:
    out = []
    for b in blocks:
        if b[0] == "h":
            out.append("#" * b[1] + " " + b[2])
        elif b[0] == "p":
            out.append(b[1])
        elif b[0] == "list":
            out.append("\n".join(f"- {i}" for i in b[1]))
        elif b[0] == "img":
            out.append(f"![{b[1]}]({b[2]})")
        elif b[0] == "table":
            headers, rows = b[1], b[2]
            lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
            lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]
            out.append("\n".join(lines))
    return "\n\n".join(out) + "\n"


_CODE = re.compile(r"`([^`]+)`")
_LINK = re.compile(r"\[([^\]]+)\]\(([^)]+?)(\.md)?\)")
_BOLD = re.compile(r"\*\*([^*]+)\*\*")


def inline(text: str) -> str:
    """Markdown inline (code, links to .md pages, bold) as HTML."""
    parts = re.split(r"(`[^`]+`)", str(text))
    out = []
    for p in parts:
        if p.startswith("`") and p.endswith("`") and len(p) > 1:
            out.append(f"<code>{_html.escape(p[1:-1])}</code>")
        else:
            s = _html.escape(p, quote=False)
            s = _LINK.sub(lambda m: f'<a href="{m.group(2)}{".html" if m.group(3) else ""}">{m.group(1)}</a>', s)
            out.append(_BOLD.sub(r"<strong>\1</strong>", s))
    return "".join(out)


def html(blocks: Sequence[Block]) -> str:
    title = next((b[2] for b in blocks if b[0] == "h"), "gemmdrift changelog")
    body = []
    for b in blocks:
        if b[0] == "h":
            body.append(f"<h{b[1]}>{inline(b[2])}</h{b[1]}>")
        elif b[0] == "p":
            body.append(f"<p>{inline(b[1])}</p>")
        elif b[0] == "img":
            body.append(f'<p><img src="{_html.escape(b[2])}" alt="{_html.escape(b[1])}" style="max-width:100%"></p>')
        elif b[0] == "list":
            body.append("<ul>\n" + "\n".join(f"<li>{inline(i)}</li>" for i in b[1]) + "\n</ul>")
        elif b[0] == "table":
            head = "".join(f"<th>{inline(h)}</th>" for h in b[1])
            rows = "\n".join("<tr>" + "".join(f"<td>{inline(c)}</td>" for c in r) + "</tr>" for r in b[2])
            body.append(f"<table>\n<tr>{head}</tr>\n{rows}\n</table>")
    style = ("body{font-family:sans-serif;max-width:60em;margin:2em auto;line-height:1.4}"
             "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 6px;text-align:left}"
             "code{font-size:90%}")
    plain = _html.escape(_CODE.sub(lambda m: m.group(1), title))
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>{plain}"
            f"</title><style>{style}</style></head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n")


__all__ = ["page", "index", "markdown", "html", "summary", "measured_blocks", "ops_blocks", "bisect_blocks",
           "nothing_moved", "num"]
