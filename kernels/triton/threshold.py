"""Fused threshold + error feedback (Strom), in Triton.

Pass 1 (:func:`_threshold_ef_kernel`), one read of ``x`` (and of the residual):
``v = x + r``, select ``v >= tau`` / ``v <= -tau``, write the new residual
``v - sent``, the 2-bit bitmap (16 codes per int32 word, which is the
little-endian byte layout of ``FMT_BITMAP2``), and per program the number
selected and ``max |v|`` (as float bits, so NaN wins as in ``torch.max``).

Pass 2, only for the index list (:func:`_threshold_compact_kernel`): reads the
bitmap (1/16 of pass 1's traffic) and writes the signed index words in ascending
order at ``exclusive_cumsum(counts)[program] + rank within the program``.

The residual may be written over the residual read (``out`` is ``residual``) or over
``x``: each element is loaded before it is stored, by the same program.

Reference: :func:`gradzip.kernels.reference.threshold_ef_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..device import DeviceThresholdResult
from ..dispatch import KERNEL_DTYPES, _guard
from ..reference import ThresholdResult, wants_residual
from . import LAUNCH, check, load_compensated, row_tile, size, spec

__all__ = ["threshold_ef_triton", "ROWS_GPU", "ROWS_INTERPRETER"]

# Elements per program = ROWS * 16 (one bitmap word per row of 16 elements).
ROWS_GPU = 256
ROWS_INTERPRETER = 1024
NUM_WARPS = 8


@triton.jit
def _threshold_ef_kernel(
    x_ptr,
    r_ptr,
    rout_ptr,
    words_ptr,
    counts_ptr,
    amax_ptr,
    n,
    tau,
    HAS_R: tl.constexpr,
    WRITE_R: tl.constexpr,
    ROWS: tl.constexpr,
):
    pid, rows, cols, offs, mask = row_tile(n, ROWS, 16)
    v = load_compensated(x_ptr, r_ptr, offs, mask, HAS_R)
    pos = (v >= tau) & mask
    neg = (v <= -tau) & mask
    if WRITE_R:
        # Same expression as the reference (and as v - decompress(payload)).
        sent = pos.to(tl.float32) * tau - neg.to(tl.float32) * tau
        tl.store(rout_ptr + offs, v - sent, mask=mask)
    code = pos.to(tl.int32) | (neg.to(tl.int32) << 1)
    # Disjoint bits: the sum is the OR (and much faster than tl.reduce_or in the interpreter).
    word = tl.sum(code << (cols * 2)[None, :], axis=1)
    nwords = (n + 15) // 16
    tl.store(words_ptr + rows, word, mask=rows < nwords)
    count = tl.sum(tl.sum((code != 0).to(tl.int32), axis=1), axis=0)
    tl.store(counts_ptr + pid, count)
    bits = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    tl.store(amax_ptr + pid, tl.max(tl.max(bits, axis=1), axis=0))


@triton.jit
def _threshold_compact_kernel(words_ptr, offsets_ptr, out_ptr, n, ROWS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, 16)
    nwords = (n + 15) // 16
    w = tl.load(words_ptr + rows, mask=rows < nwords, other=0)
    code = (w[:, None] >> (cols * 2)[None, :]) & 3
    idx = rows[:, None] * 16 + cols[None, :]
    sel = (code != 0) & (idx < n)
    s = sel.to(tl.int32)
    within = tl.cumsum(s, axis=1)
    row_count = tl.sum(s, axis=1)
    row_start = tl.cumsum(row_count, axis=0) - row_count
    base = tl.load(offsets_ptr + pid)
    dst = base + (row_start[:, None] + within - 1).to(tl.int64)
    # Index in bits 0..30 (n < 2**31 here), sign in bit 31.
    word = idx.to(tl.int32) | ((code >> 1) << 31)
    tl.store(out_ptr + dst, word, mask=sel)


class _TritonThresholdResult(DeviceThresholdResult):
    backend = "triton"

    def __init__(self, n, tau, residual, words, counts, amax_bits, rows):
        super().__init__(n, tau, residual, words, counts, amax_bits)
        self._rows = rows

    def indices(self) -> torch.Tensor:
        self._check_indexable()
        count = self.count
        out = torch.empty(count, dtype=torch.int32, device=self._words.device)
        if count:
            offsets = torch.cumsum(self._counts, 0, dtype=torch.int64) - self._counts
            grid = (self._counts.numel(),)
            with _guard("triton", out.device):  # launched outside the dispatch: serialize it under the interpreter
                _threshold_compact_kernel[grid](
                    self._words, offsets, out, self.n, ROWS=self._rows, num_warps=NUM_WARPS, **LAUNCH
                )
        return out


def threshold_ef_triton(
    x: torch.Tensor,
    tau: float,
    residual: torch.Tensor | None = None,
    *,
    new_residual: bool | None = None,
    out: torch.Tensor | None = None,
    rows: int | None = None,
) -> ThresholdResult:
    """Triton version of :func:`~gradzip.kernels.reference.threshold_ef_reference`.

    ``x`` is float32/float16/bfloat16, ``residual`` and ``out`` float32. ``rows`` (a power
    of two) sets the elements per program to ``16 * rows`` (tests use small ones).
    """
    check("x", x, KERNEL_DTYPES)
    if residual is not None:
        check("residual", residual, (torch.float32,), x.device)
    if out is not None:
        check("out", out, (torch.float32,), x.device)
    ROWS = size("rows", rows, ROWS_GPU, ROWS_INTERPRETER)
    n = x.numel()
    dev = x.device
    nprog = triton.cdiv(n, ROWS * 16)
    # The reference compares float32 v with tau rounded to float32; so does the kernel.
    tau32 = float(torch.tensor(tau, dtype=torch.float32))
    words = torch.empty(max(triton.cdiv(n, 16), 1), dtype=torch.int32, device=dev)
    counts = torch.empty(nprog, dtype=torch.int32, device=dev)
    amax_bits = torch.empty(nprog, dtype=torch.int32, device=dev)
    xf = x.reshape(-1)
    rout = None
    if wants_residual(residual, new_residual, out):
        rout = out.view(-1) if out is not None else torch.empty(n, dtype=torch.float32, device=dev)
    if nprog:
        _threshold_ef_kernel[(nprog,)](
            xf,
            residual.reshape(-1) if residual is not None else xf,
            rout if rout is not None else xf,
            words,
            counts,
            amax_bits,
            n,
            tau32,
            HAS_R=residual is not None,
            WRITE_R=rout is not None,
            ROWS=ROWS,
            num_warps=NUM_WARPS,
            **LAUNCH,
        )
    return _TritonThresholdResult(n, tau, out if out is not None else rout, words, counts, amax_bits, ROWS)


def _spec(kernel, sig, divisible=("n",), **constexprs):
    return spec(kernel, sig, constexprs, num_warps=NUM_WARPS, divisible=divisible)


def _ef_sig(x: str, n: str) -> dict:
    return {
        "x_ptr": x,
        "r_ptr": "*fp32",
        "rout_ptr": "*fp32",
        "words_ptr": "*i32",
        "counts_ptr": "*i32",
        "amax_ptr": "*i32",
        "n": n,
        "tau": "fp32",
    }


AOT_SPECS = [
    _spec(_threshold_ef_kernel, _ef_sig("*fp32", "i32"), HAS_R=True, WRITE_R=True, ROWS=ROWS_GPU),
    _spec(_threshold_ef_kernel, _ef_sig("*fp16", "i32"), HAS_R=True, WRITE_R=True, ROWS=ROWS_GPU),
    _spec(_threshold_ef_kernel, _ef_sig("*bf16", "i64"), HAS_R=True, WRITE_R=True, ROWS=ROWS_GPU),
    _spec(_threshold_ef_kernel, _ef_sig("*fp32", "i64"), HAS_R=False, WRITE_R=False, ROWS=ROWS_GPU),
    # A ragged n (not a multiple of 16): masked scalar loads instead of 16-byte vectors.
    _spec(_threshold_ef_kernel, _ef_sig("*fp32", "i32"), divisible=(), HAS_R=True, WRITE_R=True, ROWS=ROWS_GPU),
    _spec(
        _threshold_compact_kernel,
        {"words_ptr": "*i32", "offsets_ptr": "*i64", "out_ptr": "*i32", "n": "i32"},
        ROWS=ROWS_GPU,
    ),
]
