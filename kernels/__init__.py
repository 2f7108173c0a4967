"""gradzip.kernels: the codec ops that compressors are built from, and their dispatch.

Every op has a pure-PyTorch reference in :mod:`gradzip.kernels.reference`; it is
the CPU path and the oracle for GPU kernels. Importing this package never
imports triton or cupy: backends are imported on first use.

Dispatch (one rule for every op):

* CPU tensors go to the reference.
* CUDA tensors go to the first backend registered for the op (Triton, then
  CuPy) that is importable and accepts the call; otherwise to the reference. A
  backend that raises is disabled for that op for the rest of the process, with
  a warning. Every choice is recorded with the reasons for skipping the ones
  before it: :func:`backend_report`.
* ``GRADZIP_KERNELS=reference|triton|cupy`` forces a backend for every op it
  implements (ops it has no kernel for use the reference, and say so). A forced
  backend that cannot run a call raises :class:`KernelBackendError`. Forcing
  ``triton`` on CPU tensors runs the Triton interpreter and so needs
  ``TRITON_INTERPRET=1`` (set before triton is imported): that is how the CPU
  tests run the kernels.

Ops (see each function): :func:`threshold_ef`, :func:`decode_add_bitmap2`,
:func:`scatter_add_signed`, :func:`scatter_add_sparse`, :func:`abs_select`, and
the composite :func:`sampled_topk`. Kernels know nothing of compressors or torch.distributed.
"""
from __future__ import annotations

import importlib
import os
import sys
import threading
import warnings
from typing import Callable, Sequence

import torch

from .reference import (
    ThresholdResult,
    abs_select_reference,
    decode_add_bitmap2_reference,
    decode_signed_indices,
    encode_signed_indices,
    pack_2bit,
    sampled_topk_reference,
    scatter_add_signed_reference,
    scatter_add_sparse_reference,
    threshold_ef_reference,
    threshold_select_reference,
    unpack_2bit,
)

__all__ = [
    "pack_2bit",
    "unpack_2bit",
    "encode_signed_indices",
    "decode_signed_indices",
    "threshold_select_reference",
    "ThresholdResult",
    "threshold_ef",
    "decode_add_bitmap2",
    "scatter_add_signed",
    "scatter_add_sparse",
    "abs_select",
    "sampled_topk",
    "backend_report",
    "register_kernel",
    "Unsupported",
    "KernelBackendError",
    "BACKENDS",
    "ENV_VAR",
]

BACKENDS = ("reference", "triton", "cupy")
ENV_VAR = "GRADZIP_KERNELS"
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class Unsupported(Exception):
    """A backend cannot run this call (dtype, layout, device). Raised before any work is done."""


class KernelBackendError(RuntimeError):
    """A backend forced with ``GRADZIP_KERNELS`` could not run a call."""


# op -> {backend: (module relative to this package, function name)}, in order of preference.
_REGISTRY: dict[str, dict[str, tuple[str, str] | Callable]] = {
    "threshold_ef": {
        "triton": (".triton.threshold", "threshold_ef_triton"),
        "cupy": (".cupy_ops", "threshold_ef_cupy"),
    },
    "decode_add_bitmap2": {"triton": (".triton.decode", "decode_add_bitmap2_triton")},
    "scatter_add_signed": {"triton": (".triton.decode", "scatter_add_signed_triton")},
    "scatter_add_sparse": {"triton": (".triton.decode", "scatter_add_sparse_triton")},
    "abs_select": {
        "triton": (".triton.topk", "abs_select_triton"),
        "cupy": (".cupy_ops", "abs_select_cupy"),
    },
}
_REFERENCE: dict[str, Callable] = {
    "threshold_ef": threshold_ef_reference,
    "decode_add_bitmap2": decode_add_bitmap2_reference,
    "scatter_add_signed": scatter_add_signed_reference,
    "scatter_add_sparse": scatter_add_sparse_reference,
    "abs_select": abs_select_reference,
}

_lock = threading.Lock()
_loaded: dict[tuple[str, str], Callable] = {}
_import_errors: dict[str, str] = {}  # backend -> why it cannot be imported
_broken: dict[tuple[str, str], str] = {}  # (op, backend) -> the error that disabled it
_choices: dict[tuple[str, str], dict] = {}  # (op, device type) -> last choice and reasons


def register_kernel(op: str, backend: str, impl, *, reference: Callable | None = None, first: bool = False) -> None:
    """Register ``impl`` (a callable, or ``(module, name)`` imported on first use) for ``op``.

    A new op needs its ``reference``. ``first=True`` puts the backend ahead of the
    ones already registered.
    """
    if backend not in BACKENDS or backend == "reference":
        raise ValueError(f"backend must be one of {list(BACKENDS[1:])}, got {backend!r}")
    with _lock:
        if op not in _REFERENCE:
            if reference is None:
                raise ValueError(f"op {op!r} is new: pass its reference implementation")
            _REFERENCE[op] = reference
        impls = _REGISTRY.setdefault(op, {})
        impls.pop(backend, None)
        if first:
            _REGISTRY[op] = {backend: impl, **impls}
        else:
            impls[backend] = impl
        _loaded.pop((op, backend), None)
        _broken.pop((op, backend), None)


def _forced() -> str | None:
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if not value or value == "auto":
        return None
    if value not in BACKENDS:
        raise ValueError(f"{ENV_VAR} must be one of {list(BACKENDS)} (or unset), got {value!r}")
    return value


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def _import_backend(backend: str) -> str | None:
    """None if the backend's library imports, else why not (cached)."""
    if backend in _import_errors:
        return _import_errors[backend] or None
    try:
        importlib.import_module(backend)
        _import_errors[backend] = ""
    except Exception as e:  # ImportError, or a broken install raising anything else
        _import_errors[backend] = f"{backend} is not importable ({type(e).__name__}: {e})"
    return _import_errors[backend] or None


def _unusable(backend: str, device: torch.device) -> str | None:
    """None if ``backend`` can run on ``device``, else the reason."""
    if backend == "triton":
        if device.type == "cpu" and not _interpreting():
            return "tensors are on the CPU and TRITON_INTERPRET is not set"
        if device.type not in ("cpu", "cuda"):
            return f"no Triton kernels for {device.type} tensors"
    elif backend == "cupy":
        if device.type != "cuda":
            return f"CuPy kernels need CUDA tensors, got {device.type}"
    return _import_backend(backend)


def _load(op: str, backend: str) -> Callable:
    key = (op, backend)
    fn = _loaded.get(key)
    if fn is None:
        impl = _REGISTRY[op][backend]
        if callable(impl):
            fn = impl
        else:
            module, name = impl
            fn = getattr(importlib.import_module(module, __name__), name)
        _loaded[key] = fn
    return fn


def _record(op: str, device: torch.device, backend: str, why) -> None:
    _choices[(op, device.type)] = {"backend": backend, "why": list(why)}


def _call(op: str, device: torch.device, *args, **kwargs):
    forced = _forced()
    impls = _REGISTRY.get(op, {})
    if forced == "reference":
        _record(op, device, "reference", [f"{ENV_VAR}=reference"])
        return _REFERENCE[op](*args, **kwargs)
    if forced is not None:
        if forced not in impls:
            _record(op, device, "reference", [f"{ENV_VAR}={forced}, which has no kernel for {op}"])
            return _REFERENCE[op](*args, **kwargs)
        reason = _unusable(forced, device)
        if reason:
            raise KernelBackendError(f"{ENV_VAR}={forced} cannot run {op}: {reason}")
        try:
            fn = _load(op, forced)
            out = fn(*args, **kwargs)
        except Unsupported as e:
            raise KernelBackendError(f"{ENV_VAR}={forced} cannot run {op}: {e}") from e
        _record(op, device, forced, [f"forced by {ENV_VAR}"])
        return out
    if device.type != "cuda":
        _record(op, device, "reference", [f"{device.type} tensors use the reference"])
        return _REFERENCE[op](*args, **kwargs)
    why = []
    for backend in impls:
        if (op, backend) in _broken:
            why.append(f"{backend}: disabled after an error: {_broken[(op, backend)]}")
            continue
        reason = _unusable(backend, device)
        if reason:
            why.append(f"{backend}: {reason}")
            continue
        try:
            fn = _load(op, backend)
            out = fn(*args, **kwargs)
        except Unsupported as e:
            why.append(f"{backend}: {e}")
            continue
        except (torch.cuda.OutOfMemoryError, MemoryError):
            raise  # not the backend's fault: the reference would need more memory still
        except Exception as e:  # a kernel that fails to build or launch: fall back, once, loudly
            msg = f"{type(e).__name__}: {e}"
            _broken[(op, backend)] = msg
            warnings.warn(f"gradzip.kernels: {backend} {op} failed ({msg}); falling back", RuntimeWarning, stacklevel=3)
            why.append(f"{backend}: disabled after an error: {msg}")
            continue
        _record(op, device, backend, why)
        return out
    _record(op, device, "reference", why or [f"no kernel registered for {op}"])
    return _REFERENCE[op](*args, **kwargs)


def backend_report() -> dict:
    """What the dispatch knows: the forced backend, what each backend can do, and per op
    and device type the backend last chosen with the reasons the ones before it were skipped.

    Probes (imports) triton and cupy to say whether they are available.
    """
    try:
        forced = _forced()
    except ValueError as e:
        forced = f"invalid: {e}"
    backends = {"reference": "available"}
    for b in ("triton", "cupy"):
        reason = _import_backend(b)
        if reason:
            backends[b] = f"unavailable: {reason}"
        else:
            backends[b] = f"available ({getattr(sys.modules.get(b), '__version__', '?')})"
    ops = {}
    for op in _REFERENCE:
        ops[op] = {
            "registered": list(_REGISTRY.get(op, {})),
            "disabled": {b: e for (o, b), e in _broken.items() if o == op},
            "chosen": {dev: dict(c) for (o, dev), c in _choices.items() if o == op},
        }
    return {
        "forced": forced,
        "triton_interpreter": _interpreting(),
        "cuda_available": torch.cuda.is_available(),
        "backends": backends,
        "ops": ops,
    }


def _reset_for_tests() -> None:
    """Forget choices, disabled backends and import results (tests only)."""
    _choices.clear()
    _broken.clear()
    _import_errors.clear()
    _loaded.clear()


# -- the ops ---------------------------------------------------------------------------------


def _check_float(name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor) or not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {getattr(t, 'dtype', type(t))}")


def threshold_ef(
    x: torch.Tensor, tau: float, residual: torch.Tensor | None = None, *, new_residual: bool | None = None
) -> ThresholdResult:
    """Fused threshold + error feedback over ``v = x.to(acc) + residual``.

    Selects ``v >= tau`` (sent as ``+tau``) and ``v <= -tau`` (``-tau``), counts
    them, takes ``max|v|``, and returns the new residual ``v - sent`` when a
    residual was given (or ``new_residual=True``). The result's :meth:`bitmap`
    and :meth:`indices` give the two wire bodies; see :class:`ThresholdResult`.
    One pass over memory, plus a compaction pass over the bitmap for indices.
    """
    _check_float("x", x)
    if residual is not None:
        _check_float("residual", residual)
        if residual.numel() != x.numel():
            raise ValueError(f"residual has {residual.numel()} elements, x has {x.numel()}")
    return _call("threshold_ef", x.device, x, float(tau), residual, new_residual=new_residual)


def decode_add_bitmap2(out: torch.Tensor, bodies: Sequence[torch.Tensor], taus: Sequence[float]) -> None:
    """``out += decode(bodies[p], taus[p])`` for every peer ``p``, in order, in one pass.

    ``out`` is flat; each body is a uint8 ``FMT_BITMAP2`` body of at least
    ``ceil(out.numel() / 4)`` bytes. The sum per element is taken in peer order, so
    every backend gives the reference's floats.
    """
    _check_float("out", out)
    bodies, taus = list(bodies), [float(t) for t in taus]
    if len(bodies) != len(taus):
        raise ValueError(f"{len(bodies)} bodies for {len(taus)} taus")
    need = (out.numel() + 3) // 4
    for i, b in enumerate(bodies):
        if b.dtype != torch.uint8:
            raise TypeError(f"bitmap body {i} must be uint8, got {b.dtype}")
        if b.numel() < need:
            raise ValueError(f"corrupt bitmap body {i}: {b.numel()} bytes hold fewer than n={out.numel()} 2-bit codes")
    if not bodies or out.numel() == 0:
        return
    _call("decode_add_bitmap2", out.device, out, bodies, taus)


def scatter_add_signed(out: torch.Tensor, words: torch.Tensor, tau: float) -> None:
    """``out[idx] += +-tau`` for one peer's ``FMT_SIGNED_INDEX`` words.

    Indices must be below ``out.numel()`` (callers validate frames) and distinct,
    as every encoder here writes them.
    """
    _check_float("out", out)
    if words.dtype != torch.int32:
        raise TypeError(f"index words must be int32, got {words.dtype}")
    if words.numel() == 0:
        return
    _call("scatter_add_signed", out.device, out, words.reshape(-1), float(tau))


def scatter_add_sparse(out: torch.Tensor, idx: torch.Tensor, vals: torch.Tensor) -> None:
    """``out[idx] += vals`` for one peer's sparse (top-k) frame; distinct, in-range indices."""
    _check_float("out", out)
    _check_float("vals", vals)
    if idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"indices must be int32 or int64, got {idx.dtype}")
    if idx.numel() != vals.numel():
        raise ValueError(f"{idx.numel()} indices for {vals.numel()} values")
    if idx.numel() == 0:
        return
    _call("scatter_add_sparse", out.device, out, idx.reshape(-1), vals.reshape(-1))


def abs_select(v: torch.Tensor, thr, expected: int | None = None) -> torch.Tensor:
    """Ascending int64 indices of the elements of flat ``v`` with ``|v| >= thr``.

    ``thr`` is a number or a 0-d tensor (kept on the device: no host sync).
    ``expected`` is an optional guess at the count, used to size a buffer.
    """
    _check_float("v", v)
    return _call("abs_select", v.device, v.reshape(-1), thr, expected)


def sampled_topk(v: torch.Tensor, k: int, probe: torch.Tensor) -> torch.Tensor:
    """DGC top-k: at most ``k`` ascending int64 indices of large ``|v|``.

    :func:`~gradzip.kernels.reference.sampled_topk_reference` with the compaction
    (:func:`abs_select`) dispatched: the threshold estimate is ``torch.topk`` over
    the sample, the compaction one pass over ``v``, the trim a top-k over the
    survivors (about ``1.25 k`` of them).
    """
    _check_float("v", v)
    n = v.numel()
    if not (0 < k <= n):
        raise ValueError(f"k must be in [1, {n}], got {k}")
    if probe.numel() == 0:
        raise ValueError("probe must hold at least one index")
    return sampled_topk_reference(v.reshape(-1), int(k), probe.to(v.device), select=abs_select)


# -- quantizer codecs (issue 5, part 2) ---------------------------------------------------------
#
# Registered through register_kernel like any plug-in backend; CPU tensors keep the
# references, so CPU behaviour is unchanged.

from .reference import (  # noqa: E402
    decode_add_quant_reference,
    philox_uniform,
    qsgd_encode_reference,
    sign_ef_reference,
    terngrad_encode_reference,
)

__all__ += ["decode_add_quant", "philox_uniform", "qsgd_encode", "sign_ef", "terngrad_encode", "uses_kernel"]

register_kernel("sign_ef", "triton", (".triton.quant", "sign_ef_triton"), reference=sign_ef_reference)
register_kernel("qsgd_encode", "triton", (".triton.quant", "qsgd_encode_triton"), reference=qsgd_encode_reference)
register_kernel("terngrad_encode", "triton", (".triton.quant", "terngrad_encode_triton"), reference=terngrad_encode_reference)
register_kernel("decode_add_quant", "triton", (".triton.quant", "decode_add_quant_triton"), reference=decode_add_quant_reference)


def uses_kernel(op: str, device) -> bool:
    """Whether a call of ``op`` on ``device`` tensors would go to a kernel backend rather
    than the reference, by the dispatch rules above, without calling anything.

    True for CUDA tensors when a backend registered for ``op`` is importable and not
    disabled after an error; with ``GRADZIP_KERNELS=triton|cupy``, when that backend has a
    kernel for ``op`` and can run on ``device`` (forced Triton on CPU tensors needs
    ``TRITON_INTERPRET=1``). False for CPU tensors without forcing, for
    ``GRADZIP_KERNELS=reference``, and where a forced backend cannot run (a call of the op
    itself would raise :class:`KernelBackendError` there). A kernel may still decline one
    call (:class:`Unsupported`: dtype, layout); the dispatch then runs the reference, which
    gives the same result. Callers use this to pick between a kernel path and an
    eager path whose results differ (the quantizers' random draws). Importing the backend
    (once, cached) is the only side effect.
    """
    device = torch.device(device)
    if op not in _REFERENCE:
        raise ValueError(f"unknown op {op!r}")
    forced = _forced()
    impls = _REGISTRY.get(op, {})
    if forced == "reference":
        return False
    if forced is not None:
        return forced in impls and _unusable(forced, device) is None
    if device.type != "cuda":
        return False
    return any((op, b) not in _broken and _unusable(b, device) is None for b in impls)


def sign_ef(x: torch.Tensor, residual: torch.Tensor | None = None, *, block: int | None = None, new_residual: bool | None = None):
    """Scaled sign + error feedback: ``(float32 scales, int32 sign words, residual or None)``.

    ``v = x.to(float32) + residual``; ``S_b = mean |v|`` per block (float64 sum);
    bit ``i`` of the words (``bitpack.pack_bits`` layout) is ``v_i < 0``; the new residual
    is ``v - where(v < 0, -S_b, S_b)``. See :func:`~gradzip.kernels.reference.sign_ef_reference`.
    """
    _check_float("x", x)
    if x.dtype == torch.float64:
        raise TypeError("sign_ef works in float32; float64 tensors use SignSGD's own float64 path")
    if residual is not None:
        _check_float("residual", residual)
        if residual.numel() != x.numel():
            raise ValueError(f"residual has {residual.numel()} elements, x has {x.numel()}")
    return _call("sign_ef", x.device, x, residual, block=block, new_residual=new_residual)


def _check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not (0 <= seed < 2**63):
        raise ValueError(f"seed must be an integer in [0, 2**63), got {seed!r}")
    return seed


def qsgd_encode(x: torch.Tensor, levels: int, seed: int, *, block: int | None = 64, bits: int | None = None):
    """QSGD encode with Philox draws ``u_i = philox_uniform(seed, n)[i]`` (``tl.rand4x`` on the
    GPU, one Philox evaluation per four elements): ``(float32 norms, packed codes)``. See :func:`~gradzip.kernels.reference.qsgd_encode_reference`."""
    _check_float("x", x)
    if x.dtype == torch.float64:
        raise TypeError("qsgd_encode works in float32")
    return _call("qsgd_encode", x.device, x, int(levels), _check_seed(seed), block=block, bits=bits)


def terngrad_encode(x: torch.Tensor, seed: int, *, block: int | None = None, clip: float | None = None):
    """TernGrad encode with Philox draws: ``(float32 scales, 2-bit codes)``.
    See :func:`~gradzip.kernels.reference.terngrad_encode_reference`."""
    _check_float("x", x)
    if x.dtype == torch.float64:
        raise TypeError("terngrad_encode works in float32")
    return _call("terngrad_encode", x.device, x, _check_seed(seed), block=block, clip=clip)


def decode_add_quant(
    out: torch.Tensor,
    bodies: Sequence[torch.Tensor],
    kind: str,
    *,
    block: int | None = None,
    levels: int = 0,
    bits: int | None = None,
) -> None:
    """``out += decode(bodies[p])`` for every peer in rank order, one pass, for quantizer
    frame bodies (``kind`` sign1, qsgd, tern2 or int8; ``nb`` float32 scales then the codes).

    ``out`` is flat float32. Body lengths are checked here; code values are not (callers
    validate frames, as the quantizers' decoders do).
    """
    from .reference import QUANT_KINDS, quant_code_bytes, quant_layout

    if out.dtype != torch.float32:
        raise TypeError(f"out must be float32, got {out.dtype}")
    if kind not in QUANT_KINDS:
        raise ValueError(f"kind must be one of {list(QUANT_KINDS)}, got {kind!r}")
    if kind == "qsgd" and (bits not in (2, 4, 8) or not (1 <= int(levels) and 2 * int(levels) + 1 <= 1 << bits)):
        raise ValueError(f"qsgd needs bits in (2, 4, 8) and 1 <= levels with 2 * levels + 1 <= 2**bits, got {bits}, {levels}")
    bodies = list(bodies)
    n = out.numel()
    nb, _ = quant_layout(n, block)
    need = 4 * nb + quant_code_bytes(kind, n, bits)
    for i, b in enumerate(bodies):
        if b.dtype != torch.uint8:
            raise TypeError(f"body {i} must be uint8, got {b.dtype}")
        if b.numel() != need:
            raise ValueError(f"corrupt {kind} body {i}: {b.numel()} bytes, expected {need}")
    if not bodies or n == 0:
        return
    _call("decode_add_quant", out.device, out, bodies, kind, block=block, levels=int(levels), bits=bits)
