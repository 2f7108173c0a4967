"""What the quantizer encoders (:mod:`.sign`, :mod:`.stochastic`) share: block statistics,
the one-pass tile, and the choice between the two routes.

Two routes for each encoder, chosen by the launcher (:func:`one_pass_shape`); both give the
same floats and bytes, so the choice is invisible to callers.

* **One pass**, taken when a program can own whole blocks: the block length ``b``, rounded
  up to a power of two ``P``, fits the program tile (``TILE_GPU`` = 4096 elements,
  ``TILE_INTERPRETER`` under the interpreter; QSGD and TernGrad use smaller tiles on the GPU,
  see :mod:`.stochastic`), and no packed word straddles two blocks: ``b % 32 == 0`` for sign
  words, ``b % (8 // bits) == 0`` for code bytes, or the tensor is one block. A program loads
  ``ROWS = TILE / P`` blocks (fewer when the tensor has fewer) as a ``[ROWS, P / per, per]``
  tile (:func:`_onepass_tile`), masked to each block's length, reduces the block statistic
  along the block, computes the float32 scale on the device with the expression of the
  two-pass route, writes it, and encodes from the same registers. ``x`` (and the residual)
  are read once. The usual cases: QSGD's default block 64, SignSGD or TernGrad with
  ``block`` 1024 or 4096.
* **Two passes**, everywhere else (a block longer than the tile, e.g. ``block=None`` on a
  tensor of more than 4096 elements; blocks whose length is not a multiple of the packing;
  precomputed ``scales``): pass 1 (:func:`_block_stats_kernel`) writes per-segment
  partials, torch turns them into scales with the reference's functions
  (:mod:`gradzip.kernels.quant`), pass 2 encodes. ``x`` is read twice.

Minimal bytes per element (what any implementation must move; ``B`` the bytes of an ``x``
element: 4 for fp32, 2 for fp16/bf16; ``b`` the block length; the two-pass route moves
another ``B`` per element, and for sign with a residual another 4):

=================================  ==============================  ===========================
encoder                            one pass (the minimum)           two passes
=================================  ==============================  ===========================
sign_ef, residual in and out       ``B + 4 + 4 + 1/8 + 4/b``        ``2B + 8 + 4 + 1/8 + 4/b``
sign_ef, no residual (compressor)  ``B + 1/8 + 4/b``                ``2B + 1/8 + 4/b``
qsgd_encode (``bits`` per code)    ``B + bits/8 + 4/b``             ``2B + bits/8 + 4/b``
terngrad_encode                    ``B + 1/4 + 4/b``                ``2B + 1/4 + 4/b``
=================================  ==============================  ===========================

(fp32, sign with residual, block 1024: 12.13 bytes per element; QSGD s = 7, block 64: 4.56;
TernGrad, block 1024: 4.25. The two-pass route's ceiling is about the ratio of the two columns
of copy bandwidth: 60% for sign, 53% for QSGD, 52% for TernGrad.)

Block statistics (both routes): ``sum |v|`` (sign) and ``sum v^2`` (QSGD; TernGrad with
``clip``) in float64 (``v^2`` of a float32 is exact in float64; a sum of float32 values
cannot overflow float64, so a finite sum means a finite block), ``max |v|`` as float bits
(NaN wins, as in ``torch.amax``). The scales are the reference's expressions; on the GPU the
float64 divide and square root are ``div.rn.f64`` / ``sqrt.rn.f64`` and the conversion
``cvt.rn.f32.f64``: the host's correctly rounded operations. The sums' order differs from
the reference's (and between the routes); :mod:`gradzip.kernels.quant` says when that can
show in a scale.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..dispatch import Unsupported
from ..quant import quant_layout
from . import LAUNCH, load_compensated, size, spec

__all__ = ["block_stats_triton", "one_pass_shape", "choose_route", "tile_size", "check_seed", "ROUTES"]

NUM_WARPS = 8
TILE_GPU = 4096  # elements per program
TILE_INTERPRETER = 16384

STAT_SUM_ABS = 0
STAT_SUM_SQ = 1
STAT_MAX_ABS = 2
STAT_MAX_SUM_SQ = 3  # TernGrad with clip: both

ROUTES = ("auto", "one", "two")


@triton.jit
def _block_stats_kernel(
    x_ptr,
    r_ptr,
    sum_ptr,
    max_ptr,
    n,
    b,
    cb,
    nseg,
    HAS_R: tl.constexpr,
    STAT: tl.constexpr,
    ROWS: tl.constexpr,
    COLS: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    seg = pid * ROWS + tl.arange(0, ROWS)
    blk = seg // cb
    within = (seg % cb)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    offs = blk[:, None] * b + within
    mask = (seg[:, None] < nseg) & (within < b) & (offs < n)
    v = load_compensated(x_ptr, r_ptr, offs, mask, HAS_R)
    smask = seg < nseg
    if STAT == 0:
        tl.store(sum_ptr + seg, tl.sum(tl.abs(v).to(tl.float64), axis=1), mask=smask)
    if STAT == 1 or STAT == 3:
        w = v.to(tl.float64)
        tl.store(sum_ptr + seg, tl.sum(w * w, axis=1), mask=smask)
    if STAT == 2 or STAT == 3:
        bits = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        tl.store(max_ptr + seg, tl.max(bits, axis=1), mask=smask)


@triton.jit
def _block_of(offs, first, b, WIDE: tl.constexpr):
    """``offs // b`` for a two-pass tile whose first element is ``first``. ``WIDE``: blocks are
    at least as long as the tile, so it meets at most one boundary and one division per
    program does (an int64 division per element costs tens of instructions)."""
    if WIDE:
        blk0 = first // b
        return blk0 + (offs >= (blk0 + 1) * b).to(tl.int64)
    else:
        return offs // b


@triton.jit
def _onepass_tile(n, b, nb, ROWS: tl.constexpr, CHUNKS: tl.constexpr, PER: tl.constexpr):
    """The one-pass tile ``[ROWS, CHUNKS, PER]``: ROWS blocks (row ``i`` is block
    ``pid * ROWS + i``) of ``CHUNKS * PER`` (a power of two >= b) elements, masked to the
    block's own length. A chunk of PER elements is one packed word (sign: 32 bits) or one
    byte of codes (8 // bits). Chunk ``j`` of block ``k`` is word / byte ``k * b // PER + j``:
    the launcher takes this route only when ``b % PER == 0`` or the tensor is one block.

    Returns the block of each row, the element offsets and mask, the word / byte index of
    each chunk and its mask, and each block's element count (float64)."""
    pid = tl.program_id(0).to(tl.int64)
    blk = pid * ROWS + tl.arange(0, ROWS)  # [ROWS]
    chunk = tl.arange(0, CHUNKS)
    col = tl.arange(0, PER)
    within = chunk[None, :, None] * PER + col[None, None, :]  # [1, CHUNKS, PER]
    offs = blk[:, None, None] * b + within  # [ROWS, CHUNKS, PER], int64
    mask = (blk[:, None, None] < nb) & (within < b) & (offs < n)
    first = blk[:, None] * b + chunk[None, :] * PER  # [ROWS, CHUNKS]: first element of each chunk
    cmask = (blk[:, None] < nb) & (chunk[None, :] * PER < b) & (first < n)
    cidx = blk[:, None] * b // PER + chunk[None, :]
    count = tl.maximum(tl.minimum(n - blk * b, b), 1).to(tl.float64)
    return blk, offs, mask, cidx, cmask, count


@triton.jit
def _fit_f32(wide, total):
    """:func:`gradzip.kernels.quant.fit_f32` on the device: float64 ``wide`` rounded to float32,
    0 where it exceeds float32's range while the block's float64 sum ``total`` is finite (NaN
    and inf fail ``<=`` float64's maximum)."""
    over = (wide > 3.4028234663852886e38) & (total <= 1.7976931348623157e308)
    return tl.where(over, 0.0, wide).to(tl.float32)


@triton.jit
def _isnan(v):
    """NaN test on float32 bits (exponent all ones, mantissa not zero)."""
    return (v.to(tl.int32, bitcast=True) & 0x7FFFFFFF) > 0x7F800000


# -- launch helpers -----------------------------------------------------------------------------


def tile_size(tile: int | None) -> int:
    """Elements per program: ``tile`` (a power of two >= 32), or the default for where the kernels run."""
    return size("tile", tile, TILE_GPU, TILE_INTERPRETER, minimum=32)


def check_seed(seed) -> int:
    seed = int(seed)
    if not (0 <= seed < 2**63):
        raise Unsupported(f"seed must be in [0, 2**63), got {seed}")
    return seed


def block_stats_triton(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    b: int,
    stat: int,
    *,
    tile: int | None = None,
    partials: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Per-block ``(float64 sum, float32 max|v|)`` of ``v = x + residual`` for blocks of ``b``
    (either None where ``stat`` does not ask for it). Pass 1 of every two-pass encoder.
    ``partials`` (sums only): ``(the float64 sums of each block's cb chunks, block after block,
    cb)``, for a kernel that finishes the blocks itself."""
    n = x.numel()
    T = tile_size(tile)
    nb = (n + b - 1) // b
    cols = min(T, triton.next_power_of_2(b))
    rows = max(1, T // cols)
    cb = triton.cdiv(b, cols)
    nseg = nb * cb
    dev = x.device
    sums = torch.empty(nseg, dtype=torch.float64, device=dev) if stat != STAT_MAX_ABS else None
    maxb = torch.empty(nseg, dtype=torch.int32, device=dev) if stat in (STAT_MAX_ABS, STAT_MAX_SUM_SQ) else None
    xf = x.reshape(-1)
    _block_stats_kernel[(triton.cdiv(nseg, rows),)](
        xf,
        residual.reshape(-1) if residual is not None else xf,
        sums if sums is not None else maxb,
        maxb if maxb is not None else sums,
        n,
        b,
        cb,
        nseg,
        HAS_R=residual is not None,
        STAT=stat,
        ROWS=rows,
        COLS=cols,
        num_warps=NUM_WARPS,
        **LAUNCH,
    )
    if partials:
        return sums, cb
    total = None if sums is None else (sums if cb == 1 else sums.view(nb, cb).sum(dim=1))
    amax = None
    if maxb is not None:
        amax = (maxb if cb == 1 else maxb.view(nb, cb).amax(dim=1)).view(torch.float32)
    return total, amax


def one_pass_shape(n: int, block: int | None, per: int, tile: int | None = None) -> tuple[int, int] | None:
    """``(ROWS, CHUNKS)`` of the one-pass tile for ``n`` elements in blocks of ``block``, or
    None where the one-pass route does not apply: a block longer than the tile, or one whose
    length is not a multiple of ``per`` (elements per packed word or byte: 32 for sign, 8 // bits
    for the codes) while the tensor has more than one block. ``CHUNKS * per`` is the block
    length rounded up to a power of two; ``ROWS`` blocks share a program."""
    T = tile_size(tile)
    nb, b = quant_layout(n, block)
    if n == 0:
        return None
    width = max(triton.next_power_of_2(b), per)
    if width > T or (nb > 1 and b % per):
        return None
    rows = max(1, min(T // width, triton.next_power_of_2(nb)))
    return rows, width // per


def choose_route(route: str, n: int, block, per: int, tile, scales) -> tuple[int, int] | None:
    """The one-pass tile shape if this call takes the one-pass route, else None (two passes).
    ``route`` ``"one"``/``"two"`` forces one (tests, benchmarks); ``"one"`` raises
    Unsupported where it does not apply."""
    if route not in ROUTES:
        raise ValueError(f"route must be one of {list(ROUTES)}, got {route!r}")
    if route == "two" or scales is not None or n == 0:
        return None
    shape = one_pass_shape(n, block, per, tile)
    if shape is None and route == "one":
        raise Unsupported(f"no one-pass route for n={n}, block={block} (tile {tile_size(tile)}, {per} per word)")
    return shape


def _stats_sig(xp):
    return {
        "x_ptr": xp,
        "r_ptr": "*fp32",
        "sum_ptr": "*fp64",
        "max_ptr": "*i32",
        "n": "i32",
        "b": "i32",
        "cb": "i32",
        "nseg": "i32",
    }


AOT_SPECS = [
    spec(
        _block_stats_kernel,
        _stats_sig("*fp32"),
        {"HAS_R": True, "STAT": STAT_SUM_ABS, "ROWS": 1, "COLS": TILE_GPU},
        num_warps=NUM_WARPS,
    ),
    spec(
        _block_stats_kernel,
        _stats_sig("*bf16"),
        {"HAS_R": False, "STAT": STAT_SUM_SQ, "ROWS": 64, "COLS": 64},
        num_warps=NUM_WARPS,
    ),
    spec(
        _block_stats_kernel,
        _stats_sig("*fp16"),
        {"HAS_R": False, "STAT": STAT_MAX_SUM_SQ, "ROWS": 4, "COLS": 1024},
        num_warps=NUM_WARPS,
        divisible=(),
    ),
]
