"""Bit-identical resume where the grouping of tensors into calls matters, at 2 and 4 ranks.

* DDP: save at step 2, rebuild the model, DDP and the hook, load, train to step 4, against
  a run that never stopped. DDP's first step after a restart groups the gradients into its
  initial buckets (one, for this model), the unbroken run into its rebuilt ones; the engine
  state records the last step's calls and the first step after a load runs them so. Without
  that, ``TopK(scope="call")`` (one top-k per call) differed at 2 and 4 ranks, and at 4 ranks
  Identity and PowerSGD too (gloo sums a buffer in chunks set by its layout).
* FSDP2 with ``reduce_scatter=gz.Int8()`` through DCP with ``state.exact()``: each rank's
  residual rows come back to that rank (the plain state folds them into the pending update,
  which loads into the self-addressed row only, so the next encode sees other inputs); saved
  so and loaded on fewer ranks, the pending update carries over as from the plain state.
  One 4-rank run saves the checkpoint that its bit-identical resume and the 2-rank loads read.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

import gradzip as gz
from tests.support import ddp_resume_matches_unbroken, run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")]

DDP_METHODS = {
    "TopK(0.01, scope='call')": lambda: gz.TopK(0.01, scope="call"),
    "TopK(0.003, values='sign', scope='call')": lambda: gz.TopK(0.003, values="sign", scope="call"),
    "Identity": lambda: gz.Identity(),
    "PowerSGD(rank=2)": lambda: gz.PowerSGD(rank=2),
}


def _ddp(rank, world, names):
    out = {}
    for name in names:
        r = ddp_resume_matches_unbroken(rank, DDP_METHODS[name](), 2)
        out[name] = {
            "differ": sum(not torch.equal(a, b) for a, b in zip(r["unbroken"], r["resumed"])),
            "max": max(float((a - b).abs().max()) for a, b in zip(r["unbroken"], r["resumed"])),
            "calls": len(r["ckpt"]["gradzip"]["calls"]),
        }
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_ddp_resume_is_bit_identical_though_the_first_step_has_other_buckets(world):
    names = list(DDP_METHODS) if world == 4 else list(DDP_METHODS)[:2]
    res = run_ranks(_ddp, world, names, timeout=400)
    for r in res:
        for name in names:
            assert r[name]["differ"] == 0, (name, r[name])
            assert r[name]["calls"] > 1, (name, r[name])  # the saved run had rebuilt its buckets


def _fsdp_run(rank, world, root, *, steps, save_at=None, load=False, exact=True):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    from tests.frontends.test_fsdp import batch, build, loss_of

    model, _ = build(world)
    state = gz.fsdp.compress(model, gz.Int8())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    first = 0
    ckpt = state.exact() if exact else state
    if load:
        sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt), "gradzip": ckpt}
        dcp.load(sd, checkpoint_id=root)
        set_model_state_dict(model, sd["model"])
        set_optimizer_state_dict(model, opt, sd["optim"])
        first = state.step
    for step in range(first, steps):
        idx, tgt = batch(rank, step)
        loss_of(model, idx, tgt).backward()
        opt.step()
        opt.zero_grad()
        if save_at is not None and step + 1 == save_at:
            sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt), "gradzip": ckpt}
            dcp.save(sd, checkpoint_id=root)
            return {"step": state.step, "pending": _pending(state)}
    if load and steps == first:
        return {"step": state.step, "pending": _pending(state)}
    return {
        "params": {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()},
        "step": state.step,
        "residuals": {k: v.clone() for k, v in state.engine.memory.residuals.items()},
    }


def _pending(state):
    return {k: v.full_tensor().clone() for k, v in state.state_dict().items() if k != "step"}


FSDP_STEPS, FSDP_SAVE_AT = 4, 2


def _fsdp(rank, world, root):
    unbroken = _fsdp_run(rank, world, root, steps=FSDP_STEPS)
    saved = _fsdp_run(rank, world, root, steps=FSDP_STEPS, save_at=FSDP_SAVE_AT)
    resumed = _fsdp_run(rank, world, root, steps=FSDP_STEPS, load=True)
    return {"unbroken": unbroken, "saved": saved, "resumed": resumed}


def _fsdp_load(rank, world, root, exact):
    return _fsdp_run(rank, world, root, steps=FSDP_SAVE_AT, load=True, exact=exact)


def _assert_bit_identical(res):
    for r in res:
        u, v = r["unbroken"], r["resumed"]
        assert u["step"] == v["step"] == FSDP_STEPS
        differ = [n for n in u["params"] if not torch.equal(u["params"][n], v["params"][n])]
        assert not differ, differ
        assert u["residuals"].keys() == v["residuals"].keys()
        assert all(torch.equal(u["residuals"][k], v["residuals"][k]) for k in u["residuals"])


def test_fsdp_int8_resume_through_dcp_is_bit_identical_on_2_ranks():
    with tempfile.TemporaryDirectory() as root:
        _assert_bit_identical(run_ranks(_fsdp, 2, os.path.join(root, "ckpt"), timeout=400))


def test_fsdp_int8_resume_on_4_ranks_is_bit_identical_and_loads_on_2_as_the_pending_update():
    """Saved with ``state.exact()`` on 4 ranks: resumed on 4, bit for bit; loaded on 2 (with
    ``exact()`` or the plain state), where the ranks differ, so the pending update carries
    over, bit for bit, as from a plain checkpoint."""
    with tempfile.TemporaryDirectory() as root:
        path = os.path.join(root, "ckpt")
        res = run_ranks(_fsdp, 4, path, timeout=400)
        _assert_bit_identical(res)
        saved = res[0]["saved"]
        for exact in (True, False):
            loaded = run_ranks(_fsdp_load, 2, path, exact, timeout=400)[0]
            assert loaded["step"] == saved["step"] == FSDP_SAVE_AT
            assert saved["pending"].keys() == loaded["pending"].keys()
            assert all(torch.equal(saved["pending"][k], loaded["pending"][k]) for k in saved["pending"])
            assert sum(float(v.abs().sum()) for v in saved["pending"].values()) > 0
