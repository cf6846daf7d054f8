"""What a loaded model is: its dtype names, the typed :class:`ModelDescription` results carry as
``inputs["model"]``, the :class:`LoadedModel` every loader returns, its one-line description and the one
resume-key scheme of every checkpointed run. The loaders themselves are in :mod:`gemmdrift.model`, which
re-exports every name here (``from gemmdrift.model import ModelDescription`` keeps working).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..errors import GemmdriftError

# --------------------------------------------------------------------------- dtypes

DTYPE_ALIASES = {
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "float32": "float32",
    "fp32": "float32",
}


def parse_dtype(name: str) -> str:
    """Canonical dtype name ('bfloat16', 'float16', 'float32')."""
    canon = DTYPE_ALIASES.get(str(name).lower())
    if canon is None:
        raise GemmdriftError(f"unknown dtype {name!r} (choose bfloat16, float16 or float32)")
    return canon


def mx_dtype(name: str):
    import mlx.core as mx

    return getattr(mx, parse_dtype(name))


# --------------------------------------------------------------------------- the description

@dataclass(frozen=True)
class ModelDescription:
    """What a loaded model is, typed and validated: every field must be given (None where it means
    something: a dense model's ``quantization``, a model without a sliding window, a synthetic model's
    ``path``); a wrong or missing field is an error, never a default.

    ``as_dict()`` is the JSON record results carry as ``inputs["model"]`` (the keys ``lm.info`` always had);
    keys beyond the fields (``gguf``, ``weights``, ``gguf_tensor_types``, ``shape``, ``tokenizer_error``)
    travel in ``extra``.
    """

    source: str
    kind: str  # embedded | gguf | mlx | shape | tiny (tests)
    dtype: str  # bfloat16 | float16 | float32
    synthetic: bool
    architecture: str | None  # mlx-lm model_type
    n_layers: int
    layer_types: tuple[str, ...]  # 'sliding' | 'global' | 'layer' per decoder layer
    vocab_size: int
    hidden_size: int | None
    sliding_window: int | None
    max_positions: int | None  # max_position_embeddings, None when the config does not say
    quantization: Mapping[str, Any] | None  # None: dense
    path: str | None  # the mlx-lm directory (None: synthetic weights)
    stored_quantization: Mapping[str, Any] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    FIELDS = ("source", "kind", "dtype", "synthetic", "architecture", "n_layers", "layer_types", "vocab_size",
              "hidden_size", "sliding_window", "max_positions", "quantization", "path")
    OPTIONAL = ("stored_quantization",)

    def __post_init__(self) -> None:
        def bad(name: str, why: str):
            return GemmdriftError(f"model description: {name} {why} (got {getattr(self, name)!r})")

        if not isinstance(self.source, str) or not self.source:
            raise bad("source", "must be a non-empty string")
        if not isinstance(self.kind, str) or not self.kind:
            raise bad("kind", "must be a non-empty string")
        if DTYPE_ALIASES.get(str(self.dtype)) != self.dtype:
            raise bad("dtype", "must be bfloat16, float16 or float32")
        if not isinstance(self.synthetic, bool):
            raise bad("synthetic", "must be True or False")
        for name in ("n_layers", "vocab_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise bad(name, "must be a positive integer")
        for name in ("hidden_size", "sliding_window", "max_positions"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise bad(name, "must be a positive integer or None")
        if not isinstance(self.layer_types, (list, tuple)) or not all(isinstance(t, str) for t in self.layer_types):
            raise bad("layer_types", "must be a list of strings")
        if len(self.layer_types) != self.n_layers:
            raise bad("layer_types", f"must name all {self.n_layers} layers")
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        for name in ("quantization", "stored_quantization"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, Mapping):
                raise bad(name, "must be a mapping or None")
        if self.path is not None and not isinstance(self.path, str):
            raise bad("path", "must be a string or None")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelDescription":
        """From the ``info`` record a loader builds: every field of :data:`FIELDS` must be present."""
        if isinstance(d, cls):
            return d
        if not isinstance(d, Mapping):
            raise GemmdriftError(f"model description: expected a mapping, got {type(d).__name__}")
        missing = [k for k in cls.FIELDS if k not in d]
        if missing:
            raise GemmdriftError(f"model description lacks {', '.join(missing)}")
        known = set(cls.FIELDS) | set(cls.OPTIONAL)
        return cls(**{k: d[k] for k in known if k in d}, extra={k: v for k, v in d.items() if k not in known})

    def as_dict(self) -> dict[str, Any]:
        """The JSON-able record (``lm.info``): the fields, then the extras."""
        out = {k: getattr(self, k) for k in (*self.FIELDS, *self.OPTIONAL)}
        out["layer_types"] = list(self.layer_types)
        for k in ("quantization", "stored_quantization"):
            out[k] = dict(out[k]) if out[k] is not None else None
        return {**out, **dict(self.extra)}


class LoadedModel:
    """An mlx-lm model plus its tokenizer and a typed :class:`ModelDescription` of where it came from.

    ``info`` may be given as a dict (validated into the description); code reads ``lm.description``,
    and ``lm.info`` is its JSON record (a fresh dict: change the description, not the dict).
    """

    def __init__(self, model: Any, tokenizer: Any, info: Mapping[str, Any] | ModelDescription | None = None,
                 description: ModelDescription | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        if description is None:
            if info is None:
                raise GemmdriftError("a loaded model needs its description")
            description = ModelDescription.from_dict(info)
        self.description = description
        # How to load this model again (load_model's arguments; a worker process uses it), None when it cannot be.
        self.recipe: dict[str, Any] | None = None

    @property
    def info(self) -> dict[str, Any]:
        return self.description.as_dict()

    @property
    def layers(self) -> list:
        return self.model.layers

    @property
    def n_layers(self) -> int:
        return len(self.model.layers)

    @property
    def synthetic(self) -> bool:
        return self.description.synthetic

    @property
    def vocab_size(self) -> int:
        return self.description.vocab_size


def describe(info: "Mapping[str, Any] | ModelDescription") -> str:
    """One line: source, architecture, layers, dtype, quantization (a description, or its record from a results
    directory)."""
    if isinstance(info, ModelDescription):
        info = info.as_dict()
    q = info.get("quantization")
    qs = "dense" if not q else ", ".join(f"{k}={v}" for k, v in q.items() if not isinstance(v, dict))
    tag = "  [SYNTHETIC weights]" if info.get("synthetic") else ""
    return (f"{info['source']} ({info.get('architecture')}, {info['n_layers']} layers, "
            f"{info['dtype']}, {qs}){tag}")


def resume_key(description: ModelDescription, *parts: Any) -> str:
    """The one resume-key scheme of every checkpointed run (stack runs, `run` parts, prompt sets): a digest of
    the model (source, path, dtype, quantization), the mlx and mlx-lm versions, where it computes (backend,
    device, architecture, macOS version, every MLX_* variable: :func:`gemmdrift.machine.runenv.compute_record`) and the
    run's own ``parts`` (JSON-able). A checkpoint saved under another key is never reused. ``description`` None:
    a model-free measurement (fingerprints), keyed by the versions, the compute record and ``parts`` alone."""
    import hashlib

    from ..machine.envinfo import dist_version
    from ..machine.runenv import compute_record

    d = description
    model = [d.source, d.path, d.dtype, dict(d.quantization) if d.quantization else None] if d is not None else [None] * 4
    blob = json.dumps([*model, dist_version("mlx"), dist_version("mlx-lm"), compute_record(), *parts], sort_keys=True,
                      default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def weights_record(description: ModelDescription) -> dict[str, Any]:
    """What the environment record of a result measured on this model adds: the digest of the converted
    weights (sha256 of the converted model.safetensors; None for checkpoints gemmdrift did not convert) and
    the gguf package that converted them."""
    return {"weights_sha256": description.extra.get("weights_sha256"),
            "weights_gguf_version": description.extra.get("gguf_version")}
