"""Which op moved between two mlx releases: every op's inputs captured once, every op recomputed under each release.

Issue 29 item 4, the release axis. Under this interpreter the model runs once (a prompt prefilled, then one
block of positions captured); every op of every decoder layer records its inputs, its parameters and its
output as it runs:

* every leaf module of a layer, named by its module path as the op taps name it (``self_attn.q_proj``,
  ``self_attn.k_norm``, ``self_attn.rope``, ``mlp.down_proj``, ``input_layernorm``, ...): linears, quantized
  linears, norms and RoPE; the class is recorded by its import path with its scalar attributes and arrays,
  so another interpreter rebuilds the same module with *its* mlx-lm and runs it with *its* mlx;
* the attention core (``sdpa``: ``scaled_dot_product_attention`` as the model's module calls it; its cache
  argument is passed as None when recomputed: the keys and values it was given are captured).

The capture is one ``.npz`` (arrays as raw bits) and one ``.json`` (the calls in forward order), both written
atomically. Arrays are copied when captured: a KV cache writes its buffers in place, and the keys an sdpa call
saw would otherwise be overwritten by the next step. Then ``python -m gemmdrift.attribution.release_ops recompute FILE``
runs under another interpreter (``--python PATH``: another venv, or one of asv's under ``.asv/env/``) and writes
every op's output; :func:`compare` names the ops whose output bits differ, in forward order, with the share of
elements that differ and the largest ULP distance. The other interpreter is probed first (is it Python, does
it import mlx, which mlx and mlx-lm) before any model loads.

* the model's own ops around the layers: the embedding lookup (``embed_tokens``, layer -1), the final norm
  (``norm``) and the LM head (``lm_head``, or the tied embedding's ``as_linear``; both layer ``n_layers``, as
  the op taps number them).

An array given to several calls (the weight a tied embedding shares with the LM head, the normed hidden state
q, k and v all read) is stored once, by the digest of its bits.

This module imports only numpy, mlx and the standard library at the top (the other interpreter needs nothing
else of gemmdrift's dependencies).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..errors import GemmdriftError

FORMAT = 1
SDPA = "sdpa"
SDPA_NAME = "scaled_dot_product_attention"
FINAL_NORM, LM_HEAD = "norm", "lm_head"  # the op taps' names (gemmdrift.model.optaps)
_BITS = {"bfloat16": "uint16", "float16": "uint16", "float32": "uint32"}
_PROBE = ("import json, sys\ntry:\n import mlx.core as mx\nexcept Exception as e:\n print(json.dumps({'error': "
          "f'{e.__class__.__name__}: {e}'})); sys.exit(0)\ntry:\n import mlx_lm; lm = mlx_lm.__version__\nexcept "
          "Exception:\n lm = None\nprint(json.dumps({'python': sys.version.split()[0], 'mlx': mx.__version__, "
          "'mlx_lm': lm}))\n")
SRC = Path(__file__).resolve().parents[2]  # the directory holding the gemmdrift package


# ------------------------------------------------------------------ the other interpreter


def probe_python(path: str, flag: str = "--python") -> dict[str, Any]:
    """{python, mlx, mlx_lm} of the interpreter at ``path``; a one-line GemmdriftError naming ``flag`` when it is
    not a Python that imports mlx and mlx-lm (:func:`gemmdrift.machine.interpreter.probe`)."""
    from ..machine.interpreter import probe

    return probe(path, _PROBE, flag=flag, timeout=120, no_lm="it rebuilds the modules")


def this_python() -> dict[str, Any]:
    import mlx.core as mx

    try:
        import mlx_lm

        lm = mlx_lm.__version__
    except ImportError:
        lm = None
    return {"python": sys.version.split()[0], "mlx": mx.__version__, "mlx_lm": lm, "path": sys.executable}


# ------------------------------------------------------------------ arrays as bits


def to_bits(a) -> tuple[np.ndarray, str]:
    """A copy of an mlx array as numpy (floats as their raw bits: numpy has no bfloat16) and its dtype name."""
    import mlx.core as mx

    name = str(a.dtype).rpartition(".")[2]
    if name in _BITS:
        a = a.view(getattr(mx, _BITS[name]))
    return np.array(a, copy=True), name


def from_bits(x: np.ndarray, dtype: str):
    import mlx.core as mx

    a = mx.array(x)
    return a.view(getattr(mx, dtype)) if dtype in _BITS else a


def ulp_distance(a: np.ndarray, b: np.ndarray, dtype: str) -> np.ndarray:
    """|a - b| in units in the last place, from the raw bits (ordered as sign-magnitude integers)."""
    if dtype not in _BITS:
        return (a != b).astype(np.int64)
    width = 16 if _BITS[dtype] == "uint16" else 32
    sign = np.int64(1) << (width - 1)

    def ordered(x):
        x = x.astype(np.int64)
        return np.where(x & sign, -(x & (sign - 1)), x)

    return np.abs(ordered(a) - ordered(b))


# ------------------------------------------------------------------ capture


class Capture:
    """The calls recorded in forward order: JSON records and their arrays (keys ``c<i>.<role>``)."""

    def __init__(self):
        self.calls: list[dict[str, Any]] = []
        self.arrays: dict[str, np.ndarray] = {}
        self._stored: dict[tuple, str] = {}  # (dtype, shape, digest of the bits) -> the key they are stored under

    def _put(self, key: str, a) -> dict[str, Any]:
        import hashlib

        bits, dtype = to_bits(a)
        # By content, not by object: mlx's in-place operators (h *= scale) overwrite an array object that an
        # earlier call already returned, so one object can hold two values in one forward pass.
        seen = (dtype, bits.shape, hashlib.blake2b(bits.tobytes(), digest_size=16).digest())
        if seen not in self._stored:
            self.arrays[key] = bits
            self._stored[seen] = key
        return {"array": self._stored[seen], "dtype": dtype}

    def value(self, i: int, role: str, v) -> Any:
        import mlx.core as mx

        if isinstance(v, mx.array):
            return self._put(f"c{i}.{role}", v)
        if v is None or isinstance(v, (bool, int, float, str)):
            return {"value": v}
        raise TypeError(f"cannot capture a {type(v).__name__} argument")

    def record(self, op: str, layer: int, target: dict[str, Any], args: Sequence[Any], kwargs: dict[str, Any],
               out) -> None:
        i = len(self.calls)
        rec = {"seq": i, "op": op, "layer": layer, **target,
               "args": [self.value(i, f"a{j}", a) for j, a in enumerate(args)],
               "kwargs": {k: self.value(i, f"k.{k}", v) for k, v in kwargs.items()},
               "out": self._put(f"c{i}.out", out)}
        self.calls.append(rec)


def _module_target(cap: Capture, module, key: str) -> dict[str, Any]:
    import mlx.core as mx

    cls = type(module)
    attrs = {k: v for k, v in vars(module).items() if isinstance(v, (bool, int, float, str)) or v is None}
    arrays = {k: cap._put(f"{key}.p.{k}", v) for k, v in module.items() if isinstance(v, mx.array)}
    return {"kind": "module", "class": f"{cls.__module__}:{cls.__qualname__}", "attrs": attrs, "params": arrays}


class _OpProxy:
    """A leaf module's stand-in: runs it, records inputs, parameters and output (copied)."""

    def __init__(self, module, layer: int, name: str, cap: Capture):
        self.module, self.layer, self.name, self.cap = module, layer, name, cap

    def __getattr__(self, item):
        return getattr(self.module, item)

    def __call__(self, *args, **kwargs):
        import mlx.core as mx

        out = self.module(*args, **kwargs)
        mx.eval(out)
        target = _module_target(self.cap, self.module, f"c{len(self.cap.calls)}")
        self.cap.record(self.name, self.layer, target, args, kwargs, out)
        return out


class _TiedEmbeddingProxy(_OpProxy):
    """A tied embedding: its lookups are the op ``embed_tokens`` (layer -1), its ``as_linear`` the LM head."""

    def __init__(self, module, n_layers: int, cap: Capture):
        super().__init__(module, -1, "embed_tokens", cap)
        self.n_layers = n_layers

    def as_linear(self, x):
        import mlx.core as mx

        out = self.module.as_linear(x)
        mx.eval(out)
        target = {**_module_target(self.cap, self.module, f"c{len(self.cap.calls)}"), "method": "as_linear"}
        self.cap.record(LM_HEAD, self.n_layers, target, (x,), {}, out)
        return out


def _model_slots(lm, cap: Capture) -> list[tuple[Any, str, Any]]:
    """The slots of the ops outside the decoder layers: the final norm, the LM head and the embedding, found
    where the op taps find them (:func:`gemmdrift.model.optaps.sites`)."""
    from ..model import optaps

    n = lm.n_layers
    norm, head = [s for s in optaps.sites(lm.model) if s.layer == n]
    slots = [(norm.container, norm.key, _OpProxy(norm.container[norm.key], n, FINAL_NORM, cap))]
    owner, _ = optaps.find_final_norm(lm.model)  # the inner model: it holds embed_tokens
    if head.key == "embed_tokens":  # tied: the embedding is the head
        slots.append((head.container, head.key, _TiedEmbeddingProxy(head.container[head.key], n, cap)))
    else:
        slots.append((head.container, head.key, _OpProxy(head.container[head.key], n, LM_HEAD, cap)))
        if "embed_tokens" in owner:
            slots.append((owner, "embed_tokens", _OpProxy(owner["embed_tokens"], -1, "embed_tokens", cap)))
    return slots


def leaf_ops(layer) -> list[tuple[str, Any]]:
    """(module path, module) of every leaf module of a decoder layer (one with no submodule), in the layer's
    own order."""
    named = [(n, m) for n, m in layer.named_modules() if n]
    names = [n for n, _ in named]
    return [(n, m) for n, m in named if not any(o.startswith(n + ".") for o in names)]


def capture_ops(lm, tokens: Sequence[int], split: int, path: str | Path, layers: Sequence[int] | None = None,
                ) -> dict[str, Any]:
    """Run ``tokens[:split]`` as a prompt, then ``tokens[split:]`` as one block with every op captured; write
    ``path`` (``.json``) and its ``.npz`` atomically. Returns the JSON document."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from ..files import atomic_path, write_json
    from ..model.taps import swapped

    if not 0 < split < len(tokens):
        raise GemmdriftError(f"release ops: need 0 < split < tokens, got split {split} of {len(tokens)} tokens")
    model = lm.model
    wanted = set(range(lm.n_layers)) if layers is None else set(layers)
    bad = sorted(i for i in wanted if not 0 <= i < lm.n_layers)
    if bad:
        raise GemmdriftError(f"release ops: no layer {bad[0]} (the model has {lm.n_layers})")
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([list(tokens[:split])]), cache=cache))
    cap = Capture()
    slots = []
    for i, layer in enumerate(lm.layers):
        if i not in wanted:
            continue
        for name, mod in leaf_ops(layer):
            parent_name, _, attr = name.rpartition(".")
            parent = layer
            for part in parent_name.split(".") if parent_name else []:
                parent = parent[part]
            slots.append((parent, attr, _OpProxy(mod, i, name, cap)))
    attn_modules = {sys.modules[type(layer.self_attn).__module__] for layer in lm.layers
                    if hasattr(layer, "self_attn")}
    counter = {"layer": -1}
    order = sorted(wanted)
    for m in attn_modules:
        if hasattr(m, SDPA_NAME):
            slots.append((vars(m), SDPA_NAME, _sdpa_proxy(getattr(m, SDPA_NAME), cap, counter, order)))
    slots += _model_slots(lm, cap)
    with swapped(slots):
        mx.eval(model(mx.array([list(tokens[split:])]), cache=cache))
    doc = {"format": FORMAT, "captured_under": this_python(), "model": lm.info.get("source", "?"),
           "dtype": lm.info.get("dtype"), "positions": f"{split}-{len(tokens) - 1}", "tokens": [int(t) for t in tokens],
           "layers": order, "asked_layers": None if layers is None else sorted(set(layers)),
           "calls": cap.calls}
    path = Path(path)
    with atomic_path(path.with_suffix(".npz")) as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, **cap.arrays)
    write_json(path.with_suffix(".json"), doc)
    return doc


def _sdpa_proxy(fn, cap: Capture, counter: dict, order: Sequence[int]):
    def sdpa(queries, keys, values, cache=None, scale=1.0, mask=None, **kw):
        import mlx.core as mx

        if hasattr(cache, "bits"):
            raise GemmdriftError("release ops: a quantized KV cache's attention is not recomputed (use a plain cache)")
        out = fn(queries, keys, values, cache=cache, scale=scale, mask=mask, **kw)
        mx.eval(out)
        counter["layer"] += 1
        layer = order[counter["layer"]] if counter["layer"] < len(order) else counter["layer"]
        target = {"kind": "function", "function": f"{fn.__module__}:{fn.__qualname__}"}
        cap.record(SDPA, layer, target, (queries, keys, values), {"cache": None, "scale": scale, "mask": mask, **kw},
                   out)
        return out

    return sdpa


# ------------------------------------------------------------------ recompute (any interpreter)


def _load(path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    json_path, npz_path = path.with_suffix(".json"), path.with_suffix(".npz")
    try:
        doc = json.loads(json_path.read_text())
        with np.load(npz_path) as z:
            arrays = {k: z[k] for k in z.files}
        doc["calls"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise GemmdriftError(f"cannot read the captured ops {json_path} / {npz_path.name}: {e}") from None
    return doc, arrays


def _arg(v: dict[str, Any], arrays: dict[str, np.ndarray]):
    return from_bits(arrays[v["array"]], v["dtype"]) if "array" in v else v["value"]


def _import(text: str):
    mod, _, name = text.partition(":")
    obj = importlib.import_module(mod)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def rebuild(rec: dict[str, Any], arrays: dict[str, np.ndarray]):
    """The callable of one captured call, rebuilt with this interpreter's mlx and mlx-lm."""
    import mlx.nn as nn

    if rec["kind"] == "function":
        return _import(rec["function"])
    cls = _import(rec["class"])
    obj = cls.__new__(cls)
    nn.Module.__init__(obj)
    for k, v in rec["attrs"].items():
        object.__setattr__(obj, k, v)
    for k, v in rec["params"].items():
        obj[k] = _arg(v, arrays)
    return getattr(obj, rec["method"]) if rec.get("method") else obj  # method: a tied embedding's as_linear


def recompute(path: str | Path, out: str | Path) -> dict[str, Any]:
    """Every captured call run again here; outputs to ``out`` (``.npz`` of bits and ``.json``: the interpreter,
    and per call its dtype or the error that stopped it)."""
    import mlx.core as mx

    from ..files import atomic_path, write_json

    doc, arrays = _load(Path(path))
    outs: dict[str, np.ndarray] = {}
    calls = []
    for rec in doc["calls"]:
        entry: dict[str, Any] = {"seq": rec["seq"]}
        try:
            fn = rebuild(rec, arrays)
            args = [_arg(a, arrays) for a in rec["args"]]
            kwargs = {k: _arg(v, arrays) for k, v in rec["kwargs"].items()}
            y = fn(*args, **kwargs)
            mx.eval(y)
            outs[f"c{rec['seq']}"], entry["dtype"] = to_bits(y)
        except Exception as e:  # noqa: BLE001 - an op this release cannot run is reported, not fatal
            entry["error"] = f"{e.__class__.__name__}: {e}"[:300]
        calls.append(entry)
    out = Path(out)
    with atomic_path(out.with_suffix(".npz")) as tmp:
        with open(tmp, "wb") as f:
            np.savez(f, **outs)
    result = {"format": FORMAT, "recomputed_under": this_python(), "calls": calls}
    write_json(out.with_suffix(".json"), result)
    return result


def checkout_env() -> dict[str, str]:
    """This process's environment with this checkout first on ``PYTHONPATH``: another interpreter started with it
    imports this gemmdrift (``recompute_in``, the upgrade's workers)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    return env


def recompute_in(python: str, capture: Path, out: Path) -> dict[str, Any]:
    """:func:`recompute` in another interpreter (a subprocess that imports this package from this checkout)."""
    env = checkout_env()
    r = subprocess.run([python, "-m", "gemmdrift.attribution.release_ops", "recompute", str(capture), str(out)],
                       capture_output=True, text=True, env=env)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["no message"])[-1]
        raise GemmdriftError(f"--python {python}: recomputing the ops failed ({last})")
    return json.loads(out.with_suffix(".json").read_text())


# ------------------------------------------------------------------ compare


def _outputs(path: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    meta = json.loads(path.with_suffix(".json").read_text())
    with np.load(path.with_suffix(".npz")) as z:
        return meta, {k: z[k] for k in z.files}


def compare(capture: dict[str, Any], a: tuple[dict, dict[str, np.ndarray]], b: tuple[dict, dict[str, np.ndarray]],
            ) -> dict[str, Any]:
    """The ops whose outputs differ between two sets of outputs of the same captured calls, in forward order.

    ``a`` and ``b``: (meta, arrays) with arrays ``c<seq>``; meta ``calls`` may carry an ``error``. Returns
    ``compared`` (calls both ran), ``changed`` (op, layer, seq, frac_differ, max_ulp), ``errors``."""
    (ma, xa), (mb, xb) = a, b
    err_a = {c["seq"]: c.get("error") for c in ma.get("calls", [])}
    err_b = {c["seq"]: c.get("error") for c in mb.get("calls", [])}
    changed, errors, compared = [], [], 0
    for rec in capture["calls"]:
        s, key = rec["seq"], f"c{rec['seq']}"
        why = err_a.get(s) or err_b.get(s)
        if why or key not in xa or key not in xb:
            errors.append({"op": rec["op"], "layer": rec["layer"], "error": why or "no output"})
            continue
        compared += 1
        u, v = xa[key], xb[key]
        if u.shape != v.shape:
            changed.append({"op": rec["op"], "layer": rec["layer"], "seq": s, "frac_differ": 1.0,
                            "max_ulp": float("inf"), "note": f"shape {u.shape} vs {v.shape}"})
            continue
        differ = u != v
        if differ.any():
            dist = ulp_distance(u, v, rec["out"]["dtype"])
            changed.append({"op": rec["op"], "layer": rec["layer"], "seq": s, "frac_differ": float(differ.mean()),
                            "max_ulp": float(dist.max())})
    return {"compared": compared, "changed": changed, "errors": errors}


def captured_outputs(capture: dict[str, Any], arrays: dict[str, np.ndarray]) -> tuple[dict, dict[str, np.ndarray]]:
    """The outputs the capturing run itself produced, as (meta, arrays) for :func:`compare`."""
    return ({"calls": []}, {f"c{r['seq']}": arrays[r["out"]["array"]] for r in capture["calls"]})


def release_comparison(capture_path: Path, python_b: str, python_a: str | None = None,
                       work: Path | None = None) -> dict[str, Any]:
    """Every captured op recomputed under ``python_b`` (and under ``python_a``, default: the capture's own
    outputs), compared; the document the changelog reads (``from``, ``to``, ``changed`` ...)."""
    doc, arrays = _load(capture_path)
    work = work or capture_path.parent
    info_b = probe_python(python_b)
    recompute_in(python_b, capture_path, work / "outputs-b")
    b = _outputs(work / "outputs-b")
    if python_a:
        info_a = probe_python(python_a)
        recompute_in(python_a, capture_path, work / "outputs-a")
        a = _outputs(work / "outputs-a")
    else:
        info_a, a = doc["captured_under"], captured_outputs(doc, arrays)
    result = compare(doc, a, b)
    import platform

    return {"format": FORMAT, "from": {k: info_a.get(k) for k in ("mlx", "mlx_lm", "python")},
            "to": {k: info_b.get(k) for k in ("mlx", "mlx_lm", "python")},
            "machine": f"{platform.system()} {platform.machine()} CPU", "model": doc["model"],
            "positions": doc["positions"], "layers": doc["layers"],
            "ops": list(dict.fromkeys(r["op"] for r in doc["calls"])), **result}


# ------------------------------------------------------------------ command line


def add_arguments(parser) -> None:
    """``--python`` and friends, for ``gemmdrift attribute`` (or this module's own ``compare``)."""
    g = parser.add_argument_group("release comparison (issue 29 item 4)")
    g.add_argument("--python", metavar="PATH", help="recompute every op from captured inputs under this "
                                                    "interpreter (another mlx release) and compare bits")
    g.add_argument("--baseline-python", metavar="PATH",
                   help="recompute under this interpreter too and compare the two (default: this interpreter's "
                        "own outputs)")
    g.add_argument("--release-tokens", type=int, default=304,
                   help="stream length; the last block is captured (default 304: positions past 256)")
    g.add_argument("--release-split", type=int, default=300, help="prompt length before the captured block")
    g.add_argument("--release-layers", help="decoder layers to capture, e.g. 0-5 (default all)")
    g.add_argument("--release-out", metavar="FILE", help="the comparison JSON (default <out>/release_ops.json)")
    g.add_argument("--release-capture", metavar="FILE",
                   help="reuse this capture (a capture.json written before) instead of running the model again")


def parse_layers(text: str | None) -> list[int] | None:
    """``--release-layers``: a layer list such as ``0-5`` or ``0,3,17`` (None: every layer)."""
    from ..ranges import parse_ints

    return parse_ints(text, "--release-layers") if text is not None else None


def _precheck(args) -> tuple[Path, Path, list[int] | None]:
    """What the release mode can judge before the model loads (the embedded model's config is known): the
    outputs, the stream, the layers. Returns (the --out directory, the comparison file, the layers)."""
    from ..checks import check_out_dir, check_out_file, check_release_stream

    base = check_out_dir(getattr(args, "out", None) or "results/attribute")
    out = check_out_file(args.release_out, "--release-out") if args.release_out else base / "release_ops.json"
    layers = parse_layers(args.release_layers)
    if (getattr(args, "model", None) or "embedded") == "embedded":
        from ..model import SHAPES

        c = SHAPES["gemma3-270m"]
        check_release_stream(args.release_tokens, args.release_split, layers, c["num_hidden_layers"],
                             c["max_position_embeddings"])
    else:
        check_release_stream(args.release_tokens, args.release_split)
    return base, out, layers


def reusable(capture: Path, model: str, dtype: str, n: int, split: int, layers: list[int] | None) -> bool:
    """Whether a finished capture (its .json is written last) is the one this run would make: the same model,
    dtype, positions and layers asked, captured under this interpreter."""
    try:
        doc = json.loads(capture.with_suffix(".json").read_text())
    except (OSError, ValueError):
        return False
    here, under = this_python(), doc.get("captured_under") or {}
    return (capture.with_suffix(".npz").is_file() and (doc.get("model"), doc.get("dtype"), doc.get("positions"),
            doc.get("asked_layers", "?"), under.get("path"), under.get("mlx")) == (model, dtype, f"{split}-{n - 1}",
                                                                                 layers, here["path"], here["mlx"]))


def run(args, cli: Any = None) -> int | None:
    """Run the release comparison when ``--python`` was given (None otherwise: another mode's turn). ``cli``: the
    CLI module, as ``gemmdrift attribute``'s MODES pass it (not needed here)."""
    if not getattr(args, "python", None):
        return None
    base, out, layers = _precheck(args)
    info_b = probe_python(args.python)  # before any model loads
    if args.baseline_python:
        probe_python(args.baseline_python, "--baseline-python")
    from ..files import to_json, write_json
    from ..model import load_model
    from ..prompts import builtin_stream

    work = base / "release_ops"  # the capture and the recomputed outputs (large: the layers' weights)
    capture = Path(args.release_capture) if args.release_capture else work / "capture.json"
    model, dtype = getattr(args, "model", None) or "embedded", getattr(args, "dtype", None) or "bfloat16"
    n, split = int(args.release_tokens), int(args.release_split)
    if args.release_capture:
        _load(capture)  # a missing or corrupt capture: one line, before anything runs
    elif reusable(capture, model, dtype, n, split, layers):
        print(f"gemmdrift attribute: reusing the capture in {capture} (same model, positions, layers and "
              "interpreter; delete it to capture again)", file=sys.stderr)
    else:
        from ..checks import check_release_stream
        from ..machine.envinfo import select_device

        select_device(getattr(args, "device", None))
        lm = load_model(model, dtype=dtype)
        check_release_stream(n, split, layers, lm.n_layers, lm.description.max_positions)  # before the stream
        work.mkdir(parents=True, exist_ok=True)
        print(f"gemmdrift attribute: capturing every op of positions {split}-{n - 1} into {capture}", file=sys.stderr)
        capture_ops(lm, builtin_stream(lm, n), split, capture, layers)
    work.mkdir(parents=True, exist_ok=True)
    print(f"gemmdrift attribute: recomputing every captured op under {args.python}", file=sys.stderr)
    doc = release_comparison(capture, args.python, args.baseline_python, work)
    write_json(out, doc)
    names = list(dict.fromkeys(c["op"] for c in doc["changed"]))
    if getattr(args, "json", False):
        return print(to_json({"kind": "release_ops", **{k: doc[k] for k in ("from", "to", "compared", "changed",
                     "errors")}, "changed_ops": names, "capture": str(capture), "written": str(out)})) or 0
    print(f"mlx {doc['from']['mlx']} vs mlx {info_b['mlx']}: {doc['compared']} op calls compared, "
          + (f"outputs differ in (forward order): {', '.join(names)}" if names else "every output bit-identical")
          + (f"; {len(doc['errors'])} could not run" if doc["errors"] else "") + f"\nwritten to {out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gemmdrift.attribution.release_ops")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("recompute", help="every captured op run again under this interpreter")
    s.add_argument("capture")
    s.add_argument("out")
    s = sub.add_parser("compare", help="capture here, recompute under --python, compare bits")
    add_arguments(s)
    s.add_argument("--model", default="embedded")
    s.add_argument("--out", default="results/attribute")
    args = p.parse_args(argv)
    try:
        if args.cmd == "recompute":
            recompute(args.capture, args.out)
            return 0
        if not args.python:
            raise GemmdriftError("compare needs --python PATH")
        return int(run(args) or 0)
    except GemmdriftError as e:
        print(f"gemmdrift: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
