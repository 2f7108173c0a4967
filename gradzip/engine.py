"""The engine every front end shares: run a method's protocol with error feedback and the safety nets.

A front end (DDP hook, DistributedOptimizer, local SGD) hands the engine a list
of named tensors and gets back a future of their average over the ranks, as
one flat tensor. The engine owns the per-tensor state (residuals, codec state,
the step counter), and its ``state_dict()`` is what survives a restart. It alone
owns the safety nets, all decided identically on every rank:

* **Config check.** The first call of an engine all-gathers a description of the
  configuration (the method's config, error feedback, start_iter, on_nonfinite,
  and a hash of the parameter layout when the front end gave one). A mismatch
  raises ``ValueError`` naming the differing field, on every rank.
* **Non-finite gradients.** Before the protocol runs, the engine reads the call's
  gradients for NaN/Inf (the protocol may reduce them in place); after the first
  round it reads the error-feedback state the protocol has built (new residuals
  and compensated inputs, where ``gradient + residual`` may overflow). One flag,
  "this rank saw one", rides in the first round: in the protocol's own first
  collective where it can carry it (``Call.take_flag``: PowerSGD, AllGather,
  TwoPhase, Allreduce where it builds a buffer, ...), else as an int32
  allreduce(MAX) of its own; none for a call whose protocol sums every tensor as
  it is (``Protocol.plain``): there a NaN/Inf on any rank shows in the average,
  which every rank checks anyway. If any rank saw one (or the average overflows
  the output dtype), the call's result is all NaN (``on_nonfinite="skip"``:
  GradScaler then skips the step, as it would without compression) or every rank
  raises ``FloatingPointError`` (``"raise"``). An engine with no state at all
  (``Identity`` without error feedback or momentum: every call a plain allreduce)
  reads nothing with ``"skip"``: its average keeps the NaN/Inf where they arose,
  as plain DDP's does, and GradScaler skips the step alike.
  On the GPU's side with ``"skip"``, a quantizer's frames are checked on the device too
  (``Call.frame_checks``, :func:`gradzip.wire.unpack_many`'s ``defer``): a malformed one
  makes the call's result NaN and the step non-finite, and the host path's ``FrameError``
  is raised at the next call (``"raise"`` and the host path raise it in the call).
  Either way, when the step ends, the residuals and codec state of every tensor
  touched in that step are put back as they were before it
  (``ErrorFeedback.restore``): a skipped step never poisons the residual.
* **Skipping the optimizer's step.** When a step ends, ``last_step_nonfinite`` holds its
  verdict, alike on every rank, and ``nonfinite_steps`` counts the steps so judged (an
  uncommitted one, ``end_step(commit=False)``, included). :func:`gradzip.frontend.skip_nonfinite`
  (``gz.skip_nonfinite``, and the DDP hook given ``optimizer=``) makes ``optimizer.step()``
  compare that count with its own at the optimizer's last ``step()`` or ``zero_grad()``, so
  every step ended in between counts (FSDP sums each micro-batch's reduce-scatter into the
  gradients), and leave the parameters and the optimizer's state alone after such a step; it
  refuses to judge while calls are still running (``calls_running``). It sets ``skip_guard``,
  which also makes a stateless engine read its averages. A front end that owns its optimizer
  (``DistributedOptimizer``) reads the verdict itself. Without a guard, an engine whose front
  end set ``nonfinite_hint`` warns once, on its first non-finite step, with that hint.

Before the protocol runs, the engine applies local clipping (``clip``: each tensor's norm to
``clip / sqrt(N)``) and momentum correction (:mod:`gradzip.momentum`) to the call's tensors, and
it books ``bytes_raw`` and ``bytes_link_raw = protocol.link_raw(bytes_raw, N)`` per call. Its
``state_dict()`` holds the version, the owner (``rank``, ``world_size``, ``method_repr``), the
method's config, error feedback, the step, residuals, momentum buffers, per-tensor state,
stats, and ``calls``: which tensors shared each call of the last step. A call-wide choice
(``TopK(scope="call")``) and gloo's summation order depend on that grouping, and DDP's first
step after a restart uses other buckets, so the first step after a load holds the front end's
calls until ``flush()`` and runs them grouped as the saved run did (``_regroup``).
``check_state`` refuses, before anything changes, a state of another version, owner, method,
error feedback or momentum-correction mode; ``routes()`` lists each tensor with its method,
protocol and reason, and ``set_log`` calls a function from ``end_step`` every few steps.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
import warnings
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

import gradzip.args as args
import gradzip.kernels as K

from .codecs.base import Codec, TensorContext
from .codecs.cast import Identity
from .comm import FLAG_DTYPE, Communicator, Round, allgather_bytes, future_devices
from .feedback import ErrorFeedback
from .momentum import Momentum, momentum_key
from .protocols import Allreduce, Call, Protocol, as_protocol, codec_time, finite_flags
from .protocols.planned import plan_for
from .stats import Stats, log_line
from .wire import accum_dtype, run_view

__all__ = ["Engine", "layout_of", "all_finite", "check_owner", "STATE_VERSION"]

STATE_VERSION = 3  # 3: the error decay and the momentum-correction mode are recorded
#: ``Momentum.mode()`` as a checkpoint's refusal names it.
_MODES = {
    "momentum": "momentum correction (precondition=False, update='optimizer')",
    "precondition": "precondition=True (Adam's both moments in the hook)",
    "sign": "update='sign'",
}
logger = logging.getLogger("gradzip")
_NONFINITE_POLICIES = ("skip", "raise")


def layout_of(named_tensors) -> list:
    """``[(name, shape, dtype)]``: what the config check compares across ranks."""
    return [(n, list(t.shape), str(t.dtype).replace("torch.", "")) for n, t in named_tensors]


def check_real(named_tensors, what: str = "parameter") -> None:
    """``TypeError`` for tensors gradzip cannot average (complex, integer), naming them."""
    for n, t in named_tensors:
        if t.is_complex() or not t.is_floating_point():
            raise TypeError(
                f"{what} {n!r} is {t.dtype}; gradzip averages real floating-point tensors only "
                "(view complex parameters as real with torch.view_as_real)"
            )


def _extremes(tensors) -> list[tuple[float, float]]:
    """``(min, max)`` of each tensor (NaN where it holds one; (0, 0) when empty), one host sync."""
    ext = [
        torch.stack(torch.aminmax(t.detach().reshape(-1)))
        if t.numel()
        else torch.zeros(2, dtype=t.dtype, device=t.device)
        for t in tensors
    ]
    if not ext:
        return []
    return [tuple(row) for row in torch.stack([e.to(torch.float64) for e in ext]).tolist()]


def all_finite(tensors) -> bool:
    """True when no tensor holds a NaN or Inf (:func:`gradzip.protocols.finite_flags`: one host
    sync in the common case)."""
    return all(finite_flags(tensors))


def device_nonfinite(tensors, device) -> torch.Tensor:
    """A one-element bool tensor on ``device``: whether any of ``tensors`` holds a NaN/Inf.
    Exact, and read by nobody here: no host sync (one pass when they lie back to back).
    ``(x * 0).sum()`` is NaN iff ``x`` holds a NaN or an infinity (finite elements give
    signed zeros, whose sum cannot overflow): two kernels, where ``isfinite().all()``
    decomposes into five."""
    flat = run_view(tensors)
    parts = [flat] if flat is not None else [t.reshape(-1) for t in tensors if t.numel()]
    if not parts:
        return torch.zeros(1, dtype=torch.bool, device=device)
    if len(parts) == 1:
        return parts[0].mul(0).sum().isnan().reshape(1)
    return torch.stack([p.mul(0).sum().isnan() for p in parts]).any().reshape(1)


def route_summary(rows: list[dict]) -> list[str]:
    """One line per route of :meth:`Engine.routes`: tensors, elements and bytes per method."""
    by: dict = {}
    for r in rows:
        g = by.setdefault((r["method"], r["protocol"]), [0, 0, 0])
        g[0] += 1
        g[1] += r["numel"]
        g[2] += r["bytes_raw"]
    total = sum(g[2] for g in by.values()) or 1
    return [
        f"{m} via {p}: {n} tensors, {e:,} elements, {100 * b / total:.1f}% of the raw bytes"
        for (m, p), (n, e, b) in by.items()
    ]


def check_owner(sd: dict, rank: int, world_size: int) -> None:
    """Refuse an engine state saved by another rank or on another number of ranks.

    Error-feedback residuals, momentum buffers and adaptive thresholds are per rank: a
    rank that loads another rank's state runs on that rank's residuals, and nothing in
    the training shows it."""
    saved_rank, saved_world = sd["rank"], sd["world_size"]
    method = sd.get("method_repr") or sd.get("method", {}).get("name", "?")
    if int(saved_world) != world_size:
        raise ValueError(
            f"this gradzip state ({method}) was saved by rank {saved_rank} of {saved_world} ranks, and this is "
            f"rank {rank} of {world_size}: turn the {saved_world} states into {world_size} with "
            f"gz.reshard(states, {world_size}) first"
        )
    if int(saved_rank) != rank:
        raise ValueError(
            f"this gradzip state ({method}) was saved by rank {saved_rank}, and this is rank {rank}: "
            f"error-feedback state is per rank, so rank {rank} must load its own "
            "(save one file per rank: state.save(dir) / state.load(dir), or gradzip.checkpoint.save/load)"
        )
    saved_global = sd.get("global_rank")
    if (
        saved_global is not None
        and dist.is_available()
        and dist.is_initialized()
        and int(saved_global) != dist.get_rank()
    ):
        raise ValueError(
            f"this gradzip state ({method}) was saved by global rank {saved_global} (rank {saved_rank} of its group), "
            f"and this is global rank {dist.get_rank()}: with data-parallel subgroups (one per model shard), give "
            "each shard its own checkpoint directory; to move states on purpose, gz.reshard them first"
        )


class _Held:
    """A front end's call held until ``flush()`` in the first step after a load (the engine
    then runs the calls as the saved run made them, and fills this call's result)."""

    def __init__(self, names, tensors, out_dtype, dest, zero_is_unused, params, device) -> None:
        self.names, self.tensors, self.out_dtype = names, tensors, out_dtype
        self.dest, self.zero_is_unused, self.params, self.device = dest, zero_is_unused, params, device
        self.future = torch.futures.Future(devices=future_devices(device))
        self.offsets = [0]
        for t in tensors:
            self.offsets.append(self.offsets[-1] + t.numel())
        self.parts = 0  # regrouped calls still to land here
        self._lock = threading.Lock()
        self._failed = False
        self._out = None

    def pass_on(self, fut) -> None:
        try:
            value = fut.value()
        except BaseException as e:  # noqa: BLE001  (handed to the front end's future)
            self.future.set_exception(e)
            return
        self.future.set_result(value)

    def put(self, pi: int, value: torch.Tensor) -> None:
        with self._lock:
            if self._out is None:
                d, n = self.dest, self.offsets[-1]
                fits = d is not None and d.dtype == self.out_dtype and d.numel() == n and d.is_contiguous()
                self._out = d.view(-1) if fits else torch.empty(n, dtype=self.out_dtype, device=self.device)
        self._out[self.offsets[pi] : self.offsets[pi + 1]].copy_(value)

    def landed(self, error: BaseException | None = None) -> None:
        """One regrouped call is done (or failed) for this call's tensors."""
        with self._lock:
            if self._failed:
                return
            if error is not None:
                self._failed = True
            else:
                self.parts -= 1
                if self.parts:
                    return
        if error is not None:
            self.future.set_exception(error)
        else:
            self.future.set_result(self._out)


def _scatter(fut, members: list, held: list) -> None:
    """A regrouped call's flat result into the held calls its tensors came from."""
    calls = sorted({ci for ci, _ in members})
    try:
        flat = fut.value()
        pos = 0
        for ci, pi in members:
            h = held[ci]
            n = h.offsets[pi + 1] - h.offsets[pi]
            h.put(pi, flat[pos : pos + n])
            pos += n
    except BaseException as e:  # noqa: BLE001  (handed to the front ends' futures)
        for ci in calls:
            held[ci].landed(e)
        return
    for ci in calls:
        held[ci].landed()


class Engine:
    """What every front end shares: runs a method's protocol with error feedback and the
    safety nets of the module docstring, and owns the per-tensor state.

    Args:
        method: a gradzip codec or protocol.
        process_group: the process group (default: the global one), or a
            :class:`~gradzip.comm.Communicator` to use as it is (Horovod's).
        start_iter: steps before this one run a plain allreduce.
        error_feedback: ``None`` turns it on for biased methods.
        error_decay: ``beta`` in ``(0, 1]``: each residual is read as ``beta * r``
            (:mod:`gradzip.feedback`); below 1 it needs error feedback.
        on_nonfinite: ``"skip"`` or ``"raise"``.
        layout: ``[(name, shape, dtype)]`` of the tensors (``layout_of``), compared
            across ranks on the first call.
        momentum: momentum correction (:class:`gradzip.momentum.Momentum`), or None.
        clip: local gradient clipping (each tensor's norm to ``clip / sqrt(N)``), or None.
    """

    def __init__(
        self,
        method: Codec | Protocol,
        *,
        process_group: dist.ProcessGroup | Communicator | None = None,
        start_iter: int = 0,
        error_feedback: bool | None = None,
        error_decay: float = 1.0,
        on_nonfinite: str = "skip",
        layout: list | None = None,
        momentum: Momentum | None = None,
        clip: float | None = None,
    ) -> None:
        if isinstance(process_group, Communicator):  # e.g. comm_horovod.HorovodCommunicator
            self.comm = process_group
            self.stats_ = process_group.stats
        else:
            self.stats_ = Stats()
            self.comm = Communicator(process_group, self.stats_)
        self.method = method
        self.start_iter = args.integer("start_iter", start_iter, 0)
        self.on_nonfinite = args.choice("on_nonfinite", on_nonfinite, _NONFINITE_POLICIES)
        self.error_feedback = method.biased if error_feedback is None else args.flag("error_feedback", error_feedback)
        self.protocol = as_protocol(method, self.comm.world_size, feedback=self.error_feedback)
        if layout is not None:
            self.protocol.check_names([n for n, _, _ in layout])
        self.error_decay = args.number("error_decay", error_decay, 0.0, 1.0, lo_open=True)
        if self.error_decay != 1.0 and not self.error_feedback:
            raise ValueError(f"error_decay={self.error_decay} decays error-feedback residuals: it needs error_feedback")
        self.memory = ErrorFeedback(self.error_decay) if self.error_feedback else None
        self.momentum = momentum
        self.moments = ErrorFeedback() if momentum is not None else None  # its buffers, rolled back alike
        # No state at all (Identity's plain allreduce, no error feedback, no momentum): a NaN/Inf
        # shows in the average as under plain DDP and nothing needs rolling back, so with "skip"
        # the average is left as summed, without a pass over it (see _run).
        self._stateless = (
            isinstance(self.protocol, Allreduce)
            and self.protocol.codec.exact
            and self.memory is None
            and self.moments is None
        )
        self.clip = args.optional(args.number, "clip", clip, 0.0, lo_open=True)
        self.tensor_state: dict[str, dict] = {}
        self.step = 0
        self.layout = layout
        self._verified = False
        self._seen: dict[str, tuple[int, int]] = {}  # name -> (numel, element size), for routes()
        self._log = None  # (every, fn, routes logged) from set_log
        # Bookkeeping of the open step (touched from callback threads too).
        self._lock = threading.Lock()
        self._inflight = 0
        self._step_ended = False
        self._nonfinite = False
        # The GPU side's verdicts of this step's calls (a device flag, and on CUDA the event
        # after it): read once when the step ends.
        self._device_verdicts: list[tuple] = []
        self._plans: dict = {}  # planned Flat buckets by layout (gradzip.protocols.planned)
        # A malformed frame found by a deferred check (``Call.frame_checks``) in a step that
        # ended: raised at the next call.
        self._frame_error: Exception | None = None
        self._undo_store: dict = {}
        # Skipping the optimizer's step (gradzip.frontend.skip_nonfinite, and the front ends that
        # own their optimizer): the verdict of the last step that ended, the same on every rank.
        self.last_step_nonfinite = False
        self.nonfinite_steps = 0  # steps whose verdict was non-finite: a guard compares counts
        self.skip_guard = False  # an optimizer step reads last_step_nonfinite: every call is read
        self.nonfinite_hint: str | None = None  # the front end's warning, shown once, without a guard
        self._warned = False
        # Call layout (which names share a call): this step's, the last finished step's (saved
        # in the state), and, for the first step after a load, the saved one to regroup by.
        self._layout_now: list[tuple] = []
        self._layout_last: list[tuple] = []
        self._regroup: list[tuple] | None = None
        self._held: list[_Held] = []

    # -- the step ----------------------------------------------------------------------
    def reduce(
        self,
        names: Sequence[str],
        tensors: Sequence[torch.Tensor],
        out_dtype: torch.dtype | None = None,
        *,
        dest: torch.Tensor | None = None,
        zero_is_unused: bool = False,
        params: Sequence[torch.Tensor] | None = None,
    ) -> torch.futures.Future:
        """Start averaging ``tensors`` over the ranks; a future of one flat tensor.

        The flat result holds the tensors' averages back to back, in ``out_dtype``
        (default: the first tensor's dtype).

        ``dest``: a contiguous tensor of as many ``out_dtype`` elements that the result
        may be written into (and returned as), such as DDP's bucket buffer. ``tensors``
        may be views of it; they are then overwritten, as DDP's own allreduce does.

        ``zero_is_unused``: a tensor that is all zeros is a parameter unused on this rank
        (DDP with ``find_unused_parameters=True`` hands such zeros to the hook, and drops
        the average of a parameter unused on every rank): it is sent as zeros and its
        residual is left as it is, so that no mass is spent on an average that may be
        dropped. A used parameter whose gradient is exactly zero only waits a step.

        ``params``: the parameters the gradients belong to, where momentum correction
        applies weight decay (``Engine(momentum=...)``).
        """
        names, tensors = list(names), list(tensors)
        if len(names) != len(tensors):
            raise ValueError(f"{len(names)} names for {len(tensors)} tensors")
        check_real(zip(names, tensors), "gradient")
        for n, t in zip(names, tensors):
            if n not in self._seen:
                self._seen[n] = (t.numel(), t.element_size())
        out_dtype = out_dtype or (tensors[0].dtype if tensors else torch.float32)
        if self._regroup is not None:  # the first step after a load: calls as the saved run made them
            return self._hold(names, tensors, out_dtype, dest, zero_is_unused, params)
        return self._submit(names, tensors, out_dtype, dest, zero_is_unused, params)

    def _submit(self, names, tensors, out_dtype, dest, zero_is_unused, params) -> torch.futures.Future:
        self._layout_now.append(tuple(names))
        with self._lock:
            self._inflight += 1
        device = tensors[0].device if tensors else (dest.device if dest is not None else None)
        return self.comm.submit(self._run(names, tensors, out_dtype, dest, zero_is_unused, params), device=device)

    def flush(self) -> None:
        """Issue all outstanding collectives (call after the last bucket of a step)."""
        if self._held:
            self._release()
        self.comm.flush()

    # -- the saved call layout -----------------------------------------------------------
    # A call-wide choice (TopK(scope="call")) and an allreduce's summation order (gloo sums a
    # buffer in chunks set by its layout) depend on which tensors share a call. DDP's first
    # step after a restart groups them into its initial buckets, the unbroken run into its
    # rebuilt ones; so the state records the last step's calls, and the first step after a
    # load holds the front end's calls until flush() and runs them as the saved run did.
    def _hold(self, names, tensors, out_dtype, dest, zero_is_unused, params) -> torch.futures.Future:
        device = tensors[0].device if tensors else (dest.device if dest is not None else None)
        h = _Held(names, tensors, out_dtype, dest, zero_is_unused, params, device)
        self._held.append(h)
        return h.future

    def _release(self) -> None:
        """Submit the held calls regrouped by the saved layout: every saved call whose tensors
        all arrived (in one dtype, device and unused-parameter mode) runs as one call, in the
        saved order; the tensors of no complete saved call then run in their own calls. A held
        call that is exactly a saved one runs as it is, into its own destination."""
        held, self._held = self._held, []
        where = {n: (ci, pi) for ci, h in enumerate(held) for pi, n in enumerate(h.names)}
        groups, used = [], set()
        for saved in self._regroup or []:
            members = [where.get(n) for n in saved]
            if None in members or len(set(members)) != len(members) or used.intersection(members):
                continue
            calls = [held[ci] for ci, _ in members]
            key = {(h.out_dtype, h.device, h.zero_is_unused, h.params is None) for h in calls}
            if len(key) == 1:
                groups.append(members)
                used.update(members)
        for ci, h in enumerate(held):
            rest = [(ci, pi) for pi in range(len(h.names)) if (ci, pi) not in used]
            if rest or not h.names:
                groups.append(rest or [(ci, None)])
        pending = []  # (future, the held call it is, or the held positions it covers)
        for members in groups:
            h0 = held[members[0][0]]
            if members in ([(members[0][0], pi) for pi in range(len(h0.names))], [(members[0][0], None)]):  # as it came
                fut = self._submit(h0.names, h0.tensors, h0.out_dtype, h0.dest, h0.zero_is_unused, h0.params)
                pending.append((fut, h0))
                continue
            for ci in {ci for ci, _ in members}:
                held[ci].parts += 1
            params = None if h0.params is None else [held[ci].params[pi] for ci, pi in members]
            # copies: the results land in the front end's buffers, which the gradients may be views of
            tensors = [held[ci].tensors[pi].detach().clone() for ci, pi in members]
            names = [held[ci].names[pi] for ci, pi in members]
            fut = self._submit(names, tensors, h0.out_dtype, None, h0.zero_is_unused, params)
            pending.append((fut, members))
        self.comm.flush()  # every call encoded and issued before a result lands in a destination
        for fut, to in pending:
            if isinstance(to, _Held):
                fut.add_done_callback(to.pass_on)
            else:
                fut.add_done_callback(lambda f, m=to: _scatter(f, m, held))

    def end_step(self, *, commit: bool = True) -> None:
        """Close the step. Its rollback (if any rank saw a NaN/Inf) happens once its calls are done.

        ``commit=False``: the step is dropped as a non-finite one is (a fault-tolerant front end
        whose step was not committed, :mod:`gradzip.ft`): its residuals and codec state are put
        back as they were before it, once its calls are done."""
        if self._held:
            self.flush()
        self._layout_last, self._layout_now = self._layout_now, []
        self._regroup = None
        self.step += 1
        self.stats_.add(steps=1)
        with self._lock:
            if not commit:
                self._nonfinite = True
            self._step_ended = True
            self._finish_step_locked()
        if self._log is not None and self.step % self._log[0] == 0:
            self._emit_log()

    # -- one call ----------------------------------------------------------------------
    def _run(self, names, tensors, out_dtype, dest, zero_is_unused=False, params=None):
        step = self.step  # end_step() may run before this call's last round completes
        try:
            with self._lock:
                err, self._frame_error = self._frame_error, None
            if err is not None:
                raise err
            if not self._verified:
                device = tensors[0].device if tensors else torch.device("cpu")
                yield from self._verify(device)
                self._verified = True
            plain_call = self.step < self.start_iter
            call = Call(
                comm=self.comm,
                names=names,
                tensors=tensors,
                contexts=[self._context(n, t.dtype) for n, t in zip(names, tensors)],
                memory=None if plain_call else self.memory,
                out_dtype=out_dtype,
                dest=dest,
                make_context=self._context,
            )
            protocol = self._plain_protocol if plain_call else self.protocol
            raw = sum(t.numel() * t.element_size() for t in tensors)
            self.stats_.add(bytes_raw=raw, bytes_link_raw=protocol.link_raw(raw, self.comm.world_size))
            plain = protocol.plain(call)
            unused = zero_is_unused and call.memory is not None
            if self.on_nonfinite == "skip" and not unused and tensors and K.gpu_side(tensors[0].device):
                return (yield from self._run_on_device(protocol, call, plain, params))
            local: list = []
            with codec_time(self.stats_):
                if unused:
                    lo_hi = _extremes(tensors)  # one pass: finiteness and all-zero tensors
                    local = [n for n, (lo, hi) in zip(names, lo_hi) if not (math.isfinite(lo) and math.isfinite(hi))]
                    call.frozen = frozenset(n for n, (lo, hi) in zip(names, lo_hi) if lo == hi == 0.0)
                elif (not plain or self.on_nonfinite == "raise") and not all_finite(
                    tensors
                ):  # else the average shows it
                    local = [n for n, t in zip(names, tensors) if not all_finite([t])]
                if self.clip is not None or self.momentum is not None:
                    self._precondition(call, params)
            out, bad, local = yield from self._flagged(protocol.exchange(call), call, local, flag=not plain)
            # Finite inputs can still average to more than the output dtype holds (an
            # overflowing float16 gradient). Every rank holds the same ``out``, so every
            # rank decides alike without talking.
            if not (plain and self._stateless and self.on_nonfinite == "skip" and not self.skip_guard):
                with codec_time(self.stats_):
                    bad = bad or not all_finite([out])
            if bad:
                with self._lock:
                    self._nonfinite = True
                    # once per engine, where the front end set a hint and no guard skips the step
                    warn = self.on_nonfinite == "skip" and self.nonfinite_hint is not None
                    warn = warn and not self.skip_guard and not self._warned
                    self._warned = self._warned or warn
                if warn:
                    warnings.warn(self.nonfinite_hint.format(step=step), RuntimeWarning, stacklevel=2)
                if self.on_nonfinite == "raise":
                    where = f"in {local} on rank {self.comm.rank}" if local else "on another rank"
                    raise FloatingPointError(f"non-finite gradient {where} at step {step}")
                out = torch.full_like(out, float("nan"))
            if self.momentum is not None and self.momentum.takeover is not None:
                self.momentum.takeover.record(out)  # what the optimizer must find in p.grad
            return out
        finally:
            with self._lock:
                self._inflight -= 1
                self._finish_step_locked()

    def _run_on_device(self, protocol: Protocol, call: Call, plain: bool, params):
        """:meth:`_run`'s exchange on the GPU's side with ``on_nonfinite="skip"``: every check
        stays on the device. This rank's flag is a device tensor carried in the first round;
        a NaN/Inf on any rank, or an average the output dtype cannot hold, turns the result
        into NaN on the device (no branch on the host), and the call's verdict joins
        the step's, read once when the step ends (:meth:`_finish_step_locked`)."""
        tensors, device = call.tensors, call.device
        plan = None
        if not plain and self.clip is None and self.momentum is None:
            plan = plan_for(protocol, call, self._plans)
        if plan is not None:  # a planned Flat bucket: its own flags, checks and verdict
            out, bad, frame, refuse = yield from plan.run(call)
            with codec_time(self.stats_):
                return self._nan_where(call, out, bad, [(frame, refuse)])
        bad_in = None
        call.frame_checks = checks = []
        with codec_time(self.stats_):
            if not plain:
                bad_in = device_nonfinite(tensors, device)
            if self.clip is not None or self.momentum is not None:
                self._precondition(call, params)
        out, bad, _ = yield from self._flagged(
            protocol.exchange(call), call, [], not plain, on_device=True, bad_in=bad_in
        )
        with codec_time(self.stats_):
            if not (plain and self._stateless and not self.skip_guard):
                over = device_nonfinite([out], device)
                bad = over if bad is None else bad | over
            if checks:  # a malformed frame: NaN as for a non-finite value, its error raised later
                fb = torch.stack([f.reshape(()).bool() for f, _ in checks]).any().reshape(1)
                bad = fb if bad is None else bad | fb
            if bad is not None:
                out = self._nan_where(call, out, bad, checks)
        if self.momentum is not None and self.momentum.takeover is not None:
            self.momentum.takeover.record(out)
        return out

    def _nan_where(self, call: Call, out: torch.Tensor, bad: torch.Tensor, checks: list) -> torch.Tensor:
        """``out`` made NaN where the device verdict ``bad`` is set, the verdict and the call's
        frame checks kept for the step's one host read (:meth:`_finish_step_locked`)."""
        # in place into the front end's destination; elsewhere the protocol may keep `out`
        if call.dest is not None and (out.data_ptr(), out.numel()) == (call.dest.data_ptr(), call.dest.numel()):
            out.masked_fill_(bad, float("nan"))
        else:
            out = torch.where(bad, float("nan"), out)
        # On CUDA the call may have run on a side stream (the last round's decode): an
        # event orders the step's read after it, on whatever stream reads.
        done = None
        if bad.is_cuda:
            done = torch.cuda.Event()
            done.record()
        with self._lock:
            self._device_verdicts.append((bad, done, checks))
        return out

    def _flagged(self, inner, call: Call, local: list, flag: bool, *, on_device: bool = False, bad_in=None):
        """Run ``inner``, adding the non-finite flag allreduce to its first round (when
        ``flag``). Returns ``(out, any rank saw a non-finite value, this rank's names)``.
        ``on_device``: the flag is a device tensor (``bad_in``: the inputs' check, or None)
        and so is the verdict (None where no flag was sent); no names are kept."""
        seen = list(local)

        def source() -> int | torch.Tensor:  # this rank's flag; the protocol may take it (Call.take_flag)
            with codec_time(self.stats_):
                if on_device:
                    fb = self._feedback_nonfinite_on_device(call)
                    bad = fb if bad_in is None else (bad_in if fb is None else bad_in | fb)
                    if bad is None:
                        return torch.zeros((), dtype=FLAG_DTYPE, device=call.device)
                    return bad.to(FLAG_DTYPE).reshape(())
                seen.extend(n for n in self._feedback_nonfinite(call) if n not in seen)
            return 1 if seen else 0

        if flag:
            call.flag_source = source
        try:
            rnd = next(inner)
        except StopIteration as stop:
            rnd, out = None, stop.value
        # A protocol that took the flag but sent nothing carried it nowhere: it goes alone.
        carried = call.flag_seen if rnd is not None else None
        call.flag_source = None  # past the first round: too late to carry it
        work, flagged = None, None
        if flag and carried is None:
            if on_device:
                flagged = source().reshape(1).clone()
            else:
                flagged = K.host_to_device(torch.tensor([source()], dtype=FLAG_DTYPE), call.device)
            work = self.comm.allreduce(flagged, op=dist.ReduceOp.MAX, control=True)
        if rnd is None:  # the protocol sent nothing: the flag goes alone
            if work is not None:
                yield Round([work], last=True)
        else:
            if work is not None:
                rnd = Round(rnd.works + [work], rnd.last)
            while True:
                yield rnd
                try:
                    rnd = next(inner)
                except StopIteration as stop:
                    out = stop.value
                    break
        # Without a flag (a plain call) a NaN/Inf anywhere shows in the average itself.
        if on_device:
            if carried is not None:
                return out, (carried > 0).any().reshape(1), seen
            return out, None if flagged is None else flagged > 0, seen
        if carried is not None:
            return out, bool((carried > 0).any()), seen
        return out, flagged is not None and bool(flagged.item()), seen

    def adopt_momentum(self, buffers: dict) -> None:
        """Start momentum correction from buffers an optimizer already held (``{key: tensor}``,
        keys as :meth:`gradzip.momentum.Momentum.adopt` returns them)."""
        for key, buf in buffers.items():
            self.moments.set(key, buf.detach().to(accum_dtype(buf.dtype), copy=True))
        if self.moments is not None:
            self.moments.release()

    def _precondition(self, call: Call, params) -> None:
        """Local gradient clipping (each tensor's norm to ``clip / sqrt(N)``, DGC's rule) and
        momentum correction, on the call's tensors; a frozen (unused) tensor is left as it is."""
        idx = [i for i, n in enumerate(call.names) if n not in call.frozen]
        tensors = list(call.tensors)
        if self.clip is not None:
            limit = self.clip / math.sqrt(self.comm.world_size)
            norms = torch.stack([torch.linalg.vector_norm(tensors[i].float()) for i in idx]).tolist() if idx else []
            for i, norm in zip(idx, norms):
                if norm > limit:
                    tensors[i] = tensors[i] * (limit / norm)
        if self.momentum is not None:
            sub = [tensors[i] for i in idx]
            got = self.momentum.apply(
                self.moments,
                [call.names[i] for i in idx],
                sub,
                [params[i] for i in idx] if params is not None else None,
            )
            for i, t in zip(idx, got):
                tensors[i] = t
            call.momentum = {call.names[i]: self.moments.residual(momentum_key(call.names[i])) for i in idx}
        call.tensors = tensors

    @staticmethod
    def _feedback_nonfinite(call: Call) -> list:
        """Names whose error-feedback state is not finite after the first round: new
        residuals, compensated inputs, and (compensated now) residuals not used yet."""
        if call.memory is None:
            return []
        names, tensors = [], []
        for i, name in enumerate(call.names):
            if not call.feeds(i):
                continue
            if name in call.updated:
                t = call.updated[name]
            elif call.has_x(i) or call.memory.residual(name) is not None:
                t = call.x(i)
            else:
                continue
            names.append(name)
            tensors.append(t)
        if all_finite(tensors):  # one host sync for the call's tensors, not one each
            return []
        return [n for n, ok in zip(names, finite_flags(tensors)) if not ok]

    @staticmethod
    def _feedback_nonfinite_on_device(call: Call) -> torch.Tensor | None:
        """:meth:`_feedback_nonfinite` as a device flag (None where there is nothing to check)."""
        if call.memory is None:
            return None
        tensors = []
        for i, name in enumerate(call.names):
            if not call.feeds(i):
                continue
            if name in call.updated:
                tensors.append(call.updated[name])
            elif call.has_x(i) or call.memory.residual(name) is not None:
                tensors.append(call.x(i))
        return device_nonfinite(tensors, call.device) if tensors else None

    def _context(self, name: str, dtype: torch.dtype) -> TensorContext:
        """The context of a tensor (or of a protocol's piece of one, by its key) this step; its
        state is remembered on first touch, for the rollback of a non-finite step."""
        with self._lock:
            if name not in self._undo_store:
                self._undo_store[name] = dict(self.tensor_state.get(name, {}))
        return TensorContext(
            name=name,
            step=self.step,
            dtype=dtype,
            store=self.tensor_state.setdefault(name, {}),
            rank=self.comm.rank,
            world_size=self.comm.world_size,
        )

    _plain_protocol = Allreduce(Identity())  # before start_iter: what plain DDP does

    # -- config check ------------------------------------------------------------------
    def describe(self) -> dict:
        """What every rank must agree on (flat keys, plain values)."""
        d = {f"method.{k}": v for k, v in self.method.config().items()}
        d.update(error_feedback=self.error_feedback, start_iter=self.start_iter, on_nonfinite=self.on_nonfinite)
        if self.error_decay != 1.0:
            d["error_decay"] = self.error_decay
        d.update(momentum=self.momentum.describe() if self.momentum is not None else None, clip=self.clip)
        if self.layout is not None:
            blob = json.dumps(self.layout, sort_keys=True).encode()
            d["layout"] = f"{len(self.layout)} tensors, sha256 {hashlib.sha256(blob).hexdigest()[:16]}"
        return d

    def _verify(self, device):
        mine = self.describe()
        blob = json.dumps(mine, sort_keys=True, default=str).encode()
        msg = torch.frombuffer(bytearray(blob), dtype=torch.uint8).to(device)
        gathered = yield from allgather_bytes(self.comm, msg, last=False, control=True)
        descs = [json.loads(bytes(row.cpu().numpy()).rstrip(b"\0")) for row in gathered]
        keys = sorted(set().union(*descs), key=lambda k: (k != "method.name", k))  # the class first
        for key in keys:
            values = [d.get(key, "<missing>") for d in descs]
            if any(v != values[0] for v in values):
                shown = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))
                raise ValueError(f"gradzip configuration differs across ranks in {key!r} ({shown})")

    # -- non-finite rollback -----------------------------------------------------------
    @property
    def calls_running(self) -> int:
        """Calls not finished yet: submitted and running, or held until ``flush()``. While any
        is, the verdicts (``last_step_nonfinite``, ``nonfinite_steps``) are those of the steps
        that ended before it only; a step ended with its calls running is judged as they end."""
        with self._lock:
            return self._inflight + len(self._held)

    def _finish_step_locked(self) -> None:
        if not self._step_ended or self._inflight:
            return
        if self._device_verdicts:  # the GPU side's calls: the step's one host read
            verdicts, self._device_verdicts = self._device_verdicts, []
            dev = verdicts[0][0].device
            for _, done, _ in verdicts:
                if done is not None:
                    torch.cuda.current_stream(dev).wait_event(done)
            parts = [v.to(dev).reshape(1) for v, _, _ in verdicts]
            parts += [f.to(dev).reshape(-1) for _, _, checks in verdicts for f, _ in checks]
            read = torch.cat(parts).tolist()
            refusals = [r for (_, _, checks) in verdicts for _, r in checks]
            framed = next((r for r, v in zip(refusals, read[len(verdicts) :]) if v), None)
            if framed is not None and self._frame_error is None:
                self._frame_error = framed()  # the host's parse of the kept messages: its text
            if any(read[: len(verdicts)]):
                self._nonfinite = True
                warn = framed is None and self.nonfinite_hint is not None and not self.skip_guard
                warn = warn and not self._warned
                if warn:
                    self._warned = True
                    warnings.warn(self.nonfinite_hint.format(step=self.step - 1), RuntimeWarning, stacklevel=2)
        self.last_step_nonfinite = self._nonfinite
        if self._nonfinite:
            self.nonfinite_steps += 1
            if self.momentum is not None and self.momentum.takeover is not None:
                self.momentum.takeover.forget()  # this step's averages: not the next step's
            for n, store in self._undo_store.items():
                self.tensor_state[n] = store
            for mem in (self.memory, self.moments):
                if mem is not None:
                    mem.restore()
        else:
            for mem in (self.memory, self.moments):
                if mem is not None:
                    mem.release()
        self._nonfinite = False
        self._step_ended = False
        self._undo_store = {}

    # -- state -------------------------------------------------------------------------
    def stats(self, reset: bool = False) -> dict:
        """Bytes and times counted at the collectives, a flat dict of numbers (:mod:`gradzip.stats`);
        ``reset=True``: those since the previous ``stats(reset=True)``."""
        return self.stats_.as_dict(reset=reset)

    def set_log(self, every: int | None, fn: Callable[[int, dict], None] | None = None) -> None:
        """Call ``fn(step, stats of the last every steps)`` every ``every`` steps (see
        :func:`gradzip.stats.log_every`); ``every=None`` stops it."""
        if every is None:
            self._log = None
            return
        every = args.integer("every", every, 1)
        if fn is not None and not callable(fn):
            raise TypeError(f"fn must be callable, got {type(fn).__name__}")
        self.stats_.since("log")  # the first interval starts now
        self._log = [every, fn, False]

    def _emit_log(self) -> None:
        every, fn, routes_done = self._log
        counts = self.stats_.since("log")
        if fn is None:
            if not routes_done and hasattr(self.protocol, "decision"):
                for line in route_summary(self.routes()):
                    logger.info("gradzip routes: %s", line)
            log_line(self.step, self.stats_.derive(counts))
        else:
            fn(self.step, self.stats_.derive(counts))
        self._log[2] = True

    def routes(self) -> list[dict]:
        """Each tensor this engine has reduced: ``{"name", "numel", "bytes_raw"`` (per call),
        ``"method"`` (the codec or protocol it is routed to), ``"protocol"`` (what carries
        it), ``"reason"}``. With a ``Policy`` the route is the policy's rule or its cost
        model's stored decision (``"auto: undecided"`` before the first step); otherwise
        every tensor goes by the engine's method."""
        world = self.comm.world_size
        rows = []
        for name, (numel, size) in self._seen.items():
            if hasattr(self.protocol, "decision"):
                method, reason, carrier = self.protocol.decision(
                    name, numel, self.tensor_state.get(name, {}), world, self.error_feedback
                )
            else:
                method, reason, carrier = self.method, "method", self.protocol
            if self.step < self.start_iter:
                carrier, reason = self._plain_protocol, f"before start_iter={self.start_iter}"
            rows.append(
                {
                    "name": name,
                    "numel": numel,
                    "bytes_raw": numel * size,
                    "method": repr(method),
                    "protocol": repr(carrier),
                    "reason": reason,
                }
            )
        return rows

    def state_dict(self) -> dict:
        """Tensors and plain Python values only: ``torch.load(weights_only=True)`` reads it."""
        return {
            "version": STATE_VERSION,
            "rank": self.comm.rank,  # residuals are per rank: load_state_dict refuses another rank's
            "world_size": self.comm.world_size,
            # the process's rank in the whole job: a data-parallel subgroup's rank r of one model
            # shard must not load rank r of another shard (same names and shapes, other residuals)
            "global_rank": dist.get_rank() if dist.is_available() and dist.is_initialized() else None,
            "method_repr": repr(self.method),
            "method": self.method.config(),
            "error_feedback": self.error_feedback,
            "error_decay": self.error_decay,
            "step": self.step,
            "residuals": self.memory.state_dict() if self.memory is not None else {},
            "momentum": self.moments.state_dict() if self.moments is not None else {},
            "momentum_mode": self.momentum.mode() if self.momentum is not None else None,
            "tensor_state": {k: dict(v) for k, v in self.tensor_state.items()},
            "stats": self.stats_.state_dict(),
            # which tensors shared a call in the last step: the first step after a load runs so
            "calls": [list(c) for c in self._layout_last],
        }

    def check_state(self, sd: dict) -> None:
        """Refuse, with ``ValueError`` and before anything changes, a state this engine cannot
        load: another state version, another rank or world size (:func:`check_owner`),
        another method config or error feedback, momentum buffers without momentum correction,
        another momentum-correction mode (``precondition``, ``update="sign"``)."""
        if sd.get("version") != STATE_VERSION:
            raise ValueError(
                f"gradzip state version {sd.get('version')!r} is not supported (expected {STATE_VERSION}): "
                "an older state lacks what this one records (a version-2 state: the error decay, the "
                "momentum-correction mode and the saving rank); resume with the gradzip that saved it, or start "
                "from the model alone"
            )
        check_owner(sd, self.comm.rank, self.comm.world_size)
        saved, mine = sd["method"], self.method.config()
        for key in sorted(set(saved) | set(mine)):
            if saved.get(key) != mine.get(key):
                raise ValueError(
                    f"method config differs from the checkpoint in {key!r}: "
                    f"saved {saved.get(key)!r}, now {mine.get(key)!r}"
                )
        if bool(sd["error_feedback"]) != self.error_feedback:
            raise ValueError(
                f"error_feedback differs from the checkpoint: saved {sd['error_feedback']}, now {self.error_feedback}"
            )
        if float(sd["error_decay"]) != self.error_decay:
            raise ValueError(
                f"error_decay differs from the checkpoint: saved {sd['error_decay']}, now {self.error_decay}"
            )
        if self.moments is None and sd.get("momentum"):
            raise ValueError("the checkpoint holds momentum buffers of momentum correction: pass the optimizer again")
        saved_mode = sd["momentum_mode"]
        mode = self.momentum.mode() if self.momentum is not None else None
        if saved_mode is not None and mode is not None and saved_mode != mode:
            raise ValueError(
                f"momentum correction differs from the checkpoint: saved {_MODES[saved_mode]}, now {_MODES[mode]} "
                "(its buffers would be missing or left over): register the hook as the run that saved it did"
            )

    def load_state_dict(self, sd: dict, *, checked: bool = False) -> None:
        """Load what :meth:`state_dict` saved, after :meth:`check_state` (``checked=True``: the
        caller has run it on ``sd`` already)."""
        if not checked:
            self.check_state(sd)
        self.step = int(sd["step"])
        if self.memory is not None:
            self.memory.load_state_dict(sd["residuals"])
        if self.moments is not None:
            self.moments.load_state_dict(sd.get("momentum", {}))
        self.tensor_state = {k: dict(v) for k, v in sd["tensor_state"].items()}
        self.stats_.load_state_dict(sd["stats"])
        calls = sd.get("calls")
        self._regroup = [tuple(c) for c in calls] if calls else None
        self._layout_last = list(self._regroup or [])
