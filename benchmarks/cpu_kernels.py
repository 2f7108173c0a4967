"""The CPU kernels (Numba) against the pure-torch references, op by op, in ns per element.

    python -m benchmarks.cpu_kernels                     # 16M float32 elements, one thread

Each op runs on the same random input through ``gradzip.kernels`` with ``GRADZIP_KERNELS=numba``
and ``=reference``; after one untimed call (Numba compiles, or loads its cache), the median of
``--repeats`` timed calls. The ops are the ones the quantizer and Threshold codecs call on the
CPU: SignSGD's and Threshold's error-feedback encoders, QSGD and TernGrad's encoders (with
their Philox draws), Int8's encoder, and the decode-add of one QSGD, TernGrad and Int8 frame.
Writes ``--out`` (default ``benchmarks/results/cpu_kernels.json``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from benchmarks._common import RESULTS, command, write_result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=1 << 24)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=str(RESULTS / "cpu_kernels.json"))
    a = p.parse_args(argv)

    import torch

    import gradzip.kernels as K
    from gradzip.kernels import quant as Q
    from gradzip.machine import machine

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(a.n, generator=g), torch.randn(a.n, generator=g) * 0.1

    def body(scales, codes):
        return torch.cat([scales.view(torch.uint8), codes.view(torch.uint8)])

    qsgd, tern = body(*Q.qsgd_encode_reference(x, 7, 5)), body(*Q.terngrad_encode_reference(x, 5))
    int8 = body(*Q.int8_encode_reference(x, block=1024))
    out = torch.zeros(a.n)
    ops = {
        "sign_ef (residual in place)": lambda: K.sign_ef(x, r, out=r),
        "threshold_ef (residual in place, 2-bit map)": lambda: K.threshold_ef(x, 1.5, r, out=r).bitmap(),
        "qsgd_encode (levels 7, block 64)": lambda: K.qsgd_encode(x, 7, 5),
        "terngrad_encode (one block)": lambda: K.terngrad_encode(x, 5),
        "int8_encode (block 1024)": lambda: K.int8_encode(x, block=1024),
        "abs_select (|x| >= 2.6, 1% of x)": lambda: K.abs_select(x, 2.5758, expected=x.numel() // 100),
        "decode_add_quant qsgd": lambda: K.decode_add_quant(out, [qsgd], "qsgd", block=64, levels=7, bits=4),
        "decode_add_quant tern2": lambda: K.decode_add_quant(out, [tern], "tern2"),
        "decode_add_quant int8": lambda: K.decode_add_quant(out, [int8], "int8", block=1024),
    }
    rows = []
    for name, fn in ops.items():
        row = {"op": name}
        for backend in ("reference", "numba"):
            os.environ[K.ENV_VAR] = backend
            fn()
            times = []
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            row[f"{backend}_ns_per_element"] = statistics.median(times) / a.n * 1e9
        os.environ.pop(K.ENV_VAR, None)
        row["speedup"] = row["reference_ns_per_element"] / row["numba_ns_per_element"]
        rows.append(row)
        ref, nb = row["reference_ns_per_element"], row["numba_ns_per_element"]
        print(f"{name:46s} reference {ref:7.2f} ns  numba {nb:6.2f} ns  {row['speedup']:5.1f}x")
    doc = {
        "benchmark": "benchmarks/cpu_kernels.py",
        "command": command("cpu_kernels"),
        "machine": machine(),
        "elements": a.n,
        "threads": 1,
        "repeats": a.repeats,
        "rows": rows,
    }
    write_result(a.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
