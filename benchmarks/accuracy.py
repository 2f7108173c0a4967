"""Compression ratio against accuracy on real data (``gradzip bench``, written under benchmarks/results).

    python benchmarks/accuracy.py --workers 4 --seeds 0,1,2 [--optimizer sgd|adamw] [--methods ...]

Takes every option of ``gradzip bench`` (``gradzip bench --help``) and writes
benchmarks/results/<stem>.{json,csv,png} (the files ``gradzip bench --out`` writes), stem
``accuracy_<dataset>_<N>ranks_<optimizer>_<device>`` unless ``--stem`` says otherwise. The JSON
records the command, the machine, versions and date; ``benchmarks/report.py`` prints its table.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import tempfile

from gradzip import bench, cli


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_bench_arguments(p)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    p.add_argument("--stem", default=None, help="file name without extension")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    rows, cfg, code = cli.run_bench(a, no_progress=a.no_progress, plot=True)
    if code:
        return code
    stem = a.stem or f"accuracy_{cfg.dataset}_{cfg.workers}ranks_{cfg.optimizer}_{cfg.device}"
    command = shlex.join(["python", "benchmarks/accuracy.py", *(sys.argv[1:] if argv is None else argv)])
    with tempfile.TemporaryDirectory() as tmp:
        paths = bench.write_outputs(rows, cfg, tmp, command=command)
        os.makedirs(a.out, exist_ok=True)
        for kind, ext in (("json", "json"), ("csv", "csv"), ("plot", "png")):
            dst = os.path.join(a.out, f"{stem}.{ext}")
            shutil.copyfile(paths[kind], dst)
            print(f"wrote {dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
