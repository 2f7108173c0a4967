"""Start every rank from the same parameters, and check that they did.

    gz.broadcast_parameters(model)          # rank 0's parameters and buffers on every rank
    gz.check_parameters_agree(model.named_parameters())   # raises naming the first that differs

DDP broadcasts the module's parameters when it wraps it; the front ends that do not own
the model (``DistributedOptimizer``, ``LocalSGD``/``DiLoCo``) cannot, so replicas started
from different weights would drift apart with nothing to show it. They call
:func:`check_parameters_agree` on their first step: one allreduce of two int64 per tensor
(a 62-bit BLAKE2b hash of its bytes, and its negation, reduced with MAX, give every rank
the largest and the smallest hash), issued on every rank at the same point, in the same
order.
"""

from __future__ import annotations

import hashlib
import json

import torch
import torch.distributed as dist

from .comm import Communicator, track

__all__ = ["broadcast_parameters", "check_parameters_agree", "differ_across_ranks", "tensor_hash", "value_hash"]

_MASK = (1 << 62) - 1  # hashes and their negations fit in int64
_BUCKET_BYTES = 64 * 2**20


def _named(module_or_params) -> list[tuple[str, torch.Tensor]]:
    """``[(name, tensor)]`` of a module (parameters, then buffers), a dict, or an iterable of
    tensors or ``(name, tensor)`` pairs."""
    if isinstance(module_or_params, torch.nn.Module):
        return list(module_or_params.named_parameters()) + list(module_or_params.named_buffers())
    if isinstance(module_or_params, dict):
        items = list(module_or_params.items())
    else:
        items = list(module_or_params)
    out = []
    for i, x in enumerate(items):
        if isinstance(x, torch.Tensor):
            out.append((f"[{i}]", x))
        elif isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], torch.Tensor):
            out.append((str(x[0]), x[1]))
        else:
            raise TypeError(f"expected a module, or tensors or (name, tensor) pairs; item {i} is {type(x).__name__}")
    return out


def _global_rank(root: int, group) -> int:
    return root if group is None else dist.get_global_rank(group, root)


def broadcast_parameters(module_or_params, root: int = 0, group=None) -> None:
    """Copy rank ``root``'s parameters (and a module's buffers) to every rank, in place.

    Args:
        module_or_params: a ``torch.nn.Module`` (its parameters, then its buffers), a dict
            ``{name: tensor}``, or an iterable of tensors or ``(name, tensor)`` pairs, in
            the same order on every rank.
        root: the rank (in ``group``) whose values every rank takes, an integer in
            [0, group size).
        group: the process group (default: the global one).

    Tensors are flattened into buckets of one dtype and device (64 MiB at most), one
    broadcast per bucket. Call it on every rank, before wrapping the model in a front end.
    """
    world = dist.get_world_size(group)
    if isinstance(root, bool) or not isinstance(root, int) or not 0 <= root < world:
        raise ValueError(f"root must be a rank in [0, {world}), got {root!r}")
    named = _named(module_or_params)
    src = _global_rank(root, group)
    buckets: dict = {}
    order: list = []
    for _, t in named:
        key = (t.device, t.dtype)
        b = buckets.get(key)
        if b is None or b[1] + t.numel() * t.element_size() > _BUCKET_BYTES and b[0]:
            b = buckets[key] = [[], 0]
            order.append(b)
        b[0].append(t)
        b[1] += t.numel() * t.element_size()
    with torch.no_grad():
        for tensors, _ in order:
            flat = torch.cat([t.detach().reshape(-1) for t in tensors])
            track(dist.broadcast(flat, src=src, group=group, async_op=True), flat).wait()  # gradzip.comm
            pos = 0
            for t in tensors:
                t.copy_(flat[pos : pos + t.numel()].view(t.shape))
                pos += t.numel()


def tensor_hash(t: torch.Tensor) -> int:
    """A 62-bit BLAKE2b hash of a tensor's dtype, shape and bytes."""
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{t.dtype}{tuple(t.shape)}".encode())
    data = t.detach().contiguous().reshape(-1)
    if data.numel():
        h.update(data.view(torch.uint8).cpu().numpy().tobytes())
    return int.from_bytes(h.digest(), "little") & _MASK


def value_hash(value) -> int:
    """A 62-bit BLAKE2b hash of a JSON-able value (dict keys sorted)."""
    digest = hashlib.blake2b(json.dumps(value, sort_keys=True).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _MASK


def differ_across_ranks(hashes: list[int], group=None, *, comm=None, device=None) -> list[int]:
    """The indices of ``hashes`` (62-bit integers, the same count on every rank) that some rank
    holds otherwise: one allreduce(MAX) of the hashes and their negations, which gives every rank
    the largest and the smallest of each. On ``comm`` (a gradzip communicator, booked as control
    bytes) instead of ``group`` where given; ``device``: where the int64s travel (NCCL's GPU)."""
    h = torch.tensor(hashes, dtype=torch.int64)
    both = torch.cat([h, -h]).to(device or "cpu")
    if comm is None:
        track(dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group, async_op=True), both).wait()
    else:
        comm.allreduce(both, dist.ReduceOp.MAX, control=True).wait()
    both = both.cpu()
    hi, lo = both[: len(hashes)], -both[len(hashes) :]
    return (hi != lo).nonzero().flatten().tolist()


def check_parameters_agree(
    named_params, group=None, *, what: str = "parameters", comm=None, hint: str | None = None
) -> None:
    """Raise ``ValueError`` on every rank unless every rank holds the same tensors.

    Args:
        named_params: ``(name, tensor)`` pairs (``model.named_parameters()``), a dict, or
            a module (its parameters and buffers), in the same order on every rank.
        group: the process group (default: the global one).
        what: the word the message uses for the tensors.
        comm: a gradzip communicator (``engine.comm``: torch.distributed's or Horovod's) to
            run the allreduce on instead of ``group``; its bytes are booked as control bytes.
        hint: how to make them agree, for the message (default: ``gz.broadcast_parameters``).

    One allreduce(MAX) of ``2 * (T + 1)`` int64: each tensor's hash and its negation,
    plus a hash of the names (so a rank holding other tensors is caught too). The error
    names the first tensor whose values differ.
    """
    named = _named(named_params)
    names = hashlib.blake2b("\0".join(n for n, _ in named).encode(), digest_size=8).digest()
    hashes = [int.from_bytes(names, "little") & _MASK] + [tensor_hash(t) for _, t in named]
    device = named[0][1].device if named else torch.device("cpu")
    pg = group if comm is None else getattr(comm, "group", None)
    on_torch = comm is None or type(comm) is Communicator  # not Horovod's (a subclass)
    if on_torch and dist.get_backend(pg) == "nccl" and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    differ = differ_across_ranks(hashes, group, comm=comm, device=device)
    rank = dist.get_rank(group) if comm is None else comm.rank
    if not differ:
        return
    hint = hint or (
        "start every rank from the same weights: gz.broadcast_parameters(model) (or the same seed) "
        "before wrapping, or load the same checkpoint on every rank"
    )
    if differ[0] == 0:
        raise ValueError(f"the ranks hold {what} of different names or order ({len(named)} on rank {rank}); {hint}")
    first = named[differ[0] - 1][0]
    raise ValueError(
        f"{what} differ across ranks, first in {first!r} ({len(differ)} of {len(named)} tensors differ); {hint}"
    )
