"""Error feedback: per-tensor residual memory.

``compensate(name, g)`` returns ``g + residual`` in the accumulation dtype
(float32, or float64 for float64 gradients). After compression,
``update(name, compensated, sent)`` stores ``compensated - sent``. Nothing is
dropped: what was not sent stays in the residual.

Residuals are keyed by parameter *name*, not by DDP bucket, so they survive
DDP's bucket rebuild after the first iteration and can be saved and restored.

Buffer reuse (CPU): a fresh host tensor of tens of megabytes costs more to
page-fault in than the arithmetic written into it (a 64 MB subtraction: 31 ms
into a new tensor, 5 ms into an old one, on the 2-core machine of
``benchmarks/``). So large CPU residuals and compensated inputs are written
into buffers of earlier steps that nothing references any more: a buffer is
reused only while the pool holds the sole reference to it and no view shares
its storage (a residual the caller kept, or the engine's rollback copy, is
never overwritten). CUDA tensors use PyTorch's caching allocator instead.
"""
from __future__ import annotations

import sys

import torch

from .wire import accum_dtype


_POOL_MIN_BYTES = 1 << 20  # smaller tensors: malloc reuses memory by itself
_POOL_PER_NAME = 2  # a step needs one buffer for the compensated input, one for the residual


def _sole_owner(t: torch.Tensor) -> bool:
    """Called as ``_sole_owner(pool[j])`` with ``t = pool[j]`` bound by the caller: true
    when no other reference to the tensor exists and nothing views its storage."""
    try:
        # references: the pool's list, the caller's ``t``, this ``t``, getrefcount's argument
        if sys.getrefcount(t) > 4:
            return False
        return torch._C._storage_Use_Count(t.untyped_storage()._cdata) <= 2  # the tensor and this handle
    except Exception:  # private API gone: never reuse
        return False


class ErrorFeedback:
    def __init__(self) -> None:
        self.residuals: dict[str, torch.Tensor] = {}
        self._spare: dict[str, list] = {}
        self._compensated: dict[str, torch.Tensor] = {}

    # -- buffer reuse ---------------------------------------------------------------------
    def _take(self, name: str, shape, dtype: torch.dtype, device) -> torch.Tensor | None:
        pool = self._spare.get(name)
        if not pool:
            return None
        for j in range(len(pool)):
            t = pool[j]
            if t.shape == shape and t.dtype == dtype and t.device == device and _sole_owner(t):
                del t
                return pool.pop(j)
        return None

    def _give(self, name: str, t: torch.Tensor) -> None:
        if t.device.type != "cpu" or t.numel() * t.element_size() < _POOL_MIN_BYTES or not t.is_contiguous():
            return
        pool = self._spare.setdefault(name, [])
        if any(p is t for p in pool):
            return
        pool.append(t)
        del pool[:-_POOL_PER_NAME]

    def release(self, names) -> None:
        """The calls over ``names`` are done: their compensated inputs may be reused."""
        for n in names:
            c = self._compensated.pop(n, None)
            if c is not None:
                self._give(n, c)

    # -- the algorithm ----------------------------------------------------------------------
    def compensate(self, name: str, grad: torch.Tensor, *, rows: int = 0, visit=None) -> torch.Tensor:
        """``grad + residual`` in the accumulation dtype (a copy of ``grad`` without a residual).

        With ``visit`` (and ``rows > 0``), the result is written ``rows`` rows of its
        ``(shape[0], -1)`` view at a time, and ``visit(start, stop, block)`` is called on each
        block as soon as it is written, while it is still in cache (PowerSGD's first product).
        The values are the same either way.
        """
        acc = accum_dtype(grad.dtype)
        r = self.residuals.get(name)
        if r is not None and r.shape != grad.shape:
            raise ValueError(
                f"residual for {name!r} has shape {tuple(r.shape)}, gradient has {tuple(grad.shape)}"
            )
        if r is not None and (r.device != grad.device or r.dtype != acc):
            r = r.to(device=grad.device, dtype=acc)
        buf = self._take(name, grad.shape, acc, grad.device)
        if visit is not None and rows > 0 and grad.dim() > 0:
            c = buf if buf is not None else torch.empty(grad.shape, dtype=acc, device=grad.device)
            n = grad.shape[0]
            g2, c2 = grad.reshape(n, -1), c.view(n, -1)
            r2 = r.reshape(n, -1) if r is not None else None
            for s in range(0, n, rows):
                e = min(s + rows, n)
                if r2 is None:
                    c2[s:e].copy_(g2[s:e])
                else:  # promotes to ``acc`` before adding: grad.to(acc) + r, bit for bit
                    torch.add(g2[s:e], r2[s:e], out=c2[s:e])
                visit(s, e, c2[s:e])
        elif r is None:
            c = grad.to(acc, copy=True) if buf is None else buf.copy_(grad)
        else:
            c = grad.to(acc) + r if buf is None else torch.add(grad.to(acc), r, out=buf)
        self._compensated[name] = c
        return c

    def fresh(self, name: str, shape, dtype: torch.dtype, device) -> torch.Tensor:
        """An uninitialized contiguous tensor to write ``name``'s next residual into (an
        earlier step's buffer where one is free); store it, not a view of it, with
        :meth:`set_residual` (a view keeps its base alive, and the pool never reuses a
        buffer that something else uses)."""
        buf = self._take(name, torch.Size(shape), dtype, device)
        return buf if buf is not None else torch.empty(shape, dtype=dtype, device=device)

    def set_residual(self, name: str, new: torch.Tensor) -> None:
        old = self.residuals.get(name)
        self.residuals[name] = new
        if old is not None and old is not new:
            self._give(name, old)  # reused once nothing else holds it (the engine's undo copy)

    def update(self, name: str, compensated: torch.Tensor, sent: torch.Tensor) -> None:
        # Never compensated.sub_(): a payload body may alias ``compensated``.
        sent = sent.reshape(compensated.shape)
        if torch.result_type(compensated, sent) != compensated.dtype:  # a wider ``sent``: keep its precision
            new = compensated - sent
        else:
            new = torch.sub(compensated, sent, out=self.fresh(name, compensated.shape, compensated.dtype,
                                                              compensated.device))
        self.set_residual(name, new)

    def residual(self, name: str) -> torch.Tensor | None:
        return self.residuals.get(name)

    def state_dict(self) -> dict:
        return {k: v.detach().clone() for k, v in self.residuals.items()}

    def load_state_dict(self, sd: dict) -> None:
        self.residuals = {k: v.detach().clone() for k, v in sd.items()}
        self._spare.clear()
        self._compensated.clear()
