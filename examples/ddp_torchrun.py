"""DDP with gradzip's communication hook, under torchrun.

    torchrun --nproc_per_node 2 examples/ddp_torchrun.py --method "TopK(0.01)" --steps 200 --log-every 50

Every rank trains the same MLP on its own shard of a synthetic task (a random teacher
network labels Gaussian inputs, so nothing is downloaded); DDP's gradient allreduce is
replaced by ``--method`` (any spec of the method grammar: ``gz.parse``). Every
``--log-every`` steps the ``"gradzip"`` logger prints the interval's link ratio and
times on stderr (``state.log_every``: no ``logging`` setup needed); at the end each tensor's
route (``state.routes()``). CPU and gloo, or one GPU per rank with NCCL when CUDA is available.
"""

from __future__ import annotations

import argparse
import os


def setup():
    """Join the process group torchrun describes (unless already in one); the device."""
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def make_data(n: int, seed: int = 0):
    """``n`` Gaussian inputs of 32 features, labelled by a random teacher network (10 classes)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    teacher = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 10))
    with torch.no_grad():
        for p in teacher.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1))
        x = torch.randn(n, 32, generator=g)
        return x, teacher(x).argmax(1)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--method", default="TopK(0.01)", help="a gradzip method spec")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--log-every", type=int, default=50)
    return ap


def main(argv=None) -> dict:
    a = parser().parse_args(argv)  # --help and a bad flag answer before torch loads
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradzip as gz
    from gradzip.hooks import register_hook

    method = gz.parse(a.method)  # a bad method is refused before the ranks meet
    device = setup()
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)  # DDP also broadcasts rank 0's weights when it wraps the model
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)).to(device)
    ddp = DDP(model)
    state = register_hook(ddp, method)
    if rank == 0:
        state.log_every(a.log_every)  # one line on stderr every --log-every steps
    opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    x, y = make_data(8192)
    x, y = x[rank::world].to(device), y[rank::world].to(device)  # each rank its own shard
    g = torch.Generator().manual_seed(rank)
    for _ in range(a.steps):
        b = torch.randint(len(x), (a.batch,), generator=g).to(device)
        opt.zero_grad()
        loss = F.cross_entropy(ddp(x[b]), y[b])
        loss.backward()
        opt.step()
    s = state.stats()
    if rank == 0:
        for r in state.routes():
            print(f"  {r['name']:<10} {r['numel']:>6} elements  {r['method']} via {r['protocol']} ({r['reason']})")
        print(f"{a.method}: final loss {loss.item():.4f}, link ratio {s['ratio']:.1f}x over {s['steps']} steps")
    return {"loss": loss.item(), "stats": s, "routes": state.routes()}


if __name__ == "__main__":
    main()
    import torch.distributed as dist

    dist.destroy_process_group()
