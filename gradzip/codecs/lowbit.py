"""Low-bit quantizers: block-wise Int4, Int2, FP8 (E4M3) and FP4 (E3M0), with error feedback.

For gradients (the DDP hook and the other front ends) and for DiLoCo's pseudo-gradients
(``LocalSGD``/``DiLoCo``'s ``compression=``). Like :class:`~gradzip.codecs.quant.Int8`, each
splits the flattened tensor into ``nb = ceil(n / B)`` blocks of ``B = block`` elements
(``block=None``: one block; the last block may be short) and sends one float32 scale ``S_b``
per block plus a few bits per element. Rounding is deterministic, to the nearest value of
the grid: the codecs are ``biased`` (error feedback on by default) and ``fixed_frames`` (a
frame's length follows from the tensor's shape alone).

Frames (``gradzip.wire`` framing; header ``vdtype`` = float32, the scales' dtype; no entry
scale). Every body is the ``nb`` little-endian float32 scales, then the codes, packed as
:func:`gradzip.kernels.bitpack.pack_nbit` packs them (element ``i`` is the ``bits``-bit field
at bit ``bits * (i % (8 // bits))`` of byte ``i // (8 // bits)``; the unused high fields of the
last byte are zero):

======  ====  ====  ==========================================================================
format  code  bits  code ``c`` of element i in block b, and its value
======  ====  ====  ==========================================================================
INT4    26    4     4-bit two's complement ``q`` in [-7, 7]: ``q * S_b``, ``S_b = max|x| / 7``;
                    ``c = 8`` (-8) is never written
INT2    27    2     ``c`` in 0..3: ``(2c - 3) * S_b``, the levels ``{-3, -1, +1, +3} * S_b``,
                    ``S_b = max|x| / 3``
FP8     28    8     a ``float8_e4m3fn`` byte ``f``: ``f * S_b``, ``S_b = max|x| / 448``;
                    the NaN codes ``0x7F``, ``0xFF`` and negative zero ``0x80`` are never written
FP4     29    4     sign (bit 3) and exponent ``e`` (bits 0-2): ``e = 0`` is zero, else
                    ``+-2**(e - 7) * S_b`` (``2**-6 .. 1`` times ``S_b = max|x|``); ``c = 8``
                    (negative zero) is never written
======  ====  ====  ==========================================================================

Body bytes of a tensor of ``n`` elements: ``4 * nb + ceil(n * bits / 8)``, plus its 6-byte
entry in the message. Bits per element, scales included, at the default blocks: Int4 4.5
(7.1x against float32), Int2 2.5 (12.8x), FP8 8.25 (3.9x), FP4 4.5 (7.1x).

**Blocks.** Int4, Int2 and FP4 default to ``B = 64``: their grids are coarse, and an
outlier costs its whole block (a block's small elements round to zero), so blocks stay
small, for 0.5 bit of scale per element. FP8 defaults to ``B = 128``: e4m3 carries its own
exponent (``448 / 2**-9``, about ``2**18`` of range inside a block), so the scale only places
the block and a longer block costs little accuracy: 0.25 bit of scale per element.

**Int2's levels.** Two bits give four codes. The four offset levels ``{-3, -1, +1, +3} * S_b``
(a uniform grid without zero) beat the ternary ``{-1, 0, +1} * max|x|`` with a fourth code
corrupt: on gaussian blocks of 64, relative squared error 0.25 against 0.52 for one
tensor, and under error feedback (200 steps of fresh gaussian gradients) a residual holding
0.33 of a gradient's energy against 0.98. The price: a zero element is sent as ``+S_b``
(``keeps_zeros`` is false, as for SignSGD); an all-zero block (``S_b = 0``) still decodes to
zeros.

**Rounding.** Element ``x`` is divided by its block's scale in the accumulation dtype
(float32, or float64 for float64 tensors): ``t = x / S_b`` (``t = 0`` where ``S_b = 0``).

* Int4: ``q = round(t)`` (ties to even), clamped to [-7, 7]: ``|x - d| <= S_b / 2``.
* Int2: ``q = sign(t) * (1 if |t| < 2 else 3)`` (zero as ``+``): ``|x - d| <= S_b``, half
  of the grid's step ``2 S_b``.
* FP8: ``t`` clamped to [-448, 448], cast to ``float8_e4m3fn`` (round to nearest even, what
  torch's cast does): ``|x - d| <= 2**-4 |x|`` where ``|t| >= 2**-6`` (e4m3's normals),
  ``<= 2**-10 S_b`` below.
* FP4: the nearest of ``0, 2**-6, .., 2**0`` to ``|t|`` (in value, not in log2: what error
  feedback wants), ties to the smaller: ``d / x`` in ``[2/3, 4/3]`` where ``|t| >= 2**-6``,
  ``|x - d| <= 2**-7 S_b`` below.

Each bound holds up to the rounding of ``t`` and of the decoded product (relative
``2**-24`` in float32) where the scale is a normal float32.

**Scales.** ``S_b = max|x| / top`` (``top`` = 7, 3, 448, 1) in float64, rounded to float32
and then down by one ulp where ``top * S_b`` would exceed ``max|x|`` (no value beyond the
grid), at least the smallest float32 subnormal where ``max|x| > 0``. Every scale sent is
finite and not negative: a block whose scale would be infinite or NaN (a non-finite
element, which the engine catches on its own; a float64 block beyond float32's range) is
sent with scale 0 and decodes to zeros, and error feedback keeps it whole.

**Exactness of the residual.** Error feedback stores ``r = c - d`` (``c`` compensated,
``d`` decoded). For Int4, FP8 and FP4 the subtraction is exact, so ``r + d == c`` bit for
bit: round to nearest gives ``d = 0`` or ``d / c`` in ``[1/2, 2]`` (Int4 as Int8; FP8 and FP4
by their grids, the smallest nonzero level taken only above half of it), and Sterbenz's
lemma makes ``c - d`` exact; where the decoded product underflows, ``c`` and ``d`` are both
below ``2**-125`` with one sign and their difference is representable. Int2 sends ``+-S_b``
for an element near zero, so ``c - d`` may need more than 24 bits: ``r`` is ``c - d``
correctly rounded (half an ulp of ``r``), as for SignSGD.

**Frame checks** (:meth:`check_frame`; :meth:`check_frames` reads a message's frames with one
host sync): the format, value dtype float32, no entry scale, the exact body length from the
shape; then scales finite and without a sign bit (``body.scales``), zero padding bits in the
last code byte (``body.padding``) and no code the encoder never writes (``body.codes``).
Every refusal is a :class:`~gradzip.wire.FrameError` naming the field.

Pure PyTorch, on any device: the CPU path and the oracle of kernels to come. The encoders
and decoders make no host sync; the frame checks make one per message.
"""

from __future__ import annotations

import torch

import gradzip.args as args
import gradzip.kernels as K

from ..kernels.bitpack import packed_nbytes, unpack_nbit
from ..wire import FrameError, Payload, accum_dtype, as_bytes, from_bytes, host_values, narrow
from .base import (
    Codec,
    MessageChecks,
    TensorContext,
    check_format,
    check_input,
    check_length,
    check_no_scale,
    check_vdtype,
)

__all__ = ["Int4", "Int2", "FP8", "FP4", "FMT_INT4", "FMT_INT2", "FMT_FP8", "FMT_FP4"]

FMT_INT4 = 26
FMT_INT2 = 27
FMT_FP8 = 28
FMT_FP4 = 29

_F32_MAX = 3.4028234663852886e38
_F32_TINY = 2.0**-149  # the smallest float32 subnormal
_E4M3_MAX = 448.0


def _block(block) -> int | None:
    return args.optional(args.integer, "block", block, 1, 2**31 - 1)


def block_scales(amax: torch.Tensor, top: float) -> torch.Tensor:
    """float32 ``S_b = amax / top`` (see the module docstring): rounded once from float64, then
    down by one ulp where ``top * S_b > amax``; at least the smallest subnormal where ``amax > 0``;
    0 where ``amax`` is 0, NaN, infinite, or ``amax / top`` exceeds float32's range."""
    a = amax.to(torch.float64)
    s = (a / top).to(torch.float32)
    over = s.to(torch.float64) * top > a
    s = torch.where(over, torch.nextafter(s, torch.zeros_like(s)), s).clamp_(min=_F32_TINY)
    ok = (a > 0) & torch.isfinite(a) & (a / top <= _F32_MAX)
    return torch.where(ok, s, torch.zeros_like(s))


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 ``codes`` below ``2**bits`` (2, 4 or 8) packed as ``bitpack.pack_nbit`` packs them,
    by uint8 shifts: no int64 temporaries, no host sync (codes are not checked here)."""
    if bits == 8:
        return codes
    per = 8 // bits
    n = codes.numel()
    full = -(-n // per) * per
    if full != n:
        codes = torch.cat([codes, codes.new_zeros(full - n)])
    cols = codes.view(-1, per)
    out = cols[:, 0].clone()
    for k in range(1, per):
        out.bitwise_or_(cols[:, k] << (k * bits))
    return out


def _per_element(scales: torch.Tensor, n: int, b: int) -> torch.Tensor:
    """Each block's scale repeated over its elements (the first ``n``)."""
    return scales.reshape(-1, 1).expand(-1, b).reshape(-1)[:n]


class _LowBit(MessageChecks, Codec):
    """Blockwise scales and packed codes: encoding, decoding and the frame checks, shared."""

    fixed_frames = True  # nb float32 scales, then the codes: lengths from n alone
    _fmt = 0
    _label = ""
    _bits = 4
    _top = 1.0  # S_b = max|x| / _top

    def __init__(self, *, block: int | None = 64) -> None:
        self.block = _block(block)

    # -- the grid: what subclasses define ----------------------------------------------
    def _codes(self, t: torch.Tensor) -> torch.Tensor:
        """uint8 codes of ``t = x / S_b`` (0 where ``S_b`` is 0)."""
        raise NotImplementedError

    def _levels(self, codes: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
        """The values of uint8 ``codes`` in units of ``S_b``, in ``acc``."""
        raise NotImplementedError

    def _bad_bytes(self, codes: torch.Tensor) -> torch.Tensor | None:
        """Per packed byte, whether it holds a code no encoder writes (None: every code is one)."""
        return None

    _bad_what = ""

    # -- encoding ----------------------------------------------------------------------
    def _code_bytes(self, n: int) -> int:
        return packed_nbytes(n, self._bits)

    def compress(self, x: torch.Tensor, ctx: TensorContext | None = None) -> Payload:
        check_input(x)
        v = x.reshape(-1).to(accum_dtype(x.dtype))
        n = v.numel()
        nb, b = K.quant_layout(n, self.block)
        if n:
            a = v.abs()
            if nb * b != n:
                a = torch.cat([a, a.new_zeros(nb * b - n)])
            scales = block_scales(a.view(nb, b).amax(dim=1), self._top)
            se = _per_element(scales.to(v.dtype), n, b)
            t = torch.where(se > 0, v / se, torch.zeros_like(v))
            codes = pack_codes(self._codes(t), self._bits)
        else:
            scales = torch.zeros(0, dtype=torch.float32, device=x.device)
            codes = torch.zeros(0, dtype=torch.uint8, device=x.device)
        body = torch.cat([as_bytes(scales), codes])
        return Payload(body=body, shape=x.shape, dtype=x.dtype, fmt=self._fmt, vdtype=torch.float32)

    # -- decoding ----------------------------------------------------------------------
    def _split(self, payload: Payload) -> tuple[int, int, torch.Tensor, torch.Tensor]:
        nb, b = K.quant_layout(payload.numel, self.block)
        body = as_bytes(payload.body)
        return nb, b, body[: 4 * nb], body[4 * nb :]

    def _values(self, payload: Payload, acc: torch.dtype) -> torch.Tensor:
        """The ``n`` decoded values of a checked frame, flat, in ``acc`` (float32 or float64)."""
        n = payload.numel
        nb, b, raw_scales, packed = self._split(payload)
        if n == 0:
            return torch.zeros(0, dtype=acc, device=payload.body.device)
        codes = packed[:n] if self._bits == 8 else unpack_nbit(packed, n, self._bits)
        scales = from_bytes(raw_scales, torch.float32).to(acc)
        return self._levels(codes, acc) * _per_element(scales, n, b)

    def _ready(self, payloads) -> None:
        """Check every payload that no protocol has checked, all of them with one host sync."""
        todo = [p for p in payloads if not p.checked]
        if not todo:
            return
        bad = self._first_bad(todo)
        if bad is not None:
            raise bad[1].at(rank=bad[0]) if len(todo) > 1 else bad[1]

    def decompress(self, payload: Payload) -> torch.Tensor:
        self._ready([payload])
        return narrow(self._values(payload, accum_dtype(payload.dtype)), payload.dtype).reshape(payload.shape)

    def accumulate(self, payload: Payload, out: torch.Tensor) -> None:
        self.accumulate_many([payload], out)

    def accumulate_many(self, payloads, out: torch.Tensor) -> None:
        """``out += decode(p)`` for every peer's payload in rank order (values in ``out``'s dtype
        where it is float32 or float64, else float32)."""
        payloads = list(payloads)
        for p in payloads:
            if p.numel != out.numel():
                raise ValueError(f"a frame of {p.numel} elements decoded into {out.numel()}")
        self._ready(payloads)
        acc = out.dtype if out.dtype in (torch.float32, torch.float64) else torch.float32
        for p in payloads:
            out.add_(self._values(p, acc).view(out.shape))

    def subtract(self, payload: Payload, v: torch.Tensor) -> None:
        """``v -= decompress(payload)``, the values in ``v``'s dtype (exact for Int4, FP8, FP4:
        see the module docstring)."""
        self._ready([payload])
        acc = v.dtype if v.dtype in (torch.float32, torch.float64) else torch.float32
        v.sub_(self._values(payload, acc).view(v.shape).to(v.dtype))

    # -- distrusting frames ------------------------------------------------------------
    def _first_bad(self, payloads) -> tuple[int, FrameError] | None:
        """The first frame (in order) that no encoder of this configuration writes, and why:
        its format, value dtype, scale and length (on the host), then, for the frames before the
        first malformed one, the bodies: all of them in one pass and one host sync, and only
        where that finds something, frame by frame (a second sync) to name the frame."""
        header, good = None, []
        for i, p in enumerate(payloads):
            try:
                check_format(self, p, (self._fmt,))
                check_vdtype(self, p, (torch.float32,))
                check_no_scale(self, p)
                nb, _ = K.quant_layout(p.numel, self.block)
                check_length(self, p, 4 * nb + self._code_bytes(p.numel))
            except FrameError as e:
                header = (i, e)
                break
            if p.body.numel():
                good.append((i, p))
        if not good:
            return header
        flags = self._body_flags([p for _, p in good])
        if not any(host_values(torch.stack(flags))):
            return header
        # Something is wrong in the bodies: find the first frame, frame by frame (one more sync).
        rows = host_values(torch.stack([torch.stack(self._body_flags([p])) for _, p in good]).reshape(-1))
        why = f"corrupt {self._label} frame: "
        for j, (i, _) in enumerate(good):
            scales_bad, padding_bad, codes_bad = rows[3 * j : 3 * j + 3]
            if scales_bad:
                return i, FrameError("body.scales", why + "a block scale that is not finite, or negative")
            if padding_bad:
                return i, FrameError("body.padding", why + "padding bits set after the last code")
            if codes_bad:
                return i, FrameError("body.codes", why + self._bad_what)
        return header

    def _body_flags(self, payloads: list[Payload]) -> list[torch.Tensor]:
        """Three 0-d bool tensors over the bodies of ``payloads`` (lengths checked): a scale
        that is not finite or has its sign bit set; set padding bits; a code never written."""
        device = payloads[0].body.device
        scale_parts, code_parts, ends, pad_masks = [], [], [], []
        pos = 0
        per = 8 // self._bits
        for p in payloads:
            nb, _, raw_scales, packed = self._split(p)
            scale_parts.append(raw_scales)
            code_parts.append(packed)
            pos += packed.numel()
            used = p.numel % per
            if used:
                ends.append(pos - 1)
                pad_masks.append((0xFF << (used * self._bits)) & 0xFF)
        scales = torch.cat(scale_parts).view(torch.float32)
        codes = torch.cat(code_parts)
        no = torch.zeros((), dtype=torch.bool, device=device)
        scales_bad = (torch.signbit(scales) | ~torch.isfinite(scales)).any() if scales.numel() else no
        if ends:
            at = K.host_to_device(torch.tensor(ends, dtype=torch.int64), device)
            masks = K.host_to_device(torch.tensor(pad_masks, dtype=torch.uint8), device)
            padding_bad = (codes[at] & masks).ne(0).any()
        else:
            padding_bad = no
        bad = self._bad_bytes(codes) if codes.numel() else None
        codes_bad = bad.any() if bad is not None else no
        return [scales_bad, padding_bad, codes_bad]


class Int4(_LowBit):
    """Block-wise absmax int4: ``S_b = max|x| / 7`` (float32), ``q = round(x / S_b)`` in [-7, 7].

    Wire: ``FMT_INT4``, ``4 * ceil(n / B) + ceil(n / 2)`` bytes of body (4.5 bits per element at
    ``B = 64``). Error feedback on by default; the residual is exact.

    Args:
        block: elements per scale, an integer >= 1; ``None``: one scale per tensor.
    """

    formats = {"INT4": FMT_INT4}
    _fmt, _label, _bits, _top = FMT_INT4, "Int4", 4, 7.0
    _bad_what = "code 8 (-8)"

    def _codes(self, t):
        q = t.round().clamp_(-7, 7).to(torch.int16)
        return (q & 0xF).to(torch.uint8)  # two's complement nibble

    def _levels(self, codes, acc):
        c = codes.to(torch.int16)
        return (c - ((c & 8) << 1)).to(acc)  # c >= 8: c - 16

    def _bad_bytes(self, codes):
        return ((codes & 0xF) == 8) | ((codes >> 4) == 8)


class Int2(_LowBit):
    """Block-wise 2-bit quantizer on the offset levels ``{-3, -1, +1, +3} * S_b``, ``S_b = max|x| / 3``.

    An element goes to the nearest level (``|x| < 2 S_b``: ``+-S_b``; zero as ``+S_b``): the
    module docstring says why these levels and not ``{-1, 0, +1}``. Wire: ``FMT_INT2``,
    ``4 * ceil(n / B) + ceil(n / 4)`` bytes of body (2.5 bits per element at ``B = 64``).
    Error feedback on by default; the residual is ``c - d`` correctly rounded.

    Args:
        block: elements per scale, an integer >= 1; ``None``: one scale per tensor.
    """

    keeps_zeros = False  # a zero element is sent as +S_b
    formats = {"INT2": FMT_INT2}
    _fmt, _label, _bits, _top = FMT_INT2, "Int2", 2, 3.0

    def _codes(self, t):
        big = t.abs() >= 2
        neg = t < 0
        return torch.where(neg, torch.where(big, 0, 1), torch.where(big, 3, 2)).to(torch.uint8)

    def _levels(self, codes, acc):
        return (codes.to(torch.int16) * 2 - 3).to(acc)


class FP8(_LowBit):
    """Block-wise FP8 (E4M3): ``S_b = max|x| / 448`` (float32), ``x / S_b`` cast to ``float8_e4m3fn``
    (round to nearest even, saturating at +-448).

    Wire: ``FMT_FP8``, ``4 * ceil(n / B) + n`` bytes of body (8.25 bits per element at
    ``B = 128``). Error feedback on by default; the residual is exact.

    Args:
        block: elements per scale, an integer >= 1; ``None``: one scale per tensor.
    """

    formats = {"FP8": FMT_FP8}
    _fmt, _label, _bits, _top = FMT_FP8, "FP8", 8, _E4M3_MAX
    _bad_what = "a NaN code (0x7F, 0xFF) or negative zero (0x80)"

    def __init__(self, *, block: int | None = 128) -> None:
        super().__init__(block=block)

    def _codes(self, t):
        c = t.clamp(-_E4M3_MAX, _E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
        return torch.where(c == 0x80, 0, c).to(torch.uint8)  # zero as +0

    def _levels(self, codes, acc):
        return codes.contiguous().view(torch.float8_e4m3fn).to(acc)

    def _bad_bytes(self, codes):
        return ((codes & 0x7F) == 0x7F) | (codes == 0x80)


class FP4(_LowBit):
    """Block-wise FP4 (E3M0, Streaming DiLoCo's format): a sign and a 3-bit exponent, no mantissa.

    ``S_b = max|x|`` (float32); an element goes to the nearest (in value) of ``0`` and
    ``+-2**k * S_b``, ``k = -6 .. 0``, ties to the smaller. Wire: ``FMT_FP4``,
    ``4 * ceil(n / B) + ceil(n / 2)`` bytes of body (4.5 bits per element at ``B = 64``).
    Error feedback on by default; the residual is exact.

    Args:
        block: elements per scale, an integer >= 1; ``None``: one scale per tensor.
    """

    formats = {"FP4": FMT_FP4}
    _fmt, _label, _bits, _top = FMT_FP4, "FP4", 4, 1.0
    _bad_what = "code 8 (negative zero)"

    def _codes(self, t):
        a = t.abs()
        m, ex = torch.frexp(a)  # a = m * 2**ex, m in [0.5, 1)
        # the nearer of 2**(ex - 1) and 2**ex: above 0.75 * 2**ex, the upper one
        e = (torch.where(m > 0.75, ex, ex - 1) + 7).clamp_(1, 7)
        e = torch.where(a > 2.0**-7, e, 0)  # at most half of 2**-6: zero
        sign = torch.where((t < 0) & (e > 0), 8, 0)
        return (e | sign).to(torch.uint8)

    def _levels(self, codes, acc):
        c = codes.to(torch.int32)
        e = c & 7
        mag = ((e + 120) << 23).view(torch.float32)  # 2**(e - 7) by its float32 bits
        mag = torch.where(e == 0, 0.0, mag)
        return torch.where(c >= 8, -mag, mag).to(acc)

    def _bad_bytes(self, codes):
        return ((codes & 0xF) == 8) | ((codes >> 4) == 8)
