"""DiLoCo and Streaming DiLoCo with gradzip, under torchrun.

    torchrun --nproc_per_node 2 examples/diloco_torchrun.py
    torchrun --nproc_per_node 2 examples/diloco_torchrun.py --fragments 4 --delay 2 --alpha 0.5
    torchrun --nproc_per_node 4 examples/diloco_torchrun.py --ddp-size 2   # 2 workers of 2 DDP ranks each

Each worker trains on its own data shard with an inner AdamW for ``--period`` steps;
then the pseudo-gradients (global model minus local model) are averaged over the
workers, sent with ``--method`` (any gradzip method spec, int8 with error
feedback by default), and an outer SGD with Nesterov momentum (lr 0.7, momentum 0.9)
steps the global model. With ``--fragments F`` the model is synced in F fragments in
turn, each reduce overlapping ``--delay`` inner steps and merged with ``--alpha``.

With ``--ddp-size k`` each worker is a DDP group of k ranks (consecutive ranks): DDP
averages gradients inside the worker every step, and DiLoCo averages pseudo-gradients
over the group that joins the ranks with the same position in their worker.

CPU (gloo) or one GPU per rank (NCCL) when CUDA is available. The task is a synthetic
classification problem (a random teacher network labels Gaussian inputs), so nothing
is downloaded.
"""

from __future__ import annotations

import argparse
import os
import time


def make_data(n: int, dim: int, classes: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    teacher = torch.nn.Sequential(torch.nn.Linear(dim, 64), torch.nn.Tanh(), torch.nn.Linear(64, classes))
    with torch.no_grad():
        for p in teacher.parameters():  # weights ~ N(0, 1/fan_in), biases ~ N(0, 0.01)
            p.copy_(torch.randn(p.shape, generator=g) * (p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1))
        x = torch.randn(n, dim, generator=g)
        y = teacher(x).argmax(1)
    return x, y


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--period", type=int, default=16, help="inner steps between outer steps (H)")
    ap.add_argument("--method", default="Int8()", help="a gradzip method spec, e.g. 'TopK(0.01)', 'Identity'")
    ap.add_argument("--fragments", type=int, default=1)
    ap.add_argument("--delay", type=int, default=0)
    ap.add_argument("--alpha", type=float, default=0.0)
    ap.add_argument("--steps", type=int, default=320)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3, help="inner AdamW learning rate")
    ap.add_argument("--ddp-size", type=int, default=1, help="ranks per worker (a DDP group)")
    ap.add_argument("--checkpoint", default="", help="save the run's state here at the end (one file per rank)")
    return ap


def main(argv=None) -> dict:
    a = parser().parse_args(argv)  # --help and a bad flag answer before torch loads
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import gradzip as gz

    method = gz.parse(a.method)  # a bad method is refused before the ranks meet
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    if world % a.ddp_size:
        raise SystemExit(f"--ddp-size {a.ddp_size} must divide the world size {world}")
    workers = world // a.ddp_size
    worker, position = divmod(rank, a.ddp_size)
    # Every rank creates every group, in the same order (torch.distributed requires it).
    ddp_groups = [dist.new_group(list(range(w * a.ddp_size, (w + 1) * a.ddp_size))) for w in range(workers)]
    outer_groups = [dist.new_group(list(range(p, world, a.ddp_size))) for p in range(a.ddp_size)]

    torch.manual_seed(0)  # every rank starts from the same model
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)
    ).to(device)
    net = model
    if a.ddp_size > 1:
        kw = {"device_ids": [device.index]} if cuda else {}
        net = torch.nn.parallel.DistributedDataParallel(model, process_group=ddp_groups[worker], **kw)
    inner = torch.optim.AdamW(net.parameters(), lr=a.lr, weight_decay=0.01)
    opt = gz.DiLoCo(
        inner,
        model,
        period=a.period,
        compression=method,
        fragments=a.fragments,
        delay=a.delay,
        alpha=a.alpha,
        process_group=outer_groups[position] if a.ddp_size > 1 else None,
    )

    x, y = make_data(16384 + 2048, 32, 10)
    xtr, ytr, xte, yte = x[:16384].to(device), y[:16384].to(device), x[16384:].to(device), y[16384:].to(device)
    shard = torch.arange(rank, len(xtr), world, device=device)  # each rank its own data
    g = torch.Generator().manual_seed(rank)
    t0 = time.perf_counter()
    for step in range(1, a.steps + 1):
        b = shard[torch.randint(len(shard), (a.batch,), generator=g).to(device)]
        opt.zero_grad()
        loss = F.cross_entropy(net(xtr[b]), ytr[b])
        loss.backward()
        opt.step()
        if rank == 0 and (step % (4 * a.period) == 0 or step == a.steps):
            print(f"step {step:5d}  local loss {loss.item():.4f}", flush=True)
    opt.synchronize()  # every rank now holds the global model
    elapsed = time.perf_counter() - t0

    with torch.no_grad():
        acc = (model(xte).argmax(1) == yte).float().mean().item()
        flat = torch.cat([p.reshape(-1) for p in model.parameters()])
        lo, hi = flat.clone(), flat.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    s = opt.stats()
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    if rank == 0:
        print(
            f"{workers} worker(s) x {a.ddp_size} rank(s), {opt!r}\n"
            f"test accuracy {acc:.4f}; replicas identical: {bool(torch.equal(lo, hi))}; "
            f"{s['syncs']} syncs, {s['bytes_sent_per_step']:.0f} B/step sent by each rank "
            f"(DDP: {dense} B/step, {dense / max(s['bytes_sent_per_step'], 1e-9):.0f}x more); {elapsed:.1f} s"
        )
    if a.checkpoint:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, f"{a.checkpoint}.rank{rank}")
    return {"accuracy": acc, "identical": bool(torch.equal(lo, hi)), "stats": s}


if __name__ == "__main__":
    main()
    import torch.distributed as dist

    dist.destroy_process_group()
