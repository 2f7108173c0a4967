"""gradzip's Horovod-style DistributedOptimizer (no DDP), under torchrun.

    torchrun --nproc_per_node 2 examples/optimizer_torchrun.py --method "PowerSGD(rank=2)" --steps 200

Without DDP nothing broadcasts the model: ``gz.broadcast_parameters`` gives every rank
rank 0's weights (the optimizer checks on its first step that the ranks agree, and
raises naming the first parameter that differs). Gradients are averaged with
``--method``; buckets start communicating during backward.
"""

from __future__ import annotations

import argparse


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--method", default="PowerSGD(rank=2)", help="a gradzip method spec")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--batch", type=int, default=64)
    return ap


def main(argv=None) -> dict:
    a = parser().parse_args(argv)  # --help and a bad flag answer before torch loads
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from ddp_torchrun import make_data, setup

    import gradzip as gz

    method = gz.parse(a.method)  # a bad method is refused before the ranks meet
    device = setup()
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(rank)  # different on every rank on purpose: the broadcast fixes it
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)).to(device)
    gz.broadcast_parameters(model, root=0)
    opt = gz.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=model.named_parameters(),
        compression=method,
    )
    x, y = make_data(8192)
    x, y = x[rank::world].to(device), y[rank::world].to(device)
    g = torch.Generator().manual_seed(rank)
    for _ in range(a.steps):
        b = torch.randint(len(x), (a.batch,), generator=g).to(device)
        opt.zero_grad()
        loss = F.cross_entropy(model(x[b]), y[b])
        loss.backward()
        opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    lo, hi = flat.clone(), flat.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    same = bool(torch.equal(lo, hi))
    s = opt.stats()
    if rank == 0:
        print(f"{a.method}: final loss {loss.item():.4f}, link ratio {s['ratio']:.1f}x, replicas identical: {same}")
    return {"loss": loss.item(), "identical": same, "stats": s}


if __name__ == "__main__":
    main()
    import torch.distributed as dist

    dist.destroy_process_group()
