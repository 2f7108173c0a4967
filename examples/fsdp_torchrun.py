"""FSDP2 with compressed weights and gradients (gradzip.fsdp, ZeRO++'s pieces), on CPU/gloo or one GPU per rank.

    torchrun --nproc_per_node 2 examples/fsdp_torchrun.py                 # Int8 weights, Int8 reduce-scatter
    torchrun --nproc_per_node 4 examples/fsdp_torchrun.py --local-size 2  # 2 nodes x 2: ZeRO++ (qwZ, hpZ, qgZ)
    torchrun --nproc_per_node 2 examples/fsdp_torchrun.py --all-gather none   # the reduce-scatter only
    torchrun --nproc_per_node 4 examples/fsdp_torchrun.py --hsdp          # HSDP 2 x 2, + PowerSGD replicas
    torchrun --nproc_per_node 2 examples/fsdp_torchrun.py --checkpoint /tmp/gz_ckpt   # DCP save, then resume

``--all-gather`` compresses the parameter all-gathers (each rank's shard quantized, every
shard decoded into FSDP's unsharded weights; weights are not error-fed: the full-precision
shard stays the source of truth). ``--local-size L`` (ranks per node; torchrun's
``--nproc_per_node`` on a real cluster) shards with ``reshard_after_forward=L``, so the
backward all-gather stays inside the node, and reduce-scatters with ``Hierarchical(method,
local_size=L)``: plain inside the node, compressed across nodes.

On CUDA (NCCL) each rank takes GPU ``LOCAL_RANK``; otherwise CPU and gloo. The GPU path
has not been run in gradzip's tests (no GPU there): it uses only device-agnostic calls.
"""

from __future__ import annotations

import argparse
import os

VOCAB, DIM = 512, 64


def make_net():
    """A two-block transformer-like MLP language model (embedding, LayerNorm, MLP blocks, head)."""
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(DIM)
            self.fc1 = nn.Linear(DIM, 4 * DIM)
            self.fc2 = nn.Linear(4 * DIM, DIM)

        def forward(self, x):
            return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(VOCAB, DIM)
            self.blocks = nn.ModuleList([Block(), Block()])
            self.norm = nn.LayerNorm(DIM)
            self.head = nn.Linear(DIM, VOCAB)

        def forward(self, idx):
            x = self.emb(idx)
            for b in self.blocks:
                x = b(x)
            # logits [batch * time, VOCAB]: the head on a 2-D input returns a tensor of its own (on
            # 3-D, Linear returns a view, and FSDP2 warns about a root module that returns one)
            return self.head(self.norm(x).flatten(0, 1))

    return Net()


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--method", default="Int8()", help="a gradzip method spec for the reduce-scatter")
    ap.add_argument(
        "--all-gather",
        default="Int8(block=256)",
        help="a codec for the parameter all-gathers: Int8(block=...), FP16(), BF16(), Identity(), or none",
    )
    ap.add_argument(
        "--local-size",
        type=int,
        default=None,
        help="ranks per node: reshard_after_forward=L and Hierarchical(method, local_size=L) (ZeRO++'s hpZ, qgZ)",
    )
    ap.add_argument(
        "--replicate-method", default="PowerSGD(rank=4)", help="with --hsdp: a gradzip method for the replica average"
    )
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--hsdp", action="store_true", help="2 replicas x (world / 2) shards; compress both collectives")
    ap.add_argument("--bf16", action="store_true", help="MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)")
    ap.add_argument("--accum", type=int, default=1, help="microbatches per step (set_requires_gradient_sync)")
    ap.add_argument("--checkpoint", default=None, help="DCP directory: load it if it exists, save to it at the end")
    return ap


def main(argv=None) -> dict:
    a = parser().parse_args(argv)  # --help and a bad flag answer before torch loads
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    import torch.nn as nn
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import gradzip as gz

    method, replicate = gz.parse(a.method), gz.parse(a.replicate_method)  # refused before the ranks meet
    gather = None if a.all_gather.lower() == "none" else gz.parse(a.all_gather)
    if a.local_size:
        method = gz.Hierarchical(method, local_size=a.local_size)
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    torch.manual_seed(0)
    model = make_net().to(device)
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if a.bf16
        else MixedPrecisionPolicy()
    )
    if a.hsdp:
        # gradzip compresses the replica average in FSDP's all-reduce hook: FSDP shards over the
        # shard sub-mesh only, and gradzip gets the replicate sub-mesh.
        mesh = init_device_mesh(device.type, (2, world // 2), mesh_dim_names=("replicate", "shard"))
        for b in model.blocks:
            fully_shard(b, mesh=mesh["shard"], mp_policy=mp)
        fully_shard(model, mesh=mesh["shard"], mp_policy=mp)
        state = gz.fsdp.compress(
            model, method, all_gather=gather, replicate=replicate, replicate_group=mesh["replicate"]
        )
    else:
        mesh = init_device_mesh(device.type, (world,))
        # reshard_after_forward=L: after the forward each rank keeps 1/L of a block's weights (the
        # decoded ones), so the backward all-gather runs inside the node (ZeRO++'s hpZ)
        raf = a.local_size if a.local_size and a.local_size < world else True
        for b in model.blocks:
            fully_shard(b, mesh=mesh, mp_policy=mp, reshard_after_forward=raf)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        state = gz.fsdp.compress(model, method, all_gather=gather)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    if a.checkpoint and os.path.exists(os.path.join(a.checkpoint, ".metadata")):
        sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt), "gradzip": state}
        dcp.load(sd, checkpoint_id=a.checkpoint)  # gradzip's pending updates are resharded like the parameters
        set_model_state_dict(model, sd["model"])
        set_optimizer_state_dict(model, opt, sd["optim"])
        if rank == 0:
            print(f"resumed from {a.checkpoint} at gradzip step {state.step}")

    g = torch.Generator().manual_seed(rank)
    for step in range(a.steps):
        for mb in range(a.accum):
            model.set_requires_gradient_sync(mb == a.accum - 1)  # reduce on the last microbatch only
            # a learnable toy language: every token determines the next one
            start = torch.randint(0, VOCAB, (8, 1), generator=g)
            idx = ((start * 5 + 3 * torch.arange(33)) % VOCAB).to(device)
            loss = nn.functional.cross_entropy(model(idx[:, :-1]).float(), idx[:, 1:].reshape(-1))
            loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0 and (step % 5 == 0 or step == a.steps - 1):
            print(f"step {step:3d} loss {loss.item():.4f}")

    s = state.stats()
    if rank == 0:
        rs = state.stats(which="reduce_scatter")
        print(
            f"reduce-scatter: {rs['bytes_link'] / rs['steps'] / 1e3:.1f} kB/step on the link per rank, "
            f"{rs['ratio']:.2f}x less than FSDP2's own reduce-scatter"
        )
        if gather is not None:
            ag = state.stats(which="all_gather")
            print(
                f"all-gathers: {ag['bytes_link'] / ag['steps'] / 1e3:.1f} kB/step per rank, {ag['ratio']:.2f}x less "
                f"than FSDP2's own; the whole step {s['ratio']:.2f}x less"
            )
        if a.local_size:
            print(
                f"across nodes: {(s['bytes_link'] - s['bytes_link_intra']) / s['steps'] / 1e3:.1f} kB/step per rank "
                f"(inside the node: {s['bytes_link_intra'] / s['steps'] / 1e3:.1f} kB, uncompressed)"
            )
        if a.hsdp:
            r = state.stats("replicate")
            print(
                f"replica all-reduce: {r['bytes_link'] / r['steps'] / 1e3:.1f} kB/step per rank, {r['ratio']:.2f}x less"
            )
    if a.checkpoint:
        dcp.save(
            {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt), "gradzip": state},
            checkpoint_id=a.checkpoint,
        )
        if rank == 0:
            print(f"saved {a.checkpoint}")
    return {"loss": loss.item(), "stats": s, "step": state.step}


if __name__ == "__main__":
    main()
    import torch.distributed as dist

    dist.destroy_process_group()
