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



def parse_ints(text: str | None, name: str) -> list[int] | None:
    """'1-17,24,32' -> [1, ..., 17, 24, 32]; 'all' or None -> None."""
    if text is None or text == "all":
        return None
    out = []
    try:
        for part in text.split(","):
            if "-" in part.strip("-"):
                a, b = part.split("-", 1)
                if int(b) < int(a):
                    raise GemmdriftError(f"{name} {part}: the range is reversed (write {b}-{a})")
                out += list(range(int(a), int(b) + 1))
            else:
                out.append(int(part))
    except ValueError:
        raise GemmdriftError(f"{name}: expected numbers like 1-17,24,32, got {text!r}") from None
    if not out:
        raise GemmdriftError(f"{name}: empty list")
    return out
