"""Independent parts of one measurement in several processes, each with its own copy of the model.

mlx's CPU backend computes the small blocks these measurements feed (a few rows at a
time) on one core, so on a multi-core CPU independent parts (the two rungs of the
precision ladder, the two halves of the cache-state sweep, the kernel units, the runs of
schedules that share nothing, the two sides of the divergence probe, whole measurements in
:func:`gemmdrift.suite.side_by_side`) finish sooner side by side -- not twice as fast on this
2-core machine: two bf16 matmul loops side by side ran at 1.7x the speed of one. Each worker
is a fresh spawned process (mlx state is not fork-safe) that loads the
model again from the recipe :func:`gemmdrift.model.load_model` left on it, and
runs module-level functions ``fn(lm, **job)``; results come back pickled, in job
order. The numbers are the same as in one process: every part computes exactly what
it would have computed there (tests compare the tables).

On a GPU the workers would only queue on the one device, so the default there is one
process, as it is for models that cannot be loaded again (built in memory by tests) and
models whose two more copies would not fit in half the memory. :func:`run_tasks` is the
same for measurements without a model (the fingerprints).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Iterator, Sequence

from .errors import GemmdriftError

_LM = None  # this worker's model


def can_reload(lm) -> bool:
    recipe = getattr(lm, "recipe", None)
    return recipe is not None and recipe.get("dtype") == lm.description.dtype


def _fits_twice(lm) -> bool:
    """Room for two more copies of the model's weights (each worker loads its own) in half the memory."""
    from mlx.utils import tree_flatten

    try:
        weights = sum(v.nbytes for _, v in tree_flatten(lm.model.parameters()))
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return False
    return 3 * weights < memory / 2


def in_worker() -> bool:
    """True inside a worker process: a measurement run there as one part (:func:`gemmdrift.suite.side_by_side`)
    does not start processes of its own."""
    return _LM is not None


def default_workers(lm, parts: int) -> int:
    """2 on a CPU device with at least 2 cores, for a model that can be loaded again, whose two more copies
    fit in memory, and more than one part; else 1 (and 1 inside a worker)."""
    import mlx.core as mx

    if in_worker() or parts < 2 or not can_reload(lm) or mx.default_device() != mx.cpu or (os.cpu_count() or 1) < 2:
        return 1
    return 2 if _fits_twice(lm) else 1


def check_workers(lm, workers: int | None, parts: int) -> int:
    """``workers`` as given (None: :func:`default_workers`), validated, at most ``parts``."""
    if workers is None:
        return default_workers(lm, parts)
    if workers < 1:
        raise GemmdriftError(f"workers must be at least 1, got {workers}")
    if workers > 1 and not can_reload(lm):
        raise GemmdriftError("a measurement in several processes needs a model it can load again "
                             "(one loaded by gemmdrift.model.load_model)")
    n = max(1, min(workers, parts))
    if n > 1:
        _check_gpu_copies(lm, n)
    return n


def _check_gpu_copies(lm, workers: int) -> None:
    """On a GPU every worker's copy and this process's share one working set (Metal) or device memory (CUDA):
    refuse an explicit ``--workers`` whose copies do not fit. (The CPU's default is checked by
    :func:`_fits_twice`; an explicit CPU count is the user's to choose.)"""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from .machine.memory import check_copies, device_budget

    if mx.default_device().type != mx.gpu:
        return
    budget, what = device_budget()
    weights = sum(v.nbytes for _, v in tree_flatten(lm.model.parameters()))
    check_copies(workers + 1, weights, budget, what, f"--workers {workers}")


def _init(recipe: dict[str, Any], tf32_off: bool, device: tuple[str, int]) -> None:
    global _LM
    import mlx.core as mx

    from .machine import compat, envinfo
    from .model import load_model

    compat.install()  # bfloat16 arrays pickle back to the parent on every mlx release
    if tf32_off:
        envinfo.force_true_float32()  # inherited MLX_ENABLE_TF32=0; records that this process forced it
    _set_device(device)  # the parent's device
    _LM = load_model(**recipe)
    mx.eval(_LM.model.parameters())  # the lazy weights load here, not inside the first timed part


def run_jobs(lm, fn: Callable[..., Any], jobs: Sequence[dict[str, Any]], workers: int,
             done: Callable[[int, Any], None] | None = None, fresh: bool = False) -> list[Any]:
    """``[fn(lm, **job) for job in jobs]``, in ``workers`` processes when more than one (``fn`` must be a
    module-level function; its results must pickle). Jobs start in the order given (put the longest first);
    ``done(i, result)`` is called as job ``i`` finishes (in the order they finish), so a caller can keep each
    result before the others are done.

    ``fresh``: every job in a process started for it alone, even with one worker (where the model can be
    loaded again): nothing a job leaves in its process -- mlx's once-read switches such as MLX_ENABLE_TF32,
    its memory cache -- reaches the next one.
    """
    if workers > 1 or fresh:
        from .machine import compat

        compat.install()  # the jobs' bfloat16 arrays pickle on every mlx release
    if fresh and jobs and can_reload(lm):
        return _run_fresh(lm, fn, jobs, max(1, min(workers, len(jobs))), done)
    if workers <= 1 or len(jobs) <= 1:
        out = []
        for i, job in enumerate(jobs):
            out.append(fn(lm, **job))
            if done is not None:
                done(i, out[-1])
        return out
    with pool(lm, min(workers, len(jobs))) as submit:
        return _collect([submit(fn, **job) for job in jobs], done)


def _run_fresh(lm, fn, jobs, workers: int, done) -> list[Any]:
    # multiprocessing's Pool, not _executor: ProcessPoolExecutor's max_tasks_per_child needs Python 3.11.
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    before = set(multiprocessing.active_children())
    with ctx.Pool(workers, initializer=_init, initargs=_init_args(lm), maxtasksperchild=1) as p, _stopping():
        pending = {i: p.apply_async(_call_job, (fn, job)) for i, job in enumerate(jobs)}
        out: list[Any] = [None] * len(jobs)
        seen: set = set()
        while pending:
            i = _wait(pending, seen, before)
            out[i] = pending.pop(i).get()  # the job's own exception, if it raised, is raised here
            if done is not None:
                done(i, out[i])
        return out


POLL_SECONDS = 0.2  # how often a wait on a fresh worker looks for one that died


def _wait(pending: dict, seen: set, before: set) -> Any:
    """The key of a finished handle of ``pending`` (the first in key order when several are), once one is --
    except that a worker which died -- killed (out of memory), a crash inside mlx, a model it could not
    load -- raises at once. (multiprocessing's Pool replaces a dead worker without a word and loses its
    job: a plain ``get()`` waited for good.) A worker that finished its one job exits with 0."""
    import multiprocessing

    first = next(iter(pending.values()))
    while True:
        ready = [i for i, h in pending.items() if h.ready()]
        if ready:
            return ready[0]
        first.wait(POLL_SECONDS)
        seen.update(q for q in multiprocessing.active_children() if q not in before)
        dead = sorted({q.exitcode for q in seen if q.exitcode not in (None, 0)}, key=str)
        if dead:
            raise GemmdriftError(died(dead[0]))


def died(exitcode: Any) -> str:
    """The one line for a worker process that died before finishing its part."""
    import signal

    how = f"exit code {exitcode}"
    if isinstance(exitcode, int) and exitcode < 0:
        with contextlib.suppress(ValueError):
            how = f"killed by {signal.Signals(-exitcode).name}" + (" (out of memory?)" if -exitcode == 9 else "")
    return (f"a worker process died before finishing its part ({how}); run the command again to resume from "
            "what was checkpointed, or with --workers 1 (where it has that flag) to compute in this process")


def _init_args(lm) -> tuple:
    from .machine import envinfo

    tf32_off = bool(envinfo.TF32_FORCED_OFF) or os.environ.get(envinfo.TF32_VAR) == "0"
    return dict(lm.recipe), tf32_off, _device_name()


@contextlib.contextmanager
def pool(lm, workers: int) -> Iterator[Callable[..., Any]]:
    """Processes that keep their model between jobs (for a measurement in phases): yields
    ``submit(fn, **job)``, which runs ``fn(lm, **job)`` in one of them and returns its future."""
    with _stopping(_executor(workers, _init, _init_args(lm))) as ex:
        yield lambda fn, **job: ex.submit(_call_job, fn, job)


STOP_SECONDS = 5.0  # how long a worker has to exit after SIGTERM before it is killed


@contextlib.contextmanager
def _stopping(ex=None):
    """``with ex`` (a ProcessPoolExecutor, or None: the worker processes started in the block), except that a
    block ending in an exception (Ctrl-C above all, a SIGINT to this process alone included) does not wait for
    the workers to finish their jobs -- a whole half of a sweep -- nor hangs on a worker a group SIGINT left
    stuck: they are sent SIGTERM, given :data:`STOP_SECONDS`, then killed. What they finished is in their
    checkpoints."""
    import multiprocessing

    before = set(multiprocessing.active_children())
    try:
        yield ex
    except BaseException:
        if ex is not None:
            ex.shutdown(wait=False, cancel_futures=True)
        stop_processes([p for p in multiprocessing.active_children() if p not in before])
        raise
    if ex is not None:
        ex.shutdown(wait=True)


def stop_processes(procs: Sequence[Any], seconds: float = STOP_SECONDS) -> None:
    """SIGTERM each process, wait at most ``seconds`` in all, SIGKILL those still alive (then reap them)."""
    import time

    for p in procs:
        with contextlib.suppress(Exception):
            p.terminate()
    deadline = time.monotonic() + seconds
    for p in procs:
        with contextlib.suppress(Exception):
            p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        with contextlib.suppress(Exception):
            if p.is_alive():
                p.kill()
                p.join(1.0)


def run_tasks(fn: Callable[..., Any], jobs: Sequence[dict[str, Any]], workers: int) -> list[Any]:
    """``[fn(**job) for job in jobs]`` for measurements without a model, in ``workers`` processes when more
    than one, each on this process's device."""
    if workers <= 1 or len(jobs) <= 1:
        return [fn(**job) for job in jobs]
    with _stopping(_executor(min(workers, len(jobs)), _set_device, (_device_name(),))) as ex:
        return _collect([ex.submit(_call_task, fn, job) for job in jobs], None)


def _device_name() -> tuple[str, int]:
    """The default device as (type, index): a worker must use the same one, gpu:1 included."""
    import re

    import mlx.core as mx

    dev = mx.default_device()
    m = re.search(r",\s*(\d+)\)", str(dev))  # Device(gpu, 1): mlx's Python Device exposes no index attribute
    return ("gpu" if dev.type == mx.gpu else "cpu"), int(m.group(1)) if m else 0


def _set_device(device: str | tuple[str, int]) -> None:
    import mlx.core as mx

    kind, index = (device, 0) if isinstance(device, str) else device
    mx.set_default_device(mx.Device(mx.gpu if kind == "gpu" else mx.cpu, index))


def _call_job(fn: Callable[..., Any], job: dict[str, Any]) -> Any:
    return fn(_LM, **job)


_BUSY = False  # a run_tasks worker is inside a task


def _on_sigint(signum, frame) -> None:
    """Ctrl-C in a :func:`run_tasks` worker: the running task stops (its KeyboardInterrupt goes back to the
    main process like any exception); an idle worker ignores it instead of dying with a ``Process
    SpawnProcess-N: ... KeyboardInterrupt`` traceback (issue 33 D11c): the main process, interrupted too, shuts
    the pool down (the idle worker then exits normally) and says what was kept. (Exiting there instead would
    leave the task queue's lock held by a dead process: the other worker and the main would wait for good.)"""
    if _BUSY:
        raise KeyboardInterrupt


def _call_task(fn: Callable[..., Any], job: dict[str, Any]) -> Any:
    global _BUSY
    import signal

    signal.signal(signal.SIGINT, _on_sigint)
    _BUSY = True
    try:
        return fn(**job)
    finally:
        _BUSY = False


def _executor(workers: int, initializer, initargs):
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from .machine import compat

    compat.install()  # the jobs' bfloat16 arrays pickle on every mlx release

    return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"), initializer=initializer,
                               initargs=initargs)


def _collect(futures: list, done: Callable[[int, Any], None] | None) -> list[Any]:
    """The futures' results in their order; ``done(i, result)`` as each finishes (a failed one raises at once)."""
    from concurrent.futures import as_completed
    from concurrent.futures.process import BrokenProcessPool

    try:
        if done is not None:
            index = {f: i for i, f in enumerate(futures)}
            for f in as_completed(futures):
                done(index[f], f.result())
        return [f.result() for f in futures]
    except BrokenProcessPool:
        raise GemmdriftError(died("the pool broke")) from None
