"""The real ``mlx_lm.server``: greedy streams over HTTP, and what changes them.

The installed server (``mlx_lm/server.py``, mlx-lm 0.32.2) is started as a
subprocess (``python -m mlx_lm.server --model DIR --host 127.0.0.1 --port P``)
on a free loopback port, driven with greedy requests (``temperature 0``) and
always stopped (``try/finally``: on errors and Ctrl-C too; the whole process
group is terminated; the process is :mod:`gemmdrift.measure.serving`).
Three comparisons (issue 14):

a. **draft**: no draft vs ``--draft-model`` with ``--num-draft-tokens 2``; the
   draft is a re-quantized copy of the target by default (``mlx_lm.convert``
   with ``quantize=True`` into the cache directory). The server serves draft
   requests one at a time with ``stream_generate`` and a speculative step.
b. **concurrent**: one request alone vs the same request sent together with
   other requests; without a draft the server batches them
   (``BatchGenerator``: left padding, batch caches, a decode GEMM with M=B).
c. **conversation**: turn 2 of a conversation sent after turn 1 to a server
   that keeps prompt caches (``LRUPromptCache`` reuses turn 1's cache) vs the
   same full text sent to a server started with ``--prompt-cache-size 0``.

Token ids: the server returns the generated ids itself when asked for
``logprobs`` (``choices[0].logprobs.content[i].id``), so generated streams are
not re-tokenized. The server only takes prompt *text*; the prompt ids are
gemmdrift's tokenizer's, which stock mlx-lm reproduces exactly for the embedded
checkpoint (``tests/test_checkpoint_tokenizer.py``), and every request checks
that the server counted the same number of prompt tokens.

``/v1/completions`` is used for base models; ``/v1/chat/completions`` where the
tokenizer has a chat template (then the prompt ids come from the tokenizer's
own template through mlx-lm's tokenizer, as the server builds them).

Every pair of streams is saved as stream files (``{"prompt": [...], "tokens":
[...]}``, what :func:`gemmdrift.measure.diverge.read_stream` reads) and triaged with
:func:`gemmdrift.measure.diverge.triage` against its teacher-forced single-sequence
schedule (``prefill:2048,decode``; ``prefill:2048,verify:2`` for the draft
server, whose ``--prefill-step-size`` is 2048). Batching itself is not a
teacher-forced schedule: a batched stream is judged against the single-sequence
computation, so a batch-made flip shows as a NEAR-TIE or OUTSIDE verdict.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from ..errors import GemmdriftError
from .serving import PREFILL_STEP, MlxLmServer, Reply, requantized_draft

PLAIN_SCHEDULE = f"prefill:{PREFILL_STEP},decode"


# ------------------------------------------------------------------ cases


@dataclass
class StreamPair:
    """Two greedy server streams for one prompt, and their triage."""

    case: str  # draft | concurrent | conversation
    label_a: str
    label_b: str
    prompt: list[int]
    tokens_a: list[int]
    tokens_b: list[int]
    schedule_a: str
    schedule_b: str
    seconds_a: float
    seconds_b: float
    first_divergence: int | None = None
    triage: dict[str, Any] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def uses_chat(lm) -> bool:
    """Whether requests go to ``/v1/chat/completions``: the checkpoint's tokenizer has a chat template."""
    return bool(getattr(getattr(lm.tokenizer, "_tok", None), "has_chat_template", False))


def as_request(lm, text: str) -> str | list[dict]:
    """What is sent for a prompt text: the text (``/v1/completions``), or one user message (chat)."""
    return [{"role": "user", "content": text}] if uses_chat(lm) else text


def second_turn(lm, prompt: str, reply: str, follow_up: str) -> str | list[dict]:
    """The conversation's second request: the first prompt, the server's reply and a follow-up, as one text
    (completions) or as user / assistant / user messages (chat), so that the first request's tokens and the
    reply are a prefix the server's prompt cache can reuse."""
    if not uses_chat(lm):
        return prompt + reply + follow_up
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": reply},
            {"role": "user", "content": follow_up.strip()}]


def request_ids(lm, request: str | list[dict]) -> list[int]:
    """The token ids the server computes for a request: the text encoded, or the chat template applied with
    the generation prompt (as mlx_lm.server does)."""
    if isinstance(request, str):
        return [int(t) for t in lm.tokenizer.encode(request)]
    out = lm.tokenizer._tok.apply_chat_template(request, add_generation_prompt=True, tokenize=True)
    return [int(t) for t in (out["input_ids"] if hasattr(out, "keys") else out)]  # transformers 5: a mapping


def _prompt_ids(lm, prompt: str | list[dict], reply: Reply, what: str) -> list[int]:
    """gemmdrift's ids for a prompt the server tokenized; the server's count must agree."""
    ids = request_ids(lm, prompt)
    if reply.prompt_tokens != len(ids):
        raise GemmdriftError(f"{what}: the server counted {reply.prompt_tokens} prompt tokens, gemmdrift's "
                             f"tokenizer {len(ids)}: the checkpoint's tokenizer files disagree with gemmdrift")
    return ids


def run_cases(lm, model_dir: str | os.PathLike, prompt: str, n: int, *, cases: Sequence[str] = ("draft",
              "concurrent", "conversation"), draft_dir: str | os.PathLike | None = None, num_draft: int = 2,
              companions: Sequence[str] = (), follow_up: str = "\n\nContinue in one sentence:", triage: bool = True,
              progress=None, reload=None, checkpoint=None, plugins: dict[str, str] | None = None) -> list[StreamPair]:
    """Run the server cases on one prompt; return one :class:`StreamPair` per case.

    ``lm`` is gemmdrift's model on the same checkpoint in the server's dtype
    (the triage teacher-forces with it); ``draft_dir`` None makes the default
    re-quantized draft (only when the draft case runs). ``reload``: called once after the servers stopped,
    before the triage, when ``lm``'s weights were freed while they ran (only its tokenizer is used until then).
    ``checkpoint``: a :class:`gemmdrift.checkpoint.Checkpoints`; each finished case (its requests, then
    its triage) is saved there, and a case saved before is loaded: a server starts only for the cases
    still to run.
    ``plugins``: ``{"cache_impl", "rollback"}`` specs installed in the draft case's server (the one under test;
    the reference servers keep mlx-lm's); they are part of the draft case's checkpoint key.
    """
    from .diverge import first_divergence
    from .diverge import triage as run_triage

    say = progress or (lambda msg: None)
    pairs: list[StreamPair] = []
    companions = list(companions)
    draft_key = str(draft_dir) + plugin_key(plugins)  # as given: the default draft is made later, same key
    unit = lambda case: (case, prompt, n, num_draft, draft_key, companions, follow_up)  # noqa: E731
    done = {}
    for case in cases:
        d = checkpoint.load(*unit(case), check=lambda u: "tokens_b" in u) if checkpoint is not None else None
        if d is not None:
            done[case] = StreamPair(**d)
            say(f"{case}: done before (resumed)")
    cases = [c for c in cases if c not in done]
    need_plain = {"draft", "concurrent"} & set(cases)
    if need_plain or "conversation" in cases:
        say("starting mlx_lm.server (no draft, no prompt-cache reuse)")
        with MlxLmServer(model_dir, prompt_cache_size=0, max_tokens=n) as srv:
            alone = srv.complete(as_request(lm, prompt), n)
            ids = _prompt_ids(lm, as_request(lm, prompt), alone, "prompt")
            say(f"alone: {len(alone.tokens)} tokens in {alone.seconds:.1f} s")
            if "concurrent" in cases:
                if not companions:
                    raise GemmdriftError("the concurrent case needs companion prompts")
                replies = srv.complete_concurrently([as_request(lm, t) for t in [prompt, *companions]], n)
                say(f"among {len(replies)} concurrent requests: {replies[0].seconds:.1f} s")
                pairs.append(StreamPair("concurrent", "alone", f"among {len(companions) + 1}", ids, alone.tokens,
                                        replies[0].tokens, PLAIN_SCHEDULE, PLAIN_SCHEDULE, alone.seconds,
                                        replies[0].seconds,
                                        notes={"companion_prompt_tokens": [r.prompt_tokens for r in replies[1:]],
                                               "batch": len(replies)}))
                _save(checkpoint, unit, pairs[-1])
            if "conversation" in cases:
                turn2 = second_turn(lm, prompt, alone.text, follow_up)
                fresh = srv.complete(turn2, n)
                ids2 = _prompt_ids(lm, turn2, fresh, "conversation turn 2")
            plain_alone = alone
        if "conversation" in cases:
            say("starting mlx_lm.server (prompt-cache reuse)")
            with MlxLmServer(model_dir, max_tokens=n) as srv:
                first = srv.complete(as_request(lm, prompt), n)
                reused = srv.complete(turn2, n)
                pairs.append(StreamPair("conversation", "fresh", "continued (cache reuse)", ids2, fresh.tokens,
                                        reused.tokens, PLAIN_SCHEDULE, PLAIN_SCHEDULE, fresh.seconds, reused.seconds,
                                        notes={"cached_tokens": reused.cached_tokens,
                                               "turn1_equal": first.tokens == plain_alone.tokens}))
                _save(checkpoint, unit, pairs[-1])
        if "draft" in cases:
            if draft_dir is None:
                say("default draft: a 4-bit re-quantized copy of the target (mlx_lm.convert, made once and cached)")
                draft_dir = requantized_draft(model_dir)
            say(f"starting mlx_lm.server --draft-model {draft_dir} --num-draft-tokens {num_draft}")
            with MlxLmServer(model_dir, draft_dir=draft_dir, num_draft=num_draft, prompt_cache_size=0,
                             max_tokens=n, plugins=plugins) as srv:
                spec = srv.complete(as_request(lm, prompt), n)
            pairs.append(StreamPair("draft", "no draft", f"draft, {num_draft} tokens", ids, plain_alone.tokens,
                                    spec.tokens, PLAIN_SCHEDULE, f"prefill:{PREFILL_STEP},verify:{num_draft}",
                                    plain_alone.seconds, spec.seconds,
                                    notes={"draft": str(draft_dir), **{k: v for k, v in (plugins or {}).items() if v}}))
            _save(checkpoint, unit, pairs[-1])
    pairs = sorted([*done.values(), *pairs], key=lambda p: CASE_ORDER.index(p.case))
    if reload is not None and triage and pairs:
        reload()
    for p in pairs:
        p.first_divergence = first_divergence(p.tokens_a, p.tokens_b)
        if triage and p.tokens_a and p.tokens_b and not p.triage:
            say(f"triage: {p.case}")
            p.triage = run_triage(lm, p.prompt, p.tokens_a, p.tokens_b, p.schedule_a, p.schedule_b).as_dict()
            _save(checkpoint, unit, p)
    return pairs


CASE_ORDER = ("concurrent", "conversation", "draft")  # the order run_cases makes them in


def check_plugins(plugins: dict[str, str] | None, model, draft: str | None) -> None:
    """The check ``diverge`` makes (:func:`gemmdrift.caches.plugins.make_caches`: one cache per layer, each with the
    protocol) of a ``--cache-impl`` on the loaded target and on the draft, whose caches the server makes with
    the same factory (the default draft is a re-quantized copy of the target: the target's layers). No compute:
    a factory that would fail inside the draft server is one line before the first server starts."""
    spec = (plugins or {}).get("cache_impl")
    if not spec:
        return
    from ..caches.plugins import load_cache_impl, make_caches

    impl = load_cache_impl(spec)
    make_caches(impl, model)
    if draft is not None:
        from ..model import load_model

        make_caches(impl, load_model(str(draft), lazy=True).model)  # lazy: its weights are not read


def plugin_key(plugins: dict[str, str] | None) -> str:
    """The part of a draft case's checkpoint key that names the plug-ins its server ran ('' without)."""
    given = sorted((k, v) for k, v in (plugins or {}).items() if v)
    return "" if not given else " +" + ",".join(f"{k}={v}" for k, v in given)


def _save(checkpoint, unit, pair: StreamPair) -> None:
    if checkpoint is not None:
        checkpoint.save(*unit(pair.case)[:1], pair.as_dict(), *unit(pair.case)[1:])


# ------------------------------------------------------------------ the measurement


def checkpoint_dir(source: str) -> Path:
    """The mlx-lm directory the server loads for a ``--model`` value (the converted one for GGUF)."""
    from ..model import gguf_gemma
    from ..model import resolve_source

    kind, path = resolve_source(source)
    if kind == "shape":
        raise GemmdriftError("the server needs a real checkpoint: 'embedded', a Gemma 3 .gguf or an mlx-lm directory")
    if kind in ("embedded", "gguf"):
        return gguf_gemma.converted_dir(gguf_gemma.embedded_gguf() if kind == "embedded" else path)
    return path


def stored_dtype(model_dir: Path) -> str:
    """The floating dtype the server computes in: that of the checkpoint's first floating tensor.

    mlx-lm loads weights as stored (``mlx_lm/utils.py`` ``load_model``), so the
    triage model must use the same dtype to teacher-force what the server computed.
    """
    names = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
    for f in sorted(Path(model_dir).glob("model*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        for name, t in header.items():
            if name != "__metadata__" and t.get("dtype") in names and not name.endswith(("scales", "biases")):
                return names[t["dtype"]]
    raise GemmdriftError(f"no floating-point tensor in {model_dir}: cannot tell the server's dtype")


def measure_server(source: str, prompt: str, n: int, *, cases: Sequence[str] = ("draft", "concurrent", "conversation"),
                   draft: str | None = None, num_draft: int = 2, companions: Sequence[str] = (),
                   follow_up: str = "\n\nContinue in one sentence:", triage: bool = True, progress=None,
                   checkpoint=None, plugins: dict[str, str] | None = None, records: dict[str, Any] | None = None):
    """Greedy streams through the real ``mlx_lm.server``: a Result of kind ``server``.

    Also runs mlx-lm's ``generate_step`` in this process on the same prompt
    and dtype first (no server running), for two checks: the server's lone
    stream must be that stream (same code, same dtype), and the server's
    tokens/s against in-process generation.

    ``checkpoint``: an output directory; finished cases are kept under it (:func:`run_cases`) and Ctrl-C
    raises :class:`gemmdrift.checkpoint.Interrupted` with the partial Result of the finished cases.
    """
    from ..checkpoint import Checkpoints, Interrupted, partial_inputs
    from .diverge import first_divergence, generate_plain
    from ..model import describe, load_model

    say = progress or (lambda msg: None)
    if n <= 0:
        raise GemmdriftError(f"the number of tokens must be positive, got {n}")
    bad = sorted(set(cases) - {"draft", "concurrent", "conversation"})
    if bad or not cases:
        raise GemmdriftError(f"unknown server case(s) {', '.join(bad) or '(none)'}: use draft, concurrent, conversation")
    from ..model.draft_self import parse_self, self_draft

    self_layers = parse_self(draft) if draft is not None else None
    if draft is not None and self_layers is None and not Path(draft).expanduser().is_dir():
        raise GemmdriftError(f"--draft {draft}: not an mlx-lm directory")
    model_dir = checkpoint_dir(source)
    if self_layers is not None:  # the target's first layers (a test instrument), written once and cached
        draft_label, draft = draft, str(self_draft(model_dir, self_layers))
        records = {**(records or {}), "draft_spec": draft_label}
    dtype = stored_dtype(model_dir)
    plan = _memory_plan(model_dir, dtype, draft if "draft" in cases else None, "draft" in cases)  # before any load
    lm = load_model(str(model_dir), dtype=dtype)
    if lm.tokenizer is None:
        raise GemmdriftError(f"{model_dir} has no tokenizer: the server needs one")
    info = {**lm.info, "source": source}  # the model as the user named it ('embedded'); the directory is "checkpoint"
    say(f"{describe(info)}; server dtype {dtype}")
    ids = request_ids(lm, as_request(lm, prompt))  # what the server will compute: chat template where there is one
    from ..checks import check_length

    check_length(lm.description, len(ids) + n, f"the prompt with --n {n}")
    if companions:
        longest = max(len(request_ids(lm, as_request(lm, c))) for c in companions)
        check_length(lm.description, longest + n, f"the longest companion with --n {n}")
    if "draft" in cases:  # the draft case's server runs the plug-ins: checked on the loaded models, before any server
        check_plugins(plugins, lm.model, draft)
    generate_plain(lm.model, ids, 1, prefill_step=PREFILL_STEP)  # untimed: the lazy weights load on the first pass
    ref = generate_plain(lm.model, ids, n, prefill_step=PREFILL_STEP)
    say(f"in-process generate: {len(ref.tokens)} tokens in {ref.seconds:.1f} s")
    reload = None
    if plan[0] == "free":
        say(f"freeing gemmdrift's copy of the model while the servers run: two copies would not fit {plan[1]}; "
            "it is loaded again for the triage")
        reload = _free_weights(lm, lambda: load_model(str(model_dir), dtype=dtype).model)
    ck = Checkpoints(checkpoint, "server", lm.description)
    kw = dict(cases=cases, draft_dir=draft, num_draft=num_draft, companions=companions, follow_up=follow_up,
              triage=triage, plugins=plugins)
    try:
        pairs = run_cases(lm, model_dir, prompt, n, progress=say, reload=reload, checkpoint=ck, **kw)
    except KeyboardInterrupt:
        kept = []
        for case in cases:  # read back what finished (requests done, triage perhaps not)
            d = ck.load(case, prompt, n, num_draft, str(draft) + plugin_key(plugins), list(companions), follow_up)
            if d is not None:
                kept.append(StreamPair(**d))
        kept.sort(key=lambda p: CASE_ORDER.index(p.case))
        for p in kept:
            p.first_divergence = first_divergence(p.tokens_a, p.tokens_b)
        result = _server_result(lm, info, model_dir, dtype, prompt, n, cases, draft, num_draft, companions,
                                follow_up, kept, ref, {**partial_inputs(len(kept), len(cases), "case"), **(records or {})}) if kept else None
        raise Interrupted(result, len(kept), len(cases)) from None
    return _server_result(lm, info, model_dir, dtype, prompt, n, cases, draft, num_draft, companions, follow_up,
                          pairs, ref, dict(records or {}))


def _server_result(lm, info, model_dir, dtype, prompt, n, cases, draft, num_draft, companions, follow_up, pairs,
                   ref, extra):
    """The Result of :func:`measure_server` from its stream pairs."""
    from ..machine.envinfo import environment
    from ..result import Result, env_labels, tidy

    env = environment()
    rows, frame_rows = [], []
    for p in pairs:
        t = p.triage or {}
        row = {"case": p.case, "a": p.label_a, "b": p.label_b, "prompt_tokens": len(p.prompt),
               "tokens_a": len(p.tokens_a), "tokens_b": len(p.tokens_b),
               "first_divergence": p.first_divergence, "verdict": t.get("verdict", ""),
               "margin": t.get("margin"), "envelope": t.get("envelope"),
               "seconds_a": p.seconds_a, "seconds_b": p.seconds_b}
        rows.append(row)
        for metric in ("first_divergence", "seconds_a", "seconds_b", "margin", "envelope"):
            if row[metric] is not None:
                frame_rows.append({"pair": f"{p.label_a} vs {p.label_b}", "mode": p.case, "metric": metric,
                                   "value": float(row[metric])})
        frame_rows.append({"pair": f"{p.label_a} vs {p.label_b}", "mode": p.case, "metric": "diverged",
                           "value": float(p.first_divergence is not None)})
    table = pd_frame(rows)
    figures: dict[str, float] = {"server_divergences": float(sum(p.first_divergence is not None for p in pairs)),
                                 "inprocess_tokens_per_s": len(ref.tokens) / ref.seconds}
    for p in pairs:
        figures[f"server_{p.case}_diverged"] = float(p.first_divergence is not None)
        if p.first_divergence is not None:
            figures[f"server_{p.case}_first_divergence"] = float(p.first_divergence)
        if p.triage.get("verdict"):
            figures[f"server_{p.case}_outside"] = float(p.triage["verdict"] == "OUTSIDE ENVELOPE")
    lone = next((p for p in pairs if p.label_a in ("alone", "no draft")), None)
    if lone is not None and lone.seconds_a > 0:
        figures["server_tokens_per_s"] = len(lone.tokens_a) / lone.seconds_a
        figures["server_matches_inprocess"] = float(lone.tokens_a == ref.tokens)
    inputs = {"model": info, "checkpoint": str(model_dir), "dtype": dtype, "prompt": prompt, "n": n,
              "endpoint": "/v1/chat/completions" if uses_chat(lm) else "/v1/completions",
              "cases": list(cases), "draft": draft or "re-quantized copy (4-bit, group 64)", "num_draft": num_draft,
              "companions": list(companions), "follow_up": follow_up, **extra}
    details = {"pairs": [p.as_dict() for p in pairs], "inprocess": {"tokens": ref.tokens, "seconds": ref.seconds}}
    return Result(kind="server", inputs=inputs, env=env,
                  frame=tidy(frame_rows, model=info["source"], dtype=dtype, **env_labels(env)),
                  figures=figures, tables={"server": table}, details=details)


def _memory_plan(model_dir: Path, dtype: str, draft: str | None, with_draft: bool) -> tuple[str, str]:
    """(:func:`gemmdrift.machine.memory.server_plan`, the budget's name) from the checkpoints' sizes on disk."""
    from ..machine import memory

    target = memory.checkpoint_bytes(model_dir)
    bits = {"float32": 32, "bfloat16": 16, "float16": 16}[dtype]
    draft_bytes = 0
    if with_draft:  # the default draft is a 4-bit re-quantized copy, perhaps not made yet
        draft_bytes = memory.checkpoint_bytes(draft) if draft else memory.quantized_bytes(target, bits)
    budget, what = memory.device_budget()
    return memory.server_plan(target, draft_bytes, budget, what), what


def _free_weights(lm, load):
    """Drop ``lm``'s weights (its tokenizer and description stay) and return the function that loads them again."""
    import gc

    import mlx.core as mx

    lm.model = None
    gc.collect()
    mx.clear_cache()  # the freed buffers go back to the system, not to mlx's cache

    def reload() -> None:
        lm.model = load()

    return reload


def pd_frame(rows):
    import pandas as pd

    return pd.DataFrame(rows)


def stream_files(result) -> dict[str, dict[str, Any]]:
    """``{file name: stream object}`` for every pair of a server or batch result (what `gemmdrift triage` reads)."""
    out = {}
    for p in result.details.get("pairs", []):
        tag = p["case"] + ("" if "row" not in p.get("notes", {}) else f"_{p['notes']['row']}")
        out[f"{tag}_a.json"] = {"prompt": p["prompt"], "tokens": p["tokens_a"], "label": p["label_a"],
                                "schedule": p["schedule_a"]}
        out[f"{tag}_b.json"] = {"prompt": p["prompt"], "tokens": p["tokens_b"], "label": p["label_b"],
                                "schedule": p["schedule_b"]}
    return out
