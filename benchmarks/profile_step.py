"""Where one rank's training step spends its time, for one method (cProfile; CPU, no root).

    python -m benchmarks.profile_step "Policy(PowerSGD(rank=4), auto=True)" [--steps 5] [--top 18]

One gloo rank (world size 1), the step_time.py model (25.2M parameters) under DDP with
``gradient_as_bucket_view=True`` and gradzip's hook for the method, a label of
``step_time.methods`` (``DDP``: no hook). The method is built by ``step_time.methods`` as if
for ``--ranks`` ranks on a link of ``--bps`` bits/s, so ``Policy(..., auto=True)`` chooses
routes as it would there. With one rank the collectives cost almost nothing, so what is
left is the host work of the step and the codec. Prints the mean wall time per step, then
the functions with the most time spent in them.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time

from benchmarks import step_time as st
from benchmarks._common import free_port


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("method")
    p.add_argument("--ranks", type=int, default=4, help="world size the method is configured for")
    p.add_argument("--bps", type=float, default=5.2e9, help="link the method is configured for (bits/s)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--top", type=int, default=18)
    a = p.parse_args(argv)
    known = st.methods(a.bps, a.ranks)
    names = st.parse_methods(p, a.method, a.ranks)
    if len(names) != 1 or names[0] not in known:
        p.error(f"name one method of {list(known)}, not {a.method!r}")
    a.method = names[0]

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradzip.hooks import register_hook

    port = free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    torch.set_num_threads(1)
    try:
        model = st.build_model(4096, 1)
        ddp = DDP(model, gradient_as_bucket_view=True)
        if known[a.method] is not None:
            register_hook(ddp, known[a.method])
        x = torch.randn(16, 1024, generator=torch.Generator().manual_seed(0))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)

        def step():
            opt.zero_grad(set_to_none=False)
            ddp(x).square().mean().backward()
            opt.step()

        for _ in range(a.warmup):
            step()
        prof = cProfile.Profile()
        prof.enable()
        t0 = time.perf_counter()
        for _ in range(a.steps):
            step()
        wall = (time.perf_counter() - t0) / a.steps
        prof.disable()
        print(f"{a.method}: {1e3 * wall:.1f} ms/step (mean of {a.steps}, profiled)")
        pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(a.top)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
