"""The converted embedded checkpoint is a complete mlx-lm checkpoint (issue 14, item 3).

Regression: the directory held only ``tokenizer.model``, so stock mlx-lm tools
(``mlx_lm.generate``, ``mlx_lm.server``) encoded without the BOS token the GGUF
asks for (``tokenizer.ggml.add_bos_token``) and the model answered
"France. The The The...".
"""

from __future__ import annotations

import json

import pytest

from gemmdrift.model import gguf_gemma
from gemmdrift.model import SentencePieceTokenizer
from gemmdrift.prompts import builtin_prompts, builtin_text

TRICKY = [
    "The capital of France is",
    " hello  world\n\n<start_of_turn>user\nHi<end_of_turn>",  # double space, control-token text
    "<bos>[multimodal] a\n\n\n\nb\t tab",  # a control piece as text, a user-defined piece
    "日本語 😀 café\u00a0nbsp   three",  # byte fallback, no-break space
    "",
]


@pytest.fixture(scope="module")
def checkpoint():
    return gguf_gemma.converted_dir(gguf_gemma.embedded_gguf())


@pytest.mark.slow
def test_stock_mlx_lm_tokenizer_gives_gemmdrift_ids(checkpoint):
    from mlx_lm.utils import load_tokenizer  # what mlx_lm.load, generate and server call

    stock = load_tokenizer(checkpoint)
    ours = SentencePieceTokenizer(checkpoint / "tokenizer.model")
    assert stock.bos_token_id == ours.bos_id == 2
    assert set(stock.eos_token_ids) == ours.eos_ids == {1}
    assert not stock.has_chat_template  # the GGUF has no tokenizer.chat_template
    texts = [builtin_text("essay"), *builtin_prompts(), *TRICKY]
    for text in texts:
        ids = ours.encode(text)
        assert ids[0] == 2
        assert list(stock.encode(text)) == ids, text[:60]
        assert stock.decode(ids[1:]) == ours.decode(ids[1:])
    # the essay really is long and really exercises the shared path
    assert len(ours.encode(texts[0])) > 512


@pytest.mark.slow
def test_checkpoint_tokenizer_config(checkpoint):
    cfg = json.loads((checkpoint / "tokenizer_config.json").read_text())
    assert cfg["add_bos_token"] is True and cfg["bos_token"] == "<bos>" and cfg["eos_token"] == "<eos>"
    assert cfg["pad_token"] == "<pad>" and "chat_template" not in cfg
    src = json.loads((checkpoint / "gemmdrift_source.json").read_text())
    assert src["converter_version"] == gguf_gemma.CONVERTER_VERSION >= 3


def test_hf_tokenizer_files_fail_without_bos_post_processor(tmp_path):
    """The equality check can fail: a tokenizer.json without the BOS template differs from SentencePiece."""
    from sentencepiece import sentencepiece_model_pb2 as pb
    from tokenizers import Tokenizer

    m = pb.ModelProto()
    m.trainer_spec.model_type = pb.TrainerSpec.BPE
    m.trainer_spec.byte_fallback = True
    m.trainer_spec.unk_id, m.trainer_spec.bos_id, m.trainer_spec.eos_id, m.trainer_spec.pad_id = 3, 2, 1, 0
    m.trainer_spec.unk_piece, m.trainer_spec.bos_piece = "<unk>", "<bos>"
    m.trainer_spec.eos_piece, m.trainer_spec.pad_piece = "<eos>", "<pad>"
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = False
    m.normalizer_spec.remove_extra_whitespaces = False
    T = pb.ModelProto.SentencePiece
    pieces = [("<pad>", 0, T.CONTROL), ("<eos>", 0, T.CONTROL), ("<bos>", 0, T.CONTROL), ("<unk>", 0, T.UNKNOWN),
              ("\n\n", 0, T.USER_DEFINED)]
    pieces += [(f"<0x{b:02X}>", 0, T.BYTE) for b in range(256)]
    pieces += [(c, -10.0 - i, T.NORMAL) for i, c in enumerate("▁abcd")]
    pieces += [("ab", -1.0, T.NORMAL), ("▁ab", -2.0, T.NORMAL), ("cd", -3.0, T.NORMAL), ("abcd", -4.0, T.NORMAL)]
    for text, score, typ in pieces:
        p = m.pieces.add()
        p.piece, p.score, p.type = text, score, typ
    m.trainer_spec.vocab_size = len(pieces)
    proto = m.SerializeToString()
    (tmp_path / "tokenizer.model").write_bytes(proto)
    ours = SentencePieceTokenizer(tmp_path / "tokenizer.model")
    files = gguf_gemma.hf_tokenizer_files(proto)
    tok = Tokenizer.from_str(files["tokenizer.json"])
    for text in ["abcd ab\n\ncd", " abx", "dcba é"]:
        assert tok.encode(text).ids == ours.encode(text), text
    tok.post_processor = None  # the planted bug: no BOS
    assert tok.encode("abcd").ids != ours.encode("abcd")
