"""Record, per mlx release tag, the git blob of every source file the dispatch rules and kernel recipes of
gemmdrift.dispatch were read from: src/gemmdrift/data/dispatch_tags.json (read by gemmdrift.dispatch.tags).

    python scripts/read_dispatch_tags.py /path/to/ml-explore/mlx   # a clone (bare or not) with its tags

A part read from its first tag (gemmdrift.dispatch.tags.READ_FROM) follows its own rules; an older part whose files
are byte-identical to a release whose rules were read takes that release's rules ("as X.Y.Z"); any other is "not
read". Standard library and git only.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from gemmdrift.dispatch.tags import DATA, SOURCES  # noqa: E402

FIRST = (0, 26, 5)  # the oldest mlx-cpu wheel (issue 47's matrix)


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True).stdout


def blob(repo: Path, rev: str, path: str) -> str | None:
    r = subprocess.run(["git", "-C", str(repo), "rev-parse", "-q", "--verify", f"{rev}:{path}"], capture_output=True,
                       text=True)
    return r.stdout.strip()[:12] if r.returncode == 0 else None


def main(repo: Path) -> None:
    tags = []
    for t in git(repo, "tag").split():
        m = re.fullmatch(r"v(\d+)\.(\d+)\.(\d+)", t)
        if m and tuple(map(int, m.groups())) >= FIRST:
            tags.append((tuple(map(int, m.groups())), t))
    head = git(repo, "rev-parse", "--short=7", "HEAD").strip()
    version_h = git(repo, "show", "HEAD:mlx/version.h")
    head_version = ".".join(re.search(rf"MLX_VERSION_{k} (\d+)", version_h).group(1)
                            for k in ("MAJOR", "MINOR", "PATCH"))
    files = sorted({f for fs in SOURCES.values() for f in fs})
    out = {"mirror": head, "mirror_version": head_version, "files": files, "tags": {}}
    for _, t in sorted(tags):
        out["tags"][t[1:]] = {f: blob(repo, t, f) for f in files}
    if head_version not in out["tags"]:  # the mirror's HEAD: the newest source read
        out["tags"][head_version] = {f: blob(repo, "HEAD", f) for f in files}
    DATA.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"{DATA}: {len(out['tags'])} releases, {len(files)} files (mirror {head} = mlx {head_version})")


if __name__ == "__main__":
    if len(sys.argv) != 2 or not Path(sys.argv[1]).exists():
        sys.exit("usage: python scripts/read_dispatch_tags.py /path/to/ml-explore/mlx")
    main(Path(sys.argv[1]))
