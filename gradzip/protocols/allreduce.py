"""``Allreduce(codec)``: summable payloads, concatenated and summed by one allreduce.

The payload bodies of the call's tensors are concatenated into one tensor of
the wire dtype, pre-divided by the world size (as DDP does, so that the sum
cannot overflow the wire dtype) and allreduced; every tensor is then decoded
from its slice of the sum. Identity on DDP's bucket sends no copy and makes no payload: the
gradients already lie back to back in the bucket, which is also where the
result goes, so the bucket is reduced in place, as DDP's own hook does.
Where the protocol builds a buffer of its own and the engine wants its non-finite
flag (a call that is not ``plain``), the flag rides as one more element after the
bodies (``Call.take_flag``): one allreduce per call in all.
"""

from __future__ import annotations

import functools

import torch

from ..codecs.base import Codec
from ..comm import Round
from ..wire import Payload
from .base import Call, Exchange, Protocol

__all__ = ["Allreduce", "back_to_back"]


class Allreduce(Protocol):
    """One allreduce of the call's summable payloads, concatenated and pre-divided by the
    world size (DDP's own allreduce for ``Identity``).

    Args:
        codec: a summable codec (``Identity``, ``FP16``, ``BF16``, ``RandomK``).
    """

    rounds = 1

    def __init__(self, codec: Codec) -> None:
        if not isinstance(codec, Codec) or not codec.summable:
            raise ValueError(f"codec must be a summable gradzip codec, got {codec!r}")
        self.codec = codec

    @property
    def biased(self) -> bool:  # type: ignore[override]
        return self.codec.biased

    def plain(self, call: Call) -> bool:
        return self.codec.exact and call.memory is None

    def exchange(self, call: Call) -> Exchange:
        codec = self.codec
        bucket = back_to_back(call.tensors, call.dest) if self.plain(call) else None
        if bucket is not None and bucket.dtype == call.out_dtype:
            # DDP's bucket, summed as it is: no payload a tensor, no decode (and no room for the
            # engine's flag, which then goes alone)
            with call.codec():
                bucket.div_(call.world_size)
                call.comm.stats.add(bytes_payload=bucket.numel() * bucket.element_size())
            yield Round([call.comm.allreduce(bucket)], last=True)
            return bucket
        with call.codec():
            # A buffer of our own has room for the engine's non-finite flag after the bodies.
            spare = 1 if call.wants_flag else 0
            wire = _wire_buffer(codec, call, spare)
            flat = None if wire is None else wire[: call.numel]
            if flat is not None:  # a cast's bodies, written straight into the wire buffer
                payloads = [call.encode_into(codec, i, flat[call.slice(i)]) for i in range(len(call.tensors))]
            else:
                payloads = [call.encode(codec, i) for i in range(len(call.tensors))]
            bodies = [p.body.reshape(-1) for p in payloads]
            if flat is None:
                dtype = (
                    functools.reduce(torch.promote_types, [b.dtype for b in bodies], bodies[0].dtype)
                    if bodies
                    else call.out_dtype
                )
                target = _cat_target(bodies, call) if bodies else None
                n = sum(b.numel() for b in bodies)
                wire = target if target is not None else torch.empty(n + spare, dtype=dtype, device=call.device)
                flat = wire[:n]
                if bodies:
                    torch.cat(bodies, out=flat)
            flat.div_(call.world_size)  # pre-divide, as DDP does, so sums cannot overflow the wire dtype
            call.comm.stats.add(bytes_payload=flat.numel() * flat.element_size())
            if wire.numel() > flat.numel() and wire.is_floating_point():  # the flag: 0 or 1, summed
                call.comm.stats.add(bytes_control=wire.element_size())
            else:
                wire = flat
        if wire is not flat:
            wire[-1] = call.take_flag(wire[-1:])
        yield Round([call.comm.allreduce(wire)], last=True)
        with call.codec():
            if flat.dtype != call.out_dtype:  # flat is not dest: decode straight into the output
                out, pos = call.output(), 0
                for i, p in enumerate(payloads):
                    k = p.body.numel()
                    body = flat[pos : pos + k]
                    summed = Payload(body=body, shape=p.shape, dtype=p.dtype, vdtype=p.vdtype, local=p.local)
                    codec.decompress_into(summed, out[call.slice(i)])
                    pos += k
                return out
            decoded, in_place, pos = [], True, 0
            for p in payloads:
                k = p.body.numel()
                summed = Payload(body=flat[pos : pos + k], shape=p.shape, dtype=p.dtype, vdtype=p.vdtype, local=p.local)
                d = codec.decompress(summed).reshape(-1)
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


def _wire_buffer(codec: Codec, call: Call, spare: int = 0) -> torch.Tensor | None:
    """One flat buffer for all of the call's bodies (and ``spare`` elements after them) where
    the codec writes each tensor's elements one for one in a dtype of their own
    (:meth:`Codec.dense_wire`: a cast) and no tensor has error feedback; else None."""
    n = len(call.tensors)
    if not n or any(call.feeds(i) for i in range(n)):
        return None
    wires = {codec.dense_wire(t.dtype) for t in call.tensors}
    if len(wires) != 1 or None in wires:
        return None
    return torch.empty(call.numel + spare, dtype=wires.pop(), device=call.device)


def back_to_back(bodies, dest: torch.Tensor | None) -> torch.Tensor | None:
    """``dest[:n]`` when the tensors ``bodies`` are its consecutive pieces from its start
    (DDP's bucket gradients), else None."""
    if dest is None or not bodies or not dest.is_contiguous():
        return None
    flat = dest.view(-1)
    pos = 0
    for b in bodies:
        if b.dtype != flat.dtype or not b.is_contiguous():
            return None
        if b.numel() and (
            b.untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()
            or b.data_ptr() != flat.data_ptr() + pos * flat.element_size()
        ):
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
