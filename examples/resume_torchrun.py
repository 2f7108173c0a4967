"""Resume a DDP run with gradzip's hook from a checkpoint, one gradzip file per rank.

    torchrun --nproc_per_node 2 examples/resume_torchrun.py --checkpoint ckpt --steps 40 --save-at 20

Error-feedback residuals are per rank: rank 0 saves the model, and every rank saves its
own gradzip state (``state.save(dir)``: ``gradzip_rank{r}_of_{N}.pt``); a rank that
loads another rank's state gets a ``ValueError`` naming both. The script trains
``--steps`` steps in one go, then again from the checkpoint written at ``--save-at``
(fresh model, optimizer and hook), and prints how far apart the two runs end.
On another number of ranks, turn the files into new ones first:
``gradzip.checkpoint.write_states(gz.reshard(read_states(old), M), new)``.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ddp_torchrun import make_data, setup
from torch.nn.parallel import DistributedDataParallel as DDP

import gradzip as gz
from gradzip.hooks import register_hook


def build(device, method):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)).to(device)
    ddp = DDP(model)
    state = register_hook(ddp, gz.parse(method))
    return ddp, torch.optim.AdamW(ddp.parameters(), lr=3e-3), state


def train(ddp, opt, data, steps, start):
    x, y = data
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 * step + dist.get_rank())  # the batch of step `step`
        b = torch.randint(len(x), (64,), generator=g).to(x.device)
        opt.zero_grad()
        F.cross_entropy(ddp(x[b]), y[b]).backward()
        opt.step()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--method", default="TopK(0.01)", help="a gradzip method spec")
    ap.add_argument("--checkpoint", default="ckpt", help="checkpoint directory (shared by the ranks)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--save-at", type=int, default=20)
    a = ap.parse_args(argv)
    device = setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = make_data(8192)
    data = (x[rank::world].to(device), y[rank::world].to(device))

    # The unbroken run, saving at --save-at.
    ddp, opt, state = build(device, a.method)
    train(ddp, opt, data, a.save_at, 0)
    if rank == 0:
        os.makedirs(a.checkpoint, exist_ok=True)
        torch.save({"model": ddp.module.state_dict(), "opt": opt.state_dict()}, os.path.join(a.checkpoint, "model.pt"))
    state.save(a.checkpoint)  # every rank: its own file
    dist.barrier()
    train(ddp, opt, data, a.steps - a.save_at, a.save_at)

    # The resumed run: fresh objects, then the checkpoint.
    ddp2, opt2, state2 = build(device, a.method)
    saved = torch.load(os.path.join(a.checkpoint, "model.pt"), weights_only=True, map_location=device)
    ddp2.module.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])  # AdamW's moments: rank 0's equal every rank's (the averaged gradients are)
    state2.load(a.checkpoint)
    train(ddp2, opt2, data, a.steps - a.save_at, a.save_at)
    diff = max((p - q).abs().max().item() for p, q in zip(ddp.parameters(), ddp2.parameters()))
    if rank == 0:
        print(
            f"{a.method}: {a.steps} steps unbroken and resumed at step {a.save_at}: max |param difference| {diff:.3g}"
        )
    return {"diff": diff, "step": state2.step, "files": sorted(os.listdir(a.checkpoint))}


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
