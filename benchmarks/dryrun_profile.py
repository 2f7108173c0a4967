"""Where a codec's time goes in one training step: cProfile of ``costmodel.dry_run`` over
ResNet-50's gradients (``--model mlp``: step_time.py's MLP), cut into DDP's buckets, as one
rank among ``--world``.

    python -m benchmarks.dryrun_profile                              # CUDA if present, else the CPU
    python -m benchmarks.dryrun_profile --device cpu --methods "Int8()" --out benchmarks/results/x.txt

For each method (``gz.parse`` specs, ``;``-separated): two untimed steps, one step timed
without the profiler (printed as ``ms a step``), then one step under cProfile: the 18
functions with the most time of their own, and the 22 gradzip and kernel functions with the
most time under them. The step is what ``benchmarks/gpu_step.py`` times as codec time (error
feedback, encode, framing, the decode of every peer; in steady state, ``gpu_step.Steps``), so
this tells whether a method's step is spent in kernels, in Python, or in launches and
synchronizations (time spent waiting on the device shows up under the call that
synchronized: ``tolist``, ``item``, ``cpu``). Gradients are random normal (seed 0), float32.
Prints the report and writes it to ``--out`` when given.

``--count``: no cProfile; per method the median of ``--steps`` timed steps and the number of
top-level ATen operations one step issues (``torch.profiler``, CPU activity: each is a trip
through torch's dispatcher, and on a GPU a launch where it computes anything), into the JSON
file ``--json`` when given. The step's host-side work is what a launch-bound GPU step pays, so
this tracks that cost on any machine. ``host_syncs``: the calls that wait for the device on a GPU
(``item()`` and ``bool()`` of a tensor, counted as ATen's ``_local_scalar_dense``; ``cpu()`` and
``tolist()``, counted by cProfile in one more step), each a full stop of the launch queue there.
``host_uploads``: the copies of host-built data (tables, offsets, lengths) to the device by
``kernels.host_to_device`` in that step, which on CUDA wait for nothing (pinned staging; a plain
``.to("cuda")`` would stop the queue like a sync):

    python -m benchmarks.dryrun_profile --device cpu --count --methods "Int8();SignSGD()" --json x.json

``triton_launches``: under the Triton interpreter (``GRADZIP_KERNELS=triton TRITON_INTERPRET=1``,
with ``--model tiny``: the interpreter is slow) each kernel launch is counted, and the ATen
operations the interpreter issues inside it are not; the count is then what the GPU path's
host issues (its operations and launches) rather than the CPU path's Numba glue, up to the few
branches on the device's type (``bitpack``'s numpy route, PowerSGD's buffer alignment).
Elsewhere it is 0.

``--gpu-branches`` takes, on the CPU, the GPU's side of those branches
(:func:`gradzip.kernels.gpu_side_on_cpu`: PowerSGD's matrices stacked, TopK's pieces as rows at
any size, ``bitpack``'s torch route), so that with the interpreter the count is the GPU path's
throughout:

    GRADZIP_KERNELS=triton TRITON_INTERPRET=1 python -m benchmarks.dryrun_profile --device cpu \
        --count --gpu-branches --steps 1 --methods "PowerSGD(rank=4)"
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import sys
import time

import torch

import gradzip.kernels as K
from benchmarks.gpu_step import ResNet, Steps


def stepper(spec: str, grads, names, buckets, world: int, sync):
    """``(reset, run)``: ``run(step)`` is one steady-state step of ``spec``'s dry runs over the
    buckets (``gpu_step.Steps``: DDP's bucket layout, error feedback and the codecs' state kept
    between steps), ``reset()`` puts the gradients back into the buckets (call it before the
    clock starts); two untimed steps are run first."""
    import gradzip as gz

    steps = Steps(gz.parse(spec), grads, names, buckets, world)

    def reset():
        steps.reset()
        sync()

    def run(s):
        steps.run(s)
        sync()

    for s in range(2):
        reset()
        run(s)
    return reset, run


def profile(spec: str, grads, names, buckets, world: int, sync) -> str:
    reset, run = stepper(spec, grads, names, buckets, world, sync)
    reset()
    t = time.perf_counter()
    run(2)
    wall = time.perf_counter() - t
    reset()
    pr = cProfile.Profile()
    pr.enable()
    run(3)
    pr.disable()
    lines = [f"===== {spec}: {wall * 1e3:.1f} ms a step (no profiler)"]
    out = io.StringIO()
    st = pstats.Stats(pr, stream=out)
    st.sort_stats("tottime").print_stats(18)
    lines += [ln[:170] for ln in out.getvalue().splitlines()[6:40]]
    out = io.StringIO()
    st = pstats.Stats(pr, stream=out)
    st.sort_stats("cumtime").print_stats("gradzip|kernels", 22)
    lines += [ln[:170] for ln in out.getvalue().splitlines()[6:40]]
    return "\n".join(lines)


def count(spec: str, grads, names, buckets, world: int, sync, steps: int) -> dict:
    """Median seconds of ``steps`` timed steps, and the top-level ATen operations of one more."""
    import statistics

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    reset, run = stepper(spec, grads, names, buckets, world, sync)
    times = []
    for s in range(2, 2 + steps):
        reset()
        t = time.perf_counter()
        run(s)
        times.append(time.perf_counter() - t)
    reset()
    with _launches_marked(), torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        run(2 + steps)

    def inside_launch(e):
        p = e.cpu_parent
        while p is not None:
            if p.name == LAUNCH:
                return True
            p = p.cpu_parent
        return False

    def top(e):
        return (
            e.name.startswith("aten::")
            and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))
            and not inside_launch(e)
        )

    ops = sum(1 for e in prof.events() if top(e))
    launches = sum(1 for e in prof.events() if e.name == LAUNCH)
    scalars = sum(  # item(), bool()
        1 for e in prof.events() if e.name == "aten::_local_scalar_dense" and not inside_launch(e)
    )
    reset()
    pr = cProfile.Profile()
    pr.enable()
    run(3 + steps)
    pr.disable()
    waits = {f"<method '{m}' of 'torch._C.TensorBase' objects>" for m in ("cpu", "tolist")}
    stats = pstats.Stats(pr).stats
    copies = sum(st[0] for (_, _, fn), st in stats.items() if fn in waits)  # st[0]: ncalls
    uploads = sum(st[0] for (path, _, fn), st in stats.items() if fn == "host_to_device" and "dispatch" in path)
    return {
        "ms_per_step": statistics.median(times) * 1e3,
        "ms_all": [t * 1e3 for t in times],
        "aten_ops": ops,
        "host_syncs": scalars + copies,
        "triton_launches": launches,
        "host_uploads": uploads,
    }


LAUNCH = "triton::launch"


def _launches_marked():
    """Under the Triton interpreter (``GRADZIP_KERNELS=triton TRITON_INTERPRET=1``), mark every
    kernel launch as a profiler range ``triton::launch``: ``count`` counts the ranges and leaves
    out the ATen operations the interpreter issues inside them, so a CPU run counts what the
    GPU path's host issues (operations and launches). Elsewhere: nothing."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        return contextlib.nullcontext()
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def marked(self, *a, **kw):
        with torch.profiler.record_function(LAUNCH):
            return run(self, *a, **kw)

    @contextlib.contextmanager
    def patched():
        InterpretedFunction.run = marked
        try:
            yield
        finally:
            InterpretedFunction.run = run

    return patched()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    ap.add_argument("--methods", default="TopK(0.01);Int8();SignSGD()", help="';'-separated specs")
    ap.add_argument("--world", type=int, default=8, help="ranks of the dry run (default 8, as gpu_step.py)")
    ap.add_argument(
        "--model",
        default="resnet50",
        choices=["resnet50", "mlp", "tiny"],
        help="ResNet-50's 161 tensors (default), step_time.py's MLP (6 tensors, 25.2M parameters) or "
        "gpu_step.py's tiny ResNet (the tests' smoke run)",
    )
    ap.add_argument("--out", default=None, help="also write the report to this file")
    ap.add_argument("--count", action="store_true", help="time steps and count ATen operations, no cProfile")
    ap.add_argument("--steps", type=int, default=5, help="--count: timed steps a method (default 5)")
    ap.add_argument("--json", default=None, help="--count: write the figures to this JSON file")
    ap.add_argument(
        "--gpu-branches", action="store_true", help="on the CPU, take the GPU's side of the device-type branches"
    )
    args = ap.parse_args(argv)
    with K.gpu_side_on_cpu() if args.gpu_branches else contextlib.nullcontext():
        return run(args, argv)


def run(args, argv) -> int:
    """:func:`main`'s work, on its parsed arguments."""
    from gradzip.costmodel import ddp_buckets

    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.model == "mlp":
        from benchmarks.step_time import build_model

        model = build_model(4096, 1)
    elif args.model == "tiny":
        model = ResNet(blocks=(1, 1, 1, 1), base=8, classes=16)
    else:
        model = ResNet()
    named = list(model.named_parameters())
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(p.shape, generator=g).to(dev) for _, p in named]
    names = [n for n, _ in named]
    buckets = ddp_buckets([t.numel() * 4 for t in grads])
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    label = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    report = [
        f"# {label}, torch {torch.__version__}; {args.model}: {len(grads)} tensors, {len(buckets)} buckets, "
        f"{args.world} ranks"
    ]
    print(report[0], flush=True)
    specs = [s.strip() for s in args.methods.split(";") if s.strip()]
    if args.count:
        rows = {}
        for spec in specs:
            rows[spec] = count(spec, grads, names, buckets, args.world, sync, args.steps)
            row = rows[spec]
            print(
                f"{spec:30s} {row['ms_per_step']:9.1f} ms a step  {row['aten_ops']:8d} ATen ops  "
                f"{row['host_syncs']:6d} host syncs  {row['triton_launches']:6d} Triton launches  "
                f"{row['host_uploads']:4d} host uploads",
                flush=True,
            )
        if args.json:
            from benchmarks._common import write_result
            from gradzip.machine import machine

            write_result(
                args.json,
                {
                    "benchmark": "benchmarks/dryrun_profile.py --count",
                    "argv": list(argv if argv is not None else sys.argv[1:]),
                    "device": label,
                    "machine": machine(),
                    "torch": torch.__version__,
                    "threads": torch.get_num_threads(),
                    "model": args.model,
                    "tensors": len(grads),
                    "buckets": len(buckets),
                    "world": args.world,
                    "steps": args.steps,
                    "gpu_branches": args.gpu_branches,
                    "methods": rows,
                },
            )
        return 0
    for spec in specs:
        report.append(profile(spec, grads, names, buckets, args.world, sync))
        print(report[-1], flush=True)
        if args.out:  # after every method: a run stopped early keeps what it profiled
            with open(args.out, "w") as f:
                f.write("\n".join(report) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
