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


def _all_finite(tensors) -> bool:
    """True when no tensor holds a NaN or Inf. One host sync in the common case: a sum
    is non-finite whenever an element is (NaN and +-Inf propagate), and summing reads
    each tensor once without a mask. A non-finite sum of finite values (overflow) is
    told apart by aminmax, which is exact (about 20x faster on CPU than
    ``torch.isfinite(t).all()``)."""
    tensors = [t.detach().reshape(-1) for t in tensors if t.numel()]
    if not tensors:
        return True
    if bool(torch.isfinite(torch.stack([t.sum() for t in tensors])).all()):
        return True
    ext = [torch.stack(torch.aminmax(t)) for t in tensors]
    return bool(torch.isfinite(torch.cat(ext)).all())


@dataclass
class Call:
    """One ``Engine.reduce`` call: the tensors, their state, and the means to talk."""

    comm: Communicator
    names: list
    tensors: list
    contexts: list
    memory: ErrorFeedback | None
    out_dtype: torch.dtype
    #: Where the flat result may be written (DDP's bucket buffer), or None. The
    #: inputs may alias it: write it only once they have been encoded.
    dest: torch.Tensor | None = None
    offsets: list = field(init=False)
    _x: dict = field(default_factory=dict, init=False, repr=False)
    #: Names of tensors summed exactly as they are (no compression, no residual): a
    #: non-finite input shows in the averaged output, so the engine need not read them.
    plain: set = field(default_factory=set, init=False, repr=False)
    #: Names of ``plain`` tensors found non-finite (checked before they were reduced).
    nonfinite: list = field(default_factory=list, init=False, repr=False)
    #: Whether the front end reports which tensors were non-finite (``on_nonfinite="raise"``);
    #: otherwise ``plain`` tensors are not read at all (the averaged output shows a NaN/Inf).
    name_nonfinite: bool = field(default=True, repr=False)

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

    def output(self, zero: bool = False) -> torch.Tensor:
        """The flat ``out_dtype`` tensor to write this call's result into: ``dest`` when
        the front end gave one that fits, else a new tensor."""
        d = self.dest
        if d is not None and d.dtype == self.out_dtype and d.numel() == self.numel and d.is_contiguous():
            d = d.view(-1)
            return d.zero_() if zero else d
        make = torch.zeros if zero else torch.empty
        return make(self.numel, dtype=self.out_dtype, device=self.device)

    @property
    def all_plain(self) -> bool:
        """Every tensor of the call is summed as it is (see ``plain``; decided once the
        exchange has run its first round). The engine then sends no non-finite flag."""
        return bool(self.names) and self.plain.issuperset(self.names)

    def slice(self, i: int) -> slice:
        return slice(self.offsets[i], self.offsets[i + 1])

    def x(self, i: int) -> torch.Tensor:
        """The tensor to compress: gradient plus residual with error feedback, else the gradient."""
        name = self.names[i]  # keyed by name: sub-calls share the cache with their parent
        if name not in self._x:
            g = self.tensors[i]
            self._x[name] = self.memory.compensate(name, g) if self.memory is not None else g
        return self._x[name]

    def x_rows(self, i: int, rows: int, visit) -> torch.Tensor:
        """:meth:`x` as a ``(shape[0], -1)`` matrix, with ``visit(start, stop, block)`` called
        on each block of ``rows`` rows in order. A compensation not made yet is made block by
        block, each visited while it is still in cache (the values are those of :meth:`x`)."""
        name, g = self.names[i], self.tensors[i]
        if name not in self._x and self.memory is not None and g.dim() > 0:
            self._x[name] = self.memory.compensate(name, g, rows=rows, visit=visit)
            return self._x[name].view(g.shape[0], -1)
        x = self.x(i)
        x2 = x.reshape(x.shape[0], -1) if x.dim() else x.reshape(1, -1)
        for s in range(0, x2.shape[0], rows):
            visit(s, min(s + rows, x2.shape[0]), x2[s : s + rows])
        return x2

    def fresh_residual(self, i: int) -> torch.Tensor | None:
        """A buffer shaped like tensor ``i``'s compensated input for an exchange that computes
        ``x - sent`` itself (fused with its decode), or None without error feedback. Write it
        through views; store the buffer itself with :meth:`commit_residual`."""
        if self.memory is None:
            return None
        x = self.x(i)
        return self.memory.fresh(self.names[i], x.shape, x.dtype, x.device)

    def commit_residual(self, i: int, residual: torch.Tensor) -> None:
        """Store ``residual`` (from :meth:`fresh_residual`, filled) as tensor ``i``'s new residual."""
        if self.memory is not None:
            if residual.shape != self.tensors[i].shape:
                raise ValueError(f"residual of shape {tuple(residual.shape)} for a tensor of {tuple(self.tensors[i].shape)}")
            self.memory.set_residual(self.names[i], residual)

    def peek(self, i: int) -> torch.Tensor:
        """What :meth:`x` holds or would return, without compensating a tensor that has no
        residual (its gradient, widened exactly: the same values and finiteness). For checks
        that must not decide how an exchange compensates later."""
        name = self.names[i]
        if name in self._x or (self.memory is not None and self.memory.residual(name) is not None):
            return self.x(i)
        return self.tensors[i]

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

    def subset(self, idx: list, *, error_feedback: bool = True, dest: torch.Tensor | None = None) -> "Call":
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
            dest=dest,
            name_nonfinite=self.name_nonfinite,
        )
        sub._x = self._x  # one compensation per tensor per call, seen by parent and subsets
        sub.plain = self.plain
        sub.nonfinite = self.nonfinite
        return sub

    def codec(self):
        """Time a block as codec work (see :func:`codec_time`)."""
        return codec_time(self.comm.stats)


@contextmanager
def codec_time(stats):
    """Book a block's wall clock and this thread's CPU time as codec seconds in ``stats``:
    gradzip's own work outside the collectives (the engine's checks included)."""
    t0, c0 = time.perf_counter(), time.thread_time()
    try:
        yield
    finally:
        stats.add(codec_seconds=time.perf_counter() - t0, codec_cpu_seconds=time.thread_time() - c0)


def _back_to_back(bodies, dest: torch.Tensor | None) -> torch.Tensor | None:
    """``dest[:n]`` when the bodies are its consecutive pieces from its start (DDP's
    bucket gradients as Identity sends them), else None."""
    if dest is None or not bodies or not dest.is_contiguous():
        return None
    flat = dest.view(-1)
    pos = 0
    for b in bodies:
        if b.dtype != flat.dtype or not b.is_contiguous():
            return None
        if b.numel() and (b.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()
                          or b.data_ptr() != flat[pos:].data_ptr()):
            return None
        pos += b.numel()
    return flat[:pos]


def _cat_target(bodies, call: Call) -> torch.Tensor | None:
    """``call.dest`` as the buffer to concatenate the bodies into, where it fits (their dtype,
    exactly their length) and none of them lies in it; else None (a new tensor)."""
    d = call.dest
    n = sum(b.numel() for b in bodies)
    if d is None or d.numel() != n or not d.is_contiguous() or any(b.dtype != d.dtype for b in bodies):
        return None
    st = d.untyped_storage().data_ptr()
    if any(b.numel() and b.untyped_storage().data_ptr() == st for b in bodies):
        return None
    return d.view(-1)


def summable_exchange(comp: "Compressor", call: Call) -> Exchange:
    with call.codec():
        payloads = [call.encode(comp, i) for i in range(len(call.tensors))]
        bodies = [p.body.reshape(-1) for p in payloads]
        # Identity on DDP's bucket: the gradients already lie back to back in the bucket
        # buffer, which is also where the result goes. Reduce it in place, as DDP does.
        flat = _back_to_back(bodies, call.dest) if call.memory is None else None
        if flat is None and payloads:
            flat = torch.cat(bodies, out=_cat_target(bodies, call))
        elif flat is None:
            flat = torch.empty(0, dtype=call.out_dtype, device=call.device)
        if flat.numel() and not (comp.biased or call.memory is not None) and _sends_itself(payloads, call):
            # Summed as they are: checked here, before the division and the collective
            # (which may work in place), instead of by the engine afterwards.
            call.plain.update(call.names)
            if call.name_nonfinite and not _all_finite([flat]):
                call.nonfinite += [n for n, b in zip(call.names, bodies) if not _all_finite([b])]
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
        out = call.output()
        for i, d in enumerate(decoded):
            out[call.slice(i)] = d
    return out


def _sends_itself(payloads, call: Call) -> bool:
    """Every body is its input's own values (views of the gradients: Identity)."""
    return all(
        p.body.numel() == 0 or (p.body.dtype == t.dtype and p.body.data_ptr() == t.data_ptr())
        for p, t in zip(payloads, call.tensors)
    )


def framed_exchange(comp: "Compressor", call: Call) -> Exchange:
    with call.codec():
        payloads = [call.encode(comp, i) for i in range(len(call.tensors))]
        msg = pack_frames(payloads, device=call.device)
        call.comm.stats.add(bytes_payload=msg.numel())
    gathered = yield from allgather_bytes(call.comm, msg)
    with call.codec():
        shapes = [p.shape for p in payloads]
        dtypes = [p.dtype for p in payloads]
        acc_dtype = accum_dtype(call.out_dtype)
        if acc_dtype == call.out_dtype:
            acc = call.output(zero=True)  # every input was encoded before the first round
        else:
            acc = torch.zeros(call.numel, dtype=acc_dtype, device=call.device)
        frames = [unpack_frames(gathered[r], shapes, dtypes) for r in range(call.world_size)]
        for i in range(len(payloads)):
            # Each tensor's peers in fixed rank order: every rank computes the same floats.
            comp.accumulate_many([frames[r][i] for r in range(call.world_size)], acc[call.slice(i)])
        acc.div_(call.world_size)
    return acc.to(call.out_dtype)
