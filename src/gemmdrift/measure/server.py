"""The real ``mlx_lm.server``: greedy streams over HTTP, and what changes them.

The installed server (``mlx_lm/server.py``, mlx-lm 0.32.2) is started as a
subprocess (``python -m mlx_lm.server --model DIR --host 127.0.0.1 --port P``)
on a free loopback port, driven with greedy requests (``temperature 0``) and
always stopped (``try/finally``: on errors and Ctrl-C too; the whole process
group is terminated). Three comparisons (issue 14):

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
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from ..errors import GemmdriftError

PREFILL_STEP = 2048  # mlx_lm.server's --prefill-step-size default
PLAIN_SCHEDULE = f"prefill:{PREFILL_STEP},decode"


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_in_use(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


_ACCESS = re.compile(r'"(GET|POST|PUT|DELETE|HEAD) \S+ HTTP/')
# A Python warning is two lines, "file.py:12: SomeWarning: text" and the source line "warnings.warn(";
# one printed after the error (at interpreter exit, say) must not hide it.
_WARNING = re.compile(r"^\S+:\d+: \w*Warning: |^warnings\.warn\(")


# A traceback's last line, "RuntimeError: text" or "gemmdrift.errors.GemmdriftError: text".
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b(: |$)")


def _last_line(path: Path) -> str:
    """The server's error from its log: the last exception line (a request that failed is logged by the HTTP
    server as a traceback between two rules of dashes, a rule last), else the last line that is not an HTTP
    access line, a warning or a rule."""
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    lines = [ln for ln in lines if not (_ACCESS.search(ln) or _WARNING.search(ln))] or lines
    lines = [ln for ln in lines if any(c.isalnum() for c in ln)] or lines  # "----------------------------------------"
    errors = [ln for ln in lines if _EXCEPTION.match(ln)]
    return errors[-1] if errors else (lines[-1] if lines else "")


@dataclass
class Reply:
    """One greedy completion from the server."""

    tokens: list[int]
    text: str
    prompt_tokens: int
    cached_tokens: int | None
    seconds: float
    finish_reason: str | None


class MlxLmServer:
    """``mlx_lm.server`` in a subprocess on loopback; use as a context manager.

    Args:
        model_dir: the mlx-lm checkpoint directory.
        draft_dir: ``--draft-model`` (None: no draft).
        num_draft: ``--num-draft-tokens``.
        prompt_cache_size: ``--prompt-cache-size`` (0: no prompt-cache reuse).
        port: a fixed port (None: a free one).
        start_timeout: seconds to wait for ``/health``.
    """

    def __init__(self, model_dir: str | os.PathLike, *, draft_dir: str | os.PathLike | None = None,
                 num_draft: int = 2, prompt_cache_size: int | None = None, port: int | None = None,
                 start_timeout: float = 180.0, max_tokens: int = 512, plugins: dict[str, str] | None = None):
        self.model_dir = Path(model_dir)
        self.draft_dir = Path(draft_dir) if draft_dir else None
        self.num_draft = int(num_draft)
        self.prompt_cache_size = prompt_cache_size
        self.port = port
        self.start_timeout = start_timeout
        self.max_tokens = max_tokens
        self.proc: subprocess.Popen | None = None
        self._log: Path | None = None
        self.chat = False
        # {"cache_impl": spec, "rollback": spec}: installed in the server process by gemmdrift.caches.serve_launch.
        self.plugins = {k: v for k, v in (plugins or {}).items() if v}

    # ------------------------------------------------------------ lifecycle
    def command(self) -> list[str]:
        launch = ["-m", "mlx_lm.server"] if not self.plugins else (
            ["-m", "gemmdrift.caches.serve_launch"] + [f"--{k.replace('_', '-')}={v}" for k, v in sorted(self.plugins.items())]
            + ["--"])
        cmd = [sys.executable, *launch, "--model", str(self.model_dir), "--host", "127.0.0.1",
               "--port", str(self.port), "--temp", "0", "--max-tokens", str(self.max_tokens),
               "--prefill-step-size", str(PREFILL_STEP), "--log-level", "WARNING"]
        if self.draft_dir is not None:
            cmd += ["--draft-model", str(self.draft_dir), "--num-draft-tokens", str(self.num_draft)]
        if self.prompt_cache_size is not None:
            cmd += ["--prompt-cache-size", str(self.prompt_cache_size)]
        return cmd

    def start(self) -> "MlxLmServer":
        for what, d in (("model", self.model_dir), ("draft model", self.draft_dir)):
            if d is not None and not d.is_dir():  # else mlx_lm would try to download it
                raise GemmdriftError(f"{what} directory not found: {d}")
        if self.port is None:
            self.port = free_port()
        elif port_in_use(self.port):
            raise GemmdriftError(f"port {self.port} on 127.0.0.1 is in use: pick another or omit --port")
        fd, log = tempfile.mkstemp(prefix="gemmdrift-server-", suffix=".log")
        self._log = Path(log)
        # Its own process group, so stop() ends the server and anything it started.
        self.proc = subprocess.Popen(self.command(), stdout=fd, stderr=fd, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        os.close(fd)
        deadline = time.monotonic() + self.start_timeout
        while True:
            if self.proc.poll() is not None:
                last = _last_line(self._log)
                self.stop()
                raise GemmdriftError(f"mlx_lm.server exited with code {self.proc.returncode} while starting: {last}")
            status = self._health()
            if status == 200:
                break
            if status == 503:  # the generation thread died (loading the model failed)
                last = _last_line(self._log)
                self.stop()
                raise GemmdriftError(f"mlx_lm.server failed to load {self.model_dir}: {last}")
            if time.monotonic() > deadline:
                last = _last_line(self._log)
                self.stop()
                raise GemmdriftError(f"mlx_lm.server did not answer within {self.start_timeout:.0f} s: {last}")
            time.sleep(0.25)
        return self

    def stop(self) -> None:
        """Terminate the process group (SIGTERM, then SIGKILL after 10 s). Safe to call twice."""
        p = self.proc
        if p is not None and p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
            except ProcessLookupError:
                pass
        if self._log is not None and p is not None and p.poll() is not None:
            self._log.unlink(missing_ok=True)
            self._log = None

    def __enter__(self) -> "MlxLmServer":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    def last_log_line(self) -> str:
        return _last_line(self._log) if self._log else ""

    # -------------------------------------------------------------- requests
    def _health(self) -> int | None:
        """/health status (200 ok, 503 the generation thread died), None when nothing answers."""
        try:
            with urllib.request.urlopen(self.url("/health"), timeout=2) as r:
                return int(r.status)
        except urllib.error.HTTPError as e:
            return int(e.code)
        except (urllib.error.URLError, OSError):
            return None

    def _check_alive(self) -> None:
        if self.proc is None or self.proc.poll() is not None or self._health() == 503:
            raise GemmdriftError(f"mlx_lm.server stopped serving: {self.last_log_line()}")
    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def _post(self, path: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        """POST in a worker thread while this thread watches the server: a server whose generation
        thread dies would otherwise leave the request waiting forever."""
        box: dict[str, Any] = {}

        def send():
            req = urllib.request.Request(self.url(path), data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
            try:
                with urllib.request.urlopen(req, timeout=timeout) as r:
                    box["out"] = json.loads(r.read())
            except urllib.error.HTTPError as e:
                detail = e.read().decode(errors="replace").strip().splitlines()
                box["err"] = f"mlx_lm.server answered {e.code} on {path}: {detail[-1] if detail else e.reason}"
            except (urllib.error.URLError, OSError, ValueError) as e:
                box["err"] = f"mlx_lm.server request failed ({e}); server log: {self.last_log_line()}"

        worker = threading.Thread(target=send, daemon=True)
        worker.start()
        deadline = time.monotonic() + timeout
        while worker.is_alive():
            worker.join(timeout=2.0)
            if worker.is_alive():
                self._check_alive()
                if time.monotonic() > deadline:
                    raise GemmdriftError(f"mlx_lm.server did not answer {path} within {timeout:.0f} s")
        if "err" in box:
            raise GemmdriftError(box["err"])
        return box["out"]

    def complete(self, prompt: str | list[dict], n: int, timeout: float = 3600.0) -> Reply:
        """A greedy completion of ``n`` tokens: ``/v1/completions`` for a text, chat for messages."""
        body = {"max_tokens": int(n), "temperature": 0.0, "logprobs": True, "stream": False}
        if isinstance(prompt, str):
            path, body["prompt"] = "/v1/completions", prompt
        else:
            path, body["messages"] = "/v1/chat/completions", prompt
        t0 = time.perf_counter()
        out = self._post(path, body, timeout)
        seconds = time.perf_counter() - t0
        choice = out["choices"][0]
        content = (choice.get("logprobs") or {}).get("content") or []
        tokens = [int(c["id"]) for c in content if "id" in c]
        text = choice.get("text") if "text" in choice else (choice.get("message") or {}).get("content", "")
        usage = out.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        return Reply(tokens=tokens, text=text or "", prompt_tokens=int(usage.get("prompt_tokens", -1)),
                     cached_tokens=details.get("cached_tokens"), seconds=seconds,
                     finish_reason=choice.get("finish_reason"))

    def complete_concurrently(self, prompts: Sequence[str | list[dict]], n: int) -> list[Reply]:
        """All prompts sent at once (one thread each); replies in the order given."""
        replies: list[Reply | BaseException | None] = [None] * len(prompts)
        barrier = threading.Barrier(len(prompts))

        def send(i):
            try:
                barrier.wait(timeout=30)
                replies[i] = self.complete(prompts[i], n)
            except BaseException as e:  # re-raised below, in the caller's thread
                replies[i] = e

        threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for r in replies:
            if isinstance(r, BaseException):
                raise r
        return replies  # type: ignore[return-value]


# ------------------------------------------------------------------ drafts


def requantized_draft(model_dir: str | os.PathLike, bits: int = 4, group_size: int = 64) -> Path:
    """A re-quantized copy of ``model_dir`` made with mlx-lm's own ``convert``, cached beside it.

    ``mlx_lm.convert(hf_path=DIR, mlx_path=OUT, quantize=True, q_bits=4,
    q_group_size=64, dtype="bfloat16")`` (``mlx_lm/convert.py``); written to a
    temporary name and renamed, so an interrupted conversion leaves nothing.
    """
    import shutil

    from ..files import cache_dir

    src = Path(model_dir).resolve()
    target = cache_dir() / "drafts" / f"{src.name}-q{bits}g{group_size}"
    if (target / "config.json").exists():
        return target
    from mlx_lm.convert import convert

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    import contextlib

    with contextlib.redirect_stdout(sys.stderr):  # convert's "[INFO] Loading/Quantizing" lines: stdout is --json's
        convert(hf_path=str(src), mlx_path=str(tmp), quantize=True, q_bits=bits, q_group_size=group_size,
                dtype="bfloat16")
    for extra in ("tokenizer.model",):  # convert saves the transformers files; keep ours too
        if (src / extra).exists() and not (tmp / extra).exists():
            shutil.copy(src / extra, tmp / extra)
    os.replace(tmp, target)
    return target


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
