"""``AllGather(codec)``: every rank's frames all-gathered, every peer decoded.

Each rank frames the payloads of the call's tensors into one byte message
(:func:`gradzip.wire.pack_frames`); the ranks agree on the longest message
(allreduce MAX of its length: gloo refuses uneven all-gathers) and all-gather
the messages padded to it. A codec whose frames' lengths follow from the tensors'
shapes alone (``fixed_frames``: the quantizers, the casts) needs no agreement: every
rank pads its message to :func:`gradzip.wire.message_capacity` and the all-gather is
the only round, issued as the call is submitted, so that it overlaps the backward
pass on gloo too (later rounds wait for the front end's flush there). The engine's
non-finite flag rides in the first round: one more int64 in the length's allreduce,
or one more byte after each fixed-length message. Every rank decodes every peer's frames, tensor by
tensor and peers in rank order, into one float32 buffer (float64 for float64
gradients), so every rank computes the same floats, and divides by the world
size. Bytes handed to the collectives grow with the world size: ``(N - 1)``
messages arrive at each rank.
"""

from __future__ import annotations

import torch

from ..codecs.base import Codec
from ..comm import allgather_bytes, allgather_fixed
from ..wire import accum_dtype, message_capacity, message_nbytes, narrow, pack_frames, unpack_many
from .base import Call, Exchange, Protocol

__all__ = ["AllGather"]


class AllGather(Protocol):
    """Framed payloads of any codec: an allreduce(MAX) of the message length (none for a
    ``fixed_frames`` codec), then an all-gather of the padded messages; every peer decoded in
    rank order.

    Args:
        codec: a codec whose payloads decode from their frame alone (``framable``).
    """

    def __init__(self, codec: Codec) -> None:
        if not isinstance(codec, Codec) or not codec.framable:
            raise ValueError(f"codec must be a gradzip codec whose payloads travel in frames, got {codec!r}")
        self.codec = codec

    @property
    def biased(self) -> bool:  # type: ignore[override]
        return self.codec.biased

    @property
    def rounds(self) -> int:  # type: ignore[override]
        return 1 if self.codec.fixed_frames else 2

    def exchange(self, call: Call) -> Exchange:
        codec = self.codec
        with call.codec():
            payloads = call.encode_all(codec)
            # Fixed frames: packed at the agreed length (and the engine's flag byte, which rides
            # in the first round: Call.take_flag), so allgather_fixed sends it without a copy.
            cap = message_capacity(payloads) if codec.fixed_frames else None
            size = None if cap is None else cap + (1 if call.wants_flag else 0)
            msg = pack_frames(payloads, device=call.device, size=size)
            call.comm.stats.add(bytes_payload=message_nbytes(payloads))
        if codec.fixed_frames:
            gathered = yield from allgather_fixed(call.comm, msg, cap, call=call)
        else:
            gathered = yield from allgather_bytes(call.comm, msg, call=call)
        with call.codec():
            shapes = [p.shape for p in payloads]
            dtypes = [p.dtype for p in payloads]
            acc_dtype = accum_dtype(call.out_dtype)
            if acc_dtype == call.out_dtype:
                acc = call.output(zero=True)  # every input was encoded before the first round
            else:
                acc = torch.zeros(call.numel, dtype=acc_dtype, device=call.device)
            grads = [c.dtype for c in call.contexts]  # what each frame's encoder was told (ctx.dtype)
            world = call.world_size
            frames = unpack_many(  # every peer's message: a few host syncs in all
                list(gathered.unbind(0)),  # the rows, by one operation
                [shapes] * world,
                [dtypes] * world,
                grad_dtypes=[grads] * world,
                check=codec,
                names=[call.names] * world,
                ranks=list(range(world)),
                step=call.step,
                defer=call.frame_checks,
            )
            senders = codec.average == "senders"
            for i in range(len(payloads)):
                # Each tensor's peers in fixed rank order: every rank computes the same floats.
                peers = [frames[r][i] for r in range(call.world_size)]
                if senders:
                    codec.average_senders(peers, acc[call.slice(i)])
                else:
                    codec.accumulate_many(peers, acc[call.slice(i)])
            if not senders:
                acc.div_(call.world_size)
        return narrow(acc, call.out_dtype)
