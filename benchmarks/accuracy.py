"""Compression ratio against accuracy on real data (what `make demo` runs).

    python benchmarks/accuracy.py [--dataset mnist|digits] [--workers 2] [--epochs N]

Writes benchmarks/results/accuracy_<dataset>_<N>ranks_cpu.{json,csv,png} with the machine,
versions and date (the same files `gradzip bench --out` writes).
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile

from gradzip import bench


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dataset", default="mnist", choices=["mnist", "digits"])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    a = p.parse_args()
    cfg = bench.BenchConfig(dataset=a.dataset, workers=a.workers, epochs=a.epochs)
    rows = bench.run(bench.default_methods(), cfg)
    print(bench.format_table(rows))
    stem = f"accuracy_{a.dataset}_{a.workers}ranks_cpu"
    with tempfile.TemporaryDirectory() as tmp:
        paths = bench.write_outputs(rows, cfg, tmp)
        os.makedirs(a.out, exist_ok=True)
        for kind, ext in (("json", "json"), ("csv", "csv"), ("plot", "png")):
            dst = os.path.join(a.out, f"{stem}.{ext}")
            shutil.copyfile(paths[kind], dst)
            print(f"wrote {dst}")


if __name__ == "__main__":
    main()
