"""Local SGD and DiLoCo: each rank steps on its own and the models are averaged now and then.

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = LocalSGD(opt, model, period=schedules.PostLocal(warmup_steps=500, period=8),
                   compression=gradzip.TopK(0.01), overlap=True)
    for x, y in data:
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()
    opt.synchronize()          # drain the pipeline: every rank now holds the same model

    # DiLoCo: an outer optimizer (SGD, Nesterov, lr 0.7, momentum 0.9) on the averaged
    # pseudo-gradient every 32 steps, sent in int8 with error feedback; streaming: 4
    # fragments synced in turn, each reduce overlapping 2 inner steps, merged with alpha.
    opt = DiLoCo(torch.optim.AdamW(model.parameters(), lr=4e-4), model, period=32,
                 compression=gradzip.Int8(), fragments=4, delay=2, alpha=0.5)

What is averaged is the model *delta* since the last push (parameters and
floating-point buffers such as BatchNorm's running statistics; integer buffers
are left alone), through any gradzip codec or protocol with error feedback, by the
:class:`gradzip.engine.Engine` that the DDP hook and the DistributedOptimizer
use. The exact update rules are in ``docs/local_sgd.md``; in short, each rank keeps

* ``G``, the global model: identical on every rank; it changes only when a push is
  *collected*: by ``G <- G + D`` (plain averaging, ``D`` the averaged delta), or by an
  **outer optimizer** step on the pseudo-gradient ``-D`` (DiLoCo; buffers are always
  averaged plainly);
* ``B``, the base: the local model minus the progress not yet pushed;
* ``x``, the local model (the module's own tensors).

At a **push** (``push_every``, default ``period``): ``d = x - B`` is handed to the
engine, ``B <- x``. Its average ``D`` is *collected* at once, or with ``overlap=True``
at the next push, so that it travels while the next local steps compute. At a
**pull** (``pull_every``, default ``period``) after a collect:
``e = x - B; B <- G + d_inflight; x <- B + e``: the local model adopts the global
one and keeps its own unpushed progress ``e``. Pulls are local; only pushes communicate.

**Streaming** (``fragments``, ``delay``, ``alpha``): the tensors, laid end to end in
module order, are cut into ``fragments`` runs of equal bytes, inside tensors where needed
(:func:`gradzip.schedules.split_fragments`): a fragment is a list of *pieces*, each a
contiguous range of one flattened tensor, named ``"name"`` when whole and
``"name[start:stop]"`` (elements) otherwise. Fragments are synchronized in turn
(:class:`gradzip.schedules.Streaming`): fragment ``f`` is pushed ``delay`` steps before
its sync step, its reduce travels while those inner steps compute, and at the sync step
the outer step runs on its part of ``G`` and the local fragment is merged:
``x <- (1 - alpha) * G + alpha * x`` (torchft's ``lerp``), ``B <- G``. ``G``, ``B``,
the residuals and the outer optimizer's state are kept per piece (the outer optimizer
steps each piece of ``G`` as a parameter of its own).

All ranks must start from the same parameters and buffers (same seed, or
broadcast them before wrapping).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

import gradzip.args as args

from .checkpoint import reshard
from .codecs.base import Codec
from .codecs.cast import Identity
from .codecs.chunked import ChunkTopK
from .engine import Engine, check_real, layout_of
from .frontend import FrontEnd
from .protocols.base import Protocol
from .registry import register_frontend
from .schedules import Constant, Streaming, as_schedule, long_run_period, split_fragments
from .sync import check_parameters_agree

__all__ = ["LocalSGD", "DiLoCo", "SparseLoCo", "DILOCO_OUTER", "SPARSELOCO_OUTER", "reshard_state"]

STATE_VERSION = 4  # 4: with the engine's state version 3 (the error decay recorded)

#: DiLoCo's outer optimizer (Douillard et al. 2023): ``torch.optim.SGD`` with these arguments.
DILOCO_OUTER = {"lr": 0.7, "momentum": 0.9, "nesterov": True}


#: ``outer=``: an optimizer class, or a factory ``params -> optimizer``.
OuterOptimizer = Callable[..., torch.optim.Optimizer]


def _outer_factory(outer, outer_kwargs):
    """``None`` (plain averaging) or a function ``params -> torch.optim.Optimizer``."""
    if outer_kwargs is not None and not isinstance(outer_kwargs, dict):
        raise TypeError(
            f"outer_kwargs must be a dict of the outer optimizer's arguments, got {type(outer_kwargs).__name__}"
        )
    if isinstance(outer, torch.optim.Optimizer):
        raise TypeError(
            "outer must be an optimizer class or a factory params -> optimizer (e.g. "
            "lambda params: torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)), not an optimizer "
            "instance: the outer optimizer steps LocalSGD's global copy of the model, which it builds itself"
        )
    if outer is None:
        if outer_kwargs is None:
            return None
        outer = torch.optim.SGD
    if not callable(outer):
        raise TypeError(f"outer must be None, an optimizer class or a factory params -> optimizer, got {outer!r}")
    kw = dict(outer_kwargs or {})
    return lambda params: outer(params, **kw)


class _Checked(NamedTuple):
    """:meth:`LocalSGD._checked`'s arguments, checked and turned into what the constructor keeps."""

    compression: Codec | Protocol
    make_outer: Callable | None
    fragments: int
    delay: int
    alpha: float
    streaming: Streaming | None
    push_at: Callable[[int], bool]
    pull_at: Callable[[int], bool]


#: The constructor's arguments that :meth:`LocalSGD._checked` takes besides ``period``, with the
#: defaults a spec that leaves them out gets.
_SPEC_DEFAULTS = dict(
    compression=None,
    overlap=False,
    push_every=None,
    pull_every=None,
    outer=None,
    outer_kwargs=None,
    fragments=1,
    delay=0,
    alpha=0.0,
)


class Piece(NamedTuple):
    """A contiguous range ``[start, stop)`` of the flattened tensor ``name`` (elements)."""

    key: str  # ``name`` when whole, else ``name[start:stop]``
    name: str
    start: int
    stop: int
    whole: bool

    def of(self, t: torch.Tensor) -> torch.Tensor:
        """The piece of ``t`` (a view: writes reach ``t``; whole: ``t`` itself, in its shape)."""
        return t if self.whole else t.view(-1)[self.start : self.stop]


def _brief(opt: torch.optim.Optimizer) -> str:
    """``SGD(lr=0.7, momentum=0.9, nesterov=True)``: an optimizer's class and first group's main settings."""
    g = opt.param_groups[0] if opt.param_groups else {}
    keys = ("lr", "momentum", "nesterov", "betas", "weight_decay")
    shown = [f"{k}={g[k]!r}" for k in keys if k in g and g[k] not in (0, False)]
    return f"{type(opt).__name__}({', '.join(shown)})"


@register_frontend
class LocalSGD(FrontEnd, torch.optim.Optimizer):
    """Wrap ``optimizer`` so that ``step()`` steps locally and averages ``model`` on a schedule.

    Args:
        optimizer: the local (inner) optimizer (any ``torch.optim.Optimizer``).
        model: the module whose parameters and floating-point buffers are averaged.
        period: when to synchronize: an integer in [1, inf) (``Constant``), a
            :mod:`gradzip.schedules` schedule, or any callable ``step -> bool``
            (``step`` counts local steps from 1). Every rank must give the same answers.
        compression: a gradzip codec or protocol for the deltas (default ``Identity()``),
            with error feedback for biased ones: what it drops is sent later.
        overlap: collect each average at the next push instead of at once, so it
            travels while the next local steps compute.
        process_group: the group the averages run on (default: the global one). When a
            worker is itself a DDP/FSDP group, this is the group that joins one rank of
            each worker (the ranks that hold the same shard): see ``docs/local_sgd.md``.
        push_every: when to push deltas (default: ``period``); same forms as ``period``.
        pull_every: when to pull the global model (default: ``period``); same forms.
        error_feedback: ``None`` turns it on for biased methods.
        error_decay: ``beta`` in ``(0, 1]``: the residual a push adds is ``beta * r``
            (:mod:`gradzip.feedback`); SparseLoCo's decaying error buffer is
            ``DiLoCo(..., compression=ChunkTopK(32, chunk=64, values="q2"), error_decay=0.95,
            outer_kwargs={"lr": 1.0, "momentum": 0.0, "nesterov": False})`` (``docs/lm.md``).
        outer: the outer optimizer: ``None`` (with ``outer_kwargs=None``: plain averaging,
            ``G <- G + D``), an optimizer class, or a factory ``params -> optimizer``,
            called with the global copy of the parameters (and ``**outer_kwargs``). It steps
            on the pseudo-gradient ``-D`` (global minus the averaged local model).
        outer_kwargs: arguments of ``outer``; with ``outer=None`` they are
            ``torch.optim.SGD``'s (``{"lr": 1.0}`` is plain averaging, bit for bit).
        fragments: streaming: cut the model into this many fragments of equal bytes
            (inside tensors where needed), synchronized in turn; ``period`` must be an
            integer multiple of it.
        delay: streaming: inner steps each fragment's reduce overlaps (``0 <= delay <
            period / fragments``).
        alpha: streaming: merge weight of the local fragment at its sync,
            ``x <- (1 - alpha) * G + alpha * x``.
        check_parameters: on the first ``step()``, check that every rank holds the same
            global model ``G`` (taken from ``model`` here, or from a loaded checkpoint):
            one small allreduce (:func:`gradzip.sync.check_parameters_agree`), raising
            ``ValueError`` naming the first tensor that differs.

    ``param_groups`` and ``state`` are the wrapped optimizer's, so LR schedulers work;
    ``outer`` is the outer optimizer (``None`` for plain averaging).
    A NaN/Inf in any rank's delta raises ``FloatingPointError`` on every rank
    (averaging it would poison every model).

    The front-end surface (:class:`gradzip.frontend.FrontEnd`): ``stats``, ``routes``,
    ``log_every`` (its steps are the syncs), ``save``/``load``, ``check_owner``, and
    ``state_dict()``: the wrapped optimizer's state dict plus ``"local_sgd"`` and
    ``"gradzip"`` (the engine's state).
    """

    _engine_key = "gradzip"
    _own_keys = ("local_sgd",)

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: torch.nn.Module,
        period: int | Callable[[int], bool] = 1,
        compression: Codec | Protocol | None = None,
        overlap: bool = False,
        process_group: dist.ProcessGroup | None = None,
        *,
        push_every: int | Callable[[int], bool] | None = None,
        pull_every: int | Callable[[int], bool] | None = None,
        error_feedback: bool | None = None,
        error_decay: float = 1.0,
        outer: OuterOptimizer | None = None,
        outer_kwargs: dict | None = None,
        fragments: int = 1,
        delay: int = 0,
        alpha: float = 0.0,
        check_parameters: bool = True,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        c = self._checked(
            period, compression, overlap, push_every, pull_every, outer, outer_kwargs, fragments, delay, alpha
        )
        compression, make_outer, fragments, delay, alpha = c.compression, c.make_outer, c.fragments, c.delay, c.alpha
        self.streaming: Streaming | None = c.streaming
        self.push_at, self.pull_at = c.push_at, c.pull_at

        check_real((n, p) for n, p in model.named_parameters() if p.is_complex())
        entries = self._named_tensors(model)
        if not entries:
            raise ValueError("model has no floating-point parameters or buffers to average")
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups
        self.defaults = optimizer.defaults
        self.model = model
        self.overlap = overlap
        self.compression = compression
        self.fragments, self.delay, self.alpha = fragments, delay, alpha
        self._names = [n for n, _ in entries]
        # Fragments: the tensors laid end to end in module order, cut into runs of equal
        # bytes (inside a tensor where a cut falls in it; never inside a non-contiguous
        # one, whose flat view could not be written); within a fragment, the pieces in
        # ``_names`` order. One fragment: every tensor whole, as before streaming.
        order = self._module_order(model, self._names)
        ts = [entries[i][1] for i in order]
        runs = split_fragments(
            [t.numel() * t.element_size() for t in ts],
            fragments,
            granule=[t.element_size() if t.is_contiguous() else t.numel() * t.element_size() for t in ts],
        )
        self._fragments: list[list[Piece]] = []
        place = {n: i for i, n in enumerate(self._names)}
        for run in runs:
            pieces = []
            for j, start, stop in run:
                t = ts[j]
                start, stop = start // t.element_size(), stop // t.element_size()
                name = self._names[order[j]]
                whole = start == 0 and stop == t.numel()
                pieces.append(Piece(name if whole else f"{name}[{start}:{stop}]", name, start, stop, whole))
            pieces.sort(key=lambda p: (place[p.name], p.start))
            self._fragments.append(pieces)
        self._pieces = [p for f in self._fragments for p in f]
        self._keys = [p.key for p in self._pieces]
        # per fragment: [(keys, dtype)], one engine call each
        self._groups = [self._dtype_groups(f, dict(entries)) for f in self._fragments]
        with torch.no_grad():
            tensor_of = dict(entries)
            self._global = {p.key: p.of(tensor_of[p.name].detach()).clone() for p in self._pieces}
            self._base = {k: g.clone() for k, g in self._global.items()}
        self.engine = Engine(
            compression,
            process_group=process_group,
            error_feedback=error_feedback,
            error_decay=error_decay,
            on_nonfinite="raise",
            layout=layout_of(self._global.items()),  # the pieces: every rank must cut alike
        )
        params = {n for n, _ in model.named_parameters()}
        # The outer optimizer's parameters: each piece of a parameter, in fragment order
        # (buffers are averaged plainly). One fragment: model.named_parameters() order.
        self._outer_keys = [p.key for p in self._pieces if p.name in params]
        self.outer = None
        if make_outer is not None:
            self.outer = make_outer([self._global[k] for k in self._outer_keys])
            if not isinstance(self.outer, torch.optim.Optimizer):
                raise TypeError(f"outer must build a torch.optim.Optimizer, it built {type(self.outer).__name__}")
            got = {id(p) for g in self.outer.param_groups for p in g["params"]}
            if got != {id(self._global[k]) for k in self._outer_keys}:
                raise ValueError("the outer optimizer must optimize exactly the parameters it is given")
        # A push in flight: {"frag", "futures", "delta": {n: d}, "flushed", "avg": {n: D} once waited}.
        self._inflight: dict | None = None
        self._pull_pending = False
        self._aligned = True  # every rank holds x == G and nothing is in flight
        self.local_step = 0
        self._check_parameters = args.flag("check_parameters", check_parameters)

    # -- delegation --------------------------------------------------------------------
    @property
    def state(self) -> dict:  # type: ignore[override]
        return self.optimizer.state

    def __repr__(self) -> str:
        parts = [_brief(self.optimizer)]
        if self.streaming is not None:
            parts += [
                f"period={self.streaming.period}",
                f"fragments={self.fragments}",
                f"delay={self.delay}",
                f"alpha={self.alpha}",
            ]
        elif self.push_at is self.pull_at:
            p = self.push_at
            parts.append(f"period={p.period if isinstance(p, Constant) else p!r}")
        else:
            parts += [f"push_at={self.push_at!r}", f"pull_at={self.pull_at!r}"]
        parts.append(f"compression={self.compression!r}")
        if self.overlap:
            parts.append("overlap=True")
        parts.append(f"outer={_brief(self.outer) if self.outer is not None else None}")
        return f"{type(self).__name__}({', '.join(parts)})"

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict) -> None:
        self.optimizer.add_param_group(param_group)

    # -- tensors -----------------------------------------------------------------------
    @staticmethod
    def _named_tensors(model: torch.nn.Module) -> list:
        out = [(n, p) for n, p in model.named_parameters() if p.is_floating_point()]
        out += [(n, b) for n, b in model.named_buffers() if b.is_floating_point()]
        return out

    @staticmethod
    def _module_order(model: torch.nn.Module, names: list) -> list:
        """Indices into ``names`` in module order (a module's parameters, then its buffers)."""
        where = {n: i for i, n in enumerate(names)}
        order = []
        for prefix, mod in model.named_modules():
            for local, _ in list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False)):
                i = where.pop(f"{prefix}.{local}" if prefix else local, None)
                if i is not None:
                    order.append(i)
        return order + sorted(where.values())

    @staticmethod
    def _dtype_groups(pieces, tensor_of) -> list:
        groups: dict = {}
        for p in pieces:
            t = tensor_of[p.name]
            groups.setdefault((t.device, t.dtype), []).append(p.key)
        return [(keys, dtype) for (_, dtype), keys in groups.items()]

    def _views(self, pieces=None) -> list:
        """The model's current tensors' pieces (views), by name (a module may have replaced
        a buffer object)."""
        now = dict(self._named_tensors(self.model))
        try:
            return [p.of(now[p.name].detach()) for p in (self._pieces if pieces is None else pieces)]
        except KeyError as e:
            raise RuntimeError(f"model tensor {e.args[0]!r} is gone since LocalSGD was created") from None

    @property
    def in_flight(self) -> bool:
        """Whether a pushed average has not been collected yet (``overlap=True`` or ``delay > 0``)."""
        return self._inflight is not None

    @property
    def fragment_names(self) -> list:
        """The pieces of each fragment (one fragment without streaming): a tensor's name
        when the piece is the whole tensor, else ``"name[start:stop]"``, the elements
        ``start`` to ``stop`` of the flattened tensor."""
        return [[p.key for p in f] for f in self._fragments]

    # -- the step ----------------------------------------------------------------------
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        if self._check_parameters:  # the first step, on every rank, before any push
            self._check_parameters = False
            check_parameters_agree(list(self._global.items()), comm=self.engine.comm, what="global model tensors")
        loss = self.optimizer.step(closure)
        self.local_step += 1
        t = self.local_step
        self._progress()
        if self.streaming is not None:
            return self._streaming_step(t, loss)
        pushed = bool(self.push_at(t))
        if pushed:
            self._collect()
            self._push(0, collect_in=None if self.overlap else 0)
            if not self.overlap:
                self._collect()
        pulled = bool(self.pull_at(t)) and self._pull()
        self._aligned = pushed and pulled and self._inflight is None
        return loss

    def _streaming_step(self, t: int, loss):
        f = self.streaming.prepared(t)
        if f is not None:
            self._push(f, collect_in=self.delay)
        g = self.streaming.synced(t)
        if g is not None:
            self._collect()
            self._merge(g)
        self._aligned = g is not None and self.fragments == 1 and self.alpha == 0 and self._inflight is None
        return loss

    @torch.no_grad()
    def synchronize(self) -> None:
        """Collect what is in flight, push what is left, pull: every rank then holds ``x == G``.

        Streaming: the fragment in flight is collected and merged as at its sync step,
        then every fragment is pushed and collected (one outer step each) and ``x <- G``.
        A collective: every rank must call it at the same point.
        """
        if self._aligned:
            return
        if self.streaming is not None:
            if self._inflight is not None:
                f = self._inflight["frag"]
                self._collect()
                self._merge(f)
            for f in range(self.fragments):
                self._push(f, collect_in=0)
                self._collect()
            for k, t in zip(self._keys, self._views()):
                t.copy_(self._global[k])
                self._base[k].copy_(self._global[k])
            self._pull_pending = False
        else:
            self._collect()
            self._push(0, collect_in=0)
            self._collect()
            self._pull()
        self._aligned = True

    @torch.no_grad()
    def _push(self, frag: int, collect_in: int | None) -> None:
        """Hand fragment ``frag``'s delta ``x - B`` to the engine; ``B <- x``.

        ``collect_in``: local steps until it is collected (``None``: unknown). The engine
        issues every collective's first round now. On a backend that defers later rounds
        to ``flush()`` (gloo: waiting on a round blocks the host) and a collect two or more
        steps away, the flush waits for the next ``step()``: by then the first round (the
        size exchange and the non-finite flag, or the whole payload for an allreduce) has
        completed during that step's forward and backward, and the payload travels during
        the remaining steps. Otherwise it flushes now (NCCL waits on the device).
        """
        assert self._inflight is None, "a push is already in flight"
        pieces = self._fragments[frag]
        keys = [p.key for p in pieces]
        tensors = self._views(pieces)
        deltas = {k: t - self._base[k] for k, t in zip(keys, tensors)}
        futures = [
            self.engine.reduce(gkeys, [deltas[k] for k in gkeys], out_dtype=dtype)
            for gkeys, dtype in self._groups[frag]
        ]
        self._inflight = {"frag": frag, "futures": futures, "delta": deltas, "flushed": False}
        if not self.engine.comm.defer or (collect_in is not None and collect_in <= 1):
            self._progress()
        for k, t in zip(keys, tensors):
            self._base[k].copy_(t)

    def _progress(self) -> None:
        """Issue the deferred rounds of the push in flight and close its engine step."""
        inf = self._inflight
        if inf is not None and not inf["flushed"]:
            self.engine.flush()
            self.engine.end_step()
            inf["flushed"] = True

    def _average(self) -> dict:
        """The in-flight push's average per tensor (waits for it; issues only its deferred rounds)."""
        inf = self._inflight
        if "avg" not in inf:
            self._progress()
            avg = {}
            for fut, (gkeys, _) in zip(inf["futures"], self._groups[inf["frag"]]):
                flat, pos = fut.wait(), 0
                for k in gkeys:
                    d = inf["delta"][k]
                    avg[k] = flat[pos : pos + d.numel()].view(d.shape)
                    pos += d.numel()
            inf["avg"] = avg
            inf["futures"] = None
        return inf["avg"]

    @torch.no_grad()
    def _collect(self) -> None:
        """Apply the in-flight average to ``G``: the outer step on ``-D``, or ``G <- G + D``."""
        if self._inflight is None:
            return
        avg = self._average()
        keys = [p.key for p in self._fragments[self._inflight["frag"]]]
        if self.outer is None:
            for k in keys:
                self._global[k].add_(avg[k])
        else:
            stepped = set(keys)
            for k in self._outer_keys:
                if k in stepped:
                    self._global[k].grad = avg[k].neg()  # the pseudo-gradient: global - mean(local)
            for k in keys:
                if self._global[k].grad is None:  # a buffer: averaged plainly
                    self._global[k].add_(avg[k])
            self.outer.step()
            self.outer.zero_grad(set_to_none=True)
        self._inflight = None
        self._pull_pending = True

    @torch.no_grad()
    def _pull(self) -> bool:
        if not self._pull_pending:
            return False  # G and the own in-flight delta are as at the last pull: nothing to adopt
        inflight = self._inflight["delta"] if self._inflight is not None else None
        for k, t in zip(self._keys, self._views()):
            base = self._base[k]
            e = t - base  # local progress not pushed yet
            base.copy_(self._global[k])
            if inflight is not None:
                base.add_(inflight[k])
            t.copy_(base + e)
        self._pull_pending = False
        return True

    @torch.no_grad()
    def _merge(self, frag: int) -> None:
        """Streaming: ``x <- lerp(G, x, alpha)``, ``B <- G`` on fragment ``frag``."""
        pieces = self._fragments[frag]
        for p, t in zip(pieces, self._views(pieces)):
            g = self._global[p.key]
            if self.alpha == 0:
                t.copy_(g)
            else:
                t.copy_(torch.lerp(g, t, self.alpha))
            self._base[p.key].copy_(g)
        self._pull_pending = False

    # -- state (the surface of gradzip.frontend.FrontEnd) ------------------------------------
    def stats(self, reset: bool = False) -> dict:
        """The engine's stats with ``steps`` = local steps and ``syncs`` = pushes (fragment pushes);
        ``reset=True``: those since the previous ``stats(reset=True)``.

        ``ratio`` means what it means on every front end: the bytes plain DDP would have sent
        over the same steps (a ring allreduce of every parameter's gradient at every local step,
        ``bytes_link_raw``; ``bytes_raw`` handed over) over the bytes sent (``bytes_link``;
        ``ratio_handed`` against ``bytes_sent``). The average of the deltas against an
        uncompressed allreduce of the same deltas, sync by sync, is ``ratio_per_sync`` (from
        ``bytes_link_raw_per_sync`` and ``bytes_raw_per_sync``)."""
        d = super().stats(reset=reset)
        steps = self.local_step
        if reset:
            steps, self._steps_mark = self.local_step - getattr(self, "_steps_mark", 0), self.local_step
        world = self.engine.comm.world_size
        grad_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters() if p.requires_grad)
        d["syncs"] = d["steps"]
        d["steps"] = steps
        d["bytes_raw_per_sync"], d["bytes_link_raw_per_sync"] = d["bytes_raw"], d["bytes_link_raw"]
        d["ratio_per_sync"] = d["ratio"]
        d["bytes_raw"] = grad_bytes * steps
        d["bytes_link_raw"] = 2 * (world - 1) / world * grad_bytes * steps if world > 1 else 0.0
        d["ratio"] = d["bytes_link_raw"] / d["bytes_link"] if d["bytes_link"] else 1.0
        d["ratio_handed"] = d["bytes_raw"] / d["bytes_sent"] if d["bytes_sent"] else 1.0
        d["bytes_sent_per_step"] = d["bytes_sent"] / steps if steps else 0.0
        return d

    def state_dict(self) -> dict:
        """The wrapped optimizer's state dict plus ``"local_sgd"`` and ``"gradzip"`` (the engine).

        An average still in flight is waited for and saved uncollected, so a resumed
        run collects it where the unbroken run would. Waiting issues no collective of
        its own, but a push whose later rounds were deferred to the next ``step()``
        (gloo) issues them now, as that step would: call ``state_dict()`` on every rank
        at the same step. Tensors and plain values only: ``torch.load(weights_only=True)``.
        The model's own tensors are not included: save ``model.state_dict()`` too.
        """
        return super().state_dict()

    def _wrapped_state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def _load_wrapped_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def _own_state_dict(self) -> dict:
        """``{"local_sgd": ...}``: the global model, the base, the push in flight, the outer state."""
        inflight_delta, inflight_avg, frag = {}, {}, -1
        if self._inflight is not None:
            inflight_avg = {n: v.clone() for n, v in self._average().items()}
            inflight_delta = {n: v.clone() for n, v in self._inflight["delta"].items()}
            frag = self._inflight["frag"]
        own = {
            "version": STATE_VERSION,
            "local_step": self.local_step,
            "overlap": self.overlap,
            "streaming": self.streaming.config() if self.streaming is not None else None,
            "alpha": self.alpha,
            "fragments": self.fragment_names,
            "global": {n: v.clone() for n, v in self._global.items()},
            "base": {n: v.clone() for n, v in self._base.items()},
            "inflight_fragment": frag,
            "inflight_delta": inflight_delta,
            "inflight_avg": inflight_avg,
            "pull_pending": self._pull_pending,
            "aligned": self._aligned,
            "outer": self.outer.state_dict() if self.outer is not None else None,
        }
        return {"local_sgd": own}

    def _load_own_state_dict(self, state_dict: dict) -> dict:
        """Check and load ``"local_sgd"`` (after the engine's state was checked, before it loads)."""
        sd = dict(state_dict)
        mine = dict(sd.pop("local_sgd"))
        version = mine.get("version")
        if version != STATE_VERSION:
            raise ValueError(
                f"local_sgd state version {version!r} is not supported (expected {STATE_VERSION}): it was saved by "
                "an older gradzip; resume with that gradzip, or start from the model alone"
            )
        if bool(mine["overlap"]) != self.overlap:
            raise ValueError(f"overlap differs from the checkpoint: saved {mine['overlap']}, now {self.overlap}")
        now = self.streaming.config() if self.streaming is not None else None
        if mine["streaming"] != now or float(mine["alpha"]) != self.alpha:
            raise ValueError(
                f"streaming differs from the checkpoint: saved {mine['streaming']} alpha={mine['alpha']}, "
                f"now {now} alpha={self.alpha}"
            )
        if [list(f) for f in mine["fragments"]] != self.fragment_names:
            if sorted(mine["global"]) != sorted(self._keys):
                missing = sorted(set(self._keys) - set(mine["global"]))
                extra = sorted(set(mine["global"]) - set(self._keys))
                raise ValueError(
                    f"checkpoint tensors differ from the model's: missing {missing[:5]}, unexpected {extra[:5]}"
                )
            raise ValueError("the checkpoint's fragments differ from this model's (fragments or tensor sizes changed)")
        if (mine["outer"] is None) != (self.outer is None):
            raise ValueError(
                f"the checkpoint was saved {'without' if mine['outer'] is None else 'with'} an outer optimizer, "
                f"this LocalSGD has {'none' if self.outer is None else 'one'}"
            )
        with torch.no_grad():
            for n in self._keys:
                for key, dst in (("global", self._global), ("base", self._base)):
                    src = mine[key][n]
                    if src.shape != dst[n].shape:
                        raise ValueError(
                            f"{key} tensor {n!r} has shape {tuple(src.shape)}, model has {tuple(dst[n].shape)}"
                        )
                    dst[n].copy_(src)
        if self.outer is not None:
            self.outer.load_state_dict(mine["outer"])
        if mine["inflight_avg"]:
            frag = int(mine["inflight_fragment"])
            keys = [p.key for p in self._fragments[frag]]
            self._inflight = {
                "frag": frag,
                "futures": None,
                "flushed": True,
                "delta": {k: mine["inflight_delta"][k].to(self._global[k].device).clone() for k in keys},
                "avg": {k: mine["inflight_avg"][k].to(self._global[k].device).clone() for k in keys},
            }
        else:
            self._inflight = None
        self._pull_pending = bool(mine["pull_pending"])
        self._aligned = bool(mine["aligned"])
        self.local_step = int(mine["local_step"])
        self._steps_mark = self.local_step  # stats(reset=True) intervals start at the resume
        return sd

    # -- tools (gradzip plan) ----------------------------------------------------------
    @staticmethod
    def _checked(
        period, compression, overlap, push_every, pull_every, outer, outer_kwargs, fragments, delay, alpha
    ) -> _Checked:
        """The constructor's checks of its arguments (all but the optimizer, the model and the
        group), and what they become: :meth:`plan_terms` runs the same checks on a spec."""
        compression = Identity() if compression is None else compression
        if not isinstance(compression, (Codec, Protocol)):
            raise TypeError(f"compression must be a gradzip codec or protocol, got {type(compression).__name__}")
        args.flag("overlap", overlap)
        make_outer = _outer_factory(outer, outer_kwargs)
        fragments = args.integer("fragments", fragments, 1)
        delay = args.integer("delay", delay, 0)
        alpha = args.number("alpha", alpha, 0.0, 1.0)
        schedule = as_schedule("period", period)
        streaming = None
        if fragments > 1 or delay > 0 or alpha > 0:
            if overlap or push_every is not None or pull_every is not None:
                raise ValueError(
                    "fragments, delay and alpha (streaming) replace overlap, push_every and pull_every; "
                    "give one or the other"
                )
            if not isinstance(schedule, Constant):
                raise ValueError(f"streaming needs an integer period, got {period!r}")
            streaming = Streaming(schedule.period, fragments, delay)
        return _Checked(
            compression,
            make_outer,
            fragments,
            delay,
            alpha,
            streaming,
            schedule if push_every is None else as_schedule("push_every", push_every),
            schedule if pull_every is None else as_schedule("pull_every", pull_every),
        )

    @classmethod
    def plan_terms(cls, *a, **kw) -> dict:
        """What ``gradzip plan`` needs to cost this method from its spec arguments (the
        constructor's, without optimizer and model), as plain values: ``compression``
        (a codec or protocol), ``period`` (long-run steps between pushes of a fragment),
        ``fragments``, ``delay`` (steps a sync may travel behind compute: ``period`` with
        ``overlap``) and ``error_feedback``."""
        sig = inspect.signature(cls.__init__)
        try:
            bound = sig.bind(None, None, None, *a, **kw)
        except TypeError as e:
            raise ValueError(f"{cls.__name__}: {e}") from None
        bound.apply_defaults()
        v = bound.arguments
        kw = {k: v.get(k, d) for k, d in _SPEC_DEFAULTS.items()}  # DiLoCo's signature lacks some
        if cls is not LocalSGD and kw["outer"] is None and isinstance(kw["outer_kwargs"], (dict, type(None))):
            kw["outer_kwargs"] = {**cls.OUTER, **(kw["outer_kwargs"] or {})}  # DiLoCo's or SparseLoCo's outer step
        if issubclass(cls, DiLoCo) and kw["compression"] is None:
            kw["compression"] = cls.default_compression()
        try:  # the constructor's own checks: a spec it would refuse is refused here
            c = LocalSGD._checked(v["period"], **kw)
        except TypeError as e:
            raise ValueError(f"{cls.__name__}: {e}") from None
        push = v.get("push_every") or v["period"]
        period = long_run_period(push)
        fragments, delay = c.fragments, c.delay
        if v.get("overlap"):
            delay = period
        return {
            "compression": c.compression,
            "period": period,
            "fragments": fragments,
            "delay": delay,
            "error_feedback": v.get("error_feedback"),
        }


@register_frontend
class DiLoCo(LocalSGD):
    """DiLoCo (Douillard et al. 2023) and Streaming DiLoCo (2025): :class:`LocalSGD` with
    DiLoCo's outer optimizer by default.

    Every ``period`` inner steps (per fragment, when streaming) the pseudo-gradient
    ``G - mean(x)`` goes through ``compression`` (error feedback on by default for biased
    codecs) and the outer optimizer steps ``G`` with it. ``outer=None`` is
    ``torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)``; ``outer_kwargs``
    override those arguments (``{"lr": 1.0, "momentum": 0.0, "nesterov": False}`` is
    plain averaging), or are passed to ``outer`` when it is given. The other arguments
    are :class:`LocalSGD`'s.

    Args:
        optimizer: the inner optimizer.
        model: the module averaged.
        period: inner steps between outer steps, an integer >= 1 (per fragment, a
            multiple of ``fragments``).
        compression: the codec or protocol for the pseudo-gradients (default
            ``Identity()``).
        process_group, outer, outer_kwargs, fragments, delay, alpha, error_feedback,
        check_parameters: as :class:`LocalSGD`'s.
        error_decay: as :class:`LocalSGD`'s; None: :attr:`ERROR_DECAY` (1, plain error feedback).
    """

    #: The outer step's arguments when ``outer`` is None, and the error decay when ``error_decay`` is None.
    OUTER = DILOCO_OUTER
    ERROR_DECAY = 1.0

    @staticmethod
    def default_compression() -> Codec | None:
        """The pseudo-gradients' method when ``compression`` is None (None: ``Identity()``)."""
        return None

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: torch.nn.Module,
        period: int,
        compression: Codec | Protocol | None = None,
        *,
        process_group: dist.ProcessGroup | None = None,
        outer: OuterOptimizer | None = None,
        outer_kwargs: dict | None = None,
        fragments: int = 1,
        delay: int = 0,
        alpha: float = 0.0,
        error_feedback: bool | None = None,
        error_decay: float | None = None,
        check_parameters: bool = True,
    ) -> None:
        if compression is None:
            compression = self.default_compression()
        if error_decay is None:
            error_decay = self.ERROR_DECAY
        if outer is None:
            outer_kwargs = {**self.OUTER, **(outer_kwargs or {})}
        super().__init__(
            optimizer,
            model,
            period,
            compression,
            process_group=process_group,
            error_feedback=error_feedback,
            error_decay=error_decay,
            outer=outer,
            outer_kwargs=outer_kwargs,
            fragments=fragments,
            delay=delay,
            alpha=alpha,
            check_parameters=check_parameters,
        )


#: SparseLoCo's outer step (Sarfi et al. 2025): plain SGD at lr 1, no momentum; the decaying error
#: buffer (``error_decay``) takes the outer momentum's place.
SPARSELOCO_OUTER = {"lr": 1.0, "momentum": 0.0, "nesterov": False}


@register_frontend
class SparseLoCo(DiLoCo):
    """SparseLoCo: DiLoCo whose pseudo-gradient is sent as a top-k of every 64 by 64 tile with
    2-bit values (:class:`gradzip.codecs.chunked.ChunkTopK`), through an error buffer that decays
    (``e <- error_decay * e + delta``; what is sent is subtracted from it), and applied by plain
    SGD at lr 1 (:data:`SPARSELOCO_OUTER`): the decaying buffer does what DiLoCo's outer Nesterov
    momentum does. The defaults are the paper's: 32 of every 4,096 elements (0.78%), 2-bit
    values, decay 0.95; ``period`` is the inner steps between syncs (the paper's H = 15 to 30).

    ``SparseLoCo(opt, model, period=30)`` is ``DiLoCo(opt, model, period=30,
    compression=ChunkTopK(32, chunk=64, values="q2"), error_decay=0.95,
    outer_kwargs=SPARSELOCO_OUTER)``; every argument is :class:`DiLoCo`'s, with these defaults.
    Receivers average the ranks' frames; ``ChunkTopK(..., average="senders")`` averages each
    coordinate over the ranks that sent it, as the authors' code does (``docs/lm.md``).

    Args:
        optimizer, model, period, process_group, outer, fragments, delay, alpha, error_feedback,
        check_parameters: as :class:`DiLoCo`'s.
        compression: default ``ChunkTopK(32, chunk=64, values="q2")``.
        outer_kwargs: the outer SGD's arguments over :data:`SPARSELOCO_OUTER`.
        error_decay: the error buffer's decay, default 0.95.
    """

    OUTER = SPARSELOCO_OUTER
    ERROR_DECAY = 0.95

    @staticmethod
    def default_compression() -> Codec:
        """``ChunkTopK(32, chunk=64, values="q2")``: the paper's 0.78% with 2-bit values."""
        return ChunkTopK(32, chunk=64, values="q2")


def reshard_state(states: list, world_size: int, *, preserve: str = "sum") -> list:
    """``LocalSGD.state_dict()`` of ``N`` ranks to ``world_size`` new ones.

    The engine part (residuals) goes through :func:`gradzip.checkpoint.reshard`. The
    global model ``G`` and the outer optimizer's state (its momentum) are identical on
    every rank, so they are copied. ``B``, the in-flight push and the inner optimizer's
    state are per rank: the states must be saved when every rank holds ``x == G`` with
    nothing in flight (after ``synchronize()``, or at a sync step of plain periodic
    averaging), and every new rank takes old rank 0's inner optimizer state (it is
    per-rank state such as Adam's moments; rank 0's is as good a start as any).
    """
    if not states:
        raise ValueError("states must hold at least one state_dict")
    for r, s in enumerate(states):
        mine = s["local_sgd"]
        if not mine["aligned"] or mine["inflight_avg"]:
            raise ValueError(
                f"rank {r}'s state was saved mid-period or with a push in flight; reshard states saved after "
                "synchronize() (every rank then holds the global model)"
            )
        for n, g in mine["global"].items():
            if not torch.equal(g, states[0]["local_sgd"]["global"][n]):
                raise ValueError(f"the global model differs between rank 0 and rank {r} in {n!r}")
    engines = reshard([s["gradzip"] for s in states], world_size, preserve=preserve)
    out = []
    for e in engines:
        sd = {k: v for k, v in states[0].items() if k not in ("local_sgd", "gradzip")}
        sd["local_sgd"] = states[0]["local_sgd"]
        sd["gradzip"] = e
        out.append(sd)
    return out
