"""Kernel benchmark: GB/s, fraction of copy bandwidth, and speed-ups.

    python -m benchmarks.kernels                  # on a CUDA device, 1M .. 256M elements, float32
    python -m benchmarks.kernels --sizes 16M,64M,256M --dtypes fp32,bf16 --topk-sizes 100M --budget 120
    python -m benchmarks.kernels --smoke          # tiny sizes; on the CPU through the Triton interpreter

1. Measures the device's copy bandwidth: a large device-to-device ``copy_``, counting
   bytes read plus bytes written.
2. Times each kernel and its torch-eager reference (``triton.testing.do_bench``,
   median; on the CPU smoke run a wall-clock median), and the top-k selections also against
   ``torch.topk``. GB/s counts the *minimal* bytes an op must move (listed per op
   below), so the fraction of copy bandwidth is an honest ceiling check.
3. Prints a table and writes ``benchmarks/results/kernels_<device>.json`` (the smoke run
   writes ``bench_out/kernels_<device>_smoke.json`` unless ``--out`` says otherwise),
   rewritten after every block (a dtype, a size, a family of ops), so a run stopped early
   leaves what it measured. ``--budget SECONDS`` starts no block after that many seconds and
   lists the blocks it skipped (``skipped``); the goals' blocks run first (float32 at 64M
   elements, then the ``--topk-sizes``), then the other sizes, then the other dtypes.

``--dtypes`` (default fp32) gives the gradients' dtypes: the encoders and the top-k selections
read ``x`` in each (``B`` bytes per element, 4 for float32, 2 for bfloat16), with float32
residuals; the decoders write float32 whatever the gradient's dtype and run once, in the
float32 pass. Every row names its ``dtype``.

Minimal bytes per op, for n elements of B bytes, P peers, k selected per peer:

* threshold_ef (fused, with residual): read x and r, write r, write the bitmap: (B + 8) n + n / 4
* threshold_index (compressor path, no residual): read x, write 4 bytes per selected: B n + 4 k
* decode_add_bitmap2: read and write out, read P bitmaps: 8 n + P n / 4
* scatter_add_signed: per peer 4 k (words) + 8 k (read-modify-write of out)
* scatter_add_sparse: per peer 8 k (int32 index + float32 value) + 8 k
* topk_exact (``TopK``'s default: ``torch.topk`` of ``|x|``, its indices sorted; backend
  ``torch``, its reference column ``torch.topk`` alone), sampled_topk (DGC: a sampled threshold,
  one compaction pass, the exact trim), sampled_topk_approx (no exact trim,
  ``TopK(mode="approx")``; ``count_over_k`` is what it sent over k): read x once: B n
* The quantizer encoders run by two routes (see ``gradzip/kernels/triton/blocks.py``), each
  timed on its own row (``route``): **one-pass** where a program owns whole blocks (the
  blocks below), **two-pass** for the whole tensor as one block (``block=None``; forced with
  ``route="two"``, which the smoke sizes would otherwise run in one pass). Both rows of an
  encoder count the same minimal bytes; ``moved_bytes`` is what the route actually moves
  (the two-pass route reads x, and r, twice: its ceiling is ``minimal / moved`` of copy).

  - sign_ef (scaled sign + error feedback; block 1024 one-pass): read x and r, write r,
    the sign words and the scales: (B + 8) n + n / 8 + 4 nb (two-pass moves another (B + 4) n)
  - sign_ef_nores (the compressor's call: no residual in or out, block 1024 one-pass):
    B n + n / 8 + 4 nb (two-pass: another B n)
  - qsgd_encode (s = 7, 4-bit codes; block 64 one-pass): read x, write codes and norms:
    B n + n / 2 + 4 nb (two-pass: another B n)
  - terngrad_encode (block 1024 one-pass): read x, write 2-bit codes and scales:
    B n + n / 4 + 4 nb (two-pass: another B n)
  - int8_encode (block 1024 one-pass): read x, write the codes and scales: B n + n + 4 nb
    (two-pass: another B n)

  (``nb`` the number of blocks: ``ceil(n / block)``, 1 for the whole tensor.)
* decode_add_quant (P peers' frames: QSGD 4-bit, sign, TernGrad 2-bit, Int8): read and write
  out, read P bodies: 8 n + P (code bytes + 4 nb); code bytes n / 2, n / 8, n / 4, n
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SIZES = "1M,4M,16M,64M,100M,256M"
SMOKE_SIZES = "4099,20011"


def _parse_size(s: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)\s*", s)
    if not m:
        raise argparse.ArgumentTypeError(f"bad size {s!r}: use e.g. 1000, 64K, 16M")
    mult = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2).lower()]
    return int(m.group(1)) * mult


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, few repetitions; runs on the CPU (interpreter)")
    p.add_argument("--sizes", default=None, help=f"comma-separated element counts (default {DEFAULT_SIZES})")
    p.add_argument("--density", type=float, default=0.001, help="fraction selected for index lists and top-k")
    p.add_argument("--peers", type=int, default=4, help="peers decoded into one buffer")
    p.add_argument("--sample", type=int, default=65536, help="DGC sample size")
    p.add_argument("--out", default=None, help="where to write the JSON")
    p.add_argument(
        "--dtypes",
        default="fp32",
        help="comma-separated gradient dtypes of the encoders and top-k: fp32, bf16, fp16 (default fp32; "
        "the decoders write float32 and run once)",
    )
    p.add_argument(
        "--topk-sizes", default="", help="more sizes for the top-k rows only (e.g. 100M, the top-k goal's size)"
    )
    p.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds: start no block (a dtype, a size, a family) after this; what was measured is written",
    )
    return p.parse_args(argv)


DTYPES = {"fp32": None, "bf16": None, "fp16": None}  # filled with torch dtypes in main()


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def copy_bandwidth(bench, device, elems: int) -> tuple:
    """``(GB/s, bytes, ms)`` of a device-to-device copy of ``elems`` float32 values, counting
    bytes read plus bytes written; ``bench(fn)`` returns fn's time in ms."""
    import torch

    src = torch.empty(elems, dtype=torch.float32, device=device).uniform_(
        generator=torch.Generator(device=device).manual_seed(0)
    )
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    nbytes = 2 * src.numel() * 4
    return nbytes / ms / 1e6, nbytes, ms


def main(argv=None) -> int:
    args = _args(argv)
    import torch

    interpreting = os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")
    use_cuda = torch.cuda.is_available() and not interpreting
    if args.smoke and not use_cuda:
        # Must precede the first import of the Triton kernels.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if not use_cuda and not args.smoke:
        print("no CUDA device: run with --smoke for the CPU interpreter check", file=sys.stderr)
        return 2
    import triton

    from gradzip.kernels import quant as R
    from gradzip.kernels import reference as RT
    from gradzip.kernels.triton.decode import (
        decode_add_bitmap2_triton,
        decode_add_quant_triton,
        scatter_add_signed_triton,
        scatter_add_sparse_triton,
    )
    from gradzip.kernels.triton.int8 import int8_encode_triton
    from gradzip.kernels.triton.sign import sign_ef_triton
    from gradzip.kernels.triton.stochastic import qsgd_encode_triton, terngrad_encode_triton
    from gradzip.kernels.triton.threshold import threshold_ef_triton
    from gradzip.kernels.triton.topk import abs_select_triton

    try:
        import cupy  # noqa: F401

        from gradzip.kernels import cupy_ops

        have_cupy = use_cuda
    except Exception as e:  # not installed, or no driver
        cupy_ops, have_cupy = None, False
        cupy_reason = f"{type(e).__name__}: {e}"
    else:
        cupy_reason = None if use_cuda else "no CUDA device"

    device = torch.device("cuda" if use_cuda else "cpu")
    dev_name = torch.cuda.get_device_name(device) if use_cuda else f"cpu-{platform.machine()}-interpreter"
    sizes = [_parse_size(s) for s in (args.sizes or (SMOKE_SIZES if args.smoke else DEFAULT_SIZES)).split(",")]
    topk_sizes = [_parse_size(s) for s in args.topk_sizes.split(",") if s.strip()]
    DTYPES.update(fp32=torch.float32, bf16=torch.bfloat16, fp16=torch.float16)
    names = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
    dtypes = [names[d.strip()] for d in args.dtypes.split(",") if d.strip() in names]
    if not dtypes or len(dtypes) != len([d for d in args.dtypes.split(",") if d.strip()]):
        print(f"--dtypes: expected fp32, bf16 or fp16, got {args.dtypes!r}", file=sys.stderr)
        return 2
    DTYPES.update({v: DTYPES[k] for k, v in names.items()})
    if args.out:
        out_path = Path(args.out)
    elif args.smoke:
        out_path = ROOT / "bench_out" / f"kernels_{_slug(dev_name)}_smoke.json"
    else:
        out_path = ROOT / "benchmarks" / "results" / f"kernels_{_slug(dev_name)}.json"

    def sync():
        if use_cuda:
            torch.cuda.synchronize()

    def bench(fn) -> float:
        """Median milliseconds of fn()."""
        if use_cuda:
            return float(
                triton.testing.do_bench(
                    fn, warmup=25 if not args.smoke else 1, rep=100 if not args.smoke else 5, return_mode="median"
                )
            )
        fn()
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    # 1. copy bandwidth
    copy_elems = max(sizes) if use_cuda else 4 << 20
    copy_elems = max(copy_elems, 1 << 20)
    copy_gbps, copy_bytes, copy_ms = copy_bandwidth(bench, device, copy_elems)
    print(
        f"device: {dev_name}   copy bandwidth: {copy_gbps:.1f} GB/s "
        f"({copy_bytes / 1e9:.2f} GB moved in {copy_ms:.3f} ms)"
    )

    results = []

    def record(kernel, n, backend, kernel_ms, reference_ms, nbytes, dtype="float32", **extra):
        gbps = nbytes / kernel_ms / 1e6
        row = {
            "kernel": kernel,
            "backend": backend,
            "dtype": dtype,
            "n": n,
            "kernel_ms": kernel_ms,
            "reference_ms": reference_ms,
            "speedup_vs_reference": reference_ms / kernel_ms,
            "minimal_bytes": nbytes,
            "gbps": gbps,
            "fraction_of_copy": gbps / copy_gbps,
            **extra,
        }
        results.append(row)
        more = "".join(f"  {k}={v:.3g}" if isinstance(v, float) else f"  {k}={v}" for k, v in extra.items())
        print(
            f"{kernel:<20} {backend:<7} {dtype:<8} n={n:>11,}  {kernel_ms:9.4f} ms  ref {reference_ms:9.4f} ms  "
            f"x{reference_ms / kernel_ms:7.2f}  {gbps:8.1f} GB/s  {100 * gbps / copy_gbps:5.1f}% of copy{more}"
        )

    def document() -> dict:
        return {
            "benchmark": "benchmarks/kernels.py",
            "argv": list(argv) if argv is not None else sys.argv[1:],
            "smoke": bool(args.smoke),
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "machine": {
                "node": platform.node(),
                "platform": platform.platform(),
                "cpu": platform.processor(),
                "python": platform.python_version(),
            },
            "device": dev_name,
            "torch": torch.__version__,
            "triton": triton.__version__,
            "cupy": None if cupy_ops is None else __import__("cupy").__version__,
            "cupy_skipped": cupy_reason if not have_cupy else None,
            "interpreter": not use_cuda,
            "timer": "triton.testing.do_bench, median" if use_cuda else "time.perf_counter, median of 3 (CPU smoke)",
            "copy_bandwidth_gbps": copy_gbps,
            "copy_bytes": copy_bytes,
            "density": args.density,
            "peers": args.peers,
            "sample": args.sample,
            "dtypes": dtypes,
            "budget_s": args.budget,
            "elapsed_s": time.perf_counter() - t_start,
            "skipped": skipped,
            "results": results,
            "goals": goals(results),
        }

    tau_dense = 0.6745  # |N(0,1)| >= this for about half the elements: the bitmap case
    # |N(0,1)| quantile for the density: the index-list case
    tau_sparse = float(torch.special.ndtri(torch.tensor(1 - args.density / 2, dtype=torch.float64)))
    t_start = time.perf_counter()
    skipped: list[str] = []

    def over_budget(what: str) -> bool:
        """True (and ``what`` recorded as skipped) once ``--budget`` seconds have passed."""
        if args.budget is not None and time.perf_counter() - t_start > args.budget:
            skipped.append(what)
            return True
        return False

    def sparse_rows(n, x, g, dt):
        """Threshold with error feedback, the index list, and (float32 only) the decoders."""
        B = x.element_size()
        r = torch.randn(n, device=device, generator=g) * 0.1  # residuals stay float32
        k = max(1, math.ceil(args.density * n))

        def ref_ef():
            res = RT.threshold_ef_reference(x, tau_dense, r)
            res.bitmap()
            (res._pos | res._neg).sum()

        ref_ms = bench(ref_ef)
        nbytes = (B + 8) * n + (n + 3) // 4
        record("threshold_ef", n, "triton", bench(lambda: threshold_ef_triton(x, tau_dense, r)), ref_ms, nbytes, dt)
        if have_cupy and dt == "float32":
            record(
                "threshold_ef",
                n,
                "cupy",
                bench(lambda: cupy_ops.threshold_ef_cupy(x, tau_dense, r)),
                ref_ms,
                nbytes,
                dt,
            )
        # threshold index list, compressor path (the count is read on the host: that sync is timed)
        count = RT.threshold_ef_reference(x, tau_sparse).count
        ref_ms = bench(lambda: RT.threshold_ef_reference(x, tau_sparse).indices())
        nbytes = B * n + 4 * count
        ker_ms = bench(lambda: threshold_ef_triton(x, tau_sparse).indices())
        record("threshold_index", n, "triton", ker_ms, ref_ms, nbytes, dt, count=count)
        if have_cupy and dt == "float32":
            ker_ms = bench(lambda: cupy_ops.threshold_ef_cupy(x, tau_sparse).indices())
            record("threshold_index", n, "cupy", ker_ms, ref_ms, nbytes, dt, count=count)
        r = None  # drop the reference before the decoders
        if dt != "float32":
            return  # the decoders write float32 whatever the gradient's dtype: timed once

        # decode-and-accumulate of P peers' bitmaps, gathered in one buffer
        nb = (n + 3) // 4
        gathered = torch.randint(0, 256, (args.peers, nb + 32), dtype=torch.uint8, device=device, generator=g)
        bodies = [gathered[p, 16 : 16 + nb] for p in range(args.peers)]
        taus = [0.01 * (p + 1) for p in range(args.peers)]
        out = torch.zeros(n, device=device)
        ref_ms = bench(lambda: RT.decode_add_bitmap2_reference(out, bodies, taus))
        ker_ms = bench(lambda: decode_add_bitmap2_triton(out, bodies, taus))
        record("decode_add_bitmap2", n, "triton", ker_ms, ref_ms, 8 * n + args.peers * nb, dt, peers=args.peers)
        gathered = bodies = None

        # scatter-add of P peers' index lists and top-k frames
        peers_idx = [torch.randperm(n, device=device, generator=g)[:k].sort().values for _ in range(args.peers)]
        words = [RT.encode_signed_indices(i, torch.rand(k, device=device, generator=g) < 0.5) for i in peers_idx]
        vals = [torch.randn(k, device=device, generator=g) for _ in range(args.peers)]
        idx32 = [i.to(torch.int32) for i in peers_idx]

        def peers_loop(fn, *lists):
            return lambda: [fn(out, *items) for items in zip(*lists)]

        ref_ms = bench(lambda: [RT.scatter_add_signed_reference(out, w, 0.5) for w in words])
        ker_ms = bench(lambda: [scatter_add_signed_triton(out, w, 0.5) for w in words])
        record("scatter_add_signed", n, "triton", ker_ms, ref_ms, args.peers * 12 * k, dt, peers=args.peers, k=k)
        ref_ms = bench(peers_loop(RT.scatter_add_sparse_reference, idx32, vals))
        ker_ms = bench(peers_loop(scatter_add_sparse_triton, idx32, vals))
        record("scatter_add_sparse", n, "triton", ker_ms, ref_ms, args.peers * 16 * k, dt, peers=args.peers, k=k)

    def topk_rows(n, x, g, dt):
        """TopK's three selections against torch.topk: exact (the codec's default: torch.topk of
        |x|, indices sorted), the sampled kernel (DGC) and the approximate mode."""
        B = x.element_size()
        k = max(1, math.ceil(args.density * n))
        s = min(args.sample, n)
        probe = torch.randint(n, (s,), device=device, generator=g)
        topk_ms = bench(lambda: torch.topk(x.abs(), k, sorted=False))
        exact_ms = bench(lambda: torch.topk(x.abs(), k, sorted=False).indices.sort().values)
        record(
            "topk_exact",
            n,
            "torch",
            exact_ms,
            topk_ms,
            B * n,
            dt,
            k=k,
            count_over_k=1.0,
            torch_topk_ms=topk_ms,
            speedup_vs_torch_topk=topk_ms / exact_ms,
        )
        got = RT.sampled_topk_reference(x, k, probe, select=abs_select_triton)
        ref_ms = bench(lambda: RT.sampled_topk_reference(x, k, probe))
        ker_ms = bench(lambda: RT.sampled_topk_reference(x, k, probe, select=abs_select_triton))
        record(
            "sampled_topk",
            n,
            "triton",
            ker_ms,
            ref_ms,
            B * n,
            dt,
            k=k,
            count_over_k=got.numel() / k,
            torch_topk_ms=topk_ms,
            speedup_vs_torch_topk=topk_ms / ker_ms,
        )
        # the approximate mode (TopK(mode="approx")): no exact trim, count within 10% of k
        routes = []
        got = RT.sampled_topk_approx_reference(x, k, probe, select=abs_select_triton, route=routes)
        ref_ms = bench(lambda: RT.sampled_topk_approx_reference(x, k, probe))
        ker_ms = bench(lambda: RT.sampled_topk_approx_reference(x, k, probe, select=abs_select_triton))
        record(
            "sampled_topk_approx",
            n,
            "triton",
            ker_ms,
            ref_ms,
            B * n,
            dt,
            k=k,
            count_over_k=got.numel() / k,
            route=routes[0],
            torch_topk_ms=topk_ms,
            speedup_vs_torch_topk=topk_ms / ker_ms,
        )
        if have_cupy and dt == "float32":
            ker_ms = bench(lambda: RT.sampled_topk_reference(x, k, probe, select=cupy_ops.abs_select_cupy))
            record(
                "sampled_topk",
                n,
                "cupy",
                ker_ms,
                ref_ms,
                B * n,
                dt,
                k=k,
                torch_topk_ms=topk_ms,
                speedup_vs_torch_topk=topk_ms / ker_ms,
            )

    def quant_rows(n, x, g, dt):
        """The quantizer encoders (Int8's too) by both routes, and (float32 only) the decoders."""
        B = x.element_size()
        # the one-pass route (blocks that fit a program) and the two-pass route (the whole
        # tensor as one block), timed separately
        r = torch.randn(n, device=device, generator=g) * 0.1
        sblk, qblk, tblk, iblk, seed = 1024, 64, 1024, 1024, 0x5EED
        words = 4 * triton.cdiv(n, 32)
        # (row, one-pass block, kernel, reference, minimal bytes but the scales, the 2nd pass's extra bytes)
        encoders = (
            (
                "sign_ef",
                sblk,
                partial(sign_ef_triton, x, r),
                partial(R.sign_ef_reference, x, r),
                (B + 8) * n + words,
                (B + 4) * n,
            ),
            (
                "sign_ef_nores",
                sblk,
                partial(sign_ef_triton, x, None, new_residual=False),
                partial(R.sign_ef_reference, x, None, new_residual=False),
                B * n + words,
                B * n,
            ),
            (
                "qsgd_encode",
                qblk,
                partial(qsgd_encode_triton, x, 7, seed),
                partial(R.qsgd_encode_reference, x, 7, seed),
                B * n + triton.cdiv(n, 2),
                B * n,
            ),
            (
                "terngrad_encode",
                tblk,
                partial(terngrad_encode_triton, x, seed),
                partial(R.terngrad_encode_reference, x, seed),
                B * n + triton.cdiv(n, 4),
                B * n,
            ),
            (
                "int8_encode",
                iblk,
                partial(int8_encode_triton, x),
                partial(R.int8_encode_reference, x),
                B * n + n,
                B * n,
            ),
        )
        for name, blk, ker, ref, fixed, second in encoders:
            for route, b in (("one-pass", blk), ("two-pass", None)):
                ref_ms = bench(partial(ref, block=b))
                ker_ms = bench(partial(ker, block=b, route="one" if b is not None else "two"))
                nbytes = fixed + 4 * (triton.cdiv(n, b) if b is not None else 1)  # + the float32 scales
                moved = nbytes + (second if b is None else 0)
                record(name, n, "triton", ker_ms, ref_ms, nbytes, dt, route=route, block=b, moved_bytes=moved)
        r = encoders = None
        if dt != "float32":
            return

        # decode-and-accumulate of P peers' quantizer frames, gathered in one buffer
        out = torch.zeros(n, device=device)
        for kind, blk, lv, bits in (
            ("qsgd", qblk, 7, 4),
            ("sign1", sblk, 0, None),
            ("tern2", tblk, 0, None),
            ("int8", iblk, 0, None),
        ):
            nbq = triton.cdiv(n, blk)
            code_bytes = R.quant_code_bytes(kind, n, bits)
            width = (4 * nbq + code_bytes + 7) // 8 * 8
            gathered = torch.randint(0, 256, (args.peers, width + 16), dtype=torch.uint8, device=device, generator=g)
            scales = (torch.rand(args.peers, nbq, device=device, generator=g) + 0.5).view(torch.uint8)
            gathered[:, 16 : 16 + 4 * nbq] = scales
            codes = gathered[:, 16 + 4 * nbq :]
            if kind == "qsgd":  # keep codes <= 2s: nibbles of 0..14
                codes &= 0xEE
            elif kind == "tern2":  # no code 3: 2-bit fields of 0..2
                codes &= 0xAA
            elif kind == "int8":  # no -128
                codes[codes == 128] = 129
            bodies = [gathered[p, 16 : 16 + 4 * nbq + code_bytes] for p in range(args.peers)]
            kw = {"block": blk, "levels": lv, "bits": bits}
            ref_ms = bench(lambda: R.decode_add_quant_reference(out, bodies, kind, **kw))
            ker_ms = bench(lambda: decode_add_quant_triton(out, bodies, kind, **kw))
            nbytes = 8 * n + args.peers * (code_bytes + 4 * nbq)
            record(f"decode_add_{kind}", n, "triton", ker_ms, ref_ms, nbytes, dt, peers=args.peers)
            gathered = bodies = None

    def write():
        """The JSON of what was measured so far (rewritten after every block)."""
        doc = document()
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(doc, indent=2) + "\n")
        return doc

    # The goals' blocks first (float32 at 64M, then top-k at its sizes), so a budget cuts the rest.
    plan = []
    for dt in dtypes:
        goal = [n for n in sizes if n == 64 << 20]
        plan += [(dt, n, fam) for n in goal for fam in ("sparse", "topk", "quant")]
        plan += [(dt, n, "topk") for n in topk_sizes if n not in sizes]
        plan += [(dt, n, fam) for n in sizes if n not in goal for fam in ("sparse", "topk", "quant")]
    family = {"sparse": sparse_rows, "topk": topk_rows, "quant": quant_rows}
    for i, (dt, n, fam) in enumerate(plan):
        if over_budget(f"{fam} {dt} n={n}"):
            skipped += [f"{f} {d} n={m}" for d, m, f in plan[i + 1 :]]
            print(f"budget of {args.budget:g} s spent: skipped {len(skipped)} blocks", file=sys.stderr)
            break
        g = torch.Generator(device=device).manual_seed(n)
        x = torch.randn(n, device=device, generator=g).to(DTYPES[dt])
        family[fam](n, x, g, dt)
        x = None
        sync()
        if use_cuda:
            torch.cuda.empty_cache()
        write()

    doc = write()
    print(f"goals: {doc['goals']}")
    if skipped:
        print(f"skipped (budget): {', '.join(skipped)}")
    print(f"wrote {out_path}")
    return 0


def goals(results: list[dict]) -> dict:
    """The kernels' goals, checked on what was measured (None where the size was not run):
    float32 rows at 64M elements and more (the encoders' one-pass route), top-k at about 100M."""

    def rows(pred):
        return [r for r in results if r.get("dtype", "float32") == "float32" and pred(r)]

    big = rows(lambda r: r["kernel"] == "threshold_ef" and r["n"] >= 64 << 20)
    quant_one = rows(lambda r: r.get("route") == "one-pass" and r["n"] >= 64 << 20)
    near100 = (90_000_000, 110_000_000)
    topk100 = rows(lambda r: r["kernel"] == "sampled_topk" and near100[0] <= r["n"] <= near100[1])
    approx100 = rows(lambda r: r["kernel"] == "sampled_topk_approx" and near100[0] <= r["n"] <= near100[1])
    return {
        "fused_encode_ge_80pct_copy_at_64M": (min(r["fraction_of_copy"] for r in big) >= 0.8) if big else None,
        "fused_encode_ge_3x_eager": (min(r["speedup_vs_reference"] for r in big) >= 3.0) if big else None,
        "topk_100M_ge_10x_torch_topk": (max(r["speedup_vs_torch_topk"] for r in topk100) >= 10.0) if topk100 else None,
        # the approximate mode (exact mode above keeps the exact trim)
        "topk_approx_100M_ge_10x_torch_topk": (
            max(r["speedup_vs_torch_topk"] for r in approx100) >= 10.0 if approx100 else None
        ),
        "topk_approx_100M_count_within_10pct": (
            all(0.9 <= r["count_over_k"] <= 1.1 for r in approx100) if approx100 else None
        ),
        # the quantizer encoders' one-pass route, every one of them (minimal bytes)
        "quant_one_pass_encode_ge_80pct_copy_at_64M": (
            min(r["fraction_of_copy"] for r in quant_one) >= 0.8 if quant_one else None
        ),
    }


if __name__ == "__main__":
    sys.exit(main())
