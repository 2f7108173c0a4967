"""CuPy kernels: what CUDA C says better than Triton.

* :func:`threshold_ef_cupy`: fused threshold + error feedback whose bitmap is packed
  with warp ballots (``cuda/threshold_ballot.cu``); its :meth:`indices` compacts the
  bitmap into the signed index list with warp-aggregated atomics (``cuda/compact.cu``).
* :func:`abs_select_cupy`: the DGC top-k compaction with warp-aggregated atomics.

The CUDA C lives in ``kernels/cuda/*.cu`` (a CPU test compiles each file with
``nvcc -cubin -arch=sm_90``); the kernel files include ``common.cu``, the device helpers
they share. Here it is compiled by NVRTC through ``cupy.RawModule``, once per device and
file (cached). Tensors cross to CuPy through
DLPack with no copy (:func:`as_cupy`, :func:`as_torch`); float16/bfloat16 travel as
their 16-bit patterns, which CuPy's DLPack accepts for both. Every launch goes on
PyTorch's current stream, so it is ordered with the torch work around it; outputs
are allocated by torch (its caching allocator, that stream).

The threshold pass may write the residual over the residual it reads (``out`` is
``residual``) or over ``x``: each element is loaded before it is stored, by the same thread.

References: :mod:`gradzip.kernels.reference`. Imported only by the dispatch.
"""

from __future__ import annotations

import threading
from pathlib import Path

import cupy
import numpy as np
import torch

from .device import DeviceThresholdResult, compact_indices, select_threshold
from .dispatch import KERNEL_DTYPES, Unsupported
from .reference import ThresholdResult, wants_residual

__all__ = ["threshold_ef_cupy", "abs_select_cupy", "as_cupy", "as_torch", "CUDA_DIR", "CU_FILES"]

CUDA_DIR = Path(__file__).resolve().with_name("cuda")
CU_FILES = ("threshold_ballot.cu", "compact.cu")  # the kernel files; each includes common.cu
THREADS = 256
ITEMS = 16  # GZ_ITEMS in threshold_ballot.cu
_SUFFIX = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}

_lock = threading.Lock()
_modules: dict[tuple[int, str], cupy.RawModule] = {}
_functions: dict[tuple[int, str, str], object] = {}


def _function(device: torch.device, file: str, name: str):
    """The compiled kernel ``name`` of ``cuda/<file>`` for ``device`` (compiled once per device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, file, name)
    fn = _functions.get(key)
    if fn is None:
        with _lock, cupy.cuda.Device(index):
            mod = _modules.get((index, file))
            if mod is None:
                mod = cupy.RawModule(code=(CUDA_DIR / file).read_text(), options=("--std=c++17", f"-I{CUDA_DIR}"))
                _modules[(index, file)] = mod
            fn = _functions[key] = mod.get_function(name)
    return fn


def _stream(device: torch.device):
    """PyTorch's current stream on ``device``, as a CuPy stream."""
    s = torch.cuda.current_stream(device)
    return cupy.cuda.ExternalStream(s.cuda_stream, device.index if device.index is not None else -1)


def as_cupy(t: torch.Tensor):
    """A CuPy array sharing ``t``'s memory (DLPack, no copy). 16-bit floats become uint16 bits."""
    if t.dtype in (torch.float16, torch.bfloat16):
        t = t.view(torch.int16)
    return cupy.from_dlpack(t)


def as_torch(a) -> torch.Tensor:
    """A torch tensor sharing the CuPy array's memory (DLPack, no copy)."""
    return torch.from_dlpack(a)


def _check(name: str, t: torch.Tensor, dtypes, device: torch.device | None = None) -> None:
    if t.dtype not in dtypes:
        raise Unsupported(f"{name} has dtype {t.dtype}; the CuPy kernel takes {[str(d) for d in dtypes]}")
    if t.device.type != "cuda":
        raise Unsupported(f"{name} is on {t.device}; CuPy kernels need CUDA tensors")
    if not t.is_contiguous():
        raise Unsupported(f"{name} is not contiguous")
    if device is not None and t.device != device:
        raise Unsupported(f"{name} is on {t.device}, expected {device}")


class _CupyThresholdResult(DeviceThresholdResult):
    backend = "cupy"

    def indices(self) -> torch.Tensor:
        self._check_indexable()
        count = self.count
        dev = self._words.device
        out = torch.empty(count, dtype=torch.int32, device=dev)
        if count:
            counter = torch.zeros(1, dtype=torch.int64, device=dev)
            fn = _function(dev, "compact.cu", "bitmap_to_signed_words")
            grid = min((self.n + THREADS - 1) // THREADS, 65535 * 8)
            with _stream(dev):
                fn(
                    (grid,),
                    (THREADS,),
                    (as_cupy(self._words), np.int64(self.n), as_cupy(out), as_cupy(counter), np.int64(count)),
                )
            # Warps claim slots in any order: sort by index (the low 31 bits) for the ascending list.
            order = torch.argsort(out & 0x7FFFFFFF)
            out = out[order]
        return out


def threshold_ef_cupy(
    x: torch.Tensor,
    tau: float,
    residual: torch.Tensor | None = None,
    *,
    new_residual: bool | None = None,
    out: torch.Tensor | None = None,
) -> ThresholdResult:
    """CuPy version of :func:`~gradzip.kernels.reference.threshold_ef_reference`."""
    _check("x", x, KERNEL_DTYPES)
    if residual is not None:
        _check("residual", residual, (torch.float32,), x.device)
    if out is not None:
        _check("out", out, (torch.float32,), x.device)
    n = x.numel()
    dev = x.device
    tile = THREADS * ITEMS
    nblocks = (n + tile - 1) // tile
    tau32 = np.float32(float(torch.tensor(tau, dtype=torch.float32)))
    words = torch.empty(max((n + 15) // 16, 1), dtype=torch.int32, device=dev)
    counts = torch.empty(nblocks, dtype=torch.int32, device=dev)
    amax_bits = torch.empty(nblocks, dtype=torch.int32, device=dev)
    rout = None
    if wants_residual(residual, new_residual, out):
        rout = out.view(-1) if out is not None else torch.empty(n, dtype=torch.float32, device=dev)
    if nblocks:
        fn = _function(dev, "threshold_ballot.cu", f"threshold_ef_{_SUFFIX[x.dtype]}")
        none = torch.empty(0, dtype=torch.float32, device=dev)
        r = residual.reshape(-1) if residual is not None else none
        with _stream(dev):
            fn(
                (nblocks,),
                (THREADS,),
                (
                    as_cupy(x.reshape(-1)),
                    as_cupy(r),
                    as_cupy(rout if rout is not None else none),
                    as_cupy(words),
                    as_cupy(counts),
                    as_cupy(amax_bits),
                    np.int64(n),
                    tau32,
                    np.int32(residual is not None),
                    np.int32(rout is not None),
                ),
            )
    return _CupyThresholdResult(n, tau, out if out is not None else rout, words, counts, amax_bits)


def abs_select_cupy(v: torch.Tensor, thr, expected: int | None = None) -> torch.Tensor:
    """CuPy version of :func:`~gradzip.kernels.reference.abs_select_reference`; the output
    buffer is sized from ``expected`` (:func:`~gradzip.kernels.device.compact_indices`)."""
    _check("v", v, KERNEL_DTYPES)
    n = v.numel()
    dev = v.device
    if n == 0:
        return torch.empty(0, dtype=torch.int64, device=dev)
    thr_t = select_threshold(v, thr)
    fn = _function(dev, "compact.cu", f"abs_select_{_SUFFIX[v.dtype]}")
    grid = min((n + THREADS - 1) // THREADS, 65535 * 8)

    def launch(out, counter, capacity):
        with _stream(dev):
            fn(
                (grid,),
                (THREADS,),
                (as_cupy(v), as_cupy(thr_t), as_cupy(out), as_cupy(counter), np.int64(n), np.int64(capacity)),
            )

    return compact_indices(launch, n, expected, dev)
