"""The changelog's "Predicted per chip" section: dispatch differences between two releases, and the replayed
decode-vs-verify envelope under each release's recipes.

Dispatch: :func:`gemmdrift.dispatch.choose` (read from the mlx source, no mlx import) for every projection and
the LM head of the embedded Gemma (Gemma 3 270M's shapes, ``models.SHAPES["gemma3-270m"]``) and of
``shape:gemma4-31b``, dense bfloat16 and quantized affine 4 and 8 bits (group 64), and attention (T queries
against the sliding window's keys), T = 1..33, on every named Apple chip class and size (M1..M5, base, Max,
Ultra) and on sm80 and sm90. The rules were read for every tag from 0.26.5 (CUDA sdpa from 0.30.5,
:data:`gemmdrift.dispatch.tags.READ_FROM`); an older part follows the rules of a release read where its sources are
byte-identical ("as 0.30.5"), else it is "not read"; one newer than the source read is given that source's rules, and
the page says so. Each row that differs names the mlx commit(s) and pull request(s) whose rule moved it
(:func:`gemmdrift.dispatch.changed_by`, the rules of :mod:`gemmdrift.dispatch.commits`).

Envelope: :func:`gemmdrift.replay.predict.predict_drift` (the main job's replay part, one chip at a time, default
variant) under each release's recipes, decode vs verify:2 and verify:3 on the embedded Gemma. A replay is
computed once per (chip, release's plan signature) and kept in a JSON cache (the shipped one beside the pages,
``docs/changelog/replayed.json``); pages are written from the cache, and ``--replay`` computes what is
missing (it loads the model). Where the kernels' order is not knowable it says which: chosen at run time
(cuBLASLt's heuristic) or hidden in hardware (NAX's matmul2d).
Every line of this section says it is a prediction.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Sequence

from ..checks import split_release
from ..errors import GemmdriftError

T_MAX = 33
WEIGHTS = (("bf16", None), ("q4", 4), ("q8", 8))  # dense bfloat16; affine 4 and 8 bits, group 64
GROUP = 64
MODELS = (("the embedded Gemma", "gemma3-270m"), ("`shape:gemma4-31b`", "gemma4-31b"))
ENVELOPE_CHIPS = ("M1", "M2", "M3", "M4", "M5", "sm90")  # replayed envelopes: one per GPU class (base size)
ENVELOPE_KEYS = ("max_abs_dlogit", "max_abs_dgap", "flips")
PREDICTION = "prediction"
NOT_KNOWABLE = "not knowable"  # only for orders chosen at run time (cuBLASLt) or hidden in hardware (NAX)
NOT_READ = "not read"  # a part of a release whose dispatch source was not read


def chips() -> list[Any]:
    """M1..M5 in every named size, then sm80 and sm90."""
    from ..dispatch import CHIPS

    metal = [c for c in CHIPS.values() if c.backend == "metal"]
    cuda = [CHIPS[n] for n in ("sm80", "sm90")]
    return metal + cuda


def projection_shapes(name: str) -> list[tuple[str, int, int]]:
    """(projection, K, N) of a model's layers and LM head, from its HF config in ``models.SHAPES``."""
    from ..model import SHAPES

    c = SHAPES[name]
    h, inter, heads, kv, hd = (c["hidden_size"], c["intermediate_size"], c["num_attention_heads"],
                               c["num_key_value_heads"], c["head_dim"])
    out = [("q_proj", h, heads * hd), ("k_proj", h, kv * hd), ("v_proj", h, kv * hd), ("o_proj", heads * hd, h),
           ("gate_proj", h, inter), ("up_proj", h, inter), ("down_proj", inter, h)]
    if c.get("global_head_dim"):  # Gemma 4's full-attention layers: their own head dim and kv heads
        ghd, gkv = c["global_head_dim"], c.get("num_global_key_value_heads", kv)
        out += [("q_proj (global)", h, heads * ghd), ("k_proj (global)", h, gkv * ghd),
                ("o_proj (global)", heads * ghd, h)]
    return out + [("lm_head", h, c["vocab_size"])]


def sdpa_shape(name: str) -> dict[str, int]:
    from ..model import SHAPES

    c = SHAPES[name]
    return {"k_len": int(c["sliding_window"]), "head_dim": int(c["head_dim"]), "n_heads": int(c["num_attention_heads"]),
            "n_kv_heads": int(c["num_key_value_heads"])}


def _version_of(release: str) -> str:
    return split_release(release)[0]


PREDICTED_BACKENDS = ("metal", "cuda")  # the chips this section predicts (the CPU's rules are row-invariant)


def rules(release: str, backend: str, op: str):
    """Whose dispatch rules the release's ``op`` on ``backend`` follows (:func:`gemmdrift.dispatch.tags.rules_for`):
    its own from 0.30.5 on, an older tag's when its files are those of a release read ("as 0.30.5"), else none."""
    from ..dispatch.tags import rules_for

    return rules_for(_version_of(release), backend, op)


def knowable(release: str, backend: str | None = None) -> str | None:
    """Why a release's dispatch (on ``backend``, else on every predicted backend) is not predicted, or None: the
    first op whose rules were not read ("not read: ...")."""
    from ..dispatch import OPS

    for b in ((backend,) if backend else PREDICTED_BACKENDS):
        for op in OPS:
            r = rules(release, b, op)
            if r.version is None:
                return f"mlx {_version_of(release)}'s {b} {op} dispatch: {r.why}"
    return None


def sources_blocks(old: str, new: str) -> list[tuple]:
    """Where each release's rules come from, per backend and op: read, "as X.Y.Z" (files compared), assumed (newer
    than the source read), or not read (the files that differ); and whether the two releases' files of that
    part are byte-identical (a part whose files are unchanged dispatches and computes alike)."""
    from ..dispatch import OPS
    from ..dispatch.tags import same_sources

    if _version_of(old) == _version_of(new):
        return []
    rows = []
    for b in PREDICTED_BACKENDS:
        for op in OPS:
            cells = []
            for r in (old, new):
                ru = rules(r, b, op)
                cells.append(ru.why or "read")
            same = same_sources(old, new, b, op)
            rows.append([b, op] + cells + ["?" if same is None else ("yes" if same else "no")])
    return [("p", "Prediction: whose dispatch rules each release follows, per backend and op (from the git blobs "
                  "of every release tag's sources, `gemmdrift/data/dispatch_tags.json`):"),
            ("table", ["backend", "op", f"mlx {_version_of(old)}", f"mlx {_version_of(new)}", "same files"], rows)]


class Predictor:
    """The predicted section of each page; dispatch tables per release computed once, replayed envelopes
    cached per (chip, plan signature) in ``cache`` (JSON)."""

    def __init__(self, cache: Path | None = None, replay: bool = False):
        self.cache_path = Path(cache) if cache is not None else None
        self.replay = replay
        self._tables: dict[str, dict] = {}
        self._cache = self._load()
        self._dirty = False
        self._lm = None

    # ---------------------------------------------------------------- dispatch

    def table(self, release: str) -> dict[tuple, str]:
        """{(chip, model, weights, op, T): kernel label} under the release's mlx."""
        from ..dispatch import choose, label

        version = _version_of(release)
        if version in self._tables:
            return self._tables[version]
        out: dict[tuple, str] = {}
        for chip in chips():
            rv = {op: rules(release, chip.backend, op).version for op in ("matmul", "quantized_matmul", "sdpa")}
            for key, op, kw in calls(chip):
                out[key] = NOT_READ if rv[op] is None else label(choose(chip, op, mlx_version=rv[op], **kw))
        self._tables[version] = out
        return out

    def differences(self, old: str, new: str) -> list[dict[str, Any]]:
        """One row per (chip, model, weights, old kernel -> new kernel): the ops and T it holds for."""
        a, b = self.table(old), self.table(new)
        cause = self._causes(old, new, a, b)
        groups: dict[tuple, dict[str, set]] = {}
        for key, ka in a.items():
            kb = b[key]
            if ka == kb or NOT_READ in (ka, kb):  # a part not read is said by sources_blocks
                continue
            chip, model, weights, op, T = key
            g = groups.setdefault((chip, model, weights, ka, kb, cause.get(key, ())), {})
            g.setdefault(op, set()).add(T)
        rows = []
        for (chip, model, weights, ka, kb, rs), ops in groups.items():
            by_ts: dict[tuple, list[str]] = {}
            for op, ts in ops.items():
                by_ts.setdefault(tuple(sorted(ts)), []).append(op)
            for ts, names in by_ts.items():
                rows.append({"chip": chip, "model": model, "weights": weights, "ops": names, "T": list(ts),
                             "old": ka, "new": kb, "rules": rs})
        order = {c.name: i for i, c in enumerate(chips())}
        merged: dict[tuple, list[str]] = {}  # chips whose rows are the same share one row
        for r in rows:
            merged.setdefault((r["model"], r["weights"], tuple(r["ops"]), tuple(r["T"]), r["old"], r["new"],
                               r["rules"]), []).append(r["chip"])
        out = [{"chips": sorted(cs, key=order.get), "model": m, "weights": w, "ops": list(o), "T": list(t),
                "old": ka, "new": kb, "rules": list(rs)} for (m, w, o, t, ka, kb, rs), cs in merged.items()]
        return sorted(out, key=lambda r: (r["model"] != "gemma3-270m", r["weights"], order[r["chips"][0]], r["T"][0],
                                          r["ops"]))

    def _causes(self, old: str, new: str, a: dict, b: dict) -> dict[tuple, tuple[str, ...]]:
        """{key: names of the rules (dispatch.commits) that move it} for every key whose label differs, where both
        releases' rules of that op were read."""
        from ..dispatch import changed_by

        out: dict[tuple, tuple[str, ...]] = {}
        for chip in chips():
            rv = {op: (rules(old, chip.backend, op).version, rules(new, chip.backend, op).version)
                  for op in ("matmul", "quantized_matmul", "sdpa")}
            for key, op, kw in calls(chip):
                if a[key] != b[key] and None not in rv[op]:
                    out[key] = tuple(r.name for r in changed_by(chip, op, rv[op][0], rv[op][1], **kw))
        return out

    # ---------------------------------------------------------------- replayed envelopes

    def _load(self) -> dict[str, Any]:
        if self.cache_path is None or not self.cache_path.is_file():
            return {}
        try:
            d = json.loads(self.cache_path.read_text())
            if not isinstance(d, dict):
                raise ValueError("not a JSON object")
            return d
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise GemmdriftError(f"cannot read the replayed envelopes' cache {self.cache_path}: {e}") from None

    def save(self) -> None:
        if self._dirty and self.cache_path is not None:
            from ..files import write_text

            write_text(self.cache_path, json.dumps(self._cache, indent=1, sort_keys=True) + "\n")
            self._dirty = False

    def signature(self, chip: str, release: str) -> str:
        """What a replay of the embedded Gemma's dense bf16 projections on ``chip`` computes under the release:
        the recipe (kernel, parameters, default variant) the replay plans per projection at the T the predict
        part calls (1, 3, 4), or why it has none: equal signatures run the same recipes on the same inputs, so
        one replay serves every release that has it."""
        from ..dispatch import CHIPS
        from ..replay.paths import plan_for

        version = rules(release, CHIPS[chip].backend, "matmul").version or _version_of(release)
        parts = []
        for proj, K, N in projection_shapes("gemma3-270m"):
            for T in (1, 3, 4):
                try:
                    plan = plan_for(chip, "matmul", T=T, K=K, N=N, dtype="bfloat16", mlx_version=version)
                    what = (plan.recipe.kernel, sorted(plan.params.items()), sorted(plan.variant.items()))
                except GemmdriftError as e:
                    what = ("no recipe", re.sub(r"mlx [0-9.]+ ", "", str(e).partition(": ")[2]))  # the reason
                parts.append(f"{proj}@{T}={what}")
        return ";".join(parts)

    def envelope(self, chip: str, release: str) -> dict[str, Any] | None:
        """The cached replayed envelope (``verify:2``/``verify:3`` -> figures, or ``refused``), or None."""
        key = f"{chip}|{self.signature(chip, release)}"
        if key not in self._cache and self.replay:
            self._cache[key] = self._run(chip, release)
            self._dirty = True
            self.save()  # each replay kept as soon as it is computed: an interrupted --replay resumes
        return self._cache.get(key)

    def _run(self, chip: str, release: str) -> dict[str, Any]:
        from ..replay.predict import SIZES, PredictSizes, predict_drift

        if self._lm is None:
            from ..model import load_model

            self._lm = load_model("embedded")
        base = SIZES["cpu"]
        sizes = PredictSizes(tokens=base.tokens, split=base.split, chips=(chip,), variants="default")
        from ..dispatch import CHIPS

        version = rules(release, CHIPS[chip].backend, "matmul").version or _version_of(release)
        r = predict_drift(self._lm, sizes, mlx_version=version)
        env = r.tables["envelope"]
        env = env[(env["source"] == PREDICTION) & (env["chip"] == chip)]
        out: dict[str, Any] = {"mlx_recipes": version}
        for _, row in env.iterrows():
            out[row["schedule"].rpartition(",")[2]] = {k: float(row[k]) for k in ENVELOPE_KEYS if k in row}
        ref = r.tables["refused"]
        for _, row in ref[ref["chip"] == chip].iterrows():
            out.setdefault("refused", {})[row["schedule"].rpartition(",")[2]] = str(row["reason"])
        return out

    # ---------------------------------------------------------------- the section

    def blocks(self, old: str, new: str) -> list[tuple]:
        from .pages import compact_ranges, num

        out: list[tuple] = [("h", 2, "Predicted per chip"),
                            ("p", "Every line of this section is a prediction from the dispatch rules read from the "
                                  "mlx source (`gemmdrift dispatch --chip M3`) and the replay (`gemmdrift stack --kernels replay:M3`), "
                                  "not a measurement on that chip.")]
        if _version_of(old) == _version_of(new):  # an mlx-lm pair: the dispatch and the replay are mlx's
            return out + [("p", f"Nothing to predict: mlx {_version_of(new)} on both sides, so every chip "
                                "dispatches the same kernels; the pair changes mlx-lm alone, and what mlx-lm's "
                                "change does on a chip is not predicted (only measured, above).")]
        out += sources_blocks(old, new)
        ops3 = ("matmul", "quantized_matmul", "sdpa")
        blind = [r for r in (old, new) if all(rules(r, b, op).version is None for b in PREDICTED_BACKENDS for op in ops3)]
        if blind:
            return out + [("p", f"Prediction: not read: no part of mlx {_version_of(blind[0])}'s dispatch on "
                                "the chips predicted follows rules read from the mlx source (the table above).")]
        partial = any(knowable(r, b) for r in (old, new) for b in PREDICTED_BACKENDS)
        from ..dispatch import MIRROR_REVISION, MIRROR_VERSION, parse_version

        newer = [r for r in (old, new) if parse_version(_version_of(r)) > MIRROR_VERSION]
        if newer:
            out.append(("p", f"Prediction: mlx {', '.join(_version_of(r) for r in newer)} is newer than the source "
                             f"read ({MIRROR_REVISION}): its rules are taken as that source's."))
        rows = self.differences(old, new)
        names = {m: label for label, m in MODELS}
        if not rows and partial:
            out.append(("p", f"Prediction: no dispatch difference between mlx {_version_of(old)} and "
                             f"{_version_of(new)} in the parts read for both (the table above), T=1..{T_MAX}."))
        elif not rows:
            from ..dispatch.tags import same_sources

            moved = [f"{b} {op}" for b in PREDICTED_BACKENDS for op in ops3 if same_sources(old, new, b, op) is False]
            out.append(("p", f"Prediction: no dispatch difference between mlx {_version_of(old)} and "
                             f"{_version_of(new)} on any chip listed (M1..M5 in every size, sm80, sm90) for the "
                             "embedded Gemma's or `shape:gemma4-31b`'s projections (dense bf16, q4, q8) and "
                             f"attention, T=1..{T_MAX}."
                             + (f" The source files of {', '.join(moved)} changed: {_unmodelled(old, new)}"
                                if moved else "")))
        else:
            out.append(("p", f"Prediction: the kernel mlx {_version_of(new)} dispatches where mlx "
                             f"{_version_of(old)}'s differs (T=1..{T_MAX}; weights bf16 dense, q4/q8 affine "
                             f"group {GROUP}; chips without a row dispatch alike):"))
            out.append(("table", ["chips", "model", "weights", "ops", "T", f"mlx {_version_of(old)}",
                                  f"mlx {_version_of(new)}", "changed by (mlx commit, pull request)"],
                        [[", ".join(r["chips"]), names[r["model"]], r["weights"], ", ".join(f"`{o}`" for o in r["ops"]),
                          compact_ranges(r["T"]), r["old"], r["new"], commit_links(r["rules"])] for r in rows]))
        from ..dispatch import CHIPS

        env_rows, missing, unknown = [], [], []
        for chip in ENVELOPE_CHIPS:
            if any(rules(r, CHIPS[chip].backend, "matmul").version is None for r in (old, new)):
                unknown.append(chip)
                continue
            cells = []
            for rel in (old, new):
                e = self.envelope(chip, rel)
                if e is None:
                    cells.append(None)
                    continue
                cells.append(e)
            if None in cells:
                missing.append(chip)
                continue
            scheds = ["verify:2", "verify:3"] + (["decode-vs-cpu"] if any("decode-vs-cpu" in e for e in cells) else [])
            for sched in scheds:
                row = [chip, "decode vs this CPU's decode" if sched == "decode-vs-cpu" else sched]
                for e in cells:
                    if sched in e:
                        f = e[sched]
                        row.append(f"{num(f['max_abs_dlogit'])} / {num(f['max_abs_dgap'])} / {num(f['flips'])}")
                    else:
                        why = e.get("refused", {}).get(sched)
                        row.append("not knowable: " + _short(why) if why else "-")
                env_rows.append(row)
        if env_rows:
            out.append(("p", "Prediction: decode vs verify on the embedded Gemma (positions 1..4, one-token "
                             "prompt, each chip's default recipe variant) replayed under each release's recipes: "
                             "max |Δlogit| / max |Δgap| / argmax flips; where verification is not knowable, the chip's T=1 "
                             "kernels decoding the same stream against this CPU's decode."))
            out.append(("table", ["chip", "pair", f"mlx {_version_of(old)} (prediction)",
                                  f"mlx {_version_of(new)} (prediction)"], env_rows))
        if unknown:
            out.append(("p", "Prediction: the replayed envelope of " + ", ".join(unknown) + " is not predicted (its "
                             "matmul dispatch was not read, the table above)."))
        if missing:
            out.append(("p", "Prediction: the replayed envelope of " + ", ".join(missing) + " is not in the cache "
                             "(`gemmdrift changelog --replay` computes it)."))
        return out


def envelope_figures(e: dict[str, Any] | None) -> dict[str, float]:
    """A cached replayed envelope as figures for :func:`gemmdrift.changelog.classify.classify`: ``verify:2/flips``
    (an answer figure), ``verify:2/max_abs_dlogit``, ...; a refused schedule gives none."""
    out: dict[str, float] = {}
    for sched, f in (e or {}).items():
        if isinstance(f, dict) and sched not in ("refused",):
            out.update({f"{sched}/{k}": float(v) for k, v in f.items() if k in ENVELOPE_KEYS})
    return out


def chip_class(pred: "Predictor", chip: str, old: str, new: str) -> dict[str, Any]:
    """The predicted class of the pair on one chip class (its base size): ``{"cls": class or None, "cell": the
    timeline's cell text, "reason": one line}``. The replay reorders the same adds, so what it predicts moves by
    rounding by construction: ``ladder="rounding"``; a replayed argmax flip that changes is ANSWER-CHANGING. The
    same mlx on both sides (an mlx-lm pair): nothing to predict. A side whose dispatch was not read: "not read".
    A dispatch change the replay did not run (or cannot: NAX, cuBLASLt): the cell says so. A class that is not
    BIT-FOR-BIT names the mlx commit(s) and pull request(s) whose rule moved the dispatch."""
    from ..dispatch import MIRROR_VERSION, parse_version
    from .classify import BIT_FOR_BIT, ROUNDOFF, classify

    vo, vn = _version_of(old), _version_of(new)
    if vo == vn:
        return {"cls": None, "cell": "-", "reason": f"mlx {vn} on both sides: mlx-lm's change is not predicted"}
    from ..dispatch import CHIPS

    backend = CHIPS[chip].backend
    why = [w for w in (knowable(old, backend), knowable(new, backend)) if w]
    if why:
        return {"cls": None, "cell": NOT_READ, "reason": why[0]}
    assumed = [v for v in (vo, vn) if parse_version(v) > MIRROR_VERSION]
    tail = (f" (mlx {', '.join(assumed)} newer than the source read: its rules taken as "
            f"{'.'.join(map(str, MIRROR_VERSION))}'s)" if assumed else "")
    from ..dispatch import OPS
    from ..dispatch.tags import same_sources

    touched = [op for op in OPS if same_sources(vo, vn, backend, op) is False]
    if touched:  # the files changed although the rules read may give the same kernels: say so
        tail += (f"; the source files of {backend} {', '.join(touched)} changed between the two (the rules read "
                 "decide the kernels and their order)")
    rows = [r for r in pred.differences(old, new) if chip in r["chips"]]
    named = list(dict.fromkeys(n for r in rows for n in r["rules"]))
    moved = (f"the dispatch changes in {len(rows)} row{'s' if len(rows) > 1 else ''} (first: {rows[0]['weights']} "
             f"{', '.join(rows[0]['ops'])} T={compact(rows[0]['T'])} {rows[0]['old']} → {rows[0]['new']})"
             + (f", by {commit_links(named)}" if named else "") if rows else "")
    eo, en = pred.envelope(chip, old), pred.envelope(chip, new)
    fo, fn = envelope_figures(eo), envelope_figures(en)
    if eo is not None and en is not None and set(fo) & set(fn):
        pc = classify(fo, fn, ladder="rounding")
        if pc.cls == BIT_FOR_BIT and rows:
            return _named({"cls": ROUNDOFF, "cell": ROUNDOFF, "reason": f"{moved}; the replayed decode-vs-verify "
                                                                        f"envelope (bf16 dense) does not move{tail}"},
                          named)
        if pc.cls == BIT_FOR_BIT:
            return {"cls": BIT_FOR_BIT, "cell": BIT_FOR_BIT, "reason": "the same kernels dispatch for every shape "
                                                                       f"listed; the replayed envelope is identical{tail}"}
        reason = pc.reason.replace("the precision ladder says rounding",
                                   "rounding by construction (the replay reorders the same adds)")
        return _named({"cls": pc.cls, "cell": pc.cls, "reason": f"replayed: {reason}" + (f"; {moved}" if rows else "")
                       + tail}, named if pc.cls != BIT_FOR_BIT else [])
    if not rows:
        return {"cls": BIT_FOR_BIT, "cell": BIT_FOR_BIT, "reason": "the same kernels dispatch for every shape listed"
                                                                   f" (no replay needed){tail}"}
    # A side whose verification the replay refused (NAX, cuBLASLt) has no figure to set against the other side's,
    # whatever else it replayed (its T=1 decode): not knowable, as the page's envelope table says, and --replay
    # cannot change that.
    refused = [e for e in (eo, en) if e is not None and (not envelope_figures(e) or e.get("refused"))]
    if refused:
        reasons = [str(r) for e in refused for r in (e.get("refused") or {}).values()]
        why = _short(reasons[0]) if reasons else "refused"
        if why.startswith("NAX"):
            why += ": the order inside NAX's matmul2d is in the hardware, not in the source"
        return {"cls": None, "cell": "not knowable", "reason": f"{moved}; the replay cannot represent the kernels' "
                                                               f"order ({why})"}
    return {"cls": None, "cell": "not replayed", "reason": f"{moved}; the envelope is not in the replay cache "
                                                           "(`gemmdrift changelog --replay` computes it)"}


def _unmodelled(old: str, new: str) -> str:
    """Why changed source files move no prediction: no modelled rule changed, or the ones that did (linked)
    move none of the shapes listed."""
    from ..dispatch import parse_version
    from ..dispatch.commits import between

    rs = between(parse_version(_version_of(old)), parse_version(_version_of(new)))
    if not rs:
        return "in nothing the dispatch rules or the replay model (no modelled rule changed between the two)."
    return (f"the modelled rules that changed ({commit_links([r.name for r in rs])}) move none of the shapes "
            "listed.")


def _named(cell: dict[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """A predicted class's cell naming the pull requests of the rules that moved it ("ROUNDOFF (#3888)", linked)."""
    from ..dispatch.commits import RULES

    prs = list(dict.fromkeys((c.pr, c.pr_url) for n in names for c in RULES[n].commits))
    if prs:
        cell = {**cell, "cell": f"{cell['cell']} ({', '.join(f'[#{n}]({u})' for n, u in prs)})",
                "prs": [n for n, _ in prs]}
    return cell


def calls(chip: Any):
    """(key, op, choose's keywords) of every call the section predicts on ``chip``: each projection of each model
    in bf16, q4 and q8, and attention, T = 1..T_MAX; key = (chip, model, weights, projection or "sdpa", T)."""
    for _, model in MODELS:
        for wname, bits in WEIGHTS:
            for proj, K, N in projection_shapes(model):
                for T in range(1, T_MAX + 1):
                    if bits is None:
                        yield (chip.name, model, wname, proj, T), "matmul", dict(T=T, K=K, N=N, dtype="bfloat16")
                    else:
                        yield ((chip.name, model, wname, proj, T), "quantized_matmul",
                               dict(T=T, K=K, N=N, dtype="bfloat16", bits=bits, group_size=GROUP))
        s = sdpa_shape(model)
        for T in range(1, T_MAX + 1):
            yield ((chip.name, model, "any", "sdpa", T), "sdpa",
                   dict(T=T, K=s["k_len"], N=s["head_dim"], dtype="bfloat16", n_heads=s["n_heads"],
                        n_kv_heads=s["n_kv_heads"]))


def commit_links(names: Sequence[str]) -> str:
    """The mlx commits of rules ``names`` as markdown links (hash, subject, pull request), or a dash."""
    from ..dispatch.commits import RULES

    said = [c.markdown() for n in names for c in RULES[n].commits]
    return "; ".join(dict.fromkeys(said)) or "-"


def compact(ts: Sequence[int]) -> str:
    from .pages import compact_ranges

    return compact_ranges(ts)


def _short(reason: str) -> str:
    """A refusal as a table cell: its first clause."""
    text = str(reason)
    for key in ("cuBLASLt", "NAX", "nax"):
        if key in text:
            return ("cuBLASLt (order chosen at run time)" if key == "cuBLASLt"
                    else "NAX (order hidden in the hardware's matmul2d)")
    return text.split(":")[0][:80]


__all__: Sequence[str] = ["Predictor", "chip_class", "envelope_figures", "chips", "projection_shapes", "knowable", "rules", "sources_blocks", "T_MAX", "MODELS", "WEIGHTS"]
