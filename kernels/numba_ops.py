"""CPU kernels in Numba: the quantizers' per-element work in compiled passes.

The references (:mod:`.quant`) are torch ops, a pass over memory each; QSGD and TernGrad also
draw their uniforms with :func:`~gradzip.kernels.philox.philox_uniform`, ten rounds of Philox
on int64 tensors (about 230 ns an element on one core). These kernels (SignSGD's error-feedback
encoder, QSGD and TernGrad's encoders with the same Philox draws, Int8's encoder, the QSGD,
TernGrad and Int8 decoders, Int8's error-feedback subtraction, and Threshold's fused pass) give the references' results
on float32 CPU tensors (float16 and bfloat16 are widened first, as the references do); so do
the quantizers' frame checks (:func:`quant_body_stats_numba`, one pass over the bytes) and
PowerSGD's Gram-Schmidt (:func:`orthonormalize_rows_numba`, :mod:`.orth` defines its floats):

* the block statistics (``max |v|``; float64 sums of ``|v|`` or ``v^2``) are compiled too, and
  the scales come from them by the references' own functions. A float64 sum of float32 values
  is exact, whatever the order, while a block's values span fewer than about ``29 - log2 b``
  binades (5 fewer for squares); beyond that a scale may differ from torch's by an ulp, as the
  Triton kernels' may (``docs/kernels.md``). Everything downstream of a scale is bit for bit;
* the per-element work (Philox draw, quotient, level, code, packing; the decoders' values and
  additions) runs in the accumulation dtype with IEEE rounding, in the references' order
  (Numba compiles without fast-math: no reassociation, no fused multiply-add). Loops index
  slices from 0, so that Numba drops its negative-index checks and the compiler vectorises.

A call the kernels would not reproduce exactly goes to the reference instead: QSGD, TernGrad
and Int8 blocks whose scale is not finite (non-finite gradients: the engine flags those steps
anyway), float64 tensors (the dispatch sends them to the reference). Compiled on first use and
cached on disk beside this file (``cache=True``); one thread, as each rank of a CPU job takes
a core.
"""

from __future__ import annotations

import numpy as np
import torch

from .dispatch import Unsupported
from .orth import LANES
from .quant import (
    _split_body,
    each_segment,
    int8_encode_reference,
    int8_segments_by,
    qsgd_bits,
    qsgd_encode_reference,
    qsgd_norms,
    quant_code_bytes,
    quant_counts,
    quant_layout,
    sign_scales,
    sign_segments_by,
    terngrad_encode_reference,
    terngrad_scales,
)
from .reference import ThresholdResult, accum_dtype, wants_residual

try:  # imported by the dispatch only after `import numba` succeeded; the guard keeps this importable
    import numba
except ImportError:  # pragma: no cover - the dispatch never loads this module then
    numba = None

__all__ = [
    "qsgd_encode_numba",
    "terngrad_encode_numba",
    "int8_encode_numba",
    "int8_encode_segments_numba",
    "sign_ef_segments_numba",
    "decode_add_quant_numba",
    "int8_apply_numba",
    "sign_ef_numba",
    "threshold_ef_numba",
    "abs_select_numba",
    "orthonormalize_rows_numba",
    "quant_body_stats_numba",
]

_M32 = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)
_KEY_A = np.uint64(0x9E3779B9)
_KEY_B = np.uint64(0xBB67AE85)
_ROUND_A = np.uint64(0xD2511F53)
_ROUND_B = np.uint64(0xCD9E8D57)
_HALF = np.uint64(1 << 31)
_SCALE = np.float32(4.6566127342e-10)
_F32_TINY = np.float32(2.0**-149)  # the smallest float32 subnormal


def _jit(fn):
    return numba.njit(cache=True, nogil=True, error_model="numpy")(fn)


#: Elements a kernel handles per chunk (a multiple of 8): its draws and codes stay in cache.
_CHUNK = 1 << 14


def _fill_uniform(q0, nq, k0, k1, u):
    """``u[4 t + j]``: word ``j`` of Philox4x32-10 on the counter ``q0 + t`` (``(lo, hi, 0, 0)``)
    under the key ``(k0, k1)``, as ``tl.rand4x``'s float32: int32 bitcast, ``~x`` where negative,
    times the scale. A loop of its own, so that the compiler vectorises it."""
    for t in range(nq):
        q = np.uint64(q0 + t)
        c0 = q & _M32
        c1 = q >> _S32
        c2 = np.uint64(0)
        c3 = np.uint64(0)
        a0 = k0
        a1 = k1
        for _ in range(10):
            pb = _ROUND_B * c2
            pa = _ROUND_A * c0
            c0, c1, c2, c3 = ((pb >> _S32) ^ c1 ^ a0), (pb & _M32), ((pa >> _S32) ^ c3 ^ a1), (pa & _M32)
            a0 = (a0 + _KEY_A) & _M32
            a1 = (a1 + _KEY_B) & _M32
        for j, w in enumerate((c0, c1, c2, c3)):
            if w >= _HALF:
                w = _M32 - w
            u[4 * t + j] = np.float32(np.int64(w)) * _SCALE


def _pack(codes, m, shift, out):
    """``codes[:m]`` (each below ``2**(1 << shift)``) into ``out``, ``8 >> shift`` to a byte."""
    bits = 1 << shift
    per = 8 >> shift
    whole = m // per
    for k in range(whole):
        acc = np.uint8(0)
        row = codes[k * per : k * per + per]
        for j in range(per):
            acc |= np.uint8(row[j] << np.uint8(j * bits))
        out[k] = acc
    if whole * per < m:
        row = codes[whole * per : m]
        acc = np.uint8(0)
        for j in range(row.size):
            acc |= np.uint8(row[j] << np.uint8(j * bits))
        out[whole] = acc


def _stochastic_codes(v, scales, b, k0, k1, qsgd, s, shift, out):
    """QSGD's codes ``s + sign(v) * level`` (``qsgd``) or TernGrad's (1: ``+S_b``, 2: ``-S_b``),
    ``8 >> shift`` to a byte into ``out``: a chunk of Philox draws at a time, then each block's
    run of the chunk with its scale. (Loops index slices from 0: Numba then drops its
    negative-index checks and vectorises.)"""
    n = v.size
    sf = np.float32(s)
    zero = np.float32(0.0)
    one = np.float32(1.0)
    u = np.empty(_CHUNK + 4, dtype=np.float32)
    codes = np.empty(_CHUNK, dtype=np.uint8)
    for c0 in range(0, n, _CHUNK):
        c1 = min(n, c0 + _CHUNK)
        _fill_uniform(c0 // 4, (c1 - c0 + 3) // 4, k0, k1, u)
        i = c0
        while i < c1:
            blk = i // b
            stop = min(c1, (blk + 1) * b)
            e = scales[blk]
            vr = v[i:stop]
            ur = u[i - c0 : stop - c0]
            cr = codes[i - c0 : stop - c0]
            if qsgd:
                for t in range(vr.size):
                    x = vr[t]
                    r = abs(x) / e * sf if e > zero else zero
                    r = min(r, sf)
                    lo = np.floor(r)
                    lvl = lo + one if ur[t] < r - lo else lo
                    lvl = min(lvl, sf)
                    cr[t] = np.uint8(sf - lvl if x < zero else sf + lvl)
            else:
                for t in range(vr.size):
                    x = vr[t]
                    p = abs(x) / e if e > zero else zero
                    p = min(p, one)
                    cr[t] = (np.uint8(2) if x < zero else np.uint8(1)) if ur[t] < p else np.uint8(0)
            i = stop
        _pack(codes, c1 - c0, shift, out[c0 >> (3 - shift) :])


def _int8_codes(v, s, b, out):
    """``clamp(round(fl64(v / S_b)), -127, 127)`` (ties to even; 0 where ``S_b`` is 0), for
    finite ``v`` and ``S_b`` (the caller sends anything else to the reference), computed in
    float32, and a block with a quotient within ``2**-14`` of a half-integer again in float64.

    Why equal: the exact quotient ``t = v / S_b`` and float32's correctly rounded ``q = fl32(t)``
    differ by at most half an ulp of ``q``, ``2**-18`` where ``|q| < 128`` (and far less below);
    larger quotients clamp to 127 either way. So ``round(q)`` is ``round(t)`` unless ``t`` lies
    within ``2**-18`` of a half-integer, where ``q`` can land on or across it; such blocks are
    computed again in float64, as the reference computes every element (float64's own
    ``fl64(t)`` can round onto a half-integer too: the redone blocks match it there as well)."""
    n = v.size
    near_tie = np.float32(0.5 - 2.0**-14)
    for blk in range(s.size):
        e = s[blk]
        vr = v[blk * b : min(n, (blk + 1) * b)]
        orow = out[blk * b : min(n, (blk + 1) * b)]
        if e > np.float32(0.0):
            near = False
            for k in range(vr.size):
                q = vr[k] / e
                t = np.rint(q)
                near |= abs(q - t) >= near_tie
                orow[k] = np.int8(min(max(t, np.float32(-127.0)), np.float32(127.0)))
            if near:
                e64 = np.float64(e)
                for k in range(vr.size):
                    t64 = np.rint(np.float64(vr[k]) / e64)
                    orow[k] = np.int8(min(max(t64, -127.0), 127.0))
        else:
            for k in range(vr.size):
                orow[k] = np.int8(0)


def _block_sumsq(v, b, out):
    """Per block, the float64 sum of ``v^2`` (eight running sums, then added: the order differs
    from torch's; see the module docstring)."""
    n = v.size
    for blk in range(out.size):
        vr = v[blk * b : min(n, (blk + 1) * b)]
        m = vr.size // 8 * 8
        a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = 0.0
        for i in range(0, m, 8):
            w0 = np.float64(vr[i])
            w1 = np.float64(vr[i + 1])
            w2 = np.float64(vr[i + 2])
            w3 = np.float64(vr[i + 3])
            w4 = np.float64(vr[i + 4])
            w5 = np.float64(vr[i + 5])
            w6 = np.float64(vr[i + 6])
            w7 = np.float64(vr[i + 7])
            a0 += w0 * w0
            a1 += w1 * w1
            a2 += w2 * w2
            a3 += w3 * w3
            a4 += w4 * w4
            a5 += w5 * w5
            a6 += w6 * w6
            a7 += w7 * w7
        for i in range(m, vr.size):
            w = np.float64(vr[i])
            a0 += w * w
        out[blk] = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))


def _int8_scales(bits, out):
    """:func:`~gradzip.kernels.quant.int8_scales` of the block maxima (float32 bits, as
    :func:`_block_amax` gives them), written into ``out``. False (and nothing written) where a
    maximum is not finite: the caller takes the reference."""
    for blk in range(bits.size):
        if bits[blk] >= np.int32(0x7F800000):
            return False
    for blk in range(bits.size):
        a = np.float64(bits[blk : blk + 1].view(np.float32)[0])
        if a > 0.0:
            q = a / 127.0
            s = np.float32(q)
            if np.float64(s) * 127.0 > a:
                s = np.float32(np.nextafter(s, np.float32(0.0)))
            out[blk] = max(s, _F32_TINY)
        else:
            out[blk] = np.float32(0.0)
    return True


def _block_amax(bits, b, out):
    """Per block, ``max |v|`` as float32 bits (``bits``: ``v`` viewed as int32): the largest of
    ``bits & 0x7FFFFFFF``, so a NaN wins over every number, as torch's ``amax`` propagates it."""
    n = bits.size
    for blk in range(out.size):
        row = bits[blk * b : min(n, (blk + 1) * b)]
        m = np.int32(0)
        for i in range(row.size):
            m = max(m, row[i] & np.int32(0x7FFFFFFF))
        out[blk] = m


def _qsgd_add(out, scales, codes, b, levels, shift):
    """``out += decode(frame)`` (float32): ``(c - s) * (N_b / s)``, capped at ``N_b`` in magnitude."""
    n = out.size
    bits = 1 << shift
    per = 8 >> shift
    mask = np.uint8((1 << bits) - 1)
    s = np.float32(levels)
    tmp = np.empty(_CHUNK, dtype=np.uint8)
    for c0 in range(0, n, _CHUNK):
        c1 = min(n, c0 + _CHUNK)
        cb = codes[c0 // per : (c1 + per - 1) // per]
        for k in range(cb.size):
            byte = cb[k]
            row = tmp[k * per : k * per + per]
            for j in range(row.size):
                row[j] = (byte >> np.uint8(j * bits)) & mask
        i = c0
        while i < c1:
            blk = i // b
            stop = min(c1, (blk + 1) * b)
            se = scales[blk]
            step = se / s
            orow = out[i:stop]
            crow = tmp[i - c0 : stop - c0]
            for t in range(orow.size):
                val = (np.float32(crow[t]) - s) * step
                if abs(val) > se:
                    val = np.copysign(se, val)
                orow[t] += val
            i = stop


def _tern_add(out, scales, codes, b):
    """``out += decode(frame)`` (float32): ``[c == 1] * S_b - [c == 2] * S_b``, as the reference
    computes it (so a NaN or infinite scale gives the reference's NaNs)."""
    n = out.size
    one = np.float32(1.0)
    zero = np.float32(0.0)
    tmp = np.empty(_CHUNK, dtype=np.uint8)
    for c0 in range(0, n, _CHUNK):
        c1 = min(n, c0 + _CHUNK)
        # _qsgd_add's unpacking with its width fixed at 2 bits: written out, the compiler unrolls
        # it (a shared helper taking the width as an argument decoded TernGrad measurably slower)
        cb = codes[c0 // 4 : (c1 + 3) // 4]
        for k in range(cb.size):
            byte = cb[k]
            row = tmp[k * 4 : k * 4 + 4]
            for j in range(row.size):
                row[j] = (byte >> np.uint8(2 * j)) & np.uint8(3)
        i = c0
        while i < c1:
            blk = i // b
            stop = min(c1, (blk + 1) * b)
            se = scales[blk]
            orow = out[i:stop]
            crow = tmp[i - c0 : stop - c0]
            for t in range(orow.size):
                c = crow[t]
                pos = one if c == 1 else zero
                neg = one if c == 2 else zero
                orow[t] += pos * se - neg * se
            i = stop


def _int8_add(out, scales, codes, b, sign):
    """``out += code * S_b`` (``sign`` -1: ``out -= code * S_b``), the product in ``out``'s dtype."""
    n = out.size
    for blk in range(scales.size):
        se = scales[blk]
        orow = out[blk * b : min(n, (blk + 1) * b)]
        crow = codes[blk * b : min(n, (blk + 1) * b)]
        if sign > 0:
            for t in range(orow.size):
                orow[t] += crow[t] * se
        else:
            for t in range(orow.size):
                orow[t] -= crow[t] * se


def _compensate_abs_sums(x, r, v, b, sums):
    """``v = x + r`` (``r`` empty: ``v = x``), and per block the float64 sum of ``|v|`` (eight
    running sums, as :func:`_block_sumsq`). ``v`` may be ``x``'s or ``r``'s memory."""
    n = x.size
    add = r.size > 0
    for blk in range(sums.size):
        lo = blk * b
        hi = min(n, lo + b)
        xr = x[lo:hi]
        vr = v[lo:hi]
        if add:
            rr = r[lo:hi]
            for i in range(xr.size):
                vr[i] = xr[i] + rr[i]
        else:
            for i in range(xr.size):
                vr[i] = xr[i]
        m = vr.size // 8 * 8
        a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = 0.0
        for i in range(0, m, 8):
            a0 += np.float64(abs(vr[i]))
            a1 += np.float64(abs(vr[i + 1]))
            a2 += np.float64(abs(vr[i + 2]))
            a3 += np.float64(abs(vr[i + 3]))
            a4 += np.float64(abs(vr[i + 4]))
            a5 += np.float64(abs(vr[i + 5]))
            a6 += np.float64(abs(vr[i + 6]))
            a7 += np.float64(abs(vr[i + 7]))
        for i in range(m, vr.size):
            a0 += np.float64(abs(vr[i]))
        sums[blk] = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))


def _sign_bits_residual(v, s, b, words, residual):
    """Bit ``i`` of ``words`` (bytes, little-endian: ``pack_bits``' layout) is ``v_i < 0``; where
    ``residual`` is not empty, ``residual = v - where(v < 0, -S_b, S_b)`` (it may be ``v``)."""
    n = v.size
    keep = residual.size > 0
    for k in range(n // 8):
        row = v[8 * k : 8 * k + 8]
        acc = np.uint8(0)
        for j in range(8):
            if row[j] < np.float32(0.0):
                acc |= np.uint8(1 << j)
        words[k] = acc
    if n % 8:
        row = v[n // 8 * 8 : n]
        acc = np.uint8(0)
        for j in range(row.size):
            if row[j] < np.float32(0.0):
                acc |= np.uint8(1 << j)
        words[n // 8] = acc
    if keep:
        for blk in range(s.size):
            e = s[blk]
            vr = v[blk * b : min(n, (blk + 1) * b)]
            rr = residual[blk * b : min(n, (blk + 1) * b)]
            for i in range(vr.size):
                x = vr[i]
                rr[i] = x - (-e if x < np.float32(0.0) else e)


# The kernels call each other through the module globals Numba resolves at compile time.
if numba is not None:
    _fill_uniform = _jit(_fill_uniform)
    _pack = _jit(_pack)
    _stochastic_codes = _jit(_stochastic_codes)
    _int8_codes = _jit(_int8_codes)
    _block_sumsq = _jit(_block_sumsq)
    _block_amax = _jit(_block_amax)
    _int8_scales = _jit(_int8_scales)
    _qsgd_add = _jit(_qsgd_add)
    _tern_add = _jit(_tern_add)
    _int8_add = _jit(_int8_add)
    _compensate_abs_sums = _jit(_compensate_abs_sums)
    _sign_bits_residual = _jit(_sign_bits_residual)


def _tensor(a: np.ndarray) -> torch.Tensor:
    """``a`` as a tensor sharing its memory; an empty one as a fresh empty tensor (numpy's
    empty arrays come with stride 0, which ``Tensor.view(dtype)`` refuses)."""
    t = torch.from_numpy(a)
    return t if a.size else torch.empty(0, dtype=t.dtype)


def _float32_vector(x: torch.Tensor) -> torch.Tensor:
    """``x`` flat in its accumulation dtype (float32), contiguous, off the autograd graph;
    float64 (computed in float64 by the references only) is refused."""
    if x.device.type != "cpu":
        raise Unsupported(f"Numba kernels take CPU tensors, got {x.device.type}")
    if accum_dtype(x.dtype) != torch.float32:
        raise Unsupported(f"{x.dtype} tensors use the reference")
    return x.detach().reshape(-1).to(torch.float32).contiguous()


def _amax(v: torch.Tensor, nb: int, b: int) -> torch.Tensor:
    """float32 ``max |v|`` per block (NaN where a block holds one)."""
    bits = np.empty(nb, dtype=np.int32)
    _block_amax(v.numpy().view(np.int32), b, bits)
    return _tensor(bits.view(np.float32))


def _key(seed: int) -> tuple[np.uint64, np.uint64]:
    seed = int(seed) & ((1 << 64) - 1)
    return np.uint64(seed & 0xFFFFFFFF), np.uint64(seed >> 32)


def qsgd_encode_numba(x, levels, seed, *, block=64, bits=None, scales=None):
    """:func:`~gradzip.kernels.quant.qsgd_encode_reference`, its per-element pass compiled."""
    v = _float32_vector(x)
    n, s = v.numel(), int(levels)
    bits = bits or qsgd_bits(s)
    nb, b = quant_layout(n, block)
    if scales is None:
        sq = np.empty(nb, dtype=np.float64)
        _block_sumsq(v.numpy(), b, sq)
        sq = _tensor(sq)
        norms = qsgd_norms(sq, torch.isfinite(sq))  # a float32 block's sum is finite exactly when the block is
    else:
        norms = scales.to(device=v.device, dtype=torch.float32)
        if not bool(torch.isfinite(v).all()):  # the reference's cast of a NaN level is the platform's
            return qsgd_encode_reference(x, levels, seed, block=block, bits=bits, scales=scales)
    if not bool(torch.isfinite(norms).all()):
        return qsgd_encode_reference(x, levels, seed, block=block, bits=bits, scales=scales)
    out = np.empty((n * bits + 7) // 8, dtype=np.uint8)
    k0, k1 = _key(seed)
    _stochastic_codes(v.numpy(), norms.contiguous().numpy(), b, k0, k1, True, s, {2: 1, 4: 2, 8: 3}[bits], out)
    return norms, _tensor(out)


def terngrad_encode_numba(x, seed, *, block=None, clip=None, scales=None):
    """:func:`~gradzip.kernels.quant.terngrad_encode_reference`, its per-element pass compiled."""
    v = _float32_vector(x)
    n = v.numel()
    nb, b = quant_layout(n, block)
    if scales is None:
        amax, sq = _amax(v, nb, b), None
        if clip is not None:
            sq = np.empty(nb, dtype=np.float64)
            _block_sumsq(v.numpy(), b, sq)
            sq = _tensor(sq)
        scales = terngrad_scales(amax, sq, quant_counts(n, nb, b, v.device), clip)
    else:
        scales = scales.to(device=v.device, dtype=torch.float32)
    if not bool(torch.isfinite(scales).all()):
        return terngrad_encode_reference(x, seed, block=block, clip=clip, scales=scales)
    out = np.empty((n + 3) // 4, dtype=np.uint8)
    k0, k1 = _key(seed)
    _stochastic_codes(v.numpy(), scales.contiguous().numpy(), b, k0, k1, False, 1, 1, out)
    return scales, _tensor(out)


def int8_encode_numba(x, *, block=1024, scales=None):
    """:func:`~gradzip.kernels.quant.int8_encode_reference`: the block maxima by torch, the
    scales by :func:`~gradzip.kernels.quant.int8_scales`, the codes compiled."""
    v = _float32_vector(x)
    n = v.numel()
    nb, b = quant_layout(n, block)
    if scales is None:
        bits = np.empty(nb, dtype=np.int32)
        _block_amax(v.numpy().view(np.int32), b, bits)
        sc = np.empty(nb, dtype=np.float32)
        if not _int8_scales(bits, sc):  # a block holding inf or NaN
            return int8_encode_reference(x, block=block)
        scales = _tensor(sc)
    else:
        scales = scales.to(device=v.device, dtype=torch.float32).contiguous()
        if not (bool(torch.isfinite(scales).all()) and bool(torch.isfinite(v).all())):
            return int8_encode_reference(x, block=block, scales=scales)
    out = np.empty(n, dtype=np.int8)
    _int8_codes(v.numpy(), scales.numpy(), b, out)
    return scales, _tensor(out)


def sign_ef_segments_numba(x, bounds, *, residual=None, out=None):
    """:func:`~gradzip.kernels.quant.sign_ef_segments_reference`: each piece by :func:`sign_ef_numba`
    (whose refusals are all made here, before the first piece writes its residual)."""
    _float32_vector(x[:0])
    if residual is not None and (residual.device.type != "cpu" or residual.dtype != torch.float32):
        raise Unsupported("a float32 CPU residual")
    return sign_segments_by(
        lambda v, r, o: sign_ef_numba(v, r, new_residual=o is not None, out=o), x.detach(), bounds, residual, out
    )


def int8_encode_segments_numba(x, bounds, *, block=1024, residual=None):
    """:func:`~gradzip.kernels.quant.int8_encode_segments_reference`: each piece by
    :func:`int8_encode_numba`, its subtraction compiled from its scales and codes (``_int8_add``,
    as :func:`int8_apply_numba` subtracts a frame)."""

    def subtract(r, _body, scales, codes):
        _int8_add(r.numpy(), scales.numpy(), codes.numpy(), quant_layout(r.numel(), block)[1], -1)

    if x.device.type != "cpu" or x.dtype != torch.float32 or not x.is_contiguous():
        raise Unsupported("Numba encodes a contiguous float32 CPU tensor")
    return int8_segments_by(
        lambda v: int8_encode_numba(v, block=block),
        subtract,
        x.detach(),
        bounds,
        block,
        None if residual is None else residual.detach(),
    )


def decode_add_quant_numba(out, bodies, kind, *, block=None, levels=0, bits=None):
    """``out += decode(body_p)`` for QSGD, TernGrad and Int8 frames, peer by peer in order (each
    element gets the reference's additions); sign1 frames take the reference's table lookup."""
    if kind not in ("qsgd", "tern2", "int8"):
        raise Unsupported(f"{kind} frames decode by the reference's CPU path")
    if kind == "int8":
        int8_apply_numba(out, bodies, block=block)
        return
    if out.device.type != "cpu" or not out.is_contiguous() or out.dtype != torch.float32:
        raise Unsupported("Numba decoders take a contiguous float32 CPU tensor")
    n = out.numel()
    acc = out.numpy().reshape(-1)
    for body in bodies:
        _, b, scales, code = _split_body(body, n, kind, block, bits)
        sc, cd = scales.contiguous().numpy(), code.contiguous().numpy()
        if kind == "qsgd":
            _qsgd_add(acc, sc, cd, b, int(levels), {2: 1, 4: 2, 8: 3}[int(bits)])
        else:
            _tern_add(acc, sc, cd, b)


def decode_add_quant_segments_numba(out, bodies, starts, numels, kind, *, block=None, levels=0, bits=None):
    """:func:`~gradzip.kernels.quant.decode_add_quant_segments_reference` by the compiled
    decoders, a segment at a time (QSGD, TernGrad and Int8 frames)."""
    if kind not in ("qsgd", "tern2", "int8"):
        raise Unsupported(f"{kind} frames decode by the reference's CPU path")
    if out.device.type != "cpu" or not out.is_contiguous() or out.dtype != torch.float32:
        raise Unsupported("Numba decoders take a contiguous float32 CPU tensor")
    each_segment(decode_add_quant_numba, out, bodies, starts, numels, kind, block=block, levels=levels, bits=bits)


def int8_apply_numba(out, bodies, *, block, subtract=False):
    """:func:`~gradzip.kernels.quant.int8_apply_`: ``out += decode(body_p)`` (``subtract``:
    ``-=``) for every int8 frame in order, ``out`` a contiguous float32 or float64 CPU tensor."""
    if out.device.type != "cpu" or not out.is_contiguous() or out.dtype not in (torch.float32, torch.float64):
        raise Unsupported("Numba decoders take a contiguous float32 or float64 CPU tensor")
    n = out.numel()
    acc = out.numpy().reshape(-1)
    for body in bodies:
        _, b, scales, code = _split_body(body, n, "int8", block, None)
        sc = scales.contiguous().numpy().astype(acc.dtype)
        _int8_add(acc, sc, code.contiguous().numpy().view(np.int8), b, -1 if subtract else 1)


def sign_ef_numba(x, residual=None, *, block=None, new_residual=None, out=None, scales=None):
    """:func:`~gradzip.kernels.quant.sign_ef_reference` in two compiled passes: ``v = x + residual``
    with the block sums of ``|v|``, then the sign words and the new residual."""
    xv = _float32_vector(x)
    if residual is not None and (residual.device.type != "cpu" or residual.dtype != torch.float32):
        raise Unsupported("a float32 CPU residual")
    n = xv.numel()
    nb, b = quant_layout(n, block)
    rv = residual.detach().reshape(-1).contiguous() if residual is not None else torch.empty(0)
    want = wants_residual(residual, new_residual, out)
    v = out.view(-1) if out is not None else torch.empty(n, dtype=torch.float32)
    sums = np.empty(nb, dtype=np.float64)
    _compensate_abs_sums(xv.numpy(), rv.numpy(), v.numpy(), b, sums)
    if scales is None:
        total = _tensor(sums)
        scales = sign_scales(total, quant_counts(n, nb, b, v.device), torch.isfinite(total))
    else:
        scales = scales.to(device=v.device, dtype=torch.float32)
    words = np.zeros(4 * ((n + 31) // 32), dtype=np.uint8)
    _sign_bits_residual(
        v.numpy(), scales.contiguous().numpy(), b, words, v.numpy() if want else np.empty(0, np.float32)
    )
    return scales, _tensor(words.view(np.int32)), (out if out is not None else v) if want else None


def _threshold_pass(x, r, v, tau, bitmap, keep):
    """The fused threshold in two loops the compiler vectorises: ``v = x + r`` (``r`` empty:
    ``v = x``; ``v`` may be ``x``'s or ``r``'s memory; ``r`` and ``v`` both empty, without
    ``keep``: ``x`` is read, nothing written) with ``max |v|``; then the 2-bit codes (1
    where ``v >= tau``, 2 where ``v <= -tau``, four to a byte into ``bitmap``) and, with
    ``keep``, ``v -= sent`` in place. Returns ``(count, amax, NaN seen)``."""
    n = x.size
    zero = np.float32(0.0)
    amax = np.float32(0.0)
    nan = False
    if r.size > 0:
        for i in range(n):
            w = x[i] + r[i]
            v[i] = w
            amax = max(amax, abs(w))
            nan |= w != w
    elif v.size > 0:
        for i in range(n):
            w = x[i]
            v[i] = w
            amax = max(amax, abs(w))
            nan |= w != w
    else:  # no residual, none wanted: the codes come from x itself
        v = x
        for i in range(n):
            w = x[i]
            amax = max(amax, abs(w))
            nan |= w != w
    count = 0
    for k in range((n + 3) // 4):
        row = v[4 * k : min(n, 4 * k + 4)]
        byte = np.uint8(0)
        for j in range(row.size):
            w = row[j]
            pos = w >= tau
            neg = w <= -tau
            byte |= np.uint8((1 if pos else (2 if neg else 0)) << (2 * j))
            count += 1 if (pos or neg) else 0
            if keep:
                row[j] = w - (tau if pos else (-tau if neg else zero))
        bitmap[k] = byte
    return count, amax, nan


def _bitmap_words(bitmap, n, words):
    """``FMT_SIGNED_INDEX`` words of a 2-bit map: each set position ``i`` ascending, as ``i``, or
    ``i - 2**31`` (bit 31 set) where its code is 2 (``-tau``)."""
    k = 0
    for b in range(bitmap.size):
        byte = bitmap[b]
        if byte:
            for j in range(4):
                code = (byte >> np.uint8(2 * j)) & np.uint8(3)
                i = 4 * b + j
                if code and i < n:
                    words[k] = np.int32(i - 2147483648) if code == 2 else np.int32(i)
                    k += 1


if numba is not None:
    _threshold_pass = _jit(_threshold_pass)
    _bitmap_words = _jit(_bitmap_words)


def _abs_select(v, thr, out):
    """The ascending indices ``i`` with ``|v[i]| >= thr`` into ``out`` while it has room;
    returns how many there are (more than ``out.size``: ``out`` holds the first ones only)."""
    k = 0
    cap = out.size
    for i in range(v.size):
        if abs(v[i]) >= thr:
            if k < cap:
                out[k] = i
            k += 1
    return k


if numba is not None:
    _abs_select = _jit(_abs_select)


def abs_select_numba(v, thr, expected=None):
    """:func:`~gradzip.kernels.reference.abs_select_reference` in one compiled pass (a second
    where more than the buffer sized from ``expected`` reach ``thr``), float32 only: the
    reference compares in ``v``'s dtype, and a float16 or bfloat16 ``thr`` would round."""
    if v.device.type != "cpu" or v.dtype != torch.float32:
        raise Unsupported("float32 CPU tensors")
    x = v.detach().reshape(-1).contiguous().numpy()
    t = np.float32(thr.item() if isinstance(thr, torch.Tensor) else float(thr))
    cap = x.size if expected is None else min(x.size, 2 * int(expected) + 1024)
    out = np.empty(cap, dtype=np.int64)
    k = _abs_select(x, t, out)
    if k > cap:
        out = np.empty(k, dtype=np.int64)
        _abs_select(x, t, out)
    return _tensor(out[:k].copy() if k < cap // 2 else out[:k])


class NumbaThresholdResult(ThresholdResult):
    """A threshold pass's stats, 2-bit map and residual, computed by :func:`_threshold_pass`."""

    backend = "numba"

    def __init__(self, n, tau, residual, bitmap, count, amax):
        super().__init__(n, tau, residual)
        self._bitmap = bitmap
        self._stats = (count, amax)

    def _fetch_stats(self):
        return self._stats

    def bitmap(self):
        return self._bitmap

    def indices(self):
        self._check_indexable()
        words = np.empty(self._stats[0], dtype=np.int32)
        _bitmap_words(self._bitmap.numpy(), self.n, words)
        return _tensor(words)


def threshold_ef_numba(x, tau, residual=None, *, new_residual=None, out=None):
    """:func:`~gradzip.kernels.reference.threshold_ef_reference` in one compiled pass (``tau``
    compared and sent in float32, as the reference's float32 ``v >= tau`` and ``pos * tau``)."""
    xv = _float32_vector(x)
    if residual is not None and (residual.device.type != "cpu" or residual.dtype != torch.float32):
        raise Unsupported("a float32 CPU residual")
    n = xv.numel()
    rv = residual.detach().reshape(-1).contiguous() if residual is not None else torch.empty(0)
    want = wants_residual(residual, new_residual, out)
    if out is not None:
        v = out.view(-1)
    elif want or residual is not None:
        v = torch.empty(n, dtype=torch.float32)
    else:  # nothing to keep: the pass reads x and writes no copy of it
        v = torch.empty(0, dtype=torch.float32)
    bitmap = np.zeros((n + 3) // 4, dtype=np.uint8)
    count, amax, nan = _threshold_pass(xv.numpy(), rv.numpy(), v.numpy(), np.float32(tau), bitmap, want)
    result = (out if out is not None else v) if want else None
    return NumbaThresholdResult(n, tau, result, _tensor(bitmap), int(count), float("nan") if nan else float(amax))


# -- orthonormal rows (PowerSGD) ---------------------------------------------------------------


def _lanesum(a, b, acc):
    """:func:`~gradzip.kernels.orth.lanesum_reference` of ``a * b`` (float32 rows, products
    in float64), with ``acc`` (float64, ``LANES`` long) as scratch."""
    lanes = acc.size
    for t in range(lanes):
        acc[t] = 0.0
    n = a.size
    full = n // lanes
    for blk in range(full):
        base = blk * lanes
        for t in range(lanes):
            acc[t] += np.float64(a[base + t]) * np.float64(b[base + t])
    base = full * lanes
    for t in range(n - base):
        acc[t] += np.float64(a[base + t]) * np.float64(b[base + t])
    h = lanes // 2
    while h >= 1:
        for t in range(h):
            acc[t] += acc[t + h]
        h //= 2
    return acc[0]


def _orth_rows(buf, table, eps, has_eps, tiny, acc):
    """Every matrix of ``table`` (rows ``offset, k, n``) in ``buf`` (float32): the module
    docstring of :mod:`gradzip.kernels.orth`, each float32 step rounded from float64 (exact
    for products; one rounding of the exact value for quotients, differences and square roots)."""
    for m in range(table.shape[0]):
        off, k, n = table[m, 0], table[m, 1], table[m, 2]
        passes = 2 if k > 2 else 1
        for _ in range(passes):
            for i in range(k):
                ri = buf[off + i * n : off + (i + 1) * n]
                norm = np.float32(np.sqrt(_lanesum(ri, ri, acc)))
                if has_eps:
                    norm = np.float32(np.float64(norm) + np.float64(eps))
                elif norm < tiny:
                    norm = tiny
                wn = np.float64(norm)
                for t in range(n):
                    ri[t] = np.float32(np.float64(ri[t]) / wn)
                for j in range(i + 1, k):
                    rj = buf[off + j * n : off + (j + 1) * n]
                    d = np.float64(np.float32(_lanesum(ri, rj, acc)))
                    for t in range(n):
                        p = np.float64(np.float32(d * np.float64(ri[t])))
                        rj[t] = np.float32(np.float64(rj[t]) - p)


if numba is not None:
    _lanesum = _jit(_lanesum)
    _orth_rows = _jit(_orth_rows)


def orthonormalize_rows_numba(buf, table, eps=0.0):
    """:func:`~gradzip.kernels.orth.orthonormalize_rows_reference` compiled, on a float32 CPU buffer."""
    if buf.device.type != "cpu" or buf.dtype != torch.float32 or not buf.is_contiguous():
        raise Unsupported("a contiguous float32 CPU buffer")
    rows = np.asarray(table, dtype=np.int64).reshape(-1, 3)
    acc = np.empty(LANES, dtype=np.float64)
    tiny = np.float32(np.finfo(np.float32).tiny)
    _orth_rows(buf.detach().numpy(), rows, np.float32(eps), float(eps) > 0, tiny, acc)


# -- frame body checks --------------------------------------------------------------------------


def _packed_top(codes, bits):
    """The largest ``bits``-bit code in whole bytes (2-, 4- or 8-bit codes), a branch-free
    loop per width so that the compiler vectorizes the byte reduction."""
    top = np.uint8(0)
    if bits == 8:
        for t in range(codes.size):
            top = max(top, codes[t])
    elif bits == 4:
        for t in range(codes.size):
            b = codes[t]
            top = max(top, max(b & np.uint8(15), b >> np.uint8(4)))
    else:
        for t in range(codes.size):
            b = codes[t]
            lo = max(b & np.uint8(3), (b >> np.uint8(2)) & np.uint8(3))
            hi = max((b >> np.uint8(4)) & np.uint8(3), b >> np.uint8(6))
            top = max(top, max(lo, hi))
    return np.int64(top)


def _body_stats(whole, offs, nbs, ns, cbs, kind, bits, out):
    """:func:`~gradzip.kernels.quant.quant_body_stats_reference` in one pass over the frames'
    bytes (those between frames unread): ``out[0]`` 1 where a block scale is negative (sign
    bit set, not -0.0, not NaN), ``out[1]`` the largest code (``kind`` 0, Int8: 1 where a code
    byte is 0x80; 1, sign: 0; 2, packed ``bits``-bit codes: the largest of each frame's ``n``
    codes). Scales are read little-endian, as torch's float32 view on this host."""
    neg = 0
    top = 0
    per = 8 // bits if bits <= 8 else 1
    mask = (1 << bits) - 1
    for f in range(nbs.size):
        off, nb, n, cb = offs[f], nbs[f], ns[f], cbs[f]
        for s in range(nb):
            p = off + 4 * s
            u = (
                np.int64(whole[p])
                | (np.int64(whole[p + 1]) << 8)
                | (np.int64(whole[p + 2]) << 16)
                | (np.int64(whole[p + 3]) << 24)
            )
            mag = u & 0x7FFFFFFF
            if (u >> 31) and mag != 0 and mag <= 0x7F800000:
                neg = 1
        c0 = off + 4 * nb
        codes = whole[c0 : c0 + cb]
        if kind == 0:
            hit = 0
            for t in range(cb):
                hit |= codes[t] == 0x80
            if hit:
                top = 1
        elif kind == 2:
            full = n // per
            top = max(top, _packed_top(codes[:full], bits))
            if n - full * per:
                b = np.int64(codes[full])
                for k in range(n - full * per):
                    top = max(top, (b >> (k * bits)) & mask)
    out[0] = neg
    out[1] = top


if numba is not None:
    _packed_top = _jit(_packed_top)
    _body_stats = _jit(_body_stats)

_BODY_KINDS = {"int8": 0, "sign1": 1, "qsgd": 2, "tern2": 2}


def quant_body_stats_numba(whole, frames, kind, bits):
    """:func:`~gradzip.kernels.quant.quant_body_stats_reference` compiled, for bodies on the CPU."""
    if whole.device.type != "cpu":
        raise Unsupported(f"Numba kernels take CPU tensors, got {whole.device.type}")
    rows = np.asarray(frames, dtype=np.int64).reshape(-1, 3)
    offs, nbs, ns = rows[:, 0].copy(), rows[:, 1].copy(), rows[:, 2].copy()
    cbs = np.array([quant_code_bytes(kind, int(n), bits) for n in ns], dtype=np.int64)
    out = np.zeros(2, dtype=np.int64)
    _body_stats(whole.detach().numpy(), offs, nbs, ns, cbs, _BODY_KINDS[kind], int(bits), out)
    return torch.from_numpy(out)
