"""Every GPU measurement in one call, within a time budget, with one summary against the goals.

    python -m benchmarks.gpu_suite                        # CUDA: every part, within 570 s
    python -m benchmarks.gpu_suite --out DIR --budget 420 # write into DIR (the device tool: $OUT)
    python -m benchmarks.gpu_suite --parts tests --budget 200           # rerun one part
    python -m benchmarks.gpu_suite --smoke [--out DIR]    # the same code paths on the CPU, tiny sizes

The parts, in this order, each a child process with its own share of the budget (seconds:
its cap, and the least worth starting with):

=========== ===== ===== =====================================================================
part        cap   least what it runs and writes (``SLUG``: the device's name, e.g.
                        ``nvidia-h100-80gb-hbm3``)
=========== ===== ===== =====================================================================
profile     60    20    whole calls of every codec and protocol of the grammar
                        (:data:`PROFILE_METHODS`; ``measure_codec(device="cuda")`` at 1M and
                        16M float32 elements, 2 and 8 ranks, fastest of 3), the profile
                        ``gradzip plan --device`` reads once ``benchmarks/h100_profile.py``
                        has built it: ``codec_profile_SLUG.json``
kernels     90    30    ``benchmarks/kernels.py --sizes 16M,64M,256M --dtypes fp32,bf16
                        --topk-sizes 100M``: every encoder and decoder, TopK exact, sampled
                        and approximate against ``torch.topk``: ``kernels_SLUG.json``
gpu_step    140   30    ``benchmarks/gpu_step.py`` on ResNet-50 and GPT-2 small (8 timed steps,
                        3 for a method slower than 1 s a step), the goals' fast methods on both
                        models first (:data:`STEP_FIRST`): ``gpu_step_SLUG.json``
dryrun      50    20    ``benchmarks/dryrun_profile.py``: one step of ResNet-50's buckets at 8
                        ranks under cProfile for :data:`DRYRUN_METHODS` (where the codec time
                        goes: kernels, Python, launches, syncs): ``dryrun_profile_SLUG.txt``
tests       270   40    ``pytest -m gpu tests``: ``gpu_tests_SLUG.txt`` (the ranks of a multi-rank
                        test print their stacks after 45 s: ``GRADZIP_RANK_STACKS_AFTER``; a
                        failure's report is printed when it fails: ``GRADZIP_REPORT_NOW``)
=========== ===== ===== =====================================================================

A part gets ``min(cap, budget left - 10 s)``; it is skipped when that is under its least.
``kernels.py`` and ``gpu_step.py`` take a soft budget (start no block after it, 25 s short of
their share) and rewrite their file after every block, as this script's profile part does;
each part is killed, with its process group, at the end of its share. So a part stopped early
leaves what it measured, the next part still runs, and the whole run ends within ``--budget``
plus start-up: the 15 minutes of a lent device are never overrun. Then it writes
``gpu_suite_SLUG.json`` (the parts' status and times, the summary) and ``gpu_suite_SLUG.log``
(every part's output), and prints the summary: each goal of the GPU measurements with what
was measured, or "not measured". The summary reads the parts' files in the folder, so a rerun
of one part (``--parts tests``) into a folder that holds the others' files summarizes them all.

Files go to ``benchmarks/results/`` (``--out DIR`` for another folder, e.g. the device tool's
``$OUT``: six files, none in subfolders). ``--smoke`` runs the same parts on the CPU in
seconds: the profile at 256 and 4096 elements, the kernels at 4,099 elements (20,011 for
top-k) under the Triton interpreter, ``gpu_step.py`` on its tiny models, ``pytest -m gpu``
on one file (its tests skip without a GPU); it writes into a new temporary folder unless
``--out`` is given, and nowhere else. ``docs/kernels.md`` gives the device tool's command.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._common import RESULTS, ROOT, child_env, command

#: Every codec and protocol of the grammar, as the profile part measures them: the codecs'
#: defaults and the configs the plan's defaults and the GPU goals use. Policy routes tensors
#: to these (the plan costs its routes), LocalSGD and DiLoCo use their compression's fit.
PROFILE_METHODS = (
    "Identity()",
    "FP16()",
    "BF16()",
    "TopK(0.01)",
    "TopK(0.01, mode='sampled')",
    "TopK(0.01, mode='approx')",
    "RandomK(0.01)",
    "Threshold()",
    "SignSGD()",
    "SignSGD(block=1024)",
    "QSGD()",
    "TernGrad()",
    "TernGrad(block=1024)",
    "Int8()",
    "Int8(allreduce=True)",
    "Int4()",
    "Int2()",
    "FP8()",
    "FP4()",
    "ChunkTopK(32, chunk=64, values='q2')",
    "PowerSGD(rank=1)",
    "PowerSGD(rank=2)",
    "PowerSGD(rank=4)",
    "Hierarchical(Int8(), local_size=4)",
    "TwoPhase(Int8())",
    "AllGather(Int8())",
    "Allreduce(FP16())",
    "ReduceScatter(FP16())",
    "Int8Allreduce()",
    "Filter(TopK(0.01))",
    "DCT(TopK(0.01))",
    "Adaptive(TopK(0.01))",
)
#: Routes the plan costs through other methods' fits, so the profile needs no entry of theirs
#: (``Flat(codec)``: its codec's fit, on a call as one tensor).
COMPOSITE = ("Policy", "Flat")

#: gpu_step's methods, the goals' first (a budget cut drops the last): the goals' codecs as
#: ``Flat`` carries them (a bucket as one tensor) and as they run tensor by tensor.
STEP_GOAL_METHODS = (
    "Identity()",
    "Flat(TopK(0.01))",
    "Flat(SignSGD())",
    "Flat(Int8())",
    "PowerSGD(rank=4)",
    "TopK(0.01)",
    "SignSGD()",
    "Int8()",
)
#: Where a step's codec time goes, under cProfile (the dryrun part): Flat's goal codecs, PowerSGD
#: and a codec tensor by tensor.
DRYRUN_METHODS = ("Flat(Int8())", "Flat(SignSGD())", "Flat(TopK(0.01))", "PowerSGD(rank=4)", "Int8()")
#: How many of them gpu_step measures on both models before the rest (the tensor-by-tensor
#: codecs take seconds a step: they come after the fast ones).
STEP_FIRST = 5

#: part -> (cap in seconds, the least worth starting it with)
PARTS = {"profile": (60, 20), "kernels": (90, 30), "gpu_step": (140, 30), "dryrun": (50, 20), "tests": (270, 40)}
DEFAULT_BUDGET = 570
#: The tests part's ranks print their stacks after this many seconds (a hang shows where it waits).
RANK_STACKS_AFTER = 45
RESERVE = 10  # seconds kept for the summary and the files
SOFT_MARGIN = 25  # a child's soft budget ends this much before its share (a block in flight finishes)

#: The goals the summary checks (issue text: "Done when").
COPY_GOAL, APPROX_GOAL, COUNT_BAND, STEP_GOAL = 0.8, 10.0, (0.9, 1.1), 0.05
N64 = 64 << 20  # the size of the bandwidth goals: 64M float32 elements
ENCODERS = (
    ("threshold_ef", None, "Threshold with error feedback"),
    ("sign_ef", "one-pass", "SignSGD with error feedback (block 1024)"),
    ("sign_ef_nores", "one-pass", "SignSGD, no residual (block 1024)"),
    ("qsgd_encode", "one-pass", "QSGD (s = 7, block 64)"),
    ("terngrad_encode", "one-pass", "TernGrad (block 1024)"),
    ("int8_encode", "one-pass", "Int8 (block 1024)"),
    ("sampled_topk_approx", None, "TopK values, mode='approx' (one pass over x)"),
)
DECODERS = (
    ("decode_add_bitmap2", "Threshold's bitmaps, 4 peers"),
    ("decode_add_sign1", "SignSGD frames, 4 peers"),
    ("decode_add_qsgd", "QSGD frames, 4 peers"),
    ("decode_add_tern2", "TernGrad frames, 4 peers"),
    ("decode_add_int8", "Int8 frames, 4 peers"),
    ("scatter_add_sparse", "TopK frames (density 0.001), 4 peers"),
)
STEP_METHODS = STEP_GOAL_METHODS[1:]
#: Where the summary reads each goal: the goals' sizes and models on a device; on the smoke
#: run the same rows at its tiny sizes (their figures say nothing about the goals).
SCALES = {
    "device": {
        "n": N64,
        "n_text": "64M",
        "topk": (90_000_000, 110_000_000),
        "topk_text": "100M",
        "models": (("resnet50", "ResNet-50"), ("gpt2", "GPT-2 small")),
    },
    "smoke": {
        "n": 4099,
        "n_text": "4,099 (smoke)",
        "topk": (20011, 20011),
        "topk_text": "20,011 (smoke)",
        "models": (("tiny_resnet", "tiny ResNet (smoke)"), ("tiny_gpt", "tiny GPT (smoke)")),
    },
}


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def files(slug_: str) -> dict[str, str]:
    """The file of each part, and the suite's own two, for a device's slug."""
    return {
        "profile": f"codec_profile_{slug_}.json",
        "kernels": f"kernels_{slug_}.json",
        "gpu_step": f"gpu_step_{slug_}.json",
        "dryrun": f"dryrun_profile_{slug_}.txt",
        "tests": f"gpu_tests_{slug_}.txt",
        "suite": f"gpu_suite_{slug_}.json",
        "log": f"gpu_suite_{slug_}.log",
    }


# -- the profile part (run in its own process: python -m benchmarks.gpu_suite --part profile) ------------
def measure_profile(out: Path, device: str, *, smoke: bool, budget: float | None, log=print) -> dict:
    """Time every method of :data:`PROFILE_METHODS` as whole calls on ``device``
    (:func:`gradzip.costmodel.measure_codec`), rewriting ``out`` after each."""
    import torch

    import gradzip as gz
    from gradzip.costmodel import CodecProfile, measure_codec
    from gradzip.machine import machine

    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({platform.machine()})"
    sizes, repeats = ((256, 4096), 1) if smoke else ((1 << 20, 1 << 24), 3)
    worlds = (2, 8)  # on one rank TwoPhase does what it never does in use (costmodel.md)
    prof = CodecProfile(machine=machine(), sizes=sizes, worlds=worlds, repeats=repeats, threads=None)
    t0 = time.perf_counter()
    errors, skipped = [], []

    def write() -> dict:
        doc = prof.to_dict()
        doc.update(
            benchmark="benchmarks/gpu_suite.py (profile)",
            device=name,
            date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            timing="whole codec calls on the device (measure_codec(device=...)): each dry run timed with the "
            "device synchronized, less the loopback's stand-ins for the collectives; fastest of "
            f"{repeats} after a warm-up",
            methods=list(PROFILE_METHODS),
            errors=errors,
            skipped=skipped,
            budget_s=budget,
            elapsed_s=time.perf_counter() - t0,
            smoke=smoke,
        )
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        return doc

    for spec in PROFILE_METHODS:
        if budget is not None and time.perf_counter() - t0 > budget:
            skipped.append(spec)
            continue
        t = time.perf_counter()
        comp = gz.parse(spec)
        try:
            fit, raw = measure_codec(comp, sizes=sizes, worlds=worlds, repeats=repeats, device=dev, whole_call=True)
        except Exception as e:  # noqa: BLE001 - recorded and printed, never dropped
            errors.append(f"{spec}: {type(e).__name__}: {e}")
            log(f"profile: {spec}: FAILED {type(e).__name__}: {e}")
            continue
        prof.add(comp, fit, raw=raw)
        log(
            f"profile: {spec:38s} {time.perf_counter() - t:6.2f} s   "
            f"{1e3 * fit.seconds(sizes[1], worlds[1]):9.3f} ms at {sizes[1]:,} elements, {worlds[1]} ranks"
        )
        write()
    doc = write()
    if skipped:
        log(f"profile: skipped (budget): {', '.join(skipped)}")
    return doc


# -- running the parts ----------------------------------------------------------------------------
def part_command(part: str, out: Path, smoke: bool, soft: float) -> list[str]:
    """The child process of a part, writing ``out``; ``soft``: its own budget in seconds."""
    py, budget = [sys.executable, "-m"], ["--budget", f"{max(soft, 1.0):.0f}"]
    smoke_flag = ["--smoke"] if smoke else []
    if part == "profile":
        return [*py, "benchmarks.gpu_suite", "--part", "profile", "--file", str(out), *budget, *smoke_flag]
    if part == "kernels":
        sizes = (
            ["--sizes", "4099", "--topk-sizes", "20011"]
            if smoke
            else ["--sizes", "16M,64M,256M", "--topk-sizes", "100M"]
        )
        return [*py, "benchmarks.kernels", *sizes, "--dtypes", "fp32,bf16", *budget, "--out", str(out), *smoke_flag]
    if part == "gpu_step":
        from benchmarks.gpu_step import DEFAULT_METHODS

        if smoke:
            run = ["--device", "cpu", "--models", "tiny", "--steps", "1", "--warmup", "0", "--threads", "1"]
            methods = list(STEP_GOAL_METHODS)
        else:
            run = ["--device", "cuda", "--models", "resnet50,gpt2", "--steps", "8", "--warmup", "2"]
            run += ["--first", str(STEP_FIRST)]  # the fast goals' methods on both models first
            methods = list(dict.fromkeys([*STEP_GOAL_METHODS, *DEFAULT_METHODS]))
        return [*py, "benchmarks.gpu_step", *run, "--methods", "; ".join(methods), *budget, "--out", str(out)]
    if part == "dryrun":
        if smoke:
            run = ["--device", "cpu", "--model", "tiny", "--methods", DRYRUN_METHODS[0]]
        else:
            run = ["--device", "cuda", "--methods", "; ".join(DRYRUN_METHODS)]
        return [*py, "benchmarks.dryrun_profile", *run, "--out", str(out)]
    if part == "tests":
        where = ["tests/kernels/test_cuda.py"] if smoke else ["tests"]
        return [*py, "pytest", "-m", "gpu", "-q", "-rfEs", "-p", "no:cacheprovider", "--timeout", "120", *where]
    raise ValueError(f"unknown part {part!r}; choose from {', '.join(PARTS)}")


def run_part(argv: list[str], limit: float, sink, env: dict) -> tuple[int | None, float]:
    """Run ``argv`` from the repository root in its own process group, output into ``sink``;
    kill the group after ``limit`` seconds. ``(exit status or None if killed, seconds)``."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        rc = proc.wait(timeout=max(limit, 1.0))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rc = None
    return rc, time.perf_counter() - t0


def _tests_counts(text: str) -> dict:
    """The counts of pytest's last summary line (passed, failed, skipped, errors, deselected)."""
    last = [ln for ln in text.splitlines() if re.search(r"\b(passed|failed|skipped|error|deselected)\b", ln)]
    counts = {}
    if last:
        for num, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)", last[-1]):
            counts["errors" if word.startswith("error") else word] = int(num)
    return counts


# -- the summary ----------------------------------------------------------------------------------
def _load(path: Path):
    try:
        return json.loads(path.read_text()) if path.suffix == ".json" else path.read_text()
    except (OSError, ValueError):
        return None


def _row(kernels, name, route=None, n=N64, dtype="float32"):
    for r in (kernels or {}).get("results", []):
        if (
            r["kernel"] == name
            and r["n"] == n
            and r.get("dtype", "float32") == dtype
            and (route is None or r.get("route") == route)
            and r["backend"] in ("triton", "torch")
        ):
            return r
    return None


def _verdict(ok) -> str:
    if isinstance(ok, str):
        return ok
    return "not measured" if ok is None else ("met" if ok else "missed")


def summarize(docs: dict, scale: dict | None = None) -> list[dict]:
    """One row per goal: ``{"goal", "item", "measured", "target", "verdict"}``, verdict ``met``,
    ``missed`` or ``not measured``. ``docs``: the parts' files as loaded (``None`` where absent);
    ``scale``: where each goal is read (:data:`SCALES`, the device's by default)."""
    sc = scale or SCALES["device"]
    n64, (lo, hi) = sc["n"], sc["topk"]
    rows = []

    def add(goal, item, measured, target, ok):
        rows.append(
            {"goal": goal, "item": item, "measured": "not measured" if ok is None else measured, "target": target}
        )
        rows[-1]["verdict"] = _verdict(ok)

    tests = docs.get("tests")
    counts = _tests_counts(tests) if isinstance(tests, str) else {}
    if any(counts.get(c) for c in ("passed", "failed", "errors", "skipped")):
        text = ", ".join(f"{v} {k}" for k, v in counts.items() if k != "deselected")
        ok = not counts.get("failed") and not counts.get("errors") and not counts.get("skipped")
        add("pytest -m gpu", "every CUDA test", text, "all pass, none skipped", ok)
    else:
        add("pytest -m gpu", "every CUDA test", "", "all pass, none skipped", None)

    k = docs.get("kernels")
    for family, table in (("encoder", ENCODERS), ("decoder", [(a, None, b) for a, b in DECODERS])):
        for name, route, what in table:
            r = _row(k, name, route, n=n64)
            frac = r["fraction_of_copy"] if r else None
            measured = f"{100 * frac:.0f}% of copy" if r else ""
            add(
                f"{family} at {sc['n_text']} fp32",
                what,
                measured,
                ">= 80% of copy",
                None if r is None else frac >= COPY_GOAL,
            )

    def near(kernel):
        return next(
            (
                x
                for x in (k or {}).get("results", [])
                if x["kernel"] == kernel and lo <= x["n"] <= hi and x.get("dtype", "float32") == "float32"
            ),
            None,
        )

    where = f"at 0.1% of {sc['topk_text']}"
    r = near("sampled_topk_approx")
    speed = None if r is None else r["speedup_vs_torch_topk"]
    add(
        f"TopK(mode='approx') {where}",
        "speed-up over torch.topk",
        f"{speed:.1f}x" if r else "",
        f">= {APPROX_GOAL:g}x",
        None if r is None else speed >= APPROX_GOAL,
    )
    count = None if r is None else r["count_over_k"]
    add(
        f"TopK(mode='approx') {where}",
        "elements sent / k",
        f"{count:.3f}" if r else "",
        "0.9 .. 1.1",
        None if r is None else COUNT_BAND[0] <= count <= COUNT_BAND[1],
    )
    x = near("topk_exact")
    speed = None if x is None else x["speedup_vs_torch_topk"]
    add(
        f"TopK(mode='exact') {where}",
        "speed-up over torch.topk (it is torch.topk: no goal)",
        f"{speed:.2f}x" if x else "",
        "(reported)",
        None if x is None else "reported",
    )

    step = docs.get("gpu_step") or {}
    for model, label in sc["models"]:
        m = (step.get("models") or {}).get(model) or {}
        for spec in STEP_METHODS:
            row = (m.get("methods") or {}).get(spec) or {}
            frac = row.get("fraction_of_compute")
            measured = (
                f"{100 * frac:.1f}% ({row['codec_ms_per_step']:.2f} of {m['compute_ms_per_step']:.1f} ms)"
                if frac is not None
                else ""
            )
            add(
                f"codec share of a {label} step",
                spec,
                measured,
                "<= 5% of compute",
                None if frac is None else frac <= STEP_GOAL,
            )

    prof = docs.get("profile") or {}
    measured, total = len(prof.get("entries") or {}), len(PROFILE_METHODS)
    text = f"{measured} of {total}" + (f" ({len(prof['errors'])} failed)" if prof.get("errors") else "")
    add(
        "gradzip plan --device profile",
        "codecs and protocols measured as whole calls",
        text,
        f"{total} of {total}",
        None if not prof else measured == total,
    )
    return rows


def format_summary(rows: list[dict], device: str) -> str:
    widths = [max(len(str(r[c])) for r in rows) for c in ("goal", "item", "measured", "target")]
    widths = [max(w, len(h)) for w, h in zip(widths, ("goal", "item", "measured", "goal's target"))]
    head = ("goal", "item", "measured", "goal's target", "verdict")
    lines = [f"summary against the GPU goals on {device}:"]
    if "smoke" in device:
        lines[0] += " (a smoke run: CPU figures at tiny sizes, which say nothing about the goals)"
    fmt = "  ".join(f"{{:<{w}}}" for w in widths) + "  {}"
    lines.append(fmt.format(*head))
    lines.append("  ".join("-" * w for w in widths) + "  -------")
    for r in rows:
        lines.append(fmt.format(r["goal"], r["item"], r["measured"], r["target"], r["verdict"]))
    tally = {v: sum(r["verdict"] == v for r in rows) for v in ("met", "missed", "not measured")}
    lines.append(", ".join(f"{n} {v}" for v, n in tally.items()))
    return "\n".join(lines)


def summarize_folder(out: Path, names: dict, scale: dict) -> list[dict]:
    """:func:`summarize` of the part files (``names``: :func:`files`) found in ``out``."""
    return summarize({part: _load(out / names[part]) for part in PARTS}, scale)


def resummarize(device: str, out: Path, argv) -> int:
    """Summarize the part files of ``device`` in ``out`` again into its ``gpu_suite_`` file
    (the parts' status as first written, the summary and a note of this command)."""
    names = files(slug(device))
    path = out / names["suite"]
    if not path.exists():
        print(f"gpu_suite: no {path} to summarize again", file=sys.stderr)
        return 2
    doc = json.loads(path.read_text())
    doc["summary"] = summarize_folder(out, names, SCALES["device"])
    doc["summarized_again"] = {
        "command": command("gpu_suite", argv),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(format_summary(doc["summary"], device))
    return 0


# -- main -----------------------------------------------------------------------------------------
def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="the same parts on the CPU, tiny sizes, into a temp folder")
    p.add_argument("--out", default=None, help="folder for every file (default benchmarks/results/; smoke: a temp dir)")
    p.add_argument(
        "--budget",
        type=float,
        default=None,
        help=f"seconds for every part together (default {DEFAULT_BUDGET}; smoke: none)",
    )
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, in this order: {', '.join(PARTS)}")
    p.add_argument(
        "--part-budget",
        action="append",
        default=[],
        metavar="PART=SECONDS",
        help="another cap for a part (repeatable), e.g. tests=200",
    )
    p.add_argument(
        "--summarize",
        default=None,
        metavar="DEVICE",
        help="run nothing: summarize the files of DEVICE (its name, e.g. 'NVIDIA H200') in --out "
        "(default benchmarks/results/) again, after a part was rerun or merged by hand",
    )
    # internal: one part in this process (the suite starts itself so for the profile)
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)
    p.add_argument("--file", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = _args(argv)
    if args.part == "profile":
        import torch

        device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
        doc = measure_profile(Path(args.file), device, smoke=args.smoke, budget=args.budget)
        return 1 if doc["errors"] else 0
    if args.part is not None:
        print(f"--part takes profile, got {args.part!r}", file=sys.stderr)
        return 2

    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        print(f"gpu_suite: unknown part {', '.join(unknown)}; choose from {', '.join(PARTS)}", file=sys.stderr)
        return 2
    caps = {p: float(c) for p, (c, _) in PARTS.items()}
    for item in args.part_budget:
        name, _, secs = item.partition("=")
        if name not in PARTS or not re.fullmatch(r"\d+(\.\d*)?", secs):
            print(f"gpu_suite: --part-budget wants PART=SECONDS, got {item!r}", file=sys.stderr)
            return 2
        caps[name] = float(secs)

    if args.summarize:
        return resummarize(args.summarize, Path(args.out) if args.out else RESULTS, argv)

    import torch

    if args.smoke:
        device = f"cpu {platform.machine()} smoke"
    elif torch.cuda.is_available():
        device = torch.cuda.get_device_name(0)
    else:
        print("gpu_suite: no CUDA device; --smoke runs the same parts on the CPU", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else (Path(tempfile.mkdtemp(prefix="gpu_suite_")) if args.smoke else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    names = files(slug(device))
    budget = args.budget if args.budget is not None else (math.inf if args.smoke else DEFAULT_BUDGET)
    env = child_env(dict(os.environ))
    env["PYTHONUNBUFFERED"] = "1"
    if args.smoke:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    started = time.perf_counter()
    print(f"gpu_suite: {device}; parts {', '.join(parts)}; budget {budget:g} s; writing into {out}", flush=True)
    status = {}
    log_path = out / names["log"]
    with open(log_path, "w") as log:
        log.write(f"# {command('gpu_suite', argv)}\n# {device}, torch {torch.__version__}, {_dt.date.today()}\n")
        for part in parts:
            left = budget - (time.perf_counter() - started) - RESERVE
            share = min(caps[part], left)
            least = min(PARTS[part][1], caps[part])
            if share < least:
                status[part] = {"status": "skipped", "why": f"budget: {max(left, 0):.0f} s left, needs {least:g}"}
                print(f"gpu_suite: {part}: skipped ({status[part]['why']})", flush=True)
                continue
            soft = share - SOFT_MARGIN if share > 2 * SOFT_MARGIN else share / 2
            target = out / names[part]
            argv_part = part_command(part, target, args.smoke, soft)
            print(f"gpu_suite: {part}: up to {share:.0f} s: {' '.join(argv_part[1:])}", flush=True)
            log.write(f"\n## {part}: {' '.join(argv_part)}\n")
            log.flush()
            if part == "tests":
                with open(target, "w") as f:
                    f.write(
                        f"# On {device}, torch {torch.__version__}, {_dt.date.today()}\n"
                        f"$ {' '.join(['python', *argv_part[1:]])}\n"
                    )
                    f.flush()
                    # ranks print their stacks after a while; a failure's report is printed as it
                    # happens (tests/support/report_now.py): a part killed at its share keeps them
                    stacks = {"GRADZIP_RANK_STACKS_AFTER": str(RANK_STACKS_AFTER), "GRADZIP_REPORT_NOW": "1"}
                    rc, secs = run_part(argv_part, share, f, {**env, **stacks})
                text = target.read_text()
                log.write(text)
            else:
                rc, secs = run_part(argv_part, share, log, env)
            log.flush()
            state = "killed at its share" if rc is None else ("ok" if rc == 0 else f"exit status {rc}")
            status[part] = {"status": state, "seconds": round(secs, 1), "share_s": round(share, 1), "file": names[part]}
            print(f"gpu_suite: {part}: {state} after {secs:.0f} s -> {target}", flush=True)
    rows = summarize_folder(out, names, SCALES["smoke" if args.smoke else "device"])
    doc = {
        "benchmark": "benchmarks/gpu_suite.py",
        "command": command("gpu_suite", argv),
        "device": device,
        "smoke": bool(args.smoke),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "budget_s": None if math.isinf(budget) else budget,
        "elapsed_s": round(time.perf_counter() - started, 1),
        "parts": status,
        "files": names,
        "summary": rows,
    }
    (out / names["suite"]).write_text(json.dumps(doc, indent=2) + "\n")
    print()
    print(format_summary(rows, device))
    print(f"gpu_suite: {doc['elapsed_s']:.0f} s; files in {out}: {', '.join(sorted(names.values()))}")
    failed = [p for p, s in status.items() if s["status"] not in ("ok", "skipped")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
