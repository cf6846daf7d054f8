"""Golden logits: teacher-forced logits of a token stream saved as a portable base file, and two runs compared.

A *base file* is one ``.npz`` (numpy's zip of arrays, readable anywhere numpy runs) holding::

    header         a JSON string: format, version, schedule, split, dtype, top_k, full, vocab_size, the token
                   digest, the tokenizer digest, the model record, the weights digest, the environment record
    tokens         (n_tokens,) int32: the whole stream (teacher forced)
    positions      (n,) int32: 0..n_tokens-2, every position that has a correct next token
    topk_ids       (n, k) int32: the top-k token ids, descending (ties: lower id first)
    topk_logits    (n, k) float32: their logits (storage-dtype values: exact)
    lse            (n,) float64: log-sum-exp over the whole vocabulary
    target_logit   (n,) float32 and target_rank (n,) int32: the correct next token's logit and rank
    logits         (n, V) float32, only with ``--full``

Log-probabilities are ``logit - lse``. A base file is written atomically and validated on read: a missing,
truncated or foreign file is one line (exit 2), never a traceback. :func:`compare_result` turns a base and
another run into a ``compare`` :class:`~gemmdrift.result.Result` through :func:`gemmdrift.measure.twostats.two_run_stats`.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import time
import zipfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from ..errors import GemmdriftError
from .twostats import LogitView, concat_views, two_run_stats, view_from_logits

FORMAT = "gemmdrift-logits"
VERSION = 1
TOP_K = 64
GOLDEN_DEFAULT = "decode"  # the shipped base `--golden NAME` picks when no file is named
TOKENIZER_PROBE = "The capital of France is Paris. 1234 ∑ naïve café — ok?"
ARRAYS = ("tokens", "positions", "topk_ids", "topk_logits", "lse", "target_logit", "target_rank")


# ------------------------------------------------------------------------- the token stream and digests


def default_text() -> str:
    """The default stream: the built-in essay, then the built-in prompt set, as real text."""
    from ..prompts import builtin_prompts, builtin_text

    return builtin_text("essay").rstrip("\n") + "\n\n" + "\n\n".join(builtin_prompts())


def token_digest(tokens: Sequence[int]) -> str:
    """sha256 of the stream as little-endian uint32: equal digests, equal token streams."""
    return hashlib.sha256(np.asarray(tokens, dtype="<u4").tobytes()).hexdigest()


def tokenizer_digest(lm) -> str | None:
    """A digest of what the tokenizer does (its vocabulary size and its encoding of a probe text), or None."""
    tok = lm.tokenizer
    if tok is None:
        return None
    blob = json.dumps([lm.vocab_size, [int(t) for t in tok.encode(TOKENIZER_PROBE)]])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def default_split(n: int) -> int:
    """Two-phase schedules without a split decode (or verify) the last 128 positions, as `stack` does."""
    return n - 128 if n > 256 else max(1, n // 2)


def needs_split(schedule: str) -> bool:
    from ..schedules import parse_schedule

    s = parse_schedule(schedule)
    return len(s.phases) == 2 and all(p.length is None for p in s.phases)


def model_identity(model: dict[str, Any], weights_sha256: str | None) -> dict[str, Any]:
    """What must match for two runs to be "the same model": weights (digest, or source when there is none),
    architecture and shape, and quantization. The compute dtype may differ (that is a comparison of runs)."""
    q = model.get("quantization")
    return {"weights": weights_sha256 or f"source {model.get('source')}", "architecture": model.get("architecture"),
            "n_layers": model.get("n_layers"), "hidden_size": model.get("hidden_size"),
            "vocab_size": model.get("vocab_size"),
            "quantization": json.dumps(q, sort_keys=True) if q else "dense"}


# ------------------------------------------------------------------------- the file


@dataclass(frozen=True)
class LogitFile:
    """A base file as read (or about to be written): its header, the token stream and the logit view."""

    header: dict[str, Any]
    tokens: np.ndarray
    view: LogitView
    path: str = ""

    @property
    def identity(self) -> dict[str, Any]:
        return model_identity(self.header["model"], self.header.get("weights_sha256"))

    def label(self) -> str:
        h = self.header
        env = h.get("env", {})
        q = h["model"].get("quantization")
        where = env.get('backend') or env.get('device') or '?'
        kernels = kernels_of(h)
        return (f"{h['model'].get('source')} {h['dtype']}{' q' + str(q.get('bits')) if q else ''}, {h['schedule']}, "
                + (f"mlx {env.get('mlx')} ({where})" if kernels == "native" else
                   f"mlx {env.get('mlx')}, {kernels} replayed on {where}: a PREDICTION, not a measurement"))


def kernels_of(header: dict[str, Any]) -> str:
    """``native``, or the ``replay:<chip>[@variant]`` a file's logits were computed with (`logits --kernels`)."""
    return str(header.get("kernels") or "native")


def write_logits(path: str | Path, lf: LogitFile) -> int:
    """Write a base file atomically (compressed); returns its size in bytes."""
    from ..files import atomic_path, to_json

    v = lf.view
    arrays = {"header": np.array(to_json({**lf.header, "full": v.full}, indent=None)), "tokens": lf.tokens.astype(np.int32),
              "positions": v.positions.astype(np.int32), "lse": v.lse.astype(np.float64),
              "target_logit": v.target_logit.astype(np.float32), "target_rank": v.target_rank.astype(np.int32)}
    if v.full:
        from .twostats import top_k_ids

        ids = top_k_ids(v.values, v.top_k)
        arrays.update(topk_ids=ids.astype(np.int32), topk_logits=np.take_along_axis(v.values, ids, axis=1),
                      logits=v.values.astype(np.float32))
    else:
        arrays.update(topk_ids=v.ids[:, : v.top_k].astype(np.int32),
                      topk_logits=v.values[:, : v.top_k].astype(np.float32))
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            np.savez_compressed(f, **arrays)
    return Path(path).stat().st_size


def _bad(path: Path, why: str) -> GemmdriftError:
    return GemmdriftError(f"{path}: {why}")


def read_logits(path: str | Path) -> LogitFile:
    """A base file, validated: a missing, truncated or foreign file is a one-line error."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise _bad(path, "no such base file" if not path.exists() else "not a file")
    try:
        with np.load(path, allow_pickle=False) as z:
            names = set(z.files)
            if "header" not in names:
                raise _bad(path, "not a gemmdrift logits file (no header)")
            header = json.loads(str(z["header"]))
            if not isinstance(header, dict) or header.get("format") != FORMAT:
                raise _bad(path, f"not a gemmdrift logits file (format {header.get('format') if isinstance(header, dict) else None!r})")
            if header.get("version") != VERSION:
                raise _bad(path, f"logits file version {header.get('version')!r}; this gemmdrift reads version {VERSION}")
            missing = [a for a in ARRAYS if a not in names] + (["logits"] if header.get("full") and "logits" not in names else [])
            if missing:
                raise _bad(path, f"incomplete logits file (lacks {', '.join(missing)})")
            a = {k: z[k] for k in ARRAYS}
            full = z["logits"] if header.get("full") else None
    except GemmdriftError:
        raise
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, KeyError, json.JSONDecodeError) as e:
        raise _bad(path, f"truncated or not a gemmdrift logits file ({e.__class__.__name__})") from None
    for key in ("schedule", "dtype", "top_k", "vocab_size", "token_digest", "model", "env"):
        if key not in header:
            raise _bad(path, f"corrupt header (lacks {key})")
    n, k, vocab = len(a["positions"]), int(header["top_k"]), int(header["vocab_size"])
    tokens = a["tokens"].astype(np.int64)
    if n == 0 or len(tokens) != n + 1 or not np.array_equal(a["positions"], np.arange(n)):
        raise _bad(path, "corrupt arrays (positions do not cover the stream)")
    if token_digest(tokens) != header["token_digest"]:
        raise _bad(path, "corrupt: its tokens do not match its token digest")
    shapes_ok = (a["topk_ids"].shape == (n, k) and a["topk_logits"].shape == (n, k)
                 and all(a[x].shape == (n,) for x in ("lse", "target_logit", "target_rank"))
                 and (full is None or full.shape == (n, vocab)))
    if not shapes_ok or not 1 <= k <= vocab:
        raise _bad(path, "corrupt arrays (shapes do not match the header)")
    if a["topk_ids"].min() < 0 or a["topk_ids"].max() >= vocab or tokens.min() < 0 or tokens.max() >= vocab:
        raise _bad(path, "corrupt arrays (token ids outside the vocabulary)")
    if not (np.isfinite(a["lse"]).all() and np.isfinite(a["topk_logits"]).all()):
        raise _bad(path, "corrupt arrays (non-finite logits)")
    positions = np.arange(n, dtype=np.int64)
    targets = tokens[1:]
    if full is not None:
        view = LogitView(positions, targets, full.astype(np.float32), None, k, a["lse"].astype(np.float64),
                         a["target_logit"].astype(np.float32), a["target_rank"].astype(np.int64), vocab)
    else:
        view = LogitView(positions, targets, a["topk_logits"].astype(np.float32), a["topk_ids"].astype(np.int64), k,
                         a["lse"].astype(np.float64), a["target_logit"].astype(np.float32),
                         a["target_rank"].astype(np.int64), vocab)
    return LogitFile(header=header, tokens=tokens, view=view, path=str(path))


# ------------------------------------------------------------------------- shipped bases


def golden_root() -> Path:
    """The directory of the shipped base files (``src/gemmdrift/data/golden/<NAME>/<schedule>.npz``)."""
    return Path(str(resources.files("gemmdrift").joinpath("data", "golden")))


def schedule_slug(schedule: str) -> str:
    """'verify:2' -> 'verify-2'; 'prefill:2048,decode' -> 'prefill-2048_decode' (a file name)."""
    return str(schedule).replace(":", "-").replace(",", "_").replace("@", "at")


def resolve_golden(name: str) -> Path:
    """``linux-cpu`` -> its default base (decode); ``linux-cpu/verify-2`` -> that one."""
    root = golden_root()
    known = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    where, _, which = name.partition("/")
    d = root / where
    if not where or not d.is_dir():
        raise GemmdriftError(f"--golden {name}: no shipped base set {where!r} (shipped: {', '.join(known) or 'none'})")
    files = sorted(p.stem for p in d.glob("*.npz"))
    f = d / f"{schedule_slug(which) if which else GOLDEN_DEFAULT}.npz"
    if not f.is_file():
        raise GemmdriftError(f"--golden {name}: no such base (in {where}: {', '.join(files) or 'none'})")
    return f


# ------------------------------------------------------------------------- computing a run


def run_view(lm, tokens: Sequence[int], schedule: str, *, split: int | None, top_k: int, full: bool = False,
             extra_ids: np.ndarray | None = None, progress: Callable[[int], None] | None = None
             ) -> tuple[LogitView, float]:
    """Teacher-forced logits of ``tokens`` under ``schedule`` at every position with a next token, reduced
    block by block to a view (top-k, log-sum-exp, the correct token; ``extra_ids``' logits; or every logit).

    Returns (the view, seconds of the run)."""
    from ..model.taps import run_schedule

    tokens = [int(t) for t in tokens]
    n = len(tokens)
    if n < 2:
        raise GemmdriftError("the token stream is empty: it needs at least 2 tokens (one position with a next token)")
    targets = np.asarray(tokens[1:], dtype=np.int64)
    parts: list[LogitView] = []

    def sink(pos: np.ndarray, logits: np.ndarray) -> None:
        extra = extra_ids[pos] if extra_ids is not None else None
        parts.append(view_from_logits(logits, pos, targets[pos], top_k, full=full, extra_ids=extra))

    t0 = time.perf_counter()
    # One tapped hidden row only (the stream's last): the run is read at its logits.
    run_schedule(lm.model, tokens, schedule, split=split, positions=[n - 1], logit_positions=np.arange(n - 1),
                 logits_sink=sink, progress=progress)
    return concat_views(parts), time.perf_counter() - t0


def base_from_run(lm, tokens: Sequence[int], schedule: str, *, split: int | None, top_k: int = TOP_K,
                  full: bool = False, label: str = "", env: dict[str, Any] | None = None,
                  progress: Callable[[int], None] | None = None) -> LogitFile:
    """Run ``tokens`` under ``schedule`` and build the base file's content (write it with :func:`write_logits`)."""
    if not 1 <= top_k <= lm.vocab_size:
        raise GemmdriftError(f"--top-k must be between 1 and the vocabulary size {lm.vocab_size}, got {top_k}")
    view, seconds = run_view(lm, tokens, schedule, split=split, top_k=top_k, full=full, progress=progress)
    return LogitFile(header=header_for(lm, tokens, schedule, split, top_k, full, label, seconds, env),
                     tokens=np.asarray(tokens, np.int64), view=view)


def header_for(lm, tokens, schedule: str, split, top_k: int, full: bool, label: str, seconds: float,
               env: dict[str, Any] | None) -> dict[str, Any]:
    from ..machine.envinfo import environment
    from ..model import weights_record

    w = weights_record(lm.description)
    return {"format": FORMAT, "version": VERSION,
            "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "schedule": str(schedule), "split": split, "dtype": lm.description.dtype, "top_k": int(top_k),
            "full": bool(full), "n_tokens": len(tokens), "n_positions": len(tokens) - 1,
            "vocab_size": lm.vocab_size, "token_digest": token_digest(tokens), "tokenizer_digest": tokenizer_digest(lm),
            "stream": label, "model": lm.info, "weights_sha256": w["weights_sha256"],
            "env": {**(env if env is not None else environment()), **w}, "seconds": round(seconds, 3)}


# ------------------------------------------------------------------------- refusing a foreign pairing


def check_pair(base: dict[str, Any], other: dict[str, Any], *, allow_other_model: bool = False,
               base_name: str = "base", other_name: str = "this run") -> None:
    """Refuse two runs that do not compare: other tokens, another tokenizer, another model (unless allowed)."""
    if base.get("vocab_size") != other.get("vocab_size"):
        raise GemmdriftError(f"the {base_name} has a vocabulary of {base.get('vocab_size')} and {other_name} of "
                             f"{other.get('vocab_size')}: another tokenizer, nothing to compare")
    tb, to = base.get("tokenizer_digest"), other.get("tokenizer_digest")
    if tb and to and tb != to:
        raise GemmdriftError(f"the {base_name} comes from another tokenizer than {other_name} "
                             f"(tokenizer digest {tb} vs {to})")
    if base.get("token_digest") != other.get("token_digest"):
        raise GemmdriftError(f"the {base_name}'s token stream differs from {other_name}'s (token digest "
                             f"{str(base.get('token_digest'))[:12]} vs {str(other.get('token_digest'))[:12]})")
    ib = model_identity(base["model"], base.get("weights_sha256"))
    io = model_identity(other["model"], other.get("weights_sha256"))
    if ib != io and not allow_other_model:
        diff = ", ".join(f"{k} {ib[k]} vs {io[k]}" for k in ib if ib[k] != io[k])
        raise GemmdriftError(f"the {base_name} was computed by another model than {other_name} ({diff}); "
                             "pass --allow-other-model to compare them anyway (e.g. a quantized model against its "
                             "original)")


def prefix(lf: LogitFile, n_tokens: int) -> LogitFile:
    """The base restricted to its first ``n_tokens`` tokens (causal: earlier logits do not see later tokens)."""
    if not 2 <= n_tokens <= len(lf.tokens):
        raise GemmdriftError(f"--tokens {n_tokens}: the base has {len(lf.tokens)} tokens (give 2..{len(lf.tokens)})")
    if n_tokens == len(lf.tokens):
        return lf
    tokens = lf.tokens[:n_tokens]
    h = {**lf.header, "n_tokens": n_tokens, "n_positions": n_tokens - 1, "token_digest": token_digest(tokens)}
    return LogitFile(header=h, tokens=tokens, view=lf.view.select(np.arange(n_tokens - 1)), path=lf.path)


# ------------------------------------------------------------------------- the compare Result


def _side(lf: LogitFile, role: str) -> dict[str, Any]:
    h = lf.header
    env = h.get("env", {})
    return {"role": role, "path": lf.path, "label": lf.label(), "schedule": h["schedule"], "split": h.get("split"),
            "dtype": h["dtype"], "top_k": h["top_k"], "full": bool(h.get("full")), "model": h["model"].get("source"),
            "quantization": h["model"].get("quantization"), "weights_sha256": h.get("weights_sha256"),
            "mlx": env.get("mlx"), "mlx_lm": env.get("mlx_lm"), "backend": env.get("backend"),
            "device": env.get("device"), "machine": env.get("machine"), "created_utc": h.get("created_utc"),
            "kernels": kernels_of(h), "prediction": kernels_of(h) != "native"}


def compare_result(base: LogitFile, other: LogitFile, *, envelope: float | None = None,
                   env: dict[str, Any] | None = None, record: dict[str, Any] | None = None):
    """The ``compare`` Result of ``other`` against ``base`` (see :func:`gemmdrift.measure.twostats.two_run_stats`)."""
    import pandas as pd

    from ..result import Result, env_labels, tidy

    t0 = time.perf_counter()
    st = two_run_stats(base.view, other.view, envelope=envelope)
    seconds = time.perf_counter() - t0
    per = pd.DataFrame(st["positions"])
    flips = per[~per["same_top1"]][["position", "target", "top1_base", "top1_other", "gap_base", "dgap", "kld",
                                    "dp", "verdict"]]
    fig = st["summary"]
    env = dict(env if env is not None else other.header.get("env", {}))
    pair = f"{base.header['schedule']} | {other.header['schedule']}"
    frame = tidy([{"metric": k, "value": v} for k, v in fig.items()], **env_labels(env),
                 model=str(other.header["model"].get("source")), dtype=other.header["dtype"], pair=pair)
    inputs = {"base": _side(base, "base"), "other": _side(other, "other"), "tokens": int(len(base.tokens)),
              "positions": int(len(base.view)), "token_digest": base.header["token_digest"],
              "stream": base.header.get("stream", ""), **(record or {})}
    kld_note = ("exact (both sides hold every logit)" if st["kld_exact"] else
                f"a lower bound: the base's top-{base.header['top_k']} plus one tail bucket (the exact KLD is at "
                "least this)")
    details = {"kld": kld_note, "kld_exact": st["kld_exact"], "envelope_source": st["envelope_source"],
               "stats_seconds": round(seconds, 3)}
    return Result(kind="compare", inputs=inputs, env=env, frame=frame, figures=dict(fig),
                  tables={"positions": per, "flips": flips.reset_index(drop=True)}, details=details)



def compare_live(lm, base: LogitFile, *, tokens: Sequence[int] | None = None, schedule: str | None = None,
                 split: int | None = None, envelope: float | None = None, allow_other_model: bool = False,
                 label: str = "", progress: Callable[[int], None] | None = None,
                 record: dict[str, Any] | None = None, kernels: str = ""):
    """Run ``lm`` on the base's tokens (or ``tokens``, which must be the same stream) and compare with the base.

    The run keeps its own top-k and its logits at the base's top-k ids, so the KLD is exact over the base's
    top-k and bounded by one tail bucket beyond (exact when the base is full: every logit is then compared).

    ``kernels``: the ``replay:<chip>[@variant]`` installed on ``lm`` for the run (its side is then labelled a
    prediction), or "" for this machine's kernels.

    Returns (the ``compare`` Result, this run as a :class:`LogitFile` that :func:`write_logits` can save).
    """
    from ..checks import check_vocab

    ids = [int(t) for t in (base.tokens if tokens is None else tokens)]
    check_vocab(ids, lm.vocab_size, "the stream")
    schedule = schedule or base.header["schedule"]
    split = split if split is not None else base.header.get("split")
    if not needs_split(schedule):
        split = None
    elif split is None:
        split = default_split(len(ids))
    k = int(base.header["top_k"])
    here = header_for(lm, ids, schedule, split, k, False, label or base.header.get("stream", ""), 0.0, None)
    here["kernels"] = kernels or "native"
    check_pair(base.header, here, allow_other_model=allow_other_model)  # before the run
    if base.view.full:
        view, seconds = run_view(lm, ids, schedule, split=split, top_k=k, full=True, progress=progress)
    else:
        view, seconds = run_view(lm, ids, schedule, split=split, top_k=k, extra_ids=base.view.ids[:, :k],
                                 progress=progress)
    other = LogitFile(header={**here, "seconds": round(seconds, 3)}, tokens=np.asarray(ids, np.int64), view=view,
                      path="(this run)")
    result = compare_result(base, other, envelope=envelope,
                            record={"mode": "live", "allow_other_model": allow_other_model,
                                    "seconds_run": round(seconds, 3), **(record or {})})
    return result, other


def compare_golden(lm, name: str = "linux-cpu", n_tokens: int | None = None, **kw):
    """:func:`compare_live` against a shipped base (``linux-cpu``, ``linux-cpu/verify-2``), on its first
    ``n_tokens`` tokens when given (causal: a prefix's logits are the same whatever follows)."""
    base = read_logits(resolve_golden(name))
    if n_tokens is not None:
        base = prefix(base, n_tokens)
    return compare_live(lm, base, **kw)
