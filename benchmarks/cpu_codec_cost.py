"""What each codec costs on the CPU against the wire time its bytes save (one rank's view).

    python -m benchmarks.cpu_codec_cost                      # 25M parameters, 2 ranks, 1 Gbit/s
    python -m benchmarks.cpu_codec_cost --ranks 4 --threads 1 --out benchmarks/results/cpu_codec_cost_4ranks.json

The gradients of ``benchmarks/step_time.py``'s MLP (width 4096, depth 1: 25.2M float32
parameters in 6 tensors, random normal, seed 0) go through each method's protocol as one call
of one rank among ``--ranks`` (``costmodel.dry_run``, decode of every peer included, error
feedback as the engine runs it). Per method, after one untimed call (each call advances the
codecs' state, as training does): the median of ``--repeats`` calls of

* **codec**: the call's wall time less the loopback's stand-ins for the collectives (error
  feedback, encode, framing, the decode of all ranks' messages), and its time per million
  elements;
* **wire saved**: plain allreduce's wire time minus the method's on a ``--rate`` link among
  ``--ranks`` ranks, by the cost model's ring formulas (``costmodel.wire_time``, latency 0);
* **codec / saved**: the share of the saved wire time the codec spends (the goal: at most
  25%); a method that saves nothing reads ``inf``.

Torch's intra-op threads: ``--threads`` (default 1: a rank per core, as the multi-process
benchmarks run). Writes ``--out`` (default ``benchmarks/results/cpu_codec_cost.json``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import statistics
import sys

import torch

from benchmarks._common import RESULTS, command, write_result

#: The sparsifiers and quantizers (and PowerSGD for scale) at the settings the bench and the README
#: use: unlike the GPU profile's list (gpu_suite.PROFILE_METHODS, every config of the grammar),
#: Threshold runs at a target density, since its default tau keeps most elements of these
#: gradients and would save nothing.
METHODS = (
    "Identity()",
    "FP16()",
    "BF16()",
    "TopK(0.01)",
    "TopK(0.01, mode='sampled')",
    "TopK(0.01, mode='approx')",
    "RandomK(0.01)",
    "Threshold(tau=0.001, policy='target', density=0.01)",
    "SignSGD()",
    "QSGD()",
    "TernGrad()",
    "Int8()",
    "PowerSGD(rank=4)",
)
GOAL = 0.25


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rate", default="1Gbit", help="the link for the wire time saved (default 1Gbit)")
    ap.add_argument("--methods", default=None, help="';'-separated specs (default: the codecs above)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS / "cpu_codec_cost.json"))
    a = ap.parse_args(argv)

    import gradzip as gz
    from benchmarks.step_time import build_model
    from gradzip.costmodel import Link, dry_run, wire_time
    from gradzip.machine import machine

    torch.set_num_threads(a.threads)
    link = Link.parse(a.rate, "0us")
    model = build_model(4096, 1)
    g = torch.Generator().manual_seed(0)
    named = list(model.named_parameters())
    grads = [torch.randn(p.shape, generator=g) for _, p in named]
    names = [n for n, _ in named]
    n = sum(t.numel() for t in grads)
    specs = METHODS if a.methods is None else [s.strip() for s in a.methods.split(";") if s.strip()]
    base = wire_time(dry_run(gz.Identity(), grads, world_size=a.ranks, decode=False).collectives, a.ranks, link)
    rows = []
    for spec in specs:
        method = gz.parse(spec)
        stores: dict = {}
        times, colls = [], []
        for s in range(a.repeats + 1):
            d = dry_run(method, grads, world_size=a.ranks, names=names, stores=stores, step=s)
            colls = d.collectives
            if s:
                times.append(d.wall_seconds - d.loopback_seconds)
        codec = statistics.median(times)
        wire = wire_time(colls, a.ranks, link)
        saved = base - wire
        share = codec / saved if saved > 0 else math.inf
        rows.append(
            {
                "method": spec,
                "codec_s": codec,
                "codec_s_all": times,
                "codec_s_per_million": codec / n * 1e6,
                "wire_s": wire,
                "wire_saved_s": saved,
                "codec_over_saved": share if math.isfinite(share) else None,  # None: saves nothing
                "meets_goal": saved > 0 and share <= GOAL,
            }
        )
        print(
            f"{spec:55s} codec {codec:7.3f} s ({codec / n * 1e9:6.2f} ns/elem)  wire {wire:7.3f} s  "
            f"saved {saved:7.3f} s  codec/saved {share:7.1%}",
            flush=True,
        )
    doc = {
        "benchmark": "benchmarks/cpu_codec_cost.py",
        "command": command("cpu_codec_cost", argv),
        "machine": machine(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "ranks": a.ranks,
        "rate": a.rate,
        "threads": a.threads,
        "repeats": a.repeats,
        "params": n,
        "tensors": [list(t.shape) for t in grads],
        "allreduce_wire_s": base,
        "goal": f"codec <= {GOAL:.0%} of the wire time saved",
        "rows": rows,
    }
    write_result(a.out, doc, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
