"""``gemmdrift upgrade``'s measurement: the user's model under two mlx releases, one interpreter each, and the
class of the change.

On one token stream (default: past position 256 and past the model's sliding window, :func:`default_length`):

1. **the capture** (this interpreter): every op of the last ``CAPTURE_POSITIONS`` positions with its inputs
   (:func:`gemmdrift.attribution.release_ops.capture_ops`), then **recomputed under each release's interpreter**;
   the ops whose output bits differ, in forward order, give the first op that moved;
2. **each release's runs** (:mod:`gemmdrift.upgrade.worker`, one process per release, the model loaded once):
   teacher-forced logits at the compared positions (decode), the same under verify:2 (the envelope and flips
   under that release), greedy tokens from the same prompt; the float32 rung of the logits (the precision
   ladder) where the two releases' logits differ;
3. **the speed**: prefill and decode tokens per second, measured alternately in the two processes
   (``SPEED_ROUNDS`` rounds, medians), and their ratio;
4. **the class**: :func:`gemmdrift.changelog.classify.classify` on the figures of :func:`judge.class_figures`.

The two workers compute side by side (each request sent to both, then both answers read), and the capture runs
in this process while they compute their runs; only the speed rounds take turns.

Every numbered part is a unit saved under ``OUT/.checkpoints/upgrade/`` (named by the digest of everything it
depends on: the model, dtype, stream, sizes and each release's versions and interpreter): a rerun after Ctrl-C
computes only what is missing.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..attribution import release_ops as ro
from ..changelog.classify import CLASSES, classify
from ..errors import GemmdriftError
from . import judge
from .envs import Side

CAPTURE_POSITIONS = 4  # positions of the op capture (the last of the stream)
COMPARED = 64  # positions whose logits are compared (the last of the stream)
GEN = 32  # greedy tokens per release
SPEED_ROUNDS, SPEED_PREFILL, SPEED_DECODE = 3, 128, 16


def default_length(info: Mapping[str, Any]) -> int:
    """The stream length: COMPARED positions past position 256 and past the model's sliding window."""
    return max(257, int(info.get("sliding_window") or 0) + 1) + COMPARED


def split_of(n: int) -> int:
    """The compared positions start here (the last COMPARED, at most half the stream)."""
    return n - min(COMPARED, n // 2)


class Process:
    """One release's worker process (``python -m gemmdrift.upgrade.worker``): one JSON line each way."""

    def __init__(self, side: Side, log: Path):
        env = ro.checkout_env()
        env.setdefault("MLX_ENABLE_TF32", "0")  # the float32 rung is true float32 (asv sets the same)
        log.parent.mkdir(parents=True, exist_ok=True)
        self.side, self.log = side, log
        self._err = open(log, "ab")
        self.pending: list[str] = []
        self.p = subprocess.Popen([side.python, "-m", "gemmdrift.upgrade.worker"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=self._err, text=True, env=env)

    def send(self, cmd: str, **kw: Any) -> None:
        """A request, answered later by :meth:`recv` (requests are answered in order)."""
        try:
            self.p.stdin.write(json.dumps({"cmd": cmd, **kw}) + "\n")
            self.p.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # the worker stopped: recv says why
        self.pending.append(cmd)

    def recv(self) -> dict[str, Any]:
        """The answer to the oldest request not yet answered."""
        cmd = self.pending.pop(0)
        try:
            line = self.p.stdout.readline()
        except OSError:
            line = ""
        if not line:
            self._err.flush()
            tail = [t for t in self.log.read_text(errors="replace").splitlines() if t.strip()][-1:] or ["no message"]
            raise GemmdriftError(f"mlx {self.side.mlx} ({self.side.python}): the worker stopped during {cmd} "
                                 f"({tail[0][:300]})")
        reply = json.loads(line)
        if "error" in reply:
            raise GemmdriftError(f"mlx {self.side.mlx} ({self.side.python}): {cmd} failed: {reply['error']}")
        return reply

    def call(self, cmd: str, **kw: Any) -> dict[str, Any]:
        self.send(cmd, **kw)
        while len(self.pending) > 1:  # earlier requests (the load) first
            self.recv()
        return self.recv()

    def close(self) -> None:
        try:
            self.p.stdin.close()
            self.p.wait(timeout=30)
        except Exception:  # noqa: BLE001 - a worker that does not stop is stopped
            self.p.kill()
        self._err.close()


def _key(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _npz(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def _rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    den = float(np.linalg.norm(a64))
    return float(np.linalg.norm(a64 - b64)) / den if den else 0.0


def measure_upgrade(lm, tokens: Sequence[int], sides: tuple[Side, Side], out: str | Path, *, gen: int = GEN,
                    speed_rounds: int = SPEED_ROUNDS, allow: str = "ROUNDOFF", prompt_label: str = "",
                    log: Callable[[str], None] = print):
    """The ``upgrade`` Result of ``lm`` under the releases of ``sides`` (old, new); see the module docstring."""
    from ..files import write_json
    from ..measure.golden import token_digest

    old, new = sides
    tokens = [int(t) for t in tokens]
    n = len(tokens)
    split = split_of(n)
    if n < 2 * CAPTURE_POSITIONS or split < 1:
        raise GemmdriftError(f"upgrade: the stream needs at least {2 * CAPTURE_POSITIONS} tokens, got {n}")
    path, dtype = lm.info.get("path"), lm.info.get("dtype")
    if not path:
        raise GemmdriftError("upgrade: the model must be on disk (an mlx-lm directory, a GGUF or 'embedded'); "
                             f"{lm.info.get('source')} is not")
    base = {"model": lm.info.get("weights_sha256") or str(path), "dtype": dtype, "tokens": token_digest(tokens),
            "split": split, "gen": gen}
    ck = Path(out) / ".checkpoints" / "upgrade"
    ck.mkdir(parents=True, exist_ok=True)
    seconds: dict[str, float] = {}
    procs: dict[str, Process] = {}

    def proc(side: Side) -> Process:
        if side.label not in procs:  # started, its load requested (answered before its next answer)
            procs[side.label] = Process(side, ck / f"worker-{side.label}.log")
            procs[side.label].send("load", path=str(path), dtype=dtype)
        return procs[side.label]

    def side_by_side(jobs: list[tuple[Side, str, str, dict]], here: Callable[[], Any] | None = None) -> list:
        """Each job (side, unit name, request, arguments) sent to its release's worker at once, so the two
        releases compute in parallel, ``here`` run in this process meanwhile, then every answer read."""
        t0 = time.perf_counter()
        for side, _, cmd, kw in jobs:
            proc(side).send(cmd, **kw)
        if here is not None:
            here()
        out = []
        for side, name, _, _ in jobs:
            p = proc(side)
            while len(p.pending) > 1:
                p.recv()
            out.append(p.recv())
            seconds[name] = round(time.perf_counter() - t0, 2)
        return out

    def timed(name: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        r = fn()
        seconds[name] = round(time.perf_counter() - t0, 2)
        return r

    try:
        # each release's runs in its worker, side by side, while this process captures the ops
        here = ro.this_python()
        cap = ck / f"capture-{_key(base, here, CAPTURE_POSITIONS)}.json"
        run_files = {s.label: ck / f"runs-{s.label}-{_key(base, s.key())}" for s in sides}
        todo = [s for s in sides if _read_json(run_files[s.label].with_suffix(".json")) is None]
        for side in todo:
            log(f"upgrade: mlx {side.mlx}: logits (decode, verify:2) and {gen} greedy tokens")

        def capture() -> None:
            if not cap.is_file():
                log(f"upgrade: capturing every op of positions {n - CAPTURE_POSITIONS}-{n - 1} (mlx {here['mlx']})")
                timed("capture", lambda: ro.capture_ops(lm, tokens, n - CAPTURE_POSITIONS, cap))

        replies = side_by_side([(s, f"runs_{s.label}", "runs", {"tokens": tokens, "split": split, "gen": gen,
                                                                 "out": str(run_files[s.label])}) for s in todo],
                               here=capture)
        for side, reply in zip(todo, replies):
            write_json(run_files[side.label].with_suffix(".json"), reply)
        runs = {s.label: _read_json(run_files[s.label].with_suffix(".json")) for s in sides}
        arrays = {s.label: _npz(run_files[s.label].with_suffix(".npz")) for s in sides}
        # the captured ops recomputed under each release
        outputs, jobs = {}, []
        ops_files = {s.label: ck / f"ops-{s.label}-{_key(cap.name, s.key())}" for s in sides}
        for side in sides:
            if side.how == "this interpreter" and side.python == sys.executable:  # its own outputs were captured
                outputs[side.label] = ro.captured_outputs(*ro._load(cap))
            elif not ops_files[side.label].with_suffix(".json").is_file():
                log(f"upgrade: recomputing the captured ops under mlx {side.mlx}")
                jobs.append((side, f"ops_{side.label}", "recompute",
                             {"capture": str(cap), "out": str(ops_files[side.label])}))
        side_by_side(jobs)
        for side in sides:
            if side.label not in outputs:
                outputs[side.label] = ro._outputs(ops_files[side.label])
        cap_doc = json.loads(cap.read_text())
        ops = ro.compare(cap_doc, outputs[old.label], outputs[new.label])
        la, lb = arrays[old.label]["logits"], arrays[new.label]["logits"]
        positions = arrays[old.label]["positions"]
        logits = judge.logits_stats(tokens, positions, la, lb)
        # the precision ladder, where the logits differ
        ladder: dict[str, Any] = {"verdict": None, "why": "the logits are bit-identical: nothing to judge"}
        if not logits["bit_identical"]:
            if dtype == "float32":
                ladder = {"verdict": None, "why": "the model runs in float32: no higher rung"}
            else:
                rung = {s.label: ck / f"ladder-{s.label}-{_key(base, s.key())}" for s in sides}
                todo = [s for s in sides if _read_json(rung[s.label].with_suffix(".json")) is None]
                for side in todo:
                    log(f"upgrade: mlx {side.mlx}: the float32 rung")
                replies = side_by_side([(s, f"ladder_{s.label}", "ladder", {
                    "path": str(path), "tokens": tokens, "split": split, "out": str(rung[s.label])}) for s in todo])
                for side, reply in zip(todo, replies):
                    write_json(rung[side.label].with_suffix(".json"), reply)
                high = {s.label: _npz(rung[s.label].with_suffix(".npz"))["logits"] for s in sides}
                from ..measure.stack import ladder_verdict

                low_d, high_d = _rel_l2(la, lb), _rel_l2(high[old.label], high[new.label])
                shrink, v = ladder_verdict(low_d, high_d, dtype)
                ladder = {"low": low_d, "high": high_d, "shrink": shrink, "rung": str(v),
                          "verdict": {"rounding": "rounding", "semantic": "semantics"}.get(str(v)),
                          "why": f"rel_l2 of the logits between the releases {low_d:.3g} in {dtype}, {high_d:.3g} "
                                 f"in float32: {v}"}
        # 3. the speed, alternately
        sp = ck / f"speed-{_key(base, old.key(), new.key(), speed_rounds)}.json"
        if _read_json(sp) is None:
            prompt = tokens[:min(SPEED_PREFILL, n)]
            log("upgrade: speed, " + ("one round, the two releases in turn" if speed_rounds == 1 else
                                      f"{speed_rounds} rounds alternating the two releases"))
            for side in sides:  # warm up: the weights read, the kernels built
                proc(side).call("speed", tokens=prompt[:8], decode=2)
            rounds = []
            for _ in range(speed_rounds):
                rounds.append(tuple(proc(side).call("speed", tokens=prompt, decode=SPEED_DECODE) for side in sides))
            write_json(sp, {"rounds": rounds, "prefill": len(prompt), "decode": SPEED_DECODE})
        speed_doc = _read_json(sp)
        speed = judge.speed([tuple(r) for r in speed_doc["rounds"]])
    finally:
        for p in procs.values():
            p.close()
    part = judge.parting(arrays[old.label], arrays[new.label], logits["envelope"])
    f_old = judge.class_figures(runs[old.label], arrays[old.label], 0)
    f_new = judge.class_figures(runs[new.label], arrays[new.label], len(ops["changed"]))
    pc = classify(f_old, f_new, ladder=ladder["verdict"], answer=judge.is_answer)
    return _result(lm, tokens, split, gen, sides, ops, logits, part, runs, arrays, speed, speed_doc, ladder, pc,
                   allow, seconds, prompt_label, cap_doc, judge.by_direction(f_old, f_new))


def _text(lm, ids: Sequence[int]) -> str:
    if lm.tokenizer is None:
        return " ".join(str(int(i)) for i in ids)
    try:
        return lm.tokenizer.decode([int(i) for i in ids])
    except Exception:  # noqa: BLE001 - a tokenizer that cannot decode: the ids
        return " ".join(str(int(i)) for i in ids)


def _result(lm, tokens, split, gen, sides, ops, logits, part, runs, arrays, speed, speed_doc, ladder, pc, allow,
            seconds, prompt_label, cap_doc, by_direction):
    import pandas as pd

    from ..machine.envinfo import environment
    from ..result import Result, figure_name, tidy

    old, new = sides
    first = ops["changed"][0] if ops["changed"] else None
    figures: dict[str, float] = {
        "class": float(CLASSES.index(pc.cls)), "pass": float(pc.at_most(allow)),
        "ops_compared": float(ops["compared"]), "ops_changed": float(len(ops["changed"])),
        "ops_errors": float(len(ops["errors"])),
        "positions": float(logits["positions"]), "kld_mean": logits["kld_mean"], "kld_p99.9": logits["kld_p99.9"],
        "same_top1_share": logits["same_top1_share"], "flips": float(logits["flips"]),
        "max_abs_dlogit": logits["max_abs_dlogit"], "greedy_generated": float(part["generated"]),
    }
    if part["index"] is not None:
        figures["greedy_parts_at"] = float(part["index"])
    if first is not None:
        figures.update({"first_op_layer": float(first["layer"]), "first_op_frac_differ": first["frac_differ"]})
        if np.isfinite(first["max_ulp"]):
            figures["first_op_max_ulp"] = first["max_ulp"]
    for key in ("prefill_tok_s", "decode_tok_s"):
        figures[figure_name(key, "old")] = speed[key]["old"]
        figures[figure_name(key, "new")] = speed[key]["new"]
        figures[figure_name("speed_ratio", key.split("_")[0])] = speed[key]["ratio"]
    for side in sides:
        e = runs[side.label]["envelope"]
        figures[figure_name("decode_verify2", side.label, "envelope")] = e["envelope"]
        figures[figure_name("decode_verify2", side.label, "max_abs_dlogit")] = e["max_abs_dlogit"]
        figures[figure_name("decode_verify2", side.label, "flips")] = float(e["flips"])
    figures = {k: float(v) for k, v in figures.items() if v is not None and np.isfinite(v)}
    pair = f"mlx {old.mlx} -> {new.mlx}"
    env = environment()
    frame = tidy([{"metric": k, "value": v} for k, v in figures.items()], backend=str(env.get("backend") or ""),
                 mlx=f"{old.mlx}->{new.mlx}", model=str(lm.info.get("source")), dtype=str(lm.info.get("dtype")),
                 pair=pair)
    ops_table = pd.DataFrame(ops["changed"], columns=["seq", "layer", "op", "frac_differ", "max_ulp"])
    ga, gb = arrays[old.label]["greedy"], arrays[new.label]["greedy"]
    greedy = pd.DataFrame({"index": np.arange(len(ga)), "old": ga, "new": gb[: len(ga)], "same": ga == gb[: len(ga)]})
    rounds = pd.DataFrame([{"round": i, "release": s.label, "mlx": s.mlx, **r[j]}
                           for i, r in enumerate(speed_doc["rounds"]) for j, s in enumerate(sides)])
    envelopes = pd.DataFrame([{"release": s.label, "mlx": s.mlx, **runs[s.label]["envelope"]} for s in sides])
    n = len(tokens)
    inputs = {"model": lm.info.get("source"), "dtype": lm.info.get("dtype"), "tokens": n, "split": split,
              "compared_positions": f"{split}-{n - 2}", "capture_positions": cap_doc.get("positions"),
              "greedy_prompt": split + 1, "generated": gen, "prompt": prompt_label, "allow": allow,
              "from": old.record(), "to": new.record(), "speed": {"rounds": len(speed_doc["rounds"]),
                                                                   "prefill": speed_doc["prefill"],
                                                                   "decode": speed_doc["decode"]}}
    details = {"class": pc.cls, "reason": pc.reason, "pass": pc.at_most(allow), "allow": allow,
               "changed_figures": len(pc.changed), "compared_figures": pc.compared,
               "first_op": first, "ops": {"compared": ops["compared"], "changed": len(ops["changed"]),
                                          "errors": ops["errors"][:20],
                                          "ops_changed": list(dict.fromkeys(c["op"] for c in ops["changed"]))},
               "logits": logits, "parting": {**part, "text_old": _text(lm, ga), "text_new": _text(lm, gb),
                                             "prompt_tail": _text(lm, tokens[max(0, split - 15): split + 1])},
               "speed": speed, "ladder": ladder, "by_direction": by_direction,
               "envelopes": {s.label: runs[s.label]["envelope"] for s in sides},
               "sides": {"old": old.record(), "new": new.record()}, "seconds": seconds}
    return Result(kind="upgrade", inputs=inputs, env=env, frame=frame, figures=figures,
                  tables={"ops": ops_table, "greedy": greedy, "speed": rounds, "envelopes": envelopes},
                  details=details)
