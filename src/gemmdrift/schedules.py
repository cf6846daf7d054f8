"""Execution schedules: how a token stream is fed through the model.

A schedule is a comma-separated list of phases, each covering a consecutive
span of the stream:

* ``decode``     one token per forward pass (T=1): every projection is a GEMV.
* ``verify:K``   blocks of K+1 tokens, as speculative verification with K draft
  tokens feeds them when every draft is accepted (teacher forcing).
* ``prefill:C``  chunks of C tokens, as prompt processing does.

A phase may say how many tokens it covers with ``@N`` (``prefill:512@448``).
Without lengths, a one-phase schedule covers the whole stream and a two-phase
schedule splits it at the prompt boundary ``split``: ``prefill:512,verify:2``
prefills the prompt in chunks of 512 and verifies the continuation in blocks
of 3. Two schedules over the same tokens compute the same function; any
difference between them is drift.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import GemmdriftError

_PHASE = re.compile(r"^(decode|verify|prefill)(?::(-?\d+))?(?:@(-?\d+))?$")


@dataclass(frozen=True)
class Phase:
    kind: str  # 'decode' | 'verify' | 'prefill'
    param: int | None = None  # K for verify, C for prefill
    length: int | None = None  # tokens covered; None: decided by the schedule

    @property
    def block(self) -> int:
        """Tokens per forward pass."""
        if self.kind == "decode":
            return 1
        if self.kind == "verify":
            return self.param + 1
        return self.param

    def __str__(self) -> str:
        s = self.kind if self.param is None else f"{self.kind}:{self.param}"
        return s if self.length is None else f"{s}@{self.length}"


@dataclass(frozen=True)
class Schedule:
    phases: tuple[Phase, ...]

    @property
    def text(self) -> str:
        return ",".join(str(p) for p in self.phases)

    def __str__(self) -> str:
        return self.text

    def spans(self, n_tokens: int, split: int | None = None) -> list[tuple[Phase, int, int]]:
        """(phase, start, stop) for each phase over a stream of ``n_tokens``."""
        if n_tokens <= 0:
            raise GemmdriftError("the token stream is empty")
        phases = self.phases
        lengths = [p.length for p in phases]
        if len(phases) == 2 and lengths == [None, None]:
            if split is None or not 0 < split < n_tokens:
                raise GemmdriftError(
                    f"schedule {self} needs a prompt/continuation split inside the stream "
                    f"(1..{n_tokens - 1}), got {split}"
                )
            lengths = [split, n_tokens - split]
        elif len(phases) > 1 and any(n is None for n in lengths[:-1]):
            raise GemmdriftError(
                f"schedule {self}: with more than two phases, every phase but the last needs @N tokens"
            )
        if lengths[-1] is None:
            lengths[-1] = n_tokens - sum(lengths[:-1])
        if any(n <= 0 for n in lengths) or sum(lengths) != n_tokens:
            raise GemmdriftError(
                f"schedule {self} does not fit a stream of {n_tokens} tokens (phase lengths {lengths})"
            )
        out, start = [], 0
        for p, n in zip(phases, lengths):
            out.append((p, start, start + n))
            start += n
        return out

    def blocks(self, n_tokens: int, split: int | None = None) -> list[tuple[int, int]]:
        """The [start, stop) token range of every forward pass, in order."""
        out = []
        for phase, start, stop in self.spans(n_tokens, split):
            for s in range(start, stop, phase.block):
                out.append((s, min(s + phase.block, stop)))
        return out


def parse_phase(text: str) -> Phase:
    m = _PHASE.match(text.strip())
    if not m:
        raise GemmdriftError(
            f"cannot parse schedule phase {text!r} (expected decode, verify:K or prefill:C, optionally @N)"
        )
    kind, param, length = m.group(1), m.group(2), m.group(3)
    if kind == "decode":
        if param is not None:
            raise GemmdriftError(f"decode takes no parameter: {text!r}")
    else:
        if param is None:
            raise GemmdriftError(f"{kind} needs a size: {kind}:{'K' if kind == 'verify' else 'C'}")
        if int(param) <= 0:
            raise GemmdriftError(f"{kind} size must be positive, got {param} in {text!r}")
    if length is not None and int(length) <= 0:
        raise GemmdriftError(f"phase length must be positive, got @{length} in {text!r}")
    return Phase(kind, None if param is None else int(param), None if length is None else int(length))


def parse_schedule(text: str | Schedule) -> Schedule:
    """Parse ``'prefill:512,verify:2'`` into a :class:`Schedule`."""
    if isinstance(text, Schedule):
        return text
    parts = [p for p in str(text).split(",")]
    if not text or any(not p.strip() for p in parts):
        raise GemmdriftError(f"cannot parse schedule {text!r}: empty phase")
    return Schedule(tuple(parse_phase(p) for p in parts))
