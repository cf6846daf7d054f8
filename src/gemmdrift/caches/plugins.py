"""Someone else's cache or rollback under test: ``--cache-impl module:factory`` and ``--rollback module:function``.

A *cache implementation* is a factory ``factory(model) -> list`` returning the model's
per-layer caches, as ``mlx_lm.models.cache.make_prompt_cache`` does. A *rollback* is
``rollback(cache, num_tokens) -> int``: the rewind step of mlx-lm's
``speculative_generate_step`` (its ``_rewind_cache`` closure calls
``trim_prompt_cache(model_cache, ...)`` and then ``trim_prompt_cache(draft_cache, ...)``;
the rollback replaces that call for both lists and returns how many tokens it dropped).

Either is named as ``package.module:attribute`` or ``path/to/file.py:attribute``. Loading
and checking happen here, before any model compute: a spec that cannot be imported, a
factory that returns the wrong number of caches or objects without the cache protocol,
or a callable with the wrong signature is a one-line :class:`GemmdriftError` (exit 2).
Every result records what ran: :meth:`Impl.record` (the spec, the file and the sha256 of
its source).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..errors import GemmdriftError

# What every cache object must have for mlx-lm's generators, masks and gemmdrift's grid to drive it.
CACHE_METHODS = ("update_and_fetch", "is_trimmable", "trim")
CACHE_ATTRIBUTES = ("state", "offset")


@dataclass(frozen=True)
class Impl:
    """A loaded implementation: the object, where it came from, and a digest of its source."""

    spec: str
    obj: Any
    path: str
    sha256: str

    @property
    def label(self) -> str:
        return self.spec.rsplit(":", 1)[1] if ":" in self.spec else self.spec

    def record(self) -> dict[str, str]:
        return {"spec": self.spec, "path": self.path, "sha256": self.sha256}


def _split(spec: str, flag: str) -> tuple[str, str]:
    if not isinstance(spec, str) or spec.count(":") < 1:
        raise GemmdriftError(f"{flag} {spec!r}: expected module:attribute or path/to/file.py:attribute")
    where, attr = spec.rsplit(":", 1)
    if not where or not attr.isidentifier():
        raise GemmdriftError(f"{flag} {spec!r}: expected module:attribute or path/to/file.py:attribute")
    return where, attr


def _import(where: str, flag: str):
    if where.endswith(".py") or "/" in where or "\\" in where:
        path = Path(where).expanduser()
        if not path.is_file():
            raise GemmdriftError(f"{flag}: no such file {where}")
        digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
        name = f"gemmdrift_plugin_{path.stem}_{digest}"
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise GemmdriftError(f"{flag}: cannot import {where}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # classes defined there must be findable again (deepcopy, pickling)
        try:
            spec.loader.exec_module(module)
        except (Exception, SystemExit) as e:  # sys.exit() at import too: one line, not a silent exit (D17)
            del sys.modules[name]
            raise GemmdriftError(f"{flag}: importing {where} raised {type(e).__name__}: {e}") from None
        return module
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as e:
        raise GemmdriftError(f"{flag}: cannot import module {where!r} ({e})") from None
    except (Exception, SystemExit) as e:
        raise GemmdriftError(f"{flag}: importing {where!r} raised {type(e).__name__}: {e}") from None


def _source_digest(module) -> tuple[str, str]:
    path = getattr(module, "__file__", None)
    if not path or not Path(path).is_file():
        return "", ""
    return str(path), hashlib.sha256(Path(path).read_bytes()).hexdigest()


def load(spec: str, flag: str) -> Impl:
    """Import ``spec`` (``module:attribute`` or ``file.py:attribute``); the attribute must be callable."""
    where, attr = _split(spec, flag)
    module = _import(where, flag)
    obj = getattr(module, attr, None)
    if obj is None:
        raise GemmdriftError(f"{flag}: {where} has no attribute {attr!r}")
    if not callable(obj):
        raise GemmdriftError(f"{flag}: {spec} is not callable")
    path, sha = _source_digest(module)
    return Impl(spec, obj, path, sha)


def _check_arity(fn: Callable, n: int, flag: str, shape: str) -> None:
    """``fn`` must accept exactly ``n`` positional arguments (extra ones must have defaults)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin without a signature: judged when it runs
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is p.empty]
    varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
    required_kw = [p for p in params if p.kind == p.KEYWORD_ONLY and p.default is p.empty]
    if len(required) > n or (len(positional) < n and not varargs) or required_kw:
        raise GemmdriftError(f"{flag}: {getattr(fn, '__name__', fn)}{sig} has the wrong signature (expected {shape})")


def load_cache_impl(spec: str, flag: str = "--cache-impl") -> Impl:
    """A cache factory, loaded and its signature checked (``factory(model) -> list of caches``)."""
    impl = load(spec, flag)
    _check_arity(impl.obj, 1, flag, "factory(model) -> list of caches")
    return impl


def load_rollback(spec: str, flag: str = "--rollback") -> Impl:
    """A rollback, loaded and its signature checked (``rollback(cache, num_tokens) -> int``)."""
    impl = load(spec, flag)
    _check_arity(impl.obj, 2, flag, "rollback(cache, num_tokens) -> int")
    return impl


def missing_protocol(c) -> list[str]:
    """The parts of the cache protocol ``c`` lacks (empty: it has them all)."""
    out = [m for m in CACHE_METHODS if not callable(getattr(c, m, None))]
    for a in CACHE_ATTRIBUTES:
        try:
            getattr(c, a)
        except AttributeError:
            out.append(a)
        except Exception:  # a property that raises on an empty cache still exists
            pass
    return out


def make_caches(impl: Impl, model, flag: str = "--cache-impl") -> list:
    """Call the factory on ``model`` and check what it returns: one cache per layer, each with the protocol."""
    try:
        caches = impl.obj(model)
    except Exception as e:
        raise GemmdriftError(f"{flag}: {impl.spec}(model) raised {type(e).__name__}: {e}") from None
    if not isinstance(caches, (list, tuple)):
        raise GemmdriftError(f"{flag}: {impl.spec}(model) returned {type(caches).__name__}, not a list of caches")
    layers = len(model.layers)
    if len(caches) != layers:
        raise GemmdriftError(f"{flag}: {impl.spec}(model) returned {len(caches)} caches for {layers} layers")
    for i, c in enumerate(caches):
        lacks = missing_protocol(c)
        if lacks:
            raise GemmdriftError(f"{flag}: {impl.spec}(model)[{i}] ({type(c).__name__}) is not a cache: it has no "
                                 f"{', '.join(lacks)}")
    return list(caches)


def checked_factory(impl: Impl, model, flag: str = "--cache-impl") -> Callable[[Any], list]:
    """Validate the factory on the loaded model (no compute) and return ``model -> caches`` for the run."""
    make_caches(impl, model, flag)
    return lambda m: list(impl.obj(m))


def resolve(spec: str | None, kind: str) -> Impl | None:
    """``spec`` loaded as a cache factory (kind 'cache') or a rollback (kind 'rollback'); None stays None."""
    if spec is None:
        return None
    return load_cache_impl(spec) if kind == "cache" else load_rollback(spec)


@contextlib.contextmanager
def refused_on_raise(*named: tuple[str, str | None]):
    """While plug-ins under test run (``named``: (flag, spec) pairs, a None spec is not one): anything raised in
    the block -- by the plug-in, or by mlx-lm on what it returned -- ends the run as one line naming the
    plug-ins and the exception (exit 2), as ``state`` marks such a case ``refused``; never a traceback.
    Interrupts pass through, and so do gemmdrift's own one-line errors."""
    active = [f"{flag} {spec}" for flag, spec in named if spec]
    if not active:
        yield
        return
    try:
        yield
    except GemmdriftError:
        raise
    except Exception as e:  # noqa: BLE001  (whatever the plug-in raises is its verdict)
        text = str(e).splitlines()[0] if str(e) else ""
        raise GemmdriftError(f"refused: the plug-in under test ({' with '.join(active)}) raised "
                             f"{type(e).__name__}{': ' + text if text else ''}") from None


@contextlib.contextmanager
def rollback_installed(rollback: Callable[[list, int], int] | None):
    """mlx-lm's ``speculative_generate_step`` rewinds with ``rollback`` instead of ``trim_prompt_cache``.

    ``_rewind_cache`` is a closure that looks ``trim_prompt_cache`` up in ``mlx_lm.generate``'s
    globals at each call, so replacing that module attribute for the duration of the block
    replaces the rewind step (and nothing else in mlx-lm: other modules hold their own name).
    """
    if rollback is None:
        yield
        return
    G = importlib.import_module("mlx_lm.generate")  # the module: `mlx_lm.generate` the attribute is a function

    old = G.trim_prompt_cache
    G.trim_prompt_cache = rollback
    try:
        yield
    finally:
        G.trim_prompt_cache = old
