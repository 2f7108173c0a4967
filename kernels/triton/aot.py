"""Compile every Triton kernel ahead of time, with no GPU: ``python -m gradzip.kernels.triton.aot``.

Builds PTX and a cubin for each entry of the modules' ``AOT_SPECS`` (default sm_90)
and prints one JSON object per line: the kernel, its signature, and either the
sizes of what was built or the error. Exit status 1 if any failed.

Run it with TRITON_INTERPRET unset: under the interpreter, ``tl.sum`` and the
other library functions are interpreted objects that the compiler cannot inline.

``--modules sign,decode`` compiles only the named modules' specs (default: every module
in ``gradzip.kernels.triton.MODULES``); a module named here need not be listed there.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time

from . import MODULES, aot_compile, aot_specs, interpreting


def module_specs(modules) -> list[dict]:
    """The ``AOT_SPECS`` of the named modules of this package, in order (as :func:`aot_specs`)."""
    if modules is None:
        return aot_specs()
    specs = []
    for m in modules:
        mod = importlib.import_module(f"{__package__}.{m}")
        specs.extend(dict(spec, module=m) for spec in mod.AOT_SPECS)
    return specs


def compile_all(arch: int = 90, modules=None) -> list[dict]:
    rows = []
    for spec in module_specs(modules):
        row = {
            "kernel": spec["kernel"].__name__,
            "module": spec["module"],
            "signature": spec["signature"],
            "constexprs": {k: v for k, v in spec["constexprs"].items()},
            "num_warps": spec["num_warps"],
            "divisible": list(spec.get("divisible", ())),
            "arch": arch,
        }
        t0 = time.perf_counter()
        try:
            c = aot_compile(
                spec["kernel"],
                spec["signature"],
                spec["constexprs"],
                arch=arch,
                num_warps=spec["num_warps"],
                divisible=spec.get("divisible", ()),
            )
            row.update(
                ok=True,
                ptx_target=f"sm_{arch}" if f".target sm_{arch}" in c.asm["ptx"] else None,
                vector_loads=c.asm["ptx"].count("ld.global.v"),
                cubin_bytes=len(c.asm["cubin"]),
                num_warps_built=c.metadata.num_warps,
                shared_bytes=c.metadata.shared,
            )
        except Exception as e:  # report every failure, not just the first
            row.update(ok=False, error=f"{type(e).__name__}: {e}")
        row["seconds"] = round(time.perf_counter() - t0, 3)
        rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--modules", default=None, help=f"comma-separated modules (default: {','.join(MODULES)})")
    args = p.parse_args(argv)
    if interpreting():
        print("TRITON_INTERPRET is set: unset it to compile", file=sys.stderr)
        return 2
    modules = None if args.modules is None else [m for m in args.modules.split(",") if m]
    rows = compile_all(args.arch, modules)
    for row in rows:
        print(json.dumps(row))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
