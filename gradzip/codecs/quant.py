"""Quantizers: scaled sign (SignSGD), QSGD, TernGrad and block-wise int8.

Every quantizer splits the flattened tensor into blocks of ``block`` elements
(``block=None``: the whole tensor is one block; the last block may be short)
and sends one float32 scale per block plus a few bits per element. The math is
in :mod:`gradzip.kernels` (one implementation each: the reference is the CPU
path and the oracle, the Triton kernels are bit-identical to it); this module
frames the kernels' output and validates frames before decoding them.

Frames (``gradzip.wire`` framing; header ``vdtype`` = float32, the dtype of the
scales). Every body is ``nb`` little-endian float32 scales, ``nb = ceil(n / B)``,
then the packed codes of :mod:`gradzip.kernels.bitpack`:

=========  ====  ===========================================================
format     code  codes after the scales; value of element i in block b
=========  ====  ===========================================================
SIGN1      16    1 bit, 32 to an int32 word; bit 1 -> ``-S_b``, 0 -> ``+S_b``
QSGD       17    ``2s+1`` codes ``c`` in 2, 4 or 8 bits; ``(c - s) / s * N_b``;
                 the header's f32 scale holds ``s``
TERN2      18    2 bits; 0 -> 0, 1 -> ``+S_b``, 2 -> ``-S_b`` (3 is corrupt)
INT8       19    one int8 ``q`` per element; ``q * S_b``
=========  ====  ===========================================================

Bytes per tensor of ``n`` elements: ``4 * nb + packed`` in the body, plus its 6-byte
frame entry in the message (see ``gradzip.wire``; bodies lie back to back, unpadded).

Scales are finite float32 for every finite input: a block whose scale would
exceed float32's range (a float64 gradient beyond it, or the norm of float32
values near the maximum) is sent as zero, and error feedback keeps it whole.

Bias and error feedback (the engine turns error feedback on for ``biased``):

* :class:`SignSGD`, :class:`Int8`: biased, error feedback on by default. SignSGD
  encodes with the fused one-pass kernel ``kernels.sign_ef``, which updates the
  residual in the same pass.
* :class:`QSGD`, :class:`TernGrad` (without ``clip``): unbiased stochastic
  rounding, off by default; both work with it on. ``TernGrad(clip=c)`` is
  unbiased for the *clipped* tensor only, so it reports ``biased`` and error
  feedback keeps what clipping removed.

Exactness of the residual: error feedback stores ``r = c - d`` (``c`` the
compensated input, ``d`` the decoded value). For :class:`Int8` this
subtraction is always exact (round to nearest keeps ``d = 0`` or
``d / c`` in ``[1/2, 2]``, Sterbenz), so ``r + d == c`` exactly. The others
may send a value far larger than ``c`` (a sign of size ``S_b`` for a tiny
``c``), and then ``c - d`` can need more than 24 bits: ``r`` is ``c - d``
correctly rounded, off by at most half an ulp of ``r``.

Randomness (QSGD, TernGrad): one Philox4x32 draw per element keyed with
:func:`philox_seed` (``tensor_seed(seed, step, name)`` mixed with the rank), on
every device: ranks draw independently, a run is reproducible, and a step's
frame is the same on the CPU and on a GPU. An element rounds up iff ``u < frac``
(its fractional level), with probability ``frac`` up to the 2**-24 grid of the
float32 draws: unbiased.
"""

from __future__ import annotations

import torch

import gradzip.args as args
import gradzip.kernels as K

from ..kernels.bitpack import packed_nbytes, unpack_nbit
from ..wire import FrameError, Payload, accum_dtype, as_bytes, from_bytes, host_values, narrow, span_view
from .base import (
    Codec,
    MessageChecks,
    TensorContext,
    check_format,
    check_input,
    check_length,
    check_no_scale,
    check_vdtype,
    compensate,
    tensor_seed,
)

__all__ = ["SignSGD", "QSGD", "TernGrad", "Int8", "qsgd_bits", "philox_seed"]

FMT_SIGN1 = 16
FMT_QSGD = 17
FMT_TERN2 = 18
FMT_INT8 = 19
_MASK64 = (1 << 64) - 1


def philox_seed(seed: int, ctx: TensorContext) -> int:
    """The 63-bit key of one tensor's draws on one rank: ``tensor_seed(seed, step, name)``
    mixed with the rank (splitmix64 finalizer)."""
    x = (tensor_seed(seed, ctx.step, ctx.name) + (int(ctx.rank) + 1) * 0x9E3779B97F4A7C15) & _MASK64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    return x & ((1 << 63) - 1)


def qsgd_bits(levels: int) -> int:
    """Bits per element for ``levels`` s: the ``2s + 1`` codes fit in 2, 4 or 8 bits."""
    codes = 2 * levels + 1
    return 2 if codes <= 4 else 4 if codes <= 16 else 8


def _block(block) -> int | None:
    return args.optional(args.integer, "block", block, 1, 2**31 - 1)


def _frame(x: torch.Tensor, fmt: int, scales: torch.Tensor, codes: torch.Tensor, scale: float = 0.0) -> Payload:
    body = torch.cat([as_bytes(scales.to(torch.float32)), as_bytes(codes)])
    return Payload(body=body, shape=x.shape, dtype=x.dtype, fmt=fmt, vdtype=torch.float32, scale=scale)


def _code_stats(frames: list[tuple[torch.Tensor, torch.Tensor, int]], bits: int, kind: str) -> list:
    """Per frame ``(scales, codes, n)``: ``[negative scale?, largest code]`` (the largest of the
    first ``n`` ``bits``-bit codes, the padding bits of the last byte ignored; Int8: whether
    -128 occurs), bytewise, for all frames with one host sync."""
    per = 8 // bits if bits <= 8 else 1
    mask = (1 << bits) - 1 if bits <= 8 else 0
    rows = []
    for scales, code, n in frames:
        neg = (scales < 0).any() if scales.numel() else torch.zeros((), dtype=torch.bool, device=code.device)
        if kind == "int8":
            top = (
                from_bytes(code, torch.int8).amin() == -128
                if n
                else torch.zeros((), dtype=torch.bool, device=code.device)
            )
        elif kind == "sign1" or not n:
            top = torch.zeros((), dtype=torch.int64, device=code.device)
        else:
            full, tail = divmod(n, per)
            parts = []
            if full:
                head = code[:full]
                parts += [head.amax()] if bits == 8 else [((head >> (k * bits)) & mask).amax() for k in range(per)]
            if tail:
                parts.append(unpack_nbit(code[full : full + 1], tail, bits).amax())
            top = torch.stack(parts).amax()
        rows.append(torch.stack([neg.to(torch.int64), top.to(torch.int64)]))
    return torch.stack(rows).tolist() if rows else []


def _spanned(bodies: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """The bytes holding ``bodies`` as one uint8 tensor and each body's offset in it: a view
    where they lie in one buffer in order, apart or back to back (a message's frames do, and
    a gathered round's messages with padding between), else a concatenated copy."""
    got = span_view(bodies) if all(b.dtype == torch.uint8 for b in bodies) else None
    if got is not None:
        return got
    parts = [as_bytes(t) for t in bodies]
    offsets, pos = [], 0
    for b in parts:
        offsets.append(pos)
        pos += b.numel()
    return torch.cat(parts), offsets


class _Quantizer(MessageChecks, Codec):
    """Frame checks and decoding, shared: every peer's frames decode in one ``kernels.decode_add_quant``."""

    _kind = ""  # decode_add_quant's kind
    fixed_frames = True  # nb float32 scales, then the codes: lengths from n alone
    _fmt = 0
    _label = ""
    _bits = 8  # bits per code (sign1: 1)

    def _decode_kw(self) -> dict:
        return {"block": self.block}

    def _code_bytes(self, n: int) -> int:
        raise NotImplementedError

    def _bad_code(self, top: int) -> str | None:
        """Why the largest code of a frame (Int8: whether -128 occurs) is one no encoder writes."""
        return None

    def _top_limit(self) -> int:
        """The largest ``top`` of ``quant_body_stats`` an encoder writes (what ``_bad_code`` lets by)."""
        return 0

    def _planned_scale(self) -> float:
        return 0.0

    def planned_entry(self, n: int, dtype: torch.dtype | None = None) -> tuple[int, torch.dtype, int, float]:
        nb, _ = K.quant_layout(n, self.block)
        return self._fmt, torch.float32, 4 * nb + self._code_bytes(n), self._planned_scale()

    def planned_status(self, whole: torch.Tensor, frames) -> torch.Tensor:
        frames = tuple((o, K.quant_layout(n, self.block)[0], n) for o, n in frames)
        if whole.numel() == 0 or not frames:
            return torch.zeros((), dtype=torch.bool, device=whole.device)
        neg, top = K.quant_body_stats(whole, frames, self._kind, bits=self._bits).unbind(0)
        return (neg > 0) | (top > self._top_limit())

    def _check_header(self, payload: Payload) -> None:
        """The frame's scale: none, except QSGD's level count."""
        check_no_scale(self, payload)

    def _first_bad(self, payloads) -> tuple[int, FrameError] | None:
        """The first frame (in order) that no encoder of this configuration writes: its format,
        value dtype (float32, the scales'), scale and length, then (for the frames before
        the first malformed one, one host sync) negative block scales and codes no encoder
        writes."""
        header, good = None, []
        for i, p in enumerate(payloads):
            try:
                check_format(self, p, (self._fmt,))
                check_vdtype(self, p, (torch.float32,))
                self._check_header(p)
                nb, _ = K.quant_layout(p.numel, self.block)
                check_length(self, p, 4 * nb + self._code_bytes(p.numel))
            except FrameError as e:
                header = (i, e)
                break
            good.append((p, nb))
        if not good or self._clean(good):
            return header
        # Something is wrong in the bodies: find the first frame, frame by frame.
        ok = [(from_bytes(p.body[: 4 * nb], torch.float32), p.body[4 * nb :], p.numel) for p, nb in good]
        for i, (neg, top) in enumerate(_code_stats(ok, self._bits, self._kind)):
            if neg:
                return i, FrameError("body.scales", f"corrupt {self._label} frame: a negative block scale")
            why = self._bad_code(top)
            if why:
                return i, FrameError("body.codes", f"corrupt {self._label} frame: {why}")
        return header

    def _clean(self, good) -> bool:
        """Whether no frame of ``good`` (``(payload, number of scales)``, their lengths checked)
        has a negative block scale or a code no encoder writes, by one pass over all of their
        bodies and one host sync (not a few operations and a reduction per frame: a message
        of TwoPhase holds a frame per tensor piece). False sends the caller frame by frame."""
        whole, offsets = _spanned([p.body for p, _ in good])
        if whole.numel() == 0:
            return True
        frames = tuple((o, nb, p.numel) for o, (p, nb) in zip(offsets, good))
        neg_, top_ = host_values(K.quant_body_stats(whole, frames, self._kind, bits=self._bits))
        return not neg_ and self._bad_code(top_) is None

    def decompress(self, payload: Payload) -> torch.Tensor:
        # -0.0 is the additive identity: -0.0 + d == d bit for bit, signed zeros included.
        out = torch.full((payload.numel,), -0.0, dtype=accum_dtype(payload.dtype), device=payload.body.device)
        self.accumulate_many([payload], out)
        return narrow(out, payload.dtype).reshape(payload.shape)

    def accumulate(self, payload: Payload, out: torch.Tensor) -> None:
        self.accumulate_many([payload], out)

    def accumulate_segments(self, payloads, out: torch.Tensor, starts) -> None:
        """Every payload into its own range of a flat ``out`` by one ``kernels.decode_add_quant_segments``
        (one launch on CUDA), where the protocol checked them; else one at a time."""
        payloads = list(payloads)
        flat = out.dim() == 1 and out.is_contiguous() and out.dtype in (torch.float32, torch.float64)
        if not (flat and payloads and all(p.checked for p in payloads)):
            super().accumulate_segments(payloads, out, starts)
            return
        K.decode_add_quant_segments(
            out, [p.body for p in payloads], starts, [p.numel for p in payloads], self._kind, **self._decode_kw()
        )

    def accumulate_many(self, payloads, out: torch.Tensor) -> None:
        """``out += decode(p)`` for every peer's payload in rank order, in one pass over ``out``."""
        payloads = list(payloads)
        if not payloads:
            return
        for p in payloads:
            if p.numel != out.numel():
                raise ValueError(f"a frame of {p.numel} elements decoded into {out.numel()}")
        if not all(p.checked for p in payloads):  # not validated by the protocol: a peer each
            bad = self._first_bad(payloads)
            if bad is not None:
                raise bad[1].at(rank=bad[0]) if len(payloads) > 1 else bad[1]
        bodies = [p.body for p in payloads]  # read where they lie: aligned or not
        if out.dtype in (torch.float32, torch.float64) and out.is_contiguous():
            K.decode_add_quant(out.view(-1), bodies, self._kind, **self._decode_kw())
            return
        acc = torch.zeros(out.numel(), dtype=accum_dtype(out.dtype), device=out.device)
        K.decode_add_quant(acc, bodies, self._kind, **self._decode_kw())
        out.add_(acc.view(out.shape))


class SignSGD(_Quantizer):
    """Scaled sign with error feedback (EF-SignSGD, Karimireddy et al. 2019).

    Block ``b`` is sent as ``S_b * sign(x)`` with ``S_b = mean(|x|)`` over the
    block (its own length for the short last block); zero counts as ``+``. Wire:
    ``FMT_SIGN1``, ``4 * ceil(n / B) + 4 * ceil(n / 32)`` bytes of body. With error
    feedback, compensation, signs, scales and the new residual come from one pass
    (``kernels.sign_ef``).

    Args:
        block: elements per scale, an integer >= 1; ``None``: one scale per tensor.
    """

    keeps_zeros = False  # a zero element is sent as +S (its block's scale)

    formats = {"SIGN1": FMT_SIGN1}
    _kind, _fmt, _label, _bits = "sign1", FMT_SIGN1, "SignSGD", 1

    def __init__(self, *, block: int | None = None) -> None:
        self.block = _block(block)

    def _code_bytes(self, n: int) -> int:
        return packed_nbytes(n, 1)

    def compress(self, x: torch.Tensor, ctx: TensorContext | None = None) -> Payload:
        return self.encode(x, ctx)[0]

    def encode(self, x, ctx=None, residual=None, *, feedback=False, out=None):
        check_input(x)
        if residual is not None and not feedback:
            raise ValueError("a residual without feedback=True would be dropped")
        flat = x.reshape(-1).contiguous()
        if flat.dtype not in K.KERNEL_DTYPES and flat.dtype != torch.float64:
            flat = flat.float()
        scales, words, new = K.sign_ef(
            flat,
            residual.reshape(-1) if residual is not None else None,
            block=self.block,
            new_residual=feedback,
            out=out.reshape(-1) if out is not None else None,
        )
        dtype = accum_dtype(x.dtype) if feedback else x.dtype
        payload = _frame(x, FMT_SIGN1, scales, as_bytes(words))
        payload.dtype = dtype
        return payload, (new.view(x.shape) if feedback else None)

    def encode_pieces(self, x, bounds, ctxs, residual=None, *, feedback=False, out=None):
        """Every piece in one call, the payloads and residuals of :meth:`encode` piece by piece,
        bit for bit (a block's scale and signs depend on that block alone), the bodies views of
        one buffer, with no frame a piece:

        * pieces of one length ``n``, a multiple of the block (``block=None``: a piece is one
          block) and of 32 (the sign words lie within a piece): one ``kernels.sign_ef`` over
          them all at that block size, their bodies the rows of one buffer;
        * else, with ``block=None``: pieces of any lengths by one ``kernels.sign_ef_segments``
          (on CUDA three launches in all, not three a piece; on the CPU Numba piece by piece).

        Other pieces: one by one."""
        check_input(x)
        bounds = [int(v) for v in bounds]
        if x.dim() != 1 or len(bounds) < 3:
            return super().encode_pieces(x, bounds, ctxs, residual, feedback=feedback, out=out)
        lo, hi, rows = bounds[0], bounds[-1], len(bounds) - 1
        n = bounds[1] - bounds[0]
        nb, b = K.quant_layout(n, self.block) if n > 0 else (0, 1)
        one_layout = n > 0 and n % 32 == 0 and n % b == 0 and all(e - s == n for s, e in zip(bounds, bounds[1:]))
        if not one_layout and self.block is not None:
            return super().encode_pieces(x, bounds, ctxs, residual, feedback=feedback, out=out)
        dtype = accum_dtype(x.dtype) if feedback else x.dtype
        res = residual[lo:hi] if feedback and residual is not None else None
        dst = out[lo:hi] if feedback and out is not None else None
        flat = x[lo:hi].contiguous()
        if flat.dtype not in K.KERNEL_DTYPES and flat.dtype != torch.float64:
            flat = flat.float()
        if one_layout:
            scales, words, _ = K.sign_ef(flat, res, block=b, new_residual=feedback, out=dst)
            body = torch.cat([scales.view(rows, nb).view(torch.uint8), words.view(rows, n // 32).view(torch.uint8)], 1)
            bodies = body.unbind(0)  # the rows, by one operation
        else:
            buf, offsets = K.sign_ef_segments(flat, [v - lo for v in bounds], residual=res, out=dst)
            ends = [*offsets[1:], buf.numel()]  # back to back: one operation
            bodies = buf[offsets[0] :].split_with_sizes([b - a for a, b in zip(offsets, ends)])
        return [
            Payload(body=body, shape=torch.Size([e - s]), dtype=dtype, fmt=FMT_SIGN1, vdtype=torch.float32, scale=0.0)
            for body, s, e in zip(bodies, bounds, bounds[1:])
        ]


class QSGD(_Quantizer):
    """QSGD (Alistarh et al. 2017): unbiased stochastic rounding to ``levels`` levels.

    Per block, ``N_b = ||x||_2`` (float32, from a float64 sum). Element ``x`` has level
    ``r = |x| / N_b * s`` in ``[0, s]``; it is sent as ``l = floor(r) + [u < r - floor(r)]``
    with ``u`` uniform in [0, 1), so ``E[l] = r``, and decodes to
    ``sign(x) * l / s * N_b``. Code ``c = s + sign(x) * l`` in ``[0, 2s]``
    takes 2 bits for s = 1, 4 bits for s <= 7, 8 bits for s <= 127.
    Wire: ``FMT_QSGD``, ``4 * ceil(n / B) + ceil(n * bits / 8)`` bytes of body
    (the default, s = 7 and B = 64: 4.5 bits per element, 7.1x).

    Error feedback needs a contractive compressor, ``E||C(x) - x||^2 < ||x||^2``;
    QSGD's variance bound is ``min(B / s^2, sqrt(B) / s) * ||x||^2``. The default
    B = 64 keeps it near 1 for s = 7; with B = 512 and error feedback on, the
    digits MLP of ``gradzip.bench`` diverged (7.8% test accuracy, against 98.1%
    for B = 64). Choose ``block`` below about ``levels ** 2`` when turning it on.

    Args:
        levels: ``s``, the quantization levels, an integer in [1, 127].
        block: elements per norm, an integer >= 1; ``None``: one norm per tensor.
        seed: the seed of the stochastic rounding (Philox, keyed per seed, step, tensor
            and rank).
    """

    biased = False
    formats = {"QSGD": FMT_QSGD}
    _kind, _fmt, _label = "qsgd", FMT_QSGD, "QSGD"

    def __init__(self, levels: int = 7, *, block: int | None = 64, seed: int = 0) -> None:
        self.levels = args.integer("levels", levels, 1, 127)
        self.bits = self._bits = qsgd_bits(self.levels)
        self.block = _block(block)
        self.seed = args.integer("seed", seed)

    def _decode_kw(self) -> dict:
        return {"block": self.block, "levels": self.levels, "bits": self.bits}

    def _code_bytes(self, n: int) -> int:
        return packed_nbytes(n, self.bits)

    def compress(self, x: torch.Tensor, ctx: TensorContext | None = None) -> Payload:
        check_input(x)
        ctx = ctx or TensorContext(dtype=x.dtype)
        norms, codes = K.qsgd_encode(
            _flat(x), self.levels, philox_seed(self.seed, ctx), block=self.block, bits=self.bits
        )
        return _frame(x, FMT_QSGD, norms, codes, scale=float(self.levels))

    def _check_header(self, payload: Payload) -> None:
        if payload.scale != self.levels:
            raise FrameError("scale", f"QSGD frame has levels={payload.scale:g}, this QSGD has levels={self.levels}")

    def _bad_code(self, top: int) -> str | None:
        return f"code {top} > 2 * levels" if top > 2 * self.levels else None

    def _top_limit(self) -> int:
        return 2 * self.levels

    def _planned_scale(self) -> float:
        return float(self.levels)


class TernGrad(_Quantizer):
    """TernGrad (Wen et al. 2017): ``{-1, 0, +1} * S_b`` with stochastic rounding.

    Without ``clip``: ``S_b = max|x|`` over the block and ``x`` is sent as
    ``sign(x) * S_b`` with probability ``|x| / S_b``, else 0 (unbiased). With
    ``clip = c``: ``S_b = min(max|x|, c * sigma_b)``, ``sigma_b = sqrt(mean(x^2))``
    over the block (the spread about zero, which does not vanish for a
    constant block), and the probability is ``min(|x|, S_b) / S_b``: unbiased
    for the clipped tensor, so ``biased`` is true and error feedback defaults on.
    Wire: ``FMT_TERN2``, ``4 * ceil(n / B) + ceil(n / 4)`` bytes of body.

    Args:
        block: elements per scale, an integer >= 1; ``None``: one scale per tensor.
        clip: ``c`` above, a number > 0, or ``None`` (no clipping, unbiased).
        seed: the seed of the stochastic rounding.
    """

    formats = {"TERN2": FMT_TERN2}
    _kind, _fmt, _label, _bits = "tern2", FMT_TERN2, "TernGrad", 2

    def __init__(self, *, block: int | None = None, clip: float | None = None, seed: int = 0) -> None:
        self.block = _block(block)
        self.clip = args.optional(args.number, "clip", clip, 0.0, lo_open=True)
        self.seed = args.integer("seed", seed)

    @property
    def biased(self) -> bool:  # type: ignore[override]
        return self.clip is not None

    def _code_bytes(self, n: int) -> int:
        return packed_nbytes(n, 2)

    def compress(self, x: torch.Tensor, ctx: TensorContext | None = None) -> Payload:
        check_input(x)
        ctx = ctx or TensorContext(dtype=x.dtype)
        scales, codes = K.terngrad_encode(_flat(x), philox_seed(self.seed, ctx), block=self.block, clip=self.clip)
        return _frame(x, FMT_TERN2, scales, codes)

    def _bad_code(self, top: int) -> str | None:
        return "code 3" if top == 3 else None

    def _top_limit(self) -> int:
        return 2


class Int8(_Quantizer):
    """Block-wise absmax int8: ``S_b = max|x| / 127`` (float32), ``q = round(x / S_b)``.

    ``allreduce=False``: each rank frames its own scales and codes (``FMT_INT8``,
    ``4 * ceil(n / B) + n`` bytes of body), carried like every framed codec.

    ``allreduce=True``: the ranks first agree on every block's scale and then sum
    the integer codes exactly with an allreduce (the ``Int8Allreduce`` protocol,
    :mod:`gradzip.protocols.int8_allreduce`).

    Args:
        block: elements per scale, an integer >= 1; ``None``: one scale per tensor.
        allreduce: carry the codes by ``Int8Allreduce`` (an exact integer sum) instead
            of frames.
    """

    formats = {"INT8": FMT_INT8}
    _kind, _fmt, _label = "int8", FMT_INT8, "Int8"

    def __init__(self, *, block: int | None = 1024, allreduce: bool = False) -> None:
        self.block = _block(block)
        self.allreduce = args.flag("allreduce", allreduce)
        self.protocol = "Int8Allreduce" if allreduce else None

    def _code_bytes(self, n: int) -> int:
        return n

    def compress(self, x: torch.Tensor, ctx: TensorContext | None = None) -> Payload:
        check_input(x)
        scales, codes = K.int8_encode(_flat(x), block=self.block)
        return _frame(x, FMT_INT8, scales, as_bytes(codes))

    def encode_pieces(self, x, bounds, ctxs, residual=None, *, feedback=False, out=None):
        """Every piece by one ``kernels.int8_encode_segments`` (on CUDA one launch, with the
        error feedback's subtraction in the same pass), not an encode, a frame and a
        subtraction a piece: the payloads and residuals of :meth:`encode` piece by piece, bit
        for bit. The bodies are views of one buffer."""
        check_input(x)
        bounds = [int(v) for v in bounds]
        lo, hi = bounds[0], bounds[-1]
        rel = [v - lo for v in bounds]
        acc = accum_dtype(x.dtype)
        if feedback:
            src, dst = x[lo:hi], out[lo:hi]
            r = None if residual is None else residual[lo:hi]
            same = r is None and dst.dtype == src.dtype and dst.data_ptr() == src.data_ptr()
            v = dst if same else compensate(src, r, dst)
            bodies, offsets = K.int8_encode_segments(v, rel, block=self.block, residual=v)
        else:
            v = x[lo:hi].to(acc).contiguous()
            bodies, offsets = K.int8_encode_segments(v, rel, block=self.block)
        payloads, dtype = [], v.dtype if feedback else x.dtype  # as encode frames what it compressed
        for body, a, b in zip(_piece_bodies(bodies, offsets, rel, self.block), rel, rel[1:]):
            p = Payload(body=body, shape=torch.Size([b - a]), dtype=dtype, fmt=FMT_INT8, vdtype=torch.float32)
            p.checked = feedback  # as encode marks what it subtracted
            payloads.append(p)
        return payloads

    def subtract(self, payload: Payload, v: torch.Tensor) -> None:
        """``v -= decompress(payload)`` in one pass (``kernels.int8_apply_``: on CUDA one launch of
        the decode kernel), with no dense copy of the decoded tensor (the same values and the same
        subtraction): float32 on any device, float64 on the CPU; else the decode and a subtraction."""
        same = v.device == payload.body.device
        wide = v.dtype == torch.float32 or (v.dtype == torch.float64 and v.device.type == "cpu")
        if same and wide and payload.dtype == v.dtype and v.is_contiguous():
            K.int8_apply_(v.view(-1), [payload.body], block=self.block, subtract=True)
            return
        super().subtract(payload, v)

    def _bad_code(self, top: int) -> str | None:
        return "code -128" if top else None


def _piece_bodies(buf: torch.Tensor, offsets: list, rel: list, block: int | None) -> list:
    """The pieces' Int8 bodies in ``buf`` (``kernels.int8_encode_segments``' buffer and offsets):
    pieces of one length at one stride as the rows of one view, by two operations whatever
    their number; else a slice each."""
    sizes = [4 * K.quant_layout(b - a, block)[0] + (b - a) for a, b in zip(rel, rel[1:])]
    steps = {b - a for a, b in zip(offsets, offsets[1:])}
    if len(sizes) > 1 and len(set(sizes)) == 1 and len(steps) == 1 and buf.is_contiguous():
        (step,) = steps
        shape, stride = (len(sizes), sizes[0]), (step, 1)
        return list(torch.as_strided(buf, shape, stride, buf.storage_offset() + offsets[0]).unbind(0))
    return [buf[off : off + n] for off, n in zip(offsets, sizes)]


def _flat(x: torch.Tensor) -> torch.Tensor:
    """``x`` flat and contiguous, in a dtype the kernels take (others widened to float32)."""
    v = x.reshape(-1).contiguous()
    return v if v.dtype in K.KERNEL_DTYPES or v.dtype == torch.float64 else v.float()
