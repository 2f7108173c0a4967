"""Fault-tolerant DiLoCo and DDP on torchft: gradzip's compression, torchft's quorum and healing.

torchft (``pip install gradzip[ft]``, torchft 0.2.0) keeps a quorum of replica groups through a
lighthouse and one :class:`torchft.Manager` per group: a replica that fails is dropped for the
step, a new or restarted one heals from a live peer's state, and the process group (torchft's
reconfigurable ``ProcessGroupGloo``) is reconfigured without restarting the job. gradzip builds
no quorum of its own; it adds the compression:

    manager = torchft.Manager(pg=torchft.ProcessGroupGloo(), min_replica_size=2,
                              use_async_quorum=False, load_state_dict=None, state_dict=None, ...)
    opt = gradzip.ft.DiLoCo(manager, torch.optim.AdamW(model.parameters(), lr=4e-4), model,
                            period=8, compression=gradzip.Int8())
    for x, y in data:
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()

* :class:`FTCommunicator` is a :class:`gradzip.comm.Communicator` on the manager's process
  group: every protocol's collectives (allreduce, all-gather, all-to-all) go there, in the
  same order on every replica. A collective that fails (a peer gone) is reported to the manager
  (``report_error``); the protocols still pending are dropped, and so is every later one of the
  step (as torchft's own ``Manager.allreduce`` turns into a no-op after an error).
* :class:`DiLoCo` is gradzip's :class:`gradzip.local_sgd.DiLoCo` whose every sync is one
  torchft step: ``start_quorum()`` (which heals a joining replica), the push of the
  pseudo-gradient through the engine, then ``should_commit()``. Only a committed sync applies
  the outer step; an uncommitted one is dropped on every replica: ``Engine.end_step(commit=False)``
  puts the residuals and codec state back as they were before it (the rollback of a non-finite
  step), the local model goes back to the global one (the local steps since the last sync are
  lost, as in torchft's DiLoCo), and its bytes leave ``stats()`` for ``steps_lost``/``bytes_lost``.
* Healing: the manager's state transfer carries the global model, the outer optimizer's state,
  the inner optimizer's state, the local step, and the engine's step and codec state
  (``tensor_state``: PowerSGD's averaged ``Q``, Adaptive's and Policy's choices, ...) of a live
  peer (``state_dict`` key ``"gradzip_diloco"``), so the healed replica keys its codecs on the
  same step and picks the same routes and payload sizes as its peers. Its residuals restart
  from zero: a peer's residual is that peer's unsent mass, and copying it would send it twice.
  The dead replica's residual mass is lost: error feedback only delays what a codec drops, so
  the loss is one sync's quantization error of one replica, bounded and not compounding. A
  replica joins at its first ``step()``, which runs one sync and no local step: its delta then is
  zero, so the sync it joins in averages one zero delta, and the gradient at hand (taken on the
  weights from before the heal) is dropped, never applied to the healed weights.

* :class:`DDP` and :class:`OptimizerWrapper`: gradzip's DDP communication hook
  (:mod:`gradzip.hooks.ddp`'s ``comm_hook``, its engine on an :class:`FTCommunicator`) on a DDP
  model whose own process group is a world of one, as torchft's ``DistributedDataParallel``;
  every training step is one torchft step. ``zero_grad()`` starts the quorum (a restarted
  replica heals there), the hook runs the buckets' protocols through the manager's group and
  leaves the engine's step open, and ``step()`` closes it with ``should_commit()``: committed, the
  optimizer steps; not, ``Engine.end_step(commit=False)`` rolls back residuals and codec state,
  the optimizer does not step and the counts go to ``steps_lost``/``bytes_lost``. A non-finite
  step is skipped on every replica alike (the engine's ``skip_guard`` is set). Healing sends the
  model, the optimizer's state and the engine's step and codec state (``state_dict`` key
  ``"gradzip_ddp"``); residuals restart from zero, as above.

    model = gradzip.ft.DDP(manager, module, "Int8()", replicas=3)
    opt = gradzip.ft.OptimizerWrapper(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    for x, y in data:
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()

``docs/fault_tolerance.md`` has the rest: what torchft gives, the cost of a heal, what is not
covered (streaming fragments, overlap, ``no_sync``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions, AllreduceOptions, AllToAllOptions
from torch.nn.parallel import DistributedDataParallel

from .codecs.base import Codec
from .comm import Communicator, _Pending, future_devices, ring_allreduce_link
from .feedback import ErrorFeedback
from .hooks.ddp import comm_hook
from .local_sgd import DiLoCo as _DiLoCo
from .local_sgd import OuterOptimizer
from .protocols.base import Protocol
from .stats import Stats

__all__ = ["FTCommunicator", "DiLoCo", "DDP", "OptimizerWrapper", "STATE_KEY", "DDP_STATE_KEY"]

#: The key of gradzip's state in the manager's state transfer.
STATE_KEY = "gradzip_diloco"
#: The key of :class:`OptimizerWrapper`'s state (model, optimizer, engine step) in it.
DDP_STATE_KEY = "gradzip_ddp"


class FTCommunicator(Communicator):
    """A :class:`~gradzip.comm.Communicator` on a torchft manager's process group.

    ``world_size`` and ``rank`` are the quorum's (they change when replicas leave or join);
    ``replicas`` is the world size assumed before the first quorum (it picks the protocol of a
    codec: ``AllGather`` below 4 replicas, ``TwoPhase`` from 4). Errors of collectives go to
    ``manager.report_error``; once the manager has an error, no collective is issued until the
    next quorum. Later rounds are always deferred to :meth:`flush` (gloo)."""

    def __init__(self, manager, replicas: int, stats: Stats | None = None) -> None:
        self.manager = manager
        self.pg = manager._pg
        self.group = None
        self.replicas = int(replicas)
        self._start(stats, defer=True)

    @property
    def world_size(self) -> int:  # type: ignore[override]
        try:
            return int(self.pg.size())
        except Exception:  # noqa: BLE001 - not configured yet (before the first quorum)
            return self.replicas

    @property
    def rank(self) -> int:  # type: ignore[override]
        try:
            return int(self.pg.parent.rank())
        except Exception:  # noqa: BLE001
            return 0

    def split(self, local_size: int):
        raise NotImplementedError("Hierarchical protocols do not run on torchft's process group")

    # -- single collectives --------------------------------------------------------------
    def _check(self) -> None:
        err = self.manager.errored()
        if err is not None:
            raise RuntimeError(f"torchft manager errored earlier in this step: {err.original_exception}")

    def allreduce(self, t: torch.Tensor, op=dist.ReduceOp.SUM, *, control: bool = False):
        self._check()
        opts = AllreduceOptions()
        opts.reduceOp = op
        w = self.pg.allreduce([t], opts)
        nbytes = t.numel() * t.element_size()
        link = ring_allreduce_link(nbytes, self.world_size)
        return self._timed(w, nbytes, control, link, kind="allreduce", tensors=(t,))

    def allgather(self, out: torch.Tensor, inp: torch.Tensor, *, control: bool = False):
        self._check()
        w = self.pg.allgather_into_tensor_coalesced([out], [inp], AllgatherOptions())
        nbytes = inp.numel() * inp.element_size()
        link = (self.world_size - 1) * nbytes
        return self._timed(w, nbytes, control, link, gather=True, kind="allgather", tensors=(out, inp))

    def alltoall(self, out: torch.Tensor, inp: torch.Tensor, out_splits=None, in_splits=None, *, control: bool = False):
        self._check()
        w = self.pg.alltoall_base(out, inp, list(out_splits or []), list(in_splits or []), AllToAllOptions())
        el = inp.element_size()
        nbytes = inp.numel() * el
        mine = (in_splits[self.rank] if in_splits is not None else inp.numel() // self.world_size) * el
        return self._timed(w, nbytes, control, nbytes - mine, kind="alltoall", tensors=(out, inp))

    # -- protocols: a failure fails the step, never the process ---------------------------
    def _fail(self, job: _Pending, exc: BaseException) -> None:
        """Report ``exc`` to the manager and end ``job``: its generator is closed first (the
        engine's bookkeeping of the call runs), then its future gets the error."""
        if isinstance(exc, Exception):
            self.manager.report_error(exc)
        job.round = None
        try:
            job.gen.close()
        except Exception:  # noqa: BLE001 - the generator's own cleanup failed: the step fails anyway
            pass
        if not job.future.done():
            job.future.set_exception(exc)

    def submit(self, protocol, device=None) -> torch.futures.Future:
        job = _Pending(protocol, torch.futures.Future(devices=future_devices(device)))
        try:
            self._advance(job)
        except Exception as exc:  # noqa: BLE001 - issued nothing, or a collective refused
            self._fail(job, exc)
            return job.future
        if job.round is not None and not job.round.last:
            self._pending.append(job)
        return job.future

    def _advance(self, job: _Pending) -> None:
        try:
            job.round = next(job.gen)
        except StopIteration as stop:
            job.round = None
            job.future.set_result(stop.value)
            return
        if job.round.last:
            self._finish_when_done(job)

    def flush(self) -> None:
        pending, self._pending = self._pending, []
        for job in pending:
            try:
                while job.round is not None and not job.round.last:
                    for w in job.round.works:
                        w.wait()
                    self._advance(job)
            except Exception as exc:  # noqa: BLE001
                self._fail(job, exc)


def _lost_counts(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in before}


def _engine_peer_state(engine) -> dict:
    """The engine's part of a heal: its step and its codec state (``tensor_state``), copies.

    The step keys every step-dependent choice (RandomK's shared positions, PowerSGD's seeded
    draws, warm-up schedules, ``start_iter``, Adaptive's statistics rounds, Accordion's
    windows); the codec state holds what every replica must hold alike (PowerSGD's averaged
    warm-start ``Q`` and Accordion rank, Adaptive's averaged statistics and chosen settings,
    Policy's ``auto`` decisions, Filter's counts), without which the healed replica would pick
    other routes or payload sizes and its collectives would not match its peers'. Not the
    residuals (``memory``) nor momentum correction's buffers (``moments``): they are this
    replica's unsent mass and velocity."""
    return {
        "step": engine.step,
        "tensor_state": copy.deepcopy({k: dict(v) for k, v in engine.tensor_state.items()}),
    }


def _load_engine_peer_state(engine, sd: dict) -> None:
    """Adopt a peer's :func:`_engine_peer_state`; the residuals (and momentum correction's
    buffers) restart from zero. The codec state's few per-replica entries (Threshold's
    ``tau``/``amax``, Filter's reference, Adaptive's open Accordion window ``adaptive.sq``,
    the codec state of TwoPhase's pieces) start from the peer's values, as a reshard starts
    them from rank 0's: a threshold or a vote, not mass, and no collective depends on them
    being this replica's own."""
    engine.step = int(sd["step"])
    engine.tensor_state = {k: dict(v) for k, v in sd["tensor_state"].items()}
    if engine.memory is not None:
        engine.memory = ErrorFeedback(engine.error_decay)
    if engine.moments is not None:
        engine.moments = ErrorFeedback()


class DiLoCo(_DiLoCo):
    """gradzip's DiLoCo on a torchft :class:`~torchft.Manager`: a sync per ``period`` local
    steps, each one torchft step (quorum, compressed push of the pseudo-gradient, commit).

    Args:
        manager: a ``torchft.Manager`` with ``use_async_quorum=False`` (a sync heals before it
            pushes) whose process group is torchft's (``ProcessGroupGloo``). Its
            ``state_dict``/``load_state_dict`` may be None: this registers its own under
            :data:`STATE_KEY`.
        optimizer, model, period, compression, outer, outer_kwargs, error_feedback,
        error_decay: as :class:`gradzip.local_sgd.DiLoCo`'s (``period`` an integer).
        replicas: the number of replica groups expected (picks a codec's protocol; the quorum's
            size is used once it is known).

    ``stats()`` counts committed syncs only; ``steps_lost`` is the syncs not committed and
    ``bytes_lost``/``bytes_link_lost`` what they sent. ``commits`` and ``heals`` count the
    committed syncs and the heals of this replica. Streaming (``fragments``), ``overlap`` and
    ``push_every``/``pull_every`` are not supported here.
    """

    def __init__(
        self,
        manager,
        optimizer: torch.optim.Optimizer,
        model: torch.nn.Module,
        period: int,
        compression: Codec | Protocol | None = None,
        *,
        replicas: int = 2,
        outer: OuterOptimizer | None = None,
        outer_kwargs: dict | None = None,
        error_feedback: bool | None = None,
        error_decay: float | None = None,
    ) -> None:
        if getattr(manager, "_use_async_quorum", False):
            raise ValueError(
                "gradzip.ft.DiLoCo needs a synchronous quorum: torchft.Manager(..., use_async_quorum=False)"
            )
        if not isinstance(period, int) or isinstance(period, bool) or period < 1:
            raise ValueError(f"period must be an integer >= 1, got {period!r}")
        self.manager = manager
        comm = FTCommunicator(manager, replicas)
        super().__init__(
            optimizer,
            model,
            period,
            compression,
            process_group=comm,
            outer=outer,
            outer_kwargs=outer_kwargs,
            error_feedback=error_feedback,
            error_decay=error_decay,
            check_parameters=False,  # torchft's init_sync / healing makes the replicas agree
        )
        # The configuration check is an all-gather at an engine's first call: a replica that
        # joins later would run it alone. Every replica is built by the same script instead.
        self.engine._verified = True
        self.commits = 0
        self.heals = 0
        self._lost = {k: 0 for k in Stats.names()}
        self._joined = False
        manager.register_state_dict_fn(STATE_KEY, self._load_peer_state, self._peer_state)

    # -- the step ----------------------------------------------------------------------
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One local step, and a sync every ``period``. The first call is the joining sync only:
        its quorum heals a joining replica, and the gradient at hand, taken on the weights from
        before the join, is dropped (no inner step, ``local_step`` unchanged; returns None).
        With a closure, the closure runs on the joined weights and its gradient is applied."""
        if not self._joined:
            self._joined = True
            self._sync()
            self.optimizer.zero_grad()
            if closure is None:
                return None
        loss = self.optimizer.step(closure)
        self.local_step += 1
        if self.push_at(self.local_step):
            self._sync()
        return loss

    def synchronize(self) -> None:
        """Nothing to drain: every sync is collected in its step (no overlap, no streaming)."""

    def _progress(self) -> None:
        """Issue the push's deferred rounds; the engine's step ends at the commit (:meth:`_sync`)."""
        inf = self._inflight
        if inf is not None and not inf["flushed"]:
            self.engine.flush()
            inf["flushed"] = True

    @torch.no_grad()
    def _sync(self) -> bool:
        """One torchft step: quorum (and heal), push, average, commit or drop. True if committed."""
        m = self.manager
        m.start_quorum()
        before = self.engine.stats_.state_dict()
        step_before = self.engine.step
        try:
            self._push(0, collect_in=0)
            self._progress()
            for fut in self._inflight["futures"]:  # every call settled before the engine's step ends
                try:
                    fut.wait()
                except Exception:  # noqa: BLE001 - reported by the communicator
                    pass
            if m.errored() is None:
                self._average()
        except Exception as exc:  # noqa: BLE001 - a failed collective, already reported; or ours
            m.report_error(exc)
        commit = bool(m.should_commit())
        self.engine.end_step(commit=commit)
        if commit:
            self._collect()
            self._pull()
            self.commits += 1
        else:
            self._drop()
            lost = _lost_counts(before, self.engine.stats_.state_dict())
            self.engine.stats_.add(**{k: -v for k, v in lost.items()})
            for k, v in lost.items():
                self._lost[k] += v  # "steps": this sync
            self.engine.step = step_before
        self._aligned = self._inflight is None
        return commit

    @torch.no_grad()
    def _drop(self) -> None:
        """An uncommitted sync: ``G`` stays, ``x <- G``, ``B <- G`` (the local steps since the
        last sync are dropped, as torchft's DiLoCo drops them)."""
        self._inflight = None
        for k, t in zip(self._keys, self._views()):
            t.copy_(self._global[k])
            self._base[k].copy_(self._global[k])
        self._pull_pending = False

    # -- healing (the manager's state transfer) --------------------------------------------
    def _peer_state(self) -> dict:
        """What a live replica sends a healing one: ``G``, the outer and inner optimizers' states,
        the local step, the engine's step and codec state (:func:`_engine_peer_state`). Not the
        residuals: they are this replica's unsent mass."""
        return {
            "global": {k: v.detach().clone() for k, v in self._global.items()},
            "outer": copy.deepcopy(self.outer.state_dict()) if self.outer is not None else None,
            "inner": copy.deepcopy(self.optimizer.state_dict()),
            "local_step": self.local_step,
            "engine": _engine_peer_state(self.engine),
        }

    @torch.no_grad()
    def _load_peer_state(self, sd: dict) -> None:
        """Heal: ``x = B = G`` from the peer, its optimizers' states, its local step, the engine's
        step and codec state; residuals from zero."""
        for k, t in zip(self._keys, self._views()):
            g = sd["global"][k].to(self._global[k].device)
            self._global[k].copy_(g)
            self._base[k].copy_(g)
            t.copy_(g)
        if self.outer is not None and sd["outer"] is not None:
            self.outer.load_state_dict(sd["outer"])
        self.optimizer.load_state_dict(sd["inner"])
        self.local_step = int(sd["local_step"])
        self._inflight = None
        self._pull_pending = False
        _load_engine_peer_state(self.engine, sd["engine"])
        self.heals += 1

    # -- stats ---------------------------------------------------------------------------
    def stats(self, reset: bool = False) -> dict:
        """:meth:`gradzip.local_sgd.LocalSGD.stats` over committed syncs, plus ``steps_lost``
        (syncs not committed), ``bytes_lost`` and ``bytes_link_lost`` (what they sent),
        ``commits`` and ``heals``."""
        return _with_losses(super().stats(reset=reset), self)


def _with_losses(d: dict, fe) -> dict:
    """``d`` (a front end's stats) with what the uncommitted steps cost and the quorum's counts."""
    d["steps_lost"] = fe._lost["steps"]
    d["bytes_lost"] = fe._lost["bytes_sent"]
    d["bytes_link_lost"] = fe._lost["bytes_link"]
    d["commits"] = fe.commits
    d["heals"] = fe.heals
    return d


# -- the DDP hook on torchft ------------------------------------------------------------------
def _ft_hook(state, bucket):  # no annotations: DDP checks them, and this module's are strings
    """gradzip's DDP communication hook on torchft: :func:`gradzip.hooks.ddp.gradzip_hook`
    without the end of the step (the commit closes it: :meth:`OptimizerWrapper.step`) and with a
    future that never fails. A failed collective is reported to the manager by the
    :class:`FTCommunicator`; the bucket then keeps what it holds (the step is not committed, so
    the optimizer never reads it) and ``backward()`` returns as usual, as under torchft's own DDP."""
    engine = state.engine
    if state.before is None:  # the step's first bucket: the counts an uncommitted step gives back
        state.before = engine.stats_.state_dict()
    buf = bucket.buffer()
    fut = engine.reduce(
        state.names_of(bucket.parameters()),
        bucket.gradients(),
        out_dtype=buf.dtype,
        dest=buf,
        zero_is_unused=state.find_unused,
    )
    if bucket.is_last():
        engine.flush()

    def settle(f: torch.futures.Future) -> torch.Tensor:
        try:
            return f.value()
        except Exception:  # noqa: BLE001 - reported to the manager: this step will not commit
            return buf

    return fut.then(settle)


class DDP(DistributedDataParallel):
    """``module`` wrapped as torchft's ``DistributedDataParallel`` is, with gradzip's hook.

    The DDP process group is a world of one (``torchft.process_group.ProcessGroupDummy``): DDP's
    init broadcast and parameter check go nowhere, and the gradients cross the replicas only
    through the hook, whose engine runs on an :class:`FTCommunicator` (the manager's process
    group: 3 replicas, then 2 while one is down, then 3). DDP still calls a hook at world size 1.
    ``find_unused_parameters=True`` as in torchft: DDP then never rebuilds its buckets, so a
    restarted replica's first step has the same buckets, hence the same collectives, as the live
    replicas' thousandth; a parameter unused on a replica is sent as zeros and keeps its residual.

    Args:
        manager: a ``torchft.Manager`` with ``use_async_quorum=False`` (a healing replica loads
            the live model before its forward pass) on torchft's ``ProcessGroupGloo``.
        module: the model, the same on every replica (the first quorum makes them agree).
        method: a gradzip codec or protocol, or its spec (default ``"Int8()"``).
        replicas: the number of replica groups expected (picks a codec's protocol).
        start_iter, error_feedback, error_decay, clip: as :func:`gradzip.hooks.register_hook`'s.
        **ddp_kwargs: the rest of ``DistributedDataParallel``'s (``bucket_cap_mb``, ...).

    Step with an :class:`OptimizerWrapper`: its ``zero_grad()`` starts the quorum, its
    ``step()`` asks ``should_commit()`` and ends the engine's step, committed or rolled back.
    ``stats()`` counts committed steps only, plus ``steps_lost``, ``bytes_lost``,
    ``bytes_link_lost``, ``commits`` and ``heals``. ``hook_state`` is the hook's
    :class:`~gradzip.hooks.ddp.HookState` (its ``engine``).
    """

    def __init__(
        self,
        manager,
        module: torch.nn.Module,
        method: Codec | Protocol | str = "Int8()",
        *,
        replicas: int = 2,
        start_iter: int = 0,
        error_feedback: bool | None = None,
        error_decay: float = 1.0,
        clip: float | None = None,
        **ddp_kwargs,
    ) -> None:
        from torchft.process_group import ProcessGroupDummy

        if getattr(manager, "_use_async_quorum", False):
            raise ValueError("gradzip.ft.DDP needs a synchronous quorum: torchft.Manager(..., use_async_quorum=False)")
        if "process_group" in ddp_kwargs:
            raise TypeError("gradzip.ft.DDP builds its own process group (the replicas meet in the manager's)")
        if not ddp_kwargs.pop("find_unused_parameters", True):
            raise ValueError("gradzip.ft.DDP needs find_unused_parameters=True: DDP must not rebuild its buckets")
        super().__init__(module, process_group=ProcessGroupDummy(0, 1), find_unused_parameters=True, **ddp_kwargs)
        self.manager = manager
        state, _ = comm_hook(
            self,
            method,
            process_group=FTCommunicator(manager, replicas),
            start_iter=start_iter,
            error_feedback=error_feedback,
            error_decay=error_decay,
            clip=clip,
        )
        # The configuration check is an all-gather at the first call: a replica that joins
        # later would run it alone. Every replica is built by the same script instead.
        state.engine._verified = True
        # OptimizerWrapper.step reads last_step_nonfinite (DDP.end_step): the guard makes even a
        # stateless engine (Identity() without error feedback) read its averages, and the hint
        # (pass optimizer= to register_hook) is not for gz.ft users.
        state.engine.skip_guard = True
        state.engine.nonfinite_hint = None
        state.before = None  # the stats at the start of the open step (set by the hook)
        self.hook_state = state
        self.register_comm_hook(state, _ft_hook)
        self.commits = 0
        self.heals = 0
        self._lost = {k: 0 for k in Stats.names()}

    @property
    def engine(self):
        return self.hook_state.engine

    def end_step(self, commit: bool) -> bool:
        """Close the step the hook opened, committed or not (:meth:`OptimizerWrapper.step` calls
        it with ``manager.should_commit()``); True if the optimizer may step. An uncommitted step
        puts the residuals and codec state back (``Engine.end_step(commit=False)``), its counts
        leave ``stats()`` for ``steps_lost``/``bytes_lost`` and the engine's step goes back."""
        st = self.hook_state
        eng = st.engine
        before, st.before = st.before, None
        if commit:
            self.commits += 1
        if before is None:  # no backward through the hook in this step
            return commit
        step_before = eng.step
        eng.end_step(commit=commit)
        if commit:
            return not eng.last_step_nonfinite  # a NaN/Inf step: skipped on every replica alike
        lost = _lost_counts(before, eng.stats_.state_dict())
        eng.stats_.add(**{k: -v for k, v in lost.items()})
        for k, v in lost.items():
            self._lost[k] += v
        eng.step = step_before
        return False

    def stats(self, reset: bool = False) -> dict:
        """The hook's ``stats()`` over committed steps, plus ``steps_lost`` (steps not committed),
        ``bytes_lost`` and ``bytes_link_lost`` (what they sent), ``commits`` and ``heals``."""
        return _with_losses(self.hook_state.stats(reset=reset), self)

    def _heal(self, engine_state: dict) -> None:
        """A healed replica: the peer's engine step and codec state, residuals from zero (a
        peer's are its unsent mass): :func:`_load_engine_peer_state`."""
        _load_engine_peer_state(self.hook_state.engine, engine_state)
        self.hook_state.before = None
        self.heals += 1


class OptimizerWrapper(torch.optim.Optimizer):
    """``optimizer`` stepped only on committed steps of a :class:`DDP` model, as torchft's
    ``torchft.optim.OptimizerWrapper`` (one torchft step per training step):

        model = gz.ft.DDP(manager, module, "Int8()", replicas=3)
        opt = gz.ft.OptimizerWrapper(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        for x, y in data:
            opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()

    ``zero_grad()`` calls ``manager.start_quorum()`` (a restarted replica heals there) then the
    optimizer's; ``step()`` calls ``manager.should_commit()``, ends the engine's step with it
    (:meth:`DDP.end_step`) and steps the optimizer only if committed (and finite). It registers
    the state a healing replica receives, under :data:`DDP_STATE_KEY`: the model's and the
    optimizer's state dicts and the engine's step and codec state (``state_dict=False``: the caller's own
    ``Manager(state_dict=..., load_state_dict=...)`` carries them instead).
    """

    def __init__(self, model: DDP, optimizer: torch.optim.Optimizer, *, state_dict: bool = True) -> None:
        if not isinstance(model, DDP):
            raise TypeError(f"gradzip.ft.OptimizerWrapper needs a gradzip.ft.DDP model, got {type(model).__name__}")
        self.optim = optimizer
        self.model = model
        self.manager = model.manager
        if state_dict:
            self.manager.register_state_dict_fn(DDP_STATE_KEY, self._load_peer_state, self._peer_state)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.manager.start_quorum()
        self.optim.zero_grad(set_to_none)

    def step(self, closure=None) -> bool:  # type: ignore[override]
        """``should_commit()``, then the optimizer's step if committed; True if committed."""
        if closure is not None:
            raise ValueError("gradzip.ft.OptimizerWrapper.step takes no closure (as torchft's)")
        commit = bool(self.manager.should_commit())
        if self.model.end_step(commit):
            self.optim.step()
        return commit

    def add_param_group(self, param_group: dict) -> None:
        self.optim.add_param_group(param_group)

    def state_dict(self) -> dict:
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optim.load_state_dict(state_dict)

    @property
    def param_groups(self):  # type: ignore[override]
        return self.optim.param_groups

    @property
    def state(self):  # type: ignore[override]
        return self.optim.state

    # -- healing (the manager's state transfer) --------------------------------------------
    def _peer_state(self) -> dict:
        """What a live replica sends a healing one: the model, the optimizer's state, the
        engine's step and codec state (:func:`_engine_peer_state`). Copies: the transfer may
        run while this replica goes on. Not the residuals."""
        return {
            "model": {k: v.detach().clone() for k, v in self.model.module.state_dict().items()},
            "optim": copy.deepcopy(self.optim.state_dict()),
            "engine": _engine_peer_state(self.model.engine),
        }

    @torch.no_grad()
    def _load_peer_state(self, sd: dict) -> None:
        self.model.module.load_state_dict(sd["model"])
        self.optim.load_state_dict(sd["optim"])
        self.model._heal(sd["engine"])
