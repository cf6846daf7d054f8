"""The half of the GPU check that runs on the GPU machine (or, with --no-install, on any machine).

    python3 scripts/gpu_check/run.py --call N [--wait SECONDS]               # on the GPU machine, call N
    python scripts/gpu_check/run.py --no-install --device cpu --sizes small \
        --model embedded --work DIR --out DIR --foreground                     # here (tests/test_gpu_check.py)

Each call: take in call N's pieces (``.gpu-pack/callN``, checked against the manifest) and install every
artifact that is complete (install.py); start the steps (steps.py) in a process of its own session, which
outlives the call on a warm machine, unless it runs already; wait up to ``--wait`` seconds; copy what is
finished into ``$OUT``. Steps that need the weights wait for the GGUF, which the last calls bring. Every finished
step is in ``WORK/result.json`` as it finishes, and a rerun skips it: an interrupted run keeps every finished step.

What comes back in ``$OUT`` (at most 8 files): ``result.json`` (every step: status, seconds, its commands, the
answer), ``steps.tar.gz`` (each command's output directory, JSON and log), ``runner.log``, ``install.json``.
A missing CUDA driver or device is one line in result.json (``device.error``), never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
import install  # noqa: E402
import plan  # noqa: E402

RESULT = "result.json"
KEEP_BYTES = 4 * plan.MIB  # a file larger than this stays out of steps.tar.gz (listed in result.json)
BUNDLE_BYTES = 15 * plan.MIB
WEIGHTS_WAIT = 900  # seconds the steps wait for the GGUF before giving up on the steps that need it


def write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def one_line(text: str) -> str:
    lines = [ln.strip() for ln in (text or "").strip().splitlines() if ln.strip()]
    return lines[-1][:400] if lines else ""


# ----------------------------------------------------------------------------------------------- the steps


def probe_device(ctx) -> dict:
    """Can mlx compute on the device asked for? One line when not (no driver, no device, no CUDA backend)."""
    if ctx.device == "cpu":
        return {"ok": True, "device": "cpu"}
    code = ("import mlx.core as mx\n"
            "assert hasattr(mx, 'cuda') and mx.cuda.is_available(), 'mlx sees no CUDA device (mx.cuda.is_available() "
            "is False)'\n"
            "mx.set_default_device(mx.gpu); x = mx.ones((4, 4)); mx.eval(x @ x)\n"
            "print(mx.device_info(mx.gpu))")
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ctx.env, timeout=120)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": "the device probe did not finish in 120 s"}
    if done.returncode:
        return {"ok": False, "error": one_line(done.stderr) or f"exit {done.returncode}"}
    record = {"ok": True, "device_info": one_line(done.stdout)}
    if shutil.which("nvidia-smi"):  # the card, the driver and its CUDA version, as the machine reports them
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,compute_cap",
                              "--format=csv,noheader"], capture_output=True, text=True)
        record["nvidia_smi"] = one_line(smi.stdout) or one_line(smi.stderr)
    return record


def weights_ready(ctx) -> bool:
    if ctx.no_install:
        return True
    state = ctx.work / "installed.json"
    try:
        installed = json.loads(state.read_text())
    except (OSError, ValueError):
        return False
    return any(str(v).endswith(".gguf") for v in installed.values())


def run_command(cmd, ctx, deadline: float, folder: Path) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    log = folder / f"{cmd.label}.log"
    left = deadline - time.monotonic()
    rec = {"label": cmd.label, "command": " ".join(cmd.argv[1:]).replace(str(ctx.work), "$WORK")}
    if left <= 1:
        return {**rec, "status": "timeout", "seconds": 0.0, "error": "no time left in the step's budget"}
    t0 = time.monotonic()
    with open(log, "w") as err:
        try:
            done = subprocess.run(cmd.argv, stdout=subprocess.PIPE, stderr=err, text=True, env=ctx.env, timeout=left,
                                  cwd=str(ctx.repo))
            rc, stdout = done.returncode, done.stdout
        except subprocess.TimeoutExpired as e:
            rc, stdout = None, (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
    rec["seconds"] = round(time.monotonic() - t0, 2)
    (folder / f"{cmd.label}.stdout").write_text(stdout or "")
    rec["status"] = "timeout" if rc is None else ("done" if rc == 0 else "failed")
    rec["rc"] = rc
    if rc not in (0, None):
        rec["error"] = one_line(log.read_text(errors="replace")) or f"exit {rc}"
    data = None
    try:
        if cmd.json_out is not None and cmd.json_out.is_file():
            data = json.loads(cmd.json_out.read_text())
        elif cmd.stdout_json and rc == 0:
            data = json.loads(stdout)
    except ValueError as e:
        rec["error"] = f"its JSON does not parse: {e}"
    if isinstance(data, dict):
        import steps

        rec["answer"] = steps.answer(ctx.step_name, data)
    return rec


def run_steps(ctx) -> dict:
    import steps

    result_path = ctx.work / RESULT
    result = json.loads(result_path.read_text()) if result_path.is_file() else {}
    result.setdefault("steps", {})
    result.update(sizes=ctx.sizes, device_asked=ctx.device, model=ctx.model, started_utc=result.get(
        "started_utc") or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    if not (result.get("device") or {}).get("ok"):
        result["device"] = probe_device(ctx)
        write_json(result_path, result)
    if not result["device"]["ok"]:
        print(f"run: no device: {result['device']['error']}", file=sys.stderr, flush=True)
        return result
    for entry in reversed(ctx.env.get("PYTHONPATH", "").split(os.pathsep)):  # gemmdrift (and mlx) for steps.build
        if entry and entry not in sys.path:
            sys.path.insert(0, entry)
    for step in steps.build(ctx.sizes, ctx.device, ctx.model, ctx.work):
        entry = result["steps"].get(step.name, {})
        if entry.get("status") == "done" or (ctx.only and step.name not in ctx.only):
            continue
        if step.needs_weights and not weights_ready(ctx):
            print(f"run: {step.name} waits for the weights", file=sys.stderr, flush=True)
            waited = time.monotonic()
            while not weights_ready(ctx) and time.monotonic() - waited < ctx.weights_wait:
                time.sleep(2)
            if not weights_ready(ctx):
                result["steps"][step.name] = {**entry, "status": "waiting", "error": "the weights never arrived"}
                write_json(result_path, result)
                continue
        budget = ctx.budget.get(step.name, steps.SIZES[ctx.sizes]["budget"][step.name])
        entry = {"title": step.title, "answers": step.answers, "status": "running", "budget_s": budget,
                 "tries": entry.get("tries", 0) + 1, "commands": []}
        if result["steps"].get("repeat", {}).get("answer_repeatable") is False:
            entry["qualified"] = "this device was not repeatable run to run (step repeat): read this verdict so"
        result["steps"][step.name] = entry
        write_json(result_path, result)
        print(f"run: step {step.name} ({budget} s at most)", file=sys.stderr, flush=True)
        ctx.step_name = step.name
        t0 = time.monotonic()
        deadline = t0 + budget
        for cmd in step.commands:
            entry["commands"].append(run_command(cmd, ctx, deadline, ctx.work / "steps" / step.name))
            write_json(result_path, result)
        statuses = [c["status"] for c in entry["commands"]]
        entry["status"] = ("done" if all(s == "done" for s in statuses) else
                           "timeout" if "timeout" in statuses else "failed")
        entry["seconds"] = round(time.monotonic() - t0, 2)
        if step.name == "repeat":
            rep = (entry["commands"][0].get("answer") or {}).get("repeatable")
            entry["answer_repeatable"] = rep
            if rep is False:
                result["qualifier"] = ("NOT REPEATABLE: the same schedule gave other bits on a second run; every "
                                       "later verdict is qualified")
        write_json(result_path, result)
    result["finished_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    write_json(result_path, result)
    return result


# ---------------------------------------------------------------------------------------------- collecting


def collect(ctx) -> None:
    """Copy what is finished into ``out``: result.json, steps.tar.gz, runner.log, install.json (<= 8 files)."""
    out = ctx.out
    out.mkdir(parents=True, exist_ok=True)
    for name in (RESULT, "install.json"):
        src = ctx.work / name
        if src.is_file():
            (out / name).write_bytes(src.read_bytes())
    log = ctx.work / "runner.log"
    if log.is_file():
        data = log.read_bytes()
        (out / "runner.log").write_bytes(data[-2 * plan.MIB:])
    left_out, total = [], 0
    steps_dir = ctx.work / "steps"
    tmp = out / "steps.tar.gz.tmp"
    with tarfile.open(tmp, "w:gz") as t:
        for f in sorted(p for p in steps_dir.rglob("*") if p.is_file()) if steps_dir.is_dir() else []:
            size = f.stat().st_size
            if size > KEEP_BYTES or total + size > BUNDLE_BYTES or "checkpoint" in f.parts:
                left_out.append(f"{f.relative_to(ctx.work)} ({size} bytes)")
                continue
            total += size
            t.add(f, arcname=str(f.relative_to(ctx.work)))
    os.replace(tmp, out / "steps.tar.gz")
    if left_out and (out / RESULT).is_file():
        result = json.loads((out / RESULT).read_text())
        result["left_out_of_bundle"] = left_out
        write_json(out / RESULT, result)


def runner_alive(ctx) -> bool:
    if getattr(ctx, "proc", None) is not None:  # started by this call: poll() also reaps it
        return ctx.proc.poll() is None
    try:
        pid = int((ctx.work / "runner.pid").read_text())
    except (OSError, ValueError):
        return False
    try:  # a runner started by an earlier call (its process is gone, or a zombie, once it ended)
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return stat[0] != "Z" and "run.py" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
    except OSError:
        return False


def start_runner(ctx, argv: list[str]) -> None:
    """The steps in a process of their own session (it outlives this call), from a copy of gemmdrift's source and
    these scripts in WORK/code: the next call's copy of the repository cannot change them under it."""
    code = ctx.work / "code"
    if code.exists():
        shutil.rmtree(code)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ctx.repo / "src", code / "src", ignore=skip)
    shutil.copytree(HERE, code / "scripts" / "gpu_check", ignore=skip)
    env = install.run_env(ctx.work, code) if not ctx.no_install else dict(
        ctx.env, PYTHONPATH=ctx.env["PYTHONPATH"].replace(str(ctx.repo / "src"), str(code / "src")))
    log = open(ctx.work / "runner.log", "a")
    proc = subprocess.Popen([sys.executable, str(code / "scripts" / "gpu_check" / "run.py"), "--runner", *argv],
                            stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True, cwd=str(code),
                            env=env)
    (ctx.work / "runner.pid").write_text(str(proc.pid))
    ctx.proc = proc


def summary(ctx) -> str:
    path = ctx.work / RESULT
    if not path.is_file():
        return "no steps have run"
    result = json.loads(path.read_text())
    if not (result.get("device") or {}).get("ok", True):
        return f"device: {result['device'].get('error')}"
    if result.get("runner_error"):
        return f"runner: {result['runner_error']}"
    lines = [f"{name:13s} {s.get('status'):8s} {s.get('seconds', '-')!s:>7} s  {s.get('error', '')}"
             for name, s in result.get("steps", {}).items()]
    return "\n".join(lines + ([result["qualifier"]] if result.get("qualifier") else []))


def set_env(ctx) -> None:
    """The steps' environment: the installed site (once it exists), gemmdrift's source, the GGUF cache."""
    ctx.env = install.run_env(ctx.work, ctx.repo) if not ctx.no_install else dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src")] + [os.environ.get("PYTHONPATH", "")]).rstrip(
            os.pathsep), MPLBACKEND="Agg")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--call", type=int, help="the call whose pieces came in (.gpu-pack/callN); without it, only "
                   "wait for the steps and collect (a call after the last)")
    p.add_argument("--wait", type=float, default=0, help="seconds to wait for the steps before returning")
    p.add_argument("--no-install", action="store_true", help="use the installed mlx and model (no pieces)")
    p.add_argument("--device", choices=["cpu", "gpu"], default="gpu")
    p.add_argument("--sizes", choices=["gpu", "small"], default="gpu")
    p.add_argument("--model", default="embedded")
    p.add_argument("--work", default="/tmp/gemmdrift-gpu", help="where everything is kept between calls")
    p.add_argument("--out", help="where results are copied (default $OUT, else WORK/out)")
    p.add_argument("--foreground", action="store_true", help="run the steps in this process, then return")
    p.add_argument("--only", help="comma-separated step names to run now (the others wait for a later run)")
    p.add_argument("--budget", action="append", default=[], metavar="STEP=SECONDS", help="another step budget")
    p.add_argument("--weights-wait", type=float, default=WEIGHTS_WAIT)
    p.add_argument("--runner", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    ctx = args
    ctx.repo, ctx.work = REPO, Path(args.work).resolve()
    ctx.out = Path(args.out or os.environ.get("OUT") or ctx.work / "out").resolve()
    ctx.only = set(args.only.split(",")) if args.only else set()
    try:
        ctx.budget = {k: float(v) for k, v in (b.split("=", 1) for b in args.budget)}
    except ValueError:
        print("run: --budget takes STEP=SECONDS", file=sys.stderr)
        return 2
    ctx.work.mkdir(parents=True, exist_ok=True)
    try:  # finished steps are kept only for the same inputs: another device, size or model is another run
        saved = json.loads((ctx.work / RESULT).read_text())
    except (OSError, ValueError):
        saved = {}
    other = [f"{k} {saved[k]!r} (now {v!r})" for k, v in (("device_asked", args.device), ("sizes", args.sizes),
                                                           ("model", args.model)) if k in saved and saved[k] != v]
    if other:
        print(f"run: {ctx.work} holds a run made with other inputs: {'; '.join(other)}; use another --work",
              file=sys.stderr)
        return 2
    set_env(ctx)
    if args.runner:
        try:
            run_steps(ctx)
        except Exception as e:  # the steps' own failures are in result.json; this is the runner's, in one line
            path = ctx.work / RESULT
            result = json.loads(path.read_text()) if path.is_file() else {}
            write_json(path, {**result, "runner_error": f"{type(e).__name__}: {one_line(str(e))}"})
            raise
        return 0
    if not args.no_install and args.call is not None:
        t0 = time.monotonic()
        report = {"call": args.call}
        try:
            folders = sorted((REPO / plan.PACK).glob("call*/" + plan.MANIFEST))
            if not folders:
                raise plan.PackError(f"no {plan.PACK}/callN/{plan.MANIFEST} here: was the call's folder carried?")
            manifest = plan.read_manifest(folders[0])
            report.update(install.receive(REPO, manifest, ctx.work, args.call))
            report["installed"] = install.install(manifest, ctx.work)
        except Exception as e:  # a refused piece, pip, a corrupt stream, a full disk: one line, never a traceback
            report["error"] = str(e) if isinstance(e, plan.PackError) else f"{type(e).__name__}: {e}"
        report["seconds"] = round(time.monotonic() - t0, 2)
        prev = json.loads((ctx.work / "install.json").read_text()) if (ctx.work / "install.json").is_file() else []
        write_json(ctx.work / "install.json", prev + [report])
        missing = sorted(int(c) for c in report.get("missing", {}))
        if args.call in missing:
            print(f"run: call {args.call}'s pieces are not here: carry {plan.call_folder(args.call)}", file=sys.stderr)
        elif missing:
            print(f"run: pieces of earlier calls {missing} are missing: the machine was not kept warm between "
                  "calls; start again from call 1", file=sys.stderr)
        if report.get("error"):
            print(f"run: {report['error']}", file=sys.stderr)
            collect(ctx)
            return 2
    set_env(ctx)  # again: the site may have been installed by this call
    if not args.no_install and not (ctx.work / "site").is_dir():
        print("run: mlx is not installed yet (its pieces come in a later call)", file=sys.stderr)
        collect(ctx)
        return 0
    if args.foreground:
        run_steps(ctx)
    elif not runner_alive(ctx):
        start_runner(ctx, argv_without(argv, ("--call", "--wait", "--foreground")))
    t0 = last = time.monotonic()
    while not args.foreground and runner_alive(ctx) and time.monotonic() - t0 < args.wait:
        time.sleep(1.0)
        if time.monotonic() - last >= 10:  # what is finished comes back even if this call is cut off
            collect(ctx)
            last = time.monotonic()
    collect(ctx)
    print(summary(ctx))
    return 0


def argv_without(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """``argv`` less the given flags (and the value after each that takes one)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in flags:
            skip = "=" not in a and name != "--foreground"
            continue
        out.append(a)
    return out


if __name__ == "__main__":
    sys.exit(main())
