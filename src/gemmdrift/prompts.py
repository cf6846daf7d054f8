"""Prompts and token streams: text, text files, token-id files, built-in texts."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from .checks import check_vocab
from .errors import GemmdriftError

SYNTHETIC_TOKENS = 640
SYNTHETIC_TOKENS_SEED = 7


def builtin_text(name: str = "essay") -> str:
    """A built-in English text (``essay``: ~900 tokens of plain prose, long enough to cross a 512 window)."""
    return resources.files("gemmdrift").joinpath("data", f"{name}.txt").read_text(encoding="utf-8")


def builtin_prompts() -> list[str]:
    """A small set of varied English prompts for divergence statistics."""
    return [line for line in builtin_text("prompts").splitlines() if line.strip()]


def read_prompts(path: str | Path) -> list[str]:
    """One prompt per line; blank lines are skipped."""
    p = Path(path).expanduser()
    try:
        lines = [line.rstrip("\n") for line in p.read_text(encoding="utf-8").splitlines()]
    except (OSError, UnicodeDecodeError) as e:
        raise GemmdriftError(f"cannot read prompts file {p}: {e}") from None
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        raise GemmdriftError(f"prompts file {p} has no prompts")
    return prompts


def parse_token_ids(text: str, source: str = "token ids") -> list[int]:
    """A JSON list of ints, or whitespace/comma-separated ints."""
    text = text.strip()
    if not text:
        raise GemmdriftError(f"{source}: no token ids")
    if text.startswith(("[", "{")):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as e:
            raise GemmdriftError(f"{source}: not valid JSON ({e.msg} at line {e.lineno})") from None
        if not isinstance(values, list):
            raise GemmdriftError(f"{source}: expected a JSON list of integers, got a {type(values).__name__}")
    else:
        values = text.replace(",", " ").split()
    ids = []
    for v in values:
        if isinstance(v, bool) or not (isinstance(v, int) or (isinstance(v, str) and v.lstrip("-").isdigit())):
            raise GemmdriftError(f"{source}: {v!r} is not an integer token id")
        ids.append(int(v))
    if not ids:
        raise GemmdriftError(f"{source}: no token ids")
    return ids


def read_token_ids(path: str | Path) -> list[int]:
    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise GemmdriftError(f"cannot read token-id file {p}: {e}") from None
    return parse_token_ids(text, source=str(p))




def prompt_tokens(lm, text: str | None = None, text_file: str | None = None, ids_file: str | None = None,
                  default: str = "essay") -> tuple[list[int], str]:
    """Token ids for the prompt given on the command line, and a description of it.

    Token-id files are used verbatim (no BOS added). Text is encoded with the
    model's tokenizer, which adds BOS where the model expects it.
    """
    given = [x for x in (text, text_file, ids_file) if x is not None]
    if len(given) > 1:
        raise GemmdriftError("give only one of --prompt, --prompt-file and --prompt-ids")
    if ids_file is not None:
        return check_vocab(read_token_ids(ids_file), lm.description.vocab_size, ids_file), f"token ids from {ids_file}"
    if text_file is not None:
        try:
            text = Path(text_file).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise GemmdriftError(f"cannot read prompt file {text_file}: {e}") from None
        label = f"text from {text_file}"
    elif text is not None:
        label = "text from --prompt"
    else:
        text = builtin_text(default)
        label = f"built-in text '{default}'"
    if lm.tokenizer is None:
        if lm.synthetic:
            # Synthetic weights carry no meaning, so neither need the tokens.
            import numpy as np

            rng = np.random.default_rng(SYNTHETIC_TOKENS_SEED)
            n = SYNTHETIC_TOKENS if text is None else max(2, len(text.split()))
            return rng.integers(0, lm.vocab_size, n).tolist(), f"{n} synthetic token ids (seed {SYNTHETIC_TOKENS_SEED})"
        raise GemmdriftError("this model has no tokenizer files: pass --prompt-ids")
    ids = lm.tokenizer.encode(text)
    if not ids:
        raise GemmdriftError("the prompt is empty")
    return ids, label


def read_stream(path: str) -> tuple[list[int] | None, list[int]]:
    """A stream file: a JSON list / whitespace-separated ids (generated tokens), or
    ``{"prompt": [...], "tokens": [...]}``. Returns (prompt or None, tokens)."""
    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise GemmdriftError(f"cannot read stream file {p}: {e}") from None
    if text.lstrip().startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise GemmdriftError(f"{p}: not valid JSON ({e.msg})") from None
        if "tokens" not in obj:
            raise GemmdriftError(f"{p}: a stream object needs a 'tokens' list")
        prompt = obj.get("prompt")
        return (parse_token_ids(json.dumps(prompt), f"{p} prompt") if prompt is not None else None,
                parse_token_ids(json.dumps(obj["tokens"]), str(p)))
    return None, parse_token_ids(text, str(p))


BATCH_SCHEDULE = "batch:"  # a batch row's stream file: "batch:B4,row3,prefill:2048,decode" (gemmdrift.measure.batch)


def stream_schedule(given: str | None, path: str, default: str, flag: str) -> tuple[str, str]:
    """The schedule a stream is teacher-forced under, and why (said to the user): ``flag`` when given, else
    the schedule written in the stream file, else ``default``. A batch row's file names no single-sequence
    schedule: its prefill and decode, alone, are used, and said so."""
    from .schedules import parse_schedule

    written = None
    try:
        obj = json.loads(Path(path).expanduser().read_text(encoding="utf-8"))
        written = obj.get("schedule") if isinstance(obj, dict) and isinstance(obj.get("schedule"), str) else None
    except (OSError, UnicodeDecodeError, ValueError):
        pass  # a plain id list (read_stream checked the file): no schedule written
    if given is not None:
        parse_schedule(given)
        return given, (f"{flag} (the file says {written})" if written and written != given else flag)
    if written is None:
        return default, "the default: the file names no schedule"
    if written.startswith(BATCH_SCHEDULE):
        alone = ",".join(p for p in written[len(BATCH_SCHEDULE):].split(",") if not p.startswith(("B", "row")))
        parse_schedule(alone)
        return alone, (f"the file's batch row ({written}) alone: a batch row has no single-sequence schedule; "
                       f"give {flag} to choose another")
    try:
        parse_schedule(written)
    except GemmdriftError as e:
        raise GemmdriftError(f"{path}: its schedule {written!r} is not a schedule ({e}); give {flag}") from None
    return written, "written in its file"


def builtin_stream(lm, n: int) -> list[int]:
    """The first ``n`` tokens of the built-in essay (repeated when longer is asked for)."""
    if lm.tokenizer is None:
        raise GemmdriftError("the main job needs a model with a tokenizer")
    once = lm.tokenizer.encode(builtin_text())
    ids = list(once)
    while len(ids) < n:
        ids += once[1:]  # the text again, without a second BOS
    return ids[:n]
