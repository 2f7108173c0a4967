"""The ``gradzip`` command."""
from __future__ import annotations

import argparse
import sys

from . import __version__, bench, plan


def add_bench_arguments(b: argparse.ArgumentParser) -> None:
    """The options of ``gradzip bench`` (``benchmarks/accuracy.py`` takes the same)."""
    epochs = ", ".join(f"{v} for {k}" for k, v in bench.DEFAULT_EPOCHS.items())
    b.add_argument("--dataset", default="mnist", choices=["mnist", "digits"])
    b.add_argument("--workers", type=int, default=2, help="ranks (gloo processes, or GPUs with --device cuda)")
    b.add_argument("--epochs", type=int, default=None, help=f"default: {epochs} (where Identity has converged)")
    b.add_argument("--seeds", default=None,
                   help="seeds, e.g. 0,1,2 or 0-4: each method trains once per seed (init, data split and order); "
                        f"default: {','.join(map(str, bench.DEFAULT_SEEDS))} (0 with --quick)")
    b.add_argument("--seed", type=int, default=None, help=argparse.SUPPRESS)  # the old single-seed flag
    b.add_argument("--optimizer", default="sgd", choices=list(bench.OPTIMIZERS))
    b.add_argument("--lr", type=float, default=None,
                   help="base learning rate; default: " + ", ".join(f"{v:g} for {k}" for k, v in bench.DEFAULT_LR.items()))
    b.add_argument("--momentum", type=float, default=0.9, help="SGD's momentum, or AdamW's beta1 (default: 0.9)")
    b.add_argument("--weight-decay", type=float, default=None,
                   help="default: " + ", ".join(f"{v:g} for {k}" for k, v in bench.DEFAULT_WEIGHT_DECAY.items()))
    b.add_argument("--lr-schedule", default="cosine", choices=list(bench.LR_SCHEDULES),
                   help="cosine (default): from lr down to 0 over the whole run, after the warm-up")
    b.add_argument("--momentum-correction", default="auto", choices=list(bench.MOMENTUM_CORRECTION),
                   help="SGD momentum applied per rank before compression and masked where sent: auto (sparse codecs), on, off")
    b.add_argument("--warmup-epochs", type=float, default=0.0, help="linear learning-rate warm-up (default: 0)")
    b.add_argument("--batch-size", type=int, default=32, help="per rank (default: 32)")
    b.add_argument("--quick", action="store_true",
                   help="a short run: 1 epoch of MNIST (5 of digits), one seed unless --seeds is given")
    b.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: one GPU per rank, NCCL")
    b.add_argument("--methods", default="",
                   help="comma-separated methods in the method grammar, e.g. \"TopK(ratio=0.001), PowerSGD(rank=1)\" "
                        f"(default: {bench.DEFAULT_METHODS})")
    b.add_argument("--import", dest="plugins", action="append", default=[], metavar="MODULE",
                   help="import a module that defines more methods (repeatable)")


def config_from_args(args) -> bench.BenchConfig:
    """The :class:`~gradzip.bench.BenchConfig` of parsed ``gradzip bench`` options
    (ValueError for values it refuses)."""
    if args.workers < 2:
        raise ValueError(f"--workers must be at least 2 (a bench of gradient exchange), got {args.workers}")
    if args.seeds is not None:
        seeds = bench.parse_seeds(args.seeds)
    elif args.seed is not None:
        seeds = (args.seed,)
    else:
        seeds = (bench.DEFAULT_SEEDS[0],) if args.quick else bench.DEFAULT_SEEDS
    epochs = args.epochs
    if args.quick and epochs is None:
        epochs = bench.QUICK_EPOCHS[args.dataset]
    return bench.BenchConfig(
        dataset=args.dataset, workers=args.workers, epochs=epochs, batch_size=args.batch_size,
        optimizer=args.optimizer, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay,
        lr_schedule=args.lr_schedule, warmup_epochs=args.warmup_epochs, momentum_correction=args.momentum_correction, seed=seeds[0], seeds=seeds,
        device=args.device,
    )


def run_bench(args, no_progress: bool = False):
    """Run ``gradzip bench`` from parsed options: (rows, cfg, exit code)."""
    try:
        cfg = config_from_args(args)
        plan.import_plugins(args.plugins)
        methods = bench.parse_methods(args.methods or bench.DEFAULT_METHODS)
    except (ValueError, TypeError, ImportError) as exc:
        print(f"gradzip bench: {exc}", file=sys.stderr)
        return None, None, 2
    print(
        f"gradzip bench: {cfg.dataset}, {cfg.workers} {'nccl' if cfg.device == 'cuda' else 'gloo'} ranks, "
        f"{cfg.resolved_epochs()} epochs, batch {cfg.batch_size}/rank, {cfg.optimizer} lr {cfg.lr:g} "
        f"momentum {cfg.momentum:g} weight decay {cfg.weight_decay:g}, {cfg.lr_schedule} schedule"
        f"{f' after {cfg.warmup_epochs:g} warm-up epochs' if cfg.warmup_epochs else ''}, "
        f"seeds {','.join(map(str, cfg.seeds))}; {len(methods)} methods: {', '.join(methods)}",
        flush=True,
    )
    total = bench.steps_per_method(cfg) * len(methods)
    try:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="step", desc="training", dynamic_ncols=True, disable=no_progress)
    except ImportError:  # the [bench] extra is not installed: no bar
        bar = None

    def tick(method, step):
        if bar is not None:
            bar.set_description(method)
            bar.update(1)

    def progress(r):
        msg = (f"  {r['method']:<16} seed {r['seed']:<3} acc {100 * r['accuracy']:.2f}%  "
               f"last-3 {100 * r['accuracy_last3']:.2f}%  link ratio {r['ratio']:.1f}x")
        (bar.write if bar is not None else print)(msg)

    rows = bench.run(methods, cfg, progress=progress, tick=tick)
    if bar is not None:
        bar.close()
    print()
    print(bench.format_table(rows))
    return rows, cfg, 0


def _bench(args) -> int:
    rows, cfg, code = run_bench(args, no_progress=args.no_progress)
    if code:
        return code
    if args.out:
        paths = bench.write_outputs(rows, cfg, args.out)
        print(f"\nwrote {paths['json']}, {paths['csv']}, {paths['plot']}")
    return 0


def _plan(args) -> int:
    return plan.run(args)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="gradzip", description="gradient compression toolkit")
    p.add_argument("--version", action="version", version=f"gradzip {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench", help="compression ratio against accuracy on real data (MNIST by default)")
    add_bench_arguments(b)
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
