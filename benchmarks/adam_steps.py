"""How large a step AdamW takes per coordinate under each method (why SignSGD trails with AdamW).

    python -m benchmarks.adam_steps [--methods "Identity, SignSGD, TopK(0.003, values='sign', scope='call')"]
                                   [--seed 0] [--clip 2] [--epochs 16] [--precondition]

Trains the bench's MNIST CNN on 4 gloo ranks with AdamW (the bench's settings, momentum
corrected for every compressing method as ``--momentum-correction on`` does) and, after each
optimizer step on rank 0, reads AdamW's state: the normalized step of each coordinate,
``|m_hat| / (sqrt(v_hat) + eps)`` (the step is ``lr`` times it). Reports, over the last epoch's
steps, its mean and median over all coordinates and the fraction of coordinates above 0.1 and 0.5: a
method whose averaged update has the same magnitude on every coordinate (re-signed values)
makes AdamW step about ``lr`` everywhere. With ``--precondition`` the momentum-corrected rows
keep both of Adam's moments in the hook (``register_hook(precondition=True)``), and the
normalized step of such a row is what the optimizer applies: the averaged step in ``p.grad``.
Writes benchmarks/results/adam_steps_cpu.json (``--out``).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.multiprocessing as mp

from benchmarks._common import RESULTS, command, write_result
from gradzip import bench

WORLD = 4


def _normalized_steps(opt: torch.optim.Optimizer) -> torch.Tensor:
    out = []
    for group in opt.param_groups:
        b1, b2 = group["betas"]
        for p in group["params"]:
            st = opt.state.get(p, {})
            if "exp_avg_sq" not in st:
                if p.grad is not None:  # precondition=True: the hook's averaged Adam step, applied as it is
                    out.append(p.grad.detach().abs().flatten())
                continue
            t = float(st["step"])
            m = st["exp_avg"] / (1 - b1**t)
            v = st["exp_avg_sq"] / (1 - b2**t)
            out.append((m.abs() / (v.sqrt() + group["eps"])).flatten())
    return torch.cat(out)


def _worker(rank: int, port: int, methods: dict, cfg: bench.BenchConfig, last: int, queue) -> None:
    bench.init_worker(rank, WORLD, port)
    records: list = []

    def observe(opt):
        def post(o, _args, _kwargs):
            records.append(_normalized_steps(o))
            del records[:-last]  # keep the last epoch

        opt.register_step_post_hook(post)

    try:
        for label, method in methods.items():
            records.clear()
            res = bench.train_one(
                rank,
                WORLD,
                method,
                cfg,
                bench.load_dataset(cfg.dataset, cfg.seed),
                on_optimizer=observe if rank == 0 else None,
            )
            if rank == 0:
                steps = torch.stack(records)
                queue.put(
                    {
                        "method": label,
                        "accuracy": res["accuracy"],
                        "ratio": res["ratio"],
                        "mean_normalized_step": float(steps.mean()),
                        "median_normalized_step": float(steps.median()),
                        "fraction_above_0.1": float((steps > 0.1).float().mean()),
                        "fraction_above_0.5": float((steps > 0.5).float().mean()),
                    }
                )
    except BaseException as exc:  # noqa: BLE001 - tell the parent, which would otherwise wait
        queue.put({"error": f"rank {rank}: {exc!r}"})
        raise
    finally:
        torch.distributed.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default="Identity, SignSGD, TopK(0.003, values='sign', scope='call')")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clip", type=float, default=None)
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--precondition", action="store_true")
    p.add_argument("--out", default=str(RESULTS / "adam_steps_cpu.json"))
    a = p.parse_args(argv)
    cfg = bench.BenchConfig(
        dataset="mnist",
        workers=WORLD,
        optimizer="adamw",
        momentum_correction="on",
        seed=a.seed,
        clip=a.clip,
        epochs=a.epochs,
        precondition=a.precondition,
    )
    methods = bench.parse_methods(a.methods)
    bench.check_methods(methods, cfg)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = bench.free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, port, methods, cfg, cfg.steps_per_epoch(), queue)) for r in range(WORLD)
    ]
    for proc in procs:
        proc.start()
    rows = []
    while len(rows) < len(methods):
        got = queue.get(timeout=1800)
        if "error" in got:
            raise RuntimeError(got["error"])
        rows.append(got)
    for proc in procs:
        proc.join(timeout=60)
    print(f"{'method':<45} {'ratio':>8} {'acc %':>7} {'mean |step|/lr':>15} {'median':>8} {'> 0.1':>7} {'> 0.5':>7}")
    for r in rows:
        print(
            f"{r['method']:<45} {r['ratio']:>7.1f}x {100 * r['accuracy']:>7.2f} {r['mean_normalized_step']:>15.3f} "
            f"{r['median_normalized_step']:>8.3f} {100 * r['fraction_above_0.1']:>6.1f}% "
            f"{100 * r['fraction_above_0.5']:>6.1f}%"
        )
    doc = {
        "command": command("adam_steps", argv),
        "machine": bench.machine(),
        "config": {
            "seed": a.seed,
            "clip": a.clip,
            "epochs": cfg.resolved_epochs(),
            "optimizer": "adamw",
            "momentum_correction": "on",
            "workers": WORLD,
            "precondition": a.precondition,
        },
        "rows": rows,
    }
    write_result(a.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
