"""PowerSGD: rank-r gradient compression by one step of power iteration (Vogels et al., 2019).

Per tensor, with ``M`` the compensated gradient (gradient plus residual) viewed as
an ``n x m`` matrix (``n = shape[0]``, ``m = numel / n``), ``k = min(n, m, rank)``
and ``W`` ranks, one step is::

    Q      <- orth(Q_prev)              warm start: last step's averaged Q (m x k);
                                        a fresh seeded draw on the first step
    P_w     = M_w Q                     local, n x k
    P       = orth(sum_w P_w)           round 1: allreduce of every P of the call
    Q_w     = M_w^T P                   local, m x k
    Q       = (1/W) sum_w Q_w           round 2: allreduce of every Q of the call
    M_hat   = P Q^T                     = P P^T mean_w(M_w), the same on every rank
    r_w     = M_w - M_hat               error feedback (call.commit)

``orth`` orthonormalizes columns in float32 (float64 for float64 gradients),
whatever the gradients' dtype, by modified Gram-Schmidt with float64 sums,
``col <- col / (||col|| + eps)`` (a zero column stays zero when ``eps == 0``),
run twice for ``k > 2``: :func:`gradzip.kernels.orthonormalize_rows_`, which takes every
``P`` (or every ``Q``) of a call in one kernel call (Numba on CPU, a Triton program per
matrix on GPUs; torch ops made some twenty launches a column, batched by shape).

Batching: matrices of the same ``(n, m, k)`` sit side by side in the wire buffers.
On GPUs their products are one ``bmm`` over a stack of the ``M``'s (fewer kernel
launches); on CPU one ``mm`` per matrix, because MKL loops over a batch anyway and the
stack would be one more copy of the gradients. On CPU the memory-bound passes are also fused in blocks of rows (about
1 MiB, :func:`_block_rows`): each block of ``M`` is compensated (``g + r``) and
multiplied into ``P^T`` while in cache, and each block of ``M_hat`` is written and
subtracted from ``M`` for the residual while in cache (``Call.x_rows``,
``_decode_rows``); the values are those of the unfused passes up to the
blocking of the products.

A tensor's result must not depend on which tensors share its call: DDP rebuilds its
buckets, so a resumed run can group them differently from the unbroken one (tested on
CPU, bit for bit). The wire buffers hold each matrix's ``P^T`` and ``Q^T`` at offsets
set by the other tensors of the call, and on CPU the last bits of MKL's products
depend on the alignment of their operands and output. So every matrix's ``P^T`` and
``Q^T`` are computed, orthonormalized and decoded in one buffer per call in which each
starts 64-byte aligned (:func:`_slab`), and only copied to and from the wire buffers;
``M`` is copied to 64-byte alignment for a matrix-vector
product (``k = 1``) where it is not aligned, and ``P Q^T`` for ``k > 4`` (a gemm) goes
through an aligned buffer where its place in the output is not aligned. The copies
are of ``P`` and ``Q`` only (``(n + m) k`` elements per matrix). The orthonormalization
of a matrix depends on it alone (not on the others of the call, its place, the number of
threads or the device: :mod:`gradzip.kernels.orth`). On GPUs the matrices
of a shape stay stacked (:func:`_stacked`): one ``bmm`` a shape for ``P^T``, ``Q^T`` and
``M_hat``, and the compensations, the copies to and from the wire buffers and the output, and
the residuals, each one ``torch._foreach_*`` operation over the call (``Call.xs``,
``Call.commit_many``), where each would be an operation a tensor: ResNet-50's 161 tensors at
8 ranks issue 950 ATen operations a step instead of 2,757 (``benchmarks/dryrun_profile.py
--gpu-branches``, docs/kernels.md). Bit-exact resumption there relies on cuBLAS giving the
same bits for a matrix alone and in a batch (not tested here: no GPU); the stacked path is
tested on CPU against the matrix-by-matrix one (to rounding).

Unused parameters (``Call.frozen``: DDP with ``find_unused_parameters=True``): such a
tensor is sent as zeros, but ``M_hat`` is one shared result rather than the sum of what
each rank sent, so its residual is charged with it (``Call.charge``: ``r - M_hat``, what
``M_w - M_hat`` is with a zero gradient), which keeps ``W * M_hat + sum_w r_w`` equal to
what the ranks put in when other ranks used the tensor; where no rank did, ``M_hat`` is
exactly zero (``P`` is) and the residual is left as it is.

A tensor is compressed only if it has at least 2 dimensions and
``(n + m) * k * min_compression_rate < n * m``; the others (biases, small or
nearly square-thin matrices) are averaged exactly, riding in round 1's buffer
pre-divided by ``W``. Their residual is zero. So a call costs two allreduces
(one when nothing in it is compressed), the engine's non-finite flag riding in
the first; all are issued from the hook thread in call order
(:mod:`gradzip.comm`), so any number of DDP buckets is safe.

Wire: everything travels in float32 (float64 for float64 gradients). Round 1 is
``[uncompressed / W | P^T's | Accordion norms | flag]``, round 2 the ``Q^T``'s (each
``k x n`` / ``k x m``, row-major). ``flag`` is the engine's non-finite flag (1.0 or 0.0,
summed; :meth:`~gradzip.protocols.base.Call.take_flag`), there when the engine asks for
it, so a call is two allreduces in all. With ``factors="bf16"`` the ``P^T``'s and ``Q^T``'s
travel in bfloat16 (half the bytes): round 1 is then two allreduces, the float32
``[uncompressed / W | Accordion norms | flag]`` (when not empty) and the bfloat16 ``P^T``'s.
Every rank receives the same rounded sums and computes ``M_hat`` and its residual
``M - M_hat`` from them, so error feedback keeps what the rounding drops.
The products are computed as ``P^T = Q^T M^T`` and ``Q^T = P^T M``: on CPU (MKL) these
run several times faster than ``M Q`` and ``M^T P`` for ``k >= 2`` (about 60x for ``M^T P`` at 1024 x 1024).

Initial Q: ``randn(m, k)`` from a CPU generator seeded with
``tensor_seed(seed, step, name)``: the same on every rank and independent of how
tensors are grouped into buckets. A Q column that comes back all zero (a
gradient that was exactly zero) or non-finite is replaced next step by that column of
a step-independent draw, ``randn(m, k)`` seeded with ``tensor_seed(seed, -1, name)``;
otherwise warm start would keep that layer's ``M_hat`` at zero for good. On the CPU the
columns are tested on the host and the draw made where one is bad; on the GPU's side every
column is chosen on the device by ``torch.where`` from the draw, made once per tensor and
kept: the same floats, no host read. (After a non-finite step the engine also restores
every stored Q and residual.)

Accordion (Agarwal et al., 2021), when ``accordion_rank`` is set: every tensor
that is compressible at ``rank`` adds ``||g_w||^2 / W`` (its raw local gradient)
to round 1, so every rank sees ``s_t = mean_w ||g_w,t||^2``. Every
``accordion_interval`` steps ``N = sqrt(mean_t s_t)`` over the interval; with
``N_prev`` the previous interval's value, the tensor uses ``accordion_rank``
(low compression) for the next interval if ``|N - N_prev| >= accordion_eta *
N_prev`` (a critical regime), else ``rank``. Tensors start at
``accordion_rank`` (no ``N_prev`` yet). A switch truncates Q (high to low) or
appends fresh seeded columns (low to high).
"""

from __future__ import annotations

import math

import torch

import gradzip.args as args
import gradzip.kernels as K
import gradzip.warmup as warmup

from ..codecs.base import TensorContext, tensor_seed
from ..comm import Round
from ..wire import accum_dtype, itemsize, narrow
from .base import Protocol

__all__ = ["PowerSGD"]

#: Bytes: on CPU every matrix's P^T and Q^T start at such a boundary (MKL's products depend
#: on the alignment of their operands).
ALIGN = 64


def _low_rank_product(pt: torch.Tensor, qt: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = P Q^T`` from ``P^T`` (k x n) and ``Q^T`` (k x m).

    On CPU with ``k <= 4`` as ``k`` broadcast outer products (a memory-bound pass
    each, 2-4x faster than MKL's gemm at such small inner dimension); else ``mm``.
    """
    k = pt.shape[0]
    if K.gpu_side(out.device) or k > 4:
        return torch.mm(pt.t(), qt, out=out)
    torch.mul(pt[0].unsqueeze(1), qt[0].unsqueeze(0), out=out)
    for c in range(1, k):
        out.addcmul_(pt[c].unsqueeze(1), qt[c].unsqueeze(0))
    return out


def _direct(dst: torch.Tensor, k: int) -> bool:
    """Whether ``P Q^T`` may be written straight into ``dst`` (the call's output, at an offset
    set by the other tensors): on CPU with ``k > 4`` it is a gemm, whose last bits depend on
    the output's alignment, so it goes through an aligned buffer unless ``dst`` is aligned.
    The outer products of ``k <= 4`` are elementwise: the same bits at any address."""
    return K.gpu_side(dst.device) or k <= 4 or dst.data_ptr() % ALIGN == 0


def _stacked(call) -> bool:
    """Whether a call's matrices of one shape run stacked (:func:`_matrices`): one ``bmm`` a
    shape for each product, ``M_hat`` included, and the decode's copies and residuals by
    ``torch._foreach_*`` over them all. On GPUs, where every operation is a launch. On CPU
    they run matrix by matrix (MKL's bits depend on alignment), block by block where
    :func:`_fusable`."""
    return K.gpu_side(call.device)


def _matrices(call, idx: list, n: int, m: int, k: int, wd):
    """The group's compensated matrices: a ``(B, n, m)`` stack where :func:`_stacked`, else a
    list of ``(n, m)``."""
    xs = call.xs(idx)
    if _stacked(call):
        if len({x.shape for x in xs}) > 1:  # one matrix shape, several tensor shapes
            xs = [x.reshape(n, m) for x in xs]
        return torch.stack(xs).view(len(idx), n, m).to(wd)
    mats = [x.reshape(n, m).to(wd) for x in xs]
    if k == 1:  # MKL's matrix-vector product depends on the alignment of M
        mats = [a if a.data_ptr() % 64 == 0 else a.clone() for a in mats]
    return mats


def _block_rows(m: int, elsize: int) -> int:
    """Rows per block of the fused CPU passes: about 1 MiB (cache-resident between the two
    operations on it), a multiple of 16 rows so that every block starts 64-byte aligned
    where the matrix does (MKL's products depend on alignment)."""
    return max(16, ((1 << 20) // max(m * elsize, 1)) // 16 * 16)


def _fusable(call, idx: list, k: int, wd) -> bool:
    """Fused CPU passes for a group: compensation and ``P^T = Q^T M^T`` block by block, and
    ``M_hat`` with the residual block by block. Needs the compensated matrices in ``wd``
    (no cast), and for ``k = 1`` 64-byte aligned ones (MKL's matrix-vector products)."""
    if _stacked(call):
        return False
    for i in idx:
        t = call.tensors[i]
        if (accum_dtype(t.dtype) if call.feeds(i) else t.dtype) != wd:
            return False
        if k == 1 and not call.feeds(i) and t.data_ptr() % 64:
            return False
    return True


def _decode_rows(
    call, i: int, x: torch.Tensor, pt: torch.Tensor, qt: torch.Tensor, dst: torch.Tensor, rows: int
) -> None:
    """``dst = P Q^T`` and, with error feedback, the residual ``x - P Q^T`` written over
    ``x`` (the compensated input, which is the residual's buffer), ``rows`` rows at a
    time: each block of ``M_hat`` is still in cache when it is subtracted. The same
    floats as the unfused product and ``Call.commit``."""
    n, m = dst.shape
    keep = call.feeds(i)
    tmp = (
        None if dst.dtype == x.dtype and _direct(dst, pt.shape[0]) else _slots(1, min(rows, n), m, x.dtype, x.device)[0]
    )
    for s in range(0, n, rows):
        e = min(s + rows, n)
        mh = dst[s:e] if tmp is None else tmp[: e - s]
        _low_rank_product(pt[:, s:e], qt, mh)
        if tmp is not None:
            dst[s:e].copy_(narrow(mh, dst.dtype))
        if keep:
            x[s:e].sub_(mh)
    if keep:
        call.set_residual(i, x.view(call.tensors[i].shape))


def _matmul(a: torch.Tensor, mats, out: torch.Tensor, *, transpose_m: bool) -> None:
    """``out[j] = a[j] @ M_j`` (or ``M_j^T``): one ``bmm`` on a stack, one ``mm`` per matrix on CPU."""
    if isinstance(mats, torch.Tensor):
        torch.bmm(a, mats.transpose(1, 2) if transpose_m else mats, out=out)
        return
    for j, mj in enumerate(mats):
        torch.mm(a[j], mj.t() if transpose_m else mj, out=out[j])


def _views(buf: torch.Tensor, start: int, shapes: list) -> list:
    """Consecutive views of ``buf`` from element ``start``, one of each shape in ``shapes``."""
    sizes = [math.prod(s) for s in shapes]
    return [p.view(s) for p, s in zip(buf[start : start + sum(sizes)].split(sizes), shapes)]


def _slab(shapes: list, dtype, device) -> tuple[torch.Tensor, list, list]:
    """Storage for groups of matrices, ``shapes`` a list of ``(count, k, n)``: one flat buffer,
    a ``(count, k, n)`` view of it per group, and the ``(offset, k, n)`` row of every matrix
    for :func:`gradzip.kernels.orthonormalize_rows_`. Every matrix starts 64-byte aligned
    (matrices padded apart where their size is not a multiple of it), so on CPU a matrix's
    products (MKL's last bits depend on the alignment of their operands) do not depend on how
    many others share the call or where they lie; its orthonormalization depends on it alone
    anyway."""
    el = itemsize(dtype)
    per = ALIGN // el
    strides = [-(-(k * n) // per) * per for _c, k, n in shapes]
    buf = torch.empty(sum(c * s for (c, _k, _n), s in zip(shapes, strides)) + per, dtype=dtype, device=device)
    pos = (-(buf.data_ptr() // el)) % per  # the first aligned element
    views, table = [], []
    for (c, k, n), stride in zip(shapes, strides):
        views.append(buf.as_strided((c, k, n), (stride, n, 1), pos))
        table.extend((pos + j * stride, k, n) for j in range(c))
        pos += c * stride
    return buf, views, table


def _slots(count: int, k: int, n: int, dtype, device) -> torch.Tensor:
    """A ``(count, k, n)`` tensor in which every ``(k, n)`` matrix starts 64-byte aligned (:func:`_slab`)."""
    return _slab([(count, k, n)], dtype, device)[1][0]


_BF16_MAX = float(torch.finfo(torch.bfloat16).max)


def _check_bf16_range(factors: list, which: str) -> None:
    """``factors="bf16"`` with float64 gradients: a finite factor beyond bfloat16's range
    (float32's exponent range) would travel as an infinity and the step would be reported
    non-finite. Refuse it, as Threshold and TopK(values="sign") refuse float64 values beyond
    float32's range (one host sync)."""
    if not factors:
        return
    tops = torch.stack([f.abs().amax() if f.numel() else f.new_zeros(()) for f in factors])
    finite = tops[torch.isfinite(tops)]
    top = float(finite.max()) if finite.numel() else 0.0
    if top > _BF16_MAX:
        raise ValueError(
            f"PowerSGD(factors='bf16') sends its factors in bfloat16, which has float32's range (up to "
            f"{_BF16_MAX:.3g}); a {which} factor of magnitude {top:.3g} from float64 gradients beyond float32's "
            "range cannot be sent: scale the gradient, or use factors=None (float64 factors)"
        )


def _matrix_shape(shape) -> tuple[int, int]:
    n = int(shape[0])
    return n, (math.prod(shape[1:]) if n else 0)


class PowerSGD(Protocol):
    """Rank-``rank`` PowerSGD with error feedback (on by default) and warm start.

    Args:
        rank: the approximation rank ``r`` (each tensor uses ``min(n, m, r)``).
        min_compression_rate: compress an ``n x m`` matrix only if
            ``(n + m) * k * min_compression_rate < n * m``; torch's default is 2.
        warm_start: reuse last step's averaged Q (else a fresh seeded Q each step).
        seed: seeds the initial (and redrawn) Q, identically on every rank.
        eps: added to column norms in Gram-Schmidt (torch's ``orthogonalization_epsilon``).
        accordion_rank: a rank ``> rank`` to switch to in critical regimes (Accordion);
            ``None`` (default) keeps ``rank`` throughout.
        accordion_interval: steps per Accordion decision.
        accordion_eta: relative change of the gradient norm that marks a critical regime.
        factors: ``None`` (the factors travel in float32) or ``"bf16"`` (in bfloat16: half
            the bytes; the rounding stays in the residual).

    The equations, wire layout and state are in the module docstring. Per-tensor
    state (``ctx.store``): ``"q"`` (the averaged Q, an ``m x k`` float tensor) and,
    with Accordion, ``"rank"``, ``"acc_sq"``, ``"acc_steps"``, ``"prev_norm"``.
    """

    def __init__(
        self,
        rank: int = 1,
        *,
        min_compression_rate: float = 2.0,
        warm_start: bool = True,
        seed: int = 0,
        eps: float = 0.0,
        accordion_rank: int | None = None,
        accordion_interval: int = 100,
        accordion_eta: float = 0.5,
        factors: str | None = None,
    ) -> None:
        self.rank = warmup.check(args.integer, "rank", rank, 1, integer=True)
        self.min_compression_rate = args.number("min_compression_rate", min_compression_rate, 0.0, lo_open=True)
        self.warm_start = args.flag("warm_start", warm_start)
        self.seed = args.integer("seed", seed)
        self.eps = args.number("eps", eps, 0.0)
        if isinstance(self.rank, warmup.Ramp) and accordion_rank is not None:
            raise ValueError("accordion_rank needs a fixed rank, not a schedule")
        self.accordion_rank = args.optional(
            args.integer,
            "accordion_rank",
            accordion_rank,
            None if isinstance(self.rank, warmup.Ramp) else self.rank + 1,
        )
        self.accordion_interval = args.integer("accordion_interval", accordion_interval, 1)
        self.accordion_eta = args.number("accordion_eta", accordion_eta, 0.0, lo_open=True)
        self.factors = None if factors is None else args.choice("factors", factors, ("bf16",))

    # -- planning ------------------------------------------------------------------------
    def compressed_rank(self, shape, rank: int | None = None) -> int:
        """The rank a tensor of ``shape`` is compressed at, or 0 if it travels uncompressed."""
        if len(shape) < 2:
            return 0
        n, m = _matrix_shape(shape)
        k = min(n, m, self.rank_at(0) if rank is None else rank)
        if k == 0:
            return 0
        return k if (n + m) * k * self.min_compression_rate < n * m else 0

    def rank_at(self, step: int) -> int:
        """The rank at ``step`` (a rank schedule is rounded to an integer, at least 1)."""
        return max(1, round(warmup.at(self.rank, step)))

    def current_rank(self, ctx: TensorContext) -> int:
        """The configured rank for this tensor now (Accordion's choice when it is on)."""
        if self.accordion_rank is None:
            return self.rank_at(ctx.step)
        return int(ctx.store.get("rank", self.accordion_rank))

    # -- Q ---------------------------------------------------------------------------------
    def _draw(self, ctx: TensorContext, m: int, k: int, step: int | None = None) -> torch.Tensor:
        seed = tensor_seed(self.seed, ctx.step if step is None else step, ctx.name)
        return torch.randn(m, k, generator=torch.Generator(device="cpu").manual_seed(seed), dtype=torch.float32)

    def _redraws(self, call, idx, m: int, k: int, wd, dev) -> torch.Tensor:
        """``(B, k, m)``: the step-independent draws (``step=-1``) that replace bad columns of
        the matrices ``idx``' ``Q^T``, made once per (names, shape, device) and kept."""
        cache = self.__dict__.setdefault("_fresh", {})
        key = (tuple(call.names[i] for i in idx), m, k, str(dev), wd)
        got = cache.get(key)
        if got is None:
            host = torch.stack([self._draw(call.contexts[i], m, k, step=-1).t() for i in idx]).to(wd)
            got = K.host_to_device(host.contiguous(), dev)
            if len(cache) >= 4096:
                cache.clear()
            cache[key] = got
        return got

    def _start_qs(self, call, groups: list, wd, dev) -> list:
        """Per group, the orthonormal ``Q^T`` of each matrix (``(B, k, m)`` views of one
        :func:`_slab`) that ``P^T = Q^T M^T`` starts from.

        Warm start: last step's averaged Q (truncated, or extended with fresh seeded
        columns, when Accordion changed the rank). Columns that are all zero or not
        finite are replaced from the step-independent draw (module docstring): on the CPU
        after one host read per call, on the GPU's side by ``torch.where`` with none. Then
        every matrix of the call is orthonormalized by one kernel call.
        """
        buf, qts, table = _slab([(len(idx), k, m) for (_n, m, k), idx in groups], wd, dev)
        starts, dsts = [], []
        for ((_n, m, k), idx), qt in zip(groups, qts):
            for i in idx:
                ctx = call.contexts[i]
                q = ctx.store.get("q") if self.warm_start else None
                if not isinstance(q, torch.Tensor) or q.dim() != 2 or q.shape[0] != m:
                    q = self._draw(ctx, m, k)
                elif q.shape[1] > k:
                    q = q[:, :k]
                elif q.shape[1] < k:
                    q = torch.cat([q.to(torch.float32).cpu(), self._draw(ctx, m, k)[:, q.shape[1] :]], dim=1)
                starts.append(q.t() if q.device == dev else q.t().to(dev))  # (a drawn Q is on the CPU)
            dsts.extend(qt.unbind(0))
        if dsts:
            torch._foreach_copy_(dsts, starts)  # a copy: the stored Q is never changed in place
        if qts and K.gpu_side(dev):  # every column chosen on the device
            for ((_n, m, k), idx), qt in zip(groups, qts):
                cn = torch.linalg.vector_norm(qt, dim=2, keepdim=True)
                torch.where((cn > 0) & cn.isfinite(), qt, self._redraws(call, idx, m, k, wd, dev), out=qt)
        elif qts:
            norms = torch.cat([torch.linalg.vector_norm(qt, dim=2).reshape(-1) for qt in qts])  # column norms
            if not bool(((norms > 0) & norms.isfinite()).all()):
                for ((_n, m, k), idx), qt in zip(groups, qts):
                    cn = torch.linalg.vector_norm(qt, dim=2)
                    bad = ~((cn > 0) & cn.isfinite())
                    for j, i in enumerate(idx):
                        if bool(bad[j].any()):
                            fresh = self._draw(call.contexts[i], m, k, step=-1).t().to(device=dev, dtype=wd)
                            qt[j].copy_(torch.where(bad[j].unsqueeze(1), fresh, qt[j]))
        K.orthonormalize_rows_(buf, table, self.eps)
        return qts

    # -- Accordion -------------------------------------------------------------------------
    def _accordion_update(self, ctx: TensorContext, mean_sq: float) -> None:
        st = ctx.store
        st["acc_sq"] = float(st.get("acc_sq", 0.0)) + mean_sq
        st["acc_steps"] = int(st.get("acc_steps", 0)) + 1
        if st["acc_steps"] < self.accordion_interval:
            return
        norm = math.sqrt(st["acc_sq"] / st["acc_steps"])
        prev = st.get("prev_norm")
        if prev is not None:
            critical = prev <= 0.0 or not math.isfinite(norm) or abs(norm - prev) >= self.accordion_eta * prev
            st["rank"] = self.accordion_rank if critical else self.rank
        st["prev_norm"] = norm
        st["acc_sq"] = 0.0
        st["acc_steps"] = 0

    # -- the exchange ----------------------------------------------------------------------
    def exchange(self, call):
        world = call.world_size
        dev = call.device
        wd = torch.float64 if any(t.dtype == torch.float64 for t in call.tensors) else torch.float32
        with call.codec():
            unc, groups, track = [], {}, []
            for i, t in enumerate(call.tensors):
                k = self.compressed_rank(t.shape, self.current_rank(call.contexts[i]))
                if k:
                    groups.setdefault((*_matrix_shape(t.shape), k), []).append(i)
                else:
                    unc.append(i)
                if self.accordion_rank is not None and self.compressed_rank(t.shape):
                    track.append(i)
            groups = list(groups.items())
            n_unc = sum(call.tensors[i].numel() for i in unc)
            n_p = sum(len(idx) * n * k for (n, m, k), idx in groups)
            fdt = torch.bfloat16 if self.factors == "bf16" else wd  # the factors' wire dtype
            nflag = 1 if call.wants_flag else 0  # the engine's non-finite flag rides last
            if fdt == wd:  # one buffer: [uncompressed | P^T's | norms | flag]
                flat = torch.empty(n_unc + n_p + len(track) + nflag, dtype=wd, device=dev)
                pflat, p0, tail = flat, n_unc, n_unc + n_p
            else:  # [uncompressed | norms | flag] in wd, the P^T's in their own buffer
                flat = torch.empty(n_unc + len(track) + nflag, dtype=wd, device=dev)
                pflat, p0, tail = torch.empty(n_p, dtype=fdt, device=dev), 0, n_unc
            upieces = list(flat[:n_unc].split([call.tensors[i].numel() for i in unc])) if unc else []
            if unc:
                xs = call.xs(unc)
                torch._foreach_copy_(upieces, [x if x.dim() == 1 else x.reshape(-1) for x in xs])
                call.commit_many(unc, xs)  # sent whole: residual zero
                flat[:n_unc].div_(world)
            # P^T and Q^T of every matrix are computed in storage of their own (_slots) and
            # copied to and from the wire buffers, whose offsets depend on the other tensors.
            work = []  # per group: (idx, M, P^T, Q^T, rows of a fused block or 0)
            pbuf, pts, ptable = _slab([(len(idx), k, n) for (n, m, k), idx in groups], wd, dev)
            if _stacked(call):  # every matrix's compensation at once (on CPU, block by block below)
                call.xs([i for _, idx in groups for i in idx])
            for ((n, m, k), idx), qtb, pt in zip(groups, self._start_qs(call, groups, wd, dev), pts):
                rows = _block_rows(m, flat.element_size()) if _fusable(call, idx, k, wd) else 0
                if rows:  # P^T = Q^T M^T, each block of M's rows as soon as it is compensated
                    mats = [
                        call.x_rows(i, rows, lambda s, e, blk, q=qtb[j], p=pt[j]: torch.mm(q, blk.t(), out=p[:, s:e]))
                        for j, i in enumerate(idx)
                    ]
                else:
                    mats = _matrices(call, idx, n, m, k, wd)
                    _matmul(qtb, mats, pt, transpose_m=True)  # P^T = Q^T M^T
                work.append((idx, mats, pt, qtb, rows))
            if work:
                torch._foreach_copy_(_views(pflat, p0, [w[2].shape for w in work]), [w[2] for w in work])
            if fdt != wd and wd == torch.float64:
                _check_bf16_range([w[2] for w in work], "P")
            if track:
                sq = torch.stack([torch.linalg.vector_norm(call.tensors[i], dtype=wd) ** 2 for i in track])
                flat[tail : tail + len(track)].copy_(sq.div_(world))
            bufs = [flat] if pflat is flat else ([b for b in (flat, pflat) if b.numel()] or [flat])
            fbytes = nflag * flat.element_size()  # the flag is control, as the engine's own would be
            call.comm.stats.add(
                bytes_payload=sum(b.numel() * b.element_size() for b in bufs) - fbytes, bytes_control=fbytes
            )
        if nflag:  # after every tensor's compensation: the flag reads them
            flat[-1] = call.take_flag(flat[-1:])
        yield Round([call.comm.allreduce(b) for b in bufs], last=not work)

        with call.codec():
            if track:
                for i, v in zip(track, flat[tail : tail + len(track)].tolist()):
                    self._accordion_update(call.contexts[i], v)
            if work:
                qflat = torch.empty(sum(len(idx) * k * m for (n, m, k), idx in groups), dtype=fdt, device=dev)
                pts, qts = [w[2] for w in work], [w[3] for w in work]
                torch._foreach_copy_(pts, _views(pflat, p0, [p.shape for p in pts]))  # sum_w P_w^T
                K.orthonormalize_rows_(pbuf, ptable, self.eps)  # the columns of every P
                for _, mats, pt, qt, _ in work:
                    _matmul(pt, mats, qt, transpose_m=False)  # Q^T = P^T M (over the start Q^T)
                torch._foreach_copy_(_views(qflat, 0, [q.shape for q in qts]), qts)
                if fdt != wd and wd == torch.float64:
                    _check_bf16_range([w[3] for w in work], "Q")
                call.comm.stats.add(bytes_payload=qflat.numel() * qflat.element_size())
        if work:
            yield Round([call.comm.allreduce(qflat)], last=True)

        # Last round done (a callback thread): decode only, never communicate.
        with call.codec():
            out = call.output()  # the inputs were all read before the first round
            views = out.tensor_split(call.offsets[1:-1])  # tensor by tensor
            if unc:
                torch._foreach_copy_([views[i] for i in unc], upieces)
            if work:
                qts = [w[3] for w in work]
                torch._foreach_copy_(qts, _views(qflat, 0, [q.shape for q in qts]))
                torch._foreach_div_(qts, world)
            sent_idx, sent, rows_out = [], [], []  # the stacked groups' M_hat, copied and subtracted at once
            for ((n, m, _k), idx), (_, mats, pt, qt, _rows) in zip(groups, work):
                if isinstance(mats, torch.Tensor):  # stacked: M_hat = P Q^T of the group at once
                    mh = torch.bmm(pt.transpose(1, 2), qt)
                    r = mh.view(len(idx), n * m)
                    rows_out.extend((r if out.dtype == wd else narrow(r, out.dtype)).unbind(0))
                    sent_idx.extend(idx)
                    sent.extend(mh.unbind(0))
            if sent_idx:
                torch._foreach_copy_([views[i] for i in sent_idx], rows_out)
                call.commit_many(sent_idx, sent)
            for ((n, m, k), idx), (_, mats, pt, qt, rows) in zip(groups, work):
                for j, i in enumerate(idx):
                    if not isinstance(mats, torch.Tensor):
                        dst = views[i].view(n, m)
                        if rows:
                            _decode_rows(call, i, mats[j], pt[j], qt[j], dst, rows)
                        else:
                            mhat = dst if dst.dtype == wd and _direct(dst, k) else _slots(1, n, m, wd, dev)[0]
                            _low_rank_product(pt[j], qt[j], mhat)  # M_hat = P Q^T
                            if mhat is not dst:
                                dst.copy_(narrow(mhat, dst.dtype))
                            call.commit(i, mhat.view(call.tensors[i].shape))
                    # Frozen here (unused on this rank): M_hat is every rank's share, not the
                    # zeros it sent; its residual pays for it unless no rank used the tensor.
                    call.charge(i, views[i])
                if self.warm_start:
                    for i, q in zip(idx, qt.transpose(1, 2).contiguous().unbind(0)):
                        call.contexts[i].store["q"] = q
        return out
