"""The real mlx_lm.server (issue 14, item 2): started, driven over loopback HTTP, always stopped."""

from __future__ import annotations

import socket
import sys
import time

import pytest

from gemmdrift.measure import server, serving
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


@pytest.fixture(scope="module")
def freed_run():
    """One real-server run that two tests read (issue 25, item 7: each started its own mlx_lm.server and loaded
    the model twice): the embedded Gemma's concurrent case, with room for one copy of the model and a bit, not
    two, so gemmdrift's copy is freed while the server runs and loaded again for the triage. The default plan
    (the copy kept) runs through the real server in test_real_server_chat_completions_path."""
    from gemmdrift.machine import memory

    target = memory.checkpoint_bytes(server.checkpoint_dir("embedded"))
    said = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(memory, "device_budget", lambda: (int(1.5 * target), "the physical memory"))
        t0 = time.monotonic()
        r = server.measure_server("embedded", "The capital of France is", 3, cases=("concurrent",),
                                  companions=["Once upon a time"], progress=said.append)
        seconds = time.monotonic() - t0
    return r, said, seconds


@pytest.mark.slow
def test_real_server_lone_stream_is_generate_and_server_stops(freed_run):
    """Known answer: the server's lone greedy stream is mlx-lm generate's stream in this process (same
    code, same float32 weights); a concurrent request is answered too; the process is gone afterwards."""
    r, _, seconds = freed_run
    assert r.figure("server_matches_inprocess") == 1.0
    pair = r.details["pairs"][0]
    assert len(pair["tokens_a"]) == 3 and len(pair["tokens_b"]) == 3
    assert pair["prompt"][0] == 2  # BOS: the server encodes as gemmdrift does (its prompt count was checked)
    assert r.figure("server_tokens_per_s") > 0 and r.figure("inprocess_tokens_per_s") > 0
    files = server.stream_files(r)
    assert set(files) == {"concurrent_a.json", "concurrent_b.json"}
    assert seconds < 120


@pytest.mark.slow
def test_a_freed_copy_is_reloaded_for_the_triage_through_the_real_server(freed_run):
    # Moved here from tests/test_memory.py to share freed_run's server start with the test above.
    r, said, _ = freed_run
    assert any(m.startswith("freeing gemmdrift's copy") for m in said)
    assert r.figure("server_matches_inprocess") == 1.0  # the server computed what gemmdrift did before freeing
    (pair,) = r.details["pairs"]
    assert pair["triage"]["verdict"]  # the triage ran, on the reloaded model


def test_server_stops_on_keyboard_interrupt(tmp_path, monkeypatch):
    """Ctrl-C inside the with-block still kills the process group."""
    started = []

    class Fake(server.MlxLmServer):
        def command(self):  # a stand-in server: any long-lived process answers the lifecycle
            return [sys.executable, "-c", "import time; time.sleep(60)"]

    srv = Fake(tmp_path, start_timeout=1)
    monkeypatch.setattr(serving.urllib.request, "urlopen", lambda *a, **k: type(
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
    assert serving._last_line(log) == "FileNotFoundError: No such file: 'x/config.json'"


@pytest.mark.slow
def test_real_server_chat_completions_path(tmp_path):
    """The chat path, run for real: the embedded checkpoint given a chat template (a copy whose other files
    are links) is an mlx-lm checkpoint with a chat-capable tokenizer, so every request goes to
    /v1/chat/completions. The server's lone stream must be in-process generate on the chat-templated ids
    (the server's prompt count was checked against them), and the conversation's second turn (user /
    assistant / user messages) must reuse the first turn's cached tokens."""
    import json
    import os

    from gemmdrift.model.gguf_gemma import converted_dir, embedded_gguf

    src = converted_dir(embedded_gguf())
    ckpt = tmp_path / "chat"
    ckpt.mkdir()
    for f in src.iterdir():
        if f.name not in ("tokenizer_config.json", "gemmdrift_source.json"):
            os.symlink(f, ckpt / f.name)
    conf = json.loads((src / "tokenizer_config.json").read_text())
    # A chat checkpoint parses the template's control tokens (the converted base checkpoint splits them, so
    # that a prompt text is encoded as gemmdrift's SentencePiece tokenizer encodes it).
    conf["split_special_tokens"] = False
    conf["chat_template"] = ("{{ bos_token }}{% for m in messages %}<start_of_turn>"
                             "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}"
                             "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
    (ckpt / "tokenizer_config.json").write_text(json.dumps(conf))
    r = server.measure_server(str(ckpt), "The capital of France is", 3, cases=("concurrent", "conversation"),
                              companions=["Once upon a time"], triage=False)
    assert r.inputs["endpoint"] == "/v1/chat/completions"
    assert r.figure("server_matches_inprocess") == 1.0
    conc, conv = r.details["pairs"]
    assert conc["prompt"][0] == 2 and conc["prompt"][1] == 105  # BOS, then <start_of_turn> from the template
    assert conv["case"] == "conversation" and conv["notes"]["turn1_equal"]
    assert conv["notes"]["cached_tokens"] > len(conc["prompt"]) - 2  # the first turn came from the cache
