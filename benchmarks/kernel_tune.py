"""Launch-parameter sweep for the kernels that miss their bandwidth goals (CUDA only).

    python -m benchmarks.kernel_tune                 # prints a table, writes --out (JSON)

Times (``triton.testing.do_bench``, median, ms) and checks, on random data:

* the QSGD and TernGrad one-pass encoders over tiles and warp counts, and QSGD over block
  lengths and code widths, so that what limits them can be told apart (block reduction,
  packing, tile size); each result is checked against the two-pass route;
* the top-k compaction (``abs_select_triton``) over its block size, which sets how many
  programs take a slot range with an atomic add on the one counter;
* the DGC top-k's stages at 100M elements: threshold estimate, compaction, trim.

GB/s counts the minimal bytes, as ``benchmarks/kernels.py`` does.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from benchmarks.kernels import copy_bandwidth


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=64 << 20)
    p.add_argument("--topk-n", type=int, default=100 << 20)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernel_tune.py needs a CUDA device", file=sys.stderr)
        return 2
    import triton
    from triton.testing import do_bench

    import gradzip.kernels as K
    import gradzip.kernels.triton.stochastic as Q
    import gradzip.kernels.triton.topk as T
    from gradzip.kernels import reference as R

    def bench(fn):
        fn()
        torch.cuda.synchronize()
        return do_bench(fn, warmup=25, rep=100, return_mode="median")

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    n = args.n
    x = torch.randn(n, device=dev, generator=g)
    copy_gbps = copy_bandwidth(bench, dev, 256 << 20)[0]
    rows = []

    def record(name, ms, nbytes, **kw):
        row = dict(name=name, ms=ms, gbps=nbytes / ms / 1e6, fraction_of_copy=nbytes / ms / 1e6 / copy_gbps, **kw)
        rows.append(row)
        extra = "  ".join(f"{k}={v}" for k, v in kw.items())
        print(
            f"{name:18s} {ms:8.4f} ms  {row['gbps']:7.1f} GB/s  {100 * row['fraction_of_copy']:5.1f}%  {extra}",
            flush=True,
        )

    saved = Q.NUM_WARPS
    for warps in (4, 8):
        Q.NUM_WARPS = warps
        for tile in (1024, 2048, 4096, 8192, 16384):
            for bits, levels, block in ((4, 7, 64), (4, 7, 256), (4, 7, 1024), (8, 100, 64), (2, 1, 64)):
                if block > tile:
                    continue
                fn = lambda: Q.qsgd_encode_triton(x, levels, 5, block=block, tile=tile, route="one")  # noqa: E731
                one = fn()
                two = Q.qsgd_encode_triton(x, levels, 5, block=block, tile=tile, route="two")
                ok = torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
                nb = (n + block - 1) // block
                record(
                    "qsgd_onepass",
                    bench(fn),
                    4 * n + n * bits // 8 + 4 * nb,
                    warps=warps,
                    tile=tile,
                    block=block,
                    bits=bits,
                    ok=ok,
                )
            fn = lambda: Q.terngrad_encode_triton(x, 6, block=1024, tile=tile, route="one")  # noqa: E731
            one = fn()
            two = Q.terngrad_encode_triton(x, 6, block=1024, tile=tile, route="two")
            ok = torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
            record(
                "tern_onepass", bench(fn), 4 * n + n // 4 + 4 * (n // 1024), warps=warps, tile=tile, block=1024, ok=ok
            )
    Q.NUM_WARPS = saved
    x = None  # free the input before the top-k sizes

    # top-k: compaction block sizes, then the DGC stages
    m = args.topk_n
    v = torch.randn(m, device=dev, generator=g)
    k = m // 1000
    probe = torch.randint(m, (65536,), device=dev, generator=g)
    thr = R.sampled_topk_threshold(v, k, probe)
    expected = int(1.25 * k)
    want = None
    saved = T.NUM_WARPS
    for warps in (4, 8, 16):
        T.NUM_WARPS = warps
        for block in (2048, 4096, 8192, 16384, 32768):
            idx = T.abs_select_triton(v, thr, expected, block=block)
            want = idx if want is None else want
            record(
                "abs_select",
                bench(lambda: T.abs_select_triton(v, thr, expected, block=block)),
                4 * m + 8 * idx.numel(),
                warps=warps,
                block=block,
                count=idx.numel(),
                ok=torch.equal(idx, want),
            )
    T.NUM_WARPS = saved
    record("topk_threshold", bench(lambda: R.sampled_topk_threshold(v, k, probe)), 0)
    idx = T.abs_select_triton(v, thr, expected)
    record(
        "topk_trim",
        bench(lambda: idx[torch.topk(v[idx].abs(), k, sorted=False).indices].sort().values),
        0,
        survivors=idx.numel(),
    )
    record("sampled_topk", bench(lambda: K.sampled_topk(v, k, probe)), 4 * m)
    record("torch_topk", bench(lambda: torch.topk(v.abs(), k, sorted=False)), 4 * m)

    doc = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy_gbps": copy_gbps,
        "n": n,
        "topk_n": m,
        "rows": rows,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    return 0 if all(r.get("ok", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
