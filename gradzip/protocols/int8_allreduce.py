"""``Int8Allreduce``: block-wise int8 codes summed exactly by allreduce.

1. allreduce(MAX) of every block's float32 scale ``S_b = kernels.int8_scales(max|x|)``
   (4 bytes per block), taken from ``max|x|`` in the accumulation dtype: ``int8_scales``
   is monotone, so the ranks agree on the scale of the largest ``max|x|``. A block whose
   scale exceeds float32's range on some rank (a float64 block beyond it; an infinite
   value, which the engine's non-finite check reports anyway) goes as ``+inf``, wins the
   MAX, and is then sent as zeros by every rank: error feedback keeps it whole. The
   engine's non-finite flag (0 or 1) rides as one more element (``Call.take_flag``);
2. every rank quantizes with the agreed ``S_b`` (``kernels.int8_encode``) and the
   ranks allreduce-SUM the codes exactly, as integers. torch.distributed has no
   int16 sum (gloo: "Invalid scalar type"; NCCL has no int16), so the codes
   travel offset to ``q + 127`` in lanes of ``w = bitlength(254 * world)`` bits,
   ``63 // w`` lanes to an int64 word; a lane's sum never carries.

Wire cost per rank: ``4 * ceil(n / B)`` bytes of scales plus
``8 * ceil(n_call / (63 // w))`` bytes of words (``n_call``: all elements of the
call): 8/7 byte per element for 2 ranks, 4/3 for 3-4, 8/5 for 5-16, 2 for 17-64,
8/3 for 65-258. The result is ``sum(q) * S_b / world`` in float32 (float64 for float64
gradients), narrowed to the output dtype.
``Int8(allreduce=True)`` names this protocol.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import gradzip.args as args
import gradzip.kernels as K

from ..codecs.quant import Int8
from ..comm import Round
from ..wire import accum_dtype, narrow
from .base import Call, Exchange, Protocol

__all__ = ["Int8Allreduce", "int8_lanes"]


def int8_lanes(world_size: int) -> tuple[int, int]:
    """(bits per lane, lanes per int64 word) for summing offset int8 codes over ``world_size`` ranks.

    Each rank adds ``q + 127`` in ``[0, 254]``; a lane of ``w`` bits holds the
    sum without carrying into its neighbour while ``world_size * 254 < 2**w``.
    ``63 // w`` lanes fit in a non-negative int64.
    """
    w = (int(world_size) * 254).bit_length()
    return w, 63 // w


class Int8Allreduce(Protocol):
    """Block-wise int8 codes summed exactly by allreduce (module docstring).

    Args:
        codec: an ``Int8`` whose block it takes (default: ``Int8(block=block)``).
        block: elements per scale when no codec is given; ``None``: one per tensor.
    """

    rounds = 2

    def __init__(self, codec: Int8 | None = None, *, block: int | None = 1024) -> None:
        if codec is not None:
            if not isinstance(codec, Int8):
                raise ValueError(f"codec must be an Int8, got {codec!r}")
            block = codec.block
        self.codec = codec
        self.block = args.optional(args.integer, "block", block, 1, 2**31 - 1)

    def exchange(self, call: Call) -> Exchange:
        world = call.world_size
        out = torch.zeros(call.numel, dtype=call.out_dtype, device=call.device)
        with call.codec():
            vs, layouts, scales = [], [], []
            for i in range(len(call.tensors)):
                v = call.x(i).reshape(-1)
                v = v.to(accum_dtype(v.dtype))
                nb, b = K.quant_layout(v.numel(), self.block)
                vs.append(v)
                layouts.append((nb, b))
                if nb:
                    amax = K.quant_pad(v.abs(), nb, b).amax(dim=1)  # in v's dtype: float64 stays float64
                    s = K.int8_scales(amax)  # 0 where the scale exceeds float32 (and for 0 or NaN)
                    scales.append(torch.where((s == 0) & (amax > 0), float("inf"), s))
            if not scales:  # every tensor is empty, on every rank
                for i in range(len(call.tensors)):
                    call.commit(i, vs[i])
                return out
            nscales = sum(s.numel() for s in scales)
            if call.wants_flag:  # the engine's non-finite flag rides after the scales (MAX of 0 and 1)
                scales.append(scales[0].new_zeros(1))
            scales = torch.cat(scales)
            if scales.numel() > nscales:
                call.comm.stats.add(bytes_control=scales.element_size())
        if scales.numel() > nscales:
            scales[-1] = call.take_flag(scales[-1:])
        yield Round([call.comm.allreduce(scales, op=dist.ReduceOp.MAX)])
        with call.codec():
            scales = scales[:nscales]
            scales = torch.where(torch.isinf(scales), 0.0, scales)  # beyond float32 on some rank: sent as zeros
            codes, per_element, pos = [], [], 0
            for i, (v, (nb, b)) in enumerate(zip(vs, layouts)):
                s = scales[pos : pos + nb]
                pos += nb
                _, q = K.int8_encode(v, block=self.block, scales=s)
                se = K.quant_per_element(s.to(v.dtype), nb, b, v.numel())
                per_element.append(se)
                call.commit(i, q.to(v.dtype) * se)
                codes.append(q)
            flat = torch.cat(codes).to(torch.int64) + 127
            w, lanes = int8_lanes(world)
            nw = (flat.numel() + lanes - 1) // lanes
            padded = torch.zeros(nw * lanes, dtype=torch.int64, device=flat.device)
            padded[: flat.numel()] = flat
            shifts = torch.arange(lanes, dtype=torch.int64, device=flat.device) * w
            words = (padded.view(nw, lanes) << shifts).sum(dim=1)
            call.comm.stats.add(bytes_payload=scales.numel() * 4 + words.numel() * 8)
        yield Round([call.comm.allreduce(words)], last=True)
        with call.codec():
            sums = ((words.view(nw, 1) >> shifts) & ((1 << w) - 1)).reshape(-1)[: flat.numel()] - 127 * world
            # float64 gradients decode in float64: a float32 product would overflow for scales
            # near float32's maximum, though the average fits the gradients' dtype
            wd = torch.float64 if any(v.dtype == torch.float64 for v in vs) else torch.float32
            se = torch.cat([p.to(wd) for p in per_element])
            out.copy_(narrow((sums.to(wd) * se).div_(world), out.dtype))
        return out
