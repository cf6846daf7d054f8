"""Checks of the user's inputs that run before any model is loaded or anything is computed.

Standard library only: importing pandas alone takes seconds on a busy
machine, and a bad flag should be refused at once. Each check raises
:class:`~gemmdrift.errors.GemmdriftError` (one line, exit status 2).
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from .errors import GemmdriftError


def check_out_dir(out: str | Path, flag: str = "--out", shown: str | Path | None = None) -> Path:
    """Fail early (before any computation) when ``out`` cannot become a results directory.

    The directory is made and a temporary file written in it, then both removed again (a refusal that
    follows leaves nothing behind): ``os.access`` alone says yes to root on /proc or a read-only mount,
    and the work would be lost at the end. The error names ``flag`` and ``shown`` (default ``out``).
    """
    out = Path(out)
    flag = f"{flag} {shown if shown is not None else out}"
    probe = out
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise GemmdriftError(f"{flag}: {probe} is a file, not a directory")
    if probe.exists() and not os.access(probe, os.W_OK | os.X_OK):
        raise GemmdriftError(f"{flag}: {probe} is not writable")
    import tempfile

    made = [p for p in [out, *out.parents] if not p.exists()]
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".gemmdrift-probe-", dir=out)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise GemmdriftError(f"{flag}: cannot write there ({e.strerror or e})") from None
    finally:
        for p in made:  # deepest first; the command makes them again when it writes
            try:
                p.rmdir()
            except OSError:
                break
    return out


def check_out_kind(out: str | Path, kind: str, flag: str = "--out") -> None:
    """Refuse an output directory that holds another command's results: its ``result.json`` (or ``meta.json``,
    written first) names another kind, or it is the main job's run directory (``run.json``). Writing there would
    replace that record with this one's. A directory of the same kind is left to the command (it resumes)."""
    import json

    out = Path(out)
    if (out / "run.json").is_file() and kind != "run":
        raise GemmdriftError(f"{flag} {out} holds the main job's results (run.json): writing {kind}'s there would "
                             "mix them; give another --out")
    for name in ("result.json", "meta.json"):
        try:
            got = json.loads((out / name).read_text()).get("kind")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(got, str) and got != kind:
            raise GemmdriftError(f"{flag} {out} holds a {got} result ({name}): writing {kind}'s there would replace "
                                 "it; give another --out")
        return


def check_out_file(path: str | Path, flag: str = "--out", keep: str | Path | None = None) -> Path:
    """Fail early when ``path`` cannot become a file (a base file of logits): not a directory, its directory
    writable, and not the file ``keep`` (the input it was computed against: writing would replace it)."""
    path = Path(path)
    if path.is_dir():
        raise GemmdriftError(f"{flag} {path} is a directory: give the base file's path (e.g. {path}/base.npz)")
    check_out_dir(path.parent, flag, shown=path)
    if keep is not None and Path(keep).exists() and path.exists() and os.path.samefile(path, keep):
        raise GemmdriftError(f"{flag} {path} is the base file itself: writing would replace the reference; give "
                             "another path")
    return path


def check_choices(text: str | None, flag: str, choices: Sequence[str], what: str) -> list[str] | None:
    """A comma-separated list of names from ``choices`` ('a,b'); an empty one ('', ',') or an unknown name
    is refused. None (flag not given) stays None."""
    if text is None:
        return None
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise GemmdriftError(f"{flag}: give at least one of {', '.join(choices)}")
    for x in names:
        if x not in choices:
            raise GemmdriftError(f"{flag}: unknown {what} {x!r} (choose from {', '.join(choices)})")
    return names


def read_prompt_text(text: str | None, text_file: str | None) -> str | None:
    """The prompt text of --prompt or --prompt-file (not both), refused when empty; None when neither."""
    if text is not None and text_file is not None:
        raise GemmdriftError("give only one of --prompt and --prompt-file")
    if text_file is not None:
        try:
            text = Path(text_file).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise GemmdriftError(f"cannot read prompt file {text_file}: {e}") from None
    if text is not None and not text.strip():
        raise GemmdriftError(f"{'--prompt-file ' + text_file if text_file else '--prompt'} is empty")
    return text


# Requests one server case sends at once: a batch of at most 64, as `gemmdrift batch --batch-sizes` allows
# (each request is a thread and a row of the server's batch; 100000 of them exhaust the threads).
MAX_COMPANIONS = 63


def check_companions(n: int) -> None:
    if n < 1 or n > MAX_COMPANIONS:
        raise GemmdriftError(f"--companions must be between 1 and {MAX_COMPANIONS} (with the prompt, a batch of at "
                             f"most {MAX_COMPANIONS + 1} concurrent requests, as --batch-sizes allows), got {n}")


# Fingerprint probes: a call holds K x max(N, T) values in float64, float32 and the compute dtype at once
# (about 24 bytes each, and 9 more per probe term); 2**25 of them is about 1 GiB.
MAX_PROBE_TERMS = 2 ** 25


def check_probe_size(k: int, n: int, ts: Sequence[int], flag: str = "--k") -> None:
    """Refuse a fingerprint whose probes would not fit in memory (before anything is allocated)."""
    width = max([n, *ts])
    if k * width > MAX_PROBE_TERMS:
        gib = k * width * 33 / 2 ** 30
        raise GemmdriftError(
            f"{flag} {k:,} with --n {n:,} and T up to {max(ts):,}: a probe call holds K x max(N, T) = {k * width:,} "
            f"values in float64, float32 and the compute dtype (about {gib:,.1f} GiB); at most {MAX_PROBE_TERMS:,} "
            "(about 1 GiB): lower --k or --n")


def check_draw_k(draw_k: int) -> None:
    """--draw-k follows --k's rule (a reduction needs at least 2 terms); 0 skips the small-K draw."""
    if draw_k < 0 or draw_k == 1:
        raise GemmdriftError(f"--draw-k must be 0 (skip) or at least 2 (a reduction needs at least 2 terms), "
                             f"got {draw_k}")


def check_fingerprint_sizes(k: int, n: int, ts: Sequence[int], draw_k: int) -> None:
    """--k, --n and --draw-k of `fingerprint`, from memory (exactness is fingerprint.check_path's)."""
    check_draw_k(draw_k)
    check_probe_size(k, n, ts)
    if draw_k:
        check_probe_size(draw_k, n, [1], "--draw-k")


def check_batch_args(sizes: Sequence[int] | None, companions: str, n: int, long_tokens: int | None,
                     prompts: str | None, tokens: int | None) -> list[str]:
    """`gemmdrift batch`'s own flags (before the model loads); returns the companion set names."""
    if not sizes or min(sizes) < 1 or max(sizes) > 64:
        raise GemmdriftError("--batch-sizes: give sizes from 1 to 64, e.g. 1,2,4,8")
    names = [c.strip() for c in companions.split(",") if c.strip()]
    if not names or set(names) - {"short", "long"}:
        raise GemmdriftError(f"--companions: short, long or short,long (got {companions!r})")
    if n <= 0:
        raise GemmdriftError(f"--n must be positive, got {n}")
    if long_tokens is not None and long_tokens < 2:
        raise GemmdriftError("--long-tokens must be at least 2")
    if prompts is not None and prompts != "builtin":
        raise GemmdriftError("--prompts: only 'builtin' (each built-in prompt as the target in turn)")
    if prompts is not None and tokens is not None:
        raise GemmdriftError("--tokens cuts one prompt: it does not apply to --prompts builtin")
    return names


def check_tokens(tokens: int | None) -> None:
    """--tokens N (the first N tokens of the prompt): at least 2, checked whether or not a prompt is given."""
    if tokens is not None and tokens < 2:
        raise GemmdriftError(f"--tokens must be at least 2, got {tokens}")


def check_envelope(value: float | None, flag: str = "--envelope") -> None:
    """An envelope (max |Δgap|, logits) is a finite, non-negative number, or None (measure it).

    The one rule of every command's --envelope (state, triage, diverge): 0 is allowed (only bit-identical
    logits are inside), inf, nan and negative values are refused."""
    if value is None:
        return
    if not math.isfinite(value) or value < 0:
        raise GemmdriftError(f"{flag} must be a finite non-negative number of logits, got {value}")


def check_positive(**flags: int | None) -> None:
    """check_positive(n=args.n) -> '--n must be positive, got 0'. None means 'not given'."""
    for name, value in flags.items():
        if value is not None and value < 1:
            raise GemmdriftError(f"--{name.replace('_', '-')} must be positive, got {value}")


def check_range_text(text: str | None, name: str) -> None:
    """The syntax of an 'A:B' position range (B exclusive), and that it is not reversed or empty.

    What a range covers depends on the stream's length (negative ends count
    from the end), which is known only later; this catches what is wrong
    whatever the length.
    """
    if text is None or text == "none":
        return
    try:
        if ":" in text:
            a, b = text.split(":", 1)
            lo = int(a) if a else None
            hi = int(b) if b else None
        else:
            int(text)
            return
    except ValueError:
        raise GemmdriftError(f"{name}: expected A:B, got {text!r}") from None
    if lo is not None and hi is not None and (lo < 0) == (hi < 0) and lo >= hi:
        raise GemmdriftError(f"{name} {text}: the range is {'reversed' if lo > hi else 'empty'} "
                             f"(A:B covers A..B-1, so A must be below B)")


def check_prompt_args(text: str | None, text_file: str | None = None, ids_file: str | None = None) -> None:
    """At most one prompt source; no empty prompt; prompt files readable (before the model loads)."""
    given = [x for x in (text, text_file, ids_file) if x is not None]
    if len(given) > 1:
        raise GemmdriftError("give only one of --prompt, --prompt-file and --prompt-ids")
    if text is not None and not text.strip():
        raise GemmdriftError("--prompt is empty")
    for flag, path in (("--prompt-file", text_file), ("--prompt-ids", ids_file)):
        if path is None:
            continue
        p = Path(path).expanduser()
        if not p.is_file():
            raise GemmdriftError(f"{flag} {p}: no such file")
        if not os.access(p, os.R_OK):
            raise GemmdriftError(f"{flag} {p}: not readable")
        if flag == "--prompt-file":
            try:
                empty = not p.read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError) as e:
                raise GemmdriftError(f"cannot read prompt file {p}: {e}") from None
            if empty:
                raise GemmdriftError(f"{flag} {p} is empty")


def check_max_t(ts: list[int], max_t: int) -> None:
    """A kernel sweep whose --max-t is below every block size would measure nothing."""
    if ts and max_t < min(ts):
        raise GemmdriftError(f"--max-t {max_t} is below every block size in --ts (smallest {min(ts)}): nothing to measure")


def max_positions(info: Mapping[str, Any]) -> int | None:
    """The longest sequence the model takes (its max_position_embeddings), if its config says."""
    v = info.get("max_positions")
    return int(v) if v else None


def check_length(info: Mapping[str, Any], n_tokens: int, what: str) -> None:
    """Refuse a stream longer than the model's maximum positions (before computing on it)."""
    limit = info.max_positions if hasattr(info, "max_positions") else max_positions(info)
    if limit is not None and n_tokens > limit:
        raise GemmdriftError(f"{what} has {n_tokens:,} tokens: more than the model's {limit:,} positions")


def check_release_stream(tokens: int, split: int, layers: Sequence[int] | None = None, n_layers: int | None = None,
                         max_positions: int | None = None) -> None:
    """``attribute --python``: ``--release-tokens`` (at least 2, at most the model's positions), ``--release-split``
    inside the stream, ``--release-layers`` among the model's layers (those known are checked)."""
    if tokens < 2:
        raise GemmdriftError(f"--release-tokens must be at least 2 (a prompt and the captured block), got {tokens}")
    if not 0 < split < tokens:
        raise GemmdriftError(f"--release-split {split}: it must lie in 1..{tokens - 1} (the prompt before the block "
                             f"captured, of --release-tokens {tokens})")
    check_length({"max_positions": max_positions}, tokens, f"--release-tokens {tokens}: the stream")
    bad = [i for i in layers or [] if n_layers is not None and not 0 <= i < n_layers]
    if bad:
        raise GemmdriftError(f"--release-layers: no layer {bad[0]} (the model has {n_layers}: 0-{n_layers - 1})")


LM_TAG = "+lm"  # in a release label: MLX+lmMLXLM (see gemmdrift.measure.history)


def split_release(label: str) -> tuple[str, str]:
    """A release label's (mlx version, mlx-lm version); the mlx-lm one is '' for a bare mlx version."""
    mlx, _, lm = str(label).partition(LM_TAG)
    return mlx, lm


def check_gate_versions(candidate: str | None, baseline: str | None) -> str | None:
    """Refuse to gate a release against itself (that comparison passes whatever the release does) or against a
    newer one (the pair reversed). A bare mlx version and a label of the same mlx (``0.32.4`` and
    ``0.32.4+lm0.31.3``) are not ordered here: the bare one names that mlx with the newest mlx-lm it ran with, known
    only from the results (the gate checks again once both are resolved)."""
    if candidate is None or baseline is None:
        return None
    if release_order_key(candidate) == release_order_key(baseline):
        raise GemmdriftError(f"--candidate {candidate} and --baseline {baseline} are the same release: "
                             "comparing a release with itself proves nothing")
    (c_mlx, c_lm), (b_mlx, b_lm) = split_release(candidate), split_release(baseline)
    if not (c_lm and b_lm) and release_order_key(c_mlx) == release_order_key(b_mlx):
        return None
    if release_order_key(baseline) > release_order_key(candidate):
        raise GemmdriftError(f"--baseline {baseline} is newer than --candidate {candidate}: the gate judges a release "
                             f"against an older one (write --candidate {baseline} --baseline {candidate})")
    return None


def release_order_key(label: str) -> tuple:
    """A release label's sort key (mlx version, then mlx-lm version; a bare mlx version has no mlx-lm part), the
    one order of releases: the gate, the changelog and the history sort by it."""
    def version(v: str) -> tuple:
        return tuple(int(x) if x.isdigit() else 0 for x in v.split(".")) if v else ()

    mlx, lm = split_release(label)
    return version(mlx), version(lm)


def check_threshold(value: float) -> None:
    """gate --threshold: a finite non-negative fraction (inf would pass every growth but one from exactly 0)."""
    if not (math.isfinite(value) and value >= 0):
        raise GemmdriftError(f"--threshold must be a finite non-negative fraction (0.05 = 5%), got {value}")


def check_vocab(ids: Sequence[int], vocab_size: int | None, source: str = "token ids") -> list[int]:
    """Reject ids outside the vocabulary (negative ones included): the one vocabulary check."""
    for i, t in enumerate(ids):
        if t < 0 or (vocab_size and t >= vocab_size):
            limit = f"0..{vocab_size - 1}" if vocab_size else "non-negative"
            raise GemmdriftError(f"{source}: token id {t} at index {i} is outside the vocabulary ({limit})")
    return [int(t) for t in ids]


def check_positions(lo: int, hi: int, n: int, name: str) -> None:
    """The one position-range check: positions lo..hi (hi included) must lie in a stream of n tokens."""
    if lo < 0 or hi >= n:
        raise GemmdriftError(f"{name} out of range: the stream has {n} tokens (0..{n - 1})")
