"""On the GPU machine: take in a call's pieces, and install each artifact as soon as all its pieces are there.

Standard library only (and pip, already there). Everything lives under ``WORK`` (default /tmp/gemmdrift-gpu),
outside the repository copy, so that a later call on the same warm machine finds it:

* ``WORK/pieces/``: every piece received, checked against the manifest's sha256 as it arrives;
* ``WORK/site/``: the wheels installed with ``pip install --no-index --no-deps --target`` (all in one pip
  command: mlx and mlx-cuda-13 share the ``mlx/`` folder, and ``--target`` replaces a folder it finds);
* ``WORK/cache/gguf/gemma-3-270m-q4_k_m.gguf``: the embedded Gemma, where ``GEMMDRIFT_CACHE=WORK/cache``
  makes gemmdrift read it instead of assembling the chunk packages;
* ``WORK/installed.json``: what is installed, so a later call does not do it again.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import json
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plan  # noqa: E402

GGUF_DIR = "cache/gguf"


def receive(repo: Path, manifest: dict, work: Path, call: int | None) -> dict:
    """Copy the pieces of every call folder present in the repository copy into ``work/pieces`` (checked).

    Returns {"received": [...], "missing": {call: [files]}} for the calls before ``call`` whose pieces are not
    here (a machine that went cold between two calls: start again from call 1)."""
    store = work / "pieces"
    store.mkdir(parents=True, exist_ok=True)
    received, missing = [], {}
    for c in manifest["calls"]:
        folder = repo / c["folder"]
        for p in c["pieces"]:
            dst = store / p["file"]
            if dst.is_file() and dst.stat().st_size == p["bytes"]:
                continue
            src = folder / p["file"]
            if src.is_file():
                got = plan.sha256_file(src)
                if got != p["sha256"]:
                    raise plan.PackError(f"{src}: sha256 {got[:12]}... is not the manifest's {p['sha256'][:12]}...")
                tmp = dst.with_name(dst.name + ".tmp")
                shutil.copyfile(src, tmp)
                os.replace(tmp, dst)
                received.append(p["file"])
            elif call is None or c["call"] <= call:
                missing.setdefault(c["call"], []).append(p["file"])
    return {"received": received, "missing": missing}


def _joined(manifest: dict, work: Path, name: str) -> Path | None:
    """The artifact's pieces concatenated and checked (None while a piece is missing)."""
    pieces = sorted((p for c in manifest["calls"] for p in c["pieces"] if p["artifact"] == name),
                    key=lambda p: p["index"])
    files = [work / "pieces" / p["file"] for p in pieces]
    if not all(f.is_file() for f in files):
        return None
    art = next(a for a in manifest["artifacts"] if a["name"] == name)
    out = work / "joined" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    if not (out.is_file() and out.stat().st_size == art["bytes"]):
        with open(out, "wb") as g:
            for f in files:
                with open(f, "rb") as s:
                    shutil.copyfileobj(s, g, plan.CHUNK)
    if plan.sha256_file(out) != art["sha256"]:
        raise plan.PackError(f"{name}: the joined pieces do not match the manifest's sha256")
    return out


def _record_hash(data_path: Path, entry: str) -> str:
    h = hashlib.sha256(data_path.read_bytes()).digest()
    return "sha256=" + base64.urlsafe_b64encode(h).rstrip(b"=").decode()


def rebuild_wheel(tar_xz: Path, wheel_name: str, dest: Path) -> Path:
    """The wheel again, from the recompressed files, each checked against the wheel's own RECORD."""
    tree = dest / (wheel_name + ".d")
    if tree.exists():
        shutil.rmtree(tree)
    with lzma.open(tar_xz) as xz, tarfile.open(fileobj=xz) as t:
        t.extractall(tree, filter="data") if hasattr(tarfile, "data_filter") else t.extractall(tree)
    record = next(tree.glob("*.dist-info/RECORD"))
    bad = []
    for row in csv.reader(record.read_text().splitlines()):
        name, digest = row[0], row[1] if len(row) > 1 else ""
        if digest and _record_hash(tree / name, name) != digest:
            bad.append(name)
    if bad:
        raise plan.PackError(f"{wheel_name}: {len(bad)} files differ from its RECORD, e.g. {bad[0]}")
    wheel = dest / wheel_name
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as z:
        for f in [*sorted(p for p in tree.rglob("*") if p.is_file() and p != record), record]:  # RECORD last
            info = zipfile.ZipInfo(f.relative_to(tree).as_posix(), date_time=(1980, 1, 1, 0, 0, 0))
            info.external_attr = (f.stat().st_mode & 0o777) << 16  # the tar carries no dates; modes kept
            with open(f, "rb") as src, z.open(info, "w") as dst:
                shutil.copyfileobj(src, dst, plan.CHUNK)
    shutil.rmtree(tree)
    return wheel


def install(manifest: dict, work: Path) -> dict:
    """Install every artifact whose pieces are all here and that is not installed yet. Idempotent."""
    state_file = work / "installed.json"
    state = json.loads(state_file.read_text()) if state_file.is_file() else {}
    wheels_dir = work / "wheels"
    wheels_dir.mkdir(parents=True, exist_ok=True)
    wheel_arts = [a for a in manifest["artifacts"] if a["target"] == "site"]
    for art in manifest["artifacts"]:
        if art["name"] in state:
            continue
        joined = _joined(manifest, work, art["name"])
        if joined is None:
            continue
        if art["target"] == "site":
            if art["encoding"] == "tar.xz":
                rebuild_wheel(joined, art["wheel"], wheels_dir)
            else:
                shutil.copyfile(joined, wheels_dir / art["name"])
            state[art["name"]] = "ready"
        elif art["target"] == "gguf":
            target = work / GGUF_DIR / art["file"]
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name("." + target.name + ".partial")
            with lzma.open(joined) as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst, plan.CHUNK)
            if plan.sha256_file(tmp) != art["decoded_sha256"]:
                raise plan.PackError(f"{art['file']}: sha256 after xz is not the package's")
            os.replace(tmp, target)
            state[art["name"]] = str(target)
        joined.unlink()
    ready = all(state.get(a["name"]) for a in wheel_arts)
    if ready and not state.get("site"):
        site = work / "site"
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--no-cache-dir", "--upgrade", "--target", str(site), *sorted(str(p) for p in wheels_dir.glob("*.whl"))]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise plan.PackError("pip install failed: " + (done.stderr.strip().splitlines() or ["?"])[-1])
        link_cuda_libraries(site)
        state["site"] = str(site)
        shutil.rmtree(wheels_dir)
    tmp = state_file.with_name(state_file.name + ".tmp")  # the steps' process reads it: never half written
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, state_file)
    return state


def nvidia_root() -> Path | None:
    """The ``nvidia`` folder of the CUDA pip libraries already installed there (cuBLAS, NVRTC, cuDNN, ...)."""
    try:
        import nvidia  # a namespace package
    except ImportError:
        return None
    paths = [Path(p) for p in getattr(nvidia, "__path__", [])]
    return paths[0] if paths else None


def link_cuda_libraries(site: Path) -> None:
    """libmlx.so finds cuBLAS & co. through RPATH ``$ORIGIN/../../nvidia/...``: point ``site/nvidia`` at them."""
    root, link = nvidia_root(), site / "nvidia"
    if root is not None and not link.exists():
        link.symlink_to(root, target_is_directory=True)


def run_env(work: Path, repo: Path, base: dict | None = None) -> dict:
    """The environment every step runs with: the installed site first, gemmdrift's source, the GGUF cache."""
    env = dict(os.environ if base is None else base)
    paths = [str(work / "site")] if (work / "site").is_dir() else []
    env["PYTHONPATH"] = os.pathsep.join(paths + [str(repo / "src")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH")
                                                                        else []))
    env["GEMMDRIFT_CACHE"] = str(work / "cache")
    env["MPLBACKEND"] = "Agg"
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("MLX_PTX_CACHE_DIR", str(work / "ptx"))  # NVRTC's output, shared by every step's process
    root = nvidia_root()
    if root is not None:
        libs = sorted(str(p) for p in root.glob("*/lib") if p.is_dir())
        env["LD_LIBRARY_PATH"] = os.pathsep.join(libs + ([env["LD_LIBRARY_PATH"]] if env.get("LD_LIBRARY_PATH")
                                                         else []))
        # NVRTC's headers: mlx reads CUDA_HOME/include, else /usr/local/cuda
        if not env.get("CUDA_HOME") and not Path("/usr/local/cuda/include").is_dir():
            home = next((p.parent.parent for p in root.glob("*/include/cuda_runtime.h")), None)
            if home is not None:
                env["CUDA_HOME"] = str(home)
    return env
