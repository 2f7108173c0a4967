"""gradzip.kernels: the codec ops that compressors are built from.

Every op has a pure-PyTorch reference (:mod:`.reference` for the sparsifying ops,
:mod:`.quant` for the quantizers); it is the CPU path and the oracle of the GPU
kernels (:mod:`.triton`, :mod:`.cupy_ops`) and of the CPU kernels (:mod:`.numba_ops`),
which give its results bit for bit.
:mod:`.dispatch` picks the implementation of each call (see its docstring for the
rules and ``GRADZIP_KERNELS``); every choice is in :func:`backend_report`. Code that picks
how to compute by the device's type asks :func:`gpu_side` (true on the CPU too within
:func:`gpu_side_on_cpu`: the GPU path's host work, counted on the CPU).
Importing this package never imports numba, triton or cupy. Kernels know nothing of
compressors or torch.distributed.

Ops:

* sparsification: :func:`threshold_ef`, :func:`decode_add_bitmap2`,
  :func:`scatter_add_signed`, :func:`scatter_add_sparse`, :func:`scatter_add_sparse_many` (every
  peer's frame at once, in order), :func:`abs_select` and the
  composite :func:`sampled_topk`;
* quantizers: :func:`sign_ef`, :func:`sign_ef_segments` (a tensor's pieces, one scale each, and
  their error feedback at once), :func:`qsgd_encode`, :func:`terngrad_encode`,
  :func:`int8_scales`, :func:`int8_encode`, :func:`int8_encode_segments` (a tensor's pieces
  and their error feedback at once), :func:`decode_add_quant`, :func:`decode_quant`,
  :func:`quant_body_stats` (the frame checks' pass over the bodies), with the block layout
  helpers and :func:`philox_uniform`, the draws of every backend;
* low rank: :func:`orthonormalize_rows_` (PowerSGD's Gram-Schmidt, every matrix of a call at
  once; :mod:`.orth`).

Inputs may be float32, float16 or bfloat16 (computed in float32) or float64 (computed
in float64; always the reference). The error-feedback encoders write their new
residual into ``out`` when given: a contiguous tensor of ``x.numel()`` elements in the
accumulation dtype (float32; float64 for float64 ``x``), which may be the residual
passed in or ``x`` itself when ``x`` has that dtype; it is returned as it is.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import bitpack
from .dispatch import (
    BACKENDS,
    ENV_VAR,
    KERNEL_DTYPES,
    KernelBackendError,
    Unsupported,
    _call,
    _call_reference,
    _forced,
    backend_report,
    gpu_side,
    gpu_side_on_cpu,
    host_to_device,
    register_kernel,
    reset_dispatch,
    runs_triton,
    uses_kernel,
)
from .orth import orth_table, orthonormalize_rows_reference
from .philox import philox_uniform
from .quant import (
    QUANT_KINDS,
    decode_add_quant_reference,
    decode_add_quant_segments_reference,
    int8_encode_reference,
    int8_encode_segments_reference,
    int8_scales,
    int8_segments_layout,
    qsgd_bits,
    qsgd_encode_reference,
    quant_body_stats_reference,
    quant_code_bytes,
    quant_layout,
    quant_pad,
    quant_per_element,
    sign_ef_reference,
    sign_ef_segments_reference,
    sign_segments_layout,
    terngrad_encode_reference,
)
from .quant import (
    int8_apply_ as int8_apply_reference,
)
from .reference import (
    APPROX_TOL,
    ThresholdResult,
    abs_select_reference,
    accum_dtype,
    approx_band,
    decode_add_bitmap2_reference,
    decode_signed_indices,
    encode_signed_indices,
    pack_2bit,
    sampled_topk_approx_reference,
    sampled_topk_reference,
    scatter_add_signed_reference,
    scatter_add_sparse_many_reference,
    scatter_add_sparse_reference,
    threshold_ef_reference,
    threshold_select_reference,
    unpack_2bit,
)

__all__ = [
    # sparsification
    "threshold_ef",
    "ThresholdResult",
    "decode_add_bitmap2",
    "scatter_add_signed",
    "scatter_add_sparse",
    "scatter_add_sparse_many",
    "abs_select",
    "sampled_topk",
    "approx_band",
    "APPROX_TOL",
    "pack_2bit",
    "unpack_2bit",
    "encode_signed_indices",
    "decode_signed_indices",
    "threshold_select_reference",
    # quantizers
    "sign_ef",
    "sign_ef_segments",
    "sign_segments_layout",
    "qsgd_encode",
    "terngrad_encode",
    "int8_scales",
    "int8_encode",
    "int8_encode_segments",
    "int8_segments_layout",
    "int8_apply_",
    "decode_add_quant",
    "decode_add_quant_segments",
    "decode_quant",
    "quant_body_stats",
    "pack_uint",
    "unpack_uint",
    "philox_uniform",
    "QUANT_KINDS",
    "quant_layout",
    "quant_pad",
    "quant_per_element",
    "quant_code_bytes",
    "qsgd_bits",
    "accum_dtype",
    # low rank
    "orthonormalize_rows_",
    # dispatch
    "backend_report",
    "register_kernel",
    "reset_dispatch",
    "uses_kernel",
    "runs_triton",
    "gpu_side",
    "host_to_device",
    "gpu_side_on_cpu",
    "Unsupported",
    "KernelBackendError",
    "BACKENDS",
    "ENV_VAR",
    "KERNEL_DTYPES",
]

# Every op with its reference and its kernels, in order of preference: (module, launcher),
# imported on first use.
_OPS = {
    "threshold_ef": (
        threshold_ef_reference,
        {
            "numba": (".numba_ops", "threshold_ef_numba"),
            "triton": (".triton.threshold", "threshold_ef_triton"),
            "cupy": (".cupy_ops", "threshold_ef_cupy"),
        },
    ),
    "decode_add_bitmap2": (decode_add_bitmap2_reference, {"triton": (".triton.decode", "decode_add_bitmap2_triton")}),
    "scatter_add_signed": (scatter_add_signed_reference, {"triton": (".triton.decode", "scatter_add_signed_triton")}),
    "scatter_add_sparse": (scatter_add_sparse_reference, {"triton": (".triton.decode", "scatter_add_sparse_triton")}),
    "scatter_add_sparse_many": (
        scatter_add_sparse_many_reference,
        {"triton": (".triton.decode", "scatter_add_sparse_many_triton")},
    ),
    "abs_select": (
        abs_select_reference,
        {
            "numba": (".numba_ops", "abs_select_numba"),
            "triton": (".triton.topk", "abs_select_triton"),
            "cupy": (".cupy_ops", "abs_select_cupy"),
        },
    ),
    "sign_ef": (
        sign_ef_reference,
        {"numba": (".numba_ops", "sign_ef_numba"), "triton": (".triton.sign", "sign_ef_triton")},
    ),
    "sign_ef_segments": (
        sign_ef_segments_reference,
        {"numba": (".numba_ops", "sign_ef_segments_numba"), "triton": (".triton.sign", "sign_ef_segments_triton")},
    ),
    "qsgd_encode": (
        qsgd_encode_reference,
        {"numba": (".numba_ops", "qsgd_encode_numba"), "triton": (".triton.stochastic", "qsgd_encode_triton")},
    ),
    "terngrad_encode": (
        terngrad_encode_reference,
        {"numba": (".numba_ops", "terngrad_encode_numba"), "triton": (".triton.stochastic", "terngrad_encode_triton")},
    ),
    "int8_encode": (
        int8_encode_reference,
        {"numba": (".numba_ops", "int8_encode_numba"), "triton": (".triton.int8", "int8_encode_triton")},
    ),
    "int8_encode_segments": (
        int8_encode_segments_reference,
        {
            "numba": (".numba_ops", "int8_encode_segments_numba"),
            "triton": (".triton.int8", "int8_encode_segments_triton"),
        },
    ),
    "int8_apply_": (
        int8_apply_reference,
        {"numba": (".numba_ops", "int8_apply_numba"), "triton": (".triton.decode", "int8_apply_triton")},
    ),
    "decode_add_quant_segments": (
        decode_add_quant_segments_reference,
        {
            "numba": (".numba_ops", "decode_add_quant_segments_numba"),
            "triton": (".triton.decode", "decode_add_quant_segments_triton"),
        },
    ),
    "decode_add_quant": (
        decode_add_quant_reference,
        {"numba": (".numba_ops", "decode_add_quant_numba"), "triton": (".triton.decode", "decode_add_quant_triton")},
    ),
    "pack_uint": (bitpack.pack_uint, {"triton": (".triton.bits", "pack_uint_triton")}),
    "unpack_uint": (bitpack.unpack_uint, {"triton": (".triton.bits", "unpack_uint_triton")}),
    "quant_body_stats": (
        quant_body_stats_reference,
        {
            "numba": (".numba_ops", "quant_body_stats_numba"),
            "triton": (".triton.decode", "quant_body_stats_triton"),
        },
    ),
    "orthonormalize_rows_": (
        orthonormalize_rows_reference,
        {
            "numba": (".numba_ops", "orthonormalize_rows_numba"),
            "triton": (".triton.orth", "orthonormalize_rows_triton"),
        },
    ),
}
for _op, (_reference, _kernels) in _OPS.items():
    for _backend, _impl in _kernels.items():
        register_kernel(_op, _backend, _impl, reference=_reference)


# -- argument checks ---------------------------------------------------------------------------


def _check_float(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {getattr(t, 'dtype', type(t))}")


def _check_residual(x: torch.Tensor, residual: torch.Tensor | None) -> None:
    if residual is not None:
        _check_float("residual", residual)
        if residual.numel() != x.numel():
            raise ValueError(f"residual has {residual.numel()} elements, x has {x.numel()}")


def _check_out(x: torch.Tensor, out: torch.Tensor | None, new_residual: bool | None) -> None:
    """``out`` for an error-feedback encoder of ``x``: see the module docstring."""
    if out is None:
        return
    if new_residual is False:
        raise ValueError("out= is where the new residual goes: it cannot be given with new_residual=False")
    acc = accum_dtype(x.dtype)
    if not isinstance(out, torch.Tensor) or out.dtype != acc:
        raise TypeError(f"out must be a {acc} tensor for {x.dtype} x, got {getattr(out, 'dtype', type(out))}")
    if out.numel() != x.numel() or not out.is_contiguous() or out.device != x.device:
        raise ValueError(
            f"out must be a contiguous tensor of x's {x.numel()} elements on {x.device}, "
            f"got {out.numel()} elements on {out.device} ({'' if out.is_contiguous() else 'not '}contiguous)"
        )


def _check_block(block) -> int | None:
    if block is not None and (isinstance(block, bool) or not isinstance(block, int) or block < 1):
        raise ValueError(f"block must be None or a positive integer, got {block!r}")
    return block


def _check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not (0 <= seed < 2**63):
        raise ValueError(f"seed must be an integer in [0, 2**63), got {seed!r}")
    return seed


def _check_levels(levels, bits) -> tuple[int, int]:
    """QSGD's ``levels`` and the code width (``bits=None``: :func:`qsgd_bits`)."""
    if isinstance(levels, bool) or not isinstance(levels, int) or levels < 1:
        raise ValueError(f"levels must be a positive integer, got {levels!r}")
    bits = qsgd_bits(levels) if bits is None else bits
    if bits not in (2, 4, 8) or 2 * levels + 1 > 1 << bits:
        raise ValueError(
            f"qsgd needs bits in (2, 4, 8) and 2 * levels + 1 <= 2**bits, got bits={bits}, levels={levels}"
        )
    return levels, bits


def _check_bounds(x: torch.Tensor, bounds: Sequence[int]) -> list[int]:
    """A segmented op's ``bounds``: non-decreasing offsets within flat ``x``, as ints."""
    bounds = [int(v) for v in bounds]
    if not bounds or bounds[0] < 0 or bounds[-1] > x.numel() or any(a > b for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"bounds must be non-decreasing offsets within x's {x.numel()} elements, got {bounds}")
    return bounds


def _run(op: str, like: torch.Tensor, *args, **kwargs):
    """Dispatch ``op`` for tensors like ``like``; a dtype no kernel loads (float64) takes the
    reference under every setting."""
    if like.dtype not in KERNEL_DTYPES:
        return _call_reference(op, like.device, f"{like.dtype} tensors use the reference", *args, **kwargs)
    return _call(op, like.device, *args, **kwargs)


# -- sparsification -----------------------------------------------------------------------------


def threshold_ef(
    x: torch.Tensor,
    tau: float,
    residual: torch.Tensor | None = None,
    *,
    new_residual: bool | None = None,
    out: torch.Tensor | None = None,
) -> ThresholdResult:
    """Fused threshold + error feedback over ``v = x.to(acc) + residual``.

    Selects ``v >= tau`` (sent as ``+tau``) and ``v <= -tau`` (``-tau``), counts
    them, takes ``max|v|``, and returns the new residual ``v - sent`` when a
    residual was given, ``new_residual=True`` or ``out`` (then written into ``out``,
    and ``result.residual is out``). The result's :meth:`bitmap` and :meth:`indices`
    give the two wire bodies; see :class:`ThresholdResult`. One pass over memory,
    plus a compaction pass over the bitmap for indices.
    """
    _check_float("x", x)
    _check_residual(x, residual)
    _check_out(x, out, new_residual)
    return _run("threshold_ef", x, x, float(tau), residual, new_residual=new_residual, out=out)


def decode_add_bitmap2(out: torch.Tensor, bodies: Sequence[torch.Tensor], taus: Sequence[float]) -> None:
    """``out += decode(bodies[p], taus[p])`` for every peer ``p``, in order, in one pass.

    ``out`` is flat; each body is a uint8 ``FMT_BITMAP2`` body of at least
    ``ceil(out.numel() / 4)`` bytes. The sum per element is taken in peer order, so
    every backend gives the reference's floats.
    """
    _check_float("out", out)
    bodies, taus = list(bodies), [float(t) for t in taus]
    if len(bodies) != len(taus):
        raise ValueError(f"{len(bodies)} bodies for {len(taus)} taus")
    need = (out.numel() + 3) // 4
    for i, b in enumerate(bodies):
        if b.dtype != torch.uint8:
            raise TypeError(f"bitmap body {i} must be uint8, got {b.dtype}")
        if b.numel() < need:
            raise ValueError(f"corrupt bitmap body {i}: {b.numel()} bytes hold fewer than n={out.numel()} 2-bit codes")
    if not bodies or out.numel() == 0:
        return
    _run("decode_add_bitmap2", out, out, bodies, taus)


def scatter_add_signed(out: torch.Tensor, words: torch.Tensor, tau: float) -> None:
    """``out[idx] += +-tau`` for one peer's ``FMT_SIGNED_INDEX`` words.

    Indices must be below ``out.numel()`` (callers validate frames) and distinct,
    as every encoder here writes them.
    """
    _check_float("out", out)
    if words.dtype != torch.int32:
        raise TypeError(f"index words must be int32, got {words.dtype}")
    if words.numel() == 0:
        return
    _run("scatter_add_signed", out, out, words.reshape(-1), float(tau))


def scatter_add_sparse(out: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor) -> None:
    """``out[idx] += vals`` for one peer's sparse (top-k) frame; distinct, in-range indices."""
    _check_float("out", out)
    _check_float("vals", vals)
    if idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"indices must be int32 or int64, got {idx.dtype}")
    if idx.numel() != vals.numel():
        raise ValueError(f"{idx.numel()} indices for {vals.numel()} values")
    if idx.numel() == 0:
        return
    _run("scatter_add_sparse", out, out, idx.reshape(-1), vals.reshape(-1))


def scatter_add_sparse_many(out: torch.Tensor, idxs: Sequence[torch.Tensor], vals: Sequence[torch.Tensor]) -> None:
    """:func:`scatter_add_sparse` of every peer's frame ``(idxs[j], vals[j])`` in order, each
    frame's indices distinct and in range: an element's sum takes its peers' values in that
    order, bit for bit as frame after frame (on CUDA one launch for all of them after a stable
    sort of their indices, where each frame took one)."""
    _check_float("out", out)
    idxs, vals = list(idxs), list(vals)
    if len(idxs) != len(vals):
        raise ValueError(f"{len(idxs)} index tensors for {len(vals)} value tensors")
    for i, v in zip(idxs, vals):
        _check_float("vals", v)
        if i.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"indices must be int32 or int64, got {i.dtype}")
        if i.numel() != v.numel():
            raise ValueError(f"{i.numel()} indices for {v.numel()} values")
    flat = lambda t: t if t.dim() == 1 else t.reshape(-1)  # noqa: E731 (no operation for a flat one)
    kept = [(flat(i), flat(v)) for i, v in zip(idxs, vals) if i.numel()]
    if kept:
        _run("scatter_add_sparse_many", out, out, [i for i, _ in kept], [v for _, v in kept])


def abs_select(v: torch.Tensor, thr, expected: int | None = None) -> torch.Tensor:
    """Ascending int64 indices of the elements of flat ``v`` with ``|v| >= thr``.

    ``thr`` is a number or a 0-d tensor (kept on the device: no host sync).
    ``expected`` is an optional guess at the count, used to size a buffer.
    """
    _check_float("v", v)
    return _run("abs_select", v, v.reshape(-1), thr, expected)


def sampled_topk(
    v: torch.Tensor, k: int, probe: torch.Tensor, *, approx: bool = False, route: list | None = None
) -> torch.Tensor:
    """DGC top-k: ascending int64 indices of large ``|v|``.

    ``approx=False``: at most ``k`` of them,
    :func:`~gradzip.kernels.reference.sampled_topk_reference` with the compaction
    (:func:`abs_select`) dispatched: the threshold estimate is ``torch.topk`` over
    the sample, the compaction one pass over ``v``, the trim a top-k over the
    survivors (about ``1.25 k`` of them).

    ``approx=True``: between ``(1 - APPROX_TOL) k`` and ``(1 + APPROX_TOL) k`` of them
    (:func:`approx_band`), without the exact trim:
    :func:`~gradzip.kernels.reference.sampled_topk_approx_reference`, both of its
    compactions dispatched. ``route`` (a list) receives the route it took.
    """
    _check_float("v", v)
    n = v.numel()
    if not (0 < k <= n):
        raise ValueError(f"k must be in [1, {n}], got {k}")
    if probe.numel() == 0:
        raise ValueError("probe must hold at least one index")
    if approx:
        return sampled_topk_approx_reference(v.reshape(-1), int(k), probe.to(v.device), select=abs_select, route=route)
    return sampled_topk_reference(v.reshape(-1), int(k), probe.to(v.device), select=abs_select)


# -- quantizers ---------------------------------------------------------------------------------


def sign_ef(
    x: torch.Tensor,
    residual: torch.Tensor | None = None,
    *,
    block: int | None = None,
    new_residual: bool | None = None,
    out: torch.Tensor | None = None,
):
    """Scaled sign + error feedback: ``(float32 scales, int32 sign words, residual or None)``.

    ``v = x.to(acc) + residual``; ``S_b = mean |v|`` per block (float64 sum, 0 where it
    exceeds float32's range); bit ``i`` of the words (``bitpack.pack_bits`` layout) is
    ``v_i < 0``; the new residual (as :func:`threshold_ef`: into ``out`` when given) is
    ``v - where(v < 0, -S_b, S_b)``. See :func:`~gradzip.kernels.quant.sign_ef_reference`.
    """
    _check_float("x", x)
    _check_residual(x, residual)
    _check_out(x, out, new_residual)
    return _run("sign_ef", x, x, residual, block=_check_block(block), new_residual=new_residual, out=out)


def sign_ef_segments(
    x: torch.Tensor, bounds: Sequence[int], *, residual: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, list[int]]:
    """SIGN1 frame bodies of the pieces ``[bounds[j], bounds[j+1])`` of a flat contiguous ``x``,
    each as :func:`sign_ef` writes it for the piece alone with one scale (``block=None``):
    ``S = mean |v|`` of the piece, then its sign words, in one uint8 buffer at the offsets
    returned (:func:`sign_segments_layout`). ``residual`` compensates ``x`` and ``out`` receives
    the new residual over the pieces' elements, as for :func:`sign_ef`: a tensor's ``TwoPhase``
    pieces and their error feedback in one call (on CUDA three launches for any number of
    pieces, Numba on the CPU). See :func:`~gradzip.kernels.quant.sign_ef_segments_reference`."""
    _check_float("x", x)
    if x.dim() != 1 or not x.is_contiguous():
        raise ValueError(f"x must be a flat contiguous tensor, got {tuple(x.shape)}")
    bounds = _check_bounds(x, bounds)
    _check_residual(x, residual)
    _check_out(x, out, None)
    return _run("sign_ef_segments", x, x, bounds, residual=residual, out=out)


def qsgd_encode(x: torch.Tensor, levels: int, seed: int, *, block: int | None = 64, bits: int | None = None):
    """QSGD encode with the draws ``philox_uniform(seed, n)``: ``(float32 norms, packed codes)``.
    See :func:`~gradzip.kernels.quant.qsgd_encode_reference`."""
    _check_float("x", x)
    levels, bits = _check_levels(levels, bits)
    return _run("qsgd_encode", x, x, levels, _check_seed(seed), block=_check_block(block), bits=bits)


def terngrad_encode(x: torch.Tensor, seed: int, *, block: int | None = None, clip: float | None = None):
    """TernGrad encode with the draws ``philox_uniform(seed, n)``: ``(float32 scales, 2-bit codes)``.
    See :func:`~gradzip.kernels.quant.terngrad_encode_reference`."""
    _check_float("x", x)
    if clip is not None and not (0 < float(clip) < float("inf")):
        raise ValueError(f"clip must be None or a finite positive number, got {clip!r}")
    clip = None if clip is None else float(clip)
    return _run("terngrad_encode", x, x, _check_seed(seed), block=_check_block(block), clip=clip)


def int8_encode(x: torch.Tensor, *, block: int | None = 1024, scales: torch.Tensor | None = None):
    """Block-wise absmax int8: ``(float32 scales, int8 codes)`` (``scales`` given: used as
    they are). A Numba kernel on the CPU, a Triton one on CUDA. See
    :func:`~gradzip.kernels.quant.int8_encode_reference`."""
    _check_float("x", x)
    block = _check_block(block)
    if scales is not None:
        nb, _ = quant_layout(x.numel(), block)
        if scales.numel() != nb:
            raise ValueError(f"{scales.numel()} scales for {nb} blocks")
    return _run("int8_encode", x, x, block=block, scales=scales)


def int8_encode_segments(
    x: torch.Tensor, bounds: Sequence[int], *, block: int | None = 1024, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, list[int]]:
    """Int8 frame bodies of the pieces ``[bounds[j], bounds[j+1])`` of a flat contiguous ``x``
    (float32, or float64 by the reference), each as :func:`int8_encode` writes it for the piece
    alone, in one uint8 buffer at the offsets returned (:func:`int8_segments_layout`); with
    ``residual`` (flat, contiguous, ``x``'s dtype and length; ``x`` itself allowed), ``residual =
    x - decode`` over the pieces in the same pass: a tensor's ``TwoPhase`` pieces and their
    error feedback in one call (on CUDA one launch, Numba on the CPU). See
    :func:`~gradzip.kernels.quant.int8_encode_segments_reference`."""
    _check_float("x", x)
    if x.dtype not in (torch.float32, torch.float64) or x.dim() != 1 or not x.is_contiguous():
        raise ValueError(f"x must be a flat contiguous float32 or float64 tensor, got {x.dtype} {tuple(x.shape)}")
    bounds = _check_bounds(x, bounds)
    block = _check_block(block)
    if residual is not None and (
        residual.dtype != x.dtype
        or residual.shape != x.shape
        or residual.device != x.device
        or not residual.is_contiguous()
    ):
        raise ValueError(f"residual must be flat and contiguous like x ({x.dtype} {tuple(x.shape)})")
    return _run("int8_encode_segments", x, x, bounds, block=block, residual=residual)


def int8_apply_(out: torch.Tensor, bodies: Sequence[torch.Tensor], *, block: int | None, subtract: bool = False):
    """``out += decode(body_p)`` (``subtract``: ``-=``) for every int8 frame body in order, ``out``
    a flat contiguous float32 or float64 tensor (Numba on the CPU; Triton for float32 on CUDA):
    :func:`~gradzip.kernels.quant.int8_apply_`."""
    if not isinstance(out, torch.Tensor) or out.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"out must be float32 or float64, got {getattr(out, 'dtype', type(out))}")
    bodies, _ = _check_bodies(bodies, out.numel(), "int8", block, 0, None)
    if not bodies or out.numel() == 0:
        return
    if out.dtype == torch.float64 and (out.device.type != "cpu" or _forced() not in (None, "numba")):
        why = "float64 tensors use the reference (Numba's CPU kernel aside)"
        _call_reference("int8_apply_", out.device, why, out, bodies, block=block, subtract=subtract)
        return
    _call("int8_apply_", out.device, out, bodies, block=block, subtract=subtract)


def _check_bodies(bodies, n: int, kind: str, block, levels: int, bits) -> tuple[list, int | None]:
    if kind not in QUANT_KINDS:
        raise ValueError(f"kind must be one of {list(QUANT_KINDS)}, got {kind!r}")
    if kind == "qsgd":
        levels, bits = _check_levels(levels, bits)
    bodies = list(bodies)
    nb, _ = quant_layout(n, _check_block(block))
    need = 4 * nb + quant_code_bytes(kind, n, bits)
    for i, b in enumerate(bodies):
        if b.dtype != torch.uint8:
            raise TypeError(f"body {i} must be uint8, got {b.dtype}")
        if b.numel() != need:
            raise ValueError(f"corrupt {kind} body {i}: {b.numel()} bytes, expected {need}")
    return bodies, bits


def decode_add_quant(
    out: torch.Tensor,
    bodies: Sequence[torch.Tensor],
    kind: str,
    *,
    block: int | None = None,
    levels: int = 0,
    bits: int | None = None,
) -> None:
    """``out += decode(bodies[p])`` for every peer in rank order, one pass, for quantizer
    frame bodies (``kind`` sign1, qsgd, tern2 or int8; ``nb`` float32 scales then the codes;
    see :mod:`gradzip.kernels.quant` for the values).

    ``out`` is float32 or float64 (the frames decode in its dtype), of any shape (element
    ``i`` in row-major order). Body lengths are checked here; code values are not (callers
    validate frames).
    """
    if not isinstance(out, torch.Tensor) or out.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"out must be float32 or float64, got {getattr(out, 'dtype', type(out))}")
    n = out.numel()
    bodies, bits = _check_bodies(bodies, n, kind, block, levels, bits)
    if not bodies or n == 0:
        return
    _run("decode_add_quant", out, out, bodies, kind, block=block, levels=int(levels), bits=bits)


def decode_add_quant_segments(
    out: torch.Tensor,
    bodies: Sequence[torch.Tensor],
    starts: Sequence[int],
    numels: Sequence[int],
    kind: str,
    *,
    block: int | None = None,
    levels: int = 0,
    bits: int | None = None,
) -> None:
    """``out[starts[s] : starts[s] + numels[s]] += decode(bodies[s])`` for every segment: one
    quantizer frame per range of a flat contiguous float32 or float64 ``out``, the ranges
    disjoint (TwoPhase's owners' pieces of a call), in one call (on CUDA, one launch). Body
    lengths and the ranges are checked here; code values are not (callers validate frames)."""
    if not isinstance(out, torch.Tensor) or out.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"out must be float32 or float64, got {getattr(out, 'dtype', type(out))}")
    if out.dim() != 1 or not out.is_contiguous():
        raise ValueError("out must be flat and contiguous")
    bodies, starts, numels = list(bodies), [int(v) for v in starts], [int(v) for v in numels]
    if not (len(bodies) == len(starts) == len(numels)):
        raise ValueError(f"{len(bodies)} bodies, {len(starts)} starts and {len(numels)} numels")
    end = 0
    for st, n in sorted(zip(starts, numels)):
        if st < end or n < 0 or st + n > out.numel():
            raise ValueError(f"segment [{st}, {st + n}) overlaps another or leaves out's {out.numel()} elements")
        end = st + n
    _, bits = _check_bodies([], 0, kind, block, levels, bits)  # the kind, levels and code width
    for body, n in zip(bodies, numels):
        _check_bodies([body], n, kind, block, levels, bits)
    if bodies:
        kw = {"block": block, "levels": int(levels), "bits": bits}
        _run("decode_add_quant_segments", out, out, bodies, starts, numels, kind, **kw)


def decode_quant(
    body: torch.Tensor,
    n: int,
    kind: str,
    *,
    dtype: torch.dtype,
    block: int | None = None,
    levels: int = 0,
    bits: int | None = None,
) -> torch.Tensor:
    """One frame body decoded to a flat tensor of ``n`` elements of ``dtype``, computed in
    its accumulation dtype: :func:`decode_add_quant` into ``-0.0`` (the additive identity,
    so every value, signed zeros included, is the decoded one), then cast."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be a non-negative integer, got {n!r}")
    out = torch.full((n,), -0.0, dtype=accum_dtype(dtype), device=body.device)
    decode_add_quant(out, [body], kind, block=block, levels=levels, bits=bits)
    return out.to(dtype)


def quant_body_stats(whole: torch.Tensor, frames, kind: str, *, bits: int | None = None) -> torch.Tensor:
    """What the frame checks read from quantizer frame bodies in ``whole`` (uint8): ``frames``
    gives each body's ``(offset, number of block scales, elements)``, in order, apart or back
    to back (the bytes between bodies are not read). Returns an int64 tensor ``[negative,
    top]`` on ``whole``'s device: ``negative`` 1 where a block scale is below zero, ``top``
    the largest code (Int8: 1 where a code byte is -128; sign frames: 0), the padding bits of
    each frame's last byte left out. One pass, no host sync: the caller reads the two
    numbers. ``bits``: QSGD's code width (2, 4 or 8); the other kinds know theirs.
    """
    if kind not in QUANT_KINDS:
        raise ValueError(f"kind must be one of {list(QUANT_KINDS)}, got {kind!r}")
    bits = {"sign1": 1, "tern2": 2, "int8": 8}.get(kind, bits)
    if kind == "qsgd" and bits not in (2, 4, 8):
        raise ValueError(f"qsgd bodies need bits in (2, 4, 8), got {bits!r}")
    if not isinstance(whole, torch.Tensor) or whole.dtype != torch.uint8 or whole.dim() != 1:
        raise TypeError(f"whole must be a flat uint8 tensor, got {getattr(whole, 'dtype', type(whole))}")
    frames = tuple((int(o), int(nb), int(n)) for o, nb, n in frames)
    end = 0
    for o, nb, n in frames:
        if nb < 0 or n < 0 or o < end:
            raise ValueError(f"frames must lie in order without overlap, with counts >= 0: got {(o, nb, n)}")
        end = o + 4 * nb + quant_code_bytes(kind, n, bits)
        if end > whole.numel():
            raise ValueError(f"the frame at offset {o} ends at byte {end}, past whole's {whole.numel()}")
    if not whole.is_contiguous():
        whole = whole.contiguous()
    return _call("quant_body_stats", whole.device, whole, frames, kind, bits)


# -- bit packing ---------------------------------------------------------------------------------


def pack_uint(values: torch.Tensor, bits: int) -> torch.Tensor:
    """:func:`gradzip.kernels.bitpack.pack_uint` (non-negative integers below ``2**bits`` as a bit
    stream; 2-D ``values``: a stream a row), dispatched: on CUDA one Triton launch
    (``kernels/triton/bits.py``), on the CPU ``bitpack``'s numpy route."""
    bitpack.check_uint_bits(bits)
    v = values.to(torch.int64)
    if v.dim() != 2:
        v = v.reshape(-1)
    return _call("pack_uint", v.device, v, bits)


def unpack_uint(packed: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """:func:`gradzip.kernels.bitpack.unpack_uint` (``n`` int64 values of ``bits`` bits; 2-D
    ``packed``: a stream a row), dispatched as :func:`pack_uint` is."""
    bitpack.check_unpack(packed, n, bits)
    p = packed if packed.dim() == 2 else packed.reshape(-1)
    if not n:
        return torch.zeros(*p.shape[:-1], 0, dtype=torch.int64, device=p.device)
    return _call("unpack_uint", p.device, p, n, bits)


# -- low rank ------------------------------------------------------------------------------------


def orthonormalize_rows_(buf: torch.Tensor, table, eps: float = 0.0) -> torch.Tensor:
    """Orthonormalize, in place, the rows of every matrix of ``table`` in ``buf``; returns ``buf``.

    ``buf``: a flat contiguous float32 or float64 tensor (float64: the reference). ``table``:
    rows ``(offset, k, n)`` (a sequence, or an int tensor of shape ``(M, 3)``), matrix ``j``
    being the row-major ``k x n`` block at ``buf[offset:offset + k * n]``, ``1 <= k <= n``,
    none overlapping. Modified Gram-Schmidt with float64 sums in a fixed order, twice when
    ``k > 2``; ``eps`` (``>= 0``) is added to each norm, and with ``eps == 0`` a zero row stays
    zero. Each matrix's result depends on it alone, bit for bit on every backend
    (:mod:`gradzip.kernels.orth`). One kernel call for all the matrices.
    """
    _check_float("buf", buf)
    if buf.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"buf must be float32 or float64, got {buf.dtype}")
    if buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError(f"buf must be a flat contiguous tensor, got shape {tuple(buf.shape)}")
    eps = float(eps)
    if not eps >= 0.0 or eps == float("inf"):
        raise ValueError(f"eps must be a finite number >= 0, got {eps!r}")
    rows = orth_table(buf, table)
    if rows:
        _run("orthonormalize_rows_", buf, buf, rows, eps)
    return buf
