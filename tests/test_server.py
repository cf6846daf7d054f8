"""The real mlx_lm.server (issue 14, item 2): started, driven over loopback HTTP, always stopped."""

from __future__ import annotations

import socket
import sys
import time

import pytest

from gemmdrift import server
from gemmdrift.errors import GemmdriftError


def test_port_in_use_is_one_line_error(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        with pytest.raises(GemmdriftError, match=f"port {port} .* in use"):
            server.MlxLmServer(tmp_path, port=port).start()


def test_failed_start_reports_servers_last_stderr_line(tmp_path):
    """A directory without a model: the server's generation thread dies (mlx_lm/server.py answers
    /health with 503, at start or at the first request) and its last log line is the error."""
    with pytest.raises(GemmdriftError, match="model directory not found"):
        server.MlxLmServer(tmp_path / "missing").start()
    srv = server.MlxLmServer(tmp_path, start_timeout=120)
    with pytest.raises(GemmdriftError) as e:
        with srv:
            srv.complete("x", 1, timeout=120)
    msg = str(e.value)
    assert "\n" not in msg and "config.json" in msg, msg  # FileNotFoundError: ... config.json
    assert srv.proc.poll() is not None  # nothing left running


def test_stored_dtype_reads_safetensors_header(tmp_path):
    import mlx.core as mx

    mx.save_safetensors(str(tmp_path / "model.safetensors"),
                        {"a.scales": mx.zeros((2,), dtype=mx.float16), "b.weight": mx.zeros((2,), dtype=mx.bfloat16)})
    assert server.stored_dtype(tmp_path) == "bfloat16"


@pytest.mark.slow
def test_real_server_lone_stream_is_generate_and_server_stops():
    """Known answer: the server's lone greedy stream is mlx-lm generate's stream in this process (same
    code, same float32 weights); a concurrent request is answered too; the process is gone afterwards.
    (Triage of server streams is the benchmark's and the CLI's; here it would double the time.)"""
    t0 = time.monotonic()
    r = server.measure_server("embedded", "The capital of France is", 3, cases=("concurrent",),
                              companions=["Once upon a time"], triage=False)
    assert r.figure("server_matches_inprocess") == 1.0
    pair = r.details["pairs"][0]
    assert len(pair["tokens_a"]) == 3 and len(pair["tokens_b"]) == 3
    assert pair["prompt"][0] == 2  # BOS: the server encodes as gemmdrift does (its prompt count was checked)
    assert r.figure("server_tokens_per_s") > 0 and r.figure("inprocess_tokens_per_s") > 0
    files = server.stream_files(r)
    assert set(files) == {"concurrent_a.json", "concurrent_b.json"}
    assert time.monotonic() - t0 < 120


def test_server_stops_on_keyboard_interrupt(tmp_path, monkeypatch):
    """Ctrl-C inside the with-block still kills the process group."""
    started = []

    class Fake(server.MlxLmServer):
        def command(self):  # a stand-in server: any long-lived process answers the lifecycle
            return [sys.executable, "-c", "import time; time.sleep(60)"]

    srv = Fake(tmp_path, start_timeout=1)
    monkeypatch.setattr(server.urllib.request, "urlopen", lambda *a, **k: type(
        "R", (), {"status": 200, "__enter__": lambda s: s, "__exit__": lambda s, *e: None})())
    with pytest.raises(KeyboardInterrupt):
        with srv:
            started.append(srv.proc.pid)
            raise KeyboardInterrupt
    assert started and srv.proc.poll() is not None


def test_last_line_skips_access_lines_and_warnings(tmp_path):
    # Regression: a warning printed after the server's error ("...: UserWarning: ..." then "warnings.warn(")
    # became the "last stderr line" of the one-line error, hiding the FileNotFoundError.
    log = tmp_path / "server.log"
    log.write_text("INFO loading\nFileNotFoundError: No such file: 'x/config.json'\n"
                   '127.0.0.1 - - "GET /health HTTP/1.1" 200 -\n'
                   "/usr/lib/python3/x.py:19: UserWarning: resource_tracker: leaked semaphore\n"
                   "  warnings.warn(\n")
    assert server._last_line(log) == "FileNotFoundError: No such file: 'x/config.json'"
