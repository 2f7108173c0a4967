"""The Communicator's experimental pipelined rounds (``GRADZIP_PIPELINE_ROUNDS=1``): on gloo each
submit first moves the pending protocols on by a round. Multi-round protocols (AllGather of TopK,
TwoPhase, PowerSGD) with 1 MB buckets on 4 ranks whose batches differ: no hang, and the same
parameters, bit for bit, as with the rounds deferred to the flush."""

from __future__ import annotations

import os

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip as gz
from gradzip.hooks import register_hook
from tests.support import run_ranks


def _train(rank, world, pipeline, steps):
    os.environ["GRADZIP_PIPELINE_ROUNDS"] = "1" if pipeline else "0"
    out = {}
    for comp in (gz.AllGather(gz.TopK(0.01)), gz.TopK(0.01), gz.PowerSGD(rank=2)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(300, 300) for _ in range(6)])
        ddp = DDP(model, bucket_cap_mb=1)
        state = register_hook(ddp, comp)
        assert state.engine.comm.pipeline is pipeline
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        for s in range(steps):
            x = torch.randn(4 * (rank + 1), 300, generator=torch.Generator().manual_seed(s * 31 + rank))
            opt.zero_grad()
            (ddp(x) ** 2).mean().backward()
            opt.step()
        out[repr(comp)] = [p.detach().clone() for p in model.parameters()]
    os.environ.pop("GRADZIP_PIPELINE_ROUNDS", None)
    return out


def test_pipelined_rounds_on_four_ranks_match_the_flushed_ones():
    flushed = run_ranks(_train, 4, False, 10, timeout=600)
    piped = run_ranks(_train, 4, True, 10, timeout=600)
    for key, params in flushed[0].items():
        for r in range(4):
            assert all(torch.equal(a, b) for a, b in zip(piped[r][key], params)), (key, r)
            assert all(torch.equal(a, b) for a, b in zip(flushed[r][key], params)), (key, r)
