"""Small things that differ between Metal, CUDA and this CPU: seeded draws on the CPU stream, mlx-lm's generation
stream, the macOS browser lookup, and benchmark modules that import no mlx (asv's fork server needs that)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_importing_the_benchmark_modules_imports_no_mlx():
    # asv's forkserver imports every benchmark module once and forks each case from it: a module that imported
    # mlx at the top would hand every case a forked Metal/CUDA state.
    code = ("import pkgutil, importlib, sys\n"
            "import benchmarks\n"
            "names = [m.name for m in pkgutil.iter_modules(benchmarks.__path__) if m.name.startswith('bench_')]\n"
            "assert len(names) >= 8, names\n"
            "for n in names + ['common']:\n"
            "    importlib.import_module('benchmarks.' + n)\n"
            "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm'))\n"
            "print(len(names), heavy)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    count, heavy = r.stdout.strip().split(" ", 1)
    assert heavy == "[]", f"benchmark modules imported {heavy}"


def test_the_import_check_sees_a_planted_mlx_import(tmp_path):
    pkg = tmp_path / "benchmarks"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "bench_x.py").write_text("import mlx.core\n")
    r = subprocess.run([sys.executable, "-c", "import sys, benchmarks.bench_x; print('mlx.core' in sys.modules)"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "True"


def _h(a) -> str:
    import mlx.core as mx

    return hashlib.sha256(np.array(a.astype(mx.float32)).tobytes()).hexdigest()[:16]


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 (round to nearest even), as float32, computed here rather than by mlx."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rne = u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))
    return (rne & np.uint32(0xFFFF0000)).view(np.float32)


def test_seeded_synthetic_draws_keep_their_values():
    import math
    import zlib

    import mlx.core as mx

    # Every seeded draw here comes from a generator that is bit-identical across platforms and chips (issue 31):
    # numpy's Generator, or mlx's uniform (threefry bits and correctly rounded float ops) on the CPU stream;
    # never mx.random.normal, whose erfinv differs between Metal chips (mlx #3568).
    from gemmdrift import model as models, state
    from gemmdrift.model import projections as capture
    from gemmdrift.kernels import paths

    k, v = state._synthetic_kv(40, heads=2)
    # numpy Generator draws since issue 31 (portable across platforms and chips; mx.random.normal's were
    # 06ef39115022d849 / 609e67f369cedd5f): the bf16 of seed 0's first two standard-normal blocks, rounded here.
    rng = np.random.default_rng(0)
    for got in (k, v):
        want = _bf16(rng.standard_normal((1, 2, 40, 64), dtype=np.float32))
        assert np.array_equal(np.array(got.astype(mx.float32)), want)
    assert (_h(k), _h(v)) == ("96252ad39605481c", "743f71677bea4b0c")

    # _synthetic_dense: numpy's Generator per projection since issue 31 (mx.random.uniform / normal under the same
    # crc32 key before: gate_proj's hash was 2a5503671d1fafe0). Recomputed here in one draw, where the function
    # draws a slice of rows at a time (made 300 rows here: seven slices), and rounded to bf16 here. The normal
    # branch is a tied head's (an Embedding; Gemma 4's shapes): a small one stands in for it.
    import dataclasses

    import mlx.nn as nn

    lm = models.load_model("shape:gemma3-270m")
    gate = [p for p in capture.projections(lm, layers=[0]) if p.name == "mlp.gate_proj"][0]
    tied = dataclasses.replace(gate, layer=lm.n_layers, name="lm_head", module=nn.Embedding(2048, 640))
    for proj in (gate, tied):
        embedding = proj is tied
        rng = np.random.default_rng(zlib.crc32(f"{models.SYNTHETIC_SEED}:{proj.layer}:{proj.name}".encode()))
        n, kk = proj.out_dims, proj.in_dims
        scale = np.float32(math.sqrt(1.0 / kk))
        if embedding:  # nn.Embedding's init: normal(0, scale)
            want = rng.standard_normal((n, kk), dtype=np.float32) * scale
        else:  # nn.Linear's init: uniform(-scale, scale)
            want = -scale + (np.float32(2) * scale) * rng.random((n, kk), dtype=np.float32)
            assert np.abs(want).max() <= scale
        whole, _ = paths._synthetic_dense(proj, "bfloat16")  # 2048 rows of 640: one slice
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(paths, "EXACT_CHUNK_BYTES", 300 * 4 * kk)
            sliced, _ = paths._synthetic_dense(proj, "bfloat16")
        for w in (whole, sliced):
            assert w.dtype == mx.bfloat16 and w.shape == (n, kk) == (2048, 640)
            assert np.array_equal(np.array(w.astype(mx.float32)), _bf16(want)), proj.name
    assert _h(paths._synthetic_dense(gate, "bfloat16")[0]) == "076e4785d8c918df"
    assert _h(paths._synthetic_dense(tied, "bfloat16")[0]) == "946899c40f7161e2"

    # The shape model's own (lazy) parameters: the linears keep mlx's init (uniform, portable: these hashes are
    # those from before issue 31); the embeddings are redrawn from a numpy table (model._portable_embeddings).
    seen = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(models, "_portable_embeddings", seen.append)
        model, _ = models._synthetic("gemma3-270m")
    assert seen == [model]
    assert _h(model.model.layers[0].self_attn.q_proj.weight) == "253bcf4e4f19938b"
    assert _h(model.model.layers[9].self_attn.q_proj.weight) == "2c2d9b8e825e3845"

    class Stand(nn.Module):  # Gemma 3 270M's embedding is 262144 x 640: 4096 rows of it stand in (same code)
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(4096, 640)

    stand = Stand()
    models._portable_embeddings(stand)
    emb = np.array(stand.embed_tokens.weight)
    table = np.random.default_rng(models.SYNTHETIC_SEED).standard_normal(1 << models.NORMAL_TABLE_BITS, dtype=np.float32)
    values = np.unique(emb)  # 2.6M draws of the 65536 entries: every entry of the table, nothing else
    assert np.isin(values, table * np.float32(math.sqrt(1 / 640))).all() and len(values) == len(np.unique(table * np.float32(math.sqrt(1 / 640))))
    assert abs(emb.std() * math.sqrt(640) - 1) < 0.01 and abs(emb.mean()) * math.sqrt(640) < 0.01
    assert hashlib.sha256(emb.tobytes()).hexdigest()[:16] == "0b8ec11418a1c654"


def test_the_tiny_model_is_drawn_portably():
    # conftest.make_tiny's weights are numpy Generator draws (issue 31), the same on every platform and chip: many
    # tests pin the tiny model's behaviour. Pinned here, so that a change of the draw is seen where it is made.
    from conftest import make_tiny

    tiny = make_tiny("float32").model
    assert _h(tiny.model.embed_tokens.weight) == "b2471e255aa95180"
    assert _h(tiny.model.layers[0].self_attn.q_proj.weight) == "e9db3d2ae8d23453"
    assert _h(make_tiny("bfloat16", seed=3).model.model.layers[3].mlp.down_proj.weight) == "de70b90b456399d5"


def test_selecting_a_device_after_mlx_lm_generate_warns(monkeypatch, capsys):
    import mlx.core as mx

    from gemmdrift.machine import envinfo

    assert envinfo.generation_stream_warning(mx.Device(mx.cpu), mx.Device(mx.cpu)) is None
    msg = envinfo.generation_stream_warning(mx.Device(mx.gpu), mx.Device(mx.cpu))
    assert "Device(gpu, 0)" in msg and "select the device before importing mlx_lm" in msg
    # The stream of an mlx-lm imported earlier on another device (planted: this machine has one device).
    planted = types.SimpleNamespace(generation_stream=types.SimpleNamespace(device=mx.Device(mx.gpu)))
    monkeypatch.setitem(sys.modules, "mlx_lm.generate", planted)
    envinfo.select_device("cpu")
    assert "gemmdrift: warning: mlx_lm.generate was imported" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "mlx_lm.generate",
                        types.SimpleNamespace(generation_stream=types.SimpleNamespace(device=mx.Device(mx.cpu))))
    envinfo.select_device("cpu")
    assert capsys.readouterr().err == ""


def test_the_browser_is_found_in_the_macos_app_bundles(tmp_path):
    from gemmdrift.report import MAC_BROWSERS, find_chromium

    nothing = lambda name: None  # noqa: E731
    assert find_chromium(lambda n: "/usr/bin/chromium" if n == "chromium" else None) == "/usr/bin/chromium"
    assert find_chromium(nothing, home=tmp_path, exists=lambda p: p == MAC_BROWSERS[0]) == MAC_BROWSERS[0]
    user = str(tmp_path / "Applications" / "Chromium.app" / "Contents" / "MacOS" / "Chromium")
    assert find_chromium(nothing, home=tmp_path, exists=lambda p: p == user) == user
    assert find_chromium(nothing, home=tmp_path, exists=lambda p: False) is None
