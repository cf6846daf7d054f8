"""What ``gemmdrift upgrade`` runs inside each release's interpreter: ``python -m gemmdrift.upgrade.worker``.

A long-lived process that loads the model once (an mlx-lm directory, cast to the compute dtype) and answers
one JSON request per line on stdin with one JSON line on stdout (mlx-lm's own prints go to stderr):

* ``load``: the model; answers the interpreter's versions.
* ``runs``: on the token stream, one prefill of ``tokens[:split]`` shared by three runs: the teacher-forced
  logits of every position from ``split`` on under ``decode`` (kept, as float32, in ``out``.npz: the other
  release's are compared with them), the same under ``verify:2`` (the envelope: max |Δlogit|, max |Δgap| and
  argmax flips between the two schedules, under this release), and ``gen`` greedy tokens generated from the
  prompt ``tokens[:split + 1]`` (each step's logits kept, for the triage where two releases' streams part).
* ``ladder``: the same decode logits with the weights in float32 (the precision ladder's high rung).
* ``recompute``: every op of a capture (:mod:`gemmdrift.attribution.release_ops`) run again under this release.
* ``speed``: one prefill of ``prefill`` tokens and ``decode`` greedy steps, timed (tokens per second).

It imports only numpy, mlx, mlx-lm and the parts of gemmdrift that need nothing else (the model loader,
:mod:`gemmdrift.model.taps`, :mod:`gemmdrift.metrics` and the release ops' recompute): an environment made for
one mlx release holds nothing more.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import numpy as np

DECODE, VERIFY = "decode", "verify:2"


class Worker:
    def __init__(self):
        self.model = None

    def load(self, req: dict[str, Any]) -> dict[str, Any]:
        import mlx.core as mx
        import mlx_lm
        from pathlib import Path

        from ..model import _load_mlx_dir, cast_model

        if req.get("device"):
            mx.set_default_device(getattr(mx, req["device"]))
        self.model, config = _load_mlx_dir(Path(req["path"]), lazy=True)
        cast_model(self.model, req["dtype"])
        return {"python": sys.version.split()[0], "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
                "model_type": config.get("model_type"), "n_layers": len(self.model.layers),
                "device": str(mx.default_device())}

    def _schedules(self, split: int) -> list[str]:
        step = max(split, 1)
        return [f"prefill:{step},{DECODE}", f"prefill:{step},{VERIFY}"]

    def runs(self, req: dict[str, Any]) -> dict[str, Any]:
        import mlx.core as mx

        from ..files import atomic_path
        from ..model.taps import common_prefix, copy_cache, run_schedule

        tokens, split, gen = [int(t) for t in req["tokens"]], int(req["split"]), int(req["gen"])
        n = len(tokens)
        positions = np.arange(split, n - 1)  # every position with a next token to predict
        sched = self._schedules(split)
        t0 = time.perf_counter()
        prefix = common_prefix(self.model, tokens, sched, split, limit=split)
        prefill_s = time.perf_counter() - t0
        runs = {}
        for s in sched:
            t = run_schedule(self.model, tokens, s, split=split, positions=[n - 1], logit_positions=positions,
                             prefix=prefix)
            runs[s] = t.logits.astype(np.float32)
        dec, ver = runs[sched[0]], runs[sched[1]]
        envelope = schedule_envelope(dec, ver)
        # Greedy from the prompt tokens[:split + 1]: the prefix holds tokens[:split]; its last token is fed first.
        cache = copy_cache(prefix.cache)
        y = tokens[split]
        stream, rows = [], []
        for _ in range(gen):
            out = self.model(mx.array([[y]], dtype=mx.uint32), cache=cache)
            row = np.array(out[0, -1].astype(mx.float32))
            y = int(np.argmax(row))  # the first of tied maxima: the lowest id, as mlx-lm's argmax
            stream.append(y)
            rows.append(row)
        with atomic_path(req["out"] + ".npz") as tmp:
            with open(tmp, "wb") as f:
                np.savez(f, positions=positions, logits=dec, greedy=np.asarray(stream, np.int32),
                         greedy_logits=np.asarray(rows, np.float32).reshape(gen, -1))
        return {"schedules": sched, "envelope": envelope, "greedy": stream, "prefill_seconds": prefill_s,
                "logits_dtype": "float32"}

    def ladder(self, req: dict[str, Any]) -> dict[str, Any]:
        """The float32 rung: the teacher-forced decode logits of the same positions with the weights in float32."""
        from pathlib import Path

        from ..files import atomic_path
        from ..model import _load_mlx_dir, cast_model
        from ..model.taps import common_prefix, run_schedule

        model, _ = _load_mlx_dir(Path(req["path"]), lazy=True)
        cast_model(model, "float32")
        tokens, split = [int(t) for t in req["tokens"]], int(req["split"])
        n = len(tokens)
        sched = self._schedules(split)[0]
        prefix = common_prefix(model, tokens, [sched], split, limit=split)
        t = run_schedule(model, tokens, sched, split=split, positions=[n - 1],
                         logit_positions=np.arange(split, n - 1), prefix=prefix)
        with atomic_path(req["out"] + ".npz") as tmp:
            with open(tmp, "wb") as f:
                np.savez(f, logits=t.logits.astype(np.float32))
        return {"schedule": sched}

    def recompute(self, req: dict[str, Any]) -> dict[str, Any]:
        """Every op of a capture run again under this release (:func:`gemmdrift.attribution.release_ops.recompute`)."""
        from ..attribution.release_ops import recompute

        r = recompute(req["capture"], req["out"])
        return {"calls": len(r["calls"]), "errors": sum(1 for c in r["calls"] if c.get("error"))}

    def speed(self, req: dict[str, Any]) -> dict[str, Any]:
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        tokens, steps = [int(t) for t in req["tokens"]], int(req["decode"])
        cache = make_prompt_cache(self.model)
        t0 = time.perf_counter()
        out = self.model(mx.array([tokens], dtype=mx.uint32), cache=cache)
        y = mx.argmax(out[0, -1])
        mx.eval(y, [c.state for c in cache])
        t1 = time.perf_counter()
        for _ in range(steps):
            out = self.model(y.reshape(1, 1), cache=cache)
            y = mx.argmax(out[0, -1])
            mx.eval(y)
        t2 = time.perf_counter()
        return {"prefill_tok_s": len(tokens) / (t1 - t0), "decode_tok_s": steps / (t2 - t1)}


def schedule_envelope(dec: np.ndarray, ver: np.ndarray) -> dict[str, Any]:
    """decode against verify:2 on the same positions (:func:`gemmdrift.metrics.logit_drift`, summed up by
    :func:`gemmdrift.metrics.envelope_summary`): max |Δlogit|, max |Δgap| (the top-2 gap of decode's top two
    tokens, as the triage envelope), argmax flips and whether every bit agrees."""
    from ..metrics import envelope_summary, logit_drift

    if not len(dec):
        return {"positions": 0, "max_abs_dlogit": 0.0, "envelope": 0.0, "flips": 0, "bit_identical": True}
    s = envelope_summary(logit_drift(dec, ver))
    return {"positions": s["positions"], "max_abs_dlogit": s["max_abs_dlogit"], "envelope": s["max_abs_dgap"],
            "flips": s["flips"], "bit_identical": bool(np.array_equal(dec, ver))}


def main() -> int:
    out = sys.stdout
    sys.stdout = sys.stderr  # anything the libraries print stays off the answers
    w = Worker()
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        try:
            reply = getattr(w, req["cmd"])(req)
        except Exception as e:  # noqa: BLE001 - answered, the caller decides
            reply = {"error": f"{e.__class__.__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:400]}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
