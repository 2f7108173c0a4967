"""``horovod.torch.functions``: broadcasts of parameters, optimizer state and objects, and the
gather of objects, with Horovod 0.28.1's semantics on this package's collectives."""

from __future__ import annotations

import collections

import torch

from . import mpi_ops
from .mpi_ops import broadcast_, broadcast_async_, global_process_set, rank, size, synchronize

__all__ = ["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object"]


def broadcast_parameters(params, root_rank) -> None:
    """Overwrite ``params`` in place with ``root_rank``'s: a ``state_dict()`` (broadcast in sorted
    key order) or a list of ``(name, tensor)`` pairs or tensors (``named_parameters()``,
    ``parameters()``), all started before the first is waited for, as Horovod does."""
    if isinstance(params, dict):
        params = sorted(params.items())
    elif isinstance(params, list):
        params = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    handles = [broadcast_async_(p, root_rank, name) for name, p in params]
    for h in handles:
        synchronize(h)


def broadcast_optimizer_state(optimizer, root_rank, model=None) -> None:
    """Every rank's optimizer state becomes ``root_rank``'s, step for step as Horovod does it:

    * an optimizer without state (a fresh one) first takes one step on zero gradients on every
      rank (``p.grad`` set to zeros, left there), so that its state exists; a
      ``DistributedOptimizer`` takes it with the wrapped class's own ``step`` (no
      communication). With weight decay that step moves the parameters, as in Horovod;
    * the tensors of the state are broadcast in place (in parameter order, named
      ``<key>.<occurrence>``), the scalars and the hyper-parameters of every parameter group
      (``lr``, ``momentum``, ...) through one ``broadcast_object``.

    The gradzip state of this package's ``DistributedOptimizer`` (error-feedback residuals,
    codec state: per rank) is not part of ``state``/``param_groups`` and stays each rank's own.
    ``model`` marks the parameters of sparse embeddings, whose zero gradient is sparse (as
    for ``SparseAdam``)."""
    from .optimizer import _HorovodOptimizer

    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    state_dict = _plain_state_dict(optimizer)
    sparse = set()
    if model:
        for m in model.modules():
            if isinstance(m, torch.nn.Embedding) and m.sparse:
                sparse.update(id(p) for p in m.parameters())
    if len(state_dict["state"]) == 0:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and id(p) not in state_dict["state"]:
                    p.grad = p.data.new(p.size()).zero_()
                    if isinstance(optimizer, torch.optim.SparseAdam) or (
                        isinstance(optimizer, torch.optim.SGD) and id(p) in sparse
                    ):
                        p.grad = p.grad.to_sparse()
        if isinstance(optimizer, _HorovodOptimizer):
            super(_HorovodOptimizer, optimizer).step()  # the wrapped class's step: no allreduce
        else:
            optimizer.step()
        state_dict = _plain_state_dict(optimizer)
    if len(state_dict["state"]) == 0:
        return  # a stateless optimizer: nothing to broadcast

    params, scalars, callbacks = [], {}, {}
    occurrences: dict = collections.defaultdict(int)

    def state_setter(pid, name):
        def assign(v):
            state_dict["state"][pid][name] = v

        return assign

    def option_setter(index, key):
        def assign(v):
            optimizer.param_groups[index][key] = v

        return assign

    for index, group in enumerate(state_dict["param_groups"]):
        for key, value in group.items():
            if key == "params":
                continue
            k = f"{key}.{index}"
            scalars[k] = value
            callbacks[k] = option_setter(index, key)
        for pid in group["params"]:
            if pid not in state_dict["state"]:
                continue
            for name, p in state_dict["state"][pid].items():
                occurrences[name] += 1
                k = f"{name}.{occurrences[name]}"
                if torch.is_tensor(p):
                    params.append((k, p))
                else:
                    scalars[k] = p
                    callbacks[k] = state_setter(pid, name)
    broadcast_parameters(params, root_rank)
    scalars = broadcast_object(scalars, root_rank)
    for k, v in scalars.items():
        callbacks[k](v)


def _plain_state_dict(optimizer) -> dict:
    """The optimizer's own state dict (its ``state`` entries are the optimizer's live dicts, as
    torch packs them), without a gradzip optimizer's per-rank engine state."""
    from .optimizer import _HorovodOptimizer

    if isinstance(optimizer, _HorovodOptimizer):
        return optimizer._wrapped_state_dict()
    return optimizer.state_dict()


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """``root_rank``'s ``obj`` on every rank (serialised with cloudpickle, as Horovod, where
    installed; pickle otherwise): its size, then its bytes, broadcast."""
    if name is None:
        name = type(obj).__name__
    if rank() == root_rank:
        t = torch.frombuffer(bytearray(mpi_ops.dumps(obj)), dtype=torch.uint8)
        sz = torch.tensor([t.shape[0]], dtype=torch.int32)
        broadcast_(sz, root_rank, name + ".sz", process_set)
    else:
        sz = torch.tensor([0], dtype=torch.int32)
        broadcast_(sz, root_rank, name + ".sz", process_set)
        t = torch.empty(int(sz[0]), dtype=torch.uint8)
    broadcast_(t, root_rank, name + ".t", process_set)
    if rank() != root_rank:
        obj = mpi_ops.loads(t.numpy().tobytes())
    return obj


def allgather_object(obj, name=None):
    """Every rank's ``obj``, in rank order (a list)."""
    if name is None:
        name = type(obj).__name__
    t = torch.frombuffer(bytearray(mpi_ops.dumps(obj)), dtype=torch.uint8)
    sizes = mpi_ops.allgather(torch.tensor([t.shape[0]], dtype=torch.int32), name=name + ".sz").tolist()
    gathered = mpi_ops.allgather(t, name=name + ".t").numpy()
    out, start = [], 0
    for i in range(size()):
        out.append(mpi_ops.loads(gathered[start : start + sizes[i]].tobytes()))
        start += sizes[i]
    return out
