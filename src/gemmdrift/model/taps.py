"""Layer taps: run a real mlx-lm model under a schedule and record hidden states.

The model keeps its own layer loop, masks and caches (``make_prompt_cache``:
``KVCache`` and ``RotatingKVCache`` as the model makes them). For the length of
a run, every entry of ``model.layers`` is replaced by a recording proxy that
delegates the call and keeps the hidden state it returns, for the tapped
positions only. The final norm gets a proxy too: it records the normed state
and hands on only the rows whose logits are read, so the LM head (262,144 rows
for Gemma) runs on those rows alone, within the block where they were computed.

In *local* mode a proxy also replaces its layer's input with a reference run's
input at the same positions: every layer then sees identical inputs, and
whatever differs in its output was introduced by that layer (its kernels and
its cache layout) rather than inherited from below.

This wraps rather than copies the model's loop, which differs between
architectures (Gemma 4 passes per-layer inputs and shared KV). It works for any
mlx-lm model with a ``layers`` list whose layers return the hidden state
(or a tuple starting with it).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ..errors import GemmdriftError
from ..schedules import Schedule, parse_schedule

NORM_NAMES = ("norm", "final_norm", "norm_f", "ln_f", "final_layernorm")


def storage_dtype_name(dtype) -> str:
    import mlx.core as mx

    names = {mx.bfloat16: "bfloat16", mx.float16: "float16", mx.float32: "float32"}
    if dtype not in names:
        raise GemmdriftError(f"unsupported hidden-state dtype {dtype}")
    return names[dtype]


def to_numpy(x) -> np.ndarray:
    """mlx array -> float32 numpy; exact for bf16/fp16/fp32 values."""
    import mlx.core as mx

    return np.array(x.astype(mx.float32), copy=True)


@dataclass
class Taps:
    """Hidden states of one run at the tapped positions.

    ``hidden[i]`` is the output of decoder layer i for i < n_layers and the
    final norm's output for i == n_layers; rows follow ``positions``.
    ``logits`` has one row per entry of ``logit_positions``.
    """

    schedule: str
    positions: np.ndarray
    hidden: np.ndarray  # (n_layers + 1, len(positions), hidden) float32, exact
    dtype: str  # storage dtype of the hidden states
    logit_positions: np.ndarray
    logits: np.ndarray | None  # (len(logit_positions), vocab) float32
    logits_dtype: str | None
    blocks: int
    seconds: float
    mode: str = "accumulated"
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def n_layers(self) -> int:
        return self.hidden.shape[0] - 1

    def rows(self, positions: Sequence[int]) -> np.ndarray:
        """Row indices of ``positions`` in this run's tapped positions."""
        idx = np.searchsorted(self.positions, positions)
        if np.any(idx >= len(self.positions)) or np.any(self.positions[np.minimum(idx, len(self.positions) - 1)] != positions):
            raise GemmdriftError("position not tapped in this run")
        return idx

    def logit_rows(self, positions: Sequence[int]) -> np.ndarray:
        idx = np.searchsorted(self.logit_positions, positions)
        if np.any(idx >= len(self.logit_positions)) or np.any(
            self.logit_positions[np.minimum(idx, len(self.logit_positions) - 1)] != positions
        ):
            raise GemmdriftError("position has no logits in this run")
        return idx


def save_taps(path, taps: Taps) -> None:
    """Write a run's taps to ``path`` (.npz), atomically."""
    import json

    from ..files import atomic_path

    meta = {k: getattr(taps, k) for k in ("schedule", "dtype", "logits_dtype", "blocks", "seconds", "mode")}
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, positions=taps.positions, hidden=taps.hidden, logit_positions=taps.logit_positions,
                     logits=taps.logits if taps.logits is not None else np.zeros((0, 0), np.float32),
                     meta=np.array(json.dumps(meta)))


def load_taps(path) -> Taps:
    import json

    with np.load(path) as z:
        meta = json.loads(str(z["meta"]))
        logits = z["logits"]
        return Taps(positions=z["positions"], hidden=z["hidden"], logit_positions=z["logit_positions"],
                    logits=logits if logits.size else None, **meta)


def load_checkpoint(path) -> Taps | None:
    """A run's saved taps, or None when there are none yet; a corrupt file is set aside (the run is made again)."""
    import zipfile
    from pathlib import Path

    from ..files import discard_checkpoint

    if path is None or not Path(path).is_file():
        return None
    try:
        return load_taps(path)
    except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile) as e:
        discard_checkpoint(path, e.__class__.__name__)
        return None


# Blocks of at least this many rows start evaluating their taps layer by layer (see _Recorder.capture);
# shorter blocks (decode, verification) keep one eval per block, as mlx-lm does.
EAGER_ROWS = 64
SINK_ROWS = 64  # logit rows handed to a logits_sink at a time


class _Recorder:
    """Collects tapped rows block by block; feeds reference inputs in local mode."""

    def __init__(self, n_taps: int, positions: np.ndarray, logit_positions: np.ndarray, reference: Taps | None):
        self.n_taps = n_taps  # decoder layers + final norm
        self.positions = positions
        self.logit_positions = logit_positions
        self.reference = reference
        self.start = 0
        self.length = 0
        self.pending: list[tuple[int, np.ndarray, Any]] = []
        self.hidden: np.ndarray | None = None
        self.dtype: str | None = None

    def begin(self, start: int, stop: int) -> None:
        self.start, self.length = start, stop - start
        self.pending = []

    def _rows(self, wanted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(slots in `wanted`, rows in the current block) for wanted positions in this block."""
        lo = np.searchsorted(wanted, self.start)
        hi = np.searchsorted(wanted, self.start + self.length)
        return np.arange(lo, hi), wanted[lo:hi] - self.start

    def logit_block_rows(self) -> np.ndarray:
        return self._rows(self.logit_positions)[1]

    def capture(self, tap: int, h) -> None:
        slots, rows = self._rows(self.positions)
        if len(rows) == 0:
            return
        import mlx.core as mx

        if h.ndim != 3 or h.shape[1] != self.length:
            raise GemmdriftError(f"tap {tap}: expected a (1, {self.length}, hidden) state, got {tuple(h.shape)}")
        sel = h[0] if len(rows) == self.length else h[0, mx.array(rows)]
        if self.length >= EAGER_ROWS:
            # Start computing the kept rows now: otherwise mlx evaluates every layer's whole
            # output before any of the small slices taken from them, and a long prefill block
            # holds (layers x block x hidden) at once, which plain mlx-lm never does.
            mx.async_eval(sel)
        self.pending.append((tap, slots, sel))

    def arrays(self) -> list:
        return [p[2] for p in self.pending]

    def flush(self) -> None:
        for tap, slots, arr in self.pending:
            if self.hidden is None:
                self.dtype = storage_dtype_name(arr.dtype)
                self.hidden = np.zeros((self.n_taps, len(self.positions), arr.shape[-1]), np.float32)
            self.hidden[tap, slots] = to_numpy(arr)
        self.pending = []

    def reference_input(self, tap: int, like):
        """The reference run's input to ``tap`` (its tap - 1 output) for this block's rows."""
        import mlx.core as mx

        ref = self.reference
        rows = ref.rows(np.arange(self.start, self.start + self.length))
        x = mx.array(ref.hidden[tap - 1, rows][None]).astype(like.dtype)
        if x.shape != like.shape:
            raise GemmdriftError(f"local mode: reference input {tuple(x.shape)} does not match {tuple(like.shape)}")
        return x


class LayerProxy:
    """Stands in for one decoder layer: delegates, and records what it returns."""

    def __init__(self, layer, index: int, recorder: _Recorder):
        self._layer = layer
        self._index = index
        self._rec = recorder

    def __getattr__(self, name):  # the model's loop may read attributes (e.g. layer_type)
        return getattr(self._layer, name)

    def __call__(self, x, *args, **kwargs):
        rec = self._rec
        if rec.reference is not None and self._index > 0:
            x = rec.reference_input(self._index, x)
        out = self._layer(x, *args, **kwargs)
        rec.capture(self._index, out[0] if isinstance(out, tuple) else out)
        return out


class StopForward(Exception):
    """Raised after the final norm when no logits are needed: ends the forward pass there.

    The caches were already updated by then. Ending the pass also spares the
    LM head a zero-row input, which crashes mlx 0.32.4's CPU quantized_matmul
    (integer division by M=0 in mlx/backend/cpu/quantized.cpp).
    """


class _NormProxy(LayerProxy):
    """Stands in for the final norm: records, then passes on only the rows whose logits are read."""

    def __call__(self, x, *args, **kwargs):
        import mlx.core as mx

        rec = self._rec
        if rec.reference is not None:
            x = rec.reference_input(self._index, x)
        y = self._layer(x, *args, **kwargs)
        rec.capture(self._index, y)
        rows = rec.logit_block_rows()
        if len(rows) == 0:
            raise StopForward
        if len(rows) == rec.length:
            return y  # every row is read: the head sees the block exactly as in a real run
        return y[:, mx.array(rows)]


def find_final_norm(model) -> tuple[Any, str]:
    """(module holding the layer list, attribute name of its final norm)."""
    layers = model.layers
    for _, mod in model.named_modules():
        if isinstance(mod, dict) and mod.get("layers") is layers:
            for name in NORM_NAMES:
                if name in mod:
                    return mod, name
    raise GemmdriftError(
        "unsupported architecture: cannot find the final norm next to the layer list "
        f"(looked for {', '.join(NORM_NAMES)})"
    )


@contextlib.contextmanager
def swapped(slots: Sequence[tuple[Any, Any, Any]]) -> Iterator[None]:
    """The one proxy mechanism (layer taps here, input capture in :mod:`gemmdrift.model.projections`): put each
    proxy into its slot, ``container[key] = proxy``, for the duration; always restore the originals (in
    reverse order), even when a forward pass raised, so the model stays usable."""
    originals = []
    try:
        for container, key, proxy in slots:
            originals.append((container, key, container[key]))
            container[key] = proxy
        yield
    finally:
        for container, key, original in reversed(originals):
            container[key] = original


@contextlib.contextmanager
def installed(model, recorder: _Recorder) -> Iterator[None]:
    """Swap in the proxies for the duration of a run; always restore the model."""
    layers = model.layers
    owner, norm_name = find_final_norm(model)
    slots = [(layers, i, LayerProxy(layer, i, recorder)) for i, layer in enumerate(list(layers))]
    slots.append((owner, norm_name, _NormProxy(owner[norm_name], len(layers), recorder)))
    with swapped(slots):
        yield


def copy_cache(cache: list) -> list:
    """An independent copy of mlx-lm caches: every array attribute gets its own array object.

    Caches update their buffers by slice assignment, which rebinds the array
    object in place; two caches must therefore never share one.
    """
    import copy

    import mlx.core as mx

    out = []
    for c in cache:
        if c is None:
            out.append(None)
            continue
        d = copy.copy(c)
        for k, v in vars(c).items():
            if isinstance(v, mx.array):
                setattr(d, k, mx.array(v))
        out.append(d)
    return out


@dataclass
class Prefix:
    """Caches after the first ``length`` tokens, computed once and shared by runs that agree on them."""

    length: int
    blocks: list
    cache: list
    seconds: float
    loaded: bool = False  # read from a prefix store (:func:`common_prefix`), not computed here


def shared_blocks(n: int, schedules: Sequence[Schedule | str], split: int | None, limit: int) -> list:
    """The leading blocks every schedule feeds alike over ``n`` tokens, up to ``limit`` tokens."""
    lists = [parse_schedule(s).blocks(n, split) for s in schedules]
    shared = []
    for group in zip(*lists):
        if len(set(group)) != 1 or group[0][1] > limit:
            break
        shared.append(group[0])
    return shared


def common_prefix(model, tokens: Sequence[int], schedules: Sequence[Schedule | str], split: int | None,
                  limit: int, reuse: Prefix | None = None, store: Any = None) -> Prefix | None:
    """Run the blocks every schedule shares (from the start, up to ``limit`` tokens) once.

    Returns None when the schedules share no leading block below ``limit``. ``reuse``: a prefix computed
    earlier over the same leading tokens (the caller's word: tokens are not stored); returned as it is when
    its blocks are exactly the shared ones, else the prefix is computed. ``store``: ``(directory, description,
    dtype)``, where measurements of one run share their prefixes (:func:`prefix_file`): a prefix saved there
    under the same key is read instead of computed (bit for bit the caches it was saved from), and one computed
    here is saved (atomically) for the next.
    """
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    shared = shared_blocks(len(tokens), schedules, split, limit)
    if not shared:
        return None
    if reuse is not None and reuse.blocks == shared:
        return reuse
    path = prefix_file(*store, tokens, shared) if store is not None else None
    if path is not None and path.is_file():
        loaded = _load_prefix(path, model)
        if loaded is not None:
            return Prefix(shared[-1][1], shared, loaded, 0.0, loaded=True)
    cache = make_prompt_cache(model)
    token_array = mx.array(np.asarray(tokens, dtype=np.uint32))
    t0 = time.perf_counter()
    for start, stop in shared:
        model(token_array[start:stop][None], cache=cache)
        # Only the cache state is needed: the lazily built logits are never evaluated.
        mx.eval([c.state for c in cache if c is not None])
    prefix = Prefix(shared[-1][1], shared, cache, time.perf_counter() - t0)
    if path is not None:
        _save_prefix(path, cache)
    return prefix


def prefix_file(directory, description, dtype: str, tokens: Sequence[int], blocks: list):
    """Where a prefix store keeps the caches after ``blocks`` of ``tokens``: keyed by the model, the dtype it
    computes in (the ladder's float32 rung computes the same model in float32), the tokens of those blocks, the
    blocks, the mlx and mlx-lm versions and where it computes (:func:`gemmdrift.model.resume_key`)."""
    from pathlib import Path

    from . import resume_key

    n = blocks[-1][1]
    key = resume_key(description, "prefix", dtype, [int(t) for t in tokens[:n]], [list(b) for b in blocks])
    return Path(directory) / f"{key}.safetensors"


def _stock(cache) -> bool:
    """Every entry one of mlx-lm's own cache classes (a plug-in's caches are not stored: load_prompt_cache could
    not rebuild them)."""
    return all(c is not None and type(c).__module__ == "mlx_lm.models.cache" for c in cache)


def _save_prefix(path, cache) -> None:
    import os

    from mlx_lm.models.cache import save_prompt_cache

    if not _stock(cache):
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.safetensors")
    try:
        save_prompt_cache(str(tmp), cache)
        os.replace(tmp, path)
    except OSError:  # a store that cannot be written costs the next measurement a prefix, nothing more
        tmp.unlink(missing_ok=True)


def _load_prefix(path, model):
    """The caches saved at ``path``, or None: when it is unreadable (the file removed) or not the caches this
    model makes (another layout, class or layer count)."""
    from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache

    try:
        cache = load_prompt_cache(str(path))
    except Exception:  # noqa: BLE001 -- a damaged store file is recomputed, never trusted
        path.unlink(missing_ok=True)
        return None
    fresh = make_prompt_cache(model)
    if [type(c) for c in cache] != [type(c) for c in fresh] or not _stock(fresh):
        return None  # not the caches this model makes here (a plug-in's): computed, the file left as it is
    return cache


def run_schedule(
    model,
    tokens: Sequence[int],
    schedule: Schedule | str,
    *,
    split: int | None = None,
    positions: Sequence[int] | None = None,
    logit_positions: Sequence[int] | None = None,
    reference: Taps | None = None,
    progress: Callable[[int], None] | None = None,
    prefix: Prefix | None = None,
    logits_sink: Callable[[np.ndarray, np.ndarray], None] | None = None,
) -> Taps:
    """Feed ``tokens`` through ``model`` block by block as ``schedule`` says.

    Args:
        model: an mlx-lm model (its own caches are made with make_prompt_cache).
        tokens: the whole token stream (teacher forced).
        schedule: e.g. ``"prefill:512,verify:2"``.
        split: prompt/continuation boundary for two-phase schedules.
        positions: absolute positions whose hidden states are kept (default all).
        logit_positions: positions whose logits are computed (default none).
        reference: a run tapped at every position from the first block run on;
            its inputs are fed to each layer (local mode).
        progress: called with the number of tokens of each finished block.
        prefix: shared caches for the leading blocks (see :func:`common_prefix`);
            those blocks are skipped, so positions before ``prefix.length``
            cannot be tapped.
        logits_sink: called with (positions, float32 logits) of each block instead of keeping them
            (the returned ``logits`` is then None): a run reading every position's 262,144 logits
            reduces them block by block rather than holding them all.
    """
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    schedule = parse_schedule(schedule)
    n = len(tokens)
    blocks = schedule.blocks(n, split)
    start = prefix.length if prefix is not None else 0
    positions = np.arange(start, n) if positions is None else np.unique(np.asarray(positions, dtype=np.int64))
    logit_positions = (np.zeros(0, np.int64) if logit_positions is None
                       else np.unique(np.asarray(logit_positions, dtype=np.int64)))
    for name, p in (("position", positions), ("logit position", logit_positions)):
        if p.size and (p[0] < 0 or p[-1] >= n):
            raise GemmdriftError(f"{name} out of range: the stream has {n} tokens (0..{n - 1})")
    if positions.size == 0:
        raise GemmdriftError("no positions to tap")
    if prefix is not None:
        if blocks[: len(prefix.blocks)] != prefix.blocks:
            raise GemmdriftError(f"schedule {schedule} does not start with the shared prefix blocks")
        blocks = blocks[len(prefix.blocks):]
        if positions[0] < start or (logit_positions.size and logit_positions[0] < start):
            raise GemmdriftError(f"positions before {start} are inside the shared prefix and cannot be tapped")
    if reference is not None and not np.array_equal(reference.positions, np.arange(start, n)):
        raise GemmdriftError("local mode needs a reference run tapped at every position it computes")
    n_taps = len(model.layers) + 1
    rec = _Recorder(n_taps, positions, logit_positions, reference)
    cache = copy_cache(prefix.cache) if prefix is not None else make_prompt_cache(model)
    token_array = mx.array(np.asarray(tokens, dtype=np.uint32))
    logit_rows: list[np.ndarray] = []
    logits_dtype = None
    t0 = time.perf_counter()
    with installed(model, rec):
        for start, stop in blocks:
            rec.begin(start, stop)
            wanted = rec.logit_block_rows()
            try:
                out = model(token_array[start:stop][None], cache=cache)
            except StopForward:
                out = None
            # One eval per block, as mlx-lm's generate does: outputs, taps and cache state together.
            mx.eval([out] if out is not None else [], rec.arrays(), [c.state for c in cache if c is not None])
            rec.flush()
            if len(wanted):
                if out.shape[1] != len(wanted):
                    raise GemmdriftError("the model's output rows do not match the requested logit rows")
                logits_dtype = storage_dtype_name(out.dtype)
                if logits_sink is not None:
                    # Rows of the evaluated output in slices: a float32 copy of a whole prefill block's
                    # 262,144 logits per row would be another GB.
                    for s in range(0, len(wanted), SINK_ROWS):
                        logits_sink(start + wanted[s:s + SINK_ROWS], to_numpy(out[0, s:s + SINK_ROWS]))
                else:
                    logit_rows.append(to_numpy(out[0]))
            if progress:
                progress(stop - start)
    seconds = time.perf_counter() - t0
    logits = np.concatenate(logit_rows) if logit_rows else None
    return Taps(
        schedule=schedule.text,
        positions=positions,
        hidden=rec.hidden,
        dtype=rec.dtype,
        logit_positions=logit_positions,
        logits=logits,
        logits_dtype=logits_dtype,
        blocks=len(blocks),
        seconds=seconds,
        mode="local" if reference is not None else "accumulated",
    )


def run_plain(model, tokens: Sequence[int], schedule: Schedule | str, *, split: int | None = None,
              logit_positions: Sequence[int] | None = None) -> float:
    """The same blocks through plain mlx-lm calls, without taps; returns seconds.

    As mlx-lm's generate does: the model's own output for every block (the LM
    head over all its rows), evaluated with the cache state, keeping only the
    rows that would be read. The baseline of the taps' overhead.
    """
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    schedule = parse_schedule(schedule)
    n = len(tokens)
    wanted = set(int(p) for p in (logit_positions if logit_positions is not None else []))
    cache = make_prompt_cache(model)
    token_array = mx.array(np.asarray(tokens, dtype=np.uint32))
    t0 = time.perf_counter()
    for start, stop in schedule.blocks(n, split):
        out = model(token_array[start:stop][None], cache=cache)
        rows = [p - start for p in range(start, stop) if p in wanted]
        mx.eval([out[:, mx.array(rows)]] if rows else [], [c.state for c in cache if c is not None])
    return time.perf_counter() - t0
