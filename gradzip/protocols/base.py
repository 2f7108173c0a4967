"""Protocols: how the tensors of one call travel between the ranks and come back averaged.

A protocol is the only code that yields collective rounds. Its
:meth:`Protocol.exchange` is a generator (see :mod:`gradzip.comm`): it encodes the
call's tensors through the :class:`Call` (which applies error feedback), yields
``Round``\\ s of collectives launched through the call's communicator, and returns
the flat average. Codecs never communicate; :func:`as_protocol` gives each codec
the protocol that carries it: its own ``protocol`` name (``Int8(allreduce=True)``:
``Int8Allreduce``); else ``AllGather`` for a ``scope="call"`` codec; ``TwoPhase`` for a cast
whose sum rounds (``FP16``, ``BF16``) with error feedback on several ranks; ``Allreduce`` for
the other summable codecs; and for the rest ``TwoPhase`` from ``TWO_PHASE_FROM`` (4) ranks on,
``AllGather`` below.

A protocol declares ``biased`` (error feedback defaults on), ``rounds`` (when fixed, for
parallel composition), ``plain(call)`` (every tensor summed exactly as it is: the engine then
needs no non-finite flag), ``link_raw(nbytes, world)`` (the link bytes of the plain collective
it stands in for, booked as ``bytes_link_raw``), ``routes`` (its partition of a call, for the
cost model) and ``check_names`` (refusing patterns that match no tensor). The :class:`Call` is
its only access to error feedback. Where the engine needs a call's non-finite flag, a protocol
may carry it in its first round (``Call.take_flag``), saving the engine's own allreduce.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..codecs.base import Codec, TensorContext
from ..comm import Round, ring_allreduce_link
from ..feedback import ErrorFeedback
from ..registry import Registered, lookup
from ..wire import Payload

__all__ = ["Protocol", "Call", "Exchange", "as_protocol", "codec_time", "nested", "finite_flags"]

Exchange = Generator[Round, None, torch.Tensor]


class Protocol(Registered, register=False):
    """Base class of the protocols.

    ``biased``: error feedback defaults to on. ``rounds``: how many rounds every
    exchange takes when the class fixes it (``None``: it depends on the call), so that
    :func:`~gradzip.protocols.parallel.parallel` can align protocols to end together.
    ``flat``: the codec runs on the call's tensors as one (the cost model's unit).

    Args: none here; each protocol documents its own (most take the codec or protocol
    they carry as their first argument).
    """

    kind = "protocol"
    biased: ClassVar[bool] = True
    rounds: ClassVar[int | None] = None
    #: Its codec runs once on a call's tensors back to back (``Flat``): the cost model prices a
    #: call as one tensor of the call's size.
    flat: ClassVar[bool] = False

    def exchange(self, call: Call) -> Exchange:
        raise NotImplementedError

    def plain(self, call: Call) -> bool:
        """Whether this protocol sums every tensor of ``call`` exactly as it is (plain
        allreduce): then a NaN/Inf on any rank shows in the average by itself, and the
        engine needs no flag. Decided from the configuration alone, alike on every rank."""
        return False

    def check_names(self, names) -> None:
        """Raise ``ValueError`` for configuration that refers to tensors none of ``names``
        match (the front end calls it with the model's tensor names)."""

    def link_raw(self, nbytes: int, world: int) -> float:
        """Link bytes of the plain collective this protocol stands in for, on ``nbytes`` of
        gradients (the stats' ``bytes_link_raw``): a ring allreduce, unless the protocol
        replaces another collective (a reduce-scatter sends half of it)."""
        return ring_allreduce_link(nbytes, world)

    def routes(self, layers, world: int) -> list:
        """How a call over ``layers`` (``[(name, shape)]``) splits into methods, for the cost
        model: ``[(method, indices, error feedback)]``; one route, this protocol, by default."""
        return [(self, list(range(len(layers))), self.biased)]


#: From this world size on, a codec whose payloads are not summable travels by
#: ``TwoPhase`` (link bytes ~ 2(N-1)/N of the compressed size) instead of ``AllGather``
#: (~ (N-1) of it): at 2 ranks both send the same, and TwoPhase spends two more rounds and
#: a header per piece; at 3 its lead in bytes is still within its headers for small calls.
TWO_PHASE_FROM = 4


def as_protocol(method, world_size: int | None = None, *, feedback: bool = False) -> Protocol:
    """The protocol that runs ``method``: a protocol as it is; a codec in the protocol it
    names, else ``AllGather`` for a ``scope="call"`` codec, ``Allreduce`` (summable), or for
    the others ``TwoPhase`` from ``TWO_PHASE_FROM`` ranks on and ``AllGather`` below
    (``world_size`` None: AllGather).

    A summable codec whose sum rounds in the wire dtype (``FP16``, ``BF16``) travels by
    ``TwoPhase`` when error feedback is on and there are several ranks: its owners sum in
    float32 and keep the rounding of the re-cast in their own residual, for the link bytes
    of a ring allreduce of the cast payload; an allreduce in float16 would round every
    partial sum and keep that error nowhere."""
    if isinstance(method, Protocol):
        return method
    if isinstance(method, Codec):
        if method.protocol:
            name = method.protocol
        elif method.scope == "call":  # one selection over the whole call: only AllGather keeps it whole
            name = "AllGather"
        elif method.summable and method.rounds_sum and feedback and (world_size or 1) > 1:
            name = "TwoPhase"
        elif method.summable:
            name = "Allreduce"
        else:
            name = "TwoPhase" if world_size is not None and world_size >= TWO_PHASE_FROM else "AllGather"
        return lookup(name)(method)
    raise TypeError(f"expected a gradzip codec or protocol, got {type(method).__name__}")


@dataclass
class Call:
    """One ``Engine.reduce`` call: the tensors, their state, and the means to talk.

    Error feedback goes through the call: :meth:`encode` runs a codec's ``encode`` on
    gradient and residual and stores the new residual; protocols that compute what a
    tensor sent themselves use :meth:`x` (the compensated input) and :meth:`commit`,
    :meth:`skip` or :meth:`set_residual`. A tensor's compensated input is its next
    residual's buffer: read :meth:`x` before that tensor's residual is set, never after.
    """

    comm: object
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
    #: New residuals set during this call, by name (what the engine checks for NaN/Inf).
    updated: dict = field(default_factory=dict, init=False, repr=False)
    #: Names whose error feedback this call leaves alone: they are sent as they are (a
    #: parameter DDP found unused, whose zero gradient must not spend its residual).
    frozen: frozenset = frozenset()
    #: ``(key, dtype) -> TensorContext``: the state of a protocol's own keys (pieces of a
    #: tensor, say), kept and rolled back by the engine like the tensors' own.
    make_context: object = None
    #: Momentum buffers by name (momentum correction, :mod:`gradzip.momentum`): a sparse codec's
    #: payload zeroes them where it sends.
    momentum: dict = field(default_factory=dict, repr=False)
    #: A dry run that wants the bytes only (``dry_run(..., decode=False)``): a nested
    #: exchange is stopped once its last round is launched, its peers never decoded (a
    #: loopback's fabricated peers need not decode), and its result is zeros.
    bytes_only: bool = False
    #: The engine's non-finite flag, when it needs one for this call (the protocol is not
    #: ``plain``): a function giving this rank's flag (0 or 1, or a 0-dim device tensor of it
    #: on the GPU's side) from what the call has built so far. A protocol may carry it
    #: in its first round (:meth:`take_flag`), which saves the engine's own allreduce; else
    #: the engine sends it beside that round.
    flag_source: object = field(default=None, repr=False)
    #: Where every rank's flag will have arrived once the protocol's first round is done
    #: (:meth:`take_flag`), or None.
    flag_seen: torch.Tensor | None = field(default=None, init=False, repr=False)
    #: The call whose flag this sub-call may take (:meth:`subset` with ``flag=True``), or None.
    flag_owner: Call | None = field(default=None, init=False, repr=False)
    #: The engine's GPU side with ``on_nonfinite="skip"``: a list that takes the round's
    #: deferred frame checks (:func:`gradzip.wire.unpack_many`'s ``defer``), which the
    #: protocol hands to ``unpack_many``; None: frames are checked on the host as they arrive.
    frame_checks: list | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.offsets = [0]
        for t in self.tensors:
            self.offsets.append(self.offsets[-1] + t.numel())

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device if self.tensors else torch.device("cpu")

    @property
    def numel(self) -> int:
        return self.offsets[-1]

    @property
    def step(self) -> int:
        """The engine step of this call (its tensors' contexts all carry it; 0 without tensors):
        what every rank's frames of this call were written at."""
        return self.contexts[0].step if self.contexts else 0

    def slice(self, i: int) -> slice:
        return slice(self.offsets[i], self.offsets[i + 1])

    def fitting_dest(self) -> torch.Tensor | None:
        """``dest`` as a flat tensor when it fits this call's result (its dtype, its length,
        contiguous), else None."""
        d = self.dest
        if d is not None and d.dtype == self.out_dtype and d.numel() == self.numel and d.is_contiguous():
            return d.view(-1)
        return None

    def output(self, zero: bool = False) -> torch.Tensor:
        """The flat ``out_dtype`` tensor to write this call's result into: ``dest`` when
        the front end gave one that fits, else a new tensor."""
        d = self.fitting_dest()
        if d is not None:
            return d.zero_() if zero else d
        make = torch.zeros if zero else torch.empty
        return make(self.numel, dtype=self.out_dtype, device=self.device)

    # -- the engine's non-finite flag -------------------------------------------------------
    @property
    def wants_flag(self) -> bool:
        """Whether the engine needs this call's non-finite flag and no protocol has taken it
        (for a sub-call given ``flag=True``: its parent's)."""
        own = self.flag_owner if self.flag_owner is not None else self
        return own.flag_source is not None and own.flag_seen is None

    def take_flag(self, seen: torch.Tensor) -> int | torch.Tensor:
        """Carry the engine's non-finite flag in the protocol's **first** round: returns this
        rank's flag (1: it saw a NaN/Inf, else 0), which the protocol writes into what it
        sends in that round, to every peer that round reaches: a Python int, or on the GPU's
        side (:func:`gradzip.kernels.gpu_side`) a 0-dim tensor of ``seen``'s dtype on the
        call's device, so that no host read waits for the check; either assigns into a tensor
        of that dtype alike. Call it once every tensor has been encoded for the round (the
        flag reads the error-feedback state built so far), and outside a :meth:`codec` block:
        the engine books the time of its check itself.

        ``seen``: the elements that hold, once the round is done, what the ranks wrote
        there: the one element of an allreduce (SUM or MAX; a sum of 0s and 1s is above
        zero iff one is 1, in any floating-point dtype, and a NaN elsewhere in the buffer
        does not reach it), or one element per rank of an all-gather or all-to-all. The
        engine reads a NaN/Inf on some rank iff an element of ``seen`` is above zero. An
        integer ``seen`` of an allreduce must be int32 or int64 (an 8-bit sum could wrap)."""
        if not self.wants_flag:
            raise RuntimeError("this call has no flag to carry (plain, taken already, or past its first round)")
        if not seen.numel():
            raise ValueError("the flag needs at least one element to arrive in")
        if seen.dtype in (torch.bool, torch.complex64, torch.complex128):
            raise ValueError(f"the flag cannot arrive in a {seen.dtype} tensor")
        own = self.flag_owner if self.flag_owner is not None else self
        own.flag_seen = seen
        flag = own.flag_source()
        return flag.to(seen.dtype) if isinstance(flag, torch.Tensor) else int(flag)

    # -- error feedback ------------------------------------------------------------------
    def x(self, i: int) -> torch.Tensor:
        """The tensor to compress: gradient plus residual with error feedback (in a buffer
        of its own), else the gradient. Computed once per call."""
        name = self.names[i]  # keyed by name: sub-calls share the cache with their parent
        if name not in self._x:
            if name in self.updated:
                raise RuntimeError(f"{name!r} was compensated after its residual was set")
            g = self.tensors[i]
            self._x[name] = self.memory.compensate(name, g) if self.feeds(i) else g
        return self._x[name]

    def xs(self, idx: list) -> list:
        """:meth:`x` of the tensors ``idx``, the compensations not made yet made together: one
        copy and one addition over all of them (``torch._foreach_*``, on a GPU a few launches for
        any number of tensors) instead of an operation or two a tensor. The same values as
        :meth:`x` (``g`` in the accumulation dtype, then ``+ r``)."""
        todo = [i for i in idx if self.names[i] not in self._x and self.feeds(i)]
        if len(todo) > 1:
            for i in todo:
                if self.names[i] in self.updated:
                    raise RuntimeError(f"{self.names[i]!r} was compensated after its residual was set")
            gs = [self.tensors[i] for i in todo]
            rs = [self.memory.check_shape(self.names[i], g) for i, g in zip(todo, gs)]
            bufs = [self.memory.buffer(self.names[i], g) for i, g in zip(todo, gs)]
            torch._foreach_copy_(bufs, gs)
            added = [(b, r) for b, r in zip(bufs, rs) if r is not None]
            if added:
                torch._foreach_add_([b for b, _ in added], [r for _, r in added])
            for i, b in zip(todo, bufs):
                self._x[self.names[i]] = b
        return [self.x(i) for i in idx]

    def feeds(self, i: int) -> bool:
        """Whether error feedback applies to tensor ``i`` in this call."""
        return self.memory is not None and self.names[i] not in self.frozen

    def has_x(self, i: int) -> bool:
        return self.names[i] in self._x

    def x_rows(self, i: int, rows: int, visit) -> torch.Tensor:
        """:meth:`x` as a ``(shape[0], -1)`` matrix, with ``visit(start, stop, block)`` called
        on each block of ``rows`` rows in order. A compensation not made yet is made block by
        block, each visited while it is still in cache (the values are those of :meth:`x`)."""
        name, g = self.names[i], self.tensors[i]
        n = g.shape[0] if g.dim() else 1
        if name not in self._x and self.feeds(i):
            r = self.memory.check_shape(name, g)
            c = self.memory.buffer(name, g)
            g2, c2 = g.reshape(n, -1), c.view(n, -1)
            r2 = r.reshape(n, -1) if r is not None else None
            for s in range(0, n, rows):
                e = min(s + rows, n)
                if r2 is None:
                    c2[s:e].copy_(g2[s:e])
                else:  # promotes before adding: g.to(acc) + r, bit for bit
                    torch.add(g2[s:e], r2[s:e], out=c2[s:e])
                visit(s, e, c2[s:e])
            self._x[name] = c
            return c2
        x2 = self.x(i).reshape(n, -1)
        for s in range(0, n, rows):
            visit(s, min(s + rows, n), x2[s : s + rows])
        return x2

    def encode(self, codec: Codec, i: int) -> Payload:
        """Compress tensor ``i`` with ``codec``, storing its new residual (error feedback on)."""
        ctx, name = self.contexts[i], self.names[i]
        if not self.feeds(i):
            return codec.encode(self._x.get(name, self.tensors[i]), ctx)[0]
        v = self._x.pop(name, None)
        if v is not None:  # compensated already: encode it in place
            payload, new = codec.encode(v, ctx, feedback=True, out=v)
        else:
            g = self.tensors[i]
            r = self.memory.check_shape(name, g)
            payload, new = codec.encode(g, ctx, r, feedback=True, out=self.memory.buffer(name, g))
        self._store(name, new)
        self._mask(codec, name, payload, 0, self.tensors[i].numel())
        return payload

    def encode_into(self, codec: Codec, i: int, body: torch.Tensor) -> Payload:
        """Compress tensor ``i`` (error feedback off for it) with its body written into
        ``body`` (:meth:`Codec.compress_into`)."""
        if self.feeds(i):
            raise ValueError(f"{self.names[i]!r} has error feedback: encode it with encode()")
        return codec.compress_into(self._x.get(self.names[i], self.tensors[i]), body, self.contexts[i])

    def encode_all(self, codec: Codec) -> list:
        """:meth:`encode` every tensor of the call. A ``scope="call"`` codec first sees all
        the compensated inputs together and allots each tensor its count
        (:meth:`Codec.allot`, into ``TensorContext.k``)."""
        n = len(self.tensors)
        if codec.scope == "call" and n:
            xs = [self.x(i) if self.feeds(i) else self._x.get(self.names[i], self.tensors[i]) for i in range(n)]
            for ctx, k in zip(self.contexts, codec.allot(xs, self.contexts)):
                ctx.k = k
        return [self.encode(codec, i) for i in range(n)]

    def _mask(self, codec: Codec, name: str, payload: Payload, a: int, b: int) -> None:
        """Momentum factor masking: zero the momentum where a sparse codec sent."""
        u = self.momentum.get(name)
        if u is not None and codec.sparse and b > a:
            piece = u.view(-1)[a:b]
            piece.masked_fill_(codec.sent_mask(payload, b - a), 0.0)

    def encode_pieces(self, codec: Codec, i: int, bounds: list, keys: list) -> list:
        """Encode tensor ``i``'s flat elements ``[bounds[j], bounds[j+1])`` as pieces, each with
        the context of ``keys[j]``; with error feedback the pieces' new residuals make up the
        tensor's (one residual per tensor, however it is cut)."""
        name, t = self.names[i], self.tensors[i]
        ctxs = [self.context(k, t.dtype) for k in keys]
        if not self.feeds(i):
            return codec.encode_pieces(self._x.get(name, t).reshape(-1), bounds, ctxs)
        v = self._x.pop(name, None)
        if v is not None:  # compensated already: encode it in place
            x, r, out = v.view(-1), None, v.view(-1)
        else:
            r = self.memory.check_shape(name, t)
            x, r, out = t.reshape(-1), (r.reshape(-1) if r is not None else None), self.memory.buffer(name, t).view(-1)
        payloads = codec.encode_pieces(x, bounds, ctxs, r, feedback=True, out=out)
        self._store(name, out.view(t.shape))
        for a, b, p in zip(bounds, bounds[1:], payloads):
            self._mask(codec, name, p, a, b)
        return payloads

    def encode_owned(
        self, codec: Codec, key: str, v: torch.Tensor, dtype: torch.dtype, *, feedback: bool = True
    ) -> Payload:
        """Encode ``v``, a value this rank computed (a reduced piece), with a residual of its
        own kept under ``key`` (error feedback on and ``feedback``)."""
        ctx = self.context(key, dtype)
        if self.memory is None or not feedback:
            return codec.encode(v, ctx)[0]
        e = self.memory.residual(key)
        if e is not None and e.shape != v.shape:
            raise ValueError(f"residual for {key!r} has shape {tuple(e.shape)}, the value has {tuple(v.shape)}")
        payload, new = codec.encode(v, ctx, e, feedback=True, out=self.memory.buffer(key, v))
        self._store(key, new)
        return payload

    def commit(self, i: int, sent: torch.Tensor) -> None:
        """Tensor ``i`` contributed ``sent``; with error feedback the rest becomes its residual."""
        if self.feeds(i):
            v = self.x(i)
            self._x.pop(self.names[i])
            self._store(self.names[i], v.sub_(sent.reshape(v.shape)))

    def commit_many(self, idx: list, sents: list) -> None:
        """:meth:`commit` of the tensors ``idx`` (``sents[j]`` what tensor ``idx[j]`` contributed,
        in its shape or any of its element count), by one subtraction over all of them."""
        fed = [(i, s) for i, s in zip(idx, sents) if self.feeds(i)]
        if not fed:
            return
        vs = [self.x(i) for i, _ in fed]
        torch._foreach_sub_(vs, [s if s.shape == v.shape else s.reshape(v.shape) for v, (_, s) in zip(vs, fed)])
        for v, (i, _) in zip(vs, fed):
            self._x.pop(self.names[i])
            self._store(self.names[i], v)

    def skip(self, i: int) -> None:
        """Tensor ``i`` sends nothing this step; with error feedback all of it stays in the residual."""
        if self.feeds(i):
            v = self.x(i)
            self._x.pop(self.names[i])
            self._store(self.names[i], v)

    def set_residual(self, i: int, residual: torch.Tensor) -> None:
        """Store ``residual`` (usually :meth:`x`'s buffer, updated in place) as tensor ``i``'s."""
        if self.feeds(i):
            if residual.shape != self.tensors[i].shape:
                raise ValueError(
                    f"residual of shape {tuple(residual.shape)} for a tensor of {tuple(self.tensors[i].shape)}"
                )
            self._x.pop(self.names[i], None)
            self._store(self.names[i], residual)

    def charge(self, i: int, applied: torch.Tensor) -> None:
        """Tensor ``i`` is frozen (sent as zeros), but the protocol gives every rank one shared
        result instead of the sum of what each rank sent (PowerSGD's ``P Q^T``): with error
        feedback its residual becomes ``r - applied``, what a rank that sent ``g + r`` keeps
        (``g`` is zero here), so that the ranks' residuals and the average still add up to
        what the ranks put in when other ranks used the tensor. ``applied`` is all zero when
        no rank did (DDP then drops the average): the residual is then left as it is."""
        name = self.names[i]
        if self.memory is None or name not in self.frozen or not bool(applied.any()):
            return
        t = self.tensors[i]
        r = self.memory.check_shape(name, t)
        new = self.memory.buffer(name, t)
        if r is None:
            new.zero_()
        else:
            new.copy_(r)
        self._store(name, new.sub_(applied.reshape(t.shape)))

    def _store(self, name: str, new: torch.Tensor) -> None:
        self.memory.set(name, new)
        self.updated[name] = new

    # -- composition ---------------------------------------------------------------------
    def subset(self, idx: list, *, feedback: bool = True, dest: torch.Tensor | None = None, flag: bool = False) -> Call:
        """A call over some of the tensors, sharing state and error feedback (for wrappers).
        ``feedback=False`` runs them without residuals (for routes whose residual would
        stay zero; use it only for tensors that never had one). ``flag=True``: the sub-call's
        protocol may take this call's non-finite flag (:meth:`take_flag`) if its first round
        is this call's first; the first protocol to take it carries it for all."""
        sub = Call(
            comm=self.comm,
            names=[self.names[i] for i in idx],
            tensors=[self.tensors[i] for i in idx],
            contexts=[self.contexts[i] for i in idx],
            memory=self.memory if feedback else None,
            out_dtype=self.out_dtype,
            dest=dest,
        )
        sub._x = self._x  # one compensation per tensor per call, seen by parent and subsets
        sub.updated = self.updated
        sub.frozen = self.frozen
        sub.make_context = self.make_context
        sub.momentum = self.momentum
        sub.frame_checks = self.frame_checks
        if flag:
            sub.flag_owner = self.flag_owner if self.flag_owner is not None else self
        return sub

    def context(self, key: str, dtype: torch.dtype) -> TensorContext:
        """The context (state) of a key of the protocol's own: a piece of a tensor, say."""
        if self.make_context is not None:
            return self.make_context(key, dtype)
        return TensorContext(name=key, step=self.step, dtype=dtype, rank=self.rank, world_size=self.world_size)

    def codec(self):
        """Time a block as codec work (see :func:`codec_time`)."""
        return codec_time(self.comm.stats)


def nested(protocol: Exchange, call: Call | None = None) -> Exchange:
    """Run ``protocol`` inside another one that has rounds after it: its rounds, none of them
    the last (so the communicator waits for each before going on); returns its result.
    With ``call.bytes_only`` (a dry run counting bytes), ``protocol`` is closed after its
    last round and the result is zeros of ``call``'s size: nothing it received is decoded."""
    try:
        rnd = next(protocol)
        while True:
            yield Round(rnd.works, last=False)
            if rnd.last and call is not None and call.bytes_only:
                protocol.close()
                return torch.zeros(call.numel, dtype=call.out_dtype, device=call.device)
            rnd = next(protocol)
    except StopIteration as stop:
        return stop.value


def finite_flags(tensors) -> list[bool]:
    """Whether each tensor holds no NaN or Inf, with one host sync in the common case: a sum is
    non-finite whenever an element is (NaN and +-Inf propagate), and summing reads each tensor
    once without a mask. A non-finite sum of finite values (overflow) is told apart by aminmax,
    which is exact (the engine's checks and WeightGather's flags)."""
    tensors = [t.detach().reshape(-1) for t in tensors]
    if not tensors:
        return []
    sums = [t.sum().float() if t.numel() else torch.zeros((), device=t.device) for t in tensors]
    ok = torch.isfinite(torch.stack(sums)).tolist()
    return [good or bool(torch.isfinite(torch.stack(torch.aminmax(t))).all()) for t, good in zip(tensors, ok)]


@contextmanager
def codec_time(stats):
    """Book a block's wall clock and this thread's CPU time as codec seconds in ``stats``:
    gradzip's own work outside the collectives (the engine's checks included)."""
    t0, c0 = time.perf_counter(), time.thread_time()
    try:
        yield
    finally:
        stats.add(codec_seconds=time.perf_counter() - t0, codec_cpu_seconds=time.thread_time() - c0)
