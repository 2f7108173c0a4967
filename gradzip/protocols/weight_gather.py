"""``WeightGather(codec)``: a compressed all-gather of parameter shards (ZeRO++'s qwZ), for ``gradzip.fsdp``.

FSDP2 all-gathers every parameter group's shards before the forward (and again in the
backward where parameters were resharded): each rank hands in its flat shard, every rank
gets the ``N`` shards back to back. Here each rank encodes its shard of every parameter
with the codec (``Int8(block=B)``: one float32 scale per block of ``B`` elements and one
int8 code per element, as qwZ does; ``FP16()``/``BF16()``: a cast), frames the payloads,
and the framed messages are all-gathered; every rank decodes every rank's frames, its own
included, into the gathered buffer in the output dtype, so every rank computes with the
same weights.

**Weights are not error-fed.** A gradient's compression error is kept in a residual and
sent later; a weight's is not: the full-precision shard stays the source of truth, and
each all-gather quantizes it afresh (the optimizer updates the full-precision shard with
gradients computed at the quantized weights). ``biased`` is therefore false, and the
engine keeps no residuals for this protocol.

**Message.** One uint8 message per rank: ``T`` flag bytes (one per tensor of the call: 1
where this rank's shard holds a NaN or an infinity), then the frames
(:func:`gradzip.wire.pack_frames`). A flagged shard is encoded as zeros and decoded as
NaN on every rank, so a non-finite weight shows in the gathered weights everywhere, as it
would in a plain all-gather, and the engine sends no flag of its own (``plain``). The
codecs allowed write frames whose length follows from the tensor sizes alone (Int8, FP16,
BF16), and every rank's shards have the same padded sizes, so the messages are equal in
length and one all-gather moves them (no length exchange); the engine's first-call
configuration check makes sure every rank runs the same codec on the same layout.

``Identity()`` sends the shards as they are, by one all-gather of the raw tensor, without
frames: FSDP2's own all-gather, bit for bit.

Link bytes per rank: ``(N - 1)`` times the message (a ring all-gather), against ``(N - 1)``
times the raw shard for a plain all-gather (:meth:`link_raw`).
"""

from __future__ import annotations

import torch

from ..codecs.base import Codec
from ..comm import Round
from ..wire import pack_frames, unpack_frames
from .base import Call, Exchange, Protocol, finite_flags

__all__ = ["WeightGather", "GATHER_CODECS"]

#: The codecs a weight all-gather takes: their frames' lengths follow from the tensor sizes.
GATHER_CODECS = ("Identity", "FP16", "BF16", "Int8")


class WeightGather(Protocol, register=False):
    """Each rank's shards encoded with ``codec`` (no error feedback), all-gathered, every
    rank's decoded in rank order (module docstring).

    Args:
        codec: ``Identity()``, ``FP16()``, ``BF16()`` or ``Int8(block=...)`` (not
            ``allreduce=True``).
    """

    rounds = 1
    biased = False  # the full-precision shard is the source of truth: nothing to feed back

    def __init__(self, codec: Codec) -> None:
        name = type(codec).__name__
        if not isinstance(codec, Codec) or name not in GATHER_CODECS or getattr(codec, "allreduce", False):
            raise ValueError(
                f"the parameter all-gather takes {', '.join(c + '()' for c in GATHER_CODECS)} (Int8(block=...) "
                f"without allreduce): codecs whose messages have the same length on every rank; got {codec!r}"
            )
        self.codec = codec

    def plain(self, call: Call) -> bool:
        """A non-finite shard shows in the gathered weights on every rank (flagged, decoded as
        NaN; Identity sends it as it is): the engine needs no flag of its own."""
        return True

    def link_raw(self, nbytes: int, world: int) -> float:
        """A plain ring all-gather sends ``(N - 1)`` times this rank's shard."""
        return float((world - 1) * nbytes)

    def exchange(self, call: Call) -> Exchange:
        world, n = call.world_size, call.numel
        out = _output(call, world * n)
        if type(self.codec).__name__ == "Identity":
            with call.codec():
                flat = (
                    torch.cat([t.reshape(-1).to(call.out_dtype) for t in call.tensors])
                    if call.tensors
                    else torch.empty(0, dtype=call.out_dtype, device=call.device)
                )  # a copy: the inputs may be views of the output (FSDP's all-gather input is)
                call.comm.stats.add(bytes_payload=flat.numel() * flat.element_size())
            yield Round([call.comm.allgather(out, flat)], last=True)
            return out
        codec, count = self.codec, len(call.tensors)
        with call.codec():
            finite = finite_flags(call.tensors)
            payloads = [
                codec.compress(t if ok else torch.zeros_like(t), ctx)
                for t, ctx, ok in zip(call.tensors, call.contexts, finite)
            ]
            flags = torch.tensor([0 if ok else 1 for ok in finite], dtype=torch.uint8, device=call.device)
            msg = torch.cat([flags, pack_frames(payloads, device=call.device)])
            call.comm.stats.add(bytes_payload=msg.numel())
            gathered = torch.empty(world * msg.numel(), dtype=torch.uint8, device=call.device)
        yield Round([call.comm.allgather(gathered, msg)], last=True)
        with call.codec():
            rows = gathered.view(world, -1)
            bad = rows[:, :count].tolist()
            shapes = [p.shape for p in payloads]
            dtypes = [p.dtype for p in payloads]
            grads = [t.dtype for t in call.tensors]
            dest = out.view(world, n)
            for r in range(world):
                frames = unpack_frames(
                    rows[r, count:],
                    shapes,
                    dtypes,
                    grad_dtypes=grads,
                    check=codec,
                    names=call.names,
                    rank=r,
                    step=call.step,
                )
                for i in range(count):
                    seg = dest[r, call.offsets[i] : call.offsets[i + 1]]
                    if bad[r][i]:
                        seg.fill_(float("nan"))
                    else:
                        seg.fill_(-0.0)  # the additive identity: -0.0 + d == d, signed zeros included
                        codec.accumulate(frames[i], seg)
        return out


def _output(call: Call, numel: int) -> torch.Tensor:
    """``call.dest`` where it holds the gathered call (``numel`` elements of the output
    dtype, contiguous), else a new tensor."""
    d = call.dest
    if d is not None and d.dtype == call.out_dtype and d.numel() == numel and d.is_contiguous():
        return d.view(-1)
    return torch.empty(numel, dtype=call.out_dtype, device=call.device)
