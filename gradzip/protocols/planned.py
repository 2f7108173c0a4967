"""Planned ``Flat(Int8())`` and ``Flat(SignSGD())`` buckets: a bucket's two ``TwoPhase`` rounds
from a plan built once.

On the engine's GPU side with ``on_nonfinite="skip"`` (``Engine._run_on_device``), a call of
``Flat(Int8(block=b))`` (``b`` within a program's tile) or ``Flat(SignSGD())`` (a scale a piece)
that ``TwoPhase`` carries (4 ranks or more) with error feedback, float32 tensors and Triton
kernels takes this path. Everything a call of that bucket layout does is
known before it starts: each piece's frame length, every message's header and entry table,
the byte where every body, flag and padding lies in the rounds' send and receive buffers.
:class:`FlatPlan` builds that once per (tensors' names and sizes, world size, rank, device,
codec), with the buffers, the kernels' launch tables (:mod:`gradzip.kernels.triton.plan`) and
the byte counts. A call is then a fixed sequence, whatever the number of tensors or ranks:

1. ``g + r`` into the residual's spare buffer (one addition, as ``Flat`` compensates);
   this rank's non-finite flag (``(x * 0).sum()`` is NaN iff ``x`` holds a NaN or an
   infinity) into the flag byte after every message;
2. one launch (SignSGD: two, the tiles' sums and the encoder) encodes every owner's piece
   straight into its message's body in the send buffer (whose headers, tables and padding were
   written when the plan was built) and leaves the new residual in place; the all-to-all;
3. one launch checks the received messages (tables, padding and flag bytes against the plan,
   block scales and codes as the codec checks them) into a status tensor, one launch decodes
   every sender's piece into the owner's sum, divided by the world size;
4. this rank's verdict byte; one (two) launch re-encodes the owned piece into the second round's
   message, its residual added ``N`` times to this rank's residual of the piece (``Flat``'s
   rule); the all-gather;
5. one launch checks the owners' messages, one decodes them into the result.

The bytes on the wire are the general path's, byte for byte (a rank on either path reads the
other's), and so are the result, the residuals and ``stats()``. Nothing is read on the host:
the call hands the engine a verdict (a NaN or infinity on some rank, a malformed frame, a
peer's refusal, a result the float32 sum cannot hold) and a frame flag, which the engine reads
once when the step ends. A set frame flag makes the result NaN; the kept messages are then
parsed on the host in the general path's order, whose :class:`~gradzip.wire.FrameError` the
next call raises (the same text).

Any other call (a different codec, the checksum on, frozen tensors, momentum correction,
clipping, a bucket with fewer elements than ranks) takes the general path.
"""

from __future__ import annotations

import torch

import gradzip.kernels as K

from ..codecs.quant import Int8, SignSGD
from ..comm import Round
from ..feedback import ErrorFeedback
from ..wire import checksum_enabled, entries_nbytes, entries_table, host_refusal, run_view
from .base import Call, as_protocol
from .flat import Flat, _Spread, flat_key
from .twophase import TwoPhase, _peer_refusal, owner_key, piece_bounds, piece_key

__all__ = ["FlatPlan", "plan_for"]

#: The most plans an engine keeps (a model's buckets recur every step; past this, it starts afresh).
PLANS_MAX = 256


def plan_for(protocol, call: Call, plans: dict) -> FlatPlan | None:
    """The plan of ``call`` under ``protocol``, from ``plans`` (the engine's own: a plan's
    buffers serve one call at a time) or built once per layout into it; None where the call
    takes the general path (module docstring)."""
    if type(protocol) is not Flat:
        return None
    codec = protocol.codec
    if not call.tensors or not _planned_codec(codec):
        return None
    mem = call.memory
    if type(mem) is not ErrorFeedback or mem.decay != 1.0 or call.frozen or call.momentum or checksum_enabled():
        return None
    world, device = call.world_size, call.device
    if call.numel < world or not isinstance(as_protocol(codec, world, feedback=True), TwoPhase):
        return None
    if call.out_dtype != torch.float32 or any(t.dtype != torch.float32 or t.device != device for t in call.tensors):
        return None
    if not K.runs_triton("decode_add_quant", device):
        return None
    sizes = tuple(t.numel() for t in call.tensors)
    key = (tuple(call.names), sizes, world, call.rank, str(device), type(codec).__name__, codec.block)
    plan = plans.get(key)
    if plan is None:
        # A tensor lies in one bucket at a time: a plan that shares one with this layout is
        # stale (DDP's rebuilt buckets, a new world size), and its buffers are let go.
        names = set(call.names)
        for old in [k for k in plans if names.intersection(k[0])]:
            del plans[old]
        if len(plans) >= PLANS_MAX:
            plans.clear()
        plan = plans[key] = FlatPlan(codec, call)
    return plan


def _planned_codec(codec) -> bool:
    """``Int8(block=b)`` with ``b`` within a program's tile, or ``SignSGD()`` (a scale a piece)."""
    if type(codec) is Int8:
        from gradzip.kernels.triton.plan import fits

        return not codec.allreduce and fits(codec.block)
    return type(codec) is SignSGD and codec.block is None


def _encoder(codec, segs, device):
    from gradzip.kernels.triton.plan import Int8EncodeInto, SignEncodeInto

    return Int8EncodeInto(segs, codec.block, device) if type(codec) is Int8 else SignEncodeInto(segs, device)


class FlatPlan:
    """One bucket layout's buffers, tables and launches (module docstring)."""

    def __init__(self, codec, call: Call) -> None:
        from gradzip.kernels.triton.plan import DecodePeers, DecodeSegments, RoundCheck

        world, me, n, dev = call.world_size, call.rank, call.numel, call.device
        self.codec, self.world, self.me = codec, world, me
        self.key = flat_key(call.names, call.tensors)
        b = self.bounds = piece_bounds(n, world)
        self.lens = lens = [b[j + 1] - b[j] for j in range(world)]
        entries = [codec.planned_entry(m) for m in lens]
        tables = [bytes(entries_table([e])) for e in entries]  # what the general path's pack_frames writes
        # Each message padded to its capacity (room for a checksum), as fixed frames are.
        caps = [entries_nbytes([e], crc=True) for e in entries]
        self.payload1 = sum(entries_nbytes([e], crc=False) for e in entries)
        self.payload2 = entries_nbytes([entries[me]], crc=False)
        kind, block = codec._kind, codec.block
        bits, levels = codec._bits, 0.0  # the check's bits a code; the decoders read Int8's bytes, sign's bits
        nbs = [K.quant_layout(m, block)[0] for m in lens]  # block scales a piece

        # Round 1: the message to owner j, then its flag byte, at offs[j] of the send buffer.
        self.in_splits = [c + 1 for c in caps]
        offs = [sum(self.in_splits[:j]) for j in range(world)]
        send = torch.zeros(sum(self.in_splits), dtype=torch.uint8)
        for j, t in enumerate(tables):
            send[offs[j] : offs[j] + len(t)] = torch.frombuffer(bytearray(t), dtype=torch.uint8)
        self.send1 = send.to(dev)
        self.flag_at = torch.tensor([offs[j] + caps[j] for j in range(world)], dtype=torch.int64).to(dev)
        self.enc1 = _encoder(codec, [(b[j], lens[j], offs[j] + len(tables[j])) for j in range(world)], dev)
        w1 = caps[me] + 1
        self.out_splits = [w1] * world
        self.recv1 = torch.zeros(world * w1, dtype=torch.uint8, device=dev)
        t_me, end_me = tables[me], len(tables[me]) + entries[me][2]
        at, want, slots = [], bytearray(), []
        for s in range(world):  # each sender's table and padding (slot 2), its flag byte (slot 3)
            row = s * w1
            at += [row + i for i in range(len(t_me))] + [row + i for i in range(end_me, caps[me])] + [row + caps[me]]
            want += t_me + bytes(caps[me] - end_me) + b"\0"
            slots += [2] * (len(t_me) + caps[me] - end_me) + [3]
        frames = [(s * w1 + len(t_me), nbs[me], lens[me]) for s in range(world)]
        self.check1 = RoundCheck(frames, world * w1, kind, bits, at, bytes(want), slots, dev)
        self.dec1 = DecodePeers([s * w1 + len(t_me) for s in range(world)], lens[me], kind, block, levels, 8, dev)
        self.acc = torch.empty(lens[me], dtype=torch.float32, device=dev)

        # Round 2: this owner's message at the start of a buffer as long as the longest, and
        # its verdict on round 1 in the last byte.
        w2 = self.w2 = max(caps) + 1
        send2 = torch.zeros(w2, dtype=torch.uint8)
        send2[: len(t_me)] = torch.frombuffer(bytearray(t_me), dtype=torch.uint8)
        self.send2 = send2.to(dev)
        self.verdict = self.send2[w2 - 1 :]
        self.enc2 = _encoder(codec, [(0, lens[me], len(t_me))], dev)
        self.recv2 = torch.zeros(world * w2, dtype=torch.uint8, device=dev)
        at, want = [], bytearray()
        for j in range(world):  # each owner's table, padding and verdict byte
            row, end = j * w2, len(tables[j]) + entries[j][2]
            at += [row + i for i in range(len(tables[j]))] + [row + i for i in range(end, w2)]
            want += tables[j] + bytes(w2 - end)
        frames = [(j * w2 + len(tables[j]), nbs[j], lens[j]) for j in range(world)]
        self.check2 = RoundCheck(frames, world * w2, kind, bits, at, bytes(want), [2] * len(at), dev)
        self.dec2 = DecodeSegments(
            [(b[j], lens[j], j * w2 + len(tables[j])) for j in range(world)], kind, block, levels, 8, dev
        )

        # Status: round 1 in slots 0-3 (negative scale, a code no encoder writes: Int8's -128,
        # table or padding, a flag), round 2 in 4-6; every slot is bad above zero.
        self.status = torch.zeros(8, dtype=torch.int64, device=dev)
        self.status2 = self.status[4:]
        self.frame = torch.tensor([1, 1, 1, 0, 1, 1, 1, 0], dtype=torch.bool).to(dev)
        self.mine = self.status[:3]

    def _refusal(self, step: int, dtype):
        """The host path's error for this call's kept messages, in its order: this rank's check
        of the first round, the owners' verdicts, then the second round."""
        world, me, codec = self.world, self.me, self.codec
        w1 = self.out_splits[0]
        key = self.key
        ranks = list(range(world))

        def refuse():
            rows = self.recv1.view(world, w1)[:, : w1 - 1]
            err = host_refusal(
                list(rows.unbind(0)),
                [[torch.Size([self.lens[me]])]] * world,
                [[torch.float32]] * world,
                [[dtype]] * world,
                codec,
                [[piece_key(key, me, world)]] * world,
                ranks,
                step,
                layout=False,
            )
            if err is not None:
                return err
            grid = self.recv2.view(world, self.w2)
            verdicts = grid[:, -1]
            if bool(verdicts.any()):
                return _peer_refusal(verdicts, step)()
            return host_refusal(
                list(grid[:, :-1].unbind(0)),
                [[torch.Size([m])] for m in self.lens],
                [[torch.float32]] * world,
                [[dtype]] * world,
                codec,
                [[owner_key(key, j, world)] for j in ranks],
                ranks,
                step,
            )

        return refuse

    def run(self, call: Call):
        """The call's exchange (a protocol's generator): returns ``(result, verdict, frame flag,
        refusal)``, the verdict and flag one-element device bools."""
        world, me, key = self.world, self.me, self.key
        with call.codec():
            # The contexts the general path makes (the engine remembers each key's state).
            call.context(key, torch.float32)
            for j in range(world):
                call.context(piece_key(key, j, world), torch.float32)
            spread = _Spread(call, key)
            g = run_view(call.tensors)
            if g is None:
                g = torch.cat([t.reshape(-1) for t in call.tensors])
            c = Flat._compensate(call, g, spread)
            self.send1.index_put_((self.flag_at,), c.mul(0).sum().isnan().to(torch.uint8))
            self.enc1(c, c, self.send1)
            spread.set(key, c)
            self.status.zero_()
            call.comm.stats.add(bytes_payload=self.payload1, bytes_control=world)
        yield Round([call.comm.alltoall(self.recv1, self.send1, self.out_splits, self.in_splits)])
        with call.codec():
            self.check1(self.recv1, self.status)
            acc = self.acc.zero_()
            self.dec1(acc, self.recv1)
            acc.div_(world)
            self.verdict.copy_(self.mine.any())
            call.context(owner_key(key, me, world), torch.float32)
            self.enc2(acc, acc, self.send2)
            spread.set(owner_key(key, me, world), acc)
            call.comm.stats.add(bytes_payload=self.payload2, bytes_control=1)
        yield Round([call.comm.allgather(self.recv2, self.send2)], last=True)
        with call.codec():
            self.check2(self.recv2, self.status2)
            out = call.output(zero=True)
            self.dec2(out, self.recv2)
            over = self.status > 0
            bad = (over.any() | out.mul(0).sum().isnan()).reshape(1)
            frame = (over & self.frame).any().reshape(1)
        return out, bad, frame, self._refusal(call.step, call.tensors[0].dtype)
