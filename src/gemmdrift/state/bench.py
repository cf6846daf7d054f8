"""The test bench for cache fixes: point ``state``, ``diverge``, ``stack`` and ``server`` at someone else's cache.

``--cache-impl module:factory`` (or ``path/to/file.py:factory``) and ``--rollback
module:function`` are loaded and checked by :mod:`gemmdrift.caches.plugins`; this module turns
them into what each command runs:

* ``state``: a :class:`gemmdrift.state.Setup` whose caches the factory makes (every
  rollback, save/load and server-reuse case), plus the model-free trim cases on each
  class the factory returns, at that class's own window (:func:`plugin_setup`);
* ``stack``: the factory installed as the model's ``make_cache`` for the run
  (:func:`factory_installed`), so every schedule's caches are the implementation's;
* ``diverge``: the speculative stream's target and draft caches come from the factory,
  and the rewind step is the rollback (:func:`gemmdrift.caches.plugins.rollback_installed`);
* ``server``: ``python -m gemmdrift.caches.serve_launch`` installs both in the ``mlx_lm.server``
  process (:mod:`gemmdrift.caches.serve_launch`).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable

import numpy as np

from ..errors import GemmdriftError
from ..caches.plugins import Impl, checked_factory, load_cache_impl, load_rollback, make_caches, refused_on_raise


def add_arguments(s, *, rollback: bool) -> None:
    """``--cache-impl`` (and ``--rollback`` where the command has none yet) on a subcommand's parser."""
    s.add_argument("--cache-impl", metavar="MODULE:FACTORY",
                   help="caches under test: factory(model) -> per-layer caches, as make_prompt_cache "
                        "(module:attr or path/to/file.py:attr), e.g. gemmdrift.caches.exact:make_cache")
    if rollback:
        s.add_argument("--rollback", metavar="MODULE:FUNCTION",
                       help="replaces the rewind step of speculative decoding: rollback(cache, num_tokens) -> int")


def load_args(args) -> tuple[Impl | None, Impl | None]:
    """The implementations a command's flags name, loaded and signature-checked (no model needed)."""
    spec = getattr(args, "cache_impl", None)
    roll = getattr(args, "rollback", None)
    for flag, value in (("--cache-impl", spec), ("--rollback", roll)):
        if value is not None and not str(value).strip():  # e.g. an unset shell variable: never the default
            raise GemmdriftError(f"{flag} is empty: give module:function or path/to/file.py:function")
    impl = load_cache_impl(spec) if spec else None
    rb = load_rollback(roll) if (roll and ":" in roll) else None
    return impl, rb


def records(impl: Impl | None, rollback: Impl | None) -> dict[str, Any]:
    """What ran, for a Result's inputs: spec, file and sha256 of each implementation."""
    out = {}
    if impl is not None:
        out["cache_impl"] = impl.record()
    if rollback is not None:
        out["rollback_impl"] = rollback.record()
    return out


class _Template:
    """A fresh copy of one cache the factory made (the model-free trim cases), with that cache's window."""

    def __init__(self, cache):
        self._cache = cache
        self.window = getattr(cache, "max_size", None)

    def __call__(self):
        return copy.deepcopy(self._cache)


def plugin_setup(impl: Impl, lm) -> Any:
    """The :class:`gemmdrift.state.Setup` of an implementation, checked on the loaded model (no compute)."""
    from . import Setup

    caches = make_caches(impl, lm.model)
    makers: dict[str, Callable[[], Any]] = {}
    for c in caches:
        makers.setdefault(type(c).__name__, _Template(c))
    classes = ", ".join(f"{n}" + (f" (window {m.window})" if m.window else "") for n, m in makers.items())
    return Setup(impl.spec, checked_factory(impl, lm.model), f"{impl.spec} (sha256 {impl.sha256[:12]}): {classes}",
                 plugin=True, trim_makers=makers)


DEFAULT_OPERATIONS = ("rollback", "trim", "trim_prompt_cache", "draft_trim", "save_load", "server_reuse", "batch")


def measure_state_impl(lm, impl: Impl, **kwargs):
    """``gemmdrift state`` on an implementation: the same grid, verdicts and Result as for mlx-lm's classes."""
    from . import measure_state

    if kwargs.get("workers") not in (None, 1):
        raise GemmdriftError("--cache-impl runs the sweep in one process (--workers 1)")
    kwargs.pop("workers", None)
    kwargs.pop("caches", None)
    ops = tuple(kwargs.pop("operations", DEFAULT_OPERATIONS))
    if "trim" in ops and "draft_trim" not in ops:  # a plug-in is judged on the draft's rewind too
        ops += ("draft_trim",)
    kwargs["operations"] = ops
    return measure_state(lm, setups=[plugin_setup(impl, lm)], workers=1, implementations=records(impl, None),
                         **kwargs)


@contextlib.contextmanager
def factory_installed(model, factory: Callable[[Any], list] | None):
    """``make_prompt_cache(model)`` returns ``factory(model)`` inside the block (it defers to ``model.make_cache``).

    A factory that itself calls ``make_prompt_cache(model)`` (to start from the model's own
    caches) gets the model's own caches: the hook steps aside while the factory runs.
    """
    if factory is None:
        yield
        return
    own = model.__dict__.get("make_cache") if hasattr(model, "__dict__") else None
    inside = [False]

    def original():
        if own is not None:
            return own()
        cls_make = getattr(type(model), "make_cache", None)
        if cls_make is not None:
            return cls_make(model)
        from mlx_lm.models.cache import KVCache

        return [KVCache() for _ in model.layers]

    def hook():
        if inside[0]:
            return original()
        inside[0] = True
        try:
            return list(factory(model))
        finally:
            inside[0] = False

    model.make_cache = hook
    try:
        yield
    finally:
        if own is not None:
            model.make_cache = own
        else:
            try:
                del model.make_cache
            except (AttributeError, KeyError):
                model.__dict__.pop("make_cache", None)


# --------------------------------------------------------------------------- cost against mlx-lm's own cache


def cache_bytes(cache: list) -> int:
    """Bytes the caches hold now (``nbytes`` of every layer; an overlay counts its apart rows too)."""
    return int(sum(int(getattr(c, "nbytes", 0) or 0) for c in cache))


def decode_cost(lm, prompt, n: int, factories: dict[str, Callable[[Any], list]], *, repeats: int = 3,
                warmup: int = 1, prefill_step: int = 512) -> "Any":
    """Greedy decode speed and cache memory of each factory's caches, measured side by side in one run.

    Each factory's caches are prefilled once with ``prompt[:-1]`` (untimed); every run starts from a
    deep copy of that state and decodes ``n`` tokens with mlx-lm's ``generate_step`` (T=1, the path
    every generator takes), timed end to end. The factories alternate within each round (the first
    one first in even rounds, last in odd ones) so drift in the machine's load hits them alike;
    ``warmup`` rounds are run and dropped. Peak cache bytes are sampled after every decoded token.

    Returns a DataFrame, one row per factory: ``tokens_per_s`` (median over ``repeats`` rounds),
    ``ratio`` (median over rounds of this factory's tokens/s over the first factory's in the same
    round), ``peak_cache_bytes`` and ``extra_bytes_per_layer`` (against the first factory), and
    ``tokens_equal`` (its greedy tokens are the first factory's).
    """
    import time

    import mlx.core as mx
    import pandas as pd
    from mlx_lm.generate import generate_step

    if repeats < 1 or n < 1:
        raise GemmdriftError("decode_cost needs repeats >= 1 and n >= 1")
    names = list(factories)
    prompt = [int(t) for t in prompt]
    start = {}
    for name in names:
        cache = factories[name](lm.model)
        y = prompt[:-1]
        for s in range(0, len(y), prefill_step):
            lm.model(mx.array(y[s:s + prefill_step], dtype=mx.uint32)[None], cache=cache)
            mx.eval([c.state for c in cache])
        start[name] = cache
    speeds = {name: [] for name in names}
    peaks = {name: 0 for name in names}
    tokens = {}
    for rnd in range(warmup + repeats):
        order = names if rnd % 2 == 0 else names[::-1]
        for name in order:
            cache = copy.deepcopy(start[name])
            out = []
            t0 = time.perf_counter()
            for tok, _ in generate_step(mx.array(prompt[-1:], dtype=mx.uint32), lm.model, max_tokens=n,
                                        prompt_cache=cache):
                out.append(int(tok))
                peaks[name] = max(peaks[name], cache_bytes(cache))
            dt = time.perf_counter() - t0
            if rnd >= warmup:
                speeds[name].append(len(out) / dt)
            tokens[name] = out
    base = names[0]
    layers = len(lm.model.layers)
    rows = []
    for name in names:
        ratios = [a / b for a, b in zip(speeds[name], speeds[base])]
        rows.append({"cache": name, "tokens_per_s": float(np.median(speeds[name])),
                     "ratio": float(np.median(ratios)), "runs": len(speeds[name]),
                     "speeds": ",".join(f"{s:.3f}" for s in speeds[name]),
                     "peak_cache_bytes": peaks[name], "extra_bytes_per_layer": (peaks[name] - peaks[base]) / layers,
                     "tokens_equal": tokens[name] == tokens[base], "prompt_tokens": len(prompt), "n": n})
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- the commands' few lines (cli/)


def precheck(args) -> tuple[Impl | None, Impl | None]:
    """A command's ``--cache-impl`` / ``--rollback`` (and ``server --draft self:N``), checked before any model loads."""
    roll = getattr(args, "rollback", None)
    if roll is not None and getattr(args, "command", "") == "diverge" and roll not in ("mlx-lm", "exact") \
            and ":" not in roll:
        raise GemmdriftError(f"--rollback {roll!r}: mlx-lm, exact or module:function")
    if getattr(args, "command", "") == "server" \
            and "draft" not in [c.strip() for c in str(getattr(args, "cases", "draft")).split(",")]:
        for flag, value in (("--rollback", roll), ("--cache-impl", getattr(args, "cache_impl", None))):
            if value is not None:  # only the draft case's server runs the plug-ins
                raise GemmdriftError(f"{flag} {value}: only the draft case's server runs it, and --cases "
                                     f"{args.cases} leaves that case out (add draft to --cases or drop {flag})")
    if getattr(args, "command", "") == "server" and getattr(args, "draft", None) is not None:
        from pathlib import Path

        from ..model.draft_self import parse_self

        if parse_self(args.draft) is None and not Path(args.draft).expanduser().is_dir():
            raise GemmdriftError(f"--draft {args.draft}: not an mlx-lm directory (or self:N, the target's first N "
                                 "layers)")
    return load_args(args)


def state_measure(impl: Impl | None):
    """The function ``gemmdrift state`` runs: mlx-lm's classes, or the implementation's."""
    from .. import state

    return state.measure_state if impl is None else (lambda lm, **kw: measure_state_impl(lm, impl, **kw))


@contextlib.contextmanager
def stack_caches(impl: Impl | None, lm):
    """``gemmdrift stack`` with the implementation's caches in every schedule; yields what to record."""
    with factory_installed(lm.model, None if impl is None else checked_factory(impl, lm.model)), \
            refused_on_raise(("--cache-impl", None if impl is None else impl.spec)):
        yield records(impl, None)


def diverge_options(impl: Impl | None, rb: Impl | None, lm, draft, opts: dict, record: dict) -> None:
    """Check the factory on the loaded target and draft (no compute); add the specs and records to a run's options."""
    if impl is not None:
        make_caches(impl, lm.model)
        make_caches(impl, draft if draft is not None else lm.model)
        opts["cache_impl"] = impl.spec
    record.update(opts, **records(impl, rb))


def update_cost(makers: dict[str, Callable[[], Any]], *, window_rows: int, steps: int = 64, heads: int = 1,
                dim: int = 256, repeats: int = 5, dtype: str = "bfloat16") -> "Any":
    """Seconds per T=1 ``update_and_fetch`` (evaluated) of one layer's cache past the window, side by side.

    No model: each cache is filled with ``window_rows`` rows of seeded keys and values (mlx-lm's
    prefill chunks of 512), then ``steps`` single-row updates are timed, each evaluated as attention
    would consume its output. Rounds alternate the order of the makers; the median per maker over
    ``repeats`` rounds is reported, with its ratio to the first maker's in the same round. This is
    the cache's own cost per layer and token, what a decode step adds to the model's compute.
    """
    import time

    import mlx.core as mx
    import pandas as pd

    dt = getattr(mx, dtype)
    # numpy's Generator: the same fill on every platform and chip (mx.random.normal's erfinv differs between
    # Metal chips, mlx #3568; issue 31 item 5). Only timings are reported, so no figure depends on the values.
    rng = np.random.default_rng(0)
    fill = mx.array(rng.standard_normal((1, heads, window_rows + steps, dim), dtype=np.float32)).astype(dt)
    mx.eval(fill)
    names = list(makers)
    per = {n: [] for n in names}
    for rnd in range(repeats + 1):  # round 0 warms up
        for name in (names if rnd % 2 == 0 else names[::-1]):
            c = makers[name]()
            for s in range(0, window_rows, 512):
                c.update_and_fetch(fill[..., s:min(s + 512, window_rows), :], fill[..., s:min(s + 512, window_rows), :])
            mx.eval([a for a in c.state if isinstance(a, mx.array)])
            t0 = time.perf_counter()
            for i in range(steps):
                row = fill[..., window_rows + i:window_rows + i + 1, :]
                k, v = c.update_and_fetch(row, row)
                mx.eval(k, v)
            if rnd:
                per[name].append((time.perf_counter() - t0) / steps)
    base = names[0]
    return pd.DataFrame([{"cache": n, "seconds_per_update": float(np.median(per[n])),
                          "ratio": float(np.median([a / b for a, b in zip(per[n], per[base])])), "rounds": repeats}
                         for n in names])
