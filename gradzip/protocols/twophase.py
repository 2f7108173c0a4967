"""``TwoPhase(codec)``: compressed allreduce whose link bytes do not grow with the world size.

Every tensor of the call is split into ``N`` pieces (``N`` the world size; piece ``j``
holds elements ``[j * n // N, (j + 1) * n // N)``), and rank ``j`` owns piece ``j`` of
every tensor, as FSDP shards parameters. A piece is named after its tensor and place
(``name#j/N``), so its state does not depend on which tensors share a call.

1. **Reduce-scatter.** Every rank encodes each piece of ``gradient + residual`` with the
   codec (its own error feedback: the residual keyed by the tensor's name, as the
   other protocols keep it) and sends owner ``j`` the frames of its pieces ``j``
   (``gradzip.wire`` framing): an all-to-all of the message lengths, then a pairwise
   all-to-all of the messages (a ``fixed_frames`` codec skips the lengths). The engine's
   non-finite flag rides in the first of these (``Call.take_flag``). Owner ``j`` decodes
   every sender's frames in rank order into float32 (float64 for float64 gradients) and
   divides by ``N``: the average of its pieces.
2. **All-gather.** Owner ``j`` encodes its averaged pieces again with the codec, with a
   second error-feedback memory of its own (keyed ``name#j/N:owner``, in the units of
   the average), so nothing is lost: sparse codecs re-sparsify the sum (a global top-k
   of the reduced piece, gTop-k style), quantizers re-quantize it. The owners' messages
   are all-gathered (an allreduce MAX of the length, then the messages padded to it)
   and every rank decodes every owner's pieces: every rank holds the same floats.

Planned frames (the engine's GPU side, a codec with
:meth:`~gradzip.codecs.base.Codec.planned_entry`): the owners check the first round's messages on
the device (``wire.unpack_many``'s ``defer``), and each owner's verdict rides as one byte after
its phase-2 message, so a malformed first-round message turns the call's result NaN on every
rank; the owner that found it raises its :class:`~gradzip.wire.FrameError` at its next call,
the other ranks one naming that owner. A fault in the second round is seen by its receiver
alone: that rank's result is NaN and it raises at its next call.

Link bytes per rank are about ``2(N-1)/N`` of the compressed size of the call, like a
ring allreduce of it, against ``(N-1)`` for :class:`~gradzip.protocols.AllGather`.

Mass: with sender residuals ``r`` and owner residuals ``e`` (average units), every
step keeps ``N * applied + sum_ranks r' + N * e' == sum_ranks (g + r) + N * e`` up to
float rounding. A step that turns out non-finite restores both memories.
"""

from __future__ import annotations

import torch

import gradzip.kernels as K

from ..codecs.base import Codec
from ..comm import Round, allgather_bytes, allgather_fixed
from ..wire import (
    FrameError,
    accum_dtype,
    message_capacity,
    message_nbytes,
    narrow,
    pack_frames,
    pack_round,
    unpack_many,
)
from .base import Call, Exchange, Protocol

__all__ = ["TwoPhase", "reduce_scatter_pieces", "piece_bounds", "piece_key", "owner_key"]


def piece_bounds(n: int, world: int) -> list[int]:
    """``world + 1`` offsets: piece ``j`` of ``n`` elements is ``[b[j], b[j+1])``."""
    return [j * n // world for j in range(world + 1)]


def piece_key(name: str, j: int, world: int) -> str:
    return f"{name}#{j}/{world}"


def owner_key(name: str, j: int, world: int) -> str:
    """The owner's second error-feedback memory (and codec state) for piece ``j``."""
    return f"{piece_key(name, j, world)}:owner"


class TwoPhase(Protocol):
    """A compressed reduce-scatter (each rank owns one piece of every tensor), then the
    owners re-encode their averaged pieces with their own error feedback and all-gather
    them: about ``2(N-1)/N`` of the compressed call per rank (module docstring).

    Args:
        codec: any framable codec (non-summable ones, or ``FP16``/``BF16`` with error
            feedback).
    """

    def __init__(self, codec: Codec) -> None:
        if not isinstance(codec, Codec) or not codec.framable:
            raise ValueError(f"codec must be a gradzip codec whose payloads travel in frames, got {codec!r}")
        if codec.average != "ranks":
            raise ValueError(f"TwoPhase averages over the world size: {codec!r} needs AllGather")
        if codec.scope == "call":
            raise ValueError(
                f"TwoPhase cuts every tensor into pieces that their owners encode again, so {codec!r} cannot choose "
                f"over the whole call: use AllGather({codec!r}), or scope='tensor'"
            )
        self.codec = codec

    @property
    def biased(self) -> bool:  # type: ignore[override]
        return self.codec.biased

    @property
    def rounds(self) -> int:  # type: ignore[override]
        return 2 if self.codec.fixed_frames else 4

    def exchange(self, call: Call) -> Exchange:
        codec, world, me = self.codec, call.world_size, call.rank
        count = len(call.tensors)
        bounds = [piece_bounds(t.numel(), world) for t in call.tensors]
        caps: list = []
        # Planned frames (the engine's GPU side): the first round's checks stay on the device,
        # and each owner's verdict rides as one byte after its message to every rank.
        checks = call.frame_checks
        relay = checks is not None and codec.fixed_frames and codec.plans_frames
        mark = len(checks) if checks is not None else 0
        owned = yield from reduce_scatter_pieces(call, codec, bounds, caps, defer=checks if relay else None)
        with call.codec():
            acc_dtype = accum_dtype(call.out_dtype)
            # Phase 2: the owner's pieces, re-encoded with the owner's own error feedback.
            # A piece every rank found unused (DDP drops its average) is all zeros: it is sent as it
            # is, and the owner's residual waits for a step where the parameter is used.
            again = [
                call.encode_owned(
                    codec,
                    owner_key(call.names[i], me, world),
                    owned[i],
                    call.tensors[i].dtype,
                    feedback=not (call.names[i] in call.frozen and not bool(owned[i].any())),
                )
                for i in range(count)
            ]
            # Fixed frames: packed at the agreed length, so allgather_fixed sends it without a copy.
            extra = 1 if relay else 0
            msg = pack_frames(again, device=call.device, size=max(caps) + extra if caps else None)
            call.comm.stats.add(bytes_payload=message_nbytes(again))
            if relay:
                mine = [f for f, _ in checks[mark:]]
                seen = torch.stack(mine).any() if mine else torch.zeros((), dtype=torch.bool, device=call.device)
                msg[-1:].copy_(seen.reshape(1))
                call.comm.stats.add(bytes_control=1)
        if caps:  # fixed frames: every owner's message fits the largest phase-1 message to an owner
            gathered = yield from allgather_fixed(call.comm, msg, max(caps) + extra)
            if relay:
                verdicts, gathered = gathered[:, -1], gathered[:, :-1]
                checks.append(((verdicts != 0).any(), _peer_refusal(verdicts, call.step)))
        else:
            gathered = yield from allgather_bytes(call.comm, msg)
        with call.codec():
            out = call.output(zero=acc_dtype == call.out_dtype)
            acc = out if acc_dtype == call.out_dtype else torch.zeros(call.numel, dtype=acc_dtype, device=call.device)
            dtypes = [again[i].dtype for i in range(count)]
            grads = [call.tensors[i].dtype for i in range(count)]
            owners = unpack_many(  # every owner's message: a few host syncs in all
                list(gathered.unbind(0)),  # the rows, by one operation
                [[torch.Size([bounds[i][j + 1] - bounds[i][j]]) for i in range(count)] for j in range(world)],
                [dtypes] * world,
                grad_dtypes=[grads] * world,
                check=codec,
                names=[[owner_key(call.names[i], j, world) for i in range(count)] for j in range(world)],
                ranks=list(range(world)),
                step=call.step,
                defer=checks,
            )
            frames = [p for got in owners for p in got]
            starts = [call.offsets[i] + bounds[i][j] for j in range(world) for i in range(count)]
            # Every owner's piece of every tensor into its own range: together (one launch on CUDA).
            codec.accumulate_segments(frames, acc, starts)
            if acc is not out:
                out.copy_(narrow(acc, out.dtype))
        return out


def _peer_refusal(verdicts: torch.Tensor, step: int):
    """The refusal of a rank that saw no fault itself: which owners refused a message of the
    first round (each raises the error naming the frame)."""

    def refuse() -> FrameError:
        who = [j for j, v in enumerate(verdicts.tolist()) if v]
        return FrameError(
            "peer",
            f"rank(s) {who} refused a corrupt message of this call's reduce-scatter at step {step} "
            "(their own error names the frame and its sender)",
        )

    return refuse


def reduce_scatter_pieces(
    call: Call, codec: Codec, bounds: list, caps: list | None = None, defer: list | None = None
) -> Exchange:
    """Phase 1 of :class:`TwoPhase`, a compressed reduce-scatter (also the whole of
    :class:`~gradzip.protocols.reduce_scatter.ReduceScatter`): every rank encodes piece
    ``j`` (elements ``[bounds[i][j], bounds[i][j+1])`` of tensor ``i``) of ``gradient +
    residual`` with the codec (its own error feedback, the residual keyed by the tensor's
    name, the codec state by :func:`piece_key`) and sends owner ``j`` the frames of its
    pieces ``j`` (an all-to-all of the message lengths, then a pairwise all-to-all of the
    messages). Returns this rank's pieces, one flat tensor per tensor: every sender's
    frames decoded in rank order into the accumulation dtype and divided by the world size.

    A ``fixed_frames`` codec skips the lengths' all-to-all: the frames a sender writes for
    owner ``j`` are as long as this rank's own for ``j``, so every message to ``j`` is padded
    to :func:`~gradzip.wire.message_capacity` of them, and the pairwise all-to-all is the only
    round. ``caps`` (a list) then receives those capacities, one per owner.

    ``defer``: the senders' messages are checked on the device where the codec plans them
    (:func:`~gradzip.wire.unpack_many`'s ``defer``); only this rank sees the verdict, so the
    caller must hand it on (TwoPhase sends it after its all-gather's message).
    """
    world, me = call.world_size, call.rank
    count = len(call.tensors)
    with call.codec():
        sent = [
            call.encode_pieces(codec, i, bounds[i], [piece_key(call.names[i], j, world) for j in range(world)])
            for i in range(count)
        ]
        groups = [[sent[i][j] for i in range(count)] for j in range(world)]  # owner j's frames
        own = [message_nbytes(g) for g in groups]
        call.comm.stats.add(bytes_payload=sum(own))
        # The engine's non-finite flag rides in the first round (Call.take_flag): a second int64
        # beside each length, or, for fixed frames, one more byte after each message.
        flag = call.wants_flag
        extra = 1 if codec.fixed_frames and flag else 0
        if codec.fixed_frames:
            fixed = [message_capacity(g) for g in groups]
            if caps is not None:
                caps[:] = fixed
        sizes = [c + extra for c in fixed] if codec.fixed_frames else own
        # Every owner's message packed (and padded) straight into its slice of the send buffer.
        send = torch.empty(sum(sizes), dtype=torch.uint8, device=call.device)
        msgs = pack_round(groups, send, sizes)
    if codec.fixed_frames:
        in_splits, out_splits = [c + extra for c in fixed], [fixed[me] + extra] * world
    else:
        sizes_ = [[m.numel(), 0] for m in msgs] if flag else [m.numel() for m in msgs]
        lengths = K.host_to_device(torch.tensor(sizes_, dtype=torch.int64), call.device)
        got_len = torch.empty_like(lengths)
        if flag:
            lengths[:, 1] = call.take_flag(got_len[:, 1])
        yield Round([call.comm.alltoall(got_len.view(-1), lengths.view(-1), control=True)])
        lens, got = (lengths[:, 0], got_len[:, 0]) if flag else (lengths, got_len)
        in_splits, out_splits = lens.tolist(), got.tolist()
    recv = torch.empty(sum(out_splits), dtype=torch.uint8, device=call.device)
    if extra:
        ends = K.host_to_device(torch.tensor(in_splits).cumsum(0) - 1, call.device)  # each message's last byte
        send[ends] = call.take_flag(recv.view(world, fixed[me] + 1)[:, -1])
        call.comm.stats.add(bytes_control=world)
    yield Round([call.comm.alltoall(recv, send, out_splits, in_splits)])
    with call.codec():
        acc_dtype = accum_dtype(call.out_dtype)
        mine = [(bounds[i][me], bounds[i][me + 1]) for i in range(count)]
        shapes = [torch.Size([b - a]) for a, b in mine]
        dtypes = [acc_dtype if call.feeds(i) else call.tensors[i].dtype for i in range(count)]
        if len(set(out_splits)) == 1:  # the senders' messages, by one operation
            msgs = list(recv.view(world, out_splits[0])[:, : out_splits[0] - extra].unbind(0))
        else:
            msgs, pos = [], 0
            for s in range(world):
                msgs.append(recv[pos : pos + out_splits[s] - extra])
                pos += out_splits[s]
        names = [piece_key(call.names[i], me, world) for i in range(count)]
        frames = unpack_many(  # every sender's message: a few host syncs in all
            msgs,
            [shapes] * world,
            [dtypes] * world,
            grad_dtypes=[[t.dtype for t in call.tensors]] * world,
            check=codec,
            names=[names] * world,
            ranks=list(range(world)),
            step=call.step,
            defer=defer,
        )
        owned = []
        for i in range(count):
            acc = torch.zeros(shapes[i].numel(), dtype=acc_dtype, device=call.device)
            codec.accumulate_many([frames[s][i] for s in range(world)], acc)  # senders in rank order
            owned.append(acc.div_(world))
    return owned
