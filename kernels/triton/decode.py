"""Decode-and-accumulate of peers' payloads into one float32 buffer, in Triton.

* :func:`_decode_add_bitmap2_kernel`: N peers' 2-bit bitmaps in one pass. Each
  program loads its slice of ``out`` once, adds every peer's ``+-tau`` in peer
  order (so the floats are the reference's), and stores once: ``8 + N/4`` bytes
  per element, no N-fold intermediate.
* :func:`_decode_add_quant_kernel`: N peers' quantizer frame bodies (float32
  scales, then codes: sign1, qsgd, tern2 or int8) the same way, each element
  adding each peer's value with the reference's expression. Code values are not
  checked (callers validate frames first). Bodies in one storage are read where they lie;
  where one is not 4-byte aligned (frames lie back to back in a message) the scales are
  read a byte at a time (``ALIGNED``), not copied.
* :func:`_decode_segments_kernel`: one quantizer frame per range of ``out`` (TwoPhase's
  owners' pieces of a call), every range in one launch (:func:`decode_add_quant_segments_triton`);
  :func:`_decode_add_quant_kernel` with ``SUB`` subtracts instead (Int8's error feedback,
  :func:`int8_apply_triton`).
* :func:`_scatter_add_signed_kernel`: one peer's signed index words.
* :func:`_scatter_add_sparse_kernel`: one peer's top-k frame (int32/int64
  indices, float32/16/bf16 values).
* :func:`_scatter_add_runs_kernel`: every peer's top-k frame at once, their entries sorted by
  index (stably: a run of one index holds its peers' values in peer order); the run's first
  entry adds them, in that order.

Bodies that live in one buffer (the all-gathered messages) are read in place
through byte offsets from its base (:func:`_bodies_base`).

The scatters read, add and write each target once. The indices of one frame are
distinct (every encoder here writes them so), so this is exact and needs no
atomics; peers are applied one launch after the other, in order, because two
peers may hit the same element and float addition does not commute bit for bit, or (the runs
kernel) by one program per element that adds its peers' values in their order.

References: ``decode_add_bitmap2_reference``, ``scatter_add_signed_reference``,
``scatter_add_sparse_reference`` in :mod:`gradzip.kernels.reference`;
``decode_add_quant_reference`` in :mod:`gradzip.kernels.quant`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from ..dispatch import KERNEL_DTYPES, Unsupported, host_to_device
from ..quant import QUANT_KINDS, _body_layout, quant_layout
from . import LAUNCH, check, row_tile, segment_tables, size, spec

__all__ = [
    "decode_add_bitmap2_triton",
    "decode_add_quant_triton",
    "int8_apply_triton",
    "decode_add_quant_segments_triton",
    "scatter_add_signed_triton",
    "scatter_add_sparse_triton",
    "scatter_add_sparse_many_triton",
    "quant_body_stats_triton",
]

NUM_WARPS = 8
BYTES_GPU = 1024  # bitmap bytes per program (4096 elements)
BYTES_INTERPRETER = 4096
TILE_GPU = 4096  # quantizer elements per program
TILE_INTERPRETER = 16384
SCATTER_GPU = 1024
SCATTER_INTERPRETER = 8192
KIND_CODE = {k: i for i, k in enumerate(QUANT_KINDS)}  # sign1 0, qsgd 1, tern2 2, int8 3


@triton.jit
def _decode_add_bitmap2_kernel(out_ptr, base_ptr, offs_ptr, taus_ptr, n, npeers, BYTES: tl.constexpr):
    pid, rows, cols, idx, mask = row_tile(n, BYTES, 4)
    nbytes = (n + 3) // 4
    bmask = rows < nbytes
    acc = tl.load(out_ptr + idx, mask=mask, other=0.0)
    for p in range(npeers):
        off = tl.load(offs_ptr + p)
        tau = tl.load(taus_ptr + p)
        b = tl.load(base_ptr + off + rows, mask=bmask, other=0).to(tl.int32)
        code = (b[:, None] >> (cols * 2)[None, :]) & 3
        # The reference's (code == 1) * tau - (code == 2) * tau, products by 0/1 exact.
        acc = acc + ((code == 1).to(tl.float32) * tau - (code == 2).to(tl.float32) * tau)
    tl.store(out_ptr + idx, acc, mask=mask)


@triton.jit
def _quant_value(base_ptr, co, offs, mask, sc, levels, KIND: tl.constexpr, BITS: tl.constexpr):
    """The decoded float32 value of elements ``offs`` of a frame whose codes start at byte
    ``co`` of ``base_ptr``, ``sc`` their block scales: the reference's expression per kind."""
    if KIND == 0:  # sign1: bit i % 8 of byte i // 8 (the int32 words' little-endian bytes)
        byte = tl.load(base_ptr + co + offs // 8, mask=mask, other=0).to(tl.int32)
        bit = (byte >> (offs % 8).to(tl.int32)) & 1
        val = tl.where(bit != 0, -sc, sc)
    elif KIND == 1:  # qsgd: (c - s) * (N_b / s), its magnitude capped at N_b
        PER: tl.constexpr = 8 // BITS
        byte = tl.load(base_ptr + co + offs // PER, mask=mask, other=0).to(tl.int32)
        c = (byte >> ((offs % PER).to(tl.int32) * BITS)) & ((1 << BITS) - 1)
        val = (c.to(tl.float32) - levels) * tl.div_rn(sc, levels)
        val = tl.where(tl.abs(val) > sc, tl.where(val < 0, -sc, sc), val)
    elif KIND == 2:  # tern2: (c == 1) * S - (c == 2) * S
        byte = tl.load(base_ptr + co + offs // 4, mask=mask, other=0).to(tl.int32)
        c = (byte >> ((offs % 4).to(tl.int32) * 2)) & 3
        val = (c == 1).to(tl.float32) * sc - (c == 2).to(tl.float32) * sc
    else:  # int8: q * S
        byte = tl.load(base_ptr + co + offs, mask=mask, other=0).to(tl.int32)
        q = tl.where(byte >= 128, byte - 256, byte)
        val = q.to(tl.float32) * sc
    return val


@triton.jit
def _scales_bytewise(sb, mask):
    """The float32 scales whose little-endian bytes start at pointers ``sb`` (any alignment)."""
    bits = tl.load(sb, mask=mask, other=0).to(tl.int32)
    bits = bits | (tl.load(sb + 1, mask=mask, other=0).to(tl.int32) << 8)
    bits = bits | (tl.load(sb + 2, mask=mask, other=0).to(tl.int32) << 16)
    bits = bits | (tl.load(sb + 3, mask=mask, other=0).to(tl.int32) << 24)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _decode_add_quant_kernel(
    out_ptr,
    base_ptr,
    soffs_ptr,
    coffs_ptr,
    n,
    b,
    npeers,
    levels,
    KIND: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    SUB: tl.constexpr,
    ALIGNED: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    blk = offs // b
    acc = tl.load(out_ptr + offs, mask=mask, other=0.0)
    for p in range(npeers):
        so = tl.load(soffs_ptr + p)
        co = tl.load(coffs_ptr + p)
        if ALIGNED:
            sc = tl.load((base_ptr + so).to(tl.pointer_type(tl.float32)) + blk, mask=mask, other=0.0)
        else:  # a body where the message put it: its scales read a byte at a time
            sc = _scales_bytewise(base_ptr + so + blk * 4, mask)
        val = _quant_value(base_ptr, co, offs, mask, sc, levels, KIND, BITS)
        if SUB:  # acc - val is acc + (-val) bit for bit: the reference's out.sub_(decode)
            acc = acc - val
        else:
            acc = acc + val
    tl.store(out_ptr + offs, acc, mask=mask)


@triton.jit
def _decode_segments_kernel(
    out_ptr,
    base_ptr,
    prog_seg_ptr,
    prog_first_ptr,
    seg_ptr,
    levels,
    KIND: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program ``pid`` decodes elements ``[first, first + BLOCK)`` of segment ``prog_seg[pid]``
    into its own range of ``out``. A segment's row of ``seg_ptr`` (int64): its first element in
    ``out``, its length, its block length, the byte offsets of its scales and of its codes in
    ``base_ptr``. The scales are read a byte at a time: frames lie back to back in a message,
    so a body's scales need not be 4-byte aligned."""
    pid = tl.program_id(0)
    seg = tl.load(prog_seg_ptr + pid).to(tl.int64)
    first = tl.load(prog_first_ptr + pid).to(tl.int64)
    row = seg_ptr + seg * 5
    o, n, b, so, co = tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3), tl.load(row + 4)
    offs = first + tl.arange(0, BLOCK)
    mask = offs < n
    sc = _scales_bytewise(base_ptr + so + (offs // b) * 4, mask)
    acc = tl.load(out_ptr + o + offs, mask=mask, other=0.0)
    acc = acc + _quant_value(base_ptr, co, offs, mask, sc, levels, KIND, BITS)
    tl.store(out_ptr + o + offs, acc, mask=mask)


@triton.jit
def _scatter_add_signed_kernel(out_ptr, words_ptr, tau, k, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    m = offs < k
    w = tl.load(words_ptr + offs, mask=m, other=0)
    idx = (w & 0x7FFFFFFF).to(tl.int64)
    val = tl.where(w < 0, -tau, tau)
    ok = m & (idx < n)
    cur = tl.load(out_ptr + idx, mask=ok, other=0.0)
    tl.store(out_ptr + idx, cur + val, mask=ok)


@triton.jit
def _scatter_add_sparse_kernel(out_ptr, idx_ptr, val_ptr, k, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    m = offs < k
    idx = tl.load(idx_ptr + offs, mask=m, other=0).to(tl.int64)
    val = tl.load(val_ptr + offs, mask=m, other=0.0).to(tl.float32)
    ok = m & (idx >= 0) & (idx < n)
    cur = tl.load(out_ptr + idx, mask=ok, other=0.0)
    tl.store(out_ptr + idx, cur + val, mask=ok)


@triton.jit
def _scatter_add_runs_kernel(out_ptr, idx_ptr, val_ptr, k, n, runs, BLOCK: tl.constexpr):
    """Entries ``0 .. k`` sorted by index, stably, no run longer than ``runs``: the first entry
    of each run reads its element once, adds the run's values in order and writes it once."""
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    m = offs < k
    idx = tl.load(idx_ptr + offs, mask=m, other=-1)
    prev = tl.load(idx_ptr + offs - 1, mask=m & (offs > 0), other=-1)
    head = m & (idx != prev) & (idx >= 0) & (idx < n)
    acc = tl.load(out_ptr + idx, mask=head, other=0.0)
    for t in range(0, runs):
        j = offs + t
        mine = head & (j < k)
        mine = mine & (tl.load(idx_ptr + j, mask=mine, other=-1) == idx)
        val = tl.load(val_ptr + j, mask=mine, other=0.0).to(tl.float32)
        acc = tl.where(mine, acc + val, acc)  # (not acc + 0.0: -0.0 stays -0.0)
    tl.store(out_ptr + idx, acc, mask=head)


def _bodies_base(bodies: Sequence[torch.Tensor], align: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_bodies_in_one`, the offsets as an int64 tensor on the device."""
    base, offsets = _bodies_in_one(bodies, align)
    return base, host_to_device(torch.tensor(offsets, dtype=torch.int64), base.device)


def _one_storage(bodies: Sequence[torch.Tensor]) -> bool:
    """Whether every body is a contiguous view of the first one's storage."""
    st = bodies[0].untyped_storage().data_ptr()
    return all(b.is_contiguous() and b.untyped_storage().data_ptr() == st for b in bodies)


def _bodies_in_one(bodies: Sequence[torch.Tensor], align: int) -> tuple[torch.Tensor, list[int]]:
    """One uint8 tensor holding every body, and each body's byte offset in it, every offset a
    multiple of ``align``. Bodies that are views of one storage at such offsets (peers' frames
    in the gathered buffer) are read in place; otherwise they are copied into one buffer, each
    padded to a multiple of ``align``."""
    if _one_storage(bodies) and all(b.storage_offset() % align == 0 for b in bodies):
        st = bodies[0].untyped_storage()
        base = torch.empty(0, dtype=torch.uint8, device=bodies[0].device).set_(st, 0, (st.nbytes(),))
        offsets = [b.storage_offset() for b in bodies]
    else:
        offsets, pos = [], 0
        for b in bodies:
            offsets.append(pos)
            pos += (b.numel() + align - 1) // align * align
        base = torch.zeros(max(pos, align), dtype=torch.uint8, device=bodies[0].device)
        for off, b in zip(offsets, bodies):
            base[off : off + b.numel()] = b.reshape(-1)
    return base, offsets


def _check_decode(out: torch.Tensor, bodies: Sequence[torch.Tensor]) -> None:
    check("out", out, (torch.float32,))
    for i, b in enumerate(bodies):
        check(f"body {i}", b, (torch.uint8,), out.device)


def decode_add_bitmap2_triton(
    out: torch.Tensor, bodies: Sequence[torch.Tensor], taus: Sequence[float], *, block_bytes: int | None = None
) -> None:
    """Triton version of :func:`~gradzip.kernels.reference.decode_add_bitmap2_reference`."""
    _check_decode(out, bodies)
    n = out.numel()
    B = size("block_bytes", block_bytes, BYTES_GPU, BYTES_INTERPRETER)
    base, offs = _bodies_base(bodies, 1)
    taus32 = host_to_device(torch.tensor(list(taus), dtype=torch.float32), out.device)
    grid = (triton.cdiv(triton.cdiv(n, 4), B),)
    _decode_add_bitmap2_kernel[grid](out, base, offs, taus32, n, len(bodies), BYTES=B, num_warps=NUM_WARPS, **LAUNCH)


def decode_add_quant_triton(
    out: torch.Tensor,
    bodies: Sequence[torch.Tensor],
    kind: str,
    *,
    block: int | None = None,
    levels: int = 0,
    bits: int | None = None,
    tile: int | None = None,
    subtract: bool = False,
) -> None:
    """Triton version of :func:`~gradzip.kernels.quant.decode_add_quant_reference` (float32 ``out``);
    ``subtract``: ``out -= decode`` instead, peer by peer in order."""
    _check_decode(out, bodies)
    if kind not in KIND_CODE:
        raise ValueError(f"kind must be one of {list(QUANT_KINDS)}, got {kind!r}")
    n = out.numel()
    if not bodies or n == 0:
        return
    nb, b = quant_layout(n, block)
    # Bodies in one storage (a gathered round's frames) are read where they lie, their scales a
    # byte at a time where one is not 4-byte aligned; others are copied, aligned, into one buffer.
    base, offs = _bodies_in_one(bodies, 1) if _one_storage(bodies) else _bodies_in_one(bodies, 4)
    aligned = all(o % 4 == 0 for o in offs)
    soffs = host_to_device(torch.tensor(offs, dtype=torch.int64), base.device)
    B = size("tile", tile, TILE_GPU, TILE_INTERPRETER, minimum=32)
    _decode_add_quant_kernel[(triton.cdiv(n, B),)](
        out,
        base,
        soffs,
        soffs + 4 * nb,
        n,
        b,
        len(bodies),
        float(levels),
        KIND=KIND_CODE[kind],
        BITS=int(bits or 8),
        BLOCK=B,
        SUB=bool(subtract),
        ALIGNED=aligned,
        num_warps=NUM_WARPS,
        **LAUNCH,
    )


def decode_segment_tables(segs, block, B: int, device):
    """:func:`_decode_segments_kernel`'s launch tables (kept per layout) for segments ``(first
    element of out, elements, body's byte)``: a program per ``B`` elements."""

    def build():
        rows = []
        for st, n, at in segs:
            nb, b = quant_layout(n, block)
            rows.append([st, n, max(b, 1), at, at + 4 * nb])
        return rows, [n for _, n, _ in segs], B

    return segment_tables(("decode", tuple(segs), block, B), device, build)


def decode_add_quant_segments_triton(
    out: torch.Tensor,
    bodies: Sequence[torch.Tensor],
    starts: Sequence[int],
    numels: Sequence[int],
    kind: str,
    *,
    block: int | None = None,
    levels: int = 0,
    bits: int | None = None,
    tile: int | None = None,
) -> None:
    """Triton version of :func:`~gradzip.kernels.quant.decode_add_quant_segments_reference`
    (flat float32 ``out``): every segment in one launch, a program per ``tile`` elements of a
    segment. Bodies in one storage (a message's frames) are read in place."""
    _check_decode(out, bodies)
    if kind not in KIND_CODE:
        raise ValueError(f"kind must be one of {list(QUANT_KINDS)}, got {kind!r}")
    if not bodies:
        return
    B = size("tile", tile, TILE_GPU, TILE_INTERPRETER, minimum=32)
    base, offs = _bodies_in_one(bodies, 1)  # scales are read bytewise: no alignment needed
    prog_seg, prog_first, seg = decode_segment_tables(list(zip(starts, numels, offs)), block, B, out.device)
    if prog_seg.numel():
        _decode_segments_kernel[(prog_seg.numel(),)](
            out,
            base,
            prog_seg,
            prog_first,
            seg,
            float(levels),
            KIND=KIND_CODE[kind],
            BITS=int(bits or 8),
            BLOCK=B,
            num_warps=NUM_WARPS,
            **LAUNCH,
        )


def int8_apply_triton(out: torch.Tensor, bodies: Sequence[torch.Tensor], *, block: int | None, subtract: bool = False):
    """Triton version of :func:`~gradzip.kernels.quant.int8_apply_` (float32 ``out``): Int8's
    decode-add, and (``subtract``) its error feedback's subtraction, in one launch."""
    decode_add_quant_triton(out, bodies, "int8", block=block, subtract=subtract)


def scatter_add_signed_triton(out: torch.Tensor, words: torch.Tensor, tau: float, *, block: int | None = None) -> None:
    """Triton version of :func:`~gradzip.kernels.reference.scatter_add_signed_reference`."""
    check("out", out, (torch.float32,))
    check("words", words, (torch.int32,), out.device)
    k = words.numel()
    B = size("block", block, SCATTER_GPU, SCATTER_INTERPRETER)
    tau32 = float(torch.tensor(tau, dtype=torch.float32))
    _scatter_add_signed_kernel[(triton.cdiv(k, B),)](out, words, tau32, k, out.numel(), BLOCK=B, num_warps=4, **LAUNCH)


def scatter_add_sparse_triton(
    out: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor, *, block: int | None = None
) -> None:
    """Triton version of :func:`~gradzip.kernels.reference.scatter_add_sparse_reference`."""
    check("out", out, (torch.float32,))
    check("idx", idx, (torch.int32, torch.int64), out.device)
    check("vals", vals, KERNEL_DTYPES, out.device)
    k = idx.numel()
    B = size("block", block, SCATTER_GPU, SCATTER_INTERPRETER)
    _scatter_add_sparse_kernel[(triton.cdiv(k, B),)](out, idx, vals, k, out.numel(), BLOCK=B, num_warps=4, **LAUNCH)


def scatter_add_sparse_many_triton(
    out: torch.Tensor, idxs: Sequence[torch.Tensor], vals: Sequence[torch.Tensor], *, block: int | None = None
) -> None:
    """Triton version of :func:`~gradzip.kernels.reference.scatter_add_sparse_many_reference`:
    every frame's entries joined, sorted by index stably (each element's values stay in frame
    order), then one launch of :func:`_scatter_add_runs_kernel`; one frame: its own launch."""
    check("out", out, (torch.float32,))
    for i, v in zip(idxs, vals):
        check("idx", i, (torch.int32, torch.int64), out.device)
        check("vals", v, KERNEL_DTYPES, out.device)
    if len(idxs) == 1:
        scatter_add_sparse_triton(out, idxs[0], vals[0], block=block)
        return
    if len({v.dtype for v in vals}) > 1:
        raise Unsupported("values of several dtypes")
    idx, order = torch.cat([i if i.dtype == torch.int64 else i.long() for i in idxs]).sort(stable=True)
    val = torch.cat(list(vals))[order]
    k = idx.numel()
    B = size("block", block, SCATTER_GPU, SCATTER_INTERPRETER)
    _scatter_add_runs_kernel[(triton.cdiv(k, B),)](
        out, idx, val, k, out.numel(), len(idxs), BLOCK=B, num_warps=4, **LAUNCH
    )


_DEC_SIG = {
    "out_ptr": "*fp32",
    "base_ptr": "*u8",
    "soffs_ptr": "*i64",
    "coffs_ptr": "*i64",
    "n": "i32",
    "b": "i32",
    "npeers": "i32",
    "levels": "fp32",
}


@triton.jit
def _body_stats_kernel(
    w_ptr,
    codes_ptr,
    at_ptr,
    out_ptr,
    n,
    ns,
    nbp,
    eq_at_ptr,
    eq_want_ptr,
    eq_slot_ptr,
    neq,
    KIND: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """The frame checks' pass (:func:`quant_body_stats_triton`): programs ``[0, nbp)`` read
    ``BLOCK`` bytes each against the per-byte layout ``codes`` (Int8: a code byte?; packed
    codes: how many codes the byte holds) into ``out[1]``; the rest read ``BLOCK`` scales each,
    ``at`` holding every scale byte's position (a scale's first byte at ``at[4 s]``), into
    ``out[0]`` (1 where a scale is below zero: the sign bit set, not -0.0, not NaN); the
    programs after them compare ``neq`` bytes, byte ``w[eq_at[i]]`` against ``eq_want[i]``, a
    difference setting ``out[eq_slot[i]]`` to 1 (a planned round's tables, padding and flags)."""
    pid = tl.program_id(0).to(tl.int64)
    nsp = (ns + BLOCK - 1) // BLOCK
    if pid < nbp:
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        b = tl.load(w_ptr + offs, mask=m, other=0).to(tl.int32)
        c = tl.load(codes_ptr + offs, mask=m, other=0).to(tl.int32)
        if KIND == 3:  # int8: a code byte of -128
            top = ((b == 128) & (c != 0)).to(tl.int32)
        else:  # the largest of the byte's first c codes
            top = tl.zeros([BLOCK], dtype=tl.int32)
            for k in tl.static_range(8 // BITS):
                code = (b >> (k * BITS)) & ((1 << BITS) - 1)
                top = tl.maximum(top, tl.where(c > k, code, 0))
        tl.atomic_max(out_ptr + 1, tl.max(top, axis=0).to(tl.int64))
    elif pid < nbp + nsp:
        s = (pid - nbp) * BLOCK + tl.arange(0, BLOCK)
        m = s < ns
        p = tl.load(at_ptr + 4 * s, mask=m, other=0)
        b0 = tl.load(w_ptr + p, mask=m, other=0).to(tl.int32)
        b1 = tl.load(w_ptr + p + 1, mask=m, other=0).to(tl.int32)
        b2 = tl.load(w_ptr + p + 2, mask=m, other=0).to(tl.int32)
        b3 = tl.load(w_ptr + p + 3, mask=m, other=0).to(tl.int32)
        mag = b0 | (b1 << 8) | (b2 << 16) | ((b3 & 0x7F) << 24)
        neg = ((b3 & 0x80) != 0) & (mag != 0) & (mag <= 0x7F800000)
        tl.atomic_max(out_ptr, tl.max(neg.to(tl.int32), axis=0).to(tl.int64))
    else:
        i = (pid - nbp - nsp) * BLOCK + tl.arange(0, BLOCK)
        m = i < neq
        p = tl.load(eq_at_ptr + i, mask=m, other=0)
        got = tl.load(w_ptr + p, mask=m, other=0)
        want = tl.load(eq_want_ptr + i, mask=m, other=0)
        slot = tl.load(eq_slot_ptr + i, mask=m, other=0)
        tl.atomic_max(out_ptr + slot, (got != want).to(tl.int64), mask=m)


STATS_GPU = 4096  # bytes (or scales) per program of _body_stats_kernel
STATS_INTERPRETER = 16384


def quant_body_stats_triton(whole: torch.Tensor, frames, kind: str, bits: int, *, block: int | None = None):
    """Triton version of :func:`~gradzip.kernels.quant.quant_body_stats_reference`: one launch
    (and the zeroed result) over the bytes and the scales, with the reference's per-layout
    byte tables (:func:`~gradzip.kernels.quant._body_layout`, cached on the device)."""
    check("whole", whole, (torch.uint8,))
    frames = tuple((int(o), int(nb), int(k)) for o, nb, k in frames)
    n, dev = whole.numel(), whole.device
    out = torch.zeros(2, dtype=torch.int64, device=dev)
    if n == 0:
        return out
    at, codes = _body_layout(frames, n, kind, bits, dev)
    B = size("block", block, STATS_GPU, STATS_INTERPRETER)
    ns = at.numel() // 4
    nbp = 0 if codes is None else triton.cdiv(n, B)
    grid = nbp + triton.cdiv(ns, B)
    if grid:
        _body_stats_kernel[(grid,)](
            whole,
            whole if codes is None else codes,
            at,
            out,
            n,
            ns,
            nbp,
            at,
            whole,
            at,
            0,
            KIND=KIND_CODE[kind],
            BITS=bits,
            BLOCK=B,
            num_warps=4,
            **LAUNCH,
        )
    return out


AOT_SPECS = (
    [
        spec(
            _decode_add_bitmap2_kernel,
            {
                "out_ptr": "*fp32",
                "base_ptr": "*u8",
                "offs_ptr": "*i64",
                "taus_ptr": "*fp32",
                "n": "i32",
                "npeers": "i32",
            },
            {"BYTES": BYTES_GPU},
            num_warps=NUM_WARPS,
        ),
        spec(
            _scatter_add_signed_kernel,
            {"out_ptr": "*fp32", "words_ptr": "*i32", "tau": "fp32", "k": "i32", "n": "i64"},
            {"BLOCK": SCATTER_GPU},
            num_warps=4,
            divisible=(),
        ),
    ]
    + [
        spec(
            _scatter_add_sparse_kernel,
            {"out_ptr": "*fp32", "idx_ptr": ip, "val_ptr": vp, "k": "i32", "n": "i64"},
            {"BLOCK": SCATTER_GPU},
            num_warps=4,
            divisible=(),
        )
        for ip, vp in (("*i32", "*fp32"), ("*i32", "*fp16"), ("*i64", "*bf16"))
    ]
    + [
        spec(
            _scatter_add_runs_kernel,
            {"out_ptr": "*fp32", "idx_ptr": "*i64", "val_ptr": vp, "k": "i32", "n": "i64", "runs": "i32"},
            {"BLOCK": SCATTER_GPU},
            num_warps=4,
            divisible=(),
        )
        for vp in ("*fp32", "*fp16", "*bf16")
    ]
    + [
        spec(
            _decode_add_quant_kernel,
            _DEC_SIG,
            {"KIND": KIND_CODE[k], "BITS": bits, "BLOCK": TILE_GPU, "SUB": False, "ALIGNED": aligned},
            num_warps=NUM_WARPS,
        )
        for k, bits in (("sign1", 8), ("qsgd", 4), ("qsgd", 2), ("qsgd", 8), ("tern2", 8), ("int8", 8))
        for aligned in (True, False)  # peers' bodies apart, or where a gathered round put them
    ]
    + [
        spec(
            _decode_segments_kernel,
            {
                "out_ptr": "*fp32",
                "base_ptr": "*u8",
                "prog_seg_ptr": "*i32",
                "prog_first_ptr": "*i64",
                "seg_ptr": "*i64",
                "levels": "fp32",
            },
            {"KIND": KIND_CODE[k], "BITS": bits, "BLOCK": TILE_GPU},
            num_warps=NUM_WARPS,
            divisible=(),
        )
        for k, bits in (("sign1", 8), ("qsgd", 4), ("tern2", 8), ("int8", 8))
    ]
    + [  # the frame checks' pass (quant_body_stats_triton)
        spec(
            _body_stats_kernel,
            {
                "w_ptr": "*u8",
                "codes_ptr": "*u8",
                "at_ptr": "*i64",
                "out_ptr": "*i64",
                "n": "i64",
                "ns": "i64",
                "nbp": "i64",
                "eq_at_ptr": "*i64",
                "eq_want_ptr": "*u8",
                "eq_slot_ptr": "*i64",
                "neq": "i64",
            },
            {"KIND": KIND_CODE[k], "BITS": bits, "BLOCK": STATS_GPU},
            num_warps=4,
            divisible=(),
        )
        for k, bits in (("sign1", 1), ("qsgd", 4), ("qsgd", 2), ("qsgd", 8), ("tern2", 2), ("int8", 8))
    ]
    + [  # Int8's error-feedback subtraction (int8_apply_triton)
        spec(
            _decode_add_quant_kernel,
            _DEC_SIG,
            {"KIND": KIND_CODE["int8"], "BITS": 8, "BLOCK": TILE_GPU, "SUB": True, "ALIGNED": aligned},
            num_warps=NUM_WARPS,
        )
        for aligned in (True, False)
    ]
)
