"""Error feedback: per-tensor residual memory.

A codec sends ``v = g + r`` (the gradient plus the residual) compressed and
leaves ``v - sent`` in the residual (``Codec.encode``). Nothing is dropped: what
was not sent stays in the residual. Residuals are in the accumulation dtype
(float32, or float64 for float64 gradients) and keyed by tensor *name*, not by
DDP bucket, so they survive DDP's bucket rebuild and can be saved and restored.

**Two buffers per name.** A new residual is written into :meth:`buffer` (the
name's spare buffer, the residual before last) and then stored with :meth:`set`;
the residual it replaces becomes the spare. So in steady state no step allocates
(a fresh host tensor of tens of megabytes costs more to page in than the
arithmetic written into it), and the residual a step started from is still
intact when the step ends, which is what :meth:`restore` needs. A buffer is
never handed out while a snapshot holds it.

**Decay** (``ErrorFeedback(decay=beta)``, the engine's ``error_decay``): a residual is read for
compensation as ``beta * r`` (:meth:`check_shape`, :meth:`compensate`), so a codec sends
``g + beta * r`` and keeps what it did not send: the mass ``(1 - beta) * r`` is dropped each step
on purpose. This is the decaying error buffer of SparseLoCo (beta 0.95 on DiLoCo's
pseudo-gradient) and DeMo (beta 0.999, the buffer being the momentum). ``beta = 1`` is plain error
feedback. A protocol's second memory (TwoPhase's owner residuals, read by :meth:`residual`) does
not decay.

**Rollback.** The first :meth:`set` of a name in a step remembers the residual it
replaces; the engine calls :meth:`restore` to put every remembered residual back
when the step turns out non-finite, else :meth:`release`. Only the engine
restores; codecs and protocols write residuals only through :meth:`set` (via
``Call``), under any key (a protocol may keep a second memory, e.g. per chunk).
"""

from __future__ import annotations

import torch

from .wire import accum_dtype

__all__ = ["ErrorFeedback"]

_ABSENT = object()


class ErrorFeedback:
    def __init__(self, decay: float = 1.0) -> None:
        self.decay = float(decay)
        self.residuals: dict[str, torch.Tensor] = {}
        self._spare: dict[str, torch.Tensor] = {}
        self._held: dict[str, object] = {}  # name -> the residual a snapshot holds (or _ABSENT)

    def residual(self, name: str) -> torch.Tensor | None:
        return self.residuals.get(name)

    def check_shape(self, name: str, grad: torch.Tensor) -> torch.Tensor | None:
        """The residual of ``name`` on ``grad``'s device in the accumulation dtype, times the
        decay (a new tensor where the decay is not 1), or None."""
        r = self.residuals.get(name)
        if r is None:
            return None
        if r.shape != grad.shape:
            raise ValueError(f"residual for {name!r} has shape {tuple(r.shape)}, gradient has {tuple(grad.shape)}")
        acc = accum_dtype(grad.dtype)
        if self.decay != 1.0:
            return torch.mul(r.to(device=grad.device, dtype=acc), self.decay)
        return r if (r.device, r.dtype) == (grad.device, acc) else r.to(device=grad.device, dtype=acc)

    def buffer(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """An uninitialized tensor shaped like ``like`` in its accumulation dtype, to build
        ``name``'s next residual in: the spare where it fits and nothing holds it."""
        acc = accum_dtype(like.dtype)
        buf = self._spare.get(name)
        if (
            buf is not None
            and buf.shape == like.shape
            and buf.dtype == acc
            and buf.device == like.device
            and buf is not self.residuals.get(name)
            and buf is not self._held.get(name)
        ):
            del self._spare[name]
            return buf
        return torch.empty(like.shape, dtype=acc, device=like.device)

    def compensate(self, name: str, grad: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``grad + decay * residual`` in the accumulation dtype, in ``out`` (default: :meth:`buffer`)."""
        r = self.check_shape(name, grad)
        out = self.buffer(name, grad) if out is None else out
        if r is None:
            return out.copy_(grad)
        return torch.add(grad.to(out.dtype), r, out=out)  # promotes before adding: grad.to(acc) + r

    def set(self, name: str, new: torch.Tensor) -> None:
        """Store ``new`` (a tensor of its own, e.g. from :meth:`buffer`) as ``name``'s residual."""
        old = self.residuals.get(name)
        self._held.setdefault(name, _ABSENT if old is None else old)
        self.residuals[name] = new
        if old is not None and old is not new:
            self._spare[name] = old

    # -- rollback (the engine's) -------------------------------------------------------------
    def restore(self) -> None:
        """Put back every residual as it was before its first :meth:`set` since :meth:`release`."""
        for n, old in self._held.items():
            new = self.residuals.get(n)
            if old is _ABSENT:
                self.residuals.pop(n, None)
            else:
                self.residuals[n] = old
            if new is not None and new is not old:
                self._spare[n] = new
        self._held.clear()

    def release(self) -> None:
        """Forget the snapshots: their buffers may be reused."""
        self._held.clear()

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {k: v.detach().clone() for k, v in self.residuals.items()}

    def load_state_dict(self, sd: dict) -> None:
        self.residuals = {k: v.detach().clone() for k, v in sd.items()}
        self._spare.clear()
        self._held.clear()
