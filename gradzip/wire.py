"""Wire formats: the bytes that really cross the network.

A compressor turns one tensor into a :class:`Payload`. Payloads of summable
compressors are tensors in a wire dtype that allreduce adds up. The others are
*frames*: a 16-byte header plus a body of packed bytes. One message per bucket
(or per call) carries the frames of all its tensors::

    message = header[0] .. header[T-1] | body[0] pad | body[1] pad | ...

Header (little-endian, 16 bytes)::

    u8  fmt        format code (the FMT_* constants below)
    u8  vdtype     dtype code of the values in the body, where it has values
    u16 reserved   zero
    f32 scale      a per-frame scalar (threshold tau, ...)
    i64 nbytes     body length in bytes, before padding

Bodies are zero-padded to a multiple of 8 bytes, so every body starts aligned
for int64/float64 views. A receiver learns the tensor count and shapes from its
own model, never from the wire, so the headers hold no shapes.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import torch

HEADER = struct.Struct("<BBHfq")
HEADER_BYTES = HEADER.size  # 16
ALIGN = 8

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
    """Reinterpret uint8 bytes as ``dtype`` (bodies are 8-byte aligned, so no copy)."""
    if dtype == torch.uint8:
        return b
    if b.numel() == 0:
        return torch.empty(0, dtype=dtype, device=b.device)
    return b.view(dtype)


def _padded(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def frame_nbytes(body_nbytes: int) -> int:
    """Bytes one frame occupies in a message: header plus padded body."""
    return HEADER_BYTES + _padded(body_nbytes)


def pack_frames(payloads: list[Payload], device: torch.device | None = None) -> torch.Tensor:
    """Concatenate framed payloads into one uint8 message."""
    headers = bytearray()
    total = HEADER_BYTES * len(payloads)
    for p in payloads:
        nb = p.body.numel() * p.body.element_size()
        vcode = dtype_code(p.vdtype) if p.vdtype is not None else 0
        headers += HEADER.pack(p.fmt, vcode, 0, float(p.scale), nb)
        total += _padded(nb)
    if device is None:
        device = payloads[0].body.device if payloads else torch.device("cpu")
    msg = torch.zeros(total, dtype=torch.uint8, device=device)
    if payloads:
        msg[: len(headers)] = torch.frombuffer(headers, dtype=torch.uint8).to(device)
    off = len(headers)
    for p in payloads:
        b = as_bytes(p.body)
        msg[off : off + b.numel()] = b
        off += _padded(b.numel())
    return msg


def unpack_frames(
    msg: torch.Tensor, shapes: list[torch.Size], dtypes: list[torch.dtype]
) -> list[Payload]:
    """Split a message into payloads; bodies are views into ``msg``.

    ``msg`` may carry trailing padding (from a padded allgather); it is ignored.
    """
    count = len(shapes)
    hbytes = HEADER_BYTES * count
    if msg.numel() < hbytes:
        raise ValueError(f"corrupt message: {msg.numel()} bytes, need {hbytes} for {count} headers")
    raw = msg[:hbytes].cpu().numpy().tobytes()
    out = []
    off = hbytes
    for i, (fmt, vcode, _, scale, nb) in enumerate(HEADER.iter_unpack(raw)):
        if nb < 0 or off + nb > msg.numel():
            raise ValueError(f"corrupt message: frame {i} claims {nb} bytes at offset {off}")
        body = msg[off : off + nb]
        off += _padded(nb)
        out.append(
            Payload(
                body=body,
                shape=shapes[i],
                dtype=dtypes[i],
                fmt=fmt,
                vdtype=code_dtype(vcode),
                scale=scale,
            )
        )
    return out
