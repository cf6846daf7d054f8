"""The mlx <-> mlx-lm pairing: one source, asv.conf.json's matrix (issue 53).

``gemmdrift upgrade`` (which mlx-lm an environment of an mlx release gets, which cached environment is the one
asked for), ``python -m gemmdrift.history.releases`` (the environments it builds) and ``tests/test_tier.py`` read the
pairs here. The main line pairs each mlx with the newest mlx-lm its entries list (the newest whose wheel's
requirement on mlx it meets, docs/tracking.md#the-matrix); mlx 0.32.4's other entries are the mlx-lm axis, and any
other mlx's older mlx-lm entry is a bridge (:func:`bridges`).

Whether an mlx-lm can run an mlx at all is :data:`MLX_LM_NEEDS`: each mlx-lm's own requirement on mlx, read from
its wheels' metadata (2026-12-06). From mlx-lm 0.28.3 the requirement is on macOS and the ``cpu`` extra only, so
a plain Linux install of mlx-lm never says no (mlx-lm 0.32.2 installs beside mlx 0.26.5, then fails to load:
``module 'mlx.core' has no attribute 'new_thread_local_stream'``): the bound is checked here, before any build.

Standard library only: read before any check that refuses a flag.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any, Sequence

from .errors import GemmdriftError

CONF = "asv.conf.json"

# The lowest mlx each mlx-lm release asks for (its wheel's METADATA), from the first mlx-lm release that asks it:
# 0.26.4 asks mlx>=0.26.0, 0.27.1 >=0.29.0, 0.28.0 >=0.29.1, 0.28.1-0.30.2 >=0.29.2, 0.30.4-0.30.5 >=0.30.3,
# 0.30.6-0.31.2 >=0.30.4, 0.31.3 >=0.31.2, 0.32.0-0.32.2 >=0.32.2. Requirements only grow, so a release between two
# rows asks at least the lower row's (a lower bound), and one newer than the last row at least the last row's.
MLX_LM_NEEDS: tuple[tuple[str, str], ...] = (
    ("0.26.4", "0.26.0"), ("0.27.1", "0.29.0"), ("0.28.0", "0.29.1"), ("0.28.1", "0.29.2"), ("0.30.4", "0.30.3"),
    ("0.30.6", "0.30.4"), ("0.31.3", "0.31.2"), ("0.32.0", "0.32.2"),
)
_KNOWN_THROUGH = "0.32.2"  # the newest mlx-lm whose requirement was read


def vkey(v: str) -> tuple[int, ...]:
    """A release number as a sortable tuple ('0.30.10' after '0.30.9')."""
    return tuple(int(x) for x in re.findall(r"\d+", v or "")[:4])


def project_root() -> Path | None:
    """The checkout this runs in: the nearest directory up from here holding asv.conf.json
    (the notebooks run from notebooks/), else the one this package sits in (src layout)."""
    for base in (Path.cwd(), *Path.cwd().parents, Path(__file__).resolve().parents[2]):
        if (base / CONF).is_file():
            return base
    return None


def read_conf(root: Path | None = None) -> dict[str, Any]:
    """``root``'s asv.conf.json; one line when it is missing or unreadable. Default: the checkout this package sits
    in (src layout), else :func:`project_root` (a directory of the user's own with an asv.conf.json of its own is
    never read for gemmdrift's pairing while the package's checkout has one)."""
    if root is None:
        here = Path(__file__).resolve().parents[2]
        root = here if (here / CONF).is_file() else project_root()
    if root is None:
        raise GemmdriftError(f"no {CONF} here or above: the mlx <-> mlx-lm pairing is read from its matrix")
    try:
        conf = json.loads((Path(root) / CONF).read_text())
    except (OSError, ValueError) as e:
        raise GemmdriftError(f"cannot read {Path(root) / CONF}: {e}") from None
    if not isinstance(conf, dict):
        raise GemmdriftError(f"{Path(root) / CONF} is not an asv configuration")
    return conf


def this_platform() -> str:
    """The matrix's ``sys_platform`` for this machine ('darwin' on a Mac, 'linux' elsewhere)."""
    return "darwin" if sys.platform == "darwin" else "linux"


def env_label(req: dict[str, str]) -> str:
    """``mlx0.29.4-lm0.30.2``: the directory and status key of one entry."""
    return f"mlx{req.get('mlx', '')}-lm{req.get('mlx-lm', '')}"


def entries(conf: dict[str, Any], platform: str = "linux") -> list[tuple[str, dict[str, str]]]:
    """(label, pins) of every include entry of ``platform``, in the configuration's order."""
    out = []
    for inc in conf.get("include", []):
        if inc.get("sys_platform") != platform:
            continue
        req = {k: str(v) for k, v in inc.get("req", {}).items()}
        out.append((env_label(req), req))
    return out


def releases(conf: dict[str, Any], platform: str) -> list[tuple[str, str]]:
    """(mlx, mlx-lm) of every entry of ``platform``: the releases it measures."""
    return [(r.get("mlx", ""), r.get("mlx-lm", "")) for _, r in entries(conf, platform)]


def main_line(conf: dict[str, Any], platform: str | None = None) -> dict[str, str]:
    """{mlx: the mlx-lm the matrix pairs with it}: the newest mlx-lm among that mlx's entries (the main line; mlx
    0.32.4's older mlx-lm entries are the mlx-lm axis)."""
    out: dict[str, str] = {}
    for mlx, lm in releases(conf, platform or this_platform()):
        if mlx and lm and (mlx not in out or vkey(lm) > vkey(out[mlx])):
            out[mlx] = lm
    return out


def bridges(conf: dict[str, Any], platform: str = "linux") -> list[tuple[str, dict[str, str]]]:
    """The bridge entries of ``platform``: an mlx with an mlx-lm other than its main line's, where that mlx is not
    the newest (whose other entries are the mlx-lm axis). A bridge measures mlx B with the older mlx-lm X of a pair
    mlx A with X -> B with Y, so that the pair splits into mlx's change and mlx-lm's (docs/tracking.md#bridges);
    its results live apart (``benchmarks/reference/bridges``), so the history's labels stay the same."""
    main = main_line(conf, platform)
    newest = max(main, key=vkey, default="")
    return [(lab, r) for lab, r in entries(conf, platform)
            if r.get("mlx") != newest and r.get("mlx-lm") != main.get(r.get("mlx", ""))]


def needs(mlx_lm: str) -> tuple[str | None, bool]:
    """(the lowest mlx ``mlx_lm`` asks for, whether that is exact): exact for a release up to the newest whose
    requirement was read (:data:`MLX_LM_NEEDS`), a lower bound past it; (None, False) before the first row."""
    found = None
    for first, mlx in MLX_LM_NEEDS:
        if vkey(first) <= vkey(mlx_lm):
            found = mlx
    return found, found is not None and vkey(mlx_lm) <= vkey(_KNOWN_THROUGH)


def nearest_pairs(mlx: str, pairs: dict[str, str]) -> list[tuple[str, str]]:
    """The matrix's pairs next to ``mlx``: the newest mlx below it and the oldest above it."""
    vs = sorted(pairs, key=vkey)
    below = [v for v in vs if vkey(v) < vkey(mlx)]
    above = [v for v in vs if vkey(v) > vkey(mlx)]
    return [(v, pairs[v]) for v in ([below[-1]] if below else []) + ([above[0]] if above else [])]


def describe_pairs(pairs: Sequence[tuple[str, str]]) -> str:
    return ", ".join(f"mlx {m} with mlx-lm {lm}" for m, lm in pairs)


def check_pair(mlx: str, mlx_lm: str, pairs: dict[str, str] | None = None, flag: str = "--mlx-lm") -> None:
    """Refuse an mlx-lm that cannot run ``mlx`` (its requirement on mlx, :func:`needs`), naming the matrix's
    pairing for ``mlx`` (or the nearest known) when ``pairs`` is given."""
    low, exact = needs(mlx_lm)
    if low is None or vkey(mlx) >= vkey(low):
        return
    pairs = pairs or {}
    hint = (f"asv.conf.json pairs mlx {mlx} with mlx-lm {pairs[mlx]}" if mlx in pairs else
            f"the nearest known pairings: {describe_pairs(nearest_pairs(mlx, pairs))}" if pairs else "")
    raise GemmdriftError(f"{flag} {mlx_lm} cannot run mlx {mlx}: mlx-lm {mlx_lm} needs mlx >= {low}"
                         f"{'' if exact else ' at least'} (its wheel's requirement)" + (f"; {hint}" if hint else ""))
