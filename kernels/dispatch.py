"""Which implementation runs each op: the backend registry and its rules.

One rule for every op:

* CPU tensors go to the Numba kernel where the op has one, Numba imports and
  the kernel accepts the call (:mod:`.numba_ops`); otherwise to the reference.
* CUDA tensors go to the first backend registered for the op (Triton, then
  CuPy) that is importable and accepts the call; otherwise to the reference. A
  backend that raises (on either device) is disabled for that op for the rest
  of the process, with a warning. Every choice is recorded with the reasons for skipping the ones
  before it: :func:`backend_report`.
* ``GRADZIP_KERNELS=reference|numba|triton|cupy`` forces a backend for every op it
  implements (ops it has no kernel for use the reference, and say so). A forced
  backend that cannot run a call raises :class:`KernelBackendError`. Forcing
  ``triton`` on CPU tensors runs the Triton interpreter and so needs
  ``TRITON_INTERPRET=1`` (set before triton is imported): that is how the CPU
  tests run the kernels.
* Calls that no kernel can take whatever the backend (float64 tensors: every
  kernel works in float32) go to the reference under every setting, through
  :func:`_call_reference`, and the choice records why.

Importing this module never imports numba, triton or cupy: backends are imported on first use.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import threading
import warnings
from collections.abc import Callable

import torch

__all__ = [
    "BACKENDS",
    "ENV_VAR",
    "KERNEL_DTYPES",
    "Unsupported",
    "KernelBackendError",
    "register_kernel",
    "backend_report",
    "uses_kernel",
    "runs_triton",
    "reset_dispatch",
    "gpu_side",
    "gpu_side_on_cpu",
]

BACKENDS = ("reference", "numba", "triton", "cupy")
#: The backends that run on CPU tensors without being forced (Triton on the CPU is its interpreter: tests only).
CPU_BACKENDS = ("numba",)
ENV_VAR = "GRADZIP_KERNELS"
# The input dtypes the kernels load (widening to float32 as they load); float64 is reference-only.
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class Unsupported(Exception):
    """A backend cannot run this call (dtype, layout, device). Raised before any work is done."""


class KernelBackendError(RuntimeError):
    """A backend forced with ``GRADZIP_KERNELS`` could not run a call."""


_GPU_SIDE_ON_CPU = False  # set only within gpu_side_on_cpu()


def gpu_side(device: torch.device) -> bool:
    """Whether code on ``device`` takes the GPU's side of a branch that picks *how* to compute
    by the device's type: on a GPU every operation is a launch, so that side issues few
    operations (matrices stacked for one ``bmm``, pieces as the rows of one ``torch.topk``,
    torch's bit packing rather than numpy's); on the CPU the other side is faster or gives
    MKL's bits at every alignment. True on every device but the CPU, and on the CPU within
    :func:`gpu_side_on_cpu`. Branches on what a device *can* do (a kernel's device, a dtype a
    backend takes) do not ask it."""
    return device.type != "cpu" or _GPU_SIDE_ON_CPU


def host_to_device(t: torch.Tensor, device) -> torch.Tensor:
    """``t``, a tensor just built on the host (a table, offsets, lengths), on ``device``:
    itself on the CPU; on CUDA by a copy into pinned memory and an asynchronous copy from
    it, where ``t.to(device)`` (pageable memory) waits for the whole stream
    (``cudaMemcpyAsync`` then ``cudaStreamSynchronize``): a host sync in the middle of a
    step. PyTorch's pinned-memory cache keeps the staging block until the copy is done, and
    work queued after it on the stream sees the bytes."""
    device = torch.device(device)
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


@contextlib.contextmanager
def gpu_side_on_cpu():
    """Within it, :func:`gpu_side` is true on the CPU too: the GPU path's host work, counted on
    the CPU (``benchmarks/dryrun_profile.py --gpu-branches``), and the tests that check the GPU
    side against the CPU's. The same results up to what each side documents (PowerSGD's
    stacked products are MKL's at another alignment; TopK's rows may break a tie at the k-th
    magnitude otherwise). A process-wide setting, not per thread; it nests."""
    global _GPU_SIDE_ON_CPU
    saved, _GPU_SIDE_ON_CPU = _GPU_SIDE_ON_CPU, True
    try:
        yield
    finally:
        _GPU_SIDE_ON_CPU = saved


# op -> {backend: callable, or (module relative to this package, function name)}, in order of preference.
_REGISTRY: dict[str, dict[str, tuple[str, str] | Callable]] = {}
_REFERENCE: dict[str, Callable] = {}

_lock = threading.Lock()
_loaded: dict[tuple[str, str], Callable] = {}
_import_errors: dict[str, str] = {}  # backend -> why it cannot be imported ("" if it can)
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


def reset_dispatch() -> None:
    """Forget the recorded choices, the backends disabled after an error and the import
    results, so that the next call of each op chooses afresh (registrations are kept)."""
    with _lock:
        _choices.clear()
        _broken.clear()
        _import_errors.clear()
        _loaded.clear()


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
    if backend == "numba":
        if device.type != "cpu":
            return f"Numba kernels take CPU tensors, got {device.type}"
    elif backend == "triton":
        if device.type == "cpu" and not _interpreting():
            return "tensors are on the CPU and TRITON_INTERPRET is not set"
        if device.type not in ("cpu", "cuda"):
            return f"no Triton kernels for {device.type} tensors"
    elif backend == "cupy":
        if device.type != "cuda":
            return f"CuPy kernels need CUDA tensors, got {device.type}"
    return _import_backend(backend)


# The Triton interpreter is not thread-safe: it patches ``triton.language`` for the kernel it
# runs and restores it afterwards, so two kernels interpreted at once (a protocol decoding in a
# collective's callback thread while the hook encodes the next bucket) break each other.
# Interpreted launches are serialized; compiled kernels and other backends are not.
_interpreter_lock = threading.RLock()


class _NoLock:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NO_LOCK = _NoLock()


def _guard(backend: str, device: torch.device):
    """The lock a launch of ``backend`` on ``device`` tensors must hold (see above)."""
    return _interpreter_lock if backend == "triton" and device.type == "cpu" and _interpreting() else _NO_LOCK


def _load(op: str, backend: str) -> Callable:
    key = (op, backend)
    fn = _loaded.get(key)
    if fn is None:
        impl = _REGISTRY[op][backend]
        if callable(impl):
            fn = impl
        else:
            module, name = impl
            fn = getattr(importlib.import_module(module, __package__), name)
        _loaded[key] = fn
    return fn


def _record(op: str, device: torch.device, backend: str, why) -> None:
    _choices[(op, device.type)] = {"backend": backend, "why": list(why)}


def _call_reference(op: str, device: torch.device, why: str, *args, **kwargs):
    """Run ``op``'s reference whatever the setting, recording ``why``."""
    _record(op, device, "reference", [why])
    return _REFERENCE[op](*args, **kwargs)


def _call(op: str, device: torch.device, *args, **kwargs):
    """Run ``op`` on ``device`` tensors by the rules of this module."""
    forced = _forced()
    impls = _REGISTRY.get(op, {})
    if forced == "reference":
        return _call_reference(op, device, f"{ENV_VAR}=reference", *args, **kwargs)
    if forced is not None:
        if forced not in impls:
            return _call_reference(op, device, f"{ENV_VAR}={forced}, which has no kernel for {op}", *args, **kwargs)
        reason = _unusable(forced, device)
        if reason:
            raise KernelBackendError(f"{ENV_VAR}={forced} cannot run {op}: {reason}")
        try:
            with _guard(forced, device):
                out = _load(op, forced)(*args, **kwargs)
        except Unsupported as e:
            raise KernelBackendError(f"{ENV_VAR}={forced} cannot run {op}: {e}") from e
        _record(op, device, forced, [f"forced by {ENV_VAR}"])
        return out
    candidates = _automatic(impls, device)
    if candidates is None:
        return _call_reference(op, device, f"{device.type} tensors use the reference", *args, **kwargs)
    why = []
    for backend in candidates:
        if (op, backend) in _broken:
            why.append(f"{backend}: disabled after an error: {_broken[(op, backend)]}")
            continue
        reason = _unusable(backend, device)
        if reason:
            why.append(f"{backend}: {reason}")
            continue
        try:
            with _guard(backend, device):
                out = _load(op, backend)(*args, **kwargs)
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


def _automatic(impls, device: torch.device) -> list | None:
    """The backends an unforced call on ``device`` tensors tries, in order; None where only
    the reference runs (no backend of the device is registered for the op)."""
    if device.type == "cuda":
        return [b for b in impls if b not in CPU_BACKENDS]
    if device.type == "cpu":
        found = [b for b in impls if b in CPU_BACKENDS]
        return found or None
    return None


def runs_triton(op: str, device) -> bool:
    """Whether a call of ``op`` on ``device`` tensors would run its Triton kernel: forced by
    ``GRADZIP_KERNELS=triton`` where it can run, or unforced where Triton is the first backend
    that can (CUDA tensors). What a caller that launches the kernels itself, from tables it
    keeps (:mod:`gradzip.kernels.triton.plan`), asks first."""
    device = torch.device(device)
    impls = _REGISTRY.get(op, {})
    if "triton" not in impls or (op, "triton") in _broken or _unusable("triton", device) is not None:
        return False
    forced = _forced()
    if forced is not None:
        return forced == "triton"
    for backend in _automatic(impls, device) or []:
        if (op, backend) not in _broken and _unusable(backend, device) is None:
            return backend == "triton"
    return False


def uses_kernel(op: str, device) -> bool:
    """Whether a call of ``op`` on ``device`` tensors would go to a kernel backend rather
    than the reference, by the rules above, without calling anything.

    True for CUDA tensors when a backend registered for ``op`` is importable and not
    disabled after an error, and for CPU tensors likewise when ``op`` has a Numba kernel;
    with ``GRADZIP_KERNELS=numba|triton|cupy``, when that backend has a kernel for ``op``
    and can run on ``device`` (forced Triton on CPU tensors needs
    ``TRITON_INTERPRET=1``). False for ops with no kernel for the device, for
    ``GRADZIP_KERNELS=reference``, and where a forced backend cannot run (a call of the op
    itself would raise :class:`KernelBackendError` there). A kernel may still decline one
    call (:class:`Unsupported`: dtype, layout), and float64 calls always take the
    reference; every op gives the reference's results on every backend, so this only
    says where the work runs. Importing the backend (once, cached) is the only side effect.
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
    candidates = _automatic(impls, device) or []
    return any((op, b) not in _broken and _unusable(b, device) is None for b in candidates)


def backend_report() -> dict:
    """What the dispatch knows: the forced backend, what each backend can do, and per op
    and device type the backend last chosen with the reasons the ones before it were skipped.

    Probes (imports) numba, triton and cupy to say whether they are available.
    """
    try:
        forced = _forced()
    except ValueError as e:
        forced = f"invalid: {e}"
    backends = {"reference": "available"}
    for b in BACKENDS[1:]:
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
