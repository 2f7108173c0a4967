"""examples/horovod_mnist.py with horovod.torch and with gradzip.horovod, 3 seeds.

    python -m benchmarks.horovod_mnist [--seeds 0,1,2] [--epochs 10] [--np 2]

For each seed: Horovod's own run (``horovodrun --gloo``, ``horovod.torch``, Compression.none),
then the same script with ``--hvd gradzip`` under horovodrun with TopK(0.01) and PowerSGD(rank=1);
for the first seed also Identity, under horovodrun and under ``torchrun``. Writes
benchmarks/results/horovod_mnist_<np>ranks[_<epochs>ep]_cpu.json (no suffix at the default 10
epochs): every run's test accuracy, final parameter hash and gradzip's byte stats, each
method's mean accuracy minus Horovod's (in percentage points), whether Identity's parameters
equal Horovod's bit for bit, the command and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile

from benchmarks._common import command
from gradzip.machine import machine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "horovod_mnist.py")
BIN = os.path.dirname(sys.executable)
METHODS = ["Identity()", "TopK(0.01)", "PowerSGD(rank=1)"]


def run(launcher: str, n: int, flags: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        if launcher == "horovodrun":
            cmd = [os.path.join(BIN, "horovodrun"), "-np", str(n), "-H", f"localhost:{n}", "--gloo", sys.executable]
        else:
            cmd = [os.path.join(BIN, "torchrun"), f"--nproc_per_node={n}"]
        cmd += [EXAMPLE, *flags, "--out", out]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
        if p.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"{shlex.join(cmd)} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
        with open(out) as f:
            r = json.load(f)
    r["launcher"] = launcher
    r.pop("stats", None) if r.get("hvd") == "horovod" else None
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    a = ap.parse_args(argv)
    seeds = [int(s) for s in a.seeds.split(",")]
    runs = []
    for i, seed in enumerate(seeds):
        base = ["--seed", str(seed), "--epochs", str(a.epochs)]
        runs.append(run("horovodrun", a.np, base + ["--hvd", "horovod"]))
        print(json.dumps({k: runs[-1][k] for k in ("hvd", "compression", "seed", "test_accuracy")}), flush=True)
        for m in METHODS if i == 0 else METHODS[1:]:  # Identity (bit for bit, also tested) on the first seed
            runs.append(run("horovodrun", a.np, base + ["--hvd", "gradzip", "--compression", m]))
            print(json.dumps({k: runs[-1][k] for k in ("hvd", "compression", "seed", "test_accuracy")}), flush=True)
        if i == 0:
            runs.append(run("torchrun", a.np, base + ["--hvd", "gradzip", "--compression", "Identity()"]))
        write(a, argv, runs)
    write(a, argv, runs)
    return 0


def write(a, argv, runs) -> None:
    """The results so far (rewritten after every seed, so that a cut-off run leaves them)."""
    ref = {r["seed"]: r for r in runs if r["hvd"] == "horovod"}
    summary = {}
    for m in METHODS:
        mine = [r for r in runs if r["hvd"] == "gradzip" and r["compression"] == m and r["launcher"] == "horovodrun"]
        mean = sum(r["test_accuracy"] for r in mine) / len(mine)
        hmean = sum(ref[r["seed"]]["test_accuracy"] for r in mine) / len(mine)
        st = [r["stats"] for r in mine]
        summary[m] = {
            "mean_test_accuracy": mean,
            "horovod_mean_test_accuracy": hmean,
            "delta_pp": 100.0 * (mean - hmean),
            "within_0.5pp": abs(100.0 * (mean - hmean)) <= 0.5,
            "params_equal_horovod": [r["params_sha256"] == ref[r["seed"]]["params_sha256"] for r in mine],
            "bytes_link_per_run": sum(s["bytes_link"] for s in st) / len(st),
            "bytes_link_raw_per_run": sum(s["bytes_link_raw"] for s in st) / len(st),
            "link_ratio": sum(s["ratio"] for s in st) / len(st),
        }
    tr = [r for r in runs if r["launcher"] == "torchrun"]
    summary["torchrun_identity_params_equal_horovod"] = [
        r["params_sha256"] == ref[r["seed"]]["params_sha256"] for r in tr
    ]
    doc = {
        "command": command("horovod_mnist", argv),
        "machine": machine(),
        "note": "shared 2-core VM: seconds are not comparable between runs",
        "summary": summary,
        "runs": runs,
    }
    os.makedirs(a.out, exist_ok=True)
    length = "" if a.epochs == 10 else f"_{a.epochs}ep"  # the example's default length has the plain name
    path = os.path.join(a.out, f"horovod_mnist_{a.np}ranks{length}_cpu.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps(summary, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
