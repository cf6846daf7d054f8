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

from ..errors import GemmdriftError  # noqa: F401  (callers catch it as state.GemmdriftError)
from .reading import (  # noqa: F401
    LADDER_ROUNDING_SHRINK,
    KNOWN_CLASSES,
    _NOT_CACHES,
    mlx_lm_version,
    cache_classes,
    _Absent,
    _cls,
    _np,
    _live,
    read_cache,
    _rotating_like,
    _ForeignMeta,
    _Foreign,
    read_caches,
    Diff,
    compare_readings,
    merge_diffs,
    logit_diff,
    judge,
)
from .common import (  # noqa: F401
    KS,
    WHERE,
    PREFILL_STEP,
    CONTINUATION,
    COMPUTE_LIMIT_EXTRA,
    KV_BITS,
    OPTIONAL_SETUPS,
    DEFAULT_KS,
    DEFAULT_WHERE,
    OPERATIONS,
    DEFAULT_OPERATIONS,
    _LastRow,
    forward,
    head,
    logit_diffs,
    Prefix,
    compute_prefix,
    fill,
    Setup,
    _kv_group,
    model_setups,
    prefix_lengths,
    _window,
    _stream,
    _alt,
    _material,
    _continuation,
)
from .rollback import (  # noqa: F401
    _rollback_side,
    rollback_cases,
)
from .trim import (  # noqa: F401
    _synthetic_kv,
    class_factories,
    _feed_direct,
    trim_case,
)
from .saveload import (  # noqa: F401
    save_load_case,
)
from .server_reuse import (  # noqa: F401
    lru_prompt_cache_class,
    server_case,
)
from .batch import (  # noqa: F401
    batch_vs_alone,
    batch_check,
    _forward_rows,
)
from .sweep import (  # noqa: F401
    _row,
    _Float32,
    _raised,
    _progress,
    _sweep,
    measure_state,
    _state_result,
    WORKER_GROUPS,
    _MODEL_OPERATIONS,
    _workers,
    _sweep_job,
    _f32,
    NON_EXACT,
    figure_name,
    _result,
    SHORT,
    short_sweep,
)
