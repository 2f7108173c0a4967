"""Wire formats: the bytes that really cross the network.

A codec turns one tensor into a :class:`Payload`. Payloads of summable codecs
are tensors in a wire dtype that allreduce adds up. The others are *frames*: an
entry in the message's table plus a body of packed bytes. One message per call
(a DDP bucket) carries the frames of all its tensors, with one header::

    message = header | entry[0] .. entry[T-1] | body[0] | body[1] | ...

Header (little-endian, 8 bytes): ``u8 version`` (:data:`WIRE_VERSION`), ``u8 0``,
``u16 0``, ``u32 T`` (the frame count). Entry, per frame (6 bytes, 10 with a scale)::

    u8  fmt        format code (registered by the codec that writes it, see formats())
    u8  vdtype     dtype code of the values in the body; bit 7 set: a scale follows
    u32 nbytes     body length in bytes
    f32 scale      only where bit 7 is set: a per-frame scalar (threshold tau, QSGD s)

Bodies follow back to back, without padding (a receiver copies a body that it
must view as a wider dtype at an unaligned offset). A receiver learns the tensor
count and shapes from its own model, never from the wire. Version 1 (gradzip
0.1) gave every frame a 16-byte header and padded bodies to 8 bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import torch

WIRE_VERSION = 2
HEADER = struct.Struct("<BBHI")
HEADER_BYTES = HEADER.size  # 8, once per message
ENTRY = struct.Struct("<BBI")
ENTRY_BYTES = ENTRY.size  # 6 per frame
SCALE = struct.Struct("<f")
_HAS_SCALE = 0x80

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
        raise ValueError(f"corrupt frame: unknown value dtype code {code}") from None


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
    """

    body: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    fmt: int = FMT_DENSE
    vdtype: torch.dtype | None = None
    scale: float = 0.0
    local: Any = field(default=None, repr=False)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view of a contiguous tensor's bytes (a copy only if not contiguous)."""
    t = t.contiguous().reshape(-1)
    if t.dtype == torch.uint8:
        return t
    return t.view(torch.uint8)


def from_bytes(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Reinterpret uint8 bytes as ``dtype`` (a copy where ``b`` is not aligned for it)."""
    if dtype == torch.uint8:
        return b
    if b.numel() == 0:
        return torch.empty(0, dtype=dtype, device=b.device)
    size = torch.empty(0, dtype=dtype).element_size()
    if b.storage_offset() % size or not b.is_contiguous():
        b = b.clone()
    return b.view(dtype)


def frame_nbytes(body_nbytes: int, scale: bool = False) -> int:
    """Bytes one frame adds to a message: its entry and body."""
    return ENTRY_BYTES + (SCALE.size if scale else 0) + body_nbytes


def _entry(p: Payload) -> bytes:
    nb = p.body.numel() * p.body.element_size()
    vcode = dtype_code(p.vdtype) if p.vdtype is not None else 0
    if p.scale:
        return ENTRY.pack(p.fmt, vcode | _HAS_SCALE, nb) + SCALE.pack(float(p.scale))
    return ENTRY.pack(p.fmt, vcode, nb)


def message_nbytes(payloads: list[Payload]) -> int:
    """Bytes of the message :func:`pack_frames` writes for ``payloads``."""
    return HEADER_BYTES + sum(frame_nbytes(p.body.numel() * p.body.element_size(), bool(p.scale)) for p in payloads)


def pack_frames(payloads: list[Payload], device: torch.device | None = None) -> torch.Tensor:
    """Concatenate framed payloads into one uint8 message."""
    table = bytearray(HEADER.pack(WIRE_VERSION, 0, 0, len(payloads)))
    for p in payloads:
        table += _entry(p)
    total = len(table) + sum(p.body.numel() * p.body.element_size() for p in payloads)
    if device is None:
        device = payloads[0].body.device if payloads else torch.device("cpu")
    msg = torch.empty(total, dtype=torch.uint8, device=device)
    msg[: len(table)] = torch.frombuffer(table, dtype=torch.uint8).to(device)
    off = len(table)
    for p in payloads:
        b = as_bytes(p.body)
        msg[off : off + b.numel()] = b
        off += b.numel()
    return msg


def unpack_frames(msg: torch.Tensor, shapes: list[torch.Size], dtypes: list[torch.dtype]) -> list[Payload]:
    """Split a message into payloads; bodies are views into ``msg``.

    ``msg`` may carry trailing padding (from a padded allgather); it is ignored.
    """
    count = len(shapes)
    need = HEADER_BYTES + ENTRY_BYTES * count
    if msg.numel() < need:
        raise ValueError(f"corrupt message: {msg.numel()} bytes, need at least {need} for {count} frames")
    raw = msg[: need + SCALE.size * count].cpu().numpy().tobytes()
    version, _, _, n = HEADER.unpack_from(raw, 0)
    if version != WIRE_VERSION:
        raise ValueError(f"message of wire version {version}; this gradzip reads version {WIRE_VERSION}")
    if n != count:
        raise ValueError(f"corrupt message: {n} frames, the receiver expects {count}")
    pos, entries = HEADER_BYTES, []
    for i in range(count):
        if pos + ENTRY_BYTES > len(raw):
            raise ValueError(f"corrupt message: entry {i} is cut off")
        fmt, vcode, nb = ENTRY.unpack_from(raw, pos)
        pos += ENTRY_BYTES
        scale = 0.0
        if vcode & _HAS_SCALE:
            if pos + SCALE.size > len(raw):
                raise ValueError(f"corrupt message: the scale of entry {i} is cut off")
            (scale,) = SCALE.unpack_from(raw, pos)
            pos += SCALE.size
        entries.append((fmt, vcode & ~_HAS_SCALE, nb, scale))
    out, off = [], pos
    for i, (fmt, vcode, nb, scale) in enumerate(entries):
        if off + nb > msg.numel():
            raise ValueError(f"corrupt message: frame {i} claims {nb} bytes at offset {off}")
        out.append(
            Payload(
                body=msg[off : off + nb],
                shape=shapes[i],
                dtype=dtypes[i],
                fmt=fmt,
                vdtype=code_dtype(vcode),
                scale=scale,
            )
        )
        off += nb
    return out
