"""``Flat(codec)``: a call's tensors compressed as one tensor, for codecs whose cost is per call.

A DDP bucket holds some thirty tensors; most protocols run their codec on each (and
``TwoPhase`` on each of its ``N`` pieces), so a ResNet-50 step at 8 ranks is some 1,500
encodes and as many decodes. On a GPU each is a few kernel launches and their Python, and that,
not the bytes, is what a step's codec time is made of (``docs/kernels.md``). ``Flat(codec)``
runs ``codec`` (carried by the protocol :func:`~gradzip.protocols.base.as_protocol`
gives it) on **one** tensor: the call's tensors back to back, in the call's
order, as DDP lays them out in its bucket. The result has the call's layout, so it is the
call's average as it is.

What changes is the codec's unit: a quantizer's scale, a top-k's ``k`` and a threshold's
statistics are the concatenation's, not each layer's; blocks may straddle two tensors. Codecs
with one scale per block (``Int8()``, ``SignSGD(block=...)``, ``TernGrad(block=...)``) change
least; ``TopK(ratio)`` becomes a top-k over the bucket.

Error feedback stays per tensor. The flat compensated input ``g + r`` is built in one buffer,
and once encoded its residual is stored as views of that buffer, one per tensor, under the
tensors' own names: checkpoints, ``reshard``, the engine's non-finite check and its rollback
see per-tensor residuals as with any other protocol. The next step finds the residuals (and the
spare buffers) as consecutive views of one buffer and reads them as one tensor, with no copy;
after a change of the call's tensors (DDP's bucket rebuild, a restored checkpoint) they are
gathered once. A tensor whose error feedback is frozen for the call (a parameter DDP found
unused) is sent as it is and keeps its residual.

``TwoPhase``'s owner memory (the error of re-encoding this rank's piece of the average) is
handed back the same step: ``N`` times it is added to this rank's residual of the same
elements, mass for mass what the owner would have added to the next average. So every
residual stays under a tensor's name, and a change of the call's tensors loses nothing. (A
frozen tensor's share of it is added to that tensor's residual.) The codec's own state, where
it keeps one (a sampled top-k's threshold, say), lives under the call's key,
``flat:<count>:<hash of the names and sizes>``, and starts afresh when the call's tensors change.

Momentum correction (``gradzip.momentum``) masks the momentum of the flat tensor where a sparse
codec sent and copies it back to the tensors' buffers.
"""

from __future__ import annotations

import hashlib

import torch

from ..codecs.base import Codec
from ..wire import accum_dtype, run_view
from .base import Call, Exchange, Protocol, as_protocol

__all__ = ["Flat", "check_unused", "flat_codecs", "flat_key"]


def flat_key(names, tensors) -> str:
    """The key of a call's flat tensor: its count and a hash of its tensors' names and sizes."""
    h = hashlib.sha1()
    for n, t in zip(names, tensors):
        h.update(f"{n}\0{t.numel()}\0".encode())
    return f"flat:{len(names)}:{h.hexdigest()[:16]}"


def flat_codecs(method) -> list:
    """The codec of every ``Flat`` inside ``method`` (a protocol's, a policy's or a menu's
    methods, walked through their attributes), in the order met."""
    found, seen, todo = [], set(), [method]
    while todo:
        obj = todo.pop(0)
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, Flat):
            found.append(obj.codec)
        if isinstance(obj, (Codec, Protocol)):
            todo.extend(vars(obj).values())
        elif isinstance(obj, (list, tuple)):
            todo.extend(obj)
        elif isinstance(obj, dict):
            todo.extend(obj.values())
    return found


def check_unused(method) -> None:
    """Refuse a ``Flat`` of a codec that does not send zeros as zeros (``Codec.keeps_zeros``:
    SignSGD, DCT) where parameters may go unused (DDP's ``find_unused_parameters=True``): the
    unused tensor's range of the flat tensor would carry the codec's values (``+S``) into the
    average, and its error feedback could not keep the mass. A ``ValueError`` on every rank,
    at registration."""
    for codec in flat_codecs(method):
        if not codec.keeps_zeros:
            raise ValueError(
                f"Flat({codec!r}) cannot leave a parameter DDP finds unused (find_unused_parameters=True) "
                f"out of the average: {type(codec).__name__} does not send zeros as zeros, so the unused "
                f"tensor's range would carry values and lose its error feedback; use {codec!r} without Flat, "
                "a codec that keeps zeros (Flat(Int8()), Flat(TopK(0.01)), ...), or find_unused_parameters=False"
            )


class _Spread:
    """The inner call's error-feedback memory: it keeps nothing under the flat key itself.

    * The flat tensor's new residual is stored as views of its buffer, one per tensor under
      the tensor's own name (through the outer call's ``_store``, so the engine sees each and
      can roll it back).
    * ``TwoPhase``'s owner memory of this rank's piece (``<key>#j/N:owner``, in units of the
      average) is handed back at once: ``N`` times it is added to this rank's residual of the
      same elements, which is mass for mass what the owner would have added to the next
      average, so no residual is kept under a key that DDP's bucket rebuild would orphan.
    * Any other key is refused (``Flat`` carries codecs, whose protocols keep no other).
    """

    def __init__(self, call: Call, key: str) -> None:
        self.call, self.key = call, key
        self.flat: torch.Tensor | None = None  # the flat residual stored this call
        # The per-tensor spares the compensated buffer was built in (``Flat._compensate``):
        # when the flat residual is that buffer, they are its per-tensor views already.
        self.views: list | None = None

    def _owner_piece(self, name: str) -> tuple[int, int]:
        """The flat range of this rank's owner key ``name``, or a RuntimeError."""
        call, world = self.call, self.call.world_size
        head, sep, tail = name.rpartition(":owner")
        if sep and not tail and head == f"{self.key}#{call.rank}/{world}":
            n = call.numel
            return call.rank * n // world, (call.rank + 1) * n // world
        raise RuntimeError(f"Flat keeps no residual under {name!r}: only its tensors' and its owner piece's")

    def residual(self, name: str):
        self._owner_piece(name)
        return None  # handed back every step (class docstring)

    def check_shape(self, name: str, grad: torch.Tensor):
        raise RuntimeError("Flat compensates its tensor itself: the inner call must not ask for its residual")

    def compensate(self, name: str, grad: torch.Tensor, out=None) -> torch.Tensor:
        raise RuntimeError("Flat compensates its tensor itself")

    def buffer(self, name: str, like: torch.Tensor) -> torch.Tensor:
        self._owner_piece(name)
        return torch.empty(like.shape, dtype=accum_dtype(like.dtype), device=like.device)

    def set(self, name: str, new: torch.Tensor) -> None:
        call = self.call
        if name == self.key:
            self.flat = flat = new.reshape(-1)
            views = self.views
            if views is None or views[0].data_ptr() != flat.data_ptr() or views[0].dtype != flat.dtype:
                views = None  # a new buffer (the first steps, a change of layout): cut it
            for i, t in enumerate(call.tensors):
                if call.feeds(i):
                    call._store(call.names[i], views[i] if views else flat[call.slice(i)].view(t.shape))
            return
        a, b = self._owner_piece(name)
        if self.flat is None:
            raise RuntimeError(f"{name!r} came before the flat tensor's own residual")
        e = new.reshape(-1)
        self.flat[a:b].add_(e, alpha=call.world_size)
        for i, t in enumerate(call.tensors):  # a frozen tensor's range is not in the flat residual
            lo, hi = max(a, call.offsets[i]), min(b, call.offsets[i + 1])
            if call.feeds(i) or lo >= hi:
                continue
            r = call.memory.check_shape(call.names[i], t)
            own = (
                torch.zeros(t.numel(), dtype=e.dtype, device=e.device)
                if r is None
                else r.reshape(-1).to(e.dtype, copy=True)
            )
            own[lo - call.offsets[i] : hi - call.offsets[i]].add_(e[lo - a : hi - a], alpha=call.world_size)
            call._store(call.names[i], own.view(t.shape))


class Flat(Protocol):
    """Run ``codec`` on the call's tensors as one flat tensor (module docstring): a codec's
    work per call instead of per tensor, error feedback still kept per tensor.

    Args:
        codec: a gradzip codec, carried by the protocol :func:`as_protocol` gives it for
            the world size (``TwoPhase`` from 4 ranks for the quantizers and top-k).
    """

    flat = True

    def __init__(self, codec: Codec) -> None:
        if not isinstance(codec, Codec):
            raise TypeError(
                f"Flat carries a codec (a protocol keeps state Flat cannot hand back), got {type(codec).__name__}"
            )
        self.codec = codec

    @property
    def biased(self) -> bool:  # type: ignore[override]
        return self.codec.biased

    # -- the flat input ------------------------------------------------------------------------
    @staticmethod
    def _gradient(call: Call) -> torch.Tensor:
        dtypes = {t.dtype for t in call.tensors}
        if len(dtypes) > 1:
            raise ValueError(
                f"Flat needs the tensors of a call in one dtype (DDP's buckets are), got {sorted(map(str, dtypes))}"
            )
        g = run_view(call.tensors)
        return g if g is not None else torch.cat([t.reshape(-1) for t in call.tensors])

    @staticmethod
    def _compensate(call: Call, g: torch.Tensor, spread: _Spread) -> torch.Tensor:
        """``g + r`` for the flat tensor, in a buffer that becomes its residual: the tensors'
        spares when they lie back to back (``spread.views`` then holds them), else a new one;
        a frozen tensor's range holds its gradient alone."""
        mem, acc = call.memory, accum_dtype(g.dtype)
        rs = [mem.check_shape(n, t) for n, t in zip(call.names, call.tensors)]
        spares = [mem.buffer(n, t) for n, t in zip(call.names, call.tensors)]
        c = run_view(spares)
        if c is None or c.dtype != acc or c.device != g.device:
            c = torch.empty(g.numel(), dtype=acc, device=g.device)
        else:
            spread.views = spares
        r = run_view(rs)
        if r is not None and r.dtype == acc:
            torch.add(g, r, out=c)  # promotes before adding: g.to(acc) + r, bit for bit
        elif all(x is None for x in rs):
            c.copy_(g)
        else:  # gathered once after a change of layout
            for i, x in enumerate(rs):
                piece = c[call.slice(i)]
                if x is None:
                    piece.copy_(g[call.slice(i)])
                else:
                    torch.add(g[call.slice(i)], x.reshape(-1), out=piece)
        for i, t in enumerate(call.tensors):
            if not call.feeds(i):  # frozen: sent as it is, its residual left alone
                c[call.slice(i)].copy_(t.reshape(-1))
        return c

    def exchange(self, call: Call) -> Exchange:
        if not call.tensors:
            return torch.empty(0, dtype=call.out_dtype, device=call.device)
        with call.codec():
            key = flat_key(call.names, call.tensors)
            g = self._gradient(call)
            memory = _Spread(call, key) if call.memory is not None else None
            sub = Call(
                comm=call.comm,
                names=[key],
                tensors=[g],
                contexts=[call.context(key, g.dtype)],
                memory=memory,
                out_dtype=call.out_dtype,
                dest=call.dest,
            )
            sub.make_context = call.make_context
            sub.bytes_only = call.bytes_only
            sub.flag_owner = call.flag_owner if call.flag_owner is not None else call
            sub.frame_checks = call.frame_checks
            if memory is not None:
                sub._x[key] = self._compensate(call, g, memory)
            moments = None
            if call.momentum:
                moments = [call.momentum.get(n) for n in call.names]
                sub.momentum = {
                    key: torch.cat(
                        [
                            torch.zeros(t.numel(), dtype=g.dtype, device=g.device) if u is None else u.reshape(-1)
                            for u, t in zip(moments, call.tensors)
                        ]
                    )
                }
        proto = as_protocol(self.codec, call.world_size, feedback=call.memory is not None)
        out = yield from proto.exchange(sub)
        if moments is not None:
            with call.codec():
                flat_u = sub.momentum[key]
                for i, u in enumerate(moments):
                    if u is not None:
                        u.view(-1).copy_(flat_u[call.slice(i)])
        return out
