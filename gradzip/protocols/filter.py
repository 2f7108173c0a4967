"""Model filtering: skip the tensors that barely changed this step, and lose none of their mass.

``Filter(inner, min_change=m, beta=b)`` wraps any codec or protocol. For tensor ``i``
of a call, with ``c`` its compensated input (gradient plus residual) of ``n``
elements:

* ``change = ||c||_2 / sqrt(n)`` (root mean square, computed in float64;
  0 for an empty tensor);
* ``ref`` is the tensor's running reference, an exponential moving average of
  ``change`` kept in its state (``ctx.store["filter.ref"]``): absent before the
  first step, then ``ref <- change`` at the first step and
  ``ref <- b * ref + (1 - b) * change`` at every later one, sent or not;
* the rank **wants** to send the tensor iff ``change > m * ref`` (``ref`` as it
  was before this step; 0 when absent). A tensor that is all zeros is never
  wanted: skipping it loses nothing. A non-finite ``change`` is always wanted
  and leaves ``ref`` alone (the engine's non-finite check then handles the step).

The ranks then agree: one allreduce(MAX) of one uint8 flag per tensor (counted
in ``bytes_sent`` like every collective, and booked as ``bytes_control``). A tensor is sent iff some rank wants
it; every rank then runs ``inner``'s own protocol on the sent tensors only
(``Call.subset``) and fills zeros for the others. A skipped tensor's whole
compensated value stays in its residual (``Call.skip``), so
``residual + sent == compensated`` holds exactly for it, and for the sent ones
as exactly as ``inner`` makes it.

Skipping is biased: ``Filter`` reports ``biased``, so the engine turns error
feedback on by default whatever ``inner`` says. With error feedback off, a
skipped tensor's gradient is dropped.

``m`` lies in ``[0, 1)``: a tensor whose gradient keeps one direction grows
in ``change`` faster than its lagging average, so with ``m < 1`` it is sent
within a few steps; ``m = 0`` sends every tensor that is not all zeros. Counts
``filter.sent`` and ``filter.skipped`` are kept per tensor.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

import gradzip.args as args
import gradzip.kernels as K

from ..codecs.base import Codec
from ..comm import Round
from .base import Call, Exchange, Protocol, as_protocol

__all__ = ["Filter"]

REF = "filter.ref"
SENT = "filter.sent"
SKIPPED = "filter.skipped"


class Filter(Protocol):
    """Skip the tensors that barely changed this step (module docstring).

    Args:
        inner: the codec or protocol that carries the tensors that are sent.
        min_change: ``m``, in [0, 1): a tensor is wanted when its RMS change exceeds
            ``m`` times its running reference.
        beta: ``b``, in [0, 1): the running reference's decay.
    """

    def __init__(self, inner, *, min_change: float = 0.5, beta: float = 0.9) -> None:
        if not isinstance(inner, (Codec, Protocol)):
            raise TypeError(f"inner must be a gradzip codec or protocol, got {type(inner).__name__}")
        self.inner = inner
        self.min_change = args.number("min_change", min_change, 0.0, 1.0, hi_open=True)
        self.beta = args.number("beta", beta, 0.0, 1.0, hi_open=True)

    def check_names(self, names) -> None:
        as_protocol(self.inner).check_names(names)

    def wants(self, x: torch.Tensor, store: dict) -> bool:
        """This rank's vote for sending ``x`` (the compensated input); updates ``store``'s reference."""
        n = x.numel()
        change = 0.0
        if n:
            change = float(torch.linalg.vector_norm(x.detach().reshape(-1), dtype=torch.float64)) / math.sqrt(n)
        if not math.isfinite(change):  # send it: the engine's non-finite check handles the step
            return True
        ref = store.get(REF)
        store[REF] = change if ref is None else self.beta * float(ref) + (1.0 - self.beta) * change
        return change > self.min_change * float(ref or 0.0)

    def exchange(self, call: Call) -> Exchange:
        count = len(call.tensors)
        out = torch.zeros(call.numel, dtype=call.out_dtype, device=call.device)
        if count == 0:
            return out
        with call.codec():
            votes = [self.wants(call.x(i), call.contexts[i].store) for i in range(count)]
            flags = torch.tensor(votes + [0] if call.wants_flag else votes, dtype=torch.uint8)
            flags = K.host_to_device(flags, call.device)
        if flags.numel() > count:  # the engine's non-finite flag rides with the votes (MAX: no wrap)
            flags[-1] = call.take_flag(flags[-1:])
        yield Round([call.comm.allreduce(flags, op=dist.ReduceOp.MAX, control=True)])
        sent = [i for i, f in enumerate(flags[:count].tolist()) if f]
        with call.codec():
            sent_set = set(sent)
            for i in range(count):
                store = call.contexts[i].store
                if i in sent_set:
                    store[SENT] = int(store.get(SENT, 0)) + 1
                else:
                    store[SKIPPED] = int(store.get(SKIPPED, 0)) + 1
                    call.skip(i)
        if not sent:
            return out
        sub = call.subset(sent)
        got = yield from as_protocol(self.inner, call.world_size, feedback=call.memory is not None).exchange(sub)
        for j, i in enumerate(sent):
            out[call.slice(i)] = got[sub.slice(j)]
        return out
