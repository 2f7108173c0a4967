"""The ``gradzip`` command."""

from __future__ import annotations

import argparse
import os
import sys

from . import __version__, options

# The command parses its options before it imports the modules that need torch (bench, plan):
# `gradzip --help` and a refused option answer at once. Options and their checks: gradzip.options.
add_bench_arguments = options.add_bench_arguments


def config_from_args(args):
    """The :class:`~gradzip.bench.BenchConfig` of parsed ``gradzip bench`` options
    (ValueError for values it refuses)."""
    from . import bench

    if args.workers < 2:
        raise ValueError(f"--workers must be at least 2 (a bench of gradient exchange), got {args.workers}")
    if args.seeds is not None:
        seeds = bench.parse_seeds(args.seeds) if isinstance(args.seeds, str) else tuple(args.seeds)
    elif args.seed is not None:
        seeds = (args.seed,)
    else:
        seeds = (bench.DEFAULT_SEEDS[0],) if args.quick else bench.DEFAULT_SEEDS
    epochs, steps = args.epochs, args.steps
    lm = args.dataset in options.LM_DATASETS
    if lm and epochs is not None:
        raise ValueError(f"--epochs is for the image tasks; the {args.dataset} language model takes --steps")
    if not lm and (steps is not None or args.eval_every is not None):
        raise ValueError("--steps and --eval-every are for the language model (--dataset shakespeare); use --epochs")
    if args.quick and epochs is None and not lm:
        epochs = bench.QUICK_EPOCHS[args.dataset]
    if args.quick and steps is None and lm:
        steps = bench.QUICK_STEPS[args.dataset]
    return bench.BenchConfig(
        dataset=args.dataset,
        workers=args.workers,
        epochs=epochs,
        steps=steps,
        lm_size=args.lm_size,
        eval_every=args.eval_every,
        warmup_steps=args.warmup_steps,
        clip_mode=args.clip_mode,
        batch_size=args.batch_size,
        optimizer=args.optimizer,
        lr=args.lr,
        momentum=args.momentum,
        weight_decay=args.weight_decay,
        lr_schedule=args.lr_schedule,
        warmup_epochs=args.warmup_epochs,
        momentum_correction=args.momentum_correction,
        seed=seeds[0],
        seeds=seeds,
        device=args.device,
        clip=args.clip,
        precondition=args.precondition,
    )


def check_bench_extras(args, plot: bool) -> str | None:
    """What the ``[bench]`` extra must add for these options, as one line; None if nothing.
    Runs before torch is imported and before any rank starts."""
    missing = options.missing_bench_extras(args.dataset, plot)
    if not missing:
        return None
    what = ", ".join(f"{m} (for {options.BENCH_EXTRAS[m]})" for m in missing)
    return f"not installed: {what}; install them with: pip install 'gradzip[bench]'"


def check_device(cfg) -> None:
    """``--device cuda`` needs CUDA and one GPU per rank (ValueError, before the ranks start)."""
    if cfg.device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        raise ValueError(f"--device cuda: CUDA is not available to this torch ({torch.__version__}); use --device cpu")
    if torch.cuda.device_count() < cfg.workers:
        raise ValueError(
            f"--device cuda runs one rank per GPU: --workers {cfg.workers} needs {cfg.workers} GPUs, "
            f"this machine has {torch.cuda.device_count()}"
        )


class Progress:
    """``gradzip bench``'s progress: a tqdm bar on a terminal, none to a file or a pipe (there the
    per-run lines alone, no per-step updates). The bar starts at the first step, so its rate and
    ETA leave the ranks' start-up out, and its description changes with the method only.

    Args:
        total: steps of the whole run.
        disable: no bar (``--no-progress``).
        file: where the bar goes (default: stderr, as tqdm's).
    """

    def __init__(self, total: int, disable: bool = False, file=None) -> None:
        self.total, self.file = total, file if file is not None else sys.stderr
        isatty = getattr(self.file, "isatty", None)
        self.live = not disable and callable(isatty) and bool(isatty())
        self.bar = None
        self.method: str | None = None

    def tick(self, method: str, step: int) -> None:
        if not self.live:
            return
        if self.bar is None:
            try:
                from tqdm import tqdm
            except ImportError:  # the [bench] extra is not installed: no bar
                self.live = False
                return
            self.bar = tqdm(total=self.total, unit="step", desc=method, dynamic_ncols=True, file=self.file)
        elif method != self.method:
            self.bar.set_description(method, refresh=False)
        self.method = method
        self.bar.update(1)

    def write(self, msg: str) -> None:
        if self.bar is not None:
            self.bar.write(msg)
        else:
            print(msg, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def check_out(folder: str) -> None:
    """The results' folder can be written, checked before any rank trains (OSError otherwise)."""
    os.makedirs(folder, exist_ok=True)
    probe = os.path.join(folder, f".gradzip-write-test-{os.getpid()}")
    with open(probe, "w"):
        pass
    os.remove(probe)


def run_bench(args, no_progress: bool = False, plot: bool = False):
    """Run ``gradzip bench`` from parsed options: (rows, cfg, exit code). ``plot``: the caller
    will draw pareto.png (matplotlib is then checked for with the datasets, up front)."""
    problem = check_bench_extras(args, plot)
    if problem:
        print(f"gradzip bench: {problem}", file=sys.stderr)
        return None, None, 2
    from . import bench, plan

    try:
        cfg = config_from_args(args)
        check_device(cfg)
        plan.import_plugins(args.plugins)
        methods = bench.parse_methods(bench.DEFAULT_METHODS if args.methods is None else args.methods)
        bench.check_methods(methods, cfg)
        if getattr(args, "out", None):
            check_out(args.out)
    except (ValueError, TypeError, ImportError, OSError) as exc:
        print(f"gradzip bench: {exc}", file=sys.stderr)
        return None, None, 2
    print(
        f"gradzip bench: {cfg.dataset}"
        f"{f' (a {cfg.lm_size} byte-level transformer)' if cfg.is_lm else ''}, "
        f"{cfg.workers} {'nccl' if cfg.device == 'cuda' else 'gloo'} ranks, "
        f"{cfg.length()}, batch {cfg.batch_size}/rank, {cfg.optimizer} lr {cfg.lr:g} "
        f"momentum {cfg.momentum:g} weight decay {cfg.weight_decay:g}, {cfg.lr_schedule} schedule"
        f"{f' after {cfg.resolved_warmup()} warm-up steps' if cfg.resolved_warmup() else ''}"
        f"{cfg.hook_extras()}, "
        f"seeds {','.join(map(str, cfg.seeds))}; {len(methods)} methods: {', '.join(methods)}",
        flush=True,
    )
    bar = Progress(bench.steps_per_method(cfg) * len(methods), disable=no_progress)

    def progress(r):
        if "val_loss" in r:
            score = f"val loss {r['val_loss']:.4f} ({r['bits_per_byte']:.4f} bits/byte)"
        else:
            score = f"acc {100 * r['accuracy']:.2f}%  last-3 {100 * r['accuracy_last3']:.2f}%"
        bar.write(f"  {r['method']:<16} seed {r['seed']:<3} {score}  link ratio {r['ratio']:.1f}x")

    try:
        rows = bench.run(methods, cfg, progress=progress, tick=bar.tick)
    finally:
        bar.close()
    print()
    print(bench.format_table(rows))
    return rows, cfg, 0


def _bench(args) -> int:
    rows, cfg, code = run_bench(args, no_progress=args.no_progress, plot=bool(args.out))
    if code:
        return code
    if args.out:
        from . import bench

        paths = bench.write_outputs(rows, cfg, args.out)
        print(f"\nwrote {paths['json']}, {paths['csv']}, {paths['plot']}")
    return 0


def _plan(args) -> int:
    from . import plan

    return plan.run(args)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="gradzip", description="gradient compression toolkit")
    p.add_argument("--version", action="version", version=f"gradzip {__version__}")
    sub = p.add_subparsers(dest="cmd", metavar="{bench,plan}")
    b = sub.add_parser("bench", help="compression ratio against accuracy on real data (MNIST by default)")
    add_bench_arguments(b)
    b.add_argument("--out", default="bench_out", help="folder for results.json/csv and pareto.png ('' to skip)")
    b.add_argument("--no-progress", action="store_true", help="no progress bar")
    b.set_defaults(fn=_bench)
    options.apply_preset(b, argv)
    pl = sub.add_parser("plan", help="predict step time and scaling efficiency per method and world size")
    options.add_plan_arguments(pl)
    pl.set_defaults(fn=_plan)
    args = p.parse_args(argv)
    if args.cmd is None:  # `gradzip` alone: what it does and how to start
        p.print_help()
        print(
            "\nstart here: gradzip plan --arch gpt2-small --bandwidth 1Gbit --workers 8 (which method for your "
            "link), gradzip bench --dataset shakespeare --quick (its accuracy on a small language model)"
        )
        return 0
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
