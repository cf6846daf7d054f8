"""The fp-quantized recipes (``quantized_matmul(x, w, scales, mode=...)``, transposed; mxfp4, nvfp4, mxfp8).

Operands: ``x`` (T, K) float32 values of the activation dtype, ``codes`` (N, K) the float32 values of the
element codes (e2m1 for 4 bits, e4m3 for 8), ``scales`` (N, K / group) the float32 values of the group
scales (e8m0 for group 32, e4m3 for group 16: ``dequantize_scale``). :func:`decode` makes both, exactly,
from mlx's packed ``uint32`` weights and ``uint8`` scales with lookup tables.

Sources: ml-explore/mlx at 846d176, ``mlx/backend/metal/kernels/fp_quantized.h`` (byte-identical at v0.32.1;
v0.32.0 and b7c3dd6d are identical to each other and differ from v0.32.1 only by the nvfp4 global scale, a
``results_per_simdgroup`` template argument and the qmm dequantization's types; the 0.32.4 wheel's
``fp_qmv_impl`` and ``fp_qmv_wide_impl`` are byte-identical to 846d176's, its ``fp_qmv_fast_impl`` adds only
``partial_rows`` guards), ``kernels/fp4.h``, ``kernels/fp8.h``; host ``mlx/backend/metal/quantized.cpp``:

* Codes. ``fp4_e2m1::operator float16_t`` (fp4.h L36-40): ``as_type<half>((b & 7) << 9) * 16384``, signed:
  0, 0.5, 1, 1.5, 2, 3, 4, 6 (and -0 .. -6). ``fp8_e4m3::operator float16_t`` (fp8.h L32-38):
  ``as_type<half>((b & 127) << 7) * 256``: the e4m3 value, subnormals included (846d176 decodes 0x7F as 480,
  the 0.32.4 wheel as NaN; ``quantize`` saturates at 0x7E = 448, so neither occurs in a quantized weight).
* Scales (``dequantize_scale`` L30-38): group 16 (nvfp4) an e4m3 code, otherwise (mxfp4, mxfp8) e8m0:
  ``fp8_e8m0::operator float`` (fp8.h L74-77) ``as_type<float>(b << 23)``, 2**(b-127), with b = 0 read as
  0x400000 = 2**-127 and b = 255 as +inf.
* ``fp_qmv_fast`` / ``fp_qmv`` (``fp_qmv_fast_impl`` L325-398, ``fp_qmv_impl`` L400-559; host ``qmv``
  L461-535: fast if ``N % 8 == 0`` and ``K % qmv_fast_k_alignment(bits)`` (512 for 4 bits, 256 for 8 from
  v0.32.1; 512 before)): float ``U``; lane l of 32 takes ``vpt`` consecutive values per block of
  ``32 * vpt`` (vpt = 32/bits * 2 fast, 32/bits otherwise), one group each; ``qdot`` (L81-100):
  ``accum = 0``, 4 bits ``accum += (x0*w0 + x1*w1 + x2*w2 + x3*w3)`` per uint16 (left to right), 8 bits
  ``accum += x_i*w_i``; the products are exact in float32 (fp16/bf16 times a code of at most 4 significant
  bits), so contraction cannot change them; ``return scale * accum``; the caller ``result += qdot(...)``:
  whether that add is fused with qdot's product (it crosses a return; clang's ``fp-contract=on`` fuses only
  within one expression) is the ``qdot_add`` axis; it matters only for e4m3 scales (nvfp4): an e8m0 scale
  makes ``scale * accum`` exact. The tail block's lanes past K add nothing (``remaining`` is 0 or vpt:
  K is a multiple of the group size, which is a multiple of vpt). Then ``simd_sum`` (axis ``simd_sum``).
  Unlike affine qmv there is no ``sum * bias`` term and ``load_vector`` only converts x to float. At
  v0.30.5..v0.31.2 fp_qmv's N < 8 branch passed the raw scale byte to qdot (fixed by 1700b39a1, v0.32.0):
  not replayed there.
* ``fp_qmv_wide`` (``fp_qmv_wide_impl`` L561-674, from v0.32.0 (548dd80e8); host ``dispatch_qmv``
  L1739-1780 sends every fp mode with 2 <= M < the batch limit here on every chip, ``use_qmv_wide``
  L537-540, with ``k_lanes = 16``, L567): lane l of 16 takes groups l, l+16, ...; per group ``acc = 0;
  acc += dot(w4[j], float4(x4[j]))`` over the group's float4s (``dot``'s order: axis ``dot4``, as the dense
  gemv_wide's), then ``result += s * acc`` (one expression: contracted to ``fma(s, acc, result)`` by default,
  axis ``contract``; again exact for e8m0 scales); then ``simd_shuffle_down`` 8, 4, 2, 1 (L654-668). The
  axis shares its name with affine qmv_wide's ``acc += x * w``: both are one-expression ``r += a*b``, which
  the compiler contracts or not alike, so one calibrated value serves both.
* ``fp_qmm_t`` / ``fp_qmm_t_splitk`` (``fp_qmm_t_impl`` L786-910, ``fp_qmm_t_splitk`` L1794-1846; host
  ``qmm`` L1024-1118, ``qmm_splitk`` L1120-1217): ``QuantizedBlockLoader`` writes ``dequantize`` (L138-147)
  ``T(float(scale_T) * code)`` to threadgroup memory (v0.32.0: ``scale_T * code`` in T arithmetic): the
  product of a scale and a code is exact (an e8m0 power of two, or 4 x 2 significant bits), so both releases
  store ``T(T(scale) * code)``; then ``BlockMMA<T, T, 32, 32, 32, 2, 2>``, the steel MMA8 chain over K in
  order (axis ``mma``), and split-K's partials and reduction as affine qmm_t_splitk's (the same host code).
  On NAX chips (M5) ``qmm`` takes ``qmm_nax`` for fp modes too (L1039-1043): not replayed.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ..errors import GemmdriftError
from .core import SIMD_SUMS, add, f32, fma, lane_tree, mul, round_to
from .dense import DOT4, dot4
from .quant import qmm_chain, qmv_blocks, qmv_geometry

FP_MODES = {"mxfp4": (4, 32), "nvfp4": (4, 16), "mxfp8": (8, 32)}  # (bits, group size): quantize accepts only these
QDOT_ADD = {"mul-add": "result = RN(result + RN(scale*accum))", "fma": "result = fma(scale, accum, result)"}
CONTRACT = {"fma": "result = fma(s, acc, result)", "none": "result = RN(result + RN(s*acc))"}


def _e2m1() -> np.ndarray:
    mag = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
    return np.concatenate([mag, -mag]).astype(np.float32)  # code 8 is -0.0


def _e4m3() -> np.ndarray:
    b = np.arange(256)
    e, m = (b >> 3) & 15, (b & 7).astype(np.float64)
    mag = np.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * 2.0 ** (e - 7))
    mag = np.where((b & 127) == 127, np.nan, mag)  # OCP e4m3 NaN (never made by quantize, which saturates at 448)
    return np.where(b & 128, -mag, mag).astype(np.float32)


def _e8m0() -> np.ndarray:
    b = np.arange(256, dtype=np.uint32)
    bits = np.where(b == 0, np.uint32(0x400000), b << np.uint32(23)).astype(np.uint32)  # fp8.h L74-77
    return bits.view(np.float32)


E2M1, E4M3, E8M0 = _e2m1(), _e4m3(), _e8m0()


def mode_params(mode: str, bits: int | None = None, group_size: int | None = None) -> tuple[int, int]:
    """(bits, group size) of an fp mode; anything else mlx's quantize refuses is a one-line error."""
    if mode not in FP_MODES:
        raise GemmdriftError(f"unknown fp quantization mode {mode!r} (known: {', '.join(FP_MODES)})")
    b, g = FP_MODES[mode]
    if (bits is not None and bits != b) or (group_size is not None and group_size != g):
        raise GemmdriftError(f"{mode} is {b} bits in groups of {g} (mlx/ops.cpp fp_quantize), not {bits} bits "
                             f"in groups of {group_size}")
    return b, g


def unpack_codes(wq: np.ndarray, bits: int, K: int) -> np.ndarray:
    """The uint8 element codes (N, K) of mlx's packed uint32 weights (element i of a word in bits [bits*i, ...))."""
    w = np.ascontiguousarray(wq, dtype=np.uint32)
    per = 32 // bits
    shifts = np.arange(per, dtype=np.uint32) * np.uint32(bits)
    codes = (w[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    return codes.reshape(w.shape[0], -1)[:, :K].astype(np.uint8)


def decode(wq: np.ndarray, scales: np.ndarray, mode: str, K: int) -> tuple[np.ndarray, np.ndarray]:
    """(code values (N, K), scale values (N, K/g)) as float32, exactly as the Metal kernels read them."""
    bits, g = mode_params(mode)
    sc = np.asarray(scales)
    if sc.dtype != np.uint8:
        raise GemmdriftError(f"{mode} scales are uint8 codes (as mx.quantize returns them), not {sc.dtype}")
    if sc.shape[-1] * g != K:
        raise GemmdriftError(f"{mode} scales of shape {sc.shape} do not cover K={K} in groups of {g}")
    codes = unpack_codes(wq, bits, K)
    values = (E2M1 if bits == 4 else E4M3)[codes]
    return values, (E4M3 if g == 16 else E8M0)[sc]


def dequantize(wq: np.ndarray, scales: np.ndarray, mode: str, K: int) -> np.ndarray:
    """``scale * code`` in float32 (exact: a power of two, or 4 x 2 significant bits), as mx.dequantize's float32."""
    values, s = decode(wq, scales, mode, K)
    g = FP_MODES[mode][1]
    return np.multiply(values, np.repeat(s, g, axis=1), dtype=np.float32)


# ------------------------------------------------------------------------------ quantize


def to_e4m3(v: np.ndarray) -> np.ndarray:
    """float32 values -> e4m3 codes: to nearest, ties to the even code, saturating at 448 (0x7E), as mlx's to_fp8."""
    v = f32(v)
    pos = E4M3[:127].astype(np.float64)  # the finite positive values, ascending with the code
    a = np.abs(v).astype(np.float64)
    idx = np.clip(np.searchsorted(pos, a), 1, 126)  # pos[idx - 1] < a <= pos[idx]
    lo, hi = pos[idx - 1], pos[idx]
    up = (a - lo > hi - a) | ((a - lo == hi - a) & (idx % 2 == 0))
    code = np.where(a >= 448, 126, np.where(up, idx, idx - 1))
    code = np.where(a == 0, 0, code)
    return (code | np.where(np.signbit(v), 128, 0)).astype(np.uint8)


def quantize(w: np.ndarray, mode: str, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """``mx.quantize(w, mode=mode)`` for ``w`` (N, K) float32 values of ``dtype``: (packed uint32, uint8 scales).

    mlx/ops.cpp ``fp_quantize``'s graph in the weight's dtype (each op rounded to it): ``scale = amax / 6``
    (or 448); nvfp4 ``to_fp8(scale)`` and ``w / from_fp8(scale)``; mxfp4/mxfp8 the e8m0 exponent, which the
    0.32.4 build rounds *up* (the smallest power of two >= scale; 846d176's fallback rounds ``log2`` to the
    nearest, and the 0.32.4 wheel's fp8.h has ``mx_scale_round_up``: checked against this machine's mlx),
    then ``w / 2**e``; 4 bits the first nearest e2m1 value (argmin over +0, 0.5, .., 6, -0, .., -6), 8 bits
    ``to_fp8``. Finite weights only; an all-zero group of nvfp4 is not modelled (0/0).
    """
    bits, g = mode_params(mode)
    w = round_to(f32(w), dtype)
    N, K = w.shape
    if K % g:
        raise GemmdriftError(f"K={K} is not a multiple of the {mode} group size {g}")
    wg = w.reshape(-1, g)
    maxval = np.float32(6.0 if bits == 4 else 448.0)
    scales = round_to(np.max(np.abs(wg), axis=1, keepdims=True) / maxval, dtype)  # a maximum, then one division
    if g == 16:
        scodes = to_e4m3(scales)
        with np.errstate(divide="ignore", invalid="ignore"):  # a scale below e4m3's range is 0, as in mlx
            wq = round_to(wg / round_to(E4M3[scodes], dtype), dtype)  # then * 1.0f: float32, so the lut too
        diff = lambda a, b: f32(a) - f32(b)  # noqa: E731  (float32 subtraction: the promoted type)
    else:
        m, e = np.frexp(scales)
        e = np.where(scales == 0, 0, np.where(m == 0.5, e - 1, e)).astype(np.int32)
        e = np.clip(e, -127, 127)
        scodes = (e + 127).astype(np.uint8)
        wq = round_to(wg / round_to(np.ldexp(np.float32(1.0), e).astype(np.float32), dtype), dtype)
        diff = lambda a, b: round_to(f32(a) - f32(b), dtype)  # noqa: E731  (in the weight's dtype)
    if bits == 4:
        codes = np.argmin(np.abs(diff(wq[..., None], round_to(E2M1, dtype))), axis=-1).astype(np.uint32)
    else:
        codes = to_e4m3(wq).astype(np.uint32)
    codes = codes.reshape(N, K)
    per = 32 // bits
    words = np.zeros((N, K // per), dtype=np.uint32)
    for i in range(per):
        words |= codes[:, i::per] << np.uint32(bits * i)
    return words, scodes.reshape(N, K // g)


# ------------------------------------------------------------------------------ fp_qmv / fp_qmv_fast


def metal_fp_qmv(x, codes, scales, _biases, params: Mapping[str, Any], var, dtype: str, ftz: bool) -> np.ndarray:
    """fp_qmv / fp_qmv_fast: lane l, block b covers ``k = B*b + vpt*l + [0, vpt)``; per block
    ``result += scale * accum`` (``qdot_add``); lanes past K add nothing; then ``simd_sum`` over 32 lanes."""
    bits, g = int(params["bits"]), int(params["group_size"])
    fast = bool(params.get("fast", False))
    vpt, block = qmv_geometry(bits, fast)  # fp_qmv's packs_per_thread (2 fast, 1 not) of 32/bits values: the affine qmv's
    T, K, N = x.shape[0], codes.shape[1], codes.shape[0]
    if fast and K % block:
        raise GemmdriftError(f"fp_qmv_fast {bits}-bit needs K % {block} == 0, got K={K}")
    if K % vpt:
        raise GemmdriftError(f"fp_qmv {bits}-bit needs K % {vpt} == 0, got K={K}")
    how = var["qdot_add"]
    if how not in QDOT_ADD:
        raise GemmdriftError(f"unknown qdot_add variant {how!r} (known: {', '.join(QDOT_ADD)})")
    r = np.zeros((32, T, N), dtype=np.float32)
    for lanes, ks, _, acc in qmv_blocks(x, codes, vpt, block, bits, ftz):
        s = np.broadcast_to(f32(scales)[:, ks[:, 0] // g].T[:, None, :], acc.shape)  # (lane, 1, N)
        if how == "fma":
            r[:lanes] = fma(s, acc, r[:lanes], ftz)
        else:
            r[:lanes] = add(r[:lanes], mul(s, acc, ftz), ftz)
    return SIMD_SUMS[var["simd_sum"]](r, axis=0, ftz=ftz)


# ------------------------------------------------------------------------------ fp_qmv_wide


def metal_fp_qmv_wide(x, codes, scales, _biases, params: Mapping[str, Any], var, dtype: str,
                      ftz: bool) -> np.ndarray:
    """fp_qmv_wide (16 lanes): lane l takes groups l, l+16, ...; per group ``acc = sum_j dot4(w4[j], x4[j])``
    from +0, then ``result += s * acc`` (``contract``); shuffle-down 8, 4, 2, 1."""
    g = int(params["group_size"])
    kl = int(params.get("k_lanes", 16))
    T, K, N = x.shape[0], codes.shape[1], codes.shape[0]
    G = K // g
    if var["contract"] not in CONTRACT:
        raise GemmdriftError(f"unknown contract variant {var['contract']!r} (known: {', '.join(CONTRACT)})")
    if var["dot4"] not in DOT4:
        raise GemmdriftError(f"unknown dot4 variant {var['dot4']!r} (known: {', '.join(DOT4)})")
    contracted = var["contract"] == "fma"
    xt = np.ascontiguousarray(f32(x).T)  # (K, T)
    ct = np.ascontiguousarray(f32(codes).T)  # (K, N)
    sc = f32(scales)
    r = np.zeros((kl, T, N), dtype=np.float32)
    for lo_g in range(0, G, kl):
        lanes = min(kl, G - lo_g)
        gs = lo_g + np.arange(lanes)
        acc = np.zeros((lanes, T, N), dtype=np.float32)
        for j in range(g // 4):
            ks = gs[:, None] * g + 4 * j + np.arange(4)  # (lane, 4)
            P = np.multiply(xt[ks][:, :, :, None], ct[ks][:, :, None, :], dtype=np.float32)  # (lane, 4, T, N)
            acc = add(acc, dot4(P, var["dot4"], ftz), ftz)
        s = np.broadcast_to(sc[:, gs].T[:, None, :], acc.shape)
        r[:lanes] = fma(s, acc, r[:lanes], ftz) if contracted else add(r[:lanes], mul(s, acc, ftz), ftz)
    return lane_tree(r, axis=0, ftz=ftz)


# ------------------------------------------------------------------------------ fp_qmm_t


def qmm_weights(codes, scales, g: int, dtype: str) -> np.ndarray:
    """The dequantized weights in threadgroup memory: ``T(T(scale) * code)`` (the product is exact)."""
    s = np.repeat(round_to(f32(scales), dtype), g, axis=1)
    return round_to(np.multiply(s, f32(codes), dtype=np.float32), dtype)


def metal_fp_qmm_t(x, codes, scales, _biases, params: Mapping[str, Any], var, dtype: str, ftz: bool) -> np.ndarray:
    """fp_qmm_t (split_k 1) and fp_qmm_t_splitk: affine qmm_t's MMA8 chain and partials on ``T(T(s) * code)``."""
    w = qmm_weights(codes, scales, int(params["group_size"]), dtype)
    return qmm_chain(x, w, int(params.get("split_k", 1)), var, dtype, ftz)


__all__ = ["FP_MODES", "QDOT_ADD", "CONTRACT", "E2M1", "E4M3", "E8M0", "mode_params", "unpack_codes", "decode",
           "dequantize", "to_e4m3", "quantize", "metal_fp_qmv", "metal_fp_qmv_wide", "qmm_weights", "metal_fp_qmm_t"]
