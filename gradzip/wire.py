"""Wire formats: the bytes that really cross the network.

A codec turns one tensor into a :class:`Payload`. Payloads of summable codecs
are tensors in a wire dtype that allreduce adds up. The others are *frames*: an
entry in the message's table plus a body of packed bytes. One message per call
(a DDP bucket) carries the frames of all its tensors, with one header::

    message = header | entry[0] .. entry[T-1] | body[0] | body[1] | ...

Header (little-endian, 8 bytes): ``u8 version`` (:data:`WIRE_VERSION`), ``u8 flags``
(0, or :data:`FLAG_CRC32`: a ``u32`` CRC-32 of the message follows the header), ``u16 0``,
``u32 T`` (the frame count). Entry, per frame (6 bytes, 10 with a scale)::

    u8  fmt        format code (registered by the codec that writes it, see formats())
    u8  vdtype     dtype code of the values in the body; bit 7 set: a scale follows
    u32 nbytes     body length in bytes
    f32 scale      only where bit 7 is set: a per-frame scalar (threshold tau, QSGD s)

Bodies follow back to back, without padding (a receiver copies a body that it
must view as a wider dtype at an unaligned offset). A receiver learns the tensor
count and shapes from its own model, never from the wire. Version 1 (gradzip
0.1) gave every frame a 16-byte header and padded bodies to 8 bytes.

**Receivers distrust the message.** :func:`unpack_frames` refuses what no gradzip
writer produces: another version, unknown flags, nonzero reserved bytes, another
frame count, an unknown value-dtype code, a scale flag with a zero scale, bodies
beyond the message, nonzero bytes after the last body (an all-gather pads with
zeros), and, with the codec passed as ``check``, every frame the codec could not
have written (:meth:`gradzip.codecs.base.Codec.check_frame`: its formats, value
dtypes, scale, lengths consistent with the shape, codes). Every refusal is a
:class:`FrameError` (a ``ValueError``) naming the frame, its tensor (where the
protocol knows it), the sending rank and the field. A corruption that leaves a
frame its codec could have written (a value byte) decodes as that frame; the
optional checksum (:func:`set_checksum`) catches those too.

**Rounds.** Receivers decode the ranks in rank order into one float32 buffer (float64 for
float64 gradients), so every rank computes the same floats. :func:`pack_round` packs a round's
messages with one copy of all their tables to the device (and the bodies by one strided copy
where each message is one frame whose bodies are the rows of one view); :func:`unpack_many`
parses every sender's message of a round with one host copy of their tables, which reaches
:data:`HEAD_BYTES` into each message's first body (handed to the codec as ``Payload.head``),
one padding test (its flag read with the codec's own check, :func:`host_values`) and one
``check_frames`` over all their frames; where one fails it re-checks message by message, so a
refusal names the same frame, tensor and rank.

**Planned rounds.** A codec whose entry is a function of the tensor's size alone
(:meth:`~gradzip.codecs.base.Codec.planned_entry`: the block quantizers) lets a receiver know
every byte of a round's headers, tables and padding before the round arrives. On the engine's
GPU side with ``on_nonfinite="skip"`` (``unpack_many(defer=...)``) the round is parsed from that
plan, built once per layout: one gather of every row's table and padding bytes compared with
the expected ones, and one pass of the codec's body check
(:meth:`~gradzip.codecs.base.Codec.planned_status`) give a device flag, and nothing is read on
the host. Where the flag is set, the engine makes the call's result NaN,
rolls the step back and, when the step ends, parses the kept messages on the host: the
:class:`FrameError` of the host path (its text), raised at the next call. A message that parses
but is not the plan's (a peer with the checksum on) is refused as field ``layout``. With the
checksum on, rounds are parsed on the host.
"""

from __future__ import annotations

import contextvars
import os
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch

import gradzip.kernels as K

WIRE_VERSION = 2
HEADER = struct.Struct("<BBHI")
HEADER_BYTES = HEADER.size  # 8, once per message
ENTRY = struct.Struct("<BBI")
ENTRY_BYTES = ENTRY.size  # 6 per frame
SCALE = struct.Struct("<f")
CRC = struct.Struct("<I")
_HAS_SCALE = 0x80
#: Header flag: a u32 CRC-32 (zlib's) of the message follows the header, computed over the
#: header, the entries and the bodies (not over itself, nor over trailing padding).
FLAG_CRC32 = 0x01
_FLAGS = FLAG_CRC32

_checksum = os.environ.get("GRADZIP_WIRE_CRC32", "") not in ("", "0")


def set_checksum(on: bool) -> bool:
    """Whether :func:`pack_frames` appends a CRC-32 of every message (off by default; the
    environment variable ``GRADZIP_WIRE_CRC32=1`` turns it on at import). A receiver checks
    the CRC of every message that carries one, whatever its own setting. Returns the
    previous setting. Costs a pass of zlib's CRC-32 over each message on the host, on the
    sender and on every receiver (a device-to-host copy of the message on GPUs):
    ``docs/reliability.md`` gives the measured cost."""
    global _checksum
    if not isinstance(on, bool):
        raise ValueError(f"set_checksum takes True or False, got {on!r}")
    old, _checksum = _checksum, on
    return old


def checksum_enabled() -> bool:
    return _checksum


class FrameError(ValueError):
    """A message or frame that no gradzip writer produces (a ``ValueError``).

    Names the ``field`` (``"format"``, ``"value dtype"``, ``"scale"``, ``"length"``,
    ``"body.codes"``, ...) and, once a protocol has placed it, the ``frame`` index in its
    message, the ``tensor`` it belongs to and the ``rank`` that sent it."""

    def __init__(self, field: str, detail: str, *, frame=None, tensor=None, rank=None) -> None:
        self.field, self.detail = field, detail
        self.frame, self.tensor, self.rank = frame, tensor, rank
        super().__init__(self._text())

    def at(self, *, frame=None, tensor=None, rank=None) -> FrameError:
        """Fill in where the frame was (what is known already is kept); returns ``self``."""
        self.frame = self.frame if self.frame is not None else frame
        self.tensor = self.tensor if self.tensor is not None else tensor
        self.rank = self.rank if self.rank is not None else rank
        self.args = (self._text(),)
        return self

    def _text(self) -> str:
        where = "corrupt message"
        if self.rank is not None:
            where += f" from rank {self.rank}"
        if self.frame is not None:
            where += f": frame {self.frame}"
            if self.tensor is not None:
                where += f" (tensor {self.tensor!r})"
        return f"{where}, field {self.field}: {self.detail}"


# Format codes are unique across the package: a codec declares the formats it writes
# (``Codec.formats``) and registering a code twice raises. Two belong to no codec:
FMT_EMPTY = 0  # all zeros; no body
FMT_DENSE = 1  # body: every element, in vdtype
_FORMATS: dict[int, str] = {FMT_EMPTY: "wire.EMPTY", FMT_DENSE: "wire.DENSE"}


def register_format(code: int, label: str) -> int:
    """Claim a frame format code (0..255) for ``label`` ("Codec.NAME"); a code claimed by
    another label raises ``ValueError``. Returns ``code``."""
    if isinstance(code, bool) or not isinstance(code, int) or not 0 <= code <= 255:
        raise ValueError(f"format code of {label} must be an integer in [0, 255], got {code!r}")
    owner = _FORMATS.setdefault(code, label)
    if owner != label:
        raise ValueError(f"format code {code} of {label} is already taken by {owner}")
    return code


def formats() -> dict[int, str]:
    """Every registered format code and its owner."""
    return dict(_FORMATS)


_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}
_CODE_DTYPES = {v: k for k, v in _DTYPE_CODES.items()}


def dtype_code(dtype: torch.dtype) -> int:
    try:
        return _DTYPE_CODES[dtype]
    except KeyError:
        raise TypeError(f"no wire code for dtype {dtype}; floating dtypes only") from None


def code_dtype(code: int) -> torch.dtype:
    try:
        return _CODE_DTYPES[code]
    except KeyError:
        raise FrameError("value dtype", f"unknown value dtype code {code}") from None


def narrow(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype``, finite values beyond its range clipped to its largest (a decoded
    average of float16 gradients may exceed 65504); NaN and infinities stay as they are."""
    if t.dtype == dtype or torch.finfo(t.dtype).max <= torch.finfo(dtype).max:
        return t.to(dtype)
    m = torch.finfo(dtype).max
    big = t.abs() > m
    if not bool((big & torch.isfinite(t)).any()):
        return t.to(dtype)
    return torch.where(torch.isfinite(t), t.clamp(-m, m), t).to(dtype)


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums are done in: float64 stays float64, everything else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class Payload:
    """One compressed tensor.

    ``body`` is what goes on the wire: uint8 bytes of a frame body for framed
    payloads, or a tensor in the wire dtype for summable ones. ``local`` holds
    data that every rank can rebuild by itself (random-k's shared indices) and
    that is never sent.

    Args:
        body: the wire tensor (uint8 frame body, or the summable wire-dtype tensor).
        shape: the original tensor's shape.
        dtype: the original tensor's dtype.
        fmt: the wire format code (:func:`gradzip.wire.formats`).
        vdtype: the dtype of the values in the body, where it differs from ``dtype``.
        scale: the per-frame f32 scale (Threshold's tau, QSGD's levels), 0 for none.
        local: data every rank rebuilds itself (never sent).
        grad_dtype: on a received frame, the dtype of the gradient the sender compressed
            (the receiver's own, from its model), where the receiver knows it: the value
            dtypes a codec may write depend on it.
        step: on a received frame, the engine step it was written at, where the receiver
            knows it (every rank's engine is at the same step): a count that follows a
            warm-up schedule depends on it.
        checked: a received frame its codec has validated (:meth:`Codec.check_frame`);
            decoders then skip the checks.
    """

    body: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    fmt: int = FMT_DENSE
    vdtype: torch.dtype | None = None
    scale: float = 0.0
    local: Any = field(default=None, repr=False)
    grad_dtype: torch.dtype | None = field(default=None, repr=False)
    step: int | None = field(default=None, repr=False, compare=False)
    checked: bool = field(default=False, repr=False)
    #: what a validation parsed from the body (sparse positions), reused by the decode
    parsed: Any = field(default=None, repr=False, compare=False)
    #: a received body's first bytes (up to :data:`HEAD_BYTES`), already on the host: read with
    #: its message's table (:func:`unpack_many`), so a check of the body's own header needs no copy
    head: bytes | None = field(default=None, repr=False, compare=False)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def itemsize(dtype: torch.dtype | None) -> int:
    """Bytes per element of ``dtype`` (None: torch's default dtype, as ``torch.empty`` reads
    it), with no tensor made: no operation on a step's path."""
    return (dtype if dtype is not None else torch.get_default_dtype()).itemsize


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of a contiguous tensor's bytes (a copy only if not contiguous)."""
    t = t.contiguous().reshape(-1)
    if t.dtype == torch.uint8:
        return t
    return t.view(torch.uint8)


def span_view(tensors) -> tuple[torch.Tensor, list[int]] | None:
    """One flat view from the start of the first of ``tensors`` to the end of the last, and
    each one's offset in it, when they lie in one storage in order, apart or back to back
    (a gathered round's messages, padding between them), contiguous and of one dtype and
    device; else None."""
    if not tensors or any(t is None for t in tensors):
        return None
    t0 = tensors[0]
    storage = t0.untyped_storage().data_ptr()
    start = pos = t0.storage_offset()
    offsets = []
    for t in tensors:
        if t.dtype != t0.dtype or t.device != t0.device or not t.is_contiguous():
            return None
        if t.numel() and (t.untyped_storage().data_ptr() != storage or t.storage_offset() < pos):
            return None
        at = t.storage_offset() if t.numel() else pos
        offsets.append(at - start)
        pos = at + t.numel()
    return torch.as_strided(t0, (pos - start,), (1,), start), offsets


def run_view(tensors) -> torch.Tensor | None:
    """One flat view of ``tensors`` when they lie back to back in one storage, in order,
    contiguous and of one dtype and device; else None (None too when one of them is None)."""
    got = span_view(tensors)
    if got is None or got[0].numel() != sum(t.numel() for t in tensors):
        return None  # not in one storage, or apart
    return got[0]


def from_bytes(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret uint8 bytes as ``dtype`` (a copy where ``b`` is not aligned for it)."""
    if dtype == torch.uint8:
        return b
    if b.numel() == 0:
        return torch.empty(0, dtype=dtype, device=b.device)
    size = itemsize(dtype)
    if b.storage_offset() % size or not b.is_contiguous():
        b = b.clone()
    return b.view(dtype)


def frame_nbytes(body_nbytes: int, scale: bool = False) -> int:
    """Bytes one frame adds to a message: its entry and body."""
    return ENTRY_BYTES + (SCALE.size if scale else 0) + body_nbytes


def _entry(p: Payload) -> bytes:
    return _entry_bytes(p.fmt, p.vdtype, p.body.numel() * p.body.element_size(), p.scale)


def _entry_bytes(fmt: int, vdtype: torch.dtype | None, nb: int, scale: float) -> bytes:
    vcode = dtype_code(vdtype) if vdtype is not None else 0
    if scale:
        return ENTRY.pack(fmt, vcode | _HAS_SCALE, nb) + SCALE.pack(float(scale))
    return ENTRY.pack(fmt, vcode, nb)


def entries_table(entries) -> bytearray:
    """The header and entry table (no checksum) of a message whose frames have ``entries``,
    ``(format, value dtype, body bytes, scale)`` each (:meth:`Codec.planned_entry`'s)."""
    table = bytearray(HEADER.pack(WIRE_VERSION, 0, 0, len(entries)))
    for e in entries:
        table += _entry_bytes(*e)
    return table


def entries_nbytes(entries, crc: bool) -> int:
    """Bytes of a message whose frames have ``entries``, with the checksum's 4 where ``crc``
    (:func:`message_capacity`'s room for it)."""
    return HEADER_BYTES + (CRC.size if crc else 0) + sum(frame_nbytes(e[2], bool(e[3])) for e in entries)


def message_nbytes(payloads: list[Payload]) -> int:
    """Bytes of the message :func:`pack_frames` writes for ``payloads`` (with the checksum's
    4 bytes when it is on)."""
    return (
        HEADER_BYTES
        + (CRC.size if _checksum else 0)
        + sum(frame_nbytes(p.body.numel() * p.body.element_size(), bool(p.scale)) for p in payloads)
    )


def message_capacity(payloads: list[Payload]) -> int:
    """Bytes that hold the message of ``payloads`` with or without the checksum: what a rank
    pads its message to when the ranks know every frame's length without asking (AllGather of
    ``fixed_frames`` codecs), whatever each rank's :func:`set_checksum`."""
    return (
        HEADER_BYTES
        + CRC.size
        + sum(frame_nbytes(p.body.numel() * p.body.element_size(), bool(p.scale)) for p in payloads)
    )


def pad_message(msg: torch.Tensor, size: int) -> torch.Tensor:
    """``msg`` with zero bytes after it up to ``size`` (trailing padding: no frame reads it, the
    checksum does not cover it). A message longer than ``size`` raises: the ranks all-gather
    ``size`` bytes each, and a longer message would not fit."""
    if msg.numel() > size:
        raise RuntimeError(f"a message of {msg.numel()} bytes exceeds the {size} bytes the ranks agreed on")
    return torch.cat([msg, msg.new_zeros(size - msg.numel())]) if msg.numel() < size else msg


def _crc32(msg: torch.Tensor, end: int) -> int:
    """CRC-32 of a message's header, entries and bodies (bytes ``[0, 8)`` and ``[12, end)``)."""
    raw = msg[:end].cpu().numpy()
    return zlib.crc32(raw[HEADER_BYTES + CRC.size :], zlib.crc32(raw[:HEADER_BYTES])) & 0xFFFFFFFF


def _table_bytes(payloads: list[Payload], crc: bool) -> bytearray:
    """A message's header (and zeroed CRC field) and entry table."""
    table = bytearray(HEADER.pack(WIRE_VERSION, FLAG_CRC32 if crc else 0, 0, len(payloads)))
    if crc:
        table += CRC.pack(0)  # filled in by pack_frames
    for p in payloads:
        table += _entry(p)
    return table


def _put_bodies(msg: torch.Tensor, off: int, payloads: list[Payload]) -> None:
    """Copy the payloads' bodies into ``msg`` from byte ``off``, back to back."""
    for p in payloads:
        b = p.body
        if b.dtype != torch.uint8 or b.dim() != 1 or not b.is_contiguous():
            b = as_bytes(b)
        msg[off : off + b.numel()] = b
        off += b.numel()


#: Byte positions of the entry tables of the rounds packed so far (a call's layout recurs every step).
_TABLE_AT: dict = {}
_TABLE_AT_MAX = 256


def pack_round(groups: list[list[Payload]], out: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """:func:`pack_frames` of every message of a round (``groups[j]``'s frames) into ``out``'s
    consecutive slices of ``sizes[j]`` bytes, returned as views: the same bytes, for a few
    operations a round instead of a few a message. Every table goes to the device by one
    copy, written by one indexed store; the padding is one fill of ``out`` before the bodies.
    With the checksum on, message by message (each message's CRC is computed on the host)."""
    if len(groups) != len(sizes) or sum(sizes) != out.numel():
        raise ValueError(f"{len(groups)} messages of {sum(sizes)} bytes into {out.numel()} bytes")
    msgs = list(out.split_with_sizes(sizes))  # every message's slice, by one operation
    if _checksum or not groups:
        return [pack_frames(g, out=m) for g, m in zip(groups, msgs)]
    blob, where, pos = bytearray(), [], 0
    for g, size in zip(groups, sizes):
        table = _table_bytes(g, False)
        total = len(table) + sum(p.body.numel() * p.body.element_size() for p in g)
        if total > size:
            raise RuntimeError(f"a message of {total} bytes exceeds the {size} bytes the ranks agreed on")
        where.append((pos, len(table)))
        blob += table
        pos += size
    key = (tuple(where), str(out.device))
    at = _TABLE_AT.get(key)
    if at is None:
        at = K.host_to_device(torch.cat([torch.arange(p, p + n, dtype=torch.int64) for p, n in where]), out.device)
        if len(_TABLE_AT) >= _TABLE_AT_MAX:
            _TABLE_AT.clear()
        _TABLE_AT[key] = at
    out.zero_()
    out.index_put_((at,), K.host_to_device(torch.frombuffer(blob, dtype=torch.uint8), out.device))
    rows = _body_rows(groups, sizes, where)
    if rows is not None:  # one frame a message, the rows of one view, to one place in each
        src, n = rows
        torch.as_strided(out, src.shape, (sizes[0], 1), out.storage_offset() + n).copy_(src)
        return msgs
    for msg, g, (_, n) in zip(msgs, groups, where):
        _put_bodies(msg, n, g)
    return msgs


def _body_rows(groups: list[list[Payload]], sizes: list[int], where: list) -> tuple[torch.Tensor, int] | None:
    """For :func:`pack_round`: ``(the bodies as the rows of one 2-D view, the table's bytes)``
    where every message holds one frame, all messages and tables have one length and the bodies
    lie as rows (a codec's pieces encoded together: TwoPhase's first round of a ``Flat``
    bucket), so that one strided copy writes every body; else None."""
    if len(groups) < 2 or any(len(g) != 1 for g in groups):
        return None
    if len(set(sizes)) != 1 or len({n for _, n in where}) != 1:
        return None
    src = row_view([g[0].body for g in groups])
    return None if src is None else (src, where[0][1])


def pack_frames(
    payloads: list[Payload],
    device: torch.device | None = None,
    *,
    size: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Concatenate framed payloads into one uint8 message (with a CRC-32 after the header
    when :func:`set_checksum` is on).

    ``size``: the message padded with zero bytes to that length, in the same copy (what
    :func:`pad_message` makes of it); ``out``: written into this contiguous uint8 tensor
    (padded to its length) and returned, e.g. a rank's slice of a round's send buffer. A
    message longer than either raises, as :func:`pad_message` does."""
    crc = _checksum
    table = _table_bytes(payloads, crc)
    total = len(table) + sum(p.body.numel() * p.body.element_size() for p in payloads)
    if out is not None:
        device, size = out.device, out.numel()
    elif device is None:
        device = payloads[0].body.device if payloads else torch.device("cpu")
    size = total if size is None else size
    if total > size:
        raise RuntimeError(f"a message of {total} bytes exceeds the {size} bytes the ranks agreed on")
    msg = torch.empty(size, dtype=torch.uint8, device=device) if out is None else out
    msg[: len(table)] = K.host_to_device(torch.frombuffer(table, dtype=torch.uint8), device)
    _put_bodies(msg, len(table), payloads)
    if size > total:
        msg[total:].zero_()
    if crc:
        crc32 = torch.frombuffer(bytearray(CRC.pack(_crc32(msg, total))), dtype=torch.uint8)
        msg[HEADER_BYTES : HEADER_BYTES + CRC.size] = K.host_to_device(crc32, device)
    return msg


def unpack_frames(
    msg: torch.Tensor,
    shapes: list[torch.Size],
    dtypes: list[torch.dtype],
    *,
    grad_dtypes: list[torch.dtype] | None = None,
    check=None,
    names: list[str] | None = None,
    rank: int | None = None,
    step: int | None = None,
) -> list[Payload]:
    """Split a message into payloads; bodies are views into ``msg``.

    ``msg`` may carry trailing zero padding (from a padded all-gather); it is ignored.
    ``grad_dtypes``: the dtype of each frame's gradient (see :attr:`Payload.grad_dtype`),
    ``step`` the step the frames were written at (:attr:`Payload.step`). ``check``: the codec
    that wrote the frames; every frame is then validated by its
    :meth:`~gradzip.codecs.base.Codec.check_frames`. ``names`` (per frame) and ``rank``
    (the sender) only name the culprit in a refusal. Anything no writer produces raises
    :class:`FrameError` naming the frame, the tensor, the rank and the field.
    """
    try:
        return _unpack(msg, shapes, dtypes, grad_dtypes, check, step)
    except FrameError as e:
        tensor = names[e.frame] if names is not None and e.frame is not None and e.frame < len(names) else None
        raise e.at(tensor=tensor, rank=rank) from None


#: Bytes of a received body that :func:`unpack_many` copies to the host with its message's table
#: (:attr:`Payload.head`): an Elias-Fano frame's count and layout lie in its first 10.
HEAD_BYTES = 16


def _table_limit(count: int) -> int:
    """Bytes of a message of ``count`` frames that its header and entry table can take."""
    return HEADER_BYTES + CRC.size + (ENTRY_BYTES + SCALE.size) * count


def _table(raw: bytes, size: int, count: int) -> tuple[int, int, list, int]:
    """Parse a message's header and entry table from ``raw`` (its first bytes on the host, at
    least ``min(size, _table_limit(count))`` of them): ``(flags, the bodies' start, entries,
    the bodies' end)``; every refusal of the header and the table."""
    if size < HEADER_BYTES:
        raise FrameError("length", f"{size} bytes, need at least {HEADER_BYTES} for the header")
    version, flags, reserved, n = HEADER.unpack_from(raw, 0)
    if version != WIRE_VERSION:
        raise FrameError("version", f"message of wire version {version}; this gradzip reads version {WIRE_VERSION}")
    if flags & ~_FLAGS:
        raise FrameError("flags", f"unknown header flags {flags:#04x}")
    if reserved:
        raise FrameError("reserved", f"reserved header bytes hold {reserved}, not 0")
    if n != count:
        raise FrameError("count", f"{n} frames, the receiver expects {count}")
    pos = HEADER_BYTES + (CRC.size if flags & FLAG_CRC32 else 0)
    need = pos + ENTRY_BYTES * count
    if size < need:
        raise FrameError("length", f"{size} bytes, need at least {need} for {count} frames")
    raw = raw[: min(size, need + SCALE.size * count)]
    entries = []
    for i in range(count):
        if pos + ENTRY_BYTES > len(raw):
            raise FrameError("length", f"entry {i} is cut off", frame=i)
        fmt, vcode, nb = ENTRY.unpack_from(raw, pos)
        pos += ENTRY_BYTES
        scale = 0.0
        if vcode & _HAS_SCALE:
            if pos + SCALE.size > len(raw):
                raise FrameError("length", "the scale is cut off", frame=i)
            (scale,) = SCALE.unpack_from(raw, pos)
            pos += SCALE.size
            if scale == 0.0:
                raise FrameError(
                    "scale flag",
                    "the scale flag is set over a zero scale (writers set it for nonzero scales only)",
                    frame=i,
                )
        code = vcode & ~_HAS_SCALE
        if code not in _CODE_DTYPES:
            raise FrameError("value dtype", f"unknown value dtype code {code}", frame=i)
        entries.append((fmt, _CODE_DTYPES[code], nb, scale))
    end = pos + sum(e[2] for e in entries)
    if end > size:  # the table's lengths, not a frame's: an entry anywhere may be what changed
        raise FrameError(
            "length", f"the entries claim {end - pos} body bytes after a {pos}-byte table; the message holds {size}"
        )
    return flags, pos, entries, end


def _check_crc(msg: torch.Tensor, flags: int, end: int) -> None:
    if flags & FLAG_CRC32:
        (want,) = CRC.unpack(msg[HEADER_BYTES : HEADER_BYTES + CRC.size].cpu().numpy().tobytes())
        got = _crc32(msg, end)
        if got != want:
            raise FrameError("checksum", f"CRC-32 {got:#010x} of the message, the header says {want:#010x}")


def _padding_error(msg: torch.Tensor, end: int) -> FrameError:
    return FrameError("padding", f"nonzero bytes after the last body (bytes {end} to {msg.numel()})")


def _payloads(
    msg, pos, entries, shapes, dtypes, grad_dtypes, host: bytes = b"", step=None, bodies=None
) -> list[Payload]:
    """The frames of a parsed message; ``host``: the message's first bytes on the host, which
    give each body that starts within them its :attr:`Payload.head`; ``bodies``: the bodies,
    cut already."""
    nbs = [e[2] for e in entries]
    if bodies is None and len(nbs) > 1:
        bodies = msg[pos : pos + sum(nbs)].split_with_sizes(nbs)  # back to back: one operation
    elif bodies is None:
        bodies = [msg[pos : pos + nb] for nb in nbs]
    out, off = [], pos
    for i, (fmt, vdtype, nb, scale) in enumerate(entries):
        want = min(HEAD_BYTES, nb)
        out.append(
            Payload(
                body=bodies[i],
                shape=shapes[i],
                dtype=dtypes[i],
                fmt=fmt,
                vdtype=vdtype,
                scale=scale,
                grad_dtype=grad_dtypes[i] if grad_dtypes is not None else None,
                step=step,
                head=host[off : off + want] if off + want <= len(host) else None,
            )
        )
        off += nb
    return out


def _unpack(msg, shapes, dtypes, grad_dtypes, check, step=None) -> list[Payload]:
    count, size = len(shapes), msg.numel()
    raw = msg[: min(size, _table_limit(count))].cpu().numpy().tobytes()
    flags, pos, entries, end = _table(raw, size, count)
    if end < size and bool(msg[end:].any()):
        raise _padding_error(msg, end)
    _check_crc(msg, flags, end)
    out = _payloads(msg, pos, entries, shapes, dtypes, grad_dtypes, step=step)
    if check is not None:
        check.check_frames(out)
        for p in out:
            p.checked = True
    return out


class _Pending:
    """A round's padding test (a 0-d bool on the device) not read yet, and its value once read."""

    __slots__ = ("flag", "value")

    def __init__(self, flag: torch.Tensor):
        self.flag, self.value = flag, None

    def read(self) -> bool:
        if self.value is None:
            self.value = bool(self.flag)
        return self.value


_ROUND: contextvars.ContextVar[_Pending | None] = contextvars.ContextVar("gradzip_round", default=None)


def host_values(t: torch.Tensor):
    """``t.tolist()`` (a 0-d or 1-d tensor): the host read of a codec's frame check. Within
    :func:`unpack_many`'s check of a round, the round's padding test, a device flag not read
    yet, comes to the host in the same copy: one host sync a round fewer. ``unpack_many``
    refuses dirty padding after the check returns or raises, so the padding's refusal still
    comes first, as :func:`unpack_frames` orders them."""
    p = _ROUND.get()
    if p is None or p.value is not None or t.dim() > 1 or p.flag.device != t.device:
        return t.tolist()
    vals = torch.cat([t if t.dim() else t.reshape(1), p.flag.reshape(1)]).tolist()  # t's dtype: bool is the lowest
    p.value = bool(vals.pop())
    return vals[0] if t.dim() == 0 else vals


def row_view(msgs: list[torch.Tensor]) -> torch.Tensor | None:
    """``msgs`` as the rows of one 2-D view, where they are two or more contiguous uint8
    tensors of one length lying in one storage at one stride (a gathered round's fixed-length
    messages); else None."""
    if len(msgs) < 2:
        return None
    m0, n = msgs[0], msgs[0].numel()
    st, o0 = m0.untyped_storage().data_ptr(), m0.storage_offset()
    stride = msgs[1].storage_offset() - o0
    if n == 0 or stride < n:
        return None
    for j, m in enumerate(msgs):
        if (
            m.dtype != torch.uint8
            or m.numel() != n
            or not m.is_contiguous()
            or m.untyped_storage().data_ptr() != st
            or m.storage_offset() != o0 + j * stride
        ):
            return None
    return torch.as_strided(m0, (len(msgs), n), (stride, 1), o0)


class _Plan:
    """What every message of a planned round must hold where no body lies (:func:`_planned`):
    ``at``, the positions in the rows' span of every row's header, entries and padding, and
    ``want``, the bytes they must hold (the tables, then zeros), both on the device and the size
    of the tables, not of the messages; each message's entries and body start; every body's
    ``(offset in the rows' span, elements)`` for the codec's body check."""

    __slots__ = ("at", "want", "entries", "pos", "bodies")

    def __init__(self, entries, width: int, stride: int, counts, device) -> None:
        self.entries, self.bodies = entries, []
        at, want, pos = [], bytearray(), set()
        for j, es in enumerate(entries):
            table = entries_table(es)
            end = len(table) + sum(e[2] for e in es)
            if end > width:
                raise ValueError(f"the plan's message of {end} bytes exceeds the round's {width}")
            off = len(table)
            for (_, _, nb, _), n in zip(es, counts[j]):
                self.bodies.append((j * stride + off, n))
                off += nb
            at += [j * stride + i for i in range(len(table))] + [j * stride + i for i in range(end, width)]
            want += table + bytes(width - end)
            pos.add(len(table))
        if len(pos) != 1:
            raise ValueError("a planned round's messages carry tables of one length")
        (self.pos,) = pos
        self.at = K.host_to_device(torch.tensor(at, dtype=torch.int64), device)
        self.want = K.host_to_device(torch.frombuffer(want, dtype=torch.uint8), device)


#: Planned rounds by (entries, width, stride, device): a call's layout recurs every step.
_PLANS: dict = {}
_PLANS_MAX = 256


def _planned(msgs, shapes, check, grad_dtypes=None):
    """The plan of a round whose layout the receiver knows (:meth:`Codec.planned_entry`) and
    its check left on the device: ``(plan, a 0-d bool: some table, padding byte or body is not
    what the plan and the codec allow, the messages as the rows of one view)``; None where the
    round cannot be planned (the messages not the rows of one view, a codec without a plan)."""
    if not msgs:
        return None
    rows = row_view(msgs) if len(msgs) > 1 else (msgs[0].view(1, -1) if msgs[0].is_contiguous() else None)
    if rows is None or rows.dtype != torch.uint8:
        return None
    counts = tuple(tuple(s.numel() for s in sh) for sh in shapes)
    entries = []
    for j, ns in enumerate(counts):
        gds = grad_dtypes[j] if grad_dtypes is not None else [None] * len(ns)
        es = tuple(check.planned_entry(n, g) for n, g in zip(ns, gds))
        if any(e is None for e in es):
            return None
        entries.append(es)
    stride = rows.stride(0) if rows.shape[0] > 1 else rows.shape[1]
    key = (tuple(entries), rows.shape[1], stride, str(rows.device))
    plan = _PLANS.get(key)
    if plan is None:
        try:
            plan = _Plan(entries, rows.shape[1], stride, counts, rows.device)
        except ValueError:  # the round is not the plan's: the host parses it
            return None
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.clear()
        _PLANS[key] = plan
    span = (rows.shape[0] - 1) * stride + rows.shape[1]
    whole = torch.as_strided(rows, (span,), (1,), rows.storage_offset())
    bad = (whole.index_select(0, plan.at) != plan.want).any() | check.planned_status(whole, plan.bodies)
    return plan, bad, rows


def _cut_rows(rows: torch.Tensor, plan: _Plan):
    """Every message's bodies as views of the rows, a few operations for the round (not one a
    message), where every message holds the same entries; else None."""
    first = plan.entries[0]
    if not first or any(es != first for es in plan.entries):
        return None
    nbs = [e[2] for e in first]
    block = rows[:, plan.pos : plan.pos + sum(nbs)]
    if len(nbs) == 1:
        return [[b] for b in block.unbind(0)]
    frames = [f.unbind(0) for f in block.split_with_sizes(nbs, dim=1)]
    return [[f[j] for f in frames] for j in range(rows.shape[0])]


def _unpack_planned(msgs, shapes, dtypes, grad_dtypes, check, names, ranks, step, defer):
    """:func:`unpack_many`'s ``defer`` path: the payloads cut from the round's plan, and
    ``(flag, refuse)`` appended to ``defer``; None where the round cannot be planned."""
    got = _planned(msgs, shapes, check, grad_dtypes)
    if got is None:
        return None
    plan, flag, rows = got
    cut = _cut_rows(rows, plan)
    outs = []
    for j, m in enumerate(msgs):
        grads = None if grad_dtypes is None else grad_dtypes[j]
        out = _payloads(m, plan.pos, plan.entries[j], shapes[j], dtypes[j], grads, b"", step, cut and cut[j])
        for p in out:
            p.checked = True
        outs.append(out)
    parsed = check.planned_parse([p for out in outs for p in out])
    if parsed is not None:
        flag = flag | parsed

    def refuse() -> FrameError:  # the host path's parse of the kept messages
        return host_refusal(msgs, shapes, dtypes, grad_dtypes, check, names, ranks, step)

    defer.append((flag, refuse))
    return outs


def host_refusal(msgs, shapes, dtypes, grad_dtypes, check, names, ranks, step, *, layout: bool = True):
    """The :class:`FrameError` the host path raises for a planned round whose device check
    failed (:func:`unpack_many` of the kept messages, no ``defer``); where they parse, one of
    field ``layout`` (a table or padding the plan did not expect), or None with
    ``layout=False``."""
    try:
        unpack_many(msgs, shapes, dtypes, grad_dtypes=grad_dtypes, check=check, names=names, ranks=ranks, step=step)
    except FrameError as e:
        return e
    if not layout:
        return None
    return FrameError(
        "layout",
        "a message parses but differs from the round's plan (its table or padding): every rank "
        "must run the same gradzip with the same set_checksum",
    )


def unpack_many(
    msgs: list[torch.Tensor],
    shapes: list[list[torch.Size]],
    dtypes: list[list[torch.dtype]],
    *,
    grad_dtypes: list[list[torch.dtype]] | None = None,
    check=None,
    names: list[list[str]] | None = None,
    ranks: list[int] | None = None,
    step: int | None = None,
    defer: list | None = None,
) -> list[list[Payload]]:
    """:func:`unpack_frames` of several messages (the senders of one round; ``shapes``,
    ``dtypes``, ``grad_dtypes`` and ``names`` per message, ``ranks`` their senders, ``step``
    the round's), with
    the same refusals, naming the message's sender, for a few host syncs in all instead of a
    few per message: one copy of every message's header and entry table to the host, one
    test of every message's padding (read in the codec's own host read where it has one:
    :func:`host_values`), and one :meth:`~gradzip.codecs.base.Codec.check_frames` over all
    the frames. Where a test finds a fault, the messages are checked one by one, so
    a refusal names the same frame, tensor and rank as :func:`unpack_frames` would.

    ``defer`` (a list; the engine's GPU side with ``on_nonfinite="skip"``): where ``check``
    plans its frames (:meth:`~gradzip.codecs.base.Codec.planned_entry`) and the checksum is
    off, the round is parsed from the plan with no host read; the tables, the padding and the
    bodies are tested on the device, and ``(flag, refuse)`` is appended to ``defer``: a 0-d
    bool, set where a message is not what the plan and the codec allow, and a function that
    parses the kept messages on the host and returns the :class:`FrameError` the host path
    would have raised (one of field ``layout`` where they parse: a table the plan did not
    expect, from a peer with the checksum on, say). The caller makes the result NaN where the
    flag is set and raises the error later (the engine: at the next step's first call)."""
    if defer is not None and check is not None and not _checksum:
        outs = _unpack_planned(msgs, shapes, dtypes, grad_dtypes, check, names, ranks, step, defer)
        if outs is not None:
            return outs
    k = len(msgs)

    def named(e: FrameError, j: int) -> FrameError:
        ns = names[j] if names is not None else None
        tensor = ns[e.frame] if ns is not None and e.frame is not None and e.frame < len(ns) else None
        return e.at(tensor=tensor, rank=ranks[j] if ranks is not None else None)

    # the header and table, and the first body's first bytes (its head, for the codec's check)
    lims = [min(m.numel(), _table_limit(len(shapes[j])) + HEAD_BYTES) for j, m in enumerate(msgs)]
    rows = row_view(msgs)  # a round's messages at one stride in one buffer: one view of them all
    if rows is not None and len(set(lims)) == 1:
        host = rows[:, : lims[0]].cpu().numpy().tobytes()
    else:
        host = torch.cat([m[:lim] for m, lim in zip(msgs, lims)]).cpu().numpy().tobytes() if k else b""
    tables, raws, off = [], [], 0
    for j, (m, lim) in enumerate(zip(msgs, lims)):
        raws.append(host[off : off + lim])  # this message's first bytes
        try:
            tables.append(_table(raws[j], m.numel(), len(shapes[j])))
        except FrameError as e:
            raise named(e, j) from None
        off += lim
    # The padding test, a device flag: read now, or (where a codec checks the round and no
    # checksum is to be tested first) in the codec's own host read (:func:`host_values`).
    ends = {t[3] for t in tables}
    flag = None
    if rows is not None and len(ends) == 1:
        (end,) = ends
        if rows.shape[1] > end:
            flag = rows[:, end:].any()
    else:
        pads = [m[t[3] :] for m, t in zip(msgs, tables) if t[3] < m.numel()]
        if pads:
            flag = torch.cat(pads).any()

    def refuse_padding() -> None:
        for j, (m, t) in enumerate(zip(msgs, tables)):
            if t[3] < m.numel() and bool(m[t[3] :].any()):
                raise named(_padding_error(m, t[3]), j)

    crc = any(t[0] & FLAG_CRC32 for t in tables)
    pending = _Pending(flag) if flag is not None and check is not None and not crc else None
    if flag is not None and pending is None and bool(flag):
        refuse_padding()
    outs = []
    for j, (m, (flags, pos, entries, end)) in enumerate(zip(msgs, tables)):
        try:
            _check_crc(m, flags, end)
        except FrameError as e:
            raise named(e, j) from None
        grads = None if grad_dtypes is None else grad_dtypes[j]
        outs.append(_payloads(m, pos, entries, shapes[j], dtypes[j], grads, raws[j], step))
    if check is not None:
        token = _ROUND.set(pending)
        try:
            check.check_frames([p for out in outs for p in out])
        except FrameError:
            if pending is not None and pending.read():
                refuse_padding()  # the padding's refusal first, as unpack_frames orders them
            for j, out in enumerate(outs):  # the culprit, named as unpack_frames names it
                try:
                    check.check_frames(out)
                except FrameError as e:
                    raise named(e, j) from None
            raise
        finally:
            _ROUND.reset(token)
        if pending is not None and pending.read():
            refuse_padding()
        for out in outs:
            for p in out:
                p.checked = True
    return outs
