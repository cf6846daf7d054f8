"""What travels to the GPU machine, and in which call: the manifest both halves of the check read.

Pure standard library, no gemmdrift import: ``prepare.py`` (here) writes the manifest and ``run.py`` (there)
reads it. A call sends the repository's working tree plus the folders named in ``carry``, at most 64 MiB in
all (/work/.library/device/README.md, Limits); every artifact (a wheel, the recompressed CUDA wheel, the
embedded Gemma's GGUF) is one byte stream, cut into pieces so that each call's folder plus the tree fits.

Manifest (``.gpu-pack/manifest.json``, copied into every call's folder)::

    {"version": 1, "limit_bytes": 67108864, "margin_bytes": ..., "tree_bytes": ...,
     "artifacts": [{"name", "kind", "encoding", "bytes", "sha256", "decoded_sha256", "target"}],
     "calls": [{"call": 1, "folder": ".gpu-pack/call1", "bytes": ..., "total_bytes": ...,
                "pieces": [{"file", "artifact", "index", "offset", "bytes", "sha256"}]}]}
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MIB = 1024 * 1024
LIMIT = 64 * MIB  # one call's working tree, carried folders included
MARGIN = MIB // 4  # room left in every call for what the tree gains before the call (prepare.py --check re-measures)
PACK = ".gpu-pack"  # the ignored folder the pieces live in (.git/info/exclude)
MANIFEST = "manifest.json"
CHUNK = 4 * MIB  # read size for hashing and copying


class PackError(Exception):
    """A one-line refusal (a piece over the limit, a call over budget, a missing or altered piece)."""


def sha256_file(path: str | os.PathLike, offset: int = 0, size: int | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(offset)
        left = os.path.getsize(path) - offset if size is None else size
        while left > 0:
            block = f.read(min(CHUNK, left))
            if not block:
                break
            h.update(block)
            left -= len(block)
    return h.hexdigest()


def call_folder(call: int) -> str:
    return f"{PACK}/call{call}"


def piece_name(artifact: str, index: int) -> str:
    return f"{artifact}.p{index:02d}"


def plan_calls(artifacts: list[dict], tree_bytes: int, limit: int = LIMIT, margin: int = MARGIN) -> list[dict]:
    """Cut the artifacts, in order, into pieces filling calls of ``limit - margin - tree_bytes`` bytes each.

    ``artifacts``: dicts with ``name`` and ``bytes`` (the size of the file that travels). Each call but the
    last is full; a piece never spans two calls. Returns the calls (without sha256: :func:`write_pieces`
    adds them). A tree that leaves no room is refused.
    """
    room = limit - margin - tree_bytes
    if room <= 0:
        raise PackError(f"the working tree ({tree_bytes / MIB:.1f} MiB) leaves no room under "
                        f"{limit / MIB:g} MiB per call (margin {margin / MIB:g} MiB)")
    calls: list[dict] = []
    current: dict | None = None
    for art in artifacts:
        offset, index = 0, 0
        while offset < art["bytes"] or (art["bytes"] == 0 and index == 0):
            if current is None or current["bytes"] >= room:
                current = {"call": len(calls) + 1, "folder": call_folder(len(calls) + 1), "bytes": 0,
                           "pieces": []}
                calls.append(current)
            size = min(art["bytes"] - offset, room - current["bytes"])
            current["pieces"].append({"file": piece_name(art["name"], index), "artifact": art["name"],
                                      "index": index, "offset": offset, "bytes": size})
            current["bytes"] += size
            offset += size
            index += 1
            if art["bytes"] == 0:
                break
    for c in calls:
        c["total_bytes"] = c["bytes"] + tree_bytes
    return calls


def write_pieces(source: dict[str, Path], calls: list[dict], pack: Path) -> None:
    """Write every piece of ``calls`` from its artifact's file (``source[name]``) into ``pack/callN/``."""
    for c in calls:
        folder = pack / f"call{c['call']}"
        folder.mkdir(parents=True, exist_ok=True)
        for p in c["pieces"]:
            dst = folder / p["file"]
            tmp = dst.with_name(dst.name + ".tmp")
            with open(source[p["artifact"]], "rb") as f, open(tmp, "wb") as g:
                f.seek(p["offset"])
                left = p["bytes"]
                while left:
                    block = f.read(min(CHUNK, left))
                    g.write(block)
                    left -= len(block)
            os.replace(tmp, dst)
            p["sha256"] = sha256_file(dst)


def check_pack(pack: Path, manifest: dict, tree_bytes: int | None = None, limit: int = LIMIT) -> list[str]:
    """Refuse, before anything is sent, a piece over ``limit`` or a call whose folder plus the tree is over it.

    Every file under each call's folder counts (not only the manifest's pieces). Returns one line per call;
    raises :class:`PackError` naming the file or the call."""
    tree = manifest["tree_bytes"] if tree_bytes is None else tree_bytes
    lines = []
    for c in manifest["calls"]:
        folder = pack / f"call{c['call']}"
        if not folder.is_dir():
            raise PackError(f"{folder}: missing (run prepare.py again)")
        total = 0
        for f in sorted(p for p in folder.rglob("*") if p.is_file()):
            size = f.stat().st_size
            if size > limit:
                raise PackError(f"{f}: {size / MIB:.1f} MiB, over the {limit / MIB:g} MiB a call may send")
            total += size
        if total + tree > limit:
            raise PackError(f"call {c['call']} ({folder}): {total / MIB:.1f} MiB of pieces plus the working tree's "
                            f"{tree / MIB:.1f} MiB is over the {limit / MIB:g} MiB a call may send")
        for p in c["pieces"]:
            f = folder / p["file"]
            if not f.is_file() or f.stat().st_size != p["bytes"]:
                raise PackError(f"{f}: missing or not {p['bytes']} bytes (run prepare.py again)")
        lines.append(f"call {c['call']}: {len(c['pieces'])} pieces, {total / MIB:.1f} MiB + tree "
                     f"{tree / MIB:.1f} MiB = {(total + tree) / MIB:.1f} MiB")
    return lines


def tree_bytes(repo: Path) -> int:
    """Bytes of what every call sends besides the carried folders: tracked files plus untracked files git does
    not ignore (``git ls-files -co --exclude-standard``)."""
    import subprocess

    out = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=repo, check=True,
                         capture_output=True).stdout
    total = 0
    for name in out.split(b"\0"):
        if name:
            p = repo / os.fsdecode(name)
            if p.is_file() and not p.is_symlink():
                total += p.stat().st_size
    return total


def read_manifest(path: Path) -> dict:
    if not Path(path).is_file():
        raise PackError(f"{path}: missing (no pack there: run prepare.py first)")
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise PackError(f"cannot read the manifest {path}: {e}") from None
    if not isinstance(data, dict) or data.get("version") != 1:
        raise PackError(f"{path} is not a version-1 manifest")
    return data
