"""Structural corruption of every framed codec's messages: no silent wrong decode.

Every codec configuration below encodes a message of six tensors (shapes and scales chosen
so that every format it writes occurs: EMPTY, DENSE, the sparse forms, the 2-bit maps, the
quantizers' blocks), with float32 gradients and with float16 gradients under error feedback
(float32 frames of a float16 gradient). Each message is then corrupted one field at a time,
deterministically, and decoded as a receiving protocol decodes it
(``unpack_frames(..., check=codec)``, then the codec's ``accumulate_many``):

* the header: version, flags, reserved bytes, frame count;
* each frame's entry: the format byte (every code a gradzip codec writes, and a sample of
  the others, which every receiver refuses alike as an unknown format; a frame of one message
  takes half of them, the same frame of the other message the other half), the value-dtype
  code (0..7 and 127), the scale flag, the scale (0, negative, NaN, infinities, another
  positive value), the length field (off by 1, 2, 4, zero, huge, doubled);
* each frame's body: the fields a decoder reads to find its way (gap width, LEB128 count,
  padding bits, mask bits, 2-bit codes 3 and padding codes, quantizer codes no encoder
  writes, negative block scales), and value bytes (DENSE and sparse values, quantizer
  scales and codes, 2-bit codes, gap bits);
* the message's end: one byte cut, a nonzero byte appended.

**What counts as a silent wrong decode.** A corrupted message either raises
``FrameError`` (a ``ValueError``) that names the field and, for a field of a frame, the
frame's index, its tensor and the sending rank -- a *refusal* -- or decodes. A decode is
*explained* when, compared bit for bit with the uncorrupted message's decode, every tensor
differs only at elements that the corrupted byte encodes: the element a value byte holds
(DENSE, sparse values), the block of a quantizer scale, the elements packed in a code byte
or a 2-bit map byte, the positions a frame sends for its tau or mu. The bytes that code a
sparse frame's positions (gap width, count, gaps) encode every position of the frame: a
change there that leaves a frame its codec could have written (positions moved, one more
sign-frame position read from what was zero padding) is explained when that frame's decode
differs only at positions it sends before or after the change, and nothing else differs
(counted apart: these are the corruptions only a checksum catches). Header, entry and the
other structural fields encode no element: a decode after changing one of them is explained
only if nothing differs. Anything else is a *silent wrong decode*; there must be none.
"""

from __future__ import annotations

import math
import struct

import pytest
import torch

import gradzip as gz
from gradzip import wire
from gradzip.codecs.base import TensorContext
from gradzip.codecs.positions import ef_low_bits
from gradzip.codecs.quant import qsgd_bits
from gradzip.codecs.threshold import FMT_BITMAP2, FMT_SIGNED_INDEX
from gradzip.codecs.topk import FMT_SPARSE, FMT_SPARSE_EF, FMT_SPARSE_MASK, FMT_SPARSE_SIGN, FMT_SPARSE_SIGN2
from gradzip.wire import FMT_DENSE, FMT_EMPTY, FrameError, accum_dtype, pack_frames, unpack_frames

SHAPES = [(40, 30), (300,), (6, 5), (1,), (0,), (37, 11)]
SCALES = [1.0, 1.0, 3.0, 1.0, 1.0, 1e-4]  # the last: nothing reaches Threshold's tau
NAMES = [f"t{i}" for i in range(len(SHAPES))]

CODECS = [
    gz.Identity(),
    gz.FP16(),
    gz.BF16(),
    gz.TopK(0.01),  # exact: Elias-Fano positions
    gz.TopK(0.01, mode="sampled", sample=64),  # gap-coded positions
    gz.TopK(0.3),  # the mask form
    gz.TopK(1.0),  # DENSE
    gz.TopK(0.05, values="fp16"),
    gz.TopK(0.05, values="bf16"),
    gz.TopK(0.02, values="sign"),
    gz.TopK(0.6, values="sign"),  # the 2-bit map
    gz.TopK(0.05, scope="call"),  # EMPTY for tensors allotted nothing
    gz.Threshold(tau=1.5),  # index lists, the 2-bit map, EMPTY
    gz.Threshold(policy="target", density=0.4),
    gz.SignSGD(),
    gz.SignSGD(block=7),
    gz.QSGD(),
    gz.QSGD(levels=1, block=16),
    gz.QSGD(levels=127),
    gz.TernGrad(),
    gz.Int8(block=5),
]


def _format_codes() -> list[int]:
    """Every frame format gradzip defines (the ``FMT_*`` codes of gradzip.wire and of every
    module of gradzip.codecs), and a sample of the codes no codec writes: the first and last
    unused below 32, one between, and a few above."""
    import importlib
    import pkgutil

    import gradzip.codecs

    names = ["gradzip.wire"] + [f"gradzip.codecs.{m.name}" for m in pkgutil.iter_modules(gradzip.codecs.__path__)]
    known = set()
    for name in names:
        mod = importlib.import_module(name)
        known |= {v for k, v in vars(mod).items() if k.startswith("FMT_") and isinstance(v, int)}
    unused = [c for c in range(32) if c not in known]
    return sorted(known | {unused[0], unused[len(unused) // 2], unused[-1], 64, 127, 128, 255})


FORMAT_CODES = _format_codes()
#: Every code 0..31 and a few above (the checksum test, which costs little, takes them all).
ALL_FORMAT_CODES = [*range(32), 64, 127, 128, 255]


def _message(codec, dtype, feedback, seed=0):
    """The frames one rank sends for the six tensors: (message, shapes, payload dtypes,
    gradient dtypes) as AllGather frames them."""
    g = torch.Generator().manual_seed(seed)
    xs = [(torch.randn(s, generator=g) * c).to(dtype) for s, c in zip(SHAPES, SCALES)]
    ctxs = [TensorContext(name=n, step=3, dtype=dtype, store={}) for n in NAMES]
    if codec.scope == "call":
        for ctx, k in zip(ctxs, codec.allot([x.float() for x in xs], ctxs)):
            ctx.k = k
    pays = [codec.encode(x, ctx, feedback=feedback)[0] for x, ctx in zip(xs, ctxs)]
    return pack_frames(pays), [p.shape for p in pays], [p.dtype for p in pays], [c.dtype for c in ctxs]


def _decode(codec, msg, shapes, dtypes, grads):
    frames = unpack_frames(msg, shapes, dtypes, grad_dtypes=grads, check=codec, names=NAMES, rank=1)
    outs = []
    for p in frames:
        acc = torch.zeros(p.numel, dtype=accum_dtype(p.dtype))
        codec.accumulate_many([p], acc)
        outs.append(acc)
    return frames, outs


def _bits(t):
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int64)


class _Entry:
    """Where a frame lies in a message (parsed independently of gradzip.wire)."""

    def __init__(self, raw: bytes, pos: int):
        self.pos = pos
        self.fmt, self.vcode, self.nb = struct.unpack_from("<BBI", raw, pos)
        self.has_scale = bool(self.vcode & 0x80)
        self.scale = struct.unpack_from("<f", raw, pos + 6)[0] if self.has_scale else 0.0
        self.end = pos + 6 + (4 if self.has_scale else 0)


def _layout(msg):
    raw = bytes(msg.numpy())
    pos = 8 + (4 if raw[1] & wire.FLAG_CRC32 else 0)
    entries = []
    for _ in range(struct.unpack_from("<I", raw, 4)[0]):
        e = _Entry(raw, pos)
        entries.append(e)
        pos = e.end
    off = pos
    for e in entries:
        e.body = off
        off += e.nb
    return raw, entries, off


def _elements_of_byte(codec, p, b: int, n: int) -> torch.Tensor:
    """Mask of the elements whose encoding holds body byte ``b`` of a clean frame ``p``
    (value bytes only; structural bytes hold none)."""
    mask = torch.zeros(n, dtype=torch.bool)
    fmt = p.fmt
    if fmt == FMT_DENSE:
        mask[b // p.vdtype.itemsize] = True
    elif fmt in (FMT_SPARSE, FMT_SPARSE_MASK, FMT_SPARSE_EF):
        idx, vals = p.parsed
        vstart = p.body.numel() - vals.numel() * p.vdtype.itemsize
        if b >= vstart:
            mask[idx[(b - vstart) // p.vdtype.itemsize]] = True
    elif fmt in (FMT_BITMAP2, FMT_SPARSE_SIGN2):
        mask[4 * b : 4 * b + 4] = True
    elif isinstance(codec, (gz.SignSGD, gz.QSGD, gz.TernGrad, gz.Int8)):
        block = codec.block or max(n, 1)
        nb = -(-n // block)
        if b < 4 * nb:
            blk = b // 4
            mask[blk * block : (blk + 1) * block] = True
        else:
            bits = 1 if isinstance(codec, gz.SignSGD) else 2 if isinstance(codec, gz.TernGrad) else 8
            if isinstance(codec, gz.QSGD):
                bits = qsgd_bits(codec.levels)
            per = 8 // bits
            c = b - 4 * nb
            mask[c * per : (c + 1) * per] = True
    return mask


def _mutations(codec, msg, clean, formats=FORMAT_CODES):
    """(label, frame index or None, corrupted message, allowed element masks per frame or
    "moved": the gap-change rule, see the module docstring)."""
    raw, entries, end = _layout(msg)
    nothing = [torch.zeros(p.numel, dtype=torch.bool) for p in clean]

    def put(edits):
        m = bytearray(raw)
        for off, val in edits:
            m[off] = val
        return torch.frombuffer(m, dtype=torch.uint8).clone()

    def put_bytes(off, data):
        m = bytearray(raw)
        m[off : off + len(data)] = data
        return torch.frombuffer(m, dtype=torch.uint8).clone()

    out = []
    for v in (1, 3, 255):
        out.append(("header.version", None, put([(0, v)]), nothing))
    for f in (0x02, 0x80, wire.FLAG_CRC32):
        out.append(("header.flags", None, put([(1, f)]), nothing))
    out.append(("header.reserved", None, put([(2, 1)]), nothing))
    out.append(("header.reserved", None, put([(3, 1)]), nothing))
    for d in (-1, 1):
        out.append(("header.count", None, put_bytes(4, struct.pack("<I", len(entries) + d)), nothing))
    out.append(("message.truncated", None, msg[:-1].clone(), nothing))
    out.append(("message.trailing", None, torch.cat([msg, torch.tensor([7], dtype=torch.uint8)]), nothing))

    for i, (e, p) in enumerate(zip(entries, clean)):
        n = p.numel
        for code in formats:
            if code != e.fmt:
                out.append(("format", i, put([(e.pos, code)]), nothing))
        low = e.vcode & 0x7F
        for code in [*range(8), 0x7F]:
            if code != low:
                out.append(("value dtype", i, put([(e.pos + 1, code | (e.vcode & 0x80))]), nothing))
        out.append(("scale flag", i, put([(e.pos + 1, e.vcode ^ 0x80)]), nothing))
        for nb in {e.nb + 1, e.nb - 1, e.nb + 2, e.nb - 2, e.nb + 4, e.nb - 4, 0, 0xFFFFFFFF, 2 * e.nb + 1} - {e.nb}:
            if 0 <= nb <= 0xFFFFFFFF:
                out.append(("length", i, put_bytes(e.pos + 2, struct.pack("<I", nb)), nothing))
        if e.has_scale:
            for s in (0.0, -e.scale, math.nan, math.inf, -math.inf):
                out.append(("scale", i, put_bytes(e.pos + 6, struct.pack("<f", s)), nothing))
            support = [m.clone() for m in nothing]
            support[i] = _outs_clean[i] != 0  # the positions it sends (tau, mu: every sent value)
            out.append(("scale.value", i, put_bytes(e.pos + 6, struct.pack("<f", e.scale * 2)), support))
        body = raw[e.body : e.body + e.nb]
        if not e.nb:
            continue

        def at(j, val, label, allowed=nothing):
            out.append((label, i, put([(e.body + j, val)]), allowed))

        def value(j, val, label):
            allowed = [m.clone() for m in nothing]
            allowed[i] = _elements_of_byte(codec, p, j, n)
            at(j, val, label, allowed)

        if p.fmt in (FMT_SPARSE, FMT_SPARSE_SIGN, FMT_SIGNED_INDEX):
            w = body[0]
            for nw in (w + 1, w - 1, 0, 64):
                if 0 <= nw <= 255:
                    at(0, nw, "body.width", "positions")
            at(1, (body[1] + 1) & 0xFF, "body.count", "positions")
            at(1, body[1] - 1 if body[1] else 0x7F, "body.count", "positions")
            at(1, body[1] | 0x80, "body.count", "positions")
            k, pos, shift = 0, 1, 0
            while True:
                k |= (body[pos] & 0x7F) << shift
                shift += 7
                pos += 1
                if not body[pos - 1] & 0x80:
                    break
            used = k * w
            plen = (used + 7) // 8
            if used % 8:
                at(pos + plen - 1, body[pos + plen - 1] | 0x80, "body.padding")
            if plen:
                for bit in (0, 3):
                    at(pos, body[pos] ^ (1 << bit), "gap bits", "positions")
            for j in range(pos + plen, min(e.nb, pos + plen + 6)):
                value(j, body[j] ^ 0x5A, "value bytes")
        elif p.fmt == FMT_SPARSE_EF:
            k, pos = 0, 0
            while True:  # the LEB128 count
                k |= (body[pos] & 0x7F) << (7 * pos)
                pos += 1
                if not body[pos - 1] & 0x80:
                    break
            at(0, (body[0] + 1) & 0x7F | (body[0] & 0x80), "body.count", "positions")
            at(0, (body[0] - 1) & 0x7F | (body[0] & 0x80), "body.count", "positions")
            at(0, body[0] | 0x80, "body.count", "positions")
            low = ef_low_bits(n, k)
            llen = (k * low + 7) // 8
            upper = k + ((n - 1) >> low) + 1
            ulen = (upper + 7) // 8
            if (k * low) % 8:
                at(pos + llen - 1, body[pos + llen - 1] | 0x80, "body.padding")
            if upper % 8:
                at(pos + llen + ulen - 1, body[pos + llen + ulen - 1] | 0x80, "body.padding")
            if llen:
                for bit in (0, 3):
                    at(pos, body[pos] ^ (1 << bit), "position bits", "positions")  # a low part
            u0 = pos + llen
            for j in range(u0, u0 + min(ulen, 3)):
                at(j, body[j] ^ 0x01, "body.upper", "positions")  # one bit more or less: the count
                b = body[j]
                for bit in range(7):  # the first 10 / 01 pair: one position moves by one
                    if ((b >> bit) & 1) != ((b >> (bit + 1)) & 1):
                        at(j, b ^ (3 << bit), "position bits", "positions")
                        break
            for j in range(u0 + ulen, min(e.nb, u0 + ulen + 6)):
                value(j, body[j] ^ 0x5A, "value bytes")
        elif p.fmt == FMT_SPARSE_MASK:
            mlen = (n + 7) // 8
            if n % 8:
                at(mlen - 1, body[mlen - 1] | 0x80, "body.padding")
            at(0, body[0] ^ 1, "body.mask")
            for j in range(mlen, min(e.nb, mlen + 6)):
                value(j, body[j] ^ 0x5A, "value bytes")
        elif p.fmt in (FMT_BITMAP2, FMT_SPARSE_SIGN2):
            at(0, 0xFF, "body.codes")  # code 3
            if n % 4:
                at(e.nb - 1, body[-1] | 0xC0, "body.padding")
            out.append(("body.codes", i, put([(e.body + j, 0) for j in range(e.nb)]), nothing))  # nothing set
            for j in range(min(e.nb, 4)):
                c = body[j]
                if c & 3 in (1, 2):
                    value(j, c ^ 3, "code bytes")  # + <-> -
        elif p.fmt == FMT_DENSE:
            for j in range(0, min(e.nb, 24), 3):
                value(j, body[j] ^ 0x5A, "value bytes")
        elif isinstance(codec, (gz.SignSGD, gz.QSGD, gz.TernGrad, gz.Int8)):
            block = codec.block or max(n, 1)
            nb = -(-n // block)
            at(3, body[3] | 0x80, "body.scales")  # a negative block scale (-0.0 for a zero scale)
            value(1, body[1] ^ 0x21, "scale bytes")
            c0 = 4 * nb
            if isinstance(codec, gz.Int8):
                at(c0, 0x80, "body.codes")  # -128
                value(c0, body[c0] ^ 0x01, "code bytes")
            elif isinstance(codec, gz.TernGrad):
                at(c0, body[c0] | 0x03, "body.codes")  # code 3
                value(c0, (body[c0] & 0xFC) | ((body[c0] & 3) ^ 3 if body[c0] & 3 in (1, 2) else 1), "code bytes")
            elif isinstance(codec, gz.QSGD):
                bits = qsgd_bits(codec.levels)
                bad = (1 << bits) - 1  # above 2s for every s here
                at(c0, (body[c0] & ~((1 << bits) - 1) & 0xFF) | bad, "body.codes")
                value(c0, (body[c0] & ~((1 << bits) - 1) & 0xFF) | codec.levels, "code bytes")
            else:
                value(c0, body[c0] ^ 0x01, "code bytes")
    return [m for m in out if m[2].numel() != msg.numel() or not torch.equal(m[2], msg)]  # no no-op edits


_outs_clean: list = []


def _alternate_formats(cases, parity=0):
    """``cases`` with every other format code of each frame: the frames in turn take the even
    and the odd ones of :data:`FORMAT_CODES` (so each code still reaches half the frames; the
    other ``parity`` takes the other half)."""
    seen: dict = {}
    out = []
    for case in cases:
        label, frame = case[0], case[1]
        if label == "format":
            j = seen[frame] = seen.get(frame, -1) + 1
            if (j + frame + parity) % 2:
                continue
        out.append(case)
    return out


def _run(codec, dtype, feedback, parity):
    global _outs_clean
    msg, shapes, dtypes, grads = _message(codec, dtype, feedback)
    clean, outs = _decode(codec, msg, shapes, dtypes, grads)
    _outs_clean = outs
    stats = {"cases": 0, "refused": 0, "explained": 0, "positions": 0, "unchanged": 0, "silent": []}
    for label, frame, bad, allowed in _alternate_formats(_mutations(codec, msg, clean), parity):
        stats["cases"] += 1
        try:
            _, got = _decode(codec, bad, shapes, dtypes, grads)
        except FrameError as e:
            stats["refused"] += 1
            text = str(e)
            assert f"field {e.field}:" in text and "from rank 1" in text, text
            if e.frame is not None:
                assert f"frame {e.frame} (tensor '{NAMES[e.frame]}')" in text, text
                if frame is not None and label != "scale flag":  # a flag moves every body: any frame may fail
                    assert e.frame >= frame, (label, frame, text)  # frames before the corrupted one parse as they were
            else:
                assert e.field in ("version", "flags", "reserved", "count", "length", "padding", "checksum"), text
            continue
        diffs = [_bits(a) != _bits(b) for a, b in zip(got, outs)]
        if not any(bool(d.any()) for d in diffs):
            stats["unchanged"] += 1
            continue
        if allowed == "positions":  # the frame's positions changed: only where it sends, before or after
            ok = all(not bool(d.any()) for j, d in enumerate(diffs) if j != frame)
            a, b = outs[frame], got[frame]
            ok = ok and bool((~diffs[frame] | (a != 0) | (b != 0)).all())
            stats["positions"] += ok
        else:
            ok = all(not bool((d & ~m).any()) for d, m in zip(diffs, allowed))
        if ok:
            stats["explained"] += 1
        else:
            stats["silent"].append((label, frame, clean[frame].fmt if frame is not None else None))
    return stats


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: repr(c)[:48])
def test_structural_corruptions_never_decode_silently_to_a_wrong_tensor(codec):
    totals = {"cases": 0, "refused": 0, "explained": 0, "positions": 0, "unchanged": 0}
    for dtype, feedback in ((torch.float32, False), (torch.float16, True)):
        stats = _run(codec, dtype, feedback, parity=int(feedback))  # each (frame, format code) in one
        assert not stats["silent"], (dtype, stats["silent"][:10])
        for k in totals:
            totals[k] += stats[k]
    assert totals["refused"] >= 0.8 * totals["cases"], totals
    print(f"\n{codec!r}: {totals}")


def test_every_format_occurs_in_the_fuzzed_messages():
    """The messages above hold every format each codec writes (else a format goes unfuzzed)."""
    seen = {}
    for codec in CODECS:
        for dtype, feedback in ((torch.float32, False), (torch.float16, True)):
            msg, shapes, dtypes, grads = _message(codec, dtype, feedback)
            for p in unpack_frames(msg, shapes, dtypes, grad_dtypes=grads, check=codec):
                seen.setdefault(type(codec).__name__, set()).add(p.fmt)
    assert seen["TopK"] >= {
        FMT_EMPTY,
        FMT_DENSE,
        FMT_SPARSE,
        FMT_SPARSE_EF,
        FMT_SPARSE_MASK,
        FMT_SPARSE_SIGN,
        FMT_SPARSE_SIGN2,
    }
    assert seen["Threshold"] == {FMT_EMPTY, FMT_SIGNED_INDEX, FMT_BITMAP2}
    for name in ("Identity", "FP16", "BF16"):
        assert seen[name] == {FMT_DENSE}


@pytest.mark.parametrize(
    "codec",
    [gz.TopK(0.01), gz.TopK(0.01, mode="sampled", sample=64), gz.Threshold(tau=1.5), gz.Int8(block=5), gz.FP16()],
    ids=repr,
)
def test_with_the_checksum_every_corruption_is_refused(codec):
    """``wire.set_checksum(True)``: a CRC-32 after the header; every corruption above, value
    bytes and positions included, is refused (the checksum, or a field checked before it)."""
    old = wire.set_checksum(True)
    try:
        msg, shapes, dtypes, grads = _message(codec, torch.float32, False)
        assert msg[1] == wire.FLAG_CRC32 and wire.message_nbytes([]) == wire.HEADER_BYTES + 4
        clean, outs = _decode(codec, msg, shapes, dtypes, grads)
        global _outs_clean
        _outs_clean = outs
        cases = _mutations(codec, msg, clean, formats=ALL_FORMAT_CODES)
        assert len(cases) > 300
        for _, _, bad, _ in cases:
            with pytest.raises(FrameError):
                _decode(codec, bad, shapes, dtypes, grads)
        value = [c for c in cases if c[0] in ("value bytes", "scale bytes", "code bytes", "gap bits", "position bits")]
        for _, _, bad, _ in value:
            with pytest.raises(FrameError, match="field checksum"):
                _decode(codec, bad, shapes, dtypes, grads)
    finally:
        wire.set_checksum(old)
    # a message with a CRC decodes on a receiver whose own setting is off
    old = wire.set_checksum(True)
    msg, shapes, dtypes, grads = _message(codec, torch.float32, False)
    wire.set_checksum(old)
    assert all(torch.equal(a, b) for a, b in zip(_decode(codec, msg, shapes, dtypes, grads)[1], outs))


def _one(codec, x, feedback=False, dtype=None):
    ctx = TensorContext(name="w", step=0, dtype=dtype or x.dtype, store={})
    p = codec.encode(x, ctx, feedback=feedback)[0]
    return bytearray(pack_frames([p]).numpy().tobytes()), p, ctx.dtype


def _refused(codec, raw, p, grad, field):
    msg = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    with pytest.raises(FrameError, match=f"from rank 3: frame 0 \\(tensor 'w'\\), field {field}"):
        frames = unpack_frames(msg, [p.shape], [p.dtype], grad_dtypes=[grad], check=codec, names=["w"], rank=3)
        codec.decompress(frames[0])


def test_the_reported_corruptions_are_refused_naming_rank_frame_tensor_and_field():
    """The cases the adversarial run of issue #33 decoded silently (or with a bare RuntimeError)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 30, generator=g) + 4.0  # values near 4
    # a TopK or Threshold frame's format byte set to EMPTY (decoded zeros): TopK(scope="tensor")
    # never writes EMPTY for a nonempty tensor, Threshold's EMPTY has no body
    for codec, field in ((gz.TopK(0.01), "format"), (gz.Threshold(tau=5.5), "length")):
        raw, p, grad = _one(codec, x)
        raw[8] = FMT_EMPTY
        _refused(codec, raw, p, grad, field)
    # the value-dtype byte swapped fp16 <-> bf16 (values near 4 decoded as 616)
    for codec in (gz.FP16(), gz.BF16(), gz.TopK(0.05, values="fp16"), gz.TopK(0.05, values="bf16")):
        raw, p, grad = _one(codec, x)
        raw[9] = {1: 2, 2: 1}[raw[9]]
        _refused(codec, raw, p, grad, "value dtype")
    sampled = gz.TopK(0.05, mode="sampled", sample=64)
    raw, p, grad = _one(sampled, x.half(), feedback=True)  # float16 gradient, float32 residual
    assert raw[9] == 1
    raw[9] = 2
    _refused(sampled, raw, p, grad, "value dtype")
    raw, p, grad = _one(gz.TopK(0.05), x.half(), feedback=True)
    assert raw[9] == 1
    raw[9] = 0  # float32: what a sampled frame may travel in, never an exact one (it saturates)
    _refused(gz.TopK(0.05), raw, p, grad, "value dtype")
    # a Threshold frame's scale flag cleared (decoded +-2 tau off): its 4 scale bytes are then a body's
    raw, p, grad = _one(gz.Threshold(tau=5.5), x)
    raw[9] &= 0x7F
    msg = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    with pytest.raises(FrameError, match="from rank 3"):
        unpack_frames(msg, [p.shape], [p.dtype], check=gz.Threshold(tau=5.5), names=["w"], rank=3)
    # a TopK DENSE frame whose length says 4 (one value broadcast over the tensor)
    raw, p, grad = _one(gz.TopK(1.0), x)
    assert raw[8] == FMT_DENSE
    raw[10:14] = struct.pack("<I", 4)
    raw = raw[: 8 + 6 + 4]
    _refused(gz.TopK(1.0), raw, p, grad, "length")
    # a Threshold 2-bit map with code 3 (decoded as 0)
    raw, p, grad = _one(gz.Threshold(tau=3.0), x)
    assert raw[8] == FMT_BITMAP2
    raw[8 + 10] = 0xFF
    _refused(gz.Threshold(tau=3.0), raw, p, grad, "body.codes")
    # FP16, BF16 and Identity read the format byte
    for codec in (gz.FP16(), gz.BF16(), gz.Identity()):
        raw, p, grad = _one(codec, x)
        raw[8] = FMT_SPARSE
        _refused(codec, raw, p, grad, "format")
    # lengths that used to raise a bare RuntimeError (shape '[40, 30]' is invalid for input of size 0)
    raw, p, grad = _one(gz.Identity(), x)
    raw[10:14] = struct.pack("<I", 0)
    raw = raw[: 8 + 6]
    _refused(gz.Identity(), raw, p, grad, "length")


# Every configuration but TopK's bfloat16 values: its frames and checks are the float16 ones
# with another value dtype (each costs seconds here: their Elias-Fano checks, frame by frame).
UNPACK_MANY_CODECS = [c for c in CODECS if not (isinstance(c, gz.TopK) and c.values == "bf16")]


@pytest.mark.parametrize("codec", UNPACK_MANY_CODECS, ids=lambda c: repr(c)[:48])
def test_unpack_many_refuses_and_decodes_as_unpack_frames_does(codec):
    """Every corruption of the middle of three messages (ranks 0, 1 and 2, as one receive
    buffer holds them; half the format codes a frame): ``unpack_many`` raises the refusal
    ``unpack_frames`` raises for that message alone (field, frame, tensor, rank 1), or returns
    the same frames."""
    global _outs_clean
    msg, shapes, dtypes, grads = _message(codec, torch.float32, False)
    other = _message(codec, torch.float32, False, seed=1)[0]
    clean, _outs_clean = _decode(codec, msg, shapes, dtypes, grads)
    cases = 0
    for _, _, bad, _ in _alternate_formats(_mutations(codec, msg, clean)):  # half the format codes a frame
        cases += 1
        buf = torch.cat([other, bad, msg])  # one buffer: the messages are views of it
        msgs = [
            buf[: other.numel()],
            buf[other.numel() : other.numel() + bad.numel()],
            buf[other.numel() + bad.numel() :],
        ]
        try:
            want = unpack_frames(bad, shapes, dtypes, grad_dtypes=grads, check=codec, names=NAMES, rank=1)
        except FrameError as e:
            want = e
        try:
            got = wire.unpack_many(
                msgs,
                [shapes] * 3,
                [dtypes] * 3,
                grad_dtypes=[grads] * 3,
                check=codec,
                names=[NAMES] * 3,
                ranks=[0, 1, 2],
            )
        except FrameError as e:
            assert isinstance(want, FrameError), (str(e), "unpack_frames decoded it")
            assert str(e) == str(want) and (e.field, e.frame, e.tensor, e.rank) == (
                want.field,
                want.frame,
                want.tensor,
                1,
            )
            continue
        assert not isinstance(want, FrameError), (str(want), "unpack_many decoded it")
        for a, b in zip(got[1], want):
            assert (a.fmt, a.vdtype, a.scale, a.shape) == (b.fmt, b.vdtype, b.scale, b.shape) and torch.equal(
                a.body, b.body
            )
            assert a.checked and b.checked
    assert cases > 5


@pytest.mark.parametrize("codec", [c for c in CODECS if isinstance(c, gz.TopK)], ids=lambda c: repr(c)[:48])
def test_topk_checks_a_message_as_it_checks_frame_by_frame(codec):
    """TopK.check_frames (its Elias-Fano frames' positions checked together) refuses exactly
    what check_frame refuses frame by frame, with the same error, and parses the same positions
    (half the format codes a frame)."""
    from gradzip.codecs.base import Codec

    global _outs_clean
    msg, shapes, dtypes, grads = _message(codec, torch.float32, False)
    clean, _outs_clean = _decode(codec, msg, shapes, dtypes, grads)
    cases = 0
    for _, _, bad, _ in [(None, None, msg, None), *_alternate_formats(_mutations(codec, msg, clean))]:
        try:  # the frames as the wire splits them, not checked yet
            a = unpack_frames(bad, shapes, dtypes, grad_dtypes=grads)
            b = unpack_frames(bad, shapes, dtypes, grad_dtypes=grads)
        except FrameError:
            continue
        cases += 1
        errors = []
        for frames, check in ((a, codec.check_frames), (b, lambda ps: Codec.check_frames(codec, ps))):
            try:
                check(frames)
                errors.append(None)
            except FrameError as e:
                errors.append(str(e))
        assert errors[0] == errors[1]
        if errors[0] is None:
            for p, q in zip(a, b):
                if q.parsed is not None:
                    assert all(torch.equal(x, y) for x, y in zip(p.parsed, q.parsed))
    assert cases > 20


def test_unpack_many_reads_a_strided_round_as_one_view_and_still_names_the_sender(monkeypatch):
    """Fixed-length messages at one stride in one buffer (a round's receive buffer, a flag
    byte after each): their tables come to the host and their padding is tested through one
    2-D view (``wire.row_view``); the bytes between messages are no message's and are not read;
    nonzero padding in one message is refused naming its sender."""
    codec, world = gz.Int8(block=16), 4
    x = torch.randn(100)
    payload = codec.compress(x)
    size = wire.message_capacity([payload])
    msg = wire.pack_frames([payload], size=size)
    assert msg.numel() == size > wire.message_nbytes([payload])  # padded: room for the checksum
    buf = torch.full((world, size + 1), 0xAB, dtype=torch.uint8)  # 0xAB: the bytes between
    buf[:, :size] = msg
    flat = buf.view(-1)
    msgs = [flat[j * (size + 1) : j * (size + 1) + size] for j in range(world)]
    rows = wire.row_view(msgs)
    assert rows is not None and rows.shape == (world, size) and rows.data_ptr() == buf.data_ptr()
    assert wire.row_view(msgs[:1]) is None and wire.row_view([msgs[0], msgs[2]]) is not None
    assert wire.row_view([msgs[0], msgs[1][:-1]]) is None and wire.row_view([msgs[1], msgs[0]]) is None
    args = ([[x.shape]] * world, [[torch.float32]] * world)
    got = wire.unpack_many(msgs, *args, check=codec, ranks=list(range(world)))
    assert all(torch.equal(codec.decompress(g[0]), codec.decompress(payload)) for g in got)
    buf[2, size - 1] = 1  # padding of rank 2's message
    with pytest.raises(FrameError, match="padding") as e:
        wire.unpack_many(msgs, *args, check=codec, ranks=list(range(world)))
    assert e.value.rank == 2


def test_unpack_many_hands_each_body_its_first_bytes_read_with_the_table(monkeypatch):
    """The host copy of a round's tables reaches HEAD_BYTES into the first body: each frame
    starting within it gets those bytes as ``Payload.head`` (the body's own first bytes), and
    TopK's Elias-Fano check then reads its counts from them with no copy of its own, parsing
    what a check without heads parses; a message whose first body is corrupt in its count is
    still refused, naming its sender."""
    from gradzip.codecs.topk import FMT_SPARSE_EF

    codec, world = gz.TopK(0.01), 4
    frames = [codec.compress(torch.randn(5000, generator=torch.Generator().manual_seed(j))) for j in range(world)]
    assert all(p.fmt == FMT_SPARSE_EF for p in frames)
    size = max(wire.message_capacity([p]) for p in frames)
    msgs = [wire.pack_frames([p], size=size) for p in frames]
    args = ([[torch.Size([5000])]] * world, [[torch.float32]] * world)
    copies = []
    real = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda t, *a, **k: copies.append(t.numel()) or real(t, *a, **k))
    got = wire.unpack_many(msgs, *args, check=codec, ranks=list(range(world)))
    assert len(copies) == 1  # the tables (with the heads); the flags come by tolist() (host_values), not a copy
    monkeypatch.undo()
    for (g,), p in zip(got, frames):
        assert g.head == bytes(g.body[: wire.HEAD_BYTES].tolist()) and len(g.head) == wire.HEAD_BYTES
        fresh = wire.Payload(body=g.body, shape=g.shape, dtype=g.dtype, fmt=g.fmt, vdtype=g.vdtype)
        codec.check_frames([fresh, wire.Payload(body=g.body, shape=g.shape, dtype=g.dtype, fmt=g.fmt, vdtype=g.vdtype)])
        assert torch.equal(g.parsed[0], fresh.parsed[0]) and torch.equal(g.parsed[1], fresh.parsed[1])
        assert torch.equal(codec.decompress(g), codec.decompress(p))
    bad = [m.clone() for m in msgs]
    start = wire.message_nbytes([frames[1]]) - frames[1].body.numel()  # the body after header and table
    bad[1][start] ^= 0x7F  # rank 1's count (the body's first byte)
    with pytest.raises(FrameError) as e:
        wire.unpack_many(bad, *args, check=codec, ranks=list(range(world)))
    assert e.value.rank == 1


@pytest.mark.parametrize("codec", [gz.Int8(block=16), gz.SignSGD(), gz.TopK(0.01)], ids=repr)
@pytest.mark.parametrize("strided", [True, False])
def test_unpack_many_reads_the_padding_test_with_the_codecs_check(monkeypatch, codec, strided):
    """A round of padded messages (tensors of several lengths, one message size) costs two host
    reads: the tables' copy and the codec's check, which brings the padding test with it
    (``wire.host_values``), not a third for the padding. Dirty padding is still refused first,
    naming its sender, where another message's body is corrupt too, as a check of the messages
    in order (``unpack_frames``) refuses it."""
    world, lens = 4, [5000, 4990, 4900, 4000]
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(j)) for j, n in enumerate(lens)]
    frames = [codec.compress(x) for x in xs]
    size = max(wire.message_capacity([p]) for p in frames) + 8
    buf = torch.zeros(world, size + (3 if strided else 0), dtype=torch.uint8)
    for j, p in enumerate(frames):
        buf[j, :size] = pack_frames([p], size=size)
    msgs = [buf[j, :size] if strided else buf[j, :size].clone() for j in range(world)]
    assert (wire.row_view(msgs) is not None) == strided
    args = ([[torch.Size([n])] for n in lens], [[torch.float32]] * world)
    reads = []
    for name in ("cpu", "tolist", "item", "__bool__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda t, *a, _r=real, _n=name, **k: reads.append(_n) or _r(t, *a, **k))
    got = wire.unpack_many(msgs, *args, check=codec, ranks=list(range(world)))
    monkeypatch.undo()
    assert sorted(reads) == ["cpu", "tolist"], reads
    assert all(torch.equal(codec.decompress(g[0]), codec.decompress(p)) for g, p in zip(got, frames))
    body = wire.message_nbytes([frames[1]]) - frames[1].body.numel()  # rank 1's body starts here
    msgs[2][size - 1] = 1  # rank 2's padding
    with pytest.raises(FrameError, match="padding") as e:
        wire.unpack_many(msgs, *args, check=codec, ranks=list(range(world)))
    assert e.value.rank == 2
    if isinstance(codec, gz.TopK):
        msgs[1][body] ^= 0x7F  # and rank 1's count of positions corrupt
    else:
        msgs[1][body + 3] |= 0x80  # and rank 1's first block scale negative
    with pytest.raises(FrameError) as want:
        unpack_frames(msgs[1], args[0][1], args[1][1], check=codec)
    assert want.value.field != "padding"
    with pytest.raises(FrameError, match="padding") as e:
        wire.unpack_many(msgs, *args, check=codec, ranks=list(range(world)))
    assert e.value.rank == 2
    msgs[2][size - 1] = 0
    with pytest.raises(FrameError) as e:
        wire.unpack_many(msgs, *args, check=codec, ranks=list(range(world)))
    assert (str(e.value), e.value.rank) == (str(want.value.at(rank=1)), 1)


def test_host_values_reads_the_pending_padding_test_once_and_returns_what_tolist_returns():
    """``wire.host_values`` outside a round is ``tolist``; inside one, it returns the same
    values (0-d and 1-d, bool, integer and float, the flag's bool promoting to none of them)
    and the round's padding flag read in the same copy, once."""
    for flag in (True, False):
        p = wire._Pending(torch.tensor(flag))
        token = wire._ROUND.set(p)
        try:
            for t in (torch.tensor(False), torch.tensor([7, -3]), torch.tensor([0.1, 2.5], dtype=torch.float32)):
                got = wire.host_values(t)
                assert got == t.tolist() and type(got) is type(t.tolist())
                assert p.value is flag and p.read() is flag
        finally:
            wire._ROUND.reset(token)
    assert wire.host_values(torch.tensor([1, 2])) == [1, 2] and wire._ROUND.get() is None


# -- frames no writer of the receiving configuration produces (an adversarial audit, 2026-12-01) --


def _frame(fmt, body, n, *, dtype=torch.float32, vdtype=torch.float32, scale=0.0):
    if isinstance(body, (bytes, bytearray)):
        body = torch.tensor(list(body), dtype=torch.uint8)
    return wire.Payload(body=body, shape=torch.Size([n]), dtype=dtype, fmt=fmt, vdtype=vdtype, scale=scale)


def _refusal(codec, frames, n, *, dtype=torch.float32, grad=torch.float32, step=None):
    """The FrameError a receiving protocol raises on a message of ``frames`` (one tensor each of
    ``n`` elements), and the one ``codec.decompress`` raises on each frame parsed without a check."""
    msg = pack_frames(frames)
    k = len(frames)
    with pytest.raises(FrameError) as protocol:
        wire.unpack_many(
            [msg],
            [[torch.Size([n])] * k],
            [[dtype] * k],
            grad_dtypes=None if grad is None else [[grad] * k],
            check=codec,
            names=[[f"t{i}" for i in range(k)]],
            ranks=[1],
            step=step,
        )
    for p in unpack_frames(msg, [torch.Size([n])] * k, [dtype] * k, step=step):
        with pytest.raises(FrameError):
            codec.decompress(p)
    assert "rank 1" in str(protocol.value) and "tensor 't" in str(protocol.value)
    return protocol.value


def _gaps(words, width):
    from gradzip.kernels import pack_uint

    return torch.cat([torch.tensor([width, words.numel()], dtype=torch.uint8), pack_uint(words, width)])


def test_a_gap_list_whose_positions_wrap_around_int64_is_refused_not_an_index_error():
    # minimal width, minimal count, zero padding and a last position below n: only the gaps' sum
    # (2**62 - 1 four times, then 5) wraps around int64, to positions that scatter anywhere
    n, big = 1000, (1 << 62) - 1
    words = torch.tensor([big, big, big, big, 5])
    vals = torch.arange(1.0, 6.0).view(torch.uint8)
    signs = (words << 1) | torch.tensor([0, 1, 0, 1, 0])
    for codec, f in (
        (gz.TopK(0.01, mode="sampled", sample=64), _frame(FMT_SPARSE, torch.cat([_gaps(words, 62), vals]), n)),
        (gz.TopK(0.01, scope="call"), _frame(FMT_SPARSE, torch.cat([_gaps(words, 62), vals]), n)),
        (gz.TopK(0.01, values="sign"), _frame(FMT_SPARSE_SIGN, _gaps(signs, 63), n, scale=0.5)),
        (gz.Threshold(tau=1.0), _frame(FMT_SIGNED_INDEX, _gaps(signs, 63), n, scale=1.0)),
    ):
        e = _refusal(codec, [f], n)
        assert e.field == "body.indices", (codec, e)


def test_a_sparse_frame_that_sends_no_position_is_refused():
    # a tensor a TopK sends nothing of travels as EMPTY (scope="call" only): before, an all-zero
    # mask (any configuration) and a zero-count gap list (sampled, approx) decoded to zeros
    for codec, n in ((gz.TopK(0.01), 1000), (gz.TopK(0.01), 8), (gz.TopK(0.05, scope="call"), 1000)):
        e = _refusal(codec, [_frame(FMT_SPARSE_MASK, bytes((n + 7) // 8), n)], n)
        # (gap-coded configurations: the empty mask is also longer than the gaps it replaces)
        assert e.field in (("body.count",) if codec.fixed_frames else ("body.count", "format")), (codec, n, e)
    for codec in (gz.TopK(0.01, mode="sampled", sample=64), gz.TopK(0.01, mode="approx", sample=64)):
        e = _refusal(codec, [_frame(FMT_SPARSE, bytes([1, 0]), 1000)], 1000)
        assert e.field == "body.count", (codec, e)


def test_sampled_topk_sends_at_least_one_position_where_its_sample_holds_nan():
    # a NaN in the sample made the threshold NaN, which nothing reached: a frame of no position
    codec = gz.TopK(0.01, mode="sampled", sample=64)
    for fill in (math.nan, None):
        x = torch.full((1000,), math.nan) if fill is not None else torch.randn(1000)
        if fill is None:
            x[::3] = math.nan
        for step in range(5):
            p = codec.compress(x, TensorContext(name="w", step=step))
            assert p.fmt == FMT_SPARSE and p.parsed[0].numel() == 10
            out = unpack_frames(pack_frames([p]), [x.shape], [x.dtype], check=codec)[0]  # its own receiver takes it
            assert out.checked


def test_a_half_precision_tensors_values_in_the_other_half_dtype_are_refused_without_grad_dtypes():
    # the public codec API (no protocol, so no gradient dtypes): a float16 input's values are float16
    x = (torch.randn(40, 30, generator=torch.Generator().manual_seed(0)) + 4.0).half()
    for codec in (gz.TopK(0.05), gz.TopK(0.05, mode="sampled", sample=64), gz.TopK(0.3), gz.TopK(1.0)):
        p = codec.compress(x, TensorContext(name="w", dtype=torch.float16))
        raw = bytearray(pack_frames([p]).numpy().tobytes())
        raw[9] = (raw[9] & 0x80) | 2  # value dtype code: float16 -> bfloat16 (a value near 4 read as ~7000)
        msg = torch.frombuffer(raw, dtype=torch.uint8)
        with pytest.raises(FrameError, match="value dtype"):
            codec.decompress(unpack_frames(msg, [x.shape], [torch.float16])[0])


def test_topk_frames_of_another_count_or_a_dense_frame_it_would_not_write_are_refused():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    y = torch.randn(1001, generator=torch.Generator().manual_seed(2))
    exact = gz.TopK(0.01)  # always 10 positions of 1000 elements, in Elias-Fano code
    for other in (gz.TopK(0.02), gz.TopK(0.05), gz.TopK(0.009)):
        e = _refusal(exact, [other.compress(x, TensorContext(name="t0"))], 1000)
        assert e.field == "body.count" and "sends 10 of 1000" in str(e), e
    for dense in (gz.TopK(1.0).compress(x), gz.Identity().compress(x)):
        assert _refusal(exact, [dense], 1000).field == "format"
    # two tensors' frames swapped (1000 and 1001 elements: 10 and 11 positions)
    a, b = exact.compress(x, TensorContext(name="a")), exact.compress(y, TensorContext(name="b"))
    msg = pack_frames([b, a])
    with pytest.raises(FrameError, match="body.count|length"):
        unpack_frames(msg, [x.shape, y.shape], [torch.float32] * 2, check=exact, names=["a", "b"])
    # sampled and approximate top-k: counts within their bands, DENSE only where it could be smaller
    sampled = gz.TopK(0.01, mode="sampled", sample=64)
    assert _refusal(sampled, [gz.TopK(0.02, mode="sampled", sample=64).compress(x)], 1000).field == "body.count"
    assert _refusal(sampled, [gz.TopK(1.0).compress(x)], 1000).field == "format"
    approx = gz.TopK(0.01, mode="approx", sample=64)
    assert _refusal(approx, [gz.TopK(0.02, mode="approx", sample=64).compress(x)], 1000).field == "body.count"
    # what each writes, its own receiver takes (the fuzz test above checks every configuration)
    for codec in (exact, sampled, approx, gz.TopK(1.0), gz.TopK(0.3)):
        p = codec.compress(x, TensorContext(name="t0"))
        assert unpack_frames(pack_frames([p]), [x.shape], [torch.float32], check=codec)[0].checked


def test_a_warm_up_schedules_count_is_checked_at_the_frames_step():
    ratio = gz.warmup.Linear(0.1, 0.01, steps=10)
    codec = gz.TopK(ratio)
    x = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    p = codec.compress(x, TensorContext(name="t0", step=4))  # ceil(0.064 * 1000) = 64 positions
    assert p.parsed[0].numel() == 64
    assert unpack_frames(pack_frames([p]), [x.shape], [x.dtype], check=codec, step=4)[0].checked
    e = _refusal(codec, [p], 1000, step=5)  # a frame of step 4 at step 5 (55 positions)
    assert e.field == "body.count" and "sends 55 of 1000" in str(e)
    # at an unknown step a schedule's count is not checked (a constant ratio's always is)
    assert unpack_frames(pack_frames([p]), [x.shape], [x.dtype], check=codec)[0].checked


def _train_schedules(rank, world, method):
    from tests.support import many_buckets_model, train_many_buckets

    state = train_many_buckets(many_buckets_model(), gz.parse(method), rank, 5)  # steps 0-4: ramp, then settled
    return state.stats()["steps"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "method",
    [
        "TwoPhase(TopK(ratio=Linear(0.2, 0.01, steps=4)))",
        "AllGather(TopK(ratio=Exponential(0.25, 0.01, steps=4, stages=2), mode='approx', sample=256))",
    ],
)
def test_every_rank_takes_the_frames_of_a_changing_count_at_four_ranks(method):
    from tests.support import run_ranks

    # the receivers check each frame's count at the call's step: a wrong step would refuse them
    assert run_ranks(_train_schedules, 4, method) == [5] * 4
