"""Top-k and random-k sparsification."""
from __future__ import annotations

import math

import torch

import gradzip.args as args
import gradzip.kernels as K
from ..wire import FMT_DENSE, FMT_EMPTY, Payload, as_bytes, from_bytes, narrow
from .base import Codec, TensorContext, check_input, tensor_seed

__all__ = ["TopK", "RandomK"]

FMT_SPARSE32 = 4  # body: k int32 indices, then k values in vdtype
FMT_SPARSE64 = 5  # body: k int64 indices, then k values in vdtype

_INT32_LIMIT = 2**31


def _k_of(ratio: float, n: int) -> int:
    return 0 if n == 0 else min(n, max(1, math.ceil(ratio * n)))


class TopK(Codec):
    """Send the ``k = ceil(ratio * n)`` elements of largest magnitude, with their indices.

    ``mode="exact"`` uses ``torch.topk``. ``mode="sampled"`` is DGC's estimate
    (Lin et al. 2018): the threshold is the top-``ratio`` quantile of ``|x|`` on a
    random sample of ``sample`` elements, aimed 25% below the k-th value; elements
    above it are selected and trimmed to the exact top k among them. It sends at
    most k elements (fewer only when the sample overestimates the threshold) and
    costs one pass over the tensor plus top-k over the sample and the survivors.
    ``mode="auto"`` is exact below ``sampled_above`` elements and sampled from there.

    Wire: ``FMT_SPARSE32`` (int32 indices then values in the gradient's dtype,
    or in the input's when a compensated value would overflow the gradient's),
    ``FMT_SPARSE64`` for tensors of 2**31 elements or more, or ``FMT_DENSE`` (the
    input as is) when the sparse form would not be smaller.
    """

    formats = {"SPARSE32": FMT_SPARSE32, "SPARSE64": FMT_SPARSE64}

    def __init__(
        self,
        ratio: float = 0.01,
        *,
        mode: str = "exact",
        sample: int = 65536,
        sampled_above: int = 1 << 20,
        seed: int = 0,
    ) -> None:
        self.ratio = args.ratio("ratio", ratio)
        self.mode = args.choice("mode", mode, ("exact", "sampled", "auto"))
        self.sample = args.integer("sample", sample, 1)
        self.sampled_above = args.integer("sampled_above", sampled_above, 1)
        self.seed = args.integer("seed", seed)

    def select(self, v: torch.Tensor, k: int, ctx: TensorContext) -> torch.Tensor:
        """Indices (int64, ascending) of the elements to send."""
        n = v.numel()
        sampled = self.mode == "sampled" or (self.mode == "auto" and n >= self.sampled_above)
        if not sampled or n <= self.sample:
            return torch.topk(v.abs(), k, sorted=False).indices.sort().values
        g = torch.Generator(device="cpu").manual_seed(tensor_seed(self.seed, ctx.step, ctx.name))
        probe = torch.randint(n, (self.sample,), generator=g).to(v.device)
        # Aim 25% above k, then trim the survivors to exactly k: the estimate's
        # spread then rarely leaves fewer than k (DGC's hierarchical selection).
        # The compaction pass is dispatched (a one-pass kernel on the GPU).
        return K.sampled_topk(v, k, probe)

    def compress(self, x: torch.Tensor, ctx: TensorContext | None = None) -> Payload:
        check_input(x)
        ctx = ctx or TensorContext(dtype=x.dtype)
        vdtype = ctx.dtype if ctx.dtype.is_floating_point else x.dtype
        v = x.reshape(-1)
        n = v.numel()
        if n == 0:
            return Payload(body=torch.empty(0, dtype=torch.uint8, device=x.device), shape=x.shape, dtype=x.dtype, fmt=FMT_EMPTY)
        k = _k_of(self.ratio, n)
        itemsize = torch.empty(0, dtype=vdtype).element_size()
        wide = n >= _INT32_LIMIT
        sparse_bytes = k * ((8 if wide else 4) + itemsize)
        if sparse_bytes >= n * itemsize:
            return Payload(body=as_bytes(v), shape=x.shape, dtype=x.dtype, fmt=FMT_DENSE, vdtype=v.dtype)
        idx = self.select(v, k, ctx)
        ibytes = as_bytes(idx if wide else idx.to(torch.int32))
        vals = v[idx]
        sent = vals.to(vdtype)
        if vdtype != v.dtype and bool((sent.isinf() & vals.isfinite()).any()):
            # A compensated value outgrew the gradient's dtype: send this frame in the input's.
            vdtype, sent = v.dtype, vals
        body = torch.cat([ibytes, as_bytes(sent)])
        fmt = FMT_SPARSE64 if wide else FMT_SPARSE32
        return Payload(body=body, shape=x.shape, dtype=x.dtype, fmt=fmt, vdtype=vdtype)

    def decompress(self, payload: Payload) -> torch.Tensor:
        out = self.zeros(payload)
        self.accumulate(payload, out.view(-1))
        return narrow(out, payload.dtype)

    def subtract(self, payload: Payload, v: torch.Tensor) -> None:
        """``v -= decompress(payload)``, touching only the sent elements."""
        if payload.fmt == FMT_EMPTY:
            return
        if payload.fmt == FMT_DENSE:
            v.sub_(from_bytes(payload.body, payload.vdtype).to(v.dtype).view(v.shape))
            return
        idx, vals = self._split(payload, v.numel(), validate=False)  # our own frame
        flat = v.view(-1)
        flat.index_put_((idx.to(torch.int64),), flat[idx.to(torch.int64)] - vals.to(v.dtype))

    def accumulate(self, payload: Payload, out: torch.Tensor) -> None:
        if payload.fmt == FMT_EMPTY:
            return
        if payload.fmt == FMT_DENSE:
            out.add_(from_bytes(payload.body, payload.vdtype).to(out.dtype))
            return
        K.scatter_add_sparse(out, *self._split(payload, out.numel()))

    @staticmethod
    def _split(payload: Payload, n: int, validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """(indices, values) of a sparse frame, its indices checked against ``n`` elements."""
        if payload.fmt not in (FMT_SPARSE32, FMT_SPARSE64):
            raise ValueError(f"TopK cannot decode frame format {payload.fmt}")
        isize = 8 if payload.fmt == FMT_SPARSE64 else 4
        vsize = torch.empty(0, dtype=payload.vdtype).element_size()
        nb = payload.body.numel()
        if nb % (isize + vsize):
            raise ValueError(f"corrupt top-k frame: {nb} bytes is not a multiple of {isize + vsize}")
        k = nb // (isize + vsize)
        idx = from_bytes(payload.body[: k * isize], torch.int64 if isize == 8 else torch.int32)
        vb = payload.body[k * isize :]
        if vb.storage_offset() % vsize:  # e.g. float64 values after an odd number of int32 indices
            vb = vb.clone()
        vals = from_bytes(vb, payload.vdtype)
        if k and validate:
            lo, hi = torch.stack(torch.aminmax(idx)).tolist()
            if hi >= n or lo < 0:
                bad = hi if hi >= n else lo
                raise ValueError(f"corrupt top-k frame: index {bad} outside [0, {n})")
        return idx, vals


class RandomK(Codec):
    """Send ``k = ceil(ratio * n)`` elements at indices drawn from a seed all ranks share.

    The indices depend only on ``(seed, step, tensor name)``, so every rank picks
    the same ones and only the k values travel: the payload is summable and goes
    through allreduce. Values travel in the input's dtype (float32 when error
    feedback has promoted a half-precision gradient), the same on every rank. Values are not rescaled by n/k; with error feedback (the
    default) the unsent mass waits in the residual.
    """

    summable = True
    framable = False  # the indices are never sent: only an allreduce of the values carries it

    def __init__(self, ratio: float = 0.01, *, seed: int = 0) -> None:
        self.ratio = args.ratio("ratio", ratio)
        self.seed = args.integer("seed", seed)

    def indices(self, n: int, ctx: TensorContext, device) -> torch.Tensor:
        k = _k_of(self.ratio, n)
        if k == n:
            return torch.arange(n, device=device)
        g = torch.Generator(device="cpu").manual_seed(tensor_seed(self.seed, ctx.step, ctx.name))
        return torch.randperm(n, generator=g)[:k].sort().values.to(device)

    def compress(self, x: torch.Tensor, ctx: TensorContext | None = None) -> Payload:
        check_input(x)
        ctx = ctx or TensorContext(dtype=x.dtype)
        v = x.reshape(-1)
        idx = self.indices(v.numel(), ctx, x.device)
        return Payload(body=v[idx], shape=x.shape, dtype=x.dtype, vdtype=x.dtype, local=idx)

    def decompress(self, payload: Payload) -> torch.Tensor:
        out = torch.zeros(payload.shape, dtype=payload.dtype, device=payload.body.device)
        out.view(-1)[payload.local] = payload.body.to(out.dtype)
        return out

    def subtract(self, payload: Payload, v: torch.Tensor) -> None:
        flat = v.view(-1)
        flat[payload.local] -= payload.body.to(v.dtype)
