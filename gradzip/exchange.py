"""Exchanges: how the compressed tensors of one call travel and come back averaged.

An exchange is a generator protocol (see :mod:`gradzip.comm`): it compresses the
call's tensors, yields ``Round``\\ s of collectives launched through the
:class:`~gradzip.comm.Communicator`, and returns the flat average. Compressors
pick one through :meth:`Compressor.exchange`:

* :func:`summable_exchange`: payload bodies are concatenated, pre-divided by the
  world size and allreduced (one round).
* :func:`framed_exchange`: payloads are framed into one byte message per rank and
  all-gathered after a size exchange (two rounds); every rank decodes every
  peer in rank order.

Multi-round methods (PowerSGD, wrappers such as model filtering) write their own
exchange with the same :class:`Call` helpers, and never touch ``torch.distributed``.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generator

import torch

from .comm import Communicator, Round, allgather_bytes
from .feedback import ErrorFeedback
from .wire import Payload, accum_dtype, pack_frames, unpack_frames

if TYPE_CHECKING:
    from .compressors.base import Compressor

Exchange = Generator[Round, None, torch.Tensor]


@dataclass
class Call:
    """One ``Engine.reduce`` call: the tensors, their state, and the means to talk."""

    comm: Communicator
    names: list
    tensors: list
    contexts: list
    memory: ErrorFeedback | None
    out_dtype: torch.dtype
    offsets: list = field(init=False)
    _x: dict = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        self.offsets = [0]
        for t in self.tensors:
            self.offsets.append(self.offsets[-1] + t.numel())

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device if self.tensors else torch.device("cpu")

    @property
    def numel(self) -> int:
        return self.offsets[-1]

    def slice(self, i: int) -> slice:
        return slice(self.offsets[i], self.offsets[i + 1])

    def x(self, i: int) -> torch.Tensor:
        """The tensor to compress: gradient plus residual with error feedback, else the gradient."""
        name = self.names[i]  # keyed by name: sub-calls share the cache with their parent
        if name not in self._x:
            g = self.tensors[i]
            self._x[name] = self.memory.compensate(name, g) if self.memory is not None else g
        return self._x[name]

    def commit(self, i: int, sent: torch.Tensor) -> None:
        """Record what tensor ``i`` contributed; with error feedback the rest becomes its residual."""
        if self.memory is not None:
            self.memory.update(self.names[i], self.x(i), sent)

    def skip(self, i: int) -> None:
        """Tensor ``i`` sends nothing this step; with error feedback all of it stays in the residual."""
        if self.memory is not None:
            x = self.x(i)
            self.memory.update(self.names[i], x, torch.zeros_like(x))

    def encode(self, comp: "Compressor", i: int) -> Payload:
        """Compress tensor ``i`` and commit what its payload decodes to."""
        p = comp.compress(self.x(i), self.contexts[i])
        if self.memory is not None:
            self.commit(i, comp.decompress(p))
        return p

    def subset(self, idx: list, *, error_feedback: bool = True) -> "Call":
        """A call over some of the tensors, sharing state (for wrappers such as filters).

        ``error_feedback=False`` runs the subset without residuals (for an unbiased
        compressor inside a biased policy); use it only for tensors that never had one.
        """
        sub = Call(
            comm=self.comm,
            names=[self.names[i] for i in idx],
            tensors=[self.tensors[i] for i in idx],
            contexts=[self.contexts[i] for i in idx],
            memory=self.memory if error_feedback else None,
            out_dtype=self.out_dtype,
        )
        sub._x = self._x  # one compensation per tensor per call, seen by parent and subsets
        return sub

    @contextmanager
    def codec(self):
        """Time a block as codec work."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.comm.stats.add(codec_seconds=time.perf_counter() - t0)


def summable_exchange(comp: "Compressor", call: Call) -> Exchange:
    with call.codec():
        payloads = [call.encode(comp, i) for i in range(len(call.tensors))]
        if payloads:
            flat = torch.cat([p.body.reshape(-1) for p in payloads])
        else:
            flat = torch.empty(0, dtype=call.out_dtype, device=call.device)
        flat.div_(call.world_size)  # pre-divide, as DDP does, so sums cannot overflow the wire dtype
        call.comm.stats.add(bytes_payload=flat.numel() * flat.element_size())
    yield Round([call.comm.allreduce(flat)], last=True)
    with call.codec():
        decoded, in_place, pos = [], flat.dtype == call.out_dtype, 0
        for p in payloads:
            k = p.body.numel()
            summed = Payload(body=flat[pos : pos + k], shape=p.shape, dtype=p.dtype, vdtype=p.vdtype, local=p.local)
            d = comp.decompress(summed).reshape(-1)
            # Identity decodes to views of ``flat`` at its own offsets: then ``flat`` is the answer.
            in_place = in_place and d.numel() == k and (k == 0 or d.data_ptr() == flat[pos:].data_ptr())
            decoded.append(d)
            pos += k
        if in_place and pos == call.numel:
            return flat
        out = torch.empty(call.numel, dtype=call.out_dtype, device=call.device)
        for i, d in enumerate(decoded):
            out[call.slice(i)] = d
    return out


def framed_exchange(comp: "Compressor", call: Call) -> Exchange:
    with call.codec():
        payloads = [call.encode(comp, i) for i in range(len(call.tensors))]
        msg = pack_frames(payloads, device=call.device)
        call.comm.stats.add(bytes_payload=msg.numel())
    gathered = yield from allgather_bytes(call.comm, msg)
    with call.codec():
        shapes = [p.shape for p in payloads]
        dtypes = [p.dtype for p in payloads]
        acc = torch.zeros(call.numel, dtype=accum_dtype(call.out_dtype), device=call.device)
        frames = [unpack_frames(gathered[r], shapes, dtypes) for r in range(call.world_size)]
        for i in range(len(payloads)):
            # Each tensor's peers in fixed rank order: every rank computes the same floats.
            comp.accumulate_many([frames[r][i] for r in range(call.world_size)], acc[call.slice(i)])
        acc.div_(call.world_size)
    return acc.to(call.out_dtype)
