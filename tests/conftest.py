"""Shared fixtures.

Two models: a tiny seeded gemma3_text (mlx-lm's own code, sliding window 8) for
fast structural tests, and the real embedded Gemma 3 270M, converted once per
cache directory and shared by the whole session.
"""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path

import pytest

# Tests share one conversion cache; CI starts empty and converts once (~20 s).
os.environ.setdefault("GEMMDRIFT_CACHE", str(Path(__file__).resolve().parent.parent / ".cache" / "gemmdrift"))

# The device every test computes on: the CPU, or the GPU with GEMMDRIFT_TEST_DEVICE=gpu (then the tests of
# reference-CPU facts are skipped and the structural ones run there). GEMMDRIFT_DEVICE is the CLI's default
# --device, so the commands the tests start (gd(...)) compute on it too.
TEST_DEVICE = os.environ.get("GEMMDRIFT_TEST_DEVICE", "").strip().lower() or "cpu"
os.environ["GEMMDRIFT_DEVICE"] = TEST_DEVICE
os.environ.setdefault("MLX_ENABLE_TF32", "0")  # true float32 in this process, as every measuring command sets it
# The main job's asv benchmarks are opt-in (benchmarks/common.full_benchmarks, issue 47); their tests run them. The
# tests of the opt-in itself unset it (monkeypatch).
os.environ.setdefault("GEMMDRIFT_BENCH_FULL", "1")


def reference_backend() -> bool:
    """Whether the tests run on the backend the linux_cpu_reference facts were read from: mlx's CPU backend on
    Linux x86_64 (reference BLAS cblas_sgemm, simd max_size 1). A Mac's CPU backend (Accelerate, BNNS), Linux
    aarch64 (NEON) and every GPU compute in other orders."""
    return sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64") and TEST_DEVICE == "cpu"


def pytest_configure(config):
    import mlx.core as mx

    if TEST_DEVICE not in ("cpu", "gpu"):
        raise pytest.UsageError(f"GEMMDRIFT_TEST_DEVICE={TEST_DEVICE!r}: expected cpu or gpu")
    if TEST_DEVICE == "gpu" and not (mx.metal.is_available() or (hasattr(mx, "cuda") and mx.cuda.is_available())):
        raise pytest.UsageError("GEMMDRIFT_TEST_DEVICE=gpu: this mlx sees no GPU (neither Metal nor CUDA)")
    mx.set_default_device(mx.gpu if TEST_DEVICE == "gpu" else mx.cpu)


# The test files that take longest, longest first (their summed durations in a run of the whole suite on the 2-core
# machine, 2026-12-03; the shared benchmark setup's test alone is about 200 s idle). `make test` runs each file whole in one of two
# processes and hands them out in collection order (pytest-xdist --dist loadfile --no-loadscope-reorder): these
# start first, so the run does not end on one long file while the other core idles.
LONG_FILES = ("test_benchmarks.py", "test_notebooks.py", "test_server.py", "test_cli.py", "test_replay.py",
              "test_golden.py", "test_workers.py", "test_report.py", "test_replay_jit.py", "test_cachebench.py",
              "test_release_ops.py")


def pytest_collection_modifyitems(config, items):
    first = {name: i for i, name in enumerate(LONG_FILES)}
    items[:] = sorted(items, key=lambda item: first.get(item.path.name, len(first)))  # stable: files stay whole
    if reference_backend():
        return
    skip = pytest.mark.skip(reason=f"a fact of mlx's Linux x86_64 CPU backend (reference BLAS); here "
                                   f"{platform.system()} {platform.machine()}, device {TEST_DEVICE}")
    for item in items:
        if "linux_cpu_reference" in item.keywords:
            item.add_marker(skip)

TINY_CONFIG = {
    "model_type": "gemma3_text",
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "query_pre_attn_scalar": 32,
    "vocab_size": 97,
    "sliding_window": 8,
    "sliding_window_pattern": 2,
    "rms_norm_eps": 1e-6,
}


def make_tiny(dtype: str = "bfloat16", seed: int = 0, **overrides):
    """A LoadedModel around a small random gemma3_text model (real mlx-lm code, caches and masks)."""
    import math
    import zlib

    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np
    from mlx_lm.models import gemma3_text

    from gemmdrift.model import LoadedModel, cast_model, layer_types

    config = {**TINY_CONFIG, **overrides}
    model = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(config))
    # The weights are drawn with numpy's Generator, one per parameter (seeded by seed and the parameter's path), in
    # mlx.nn's init distributions: the same tiny model on every platform and chip. Until issue 31 they were the
    # init's own draws after mx.random.seed(seed); nn.Embedding's is mx.random.normal, whose erfinv differs between
    # Metal chips (mlx #3568). The norms keep their init (ones).
    for path, mod in model.named_modules():
        if isinstance(mod, (nn.Linear, nn.Embedding)):
            rng = np.random.default_rng([seed, zlib.crc32(f"{path}.weight".encode())])
            n, k = mod.weight.shape
            scale = np.float32(math.sqrt(1.0 / k))
            if isinstance(mod, nn.Embedding):  # nn.Embedding: normal(0, 1/sqrt(dims))
                w = rng.standard_normal((n, k), dtype=np.float32) * scale
            else:  # nn.Linear: uniform(-1/sqrt(in), 1/sqrt(in)), as mlx draws it: lo + (hi - lo) * u, u in [0, 1)
                w = -scale + (np.float32(2) * scale) * rng.random((n, k), dtype=np.float32)
            assert "bias" not in mod  # gemma3_text's linears have none
            # Larger-than-default weights (x4, exact) so that activations are not tiny.
            mod.weight = mx.array(w * np.float32(4))
    cast_model(model, dtype)
    mx.eval(model.parameters())
    info = {"source": "tiny", "kind": "tiny", "dtype": dtype, "synthetic": True, "architecture": "gemma3_text",
            "n_layers": config["num_hidden_layers"], "layer_types": layer_types(model),
            "vocab_size": config["vocab_size"], "hidden_size": config["hidden_size"], "quantization": None,
            "sliding_window": config["sliding_window"], "max_positions": None, "path": None}
    return LoadedModel(model=model, tokenizer=None, info=info)


def plant_zero_first_key(lm) -> None:
    """A planted semantic bug: caches that zero their oldest entry on multi-token updates, so
    verification blocks attend over a wrong key, whatever the precision."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    class ZeroFirstKeyOnBlocks(KVCache):
        def update_and_fetch(self, k, v):
            keys, values = super().update_and_fetch(k, v)
            if k.shape[2] > 1 and keys.shape[2] > k.shape[2]:
                z = mx.zeros_like(keys[..., :1, :])
                return mx.concatenate([z, keys[..., 1:, :]], axis=2), mx.concatenate([z, values[..., 1:, :]], axis=2)
            return keys, values

    lm.model.make_cache = lambda: [ZeroFirstKeyOnBlocks() for _ in lm.model.layers]


@pytest.fixture
def tiny():
    return make_tiny()


@pytest.fixture(scope="session")
def embedded():
    from gemmdrift.model import load_model

    return load_model("embedded", dtype="bfloat16")
