"""The Communicator's ordering guarantee and error paths, on real gloo ranks."""

import time

import pytest
import torch
import torch.distributed as dist

from gradzip.comm import Communicator, Round, allgather_bytes
from tests.support import run_ranks

pytestmark = pytest.mark.slow


def three_rounds(comm, value):
    a = torch.tensor([float(value)])
    yield Round([comm.allreduce(a)])
    b = a * 2
    yield Round([comm.allreduce(b, op=dist.ReduceOp.MAX)])
    c = b + 1
    yield Round([comm.allreduce(c)], last=True)
    return c.item()


def failing(comm):
    t = torch.ones(1)
    yield Round([comm.allreduce(t)], last=True)
    raise ValueError("decode failed")


def _ordering(rank, world, defer=None):
    comm = Communicator(defer=defer)
    assert comm.defer == (True if defer is None else defer)  # gloo: deferred by default
    futs = []
    for i in range(6):
        if rank == 1:
            time.sleep(0.01 * (i % 3))  # ranks reach each submit at different times
        msg = torch.full((5 + 3 * i * (rank + 1),), i + rank, dtype=torch.uint8)
        futs.append(comm.submit(allgather_bytes(comm, msg)))
        futs.append(comm.submit(three_rounds(comm, i + rank)))
        # Deferred: every protocol waits at its first round until flush(); else only the newest.
        assert comm.pending == (2 * (i + 1) if comm.defer else 1)
    comm.flush()
    assert comm.pending == 0
    vals = [f.wait() for f in futs]
    err = comm.submit(failing(comm))
    comm.flush()
    with pytest.raises(Exception, match="decode failed"):
        err.wait()
    return {"vals": vals, "stats": comm.stats.as_dict()}


@pytest.mark.parametrize("defer", [None, False])
def test_protocols_interleave_in_one_order_on_every_rank(defer):
    res = run_ranks(_ordering, 2, defer) if defer is not None else run_ranks(_ordering, 2)
    for r in res:
        vals = r["vals"]
        for i in range(6):
            g = vals[2 * i]
            lens = [5 + 3 * i * (k + 1) for k in range(2)]
            assert g.shape == (2, max(lens))
            for k in range(2):
                assert torch.all(g[k, : lens[k]] == i + k) and torch.all(g[k, lens[k] :] == 0)
            s = i + i + 1  # round 1: sum over ranks
            assert vals[2 * i + 1] == 2 * s * 2 + 2  # max(2s, 2s) + 1, summed over 2 ranks
        st = r["stats"]
        assert st["collectives"] == 6 * 2 + 6 * 3 + 1
