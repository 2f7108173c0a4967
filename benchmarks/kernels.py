"""Kernel benchmark: GB/s, fraction of copy bandwidth, and speed-ups.

    python -m benchmarks.kernels                  # on a CUDA device, 1M .. 256M elements
    python -m benchmarks.kernels --sizes 1M,64M   # a subset
    python -m benchmarks.kernels --smoke          # tiny sizes; on the CPU through the Triton interpreter

1. Measures the device's copy bandwidth: a large device-to-device ``copy_``, counting
   bytes read plus bytes written.
2. Times each kernel and its torch-eager reference (``triton.testing.do_bench``,
   median; on the CPU smoke run a wall-clock median), and the DGC top-k also against
   ``torch.topk``. GB/s counts the *minimal* bytes an op must move (listed per op
   below), so the fraction of copy bandwidth is an honest ceiling check.
3. Prints a table and writes ``benchmarks/results/kernels_<device>.json`` (the smoke run
   writes ``bench_out/kernels_<device>_smoke.json`` unless ``--out`` says otherwise).

Minimal bytes per op, for n float32 elements, P peers, k selected per peer:

* threshold_ef (fused, with residual): read x and r, write r, write the bitmap: 12.25 n
* threshold_index (compressor path, no residual): read x, write 4 bytes per selected: 4 n + 4 k
* decode_add_bitmap2: read and write out, read P bitmaps: 8 n + P n / 4
* scatter_add_signed: per peer 4 k (words) + 8 k (read-modify-write of out)
* scatter_add_sparse: per peer 8 k (int32 index + float32 value) + 8 k
* sampled_topk, sampled_topk_approx (no exact trim, ``TopK(mode="approx")``): read v once: 4 n
* The quantizer encoders run by two routes (see ``gradzip/kernels/triton/blocks.py``), each
  timed on its own row (``route``): **one-pass** where a program owns whole blocks (the
  blocks below), **two-pass** for the whole tensor as one block (``block=None``; forced with
  ``route="two"``, which the smoke sizes would otherwise run in one pass). Both rows of an
  encoder count the same minimal bytes; ``moved_bytes`` is what the route actually moves
  (the two-pass route reads x, and r, twice: its ceiling is ``minimal / moved`` of copy).

  - sign_ef (scaled sign + error feedback; block 1024 one-pass): read x and r, write r,
    the sign words and the scales: 12 n + n / 8 + 4 nb (two-pass moves another 8 n)
  - sign_ef_nores (the compressor's call: no residual in or out, block 1024 one-pass):
    4 n + n / 8 + 4 nb (two-pass: another 4 n)
  - qsgd_encode (s = 7, 4-bit codes; block 64 one-pass): read x, write codes and norms:
    4 n + n / 2 + 4 nb (two-pass: another 4 n)
  - terngrad_encode (block 1024 one-pass): read x, write 2-bit codes and scales:
    4 n + n / 4 + 4 nb (two-pass: another 4 n)

  (``nb`` the number of blocks: ``ceil(n / block)``, 1 for the whole tensor.)
* decode_add_quant (P peers' QSGD 4-bit frames, or sign frames): read and write out, read
  P bodies: 8 n + P (n / 2 + 4 n / 64), or 8 n + P (n / 8 + 4 n / 1024)
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
    return p.parse_args(argv)


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

    def record(kernel, n, backend, kernel_ms, reference_ms, nbytes, **extra):
        gbps = nbytes / kernel_ms / 1e6
        row = {
            "kernel": kernel,
            "backend": backend,
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
            f"{kernel:<20} {backend:<7} n={n:>11,}  {kernel_ms:9.4f} ms  ref {reference_ms:9.4f} ms  "
            f"x{reference_ms / kernel_ms:7.2f}  {gbps:8.1f} GB/s  {100 * gbps / copy_gbps:5.1f}% of copy{more}"
        )

    tau_dense = 0.6745  # |N(0,1)| >= this for about half the elements: the bitmap case
    for n in sizes:
        g = torch.Generator(device=device).manual_seed(n)
        x = torch.randn(n, device=device, generator=g)
        r = torch.randn(n, device=device, generator=g) * 0.1
        k = max(1, math.ceil(args.density * n))
        # |N(0,1)| quantile for the density: the index-list case
        tau_sparse = float(torch.special.ndtri(torch.tensor(1 - args.density / 2, dtype=torch.float64)))

        # threshold_ef, fused with error feedback
        def ref_ef():
            res = RT.threshold_ef_reference(x, tau_dense, r)
            res.bitmap()
            (res._pos | res._neg).sum()

        ref_ms = bench(ref_ef)
        nbytes = 12 * n + (n + 3) // 4
        record("threshold_ef", n, "triton", bench(lambda: threshold_ef_triton(x, tau_dense, r)), ref_ms, nbytes)
        if have_cupy:
            record(
                "threshold_ef", n, "cupy", bench(lambda: cupy_ops.threshold_ef_cupy(x, tau_dense, r)), ref_ms, nbytes
            )

        # threshold index list, compressor path (the count is read on the host: that sync is timed)
        count = RT.threshold_ef_reference(x, tau_sparse).count
        ref_ms = bench(lambda: RT.threshold_ef_reference(x, tau_sparse).indices())
        nbytes = 4 * n + 4 * count
        record(
            "threshold_index",
            n,
            "triton",
            bench(lambda: threshold_ef_triton(x, tau_sparse).indices()),
            ref_ms,
            nbytes,
            count=count,
        )
        if have_cupy:
            record(
                "threshold_index",
                n,
                "cupy",
                bench(lambda: cupy_ops.threshold_ef_cupy(x, tau_sparse).indices()),
                ref_ms,
                nbytes,
                count=count,
            )
        r = None  # drop the reference before the next size

        # decode-and-accumulate of P peers' bitmaps, gathered in one buffer
        nb = (n + 3) // 4
        gathered = torch.randint(0, 256, (args.peers, nb + 32), dtype=torch.uint8, device=device, generator=g)
        bodies = [gathered[p, 16 : 16 + nb] for p in range(args.peers)]
        taus = [0.01 * (p + 1) for p in range(args.peers)]
        out = torch.zeros(n, device=device)
        ref_ms = bench(lambda: RT.decode_add_bitmap2_reference(out, bodies, taus))
        ker_ms = bench(lambda: decode_add_bitmap2_triton(out, bodies, taus))
        record("decode_add_bitmap2", n, "triton", ker_ms, ref_ms, 8 * n + args.peers * nb, peers=args.peers)
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
        record("scatter_add_signed", n, "triton", ker_ms, ref_ms, args.peers * 12 * k, peers=args.peers, k=k)
        ref_ms = bench(peers_loop(RT.scatter_add_sparse_reference, idx32, vals))
        ker_ms = bench(peers_loop(scatter_add_sparse_triton, idx32, vals))
        record("scatter_add_sparse", n, "triton", ker_ms, ref_ms, args.peers * 16 * k, peers=args.peers, k=k)
        peers_idx = words = vals = idx32 = out = None

        # DGC top-k vs the eager reference and torch.topk
        s = min(args.sample, n)
        probe = torch.randint(n, (s,), device=device, generator=g)
        got = RT.sampled_topk_reference(x, k, probe, select=abs_select_triton)
        ref_ms = bench(lambda: RT.sampled_topk_reference(x, k, probe))
        ker_ms = bench(lambda: RT.sampled_topk_reference(x, k, probe, select=abs_select_triton))
        topk_ms = bench(lambda: torch.topk(x.abs(), k, sorted=False))
        record(
            "sampled_topk",
            n,
            "triton",
            ker_ms,
            ref_ms,
            4 * n,
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
            4 * n,
            k=k,
            count_over_k=got.numel() / k,
            route=routes[0],
            torch_topk_ms=topk_ms,
            speedup_vs_torch_topk=topk_ms / ker_ms,
        )
        if have_cupy:
            ker_ms = bench(lambda: RT.sampled_topk_reference(x, k, probe, select=cupy_ops.abs_select_cupy))
            record(
                "sampled_topk",
                n,
                "cupy",
                ker_ms,
                ref_ms,
                4 * n,
                k=k,
                torch_topk_ms=topk_ms,
                speedup_vs_torch_topk=topk_ms / ker_ms,
            )
        probe = None

        # quantizer encoders: the one-pass route (blocks that fit a program) and the
        # two-pass route (the whole tensor as one block), timed separately
        r = torch.randn(n, device=device, generator=g) * 0.1
        sblk, qblk, tblk, seed = 1024, 64, 1024, 0x5EED
        words = 4 * triton.cdiv(n, 32)
        # (row, one-pass block, kernel, reference, minimal bytes but the scales, the 2nd pass's extra bytes)
        encoders = (
            ("sign_ef", sblk, partial(sign_ef_triton, x, r), partial(R.sign_ef_reference, x, r), 12 * n + words, 8 * n),
            (
                "sign_ef_nores",
                sblk,
                partial(sign_ef_triton, x, None, new_residual=False),
                partial(R.sign_ef_reference, x, None, new_residual=False),
                4 * n + words,
                4 * n,
            ),
            (
                "qsgd_encode",
                qblk,
                partial(qsgd_encode_triton, x, 7, seed),
                partial(R.qsgd_encode_reference, x, 7, seed),
                4 * n + triton.cdiv(n, 2),
                4 * n,
            ),
            (
                "terngrad_encode",
                tblk,
                partial(terngrad_encode_triton, x, seed),
                partial(R.terngrad_encode_reference, x, seed),
                4 * n + triton.cdiv(n, 4),
                4 * n,
            ),
        )
        for name, blk, ker, ref, fixed, second in encoders:
            for route, b in (("one-pass", blk), ("two-pass", None)):
                ref_ms = bench(partial(ref, block=b))
                ker_ms = bench(partial(ker, block=b, route="one" if b is not None else "two"))
                nbytes = fixed + 4 * (triton.cdiv(n, b) if b is not None else 1)  # + the float32 scales
                moved = nbytes + (second if b is None else 0)
                record(name, n, "triton", ker_ms, ref_ms, nbytes, route=route, block=b, moved_bytes=moved)
        r = encoders = None

        # decode-and-accumulate of P peers' quantizer frames, gathered in one buffer
        out = torch.zeros(n, device=device)
        for kind, blk, lv, bits in (("qsgd", qblk, 7, 4), ("sign1", sblk, 0, None)):
            nbq = triton.cdiv(n, blk)
            code_bytes = R.quant_code_bytes(kind, n, bits)
            width = (4 * nbq + code_bytes + 7) // 8 * 8
            gathered = torch.randint(0, 256, (args.peers, width + 16), dtype=torch.uint8, device=device, generator=g)
            scales = (torch.rand(args.peers, nbq, device=device, generator=g) + 0.5).view(torch.uint8)
            gathered[:, 16 : 16 + 4 * nbq] = scales
            if kind == "qsgd":  # keep codes <= 2s: nibbles of 0..14
                gathered[:, 16 + 4 * nbq :] &= 0xEE
            bodies = [gathered[p, 16 : 16 + 4 * nbq + code_bytes] for p in range(args.peers)]
            kw = {"block": blk, "levels": lv, "bits": bits}
            ref_ms = bench(lambda: R.decode_add_quant_reference(out, bodies, kind, **kw))
            ker_ms = bench(lambda: decode_add_quant_triton(out, bodies, kind, **kw))
            record(
                f"decode_add_{kind}",
                n,
                "triton",
                ker_ms,
                ref_ms,
                8 * n + args.peers * (code_bytes + 4 * nbq),
                peers=args.peers,
            )
            gathered = bodies = None
        x = out = None
        sync()
        if use_cuda:
            torch.cuda.empty_cache()

    # The kernels' goals, checked on what was measured (None where the size was not run).
    def best(kernel, pred):
        rows = [r for r in results if r["kernel"] == kernel and pred(r)]
        return rows

    big = best("threshold_ef", lambda r: r["n"] >= 64 << 20)
    quant_one = [r for r in results if r.get("route") == "one-pass" and r["n"] >= 64 << 20]
    topk100 = best("sampled_topk", lambda r: 90_000_000 <= r["n"] <= 110_000_000)
    approx100 = best("sampled_topk_approx", lambda r: 90_000_000 <= r["n"] <= 110_000_000)
    goals = {
        "fused_encode_ge_80pct_copy_at_64M": (min(r["fraction_of_copy"] for r in big) >= 0.8) if big else None,
        "fused_encode_ge_3x_eager": (min(r["speedup_vs_reference"] for r in big) >= 3.0) if big else None,
        "topk_100M_ge_10x_torch_topk": (max(r["speedup_vs_torch_topk"] for r in topk100) >= 10.0) if topk100 else None,
        # the approximate mode (exact mode above keeps the exact trim)
        "topk_approx_100M_ge_10x_torch_topk": (
            max(r["speedup_vs_torch_topk"] for r in approx100) >= 10.0 if approx100 else None
        ),
        # the quantizer encoders' one-pass route, every one of them (minimal bytes)
        "quant_one_pass_encode_ge_80pct_copy_at_64M": (
            min(r["fraction_of_copy"] for r in quant_one) >= 0.8 if quant_one else None
        ),
    }
    import torch as _t

    doc = {
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
        "torch": _t.__version__,
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
        "results": results,
        "goals": goals,
    }
    if args.out:
        out_path = Path(args.out)
    elif args.smoke:
        out_path = ROOT / "bench_out" / f"kernels_{_slug(dev_name)}_smoke.json"
    else:
        out_path = ROOT / "benchmarks" / "results" / f"kernels_{_slug(dev_name)}.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"goals: {goals}")
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
