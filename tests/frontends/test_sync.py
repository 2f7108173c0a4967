"""Replicas start from the same parameters.

``gz.broadcast_parameters`` copies rank 0's tensors everywhere; ``DistributedOptimizer`` and
``LocalSGD``/``DiLoCo`` check on their first step that the ranks agree (one allreduce of
hashes) and raise ``ValueError`` naming the first tensor that differs, on every rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import gradzip as gz
from tests.support import make_model, run_ranks, train_steps


def _model(seed):
    return make_model(seed, widths=(8,))


def _step(model, opt):
    train_steps(model, opt, 1, dist.get_rank())


def _error(fn):
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def _agree(rank, world):
    out = {}
    # Only the last bias differs: the message names it, not the tensors before it.
    model = _model(0)
    if rank == 1:
        with torch.no_grad():
            model[2].bias.add_(1e-6)
    opt = gz.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(), compression=gz.TopK(0.5)
    )
    out["optim"] = _error(lambda: _step(model, opt))

    model = _model(rank)  # every rank its own seed
    lsgd = gz.DiLoCo(torch.optim.SGD(model.parameters(), lr=0.1), model, period=2)
    out["diloco"] = _error(lambda: _step(model, lsgd))

    # broadcast_parameters makes them agree (buffers too); training then runs.
    model = _model(rank)
    model.register_buffer("count", torch.full((2,), float(rank)))
    gz.broadcast_parameters(model, root=1)
    gathered = [torch.zeros(sum(p.numel() for p in model.state_dict().values())) for _ in range(world)]
    dist.all_gather(gathered, torch.cat([t.reshape(-1) for t in model.state_dict().values()]))
    out["equal"] = torch.equal(gathered[0], gathered[1])
    out["root_kept"] = torch.equal(model.count, torch.ones(2))
    opt = gz.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(), compression=gz.TopK(0.5)
    )
    for _ in range(2):
        _step(model, opt)
    lsgd_model = _model(0)
    lsgd = gz.LocalSGD(torch.optim.SGD(lsgd_model.parameters(), lr=0.1), lsgd_model, period=2)
    for _ in range(2):
        _step(lsgd_model, lsgd)
    out["trained"] = opt.engine.step == 2 and lsgd.local_step == 2

    # Turned off: no check, no error (the replicas then drift, as before).
    model = _model(rank)
    opt = gz.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(), check_parameters=False
    )
    out["off"] = _error(lambda: _step(model, opt))
    return out


@pytest.mark.slow
def test_front_ends_refuse_replicas_that_start_apart_and_broadcast_fixes_it():
    for out in run_ranks(_agree, 2):
        assert out["optim"] is not None and "first in '2.bias'" in out["optim"], out["optim"]
        assert "broadcast_parameters" in out["optim"]
        assert out["diloco"] is not None and "first in '0.weight'" in out["diloco"], out["diloco"]
        assert out["equal"] and out["root_kept"]
        assert out["trained"]
        assert out["off"] is None


def test_arguments_are_checked():
    from gradzip.sync import _named, tensor_hash

    with pytest.raises(TypeError, match="item 0 is int"):
        _named([3])
    a = torch.arange(6.0)
    assert tensor_hash(a) == tensor_hash(a.clone()) != tensor_hash(a.view(2, 3))
    assert tensor_hash(a) != tensor_hash(a.double())
    assert 0 <= tensor_hash(torch.zeros(0)) < 2**62
