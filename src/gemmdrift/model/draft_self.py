"""``--draft self:N``: the target truncated to its first N decoder layers, as an mlx-lm directory.

For Gemma 3 (a full-attention layer every 6) N is at least 6: mlx-lm's gemma3_text takes its global mask
from the cache of layer 5.

A **test instrument, not a real draft model**: the first N layers, the target's final norm and
its tied embedding as the LM head, nothing retrained. It is cheap on this CPU (N/L of the
target's layer compute) and disagrees with the target often, so speculative decoding rejects
drafts, and rolls the caches back, at almost every step -- what the server check past the
sliding window needs (a bf16 or 4-bit copy of the target almost never disagrees, so its
rollback never runs). Written once per (checkpoint, N) under the cache directory, like the
converted checkpoint: a temporary directory renamed into place, so an interrupted write
leaves nothing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from ..errors import GemmdriftError

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def parse_self(spec: str) -> int | None:
    """'self:3' -> 3; anything else -> None (not a self draft). A malformed 'self:' spec is an error."""
    if not isinstance(spec, str) or not spec.startswith("self:"):
        return None
    text = spec[5:]
    if not text.isdigit() or int(text) < 1:
        raise GemmdriftError(f"--draft {spec}: expected self:N with N a positive number of layers (e.g. self:6)")
    return int(text)


def self_draft(model_dir: str | os.PathLike, n_layers: int) -> Path:
    """The mlx-lm directory of ``model_dir`` cut to its first ``n_layers`` layers (made once, cached)."""
    import mlx.core as mx

    from ..files import cache_dir

    src = Path(model_dir).resolve()
    try:
        config = json.loads((src / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise GemmdriftError(f"cannot read {src / 'config.json'}: {e}") from None
    total = int(config.get("num_hidden_layers", 0))
    pattern = int(config.get("sliding_window_pattern") or 1)
    lowest = max(1, min(pattern, total - 1))  # the same range in both refusals (D17)
    if not 1 <= n_layers < total:
        raise GemmdriftError(f"--draft self:{n_layers}: the target has {total} layers (choose {lowest}..{total - 1})")
    if n_layers < pattern:  # gemma3_text reads its global mask from cache[pattern - 1]: one global layer at least
        raise GemmdriftError(f"--draft self:{n_layers}: this architecture needs at least one full-attention layer, "
                             f"the first is layer {pattern - 1} (choose {pattern}..{total - 1})")
    target = cache_dir() / "drafts" / f"{src.name}-self{n_layers}"
    if (target / "config.json").exists():
        return target
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise GemmdriftError(f"no .safetensors weights in {src}")
    kept = {}
    for f in files:
        for name, w in mx.load(str(f)).items():
            m = _LAYER.match(name)
            if m is None or int(m.group(1)) < n_layers:
                kept[name] = w
    if "lm_head.weight" not in kept and not any(k.endswith("embed_tokens.weight") for k in kept):
        raise GemmdriftError(f"{src}: no embedding or LM head found to keep")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    mx.save_safetensors(str(tmp / "model.safetensors"), kept, {"format": "mlx"})
    config = dict(config, num_hidden_layers=n_layers)
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][:n_layers]
    (tmp / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    for p in src.iterdir():  # the tokenizer and its files
        if p.is_file() and not p.name.endswith(".safetensors") and p.name not in ("config.json",) and \
                not p.name.endswith(".index.json"):
            shutil.copy(p, tmp / p.name)
    (tmp / "gemmdrift_draft.json").write_text(json.dumps(
        {"target": str(src), "layers": n_layers, "note": "test instrument: the target's first layers, final norm "
         "and tied head; not a trained draft"}, indent=2), encoding="utf-8")
    os.replace(tmp, target)
    return target
