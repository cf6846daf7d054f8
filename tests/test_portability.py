"""Small things that differ between Metal, CUDA and this CPU: seeded draws on the CPU stream, mlx-lm's generation
stream, the macOS browser lookup, and benchmark modules that import no mlx (asv's fork server needs that)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import types
from pathlib import Path

import numpy as np

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


def test_seeded_synthetic_draws_keep_their_values():
    import mlx.core as mx

    # Drawn on the CPU stream now (a GPU's erfinv may differ in the last bits); on this CPU the values are
    # those drawn before the change, bit for bit (the hashes were taken from main before it).
    from gemmdrift import model as models, state
    from gemmdrift.model import projections as capture
    from gemmdrift.kernels import paths

    k, v = state._synthetic_kv(40, heads=2)
    # numpy Generator draws since issue 31 (portable across platforms and chips; mx.random.normal's were
    # 06ef39115022d849 / 609e67f369cedd5f): the bf16 of seed 0's first two standard-normal blocks, rounded here.
    rng = np.random.default_rng(0)
    for got in (k, v):
        u = rng.standard_normal((1, 2, 40, 64), dtype=np.float32).view(np.uint32)
        rne = u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))  # round to nearest even, to bf16
        want = (rne & np.uint32(0xFFFF0000)).view(np.float32)
        assert np.array_equal(np.array(got.astype(mx.float32)), want)
    assert (_h(k), _h(v)) == ("96252ad39605481c", "743f71677bea4b0c")
    lm = models.load_model("shape:gemma3-270m")
    proj = [p for p in capture.projections(lm, layers=[0]) if p.name == "mlp.gate_proj"][0]
    w, _ = paths._synthetic_dense(proj, "bfloat16")
    assert _h(w) == "2a5503671d1fafe0"
    model, _ = models._synthetic("gemma3-270m")  # the shape model's own (lazy) initialisation
    assert _h(model.model.layers[0].self_attn.q_proj.weight) == "253bcf4e4f19938b"
    assert _h(model.model.layers[9].self_attn.q_proj.weight) == "2c2d9b8e825e3845"


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
