"""The FSDP2 acceptance run: 100 steps of FSDP2 (2 and 4 ranks) and HSDP (2 x 2) on CPU/gloo.

For every layout it trains the transformer-like test model (an embedding, two
attention-free MLP blocks with LayerNorm, a head; each block and the root
``fully_shard``'d) plain, through gradzip.fsdp with Identity, and with Int8 (error
feedback on), from the same initialization and data, and records:

* Identity against plain: whether the full parameters are equal bit for bit, else the
  largest difference (at 4 ranks gloo's reduce-scatter sums in ring order and gradzip in
  rank order: float32 rounding);
* Int8 against plain: the largest loss difference per step, against plain's band (the
  standard deviation of its own loss over the last 20 steps), and the largest parameter
  difference;
* gradzip's own byte counters (link bytes against a plain reduce-scatter's).

    .venv/bin/python -m benchmarks.fsdp_acceptance      # writes benchmarks/results/fsdp_acceptance.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

from benchmarks._common import RESULTS, command
from tests.frontends.test_fsdp import train  # the test suite's model and training loop
from tests.support.ranks import run_ranks

LAYOUTS = [("fsdp", 2, {}), ("fsdp", 4, {}), ("hsdp", 4, {})]


def _work(rank, world, layout, steps, lr):
    import warnings

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    out = {}
    if layout == "fsdp":
        runs = {"plain": {}, "identity": dict(rs="Identity()"), "int8": dict(rs="Int8()")}
    else:  # gradzip's HSDP: FSDP on the shard sub-mesh, the replica average in the hook
        runs = {
            "plain": dict(layout="hsdp"),
            "identity": dict(layout="hsdp_shard", rs="Identity()", replicate="Identity()"),
            "int8": dict(layout="hsdp_shard", rs="Int8()", replicate="Int8()"),
        }
    for name, kw in runs.items():
        t0 = time.perf_counter()
        out[name] = train(rank, world, steps=steps, lr=lr, **kw)
        out[name]["seconds"] = time.perf_counter() - t0
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--out", default=str(RESULTS / "fsdp_acceptance.json"))
    a = ap.parse_args()
    import torch

    rows = []
    for layout, world, _ in LAYOUTS:
        t0 = time.time()
        res = run_ranks(_work, world, layout, a.steps, a.lr, timeout=3600, pg_timeout=600)
        r = res[0]
        plain, ident, int8 = r["plain"], r["identity"], r["int8"]

        def diff(x, y):
            return max((x[k] - y[k]).abs().max().item() for k in x)

        band = plain["losses"][-20:]
        row = {
            "layout": "FSDP2"
            if layout == "fsdp"
            else "HSDP 2x2 (FSDP on mesh['shard'] + gradzip replica hook; plain: native HSDP)",
            "world": world,
            "steps": a.steps,
            "identity_bit_identical": all(torch.equal(ident["params"][k], plain["params"][k]) for k in plain["params"]),
            "identity_max_param_diff": diff(ident["params"], plain["params"]),
            "identity_max_loss_diff": max(abs(x - y) for x, y in zip(ident["losses"], plain["losses"])),
            "int8_max_param_diff": diff(int8["params"], plain["params"]),
            "int8_max_loss_diff": max(abs(x - y) for x, y in zip(int8["losses"], plain["losses"])),
            "plain_final_loss": plain["losses"][-1],
            "int8_final_loss": int8["losses"][-1],
            # plain's band: the standard deviation of its own loss over the last 20 steps
            "plain_loss_std_last20": statistics.pstdev(band),
            "int8_within_plain_band": max(abs(x - y) for x, y in zip(int8["losses"], plain["losses"]))
            <= statistics.pstdev(band),
            "ranks_agree": all(
                torch.equal(q[m]["params"][k], r[m]["params"][k]) for q in res[1:] for m in r for k in r[m]["params"]
            ),
            "int8_stats": {
                k: int8["stats"][k]
                for k in ("steps", "bytes_raw", "bytes_sent", "bytes_link", "bytes_link_raw", "ratio")
            },
            "int8_replicate_stats": {
                k: int8["replicate_stats"][k] for k in ("steps", "bytes_link", "bytes_link_raw", "ratio")
            }
            if "replicate_stats" in int8
            else None,
            "losses": {"plain": plain["losses"], "identity": ident["losses"], "int8": int8["losses"]},
            "seconds": {m: r[m]["seconds"] for m in r},
        }
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "losses"}), f"({time.time() - t0:.0f} s)", flush=True)
    out = {
        "benchmark": "benchmarks/fsdp_acceptance.py",
        "command": command("fsdp_acceptance", python=".venv/bin/python"),
        "machine": {
            "description": f"this {os.cpu_count()}-core VM (shared), CPU only, gloo on 127.0.0.1",
            "torch": torch.__version__,
            "python": platform.python_version(),
            "kernel": platform.release(),
        },
        "model": "Embedding(37, 22), 2 x [LayerNorm, Linear(22, 66), GELU, Linear(66, 22)], LayerNorm, Linear(22, 37); "
        f"SGD lr {a.lr:g} momentum 0.9, batch 4 x 8 tokens per rank",
        "rows": rows,
    }
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
