"""gemmdrift's direct GGUF reader gives what gguf-py's GGUFReader gives: every metadata value, every tensor's
type, dtype, shape and bytes (issue 25, item 7: the fresh-clone conversion spent most of its time in GGUFReader).

The embedded Gemma itself is covered end to end elsewhere: its conversion's weights digest is pinned in the
shipped golden base (tests/test_golden.py) and the stored norm weights are read by a third, struct-only reader
(tests/test_models.py::gguf_tensor)."""

from __future__ import annotations

import numpy as np
import pytest

from gemmdrift.model import gguf_gemma
from gemmdrift.errors import GemmdriftError
from gemmdrift.model.gguf_read import GGUFFile

gguf = pytest.importorskip("gguf")


def reference_fields(reader) -> dict:
    """GGUFReader's fields as Python values, decoded the way gguf_gemma decoded them before."""
    out = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):  # the header, not metadata
            continue
        if f.types[0].name == "ARRAY":
            if f.types[1].name == "STRING":
                out[key] = [bytes(f.parts[i]).decode("utf-8", errors="replace") for i in f.data]
            else:
                out[key] = [f.parts[i].tolist()[0] for i in f.data]
        elif f.types[0].name == "STRING":
            out[key] = bytes(f.parts[f.data[0]]).decode("utf-8")
        else:
            out[key] = f.parts[f.data[0]].tolist()[0]
    return out


def write_sample(path, alignment=None):
    rng = np.random.default_rng(3)
    w = gguf.GGUFWriter(str(path), "gemma3")
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_block_count(2)
    w.add_layer_norm_rms_eps(1e-6)  # float32
    w.add_bool("test.flag", True)
    w.add_int64("test.neg", -(2**40))
    w.add_float64("test.f64", 0.1)
    w.add_string("test.text", "naïve ▁piece")
    w.add_token_list(["<pad>", "<eos>", "<bos>", "▁a", "\n\n", "é"])
    w.add_token_scores([0.0, -1.5, 2.25, -3.0, 1e-8, 7.0])
    w.add_token_types([3, 3, 3, 1, 4, 1])
    w.add_array("test.nested", [[1, 2], [3]])  # arrays of arrays: decoded element by element
    w.add_tensor("plain32", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("plain16", rng.standard_normal(7).astype(np.float16))
    q = gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("q8", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("alignment", [None, 64])
def test_the_reader_reads_what_gguf_py_reads(tmp_path, alignment):
    path = tmp_path / "s.gguf"
    write_sample(path, alignment)
    mine, ref = GGUFFile(path), gguf.GGUFReader(str(path))
    expected = reference_fields(ref)
    assert set(mine.fields) == set(expected)
    for key, value in expected.items():
        if key == "test.nested":  # GGUFReader flattens nested arrays; this reader keeps their structure
            assert mine.fields[key] == [[1, 2], [3]]
            continue
        assert mine.fields[key] == value and type(mine.fields[key]) is type(value), key
    assert mine.fields["test.text"] == "naïve ▁piece" and mine.fields["test.neg"] == -(2**40)
    assert [t.name for t in mine.tensors] == [t.name for t in ref.tensors] == ["plain32", "plain16", "q8"]
    for a, b in zip(mine.tensors, ref.tensors):
        assert a.tensor_type == b.tensor_type and a.data.dtype == b.data.dtype and a.data.shape == b.data.shape
        assert a.data.tobytes() == b.data.tobytes(), a.name
        np.testing.assert_array_equal(gguf.quants.dequantize(a.data, a.tensor_type),
                                      gguf.quants.dequantize(b.data, b.tensor_type))
    assert mine.tensors[0].data.shape == (3, 5) and mine.tensors[2].data.shape == (2, 68)  # 34-byte Q8_0 blocks


def test_the_sample_gives_the_config_and_vocabulary(tmp_path):
    path = tmp_path / "s.gguf"
    write_sample(path)
    reader = gguf_gemma._reader(path)
    assert gguf_gemma._string_list(reader, "tokenizer.ggml.tokens")[3:] == ["▁a", "\n\n", "é"]
    assert gguf_gemma._number_list(reader, "tokenizer.ggml.scores")[1:3] == [-1.5, 2.25]
    assert gguf_gemma._field(reader, "gemma3.block_count") == 2
    assert gguf_gemma._field(reader, "no.such.key", 7) == 7


@pytest.mark.parametrize("cut", [3, 30, 200, -40])  # -40: into the last tensor (past its padding, < 32)
def test_a_truncated_file_is_a_clear_error(tmp_path, cut):
    path = tmp_path / "s.gguf"
    write_sample(path)
    data = path.read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[:cut])
    with pytest.raises(GemmdriftError, match="truncated or corrupt"):
        gguf_gemma._reader(bad)


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGML" + bytes(100))
    with pytest.raises(GemmdriftError, match="magic"):
        gguf_gemma._reader(bad)


def test_two_conversions_at_once_convert_once(tmp_path, monkeypatch):
    """Two test workers (or two commands) on a fresh cache: the second waits for the first's lock and uses its
    directory, instead of converting again and replacing the finished one under the first's feet."""
    import threading
    import time

    monkeypatch.setenv("GEMMDRIFT_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "s.gguf"
    write_sample(path)
    calls = []

    def slow_convert(gguf_path, target, progress):
        calls.append(target)
        time.sleep(0.5)  # long enough for the other thread to arrive at the lock
        tmp = target.with_name(".tmp-" + target.name)
        tmp.mkdir()
        (tmp / "config.json").write_text("{}")
        (tmp / "model.safetensors").write_bytes(b"")
        tmp.rename(target)
        return target

    monkeypatch.setattr(gguf_gemma, "_convert", slow_convert)
    got = []
    threads = [threading.Thread(target=lambda: got.append(gguf_gemma.converted_dir(path))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and got == [calls[0], calls[0]]
