"""``import gradzip.horovod as hvd``: a drop-in for ``horovod.torch`` in a training script.

    import gradzip.horovod as hvd                 # was: import horovod.torch as hvd
    hvd.init()
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.none)   # or gz.TopK(0.01), "PowerSGD(rank=2)"
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)

**Transports.** ``init()`` sets up ``torch.distributed`` (gloo) from the environment of
``torchrun`` (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``) or of ``horovodrun
--gloo`` (``HOROVOD_RANK``, ``HOROVOD_SIZE``, and the rendezvous server it runs: rank 0
publishes the address of a ``TCPStore`` there, the others read it), or uses a process group
that is already initialised; without a launcher it is a world of one process. That is
``transport="torch"``, the default. ``init(transport="horovod")`` (or
``GRADZIP_HOROVOD_TRANSPORT=horovod``) instead initialises Horovod itself under ``horovodrun``
and runs everything on Horovod's collectives: the optimizer's protocols through
:class:`gradzip.comm_horovod.HorovodCommunicator`, the broadcasts and ``allreduce`` through
``horovod.torch``. ``DistributedOptimizer(..., transport=...)`` picks per optimizer.

**DistributedOptimizer** has Horovod 0.28.1's signature, argument order and semantics, and
returns, as Horovod does, an instance of a subclass of the wrapped optimizer's class
(``isinstance(opt, torch.optim.SGD)`` holds) that shares its parameter groups. Underneath it is
:class:`gradzip.optim.DistributedOptimizer` (buckets, the engine, error feedback, byte stats):

* ``compression``: a gradzip codec, protocol or ``Policy``, a method string in the grammar of
  ``gradzip.parse`` (``"TopK(0.01)"``), or ``Compression.none``/``Compression.fp16`` (this
  module's or ``horovod.torch``'s). ``fp16`` runs gradzip's ``FP16`` with error feedback: a
  finite value beyond ±65504 is sent saturated and its excess kept in the residual (never
  clipped silently); a NaN/Inf gradient takes the engine's non-finite path.
* ``op``: ``Average`` (default) or ``Sum`` (``Adasum``, ``Min``, ``Max``, ``Product`` are refused:
  gradzip averages). ``gradient_predivide_factor`` in Horovod's convention (the wire carries
  ``g / f`` before the sum): it is gradzip's ``f / size()``, except ``f = 1``, where gradzip
  pre-divides by the world size as DDP does (the same average; for 2 ranks bit for bit).
* ``num_groups`` / ``groups``: Horovod's explicit grouping: each group is one engine call (a
  gradzip bucket), issued when all its gradients are ready; parameters in no group are
  groups of one. Without groups, gradients are cut into DDP-style buckets (``bucket_mb``).
* ``sparse_as_dense``: sparse gradients (``nn.Embedding(sparse=True)``) go through the codec
  dense either way, and ``p.grad`` is sparse again after ``synchronize()``, as in Horovod.
* ``process_set``: the global process set only (``global_process_set``, Horovod's, or None).
* ``set_backward_passes_per_step``, ``synchronize``, ``skip_synchronize``, ``zero_grad``
  (raises between ``backward()`` and ``step()``), ``state_dict`` (the optimizer's, plus
  ``"gradzip"``: residuals and codec state) and ``load_state_dict`` (that, or a plain
  optimizer state dict: the gradzip state then stays as it is), and the rest of the front-end
  surface of :class:`gradzip.frontend.FrontEnd`: ``stats()``, ``routes()``, ``log_every()``,
  ``save()``/``load()``.
* Keyword-only extras: ``transport``, ``error_feedback``, ``on_nonfinite``, ``start_iter``,
  ``momentum_correction``, ``clip``, ``bucket_mb`` (see :class:`gradzip.optim.DistributedOptimizer`).

**Compression adapters** (:func:`adapt`, :class:`Compression`) put gradzip's summable casts
behind Horovod's own ``Compression`` interface, for scripts that keep ``horovod.torch``'s
optimizer. ``Compression.fp16`` keeps Horovod's overflow semantics: a value beyond ±65504
becomes ±inf, as with ``horovod.torch.Compression.fp16``, so ``GradScaler`` sees the overflow
(no saturation: that interface has no residual to keep the excess). ``BF16`` is refused at
construction: Horovod's torch binding has no bfloat16 allreduce. Sparsifiers and quantizers
are refused too: Horovod's allreduce adds payloads element by element, which is no sum of
index/value lists, and its static ``compress(tensor)`` has no name, step or residual for
error feedback; give them to this module's ``DistributedOptimizer`` instead.
"""

from __future__ import annotations

import io
import os
import socket
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

import gradzip.args as args

from .codecs.base import Codec
from .codecs.cast import BF16, FP16, Identity
from .engine import Engine
from .frontend import FrontEnd
from .optim import DistributedOptimizer as _GzOptimizer
from .optim import _Bucket
from .protocols.base import Protocol
from .registry import parse
from .wire import Payload

__all__ = [
    "init",
    "shutdown",
    "is_initialized",
    "size",
    "rank",
    "local_rank",
    "local_size",
    "cross_rank",
    "cross_size",
    "transport",
    "Average",
    "Sum",
    "Adasum",
    "Min",
    "Max",
    "Product",
    "global_process_set",
    "allreduce",
    "allreduce_",
    "allgather",
    "broadcast",
    "broadcast_",
    "broadcast_object",
    "broadcast_parameters",
    "broadcast_optimizer_state",
    "barrier",
    "Compression",
    "HorovodCompressor",
    "adapt",
    "DistributedOptimizer",
]

# Horovod's reduce-op constants (horovod.torch.mpi_ops: the same integers).
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
_OP_NAMES = {0: "Average", 1: "Sum", 2: "Adasum", 3: "Min", 4: "Max", 5: "Product"}
_TRANSPORTS = ("torch", "horovod")
_RDZV_TIMEOUT_S = 300.0


class _GlobalProcessSet:
    """The global process set (all ranks); the only one gradzip.horovod supports."""

    def __repr__(self) -> str:
        return "gradzip.horovod.global_process_set"


global_process_set = _GlobalProcessSet()
_state: dict = {"transport": None, "local_rank": 0, "local_size": 1, "cross_rank": 0, "cross_size": 1}


# -- init and the process layout --------------------------------------------------------
def _env_int(*names: str) -> int | None:
    for n in names:
        if os.environ.get(n, "") != "":
            return int(os.environ[n])
    return None


def _horovod():
    """``horovod.torch``, initialised (under horovodrun); ImportError with the reason otherwise."""
    try:
        import horovod.torch as hvd
    except ImportError as exc:
        raise ImportError(f"transport='horovod' needs Horovod (horovod.torch): {exc}") from exc
    if not hvd.is_initialized():
        hvd.init()
    return hvd


def _kv(url: str, value: str | None = None) -> str | None:
    """GET (``value`` None; None while the key is missing) or PUT a key of horovodrun's rendezvous server."""
    req = urllib.request.Request(
        url, data=None if value is None else value.encode(), method="GET" if value is None else "PUT"
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.read().decode()
    except urllib.error.HTTPError as exc:
        if exc.code == 404 and value is None:
            return None
        raise


def _init_from_horovodrun(rank_: int, world: int, backend: str) -> None:
    """torch.distributed from horovodrun's environment: rank 0 starts a TCPStore on a free port and
    publishes ``host:port`` on horovodrun's rendezvous server (scope ``gradzip``), the others read it."""
    addr = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR")
    port = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_PORT")
    if not addr or not port:
        raise RuntimeError(
            "HOROVOD_RANK is set but HOROVOD_GLOO_RENDEZVOUS_ADDR/PORT are not: run with `horovodrun --gloo`"
        )
    if os.environ.get("HOROVOD_GLOO_IFACE") and not os.environ.get("GLOO_SOCKET_IFACE"):
        os.environ["GLOO_SOCKET_IFACE"] = os.environ["HOROVOD_GLOO_IFACE"]
    url = f"http://{addr}:{port}/gradzip/store"
    timeout = timedelta(seconds=_RDZV_TIMEOUT_S)
    if rank_ == 0:
        host = socket.gethostbyname(os.environ.get("HOROVOD_HOSTNAME") or socket.gethostname())
        store = dist.TCPStore(host, 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
        _kv(url, f"{host}:{store.port}")
    else:
        deadline = time.monotonic() + _RDZV_TIMEOUT_S
        while (where := _kv(url)) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0 did not publish its store at {url} within {_RDZV_TIMEOUT_S:.0f}s")
            time.sleep(0.05)
        host, _, p = where.rpartition(":")
        store = dist.TCPStore(host, int(p), world, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank_, world_size=world, timeout=timeout)


def init(comm=None, process_sets=None, *, transport: str | None = None) -> None:
    """Join the job (Horovod's ``init``). ``comm`` (an MPI communicator) and ``process_sets``
    are Horovod's MPI/process-set options: gradzip supports neither (pass None).

    ``transport``: ``"torch"`` (default; ``GRADZIP_HOROVOD_TRANSPORT`` overrides the default)
    or ``"horovod"`` (module docstring). Under torchrun, horovodrun, or with torch.distributed
    already initialised, every process learns the real world size; a launcher environment that
    is neither (``mpirun``: ``OMPI_COMM_WORLD_SIZE``, ``PMI_SIZE`` > 1) raises rather than
    silently making each process a world of one.
    """
    if comm is not None or process_sets is not None:
        raise ValueError("gradzip.horovod.init() supports neither an MPI comm nor process_sets (the global set only)")
    transport = transport or os.environ.get("GRADZIP_HOROVOD_TRANSPORT") or "torch"
    args.choice("transport", transport, _TRANSPORTS)
    if transport == "horovod":
        hvd = _horovod()
        _state.update(
            transport="horovod",
            local_rank=hvd.local_rank(),
            local_size=hvd.local_size(),
            cross_rank=hvd.cross_rank(),
            cross_size=hvd.cross_size(),
        )
        return
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    if not dist.is_initialized():
        if _env_int("RANK") is not None and _env_int("WORLD_SIZE") is not None:  # torchrun
            dist.init_process_group(backend, init_method="env://")
        elif _env_int("HOROVOD_RANK") is not None:  # horovodrun --gloo
            _init_from_horovodrun(_env_int("HOROVOD_RANK"), _env_int("HOROVOD_SIZE"), backend)
        elif (_env_int("OMPI_COMM_WORLD_SIZE", "PMI_SIZE") or 1) > 1:
            raise RuntimeError(
                "launched by mpirun: gradzip.horovod.init() reads torchrun's or horovodrun --gloo's environment; "
                "use one of them, or initialise torch.distributed yourself before init()"
            )
        else:  # a plain `python train.py`: a world of one, as Horovod gives
            store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
            dist.init_process_group(backend, store=store, rank=0, world_size=1)
    world = dist.get_world_size()
    lsize = _env_int("LOCAL_WORLD_SIZE", "HOROVOD_LOCAL_SIZE") or (1 if world == 1 else None)
    lrank = _env_int("LOCAL_RANK", "HOROVOD_LOCAL_RANK")
    if lsize is None or lrank is None:  # torch.distributed set up by hand: assume one node
        lsize, lrank = world, dist.get_rank()
    _state.update(
        transport="torch",
        local_rank=lrank,
        local_size=lsize,
        cross_rank=dist.get_rank() // lsize,
        cross_size=max(1, world // lsize),
    )


def _require() -> str:
    if _state["transport"] is None:
        raise ValueError("gradzip.horovod has not been initialized; use gradzip.horovod.init()")
    return _state["transport"]


def transport() -> str:
    """``"torch"`` or ``"horovod"``: what ``init()`` chose."""
    return _require()


def is_initialized() -> bool:
    return _state["transport"] is not None


def shutdown() -> None:
    """Leave the job: destroys the process group (transport ``torch``) or shuts Horovod down."""
    t = _state["transport"]
    _state["transport"] = None
    if t == "horovod":
        _horovod().shutdown()
    elif t == "torch" and dist.is_initialized():
        dist.destroy_process_group()


def size() -> int:
    return _horovod().size() if _require() == "horovod" else dist.get_world_size()


def rank() -> int:
    return _horovod().rank() if _require() == "horovod" else dist.get_rank()


def local_rank() -> int:
    _require()
    return _state["local_rank"]


def local_size() -> int:
    _require()
    return _state["local_size"]


def cross_rank() -> int:
    _require()
    return _state["cross_rank"]


def cross_size() -> int:
    _require()
    return _state["cross_size"]


def _check_process_set(process_set) -> None:
    if process_set is None or process_set is global_process_set:
        return
    if type(process_set).__module__.startswith("horovod.") and getattr(process_set, "process_set_id", None) == 0:
        return  # horovod.torch.global_process_set
    raise ValueError(f"gradzip.horovod supports the global process set only, got {process_set!r}")


# -- collectives --------------------------------------------------------------------------
def _op_of(average, op) -> int:
    if average is not None:
        if op is not None:
            raise ValueError("pass op or average, not both")
        return Average if average else Sum
    return Average if op is None else int(op)


class _Allreduce(torch.autograd.Function):
    """Allreduce whose backward allreduces the gradient with the same op, as Horovod's."""

    @staticmethod
    def forward(ctx, tensor, op, prescale, postscale):
        ctx.op, ctx.scales = op, (prescale, postscale)
        return _allreduce_torch(tensor.detach().clone(), op, prescale, postscale)

    @staticmethod
    def backward(ctx, grad):
        return _allreduce_torch(grad.clone(), ctx.op, *ctx.scales), None, None, None


_DIST_OPS = {
    Sum: dist.ReduceOp.SUM,
    Average: dist.ReduceOp.SUM,
    Min: dist.ReduceOp.MIN,
    Max: dist.ReduceOp.MAX,
    Product: dist.ReduceOp.PRODUCT,
}


def _allreduce_torch(t: torch.Tensor, op: int, prescale: float, postscale: float) -> torch.Tensor:
    """In place on ``t``: Horovod's order (scale by ``prescale``, reduce, then ``postscale``, and
    ``1 / size`` for Average)."""
    if op not in _DIST_OPS:
        raise ValueError(f"op must be one of Average, Sum, Min, Max, Product; got {_OP_NAMES.get(op, op)!r}")
    if prescale != 1.0:
        t.mul_(prescale)
    dist.all_reduce(t, op=_DIST_OPS[op])
    post = postscale / dist.get_world_size() if op == Average else postscale
    if post != 1.0:
        t.mul_(post)
    return t


def allreduce(
    tensor,
    average=None,
    name=None,
    compression=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=global_process_set,
):
    """A new tensor: ``tensor`` reduced over the ranks (Horovod's ``allreduce``; autograd-aware).
    ``compression`` is a Horovod-interface class (``Compression.none``/``fp16``)."""
    _check_process_set(process_set)
    op = _op_of(average, op)
    comp = Compression.none if compression is None else compression
    if _require() == "horovod":
        hvd = _horovod()
        return hvd.allreduce(
            tensor,
            name=name,
            compression=comp,
            op=op,
            prescale_factor=prescale_factor,
            postscale_factor=postscale_factor,
        )
    compressed, ctx = comp.compress(tensor)
    out = _Allreduce.apply(compressed, op, float(prescale_factor), float(postscale_factor))
    return comp.decompress(out, ctx)


def allreduce_(
    tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set
):
    """``allreduce`` in place; returns ``tensor``."""
    _check_process_set(process_set)
    op = _op_of(average, op)
    if _require() == "horovod":
        return _horovod().allreduce_(
            tensor, name=name, op=op, prescale_factor=prescale_factor, postscale_factor=postscale_factor
        )
    with torch.no_grad():
        return _allreduce_torch(tensor, op, float(prescale_factor), float(postscale_factor))


def allgather(tensor, name=None, process_set=global_process_set):
    """Every rank's ``tensor`` concatenated along dimension 0 (their first dimensions may differ)."""
    _check_process_set(process_set)
    if _require() == "horovod":
        return _horovod().allgather(tensor, name=name)
    n = torch.tensor([tensor.shape[0] if tensor.dim() else 1], dtype=torch.int64)
    sizes = [torch.zeros_like(n) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, n)
    rows = [int(s) for s in sizes]
    t = tensor.detach().reshape(-1, *tensor.shape[1:]) if tensor.dim() else tensor.detach().reshape(1)
    pad = max(rows)
    if t.shape[0] < pad:
        t = torch.cat([t, t.new_zeros(pad - t.shape[0], *t.shape[1:])])
    out = [torch.empty_like(t) for _ in rows]
    dist.all_gather(out, t.contiguous())
    return torch.cat([o[:r] for o, r in zip(out, rows)])


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """Overwrite ``tensor`` with ``root_rank``'s, in place; returns it."""
    _check_process_set(process_set)
    if _require() == "horovod":
        return _horovod().broadcast_(tensor, root_rank, name=name)
    with torch.no_grad():
        dist.broadcast(tensor, src=root_rank)
    return tensor


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """A new tensor holding ``root_rank``'s ``tensor``."""
    _check_process_set(process_set)
    if _require() == "horovod":
        return _horovod().broadcast(tensor, root_rank, name=name)
    return broadcast_(tensor.detach().clone(), root_rank)


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """``root_rank``'s ``obj`` (pickled; tensors included) on every rank."""
    _check_process_set(process_set)
    if _require() == "horovod":
        return _horovod().broadcast_object(obj, root_rank, name=name)
    box = [obj if dist.get_rank() == root_rank else None]
    dist.broadcast_object_list(box, src=root_rank)
    return box[0]


def barrier(process_set=global_process_set) -> None:
    _check_process_set(process_set)
    if _require() == "horovod":
        _horovod().barrier()
    else:
        dist.barrier()


def broadcast_parameters(params, root_rank) -> None:
    """Horovod's ``broadcast_parameters``: ``params`` is a ``state_dict()`` (broadcast in sorted
    key order) or a list of ``(name, tensor)`` pairs or tensors; each is overwritten in place."""
    if isinstance(params, dict):
        params = sorted(params.items())
    elif isinstance(params, list):
        params = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type {type(params).__name__}: a dict (state_dict) or a list")
    for name, p in params:
        if isinstance(p, torch.Tensor):
            broadcast_(p.data if isinstance(p, torch.nn.Parameter) else p, root_rank, name=name)


def broadcast_optimizer_state(optimizer, root_rank, model=None) -> None:
    """Every rank's optimizer state becomes ``root_rank``'s (hyper-parameters and buffers),
    through one object broadcast. The gradzip state of this module's ``DistributedOptimizer``
    (error-feedback residuals, momentum buffers: per rank) stays each rank's own: it is not
    broadcast (the root's residuals are not another rank's). ``model`` (Horovod's hint for
    sparse parameters) is not needed: the state travels pickled."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    sd = None
    if rank() == root_rank:
        sd = dict(optimizer.state_dict())
        sd.pop("gradzip", None)
    buf = io.BytesIO()
    if sd is not None:
        torch.save(sd, buf)
    got = broadcast_object(buf.getvalue() if sd is not None else None, root_rank)
    if rank() != root_rank:
        optimizer.load_state_dict(torch.load(io.BytesIO(got), weights_only=False))


# -- Horovod's Compression interface ------------------------------------------------------
class HorovodCompressor:
    """Horovod's interface: static ``compress(tensor) -> (tensor, ctx)`` and ``decompress(tensor, ctx)``."""

    gradzip_compressor: Codec

    @staticmethod
    def compress(tensor: torch.Tensor):  # pragma: no cover - overridden by adapt()
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx):  # pragma: no cover - overridden by adapt()
        raise NotImplementedError


class _Ctx(NamedTuple):
    shape: torch.Size
    dtype: torch.dtype
    vdtype: torch.dtype | None
    fmt: int
    scale: float


def adapt(compressor: Codec) -> type:
    """A Horovod ``Compression`` class (static ``compress``/``decompress``) that runs ``compressor``.

    Raises ``ValueError`` at construction for what Horovod's allreduce cannot carry: payloads
    that are not summable, biased codecs (they need per-parameter error feedback), codecs with a
    protocol of their own, and ``BF16`` (Horovod's torch binding has no bfloat16 allreduce).
    ``FP16`` casts as Horovod's ``Compression.fp16`` does (beyond ±65504 becomes ±inf: the
    overflow stays visible). Non-floating-point tensors pass through unchanged, as in Horovod.
    """
    if not isinstance(compressor, Codec):
        raise TypeError(f"compressor must be a gradzip codec, got {type(compressor).__name__}")
    name = type(compressor).__name__
    if isinstance(compressor, BF16):
        raise ValueError(
            "BF16 cannot go through Horovod: its torch binding has no bfloat16 allreduce "
            "(ValueError 'Tensor type torch.BFloat16Tensor is not supported'); use "
            "gradzip.horovod.DistributedOptimizer(compression=gz.BF16()) on transport='torch', or FP16"
        )
    if not compressor.summable:
        raise ValueError(
            f"{name} cannot go through Horovod's allreduce: its payloads are not summable "
            "(index/value lists differ across ranks); use gradzip.horovod.DistributedOptimizer"
        )
    if compressor.biased:
        raise ValueError(
            f"{name} cannot go through Horovod's Compression interface: it is biased and needs per-parameter "
            "error feedback (and per-tensor state), which the static compress(tensor) cannot keep; "
            "use gradzip.horovod.DistributedOptimizer"
        )
    if compressor.protocol is not None:
        raise ValueError(
            f"{name} travels by its own protocol ({compressor.protocol}), which Horovod's single allreduce "
            "cannot carry; use gradzip.horovod.DistributedOptimizer"
        )
    if isinstance(compressor, FP16):

        def compress(tensor: torch.Tensor):
            if not tensor.is_floating_point():
                return tensor, None
            return tensor.to(torch.float16), tensor.dtype  # IEEE rounding: overflow is ±inf, as Horovod

        def decompress(tensor: torch.Tensor, ctx):
            return tensor if ctx is None else tensor.to(ctx)

    else:

        def compress(tensor: torch.Tensor):
            if not tensor.is_floating_point():
                return tensor, None
            p = compressor.compress(tensor)
            body = p.body
            if body.numel() == tensor.numel():
                body = body.reshape(tensor.shape)
            return body, _Ctx(p.shape, p.dtype, p.vdtype, p.fmt, p.scale)

        def decompress(tensor: torch.Tensor, ctx):
            if ctx is None:
                return tensor
            payload = Payload(
                body=tensor.reshape(-1),
                shape=ctx.shape,
                dtype=ctx.dtype,
                fmt=ctx.fmt,
                vdtype=ctx.vdtype,
                scale=ctx.scale,
            )
            return compressor.decompress(payload)

    return type(
        f"Horovod{name}",
        (HorovodCompressor,),
        {
            "__doc__": f"Horovod Compression running gradzip's {compressor!r}.",
            "gradzip_compressor": compressor,
            "compress": staticmethod(compress),
            "decompress": staticmethod(decompress),
        },
    )


class _CompressionMeta(type):
    def __getattr__(cls, name):
        if name == "bf16":
            raise AttributeError(
                "Compression.bf16 does not exist: Horovod's torch binding has no bfloat16 allreduce. Use "
                "gradzip.horovod.DistributedOptimizer(compression=gz.BF16()) (transport 'torch') instead"
            )
        raise AttributeError(f"type object 'Compression' has no attribute {name!r}")


class Compression(metaclass=_CompressionMeta):
    """Ready-made adapters, named as in ``horovod.torch.Compression``."""

    none = adapt(Identity())
    fp16 = adapt(FP16())


def _method(compression):
    """(gradzip method, error feedback default) for a ``compression=`` argument."""
    if compression is None:
        return Identity(), None
    if isinstance(compression, str):
        compression = parse(compression)
    if isinstance(compression, (Codec, Protocol)):
        return compression, None
    if isinstance(compression, type):
        codec = getattr(compression, "gradzip_compressor", None)
        if codec is None and compression.__module__.startswith("horovod."):
            codec = {"NoneCompressor": Identity(), "FP16Compressor": FP16()}.get(compression.__name__)
        if codec is not None:
            # FP16 saturates beyond ±65504; error feedback keeps the excess (never a silent clip).
            return codec, (True if isinstance(codec, FP16) else None)
    raise TypeError(
        f"compression must be a gradzip codec, protocol or method string, or Compression.none/fp16; got {compression!r}"
    )


# -- DistributedOptimizer --------------------------------------------------------------------
class _Engine(_GzOptimizer):
    """gradzip's DistributedOptimizer with Horovod's groups and sparse gradients."""

    def __init__(self, *a, groups=None, **kw) -> None:
        super().__init__(*a, **kw)
        self._sparse: dict = {}  # id(param) -> sparse_dim, for gradients that came sparse this step
        if groups is not None:
            self._regroup(groups)

    def _regroup(self, groups) -> None:
        """One bucket per Horovod group (split by dtype/device), ordered by first parameter in
        the reversed parameter order, as ``optim._buckets`` orders them."""
        name_of = {id(p): n for b in self._buckets for n, p in zip(b.names, b.params)}
        trainable = [p for g in self.param_groups for p in g["params"] if id(p) in name_of]  # optimizer order
        pos = {id(p): len(trainable) - 1 - i for i, p in enumerate(trainable)}  # reversed, as backward goes
        if isinstance(groups, int):
            n = args.integer("groups", groups, 1)
            k, m = divmod(len(trainable), n)  # horovod.common.util.split_list
            cut = [trainable[i * k + min(i, m) : (i + 1) * k + min(i + 1, m)] for i in range(n)]
        else:
            seen: set = set()
            cut = []
            for g in groups:
                for p in g:
                    if not isinstance(p, torch.Tensor):
                        raise ValueError("groups must consist of torch.Tensor")
                    if id(p) in seen:
                        raise ValueError("A parameter can only appear once in groups")
                    seen.add(id(p))
                cut.append([p for p in g if id(p) in pos])
            cut += [[p] for p in trainable if id(p) not in seen]
        parts = []
        for g in cut:
            by_kind: dict = {}
            for p in sorted(g, key=lambda p: pos[id(p)]):
                by_kind.setdefault((p.device, p.dtype), []).append(p)
            parts += list(by_kind.values())
        parts.sort(key=lambda ps: pos[id(ps[0])])
        self._buckets = [_Bucket(i, ps, [name_of[id(p)] for p in ps]) for i, ps in enumerate(parts)]
        self._where = {id(p): b for b in self._buckets for p in b.params}

    def _on_grad(self, p: torch.Tensor) -> None:
        if p.grad is not None and p.grad.is_sparse:
            self._sparse[id(p)] = (p, p.grad.sparse_dim())
            p.grad = p.grad.to_dense()
        super()._on_grad(p)

    def synchronize(self) -> None:
        try:
            super().synchronize()
        finally:
            sparse, self._sparse = self._sparse, {}
        for p, sd in sparse.values():
            p.grad = p.grad.to_sparse(sd)


class _HorovodOptimizer(FrontEnd):
    """The methods mixed into the subclass of the wrapped optimizer's class (see the module
    docstring), with the front-end surface of :class:`gradzip.frontend.FrontEnd`:
    ``state_dict()`` is the wrapped optimizer class's state dict plus ``"gradzip"`` (the
    engine's state), and ``load_state_dict`` takes that, or a plain optimizer state (the gradzip
    state is then kept)."""

    _gz: _Engine
    _engine_key = "gradzip"
    _engine_optional = True

    def add_param_group(self, param_group) -> None:
        if "_gz" in self.__dict__:
            raise RuntimeError("DistributedOptimizer cannot take new parameter groups; add them before wrapping")
        super().add_param_group(param_group)

    @property
    def backward_passes_per_step(self) -> int:
        return self._gz.backward_passes_per_step

    def set_backward_passes_per_step(self, passes: int) -> None:
        passes = args.integer("backward_passes_per_step", passes, 1)
        if self._gz._pending:
            raise RuntimeError("set_backward_passes_per_step() between backward() and step()")
        self._gz.backward_passes_per_step = passes

    def synchronize(self) -> None:
        self._gz.synchronize()

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        with self._gz.skip_synchronize():
            yield

    def step(self, closure=None):
        gz = self._gz
        if gz._should_synchronize:
            if gz._synchronized:
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(): synchronizing again.",
                    stacklevel=2,
                )
            self.synchronize()
        elif gz._pending:
            raise RuntimeError(
                "step() inside skip_synchronize() with gradients not yet synchronized; call synchronize() first"
            )
        gz._synchronized = False
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._gz._pending:
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                "optimizer.synchronize(); the gradients of this step are already being communicated"
            )
        super().zero_grad(set_to_none=set_to_none)

    @property
    def engine(self) -> Engine:
        """The engine of the gradzip optimizer underneath."""
        return self._gz.engine

    # -- state (the surface of gradzip.frontend.FrontEnd) ------------------------------------
    def _wrapped_state_dict(self) -> dict:
        return super(FrontEnd, self).state_dict()  # the wrapped optimizer class's own

    def _load_wrapped_state_dict(self, state_dict: dict) -> None:
        super(FrontEnd, self).load_state_dict(state_dict)

    def _check_loadable(self) -> None:
        if self._gz._pending:
            raise RuntimeError("load_state_dict() called in the middle of a step (after backward, before step())")


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    compression: Codec | Protocol | str | type = Compression.none,
    backward_passes_per_step: int = 1,
    op: int = Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: int | list[list[torch.Tensor]] | None = None,
    sparse_as_dense: bool = False,
    process_set: object = global_process_set,
    *,
    transport: str | None = None,
    error_feedback: bool | None = None,
    on_nonfinite: str = "skip",
    start_iter: int = 0,
    momentum_correction: bool = False,
    clip: float | None = None,
    bucket_mb: float = 25,
    check_parameters: bool = True,
) -> torch.optim.Optimizer:
    """Horovod's ``DistributedOptimizer`` (same signature and order; keyword-only extras after
    ``process_set``) on gradzip's engine. Returns an instance of a subclass of
    ``type(optimizer)`` that is also a :class:`gradzip.frontend.FrontEnd` (``stats``, ``routes``,
    ``log_every``, ``save``/``load``); see the module docstring."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, (_HorovodOptimizer, _GzOptimizer)):
        raise ValueError("optimizer is already a DistributedOptimizer; wrap the plain optimizer once")
    _check_process_set(process_set)
    op = int(op)
    if op not in (Average, Sum):
        raise ValueError(f"op={_OP_NAMES.get(op, op)}: gradzip averages or sums gradients (Average, Sum)")
    f = args.number("gradient_predivide_factor", gradient_predivide_factor, 0.0, lo_open=True)
    if f != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    args.integer("backward_passes_per_step", backward_passes_per_step, 1)
    args.integer("num_groups", num_groups, 0)
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups`.", DeprecationWarning, stacklevel=2)
        if groups is None:
            groups = num_groups
    if groups is not None and not isinstance(groups, list):
        args.integer("groups", groups, 1)
    args.flag("sparse_as_dense", sparse_as_dense)
    method, ef_default = _method(compression)
    if error_feedback is None:
        error_feedback = ef_default
    t = transport or _require()
    args.choice("transport", t, _TRANSPORTS)
    if t == "horovod":
        from .comm_horovod import HorovodCommunicator

        _horovod()
        inner = getattr(method, "codec", method)
        if getattr(inner, "wire_dtype", None) == torch.bfloat16:
            raise ValueError(
                f"{method!r} sends bfloat16, which Horovod's torch binding cannot carry; use transport='torch' or FP16"
            )
        comm = HorovodCommunicator()
        world = comm.world_size
    else:
        if not dist.is_initialized():
            raise ValueError("gradzip.horovod has not been initialized; use gradzip.horovod.init()")
        comm, world = None, dist.get_world_size()
    f_gz = 1.0 if f == 1.0 else f / world

    base = type(optimizer)
    cls = type(base.__name__, (_HorovodOptimizer, base), {"__module__": __name__})
    self = cls.__new__(cls)
    try:
        base.__init__(self, optimizer.param_groups)
    except TypeError:  # an optimizer whose constructor needs more than its parameters
        torch.optim.Optimizer.__init__(self, optimizer.param_groups, dict(optimizer.defaults))
    self.defaults = dict(optimizer.defaults)
    self.state.update(optimizer.state)
    self.sparse_as_dense = sparse_as_dense
    self.op = op
    self.gradient_predivide_factor = f
    self.process_set = process_set
    self._compression = compression
    self._gz = _Engine(
        self,
        named_parameters,
        compression=method,
        backward_passes_per_step=backward_passes_per_step,
        op="sum" if op == Sum else "average",
        gradient_predivide_factor=f_gz,
        bucket_mb=bucket_mb,
        process_group=comm,
        error_feedback=error_feedback,
        start_iter=start_iter,
        on_nonfinite=on_nonfinite,
        momentum_correction=momentum_correction,
        clip=clip,
        groups=groups,
        check_parameters=check_parameters,
    )
    return self
