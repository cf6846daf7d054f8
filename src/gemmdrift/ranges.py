"""The CLI's list and range arguments ('1-17,24,32', 'A:B') and the default split of a stream, parsed into
what the library takes (split out of cli.py, issue 25)."""

from __future__ import annotations

from .errors import GemmdriftError


def parse_range(text: str | None, n: int, name: str):
    """'A:B' (B exclusive, either side optional), 'A', or 'none' -> array of positions."""
    import numpy as np

    if text is None:
        return None
    if text == "none":
        return np.zeros(0, dtype=np.int64)
    try:
        if ":" in text:
            a, b = text.split(":", 1)
            lo = int(a) if a else 0
            hi = int(b) if b else n
        else:
            lo = int(text)
            hi = lo + 1
    except ValueError:
        raise GemmdriftError(f"{name}: expected A:B, got {text!r}") from None
    if lo < 0:
        lo += n
    if hi < 0:
        hi += n
    from .checks import check_positions

    check_positions(lo, hi - 1 if hi > lo else n, n, f"{name} {text}")  # empty or reversed: out of range
    return np.arange(lo, hi)



def default_split(n: int) -> int:
    """Compare the last 128 positions by default (half the stream if it is shorter)."""
    return n - 128 if n > 256 else max(1, n // 2)



MAX_VALUES = 100_000  # the most values one list flag expands to (--ts 1-100000000 is refused, never built)


def parse_ints(text: str | None, name: str, *, cap: int = MAX_VALUES) -> list[int] | None:
    """'1-17,24,32' -> [1, ..., 17, 24, 32]; 'all' or None -> None.

    The one parser of the CLI's integer lists (``--ts``, ``--layers``, ``--k``, ``--batch-sizes`` of every
    command, ``dispatch`` and ``replay check`` included). Each range's count comes from its two ends before
    anything is built, so a list of more than ``cap`` values is refused at once, whatever its size.
    """
    if text is None or str(text).strip() == "all":
        return None
    import re

    spans: list[tuple[int, int]] = []
    for part in str(text).split(","):
        m = re.fullmatch(r"\s*(-?\d+)\s*(?:-\s*(-?\d+)\s*)?", part)
        if not m:
            raise GemmdriftError(f"{name}: expected numbers like 1-17,24,32, got {text!r}")
        lo, hi = int(m.group(1)), int(m.group(2) if m.group(2) is not None else m.group(1))
        if hi < lo:
            raise GemmdriftError(f"{name} {part.strip()}: the range is reversed (write {hi}-{lo})")
        spans.append((lo, hi))
    count = sum(hi - lo + 1 for lo, hi in spans)
    if count > cap:
        raise GemmdriftError(f"{name}: {count} values, at most {cap}")
    out = [v for lo, hi in spans for v in range(lo, hi + 1)]
    if not out:
        raise GemmdriftError(f"{name}: empty list")
    return out
