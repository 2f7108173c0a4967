"""Local SGD with gradzip, under torchrun: each rank steps on its own, and the model
deltas are averaged every ``--period`` steps through ``--method``, with error feedback.

    torchrun --nproc_per_node 2 examples/local_sgd_torchrun.py --period 8 --method "Int8()" --steps 200

(DiLoCo and streaming DiLoCo: ``examples/diloco_torchrun.py``.)
"""

from __future__ import annotations

import argparse


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--method", default="Int8()", help="a gradzip method spec for the deltas")
    ap.add_argument("--period", type=int, default=8)
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

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)).to(device)
    gz.broadcast_parameters(model)  # the same start everywhere (LocalSGD checks it on its first step)
    opt = gz.LocalSGD(
        torch.optim.SGD(model.parameters(), lr=0.05),
        model,
        period=gz.schedules.PostLocal(warmup_steps=a.period, period=a.period),
        compression=method,
        overlap=True,
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
    opt.synchronize()  # every rank now holds the same model
    s = opt.stats()
    if rank == 0:
        print(
            f"{opt!r}: final local loss {loss.item():.4f}, {s['syncs']} syncs in {s['steps']} steps, "
            f"link ratio {s['ratio']:.1f}x per sync"
        )
    return {"loss": loss.item(), "stats": s}


if __name__ == "__main__":
    main()
    import torch.distributed as dist

    dist.destroy_process_group()
