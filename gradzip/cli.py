"""The ``gradzip`` command."""
from __future__ import annotations

import argparse
import sys

from . import bench, plan


def _bench(args) -> int:
    cfg = bench.BenchConfig(dataset=args.dataset, workers=args.workers, epochs=args.epochs, seed=args.seed,
                            device=args.device)
    if args.quick:
        cfg.epochs = cfg.epochs or {"mnist": 1, "digits": 5}[args.dataset]
    try:
        plan.import_plugins(args.plugins)
        methods = bench.parse_methods(args.methods or bench.DEFAULT_METHODS)
    except (ValueError, TypeError, ImportError) as exc:
        print(f"gradzip bench: {exc}", file=sys.stderr)
        return 2
    print(
        f"gradzip bench: {cfg.dataset}, {cfg.workers} {'nccl' if cfg.device == 'cuda' else 'gloo'} ranks, "
        f"{cfg.resolved_epochs()} epochs, batch {cfg.batch_size}/rank, {len(methods)} methods: {', '.join(methods)}",
        flush=True,
    )
    n_train = {"mnist": 4000, "digits": 1437}[cfg.dataset]
    total = bench.steps_per_method(cfg, n_train) * len(methods)
    try:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="step", desc="training", dynamic_ncols=True, disable=args.no_progress)
    except ImportError:  # the [bench] extra is not installed: no bar
        bar = None

    def tick(method, step):
        if bar is not None:
            bar.set_description(method)
            bar.update(1)

    def progress(row):
        msg = f"  {row['method']:<10} acc {100 * row['accuracy']:.2f}%  ratio {row['ratio']:.1f}x"
        (bar.write if bar is not None else print)(msg)

    rows = bench.run(methods, cfg, progress=progress, tick=tick)
    if bar is not None:
        bar.close()
    print()
    print(bench.format_table(rows))
    if args.out:
        paths = bench.write_outputs(rows, cfg, args.out)
        print(f"\nwrote {paths['json']}, {paths['csv']}, {paths['plot']}")
    return 0


def _plan(args) -> int:
    return plan.run(args)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="gradzip", description="gradient compression toolkit")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench", help="compression ratio against accuracy on real data (MNIST by default)")
    b.add_argument("--dataset", default="mnist", choices=["mnist", "digits"])
    b.add_argument("--workers", type=int, default=2)
    b.add_argument("--epochs", type=int, default=None, help="default: 4 for mnist, 20 for digits")
    b.add_argument("--quick", action="store_true", help="a short run: 1 epoch of MNIST (5 of digits)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: one GPU per rank, NCCL")
    b.add_argument("--methods", default="",
                   help="comma-separated methods in the method grammar, e.g. \"TopK(ratio=0.001), PowerSGD(rank=1)\" "
                        f"(default: {bench.DEFAULT_METHODS})")
    b.add_argument("--import", dest="plugins", action="append", default=[], metavar="MODULE",
                   help="import a module that defines more methods (repeatable)")
    b.add_argument("--out", default="bench_out", help="folder for results.json/csv and pareto.png ('' to skip)")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.set_defaults(fn=_bench)
    pl = sub.add_parser("plan", help="predict step time and scaling efficiency per method and world size")
    plan.add_arguments(pl)
    pl.set_defaults(fn=_plan)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
