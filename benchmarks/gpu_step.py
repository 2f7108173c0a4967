"""GPU step time: compute per step, gradzip's codec time per step per method, and break-even links.

    python -m benchmarks.gpu_step                                   # CUDA: ResNet-50 and GPT-2 small
    python -m benchmarks.gpu_step --models gpt2 --methods "TopK(0.01, mode='approx')"
    python -m benchmarks.gpu_step --device cpu --models tiny --steps 2   # the smoke run (tests)

For each model, at random initialization (seed 0), on one device:

1. **Compute step**: forward, backward and an SGD step on a synthetic batch, no
   communication; the median of ``--steps`` timed steps after ``--warmup`` (CUDA:
   ``torch.cuda.synchronize()`` around each step).
2. **Codec time per step**, for every method (``gz.parse`` specs): the gradients of one
   backward, cut into DDP's buckets (25 MiB, the first 1 MiB: ``costmodel.ddp_buckets``),
   each bucket run through ``Engine.reduce`` (``--through engine``, the default: the engine's
   checks and flags, and on a GPU its planned buckets) or the method's protocol alone by
   ``costmodel.dry_run`` (``--through protocol``) as one rank among ``--world`` identical
   ranks: error feedback, encode, framing, and the decode of all ``--world`` peers (the
   loopback communicator hands this rank's message back for every peer). Timed as the wall
   time of all buckets with the device synchronized before and after, the median over
   ``--steps`` steps (each step advances the codecs' state, as training does). In steady
   state (:class:`Steps`): each bucket is one flat buffer that
   receives the result, as DDP's does, and the error-feedback memory is kept from step to step
   (the residual is added, its buffers reused). ``Identity()`` is plain DDP's cost (a
   pre-division of the bucket in place). ``benchmarks/results/gpu_step_nvidia-h200.json``
   is not in steady state: its dry runs have loose tensors and a fresh memory (no residual to
   add, new buffers, and a copy into a new output).
3. **Fraction added**: codec time / compute step.
4. **Break-even link**: the cost model's wire time of the collectives each method launched
   (``costmodel.wire_time``, ring formulas, latency 0, ``--world`` ranks on one flat link)
   against plain allreduce of the same gradients. With ``W(B) = bits / B`` the wire time at
   link speed ``B``, a method saves time on links slower than
   ``B* = (bits_allreduce - bits_method) / (codec_method - codec_identity)``; ``inf`` when it
   costs no more codec time than plain allreduce, ``null`` when it sends no fewer bits. No
   overlap of wire and compute is assumed (an upper bound on what the wire can cost).

A method whose dry run raises is recorded under ``errors`` (and the exit status is 1). Known:
the loopback communicator replays this rank's piece as every owner's, so TwoPhase (non-summable
codecs from 4 ranks) fails on tensors whose size is not a multiple of ``--world``
(``corrupt ... frame``); every tensor of the models here is a multiple of 8.

Writes ``benchmarks/results/gpu_step_<device>.json`` (``--out`` to change), naming the
device, torch, triton, the models' sizes and every figure, rewritten after each model. The
kernels chosen (``gradzip.kernels.backend_report()``) are recorded per op. ``--budget SECONDS``
starts no model or method after that many seconds; those are listed under ``skipped``.

Models (written here; torchvision is not needed):

* ``resnet50``: ResNet-50 (bottleneck blocks 3-4-6-3, 25.6M parameters), batch 64 at 224x224;
* ``gpt2``: a GPT-2-small-sized decoder (12 layers, d 768, 12 heads, vocabulary 50257,
  context 1024; 124M parameters, tied embedding), batch 8 x 1024 tokens;
* ``tiny``: small versions of both (for the CPU smoke run).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_METHODS = [
    "Identity()",
    "FP16()",
    "BF16()",
    "Threshold(tau=0.001, policy='target', density=0.01)",
    "TopK(0.01)",
    "TopK(0.01, mode='sampled')",
    "TopK(0.01, mode='approx')",
    "RandomK(0.01)",
    "SignSGD(block=1024)",
    "QSGD(7)",
    "TernGrad(block=1024)",
    "Int8()",
    "Int8(allreduce=True)",
    "PowerSGD(rank=4)",
    "Flat(Int8())",
    "Flat(SignSGD(block=1024))",
    "Flat(QSGD(7))",
    "Flat(TernGrad(block=1024))",
    "Flat(TopK(0.01))",
    "Flat(TopK(0.01, mode='approx'))",
]


# -- models -------------------------------------------------------------------------------------


class Bottleneck(nn.Module):
    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = 4 * width
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    """ResNet-50's layout (He et al. 2016): ``blocks`` bottlenecks per stage, ``base`` stem width."""

    def __init__(self, blocks=(3, 4, 6, 3), base: int = 64, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, base, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(base),
            nn.ReLU(),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        layers, cin = [], base
        for i, n in enumerate(blocks):
            width = base * 2**i
            for j in range(n):
                layers.append(Bottleneck(cin, width, 2 if (j == 0 and i > 0) else 1))
                cin = 4 * width
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.layers(self.stem(x)), 1), 1))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """A GPT-2-style decoder (pre-norm blocks, learned positions, tied embedding)."""

    def __init__(self, vocab: int = 50257, ctx: int = 1024, d: int = 768, layers: int = 12, heads: int = 12) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for b in self.blocks:
            x = b(x)
        return self.ln(x) @ self.tok.weight.t()


#: A method's timed steps stop after MIN_STEPS once they add up to SLOW_S seconds (the codec
#: of a slow method is seconds a step: three steps give its median, a budget measures more methods).
MIN_STEPS, SLOW_S = 3, 1.0


def build(name: str, device: torch.device):
    """``(model, make_batch, loss_fn, description)`` of one model; ``make_batch(g)`` draws a batch."""
    if name in ("resnet50", "tiny_resnet"):
        big = name == "resnet50"
        model = ResNet() if big else ResNet(blocks=(1, 1, 1, 1), base=8, classes=16)
        batch, side, classes = (64, 224, 1000) if big else (4, 32, 16)

        def make_batch(g):
            x = torch.randn(batch, 3, side, side, generator=g).to(device)
            return x, torch.randint(classes, (batch,), generator=g).to(device)

        def loss_fn(m, b):
            return F.cross_entropy(m(b[0]), b[1])

        desc = f"ResNet, batch {batch} at {side}x{side}"
    elif name in ("gpt2", "tiny_gpt"):
        big = name == "gpt2"
        model = GPT() if big else GPT(vocab=257, ctx=64, d=32, layers=2, heads=4)
        batch, seq, vocab = (8, 1024, 50257) if big else (2, 64, 257)

        def make_batch(g):
            idx = torch.randint(vocab, (batch, seq + 1), generator=g).to(device)
            return idx[:, :-1], idx[:, 1:]

        def loss_fn(m, b):
            return F.cross_entropy(m(b[0]).reshape(-1, vocab).float(), b[1].reshape(-1))

        desc = f"GPT decoder, batch {batch} x {seq} tokens"
    else:
        raise ValueError(f"unknown model {name!r}: resnet50, gpt2, tiny_resnet, tiny_gpt (or tiny: both)")
    return model.to(device), make_batch, loss_fn, desc


# -- timing -------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - t0


class Steps:
    """Steady-state codec steps of one method over a model's gradients, as DDP and the engine
    run them: each bucket one flat buffer, the gradients its views (``dry_run(bucket=...)``:
    the protocol writes the result into it, as into DDP's bucket); one error-feedback memory
    kept from step to step and released after each, as the engine does (so a step adds the
    residual the step before left and writes the next into the buffer it freed, instead of
    starting with none in new buffers); the codecs' state kept in ``stores``.

    ``reset()`` copies the gradients back into the buckets (the step before left its result
    there): call it before the clock starts. ``run(step)`` runs one step's dry runs and returns
    their collectives."""

    def __init__(self, method, grads, names, buckets, world: int) -> None:
        from gradzip.feedback import ErrorFeedback

        self.method, self.world = method, world
        self.names = [[names[i] for i in b] for b in buckets]
        self.pristine = [torch.cat([grads[i].reshape(-1) for i in b]) for b in buckets]
        self.flat = [p.clone() for p in self.pristine]
        self.views = []
        for b, flat in zip(buckets, self.flat):
            views, pos = [], 0
            for i in b:
                views.append(flat[pos : pos + grads[i].numel()].view(grads[i].shape))
                pos += grads[i].numel()
            self.views.append(views)
        self.stores: dict = {}
        self.memory = ErrorFeedback()

    def reset(self) -> None:
        for f, p in zip(self.flat, self.pristine):
            f.copy_(p)

    def run(self, step: int) -> list:
        from gradzip.costmodel import dry_run

        colls = []
        for views, names, flat in zip(self.views, self.names, self.flat):
            d = dry_run(
                self.method,
                views,
                world_size=self.world,
                names=names,
                stores=self.stores,
                step=step,
                memory=self.memory,
                bucket=flat,
            )
            colls.extend(d.collectives)
        self.memory.release()
        return colls


class EngineSteps(Steps):
    """:class:`Steps` through ``Engine.reduce`` (``--through engine``, the default): an engine
    against :class:`benchmarks.host_syncs.EngineLoopback` (``world`` ranks that send what this
    rank sends), so the engine's checks, flags and its planned buckets
    (:mod:`gradzip.protocols.planned`) are timed with the codec, and ``end_step()``'s one host
    read with each step. ``run(step)`` returns the collectives the loopback logged."""

    def __init__(self, method, grads, names, buckets, world: int) -> None:
        from benchmarks.host_syncs import EngineLoopback
        from gradzip.engine import Engine

        super().__init__(method, grads, names, buckets, world)
        self.comm = EngineLoopback(world)
        self.engine = Engine(method, process_group=self.comm)

    def run(self, step: int) -> list:
        log = self.comm.loop.log
        start = len(log)
        for views, names, flat in zip(self.views, self.names, self.flat):
            fut = self.engine.reduce(names, views, dest=flat)
            self.engine.flush()
            fut.wait()
        self.engine.end_step()
        return log[start:]


def measure_model(name, methods, device, world, steps, warmup, log=print, deadline=None, through="engine") -> dict:
    """One model's figures (above); ``deadline`` (a ``time.perf_counter()`` value): a method not
    started by then is listed under ``skipped`` instead of timed. ``through``: ``"engine"``
    (:class:`EngineSteps`) or ``"protocol"`` (:class:`Steps`, the protocol's dry runs)."""
    import gradzip as gz
    from gradzip.costmodel import Link, ddp_buckets, dry_run, wire_time

    torch.manual_seed(0)
    model, make_batch, loss_fn, desc = build(name, device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    batches = [make_batch(g) for _ in range(2)]

    def step(i):
        opt.zero_grad(set_to_none=True)
        loss_fn(model, batches[i % 2]).backward()
        opt.step()

    for i in range(warmup):
        step(i)
    compute = [timed(lambda: step(i), device) for i in range(steps)]
    compute_s = statistics.median(compute)

    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt.zero_grad(set_to_none=True)
    loss_fn(model, batches[0]).backward()
    grads = [p.grad.detach().clone() for _, p in params]
    names = [n for n, _ in params]
    nbytes = [t.numel() * t.element_size() for t in grads]
    buckets = ddp_buckets(nbytes)
    raw_bytes = sum(nbytes)
    ones = Link(1.0)  # wire time at 1 bit/s = the bits on the wire (latency 0)
    raw_bits = sum(
        wire_time(
            [c for c in dry_run(gz.Identity(), [grads[i] for i in b], world_size=world, decode=False).collectives],
            world,
            ones,
        )
        for b in buckets
    )
    log(
        f"{name}: {sum(t.numel() for t in grads) / 1e6:.1f}M parameters, {len(buckets)} buckets, "
        f"compute {compute_s * 1e3:.2f} ms/step"
    )

    rows, skipped = {}, []
    for spec in methods:
        if deadline is not None and time.perf_counter() > deadline:
            skipped.append(spec)
            continue
        times, colls = [], []
        try:
            steps_of = (EngineSteps if through == "engine" else Steps)(gz.parse(spec), grads, names, buckets, world)
            for s in range(warmup + steps):
                steps_of.reset()

                def run():
                    colls[:] = steps_of.run(s)

                t = timed(run, device)
                if s >= warmup:
                    times.append(t)
                    if len(times) >= MIN_STEPS and sum(times) > SLOW_S:
                        break  # a slow method: its median of MIN_STEPS steps is figure enough
        except Exception as e:  # noqa: BLE001 - recorded in the results and printed, never dropped
            rows[spec] = {"error": f"{type(e).__name__}: {e}"}
            log(f"  {spec:55s} FAILED: {rows[spec]['error']}")
            continue
        codec_s = statistics.median(times)
        bits = wire_time(colls, world, ones)
        rows[spec] = {
            "codec_ms_per_step": codec_s * 1e3,
            "codec_ms_min": min(times) * 1e3,
            "steps_timed": len(times),
            "fraction_of_compute": codec_s / compute_s,
            "bytes_handed": sum(c.nbytes for c in colls),
            "wire_bits_per_step": bits,
            "wire_ratio_vs_allreduce": raw_bits / bits if bits else math.inf,
        }
        log(
            f"  {spec:55s} codec {codec_s * 1e3:9.3f} ms/step ({codec_s / compute_s:7.1%} of compute), "
            f"wire {raw_bits / bits if bits else math.inf:8.1f}x less than allreduce"
        )
    res = {
        "description": desc,
        "parameters": sum(t.numel() for t in grads),
        "gradient_bytes": raw_bytes,
        "buckets": len(buckets),
        "compute_ms_per_step": compute_s * 1e3,
        "compute_ms_all": [c * 1e3 for c in compute],
        "allreduce_wire_bits_per_step": raw_bits,
        "methods": rows,
        "skipped": skipped,
    }
    add_breakeven(res)
    return res


def add_breakeven(res: dict) -> None:
    """Each method's break-even link (``breakeven_gbps``, above) against ``Identity()``'s codec
    time (0 when Identity was not measured) in one model's figures."""
    rows = res["methods"]
    base = rows.get("Identity()", {}).get("codec_ms_per_step", 0.0) / 1e3
    for row in rows.values():
        if "error" in row:
            continue
        saved = res["allreduce_wire_bits_per_step"] - row["wire_bits_per_step"]
        extra = row["codec_ms_per_step"] / 1e3 - base
        if saved <= 0:
            be = None
        elif extra <= 0:
            be = math.inf
        else:
            be = saved / extra / 1e9
        row["breakeven_gbps"] = be


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    ap.add_argument("--models", "--model", default="resnet50,gpt2", help="comma-separated: resnet50, gpt2, tiny")
    ap.add_argument("--methods", default=None, help="';'-separated gz.parse specs (default: every method)")
    ap.add_argument("--world", type=int, default=8, help="ranks for the protocols and the cost model (default 8)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default: 3 on CUDA, 1 on CPU)")
    ap.add_argument(
        "--first",
        type=int,
        default=0,
        help="measure the first N methods on every model before the others (the goals' first; default: no split)",
    )
    ap.add_argument(
        "--through",
        choices=("engine", "protocol"),
        default="engine",
        help="time each bucket through Engine.reduce (default: checks, flags and planned buckets included) "
        "or the protocol's dry run alone",
    )
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/gpu_step_<device>.json)")
    ap.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds: start no model or method after this; what was measured is written (skipped lists the rest)",
    )
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_step: no CUDA device; use --device cpu for the smoke run", file=sys.stderr)
        return 2
    if args.steps < 1 or args.world < 1:
        ap.error("--steps and --world must be at least 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    warmup = args.warmup if args.warmup is not None else (3 if device.type == "cuda" else 1)
    models = []
    for m in args.models.split(","):
        models += ["tiny_resnet", "tiny_gpt"] if m.strip() == "tiny" else [m.strip()]
    methods = DEFAULT_METHODS if args.methods is None else [s.strip() for s in args.methods.split(";") if s.strip()]

    import gradzip as gz
    import gradzip.kernels as K

    for spec in methods:
        gz.parse(spec)  # a bad spec fails before anything is timed
    K.reset_dispatch()
    t0 = time.perf_counter()
    deadline = None if args.budget is None else t0 + args.budget
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # noqa: BLE001 - recorded, not needed
        triton_version = None
    name = device_name(device)
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"gpu_step_{slug(name)}.json"
    results: dict = {}
    skipped: list[str] = []

    def write() -> dict:
        report = K.backend_report()
        doc = {
            "benchmark": "benchmarks/gpu_step.py",
            "argv": list(argv) if argv is not None else sys.argv[1:],
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "device": name,
            "machine": {"node": platform.node(), "platform": platform.platform(), "python": platform.python_version()},
            "torch": torch.__version__,
            "triton": triton_version,
            "world": args.world,
            "through": args.through,
            "threads": torch.get_num_threads(),
            "steps": args.steps,
            "warmup": warmup,
            "budget_s": args.budget,
            "elapsed_s": time.perf_counter() - t0,
            "cost_model": "ring formulas (gradzip.costmodel.wire_time), latency 0, one flat link, no overlap",
            "kernels_chosen": {
                op: {dev: c["backend"] for dev, c in v["chosen"].items()}
                for op, v in report["ops"].items()
                if v["chosen"]
            },
            "models": results,
            "skipped": skipped + [f"{m}: {spec}" for m, r in results.items() for spec in r.get("skipped", [])],
        }
        doc["errors"] = [
            f"{m}: {spec}: {row['error']}"
            for m, r in results.items()
            for spec, row in r["methods"].items()
            if "error" in row
        ]
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=2, default=lambda v: None if v != v else str(v)) + "\n")
        return doc

    # The first --first methods on every model, then the rest on every model; the file is
    # rewritten after each pass of a model: a run stopped early leaves what it measured.
    passes = [methods[: args.first], methods[args.first :]] if 0 < args.first < len(methods) else [methods]
    for chunk in passes:
        for m in models:
            if deadline is not None and time.perf_counter() > deadline:
                if m in results:
                    results[m].setdefault("skipped", []).extend(chunk)
                elif m not in skipped:
                    skipped.append(m)
                continue
            got = measure_model(
                m, chunk, device, args.world, args.steps, warmup, deadline=deadline, through=args.through
            )
            if m in results:  # the second pass: its methods join the first's, as shares of the first's compute
                first_ms = results[m]["compute_ms_per_step"]
                for row in got["methods"].values():
                    if "error" not in row:
                        row["fraction_of_compute"] = row["codec_ms_per_step"] / first_ms
                results[m]["methods"].update(got["methods"])
                results[m].setdefault("skipped", []).extend(got.get("skipped", []))
                add_breakeven(results[m])
            else:
                results[m] = got
            write()
    doc = write()
    print(f"wrote {out}")
    if doc["skipped"]:
        print(f"gpu_step: skipped (budget): {', '.join(doc['skipped'])}", file=sys.stderr)
    for line in doc["errors"]:
        print(f"gpu_step: FAILED {line}", file=sys.stderr)
    return 1 if doc["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
