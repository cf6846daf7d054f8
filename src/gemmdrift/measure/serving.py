"""The ``mlx_lm.server`` process: a free loopback port, the subprocess started and always stopped, greedy HTTP
requests and their replies; and the re-quantized default draft it serves.

The installed server is started as ``python -m mlx_lm.server --model DIR --host 127.0.0.1 --port P`` and
stopped in ``try/finally`` (on errors and Ctrl-C too; the whole process group is terminated); a failed start
or request is one line, the server's own error read from its log. The measurements that drive it are
:mod:`gemmdrift.measure.server`."""

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..errors import GemmdriftError

PREFILL_STEP = 2048  # mlx_lm.server's --prefill-step-size default


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
