"""Resume a DDP run with gradzip's hook from a checkpoint, one gradzip file per rank.

    torchrun --nproc_per_node 2 examples/resume_torchrun.py --steps 40 --save-at 20   # a new temporary directory
    torchrun --nproc_per_node 2 examples/resume_torchrun.py --checkpoint /tmp/gz_ckpt

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


def build(device, method):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradzip.hooks import register_hook

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)).to(device)
    ddp = DDP(model)
    state = register_hook(ddp, method)
    return ddp, torch.optim.AdamW(ddp.parameters(), lr=3e-3), state


def train(ddp, opt, data, steps, start):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    x, y = data
    for step in range(start, start + steps):
        g = torch.Generator().manual_seed(1000 * step + dist.get_rank())  # the batch of step `step`
        b = torch.randint(len(x), (64,), generator=g).to(x.device)
        opt.zero_grad()
        F.cross_entropy(ddp(x[b]), y[b]).backward()
        opt.step()


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--method", default="TopK(0.01)", help="a gradzip method spec")
    ap.add_argument(
        "--checkpoint", default=None, help="checkpoint directory, shared by the ranks (default: a new temporary one)"
    )
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--save-at", type=int, default=20)
    return ap


def main(argv=None) -> dict:
    a = parser().parse_args(argv)  # --help and a bad flag answer before torch loads
    import tempfile

    import torch
    import torch.distributed as dist
    from ddp_torchrun import make_data, setup

    import gradzip as gz

    method = gz.parse(a.method)  # a bad method is refused before the ranks meet
    device = setup()
    rank, world = dist.get_rank(), dist.get_world_size()
    where = [a.checkpoint or (tempfile.mkdtemp(prefix="gradzip_resume_") if rank == 0 else None)]
    dist.broadcast_object_list(where)  # one directory for every rank: rank 0's
    ckpt = where[0]
    x, y = make_data(8192)
    data = (x[rank::world].to(device), y[rank::world].to(device))

    # The unbroken run, saving at --save-at.
    ddp, opt, state = build(device, method)
    train(ddp, opt, data, a.save_at, 0)
    if rank == 0:
        os.makedirs(ckpt, exist_ok=True)
        torch.save({"model": ddp.module.state_dict(), "opt": opt.state_dict()}, os.path.join(ckpt, "model.pt"))
    state.save(ckpt)  # every rank: its own file
    dist.barrier()
    train(ddp, opt, data, a.steps - a.save_at, a.save_at)

    # The resumed run: fresh objects, then the checkpoint.
    ddp2, opt2, state2 = build(device, method)
    saved = torch.load(os.path.join(ckpt, "model.pt"), weights_only=True, map_location=device)
    ddp2.module.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])  # AdamW's moments: rank 0's equal every rank's (the averaged gradients are)
    state2.load(ckpt)
    train(ddp2, opt2, data, a.steps - a.save_at, a.save_at)
    diff = max((p - q).abs().max().item() for p, q in zip(ddp.parameters(), ddp2.parameters()))
    if rank == 0:
        print(
            f"{a.method}: {a.steps} steps unbroken and resumed at step {a.save_at}: max |param difference| {diff:.3g} "
            f"(checkpoint in {ckpt})"
        )
    return {"diff": diff, "step": state2.step, "files": sorted(os.listdir(ckpt)), "dir": ckpt}


if __name__ == "__main__":
    main()
    import torch.distributed as dist

    dist.destroy_process_group()
