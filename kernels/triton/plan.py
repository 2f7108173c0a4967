"""The quantizer kernels launched from tables built once per layout (the planned path,
:mod:`gradzip.protocols.planned`): no table, offset or output is made on a call, so a launch is
the kernel's launch and nothing else. The kernels are the ones the dispatch runs
(``int8.py``, ``decode.py``), so the bytes and floats are theirs; each launcher here fixes
the addresses they read and write: a frame's body where its message puts it in a round's
send buffer, a received piece where the round's receive buffer holds it.

Interpreted launches (``TRITON_INTERPRET=1`` on CPU tensors) take the dispatch's lock, as every
interpreted launch does (``dispatch._guard``)."""

from __future__ import annotations

import torch
import triton

from ..dispatch import _guard
from ..quant import _body_layout, quant_layout
from . import LAUNCH, size
from .blocks import NUM_WARPS, tile_size
from .decode import (
    KIND_CODE,
    STATS_GPU,
    STATS_INTERPRETER,
    TILE_GPU,
    TILE_INTERPRETER,
    _body_stats_kernel,
    _decode_add_quant_kernel,
    _decode_segments_kernel,
    decode_segment_tables,
)
from .decode import (
    NUM_WARPS as DECODE_WARPS,
)
from .int8 import _int8_segments_kernel, int8_segment_tables
from .sign import SEG_CHUNK, _sign_seg_encode_into_kernel, _sign_seg_sums_kernel, sign_segment_tables

__all__ = ["Int8EncodeInto", "SignEncodeInto", "DecodePeers", "DecodeSegments", "RoundCheck", "fits"]


def fits(block: int | None) -> bool:
    """Whether Int8's segmented encoder takes ``block`` in one launch (a block within a tile)."""
    return block is not None and triton.next_power_of_2(int(block)) <= tile_size(None)


class Int8EncodeInto:
    """Int8 frames of segments of a flat ``x``, each body written at a given byte of ``out``
    (its scales, then its codes), the residual ``x - decode`` written into ``residual``:
    ``_int8_segments_kernel``, one launch. ``segs``: ``(first element, elements, body's byte)``."""

    def __init__(self, segs, block: int, device) -> None:
        width = triton.next_power_of_2(int(block))
        self.rows, self.width = tile_size(None) // width, width
        self.prog_seg, self.prog_first, self.seg = int8_segment_tables(segs, block, self.rows, device)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, out: torch.Tensor) -> None:
        with _guard("triton", x.device):
            _int8_segments_kernel[(self.prog_seg.numel(),)](
                x,
                residual,
                out,
                self.prog_seg,
                self.prog_first,
                self.seg,
                ROWS=self.rows,
                WIDTH=self.width,
                HAS_RES=True,
                num_warps=NUM_WARPS,
                **LAUNCH,
            )


class SignEncodeInto:
    """SignSGD frames (one scale a segment, ``block=None``) of segments of a flat ``x``, each body
    written at a given byte of ``out``, the residual ``x - decode`` written into ``residual``:
    ``_sign_seg_sums_kernel`` then ``_sign_seg_encode_into_kernel``, two launches (the sums'
    buffer kept). ``segs``: ``(first element, elements, body's byte)``."""

    def __init__(self, segs, device) -> None:
        self.T = tile_size(None)
        self.prog_seg, self.prog_first, self.seg = sign_segment_tables(segs, self.T, device)
        self.part = torch.empty(self.prog_seg.numel(), dtype=torch.float64, device=device)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, out: torch.Tensor) -> None:
        grid, tables = (self.prog_seg.numel(),), (self.prog_seg, self.prog_first, self.seg)
        with _guard("triton", x.device):
            _sign_seg_sums_kernel[grid](
                x, x, self.part, *tables, TILE=self.T, HAS_R=False, num_warps=NUM_WARPS, **LAUNCH
            )
            _sign_seg_encode_into_kernel[grid](
                x,
                x,
                residual,
                out,
                self.part,
                *tables,
                WORDS=self.T // 32,
                CHUNK=SEG_CHUNK,
                HAS_R=False,
                num_warps=NUM_WARPS,
                **LAUNCH,
            )


class DecodePeers:
    """``out += decode(peer p's body)`` for every peer in rank order, each body at byte
    ``offsets[p]`` of a base buffer: ``_decode_add_quant_kernel``, one launch."""

    def __init__(self, offsets, n: int, kind: str, block, levels: float, bits: int, device) -> None:
        nb, self.b = quant_layout(n, block)
        self.n, self.npeers, self.levels = n, len(offsets), float(levels)
        self.kind, self.bits = KIND_CODE[kind], int(bits or 8)
        self.aligned = all(o % 4 == 0 for o in offsets)
        self.B = size("tile", None, TILE_GPU, TILE_INTERPRETER, minimum=32)
        self.soffs = torch.tensor(offsets, dtype=torch.int64).to(device)
        self.coffs = (torch.tensor(offsets, dtype=torch.int64) + 4 * nb).to(device)

    def __call__(self, out: torch.Tensor, base: torch.Tensor) -> None:
        with _guard("triton", out.device):
            _decode_add_quant_kernel[(triton.cdiv(self.n, self.B),)](
                out,
                base,
                self.soffs,
                self.coffs,
                self.n,
                self.b,
                self.npeers,
                self.levels,
                KIND=self.kind,
                BITS=self.bits,
                BLOCK=self.B,
                SUB=False,
                ALIGNED=self.aligned,
                num_warps=DECODE_WARPS,
                **LAUNCH,
            )


class DecodeSegments:
    """``out[start:start + n] += decode(body)`` for every segment ``(start, n, body's byte)``
    of a base buffer: ``_decode_segments_kernel``, one launch."""

    def __init__(self, segs, kind: str, block, levels: float, bits: int, device) -> None:
        self.B = size("tile", None, TILE_GPU, TILE_INTERPRETER, minimum=32)
        self.levels, self.kind, self.bits = float(levels), KIND_CODE[kind], int(bits or 8)
        self.prog_seg, self.prog_first, self.seg = decode_segment_tables(segs, block, self.B, device)

    def __call__(self, out: torch.Tensor, base: torch.Tensor) -> None:
        with _guard("triton", out.device):
            _decode_segments_kernel[(self.prog_seg.numel(),)](
                out,
                base,
                self.prog_seg,
                self.prog_first,
                self.seg,
                self.levels,
                KIND=self.kind,
                BITS=self.bits,
                BLOCK=self.B,
                num_warps=DECODE_WARPS,
                **LAUNCH,
            )


class RoundCheck:
    """A received round's check in one launch (``_body_stats_kernel``): the frames' bodies at
    ``frames`` (``(byte, scales, elements)``) in ``size`` bytes give ``status[0]`` (a negative
    scale) and ``status[1]`` (the largest code, Int8: a -128), and the bytes at ``at`` are
    compared with ``want``, a difference setting ``status[slot]``. ``status`` must be zeroed
    before the launch (its slots are maxima)."""

    def __init__(self, frames, size_: int, kind: str, bits: int, at, want: bytes, slots, device) -> None:
        if len(at) != len(want) or len(at) != len(slots):
            raise ValueError("one wanted byte and one slot per compared position")
        frames = tuple((int(o), int(nb), int(k)) for o, nb, k in frames)
        self.scale_at, self.codes = _body_layout(frames, size_, kind, bits, device)
        self.n, self.kind, self.bits = size_, KIND_CODE[kind], bits
        self.B = size("block", None, STATS_GPU, STATS_INTERPRETER)
        self.ns = self.scale_at.numel() // 4
        self.nbp = 0 if self.codes is None else triton.cdiv(size_, self.B)
        self.eq_at = torch.tensor(list(at), dtype=torch.int64).to(device)
        self.eq_want = torch.frombuffer(bytearray(want), dtype=torch.uint8).to(device) if want else None
        self.eq_slot = torch.tensor(list(slots), dtype=torch.int64).to(device)
        self.grid = self.nbp + triton.cdiv(self.ns, self.B) + triton.cdiv(len(at), self.B)

    def __call__(self, whole: torch.Tensor, status: torch.Tensor) -> None:
        if not self.grid:
            return
        with _guard("triton", whole.device):
            _body_stats_kernel[(self.grid,)](
                whole,
                whole if self.codes is None else self.codes,
                self.scale_at,
                status,
                self.n,
                self.ns,
                self.nbp,
                self.eq_at,
                whole if self.eq_want is None else self.eq_want,
                self.eq_slot,
                self.eq_at.numel(),
                KIND=self.kind,
                BITS=self.bits,
                BLOCK=self.B,
                num_warps=4,
                **LAUNCH,
            )
