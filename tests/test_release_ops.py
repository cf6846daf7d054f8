"""The release comparison of ops (issue 29 item 4): every op captured once, recomputed under another interpreter.

The other release is planted: this interpreter with a ``sitecustomize`` that scales ``mx.fast.rope``'s output by
(1 + 2**-7), so RoPE alone changes, by one or two bf16 ULPs wherever its output is not zero.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import make_tiny
from gemmdrift.attribution import release_ops as ro
from gemmdrift.errors import GemmdriftError

PLANT = """import os
if os.environ.get("GEMMDRIFT_PLANT_ROPE"):
    import mlx.core as mx
    _rope = mx.fast.rope
    mx.fast.rope = lambda *a, **k: _rope(*a, **k) * 1.0078125
"""


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    d = tmp_path_factory.mktemp("release_ops")
    lm = make_tiny()
    doc = ro.capture_ops(lm, list(range(1, 12)), 8, d / "capture.json")
    return d, doc


def test_capture_names_every_op_in_forward_order_and_copies_its_arrays(captured):
    d, doc = captured
    layer0 = [c["op"] for c in doc["calls"] if c["layer"] == 0]
    assert layer0 == ["input_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                      "self_attn.q_norm", "self_attn.k_norm", "self_attn.rope", "self_attn.rope", "sdpa",
                      "self_attn.o_proj", "post_attention_layernorm", "pre_feedforward_layernorm", "mlp.gate_proj",
                      "mlp.up_proj", "mlp.down_proj", "post_feedforward_layernorm"]
    assert sorted({c["layer"] for c in doc["calls"]}) == [-1, 0, 1, 2, 3, 4]
    # The model's own ops: the embedding first, the final norm and the LM head (untied here) last, numbered as
    # the op taps number them.
    outside = [(c["op"], c["layer"]) for c in doc["calls"] if c["layer"] in (-1, 4)]
    assert outside == [("embed_tokens", -1), ("norm", 4), ("lm_head", 4)]
    assert doc["calls"][0]["op"] == "embed_tokens" and doc["calls"][-1]["op"] == "lm_head"
    emb, head = doc["calls"][0], doc["calls"][-1]
    assert "method" not in head and head["class"].endswith(":Linear")
    assert emb["args"][0]["dtype"] == "int32"  # the token ids of the block
    # gemma3 scales the embedding in place (h *= sqrt(hidden)): the object the lookup returned then holds the
    # first layer's input. Stored by identity, the first norm would be given the unscaled lookup.
    first_norm = doc["calls"][1]
    assert first_norm["op"] == "input_layernorm" and first_norm["args"][0]["array"] != emb["out"]["array"]
    with np.load(d / "capture.npz") as z:
        lookup = ro.from_bits(z[emb["out"]["array"]], "bfloat16")
        import mlx.core as mx
        scaled = lookup * mx.array(64 ** 0.5, mx.bfloat16).astype(lookup.dtype)
        assert np.array_equal(z[first_norm["args"][0]["array"]], ro.to_bits(scaled)[0])
    with np.load(d / "capture.npz") as z:
        assert z[head["out"]["array"]].shape == (1, 3, 97)  # the block's 3 positions, the tiny vocabulary
        # q, k and v read the same normed hidden state: one array
        q, k, v = [c for c in doc["calls"] if c["layer"] == 0 and c["op"] in ("self_attn.q_proj", "self_attn.k_proj",
                                                                                "self_attn.v_proj")]
        assert q["args"][0] == k["args"][0] == v["args"][0]
        assert len(z.files) == len({a["array"] for c in doc["calls"] for a in [*c["args"], c["out"],
                                    *c.get("params", {}).values(), *c["kwargs"].values()] if "array" in a})
    assert [c["seq"] for c in doc["calls"]] == list(range(len(doc["calls"])))
    with np.load(d / "capture.npz") as z:
        keys = {c["layer"]: z[c["args"][1]["array"]].shape[2] for c in doc["calls"] if c["op"] == "sdpa"}
    # The keys each sdpa call of the block saw (copies, not the caches' buffers, which later steps overwrite):
    # the global layers all 8 prompt positions and the 3 of the block; the sliding ones (window 8) the
    # RotatingKVCache's 7 + 3.
    assert keys == {0: 10, 1: 11, 2: 10, 3: 11}
    assert doc["positions"] == "8-10"
    assert (d / "capture.json").is_file() and not list(d.glob("*.tmp*"))


def test_a_tied_lm_head_is_the_embeddings_as_linear_and_its_table_is_stored_once(tmp_path):
    lm = make_tiny()
    lm.model.tie_word_embeddings = True  # as mlx-lm's sanitize leaves a checkpoint without lm_head weights
    lm.model.pop("lm_head")
    doc = ro.capture_ops(lm, list(range(1, 12)), 8, tmp_path / "capture.json")
    emb, head = doc["calls"][0], doc["calls"][-1]
    assert (emb["op"], emb["layer"], head["op"], head["layer"]) == ("embed_tokens", -1, "lm_head", 4)
    assert head["method"] == "as_linear" and head["params"]["weight"] == emb["params"]["weight"]
    with np.load(tmp_path / "capture.npz") as z:
        table = z[emb["params"]["weight"]["array"]]
        assert table.shape == (97, 64)
        logits = z[head["out"]["array"]]
    x = ro.from_bits(np.load(tmp_path / "capture.npz")[head["args"][0]["array"]], head["args"][0]["dtype"])
    assert np.array_equal(logits, ro.to_bits(lm.model.model.embed_tokens.as_linear(x))[0])  # the head's own output
    res = ro.release_comparison(tmp_path / "capture.json", sys.executable, None, tmp_path / "same")
    assert res["compared"] == len(doc["calls"]) and res["changed"] == [] and res["errors"] == []


def test_the_same_interpreter_recomputes_every_op_bit_for_bit(captured):
    d, doc = captured
    res = ro.release_comparison(d / "capture.json", sys.executable, None, d / "same")
    assert res["compared"] == len(doc["calls"]) and res["changed"] == [] and res["errors"] == []


def test_a_planted_op_change_in_another_interpreter_is_named_alone(captured, tmp_path, monkeypatch):
    d, doc = captured
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(PLANT)
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.setenv("GEMMDRIFT_PLANT_ROPE", "1")
    work = tmp_path / "w"
    work.mkdir()
    res = ro.release_comparison(d / "capture.json", sys.executable, None, work)
    assert res["errors"] == []
    assert [c["op"] for c in res["changed"]] == ["self_attn.rope"] * 8  # q and k, four layers, nothing else
    assert [c["layer"] for c in res["changed"]] == [0, 0, 1, 1, 2, 2, 3, 3]
    with np.load(d / "capture.npz") as z:
        for c in res["changed"]:
            rec = doc["calls"][c["seq"]]
            out = z[rec["out"]["array"]]
            nonzero = (out & 0x7FFF) != 0  # the bf16 bits of a nonzero value
            assert c["frac_differ"] == pytest.approx(nonzero.mean())
            assert c["max_ulp"] in (1.0, 2.0)  # x * (1 + 2**-7) is one or two bf16 ULPs from x


def test_ulp_distance_of_bf16_bits():
    a = np.array([0x3F80, 0x3F80, 0x0000, 0x8001], dtype=np.uint16)  # 1.0, 1.0, +0, -tiny
    b = np.array([0x3F81, 0x3F80, 0x8000, 0x0001], dtype=np.uint16)  # next, same, -0, +tiny
    assert ro.ulp_distance(a, b, "bfloat16").tolist() == [1, 0, 0, 2]


def test_another_interpreter_is_probed_before_any_model_loads(tmp_path):
    with pytest.raises(GemmdriftError, match="no such file"):
        ro.probe_python(str(tmp_path / "nope"))
    with pytest.raises(GemmdriftError, match="mlx does not import"):
        ro.probe_python("/usr/bin/python3")
    sh = tmp_path / "notpython"
    sh.write_text("#!/bin/sh\necho hello\n")
    sh.chmod(0o755)
    with pytest.raises(GemmdriftError, match="not a Python interpreter"):
        ro.probe_python(str(sh))
    info = ro.probe_python(sys.executable)
    assert info["mlx"] == ro.this_python()["mlx"]
    r = subprocess.run([sys.executable, "-m", "gemmdrift.attribution.release_ops", "compare", "--python", str(tmp_path / "nope"),
                        "--out", str(tmp_path / "o")], capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert not (tmp_path / "o").exists()
    r = subprocess.run([sys.executable, "-m", "gemmdrift", "attribute", "--python", "/usr/bin/python3", "--out",
                        str(tmp_path / "o")], capture_output=True, text=True)  # the attribute command's mode
    assert r.returncode == 2 and "mlx does not import" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_the_shipped_release_comparisons_name_rope_for_0294():
    shipped = Path(__file__).resolve().parent.parent / "benchmarks" / "release_ops"
    docs = [json.loads(p.read_text()) for p in sorted(shipped.glob("*.json"))]
    if not docs:
        pytest.skip("no shipped release comparisons")
    old = [d for d in docs if "0.29.4" in (d["from"]["mlx"], d["to"]["mlx"])]
    assert old and all({c["op"] for c in d["changed"]} == {"self_attn.rope"} for d in old)
    for d in docs:
        if "0.29.4" not in (d["from"]["mlx"], d["to"]["mlx"]):
            assert d["changed"] == [], (d["from"], d["to"])
