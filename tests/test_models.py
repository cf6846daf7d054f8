"""Model sources: the embedded Gemma, GGUF conversion, mlx-lm directories, shapes, bad input."""

import json
import math

import numpy as np
import pytest

from conftest import make_tiny
from gemmdrift.model import gguf_gemma
from gemmdrift import model as models
from gemmdrift.errors import GemmdriftError

SENTENCE = "The keeper wound the clock every four hours, and he wrote the weather in his ledger."


def log_likelihood(lm, ids):
    import mlx.core as mx

    logits = lm.model(mx.array([[int(i) for i in ids]])).astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    # int(): mlx before 0.31.2 cannot index an array with a numpy integer (the shuffled ids are np.int64).
    return float(sum(logp[0, i, int(ids[i + 1])].item() for i in range(len(ids) - 1)))


@pytest.mark.slow
def test_embedded_model_is_the_real_gemma(embedded):
    info = embedded.info
    assert (info["architecture"], info["n_layers"], info["hidden_size"], info["vocab_size"]) == (
        "gemma3_text", 18, 640, 262144)
    assert info["layer_types"] == (["sliding"] * 5 + ["global"]) * 3
    assert set(info["gguf_tensor_types"]) == {"F32", "Q4_K", "Q5_0", "Q6_K", "Q8_0"}
    assert not embedded.synthetic


@pytest.mark.slow
def test_embedded_tokenizer_round_trips_english(embedded):
    tok = embedded.tokenizer
    assert tok.encode("The capital of France is") == [2, 818, 5279, 529, 7001, 563]
    text = "Hello world!  Two  spaces,\ttabs and newlines\nüñíçødé 12345."
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.slow
def test_converted_weights_read_as_english(embedded):
    # A correct conversion (norm offsets, names, no Q/K permutation) makes a real
    # sentence far likelier than the same tokens shuffled.
    ids = embedded.tokenizer.encode(SENTENCE)
    shuffled = [ids[0]] + list(np.random.default_rng(0).permutation(ids[1:]))
    real, mixed = log_likelihood(embedded, ids), log_likelihood(embedded, shuffled)
    per_token = (real - mixed) / (len(ids) - 1)
    assert per_token > 2.0, (real, mixed)
    assert real / (len(ids) - 1) > -6.0  # uniform guessing over 262,144 tokens would be -12.5


def gguf_tensor(path, wanted: str) -> np.ndarray:
    """One F32 or F16 tensor of a GGUF file, read from its header with struct alone (GGUF v2/v3 layout).

    Why not gguf-py's GGUFReader: it builds numpy views of every one of the 262,144 vocabulary strings, 8 s
    on a quiet core here and over a minute under load, to read 640 floats (issue 25, item 7). A wrong
    offset here reads other bytes, which cannot equal the loaded weights: the test below cannot pass by it.
    """
    import mmap
    import struct

    scalar = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        assert m[:4] == b"GGUF"
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", m, 4)
        assert version in (2, 3), version
        pos = 24

        def take(fmt):
            nonlocal pos
            out = struct.unpack_from("<" + fmt, m, pos)
            pos += struct.calcsize("<" + fmt)
            return out[0] if len(out) == 1 else out

        def string():
            nonlocal pos
            n = take("Q")
            pos += n
            return bytes(m[pos - n:pos]).decode()

        def value(kind):
            nonlocal pos
            if kind == 8:
                return string()
            if kind == 9:
                elem, count = take("I"), take("Q")
                if elem in scalar:  # skipped whole: no key read here is an array
                    pos += count * struct.calcsize(scalar[elem])
                else:
                    for _ in range(count):
                        value(elem)
                return None
            return take(scalar[kind])

        alignment = 32
        for _ in range(n_kv):
            key = string()
            v = value(take("I"))
            if key == "general.alignment":
                alignment = v
        infos = {}
        for _ in range(n_tensors):
            name = string()
            dims = [take("Q") for _ in range(take("I"))]
            infos[name] = (dims, take("I"), take("Q"))
        data_start = -(-pos // alignment) * alignment
        dims, kind, offset = infos[wanted]
        dtype = {0: np.float32, 1: np.float16}[kind]  # GGML_TYPE_F32, GGML_TYPE_F16 (norms are stored plain)
        count = int(np.prod(dims))
        return np.frombuffer(m, dtype=dtype, count=count, offset=data_start + offset).astype(np.float32)


@pytest.mark.slow
def test_norm_weights_are_shifted_back_by_one(embedded):
    import mlx.core as mx

    stored = gguf_tensor(embedded.info["gguf"], "output_norm.weight")
    loaded = np.array(embedded.model.model.norm.weight.astype(mx.float32))
    np.testing.assert_array_equal(loaded, np.array(mx.array(stored - 1).astype(mx.bfloat16).astype(mx.float32)))


def test_gguf_config_builds_from_metadata(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "g.gguf"
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(2)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_key_length(32)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1e6)
    w.add_sliding_window(8)
    w.add_context_length(1024)
    w.add_token_list(["<pad>", "<eos>", "<bos>", "<unk>", "a"])
    w.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cfg = gguf_gemma.gguf_config(gguf_gemma._reader(path))
    assert cfg["model_type"] == "gemma3_text" and cfg["num_hidden_layers"] == 2
    assert (cfg["hidden_size"], cfg["head_dim"], cfg["query_pre_attn_scalar"], cfg["vocab_size"]) == (64, 32, 32, 5)
    assert cfg["sliding_window"] == 8 and cfg["sliding_window_pattern"] == 6
    # A GGUF with the tensors missing is refused with a clear message.
    with pytest.raises(GemmdriftError, match="lacks"):
        models.load_model(str(path))


def test_other_gguf_architectures_are_refused(tmp_path):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "llama.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("x", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GemmdriftError, match="unsupported GGUF architecture 'llama'"):
        models.load_model(str(path))


@pytest.mark.slow
def test_truncated_gguf_is_a_clear_error(tmp_path, embedded):
    src = embedded.info["gguf"]
    bad = tmp_path / "cut.gguf"
    with open(src, "rb") as f:
        bad.write_bytes(f.read(3_000_000))
    with pytest.raises(GemmdriftError, match="truncated or corrupt"):
        models.load_model(str(bad))


def save_tiny(path, quantization=None, model_type="gemma3_text"):
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from conftest import TINY_CONFIG

    lm = make_tiny("float32")
    path.mkdir(parents=True, exist_ok=True)
    cfg = {**TINY_CONFIG, "model_type": model_type}
    (path / "config.json").write_text(json.dumps(cfg))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(lm.model.parameters())))
    return lm


def test_mlx_lm_directory_loads_lazily_with_its_own_code(tmp_path):
    import mlx.core as mx

    ref = save_tiny(tmp_path / "m")
    lm = models.load_model(str(tmp_path / "m"), dtype="float32")
    assert lm.info["kind"] == "mlx" and lm.info["architecture"] == "gemma3_text" and lm.n_layers == 4
    assert lm.tokenizer is None and "tokenizer_error" in lm.info
    x = mx.array([[1, 2, 3]])
    assert np.array_equal(np.array(lm.model(x)), np.array(ref.model(x)))


def test_requantize_mimics_mlx_lm_convert(tmp_path):
    import mlx.nn as nn

    save_tiny(tmp_path / "m")
    q = models.parse_quantization(4, 32)
    lm = models.load_model(str(tmp_path / "m"), quantize=q)
    assert isinstance(lm.model.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert lm.info["quantization"]["bits"] == 4 and lm.info["quantization"]["group_size"] == 32


def test_unsupported_architecture(tmp_path):
    save_tiny(tmp_path / "m", model_type="no_such_arch")
    with pytest.raises(GemmdriftError, match="unsupported architecture 'no_such_arch'"):
        models.load_model(str(tmp_path / "m"))


def test_corrupt_safetensors(tmp_path):
    save_tiny(tmp_path / "m")
    f = tmp_path / "m" / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(GemmdriftError, match="truncated"):
        models.load_model(str(tmp_path / "m"))
    f.write_bytes(b"\x05\x00")
    with pytest.raises(GemmdriftError, match="corrupt safetensors"):
        models.load_model(str(tmp_path / "m"))


def test_directory_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(GemmdriftError, match="no config.json"):
        models.load_model(str(tmp_path / "empty"))


def test_bad_sources_and_options(tmp_path):
    with pytest.raises(GemmdriftError, match="model not found"):
        models.load_model(str(tmp_path / "nope"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(GemmdriftError, match="not a .gguf"):
        models.load_model(str(tmp_path / "weights.bin"))
    with pytest.raises(GemmdriftError, match="unknown shape"):
        models.load_model("shape:gemma9")
    with pytest.raises(GemmdriftError, match="unknown dtype"):
        models.parse_dtype("float8")
    for bits, gs, mode in [(7, 64, "affine"), (4, 48, "affine"), (4, 64, "nope"), (4, 64, "mxfp4")]:
        with pytest.raises(GemmdriftError):
            models.parse_quantization(bits, gs, mode)


def test_shape_models_are_synthetic_and_lazy():
    import importlib.util
    import time

    lm = models.load_model("shape:gemma3-270m", dtype="bfloat16")
    assert lm.synthetic and lm.info["weights"].startswith("synthetic") and lm.n_layers == 18
    if importlib.util.find_spec("mlx_lm.models.gemma4_text") is None:
        # mlx-lm before 0.31.2 has no Gemma 4: one clear error, and laziness is shown on Gemma 3 27B.
        with pytest.raises(GemmdriftError, match="no gemma4_text architecture"):
            models.load_model("shape:gemma4-31b")
        t0 = time.perf_counter()
        big = models.load_model("shape:gemma3-27b")  # ~27B parameters: must stay lazy
        assert time.perf_counter() - t0 < 30
        assert big.n_layers == 62 and big.info["hidden_size"] == 5376 and big.synthetic
        assert big.info["layer_types"] == (["sliding"] * 5 + ["global"]) * 10 + ["sliding"] * 2
        return
    t0 = time.perf_counter()
    big = models.load_model("shape:gemma4-31b")  # ~31B parameters: must stay lazy
    assert time.perf_counter() - t0 < 30
    assert big.n_layers == 60 and big.info["hidden_size"] == 5376 and big.synthetic
    assert big.info["layer_types"] == (["sliding"] * 5 + ["global"]) * 10


def test_conversion_progress_goes_to_stderr(tmp_path, monkeypatch, capsys):
    # Regression: "gemmdrift: converting ...gguf" went to stdout, so the first `--json` run on a fresh
    # cache printed invalid JSON.
    class Stop(Exception):
        pass

    def stop(path):
        raise Stop

    monkeypatch.setenv("GEMMDRIFT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_gemma, "_reader", stop)  # stop right after the progress line
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    with pytest.raises(Stop):
        gguf_gemma.converted_dir(f)
    out, err = capsys.readouterr()
    assert out == "" and "converting m.gguf" in err
