"""Compression ratio against accuracy on sklearn's digits (what `make demo` prints).

    python benchmarks/accuracy.py [--workers 2] [--epochs 20]

Writes benchmarks/results/accuracy_digits_<host kind>.json with the machine, versions and date.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys

import torch

from gradzip import bench


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "device": "cpu",
        "date": datetime.date.today().isoformat(),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    a = p.parse_args()
    cfg = bench.BenchConfig(workers=a.workers, epochs=a.epochs)
    rows = bench.run(bench.default_methods(), cfg)
    print(bench.format_table(rows))
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"accuracy_digits_{a.workers}ranks_cpu.json")
    methods = {k: repr(v) for k, v in bench.default_methods().items()}
    with open(path, "w") as f:
        json.dump({"machine": machine(), "config": bench.asdict(cfg), "methods": methods, "rows": rows}, f, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
