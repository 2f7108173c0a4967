"""Compression ratio against accuracy on real data (``gradzip bench``, written under benchmarks/results).

    python -m benchmarks.accuracy --workers 4 --seeds 0,1,2 [--optimizer sgd|adamw] [--methods ...]

Takes every option of ``gradzip bench`` (``gradzip bench --help``) and writes
benchmarks/results/<stem>.{json,csv,png} (the files ``gradzip bench --out`` writes), stem
``accuracy_<dataset>_<N>ranks_<optimizer>_<device>`` unless ``--stem`` says otherwise. The JSON
records the command, the machine, versions and date; ``benchmarks/report.py`` prints its table (docs/results.md).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

from benchmarks._common import RESULTS, command
from gradzip import bench, cli, options


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_bench_arguments(p)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--stem", default=None, help="file name without extension")
    p.add_argument("--no-progress", action="store_true")
    options.apply_preset(p, argv)
    a = p.parse_args(argv)
    rows, cfg, code = cli.run_bench(a, no_progress=a.no_progress, plot=True)
    if code:
        return code
    stem = a.stem or f"accuracy_{cfg.dataset}_{cfg.workers}ranks_{cfg.optimizer}_{cfg.device}"
    cmd = command("accuracy", argv)
    with tempfile.TemporaryDirectory() as tmp:
        paths = bench.write_outputs(rows, cfg, tmp, command=cmd)
        os.makedirs(a.out, exist_ok=True)
        for kind, ext in (("json", "json"), ("csv", "csv"), ("plot", "png")):
            dst = os.path.join(a.out, f"{stem}.{ext}")
            shutil.copyfile(paths[kind], dst)
            print(f"wrote {dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
