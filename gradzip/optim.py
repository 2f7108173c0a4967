"""Horovod-style DistributedOptimizer: gradient averaging without DDP.

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                               compression=gradzip.TopK(ratio=0.01))
    for x, y in data:
        opt.zero_grad()
        loss_fn(model(x), y).backward()   # buckets start communicating during backward
        opt.step()                        # waits, writes the averages into p.grad, steps

It is a thin adapter over :class:`gradzip.engine.Engine`, the pipeline the DDP
hook uses: same codecs and protocols, error feedback, byte accounting and ``state_dict``.

**Buckets.** The trainable parameters of the wrapped optimizer are cut into
buckets as DDP cuts them: in *reverse* order of the optimizer's parameter list
(backward produces the last layers' gradients first), one dtype and device per
bucket, each bucket closed as soon as it reaches ``bucket_mb`` MiB, except the
first, which is closed at ``min(1 MiB, bucket_mb)`` so that communication
starts early. The layout depends only on that list, so it is the same on every
rank (and, for models whose gradients become ready in reverse parameter order,
it is the layout DDP rebuilds after its first iteration).

**When communication starts.** A ``register_post_accumulate_grad_hook`` on each
parameter counts its backward passes. When a parameter has seen
``backward_passes_per_step`` of them its gradient is final for this step, and
when all of a bucket's parameters are final the bucket is ready. Buckets go to
the engine strictly in index order: when one becomes ready, every ready bucket
from the next unsubmitted index onward is submitted, stopping at the first that
is not ready (hooks may fire in a different order on different ranks; the
collectives may not). After the last bucket, ``engine.flush()`` issues what is
left of every protocol. So communication overlaps the rest of backward.

**synchronize()** submits, in order, every bucket still unsubmitted, waits for
all of them and writes the averages into ``p.grad``. A parameter with no
gradient on this rank this step (unused in the forward pass, or ``set_to_none``
and never reached) contributes zeros; after ``synchronize()`` its ``.grad`` holds
the average over the ranks, zeros if no rank had one. Ranks never wait for a
gradient that will not come, so an unused parameter cannot hang them.

**backward_passes_per_step = k** accumulates locally: ``p.grad`` sums the k
passes as usual, and the bucket is compressed and sent once, after the k-th, so
error feedback sees the accumulated gradient once. As in Horovod the k passes
are summed, not averaged: divide the loss by k for the average of k micro-batches.

**op and gradient_predivide_factor.** ``op="average"`` returns the mean over the
ranks, computed as the engine (and DDP) does: every rank divides by the world
size before the collective and the collective sums. ``op="sum"`` multiplies
that mean by the world size (equal to the sum up to rounding, except for world
sizes that are powers of two, where it is exact). ``gradient_predivide_factor=f``
additionally divides the gradient by ``f`` before compression and multiplies the
result by ``f``, so the wire carries ``g / (f * world_size)``. Note the
convention: Horovod's wire carries ``g / f_horovod``, so Horovod's
``f_horovod`` corresponds to ``f = f_horovod / world_size`` here; the default
``f = 1`` is what DDP does. With error feedback, keep ``f`` fixed over a run
(residuals are kept in the scaled units).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

import gradzip.args as args

from .codecs.base import Codec
from .codecs.cast import Identity
from .comm import Communicator
from .engine import Engine, check_real, layout_of
from .frontend import FrontEnd
from .momentum import Momentum
from .protocols.base import Protocol
from .sync import check_parameters_agree

__all__ = ["DistributedOptimizer"]

_OPS = ("average", "sum")
FIRST_BUCKET_BYTES = 2**20  # DDP's first bucket: small, so communication starts early


class _Bucket:
    __slots__ = ("index", "params", "names", "dtype", "offsets", "waiting", "future")

    def __init__(self, index: int, params: list, names: list) -> None:
        self.index = index
        self.params = params
        self.names = names
        self.dtype = params[0].dtype
        self.offsets = [0]
        for p in params:
            self.offsets.append(self.offsets[-1] + p.numel())
        self.waiting = len(params)  # parameters whose gradient is not final yet
        self.future = None


def _buckets(named: list, cap_bytes: float) -> list[tuple[list, list]]:
    """Cut ``named`` (already in reverse order) into buckets of one dtype and device.

    DDP's rule: a bucket is closed as soon as it reaches its cap, which is
    ``min(1 MiB, cap_bytes)`` for the first bucket of each dtype/device and
    ``cap_bytes`` after it. Buckets are ordered by their first parameter.
    """
    first_cap = min(float(FIRST_BUCKET_BYTES), cap_bytes)
    open_: dict = {}
    closed_keys: set = set()
    done: list = []  # (first position, params, names)
    for pos, (name, p) in enumerate(named):
        key = (p.device, p.dtype)
        b = open_.get(key)
        if b is None:
            b = open_[key] = [pos, [], [], 0]
        b[1].append(p)
        b[2].append(name)
        b[3] += p.numel() * p.element_size()
        if b[3] >= (cap_bytes if key in closed_keys else first_cap):
            done.append(b[:3])
            closed_keys.add(key)
            del open_[key]
    done.extend(b[:3] for b in open_.values())
    done.sort(key=lambda b: b[0])
    return [(b[1], b[2]) for b in done]


class DistributedOptimizer(FrontEnd, torch.optim.Optimizer):
    """Wrap ``optimizer`` so that ``step()`` uses gradients averaged over the ranks.

    Args:
        optimizer: any ``torch.optim.Optimizer``; its parameters are the ones averaged.
        named_parameters: ``(name, parameter)`` pairs, usually ``model.named_parameters()``.
            Names key the residuals and codec state and must be the same on
            every rank. Every trainable parameter of ``optimizer`` must be named;
            named parameters that ``optimizer`` does not hold are ignored. Default:
            ``"param.{group}.{index}"`` from the optimizer's parameter groups.
        compression: any gradzip codec or protocol, or its spec (``"TopK(0.01)"``; default
            ``Identity()``: a plain allreduce).
        backward_passes_per_step: backward passes accumulated locally per ``step()``,
            an integer in [1, inf).
        op: ``"average"`` or ``"sum"``.
        gradient_predivide_factor: a finite number in (0, inf); see the module docstring.
        bucket_mb: bucket size in MiB, a finite number in (0, inf).
        process_group: the process group (default: the global one).
        error_feedback: ``None`` turns it on for biased methods.
        start_iter: steps before this one use a plain allreduce.
        on_nonfinite: ``"skip"`` (a NaN/Inf in any rank's gradient makes the step's average
            NaN, leaves residuals untouched, and ``step()`` then returns ``None`` without
            stepping the wrapped optimizer, on every rank: parameters and optimizer state stay
            as they were) or ``"raise"``; see :class:`gradzip.engine.Engine`.
        momentum_correction: take over the wrapped ``torch.optim.SGD``'s momentum and weight
            decay (``Adam``/``AdamW``: its beta1) and apply them before compression
            (:mod:`gradzip.momentum`); other optimizers raise ``ValueError``.
        precondition: with momentum correction of an ``Adam``/``AdamW``, take its second
            moment over too, per rank, and compress Adam's step (:mod:`gradzip.momentum`).
        clip: local gradient clipping before compression (norm ``clip / sqrt(world_size)``
            per gradient).
        check_parameters: on the first step, before its first collective, check that every
            rank holds the same parameters (:func:`gradzip.sync.check_parameters_agree`, one
            small allreduce) and raise ``ValueError`` naming the first that differs. Start
            every rank alike with :func:`gradzip.sync.broadcast_parameters`.

    Like torch's ``PostLocalSGDOptimizer`` it delegates to the wrapped optimizer
    (``param_groups`` and ``state`` are the wrapped optimizer's own), so LR
    schedulers work on it. Create it before the first backward pass: the
    gradient hooks are registered here, on the parameters that require grad at
    that moment (the set is fixed from then on). ``remove_hooks()`` detaches them.

    The front-end surface (:class:`gradzip.frontend.FrontEnd`): ``stats``, ``routes``,
    ``log_every``, ``save``/``load``, and ``state_dict()``: the wrapped optimizer's state dict
    plus ``"gradzip"``, the engine's state (``load_state_dict`` refuses another rank's, and a
    call between ``backward()`` and ``step()``).
    """

    #: How to make the ranks' parameters agree, in the first step's check's message (None: gradzip's own).
    _agree_hint: str | None = None

    _engine_key = "gradzip"

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
        compression: Codec | Protocol | str | None = None,
        backward_passes_per_step: int = 1,
        op: str = "average",
        gradient_predivide_factor: float = 1.0,
        bucket_mb: float = 25,
        process_group: dist.ProcessGroup | Communicator | None = None,
        *,
        error_feedback: bool | None = None,
        start_iter: int = 0,
        on_nonfinite: str = "skip",
        momentum_correction: bool = False,
        clip: float | None = None,
        precondition: bool = False,
        check_parameters: bool = True,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, (DistributedOptimizer,)):
            raise ValueError("optimizer is already a DistributedOptimizer; wrap the plain optimizer once")
        compression = Identity() if compression is None else compression
        if isinstance(compression, str):
            from .registry import parse

            compression = parse(compression)
        if not isinstance(compression, (Codec, Protocol)):
            raise TypeError(f"compression must be a gradzip codec or protocol, got {type(compression).__name__}")
        bpps = args.integer("backward_passes_per_step", backward_passes_per_step, 1)
        args.choice("op", op, _OPS)
        f = args.number("gradient_predivide_factor", gradient_predivide_factor, 0.0, lo_open=True)
        bucket_mb = args.number("bucket_mb", bucket_mb, 0.0, lo_open=True)

        trainable = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        if named_parameters is None:
            names_of = {
                id(p): f"param.{gi}.{i}"
                for gi, g in enumerate(optimizer.param_groups)
                for i, p in enumerate(g["params"])
            }
        else:
            pairs = list(named_parameters)
            if any(not (isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str)) for x in pairs):
                raise ValueError("named_parameters must be (name, parameter) pairs, e.g. model.named_parameters()")
            seen: set = set()
            dups = sorted({n for n, _ in pairs if n in seen or seen.add(n)})
            if dups:
                raise ValueError(f"named_parameters has duplicate names: {dups}")
            names_of = {id(p): n for n, p in pairs}
            unnamed = [i for i, p in enumerate(trainable) if id(p) not in names_of]
            if unnamed:
                raise ValueError(
                    f"named_parameters does not name {len(unnamed)} of the optimizer's trainable parameters "
                    f"(positions {unnamed[:8]} in its parameter groups)"
                )
        check_real((names_of[id(p)], p) for p in trainable)
        if len({id(p) for p in trainable}) != len(trainable):
            raise ValueError("optimizer holds the same parameter twice")

        # Delegation, as torch's PostLocalSGDOptimizer does (no Optimizer.__init__).
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups
        self.defaults = optimizer.defaults
        self.compression = compression
        self.backward_passes_per_step = bpps
        self.op = op
        self.gradient_predivide_factor = float(f)
        self.bucket_mb = float(bucket_mb)

        named = [(names_of[id(p)], p) for p in reversed(trainable)]
        args.flag("momentum_correction", momentum_correction)
        if precondition and not momentum_correction:
            raise ValueError("precondition=True is part of momentum correction: pass momentum_correction=True too")
        if precondition and (op != "average" or f != 1.0):
            raise ValueError(
                "precondition=True hands the optimizer Adam's averaged step, which op='sum' or a "
                "gradient_predivide_factor would rescale: use op='average' and factor 1"
            )
        momentum, buffers = (
            Momentum.adopt(optimizer, named, precondition=precondition) if momentum_correction else (None, {})
        )
        self.engine = Engine(
            compression,
            process_group=process_group,
            start_iter=start_iter,
            error_feedback=error_feedback,
            on_nonfinite=on_nonfinite,
            layout=layout_of(named),
            momentum=momentum,
            clip=clip,
        )
        self.engine.adopt_momentum(buffers)
        self.engine.skip_guard = self.engine.on_nonfinite == "skip"  # step() skips a non-finite step
        world = self.engine.comm.world_size
        self._pre = 1.0 / f if f != 1.0 else None
        post = f * (world if op == "sum" else 1)
        self._post = post if post != 1.0 else None

        self._buckets = [_Bucket(i, ps, ns) for i, (ps, ns) in enumerate(_buckets(named, bucket_mb * 2**20))]
        self._where = {}  # id(param) -> bucket
        for b in self._buckets:
            for p in b.params:
                self._where[id(p)] = b
        self._passes = {id(p): 0 for p in trainable}
        self._next = 0  # next bucket to submit
        self._unchecked = (
            [(n, p) for b in self._buckets for n, p in zip(b.names, b.params)]
            if args.flag("check_parameters", check_parameters)
            else None
        )
        self._synchronized = False
        self._should_synchronize = True
        # The hooks hold the optimizer weakly: dropping it leaves inert hooks, not a live one.
        me = weakref.ref(self)

        def hook(p: torch.Tensor) -> None:
            opt = me()
            if opt is not None:
                opt._on_grad(p)

        self._handles = [p.register_post_accumulate_grad_hook(hook) for p in trainable]

    def remove_hooks(self) -> None:
        """Detach the gradient hooks (e.g. to wrap the same parameters differently); irreversible."""
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- delegation --------------------------------------------------------------------
    @property
    def state(self) -> dict:  # type: ignore[override]
        return self.optimizer.state

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r}, compression={self.compression!r})"

    def add_param_group(self, param_group: dict) -> None:
        raise RuntimeError("DistributedOptimizer cannot take new parameter groups; add them before wrapping")

    # -- gradient hooks ----------------------------------------------------------------
    def _on_grad(self, p: torch.Tensor) -> None:
        if p.grad is not None and p.grad.is_sparse:
            raise RuntimeError("DistributedOptimizer does not support sparse gradients")
        key = id(p)
        self._passes[key] += 1
        n = self._passes[key]
        if n > self.backward_passes_per_step:
            raise RuntimeError(
                f"a gradient was computed {n} times before step()/synchronize(), but backward_passes_per_step="
                f"{self.backward_passes_per_step}; raise backward_passes_per_step to accumulate more passes"
            )
        if n == self.backward_passes_per_step:
            b = self._where[key]
            b.waiting -= 1
            if b.waiting == 0:
                self._submit_ready()

    def _submit_ready(self) -> None:
        """Submit every ready bucket from the next unsubmitted index on, in order."""
        while self._next < len(self._buckets) and self._buckets[self._next].waiting == 0:
            self._submit(self._buckets[self._next])

    def _submit(self, b: _Bucket) -> None:
        if self._unchecked is not None:  # the first step's first bucket, on every rank
            named, self._unchecked = self._unchecked, None
            check_parameters_agree(named, comm=self.engine.comm, hint=self._agree_hint)
        grads = []
        for p in b.params:
            g = p.grad if p.grad is not None else torch.zeros_like(p, memory_format=torch.contiguous_format)
            grads.append(g.div(self.gradient_predivide_factor) if self._pre is not None else g)
        b.future = self.engine.reduce(
            b.names, grads, out_dtype=b.dtype, params=b.params if self.engine.momentum is not None else None
        )
        self._next += 1
        if self._next == len(self._buckets):
            self.engine.flush()

    # -- the step ----------------------------------------------------------------------
    def synchronize(self) -> None:
        """Finish communication and write the averaged gradients into ``p.grad``.

        Buckets not submitted yet (missing gradients, or fewer backward passes
        than ``backward_passes_per_step``) are submitted now, in order, with the
        gradients they have (zeros where a parameter has none).
        """
        while self._next < len(self._buckets):
            self._submit(self._buckets[self._next])
        try:
            with torch.no_grad():
                for b in self._buckets:
                    flat = b.future.wait()
                    if self._post is not None:
                        flat = flat.mul(self._post)
                    for i, p in enumerate(b.params):
                        avg = flat[b.offsets[i] : b.offsets[i + 1]].view(p.shape)
                        if p.grad is None:
                            p.grad = avg.clone()
                        else:
                            p.grad.copy_(avg)
        finally:
            self.engine.end_step()
            self._reset()
        self._synchronized = True

    def _reset(self) -> None:
        for b in self._buckets:
            b.waiting = len(b.params)
            b.future = None
        for k in self._passes:
            self._passes[k] = 0
        self._next = 0

    @property
    def _pending(self) -> bool:
        return any(n for n in self._passes.values()) or self._next > 0

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``step()`` inside this context does not synchronize (call ``synchronize()`` first).

        opt.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with opt.skip_synchronize():
            opt.step()
        """
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        if self._should_synchronize:
            if self._synchronized:
                warnings.warn(
                    "step() called after synchronize() outside skip_synchronize(): synchronizing again. "
                    "Use `with opt.skip_synchronize(): opt.step()` after an explicit synchronize().",
                    stacklevel=2,
                )
            self.synchronize()
        elif self._pending:
            raise RuntimeError(
                "step() inside skip_synchronize() with gradients not yet synchronized; call synchronize() first"
            )
        self._synchronized = False
        if self._skips():
            return None
        return self.optimizer.step(closure)

    def _skips(self) -> bool:
        """Whether ``step()`` leaves the wrapped optimizer alone: the step just synchronized held
        a NaN/Inf on some rank (every rank sees the same verdict) and ``on_nonfinite="skip"``."""
        return self.engine.skip_guard and self.engine.last_step_nonfinite

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._pending:
            raise RuntimeError(
                "zero_grad() called after backward() but before step() or synchronize(); "
                "the gradients of this step are already being communicated"
            )
        self.optimizer.zero_grad(set_to_none=set_to_none)

    # -- state (the surface of gradzip.frontend.FrontEnd) ------------------------------------
    def _wrapped_state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def _load_wrapped_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def _check_loadable(self) -> None:
        if self._pending:
            raise RuntimeError("load_state_dict() called in the middle of a step (after backward, before step())")
