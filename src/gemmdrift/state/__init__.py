"""State exactness: every way mlx-lm rewinds, reuses or reshapes a KV cache, checked bit for bit.

For each case an *operation* (a speculative rollback, a trim, a save/load round
trip, a server prompt-cache reuse, a batch join or leave) runs on a cache, and a
*reference* computes the same tokens from the same starting state without the
operation, with the same blocks, so that an exact implementation gives
bit-identical results. Both sides are then compared:

* the cache contents in temporal order: every entry the next query can still
  attend to (for a ``RotatingKVCache`` the last ``max_size - 1`` entries, read
  through mlx-lm's own ``_temporal_order``), the offset and the class's other
  state fields (``keep``, ``max_size``, ``bits``, ...), right after the
  operation and again after the generator continues;
* the logits of the next position after the continuation.

Verdicts (:class:`gemmdrift.result.Verdict`): **EXACT** (bit-identical);
**ROUNDING** (same structure, the numbers differ, and at float32 the difference
shrinks by at least 100x, the precision ladder of ``gemmdrift stack``; with
``envelope`` given, also max|Δlogit| within it); **STATE BUG** (different
offsets or entries, a difference that does not shrink, or an operation the
library refused while the generator carried on, e.g. ``trim_prompt_cache``
returning 0); **not applicable** (the model has no cache the operation applies
to); **not checked** (a cache class this module does not know, e.g. from a
newer mlx-lm).

Where the code under test lives (mlx-lm 0.32.2, ``site-packages/mlx_lm``):
``models/cache.py`` (the cache classes, ``trim``/``is_trimmable``,
``can_trim_prompt_cache``/``trim_prompt_cache``, ``save_prompt_cache``/
``load_prompt_cache``, ``LRUPromptCache``/``PromptTrie``, ``BatchKVCache``/
``BatchRotatingKVCache`` ``merge``/``extend``/``filter``/``extract``) and
``generate.py`` (``speculative_generate_step``, whose ``_rewind_cache`` calls
``trim_prompt_cache(model_cache, num_draft - num_accept)`` and ignores what it
returns; ``maybe_quantize_kv_cache``, the ``kv_bits`` path).

**Prefix states.** Every case of one model starts from caches filled with the
keys and values of one real prefill of the prompt (all layers ``KVCache``, in
chunks, no LM head), poured into each cache class through its own
``update_and_fetch`` in chunks of ``prefill_step`` (512, what
``speculative_generate_step`` uses), so each class ends in the layout mlx-lm
gives it. ``QuantizedKVCache`` comes from ``maybe_quantize_kv_cache`` (kv_bits 8,
``quantized_kv_start`` 0). The prefill covers the shortest prefix (+16 tokens,
``compute_limit``); longer prefixes repeat the computed keys and values (the
cache's offset, ring position and layout are those of the long prefix, the
content repeats; both sides start from the same state, so the comparison is as
strict as with a computed prefix, at a fraction of the prefill time).

**Same schedule.** A rollback feeds ``[y, d1..dk]`` as one block, rejects the
last ``r`` drafts and continues with a block ``[c, x1, x2]``. Its reference feeds
``[y, d1..dn]`` (n = k - r) as one block and the same continuation block. The
kept rows are then computed in blocks of k+1 and n+1 rows: on a backend whose
kernels are row-invariant (measured for this CPU backend by ``gemmdrift
kernels``) an exact rollback is bit-identical; elsewhere block-size rounding
shows up as ROUNDING, never as a state bug."""

from __future__ import annotations

import importlib

from ..errors import GemmdriftError  # noqa: F401  (callers catch it as state.GemmdriftError)

# What the submodules define, read from here (``state.measure_state``, ``from gemmdrift.state import Setup``).
# Each submodule loads on the first use of one of its names, so that importing a single module of this wing
# (``gemmdrift.state.bench``, which the command line reads on every start) does not load them all.
_FROM = {
    "reading": (
        "LADDER_ROUNDING_SHRINK", "KNOWN_CLASSES", "_NOT_CACHES", "mlx_lm_version", "cache_classes", "Absent",
        "cache_class", "to_numpy", "_live", "read_cache", "_rotating_like", "_ForeignMeta", "_Foreign", "read_caches",
        "Diff", "compare_readings", "merge_diffs", "logit_diff", "judge"
    ),
    "common": (
        "KS", "WHERE", "PREFILL_STEP", "CONTINUATION", "COMPUTE_LIMIT_EXTRA", "KV_BITS", "OPTIONAL_SETUPS",
        "DEFAULT_KS", "DEFAULT_WHERE", "OPERATIONS", "DEFAULT_OPERATIONS", "LastRow", "forward", "head",
        "logit_diffs", "Prefix", "compute_prefix", "fill", "Setup", "_kv_group", "model_setups",
        "prefix_lengths", "window_of", "token_stream", "other_token", "material", "fed_after_rollback"
    ),
    "rollback": ("rollback_side", "rollback_cases"),
    "trim": ("_synthetic_kv", "class_factories", "_feed_direct", "trim_case"),
    "saveload": ("save_load_case",),
    "server_reuse": ("lru_prompt_cache_class", "server_case"),
    "batch": ("batch_vs_alone", "batch_check", "_forward_rows"),
    "sweep": (
        "_row", "_Float32", "_raised", "_progress", "_sweep", "measure_state", "_state_result", "WORKER_GROUPS",
        "_MODEL_OPERATIONS", "_workers", "_sweep_job", "_f32", "NON_EXACT", "figure_name", "_result", "SHORT",
        "short_sweep"
    ),
}
_WHERE = {name: module for module, names in _FROM.items() for name in names}


def __getattr__(name: str):
    """A name of a submodule (loaded now, then kept here), or a submodule itself."""
    module = _WHERE.get(name)
    if module is None:
        if name.startswith("__"):
            raise AttributeError(name)
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_WHERE))
