"""``horovod.torch.optimizer``: Horovod's ``DistributedOptimizer`` on gradzip's engine.

It has Horovod 0.28.1's signature, argument order and semantics, and returns, as Horovod does,
an instance of a subclass of the wrapped optimizer's class (``isinstance(opt, torch.optim.SGD)``
holds) built anew on its parameter groups: state the wrapped optimizer already had is dropped,
as Horovod drops it. Underneath it is :class:`gradzip.optim.DistributedOptimizer` (buckets,
the engine, error feedback, byte stats):

* ``compression``: a gradzip codec, protocol or ``Policy``, a method string in the grammar of
  ``gradzip.parse`` (``"TopK(0.01)"``), or ``Compression.none``/``Compression.fp16`` (this
  package's or ``horovod.torch``'s; ``GRADZIP_COMPRESSION`` replaces these two, see
  :mod:`gradzip.horovod.compression`). ``fp16`` runs gradzip's ``FP16`` with error feedback:
  a finite value beyond ±65504 is sent saturated and its excess kept in the residual (never
  clipped silently); a NaN/Inf gradient takes the engine's non-finite path.
* ``op``: ``Average`` (default) or ``Sum``; ``Adasum`` gives Horovod's delta optimizer (each
  parameter's update ``-lr f(g)`` is combined by :func:`gradzip.horovod.mpi_ops.adasum_` when
  its gradient is ready; no compression, power-of-two worlds); ``Min``, ``Max``, ``Product``
  are refused. ``gradient_predivide_factor`` in Horovod's convention (the wire carries
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
  With ``on_nonfinite="skip"`` (the default) a step whose gradient held a NaN/Inf on any rank
  is skipped on every rank (``step()`` returns ``None``), where Horovod would step on NaN.

With the method chosen by ``GRADZIP_COMPRESSION``, rank 0 reports the choice once on stderr
when the first such optimizer is made, and at exit one line per such optimizer: its steps and
compression ratio (``GRADZIP_LOG_EVERY=N`` adds a line every ``N`` steps).
"""

from __future__ import annotations

import atexit
import os
import sys
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

import gradzip.args as args

from ..codecs.base import Codec
from ..engine import Engine
from ..frontend import FrontEnd
from ..optim import DistributedOptimizer as _GzOptimizer
from ..optim import _Bucket
from ..protocols.base import Protocol
from . import mpi_ops
from .compression import ENV, Compression, _horovod_kind, method_of
from .mpi_ops import OP_NAMES, TRANSPORTS, Adasum, Average, Sum, global_process_set

__all__ = ["DistributedOptimizer"]


def _check_process_set(process_set) -> None:
    if process_set is None or process_set is global_process_set:
        return
    if type(process_set).__module__.startswith("horovod.") and getattr(process_set, "process_set_id", None) == 0:
        return  # horovod.torch.global_process_set
    raise ValueError(f"gradzip.horovod.DistributedOptimizer supports the global process set only, got {process_set!r}")


# -- DistributedOptimizer --------------------------------------------------------------------
class _Engine(_GzOptimizer):
    """gradzip's DistributedOptimizer with Horovod's groups and sparse gradients."""

    _agree_hint = (
        "start every rank from the same weights: hvd.broadcast_parameters(model.state_dict(), root_rank=0) "
        "before the first step (or the same seed); DistributedOptimizer(..., check_parameters=False) skips this check"
    )

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
        if gz._skips():  # a NaN/Inf on some rank, on_nonfinite="skip": every rank leaves its step
            return None
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


_reported: dict = {"choice": False, "optimizers": []}


def _report_choice(method, compression) -> None:
    """Rank 0, once per process: which method GRADZIP_COMPRESSION put in place of what."""
    if _reported["choice"] or mpi_ops.rank() != 0:
        return
    _reported["choice"] = True
    was = f"Compression.{_horovod_kind(compression)}"
    print(
        f"gradzip.horovod: {ENV}={os.environ.get(ENV)!r}: DistributedOptimizer runs {method!r} "
        f"in place of {was} (Horovod's compression of this script)",
        file=sys.stderr,
        flush=True,
    )
    atexit.register(_report_ratios)


def _report_ratios() -> None:
    for name, opt in _reported["optimizers"]:
        try:
            s = opt.stats()
        except Exception:  # noqa: BLE001 - never fail an exit over a report
            continue
        print(
            f"gradzip.horovod: {name}: {s['steps']} steps, compression ratio {s['ratio']:.1f}x "
            f"({s['bytes_link_raw'] / 1e6:.2f} MB uncompressed, {s['bytes_link'] / 1e6:.2f} MB on the links)",
            file=sys.stderr,
            flush=True,
        )


def _log_line(step: int, s: dict) -> None:
    print(f"gradzip.horovod: step {step}: ratio {s['ratio']:.1f}x over the last {s['steps']} steps", file=sys.stderr)


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
    if isinstance(optimizer, (_HorovodOptimizer, _GzOptimizer, _AdasumOptimizer)):
        raise ValueError("optimizer is already a DistributedOptimizer; wrap the plain optimizer once")
    _check_process_set(process_set)
    op = int(op)
    f = args.number("gradient_predivide_factor", gradient_predivide_factor, 0.0, lo_open=True)
    if f != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if op not in (Average, Sum, Adasum):
        raise ValueError(f"op={OP_NAMES.get(op, op)}: gradzip averages or sums gradients (Average, Sum, Adasum)")
    args.integer("backward_passes_per_step", backward_passes_per_step, 1)
    args.integer("num_groups", num_groups, 0)
    if num_groups != 0:
        warnings.warn(
            "Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
            DeprecationWarning,
            stacklevel=2,
        )
        if groups is None:
            groups = num_groups
    if groups is not None and not isinstance(groups, list):
        args.integer("groups", groups, 1)
    args.flag("sparse_as_dense", sparse_as_dense)
    t = transport or mpi_ops.transport()
    args.choice("transport", t, TRANSPORTS)
    if op == Adasum and mpi_ops.size() > 1:
        return _adasum_optimizer(optimizer, named_parameters, compression, backward_passes_per_step, t)
    method, ef_default, source = method_of(compression)
    if error_feedback is None:
        error_feedback = ef_default
    if t == "horovod":
        from ..comm_horovod import HorovodCommunicator

        mpi_ops.horovod()
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
    self = _fresh(cls, base, optimizer)
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
    if source == "environment":
        _report_choice(method, compression)
        if mpi_ops.rank() == 0:
            _reported["optimizers"].append((f"{base.__name__} with {method!r}", self))
            every = int(os.environ.get("GRADZIP_LOG_EVERY", "0") or 0)
            if every > 0:
                self.log_every(every, _log_line)
    return self


def _fresh(cls, base, optimizer):
    """An instance of ``cls`` made on ``optimizer``'s parameter groups, as Horovod's
    ``cls(optimizer.param_groups, ...)``: the groups' hyper-parameters are kept, the wrapped
    optimizer's state is not (Horovod drops it too)."""
    self = cls.__new__(cls)
    try:
        base.__init__(self, optimizer.param_groups)
    except TypeError:  # an optimizer whose constructor needs more than its parameters
        torch.optim.Optimizer.__init__(self, optimizer.param_groups, dict(optimizer.defaults))
    self.defaults = dict(optimizer.defaults)
    return self


# -- Adasum ------------------------------------------------------------------------------------
class _AdasumOptimizer:
    """Horovod's delta optimizer for ``op=Adasum`` (mixed into a subclass of the wrapped class).

    When a parameter's gradient is ready (after ``backward_passes_per_step`` passes) the wrapped
    optimizer steps on that parameter alone from a zero start, which gives its update
    ``delta = -lr f(g)``; ``delta`` is combined over the ranks by Adasum and ``step()`` adds it
    to the parameter's value at the start of the step. ``synchronize()`` does nothing and
    ``skip_synchronize()`` raises, as in Horovod."""

    def _adasum_setup(self, named_parameters, compression, backward_passes_per_step) -> None:
        named = _named(self, named_parameters)
        self._compression = compression
        self._parameter_names = {p: n for n, p in sorted(named, key=lambda x: x[0])}
        self.backward_passes_per_step = backward_passes_per_step
        self._allreduce_delay = {p: backward_passes_per_step for _, p in named}
        self._handles: dict = {}
        self._requires_update: set = set()
        self._starting_models = {p: torch.zeros_like(p, requires_grad=False) for _, p in named}
        self._grad_accs = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    p.grad = p.data.new(p.size()).zero_()
                    self._requires_update.add(p)
                    acc = p.expand_as(p).grad_fn.next_functions[0][0]
                    acc.register_hook(self._adasum_hook(p))
                    self._grad_accs.append(acc)

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = args.integer("backward_passes_per_step", passes, 1)
        for p in self._allreduce_delay:
            self._allreduce_delay[p] = passes

    def _adasum_delta(self, p):
        start = self._starting_models[p]
        stashed = []
        for group in self.param_groups:
            stashed.append(group["params"])
            group["params"] = [p] if any(p is v for v in group["params"]) else []
        try:
            start.data.copy_(p)
            super().step()  # the wrapped class's step, on p alone
            p.data.sub_(start)
        finally:
            for s, group in zip(stashed, self.param_groups):
                group["params"] = s
        compressed, ctx = self._compression.compress(p.data)
        mpi_ops.adasum_(compressed)
        return compressed, ctx

    def _adasum_hook(self, p):
        def hook(*_):
            if p in self._handles and self._handles[p][0] is not None and self._allreduce_delay[p] <= 0:
                raise AssertionError(
                    "Gradients were computed more than backward_passes_per_step times before call to step(). "
                    "Increase backward_passes_per_step to accumulate gradients locally."
                )
            self._allreduce_delay[p] -= 1
            delta = None
            if self._allreduce_delay[p] == 0:
                delta = self._adasum_delta(p)
            self._handles[p] = delta

        return hook

    def synchronize(self) -> None:
        pass

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        raise AssertionError("Skipping synchronization is not supported when using Adasum optimizer.")
        yield  # pragma: no cover

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for p in sorted(self._requires_update - set(self._handles), key=lambda q: self._parameter_names[q]):
            self._handles[p] = self._adasum_delta(p)
        for p in sorted(self._handles, key=lambda q: self._parameter_names[q]):
            if self._handles[p] is None:
                self._handles[p] = self._adasum_delta(p)
            compressed, ctx = self._handles[p]
            delta = self._compression.decompress(compressed, ctx)
            start = self._starting_models[p]
            start.data.add_(delta.data)
            p.data.copy_(start)
            self._allreduce_delay[p] = self.backward_passes_per_step
        self._handles.clear()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._handles:
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
                "optimizer.synchronize(). This is prohibited as it can cause a race condition."
            )
        super().zero_grad(set_to_none=set_to_none)


def _named(opt, named_parameters) -> list:
    if named_parameters is not None:
        named = list(named_parameters)
    else:
        named = [(f"allreduce.noname.{i}", v) for g in opt.param_groups for i, v in enumerate(g["params"])]
    if any(not isinstance(p, tuple) for p in named):
        raise ValueError(
            "named_parameters should be a sequence of tuples (name, parameter), usually produced by "
            "model.named_parameters()."
        )
    seen, dups = set(), set()
    for k, _ in named:
        (dups if k in seen else seen).add(k)
    if dups:
        raise ValueError(f"Parameter names in named_parameters must be unique. Found duplicates: {', '.join(dups)}")
    named_ids = {id(v) for _, v in named}
    unnamed = [id(v) for g in opt.param_groups for v in g["params"] if id(v) not in named_ids]
    if unnamed:
        raise ValueError(
            "named_parameters was specified, but one or more model parameters were not named. Python object ids: "
            + ", ".join(str(i) for i in unnamed)
        )
    return named


def _adasum_optimizer(optimizer, named_parameters, compression, backward_passes_per_step, transport):
    if transport != "torch":
        raise ValueError("op=Adasum runs on transport='torch' (this build of Horovod has no Adasum operation)")
    n = mpi_ops.size()
    if n & (n - 1):
        raise NotImplementedError("Running Adasum with non-power of 2 ranks is not supported yet.")
    comp = Compression.none if compression is None else compression
    if not (isinstance(comp, type) and hasattr(comp, "compress") and hasattr(comp, "decompress")):
        raise ValueError(
            "op=Adasum combines whole updates: pass Compression.none or Compression.fp16 (Horovod's interface), "
            f"not {comp!r}"
        )
    base = type(optimizer)
    cls = type(base.__name__, (_AdasumOptimizer, base), {"__module__": __name__})
    self = _fresh(cls, base, optimizer)
    self._adasum_setup(named_parameters, comp, backward_passes_per_step)
    return self
