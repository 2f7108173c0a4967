"""Checkpoints that cannot mix ranks.

An engine state records the rank that saved it, the world size and the method; loading
another rank's state raises naming both ranks; ``save(dir)``/``load(dir)`` write and read
one file per rank; ``torch.distributed.checkpoint`` keeps every rank's state (through
``gradzip.checkpoint.PerRank``); ``gz.reshard`` is exported at the top level.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import gradzip as gz
from gradzip.engine import STATE_VERSION
from tests.support import make_model, run_ranks, train_steps


def _model():
    return make_model(0, widths=(16,))


def _train(model, opt, steps=2):
    train_steps(model, opt, steps, dist.get_rank())  # each rank its own data


def _refusal(fn, exc=ValueError):
    """The message ``fn()`` raises (``exc``), or None when it does not raise."""
    try:
        fn()
    except exc as e:
        return str(e)
    return None


def _all_fronts(rank, world, root):
    """Every front end: save per rank, refuse the other rank's state, load its own."""
    import torch.distributed.checkpoint as dcp
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradzip.checkpoint import PerRank
    from gradzip.hooks import register_hook

    out = {}
    # DDP hook
    ddp = DDP(_model())
    state = register_hook(ddp, gz.TopK(0.25))
    _train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1))
    sd = state.state_dict()
    out["keys"] = (sd["rank"], sd["world_size"], sd["method_repr"])
    path = state.save(os.path.join(root, "hook"))
    dist.barrier()
    out["files"] = sorted(os.listdir(os.path.join(root, "hook")))
    other = torch.load(os.path.join(root, "hook", f"gradzip_rank{1 - rank}_of_{world}.pt"), weights_only=True)
    fresh = register_hook(DDP(_model()), gz.TopK(0.25))
    out["other"] = _refusal(lambda: fresh.load_state_dict(other))
    fresh.load(os.path.join(root, "hook"))
    mine = torch.load(path, weights_only=True)
    out["hook_residuals_equal"] = all(
        torch.equal(fresh.engine.memory.residual(k), v) for k, v in mine["residuals"].items()
    ) and bool(mine["residuals"])
    out["residuals_differ_across_ranks"] = not all(
        torch.equal(other["residuals"][k], v) for k, v in mine["residuals"].items()
    )
    # Another model shard's state (data-parallel subgroups: same group rank, other global
    # rank, same names and shapes): refused too.
    shard = dict(mine, global_rank=mine["global_rank"] + 2)
    out["shard"] = _refusal(lambda: register_hook(DDP(_model()), gz.TopK(0.25)).load_state_dict(shard))
    out["global_rank"] = mine["global_rank"]
    # A directory of another world size: a clear error naming what it holds.
    out["missing"] = _refusal(lambda: fresh.load(os.path.join(root, "none")), FileNotFoundError)

    # DistributedOptimizer
    model = _model()
    opt = gz.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        compression=gz.TopK(0.25),
    )
    _train(model, opt)
    opt.save(os.path.join(root, "optim"))
    dist.barrier()
    model2 = _model()
    opt2 = gz.DistributedOptimizer(
        torch.optim.SGD(model2.parameters(), lr=0.1),
        named_parameters=model2.named_parameters(),
        compression=gz.TopK(0.25),
    )
    opt2.load(os.path.join(root, "optim"))
    out["optim_step"] = opt2.engine.step
    other_file = f"gradzip_rank{1 - rank}_of_{world}.pt"
    out["optim_other"] = _refusal(
        lambda: opt2.load_state_dict(torch.load(os.path.join(root, "optim", other_file), weights_only=True))
    )

    # LocalSGD: refused before anything is changed
    model = _model()
    lsgd = gz.LocalSGD(torch.optim.SGD(model.parameters(), lr=0.1), model, period=2, compression=gz.TopK(0.25))
    _train(model, lsgd, steps=2)
    lsgd.save(os.path.join(root, "local"))
    dist.barrier()
    model3 = _model()
    lsgd3 = gz.LocalSGD(torch.optim.SGD(model3.parameters(), lr=0.1), model3, period=2, compression=gz.TopK(0.25))
    out["local_other"] = _refusal(
        lambda: lsgd3.load_state_dict(torch.load(os.path.join(root, "local", other_file), weights_only=True))
    )
    out["local_untouched"] = lsgd3.local_step == 0
    lsgd3.load(os.path.join(root, "local"))
    out["local_step"] = lsgd3.local_step

    # torch.distributed.checkpoint: every rank's state is kept and comes back to its rank.
    dcp.save({"gradzip": PerRank(state)}, checkpoint_id=os.path.join(root, "dcp"))
    target = register_hook(DDP(_model()), gz.TopK(0.25))
    dcp.load({"gradzip": PerRank(target)}, checkpoint_id=os.path.join(root, "dcp"))
    got = target.state_dict()
    out["dcp"] = got["rank"] == rank and all(torch.equal(got["residuals"][k], v) for k, v in sd["residuals"].items())
    return out


@pytest.mark.slow
def test_states_carry_their_rank_and_refuse_another_ranks(tmp_path):
    outs = run_ranks(_all_fronts, 2, str(tmp_path))
    for rank, out in enumerate(outs):
        assert out["keys"] == (rank, 2, "TopK(ratio=0.25)")
        assert out["files"] == ["gradzip_rank0_of_2.pt", "gradzip_rank1_of_2.pt"]
        assert out["residuals_differ_across_ranks"]  # what mixing would silently lose
        for key in ("other", "optim_other", "local_other"):
            msg = out[key]
            assert msg is not None, key
            assert f"saved by rank {1 - rank}" in msg and f"this is rank {rank}" in msg, msg
        assert out["hook_residuals_equal"]
        assert out["global_rank"] == rank
        assert out["shard"] and f"saved by global rank {rank + 2}" in out["shard"], out["shard"]
        assert out["optim_step"] == 2
        assert out["local_untouched"] and out["local_step"] == 2
        assert "holds no gradzip states" in out["missing"]
        assert out["dcp"]


def test_reshard_assigns_ranks_and_refuses_states_out_of_order():
    def state(rank, world):
        return {
            "version": STATE_VERSION,
            "rank": rank,
            "world_size": world,
            "method_repr": "TopK()",
            "method": {"name": "TopK"},
            "error_feedback": True,
            "error_decay": 1.0,
            "step": 3,
            "residuals": {"w": torch.full((4,), float(rank))},
            "momentum": {},
            "momentum_mode": None,
            "tensor_state": {},
            "stats": {},
        }

    new = gz.reshard([state(0, 2), state(1, 2)], 3)
    assert [(s["rank"], s["world_size"]) for s in new] == [(0, 3), (1, 3), (2, 3)]
    with pytest.raises(ValueError, match=r"states\[0\] was saved by rank 1"):
        gz.reshard([state(1, 2), state(0, 2)], 2)
    old = {**state(1, 2), "version": STATE_VERSION - 1}  # an older gradzip's: refused, naming both versions
    with pytest.raises(ValueError, match=rf"states\[1\] has gradzip state version {STATE_VERSION - 1}"):
        gz.reshard([state(0, 2), old], 2)


def test_reshard_takes_an_optimizers_whole_states_and_sends_local_sgd_to_its_own():
    """A DistributedOptimizer's states (the wrapped optimizer's beside ``"gradzip"``): the engine
    states resharded, every new rank the wrapped optimizer's rank 0's; LocalSGD/DiLoCo states are
    refused naming ``local_sgd.reshard_state``; anything else without residuals, clearly."""

    def engine(rank):
        return {
            "version": STATE_VERSION,
            "rank": rank,
            "world_size": 2,
            "method": {"name": "TopK"},
            "error_feedback": True,
            "error_decay": 1.0,
            "step": 3,
            "residuals": {"w": torch.full((4,), float(rank))},
            "momentum": {},
            "momentum_mode": "momentum",
            "tensor_state": {},
            "stats": {},
        }

    opt = {"state": {0: {"momentum_buffer": torch.ones(4)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    new = gz.reshard([{**opt, "gradzip": engine(r)} for r in range(2)], 3)
    assert [(s["gradzip"]["rank"], s["gradzip"]["world_size"]) for s in new] == [(0, 3), (1, 3), (2, 3)]
    assert all(s["param_groups"] == opt["param_groups"] and s["state"] is opt["state"] for s in new)
    assert torch.allclose(sum(s["gradzip"]["residuals"]["w"] for s in new), torch.ones(4))
    assert all(s["gradzip"]["momentum_mode"] == "momentum" for s in new)
    with pytest.raises(ValueError, match=r"gradzip.local_sgd.reshard_state\(states, 3\)"):
        gz.reshard([{"local_sgd": {}, "gradzip": engine(r)} for r in range(2)], 3)
    with pytest.raises(ValueError, match="states must be engine states"):
        gz.reshard([{"model": 1}, {"model": 2}], 3)


def test_reshard_dir_roundtrip(tmp_path):
    from gradzip.checkpoint import read_states, write_states

    states = [
        {
            "version": STATE_VERSION,
            "rank": r,
            "world_size": 2,
            "method": {"name": "TopK"},
            "error_feedback": True,
            "error_decay": 1.0,
            "step": 1,
            "residuals": {"w": torch.ones(3) * r},
            "momentum": {},
            "momentum_mode": None,
            "tensor_state": {},
            "stats": {},
        }
        for r in range(2)
    ]
    write_states(states, tmp_path / "old")
    write_states(gz.reshard(read_states(tmp_path / "old"), 4), tmp_path / "new")
    got = read_states(tmp_path / "new")
    assert [s["rank"] for s in got] == [0, 1, 2, 3]
    assert torch.equal(sum(s["residuals"]["w"] for s in got), torch.ones(3))
    (tmp_path / "old" / "gradzip_rank1_of_2.pt").unlink()
    with pytest.raises(ValueError, match=r"lacks the states of ranks \[1\]"):
        read_states(tmp_path / "old")
