"""The compiled replay's ground: numba set-up and the scalar float32 operations the compiled recipes use.

The compiled recipes (:mod:`.jit`) do exactly the adds of the numpy
recipes (:mod:`.dense`, :mod:`.quant`, the readable reference),
in the same order, one output vector of ``NB`` columns at a time; this module
gives them the scalar pieces:

* :func:`fl`: Apple's float32 FTZ (a subnormal becomes a zero of its sign), as
  :func:`.core.flush`;
* :func:`fma32`: a correctly rounded float32 fused multiply-add (LLVM's
  ``llvm.fma.f32``: the hardware FMA, or libm's ``fmaf``), as
  :func:`.core.fma`;
* :func:`rnd`: RNE to bfloat16 / float16 held in float32, as
  :func:`.core.round_to`; :func:`add_rounded`, as its namesake.

numba is never given ``fastmath``: without it LLVM neither contracts ``a*b + c``
into an FMA nor reorders a float sum, which is what makes these loops the
recipes' order. Kernels are cached (``cache=True``) in ``NUMBA_CACHE_DIR``,
which defaults to ``<gemmdrift cache>/numba`` (``numba-serial`` where
:data:`THREADS` is off; set here, before numba is imported, unless the user
set it), and each kernel's first compile in a process
holds a lock in that directory (:func:`compile_once`): processes started
together on an empty cache (test workers, side-by-side parts) compile a kernel
once, the others load it from the cache.
"""

from __future__ import annotations

import functools
import os

from ..files import cache_dir

# The quantized tile loops spread their tiles over numba's threads (``prange``) only on a machine with more than two
# cores: the threaded compile costs twice the serial one (their four kernels 65 s against 34 s on this project's
# 2-core VM, where the side-by-side processes already keep both cores busy), and the warm run was no faster there
# (3.2 s either way for a replay check of two projections). Threads change no bit (each tile on one thread).
THREADS = (os.cpu_count() or 1) > 2
if "NUMBA_CACHE_DIR" not in os.environ:  # must precede the first numba import to take effect
    # numba's cache key does not hold the parallel flag: the two compiled forms live apart
    os.environ["NUMBA_CACHE_DIR"] = str(cache_dir() / ("numba" if THREADS else "numba-serial"))

import numpy as np  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import njit, prange, types  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

NB = 64  # output columns per vector step: independent accumulators, contiguous (what LLVM vectorises)
TINY = np.float32(2.0 ** -126)  # the smallest normal float32
ZERO = np.float32(0.0)
HALF = np.float32(0.5)
QNAN = np.uint32(0x7FC00000)
DTYPE_CODE = {"float32": 0, "bfloat16": 1, "float16": 2}


@intrinsic
def fma32(typingctx, a, b, c):
    """``RN32(a*b + c)``, one rounding (llvm.fma.f32)."""
    sig = types.float32(types.float32, types.float32, types.float32)

    def codegen(context, builder, signature, args):
        return builder.fma(*args)

    return sig, codegen


@intrinsic
def bits32(typingctx, a):
    """The uint32 bit pattern of a float32."""
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


@intrinsic
def bits64(typingctx, a):
    """The int64 bit pattern of a float64."""
    sig = types.int64(types.float64)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(64))

    return sig, codegen


@intrinsic
def from_bits32(typingctx, u):
    """The float32 of a uint32 bit pattern."""
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@njit
def fl(v, ftz):
    """FTZ when ``ftz``: ``v * 0`` is a zero with v's sign (as replay.core.flush's copysign)."""
    if ftz and v < TINY and v > -TINY:
        return v * ZERO
    return v


@intrinsic
def to_bf16(typingctx, v):
    """RNE to bfloat16 held in float32, as round_to: ``(u + 0x7FFF + lsb) & 0xFFFF0000`` on the bits u, NaN ->
    the quiet NaN. In 32-bit lanes (numba's integer arithmetic would widen to 64 and halve the vector): for
    every non-NaN u the sum stays below 2**32 (-inf, 0xFF800000, is the largest), so nothing wraps."""
    sig = types.float32(types.float32)

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        u = builder.bitcast(args[0], i32)
        lsb = builder.and_(builder.lshr(u, ir.Constant(i32, 16)), ir.Constant(i32, 1))
        r = builder.and_(builder.add(builder.add(u, ir.Constant(i32, 0x7FFF)), lsb), ir.Constant(i32, 0xFFFF0000))
        nan = builder.fcmp_unordered("uno", args[0], args[0])
        qnan = builder.bitcast(ir.Constant(i32, 0x7FC00000), ir.FloatType())
        return builder.select(nan, qnan, builder.bitcast(r, ir.FloatType()))

    return sig, codegen


@njit
def to_f16(v):
    """RNE to IEEE half (subnormals, overflow to inf), as numpy's float32 -> float16 cast."""
    if v != v:
        return v
    u = np.int64(bits32(v))
    sign = u & 0x80000000
    a = from_bits32(np.uint32(u & 0x7FFFFFFF))
    if a < np.float32(2.0 ** -14):
        # half subnormals are multiples of 2**-24, the float32 ulp of [0.5, 1): one RNE add, then exact.
        r = np.int64(bits32((a + HALF) - HALF))
    else:
        au = u & 0x7FFFFFFF
        r = (au + 0xFFF + ((au >> 13) & 1)) & 0xFFFFE000  # RNE to 11 significant bits
        if r > 0x477FE000:  # above 65504: inf
            r = 0x7F800000
    return from_bits32(np.uint32(r | sign))


@njit
def rnd(v, code):
    """``v`` rounded to the dtype of ``code`` (0 float32: unchanged, 1 bfloat16, 2 float16)."""
    if code == 1:
        return to_bf16(v)
    if code == 2:
        return to_f16(v)
    return v


@njit
def round_odd_sum(p, c):
    """replay.core._round_odd_sum for float64 scalars."""
    s = p + c
    risky = (bits64(s) & 0x1FFFFFFF) == 0x10000000 or abs(s) < 2.0 ** -125
    if not risky:
        return s
    bp = s - c
    e = (p - bp) + (c - (s - bp))
    if e != 0 and np.isfinite(s) and (bits64(s) & 1) == 0:
        return np.nextafter(s, np.copysign(np.inf, e))
    return s


@njit
def _odd_f32(s):
    """replay.core._odd_f32 for a float64 scalar."""
    r = np.float32(s)
    if np.float64(r) != s and np.isfinite(s) and (bits32(r) & np.uint32(1)) == 0:
        if np.float64(r) > s:
            return np.nextafter(r, np.float32(-np.inf))
        return np.nextafter(r, np.float32(np.inf))
    return r


@njit
def add_rounded(a, b, code):
    """replay.core.add_rounded: ``a + b`` of two dtype values, rounded once to the dtype."""
    if code == 0:
        return a + b
    return rnd(_odd_f32(round_odd_sum(np.float64(a), np.float64(b))), code)


def compile_once(kernel):
    """``kernel`` (a cached numba dispatcher, called from Python only), whose first call in this process
    compiles it -- or loads it from numba's cache -- holding an exclusive lock on
    ``NUMBA_CACHE_DIR/<module>.<name>.lock``. numba itself does not lock: two processes reaching a kernel at
    once on an empty cache both compiled it (the quantized ones take 10-20 s of CPU each); now the second
    waits and loads the first's. Where the lock cannot be taken (no fcntl, an unwritable directory) the call
    compiles as numba would. The dispatcher is ``.kernel`` of the returned function."""

    @functools.wraps(kernel.py_func)
    def call(*args):
        if not kernel.signatures:
            _compile_locked(kernel, args)
        return kernel(*args)

    call.kernel = kernel
    return call


def _compile_locked(kernel, args) -> None:
    try:
        import fcntl

        folder = os.environ.get("NUMBA_CACHE_DIR") or str(cache_dir() / "numba")
        os.makedirs(folder, exist_ok=True)
        lock = open(os.path.join(folder, f"{kernel.py_func.__module__}.{kernel.__name__}.lock"), "a")
    except (ImportError, OSError):
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        # The argument types the call dispatches on: the cache's entry when another process wrote it.
        kernel.compile(tuple(kernel.typeof_pyval(a) for a in args))


@compile_once
@njit(cache=True)
def _min_key(a):
    """min over a (contiguous float32, flat) of ``(bits & 0x7FFFFFFF) - 1`` as uint32, NaN keyed highest:
    zero wraps to the top, so the minimum is the smallest nonzero magnitude (an integer min: vectorises)."""
    best = np.uint32(0xFFFFFFFF)
    for i in range(a.size):
        u = bits32(a[i]) & np.uint32(0x7FFFFFFF)
        key = np.uint32(0xFFFFFFFF) if u > np.uint32(0x7F800000) else u - np.uint32(1)
        best = min(best, key)
    return best


def min_nonzero(a) -> float:
    """The smallest nonzero |a| of a float32 array (inf if none, NaN ignored), as replay.core.min_nonzero."""
    key = _min_key(np.ascontiguousarray(a, dtype=np.float32).reshape(-1))
    if key >= 0x7F800000:  # only zeros and NaN (or inf: the key of inf is 0x7F7FFFFF)
        return float(np.inf)
    return float(np.uint32(key + 1).view(np.float32))


__all__ = ["NB", "TINY", "ZERO", "DTYPE_CODE", "fma32", "bits32", "from_bits32", "fl", "rnd", "add_rounded",
           "min_nonzero", "compile_once", "THREADS", "njit", "np", "prange", "to_bf16", "to_f16", "round_odd_sum"]
