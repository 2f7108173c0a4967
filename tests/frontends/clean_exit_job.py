"""Jobs that must leave with exit status 0 once their work is done (tests/frontends/test_clean_exit.py).

    python tests/frontends/clean_exit_job.py ddp RANK WORLD PORT [destroy]
    python tests/frontends/clean_exit_job.py callback

``ddp``: one rank of a float64 model under DDP with ``register_hook(ddp, gradzip.Int8())`` on
gloo (127.0.0.1:PORT), a few steps, then the script ends as users' scripts do: without
``destroy_process_group()`` (or with it, ``destroy``). gloo runs the hook's last decode on its
worker thread and the protocol's future wakes DDP's backward before that callback has
returned, so the script can end while gloo's thread still needs the GIL.

``callback``: the same race made certain, on a world of one: a protocol whose decode, run by
gloo's worker thread, is still sleeping when the script ends without waiting for it.

Before gradzip waited for its collectives at exit (gradzip/comm.py), such a process could
abort in the interpreter's finalization: "terminate called without an active exception",
SIGABRT (issue 60).
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

STEPS = 4


def ddp(rank: int, world: int, port: int, destroy: bool) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradzip
    from gradzip.hooks import register_hook

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).double()
    ddp_model = DDP(model)
    register_hook(ddp_model, gradzip.Int8())
    opt = torch.optim.SGD(ddp_model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        opt.zero_grad()
        ddp_model(torch.randn(8, 16, dtype=torch.float64, generator=g)).square().mean().backward()
        opt.step()
    print(f"rank {rank}: done", flush=True)
    if destroy:
        dist.destroy_process_group()


def callback() -> None:
    from gradzip.comm import Communicator, Round

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    comm = Communicator()

    def protocol():
        t = torch.ones(8, dtype=torch.float64)
        yield Round([comm.allreduce(t)], last=True)
        time.sleep(0.5)  # the decode, on gloo's worker thread, while the script ends
        return t

    comm.submit(protocol())
    print("done", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if sys.argv[1] == "ddp":
        ddp(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), destroy=sys.argv[5:] == ["destroy"])
    elif sys.argv[1] == "callback":
        callback()
    else:
        raise SystemExit(f"unknown job {sys.argv[1]!r}")
