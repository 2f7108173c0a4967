"""The ``gradzip`` command."""
from __future__ import annotations

import argparse
import json
import os
import sys


def _bench(args) -> int:
    from . import bench

    cfg = bench.BenchConfig(dataset=args.dataset, workers=args.workers, epochs=args.epochs, seed=args.seed)
    methods = bench.default_methods()
    if args.methods:
        wanted = [m.strip() for m in args.methods.split(",")]
        unknown = [m for m in wanted if m not in methods]
        if unknown:
            print(f"unknown methods {unknown}; choose from {list(methods)}", file=sys.stderr)
            return 2
        if wanted[0] != "Identity":
            wanted.insert(0, "Identity")
        methods = {m: methods[m] for m in dict.fromkeys(wanted)}
    print(
        f"gradzip bench: {cfg.dataset}, {cfg.workers} gloo ranks, {cfg.epochs} epochs, "
        f"batch {cfg.batch_size}/rank, {len(methods)} methods",
        flush=True,
    )

    def progress(row):
        print(f"  done: {row['method']:<10} acc {100 * row['accuracy']:.2f}%  ratio {row['ratio']:.1f}x", flush=True)

    rows = bench.run(methods, cfg, progress=progress)
    print()
    print(bench.format_table(rows))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "results.json")
        with open(path, "w") as f:
            json.dump({"config": bench.asdict(cfg), "rows": rows}, f, indent=2, default=str)
        print(f"\nwrote {path}")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="gradzip", description="gradient compression toolkit")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench", help="compression ratio against accuracy on a small real dataset")
    b.add_argument("--dataset", default="digits", choices=["digits"])
    b.add_argument("--workers", type=int, default=2)
    b.add_argument("--epochs", type=int, default=20)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--methods", default="", help="comma-separated subset of the default methods")
    b.add_argument("--out", default="bench_out", help="folder for results.json ('' to skip)")
    b.set_defaults(fn=_bench)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
