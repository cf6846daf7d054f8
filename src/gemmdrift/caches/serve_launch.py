"""``mlx_lm.server`` with a plug-in cache and rollback installed in its process (the installed mlx-lm untouched).

    python -m gemmdrift.caches.serve_launch [--cache-impl MODULE:FACTORY] [--rollback MODULE:FUNCTION] -- SERVER ARGS

Before ``mlx_lm.server.main()`` runs: the server's ``make_prompt_cache`` (the name it imported
from ``mlx_lm.models.cache``; it makes every request's caches, the draft model's too) returns the
factory's caches, checked like ``--cache-impl`` everywhere (:func:`gemmdrift.caches.plugins.make_caches`),
and ``mlx_lm.generate.trim_prompt_cache`` (what ``speculative_generate_step``'s rewind step calls)
is the rollback. A bad spec is one line on stderr and exit 2, before the server loads a model.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from ..errors import GemmdriftError
from .plugins import load_cache_impl, load_rollback, make_caches


def install(cache_impl: str | None, rollback: str | None) -> None:
    """Patch the names ``mlx_lm.server`` and ``speculative_generate_step`` look up, in this process."""
    server = importlib.import_module("mlx_lm.server")
    if cache_impl:
        impl = load_cache_impl(cache_impl)
        server.make_prompt_cache = lambda model, max_kv_size=None: make_caches(impl, model)
        print(f"gemmdrift serve_launch: caches from {impl.spec} (sha256 {impl.sha256})", file=sys.stderr, flush=True)
    if rollback:
        rb = load_rollback(rollback)
        importlib.import_module("mlx_lm.generate").trim_prompt_cache = rb.obj
        print(f"gemmdrift serve_launch: rollback {rb.spec} (sha256 {rb.sha256})", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(prog="python -m gemmdrift.caches.serve_launch")
    p.add_argument("--cache-impl")
    p.add_argument("--rollback")
    args = p.parse_args(ours)
    try:
        install(args.cache_impl, args.rollback)
    except GemmdriftError as e:
        print(f"gemmdrift serve_launch: error: {e}", file=sys.stderr)
        return 2
    server = importlib.import_module("mlx_lm.server")
    sys.argv = ["mlx_lm.server", *rest]
    server.main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
