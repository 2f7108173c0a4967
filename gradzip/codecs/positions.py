"""Where a sparse frame's elements lie: the position codings that TopK, Threshold and ChunkTopK share.

* Gap lists (:func:`pack_gaps`): a ``u8`` bit width, the count as a LEB128 varint, then the gaps
  between ascending positions (``idx[0]``, then ``idx[i] - idx[i-1] - 1``), bit-packed at the width
  the largest gap needs (about ``log2(n / k)`` bits a position), each optionally followed by extra
  bits (Threshold's and STC's signs).
* Elias-Fano (:func:`pack_ef`): the count as a LEB128 varint; each position's
  ``L = floor(log2(n / k))`` low bits, bit-packed; then a bitmap of ``k + ((n - 1) >> L) + 1`` bits
  with bit ``(idx[i] >> L) + i`` set (the high parts in unary), each part padded to a byte: fewer
  than ``L + 3`` bits a position and a length (:func:`ef_nbytes`) set by ``n`` and ``k`` alone, so
  every rank knows a frame's length without asking (8.6 bits a position against the gaps' 11.0
  for 160,000 uniform positions of 16M: ``tests/codecs/test_ef.py``).
* 2-bit maps (:func:`check_codes2`): one code per element, 0 for zero, 1 for ``+s``, 2 for ``-s``;
  code 3 is corrupt.

Every decoder refuses what its encoder would not have written (:class:`~gradzip.wire.FrameError`):
minimal widths and counts, zero padding bits, positions strictly ascending below ``n``, a gap
checked before the sum that could wrap around int64.
"""

from __future__ import annotations

import torch

import gradzip.kernels as K

from ..wire import (
    FrameError,
    from_bytes,
    host_values,
    row_view,
)

__all__ = [
    "pack_gaps",
    "unpack_gaps",
    "gaps_nbytes",
    "pack_ef",
    "unpack_ef",
    "unpack_ef_many",
    "ef_nbytes",
    "ef_low_bits",
    "check_codes2",
]


def _leb128(k: int) -> bytearray:
    head = bytearray()
    while True:
        head.append((k & 0x7F) | (0x80 if k > 0x7F else 0))
        k >>= 7
        if not k:
            return head


def _read_leb128(head: list, what: str) -> tuple[int, int]:
    """``(count, bytes it took)`` of the LEB128 count at the start of ``head`` (a frame's first
    bytes, read to the host once), refusing one cut off or written in more bytes than it needs."""
    k, shift, pos = 0, 0, 0
    while True:
        if pos >= len(head):
            raise FrameError("body.count", f"corrupt {what} frame: the count is cut off")
        k |= (head[pos] & 0x7F) << shift
        shift += 7
        pos += 1
        if not head[pos - 1] & 0x80:
            break
    if pos > 1 and head[pos - 1] == 0:
        raise FrameError(
            "body.count", f"corrupt {what} frame: the count {k} in {pos} LEB128 bytes (a writer uses fewer)"
        )
    return k, pos


def pack_gaps(idx: torch.Tensor, extra: torch.Tensor | None = None, extra_bits: int = 0) -> torch.Tensor:
    """Ascending int64 indices as ``u8 width``, their count as a LEB128 varint, then their
    gaps (``idx[0]``, then ``idx[i] - idx[i-1] - 1``), each shifted left by ``extra_bits``
    over that many low bits of ``extra`` (a sign, say), bit-packed at the width the largest
    needs: about ``log2(n / k)`` bits a position instead of 32."""
    gaps = torch.diff(idx, prepend=idx.new_full((1,), -1)) - 1
    words = gaps if extra is None else (gaps << extra_bits) | extra.to(torch.int64)
    width = max(1, int(words.max()).bit_length()) if words.numel() else 1
    head = bytearray([width]) + _leb128(idx.numel())
    head_t = K.host_to_device(torch.frombuffer(head, dtype=torch.uint8), idx.device)
    return torch.cat([head_t, K.pack_uint(words, width)])


def gaps_nbytes(idx: torch.Tensor) -> int:
    """Bytes :func:`pack_gaps` writes for the ascending positions ``idx`` (no extra bits)."""
    k = idx.numel()
    gaps = torch.diff(idx, prepend=idx.new_full((1,), -1)) - 1
    width = max(1, int(gaps.max()).bit_length()) if k else 1
    return 1 + max(1, -(-k.bit_length() // 7)) + (k * width + 7) // 8


def unpack_gaps(body: torch.Tensor, n: int, value_bytes: int, extra_bits: int = 0):
    """``(indices, extra or None, the bytes after the gaps)`` of a :func:`pack_gaps` body that is
    followed by ``value_bytes`` per position. Everything :func:`pack_gaps` would not have
    written raises :class:`~gradzip.wire.FrameError`: a width other than the largest word's,
    a count in more LEB128 bytes than it needs, a length that disagrees with the count,
    nonzero padding bits, a gap or a position outside ``[0, n)``."""
    head = body[:11].cpu().tolist()
    if len(head) < 2:
        raise FrameError("length", f"corrupt sparse frame: {len(head)} bytes hold no width and count")
    width = head[0]
    k, pos = _read_leb128(head[1:], "sparse")
    pos += 1
    if not max(extra_bits, 1) <= width <= 63:
        raise FrameError("body.width", f"corrupt sparse frame: gap width {width}")
    plen = (k * width + 7) // 8
    if pos + plen + k * value_bytes != body.numel():
        raise FrameError(
            "length",
            f"corrupt sparse frame: {body.numel()} bytes for {k} positions of {width} bits "
            f"(and {value_bytes} value bytes each)",
        )
    words = K.unpack_uint(body[pos : pos + plen], k, width)
    used = k * width
    if used % 8 and int(body[pos + plen - 1]) >> (used % 8):
        raise FrameError("body.padding", "corrupt sparse frame: nonzero padding bits after the last gap")
    top = int(words.max()) if k else 0
    need = max(1, top.bit_length())
    if width != need:
        raise FrameError("body.width", f"corrupt sparse frame: gap width {width} where the largest word needs {need}")
    if k and top >> extra_bits >= n:
        # a gap of n or more leaves [0, n) at once; checked before the sum, which could wrap around int64
        raise FrameError("body.indices", f"corrupt sparse frame: a gap of {top >> extra_bits} in a tensor of {n}")
    extra = None
    if extra_bits:
        extra = words & ((1 << extra_bits) - 1)
        words = words >> extra_bits
    idx = torch.cumsum(words + 1, 0) - 1
    if k and int(idx[-1]) >= n:
        raise FrameError("body.indices", f"corrupt sparse frame: index {int(idx[-1])} outside [0, {n})")
    return idx, extra, body[pos + plen :]


def ef_low_bits(n: int, k: int) -> int:
    """Low bits per position of the Elias-Fano code of ``k`` positions in ``[0, n)``:
    ``floor(log2(n / k))``, at least 0."""
    return (n // k).bit_length() - 1 if 0 < k <= n else 0


def ef_nbytes(n: int, k: int) -> int:
    """Bytes :func:`pack_ef` writes for ``k`` positions in ``[0, n)``: a function of ``n`` and
    ``k`` alone (``k`` LEB128, ``k * L`` low bits, ``k + ((n - 1) >> L) + 1`` upper bits, each
    part padded to a byte): fewer than ``L + 3`` bits a position (``n >> L < 2k``), plus the
    count and the padding."""
    low = ef_low_bits(n, k)
    upper = k + ((n - 1) >> low) + 1 if n else 1
    return len(_leb128(k)) + (k * low + 7) // 8 + (upper + 7) // 8


def pack_ef(idx: torch.Tensor, n: int) -> torch.Tensor:
    """Strictly ascending int64 positions in ``[0, n)`` in Elias-Fano code: their count as a
    LEB128 varint; each position's ``L = floor(log2(n / k))`` low bits, bit-packed; then a
    bitmap of ``k + ((n - 1) >> L) + 1`` bits with bit ``(idx[i] >> L) + i`` set for every
    ``i`` (the high parts in unary). The length is :func:`ef_nbytes` ``(n, k)``: it does not
    depend on where the positions lie, so every rank knows a frame's length from ``n`` and
    ``k`` (TopK's ``fixed_frames``)."""
    k = idx.numel()
    low = ef_low_bits(n, k)
    upper = k + ((n - 1) >> low) + 1
    dev = idx.device
    parts = [K.host_to_device(torch.frombuffer(_leb128(k), dtype=torch.uint8), dev)]
    if low and k:
        parts.append(K.pack_uint(idx & ((1 << low) - 1), low))
    bits = torch.zeros(upper, dtype=torch.int64, device=dev)
    bits[(idx >> low) + torch.arange(k, device=dev)] = 1
    parts.append(K.pack_uint(bits, 1))
    return torch.cat(parts)


def _pack_ef_rows(idx: torch.Tensor, n: int) -> torch.Tensor:
    """:func:`pack_ef` of each row of ``idx`` (``(rows, k)``, each strictly ascending in
    ``[0, n)``): ``(rows, ef_nbytes(n, k))``, every step once for all rows."""
    rows, k = idx.shape
    low = ef_low_bits(n, k)
    upper = k + ((n - 1) >> low) + 1
    dev = idx.device
    parts = [K.host_to_device(torch.frombuffer(_leb128(k), dtype=torch.uint8), dev).expand(rows, -1)]
    if low and k:
        parts.append(K.pack_uint(idx & ((1 << low) - 1), low))
    bits = torch.zeros(rows, upper, dtype=torch.int64, device=dev)
    bits.scatter_(1, (idx >> low) + torch.arange(k, device=dev), 1)
    parts.append(K.pack_uint(bits, 1))
    return torch.cat(parts, dim=1)


def _ef_layout(head: list, n: int, value_bytes: int, nbytes: int) -> tuple[int, int, int, int, int, int]:
    """``(k, the count's bytes, low bits, bitmap bits, low bytes, bitmap bytes)`` of an
    Elias-Fano body of ``nbytes`` whose first bytes are ``head`` (on the host), refusing a count
    :func:`pack_ef` would not write and a length other than :func:`ef_nbytes` plus the values."""
    k, pos = _read_leb128(head, "Elias-Fano")
    if not 0 < k <= n:
        raise FrameError("body.count", f"corrupt Elias-Fano frame: {k} positions in a tensor of {n}")
    low = ef_low_bits(n, k)
    upper = k + ((n - 1) >> low) + 1
    llen, ulen = (k * low + 7) // 8, (upper + 7) // 8
    if pos + llen + ulen + k * value_bytes != nbytes:
        raise FrameError(
            "length",
            f"corrupt Elias-Fano frame: {nbytes} bytes for {k} positions in {n} (and {value_bytes} value bytes each)",
        )
    return k, pos, low, upper, llen, ulen


def _ef_lows(body: torch.Tensor, pos: int, llen: int, k: int, low: int) -> torch.Tensor:
    """The ``k`` positions' low bits (int64; zeros where ``low`` is 0)."""
    if low:
        return K.unpack_uint(body[pos : pos + llen], k, low)
    return torch.zeros(k, dtype=torch.int64, device=body.device)


def unpack_ef(body: torch.Tensor, n: int, value_bytes: int):
    """``(indices, the bytes after the positions)`` of a :func:`pack_ef` body followed by
    ``value_bytes`` per position. Refuses (:class:`~gradzip.wire.FrameError`) what
    :func:`pack_ef` would not have written: a count of 0 or above ``n``, or in more LEB128
    bytes than it needs; a length other than :func:`ef_nbytes` plus the values; nonzero
    padding bits after the low bits or after the bitmap; a bitmap with other than ``k`` bits
    set; positions not strictly ascending or outside ``[0, n)``. One host sync for the checks."""
    k, pos, low, upper, llen, ulen = _ef_layout(body[:10].cpu().tolist(), n, value_bytes, body.numel())
    dev = body.device
    lows = _ef_lows(body, pos, llen, k, low)
    ub = body[pos + llen : pos + llen + ulen]
    bits = K.unpack_uint(ub, upper, 1)
    where = bits.nonzero().reshape(-1)
    zero = torch.zeros((), dtype=torch.bool, device=dev)
    lpad = (body[pos + llen - 1] >> ((k * low) % 8)).bool() if (k * low) % 8 else zero
    upad = (ub[-1] >> (upper % 8)).bool() if upper % 8 else zero
    count_ok = where.numel() == k
    if count_ok:
        idx = ((where - torch.arange(k, device=dev)) << low) | lows
        order = (idx[1:] > idx[:-1]).all() if k > 1 else ~zero
        top = idx[-1]
    else:
        idx, order, top = None, ~zero, torch.zeros((), dtype=torch.int64, device=dev)
    bad_lpad, bad_upad, ascending, last = torch.stack([lpad.long(), upad.long(), order.long(), top.long()]).tolist()
    if bad_lpad:
        raise FrameError("body.padding", "corrupt Elias-Fano frame: nonzero padding bits after the low bits")
    if bad_upad:
        raise FrameError("body.padding", "corrupt Elias-Fano frame: bits set after the bitmap")
    if not count_ok:
        raise FrameError("body.upper", f"corrupt Elias-Fano frame: {where.numel()} bitmap bits set for {k} positions")
    if not ascending:
        raise FrameError("body.indices", "corrupt Elias-Fano frame: positions not strictly ascending")
    if last >= n:
        raise FrameError("body.indices", f"corrupt Elias-Fano frame: index {last} outside [0, {n})")
    return idx, body[pos + llen + ulen :]


def unpack_ef_many(
    bodies: list, ns: list, value_bytes: list, vdtype: torch.dtype | None = None, heads: list | None = None
) -> list | None:
    """:func:`unpack_ef` of several frames with two host syncs in all (one copy of every
    frame's first bytes, none where ``heads`` has them already: ``Payload.head``, read with the
    messages' tables; one read of every frame's flags) instead of about three a frame: a
    list of ``(indices, the bytes after the positions)`` (with ``vdtype``: those bytes as
    ``vdtype`` values, by ``wire.from_bytes``; for frames that are rows of one view, one view of
    all rows), or None where any frame is one
    :func:`unpack_ef` refuses (the caller then checks frame by frame, which names it). The
    positions come from the bitmap by a prefix sum and a scatter, not ``nonzero`` (whose output
    size is a host sync on a GPU): the same ascending positions wherever the bitmap holds ``k``
    set bits, which the flags check."""
    if not bodies:
        return []
    dev = bodies[0].device
    rows = row_view(bodies)  # a round's frames of one length at one stride: one view of them all
    sizes = [min(10, b.numel()) for b in bodies]
    if heads is not None and all(h is not None and len(h) >= m for h, m in zip(heads, sizes)):
        firsts = [list(h[:m]) for h, m in zip(heads, sizes)]  # on the host already: no copy
    else:
        if rows is not None and rows.shape[1] >= 10:
            host = rows[:, :10].reshape(-1).cpu().tolist()
        else:
            host = torch.cat([b[:10] for b in bodies]).cpu().tolist()
        firsts, off = [], 0
        for m in sizes:
            firsts.append(host[off : off + m])
            off += m
    plans = []
    for body, n, vb, first in zip(bodies, ns, value_bytes, firsts):
        try:
            plans.append(_ef_layout(first, n, vb, body.numel()))
        except FrameError:
            return None
    if rows is not None and len(set(plans)) == 1 and len(set(ns)) == 1:
        return _unpack_ef_rows(rows, ns[0], plans[0], vdtype)  # one layout too: every step at once
    flags, out = [], []
    for body, n, (k, pos, low, upper, llen, ulen) in zip(bodies, ns, plans):
        lows = _ef_lows(body, pos, llen, k, low)
        ub = body[pos + llen : pos + llen + ulen]
        bits = K.unpack_uint(ub, upper, 1)
        rank = bits.cumsum(0) - 1  # the j-th set bit has rank j
        slot = torch.where((bits == 1) & (rank < k), rank, k)  # the rest to a slot dropped below
        where = torch.zeros(k + 1, dtype=torch.int64, device=dev)
        where.scatter_(0, slot, torch.arange(upper, device=dev))
        idx = ((where[:k] - torch.arange(k, device=dev)) << low) | lows
        good = bits.sum() == k
        if (k * low) % 8:
            good = good & ((body[pos + llen - 1] >> ((k * low) % 8)) == 0)
        if upper % 8:
            good = good & ((ub[-1] >> (upper % 8)) == 0)
        if k > 1:
            good = good & (idx[1:] > idx[:-1]).all()
        flags.append(good & (idx[-1] < n))
        tail = body[pos + llen + ulen :]
        out.append((idx, tail if vdtype is None else from_bytes(tail, vdtype)))
    return out if host_values(torch.stack(flags).all()) else None


def _unpack_ef_rows(
    rows: torch.Tensor, n: int, plan: tuple, vdtype: torch.dtype | None = None, *, read: bool = True
) -> list | None | tuple[list, torch.Tensor]:
    """:func:`unpack_ef_many` of frames of one layout (``plan``, from :func:`_ef_layout`) that
    are the rows of one 2-D view: every step once for all of them, and one read of their flags.
    The bytes after the positions (the values; with ``vdtype``, those values, by one view of
    all rows) are views of the rows, or, where they are not 8-byte aligned, of one aligned copy
    of all rows' values. ``read=False`` (a planned round, :meth:`TopK.planned_parse`): nothing
    is read; returns ``(the frames, a 0-d bool: all of them valid)``, the count's bytes
    compared on the device too."""
    k, pos, low, upper, llen, ulen = plan
    f, dev = rows.shape[0], rows.device
    lows = K.unpack_uint(rows[:, pos : pos + llen], k, low) if low else torch.zeros(f, k, dtype=torch.int64, device=dev)
    ub = rows[:, pos + llen : pos + llen + ulen]
    bits = K.unpack_uint(ub, upper, 1)
    rank = bits.cumsum(1) - 1  # the j-th set bit of a row has rank j
    slot = torch.where((bits == 1) & (rank < k), rank, k)  # the rest to a slot dropped below
    where = torch.zeros(f, k + 1, dtype=torch.int64, device=dev)
    where.scatter_(1, slot, torch.arange(upper, device=dev).expand(f, upper))
    idx = ((where[:, :k] - torch.arange(k, device=dev)) << low) | lows
    good = bits.sum(dim=1) == k
    # the padding bits of the low bits' last byte and of the bitmap's last (none where a part
    # fills its bytes): one test whatever the layout, so a round's operations do not vary
    lpad, upad = (k * low) % 8, upper % 8
    pad = (rows[:, pos + llen - 1] & (0xFF & -(1 << lpad) if lpad else 0)) | (
        ub[:, -1] & (0xFF & -(1 << upad) if upad else 0)
    )
    good = good & (pad == 0)
    if k > 1:
        good = good & (idx[:, 1:] > idx[:, :-1]).all(dim=1)
    good = good & (idx[:, -1] < n)
    if not read:
        count = K.host_to_device(torch.frombuffer(bytearray(_leb128(k)), dtype=torch.uint8), dev)
        good = good & (rows[:, :pos] == count).all(dim=1)
    elif not host_values(good.all()):
        return None
    tail = rows[:, pos + llen + ulen :]
    if tail.shape[1] and (tail.storage_offset() % 8 or tail.stride(0) % 8):
        tail = tail.contiguous()  # the values aligned by one copy of all rows, not one a frame
    if vdtype is not None and vdtype != torch.uint8 and tail.shape[1]:
        tail = tail.view(vdtype)  # every row's values at once (rows and their starts 8-byte aligned)
    got = list(zip(idx.unbind(0), tail.unbind(0)))  # every row's, by two operations
    return got if read else (got, good.all())


def _signs2(body: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and signs (True: negative) of a 2-bit map (0 -> 0, 1 -> +, 2 -> -), refusing
    code 3, set padding codes and a map with nothing set (an encoder writes EMPTY then)."""
    check_codes2(body, n)
    codes = K.unpack_uint(body, n, 2)
    idx = codes.nonzero().reshape(-1)
    return idx, codes[idx] == 2


def check_codes2(body: torch.Tensor, n: int) -> None:
    """A 2-bit map of ``n`` codes (0, +, -) as an encoder writes it: no code 3, no code after
    the ``n``-th, at least one set (else the encoder writes EMPTY). One pass over the bytes,
    one host sync."""
    b = body.reshape(-1)
    if not b.numel():
        raise FrameError("body.codes", "an empty 2-bit map (an encoder writes EMPTY)")
    three = ((b & (b >> 1)) & 0x55).any()
    rem = n % 4
    pad = (b[-1] >> (2 * rem)).bool() if rem else torch.zeros((), dtype=torch.bool, device=b.device)
    bad3, badpad, some = torch.stack([three, pad, b.any()]).tolist()
    if bad3:
        raise FrameError("body.codes", "corrupt 2-bit map: code 3 (only 0, +, - exist)")
    if badpad:
        raise FrameError("body.padding", f"corrupt 2-bit map: codes set after the {n}-th")
    if not some:
        raise FrameError("body.codes", "a 2-bit map with no position set (an encoder writes EMPTY)")
