"""FSDP2 with Int8 weights and Int8 gradients against plain FSDP2: the loss of a small transformer.

The byte-level GPT of ``gradzip.bench.lm`` (``tiny``: 4 blocks of width 128, 0.88M parameters;
``fully_shard`` per block and on the root) trains on the bundled text for ``--steps`` AdamW
steps on 2 gloo ranks, from the same initialization and batches, three ways per seed:

* plain FSDP2;
* ``gz.fsdp.compress(model, all_gather=Int8(block=256))``: Int8 weights alone, to show what
  quantizing the weights (which are not error-fed) does to the loss;
* ``all_gather=Int8(block=256)`` and ``reduce_scatter=Int8()`` (with error feedback): a whole
  step compressed.

It records the training loss of every step, the mean of the last 20, and the validation loss
at the end (the same 64 windows for every run, scored by both ranks), and compares each with
plain FSDP2's, seed by seed. The learning rate warms up over 10 steps and decays to a tenth by
the last step (cosine; ``--schedule constant`` keeps it flat: at a high constant rate the loss at
step 200 is still falling fast, and the runs' ends differ more by where each noisy trajectory
happens to be).

    .venv/bin/python -m benchmarks.fsdp_zeropp_loss     # writes benchmarks/results/fsdp_zeropp_loss.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from benchmarks._common import RESULTS, command
from tests.support.ranks import run_ranks

RUNS = {
    "plain FSDP2": dict(ag=None, rs=None),
    "Int8 weights": dict(ag="Int8(block=256)", rs=None),
    "Int8 weights + Int8 gradients": dict(ag="Int8(block=256)", rs="Int8()"),
}


def _lr_at(step: int, steps: int, lr: float, schedule: str) -> float:
    """Linear warm-up over 10 steps, then cosine decay to ``lr / 10`` at the last step (or flat)."""
    import math

    if schedule == "constant":
        return lr
    if step < 10:
        return lr * (step + 1) / 10
    t = (step - 10) / max(steps - 11, 1)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def _train(rank, world, seed, ag, rs, steps, batch, context, lr, schedule="cosine"):
    import warnings

    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import gradzip as gz
    from gradzip.bench import lm

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    model = lm.make_gpt("tiny", seed)
    mesh = init_device_mesh("cpu", (world,))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    state = None
    if ag or rs:
        state = gz.fsdp.compress(model, gz.parse(rs) if rs else None, all_gather=gz.parse(ag) if ag else None)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    train, val = lm.corpus()
    batches = lm.Batches(train, context, batch, seed, rank)
    losses = []
    t0 = time.perf_counter()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, steps, lr, schedule)
        x, y = batches.next()
        loss = F.cross_entropy(model(x).reshape(-1, lm.VOCAB), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    seconds = time.perf_counter() - t0
    wins = lm.windows(val, context, limit=64)  # 32 a rank: one forward each, alike on both ranks
    out = {"losses": losses, "val_loss": lm.val_loss(model, wins, world, rank, batch=32), "seconds": seconds}
    if state is not None:
        out["stats"] = {k: state.stats(which=k) for k in state._engines()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--batch", type=int, default=4, help="windows per rank per step")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--schedule", default="cosine", choices=["cosine", "constant"])
    ap.add_argument("--out", default=str(RESULTS / "fsdp_zeropp_loss.json"))
    a = ap.parse_args()
    import torch

    from gradzip.machine import machine

    seeds = [int(s) for s in a.seeds.split(",")]
    rows = []
    for seed in seeds:
        got = {}
        for label, kw in RUNS.items():
            t0 = time.time()
            r = run_ranks(
                _train, 2, seed, kw["ag"], kw["rs"], a.steps, a.batch, a.context, a.lr, a.schedule, timeout=3600
            )[0]
            got[label] = r
            print(
                f"seed {seed} {label:32s} val {r['val_loss']:.4f} train(last 20) "
                f"{statistics.mean(r['losses'][-20:]):.4f} ({time.time() - t0:.0f} s)",
                flush=True,
            )
        plain = got["plain FSDP2"]
        for label, r in got.items():
            last20 = statistics.mean(r["losses"][-20:])
            base20 = statistics.mean(plain["losses"][-20:])
            row = {
                "seed": seed,
                "run": label,
                **RUNS[label],
                "val_loss": r["val_loss"],
                "val_loss_rel_to_plain": r["val_loss"] / plain["val_loss"] - 1,
                "train_loss_last20": last20,
                "train_loss_last20_rel_to_plain": last20 / base20 - 1,
                "seconds": r["seconds"],
                "losses": r["losses"],
            }
            if "stats" in r:
                row["ratio"] = {k: v["ratio"] for k, v in r["stats"].items()}
            rows.append(row)
    summary = {}
    for label in RUNS:
        mine = [r for r in rows if r["run"] == label]
        summary[label] = {
            "val_loss_mean": statistics.mean(r["val_loss"] for r in mine),
            "val_loss_rel_to_plain_per_seed": [r["val_loss_rel_to_plain"] for r in mine],
            "val_loss_rel_to_plain_max_abs": max(abs(r["val_loss_rel_to_plain"]) for r in mine),
            "train_loss_last20_rel_to_plain_per_seed": [r["train_loss_last20_rel_to_plain"] for r in mine],
        }
    out = {
        "benchmark": "benchmarks/fsdp_zeropp_loss.py",
        "command": command("fsdp_zeropp_loss", python=".venv/bin/python"),
        "machine": {
            **machine(),
            "description": f"this shared {os.cpu_count()}-core VM (other jobs ran beside it), CPU only, 2 gloo ranks",
            "torch": torch.__version__,
        },
        "model": "gradzip.bench.lm GPT tiny (4 x 128, context 128), fully_shard per block and on the root; "
        f"AdamW lr {a.lr:g} ({a.schedule}); {a.batch} windows of {a.context} bytes per rank per step; {a.steps} steps",
        "seeds": seeds,
        "summary": summary,
        "rows": rows,
    }
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(summary, indent=1))
    print("wrote", a.out)


if __name__ == "__main__":
    main()
