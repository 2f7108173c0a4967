"""Triton kernels. Imported on first use by :mod:`gradzip.kernels`.

Modules: :mod:`.threshold` (threshold + error feedback), :mod:`.decode` (decode and
accumulate of every frame format), :mod:`.topk` (the top-k compaction), and the
quantizer encoders :mod:`.sign` (scaled sign + error feedback), :mod:`.stochastic`
(QSGD and TernGrad) and :mod:`.int8` (block-wise absmax int8), which share :mod:`.blocks`
(block statistics, tiles, routes); :mod:`.orth` (PowerSGD's Gram-Schmidt, a matrix a program);
:mod:`.bits` (``pack_uint``/``unpack_uint``, bit packing at any width: top-k's positions).

Each module holds private ``_..._kernel`` functions, public launchers
``..._triton`` that the dispatch calls, and ``AOT_SPECS``: the signatures every
kernel it declares is compiled for ahead of time (``tests/kernels/test_triton.py``
builds each one for sm_90 with no GPU present).

Conventions: a ``tl.constexpr`` block size, a mask on every load and store, int64
element offsets (``program_id(0).to(tl.int64)`` first), no ``assert`` for
validation (launchers raise :class:`gradzip.kernels.Unsupported` before launching),
and no fp fusion where a kernel must match the reference bit for bit.
"""

from __future__ import annotations

import importlib
import os

import torch
import triton
import triton.language as tl

from ..dispatch import Unsupported

__all__ = [
    "interpreting",
    "check",
    "size",
    "spec",
    "row_tile",
    "load_compensated",
    "aot_compile",
    "aot_specs",
    "MODULES",
]

MODULES = ("threshold", "decode", "topk", "blocks", "sign", "stochastic", "int8", "orth", "bits")
LAUNCH = {"enable_fp_fusion": False}


def interpreting() -> bool:
    """True when kernels run in the Triton interpreter (TRITON_INTERPRET=1 at import)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def size(name: str, value: int | None, gpu: int, interpreter: int, minimum: int = 1) -> int:
    """A power-of-two launch size: ``value`` when given (tests use small ones), else ``gpu``,
    or ``interpreter`` under the interpreter (larger programs: fewer interpreted launches)."""
    if value is None:
        return interpreter if interpreting() else gpu
    if value < minimum or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= {minimum}, got {value}")
    return value


def spec(kernel, signature: dict, constexprs: dict, *, num_warps: int, divisible=("n",)) -> dict:
    """One entry of a module's ``AOT_SPECS``: see :func:`aot_compile`."""
    return {
        "kernel": kernel,
        "signature": signature,
        "constexprs": constexprs,
        "num_warps": num_warps,
        "divisible": divisible,
    }


@triton.jit
def row_tile(n, ROWS: tl.constexpr, COLS: tl.constexpr):
    """This program's ``[ROWS, COLS]`` tile of consecutive elements (row ``i`` starts at element
    ``(pid * ROWS + i) * COLS``): ``(pid, rows, cols, offs, mask)``, the offsets int64."""
    pid = tl.program_id(0).to(tl.int64)
    rows = pid * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, COLS)
    offs = rows[:, None] * COLS + cols[None, :]
    return pid, rows, cols, offs, offs < n


@triton.jit
def load_compensated(x_ptr, r_ptr, offs, mask, HAS_R: tl.constexpr):
    """``v = x + r`` at ``offs`` in float32 (``x`` widened as it is loaded, the float32 residual
    ``r`` read only with ``HAS_R``), 0 where masked."""
    v = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_R:
        v = v + tl.load(r_ptr + offs, mask=mask, other=0.0)
    return v


#: Launch tables of the segmented kernels' layouts so far (a TwoPhase call's layout recurs every step).
_SEGMENT_TABLES: dict = {}
_SEGMENT_TABLES_MAX = 256


def segment_tables(key: tuple, device: torch.device, build) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The launch tables of a segmented kernel for the layout ``key``, built once and kept:
    ``build()`` gives ``(rows, spans, step)``, a row of 5 int64 per segment and how far its
    programs reach (programs start at ``0, step, 2 step, ...`` below its span). Returns each
    program's segment (int32) and first index (int64), and the rows (int64, ``(segments, 5)``),
    on ``device``."""
    key = (*key, str(device))
    got = _SEGMENT_TABLES.get(key)
    if got is None:
        rows, spans, step = build()
        prog_seg, prog_first = [], []
        for j, span in enumerate(spans):
            for first in range(0, span, step):
                prog_seg.append(j)
                prog_first.append(first)
        got = (
            torch.tensor(prog_seg, dtype=torch.int32).to(device),
            torch.tensor(prog_first, dtype=torch.int64).to(device),
            torch.tensor(rows, dtype=torch.int64).reshape(-1, 5).to(device),
        )
        if len(_SEGMENT_TABLES) >= _SEGMENT_TABLES_MAX:
            _SEGMENT_TABLES.clear()
        _SEGMENT_TABLES[key] = got
    return got


def check(name: str, t: torch.Tensor, dtypes, device: torch.device | None = None) -> None:
    """Raise Unsupported unless ``t`` is a contiguous tensor of one of ``dtypes`` that Triton can reach."""
    if t.dtype not in dtypes:
        raise Unsupported(f"{name} has dtype {t.dtype}; the Triton kernel takes {[str(d) for d in dtypes]}")
    if not t.is_contiguous():
        raise Unsupported(f"{name} is not contiguous")
    if t.device.type == "cuda":
        if interpreting():
            raise Unsupported("TRITON_INTERPRET=1: kernels were built for the interpreter, not the GPU")
    elif t.device.type != "cpu" or not interpreting():
        raise Unsupported(f"{name} is on {t.device}; Triton needs CUDA tensors (or TRITON_INTERPRET=1 for CPU ones)")
    if device is not None and t.device != device:
        raise Unsupported(f"{name} is on {t.device}, expected {device}")


def aot_compile(kernel, signature: dict, constexprs: dict, *, arch: int = 90, num_warps: int = 4, divisible=()):
    """Compile ``kernel`` for ``sm_<arch>`` without a GPU; returns triton's CompiledKernel.

    Pointer arguments are marked 16-byte aligned, as the launcher marks torch's
    allocations. Run it with TRITON_INTERPRET unset (see :mod:`.aot`): under the
    interpreter, library functions such as ``tl.sum`` cannot be compiled.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    fn = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)
    sig = dict(signature)
    for k in constexprs:
        sig[k] = "constexpr"
    # As the launcher specializes at run time: pointers from torch's allocator are 16-byte aligned.
    # Integer arguments named in ``divisible`` are multiples of 16, as the launcher marks them.
    attrs = {
        (fn.arg_names.index(k),): [["tt.divisibility", 16]]
        for k, t in signature.items()
        if t.startswith("*") or k in divisible
    }
    src = ASTSource(fn=fn, signature=sig, constexprs=dict(constexprs), attrs=attrs)
    options = dict(LAUNCH, num_warps=num_warps)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def aot_specs() -> list[dict]:
    """Every (kernel, signature, constexprs) that the modules declare in ``AOT_SPECS``."""
    specs = []
    for m in MODULES:
        mod = importlib.import_module(f"{__name__}.{m}")
        for spec in mod.AOT_SPECS:
            specs.append(dict(spec, module=m))
    return specs
